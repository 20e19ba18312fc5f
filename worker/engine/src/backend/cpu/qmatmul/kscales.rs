//! Scalar reads of the per-group scales of Q5_0/Q5_1 and K-quant blocks from raw
//! pointers, shared by the AVX2 and AVX-512 decoders (values as
//! [`crate::model::gguf::dequant_k`] computes them: each product exact in f32).
use std::arch::x86_64::*;

/// The f16 at `p` as f32.
///
/// # Safety
/// Two readable bytes at `p`; the CPU has F16C.
#[inline(always)]
pub(super) unsafe fn f16(p: *const u8) -> f32 {
    // SAFETY: as documented.
    unsafe {
        let bits = i32::from(u16::from_le_bytes([*p, *p.wrapping_add(1)]));
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits)))
    }
}

/// Four little-endian bytes at `p`.
///
/// # Safety
/// Four readable bytes at `p`.
#[inline(always)]
pub(super) unsafe fn u32_at(p: *const u8) -> u32 {
    // SAFETY: as documented.
    unsafe { u32::from_le_bytes([*p, *p.wrapping_add(1), *p.wrapping_add(2), *p.wrapping_add(3)]) }
}

/// `(d·sc, dmin·m)` of group `g` of the Q4_K/Q5_K super-block at `p` (ggml's
/// `get_scale_min_k4` on the 12 bytes after `d` and `dmin`).
///
/// # Safety
/// A whole super-block at `p`, `g < 8`; the CPU has F16C.
#[inline(always)]
pub(super) unsafe fn k4_scale_min(p: *const u8, g: usize) -> (f32, f32) {
    // SAFETY: bytes 0..16 of the block.
    unsafe {
        let q = |i: usize| *p.wrapping_add(4 + i);
        let (sc, m) = if g < 4 {
            (q(g) & 63, q(g + 4) & 63)
        } else {
            ((q(g + 4) & 0xF) | ((q(g - 4) >> 6) << 4), (q(g + 4) >> 4) | ((q(g) >> 6) << 4))
        };
        (f16(p) * f32::from(sc), f16(p.wrapping_add(2)) * f32::from(m))
    }
}

/// `(d·sc[2k], d·sc[2k + 1])` of group `g = 4n + k` of the Q6_K super-block at `p`: the
/// scales of its first and second sixteen weights.
///
/// # Safety
/// A whole super-block at `p`, `g < 8`; the CPU has F16C.
#[inline(always)]
pub(super) unsafe fn q6k_scales(p: *const u8, g: usize) -> (f32, f32) {
    // SAFETY: bytes 192..210 of the block.
    unsafe {
        let d = f16(p.wrapping_add(208));
        let sc = p.wrapping_add(192 + 8 * (g / 4) + 2 * (g % 4));
        (d * f32::from(*sc as i8), d * f32::from(*sc.wrapping_add(1) as i8))
    }
}
