//! Paged causal attention on the CPU (PagedAttention, Kwon et al., SOSP 2023): each query
//! token attends over its sequence's cached K/V, found through the block table, up to and
//! including its own position; grouped-query attention maps query head `h` to KV head
//! `h / (q_heads / kv_heads)`. Softmax in f32 with the running max subtracted.

use rayon::prelude::*;

use super::ops::{axpy, dot};

/// Shapes of one attention call (the local shard's heads).
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query heads.
    pub q_heads: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Head width.
    pub head_dim: usize,
    /// Tokens per KV block.
    pub block_size: usize,
}

/// Per-token attention work item: the token's position and its sequence's block table.
pub struct TokenCtx<'a> {
    /// Absolute position: attends over `0..=pos`.
    pub pos: usize,
    /// The sequence's physical blocks.
    pub block_table: &'a [u32],
}

/// `out[t, h*d..(h+1)*d] = softmax(q_t,h · K[0..=pos]ᵀ · scale) · V[0..=pos]`.
///
/// `q` rows have stride `q_stride` (the fused QKV buffer); the first `q_heads * head_dim`
/// values of each row are the (RoPE-applied) query. K/V caches are
/// `[num_blocks, block_size, kv_heads, head_dim]`. Callers have checked that every block
/// table covers `pos` and holds valid block ids.
pub fn paged_attention(
    shape: AttnShape,
    q: &[f32],
    q_stride: usize,
    tokens: &[TokenCtx<'_>],
    k_cache: &[f32],
    v_cache: &[f32],
    out: &mut [f32],
) {
    let AttnShape { q_heads, kv_heads, head_dim: d, block_size } = shape;
    let group = q_heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let kv_dim = kv_heads * d;
    out.par_chunks_mut(d).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (idx, o)| {
        let (t, h) = (idx / q_heads, idx % q_heads);
        let g = h / group;
        let tok = &tokens[t];
        let qv = &q[t * q_stride + h * d..t * q_stride + (h + 1) * d];
        let n = tok.pos + 1;
        scores.clear();
        scores.reserve(n);
        let mut max = f32::NEG_INFINITY;
        for p in 0..n {
            let slot = tok.block_table[p / block_size] as usize * block_size + p % block_size;
            let k = &k_cache[slot * kv_dim + g * d..slot * kv_dim + (g + 1) * d];
            let s = dot(qv, k) * scale;
            max = max.max(s);
            scores.push(s);
        }
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let inv = 1.0 / sum;
        o.fill(0.0);
        for (p, &s) in scores.iter().enumerate() {
            let slot = tok.block_table[p / block_size] as usize * block_size + p % block_size;
            let v = &v_cache[slot * kv_dim + g * d..slot * kv_dim + (g + 1) * d];
            axpy(o, s * inv, v);
        }
    });
}
