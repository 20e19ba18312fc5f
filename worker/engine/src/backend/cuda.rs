//! The CUDA backend (feature `cuda`): the Llama forward pass of `cpu.rs` in bf16 on one GPU
//! (vLLM's GPU model runner shape). Weights are uploaded as bf16 (q/k/v and gate/up fused),
//! products go through cuBLAS (`cublasGemmEx`, bf16 in, f32 accumulate), everything else is
//! NVRTC-compiled CUDA C (`cuda/kernels/llama.cu`): embedding gather, residual add fused with
//! RMSNorm, RoPE (rotate-half, llama3 scaling through the precomputed inverse frequencies)
//! fused with the K/V write into the paged cache through the slot mapping, paged GQA
//! attention (PagedAttention, Kwon et al. 2023; one kernel serves prefill chunks and decode:
//! each query token attends over its sequence's block table up to its own position),
//! SiLU·mul and a greedy argmax on the device. The residual stream stays in f32.
//!
//! Batch invariance (deterministic inference, opt-in): a sequence's logits do not depend on what
//! else is in the step or how its prompt is chunked. GEMMs use one cuBLASLt algorithm per weight
//! shape for every row count, checked bitwise row-invariant on the device at load
//! ([`gemm`]); attention splits each token's context into fixed 128-position chunks merged in
//! chunk order; every other kernel is per row.
//!
//! CUDA graphs: a pure decode step is padded to a batch-size bucket (1, 2, 4, … up to
//! `max_num_seqs`; padding tokens write no KV) and replayed from a graph captured per
//! (bucket, context-chunk bucket) on its second use; metadata goes to fixed device addresses
//! before each replay, so a replay allocates and compiles nothing.
//!
//! The KV cache is preallocated after the weights and the step scratch from
//! `gpu_memory_utilization` (vLLM's rule: `total · utilization − in use`) unless an explicit
//! byte budget is given; its capacity in tokens is logged.
//!
//! Two modes. The default fast mode runs steps of at most `gemv_max_tokens` tokens through
//! fused decode GEMVs (`gemv.rs`: norms, RoPE + K/V write, residual adds and SiLU·mul inside),
//! larger steps through cuBLASLt's per-M heuristic, and attention through tensor-core kernels
//! (`attn_decode.rs`: FlashDecoding over the paged cache, all query heads of a KV head per
//! K/V read; `attn_prefill.rs`: FlashAttention-2 over prefill chunks). The batch-invariant mode
//! (`CudaOptions::batch_invariant`) keeps the fixed-algorithm GEMMs and the split-KV kernel
//! below, trading speed for logits that never depend on the rest of the step.
//!
//! FP8 (`CudaOptions::quantization`, `CudaOptions::kv_cache_dtype`; vLLM's `--quantization fp8`
//! and `--kv-cache-dtype fp8`): the decoder layers' matrices quantized at load to e4m3 with one
//! f32 scale per output channel ([`fp8`]); the decode GEMVs stream the e4m3 bytes (half the
//! bytes of a bf16 step) with the same fusions, larger steps quantize their activations per token
//! and run cuBLASLt's FP8 GEMM with both scale vectors (`gemm_fp8.rs`). An FP8 KV cache stores
//! e4m3 with a per-tensor scale of 1.0 (vLLM's default without calibration data), so the same
//! memory holds twice the tokens; the tensor-core attention kernels widen it to f16 on the way
//! into shared memory and run f16 mma.
//!
//! Parallel replicas: every rank of a tensor- and pipeline-parallel group is a process of its
//! own (`crate::parallel`), and its CUDA part is [`stage::CudaStage`]: this backend built from
//! only the rank's shard of its stage's layers (read straight from the mmapped safetensors),
//! with NCCL (`ncclCommInitRank` from the driver's unique id, the stage's group split off the
//! world) for the all-reduces after o_proj and down_proj and `ncclSend`/`ncclRecv` for the
//! stage-to-stage hidden states. The fused decode GEMVs and CUDA graphs stay on (the NCCL
//! calls are captured with the rest); every step's wait is bounded by the collective timeout
//! and aborts the communicators past it. With host collectives (several ranks sharing one GPU,
//! for tests) the values go through host memory and graphs are off for a tensor-parallel stage.
//!
//! Files: [`options`] (options, model dimensions, synthetic shapes), [`error`] ([`CudaError`]),
//! [`device`] (context, stream, buffers, the `llama.cu` kernels), `weights.rs` (uploads),
//! `kv_cache.rs` and `scratch.rs` (device memory of the cache and of a step), [`gemm`],
//! [`gemv`], [`attn_decode`], [`attn_prefill`] (kernels and their launches), `forward.rs` (one
//! step of a shard), `runner.rs` ([`CudaBackend`]: validation, metadata, CUDA graphs),
//! `nccl.rs` (a rank's collectives) and [`stage`] (a rank of a parallel replica).

mod arch;
pub mod attn_decode;
pub mod attn_prefill;
pub mod device;
pub mod error;
mod forward;
pub mod fp8;
mod fp8_path;
pub mod gemm;
pub mod gemm_fp8;
pub mod gemv;
mod kv_cache;
mod nccl;
pub mod options;
mod runner;
mod scratch;
pub mod stage;
mod weights;

pub use device::cuda_available;
pub use error::CudaError;
pub use options::{CudaOptions, KvCacheDtype, Quantization, SyntheticShape};
pub use runner::{ConstrainedTiming, CudaBackend};
