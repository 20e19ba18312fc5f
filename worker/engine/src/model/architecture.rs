//! [`ModelConfig::from_hf`]: a Hugging Face `config.json` read by the rules of the
//! architecture it names (`architectures[0]`): Llama's reading of the shared fields
//! (`config.rs`), then the family's own (`mistral.rs`, `qwen2.rs`, `qwen3.rs`, `gemma3.rs`).

use super::config::{Architecture, HfLlamaConfig, ModelConfig, SUPPORTED_HF_ARCHITECTURES};
use super::error::ModelError;
use super::{gemma3, mistral, qwen2, qwen3};

impl ModelConfig {
    /// Builds and validates a config from a Hugging Face `config.json`. The architecture is
    /// the first `architectures` entry (Llama when the list is empty).
    ///
    /// # Errors
    /// [`ModelError::Config`] when the shapes are inconsistent or the family's options are
    /// unsupported, [`ModelError::Architecture`] naming `architectures` for an unsupported
    /// family.
    pub fn from_hf(hf: &HfLlamaConfig) -> Result<Self, ModelError> {
        let arch = match hf.architectures.first() {
            None => Architecture::Llama,
            Some(name) => Architecture::from_hf(name).ok_or_else(|| ModelError::Architecture {
                name: format!("architectures[0] = {name:?}"),
                supported: SUPPORTED_HF_ARCHITECTURES,
            })?,
        };
        let mut cfg = Self::llama_from_hf(hf)?;
        if hf.attn_logit_softcapping.is_some() {
            return Err(ModelError::Config("attn_logit_softcapping is not supported".into()));
        }
        match arch {
            Architecture::Llama => {}
            Architecture::Mistral => mistral::configure_hf(&mut cfg, hf),
            Architecture::Qwen2 => qwen2::configure_hf(&mut cfg, hf),
            Architecture::Qwen3 => qwen3::configure_hf(&mut cfg, hf)?,
            Architecture::Gemma3 => gemma3::configure_hf(&mut cfg, hf)?,
        }
        cfg.validate()?;
        Ok(cfg)
    }
}
