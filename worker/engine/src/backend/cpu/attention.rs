//! Paged causal attention on the CPU (PagedAttention, Kwon et al., SOSP 2023): each query
//! token attends over its sequence's cached K/V, found through the block table, up to and
//! including its own position; grouped-query attention maps query head `h` to KV head
//! `h / (q_heads / kv_heads)`. Softmax in f32 with the running max subtracted.
//!
//! One rayon task per (token, query head); it walks the block table block by block (no
//! per-position division), with an AVX2+FMA kernel (`head_dim` a multiple of 8) that keeps
//! the output accumulators in registers; a scalar version otherwise. A token's result
//! depends only on its own query and its sequence's cache, never on the rest of the batch.

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
    /// Softmax scale (`head_dim^-0.5` for most models).
    pub scale: f32,
    /// Sliding window: a token at `pos` attends to `pos - window + 1 ..= pos` only.
    pub window: Option<usize>,
    /// Normalize the softmax weights and round them to f16 before they multiply V (ggml's
    /// CPU attention with an f16 V cache converts them so); `false`: f32 weights, the sum
    /// divided out at the end.
    pub probs_f16: bool,
}

/// Per-token attention work item: the token's position and its sequence's block table.
pub struct TokenCtx<'a> {
    /// Absolute position: attends over `0..=pos`.
    pub pos: usize,
    /// The sequence's physical blocks.
    pub block_table: &'a [u32],
}

/// `out[t, h*d..(h+1)*d] = softmax(q_t,h · K[s..=pos]ᵀ · scale) · V[s..=pos]`, with `s = 0`,
/// or `pos + 1 - window` under a sliding window (blocks wholly before `s` are never read, so
/// their table entries may name blocks that were given back).
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
    let AttnShape { q_heads, kv_heads, head_dim: d, block_size, scale, window, probs_f16 } = shape;
    let group = q_heads / kv_heads;
    let kv_dim = kv_heads * d;
    let avx2 = has_avx2() && d.is_multiple_of(8);
    out.par_chunks_mut(d).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (idx, o)| {
        let (t, h) = (idx / q_heads, idx % q_heads);
        let g = h / group;
        let tok = &tokens[t];
        let qv = &q[t * q_stride + h * d..t * q_stride + (h + 1) * d];
        let n = tok.pos + 1;
        let start = window.map_or(0, |w| n.saturating_sub(w));
        scores.clear();
        scores.resize(n - start, 0.0);
        let head =
            Head { q: qv, kv_off: g * d, kv_dim, block_size, start, n, block_table: tok.block_table, scale, probs_f16 };
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: AVX2 and FMA are present; the caller checked that every block id
            // in the table is inside the caches and that the table covers `pos`.
            unsafe { avx2::head(&head, k_cache, v_cache, scores, o) };
            return;
        }
        let _ = avx2;
        head_scalar(&head, k_cache, v_cache, scores, o);
    });
}

/// One (token, query head) attention problem.
struct Head<'a> {
    q: &'a [f32],
    /// Offset of the KV head inside a cache slot.
    kv_off: usize,
    kv_dim: usize,
    block_size: usize,
    /// First position attended.
    start: usize,
    /// One past the last position attended (`pos + 1`).
    n: usize,
    block_table: &'a [u32],
    scale: f32,
    probs_f16: bool,
}

fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Softmax in place; returns `1 / Σ exp` (weights are left unnormalized), or, with
/// `probs_f16`, normalizes them, rounds them to f16 and returns 1.
fn softmax_unnormalized(scores: &mut [f32], probs_f16: bool) -> f32 {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for s in scores.iter_mut() {
        *s = (*s - max).exp();
        sum += *s;
    }
    if !probs_f16 {
        return 1.0 / sum;
    }
    // ggml sums in f64 and scales by the f32 of the f64 reciprocal.
    let inv = (1.0 / scores.iter().map(|&s| f64::from(s)).sum::<f64>()) as f32;
    for s in scores.iter_mut() {
        *s = half::f16::from_f32(*s * inv).to_f32();
    }
    1.0
}

fn head_scalar(hd: &Head<'_>, k_cache: &[f32], v_cache: &[f32], scores: &mut [f32], o: &mut [f32]) {
    let d = o.len();
    let slot = |p: usize| hd.block_table[p / hd.block_size] as usize * hd.block_size + p % hd.block_size;
    for (i, s) in scores.iter_mut().enumerate() {
        let k = slot(hd.start + i) * hd.kv_dim + hd.kv_off;
        *s = dot(hd.q, &k_cache[k..k + d]) * hd.scale;
    }
    let inv = softmax_unnormalized(scores, hd.probs_f16);
    o.fill(0.0);
    for (i, &s) in scores.iter().enumerate() {
        let v = slot(hd.start + i) * hd.kv_dim + hd.kv_off;
        axpy(o, s * inv, &v_cache[v..v + d]);
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    //! AVX2+FMA attention for one (token, head); loads via `lddqu` (see `qmatmul`).
    use std::arch::x86_64::*;

    use super::{Head, softmax_unnormalized};

    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: 32 readable bytes at `p` (caller).
        unsafe { _mm256_castsi256_ps(_mm256_lddqu_si256(p.cast())) }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: AVX present (caller).
        unsafe {
            let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let r = _mm_add_ps(q, _mm_movehl_ps(q, q));
            _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)))
        }
    }

    /// Calls `f(position - start, slot)` for every attended position, block by block.
    #[inline(always)]
    fn for_each_slot(hd: &Head<'_>, mut f: impl FnMut(usize, usize)) {
        let bs = hd.block_size;
        let mut p = hd.start;
        while p < hd.n {
            let off = p % bs;
            let base = hd.block_table[p / bs] as usize * bs + off;
            let cnt = (bs - off).min(hd.n - p);
            for i in 0..cnt {
                f(p - hd.start + i, base + i);
            }
            p += cnt;
        }
    }

    /// `o = softmax(q·Kᵀ·scale)·V` over the head's positions.
    ///
    /// # Safety
    /// AVX2 and FMA present; `o.len()` (the head width) a multiple of 8 and equal to
    /// `q.len()`; every slot of the block table's first `n` positions inside the caches.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn head(hd: &Head<'_>, k_cache: &[f32], v_cache: &[f32], scores: &mut [f32], o: &mut [f32]) {
        let d = o.len();
        let nv = d / 8;
        let kp = k_cache.as_ptr();
        let vp = v_cache.as_ptr();
        let (kv_dim, off) = (hd.kv_dim, hd.kv_off);
        let sp = scores.as_mut_ptr();
        let qp = hd.q.as_ptr();
        // SAFETY: slots are inside the caches and `scores` has `n` entries (caller).
        unsafe {
            for_each_slot(hd, |p, slot| {
                let k = kp.wrapping_add(slot * kv_dim + off);
                let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut c = 0;
                while c + 2 <= nv {
                    a0 = _mm256_fmadd_ps(load8(qp.wrapping_add(8 * c)), load8(k.wrapping_add(8 * c)), a0);
                    a1 = _mm256_fmadd_ps(load8(qp.wrapping_add(8 * c + 8)), load8(k.wrapping_add(8 * c + 8)), a1);
                    c += 2;
                }
                if c < nv {
                    a0 = _mm256_fmadd_ps(load8(qp.wrapping_add(8 * c)), load8(k.wrapping_add(8 * c)), a0);
                }
                *sp.wrapping_add(p) = hsum(_mm256_add_ps(a0, a1)) * hd.scale;
            });
            let inv = softmax_unnormalized(scores, hd.probs_f16);
            let op = o.as_mut_ptr();
            if d == 64 {
                let mut acc = [_mm256_setzero_ps(); 8];
                for_each_slot(hd, |p, slot| {
                    let v = vp.wrapping_add(slot * kv_dim + off);
                    let w = _mm256_set1_ps(*sp.wrapping_add(p));
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(w, load8(v.wrapping_add(8 * i)), *a);
                    }
                });
                let inv = _mm256_set1_ps(inv);
                for (i, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(op.wrapping_add(8 * i), _mm256_mul_ps(*a, inv));
                }
            } else {
                for c in 0..nv {
                    let mut acc = _mm256_setzero_ps();
                    for_each_slot(hd, |p, slot| {
                        let v = vp.wrapping_add(slot * kv_dim + off + 8 * c);
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(*sp.wrapping_add(p)), load8(v), acc);
                    });
                    _mm256_storeu_ps(op.wrapping_add(8 * c), _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vectorized kernel (head widths 64 and 16) against a plain softmax(q·K)·V.
    #[test]
    fn matches_a_plain_computation() {
        for d in [64usize, 16] {
            let shape = AttnShape {
                q_heads: 4,
                kv_heads: 2,
                head_dim: d,
                block_size: 4,
                scale: 1.0 / (d as f32).sqrt(),
                window: None,
                probs_f16: false,
            };
            let kv_dim = 2 * d;
            let blocks = 6;
            let val = |i: usize, m: usize| ((i * m % 97) as f32 - 48.0) / 40.0;
            let k: Vec<f32> = (0..blocks * 4 * kv_dim).map(|i| val(i, 31)).collect();
            let v: Vec<f32> = (0..blocks * 4 * kv_dim).map(|i| val(i, 53)).collect();
            let table = [5u32, 1, 3];
            let q: Vec<f32> = (0..2 * 4 * d).map(|i| val(i, 17)).collect();
            let tokens = [TokenCtx { pos: 10, block_table: &table }, TokenCtx { pos: 3, block_table: &table }];
            let mut out = vec![0f32; 2 * 4 * d];
            paged_attention(shape, &q, 4 * d, &tokens, &k, &v, &mut out);
            for (t, tok) in tokens.iter().enumerate() {
                for h in 0..4 {
                    let g = h / 2;
                    let slot = |p: usize| table[p / 4] as usize * 4 + p % 4;
                    let qv = &q[t * 4 * d + h * d..][..d];
                    let s: Vec<f64> = (0..=tok.pos)
                        .map(|p| {
                            let kr = &k[slot(p) * kv_dim + g * d..][..d];
                            qv.iter().zip(kr).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum::<f64>()
                                / (d as f64).sqrt()
                        })
                        .collect();
                    let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for c in 0..d {
                        let r: f64 = (0..=tok.pos).map(|p| e[p] / z * f64::from(v[slot(p) * kv_dim + g * d + c])).sum();
                        let got = f64::from(out[t * 4 * d + h * d + c]);
                        assert!((got - r).abs() < 1e-5, "d={d} t={t} h={h} c={c}: {got} vs {r}");
                    }
                }
            }
        }
    }
}
