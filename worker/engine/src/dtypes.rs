//! The number formats a deployment picks for a CUDA replica: the weights' ([`Quantization`],
//! vLLM's `--quantization`) and the KV cache's ([`KvCacheDtype`], vLLM's `--kv-cache-dtype`).

/// Weight format of the decoder layers' linear layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Quantization {
    /// bf16 (the checkpoint's values rounded to bf16).
    #[default]
    None,
    /// FP8 e4m3 weights with per-output-channel f32 scales: half the bytes a decode step
    /// reads; FP8 tensor-core GEMMs (activations quantized per token) for larger steps.
    Fp8,
}

/// Element type of the paged KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheDtype {
    /// bf16.
    #[default]
    Bf16,
    /// e4m3 with a per-tensor scale of 1.0 (vLLM's default without calibration: K and V
    /// values are stored as they are, saturating at ±448): twice the tokens in the same memory.
    Fp8,
}

impl KvCacheDtype {
    /// Bytes per cached value.
    pub fn bytes(self) -> usize {
        match self {
            Self::Bf16 => 2,
            Self::Fp8 => 1,
        }
    }
}
