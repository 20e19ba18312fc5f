//! Matrix products with 8-bit activations, computed as ggml's CPU backend (llama.cpp)
//! computes them: each activation row is quantized per block — Q8_0 (32 values, an f16
//! scale) for Q4_0/Q5_0/Q8_0 weights, Q8_K (256 values, an f32 scale and sixteen sums of
//! 16) for Q4_K/Q5_K/Q6_K — and every output is an integer dot product per block scaled in
//! f32. The float arithmetic follows ggml's AVX2 `ggml_vec_dot_*` kernels step for step:
//! eight f32 lanes, lane `l` holding the integer sum of elements `4l..4l + 4` of each
//! group of 32, one FMA per block (Q8_0) or super-block (Q8_K) with the product of the two
//! scales, ggml's lane reduction, and the minimum terms of Q4_K (four lanes) and Q5_K (one
//! sum). The result is therefore what llama.cpp computes for the same activations, not the
//! f32 product of the dequantized weight (see [`super`] for that path).
//!
//! [`quantize`] writes the activation blocks; [`dot_scalar`] is the portable kernel (and
//! the tests' reference); `q8_avx2` and `q8_avx512` hold the AVX2 and AVX-512 kernels,
//! which give the same bits.

use super::job::reduce_lanes;
use super::k4::k4_scales_mins;
use crate::model::gguf::dequant::{GgmlType, QK};
use crate::model::gguf::dequant_k::QK_K;

/// The activation block format a weight format is multiplied with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActBlocks {
    /// 32 values, scale `max|x| / 127` stored as f16 (ggml's AVX2 `quantize_row_q8_0`).
    Q8_0,
    /// 256 values, scale `1 / (-127 / x_max)` in f32 (`quantize_row_q8_K_ref`), plus the
    /// sums of each 16 quants.
    Q8K,
}

impl ActBlocks {
    /// The activation blocks ggml pairs with weights of `fmt` (its `vec_dot_type`), for
    /// the formats this path implements.
    pub fn for_format(fmt: GgmlType) -> Option<Self> {
        match fmt {
            GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => Some(Self::Q8_0),
            GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K => Some(Self::Q8K),
            _ => None,
        }
    }

    /// Values per block.
    pub fn block(self) -> usize {
        match self {
            Self::Q8_0 => QK,
            Self::Q8K => QK_K,
        }
    }
}

/// `n` activation rows of `inp` values quantized to [`ActBlocks`].
#[derive(Debug, Default)]
pub struct QuantRows {
    /// Values per row.
    pub inp: usize,
    /// `[n, inp]` quants.
    pub qs: Vec<i8>,
    /// `[n, inp / block]` block scales (as f32; Q8_0's are f16 values).
    pub d: Vec<f32>,
    /// `[n, inp / 16]` sums of each 16 quants (Q8_K only).
    pub bsums: Vec<i16>,
}

impl QuantRows {
    /// Row `t`'s quants, scales and sums.
    pub fn row(&self, t: usize, kind: ActBlocks) -> (&[i8], &[f32], &[i16]) {
        let nb = self.inp / kind.block();
        let bs = if kind == ActBlocks::Q8K { self.inp / 16 } else { 0 };
        (&self.qs[t * self.inp..][..self.inp], &self.d[t * nb..][..nb], &self.bsums[t * bs..][..bs])
    }
}

/// ggml's `nearest_int`: round to nearest, ties to even, through the 1.5·2²³ trick.
#[inline(always)]
fn nearest_int(v: f32) -> i32 {
    let f = v + 12_582_912.0;
    (f.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// Quantizes the `n` rows of `x` (`[n, inp]`, `inp` a multiple of the block) into `out`.
pub fn quantize(x: &[f32], n: usize, inp: usize, kind: ActBlocks, out: &mut QuantRows) {
    let block = kind.block();
    out.inp = inp;
    out.qs.resize(n * inp, 0);
    out.d.resize(n * inp / block, 0.0);
    out.bsums.resize(if kind == ActBlocks::Q8K { n * inp / 16 } else { 0 }, 0);
    match kind {
        ActBlocks::Q8_0 => {
            for ((xb, qb), d) in x.chunks_exact(QK).zip(out.qs.chunks_exact_mut(QK)).zip(&mut out.d) {
                let max = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                *d = half::f16::from_f32(max / 127.0).to_f32();
                let id = if max != 0.0 { 127.0 / max } else { 0.0 };
                for (q, &v) in qb.iter_mut().zip(xb) {
                    *q = (v * id).round_ties_even() as i8;
                }
            }
        }
        ActBlocks::Q8K => {
            let blocks = x.chunks_exact(QK_K).zip(out.qs.chunks_exact_mut(QK_K));
            for (((xb, qb), d), sums) in blocks.zip(&mut out.d).zip(out.bsums.chunks_exact_mut(QK_K / 16)) {
                let (mut max, mut amax) = (0f32, 0f32);
                for &v in xb {
                    if v.abs() > amax {
                        (amax, max) = (v.abs(), v);
                    }
                }
                if amax == 0.0 {
                    *d = 0.0;
                    qb.fill(0);
                    sums.fill(0);
                    continue;
                }
                let iscale = -127.0 / max;
                for (q, &v) in qb.iter_mut().zip(xb) {
                    *q = nearest_int(iscale * v).min(127) as i8;
                }
                for (s, q16) in sums.iter_mut().zip(qb.chunks_exact(16)) {
                    *s = q16.iter().map(|&q| i16::from(q)).sum();
                }
                *d = 1.0 / iscale;
            }
        }
    }
}

fn f16_at(p: &[u8], o: usize) -> f32 {
    half::f16::from_le_bytes([p[o], p[o + 1]]).to_f32()
}

/// The f16 scale and the 32 signed quants of a Q4_0/Q5_0/Q8_0 block.
pub fn block_i8(fmt: GgmlType, p: &[u8]) -> (f32, [i8; 32]) {
    let mut q = [0i8; 32];
    match fmt {
        GgmlType::Q4_0 => {
            for j in 0..16 {
                q[j] = (p[2 + j] & 0xF) as i8 - 8;
                q[j + 16] = (p[2 + j] >> 4) as i8 - 8;
            }
        }
        GgmlType::Q5_0 => {
            let qh = u32::from_le_bytes([p[2], p[3], p[4], p[5]]);
            for j in 0..16 {
                let hi = |b: usize| (((qh >> b) & 1) << 4) as u8;
                q[j] = ((p[6 + j] & 0xF) | hi(j)) as i8 - 16;
                q[j + 16] = ((p[6 + j] >> 4) | hi(j + 16)) as i8 - 16;
            }
        }
        _ => {
            for (v, &b) in q.iter_mut().zip(&p[2..34]) {
                *v = b as i8;
            }
        }
    }
    (f16_at(p, 0), q)
}

/// Quant `e` (0..256) of a K-quant super-block and its integer scale.
fn k_quant(fmt: GgmlType, p: &[u8], sc: &[u8; 8], e: usize) -> (i32, i32) {
    let (g, k) = (e / 32, e % 32);
    match fmt {
        GgmlType::Q4K => (i32::from((p[16 + 32 * (g / 2) + k] >> (4 * (g & 1))) & 0xF), i32::from(sc[g])),
        GgmlType::Q5K => {
            let lo = (p[48 + 32 * (g / 2) + k] >> (4 * (g & 1))) & 0xF;
            let hi = (p[16 + k] >> g) & 1;
            (i32::from(lo | (hi << 4)), i32::from(sc[g]))
        }
        _ => {
            let (n, c) = (g / 4, g % 4);
            let lo = (p[64 * n + 32 * (c & 1) + k] >> (4 * (c >> 1))) & 0xF;
            let hi = (p[128 + 32 * n + k] >> (2 * c)) & 3;
            let s = p[192 + 8 * n + 2 * c + k / 16] as i8;
            (i32::from(lo | (hi << 4)) - 32, i32::from(s))
        }
    }
}

/// One output: weight row `w` (blocks of `fmt`) times one quantized activation row.
pub fn dot_scalar(fmt: GgmlType, w: &[u8], qs: &[i8], d: &[f32], bsums: &[i16]) -> f32 {
    let bb = fmt.block_layout().1;
    let mut acc = [0f32; 8];
    match ActBlocks::for_format(fmt) {
        Some(ActBlocks::Q8_0) => {
            for (b, p) in w.chunks_exact(bb).enumerate() {
                let (wd, wq) = block_i8(fmt, p);
                let dd = wd * d[b];
                let y = &qs[b * QK..][..QK];
                for (l, a) in acc.iter_mut().enumerate() {
                    let s: i32 = (4 * l..4 * l + 4).map(|e| i32::from(wq[e]) * i32::from(y[e])).sum();
                    *a = dd.mul_add(s as f32, *a);
                }
            }
            reduce_lanes(&acc)
        }
        Some(ActBlocks::Q8K) => {
            let (mut acc_m, mut summs) = ([0f32; 4], 0f32);
            for (b, p) in w.chunks_exact(bb).enumerate() {
                let y = &qs[b * QK_K..][..QK_K];
                let (sc, mins) = match fmt {
                    GgmlType::Q6K => ([0; 8], [0; 8]),
                    _ => k4_scales_mins(p),
                };
                let mut sumi = [0i32; 8];
                for e in 0..QK_K {
                    let (q, s) = k_quant(fmt, p, &sc, e);
                    sumi[(e % 32) / 4] += s * q * i32::from(y[e]);
                }
                if fmt == GgmlType::Q6K {
                    let dd = d[b] * f16_at(p, 208);
                    for (a, &s) in acc.iter_mut().zip(&sumi) {
                        *a = dd.mul_add(s as f32, *a);
                    }
                    continue;
                }
                let (dd, dmin) = (d[b] * f16_at(p, 0), -d[b] * f16_at(p, 2));
                let bs = &bsums[b * 16..][..16];
                let s = |g: usize| i32::from(bs[2 * g]) + i32::from(bs[2 * g + 1]);
                let prod: [i32; 4] = std::array::from_fn(|k| {
                    i32::from(mins[2 * k]) * s(2 * k) + i32::from(mins[2 * k + 1]) * s(2 * k + 1)
                });
                if fmt == GgmlType::Q4K {
                    for (a, &p) in acc_m.iter_mut().zip(&prod) {
                        *a = dmin.mul_add(p as f32, *a);
                    }
                } else {
                    summs += dmin * ((prod[0] + prod[1]) + (prod[2] + prod[3])) as f32;
                }
                for (a, &s) in acc.iter_mut().zip(&sumi) {
                    *a = dd.mul_add(s as f32, *a);
                }
            }
            match fmt {
                GgmlType::Q4K => reduce_lanes(&acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3])),
                GgmlType::Q5K => reduce_lanes(&acc) + summs,
                _ => reduce_lanes(&acc),
            }
        }
        None => unreachable!("dot_scalar: {fmt:?} has no 8-bit activation path"),
    }
}

/// Rows of activations per weight-row visit in the SIMD kernels.
const TILE: usize = 4;

/// Which kernels [`run`] takes (all give the same bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kernels {
    /// [`dot_scalar`].
    Scalar,
    /// `q8_avx2` (AVX2, FMA, F16C).
    Avx2,
    /// `q8_avx512` (AVX-512F/BW/VNNI as well); `q8_avx2` for a last odd weight row of the
    /// 32-weight formats.
    Avx512,
}

impl Kernels {
    /// The fastest this CPU runs (`PRISM_CPU_NO_AVX512=1`: AVX2 at most).
    pub(super) fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::is_x86_feature_detected as has;
            if super::q8_avx512::available() {
                return Self::Avx512;
            }
            if has!("avx2") && has!("fma") && has!("f16c") {
                return Self::Avx2;
            }
        }
        Self::Scalar
    }
}

/// A weight's rows of GGUF blocks.
pub(super) struct BlockRows<'a> {
    pub bytes: &'a [u8],
    pub row_bytes: usize,
    /// Values per row.
    pub inp: usize,
    pub ty: GgmlType,
}

/// Where [`run`] writes: `y[t, j - j0]` at `y + t·stride + j - j0`.
pub(super) struct Out {
    pub y: *mut f32,
    pub stride: usize,
}

/// `y[t - t0, j - j0] = w[j] · a[t]` for rows `t0..t0 + n` of `a` and features `j0..j1`
/// of `w`, with `kernels`.
///
/// # Safety
/// `out` points at `n` rows of `out.stride` values, `j1 <= w.out`, `j1 - j0 <= out.stride`;
/// `a` holds `n` rows of `w.inp` values quantized for `w`'s format; the CPU has what
/// `kernels` needs ([`Kernels::best`] or below).
pub(super) unsafe fn run(
    w: &BlockRows<'_>,
    a: &QuantRows,
    (t0, n): (usize, usize),
    (j0, j1): (usize, usize),
    out: &Out,
    kernels: Kernels,
) {
    let Some(kind) = ActBlocks::for_format(w.ty) else { unreachable!("run: {:?} has no 8-bit path", w.ty) };
    let mut t = 0;
    #[cfg(target_arch = "x86_64")]
    if kernels != Kernels::Scalar {
        while t + TILE <= n {
            let rows: [(&[i8], &[f32], &[i16]); TILE] = std::array::from_fn(|r| a.row(t0 + t + r, kind));
            // SAFETY: rows `t..t + TILE` of `out` exist (caller); the rest as documented.
            unsafe { row_tile(w, &rows, (j0, j1), out.y.add(t * out.stride), out.stride, kernels) };
            t += TILE;
        }
        while t < n {
            let rows = [a.row(t0 + t, kind)];
            // SAFETY: as above.
            unsafe { row_tile(w, &rows, (j0, j1), out.y.add(t * out.stride), out.stride, kernels) };
            t += 1;
        }
        return;
    }
    let rb = w.row_bytes;
    for t in t..n {
        let (qs, d, bsums) = a.row(t0 + t, kind);
        for j in j0..j1 {
            // SAFETY: `y[t, j - j0]` is in bounds (caller).
            unsafe {
                *out.y.add(t * out.stride + j - j0) = dot_scalar(w.ty, &w.bytes[j * rb..(j + 1) * rb], qs, d, bsums)
            };
        }
    }
}

/// `y[r, j - j0]` for the `R` activation `rows` and features `j0..j1`: two weight rows at
/// a time with the AVX-512 kernels of the 32-weight formats, else one.
///
/// # Safety
/// As [`run`] with `kernels` not `Scalar`; `y` points at `R` rows of `stride` values.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn row_tile<const R: usize>(
    w: &BlockRows<'_>,
    rows: &[(&[i8], &[f32], &[i16]); R],
    (j0, j1): (usize, usize),
    y: *mut f32,
    stride: usize,
    kernels: Kernels,
) {
    let rb = w.row_bytes;
    let nb = w.inp / ActBlocks::for_format(w.ty).map_or(QK, ActBlocks::block);
    let wrow = |j: usize| w.bytes[j * rb..(j + 1) * rb].as_ptr();
    let put = |j: usize, r: usize, v: f32| {
        // SAFETY: `j0 <= j < j1` and `r < R`: inside `y` (caller).
        unsafe { *y.add(r * stride + j - j0) = v };
    };
    let mut j = j0;
    if kernels == Kernels::Avx512 && matches!(w.ty, GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0) {
        let yq: [*const i8; R] = std::array::from_fn(|r| rows[r].0.as_ptr());
        let yd: [*const f32; R] = std::array::from_fn(|r| rows[r].1.as_ptr());
        while j + 2 <= j1 {
            // SAFETY: rows `j` and `j + 1` exist (`j + 2 <= j1 <= w.out`); AVX-512 present.
            let o = unsafe { pair::<R>(w.ty, wrow(j), rb, nb, yq, yd) };
            for (i, r) in (0..2).flat_map(|i| (0..R).map(move |r| (i, r))) {
                put(j + i, r, o[i][r]);
            }
            j += 2;
        }
    }
    for j in j..j1 {
        // SAFETY: row `j` exists; the CPU has what `kernels` needs.
        let o = unsafe { tile::<R>(w.ty, wrow(j), nb, rows, kernels) };
        for (r, v) in o.into_iter().enumerate() {
            put(j, r, v);
        }
    }
}

/// Weight rows `w` and `w + stride` of a 32-weight format times `R` Q8_0 rows with the
/// AVX-512 kernel.
///
/// # Safety
/// AVX-512F/BW/VL/VNNI, AVX2, FMA, F16C present; two rows of `nb` blocks at `w`, `stride`
/// bytes apart; `y[r]` `32·nb` quants, `yd[r]` `nb` scales.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn pair<const R: usize>(
    fmt: GgmlType,
    w: *const u8,
    stride: usize,
    nb: usize,
    y: [*const i8; R],
    yd: [*const f32; R],
) -> [[f32; R]; 2] {
    use super::q8_avx512::{self as k, dot_q8_0};
    // SAFETY: as documented.
    unsafe {
        match fmt {
            GgmlType::Q4_0 => dot_q8_0::<k::Q40, R>(w, stride, nb, y, yd),
            GgmlType::Q5_0 => dot_q8_0::<k::Q50, R>(w, stride, nb, y, yd),
            GgmlType::Q8_0 => dot_q8_0::<k::Q80, R>(w, stride, nb, y, yd),
            _ => unreachable!("pair: {fmt:?} is not a 32-weight format"),
        }
    }
}

/// One weight row against `R` activation rows with the SIMD kernel of `fmt`.
///
/// # Safety
/// The CPU has what `kernels` (not `Scalar`) needs; `w` holds `nb` blocks of `fmt`, the
/// rows `nb` blocks each.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile<const R: usize>(
    fmt: GgmlType,
    w: *const u8,
    nb: usize,
    rows: &[(&[i8], &[f32], &[i16]); R],
    kernels: Kernels,
) -> [f32; R] {
    use super::q8_avx2::{self as k, dot_k, dot_q8_0};
    use super::q8_avx512 as wide;
    let y: [*const i8; R] = std::array::from_fn(|r| rows[r].0.as_ptr());
    let yd: [*const f32; R] = std::array::from_fn(|r| rows[r].1.as_ptr());
    let bs: [*const i16; R] = std::array::from_fn(|r| rows[r].2.as_ptr());
    let avx512 = kernels == Kernels::Avx512;
    // SAFETY: as documented.
    unsafe {
        match fmt {
            GgmlType::Q4_0 => dot_q8_0::<k::Q40, R>(w, nb, y, yd),
            GgmlType::Q5_0 => dot_q8_0::<k::Q50, R>(w, nb, y, yd),
            GgmlType::Q8_0 => dot_q8_0::<k::Q80, R>(w, nb, y, yd),
            GgmlType::Q4K if avx512 => wide::dot_k::<k::Q4K, R>(w, nb, y, yd, bs),
            GgmlType::Q5K if avx512 => wide::dot_k::<k::Q5K, R>(w, nb, y, yd, bs),
            GgmlType::Q6K if avx512 => wide::dot_k::<k::Q6K, R>(w, nb, y, yd, bs),
            GgmlType::Q4K => dot_k::<k::Q4K, R>(w, nb, y, yd, bs),
            GgmlType::Q5K => dot_k::<k::Q5K, R>(w, nb, y, yd, bs),
            GgmlType::Q6K => dot_k::<k::Q6K, R>(w, nb, y, yd, bs),
            _ => unreachable!("tile: {fmt:?} has no 8-bit activation path"),
        }
    }
}
