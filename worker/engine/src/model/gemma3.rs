//! `Gemma3ForCausalLM` (Gemma 3 text; `model_type: gemma3_text`) as [`ArchConfig`] describes
//! it: embedding rows scaled by `sqrt(hidden_size)`; RMSNorm gains stored as `w` with the norm
//! computing `x̂ · (1 + w)` (Hugging Face files; llama.cpp's converter stores `1 + w`); a
//! norm of the attention output and of the MLP output before each residual add (sandwich
//! norms: `post_attention_layernorm`, `post_feedforward_layernorm`; the norm before the MLP
//! is `pre_feedforward_layernorm`); per-head q/k RMSNorm; GeGLU (`gelu_pytorch_tanh`);
//! softmax scale `query_pre_attn_scalar^-0.5`; local layers with a sliding window and RoPE
//! base `rope_local_base_freq` (10 000) interleaved with global layers (full attention, base
//! `rope_theta`, 1 000 000): every `sliding_window_pattern`-th (6th) layer is global, or as
//! `layer_types` says.
//!
//! GGUF `gemma3` (llama.cpp): `gemma3.*` keys, `gemma3.attention.sliding_window`,
//! `gemma3.rope.freq_base` for the global layers, `gemma3.rope.freq_base_swa` for the local
//! ones (else 10 000), `gemma3.attention.sliding_window_pattern` (a period or one bool per
//! layer; else 6, llama.cpp's default); softmax scale `key_length^-0.5`; tensors `blk.N.attn_q_norm`, `attn_k_norm`, `post_attention_norm`,
//! `ffn_norm` (before the MLP), `post_ffw_norm`; Q/K rows not permuted.

use super::config::{Activation, Architecture, HfLlamaConfig, ModelConfig, set_hf_windows};
use super::error::ModelError;

/// Gemma 3's default RoPE base of its local layers.
pub const LOCAL_ROPE_THETA: f32 = 10_000.0;
/// Gemma 3's default: layers `5, 11, 17, ...` are global.
pub const SLIDING_WINDOW_PATTERN: usize = 6;

/// The Gemma 3 recipe on a config whose shapes are set, for local layers with window
/// `window` (as `local(layer)` says), bases `global_theta` / `local_theta`.
pub(super) fn apply(cfg: &mut ModelConfig, norm_offset: f32, query_pre_attn_scalar: f32, local_theta: f32) {
    let a = &mut cfg.arch;
    a.architecture = Architecture::Gemma3;
    a.qk_norm = true;
    a.sandwich_norms = true;
    a.norm_weight_offset = norm_offset;
    a.hidden_activation = Activation::GeluTanh;
    a.embedding_scale = Some((cfg.hidden_size as f32).sqrt());
    a.query_pre_attn_scalar = Some(query_pre_attn_scalar);
    for l in &mut a.layers {
        l.rope_theta = cfg.rope_theta;
        if l.sliding_window.is_some() {
            l.rope_theta = local_theta;
            l.rope_scaled = false;
        }
    }
}

/// Whether layer `i` is local under a `pattern` (every `pattern`-th layer is global).
pub fn is_local(i: usize, pattern: usize) -> bool {
    pattern == 0 || !(i + 1).is_multiple_of(pattern)
}

fn rope_theta_of(hf: &HfLlamaConfig, layer_type: &str) -> Option<f32> {
    let p = hf.rope_parameters.as_ref()?.get(layer_type)?;
    p.get("rope_theta")?.as_f64().map(|t| t as f32)
}

/// Gemma 3's reading of `config.json` on top of Llama's.
///
/// # Errors
/// [`ModelError::Config`] for an activation other than `gelu_pytorch_tanh`, attention
/// biases, or RoPE scaling other than none (or `rope_type: default`).
pub(super) fn configure_hf(cfg: &mut ModelConfig, hf: &HfLlamaConfig) -> Result<(), ModelError> {
    let act = hf.hidden_activation.as_deref().or(hf.hidden_act.as_deref()).unwrap_or("gelu_pytorch_tanh");
    if act != "gelu_pytorch_tanh" {
        return Err(ModelError::Config(format!("Gemma3ForCausalLM: hidden_activation {act:?} is not supported")));
    }
    if hf.attention_bias == Some(true) {
        return Err(ModelError::Config("Gemma3ForCausalLM: attention_bias true is not supported".into()));
    }
    if let Some(p) = hf.rope_parameters.as_ref().and_then(|p| p.get("full_attention"))
        && p.get("rope_type").and_then(|t| t.as_str()).is_some_and(|t| t != "default")
    {
        return Err(ModelError::Config(format!(
            "Gemma3ForCausalLM: rope_parameters.full_attention {p} is not supported"
        )));
    }
    if let Some(theta) = rope_theta_of(hf, "full_attention") {
        cfg.rope_theta = theta;
    }
    let local_theta = rope_theta_of(hf, "sliding_attention").or(hf.rope_local_base_freq).unwrap_or(LOCAL_ROPE_THETA);
    let pattern = hf.sliding_window_pattern.unwrap_or(SLIDING_WINDOW_PATTERN);
    set_hf_windows(cfg, hf, |i| is_local(i, pattern));
    let scalar = hf.query_pre_attn_scalar.unwrap_or(cfg.head_dim as f32);
    apply(cfg, 1.0, scalar, local_theta);
    cfg.arch.final_logit_softcapping = hf.final_logit_softcapping;
    Ok(())
}
