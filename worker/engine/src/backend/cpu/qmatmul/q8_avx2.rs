//! AVX2 kernels of the 8-bit-activation path ([`super::q8`]): ggml's `ggml_vec_dot_*`
//! arithmetic (see there), for `R` activation rows per weight row so each weight block is
//! decoded once per row tile. Integer parts are exact, the f32 steps are the scalar
//! kernel's, so both give the same bits.
use std::arch::x86_64::*;

use super::k4::k4_scales_mins;
use super::kscales::{f16, u32_at};
use crate::model::gguf::dequant_k::{Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, QK_K};

/// ggml's `hsum_float_8`: `(l0+l4) + (l2+l6)` and `(l1+l5) + (l3+l7)`, then their sum.
#[inline(always)]
pub(super) unsafe fn hsum8(v: __m256) -> f32 {
    // SAFETY: AVX present (caller).
    unsafe {
        let q = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
        let r = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(r, _mm_movehdup_ps(r)))
    }
}

/// Eight i32 lanes, lane `l` = Σ x[4l..4l+4]·y[4l..4l+4] over signed bytes.
#[inline(always)]
unsafe fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256i {
    // SAFETY: AVX2 present (caller).
    unsafe {
        let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x));
        _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
    }
}

#[inline(always)]
unsafe fn load32(p: *const u8) -> __m256i {
    // SAFETY: 32 readable bytes at `p` (caller).
    unsafe { _mm256_loadu_si256(p.cast()) }
}

/// Low nibbles of the 16 bytes at `p` as bytes 0..16, high nibbles as bytes 16..32.
#[inline(always)]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    // SAFETY: 16 readable bytes at `p` (caller).
    unsafe {
        let v = _mm_loadu_si128(p.cast());
        let m = _mm_set1_epi8(0x0F);
        _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m), _mm_and_si128(v, m))
    }
}

/// A block format multiplied with Q8_0 activations: its f16 scale and 32 signed quants.
pub(super) trait I8Block {
    const BYTES: usize;
    /// # Safety
    /// A whole block at `p`; AVX2 and F16C present.
    unsafe fn decode(p: *const u8) -> (f32, __m256i);
}

pub(super) struct Q40;
pub(super) struct Q50;
pub(super) struct Q80;

impl I8Block for Q40 {
    const BYTES: usize = 18;
    #[inline(always)]
    unsafe fn decode(p: *const u8) -> (f32, __m256i) {
        // SAFETY: as documented.
        unsafe { (f16(p), _mm256_sub_epi8(nibbles32(p.wrapping_add(2)), _mm256_set1_epi8(8))) }
    }
}

impl I8Block for Q50 {
    const BYTES: usize = 22;
    #[inline(always)]
    unsafe fn decode(p: *const u8) -> (f32, __m256i) {
        // SAFETY: as documented.
        unsafe {
            let qh = u32_at(p.wrapping_add(2)) as i32;
            // Byte i holds byte i / 8 of qh; keep bit i % 8: 0xFF where the fifth bit is set.
            let shuf = _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
            );
            let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
            let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(qh), shuf);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
            // q - 16 = q | 0xF0 (as i8) where the fifth bit is clear, q where it is set.
            let hi = _mm256_andnot_si256(set, _mm256_set1_epi8(0xF0u8 as i8));
            (f16(p), _mm256_or_si256(nibbles32(p.wrapping_add(6)), hi))
        }
    }
}

impl I8Block for Q80 {
    const BYTES: usize = 34;
    #[inline(always)]
    unsafe fn decode(p: *const u8) -> (f32, __m256i) {
        // SAFETY: as documented.
        unsafe { (f16(p), load32(p.wrapping_add(2))) }
    }
}

/// Weight row `w` (`nb` blocks of `D`) times `R` Q8_0 activation rows (`y[r]`: quants,
/// `yd[r]`: scales).
///
/// # Safety
/// AVX2, FMA and F16C present; `w` holds `nb` blocks, `y[r]` `32·nb` quants, `yd[r]` `nb`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_q8_0<D: I8Block, const R: usize>(
    w: *const u8,
    nb: usize,
    y: [*const i8; R],
    yd: [*const f32; R],
) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    // SAFETY: as documented.
    unsafe {
        for b in 0..nb {
            let (wd, q) = D::decode(w.wrapping_add(b * D::BYTES));
            for r in 0..R {
                let s = _mm256_cvtepi32_ps(mul_sum_i8(q, load32(y[r].wrapping_add(32 * b).cast())));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(wd * *yd[r].add(b)), s, acc[r]);
            }
        }
        std::array::from_fn(|r| hsum8(acc[r]))
    }
}

/// A K-quant super-block multiplied with Q8_K activations.
pub(super) trait KBlock {
    const BYTES: usize;
    /// Q4_K: minimum terms over four lanes; Q5_K: one running sum; Q6_K: none.
    const MINS: Mins;
    /// Per super-block: `(d, dmin, scales, minimums)`.
    ///
    /// # Safety
    /// A whole super-block at `p`; F16C present.
    unsafe fn prepare(p: *const u8) -> (f32, f32, [u8; 8], [u8; 8]);
    /// Group `g`'s 32 quants and the i16 scale of each pair of them; signed quants when
    /// `SIGNED`.
    ///
    /// # Safety
    /// A whole super-block at `p`, `g < 8`; AVX2 present.
    unsafe fn group(p: *const u8, g: usize, sc: &[u8; 8]) -> (__m256i, __m256i);
    const SIGNED: bool;
}

#[derive(PartialEq, Eq)]
pub(super) enum Mins {
    Lanes4,
    Sum,
    None,
}

pub(super) struct Q4K;
pub(super) struct Q5K;
pub(super) struct Q6K;

/// The 32 bytes at `p` shifted right by `shift` bits and masked with `mask`.
#[inline(always)]
unsafe fn bits(p: *const u8, shift: usize, mask: i8) -> __m256i {
    // SAFETY: 32 readable bytes at `p` (caller).
    unsafe { _mm256_and_si256(_mm256_srl_epi16(load32(p), _mm_cvtsi32_si128(shift as i32)), _mm256_set1_epi8(mask)) }
}

unsafe fn k4_prepare(p: *const u8) -> (f32, f32, [u8; 8], [u8; 8]) {
    // SAFETY: a whole super-block at `p` (caller).
    unsafe {
        let head = std::slice::from_raw_parts(p, 16);
        let (sc, m) = k4_scales_mins(head);
        (f16(p), f16(p.wrapping_add(2)), sc, m)
    }
}

impl KBlock for Q4K {
    const BYTES: usize = Q4_K_BYTES;
    const MINS: Mins = Mins::Lanes4;
    const SIGNED: bool = false;
    #[inline(always)]
    unsafe fn prepare(p: *const u8) -> (f32, f32, [u8; 8], [u8; 8]) {
        // SAFETY: as documented.
        unsafe { k4_prepare(p) }
    }
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize, sc: &[u8; 8]) -> (__m256i, __m256i) {
        // SAFETY: as documented.
        unsafe { (bits(p.wrapping_add(16 + 32 * (g / 2)), 4 * (g & 1), 0x0F), _mm256_set1_epi16(i16::from(sc[g]))) }
    }
}

impl KBlock for Q5K {
    const BYTES: usize = Q5_K_BYTES;
    const MINS: Mins = Mins::Sum;
    const SIGNED: bool = false;
    #[inline(always)]
    unsafe fn prepare(p: *const u8) -> (f32, f32, [u8; 8], [u8; 8]) {
        // SAFETY: as documented.
        unsafe { k4_prepare(p) }
    }
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize, sc: &[u8; 8]) -> (__m256i, __m256i) {
        // SAFETY: as documented.
        unsafe {
            let lo = bits(p.wrapping_add(48 + 32 * (g / 2)), 4 * (g & 1), 0x0F);
            let hi = _mm256_slli_epi16(bits(p.wrapping_add(16), g, 1), 4);
            (_mm256_or_si256(lo, hi), _mm256_set1_epi16(i16::from(sc[g])))
        }
    }
}

impl KBlock for Q6K {
    const BYTES: usize = Q6_K_BYTES;
    const MINS: Mins = Mins::None;
    const SIGNED: bool = true;
    #[inline(always)]
    unsafe fn prepare(p: *const u8) -> (f32, f32, [u8; 8], [u8; 8]) {
        // SAFETY: as documented.
        unsafe { (f16(p.wrapping_add(208)), 0.0, [0; 8], [0; 8]) }
    }
    #[inline(always)]
    unsafe fn group(p: *const u8, g: usize, _sc: &[u8; 8]) -> (__m256i, __m256i) {
        // SAFETY: as documented.
        unsafe {
            let (n, c) = (g / 4, g % 4);
            let lo = bits(p.wrapping_add(64 * n + 32 * (c & 1)), 4 * (c >> 1), 0x0F);
            let hi = _mm256_slli_epi16(bits(p.wrapping_add(128 + 32 * n), 2 * c, 3), 4);
            let q = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
            let s = p.wrapping_add(192 + 8 * n + 2 * c);
            let (s0, s1) = (i16::from(*s as i8), i16::from(*s.wrapping_add(1) as i8));
            (q, _mm256_set_m128i(_mm_set1_epi16(s1), _mm_set1_epi16(s0)))
        }
    }
}

/// Weight row `w` (`nsb` super-blocks of `K`) times `R` Q8_K activation rows (`y[r]`:
/// quants, `yd[r]`: scales, `bs[r]`: sums of 16).
///
/// # Safety
/// AVX2, FMA and F16C present; `w` holds `nsb` super-blocks, `y[r]` `256·nsb` quants,
/// `yd[r]` `nsb` scales, `bs[r]` `16·nsb` sums.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dot_k<K: KBlock, const R: usize>(
    w: *const u8,
    nsb: usize,
    y: [*const i8; R],
    yd: [*const f32; R],
    bs: [*const i16; R],
) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_m = [_mm_setzero_ps(); R];
    let mut summs = [0f32; R];
    // SAFETY: as documented.
    unsafe {
        for sb in 0..nsb {
            let p = w.wrapping_add(sb * K::BYTES);
            let (xd, xmin, sc, mins) = K::prepare(p);
            let mut sumi = [_mm256_setzero_si256(); R];
            for g in 0..8 {
                let (q, scale) = K::group(p, g, &sc);
                let aq = if K::SIGNED { _mm256_sign_epi8(q, q) } else { q };
                for r in 0..R {
                    let yq = load32(y[r].wrapping_add(QK_K * sb + 32 * g).cast());
                    let yq = if K::SIGNED { _mm256_sign_epi8(yq, q) } else { yq };
                    let pairs = _mm256_maddubs_epi16(aq, yq);
                    sumi[r] = _mm256_add_epi32(sumi[r], _mm256_madd_epi16(scale, pairs));
                }
            }
            let m16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(mins.as_ptr().cast()));
            for r in 0..R {
                let ydr = *yd[r].add(sb);
                if K::MINS != Mins::None {
                    let b = bs[r].wrapping_add(16 * sb);
                    let q8s = _mm_hadd_epi16(_mm_loadu_si128(b.cast()), _mm_loadu_si128(b.wrapping_add(8).cast()));
                    let prod = _mm_madd_epi16(m16, q8s);
                    let dmin = -ydr * xmin;
                    if K::MINS == Mins::Lanes4 {
                        acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[r]);
                    } else {
                        let h = _mm_hadd_epi32(_mm_hadd_epi32(prod, _mm_setzero_si128()), _mm_setzero_si128());
                        summs[r] += dmin * _mm_cvtsi128_si32(h) as f32;
                    }
                }
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(ydr * xd), _mm256_cvtepi32_ps(sumi[r]), acc[r]);
            }
        }
        std::array::from_fn(|r| match K::MINS {
            Mins::Lanes4 => {
                let m = _mm_add_ps(acc_m[r], _mm_movehl_ps(acc_m[r], acc_m[r]));
                hsum8(acc[r]) + _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)))
            }
            Mins::Sum => hsum8(acc[r]) + summs[r],
            Mins::None => hsum8(acc[r]),
        })
    }
}
