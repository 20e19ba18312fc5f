//! `y[n, out] = x[n, inp] · Wᵀ` for weights kept as stored: f32 rows, GGUF blocks of 32
//! (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) or K-quant super-blocks of 256 (Q4_K, Q5_K, Q6_K, Q8_K,
//! decoded as eight groups of 32), dequantized in registers to exactly the f32 values that
//! [`dequantize`] gives at load time, so a quantized weight and its load-time f32
//! dequantization produce bit-identical outputs. The design is llama.cpp's `ggml_vec_dot_*`
//! row kernels, kept in f32 arithmetic (no activation quantization) so results stay those
//! of the f32 reference.
//!
//! **Fixed accumulation order.** Every output `y[t, j]` is computed the same way whatever
//! the number of rows `n` and however the work is tiled: eight f32 lanes, lane `l`
//! accumulating `w[32b + 8s + l] · x[32b + 8s + l]` with one FMA for block `b = 0, 1, …`
//! and sub-vector `s = 0..4` in that order, then a fixed pairwise lane reduction, then the
//! (f32-only) tail of `inp % 32` elements in order. Batching, chunked prefill and
//! preemption therefore never change a row's value. Tiles (`F` weight rows × `R`
//! activation rows, `F·R = 8` independent FMA chains) only decide which outputs are
//! computed together: each weight block is decoded once per tile and used for `R` rows.
//! An AVX-512 kernel (sixteen lanes, its own fixed order) or an AVX2+FMA+F16C kernel is
//! chosen at run time (`PRISM_CPU_NO_AVX512=1` forces AVX2); the scalar fallback follows
//! the AVX2 order with `f32::mul_add`.
//!
//! Threads: rayon over chunks of output features; inside a chunk, tiles of rows outside,
//! features inside (the chunk's weights stay in cache while row tiles stream).

mod job;
mod k4;
#[cfg(target_arch = "x86_64")]
mod kscales;
pub mod q8;
#[cfg(target_arch = "x86_64")]
mod q8_avx2;
#[cfg(target_arch = "x86_64")]
mod q8_avx512;
#[cfg(test)]
mod q8_tests;

use rayon::prelude::*;

use crate::model::Linear;
use crate::model::gguf::dequant::{GgmlType, QK, dequantize};
use crate::model::gguf::dequant_k::QK_K;
use job::{Job, reduce_lanes, scalar_tail};

/// How a [`PackedWeight`] stores its rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// f32 values (any `inp`).
    F32,
    /// GGUF Q4_0 blocks (`inp` a multiple of 32).
    Q4_0,
    /// GGUF Q4_1 blocks.
    Q4_1,
    /// GGUF Q8_0 blocks.
    Q8_0,
    /// GGUF Q5_0 blocks.
    Q5_0,
    /// GGUF Q5_1 blocks.
    Q5_1,
    /// GGUF Q4_K super-blocks (`inp` a multiple of 256).
    Q4K,
    /// GGUF Q5_K super-blocks.
    Q5K,
    /// GGUF Q6_K super-blocks.
    Q6K,
    /// GGUF Q8_K super-blocks.
    Q8K,
}

impl Format {
    /// `(weights, bytes)` of one block: 32 for f32 rows and the Q*_0/Q*_1 formats, 256
    /// for the K-quants.
    fn block(self) -> (usize, usize) {
        match self {
            Self::F32 => (QK, 4 * QK),
            f => f.ggml().block_layout(),
        }
    }

    fn ggml(self) -> GgmlType {
        match self {
            Self::F32 => GgmlType::F32,
            Self::Q4_0 => GgmlType::Q4_0,
            Self::Q4_1 => GgmlType::Q4_1,
            Self::Q8_0 => GgmlType::Q8_0,
            Self::Q5_0 => GgmlType::Q5_0,
            Self::Q5_1 => GgmlType::Q5_1,
            Self::Q4K => GgmlType::Q4K,
            Self::Q5K => GgmlType::Q5K,
            Self::Q6K => GgmlType::Q6K,
            Self::Q8K => GgmlType::Q8K,
        }
    }

    fn from_ggml(ty: GgmlType) -> Option<Self> {
        match ty {
            GgmlType::Q4_0 => Some(Self::Q4_0),
            GgmlType::Q4_1 => Some(Self::Q4_1),
            GgmlType::Q8_0 => Some(Self::Q8_0),
            GgmlType::Q5_0 => Some(Self::Q5_0),
            GgmlType::Q5_1 => Some(Self::Q5_1),
            GgmlType::Q4K => Some(Self::Q4K),
            GgmlType::Q5K => Some(Self::Q5K),
            GgmlType::Q6K => Some(Self::Q6K),
            GgmlType::Q8K => Some(Self::Q8K),
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => None,
        }
    }
}

/// A `[out, inp]` weight matrix in f32 or GGUF blocks, rows stored one after another.
pub struct PackedWeight {
    out: usize,
    inp: usize,
    fmt: Format,
    /// f32 rows (`Format::F32`).
    f32: Vec<f32>,
    /// Block rows (quantized formats).
    bytes: Vec<u8>,
    /// Activations are quantized to these blocks and multiplied in integers
    /// ([`q8`], llama.cpp's arithmetic) instead of the f32 product.
    act: Option<q8::ActBlocks>,
    /// Row ranges of different block formats, each with its first output column (a fused
    /// weight whose parts differ in format but share the activation blocks); empty for a
    /// matrix of one format.
    parts: Vec<(usize, PackedWeight)>,
}

impl std::fmt::Debug for PackedWeight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedWeight").field("out", &self.out).field("inp", &self.inp).field("fmt", &self.fmt).finish()
    }
}

impl PackedWeight {
    /// Stacks the rows of `parts` (all with the same `in_features`) into one matrix, e.g.
    /// q/k/v into a fused QKV weight. Quantized parts stay quantized when all share one
    /// supported block format; otherwise everything is dequantized to f32.
    pub fn stack(parts: Vec<Linear>) -> Self {
        let inp = parts.first().map_or(0, |l| l.in_features);
        let out = parts.iter().map(|l| l.out_features).sum();
        let fmt = parts
            .iter()
            .map(|l| l.quant.as_ref().and_then(|q| Format::from_ggml(q.ty)))
            .reduce(|a, b| if a == b { a } else { None })
            .flatten()
            .filter(|f| inp.is_multiple_of(f.block().0));
        match fmt {
            Some(fmt) => {
                let (per, bb) = fmt.block();
                let mut bytes = Vec::with_capacity(out * inp / per * bb);
                for l in parts {
                    if let Some(q) = l.quant {
                        bytes.extend_from_slice(&q.bytes);
                    }
                }
                Self { out, inp, fmt, f32: Vec::new(), bytes, act: None, parts: Vec::new() }
            }
            None => {
                let mut f32 = Vec::with_capacity(out * inp);
                for l in parts {
                    match l.quant {
                        None => f32.extend_from_slice(&l.data),
                        Some(_) => f32.extend_from_slice(&l.to_f32()),
                    }
                }
                Self { out, inp, fmt: Format::F32, f32, bytes: Vec::new(), act: None, parts: Vec::new() }
            }
        }
    }

    /// As [`PackedWeight::stack`], multiplying with 8-bit activations ([`q8`]) where the
    /// parts' formats have them: parts of one format stay one matrix; parts of different
    /// formats that share the activation blocks (Q5_0 and Q8_0 q/k/v) stay separate
    /// matrices written to their own output columns. Anything else is as `stack`.
    pub fn stack_q8(parts: Vec<Linear>) -> Self {
        let act_of = |l: &Linear| {
            let fmt = l.quant.as_ref().and_then(|q| Format::from_ggml(q.ty))?;
            q8::ActBlocks::for_format(fmt.ggml()).filter(|a| l.in_features.is_multiple_of(a.block()))
        };
        let acts: Vec<_> = parts.iter().map(act_of).collect();
        let Some(Some(act)) = acts.first().copied() else { return Self::stack(parts) };
        if acts.iter().any(|a| *a != Some(act)) {
            return Self::stack(parts);
        }
        let mut whole = Self::stack(parts.clone());
        if whole.fmt != Format::F32 {
            whole.act = Some(act);
            return whole;
        }
        let (out, inp) = (whole.out, whole.inp);
        let mut col = 0;
        let parts = parts
            .into_iter()
            .map(|l| {
                let c = col;
                col += l.out_features;
                let mut p = Self::stack(vec![l]);
                p.act = Some(act);
                (c, p)
            })
            .collect();
        Self { out, inp, fmt: Format::F32, f32: whole.f32, bytes: Vec::new(), act: None, parts }
    }

    /// Output features (rows).
    pub fn out_features(&self) -> usize {
        self.out
    }

    /// Storage format.
    pub fn format(&self) -> Format {
        self.fmt
    }

    /// Bytes held by the weight.
    pub fn size_bytes(&self) -> usize {
        match self.parts.is_empty() {
            true => self.f32.len() * 4 + self.bytes.len(),
            false => self.parts.iter().map(|(_, p)| p.size_bytes()).sum(),
        }
    }

    /// The activation blocks this weight multiplies with (`None`: f32 activations).
    pub fn activation_blocks(&self) -> Option<q8::ActBlocks> {
        self.act.or_else(|| self.parts.first().and_then(|(_, p)| p.act))
    }

    /// The block rows as [`q8`] reads them.
    fn block_rows(&self) -> q8::BlockRows<'_> {
        q8::BlockRows { bytes: &self.bytes, row_bytes: self.row_bytes(), inp: self.inp, ty: self.fmt.ggml() }
    }

    fn row_bytes(&self) -> usize {
        match self.fmt {
            Format::F32 => self.inp * 4,
            f => self.inp / f.block().0 * f.block().1,
        }
    }

    /// Row `r` as f32 (an embedding lookup), exactly the load-time dequantized values.
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        match self.fmt {
            Format::F32 => out.copy_from_slice(&self.f32[r * self.inp..(r + 1) * self.inp]),
            f => {
                let rb = self.row_bytes();
                dequantize(f.ggml(), &self.bytes[r * rb..(r + 1) * rb], out);
            }
        }
    }

    fn base(&self) -> *const u8 {
        match self.fmt {
            Format::F32 => self.f32.as_ptr().cast(),
            _ => self.bytes.as_ptr(),
        }
    }
}

/// A raw output pointer shared by the rayon tasks (each writes disjoint elements).
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint columns of `y` and the owner waits for all of them.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The pointer (a method, so closures capture the `Sync` wrapper, not the field).
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avx512_k;

/// Which kernel runs (chosen once per call from the CPU's features).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Scalar,
    Avx2,
    Avx512,
}

fn best_isa() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        use std::is_x86_feature_detected as has;
        if has!("avx2") && has!("fma") && has!("f16c") {
            return if has!("avx512f") && std::env::var_os("PRISM_CPU_NO_AVX512").is_none() {
                Isa::Avx512
            } else {
                Isa::Avx2
            };
        }
    }
    Isa::Scalar
}

/// `y[n, out] = x[n, inp] · Wᵀ` (see the module docs for the accumulation order).
///
/// # Panics
/// When `x` or `y` do not have `n * inp` / `n * out` elements.
pub fn matmul(x: &[f32], n: usize, w: &PackedWeight, y: &mut [f32]) {
    assert_eq!(x.len(), n * w.inp, "matmul: x has the wrong length");
    assert_eq!(y.len(), n * w.out, "matmul: y has the wrong length");
    if n == 0 || w.out == 0 {
        return;
    }
    if w.act.is_some() || !w.parts.is_empty() {
        return matmul_q8(x, n, w, y);
    }
    let threads = rayon::current_num_threads().max(1);
    let chunk = (w.out / (threads * 8)).clamp(16, 512).next_multiple_of(8);
    let yp = OutPtr(y.as_mut_ptr());
    let isa = best_isa();
    // Long batches (prefill) go in blocks of rows so a block of activations stays in L2
    // while a chunk of weights is applied to it; a row's value does not depend on this.
    let chunks = w.out.div_ceil(chunk);
    let row_blocks = n.div_ceil(ROW_BLOCK);
    (0..chunks * row_blocks).into_par_iter().for_each(|task| {
        let (rb, c) = (task / chunks, task % chunks);
        let (t0, j0) = (rb * ROW_BLOCK, c * chunk);
        let rows = ROW_BLOCK.min(n - t0);
        let j1 = (j0 + chunk).min(w.out);
        // SAFETY: `x` holds `n * inp` values and `y` `n * out` (asserted above), so rows
        // `t0..t0 + rows` exist in both; the weight holds `out` rows of `row_bytes`; this
        // task writes only columns `j0..j1` of those rows.
        unsafe {
            let x = x.as_ptr().add(t0 * w.inp);
            run_chunk(w, x, rows, j0, j1, yp.get().add(t0 * w.out), isa);
        }
    });
}

/// Rows per task for long batches.
const ROW_BLOCK: usize = 64;

/// [`matmul`] of a weight with 8-bit activations: the rows are quantized once per
/// activation format, then each part's columns computed as in [`q8`].
fn matmul_q8(x: &[f32], n: usize, w: &PackedWeight, y: &mut [f32]) {
    let whole = [(0, w)];
    let parts: Vec<(usize, &PackedWeight)> = match w.parts.is_empty() {
        true => whole.to_vec(),
        false => w.parts.iter().map(|(c, p)| (*c, p)).collect(),
    };
    let Some(kind) = parts[0].1.act else { unreachable!("matmul_q8 without activation blocks") };
    let mut a = q8::QuantRows::default();
    q8::quantize(x, n, w.inp, kind, &mut a);
    let kernels = q8::Kernels::best();
    let threads = rayon::current_num_threads().max(1);
    let yp = OutPtr(y.as_mut_ptr());
    let out_total = w.out;
    // Every part's chunks of output features, run in one parallel region (one dispatch
    // per product, not one per part).
    let chunks: Vec<(usize, usize, usize)> = parts
        .iter()
        .enumerate()
        .flat_map(|(i, (_, p))| {
            let chunk = (p.out / (threads * 8)).clamp(16, 512).next_multiple_of(8);
            (0..p.out.div_ceil(chunk)).map(move |c| (i, c * chunk, ((c + 1) * chunk).min(p.out)))
        })
        .collect();
    let row_blocks = n.div_ceil(ROW_BLOCK);
    let a = &a;
    (0..chunks.len() * row_blocks).into_par_iter().for_each(|task| {
        let (rb, (i, j0, j1)) = (task / chunks.len(), chunks[task % chunks.len()]);
        let (col0, p) = parts[i];
        let t0 = rb * ROW_BLOCK;
        let rows = ROW_BLOCK.min(n - t0);
        // SAFETY: `y` holds `n * out` values; this task writes rows `t0..t0 + rows`,
        // columns `col0 + j0..col0 + j1`, which lie inside it; `a` holds `n` rows
        // quantized for `p`'s format; the kernels are the CPU's.
        unsafe {
            let out = q8::Out { y: yp.get().add(t0 * out_total + col0 + j0), stride: out_total };
            q8::run(&p.block_rows(), a, (t0, rows), (j0, j1), &out, kernels);
        }
    });
}

/// Computes `y[.., j0..j1]` for all `n` rows.
///
/// # Safety
/// `x` points at `n * w.inp` values, `y` at `n * w.out`, `j0 <= j1 <= w.out`.
unsafe fn run_chunk(w: &PackedWeight, x: *const f32, n: usize, j0: usize, j1: usize, y: *mut f32, isa: Isa) {
    let job = Job {
        w: w.base(),
        w_stride: w.row_bytes(),
        nblocks: w.inp / QK,
        tail: if w.fmt == Format::F32 { w.inp % QK } else { 0 },
        x,
        x_stride: w.inp,
        y,
        y_stride: w.out,
    };
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: the CPU has AVX-512F, AVX2, FMA and F16C (`best_isa`); pointers as above.
        unsafe {
            match w.fmt {
                Format::F32 => avx512::run::<avx512::F32>(&job, n, j0, j1),
                Format::Q4_0 => avx512::run::<avx512::Q40>(&job, n, j0, j1),
                Format::Q4_1 => avx512::run::<avx512::Q41>(&job, n, j0, j1),
                Format::Q8_0 => avx512::run::<avx512::Q80>(&job, n, j0, j1),
                Format::Q5_0 => avx512::run::<avx512_k::Q50>(&job, n, j0, j1),
                Format::Q5_1 => avx512::run::<avx512_k::Q51>(&job, n, j0, j1),
                Format::Q4K => avx512::run::<avx512_k::Q4K>(&job, n, j0, j1),
                Format::Q5K => avx512::run::<avx512_k::Q5K>(&job, n, j0, j1),
                Format::Q6K => avx512::run::<avx512_k::Q6K>(&job, n, j0, j1),
                Format::Q8K => avx512::run::<avx512_k::Q8K>(&job, n, j0, j1),
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        // SAFETY: the CPU has AVX2, FMA and F16C (`best_isa`); pointers as above.
        unsafe {
            match w.fmt {
                Format::F32 => avx2::run::<avx2::F32>(&job, n, j0, j1),
                Format::Q4_0 => avx2::run::<avx2::Q40>(&job, n, j0, j1),
                Format::Q4_1 => avx2::run::<avx2::Q41>(&job, n, j0, j1),
                Format::Q8_0 => avx2::run::<avx2::Q80>(&job, n, j0, j1),
                Format::Q5_0 => avx2::run::<avx2_k::Q50>(&job, n, j0, j1),
                Format::Q5_1 => avx2::run::<avx2_k::Q51>(&job, n, j0, j1),
                Format::Q4K => avx2::run::<avx2_k::Q4K>(&job, n, j0, j1),
                Format::Q5K => avx2::run::<avx2_k::Q5K>(&job, n, j0, j1),
                Format::Q6K => avx2::run::<avx2_k::Q6K>(&job, n, j0, j1),
                Format::Q8K => avx2::run::<avx2_k::Q8K>(&job, n, j0, j1),
            }
        }
        return;
    }
    // SAFETY: pointers as above.
    unsafe { scalar_run(&job, w.fmt, n, j0, j1) };
}

/// Scalar fallback with the AVX2 kernel's order.
///
/// # Safety
/// As [`run_chunk`].
unsafe fn scalar_run(job: &Job, fmt: Format, n: usize, j0: usize, j1: usize) {
    let mut wb = [0f32; QK_K];
    let (per, bb) = fmt.block();
    let wb = &mut wb[..per];
    for t in 0..n {
        // SAFETY: row `t` of `x` holds `x_stride` values.
        let x = unsafe { std::slice::from_raw_parts(job.x.add(t * job.x_stride), job.x_stride) };
        for j in j0..j1 {
            // SAFETY: row `j` of the weight holds `w_stride` bytes.
            let wrow = unsafe { std::slice::from_raw_parts(job.w.add(j * job.w_stride), job.w_stride) };
            let mut acc = [0f32; 8];
            for b in 0..job.nblocks * QK / per {
                dequantize(fmt.ggml(), &wrow[b * bb..(b + 1) * bb], wb);
                for (g, wg) in wb.chunks_exact(QK).enumerate() {
                    let xg = &x[b * per + g * QK..][..QK];
                    for s in 0..4 {
                        for (l, a) in acc.iter_mut().enumerate() {
                            let k = 8 * s + l;
                            *a = wg[k].mul_add(xg[k], *a);
                        }
                    }
                }
            }
            let mut sum = reduce_lanes(&acc);
            sum = scalar_tail(job, wrow, x, sum);
            // SAFETY: `y[t, j]` lies inside `y` and only this task writes column `j`.
            unsafe { *job.y.add(t * job.y_stride + j) = sum };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_k;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::QuantizedData;

    fn q4_1_linear(out: usize, inp: usize) -> Linear {
        let nb = out * inp / QK;
        let mut bytes = Vec::with_capacity(nb * 20);
        for b in 0..nb {
            bytes.extend(half::f16::from_f32(0.01 + (b % 7) as f32 * 0.003).to_le_bytes());
            bytes.extend(half::f16::from_f32(-0.05 - (b % 5) as f32 * 0.01).to_le_bytes());
            bytes.extend((0..16).map(|i| ((b * 31 + i * 17) % 256) as u8));
        }
        Linear {
            out_features: out,
            in_features: inp,
            data: Vec::new(),
            quant: Some(QuantizedData { ty: GgmlType::Q4_1, bytes }),
        }
    }

    fn input(n: usize, inp: usize) -> Vec<f32> {
        (0..n * inp).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect()
    }

    fn run(x: &[f32], n: usize, w: &PackedWeight) -> Vec<f32> {
        let mut y = vec![0f32; n * w.out];
        matmul(x, n, w, &mut y);
        y
    }

    #[test]
    fn close_to_f64_and_quantized_equals_its_f32_dequantization() {
        let (out, inp) = (70, 96);
        let q = q4_1_linear(out, inp);
        let f = q.clone().dequantized();
        let (pq, pf) = (PackedWeight::stack(vec![q]), PackedWeight::stack(vec![f.clone()]));
        assert_eq!((pq.format(), pf.format()), (Format::Q4_1, Format::F32));
        for n in [1, 3, 8, 13] {
            let x = input(n, inp);
            let (yq, yf) = (run(&x, n, &pq), run(&x, n, &pf));
            assert_eq!(yq, yf, "n={n}: quantized and dequantized weights must give identical values");
            for t in 0..n {
                for j in 0..out {
                    let r: f64 = (0..inp).map(|k| f64::from(x[t * inp + k]) * f64::from(f.data[j * inp + k])).sum();
                    assert!((f64::from(yq[t * out + j]) - r).abs() < 1e-4, "n={n} t={t} j={j}");
                }
            }
        }
    }

    #[test]
    fn a_row_does_not_depend_on_the_batch() {
        for (out, inp) in [(37, 96), (20, 45)] {
            let w = if inp % QK == 0 {
                q4_1_linear(out, inp)
            } else {
                Linear::new(out, inp, (0..out * inp).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect())
            };
            let w = PackedWeight::stack(vec![w]);
            let n = 70; // more than one ROW_BLOCK
            let x = input(n, inp);
            let all = run(&x, n, &w);
            for t in 0..n {
                let one = run(&x[t * inp..(t + 1) * inp], 1, &w);
                assert_eq!(one.as_slice(), &all[t * out..(t + 1) * out], "row {t} of ({out}, {inp})");
            }
            for (a, b) in [(0, 5), (5, 7), (7, 21), (21, 70)] {
                let part = run(&x[a * inp..b * inp], b - a, &w);
                assert_eq!(part.as_slice(), &all[a * out..b * out]);
            }
            // Every kernel is row-count independent, and the scalar fallback follows the
            // AVX2 kernel's order exactly.
            let isas = [Isa::Scalar, Isa::Avx2, Isa::Avx512];
            let by_isa = |isa: Isa, x: &[f32], n: usize| {
                let mut y = vec![0f32; n * out];
                // SAFETY: shapes as `matmul` checks them; only ISAs this CPU has run.
                unsafe { run_chunk(&w, x.as_ptr(), n, 0, out, y.as_mut_ptr(), isa) };
                y
            };
            let have = |isa: Isa| match (isa, best_isa()) {
                (Isa::Scalar, _) | (_, Isa::Avx512) => true,
                (Isa::Avx2, b) => b == Isa::Avx2,
                (Isa::Avx512, _) => false,
            };
            for isa in isas.into_iter().filter(|&i| have(i)) {
                let full = by_isa(isa, &x, n);
                for t in [0, 9, 20, 69] {
                    assert_eq!(
                        by_isa(isa, &x[t * inp..(t + 1) * inp], 1).as_slice(),
                        &full[t * out..(t + 1) * out],
                        "{isa:?}"
                    );
                }
            }
            if have(Isa::Avx2) {
                assert_eq!(by_isa(Isa::Scalar, &x, n), by_isa(Isa::Avx2, &x, n));
            }
        }
    }

    #[test]
    fn other_block_formats_match_their_dequantization() {
        let (out, inp) = (9, 64);
        for ty in [GgmlType::Q4_0, GgmlType::Q8_0] {
            let bb = ty.block_layout().1;
            let bytes: Vec<u8> = (0..out * inp / QK)
                .flat_map(|b| {
                    let mut v = half::f16::from_f32(0.02 + b as f32 * 0.001).to_le_bytes().to_vec();
                    v.extend((0..bb - 2).map(|i| ((b * 7 + i * 29) % 256) as u8));
                    v
                })
                .collect();
            let q = Linear {
                out_features: out,
                in_features: inp,
                data: Vec::new(),
                quant: Some(QuantizedData { ty, bytes }),
            };
            let f = q.clone().dequantized();
            let x = input(5, inp);
            let (pq, pf) = (PackedWeight::stack(vec![q.clone()]), PackedWeight::stack(vec![f]));
            assert_eq!(run(&x, 5, &pq), run(&x, 5, &pf), "{ty:?}");
            let mut row = vec![0f32; inp];
            pq.row_f32(3, &mut row);
            assert_eq!(row.as_slice(), &q.to_f32()[3 * inp..4 * inp]);
        }
    }
}

#[cfg(test)]
mod kquant_tests {
    use super::tests_support::random_linear;
    use super::*;

    const TYPES: [GgmlType; 6] =
        [GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K, GgmlType::Q8K];

    fn input(n: usize, inp: usize) -> Vec<f32> {
        (0..n * inp).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect()
    }

    fn by_isa(w: &PackedWeight, x: &[f32], n: usize, isa: Isa) -> Vec<f32> {
        let mut y = vec![0f32; n * w.out];
        // SAFETY: `x` holds `n * inp` values and `y` `n * out`; only ISAs this CPU has run.
        unsafe { run_chunk(w, x.as_ptr(), n, 0, w.out, y.as_mut_ptr(), isa) };
        y
    }

    fn isas() -> Vec<Isa> {
        match best_isa() {
            Isa::Avx512 => vec![Isa::Scalar, Isa::Avx2, Isa::Avx512],
            Isa::Avx2 => vec![Isa::Scalar, Isa::Avx2],
            Isa::Scalar => vec![Isa::Scalar],
        }
    }

    #[test]
    fn every_block_format_equals_its_f32_dequantization_on_every_kernel() {
        for ty in TYPES {
            let (out, inp) = (19, 512);
            let q = random_linear(ty, out, inp, 7);
            let f = q.clone().dequantized();
            let (pq, pf) = (PackedWeight::stack(vec![q.clone()]), PackedWeight::stack(vec![f.clone()]));
            assert_eq!(pq.format(), Format::from_ggml(ty).expect("kept quantized"), "{ty:?}");
            assert_eq!(pq.size_bytes(), q.quant.as_ref().map_or(0, |b| b.bytes.len()));
            for n in [1, 3, 8, 13] {
                let x = input(n, inp);
                let mut y = vec![0f32; n * out];
                matmul(&x, n, &pq, &mut y);
                for t in 0..n {
                    for j in 0..out {
                        let r: f64 = (0..inp).map(|k| f64::from(x[t * inp + k]) * f64::from(f.data[j * inp + k])).sum();
                        let scale: f64 = (0..inp).map(|k| (x[t * inp + k] * f.data[j * inp + k]).abs() as f64).sum();
                        let got = f64::from(y[t * out + j]);
                        assert!((got - r).abs() <= 1e-4 * scale.max(1.0), "{ty:?} n={n} t={t} j={j}: {got} vs {r}");
                    }
                }
                let mut scalar = None;
                for isa in isas() {
                    let yq = by_isa(&pq, &x, n, isa);
                    assert_eq!(yq, by_isa(&pf, &x, n, isa), "{ty:?} {isa:?} n={n}: quantized differs from f32");
                    // A row's value does not depend on the batch.
                    assert_eq!(by_isa(&pq, &x[(n - 1) * inp..], 1, isa).as_slice(), &yq[(n - 1) * out..]);
                    match isa {
                        Isa::Scalar => scalar = Some(yq),
                        Isa::Avx2 => assert_eq!(scalar.as_ref(), Some(&yq), "{ty:?}: scalar follows AVX2's order"),
                        Isa::Avx512 => {}
                    }
                }
            }
            let mut row = vec![0f32; inp];
            pq.row_f32(4, &mut row);
            assert_eq!(row.as_slice(), &f.data[4 * inp..5 * inp], "{ty:?}");
        }
    }

    #[test]
    fn fused_parts_of_one_format_stay_quantized_and_mixed_ones_fall_back_to_f32() {
        let inp = 256;
        let parts = vec![random_linear(GgmlType::Q4K, 5, inp, 1), random_linear(GgmlType::Q4K, 3, inp, 2)];
        let fused = PackedWeight::stack(parts.clone());
        assert_eq!((fused.format(), fused.out_features()), (Format::Q4K, 8));
        let mixed = PackedWeight::stack(vec![parts[0].clone(), random_linear(GgmlType::Q6K, 3, inp, 3)]);
        assert_eq!(mixed.format(), Format::F32);
        let x = input(2, inp);
        let (mut a, mut b) = (vec![0f32; 16], vec![0f32; 16]);
        matmul(&x, 2, &fused, &mut a);
        let fused_f32 = PackedWeight::stack(parts.into_iter().map(Linear::dequantized).collect());
        matmul(&x, 2, &fused_f32, &mut b);
        assert_eq!(a, b);
    }
}

#[cfg(test)]
mod bench {
    use super::*;

    #[test]
    #[ignore = "micro-benchmark"]
    fn matmul_gflops() {
        let (out, inp) = (1536, 576);
        let w = PackedWeight::stack(vec![tests_support::q4_1(out, inp)]);
        for n in [512usize, 1, 8, 32, 512, 64] {
            let x = vec![0.5f32; n * inp];
            let mut y = vec![0f32; n * out];
            let reps = (2048 / n).max(4);
            let t = std::time::Instant::now();
            for _ in 0..reps {
                matmul(&x, n, &w, &mut y);
            }
            let dt = t.elapsed().as_secs_f64();
            eprintln!("n={n}: {:.1} GFLOPS", reps as f64 * 2.0 * (n * out * inp) as f64 / dt / 1e9);
        }
    }
}

#[cfg(test)]
mod tests_support {
    use super::*;
    use crate::model::QuantizedData;

    /// Byte offsets of the f16 scale fields in one block of `ty`, and where an f32 scale
    /// sits (Q8_K).
    fn scale_fields(ty: GgmlType) -> (&'static [usize], Option<usize>) {
        match ty {
            GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q5_0 => (&[0], None),
            GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => (&[0, 2], None),
            GgmlType::Q6K => (&[208], None),
            GgmlType::Q8K => (&[], Some(0)),
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => (&[], None),
        }
    }

    /// The bytes of the f16 / f32 scale fields in one block of `ty`.
    pub(super) fn scale_offsets(ty: GgmlType) -> Vec<usize> {
        let (f16s, f32_at) = scale_fields(ty);
        let mut v: Vec<usize> = f16s.iter().flat_map(|&o| [o, o + 1]).collect();
        v.extend(f32_at.into_iter().flat_map(|o| o..o + 4));
        v
    }

    /// A `[out, inp]` weight of `ty`: pseudo-random quant bytes, small finite scales.
    pub(super) fn random_linear(ty: GgmlType, out: usize, inp: usize, seed: u64) -> Linear {
        let (per, bb) = ty.block_layout();
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (f16s, f32_at) = scale_fields(ty);
        let mut bytes = Vec::with_capacity(out * inp / per * bb);
        for _ in 0..out * inp / per {
            let mut b: Vec<u8> = (0..bb).map(|_| next() as u8).collect();
            for &o in f16s {
                let v = (next() % 1000) as f32 / 1000.0 * 0.02 - 0.01;
                b[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            }
            if let Some(o) = f32_at {
                let v = (next() % 1000) as f32 / 1000.0 * 0.002 - 0.001;
                b[o..o + 4].copy_from_slice(&v.to_le_bytes());
            }
            bytes.extend(b);
        }
        Linear { out_features: out, in_features: inp, data: Vec::new(), quant: Some(QuantizedData { ty, bytes }) }
    }

    pub(super) fn q4_1(out: usize, inp: usize) -> Linear {
        let bytes = (0..out * inp / QK * 20).map(|i| (i % 251) as u8 & 0x3b).collect();
        Linear {
            out_features: out,
            in_features: inp,
            data: Vec::new(),
            quant: Some(QuantizedData { ty: GgmlType::Q4_1, bytes }),
        }
    }
}
