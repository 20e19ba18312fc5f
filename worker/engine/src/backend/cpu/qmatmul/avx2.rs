//! The AVX2+FMA+F16C tile kernel. Loads go through `lddqu` (an LLVM builtin): std's
//! `loadu` intrinsics copy through `copy_nonoverlapping`, whose debug-build precondition
//! checks (the dev profile keeps debug assertions) would spill every accumulator.
use std::arch::x86_64::*;

use super::job::{Job, scalar_tail};
use crate::model::gguf::dequant::QK;

/// Eight f32 at `p`, unaligned.
#[inline(always)]
unsafe fn load8(p: *const f32) -> __m256 {
    // SAFETY: 32 readable bytes at `p` (caller); AVX present.
    unsafe { _mm256_castsi256_ps(_mm256_lddqu_si256(p.cast())) }
}

/// Sixteen bytes at `p`, unaligned.
#[inline(always)]
pub(super) unsafe fn load16b(p: *const u8) -> __m128i {
    // SAFETY: 16 readable bytes at `p` (caller).
    unsafe { _mm_lddqu_si128(p.cast()) }
}

/// Decodes group `g` (32 weights) of one block into four vectors of eight.
pub(super) trait Block {
    /// Bytes per block.
    const BYTES: usize;
    /// Groups of 32 weights per block (8 in a K-quant super-block of 256).
    const GROUPS: usize = 1;
    /// # Safety
    /// `p` points at one whole block, `g < GROUPS`; the CPU has AVX2, FMA and F16C.
    unsafe fn load(p: *const u8, g: usize) -> [__m256; 4];
}

pub(super) struct F32;
pub(super) struct Q40;
pub(super) struct Q41;
pub(super) struct Q80;

impl Block for F32 {
    const BYTES: usize = 4 * QK;
    #[inline(always)]
    unsafe fn load(p: *const u8, _g: usize) -> [__m256; 4] {
        let p = p.cast::<f32>();
        // SAFETY: 32 f32 at `p` (caller).
        unsafe { [load8(p), load8(p.wrapping_add(8)), load8(p.wrapping_add(16)), load8(p.wrapping_add(24))] }
    }
}

/// The f16 at `p` as f32, broadcast.
#[inline(always)]
pub(super) unsafe fn scale(p: *const u8) -> __m256 {
    // SAFETY: two bytes at `p` (caller); F16C present.
    unsafe {
        let bits = i32::from(u16::from_le_bytes([*p, *p.wrapping_add(1)]));
        _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
    }
}

impl Block for Q40 {
    const BYTES: usize = 2 + QK / 2;
    #[inline(always)]
    unsafe fn load(p: *const u8, _g: usize) -> [__m256; 4] {
        // SAFETY: one 18-byte block at `p` (caller).
        unsafe {
            let d = scale(p);
            let qs = load16b(p.wrapping_add(2));
            let m = _mm_set1_epi8(0x0F);
            let eight = _mm_set1_epi8(8);
            let lo = _mm_sub_epi8(_mm_and_si128(qs, m), eight);
            let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), m), eight);
            let f = |v: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
            [f(lo), f(_mm_srli_si128(lo, 8)), f(hi), f(_mm_srli_si128(hi, 8))]
        }
    }
}

impl Block for Q41 {
    const BYTES: usize = 4 + QK / 2;
    #[inline(always)]
    unsafe fn load(p: *const u8, _g: usize) -> [__m256; 4] {
        // SAFETY: one 20-byte block at `p` (caller).
        unsafe {
            let d = scale(p);
            let mn = scale(p.wrapping_add(2));
            let qs = load16b(p.wrapping_add(4));
            let m = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(qs, m);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m);
            // q·d is exact in f32 (4-bit × 11-bit), so one FMA rounds like `q * d + m`.
            let f = |v: __m128i| _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), d, mn);
            [f(lo), f(_mm_srli_si128(lo, 8)), f(hi), f(_mm_srli_si128(hi, 8))]
        }
    }
}

impl Block for Q80 {
    const BYTES: usize = 2 + QK;
    #[inline(always)]
    unsafe fn load(p: *const u8, _g: usize) -> [__m256; 4] {
        // SAFETY: one 34-byte block at `p` (caller).
        unsafe {
            let d = scale(p);
            let (a, b) = (load16b(p.wrapping_add(2)), load16b(p.wrapping_add(18)));
            let f = |v: __m128i| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), d);
            [f(a), f(_mm_srli_si128(a, 8)), f(b), f(_mm_srli_si128(b, 8))]
        }
    }
}

/// Lane reduction in [`super::job::reduce_lanes`]'s order.
#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    // SAFETY: AVX present (caller).
    unsafe {
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let r = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)))
    }
}

/// `F` weight rows from `j` × `R` activation rows from `t`. Pointer arithmetic is
/// wrapping (no overflow checks in the dev profile's hot loop; every address stays
/// inside the buffers by the caller's contract), so the accumulators live in registers.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // const-size loops that unroll into registers
unsafe fn tile<B: Block, const F: usize, const R: usize>(job: &Job, t: usize, j: usize) {
    let ws = job.w_stride;
    let xs = job.x_stride;
    let w0 = job.w.wrapping_add(j.wrapping_mul(ws));
    let x0 = job.x.wrapping_add(t.wrapping_mul(xs));
    let mut wp: [*const u8; F] = std::array::from_fn(|f| w0.wrapping_add(f.wrapping_mul(ws)));
    let mut xp: [*const f32; R] = std::array::from_fn(|r| x0.wrapping_add(r.wrapping_mul(xs)));
    // SAFETY: rows `t..t+R` and `j..j+F` exist and hold `nblocks` blocks (caller);
    // AVX2/FMA present.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); R]; F];
        for _ in 0..job.nblocks / B::GROUPS {
            for g in 0..B::GROUPS {
                for f in 0..F {
                    let wv = B::load(wp[f], g);
                    for r in 0..R {
                        let x = xp[r];
                        let mut a = acc[f][r];
                        a = _mm256_fmadd_ps(wv[0], load8(x), a);
                        a = _mm256_fmadd_ps(wv[1], load8(x.wrapping_add(8)), a);
                        a = _mm256_fmadd_ps(wv[2], load8(x.wrapping_add(16)), a);
                        a = _mm256_fmadd_ps(wv[3], load8(x.wrapping_add(24)), a);
                        acc[f][r] = a;
                    }
                }
                for p in &mut xp {
                    *p = p.wrapping_add(QK);
                }
            }
            for p in &mut wp {
                *p = p.wrapping_add(B::BYTES);
            }
        }
        for f in 0..F {
            for r in 0..R {
                let mut sum = hsum(acc[f][r]);
                if job.tail > 0 {
                    let wrow = std::slice::from_raw_parts(w0.add(f * ws), ws);
                    let x = std::slice::from_raw_parts(x0.add(r * xs), xs);
                    sum = scalar_tail(job, wrow, x, sum);
                }
                *job.y.add((t + r) * job.y_stride + j + f) = sum;
            }
        }
    }
}

/// Features `j0..j1` of one row tile: `F` at a time, then the rest one by one.
#[inline(always)]
unsafe fn features<B: Block, const F: usize, const R: usize>(job: &Job, t: usize, j0: usize, j1: usize) {
    let mut j = j0;
    // SAFETY: forwarded from `run`.
    unsafe {
        while j + F <= j1 {
            tile::<B, F, R>(job, t, j);
            j += F;
        }
        while j < j1 {
            tile::<B, 1, R>(job, t, j);
            j += 1;
        }
    }
}

/// All `n` rows × features `j0..j1`.
///
/// # Safety
/// As [`super::run_chunk`]; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run<B: Block>(job: &Job, n: usize, j0: usize, j1: usize) {
    let mut t = 0;
    // SAFETY: forwarded.
    unsafe {
        while t < n {
            let rem = n - t;
            if rem >= 8 {
                features::<B, 1, 8>(job, t, j0, j1);
                t += 8;
            } else if rem >= 4 {
                features::<B, 2, 4>(job, t, j0, j1);
                t += 4;
            } else if rem >= 2 {
                features::<B, 4, 2>(job, t, j0, j1);
                t += 2;
            } else {
                features::<B, 8, 1>(job, t, j0, j1);
                t += 1;
            }
        }
    }
}
