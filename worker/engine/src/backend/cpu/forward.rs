//! The CPU forward pass in parts, shared by the whole-model [`super::CpuBackend`] and a
//! pipeline stage ([`super::stage::CpuStage`]): [`CpuModel::begin`] sizes the scratch and
//! the RoPE tables, [`CpuModel::embed`] fills the residual stream `x` (`[tokens, hidden]`)
//! from the embedding (first stage) — or a stage writes it from the previous stage's
//! activations ([`CpuModel::hidden_mut`]) — [`CpuModel::run_layers`] runs the model's
//! (stage's) decoder layers on `x` in place, [`CpuModel::logits`] applies the final norm
//! and the output projection to the rows that want logits (last stage).
//!
//! A model holds only what its part needs: the embedding when it embeds tokens (or when it
//! is the last stage of a model with tied embeddings, as the output projection), the final
//! norm and output projection when it computes logits.

use super::AllReduce;
use super::attention::{AttnShape, TokenCtx, paged_attention};
use super::ops::{
    gelu_tanh_mul, gelu_tanh_mul_f16_table, rms_norm, rms_norm_f64_sum, rms_norm_f64_sum_in_place, rms_norm_in_place,
    rope_apply, rope_tables, silu_mul,
};
use super::qmatmul::{PackedWeight, matmul};
use crate::backend::{BackendError, Logits, StepBatch};
use crate::model::gguf::dequant::GgmlType;
use crate::model::{Activation, LayerWeights, Linear, ModelConfig};
use crate::request::EngineError;

/// How the CPU forward pass rounds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Numerics {
    /// f32 throughout: products of the exact f32 weight values (quantized weights give
    /// the same bits as their f32 dequantization), f32 K/V cache.
    F32,
    /// ggml's CPU arithmetic (llama.cpp's defaults), so greedy text follows llama.cpp's
    /// on the same file: Q4_0/Q5_0/Q8_0/K-quant weights multiply 8-bit-quantized
    /// activations ([`super::qmatmul::q8`]); K, V and Q are rounded to f16 (its f16 KV
    /// cache) and so are the softmax weights before they multiply V; GELU from ggml's f16
    /// table; RMSNorm sums squares in f64.
    Ggml,
}

impl Numerics {
    /// `PRISM_CPU_NUMERICS` (`f32` or `ggml`) when set, else [`Numerics::Ggml`] for a
    /// model with K-quant matrices (files made with llama.cpp's K-quant mixes, whose
    /// reference is llama.cpp) and [`Numerics::F32`] otherwise.
    pub fn for_layers(layers: &[LayerWeights]) -> Result<Self, EngineError> {
        match std::env::var("PRISM_CPU_NUMERICS").as_deref() {
            Ok("f32") => return Ok(Self::F32),
            Ok("ggml") => return Ok(Self::Ggml),
            Ok(other) => {
                return Err(EngineError::InvalidRequest {
                    field: "PRISM_CPU_NUMERICS",
                    message: format!("PRISM_CPU_NUMERICS {other:?} is not one of f32, ggml"),
                });
            }
            Err(_) => {}
        }
        let kquant = |l: &Linear| {
            l.quant.as_ref().is_some_and(|q| matches!(q.ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K))
        };
        let any = layers.iter().any(|l| {
            [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj].into_iter().any(kquant)
        });
        Ok(if any { Self::Ggml } else { Self::F32 })
    }
}

struct Layer {
    input_norm: Vec<f32>,
    /// `[q + 2·kv, hidden]`: q_proj, k_proj, v_proj rows stacked.
    qkv: PackedWeight,
    o_proj: PackedWeight,
    post_norm: Vec<f32>,
    /// `[2·inter, hidden]`: gate_proj then up_proj rows.
    gate_up: PackedWeight,
    down: PackedWeight,
    /// `[q + 2·kv]`: q, k, v biases, when the architecture has them.
    qkv_bias: Option<Vec<f32>>,
    /// Per-head q and k RMSNorm gains.
    qk_norm: Option<[Vec<f32>; 2]>,
    /// RMSNorm gains of the attention and MLP outputs (Gemma 3).
    sandwich_norms: Option<[Vec<f32>; 2]>,
    /// Attention window (`None`: full causal).
    window: Option<usize>,
    /// Index of this layer's RoPE frequencies in [`CpuModel::inv_freqs`].
    rope: usize,
}

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    h: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate_up: Vec<f32>,
    act: Vec<f32>,
    /// Per RoPE variant: `[tokens, half]` cos and sin.
    rope: Vec<(Vec<f32>, Vec<f32>)>,
    last: Vec<f32>,
}

/// The weights a [`CpuModel`] is built from: a whole model, or one stage's part of one
/// (tensor-parallel shards are read off the weight shapes).
pub struct ModelParts {
    /// `[vocab, hidden]` token embedding: present on the first stage, and on the last
    /// stage of a tied model (there only as the output projection).
    pub embed: Option<Linear>,
    /// Decoder layers, in order.
    pub layers: Vec<LayerWeights>,
    /// Final norm and, when untied, `lm_head` (`None` for a stage that is not the last).
    pub head: Option<(Vec<f32>, Option<Linear>)>,
    /// Whether `embed` embeds the tokens (false: only the tied output projection).
    pub embeds_tokens: bool,
    /// Index in the whole model of `layers[0]` (a pipeline stage's first layer): where the
    /// per-layer attention of [`crate::model::ArchConfig::layers`] is read.
    pub first_layer: usize,
}

/// RMSNorm of every `[gain.len()]` row of `x`, in place.
fn rms_norm_in_place_rows(x: &mut [f32], gain: &[f32], eps: f32, numerics: Numerics) {
    for row in x.chunks_exact_mut(gain.len()) {
        norm_in_place(numerics, row, gain, eps);
    }
}

/// RMSNorm of one row in place, rounded as `numerics` says.
fn norm_in_place(numerics: Numerics, x: &mut [f32], gain: &[f32], eps: f32) {
    match numerics {
        Numerics::F32 => rms_norm_in_place(x, gain, eps),
        Numerics::Ggml => rms_norm_f64_sum_in_place(x, gain, eps),
    }
}

/// RMSNorm of every row of `x` into `y`, rounded as `numerics` says.
fn norm(numerics: Numerics, x: &[f32], gain: &[f32], eps: f32, y: &mut [f32]) {
    match numerics {
        Numerics::F32 => rms_norm(x, gain, eps, y),
        Numerics::Ggml => rms_norm_f64_sum(x, gain, eps, y),
    }
}

/// Rounds every value to the nearest f16 (ggml's f16 K/V cache and f16 query).
fn round_f16(v: &mut [f32]) {
    for x in v {
        *x = half::f16::from_f32(*x).to_f32();
    }
}

/// Weights, KV cache and scratch of a CPU model (or stage); see the module docs.
pub struct CpuModel {
    hidden: usize,
    /// Local (this shard's) query / KV heads and MLP width.
    q_heads: usize,
    kv_heads: usize,
    inter: usize,
    head_dim: usize,
    eps: f32,
    vocab: usize,
    /// Distinct RoPE inverse-frequency tables of this model's layers (one for Llama).
    inv_freqs: Vec<Vec<f32>>,
    activation: Activation,
    embedding_scale: Option<f32>,
    attention_scale: f32,
    final_logit_softcapping: Option<f32>,
    numerics: Numerics,
    embed: Option<PackedWeight>,
    embeds_tokens: bool,
    /// Final norm, and the untied output projection (`None`: `embed`).
    head: Option<(Vec<f32>, Option<PackedWeight>)>,
    layers: Vec<Layer>,
    block_size: usize,
    num_blocks: usize,
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    s: Scratch,
}

impl CpuModel {
    /// Fuses q/k/v and gate/up (quantized matrices stay quantized) and allocates
    /// `kv_cache_bytes / (block_size · kv_bytes_per_token)` KV blocks.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (field `kv_cache_bytes`) when the budget holds no
    /// block, or `block_size` is 0; [`EngineError::Internal`] when weights and config disagree.
    pub fn new(
        parts: ModelParts,
        config: &ModelConfig,
        kv_cache_bytes: u64,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        let hd = config.head_dim;
        let first = parts.layers.first().ok_or_else(|| EngineError::Internal("model has no layers".into()))?;
        let q_dim = first.q_proj.out_features;
        let kv_dim = first.k_proj.out_features;
        let inter = first.gate_proj.out_features;
        if !q_dim.is_multiple_of(hd)
            || !kv_dim.is_multiple_of(hd)
            || kv_dim == 0
            || !(q_dim / hd).is_multiple_of(kv_dim / hd)
        {
            return Err(EngineError::Internal("weight shapes do not match head_dim".into()));
        }
        if block_size == 0 {
            return Err(EngineError::InvalidRequest { field: "block_size", message: "block_size must be >= 1".into() });
        }
        if parts.head.as_ref().is_some_and(|(_, lm)| lm.is_none()) && parts.embed.is_none() {
            return Err(EngineError::Internal("a tied output projection needs the embedding".into()));
        }
        let layers_n = parts.layers.len();
        let per_token = layers_n * 2 * kv_dim * 4;
        let num_blocks = usize::try_from(kv_cache_bytes / (per_token * block_size) as u64).unwrap_or(usize::MAX);
        if num_blocks == 0 {
            return Err(EngineError::InvalidRequest {
                field: "kv_cache_bytes",
                message: format!(
                    "KV budget {kv_cache_bytes} B holds no block of {block_size} tokens ({per_token} B/token)"
                ),
            });
        }
        let numerics = Numerics::for_layers(&parts.layers)?;
        let stack = |v: Vec<Linear>| match numerics {
            Numerics::F32 => PackedWeight::stack(v),
            Numerics::Ggml => PackedWeight::stack_q8(v),
        };
        let mut inv_freqs: Vec<Vec<f32>> = Vec::new();
        let mut layers = Vec::with_capacity(layers_n);
        for (i, l) in parts.layers.into_iter().enumerate() {
            let index = parts.first_layer + i;
            let attn = config
                .arch
                .layers
                .get(index)
                .ok_or_else(|| EngineError::Internal(format!("layer {index} is not in the config")))?;
            let inv = config.layer_rope_inv_freq(index);
            let rope = match inv_freqs.iter().position(|f| *f == inv) {
                Some(r) => r,
                None => {
                    inv_freqs.push(inv);
                    inv_freqs.len() - 1
                }
            };
            let (qb, kb, vb) = (l.q_proj.out_features, l.k_proj.out_features, l.v_proj.out_features);
            let qkv_bias = match l.qkv_bias {
                Some([bq, bk, bv]) if bq.len() == qb && bk.len() == kb && bv.len() == vb => Some([bq, bk, bv].concat()),
                Some(_) => return Err(EngineError::Internal("q/k/v bias lengths do not match the weights".into())),
                None => None,
            };
            layers.push(Layer {
                input_norm: l.input_layernorm,
                qkv: stack(vec![l.q_proj, l.k_proj, l.v_proj]),
                o_proj: stack(vec![l.o_proj]),
                post_norm: l.post_attention_layernorm,
                gate_up: stack(vec![l.gate_proj, l.up_proj]),
                down: stack(vec![l.down_proj]),
                qkv_bias,
                qk_norm: l.qk_norm,
                sandwich_norms: l.sandwich_norms,
                window: attn.sliding_window,
                rope,
            });
        }
        let cache_len = num_blocks * block_size * kv_dim;
        Ok(Self {
            hidden: config.hidden_size,
            q_heads: q_dim / hd,
            kv_heads: kv_dim / hd,
            inter,
            head_dim: hd,
            eps: config.rms_norm_eps,
            vocab: config.vocab_size,
            inv_freqs,
            activation: config.arch.hidden_activation,
            embedding_scale: config.arch.embedding_scale,
            attention_scale: config.attention_scale(),
            final_logit_softcapping: config.arch.final_logit_softcapping,
            numerics,
            embed: parts.embed.map(|e| stack(vec![e])),
            embeds_tokens: parts.embeds_tokens,
            head: parts.head.map(|(norm, lm)| (norm, lm.map(|l| stack(vec![l])))),
            layers,
            block_size,
            num_blocks,
            k_cache: (0..layers_n).map(|_| vec![0.0; cache_len]).collect(),
            v_cache: (0..layers_n).map(|_| vec![0.0; cache_len]).collect(),
            s: Scratch::default(),
        })
    }

    /// Bytes held by the weight matrices (f32 or blocks; norms excluded).
    pub fn weight_bytes(&self) -> usize {
        let layers: usize = self
            .layers
            .iter()
            .map(|l| l.qkv.size_bytes() + l.o_proj.size_bytes() + l.gate_up.size_bytes() + l.down.size_bytes())
            .sum();
        let lm = self.head.as_ref().and_then(|(_, lm)| lm.as_ref()).map_or(0, PackedWeight::size_bytes);
        layers + self.embed.as_ref().map_or(0, PackedWeight::size_bytes) + lm
    }

    /// Checks a batch against the cache geometry.
    ///
    /// # Errors
    /// [`BackendError::InvalidBatch`] naming the first violation.
    pub fn validate(&self, b: &StepBatch) -> Result<(), BackendError> {
        b.validate(self.vocab, self.num_blocks, self.block_size).map(|_| ())
    }

    /// Model width.
    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// Vocabulary size (logit row length).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// KV blocks allocated.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// The window every layer of this model has, if every one has one.
    pub fn uniform_sliding_window(&self) -> Option<usize> {
        self.layers.iter().map(|l| l.window).try_fold(0, |m, w| w.map(|w| m.max(w)))
    }

    /// KV bytes per token over this model's layers and KV heads (K and V).
    pub fn kv_bytes_per_token(&self) -> usize {
        self.layers.len() * 2 * self.kv_heads * self.head_dim * std::mem::size_of::<f32>()
    }

    /// Sizes the scratch for `batch` (already validated) and builds its RoPE tables.
    pub fn begin(&mut self, batch: &StepBatch) {
        let n = batch.token_ids.len();
        let (h, inter) = (self.hidden, self.inter);
        let q_dim = self.q_heads * self.head_dim;
        let qkv_dim = q_dim + 2 * self.kv_heads * self.head_dim;
        let s = &mut self.s;
        s.x.resize(n * h, 0.0);
        s.h.resize(n * h, 0.0);
        s.qkv.resize(n * qkv_dim, 0.0);
        s.attn.resize(n * q_dim, 0.0);
        s.proj.resize(n * h, 0.0);
        s.gate_up.resize(n * 2 * inter, 0.0);
        s.act.resize(n * inter, 0.0);
        s.rope.resize_with(self.inv_freqs.len(), Default::default);
        for (inv, (cos, sin)) in self.inv_freqs.iter().zip(&mut s.rope) {
            rope_tables(&batch.positions, inv, cos, sin);
        }
    }

    /// The residual stream `[tokens, hidden]` after [`CpuModel::begin`]: a stage's input
    /// (written from the previous stage) and output (sent to the next).
    pub fn hidden_mut(&mut self) -> &mut [f32] {
        &mut self.s.x
    }

    /// Fills the residual stream with the tokens' embeddings.
    ///
    /// # Errors
    /// [`BackendError::Device`] when this model does not embed tokens (not a first stage).
    pub fn embed(&mut self, batch: &StepBatch) -> Result<(), BackendError> {
        let h = self.hidden;
        let embed = match &self.embed {
            Some(e) if self.embeds_tokens => e,
            _ => return Err(BackendError::Device("this stage does not hold the token embedding".into())),
        };
        for (t, &id) in batch.token_ids.iter().enumerate() {
            embed.row_f32(id as usize, &mut self.s.x[t * h..(t + 1) * h]);
        }
        if let Some(scale) = self.embedding_scale {
            for v in &mut self.s.x {
                *v *= scale;
            }
        }
        Ok(())
    }

    /// Runs the decoder layers on the residual stream, writing each token's K/V to its
    /// slot. `reduce` is called after o_proj and after down_proj of every layer (the
    /// tensor-parallel all-reduce, and the place a replica's stop request is checked).
    ///
    /// # Errors
    /// What `reduce` returns.
    pub fn run_layers(&mut self, batch: &StepBatch, reduce: &mut dyn AllReduce) -> Result<(), BackendError> {
        let n = batch.token_ids.len();
        let (hd, inter) = (self.head_dim, self.inter);
        let q_dim = self.q_heads * hd;
        let kv_dim = self.kv_heads * hd;
        let qkv_dim = q_dim + 2 * kv_dim;
        let half = hd / 2;
        let nm = self.numerics;
        let ggml = nm == Numerics::Ggml;
        let s = &mut self.s;
        let mut tokens: Vec<TokenCtx<'_>> = Vec::with_capacity(n);
        for seq in &batch.seqs {
            for i in 0..seq.query_len {
                tokens.push(TokenCtx { pos: seq.context_len - seq.query_len + i, block_table: &seq.block_table });
            }
        }
        for (li, layer) in self.layers.iter().enumerate() {
            let shape = AttnShape {
                q_heads: self.q_heads,
                kv_heads: self.kv_heads,
                head_dim: hd,
                block_size: self.block_size,
                scale: self.attention_scale,
                window: layer.window,
                probs_f16: ggml,
            };
            norm(nm, &s.x, &layer.input_norm, self.eps, &mut s.h);
            matmul(&s.h, n, &layer.qkv, &mut s.qkv);
            if let Some(bias) = &layer.qkv_bias {
                for row in s.qkv.chunks_exact_mut(qkv_dim) {
                    for (v, b) in row.iter_mut().zip(bias) {
                        *v += b;
                    }
                }
            }
            let (kc, vc) = (&mut self.k_cache[li], &mut self.v_cache[li]);
            let (cos_all, sin_all) = &s.rope[layer.rope];
            for t in 0..n {
                let row = &mut s.qkv[t * qkv_dim..(t + 1) * qkv_dim];
                if let Some([qn, kn]) = &layer.qk_norm {
                    for head in row[..q_dim].chunks_exact_mut(hd) {
                        norm_in_place(nm, head, qn, self.eps);
                    }
                    for head in row[q_dim..q_dim + kv_dim].chunks_exact_mut(hd) {
                        norm_in_place(nm, head, kn, self.eps);
                    }
                }
                let (cos, sin) = (&cos_all[t * half..(t + 1) * half], &sin_all[t * half..(t + 1) * half]);
                rope_apply(&mut row[..q_dim + kv_dim], cos, sin);
                if ggml {
                    round_f16(row);
                }
                let slot = batch.slot_mapping[t] as usize;
                kc[slot * kv_dim..(slot + 1) * kv_dim].copy_from_slice(&row[q_dim..q_dim + kv_dim]);
                vc[slot * kv_dim..(slot + 1) * kv_dim].copy_from_slice(&row[q_dim + kv_dim..]);
            }
            paged_attention(shape, &s.qkv, qkv_dim, &tokens, kc, vc, &mut s.attn);
            matmul(&s.attn, n, &layer.o_proj, &mut s.proj);
            reduce.all_reduce_sum(&mut s.proj)?;
            if let Some([attn_out, _]) = &layer.sandwich_norms {
                rms_norm_in_place_rows(&mut s.proj, attn_out, self.eps, nm);
            }
            for (x, p) in s.x.iter_mut().zip(&s.proj) {
                *x += p;
            }
            norm(nm, &s.x, &layer.post_norm, self.eps, &mut s.h);
            matmul(&s.h, n, &layer.gate_up, &mut s.gate_up);
            match (self.activation, nm) {
                (Activation::Silu, _) => silu_mul(&s.gate_up, inter, &mut s.act),
                (Activation::GeluTanh, Numerics::F32) => gelu_tanh_mul(&s.gate_up, inter, &mut s.act),
                (Activation::GeluTanh, Numerics::Ggml) => gelu_tanh_mul_f16_table(&s.gate_up, inter, &mut s.act),
            }
            matmul(&s.act, n, &layer.down, &mut s.proj);
            reduce.all_reduce_sum(&mut s.proj)?;
            if let Some([_, ffn_out]) = &layer.sandwich_norms {
                rms_norm_in_place_rows(&mut s.proj, ffn_out, self.eps, nm);
            }
            for (x, p) in s.x.iter_mut().zip(&s.proj) {
                *x += p;
            }
        }
        Ok(())
    }

    /// Final norm and output projection of the last token of every sequence that wants
    /// logits, in batch order.
    ///
    /// # Errors
    /// [`BackendError::Device`] when this model holds no output head (not a last stage).
    pub fn logits(&mut self, batch: &StepBatch) -> Result<Logits, BackendError> {
        let h = self.hidden;
        let Some((gain, lm_head)) = &self.head else {
            return Err(BackendError::Device("this stage does not hold the output head".into()));
        };
        let Some(out_proj) = lm_head.as_ref().or(self.embed.as_ref()) else {
            return Err(BackendError::Device("this stage does not hold the output projection".into()));
        };
        let s = &mut self.s;
        let want: Vec<usize> =
            batch.seqs.iter().filter(|q| q.want_logits).map(|q| q.query_start + q.query_len - 1).collect();
        let rows = want.len();
        s.last.resize(rows * h, 0.0);
        s.h.resize(rows * h, 0.0);
        for (r, &t) in want.iter().enumerate() {
            s.last[r * h..(r + 1) * h].copy_from_slice(&s.x[t * h..(t + 1) * h]);
        }
        norm(self.numerics, &s.last, gain, self.eps, &mut s.h[..rows * h]);
        let mut data = vec![0f32; rows * self.vocab];
        matmul(&s.h[..rows * h], rows, out_proj, &mut data);
        if let Some(cap) = self.final_logit_softcapping {
            for v in &mut data {
                *v = (*v / cap).tanh() * cap;
            }
        }
        Ok(Logits { rows, vocab_size: self.vocab, data })
    }
}
