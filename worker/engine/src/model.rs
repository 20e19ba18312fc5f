//! Model loading: one [`ModelSource`] (a GGUF file or a Hugging Face directory) turned into a
//! [`LoadedModel`] — config, tokenizer, chat template and f32 host weights in the Hugging Face
//! layout (`[out_features, in_features]` row-major, Q/K un-permuted), the shape candle's
//! `llama.rs` and vLLM's model loader use.
//!
//! - [`config`]: [`ModelConfig`] (serde mirror of `config.json`, also built from GGUF metadata).
//! - [`gguf`]: GGUF v3 reader and dequantization (F32/F16/BF16/Q8_0/Q4_0/Q4_1).
//! - [`safetensors`]: Hugging Face `model.safetensors` / sharded index; FP8 weights
//!   dequantized with their scales, or read as stored ([`safetensors::SafetensorsFiles::fp8_weight`]).
//! - [`quantization`]: [`CheckpointQuant`] (`quantization_config`: fp8, compressed-tensors).
//! - [`fp8`]: E4M3/E5M2 conversion and [`fp8::Fp8Weight`] (codes + scales).
//! - [`tokenizer`]: [`Tokenizer`] (tokenizers crate; built from GGUF metadata or `tokenizer.json`).
//! - [`chat_template`]: [`ChatTemplate`] (minijinja with Hugging Face semantics).
//! - [`llama`]: [`LlamaWeights`] (the decoder weights every family shares) and
//!   tensor-parallel sharding.
//! - [`mistral`], [`qwen2`], [`qwen3`], [`gemma3`]: how each family's config (Hugging Face
//!   and GGUF) maps onto [`ArchConfig`], the backend-neutral description of its layers.

mod architecture;
pub mod chat_template;
pub mod config;
pub mod error;
pub mod fp8;
pub mod gemma3;
pub mod gguf;
pub mod llama;
mod loaded;
pub mod mistral;
pub mod quantization;
pub mod qwen2;
pub mod qwen3;
pub mod safetensors;
pub mod tokenizer;

use std::path::{Path, PathBuf};

pub use chat_template::ChatTemplate;
pub use config::{Activation, ArchConfig, Architecture, LayerAttention, ModelConfig, RopeScaling};
pub use error::ModelError;
pub use llama::{LayerWeights, Linear, LlamaWeights, QuantizedData};
pub use loaded::{LoadOptions, LoadedModel, ProgressFn};
pub use quantization::CheckpointQuant;
pub use tokenizer::{Tokenizer, TokenizerExport};

use crate::request::EngineError;

/// Where a model comes from; detected from the path by [`ModelSource::detect`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelSource {
    /// A single GGUF file (`general.architecture` llama, qwen2, qwen3 or gemma3).
    Gguf(PathBuf),
    /// A Hugging Face model directory (`config.json`, `*.safetensors`, `tokenizer.json`).
    HfDir(PathBuf),
}

impl ModelSource {
    /// A directory is a Hugging Face checkout; a file is read as GGUF (its magic is checked at load).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (field `model`) when the path does not exist.
    pub fn detect(path: impl AsRef<Path>) -> Result<Self, EngineError> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| EngineError::InvalidRequest {
            field: "model",
            message: format!("model path {}: {e}", path.display()),
        })?;
        if meta.is_dir() { Ok(Self::HfDir(path.to_path_buf())) } else { Ok(Self::Gguf(path.to_path_buf())) }
    }

    /// The path this source reads.
    pub fn path(&self) -> &Path {
        match self {
            Self::Gguf(p) | Self::HfDir(p) => p,
        }
    }
}

/// Loads a model with every weight in f32 (blocking; call from `spawn_blocking` or a
/// plain thread).
///
/// # Errors
/// [`ModelError`] on unreadable or malformed files, unsupported architectures or tensor types,
/// and missing tensors (the engine reports it as [`EngineError::Internal`]).
pub fn load_model(source: &ModelSource, progress: Option<ProgressFn<'_>>) -> Result<LoadedModel, ModelError> {
    load_model_with(source, progress, LoadOptions::default())
}

/// As [`load_model`], with [`LoadOptions`].
///
/// # Errors
/// As [`load_model`].
pub fn load_model_with(
    source: &ModelSource,
    progress: Option<ProgressFn<'_>>,
    options: LoadOptions,
) -> Result<LoadedModel, ModelError> {
    let noop = |_: u64, _: u64| {};
    let progress: ProgressFn<'_> = progress.unwrap_or(&noop);
    match source {
        ModelSource::Gguf(path) => gguf::loader::load(path, progress, options.keep_quantized),
        ModelSource::HfDir(dir) => safetensors::load_dir(dir, progress),
    }
}
