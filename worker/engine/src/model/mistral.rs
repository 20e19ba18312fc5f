//! `MistralForCausalLM`: Llama's layers with an optional sliding attention window on every
//! layer (`sliding_window`, 4096 in Mistral 7B v0.1, null from v0.2 on). Its GGUF files say
//! `general.architecture = llama` and are read as Llama, with `llama.attention.sliding_window`
//! when the converter wrote it.

use super::config::{Architecture, HfLlamaConfig, ModelConfig, set_hf_windows};

/// Mistral's reading of `config.json` on top of Llama's.
pub(super) fn configure_hf(cfg: &mut ModelConfig, hf: &HfLlamaConfig) {
    cfg.arch.architecture = Architecture::Mistral;
    set_hf_windows(cfg, hf, |_| true);
}
