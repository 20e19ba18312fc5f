//! The inference engine of one replica, following vLLM's design: a paged KV cache
//! (PagedAttention, Kwon et al., SOSP 2023), iteration-level continuous batching (Orca,
//! OSDI 2022) with chunked prefill (Sarathi-Serve, OSDI 2024), per-request sampling and
//! incremental detokenization. The step loop runs on its own OS thread and is reached
//! through a cloneable [`EngineHandle`].
//!
//! Module map:
//! - [`request`]: the public request/output/error types and their validation.
//! - [`handle`]: [`EngineHandle`] (`start`, `submit`, `stats`, `model_info`, `is_alive`,
//!   `shutdown`, `inject_fault`), [`OutputStream`] (drop = abort), configs.
//! - [`backend`]: the `Backend` trait (CPU reference, CUDA) that runs one forward step.
//! - [`model`]: model formats (GGUF, Hugging Face safetensors), config, tokenizer, chat template.
//! - [`codec`]: the tokenizer/chat-template interface the engine uses.
//! - [`kv_cache`]: `BlockPool` (refcounted blocks, the prefix cache's LRU), `BlockTable`, the
//!   exact prefix-cache index and event log, the chained block hashes shared with routers.
//! - [`scheduler`], [`sampler`], [`detokenizer`], `step_loop`: the step loop's parts.
//! - [`structured`]: grammars (JSON schema, regex, choice, Lark) compiled by llguidance;
//!   `constraint`: their per-step token masks, `logit_bias` and `min_tokens`.
//! - [`backend::StepControl`]: stop requests and in-step progress shared by the handle, the
//!   step loop and the backend; each replica computes on its own rayon pool.
//! - [`parallel`]: tensor and pipeline parallelism with ranks as processes (communicator,
//!   rank process, driver).
//! - [`metrics`]: engine statistics and latency histograms for the worker's `vllm:*` metrics.

pub mod backend;
pub mod codec;
mod config;
mod constraint;
pub mod detokenizer;
pub mod dtypes;
#[cfg(test)]
mod engine_prefix_tests;
#[cfg(test)]
mod grammar_failure_tests;
pub mod handle;
pub mod kv_cache;
pub mod metrics;
pub mod model;
pub mod parallel;
pub mod request;
pub mod sampler;
pub mod scheduler;
#[cfg(test)]
mod scheduler_prefix_tests;
mod step_loop;
#[cfg(test)]
mod stop_tests;
pub mod structured;
#[cfg(test)]
mod test_double;

pub use config::{BackendKind, EngineConfig};
pub use dtypes::{KvCacheDtype, Quantization};
pub use handle::{EngineHandle, EngineParts, ModelInfo, OutputStream, RuntimeConfig};
pub use metrics::{EngineStats, FinishedCounts, KvWasteStats, LatencyHistogram};
pub use request::*;
pub use step_loop::Fault;
