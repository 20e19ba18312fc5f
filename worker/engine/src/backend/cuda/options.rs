//! What a CUDA backend is built from besides its weights: [`CudaOptions`] (device, KV-cache
//! budget, step limits, graphs, batch invariance), the model dimensions of the local shard
//! (`Dims`) and [`SyntheticShape`], a model shape filled with seeded random weights on the
//! device (benchmarks at real sizes without shipping checkpoints).

pub use crate::dtypes::{KvCacheDtype, Quantization};

/// Options for [`super::CudaBackend::new`].
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Fraction of the device's memory this replica may use (vLLM's `gpu_memory_utilization`).
    pub gpu_memory_utilization: f32,
    /// Explicit KV-cache budget in bytes; overrides `gpu_memory_utilization` when set.
    pub kv_cache_bytes: Option<u64>,
    /// Most tokens in one step (scratch rows).
    pub max_num_batched_tokens: usize,
    /// Most sequences in one step (logit rows).
    pub max_num_seqs: usize,
    /// Replay decode steps from CUDA graphs captured per batch-size bucket.
    pub cuda_graphs: bool,
    /// Batch-invariant (deterministic) mode: one fixed cuBLASLt algorithm per weight shape for
    /// every row count and no GEMV fast path, so a sequence's logits never depend on what else
    /// is in the step (vLLM's `VLLM_BATCH_INVARIANT`, SGLang's deterministic inference). Off by
    /// default: the fast mode uses fused decode GEMVs for steps of at most
    /// [`super::gemv::GEMV_MAX_M`] tokens and cuBLASLt's per-`M` heuristic choice above that.
    pub batch_invariant: bool,
    /// Fast mode: steps of at most this many tokens (≤ [`super::gemv::GEMV_MAX_M`]) run the fused
    /// decode GEMVs; larger steps use cuBLASLt.
    pub gemv_max_tokens: usize,
    /// Weight format of the decoder layers' linears (vLLM's `--quantization`): bf16 as loaded,
    /// or e4m3 quantized at load with one f32 scale per output channel.
    pub quantization: Quantization,
    /// With [`Quantization::Fp8`]: the lm_head in FP8 too (per-vocabulary-row scales); off by
    /// default (it stays bf16, as in vLLM).
    pub fp8_lm_head: bool,
    /// Element type of the KV cache (vLLM's `--kv-cache-dtype`).
    pub kv_cache_dtype: KvCacheDtype,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device: 0,
            block_size: 16,
            gpu_memory_utilization: 0.9,
            kv_cache_bytes: None,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            cuda_graphs: true,
            batch_invariant: false,
            gemv_max_tokens: 2,
            quantization: Quantization::None,
            fp8_lm_head: false,
            kv_cache_dtype: KvCacheDtype::Bf16,
        }
    }
}

/// Model dimensions of the (local) shard.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub hidden: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    pub vocab: usize,
    pub layers: usize,
    pub eps: f32,
}

impl Dims {
    /// Width of the Q projection output.
    pub fn q_dim(&self) -> usize {
        self.q_heads * self.head_dim
    }

    /// Width of the K (and V) projection output.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Width of the fused QKV projection output.
    pub fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
}

/// A Llama-family shape for [`super::CudaBackend::synthetic`] (e.g. [`SyntheticShape::llama3_8b`]).
#[derive(Clone, Debug)]
pub struct SyntheticShape {
    /// Decoder layers.
    pub layers: usize,
    /// Model width.
    pub hidden: usize,
    /// Query heads.
    pub heads: usize,
    /// KV heads (GQA).
    pub kv_heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Vocabulary.
    pub vocab: usize,
    /// RoPE base.
    pub rope_theta: f32,
    /// Weight seed.
    pub seed: u32,
}

impl SyntheticShape {
    /// Llama-3-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256,
    /// rope_theta 500000, untied lm_head.
    pub fn llama3_8b(seed: u32) -> Self {
        Self {
            layers: 32,
            hidden: 4096,
            heads: 32,
            kv_heads: 8,
            intermediate: 14336,
            vocab: 128_256,
            rope_theta: 500_000.0,
            seed,
        }
    }

    /// RoPE inverse frequencies (no scaling).
    pub fn inv_freq(&self) -> Vec<f32> {
        let hd = self.hidden / self.heads;
        (0..hd / 2).map(|i| (1.0 / f64::from(self.rope_theta).powf(2.0 * i as f64 / hd as f64)) as f32).collect()
    }

    /// The dimensions of this shape (RMSNorm epsilon 1e-5).
    pub(crate) fn dims(&self) -> Dims {
        Dims {
            hidden: self.hidden,
            q_heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.hidden / self.heads,
            inter: self.intermediate,
            vocab: self.vocab,
            layers: self.layers,
            eps: 1e-5,
        }
    }
}
