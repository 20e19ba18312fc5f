//! `Qwen2ForCausalLM` (Qwen2, Qwen2.5): Llama's layers with biases on the q/k/v projections
//! (always; o_proj has none). With `use_sliding_window`, layers from `max_window_layers` on
//! use `sliding_window` (or as `layer_types` says). GGUF `qwen2`: `blk.N.attn_{q,k,v}.bias`,
//! Q/K rows in the Hugging Face (NeoX, rotate-half) order, not permuted.

use super::config::{Architecture, HfLlamaConfig, ModelConfig, set_hf_windows};

/// Qwen2's reading of `config.json` on top of Llama's.
pub(super) fn configure_hf(cfg: &mut ModelConfig, hf: &HfLlamaConfig) {
    cfg.arch.architecture = Architecture::Qwen2;
    cfg.arch.attention_bias = true;
    set_qwen_windows(cfg, hf);
}

/// Qwen's windows: none unless `use_sliding_window`; then `layer_types`, or every layer from
/// `max_window_layers` on.
pub(super) fn set_qwen_windows(cfg: &mut ModelConfig, hf: &HfLlamaConfig) {
    if hf.use_sliding_window != Some(true) {
        return;
    }
    let first = hf.max_window_layers.unwrap_or(0);
    set_hf_windows(cfg, hf, |i| i >= first);
}
