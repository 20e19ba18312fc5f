//! The inference engine of one replica, following vLLM's design: a paged KV cache
//! (PagedAttention, Kwon et al., SOSP 2023), iteration-level continuous batching (Orca,
//! OSDI 2022) with chunked prefill (Sarathi-Serve, OSDI 2024), per-request sampling and
//! incremental detokenization. The step loop runs on its own OS thread and is reached
//! through a cloneable [`EngineHandle`].
//!
//! Module map:
//! - [`request`]: the public request/output/error types (this file re-exports them).
//! - [`backend`]: the `Backend` trait (CPU reference, CUDA) that runs one forward step.
//! - `model/`: model formats (GGUF, Hugging Face safetensors), config, tokenizer, chat template, llama.
//! - `kv_cache/`: `BlockPool`, `BlockTable`.
//! - `scheduler`, `sampler`, `detokenizer`: the step loop's parts.

pub mod backend;
pub mod request;

pub use request::*;
