//! AVX-512 kernels of the 8-bit-activation path ([`super::q8`]) for CPUs with AVX-512 BW,
//! VL and VNNI: the same integer lane sums as the AVX2 kernels (`q8_avx2`), computed with
//! `vpdpbusd` / `vpdpwssd` on 512-bit vectors, then the same f32 steps, so every output
//! keeps the scalar kernel's bits. Integer sums are exact whatever their order, which is
//! what lets the layouts below differ from the AVX2 ones.
//!
//! - Q4_0 / Q5_0 / Q8_0 weights: two weight rows per vector, laid out as 128-bit lanes
//!   `[row 0 elements 0..16, row 1 elements 0..16, row 0 16..32, row 1 16..32]` (the
//!   nibble order of Q4_0/Q5_0 blocks), the activation block as `[y 0..16, y 0..16,
//!   y 16..32, y 16..32]`. Each 32-bit lane is one of ggml's eight lanes (four consecutive
//!   products) of one row; the f32 accumulators follow the same layout and each row's
//!   eight lanes are gathered for ggml's reduction at the end. Unsigned quants (Q4_0, Q5_0)
//!   multiply the signed activations directly and subtract `offset · Σ y` per lane; Q8_0
//!   takes ggml's sign trick.
//! - K-quants: one weight row per vector, groups `2k` and `2k + 1` in its two halves; the
//!   halves' integer sums are added before the f32 step of the super-block.
//!
//! Every load is a masked load (LLVM builtins, plain loads once compiled), never std's
//! `loadu` or a raw-pointer read, whose debug-build precondition checks would otherwise
//! dominate these loops in the `dev` profile.
use std::arch::x86_64::*;

use super::q8_avx2::{KBlock, Mins, Q4K, Q5K, Q6K, hsum8};
use crate::model::gguf::dequant_k::QK_K;

#[inline(always)]
unsafe fn load128(p: *const u8) -> __m128i {
    // SAFETY: 16 readable bytes at `p` (caller); AVX-512BW/VL present.
    unsafe { _mm_maskz_loadu_epi8(0xFFFF, p.cast()) }
}

#[inline(always)]
unsafe fn load256(p: *const u8) -> __m256i {
    // SAFETY: 32 readable bytes at `p` (caller); AVX-512BW/VL present.
    unsafe { _mm256_maskz_loadu_epi8(u32::MAX, p.cast()) }
}

#[inline(always)]
unsafe fn load512(p: *const u8) -> __m512i {
    // SAFETY: 64 readable bytes at `p` (caller); AVX-512BW present.
    unsafe { _mm512_maskz_loadu_epi8(u64::MAX, p.cast()) }
}

/// The four bytes at `p` as a little-endian u32.
#[inline(always)]
unsafe fn u32_at(p: *const u8) -> u32 {
    // SAFETY: 4 readable bytes at `p` (caller); AVX-512BW/VL present.
    unsafe { _mm_cvtsi128_si32(_mm_maskz_loadu_epi8(0xF, p.cast())) as u32 }
}

/// The f32 at `p`, broadcast.
#[inline(always)]
unsafe fn splat(p: *const f32) -> __m512 {
    // SAFETY: 4 readable bytes at `p` (caller); AVX-512F/VL present.
    unsafe { _mm512_broadcastss_ps(_mm_maskz_loadu_ps(1, p)) }
}

/// The 32 bytes at `p` in both halves of a vector.
#[inline(always)]
unsafe fn twice(p: *const u8) -> __m512i {
    // SAFETY: 32 readable bytes at `p` (caller).
    unsafe { _mm512_broadcast_i64x4(load256(p)) }
}

/// A vector of sixteen i16: `lo` in the lower half, `hi` in the upper.
#[inline(always)]
unsafe fn halves16(lo: i16, hi: i16) -> __m512i {
    // SAFETY: AVX-512F present (caller).
    unsafe { _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1) }
}

/// A block format multiplied with Q8_0 activations, decoded for two rows at once.
pub(super) trait I8Pair {
    const BYTES: usize;
    /// 0: signed quants; else the quants are unsigned and this is subtracted from each.
    const OFFSET: i8;
    /// The quants of the blocks at `p0` and `p1` in the interleaved layout (module docs).
    ///
    /// # Safety
    /// A whole block at `p0` and at `p1`; AVX-512F/BW/VL present.
    unsafe fn quants(p0: *const u8, p1: *const u8) -> __m512i;
}

pub(super) struct Q40;
pub(super) struct Q50;
pub(super) struct Q80;

/// Low nibbles of the 16 bytes at `a` and at `b`, then their high nibbles: the
/// interleaved layout of two Q4_0/Q5_0 blocks' quants.
#[inline(always)]
unsafe fn nibbles2(a: *const u8, b: *const u8) -> __m512i {
    // SAFETY: 16 readable bytes at `a` and `b` (caller).
    unsafe {
        let v = _mm256_inserti128_si256(_mm256_castsi128_si256(load128(a)), load128(b), 1);
        let m = _mm256_set1_epi8(0x0F);
        let lo = _mm256_and_si256(v, m);
        let hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
        _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1)
    }
}

impl I8Pair for Q40 {
    const BYTES: usize = 18;
    const OFFSET: i8 = 8;
    #[inline(always)]
    unsafe fn quants(p0: *const u8, p1: *const u8) -> __m512i {
        // SAFETY: as documented.
        unsafe { nibbles2(p0.wrapping_add(2), p1.wrapping_add(2)) }
    }
}

impl I8Pair for Q50 {
    const BYTES: usize = 22;
    const OFFSET: i8 = 16;
    #[inline(always)]
    unsafe fn quants(p0: *const u8, p1: *const u8) -> __m512i {
        // SAFETY: as documented.
        unsafe {
            let (h0, h1) = (u64::from(u32_at(p0.wrapping_add(2))), u64::from(u32_at(p1.wrapping_add(2))));
            // Bit i of the mask is the fifth bit of byte i of the layout.
            let k = (h0 & 0xFFFF) | (h1 & 0xFFFF) << 16 | (h0 >> 16) << 32 | (h1 >> 16) << 48;
            let q = nibbles2(p0.wrapping_add(6), p1.wrapping_add(6));
            _mm512_mask_add_epi8(q, k, q, _mm512_set1_epi8(16))
        }
    }
}

impl I8Pair for Q80 {
    const BYTES: usize = 34;
    const OFFSET: i8 = 0;
    #[inline(always)]
    unsafe fn quants(p0: *const u8, p1: *const u8) -> __m512i {
        // SAFETY: as documented.
        unsafe {
            let v =
                _mm512_inserti64x4(_mm512_castsi256_si512(load256(p0.wrapping_add(2))), load256(p1.wrapping_add(2)), 1);
            _mm512_shuffle_i64x2(v, v, 0b11_01_10_00)
        }
    }
}

/// ggml's eight lanes of the two rows of an interleaved f32 accumulator.
#[inline(always)]
unsafe fn split_rows(acc: __m512) -> [__m256; 2] {
    // SAFETY: AVX-512F present (caller).
    unsafe {
        let lo = _mm512_castps512_ps256(acc);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
        [_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)]
    }
}

/// Bytes ahead of each weight row's current block that [`dot_q8_0`] prefetches. Two rows
/// read side by side are two interleaved streams, which the hardware prefetchers follow
/// less well than one: on the 2-vCPU AMD EPYC VM (`docs/benchmarks.md`) the Q8_0 output
/// projection of Gemma 3 270M streamed at half the one-row kernel's speed without this,
/// and about 1.2x faster than it with 256 or 320 bytes (192 or fewer, or a row length or
/// more, lost the gain).
const PREFETCH: usize = 256;

/// Weight rows `w` and `w + stride` (`nb` blocks of `D` each) times `R` Q8_0 activation
/// rows (`y[r]`: quants, `yd[r]`: scales): `out[i][r]` for row `i`.
///
/// # Safety
/// AVX-512F/BW/VL/VNNI, AVX2, FMA and F16C present; two rows of `nb` blocks at `w`,
/// `stride` bytes apart; `y[r]` `32·nb` quants, `yd[r]` `nb` scales.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn dot_q8_0<D: I8Pair, const R: usize>(
    w: *const u8,
    stride: usize,
    nb: usize,
    y: [*const i8; R],
    yd: [*const f32; R],
) -> [[f32; R]; 2] {
    let mut acc = [_mm512_setzero_ps(); R];
    // Lane `l` of an interleaved vector belongs to row `l / 4 % 2`.
    let pick = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1);
    let zero = _mm512_setzero_si512();
    let offset = _mm512_set1_epi8(D::OFFSET);
    // SAFETY: as documented (prefetches never fault).
    unsafe {
        for b in 0..nb {
            let (p0, p1) = (w.wrapping_add(b * D::BYTES), w.wrapping_add(stride + b * D::BYTES));
            _mm_prefetch::<_MM_HINT_T0>(p0.wrapping_add(PREFETCH).cast());
            _mm_prefetch::<_MM_HINT_T0>(p1.wrapping_add(PREFETCH).cast());
            let q = D::quants(p0, p1);
            // The f16 scales of the two rows (i16 lanes 0 and 1; the second load starts two
            // bytes early, its first lane masked off), as f32 in the interleaved layout.
            let h = _mm_mask_loadu_epi16(_mm_maskz_loadu_epi16(1, p0.cast()), 2, p1.wrapping_sub(2).cast());
            let d = _mm512_permutexvar_ps(pick, _mm512_castps128_ps512(_mm_cvtph_ps(h)));
            let (aq, neg) = if D::OFFSET == 0 { (_mm512_abs_epi8(q), _mm512_movepi8_mask(q)) } else { (q, 0) };
            for r in 0..R {
                let v = _mm512_castsi256_si512(load256(y[r].wrapping_add(32 * b).cast()));
                let ys = _mm512_shuffle_i64x2(v, v, 0b01_01_00_00);
                let s = if D::OFFSET == 0 {
                    _mm512_dpbusd_epi32(zero, aq, _mm512_mask_sub_epi8(ys, neg, zero, ys))
                } else {
                    _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, q, ys), _mm512_dpbusd_epi32(zero, offset, ys))
                };
                let dd = _mm512_mul_ps(d, splat(yd[r].wrapping_add(b)));
                acc[r] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(s), acc[r]);
            }
        }
        let rows: [[__m256; 2]; R] = std::array::from_fn(|r| split_rows(acc[r]));
        std::array::from_fn(|i| std::array::from_fn(|r| hsum8(rows[r][i])))
    }
}

/// A super-block's scales as [`dot_k`] uses them.
pub(super) struct Head {
    /// The super-block scale (`d`).
    d: f32,
    /// The minimum scale (`dmin`; 0 for Q6_K).
    dmin: f32,
    /// The integer scales as i16 lanes (eight for Q4_K/Q5_K, sixteen for Q6_K), spread
    /// over a pair's quants by [`KPairs::SPREAD`].
    scales: __m512i,
    /// The eight integer minimums as i16 (Q4_K/Q5_K).
    mins: __m128i,
}

/// A K-quant super-block decoded two groups at a time.
pub(super) trait KPairs: KBlock {
    /// Lane indices into [`Head::scales`] for groups 0 and 1 (the i16 scale of each pair
    /// of their quants); groups `2k`, `2k + 1` add `k` times [`KPairs::STEP`].
    const SPREAD: [i16; 4];
    /// See [`KPairs::SPREAD`].
    const STEP: i16;
    /// # Safety
    /// A whole super-block at `p`; AVX-512F/BW/VL, F16C present.
    unsafe fn head(p: *const u8) -> Head;
    /// Unsigned quants of groups `2k` (lower half) and `2k + 1` (upper half); Q6_K's
    /// are offset by 32 ([`KBlock::SIGNED`]).
    ///
    /// # Safety
    /// A whole super-block at `p`, `k < 4`; AVX-512F/BW/VL present.
    unsafe fn quants(p: *const u8, k: usize) -> __m512i;
}

/// Q4_K/Q5_K: `d`, `dmin` and the eight 6-bit scales and minimums (ggml's
/// `get_scale_min_k4`, unpacked for all eight groups at once as ggml's AVX2 kernels do:
/// bytes 0..8 of `[u0, u1]` are the scales, of `[u2, u3]` the minimums).
#[inline(always)]
unsafe fn k4_head(p: *const u8) -> Head {
    // SAFETY: bytes 0..16 of the super-block (caller); AVX-512BW/VL and F16C present.
    unsafe {
        let (m1, m2, m3) = (0x3f3f_3f3fu32, 0x0f0f_0f0fu32, 0x0303_0303u32);
        let (q0, q1, q2) = (u32_at(p.wrapping_add(4)), u32_at(p.wrapping_add(8)), u32_at(p.wrapping_add(12)));
        let u0 = q0 & m1;
        let u1 = (q2 & m2) | (((q0 >> 6) & m3) << 4);
        let u2 = q1 & m1;
        let u3 = ((q2 >> 4) & m2) | (((q1 >> 6) & m3) << 4);
        let bytes = _mm_setr_epi32(u0 as i32, u1 as i32, u2 as i32, u3 as i32);
        let h = _mm_cvtph_ps(_mm_maskz_loadu_epi16(0b11, p.cast()));
        Head {
            d: _mm_cvtss_f32(h),
            dmin: _mm_cvtss_f32(_mm_movehdup_ps(h)),
            scales: _mm512_castsi128_si512(_mm_cvtepu8_epi16(bytes)),
            mins: _mm_cvtepu8_epi16(_mm_unpackhi_epi64(bytes, bytes)),
        }
    }
}

/// The two halves of `v` shifted right by `lo` and `hi` bits (within each byte's 16-bit
/// lane) and masked with `mask`.
#[inline(always)]
unsafe fn bits2(v: __m512i, lo: i16, hi: i16, mask: i8) -> __m512i {
    // SAFETY: AVX-512F/BW present (caller).
    unsafe { _mm512_and_si512(_mm512_srlv_epi16(v, halves16(lo, hi)), _mm512_set1_epi8(mask)) }
}

impl KPairs for Q4K {
    const SPREAD: [i16; 4] = [0, 0, 1, 1];
    const STEP: i16 = 2;
    #[inline(always)]
    unsafe fn head(p: *const u8) -> Head {
        // SAFETY: as documented.
        unsafe { k4_head(p) }
    }
    #[inline(always)]
    unsafe fn quants(p: *const u8, k: usize) -> __m512i {
        // SAFETY: as documented.
        unsafe { bits2(twice(p.wrapping_add(16 + 32 * k)), 0, 4, 0x0F) }
    }
}

impl KPairs for Q5K {
    const SPREAD: [i16; 4] = [0, 0, 1, 1];
    const STEP: i16 = 2;
    #[inline(always)]
    unsafe fn head(p: *const u8) -> Head {
        // SAFETY: as documented.
        unsafe { k4_head(p) }
    }
    #[inline(always)]
    unsafe fn quants(p: *const u8, k: usize) -> __m512i {
        // SAFETY: as documented.
        unsafe {
            let lo = bits2(twice(p.wrapping_add(48 + 32 * k)), 0, 4, 0x0F);
            let g = 2 * k as i16;
            let hi = _mm512_slli_epi16(bits2(twice(p.wrapping_add(16)), g, g + 1, 1), 4);
            _mm512_or_si512(lo, hi)
        }
    }
}

impl KPairs for Q6K {
    const SPREAD: [i16; 4] = [0, 1, 2, 3];
    const STEP: i16 = 4;
    #[inline(always)]
    unsafe fn head(p: *const u8) -> Head {
        // SAFETY: as documented: the sixteen i8 scales at 192, `d` at 208.
        unsafe {
            let h = _mm_cvtph_ps(_mm_maskz_loadu_epi16(1, p.wrapping_add(208).cast()));
            let scales = _mm256_cvtepi8_epi16(load128(p.wrapping_add(192)));
            Head { d: _mm_cvtss_f32(h), dmin: 0.0, scales: _mm512_castsi256_si512(scales), mins: _mm_setzero_si128() }
        }
    }
    #[inline(always)]
    unsafe fn quants(p: *const u8, k: usize) -> __m512i {
        // SAFETY: as documented. Groups 4n + c, 4n + c + 1 (c = 0 or 2): low nibbles (c = 0)
        // or high nibbles (c = 2) of bytes 64n..64n + 64, two bits of bytes 128 + 32n.. at
        // shifts 2c and 2c + 2.
        unsafe {
            let (n, c) = (k / 2, 2 * (k % 2));
            let s = 4 * (c as i16 / 2);
            let lo = bits2(load512(p.wrapping_add(64 * n)), s, s, 0x0F);
            let hi = bits2(twice(p.wrapping_add(128 + 32 * n)), 2 * c as i16, 2 * c as i16 + 2, 3);
            _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4))
        }
    }
}

/// Weight row `w` (`nsb` super-blocks of `K`) times `R` Q8_K activation rows, as
/// `q8_avx2::dot_k` (same arguments, same bits).
///
/// # Safety
/// AVX-512F/BW/VL/VNNI, AVX2, FMA and F16C present; `w` holds `nsb` super-blocks, `y[r]`
/// `256·nsb` quants, `yd[r]` `nsb` scales, `bs[r]` `16·nsb` sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn dot_k<K: KPairs, const R: usize>(
    w: *const u8,
    nsb: usize,
    y: [*const i8; R],
    yd: [*const f32; R],
    bs: [*const i16; R],
) -> [f32; R] {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut acc_m = [_mm_setzero_ps(); R];
    let mut summs = [0f32; R];
    let m32 = _mm512_set1_epi8(32);
    // i16 lane `i` of the scales of groups 0 and 1: SPREAD[i / 8] (lanes 0..16 belong to
    // group 0's sixteen pairs of quants, 16..32 to group 1's).
    let [a, b, c, d] = K::SPREAD;
    let spread = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_inserti128_si256(_mm256_set1_epi16(a), _mm_set1_epi16(b), 1)),
        _mm256_inserti128_si256(_mm256_set1_epi16(c), _mm_set1_epi16(d), 1),
        1,
    );
    // SAFETY: as documented.
    unsafe {
        for sb in 0..nsb {
            let p = w.wrapping_add(sb * K::BYTES);
            let Head { d: xd, dmin: xmin, scales, mins: m16 } = K::head(p);
            let mut sumi = [_mm512_setzero_si512(); R];
            for k in 0..4 {
                let q = K::quants(p, k);
                let idx = _mm512_add_epi16(spread, _mm512_set1_epi16(K::STEP * k as i16));
                let scale = _mm512_permutexvar_epi16(idx, scales);
                for r in 0..R {
                    let yq = load512(y[r].wrapping_add(QK_K * sb + 64 * k).cast());
                    let mut pairs = _mm512_maddubs_epi16(q, yq);
                    if K::SIGNED {
                        pairs = _mm512_sub_epi16(pairs, _mm512_maddubs_epi16(m32, yq));
                    }
                    sumi[r] = _mm512_dpwssd_epi32(sumi[r], scale, pairs);
                }
            }
            for r in 0..R {
                let ydr = _mm_cvtss_f32(_mm_maskz_loadu_ps(1, yd[r].wrapping_add(sb)));
                if K::MINS != Mins::None {
                    let b = bs[r].wrapping_add(16 * sb);
                    let q8s = _mm_hadd_epi16(load128(b.cast()), load128(b.wrapping_add(8).cast()));
                    let prod = _mm_madd_epi16(m16, q8s);
                    let dmin = -ydr * xmin;
                    if K::MINS == Mins::Lanes4 {
                        acc_m[r] = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m[r]);
                    } else {
                        let h = _mm_hadd_epi32(_mm_hadd_epi32(prod, _mm_setzero_si128()), _mm_setzero_si128());
                        summs[r] += dmin * _mm_cvtsi128_si32(h) as f32;
                    }
                }
                let s = _mm256_add_epi32(_mm512_castsi512_si256(sumi[r]), _mm512_extracti64x4_epi64(sumi[r], 1));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(ydr * xd), _mm256_cvtepi32_ps(s), acc[r]);
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

/// Whether the CPU has what these kernels need (and `PRISM_CPU_NO_AVX512` is unset).
pub(super) fn available() -> bool {
    use std::is_x86_feature_detected as has;
    has!("avx512f")
        && has!("avx512bw")
        && has!("avx512vl")
        && has!("avx512vnni")
        && has!("avx2")
        && has!("fma")
        && has!("f16c")
        && std::env::var_os("PRISM_CPU_NO_AVX512").is_none()
}
