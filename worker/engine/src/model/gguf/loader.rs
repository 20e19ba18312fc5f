//! [`load`]: a GGUF file (llama, qwen2, qwen3, gemma3) turned into a [`LoadedModel`] — config
//! from `{arch}.*` keys, tokenizer and chat template from `tokenizer.*` metadata, tensors by their
//! Hugging Face names (llama.cpp's name map), dequantized to f32 or kept in their blocks, with
//! Q/K of `llama` files un-permuted back to the Hugging Face layout (see [`llama::unpermute_qk`]).

use std::path::Path;

use super::{GgufFile, GgufValue, gguf_name_for};
use crate::model::chat_template::{self, ChatTemplate};
use crate::model::config::ModelConfig;
use crate::model::error::{ModelError, ResultExt, tokenizer_no_panic};
use crate::model::llama::{self, HostTensor, LlamaWeights, QuantizedData, QuantizedTensor, WeightSource};
use crate::model::loaded::{LoadedModel, ProgressFn};
use crate::model::tokenizer::Tokenizer;

struct GgufWeights<'a> {
    file: &'a GgufFile,
    cfg: &'a ModelConfig,
    /// llama.cpp permutes Q/K rows only for the `llama` architecture (interleaved RoPE); the
    /// others keep the Hugging Face (NeoX) order.
    permuted_qk: bool,
    done: u64,
    total: u64,
    progress: ProgressFn<'a>,
}

impl WeightSource for GgufWeights<'_> {
    fn tensor(&mut self, hf_name: &str) -> Result<Option<HostTensor>, ModelError> {
        let Some(name) = gguf_name_for(self.file.architecture(), hf_name) else { return Ok(None) };
        if !self.file.tensors.contains_key(&name) {
            return Ok(None);
        }
        let (shape, mut data) = self.file.tensor_f32(&name)?;
        if !self.permuted_qk {
            // NeoX-order Q/K: as stored.
        } else if hf_name.ends_with("q_proj.weight") {
            llama::unpermute_qk(&mut data, self.cfg.num_attention_heads, self.cfg.hidden_size);
        } else if hf_name.ends_with("k_proj.weight") {
            llama::unpermute_qk(&mut data, self.cfg.num_key_value_heads, self.cfg.hidden_size);
        }
        self.done += self.file.tensor_bytes(&name).map(|(_, b)| b.len() as u64).unwrap_or(0);
        (self.progress)(self.done, self.total);
        Ok(Some((shape, data)))
    }

    fn quantized(&mut self, hf_name: &str) -> Result<Option<QuantizedTensor>, ModelError> {
        let Some(name) = gguf_name_for(self.file.architecture(), hf_name) else { return Ok(None) };
        if !self.file.tensors.contains_key(&name) {
            return Ok(None);
        }
        let (info, bytes) = self.file.tensor_bytes(&name)?;
        let shape = info.shape();
        if !QuantizedData::supports(info.ty) || shape.len() != 2 || !shape[1].is_multiple_of(info.ty.block_layout().0) {
            return Ok(None);
        }
        let mut q = QuantizedData { ty: info.ty, bytes: bytes.to_vec() };
        let row_bytes = q.row_bytes(shape[1]);
        if !self.permuted_qk {
            // NeoX-order Q/K: as stored.
        } else if hf_name.ends_with("q_proj.weight") {
            llama::unpermute_qk_bytes(&mut q.bytes, self.cfg.num_attention_heads, row_bytes);
        } else if hf_name.ends_with("k_proj.weight") {
            llama::unpermute_qk_bytes(&mut q.bytes, self.cfg.num_key_value_heads, row_bytes);
        }
        self.done += bytes.len() as u64;
        (self.progress)(self.done, self.total);
        Ok(Some((shape, q)))
    }
}

/// Loads a llama-architecture GGUF file; with `keep_quantized`, matrices in a block format
/// (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 and the K-quants) keep their blocks
/// ([`crate::model::Linear::quant`]) instead of being dequantized to f32.
///
/// # Errors
/// [`ModelError`] (wrapped in [`ModelError::File`] with `path`) on malformed files, other
/// architectures or tokenizers, missing tensors.
pub fn load(path: &Path, progress: ProgressFn<'_>, keep_quantized: bool) -> Result<LoadedModel, ModelError> {
    let file = GgufFile::open(path)?;
    load_file(&file, progress, keep_quantized).in_file(path)
}

fn load_file(file: &GgufFile, progress: ProgressFn<'_>, keep_quantized: bool) -> Result<LoadedModel, ModelError> {
    let config = file.model_config()?;
    let tokenizer = tokenizer_no_panic(|| Tokenizer::from_gguf(file))?;
    let architecture = file.architecture();
    let source = file.get("tokenizer.chat_template").and_then(GgufValue::as_str).or_else(|| {
        let builtin = chat_template::builtin_source(architecture);
        if builtin.is_some() {
            tracing::info!(architecture, "the GGUF file has no chat template; using the family's published one");
        }
        builtin
    });
    let chat_template = match source {
        Some(src) => Some(ChatTemplate::new(src, tokenizer.bos_text(), tokenizer.eos_text())?),
        None => None,
    };
    let total = file.tensors.keys().filter_map(|n| file.tensor_bytes(n).ok().map(|(_, b)| b.len() as u64)).sum();
    let permuted_qk = file.architecture() == "llama";
    let mut src = GgufWeights { file, cfg: &config, permuted_qk, done: 0, total, progress };
    let weights = LlamaWeights::load_with(&config, &mut src, keep_quantized)?;
    Ok(LoadedModel { config, tokenizer, chat_template, weights })
}
