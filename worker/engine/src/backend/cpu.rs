//! The CPU reference backend: the Llama forward pass in f32 over a flattened batch with a
//! paged KV cache (vLLM's CPU model runner shape). Per layer: RMSNorm → fused QKV product →
//! RoPE (rotate-half) → K/V written to their slots → paged GQA attention → o_proj →
//! all-reduce hook → residual; RMSNorm → fused gate/up → SiLU·mul → down_proj → all-reduce
//! hook → residual. Logits only for the rows that ask for them (tied lm_head when the model
//! has no separate one). Scratch buffers live in the backend and are reused every step.
//!
//! Weights stay as loaded: f32, or GGUF Q4_0/Q4_1/Q8_0 blocks (a model loaded with
//! `keep_quantized`) that [`qmatmul`] dequantizes in registers — about a fifth of the bytes
//! per decoded token and of the resident memory, with outputs bit-identical to the f32
//! dequantization. Every matrix product and the attention compute each output row the same
//! way whatever the batch holds, so batching and chunking never change a sequence's tokens.
//!
//! Tensor parallelism: the backend runs whatever shard [`LlamaWeights::shard`] produced
//! (local heads and MLP columns are read off the weight shapes); an [`AllReduce`] given
//! with [`CpuBackend::with_all_reduce`] sums the row-parallel outputs across ranks.

pub mod attention;
pub mod ops;
pub mod qmatmul;

use super::{Backend, BackendError, Logits, StepBatch};
use crate::model::{LlamaWeights, ModelConfig};
use crate::request::EngineError;
use attention::{AttnShape, TokenCtx, paged_attention};
use ops::{rms_norm, rope_apply, rope_tables, silu_mul};
use qmatmul::{PackedWeight, matmul};

/// Sums a buffer element-wise across tensor-parallel ranks (NCCL's all-reduce on CUDA;
/// shared memory in tests). Every rank calls it with the same shape in the same order.
pub trait AllReduce: Send {
    /// Replaces `buf` with the element-wise sum of every rank's `buf`.
    ///
    /// # Errors
    /// [`BackendError::Device`] when a peer is gone.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), BackendError>;
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
    cos: Vec<f32>,
    sin: Vec<f32>,
    last: Vec<f32>,
}

/// CPU backend for Llama-family models (or one tensor-parallel shard of one): f32
/// arithmetic over f32 or block-quantized weights.
pub struct CpuBackend {
    hidden: usize,
    /// Local (this shard's) query / KV heads and MLP width.
    q_heads: usize,
    kv_heads: usize,
    inter: usize,
    head_dim: usize,
    eps: f32,
    vocab: usize,
    inv_freq: Vec<f32>,
    /// `[vocab, hidden]` token embedding (also the output projection when tied).
    embed: PackedWeight,
    /// `[vocab, hidden]` untied output projection.
    lm_head: Option<PackedWeight>,
    norm: Vec<f32>,
    layers: Vec<Layer>,
    block_size: usize,
    num_blocks: usize,
    k_cache: Vec<Vec<f32>>,
    v_cache: Vec<Vec<f32>>,
    all_reduce: Option<Box<dyn AllReduce>>,
    s: Scratch,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("layers", &self.layers.len())
            .field("q_heads", &self.q_heads)
            .field("kv_heads", &self.kv_heads)
            .field("num_blocks", &self.num_blocks)
            .field("block_size", &self.block_size)
            .finish_non_exhaustive()
    }
}

impl CpuBackend {
    /// Takes ownership of the weights (fusing q/k/v and gate/up; quantized matrices stay
    /// quantized) and allocates
    /// `kv_cache_bytes / (block_size · kv_bytes_per_token)` KV blocks.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (field `kv_cache_bytes`) when the budget holds no
    /// block, or `block_size` is 0; [`EngineError::Internal`] when weights and config disagree.
    pub fn new(
        weights: LlamaWeights,
        config: &ModelConfig,
        kv_cache_bytes: u64,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        let hd = config.head_dim;
        let hidden = config.hidden_size;
        let first = weights.layers.first().ok_or_else(|| EngineError::Internal("model has no layers".into()))?;
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
        let layers_n = weights.layers.len();
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
        let vocab = weights.embed_tokens.out_features;
        let lm_head = weights.lm_head.map(|l| PackedWeight::stack(vec![l]));
        let layers = weights
            .layers
            .into_iter()
            .map(|l| Layer {
                input_norm: l.input_layernorm,
                qkv: PackedWeight::stack(vec![l.q_proj, l.k_proj, l.v_proj]),
                o_proj: PackedWeight::stack(vec![l.o_proj]),
                post_norm: l.post_attention_layernorm,
                gate_up: PackedWeight::stack(vec![l.gate_proj, l.up_proj]),
                down: PackedWeight::stack(vec![l.down_proj]),
            })
            .collect();
        let cache_len = num_blocks * block_size * kv_dim;
        Ok(Self {
            hidden,
            q_heads: q_dim / hd,
            kv_heads: kv_dim / hd,
            inter,
            head_dim: hd,
            eps: config.rms_norm_eps,
            vocab,
            inv_freq: config.rope_inv_freq(),
            embed: PackedWeight::stack(vec![weights.embed_tokens]),
            lm_head,
            norm: weights.norm,
            layers,
            block_size,
            num_blocks,
            k_cache: (0..layers_n).map(|_| vec![0.0; cache_len]).collect(),
            v_cache: (0..layers_n).map(|_| vec![0.0; cache_len]).collect(),
            all_reduce: None,
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
        layers + self.embed.size_bytes() + self.lm_head.as_ref().map_or(0, PackedWeight::size_bytes)
    }

    /// Installs the all-reduce used after o_proj and down_proj (tensor-parallel shards).
    pub fn with_all_reduce(mut self, all_reduce: Box<dyn AllReduce>) -> Self {
        self.all_reduce = Some(all_reduce);
        self
    }

    fn validate(&self, b: &StepBatch) -> Result<(), BackendError> {
        b.validate(self.vocab, self.num_blocks, self.block_size).map(|_| ())
    }

    fn reduce(all_reduce: &mut Option<Box<dyn AllReduce>>, buf: &mut [f32]) -> Result<(), BackendError> {
        match all_reduce {
            Some(ar) => ar.all_reduce_sum(buf),
            None => Ok(()),
        }
    }
}

impl Backend for CpuBackend {
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits, BackendError> {
        self.validate(batch)?;
        let n = batch.token_ids.len();
        let (h, hd, inter) = (self.hidden, self.head_dim, self.inter);
        let q_dim = self.q_heads * hd;
        let kv_dim = self.kv_heads * hd;
        let qkv_dim = q_dim + 2 * kv_dim;
        let half = hd / 2;
        let s = &mut self.s;
        s.x.resize(n * h, 0.0);
        s.h.resize(n * h, 0.0);
        s.qkv.resize(n * qkv_dim, 0.0);
        s.attn.resize(n * q_dim, 0.0);
        s.proj.resize(n * h, 0.0);
        s.gate_up.resize(n * 2 * inter, 0.0);
        s.act.resize(n * inter, 0.0);
        for (t, &id) in batch.token_ids.iter().enumerate() {
            let id = id as usize;
            self.embed.row_f32(id, &mut s.x[t * h..(t + 1) * h]);
        }
        rope_tables(&batch.positions, &self.inv_freq, &mut s.cos, &mut s.sin);
        let mut tokens: Vec<TokenCtx<'_>> = Vec::with_capacity(n);
        for seq in &batch.seqs {
            for i in 0..seq.query_len {
                tokens.push(TokenCtx { pos: seq.context_len - seq.query_len + i, block_table: &seq.block_table });
            }
        }
        let shape =
            AttnShape { q_heads: self.q_heads, kv_heads: self.kv_heads, head_dim: hd, block_size: self.block_size };
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&s.x, &layer.input_norm, self.eps, &mut s.h);
            matmul(&s.h, n, &layer.qkv, &mut s.qkv);
            let (kc, vc) = (&mut self.k_cache[li], &mut self.v_cache[li]);
            for t in 0..n {
                let row = &mut s.qkv[t * qkv_dim..(t + 1) * qkv_dim];
                let (cos, sin) = (&s.cos[t * half..(t + 1) * half], &s.sin[t * half..(t + 1) * half]);
                rope_apply(&mut row[..q_dim + kv_dim], cos, sin);
                let slot = batch.slot_mapping[t] as usize;
                kc[slot * kv_dim..(slot + 1) * kv_dim].copy_from_slice(&row[q_dim..q_dim + kv_dim]);
                vc[slot * kv_dim..(slot + 1) * kv_dim].copy_from_slice(&row[q_dim + kv_dim..]);
            }
            paged_attention(shape, &s.qkv, qkv_dim, &tokens, kc, vc, &mut s.attn);
            matmul(&s.attn, n, &layer.o_proj, &mut s.proj);
            Self::reduce(&mut self.all_reduce, &mut s.proj)?;
            for (x, p) in s.x.iter_mut().zip(&s.proj) {
                *x += p;
            }
            rms_norm(&s.x, &layer.post_norm, self.eps, &mut s.h);
            matmul(&s.h, n, &layer.gate_up, &mut s.gate_up);
            silu_mul(&s.gate_up, inter, &mut s.act);
            matmul(&s.act, n, &layer.down, &mut s.proj);
            Self::reduce(&mut self.all_reduce, &mut s.proj)?;
            for (x, p) in s.x.iter_mut().zip(&s.proj) {
                *x += p;
            }
        }
        let want: Vec<usize> =
            batch.seqs.iter().filter(|q| q.want_logits).map(|q| q.query_start + q.query_len - 1).collect();
        let rows = want.len();
        s.last.resize(rows * h, 0.0);
        s.h.resize(rows * h, 0.0);
        for (r, &t) in want.iter().enumerate() {
            s.last[r * h..(r + 1) * h].copy_from_slice(&s.x[t * h..(t + 1) * h]);
        }
        rms_norm(&s.last, &self.norm, self.eps, &mut s.h[..rows * h]);
        let mut data = vec![0f32; rows * self.vocab];
        matmul(&s.h[..rows * h], rows, self.lm_head.as_ref().unwrap_or(&self.embed), &mut data);
        Ok(Logits { rows, vocab_size: self.vocab, data })
    }

    fn num_kv_blocks(&self) -> usize {
        self.num_blocks
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.layers.len() * 2 * self.kv_heads * self.head_dim * std::mem::size_of::<f32>()
    }

    fn name(&self) -> &'static str {
        "cpu"
    }
}
