//! [`ModelConfig`]: the model's hyper-parameters, built from a Hugging Face `config.json`
//! ([`HfLlamaConfig`], a serde mirror of the fields every supported family uses) or from GGUF
//! metadata, and [`ArchConfig`]: the backend-neutral description of how an architecture's
//! decoder layer differs from Llama's (q/k/v bias, q/k norm, Gemma's sandwich norms and
//! GeGLU, embedding scale, attention scale, per-layer sliding window and RoPE base). Each
//! architecture's own rules for reading it live in its file beside `llama.rs` (`mistral.rs`,
//! `qwen2.rs`, `qwen3.rs`, `gemma3.rs`; `architecture.rs` picks one). RoPE
//! frequencies, including Llama 3's `rope_scaling` (`rope_type: "llama3"`), follow
//! transformers' `modeling_rope_utils._compute_llama3_parameters`.

use serde::{Deserialize, Serialize};

use super::error::ModelError;
use super::quantization::CheckpointQuant;

/// Most decoder layers a model may have (far above any released model).
pub const MAX_LAYERS: usize = 1 << 12;
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

/// Hugging Face `config.json` of the supported families (Llama 2/3, SmolLM, Mistral, Qwen2,
/// Qwen3, Gemma 3 text): the Llama fields plus the optional ones the other families add.
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
    /// q/k/v (and o) projections have biases (Qwen3, Gemma 3, Llama; Qwen2 always has q/k/v
    /// biases and has no such key).
    #[serde(default)]
    pub attention_bias: Option<bool>,
    /// Sliding attention window in tokens (Mistral, Qwen2/3, Gemma 3's local layers).
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Qwen2/3: whether `sliding_window` is used at all.
    #[serde(default)]
    pub use_sliding_window: Option<bool>,
    /// Qwen2/3: layers below this index use full attention when windows are on.
    #[serde(default)]
    pub max_window_layers: Option<usize>,
    /// Per-layer `"sliding_attention"` / `"full_attention"` (transformers ≥ 4.53 writes it).
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    /// Gemma 3: every `sliding_window_pattern`-th layer is global (older configs).
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    /// Gemma 3: RoPE base of the local (sliding-window) layers.
    #[serde(default)]
    pub rope_local_base_freq: Option<f32>,
    /// Gemma 3: the softmax scale is `query_pre_attn_scalar^-0.5`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f32>,
    /// MLP activation (Gemma: `gelu_pytorch_tanh`).
    #[serde(default)]
    pub hidden_activation: Option<String>,
    /// MLP activation (Llama, Qwen, Mistral: `silu`).
    #[serde(default)]
    pub hidden_act: Option<String>,
    /// Gemma: logits become `c · tanh(logits / c)`.
    #[serde(default)]
    pub final_logit_softcapping: Option<f32>,
    /// Gemma 2: attention scores soft-capped (not supported; must be absent or null).
    #[serde(default)]
    pub attn_logit_softcapping: Option<f32>,
    /// transformers ≥ 5: RoPE parameters (`rope_theta`, `rope_type`, ...), or for Gemma 3 one
    /// such map per layer type (`full_attention`, `sliding_attention`).
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
}

/// Model family: which decoder-layer recipe (with [`ArchConfig`]) a checkpoint follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Architecture {
    /// `LlamaForCausalLM` / GGUF `llama`.
    Llama,
    /// `MistralForCausalLM` (Llama with an optional sliding window; GGUF files say `llama`).
    Mistral,
    /// `Qwen2ForCausalLM` / GGUF `qwen2`: q/k/v biases.
    Qwen2,
    /// `Qwen3ForCausalLM` / GGUF `qwen3`: per-head q/k RMSNorm.
    Qwen3,
    /// `Gemma3ForCausalLM` (text) / GGUF `gemma3`.
    Gemma3,
}

impl Architecture {
    /// The Hugging Face `architectures` entry.
    pub fn hf_name(self) -> &'static str {
        match self {
            Self::Llama => "LlamaForCausalLM",
            Self::Mistral => "MistralForCausalLM",
            Self::Qwen2 => "Qwen2ForCausalLM",
            Self::Qwen3 => "Qwen3ForCausalLM",
            Self::Gemma3 => "Gemma3ForCausalLM",
        }
    }

    /// The architecture a Hugging Face `architectures` entry names.
    pub fn from_hf(name: &str) -> Option<Self> {
        [Self::Llama, Self::Mistral, Self::Qwen2, Self::Qwen3, Self::Gemma3].into_iter().find(|a| a.hf_name() == name)
    }
}

/// Hugging Face `architectures` values the loaders read.
pub const SUPPORTED_HF_ARCHITECTURES: &str =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma3ForCausalLM";

/// GGUF `general.architecture` values the loaders read.
pub const SUPPORTED_GGUF_ARCHITECTURES: &str = "llama, qwen2, qwen3, gemma3";

/// The MLP's gate activation: `down(act(gate(x)) · up(x))`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x · sigmoid(x)` (SwiGLU; Llama, Mistral, Qwen).
    Silu,
    /// GELU, tanh approximation (`gelu_pytorch_tanh`; GeGLU, Gemma):
    /// `0.5 · x · (1 + tanh(sqrt(2/π) · (x + 0.044715 · x³)))`.
    GeluTanh,
}

/// One decoder layer's attention: its window and its RoPE.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerAttention {
    /// `Some(w)`: the query at position `p` attends to positions `p - w + 1 ..= p` only
    /// (transformers' `sliding_window` mask, llama.cpp's standard SWA); `None`: `0 ..= p`.
    pub sliding_window: Option<usize>,
    /// RoPE base of this layer.
    pub rope_theta: f32,
    /// Whether [`ModelConfig::rope_scaling`] and [`ModelConfig::rope_freq_factors`] apply
    /// to this layer (Gemma 3's local layers use plain RoPE with their own base).
    pub rope_scaled: bool,
}

/// How an architecture's decoder differs from Llama's — everything a backend needs beyond
/// the shapes. [`ArchConfig::llama`] is Llama's recipe (every flag off), under which the
/// backends compute exactly what they computed before this description existed.
///
/// A layer, for hidden state `x` (`norm` = RMSNorm with the layer's gain):
/// ```text
/// h = norm_in(x)                                   (LayerWeights::input_layernorm)
/// q, k, v = h·Wqᵀ (+ bq), h·Wkᵀ (+ bk), h·Wvᵀ (+ bv) (attention_bias)
/// q, k = rms_norm_per_head(q, q_norm), (k, k_norm) (qk_norm; eps = rms_norm_eps)
/// q, k = rope(q, k; layer's rope_theta)            (rotate-half layout)
/// a = attention(q, k, v; attention_scale, layer's sliding_window) · Woᵀ
/// x = x + (sandwich_norms ? norm(a, attn_out_norm) : a)
/// h = norm(x, post_attention_layernorm)            (Gemma 3: pre_feedforward_layernorm)
/// m = (act(h·Wgᵀ) ⊙ h·Wuᵀ)·Wdᵀ                     (hidden_activation)
/// x = x + (sandwich_norms ? norm(m, ffn_out_norm) : m)
/// ```
/// The embedding rows are multiplied by `embedding_scale` (when set); logits are
/// `c · tanh(logits / c)` with `c = final_logit_softcapping` (when set).
#[derive(Clone, Debug, PartialEq)]
pub struct ArchConfig {
    /// The family.
    pub architecture: Architecture,
    /// q/k/v projections add a bias (`LayerWeights::{q,k,v}_bias`; Qwen2).
    pub attention_bias: bool,
    /// Per-head RMSNorm of q and of k (gains `[head_dim]`, `LayerWeights::{q,k}_norm`) after
    /// the projection, before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// RMSNorm of the attention output and of the MLP output before each residual add
    /// (`LayerWeights::{attn_out_norm, ffn_out_norm}`; Gemma 3).
    pub sandwich_norms: bool,
    /// The checkpoint stores every RMSNorm gain as `g - 1` (Gemma's `x̂ · (1 + w)`; Hugging
    /// Face files, not GGUF, whose converter adds the 1). The loaders add it when they build
    /// [`super::LlamaWeights`], whose gains are always the plain `g`; a backend that reads
    /// checkpoint tensors itself must add it too.
    pub norm_weight_offset: f32,
    /// MLP gate activation.
    pub hidden_activation: Activation,
    /// Embedding rows are multiplied by this (Gemma: `sqrt(hidden_size)`, in f32).
    pub embedding_scale: Option<f32>,
    /// Softmax scale is `query_pre_attn_scalar^-0.5` (Gemma 3) instead of `head_dim^-0.5`.
    pub query_pre_attn_scalar: Option<f32>,
    /// Logits are `c · tanh(logits / c)`.
    pub final_logit_softcapping: Option<f32>,
    /// One entry per decoder layer.
    pub layers: Vec<LayerAttention>,
}

/// Sets each layer's window from `config.json`: `layer_types` when present
/// (`"sliding_attention"` layers get `sliding_window`), else `default_sliding(layer)`.
pub(super) fn set_hf_windows(cfg: &mut ModelConfig, hf: &HfLlamaConfig, default_sliding: impl Fn(usize) -> bool) {
    let Some(w) = hf.sliding_window else { return };
    for (i, l) in cfg.arch.layers.iter_mut().enumerate() {
        let sliding = match &hf.layer_types {
            Some(types) => types.get(i).is_some_and(|t| t == "sliding_attention"),
            None => default_sliding(i),
        };
        l.sliding_window = sliding.then_some(w);
    }
}

impl ArchConfig {
    /// Llama's recipe for `num_layers` layers of full attention with RoPE base `rope_theta`.
    pub fn llama(num_layers: usize, rope_theta: f32) -> Self {
        Self {
            architecture: Architecture::Llama,
            attention_bias: false,
            qk_norm: false,
            sandwich_norms: false,
            norm_weight_offset: 0.0,
            hidden_activation: Activation::Silu,
            embedding_scale: None,
            query_pre_attn_scalar: None,
            final_logit_softcapping: None,
            // A layer count past the supported maximum is refused by `ModelConfig::validate`;
            // the list is never sized from it (a hostile header may claim 10^9 layers).
            layers: vec![
                LayerAttention { sliding_window: None, rope_theta, rope_scaled: true };
                num_layers.min(MAX_LAYERS + 1)
            ],
        }
    }
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

/// Whether `v` is a positive number (NaN is not).
fn positive(v: f32) -> bool {
    v.is_finite() && v > 0.0
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
    /// The architecture's decoder recipe (Llama's for Llama).
    pub arch: ArchConfig,
}

impl ModelConfig {
    /// The Llama reading of `config.json` (every family's common fields), not validated;
    /// [`ModelConfig::from_hf`] (in `architecture.rs`) adds the family's own.
    pub(super) fn llama_from_hf(hf: &HfLlamaConfig) -> Result<Self, ModelError> {
        let heads = hf.num_attention_heads;
        if heads == 0 {
            return Err(ModelError::Config("num_attention_heads is 0".into()));
        }
        // transformers ≥ 5 writes the RoPE base and scaling under `rope_parameters`.
        let flat = hf.rope_parameters.as_ref().filter(|p| p.get("rope_theta").is_some());
        let rope_theta = flat.and_then(|p| p.get("rope_theta")?.as_f64()).map_or(hf.rope_theta, |t| t as f32);
        // Only a scaled RoPE has a `factor` (`{"rope_type": "default", "rope_theta": ..}` is none).
        let from_params = match flat.filter(|p| p.get("factor").is_some()) {
            Some(p) => {
                Some(RopeScaling::deserialize(p).map_err(|e| ModelError::Config(format!("rope_parameters: {e}")))?)
            }
            None => None,
        };
        let rope_scaling = match hf.rope_scaling.clone().or(from_params) {
            Some(rs) if rs.rope_type == "default" => None,
            other => other,
        };
        let cfg = Self {
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_attention_heads: heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf.head_dim.unwrap_or(hf.hidden_size / heads),
            num_hidden_layers: hf.num_hidden_layers,
            rms_norm_eps: hf.rms_norm_eps,
            rope_theta,
            rope_scaling,
            rope_freq_factors: None,
            vocab_size: hf.vocab_size,
            max_position_embeddings: hf.max_position_embeddings,
            tie_word_embeddings: hf.tie_word_embeddings,
            bos_token_id: hf.bos_token_id,
            eos_token_ids: hf.eos_token_id.as_ref().map(TokenIds::to_vec).unwrap_or_default(),
            quantization: hf.quantization_config.as_ref().map(CheckpointQuant::from_hf).transpose()?,
            arch: ArchConfig::llama(hf.num_hidden_layers, rope_theta),
        };
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
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
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
        if self.arch.layers.len() != self.num_hidden_layers {
            return Err(ModelError::Config(format!(
                "{} layer attention entries for {} layers",
                self.arch.layers.len(),
                self.num_hidden_layers
            )));
        }
        if self.arch.layers.iter().any(|l| l.sliding_window == Some(0) || !positive(l.rope_theta)) {
            return Err(ModelError::Config("sliding_window must be >= 1 and rope_theta > 0".into()));
        }
        if self.arch.query_pre_attn_scalar.is_some_and(|s| !positive(s))
            || self.arch.final_logit_softcapping.is_some_and(|c| !positive(c))
        {
            return Err(ModelError::Config("query_pre_attn_scalar and final_logit_softcapping must be > 0".into()));
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

    /// Softmax scale of attention: `query_pre_attn_scalar^-0.5`, else `head_dim^-0.5`.
    pub fn attention_scale(&self) -> f32 {
        1.0 / self.arch.query_pre_attn_scalar.unwrap_or(self.head_dim as f32).sqrt()
    }

    /// The window every layer has, when every layer has one (the largest): KV entries older
    /// than it are never read again, so their blocks can be freed. `None` when some layer
    /// attends over the whole context.
    pub fn uniform_sliding_window(&self) -> Option<usize> {
        self.arch.layers.iter().map(|l| l.sliding_window).try_fold(0, |m, w| w.map(|w| m.max(w)))
    }

    /// RoPE inverse frequencies, `head_dim / 2` values (`theta^(-2i/d)`), with Llama 3
    /// scaling applied when configured. Computed in f64, returned as f32.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        self.inv_freq_with(self.rope_theta, true)
    }

    /// [`ModelConfig::rope_inv_freq`] of decoder layer `layer` (its own base and scaling).
    pub fn layer_rope_inv_freq(&self, layer: usize) -> Vec<f32> {
        match self.arch.layers.get(layer) {
            Some(l) => self.inv_freq_with(l.rope_theta, l.rope_scaled),
            None => self.rope_inv_freq(),
        }
    }

    fn inv_freq_with(&self, theta: f32, scaled: bool) -> Vec<f32> {
        let d = self.head_dim as f64;
        let base = f64::from(theta);
        let mut inv: Vec<f64> = (0..self.head_dim / 2).map(|i| 1.0 / base.powf(2.0 * i as f64 / d)).collect();
        if !scaled {
            return inv.into_iter().map(|f| f as f32).collect();
        }
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
