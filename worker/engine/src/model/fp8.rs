//! FP8 numbers and FP8 weights: the OCP 8-bit floating point formats (OFP8, "OCP 8-bit
//! Floating Point Specification" v1.0, 2023) that Hopper tensor cores and the Hugging Face /
//! vLLM / compressed-tensors checkpoints use, and the scales that turn stored codes back into
//! weights.
//!
//! - E4M3 (`float8_e4m3fn`, safetensors `F8_E4M3`): 1 sign, 4 exponent (bias 7), 3 mantissa
//!   bits; no infinities, `S.1111.111` is NaN, largest finite ±448, smallest subnormal 2⁻⁹.
//! - E5M2 (`float8_e5m2`, safetensors `F8_E5M2`): the upper byte of an IEEE half; read only.
//!
//! [`e4m3_to_f32`] is a table lookup (every code is exact in f32); [`f32_to_e4m3`] rounds to
//! nearest, ties to even, and saturates finite values and infinities to ±448 (what
//! quantizers do by clamping to the format's range before casting). The weight `w` of an FP8
//! checkpoint is `e4m3_to_f32(code) * scale`, the scale per tensor, per output channel (row)
//! or per `[block_rows, block_cols]` block ([`Fp8Scales`]).

use half::f16;

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The E4M3 NaN code with the sign bit clear (`0x7f`; `0xff` is NaN too).
pub const E4M3_NAN: u8 = 0x7f;

/// Every E4M3 code's value, built from the bit layout at compile time.
static E4M3_TABLE: [f32; 256] = e4m3_table();

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut code = 0usize;
    while code < 256 {
        let sign = ((code as u32) >> 7) << 31;
        let exp = ((code >> 3) & 0xf) as u32;
        let man = (code & 0x7) as u32;
        let bits = if exp == 0xf && man == 0x7 {
            sign | 0x7fc0_0000
        } else if exp == 0 {
            if man == 0 {
                sign
            } else {
                // Subnormal man · 2⁻⁹: normalise around man's leading bit p (0..=2).
                let p = 31 - man.leading_zeros();
                sign | ((p + 127 - 9) << 23) | ((man - (1 << p)) << (23 - p))
            }
        } else {
            sign | ((exp + 127 - 7) << 23) | (man << 20)
        };
        t[code] = f32::from_bits(bits);
        code += 1;
    }
    t
}

/// The value of an E4M3 code (exact; NaN for `0x7f` and `0xff`).
#[inline]
pub fn e4m3_to_f32(code: u8) -> f32 {
    E4M3_TABLE[code as usize]
}

/// The value of an E5M2 code (exact: E5M2 is the upper byte of an IEEE half).
#[inline]
pub fn e5m2_to_f32(code: u8) -> f32 {
    f16::from_bits(u16::from(code) << 8).to_f32()
}

/// The E4M3 code nearest to `x`, ties to even; finite values beyond ±448 and infinities
/// saturate to ±448, NaN gives the NaN code with `x`'s sign.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 31) as u8) << 7;
    let a = x.abs();
    if a.is_nan() {
        return sign | E4M3_NAN;
    }
    // 2⁹ and above (infinity included) rounds past 448 whatever the mantissa.
    if a >= 512.0 {
        return sign | 0x7e;
    }
    if a < 1.0 / 64.0 {
        // Subnormal range (below 2⁻⁶): a · 2⁹ is exact, its rounding is the code (8 is 2⁻⁶,
        // the smallest normal, whose code is also 8).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let exp = (a.to_bits() >> 23) as i32 - 127; // -6..=8
    let man = a.to_bits() & 0x7f_ffff;
    let keep = man >> 20;
    let rest = man & 0xf_ffff;
    let up = rest > 0x8_0000 || (rest == 0x8_0000 && keep & 1 == 1);
    // A carry out of the mantissa moves to the next exponent, as the encoding wants.
    let code = (((exp + 7) as u32) << 3) + keep + u32::from(up);
    sign | code.min(0x7e) as u8
}

/// Per-row quantization of `x [rows, cols]` (bf16 values held as f32) to (e4m3 codes, one f32
/// scale per row): `scale = max|row| / 448` (1 for an all-zero row), `code = e4m3(x · (1 /
/// scale))` in f32. vLLM's per-output-channel weight rule (`--quantization fp8`) and its
/// per-token dynamic activation rule; the CUDA backend's kernel (`backend/cuda/fp8.rs`) and
/// `scripts/quantize_fp8.py` compute exactly this.
pub fn quantize_rows(x: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / cols.max(1));
    for row in x.chunks(cols.max(1)) {
        let m = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if m > 0.0 { m / E4M3_MAX } else { 1.0 };
        let inv = 1.0 / s;
        codes.extend(row.iter().map(|&v| f32_to_e4m3(v * inv)));
        scales.push(s);
    }
    (codes, scales)
}

/// Which FP8 format a weight is stored in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Format {
    /// `F8_E4M3` (`float8_e4m3fn`).
    E4M3,
    /// `F8_E5M2` (`float8_e5m2`).
    E5M2,
}

impl Fp8Format {
    /// The value of `code` in this format.
    #[inline]
    pub fn to_f32(self, code: u8) -> f32 {
        match self {
            Self::E4M3 => e4m3_to_f32(code),
            Self::E5M2 => e5m2_to_f32(code),
        }
    }
}

/// The scales of an FP8 weight `[out_features, in_features]`: `w[r][c] = code[r][c] · s`.
#[derive(Clone, Debug, PartialEq)]
pub enum Fp8Scales {
    /// One scale for the whole matrix (a `[]` or `[1]` scale tensor).
    PerTensor(f32),
    /// One scale per output row, `out_features` values (a `[out]` or `[out, 1]` scale tensor).
    PerChannel(Vec<f32>),
    /// One scale per `block[0] × block[1]` block (`weight_block_size`, DeepSeek-V3's layout):
    /// `scales` is row-major `[ceil(out / block[0]), ceil(in / block[1])]`; edge blocks are
    /// partial.
    Block {
        /// `[block_rows, block_cols]`.
        block: [usize; 2],
        /// `ceil(in_features / block[1])` values per block row.
        scales: Vec<f32>,
    },
}

impl Fp8Scales {
    /// The scale of weight `[r][c]` in a matrix of `in_features` columns.
    #[inline]
    pub fn at(&self, r: usize, c: usize, in_features: usize) -> f32 {
        match self {
            Self::PerTensor(s) => *s,
            Self::PerChannel(s) => s[r],
            Self::Block { block, scales } => scales[(r / block[0]) * in_features.div_ceil(block[1]) + c / block[1]],
        }
    }
}

/// An FP8 linear weight as stored: the codes (borrowed from the mmapped file), its shape and
/// scales, and the static activation scale when the checkpoint has one (`input_scale`; the
/// CPU backend dequantizes weights and does not use it).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Weight<'a> {
    /// Storage format of `bytes`.
    pub format: Fp8Format,
    /// `out_features · in_features` codes, row-major.
    pub bytes: &'a [u8],
    /// `[out_features, in_features]`.
    pub shape: [usize; 2],
    /// How codes scale to weights.
    pub scales: Fp8Scales,
    /// Per-tensor static activation scale (`input_scale`), when stored.
    pub input_scale: Option<f32>,
}

impl Fp8Weight<'_> {
    /// Appends `w[r][c]` for `r` in `rows`, `c` in `cols` to `out` (row by row), each value
    /// `code · scale` computed in f32 — exactly the product, so every backend that
    /// dequantizes gets the same weights. Ranges must lie inside `shape`.
    pub fn dequantize_block(&self, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>, out: &mut Vec<f32>) {
        let inp = self.shape[1];
        out.reserve(rows.len() * cols.len());
        for r in rows {
            let row = &self.bytes[r * inp..(r + 1) * inp];
            let row_scale = match &self.scales {
                Fp8Scales::PerTensor(s) => Some(*s),
                Fp8Scales::PerChannel(s) => Some(s[r]),
                Fp8Scales::Block { .. } => None,
            };
            match row_scale {
                Some(s) => out.extend(row[cols.clone()].iter().map(|&q| self.format.to_f32(q) * s)),
                None => out.extend(cols.clone().map(|c| self.format.to_f32(row[c]) * self.scales.at(r, c, inp))),
            }
        }
    }

    /// The whole weight in f32, `out_features · in_features` values.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = Vec::new();
        self.dequantize_block(0..self.shape[0], 0..self.shape[1], &mut out);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_e4m3_encodings() {
        let table: [(u8, f32); 16] = [
            (0x00, 0.0),
            (0x01, 1.0 / 512.0), // smallest subnormal 2⁻⁹
            (0x02, 2.0 / 512.0),
            (0x07, 7.0 / 512.0), // largest subnormal
            (0x08, 1.0 / 64.0),  // smallest normal 2⁻⁶
            (0x0f, 1.875 / 64.0),
            (0x30, 0.5),
            (0x38, 1.0),
            (0x39, 1.125),
            (0x3c, 1.5),
            (0x40, 2.0),
            (0x50, 8.0),
            (0x77, 240.0),
            (0x7e, 448.0),
            (0xb8, -1.0),
            (0xfe, -448.0),
        ];
        for (code, value) in table {
            assert_eq!(e4m3_to_f32(code), value, "code {code:#04x}");
            assert_eq!(f32_to_e4m3(value), code, "value {value}");
        }
        assert_eq!(e4m3_to_f32(0x80).to_bits(), (-0.0f32).to_bits());
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        assert_eq!(f32_to_e4m3(f32::NAN), 0x7f);
        assert_eq!(f32_to_e4m3(-f32::NAN), 0xff);
        // 0x78..0x7e are finite (E4M3 has no infinities): 256, 288, ..., 448.
        assert_eq!(e4m3_to_f32(0x78), 256.0);
        assert_eq!(e4m3_to_f32(0x7d), 416.0);
    }

    #[test]
    fn every_code_round_trips() {
        for code in 0..=255u8 {
            let v = e4m3_to_f32(code);
            if code & 0x7f == 0x7f {
                assert!(v.is_nan());
                assert_eq!(f32_to_e4m3(v) & 0x7f, 0x7f, "NaN code {code:#04x}");
            } else {
                assert_eq!(f32_to_e4m3(v), code, "code {code:#04x} = {v}");
            }
        }
    }

    #[test]
    fn rounding_is_nearest_even_and_saturates() {
        // Ties: 1.0625 lies between 1.0 (mantissa 0) and 1.125 (1): to 1.0; 1.1875 between
        // 1.125 and 1.25 (2): to 1.25; half the smallest subnormal ties to 0.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3a);
        assert_eq!(f32_to_e4m3(1.0 / 1024.0), 0x00);
        assert_eq!(f32_to_e4m3(3.0 / 1024.0), 0x02);
        assert_eq!(f32_to_e4m3(1.0 / 1024.0 + 1e-7), 0x01);
        // The largest subnormal rounds up into the smallest normal.
        assert_eq!(f32_to_e4m3(7.5 / 512.0), 0x08);
        // Above 448: saturate (there is no 480), including infinities.
        for v in [448.5, 463.9, 464.0, 479.0, 480.0, 1.0e6, f32::MAX, f32::INFINITY] {
            assert_eq!(f32_to_e4m3(v), 0x7e, "{v}");
            assert_eq!(f32_to_e4m3(-v), 0xfe, "-{v}");
        }
        // Below half the smallest subnormal: zero with the sign kept.
        assert_eq!(f32_to_e4m3(1.0e-30), 0x00);
        assert_eq!(f32_to_e4m3(-1.0e-30), 0x80);
    }

    /// The nearest finite code by search over the table, ties to the even code.
    fn nearest_by_search(x: f32) -> u8 {
        let mut best = 0u8;
        let mut best_d = f64::INFINITY;
        for code in (0..=255u8).filter(|c| c & 0x7f != 0x7f) {
            let d = (f64::from(e4m3_to_f32(code)) - f64::from(x)).abs();
            if d < best_d
                || (d == best_d && code & 1 == 0 && e4m3_to_f32(code).is_sign_negative() == x.is_sign_negative())
            {
                best = code;
                best_d = d;
            }
        }
        best
    }

    #[test]
    fn encoding_is_the_nearest_code_over_the_range() {
        // Every midpoint between neighbouring codes, and points just either side of it.
        let mut values: Vec<f32> = Vec::new();
        for code in 0..0x7eu8 {
            let (a, b) = (e4m3_to_f32(code), e4m3_to_f32(code + 1));
            let mid = (a + b) / 2.0;
            values.extend([mid, mid.next_up(), mid.next_down(), a, b]);
        }
        // Pseudo-random values over the whole finite range.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            values.push(
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 900.0 * ((state & 0xff) as f32 / 255.0).powi(8),
            );
        }
        for v in values.into_iter().filter(|v| v.abs() <= 448.0) {
            for x in [v, -v] {
                assert_eq!(f32_to_e4m3(x), nearest_by_search(x), "{x}");
            }
        }
    }

    #[test]
    fn e5m2_is_the_upper_half_byte() {
        assert_eq!(e5m2_to_f32(0x3c), 1.0);
        assert_eq!(e5m2_to_f32(0x01), 1.0 / 65_536.0);
        assert_eq!(e5m2_to_f32(0x7b), 57_344.0);
        assert_eq!(e5m2_to_f32(0x7c), f32::INFINITY);
        assert_eq!(e5m2_to_f32(0xc0), -2.0);
        assert!(e5m2_to_f32(0x7d).is_nan());
    }

    #[test]
    fn block_scales_cover_partial_edge_blocks() {
        // 3 x 5 weight, 2 x 2 blocks: a 2 x 3 grid of scales.
        let bytes: Vec<u8> = (0..15).map(|i| f32_to_e4m3(i as f32)).collect();
        let scales = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let w = Fp8Weight {
            format: Fp8Format::E4M3,
            bytes: &bytes,
            shape: [3, 5],
            scales: Fp8Scales::Block { block: [2, 2], scales },
            input_scale: None,
        };
        let full = w.dequantize();
        let grid = |r: usize, c: usize| [1.0, 2.0, 3.0, 4.0, 5.0, 6.0][(r / 2) * 3 + c / 2];
        for r in 0..3 {
            for c in 0..5 {
                assert_eq!(full[r * 5 + c], e4m3_to_f32(bytes[r * 5 + c]) * grid(r, c), "[{r}][{c}]");
            }
        }
        let mut part = Vec::new();
        w.dequantize_block(1..3, 2..5, &mut part);
        let want: Vec<f32> = (1..3).flat_map(|r| full[r * 5 + 2..r * 5 + 5].to_vec()).collect();
        assert_eq!(part, want);
        let per_channel = Fp8Weight { scales: Fp8Scales::PerChannel(vec![0.5, 2.0, -1.0]), ..w.clone() };
        assert_eq!(per_channel.dequantize()[5..10], [5.0, 6.0, 7.0, 8.0, 9.0].map(|v: f32| v * 2.0));
    }
}
