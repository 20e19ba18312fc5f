//! GGML tensor types and their dequantization to f32, bit-exact with ggml's reference
//! `dequantize_row_*` (ggml-quants.c): blocks of 32 weights with an f16 scale (and an f16
//! minimum for Q4_1/Q5_1, a 32-bit mask of fifth bits for Q5_0/Q5_1), and the K-quant
//! super-blocks of 256 ([`super::dequant_k`]).

use half::{bf16, f16};

use super::dequant_k::{self, KQuant, QK_K};

/// Weights per quantization block (QK4_0 = QK4_1 = QK8_0 = 32).
pub const QK: usize = 32;

/// The GGML tensor types Prism reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgmlType {
    /// 4-byte float.
    F32,
    /// IEEE half.
    F16,
    /// bfloat16.
    Bf16,
    /// 32 × i8 with an f16 scale: 34 bytes per block.
    Q8_0,
    /// 32 × 4-bit (offset 8) with an f16 scale: 18 bytes per block.
    Q4_0,
    /// 32 × 4-bit with f16 scale and f16 minimum: 20 bytes per block.
    Q4_1,
    /// 32 × 5-bit (offset 16) with an f16 scale: 22 bytes per block.
    Q5_0,
    /// 32 × 5-bit with f16 scale and f16 minimum: 24 bytes per block.
    Q5_1,
    /// K-quant super-block of 256 4-bit weights: 144 bytes.
    Q4K,
    /// K-quant super-block of 256 5-bit weights: 176 bytes.
    Q5K,
    /// K-quant super-block of 256 6-bit weights: 210 bytes.
    Q6K,
    /// K-quant super-block of 256 8-bit weights: 292 bytes.
    Q8K,
}

impl GgmlType {
    /// From the GGUF type id (`ggml_type` enum); `None` for types Prism does not read.
    pub fn from_id(id: u32) -> Option<Self> {
        Some(match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            12 => Self::Q4K,
            13 => Self::Q5K,
            14 => Self::Q6K,
            15 => Self::Q8K,
            30 => Self::Bf16,
            _ => return None,
        })
    }

    /// `(elements per block, bytes per block)`.
    pub fn block_layout(self) -> (usize, usize) {
        match self {
            Self::F32 => (1, 4),
            Self::F16 | Self::Bf16 => (1, 2),
            Self::Q8_0 => (QK, 2 + QK),
            Self::Q4_0 => (QK, 2 + QK / 2),
            Self::Q4_1 => (QK, 4 + QK / 2),
            Self::Q5_0 => (QK, 6 + QK / 2),
            Self::Q5_1 => (QK, 8 + QK / 2),
            Self::Q4K | Self::Q5K | Self::Q6K | Self::Q8K => (QK_K, self.k_quant().map_or(0, KQuant::block_bytes)),
        }
    }

    /// ggml's name for the type (`"Q4_K"`, `"F16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "F32",
            Self::F16 => "F16",
            Self::Bf16 => "BF16",
            Self::Q8_0 => "Q8_0",
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q5_0 => "Q5_0",
            Self::Q5_1 => "Q5_1",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
            Self::Q8K => "Q8_K",
        }
    }

    /// The K-quant format of a super-block type.
    pub fn k_quant(self) -> Option<KQuant> {
        match self {
            Self::Q4K => Some(KQuant::Q4K),
            Self::Q5K => Some(KQuant::Q5K),
            Self::Q6K => Some(KQuant::Q6K),
            Self::Q8K => Some(KQuant::Q8K),
            _ => None,
        }
    }

    /// Bytes needed for `n` elements, `None` when `n` is not a whole number of blocks.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        let (per, bytes) = self.block_layout();
        if !n.is_multiple_of(per) {
            return None;
        }
        (n / per).checked_mul(bytes)
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// Weights `j` and `j + 16` of a Q5_0/Q5_1 block: low/high nibble of `qs[j]`, fifth bits
/// `j` and `j + 16` of the little-endian `qh` (ggml's `xh_0`, `xh_1`).
#[inline(always)]
fn q5_pair(qh: u32, qs: &[u8], j: usize) -> (u8, u8) {
    let h0 = ((qh >> j) << 4) as u8 & 0x10;
    let h1 = (qh >> (j + 12)) as u8 & 0x10;
    ((qs[j] & 0x0F) | h0, (qs[j] >> 4) | h1)
}

/// Dequantizes `out.len()` elements of type `ty` from `src` (exactly
/// `ty.bytes_for(out.len())` bytes; the caller checks sizes).
pub fn dequantize(ty: GgmlType, src: &[u8], out: &mut [f32]) {
    match ty {
        GgmlType::F32 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Bf16 => {
            for (o, c) in out.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        GgmlType::Q8_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(2 + QK)) {
                let d = f16_at(b, 0);
                for (x, &q) in o.iter_mut().zip(&b[2..]) {
                    *x = f32::from(q as i8) * d;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(2 + QK / 2)) {
                let d = f16_at(b, 0);
                let qs = &b[2..];
                for j in 0..QK / 2 {
                    o[j] = (i32::from(qs[j] & 0x0F) - 8) as f32 * d;
                    o[j + QK / 2] = (i32::from(qs[j] >> 4) - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(4 + QK / 2)) {
                let d = f16_at(b, 0);
                let m = f16_at(b, 2);
                let qs = &b[4..];
                for j in 0..QK / 2 {
                    o[j] = f32::from(qs[j] & 0x0F) * d + m;
                    o[j + QK / 2] = f32::from(qs[j] >> 4) * d + m;
                }
            }
        }
        GgmlType::Q5_0 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(6 + QK / 2)) {
                let d = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for j in 0..QK / 2 {
                    let (x0, x1) = q5_pair(qh, &b[6..], j);
                    o[j] = (i32::from(x0) - 16) as f32 * d;
                    o[j + QK / 2] = (i32::from(x1) - 16) as f32 * d;
                }
            }
        }
        GgmlType::Q5_1 => {
            for (o, b) in out.chunks_exact_mut(QK).zip(src.chunks_exact(8 + QK / 2)) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
                for j in 0..QK / 2 {
                    let (x0, x1) = q5_pair(qh, &b[8..], j);
                    o[j] = f32::from(x0) * d + m;
                    o[j + QK / 2] = f32::from(x1) * d + m;
                }
            }
        }
        GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K | GgmlType::Q8K => {
            if let Some(k) = ty.k_quant() {
                dequant_k::dequantize(k, src, out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(x: f32) -> [u8; 2] {
        f16::from_f32(x).to_le_bytes()
    }

    #[test]
    fn q8_0_block() {
        let mut b = h(0.5).to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q8_0, &b, &mut out);
        assert_eq!(out[0], -8.0);
        assert_eq!(out[16], 0.0);
        assert_eq!(out[31], 7.5);
    }

    #[test]
    fn q4_0_block() {
        let mut b = h(2.0).to_vec();
        // low nibble j, high nibble 15 - j
        b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_0, &b, &mut out);
        assert_eq!(out[0], -16.0); // (0 - 8) * 2
        assert_eq!(out[15], 14.0); // (15 - 8) * 2
        assert_eq!(out[16], 14.0); // high nibble of byte 0 = 15
        assert_eq!(out[31], -16.0);
    }

    #[test]
    fn q4_1_block() {
        let mut b = h(0.25).to_vec();
        b.extend(h(-1.0));
        b.extend((0..16u8).map(|j| j | (3 << 4)));
        let mut out = [0f32; 32];
        dequantize(GgmlType::Q4_1, &b, &mut out);
        assert_eq!(out[0], -1.0);
        assert_eq!(out[15], 15.0 * 0.25 - 1.0);
        assert_eq!(out[16], 3.0 * 0.25 - 1.0);
    }

    #[test]
    fn float_types() {
        let mut out = [0f32; 2];
        dequantize(GgmlType::F16, &[h(1.5), h(-0.125)].concat(), &mut out);
        assert_eq!(out, [1.5, -0.125]);
        let bf: Vec<u8> = [bf16::from_f32(3.0), bf16::from_f32(-2.5)].iter().flat_map(|x| x.to_le_bytes()).collect();
        dequantize(GgmlType::Bf16, &bf, &mut out);
        assert_eq!(out, [3.0, -2.5]);
        let f: Vec<u8> = [1.25f32, 7.0].iter().flat_map(|x| x.to_le_bytes()).collect();
        dequantize(GgmlType::F32, &f, &mut out);
        assert_eq!(out, [1.25, 7.0]);
    }

    #[test]
    fn sizes() {
        assert_eq!(GgmlType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(GgmlType::Q8_0.bytes_for(33), None);
        assert_eq!(GgmlType::from_id(3), Some(GgmlType::Q4_1));
        assert_eq!(GgmlType::from_id(12), Some(GgmlType::Q4K));
        assert_eq!(GgmlType::Q6K.bytes_for(512), Some(420));
        assert_eq!(GgmlType::Q4K.bytes_for(640), None);
        // Q2_K and Q3_K, IQ formats and ids past the enum are not read.
        assert_eq!(GgmlType::from_id(10), None);
        assert_eq!(GgmlType::from_id(11), None);
        assert_eq!(GgmlType::from_id(99), None);
    }
}
