//! The AVX-512 tile kernel: as the AVX2 one with sixteen lanes (lane `l` accumulates
//! elements `32b + 16s + l`, `s = 0, 1`), reduced as the upper 256 bits added to the
//! lower, then the AVX2 lane order. The order is again fixed whatever the row count.
//! Loads are masked loads with a full mask (LLVM builtins, folded into plain loads), which
//! avoid the debug-build precondition checks of std's `loadu`.
use std::arch::x86_64::*;

use super::job::{Job, scalar_tail};
use crate::model::gguf::dequant::QK;

#[inline(always)]
unsafe fn load16(p: *const f32) -> __m512 {
    // SAFETY: 64 readable bytes at `p` (caller).
    unsafe { _mm512_maskz_loadu_ps(0xFFFF, p) }
}

#[inline(always)]
pub(super) unsafe fn load16b(p: *const u8) -> __m128i {
    // SAFETY: 16 readable bytes at `p` (caller).
    unsafe { _mm_lddqu_si128(p.cast()) }
}

/// The f16 at `p` as f32, broadcast.
#[inline(always)]
pub(super) unsafe fn scale(p: *const u8) -> __m512 {
    // SAFETY: two bytes at `p` (caller); F16C present.
    unsafe {
        let bits = i32::from(u16::from_le_bytes([*p, *p.wrapping_add(1)]));
        _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
    }
}

/// Decodes group `g` (32 weights) of one block into two vectors of sixteen.
pub(super) trait Block {
    /// Bytes per block.
    const BYTES: usize;
    /// Groups of 32 weights per block (8 in a K-quant super-block of 256).
    const GROUPS: usize = 1;
    /// # Safety
    /// `p` points at one whole block, `g < GROUPS`; the CPU has AVX-512F and F16C.
    unsafe fn load(p: *const u8, g: usize) -> [__m512; 2];
}

pub(super) struct F32;
pub(super) struct Q40;
pub(super) struct Q41;
pub(super) struct Q80;

impl Block for F32 {
    const BYTES: usize = 4 * QK;
    #[inline(always)]
    unsafe fn load(p: *const u8, _g: usize) -> [__m512; 2] {
        let p = p.cast::<f32>();
        // SAFETY: 32 f32 at `p` (caller).
        unsafe { [load16(p), load16(p.wrapping_add(16))] }
    }
}

impl Block for Q40 {
    const BYTES: usize = 2 + QK / 2;
    #[inline(always)]
    unsafe fn load(p: *const u8, _g: usize) -> [__m512; 2] {
        // SAFETY: one 18-byte block at `p` (caller).
        unsafe {
            let d = scale(p);
            let qs = load16b(p.wrapping_add(2));
            let (m, eight) = (_mm_set1_epi8(0x0F), _mm_set1_epi8(8));
            let lo = _mm_sub_epi8(_mm_and_si128(qs, m), eight);
            let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), m), eight);
            let f = |v: __m128i| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), d);
            [f(lo), f(hi)]
        }
    }
}

impl Block for Q41 {
    const BYTES: usize = 4 + QK / 2;
    #[inline(always)]
    unsafe fn load(p: *const u8, _g: usize) -> [__m512; 2] {
        // SAFETY: one 20-byte block at `p` (caller).
        unsafe {
            let (d, mn) = (scale(p), scale(p.wrapping_add(2)));
            let qs = load16b(p.wrapping_add(4));
            let m = _mm_set1_epi8(0x0F);
            let lo = _mm_and_si128(qs, m);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), m);
            // q·d is exact in f32, so one FMA rounds like `q * d + m`.
            let f = |v: __m128i| _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)), d, mn);
            [f(lo), f(hi)]
        }
    }
}

impl Block for Q80 {
    const BYTES: usize = 2 + QK;
    #[inline(always)]
    unsafe fn load(p: *const u8, _g: usize) -> [__m512; 2] {
        // SAFETY: one 34-byte block at `p` (caller).
        unsafe {
            let d = scale(p);
            let f = |v: __m128i| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), d);
            [f(load16b(p.wrapping_add(2))), f(load16b(p.wrapping_add(18)))]
        }
    }
}

#[inline(always)]
unsafe fn hsum(v: __m512) -> f32 {
    // SAFETY: AVX-512F present (caller).
    unsafe {
        let lo = _mm512_castps512_ps256(v);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
        let e = _mm256_add_ps(lo, hi);
        let q = _mm_add_ps(_mm256_castps256_ps128(e), _mm256_extractf128_ps(e, 1));
        let r = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(r, _mm_shuffle_ps(r, r, 1)))
    }
}

/// `F` weight rows from `j` × `R` activation rows from `t` (see the AVX2 kernel).
#[inline(always)]
#[allow(clippy::needless_range_loop)] // const-size loops that unroll into registers
unsafe fn tile<B: Block, const F: usize, const R: usize>(job: &Job, t: usize, j: usize) {
    let (ws, xs) = (job.w_stride, job.x_stride);
    let w0 = job.w.wrapping_add(j.wrapping_mul(ws));
    let x0 = job.x.wrapping_add(t.wrapping_mul(xs));
    let mut wp: [*const u8; F] = std::array::from_fn(|f| w0.wrapping_add(f.wrapping_mul(ws)));
    let mut xp: [*const f32; R] = std::array::from_fn(|r| x0.wrapping_add(r.wrapping_mul(xs)));
    // SAFETY: rows `t..t+R` and `j..j+F` exist and hold `nblocks` blocks (caller).
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); R]; F];
        for _ in 0..job.nblocks / B::GROUPS {
            for g in 0..B::GROUPS {
                for f in 0..F {
                    let wv = B::load(wp[f], g);
                    for r in 0..R {
                        let x = xp[r];
                        let mut a = acc[f][r];
                        a = _mm512_fmadd_ps(wv[0], load16(x), a);
                        a = _mm512_fmadd_ps(wv[1], load16(x.wrapping_add(16)), a);
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
/// As `run_chunk`; the CPU has AVX-512F, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
pub(super) unsafe fn run<B: Block>(job: &Job, n: usize, j0: usize, j1: usize) {
    let mut t = 0;
    // SAFETY: forwarded.
    unsafe {
        while t < n {
            let rem = n - t;
            if rem >= 8 {
                features::<B, 2, 8>(job, t, j0, j1);
                t += 8;
            } else if rem >= 4 {
                features::<B, 4, 4>(job, t, j0, j1);
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
