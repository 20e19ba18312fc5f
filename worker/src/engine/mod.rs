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
pub mod model;
pub mod request;

pub use request::*;

// ---------------------------------------------------------------------------------------
// Contract for the rest of the worker (implemented in `engine.rs`-level modules):
//
//   pub struct EngineConfig { model: PathBuf, served_model_name, max_model_len: Option<usize>,
//       block_size: usize (16), max_num_seqs: usize (256), max_num_batched_tokens: usize (2048),
//       kv_cache_bytes: Option<u64>, backend: BackendKind (Cpu | Cuda{devices}) , ... }
//   impl EngineHandle {
//       pub fn start(cfg: EngineConfig, progress: Option<&dyn Fn(u64, u64)>) -> Result<EngineHandle, EngineError>;
//           // loads the model (blocking; call from spawn_blocking), starts the step thread
//       pub fn submit(&self, req: EngineRequest) -> Result<OutputStream, EngineError>;
//           // validates synchronously; OutputStream = tokio::sync::mpsc::Receiver<EngineOutput>
//           // wrapper; dropping it aborts the request at the next step boundary
//       pub fn stats(&self) -> EngineStats;  // running, waiting, kv_cache_usage [0,1],
//           // num_preemptions_total, prompt_tokens_total, generation_tokens_total,
//           // free_blocks, total_blocks, last_step_ok_at, histograms for TTFT/ITL/e2e
//       pub fn model_info(&self) -> ModelInfo; // served name, max_model_len, vocab, eos ids
//       pub fn is_alive(&self) -> bool;      // engine thread running and healthy
//       pub fn shutdown(&self);              // aborts everything, stops the thread
//   }
// ---------------------------------------------------------------------------------------
