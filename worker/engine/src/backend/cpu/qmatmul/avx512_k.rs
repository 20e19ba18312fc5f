//! AVX-512 decoders ([`Block`]) for Q5_0/Q5_1 blocks and the K-quant super-blocks, as the
//! AVX2 ones ([`super::avx2_k`]) with sixteen lanes: one multiply or FMA per weight, which
//! rounds exactly as the reference dequantization.
use std::arch::x86_64::*;

use super::avx512::{Block, load16b, scale};
use super::kscales::{k4_scale_min, q6k_scales, u32_at};
use crate::model::gguf::dequant_k::{Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BYTES};

pub(super) struct Q50;
pub(super) struct Q51;
pub(super) struct Q4K;
pub(super) struct Q5K;
pub(super) struct Q6K;
pub(super) struct Q8K;

/// The 32 weights of a Q5_0/Q5_1 block as i32 lanes: low four bits from 16 packed bytes
/// (weights `j` and `j + 16` share byte `j`), the fifth from bit `w` of `qh`.
#[inline(always)]
unsafe fn q5_ints(qs: *const u8, qh: u32) -> [__m512i; 2] {
    // SAFETY: 16 readable bytes at `qs` (caller); AVX-512F present.
    unsafe {
        let v = load16b(qs);
        let m = _mm_set1_epi8(0x0F);
        let (lo, hi) = (_mm_and_si128(v, m), _mm_and_si128(_mm_srli_epi16(v, 4), m));
        let bits = _mm512_set1_epi32(qh as i32);
        let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        let one = _mm512_set1_epi32(1);
        let h = |base: i32| {
            let shift = _mm512_add_epi32(lanes, _mm512_set1_epi32(base));
            _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(bits, shift), one), 4)
        };
        [_mm512_or_si512(_mm512_cvtepu8_epi32(lo), h(0)), _mm512_or_si512(_mm512_cvtepu8_epi32(hi), h(16))]
    }
}

impl Block for Q50 {
    const BYTES: usize = 22;
    #[inline(always)]
    unsafe fn load(p: *const u8, _g: usize) -> [__m512; 2] {
        // SAFETY: one 22-byte block at `p` (caller).
        unsafe {
            let d = scale(p);
            let q = q5_ints(p.wrapping_add(6), u32_at(p.wrapping_add(2)));
            let sixteen = _mm512_set1_epi32(16);
            let f = |v| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(v, sixteen)), d);
            [f(q[0]), f(q[1])]
        }
    }
}

impl Block for Q51 {
    const BYTES: usize = 24;
    #[inline(always)]
    unsafe fn load(p: *const u8, _g: usize) -> [__m512; 2] {
        // SAFETY: one 24-byte block at `p` (caller).
        unsafe {
            let (d, m) = (scale(p), scale(p.wrapping_add(2)));
            let q = q5_ints(p.wrapping_add(8), u32_at(p.wrapping_add(4)));
            // q·d is exact in f32, so one FMA rounds like `q * d + m`.
            let f = |v| _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), d, m);
            [f(q[0]), f(q[1])]
        }
    }
}

/// 32 bytes at `p` shifted right by `shift` bits and masked to `mask`, as two halves.
#[inline(always)]
unsafe fn bits32(p: *const u8, shift: usize, mask: i8) -> (__m128i, __m128i) {
    // SAFETY: 32 readable bytes at `p` (caller).
    unsafe {
        let (cnt, m) = (_mm_cvtsi32_si128(shift as i32), _mm_set1_epi8(mask));
        let f = |v: __m128i| _mm_and_si128(_mm_srl_epi16(v, cnt), m);
        (f(load16b(p)), f(load16b(p.wrapping_add(16))))
    }
}

impl Block for Q4K {
    const BYTES: usize = Q4_K_BYTES;
    const GROUPS: usize = 8;
    #[inline(always)]
    unsafe fn load(p: *const u8, g: usize) -> [__m512; 2] {
        // SAFETY: one super-block at `p`, `g < 8` (caller).
        unsafe {
            let (d, m) = k4_scale_min(p, g);
            let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
            let (a, b) = bits32(p.wrapping_add(16 + 32 * (g / 2)), 4 * (g & 1), 0x0F);
            let f = |v| _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)), d, m);
            [f(a), f(b)]
        }
    }
}

impl Block for Q5K {
    const BYTES: usize = Q5_K_BYTES;
    const GROUPS: usize = 8;
    #[inline(always)]
    unsafe fn load(p: *const u8, g: usize) -> [__m512; 2] {
        // SAFETY: one super-block at `p`, `g < 8` (caller).
        unsafe {
            let (d, m) = k4_scale_min(p, g);
            let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
            let (a, b) = bits32(p.wrapping_add(48 + 32 * (g / 2)), 4 * (g & 1), 0x0F);
            let (ha, hb) = bits32(p.wrapping_add(16), g, 1);
            let (a, b) = (_mm_or_si128(a, _mm_slli_epi16(ha, 4)), _mm_or_si128(b, _mm_slli_epi16(hb, 4)));
            let f = |v| _mm512_fmsub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)), d, m);
            [f(a), f(b)]
        }
    }
}

impl Block for Q6K {
    const BYTES: usize = Q6_K_BYTES;
    const GROUPS: usize = 8;
    #[inline(always)]
    unsafe fn load(p: *const u8, g: usize) -> [__m512; 2] {
        // SAFETY: one super-block at `p`, `g < 8` (caller).
        unsafe {
            let (n, k) = (g / 4, g % 4);
            let (s0, s1) = q6k_scales(p, g);
            let (lo_a, lo_b) = bits32(p.wrapping_add(64 * n + 32 * (k & 1)), 4 * (k >> 1), 0x0F);
            let (hi_a, hi_b) = bits32(p.wrapping_add(128 + 32 * n), 2 * k, 3);
            let thirty_two = _mm_set1_epi8(32);
            let q = |lo: __m128i, hi: __m128i| _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), thirty_two);
            let f = |v: __m128i, s: f32| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), _mm512_set1_ps(s));
            [f(q(lo_a, hi_a), s0), f(q(lo_b, hi_b), s1)]
        }
    }
}

impl Block for Q8K {
    const BYTES: usize = Q8_K_BYTES;
    const GROUPS: usize = 8;
    #[inline(always)]
    unsafe fn load(p: *const u8, g: usize) -> [__m512; 2] {
        // SAFETY: one super-block at `p`, `g < 8` (caller).
        unsafe {
            let d = _mm512_set1_ps(f32::from_bits(u32_at(p)));
            let q = p.wrapping_add(4 + 32 * g);
            let f = |v: __m128i| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v)), d);
            [f(load16b(q)), f(load16b(q.wrapping_add(16)))]
        }
    }
}
