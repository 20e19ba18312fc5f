//! [`ModelConfig`]: the Llama-family hyper-parameters, a serde mirror of Hugging Face's
//! `config.json` (`LlamaConfig`), also built from GGUF `llama.*` metadata. RoPE frequencies,
//! including Llama 3's `rope_scaling` (`rope_type: "llama3"`), follow transformers'
//! `modeling_rope_utils._compute_llama3_parameters`.

use serde::{Deserialize, Serialize};

use super::error::ModelError;
use super::quantization::CheckpointQuant;

/// Llama 3 style RoPE frequency scaling (`rope_scaling` with `rope_type: "llama3"`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    /// "llama3" (also accepted under the older key `type`).
    #[serde(alias = "type")]
    pub rope_type: String,
    /// Overall scale factor (8.0 for Llama 3.1).
    pub factor: f32,
    /// Wavelengths longer than `original_max / low_freq_factor` are scaled by `1/factor`.
    #[serde(default = "one")]
    pub low_freq_factor: f32,
    /// Wavelengths shorter than `original_max / high_freq_factor` are unchanged.
    #[serde(default = "four")]
    pub high_freq_factor: f32,
    /// Context length the model was pre-trained with.
    #[serde(default = "default_orig_max")]
    pub original_max_position_embeddings: usize,
}

fn one() -> f32 {
    1.0
}
fn four() -> f32 {
    4.0
}
fn default_orig_max() -> usize {
    8192
}

/// `eos_token_id` in `config.json` / `generation_config.json`: one id or a list.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// A single id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// As a list.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            Self::One(id) => vec![*id],
            Self::Many(ids) => ids.clone(),
        }
    }
}

/// Hugging Face `config.json` for the Llama family (Llama 2/3, Mistral, SmolLM).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HfLlamaConfig {
    /// Model width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (GQA); defaults to `num_attention_heads`.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Per-head width; defaults to `hidden_size / num_attention_heads`.
    #[serde(default)]
    pub head_dim: Option<usize>,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    /// RoPE base.
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    /// Optional RoPE scaling (only "llama3" and "default" are supported).
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// Vocabulary rows of the embedding.
    pub vocab_size: usize,
    /// Context window.
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// `lm_head` shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// BOS id.
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    /// EOS id(s).
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    /// Architectures list (e.g. `["LlamaForCausalLM"]`).
    #[serde(default)]
    pub architectures: Vec<String>,
    /// How the weights are quantized (FP8 checkpoints), parsed by
    /// [`CheckpointQuant::from_hf`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization_config: Option<serde_json::Value>,
}

fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f32 {
    10_000.0
}
fn default_max_pos() -> usize {
    2048
}

/// Validated model hyper-parameters, independent of the file format.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// Model width (`d_model`).
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// KV heads (divides `num_attention_heads`).
    pub num_key_value_heads: usize,
    /// Per-head width (even).
    pub head_dim: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// Llama 3 RoPE scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Per-frequency divisors (`head_dim / 2` values) from a GGUF `rope_freqs.weight`
    /// tensor (how llama.cpp stores Llama 3 scaling); applied after `rope_scaling`.
    pub rope_freq_factors: Option<Vec<f32>>,
    /// Vocabulary size (embedding rows).
    pub vocab_size: usize,
    /// Context window in tokens.
    pub max_position_embeddings: usize,
    /// `lm_head` is the embedding matrix.
    pub tie_word_embeddings: bool,
    /// BOS id, if the model has one.
    pub bos_token_id: Option<u32>,
    /// EOS ids (config.json, generation_config.json and tokenizer merged, deduplicated).
    pub eos_token_ids: Vec<u32>,
    /// The checkpoint's weight quantization (an FP8 checkpoint's `quantization_config`);
    /// `None` for float checkpoints and GGUF files.
    pub quantization: Option<CheckpointQuant>,
}

impl ModelConfig {
    /// Builds and validates a config from a Hugging Face `config.json`.
    ///
    /// # Errors
    /// [`ModelError::Config`] when the shapes are inconsistent, [`ModelError::Quantization`]
    /// for a `quantization_config` the loader does not read.
    pub fn from_hf(hf: &HfLlamaConfig) -> Result<Self, ModelError> {
        let heads = hf.num_attention_heads;
        if heads == 0 {
            return Err(ModelError::Config("num_attention_heads is 0".into()));
        }
        let rope_scaling = match &hf.rope_scaling {
            Some(rs) if rs.rope_type == "default" => None,
            other => other.clone(),
        };
        let cfg = Self {
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf.head_dim.unwrap_or(hf.hidden_size / heads),
            num_hidden_layers: hf.num_hidden_layers,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta,
            rope_scaling,
            rope_freq_factors: None,
            vocab_size: hf.vocab_size,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings,
            bos_token_id: hf.bos_token_id,
            eos_token_ids: hf.eos_token_id.as_ref().map(TokenIds::to_vec).unwrap_or_default(),
            quantization: hf.quantization_config.as_ref().map(CheckpointQuant::from_hf).transpose()?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the shape invariants the backends rely on.
    ///
    /// # Errors
    /// [`ModelError::Config`] naming the broken invariant.
    pub fn validate(&self) -> Result<(), ModelError> {
        // Bounds far above any released model, checked before anything is sized from the
        // config (the layer list, RoPE tables, shape checks): a config.json or GGUF header
        // claiming 2^40 hidden units or 10^9 layers is an error, not an allocation.
        for (name, value, max) in [
            ("hidden_size", self.hidden_size, 1usize << 17),
            ("intermediate_size", self.intermediate_size, 1 << 20),
            ("num_attention_heads", self.num_attention_heads, 1 << 12),
            ("num_key_value_heads", self.num_key_value_heads, 1 << 12),
            ("head_dim", self.head_dim, 1 << 12),
            ("num_hidden_layers", self.num_hidden_layers, 1 << 12),
            ("vocab_size", self.vocab_size, 1 << 24),
            ("max_position_embeddings", self.max_position_embeddings, 1 << 26),
            ("q_dim", self.num_attention_heads.saturating_mul(self.head_dim), 1 << 20),
        ] {
            if value > max {
                return Err(ModelError::Config(format!("{name} {value} is larger than the supported maximum {max}")));
            }
        }
        if self.hidden_size == 0 || self.intermediate_size == 0 || self.num_hidden_layers == 0 || self.vocab_size == 0 {
            return Err(ModelError::Config("zero-sized model dimension".into()));
        }
        if self.num_key_value_heads == 0 || !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            return Err(ModelError::Config(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return Err(ModelError::Config(format!("head_dim {} must be even and > 0", self.head_dim)));
        }
        if let Some(f) = &self.rope_freq_factors
            && f.len() != self.head_dim / 2
        {
            return Err(ModelError::Config("rope_freqs has the wrong length".into()));
        }
        if let Some(rs) = &self.rope_scaling {
            if rs.rope_type != "llama3" {
                return Err(ModelError::Config(format!("unsupported rope_scaling type {:?}", rs.rope_type)));
            }
            if rs.high_freq_factor <= rs.low_freq_factor || rs.factor <= 0.0 {
                return Err(ModelError::Config(
                    "rope_scaling: need high_freq_factor > low_freq_factor and factor > 0".into(),
                ));
            }
        }
        Ok(())
    }

    /// Width of the Q projection output (`num_attention_heads * head_dim`).
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// Width of the K (and V) projection output (`num_key_value_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// RoPE inverse frequencies, `head_dim / 2` values (`theta^(-2i/d)`), with Llama 3
    /// scaling applied when configured. Computed in f64, returned as f32.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim as f64;
        let base = f64::from(self.rope_theta);
        let mut inv: Vec<f64> = (0..self.head_dim / 2).map(|i| 1.0 / base.powf(2.0 * i as f64 / d)).collect();
        if let Some(rs) = &self.rope_scaling {
            let factor = f64::from(rs.factor);
            let low = f64::from(rs.low_freq_factor);
            let high = f64::from(rs.high_freq_factor);
            let old = rs.original_max_position_embeddings as f64;
            let low_wavelen = old / low;
            let high_wavelen = old / high;
            for f in &mut inv {
                let wavelen = 2.0 * std::f64::consts::PI / *f;
                if wavelen > low_wavelen {
                    *f /= factor;
                } else if wavelen >= high_wavelen {
                    let smooth = (old / wavelen - low) / (high - low);
                    *f = (1.0 - smooth) * *f / factor + smooth * *f;
                }
            }
        }
        if let Some(factors) = &self.rope_freq_factors {
            for (f, d) in inv.iter_mut().zip(factors) {
                *f /= f64::from(*d);
            }
        }
        inv.into_iter().map(|f| f as f32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_llama3_config_with_eos_list() -> anyhow::Result<()> {
        let json = r#"{"hidden_size":64,"intermediate_size":128,"num_attention_heads":4,
            "num_key_value_heads":2,"num_hidden_layers":2,"rms_norm_eps":1e-5,"rope_theta":500000.0,
            "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,
            "original_max_position_embeddings":8192,"rope_type":"llama3"},
            "vocab_size":100,"max_position_embeddings":131072,"tie_word_embeddings":true,
            "bos_token_id":1,"eos_token_id":[2,3]}"#;
        let hf: HfLlamaConfig = serde_json::from_str(json)?;
        let cfg = ModelConfig::from_hf(&hf)?;
        assert_eq!(cfg.head_dim, 16);
        assert_eq!(cfg.kv_dim(), 32);
        assert_eq!(cfg.eos_token_ids, vec![2, 3]);
        let inv = cfg.rope_inv_freq();
        assert_eq!(inv.len(), 8);
        assert_eq!(inv[0], 1.0);
        // The lowest frequency has wavelength far above 8192/1: divided by the factor.
        let unscaled = 1.0 / 500_000f64.powf(14.0 / 16.0);
        assert!((f64::from(inv[7]) - unscaled / 8.0).abs() < 1e-12);
        Ok(())
    }

    #[test]
    fn eos_may_be_an_int() -> anyhow::Result<()> {
        let hf: HfLlamaConfig = serde_json::from_str(
            r#"{"hidden_size":8,"intermediate_size":8,"num_attention_heads":2,"num_hidden_layers":1,
            "vocab_size":10,"eos_token_id":7}"#,
        )?;
        let cfg = ModelConfig::from_hf(&hf)?;
        assert_eq!(cfg.eos_token_ids, vec![7]);
        assert_eq!(cfg.num_key_value_heads, 2);
        Ok(())
    }

    #[test]
    fn rejects_bad_gqa() {
        let hf: Result<HfLlamaConfig, _> = serde_json::from_str(
            r#"{"hidden_size":8,"intermediate_size":8,"num_attention_heads":3,"num_key_value_heads":2,
            "num_hidden_layers":1,"vocab_size":10}"#,
        );
        let hf = hf.expect("valid json");
        assert!(matches!(ModelConfig::from_hf(&hf), Err(ModelError::Config(_))));
        // The engine reports it as an internal error, as for every load failure.
        assert!(matches!(
            ModelConfig::from_hf(&hf).map_err(crate::request::EngineError::from),
            Err(crate::request::EngineError::Internal(_))
        ));
    }
}
