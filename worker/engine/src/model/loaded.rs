//! What a loader produces: [`LoadedModel`] (config, tokenizer, chat template, host weights),
//! the [`LoadOptions`] that shape it and the [`ProgressFn`] loaders report to.

use super::chat_template::ChatTemplate;
use super::config::ModelConfig;
use super::llama::LlamaWeights;
use super::tokenizer::Tokenizer;

/// A model ready to be handed to a backend: everything on the host, weights in f32.
pub struct LoadedModel {
    /// Architecture hyper-parameters and special token ids.
    pub config: ModelConfig,
    /// The tokenizer (encode, token bytes, special tokens).
    pub tokenizer: Tokenizer,
    /// The chat template, when the model ships one.
    pub chat_template: Option<ChatTemplate>,
    /// f32 host weights, Hugging Face layout.
    pub weights: LlamaWeights,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel").field("config", &self.config).finish_non_exhaustive()
    }
}

/// Load progress callback: `(done, total)` in bytes of tensor data.
pub type ProgressFn<'a> = &'a dyn Fn(u64, u64);

/// How [`super::load_model_with`] represents weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Keep GGUF Q4_0/Q4_1/Q8_0 matrices in their blocks ([`super::Linear::quant`], read directly
    /// by the CPU backend; about a fifth of the f32 memory) instead of dequantizing them.
    pub keep_quantized: bool,
}
