//! The GGUF "K-quant" formats (llama.cpp's `k_quants`): super-blocks of [`QK_K`] = 256
//! weights, decoded bit-exactly as ggml's reference `dequantize_row_q{4,5,6,8}_K`
//! (ggml-quants.c).
//!
//! - **Q4_K** (144 bytes): f16 `d`, f16 `dmin`, 12 bytes of eight 6-bit scales and eight
//!   6-bit minimums, 128 bytes of 4-bit quants. Weight = `d·sc[s]·q − dmin·m[s]` for
//!   sub-block `s` of 32.
//! - **Q5_K** (176 bytes): as Q4_K plus 32 bytes `qh` holding each weight's fifth bit.
//! - **Q6_K** (210 bytes): 128 bytes low nibbles `ql`, 64 bytes high bit pairs `qh`, sixteen
//!   i8 scales (one per 16 weights), f16 `d`. Weight = `d·sc·(q − 32)`.
//! - **Q8_K** (292 bytes): f32 `d`, 256 × i8, sixteen i16 block sums (not needed to
//!   dequantize). Weight = `d·q`.
//!
//! Every product here is exact in f32 before its one rounding (an f16 scale has 11
//! significant bits, a 6-bit scale times a 6-bit quant at most 12 more), so the decoders
//! may fuse or reorder `d·sc·q − m` without changing a bit; [`sub_block`] decodes one group
//! of 32 weights, the unit the matmul kernels consume.

use half::f16;

/// Weights per K-quant super-block (ggml's `QK_K`).
pub const QK_K: usize = 256;
/// Bytes of a Q4_K super-block.
pub const Q4_K_BYTES: usize = 4 + 12 + QK_K / 2;
/// Bytes of a Q5_K super-block.
pub const Q5_K_BYTES: usize = 4 + 12 + QK_K / 8 + QK_K / 2;
/// Bytes of a Q6_K super-block.
pub const Q6_K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
/// Bytes of a Q8_K super-block.
pub const Q8_K_BYTES: usize = 4 + QK_K + QK_K / 8;

/// The K-quant formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KQuant {
    /// 4-bit quants, 6-bit scales and minimums.
    Q4K,
    /// 5-bit quants, 6-bit scales and minimums.
    Q5K,
    /// 6-bit quants, 8-bit scales.
    Q6K,
    /// 8-bit quants, one f32 scale.
    Q8K,
}

impl KQuant {
    /// Bytes per super-block.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4K => Q4_K_BYTES,
            Self::Q5K => Q5_K_BYTES,
            Self::Q6K => Q6_K_BYTES,
            Self::Q8K => Q8_K_BYTES,
        }
    }
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Scale and minimum of sub-block `j` (0..8) from the 12 packed bytes (ggml's
/// `get_scale_min_k4`): sub-blocks 0..4 keep theirs in the low six bits of bytes `j` and
/// `j + 4`; sub-blocks 4..8 keep the low four bits in byte `j + 4` and the top two in the
/// spare high bits of bytes `j − 4` (scale) and `j` (minimum).
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// `(d·sc, dmin·m)` of sub-block `s` of a Q4_K/Q5_K super-block `b`.
#[inline(always)]
pub fn scale_min(b: &[u8], s: usize) -> (f32, f32) {
    let (sc, m) = scale_min_k4(s, &b[4..16]);
    (f16_at(b, 0) * f32::from(sc), f16_at(b, 2) * f32::from(m))
}

/// Decodes weights `32s..32s + 32` of super-block `b` (one whole block of `ty`).
#[inline(always)]
pub fn sub_block(ty: KQuant, b: &[u8], s: usize, out: &mut [f32; 32]) {
    match ty {
        KQuant::Q4K => {
            let (d, m) = scale_min(b, s);
            let (qs, shift) = (&b[16 + 32 * (s / 2)..][..32], 4 * (s & 1));
            for (o, &q) in out.iter_mut().zip(qs) {
                *o = d * f32::from((q >> shift) & 0xF) - m;
            }
        }
        KQuant::Q5K => {
            let (d, m) = scale_min(b, s);
            let qh = &b[16..48];
            let (qs, shift) = (&b[48 + 32 * (s / 2)..][..32], 4 * (s & 1));
            for ((o, &q), &h) in out.iter_mut().zip(qs).zip(qh) {
                let v = ((q >> shift) & 0xF) | (((h >> s) & 1) << 4);
                *o = d * f32::from(v) - m;
            }
        }
        KQuant::Q6K => {
            // Half `n` of 128 weights, quarter `k` of 32 within it.
            let (n, k) = (s / 4, s % 4);
            let ql = &b[64 * n + 32 * (k & 1)..][..32];
            let qh = &b[128 + 32 * n..][..32];
            let sc = &b[192 + 8 * n + 2 * k..][..2];
            let d = f16_at(b, 208);
            for (l, o) in out.iter_mut().enumerate() {
                let lo = (ql[l] >> (4 * (k >> 1))) & 0xF;
                let hi = (qh[l] >> (2 * k)) & 3;
                let q = i32::from(lo | (hi << 4)) - 32;
                *o = d * f32::from(sc[l / 16] as i8) * q as f32;
            }
        }
        KQuant::Q8K => {
            let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            for (o, &q) in out.iter_mut().zip(&b[4 + 32 * s..][..32]) {
                *o = d * f32::from(q as i8);
            }
        }
    }
}

/// Dequantizes `out.len()` (a multiple of 256) weights of `ty` from `src`.
pub fn dequantize(ty: KQuant, src: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(QK_K).zip(src.chunks_exact(ty.block_bytes())) {
        for (s, o) in o.chunks_exact_mut(32).enumerate() {
            let o: &mut [f32; 32] = o.try_into().unwrap_or_else(|_| unreachable!("chunks of 32"));
            sub_block(ty, b, s, o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_ggml() {
        assert_eq!((Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q8_K_BYTES), (144, 176, 210, 292));
    }

    #[test]
    fn packed_scales_unpack_as_ggml() {
        // Bytes 0..4: scale low 6 bits + top bits of scales 4..8; 4..8: minimums (+ top
        // bits of minimums 4..8); 8..12: low nibbles of scales/minimums 4..8.
        let q = [0xC1, 0x42, 0x03, 0x84, 0xC5, 0x06, 0x47, 0x08, 0x9A, 0x0B, 0xFC, 0x3D];
        assert_eq!(scale_min_k4(0, &q), (1, 5));
        assert_eq!(scale_min_k4(3, &q), (4, 8));
        // j = 4: scale = (q[8] & 0xF) | (q[0] >> 6) << 4 = 0xA | 0x30; min = q[8] >> 4 | (q[4] >> 6) << 4.
        assert_eq!(scale_min_k4(4, &q), (0x3A, 0x39));
        assert_eq!(scale_min_k4(5, &q), (0x1B, 0x00));
    }

    #[test]
    fn q6_k_constant_block() {
        // All quants 0b100000 = 32 (value 0) except the first weight: ql = 1 → q = 1 - 32.
        let mut b = vec![0u8; Q6_K_BYTES];
        for h in &mut b[128..192] {
            *h = 0b1010_1010;
        }
        b[0] = 1;
        for (i, s) in b[192..208].iter_mut().enumerate() {
            *s = (i as i8 - 8) as u8;
        }
        b[208..210].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        let mut out = vec![0f32; QK_K];
        dequantize(KQuant::Q6K, &b, &mut out);
        // 0.5 · sc[0] (= -8) · (33 - 32): ql low nibble 1, qh bits 10 → 0b100001 = 33.
        assert_eq!(out[0], 0.5 * -8.0 * 1.0);
        assert!(out[1..].iter().all(|&v| v == 0.0));
    }
}
