//! What a shard's forward pass does beyond Llama's, read off [`ArchConfig`] for the shard's
//! layers: each layer's RoPE table (one per distinct base) and sliding window, the attention
//! scale, GeGLU, the embedding scale and the final logit soft-capping. The weights say which
//! layers carry q/k/v biases, q/k norms and sandwich norms ([`super::weights::LayerPtrs`]).
//!
//! [`ArchConfig`]: crate::model::config::ArchConfig

use crate::model::config::{Activation, ModelConfig};

/// One decoder layer's attention on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LayerPlan {
    /// Sliding window in positions (0: full causal attention).
    pub window: i32,
    /// Index of the layer's table in [`ArchPlan::inv_freqs`].
    pub rope: usize,
}

/// The per-model choices of the forward pass (Llama: [`ArchPlan::llama`]).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ArchPlan {
    /// Distinct RoPE inverse-frequency tables (`head_dim / 2` values each).
    pub inv_freqs: Vec<Vec<f32>>,
    /// The shard's layers, in order.
    pub layers: Vec<LayerPlan>,
    /// Softmax scale of attention.
    pub attention_scale: f32,
    /// GeGLU (gelu tanh) instead of SwiGLU.
    pub gelu: bool,
    /// Embedding rows are multiplied by this.
    pub embedding_scale: Option<f32>,
    /// Logits are `c · tanh(logits / c)`.
    pub softcap: Option<f32>,
}

impl ArchPlan {
    /// Llama: `layers` layers of full attention with one RoPE table, `head_dim^-0.5` scale.
    pub fn llama(inv_freq: Vec<f32>, layers: usize, head_dim: usize) -> Self {
        Self {
            inv_freqs: vec![inv_freq],
            layers: vec![LayerPlan { window: 0, rope: 0 }; layers],
            attention_scale: 1.0 / (head_dim as f32).sqrt(),
            gelu: false,
            embedding_scale: None,
            softcap: None,
        }
    }

    /// The plan of `cfg`'s decoder layers `layers` (a pipeline stage's, or all of them).
    pub fn new(cfg: &ModelConfig, layers: std::ops::Range<usize>) -> Self {
        let mut inv_freqs: Vec<Vec<f32>> = Vec::new();
        let mut plans = Vec::with_capacity(layers.len());
        for li in layers {
            let inv = cfg.layer_rope_inv_freq(li);
            let rope = match inv_freqs.iter().position(|f| *f == inv) {
                Some(r) => r,
                None => {
                    inv_freqs.push(inv);
                    inv_freqs.len() - 1
                }
            };
            let window = cfg.arch.layers.get(li).and_then(|l| l.sliding_window).map_or(0, |w| w.min(i32::MAX as usize));
            plans.push(LayerPlan { window: window as i32, rope });
        }
        if inv_freqs.is_empty() {
            inv_freqs.push(cfg.rope_inv_freq());
        }
        let a = &cfg.arch;
        Self {
            inv_freqs,
            layers: plans,
            attention_scale: cfg.attention_scale(),
            gelu: a.hidden_activation == Activation::GeluTanh,
            embedding_scale: a.embedding_scale,
            softcap: a.final_logit_softcapping,
        }
    }

    /// Some layer attends over a sliding window (the tensor-core attention kernels take only
    /// full causal attention; the split-KV kernel takes windows).
    pub fn windowed(&self) -> bool {
        self.layers.iter().any(|l| l.window > 0)
    }

    /// The RoPE tables one after another (as uploaded; table `r` starts at `r · head_dim / 2`).
    pub fn inv_freq_concat(&self) -> Vec<f32> {
        self.inv_freqs.concat()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{ArchConfig, LayerAttention};

    fn config(arch: ArchConfig) -> ModelConfig {
        ModelConfig {
            hidden_size: 64,
            intermediate_size: 128,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            num_hidden_layers: arch.layers.len(),
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_scaling: None,
            rope_freq_factors: None,
            vocab_size: 100,
            max_position_embeddings: 512,
            tie_word_embeddings: true,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
            arch,
            quantization: None,
        }
    }

    #[test]
    fn llama_is_one_table_full_attention_and_head_dim_scale() {
        let cfg = config(ArchConfig::llama(3, 10_000.0));
        let plan = ArchPlan::new(&cfg, 0..3);
        assert_eq!(plan, ArchPlan::llama(cfg.rope_inv_freq(), 3, 16));
        assert!(!plan.windowed());
    }

    #[test]
    fn interleaved_local_and_global_layers_get_their_own_tables_and_windows() {
        // Gemma 3's pattern: five local layers (base 10k, window 8) then a global one (1M).
        let mut arch = ArchConfig::llama(7, 1_000_000.0);
        for (i, l) in arch.layers.iter_mut().enumerate() {
            if i % 6 != 5 {
                *l = LayerAttention { sliding_window: Some(8), rope_theta: 10_000.0, rope_scaled: false };
            }
        }
        arch.hidden_activation = Activation::GeluTanh;
        arch.query_pre_attn_scalar = Some(64.0);
        arch.final_logit_softcapping = Some(30.0);
        let cfg = config(arch);
        let plan = ArchPlan::new(&cfg, 0..7);
        assert_eq!(plan.inv_freqs.len(), 2);
        assert_eq!(plan.inv_freqs[0], cfg.layer_rope_inv_freq(0));
        assert_eq!(plan.inv_freqs[1], cfg.layer_rope_inv_freq(5));
        assert_ne!(plan.inv_freqs[0], plan.inv_freqs[1]);
        let got: Vec<(i32, usize)> = plan.layers.iter().map(|l| (l.window, l.rope)).collect();
        assert_eq!(got, vec![(8, 0), (8, 0), (8, 0), (8, 0), (8, 0), (0, 1), (8, 0)]);
        assert!(plan.windowed() && plan.gelu);
        assert_eq!((plan.attention_scale, plan.softcap), (0.125, Some(30.0)));
        // A pipeline stage of the global layer and the next: the tables it uses, in its order.
        let stage = ArchPlan::new(&cfg, 5..7);
        assert_eq!(stage.inv_freqs, vec![cfg.layer_rope_inv_freq(5), cfg.layer_rope_inv_freq(6)]);
        assert_eq!(stage.layers, vec![LayerPlan { window: 0, rope: 0 }, LayerPlan { window: 8, rope: 1 }]);
        assert_eq!(stage.inv_freq_concat().len(), 16);
    }
}
