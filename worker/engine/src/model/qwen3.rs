//! `Qwen3ForCausalLM` (dense Qwen3): Llama's layers with a per-head RMSNorm of q and of k
//! (`self_attn.{q,k}_norm`, `[head_dim]`) after the projections and before RoPE; `head_dim`
//! set explicitly (128, not hidden / heads). Sliding windows as Qwen2's. GGUF `qwen3`:
//! `blk.N.attn_{q,k}_norm`, Q/K rows not permuted.

use super::config::{Architecture, HfLlamaConfig, ModelConfig};
use super::error::ModelError;

/// Qwen3's reading of `config.json` on top of Llama's.
///
/// # Errors
/// [`ModelError::Config`] for `attention_bias: true` (it adds an o_proj bias too, which no
/// released Qwen3 has and the backends do not implement).
pub(super) fn configure_hf(cfg: &mut ModelConfig, hf: &HfLlamaConfig) -> Result<(), ModelError> {
    if hf.attention_bias == Some(true) {
        return Err(ModelError::Config("Qwen3ForCausalLM: attention_bias true is not supported".into()));
    }
    cfg.arch.architecture = Architecture::Qwen3;
    cfg.arch.qk_norm = true;
    super::qwen2::set_qwen_windows(cfg, hf);
    Ok(())
}
