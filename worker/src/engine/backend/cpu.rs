//! The CPU reference backend: the Llama forward pass in f32 over a flattened batch with a
//! paged KV cache (vLLM's CPU model runner shape). Per layer: RMSNorm → fused QKV product →
//! RoPE (rotate-half) → K/V written to their slots → paged GQA attention → o_proj →
//! all-reduce hook → residual; RMSNorm → fused gate/up → SiLU·mul → down_proj → all-reduce
//! hook → residual. Logits only for the rows that ask for them (tied lm_head when the model
//! has no separate one). Scratch buffers live in the backend and are reused every step.
//!
//! Tensor parallelism: the backend runs whatever shard [`LlamaWeights::shard`] produced
//! (local heads and MLP columns are read off the weight shapes); an [`AllReduce`] given
//! with [`CpuBackend::with_all_reduce`] sums the row-parallel outputs across ranks.

pub mod attention;
pub mod ops;

use super::{Backend, BackendError, Logits, StepBatch};
use crate::engine::EngineError;
use crate::engine::model::{LlamaWeights, ModelConfig};
use attention::{AttnShape, TokenCtx, paged_attention};
use ops::{GEMV_MAX_ROWS, MatmulScratch, gemv_f16, matmul_t, rms_norm, rope_apply, rope_tables, silu_mul, to_f16_bits};

/// Sums a buffer element-wise across tensor-parallel ranks (NCCL's all-reduce on CUDA;
/// shared memory in tests). Every rank calls it with the same shape in the same order.
pub trait AllReduce: Send {
    /// Replaces `buf` with the element-wise sum of every rank's `buf`.
    ///
    /// # Errors
    /// [`BackendError::Device`] when a peer is gone.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), BackendError>;
}

/// A `[out, in]` weight in f32, plus an optional f16 copy used for decode-sized batches.
struct Weight {
    f32: Vec<f32>,
    f16: Vec<u16>,
    out: usize,
    inp: usize,
}

impl Weight {
    fn new(f32: Vec<f32>, out: usize, inp: usize) -> Self {
        Self { f32, f16: Vec::new(), out, inp }
    }

    /// `y[n, out] = x[n, inp] · Wᵀ`.
    fn mm(&self, x: &[f32], n: usize, y: &mut [f32], scratch: &mut MatmulScratch) {
        if n <= GEMV_MAX_ROWS && !self.f16.is_empty() {
            gemv_f16(x, n, &self.f16, self.out, self.inp, y, scratch);
        } else {
            matmul_t(x, n, &self.f32, self.out, self.inp, y, scratch);
        }
    }
}

struct Layer {
    input_norm: Vec<f32>,
    /// `[q + 2·kv, hidden]`: q_proj, k_proj, v_proj rows stacked.
    qkv: Weight,
    o_proj: Weight,
    post_norm: Vec<f32>,
    /// `[2·inter, hidden]`: gate_proj then up_proj rows.
    gate_up: Weight,
    down: Weight,
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
    mm: MatmulScratch,
}

/// f32 CPU backend for Llama-family models (or one tensor-parallel shard of one).
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
    embed: Weight,
    /// `[vocab, hidden]` untied output projection.
    lm_head: Option<Weight>,
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

fn invalid(msg: impl Into<String>) -> BackendError {
    BackendError::InvalidBatch(msg.into())
}

impl CpuBackend {
    /// Takes ownership of the weights (fusing q/k/v and gate/up) and allocates
    /// `kv_cache_bytes / (block_size · kv_bytes_per_token)` KV blocks.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (field `kv_cache_bytes`) when the budget holds no
    /// block, or `block_size` is 0; [`EngineError::Internal`] when weights and config disagree.
    pub fn new(weights: LlamaWeights, config: &ModelConfig, kv_cache_bytes: u64, block_size: usize) -> Result<Self, EngineError> {
        let hd = config.head_dim;
        let hidden = config.hidden_size;
        let first = weights.layers.first().ok_or_else(|| EngineError::Internal("model has no layers".into()))?;
        let q_dim = first.q_proj.out_features;
        let kv_dim = first.k_proj.out_features;
        let inter = first.gate_proj.out_features;
        if !q_dim.is_multiple_of(hd) || !kv_dim.is_multiple_of(hd) || kv_dim == 0 || !(q_dim / hd).is_multiple_of(kv_dim / hd) {
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
                message: format!("KV budget {kv_cache_bytes} B holds no block of {block_size} tokens ({per_token} B/token)"),
            });
        }
        let vocab = weights.embed_tokens.out_features;
        let lm_head = weights.lm_head.map(|l| Weight::new(l.data, vocab, hidden));
        let layers = weights
            .layers
            .into_iter()
            .map(|l| {
                let mut qkv = l.q_proj.data;
                qkv.extend_from_slice(&l.k_proj.data);
                qkv.extend_from_slice(&l.v_proj.data);
                let mut gate_up = l.gate_proj.data;
                gate_up.extend_from_slice(&l.up_proj.data);
                let qkv_out = l.q_proj.out_features + 2 * l.k_proj.out_features;
                Layer {
                    input_norm: l.input_layernorm,
                    qkv: Weight::new(qkv, qkv_out, hidden),
                    o_proj: Weight::new(l.o_proj.data, hidden, l.o_proj.in_features),
                    post_norm: l.post_attention_layernorm,
                    gate_up: Weight::new(gate_up, 2 * inter, hidden),
                    down: Weight::new(l.down_proj.data, hidden, inter),
                }
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
            embed: Weight::new(weights.embed_tokens.data, vocab, hidden),
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

    /// Keeps an f16 copy of every weight matrix and uses it for batches of up to
    /// [`GEMV_MAX_ROWS`] tokens (decode), halving the bytes read per token on this
    /// memory-bound path; prefill stays f32. Costs half the f32 weight memory again and
    /// rounds weights to f16 (≈1e-3 relative), so greedy outputs may differ from the
    /// f32 reference at near-ties. Off by default.
    pub fn with_f16_decode_weights(mut self) -> Self {
        let mut all: Vec<&mut Weight> = vec![self.lm_head.as_mut().unwrap_or(&mut self.embed)];
        for l in &mut self.layers {
            all.extend([&mut l.qkv, &mut l.o_proj, &mut l.gate_up, &mut l.down]);
        }
        for w in all {
            w.f16 = to_f16_bits(&w.f32);
        }
        self
    }

    /// Installs the all-reduce used after o_proj and down_proj (tensor-parallel shards).
    pub fn with_all_reduce(mut self, all_reduce: Box<dyn AllReduce>) -> Self {
        self.all_reduce = Some(all_reduce);
        self
    }

    fn validate(&self, b: &StepBatch) -> Result<(), BackendError> {
        let n = b.token_ids.len();
        if b.positions.len() != n || b.slot_mapping.len() != n {
            return Err(invalid("token_ids, positions and slot_mapping differ in length"));
        }
        let slots = self.num_blocks * self.block_size;
        if let Some(&id) = b.token_ids.iter().find(|&&id| id as usize >= self.vocab) {
            return Err(invalid(format!("token id {id} >= vocab {}", self.vocab)));
        }
        if b.slot_mapping.iter().any(|&s| s as usize >= slots) {
            return Err(invalid("slot out of range"));
        }
        let mut next = 0;
        for s in &b.seqs {
            if s.query_start != next || s.query_len == 0 || s.query_len > s.context_len {
                return Err(invalid("sequences must tile the batch in order with query_len in 1..=context_len"));
            }
            next += s.query_len;
            if next > n || s.block_table.len() * self.block_size < s.context_len {
                return Err(invalid("block table does not cover context_len"));
            }
            if s.block_table.iter().any(|&blk| blk as usize >= self.num_blocks) {
                return Err(invalid("block id out of range"));
            }
            for i in 0..s.query_len {
                if b.positions[s.query_start + i] as usize != s.context_len - s.query_len + i {
                    return Err(invalid("positions must be context_len - query_len + i"));
                }
            }
        }
        if next != n {
            return Err(invalid("sequences do not cover every token"));
        }
        Ok(())
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
            s.x[t * h..(t + 1) * h].copy_from_slice(&self.embed.f32[id * h..(id + 1) * h]);
        }
        rope_tables(&batch.positions, &self.inv_freq, &mut s.cos, &mut s.sin);
        let mut tokens: Vec<TokenCtx<'_>> = Vec::with_capacity(n);
        for seq in &batch.seqs {
            for i in 0..seq.query_len {
                tokens.push(TokenCtx { pos: seq.context_len - seq.query_len + i, block_table: &seq.block_table });
            }
        }
        let shape = AttnShape { q_heads: self.q_heads, kv_heads: self.kv_heads, head_dim: hd, block_size: self.block_size };
        for (li, layer) in self.layers.iter().enumerate() {
            rms_norm(&s.x, &layer.input_norm, self.eps, &mut s.h);
            layer.qkv.mm(&s.h, n, &mut s.qkv, &mut s.mm);
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
            layer.o_proj.mm(&s.attn, n, &mut s.proj, &mut s.mm);
            Self::reduce(&mut self.all_reduce, &mut s.proj)?;
            for (x, p) in s.x.iter_mut().zip(&s.proj) {
                *x += p;
            }
            rms_norm(&s.x, &layer.post_norm, self.eps, &mut s.h);
            layer.gate_up.mm(&s.h, n, &mut s.gate_up, &mut s.mm);
            silu_mul(&s.gate_up, inter, &mut s.act);
            layer.down.mm(&s.act, n, &mut s.proj, &mut s.mm);
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
        self.lm_head.as_ref().unwrap_or(&self.embed).mm(&s.h[..rows * h], rows, &mut data, &mut s.mm);
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
