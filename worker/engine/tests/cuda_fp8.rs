//! FP8 kernels on the device against host references (built with `--features cuda`; needs a
//! GPU, sm_89 or newer for the FP8 GEMM):
//! - the FP8-KV decode and prefill attention read the same cache contents as the bf16 kernels
//!   (the bf16 cache holds exactly the e4m3 values), both against an f64 host attention: the
//!   e4m3 read path adds no error of its own (one-split and split-KV decode, chunked prefill);
//! - the device quantization of a matrix equals the host rule bit for bit;
//! - the FP8 GEMM (per-token activation codes, cuBLASLt, `scale_rows_cols`) equals the exact
//!   product of the dequantized activations and weights, the FP8 GEMV and the bf16 GEMM of the
//!   dequantized weight equal the exact product of the bf16 activations and the dequantized
//!   weights, each within bf16 rounding; the GEMM-vs-GEMV difference is printed next to what
//!   per-token activation rounding alone gives on the host;
//! - the fused passes of the FP8 GEMM path: SiLU·mul and the residual add + RMSNorm reading an
//!   unscaled product (per-token × per-channel scales applied on load) and writing e4m3 rows
//!   with per-token scales equal the f64 host computation within bf16 and e4m3 rounding, and
//!   unscaled, SiLU·mul gives bit for bit the codes of `silu_mul` then the quantization.
#![cfg(feature = "cuda")]

#[path = "../examples/support/splitmix.rs"]
mod splitmix;

use cudarc::driver::PushKernelArg;
use half::bf16;
use prism_engine::backend::cuda::CudaError;
use prism_engine::backend::cuda::attn_decode::{AttnShape, DecodeArgs, DecodeAttention, MAX_SPLITS};
use prism_engine::backend::cuda::attn_prefill::{PrefillAttention, PrefillDims, PrefillPtrs, PrefillSeq};
use prism_engine::backend::cuda::device::grid_stride;
use prism_engine::backend::cuda::device::{DevBuf, GemmArgs, GemmShape, Gpu};
use prism_engine::backend::cuda::fp8::{Fp8Kernels, NormIo, ScaleArgs, SiluIo, quantize_rows};
use prism_engine::backend::cuda::gemm_fp8::{Fp8Gemm, Fp8GemmArgs};
use prism_engine::backend::cuda::gemv::{Gemv, GemvArgs, GemvKind, RopeArgs};
use prism_engine::model::fp8::{e4m3_to_f32, f32_to_e4m3};
use splitmix::Rng;

const BS: usize = 16;

fn gpu() -> Gpu {
    Gpu::new(0).expect("a CUDA device (these tests run on the GPU machine)")
}

fn bf(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}
fn from_bf(b: u16) -> f32 {
    bf16::from_bits(b).to_f32()
}

fn upload<T>(gpu: &Gpu, v: &[T]) -> Result<DevBuf, CudaError> {
    let b = DevBuf::zeroed(gpu, std::mem::size_of_val(v))?;
    gpu.upload(&b, 0, v)?;
    Ok(b)
}

fn download_bf16(gpu: &Gpu, ptr: u64, n: usize) -> Result<Vec<f32>, CudaError> {
    let mut h = vec![0u16; n];
    gpu.sync()?;
    gpu.download(&mut h, ptr)?;
    Ok(h.into_iter().map(from_bf).collect())
}

fn uniform(rng: &mut Rng, a: f32) -> f32 {
    from_bf(rng.bf(a))
}

/// A paged cache of `seqs` sequences of the given lengths: e4m3 codes and the same values as
/// bf16 (exact: every e4m3 value is a bf16 value), block tables over shuffled blocks.
struct Cache {
    kvh: usize,
    hd: usize,
    k8: Vec<u8>,
    v8: Vec<u8>,
    /// Block table offset of each sequence in `bts`.
    bt_off: Vec<usize>,
    bts: Vec<u32>,
}

impl Cache {
    fn new(rng: &mut Rng, lens: &[usize], kvh: usize, hd: usize, amp: f32) -> Self {
        let blocks: usize = lens.iter().map(|l| l.div_ceil(BS)).sum();
        let mut ids: Vec<u32> = (0..blocks as u32).collect();
        rng.shuffle(&mut ids);
        let (mut bt_off, mut bts) = (Vec::new(), Vec::new());
        for l in lens {
            bt_off.push(bts.len());
            for _ in 0..l.div_ceil(BS) {
                bts.push(ids[bts.len()]);
            }
        }
        let n = blocks * BS * kvh * hd;
        let mut code = || f32_to_e4m3(uniform(rng, amp));
        let k8: Vec<u8> = (0..n).map(|_| code()).collect();
        let v8: Vec<u8> = (0..n).map(|_| code()).collect();
        Self { kvh, hd, k8, v8, bt_off, bts }
    }

    fn slot(&self, seq: usize, p: usize) -> usize {
        self.bts[self.bt_off[seq] + p / BS] as usize * BS + p % BS
    }
    fn k(&self, seq: usize, p: usize, h: usize, d: usize) -> f64 {
        f64::from(e4m3_to_f32(self.k8[(self.slot(seq, p) * self.kvh + h) * self.hd + d]))
    }
    fn v(&self, seq: usize, p: usize, h: usize, d: usize) -> f64 {
        f64::from(e4m3_to_f32(self.v8[(self.slot(seq, p) * self.kvh + h) * self.hd + d]))
    }

    /// Device copies: (e4m3 K, e4m3 V, bf16 K, bf16 V, block tables).
    fn upload(&self, gpu: &Gpu) -> Result<[DevBuf; 5], CudaError> {
        let wide = |c: &[u8]| c.iter().map(|&x| bf(e4m3_to_f32(x))).collect::<Vec<u16>>();
        Ok([
            upload(gpu, &self.k8)?,
            upload(gpu, &self.v8)?,
            upload(gpu, &wide(&self.k8))?,
            upload(gpu, &wide(&self.v8))?,
            upload(gpu, &self.bts)?,
        ])
    }

    /// f64 attention of query `q` (head `qhead` of `g` per KV head) over positions `0..=pos`.
    fn attend(&self, seq: usize, pos: usize, qhead: usize, g: usize, q: &[f32], scale: f64) -> Vec<f64> {
        let h = qhead / g;
        let s: Vec<f64> = (0..=pos)
            .map(|p| (0..self.hd).map(|d| f64::from(q[d]) * self.k(seq, p, h, d)).sum::<f64>() * scale)
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let den: f64 = w.iter().sum();
        (0..self.hd).map(|d| (0..=pos).map(|p| w[p] * self.v(seq, p, h, d)).sum::<f64>() / den).collect()
    }
}

/// max |a − b| over the pairs.
fn max_err(a: &[f32], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (f64::from(*x) - y).abs()).fold(0.0, f64::max)
}

fn rms(v: &[f64]) -> f64 {
    (v.iter().map(|x| x * x).sum::<f64>() / v.len().max(1) as f64).sqrt()
}

/// Decode: one token per sequence at the last position of contexts from 1 to 2,500 (one split
/// and up to 16), the FP8-KV kernel and the bf16 kernel on the same values.
#[test]
fn fp8_kv_decode_attention_equals_the_bf16_kernel_on_the_same_cache_values() {
    let gpu = gpu();
    let mut rng = Rng(0x5eed_0001);
    for (qh, kvh, hd) in [(8, 2, 64), (32, 8, 128)] {
        let ctxs = [1usize, 2, 63, 64, 65, 200, 364, 1000, 2500];
        let cache = Cache::new(&mut rng, &ctxs, kvh, hd, 2.0);
        let [k8, v8, k16, v16, bts] = cache.upload(&gpu).unwrap();
        let n = ctxs.len();
        let qkv_dim = (qh + 2 * kvh) * hd;
        let qkv: Vec<u16> = (0..n * qkv_dim).map(|_| rng.bf(3.0)).collect();
        let qkv_d = upload(&gpu, &qkv).unwrap();
        let pos: Vec<u32> = ctxs.iter().map(|c| (c - 1) as u32).collect();
        let tok_bt: Vec<u32> = cache.bt_off.iter().map(|&o| o as u32).collect();
        let (pos_d, tok_bt_d) = (upload(&gpu, &pos).unwrap(), upload(&gpu, &tok_bt).unwrap());
        let scale = 1.0 / (hd as f32).sqrt();
        let g = qh / kvh;
        let mut want = Vec::new();
        for (t, &c) in ctxs.iter().enumerate() {
            for h in 0..qh {
                let q: Vec<f32> = (0..hd).map(|d| from_bf(qkv[t * qkv_dim + h * hd + d])).collect();
                want.extend(cache.attend(t, c - 1, h, g, &q, f64::from(scale)));
            }
        }
        let shape = AttnShape { q_heads: qh, kv_heads: kvh, head_dim: hd };
        let bf16_k = DecodeAttention::new(&gpu, shape, n).unwrap();
        let fp8_k = DecodeAttention::with_kv(&gpu, shape, n, true).unwrap();
        let out = DevBuf::zeroed(&gpu, n * qh * hd * 2).unwrap();
        for cap in [1, 4, MAX_SPLITS] {
            let mut errs = [0.0; 2];
            for (i, (kern, kc, vc)) in [(&bf16_k, &k16, &v16), (&fp8_k, &k8, &v8)].into_iter().enumerate() {
                gpu.fill_const(out.ptr, n * qh * hd, 1000.0).unwrap();
                let a = DecodeArgs {
                    n_tokens: n,
                    max_ctx: 2500,
                    split_cap: cap,
                    out: out.ptr,
                    qkv: qkv_d.ptr,
                    k_cache: kc.ptr,
                    v_cache: vc.ptr,
                    pos: pos_d.ptr,
                    tok_bt: tok_bt_d.ptr,
                    bts: bts.ptr,
                    block_size: BS,
                    scale,
                };
                kern.launch(&gpu, &a).unwrap();
                let got = download_bf16(&gpu, out.ptr, n * qh * hd).unwrap();
                errs[i] = max_err(&got, &want);
                // The early launch (programmatic dependent launch, metadata read and K/V
                // prefetched into L2 before the wait; a plain launch before Hopper): the same
                // values bit for bit.
                gpu.fill_const(out.ptr, n * qh * hd, 1000.0).unwrap();
                kern.launch_with(&gpu, &a, true).unwrap();
                let early = download_bf16(&gpu, out.ptr, n * qh * hd).unwrap();
                assert!(
                    got.iter().zip(&early).all(|(x, y)| x.to_bits() == y.to_bits()),
                    "early launch differs: hd {hd}, cap {cap}, kernel {i}"
                );
            }
            println!(
                "decode hd {hd} g {g} split cap {cap}: max |out - f64| bf16 kernel {:.5}, fp8-KV kernel {:.5}",
                errs[0], errs[1]
            );
            // Outputs are at most 2 in magnitude: bf16 output rounding is ≤ 2^-8, bf16 P adds as much; Q and P are
            // rounded to f16 (finer than bf16) on the FP8 path.
            assert!(errs[0] < 2e-2, "bf16 decode kernel off the f64 reference by {}", errs[0]);
            assert!(
                errs[1] < 2e-2 && errs[1] <= 1.5 * errs[0] + 2e-3,
                "fp8-KV decode kernel off by {} (bf16 {})",
                errs[1],
                errs[0]
            );
        }
    }
}

/// Prefill: whole prompts and chunks of longer contexts (the query tokens at the end of the
/// context), the FP8-KV kernel and the bf16 kernel on the same values.
#[test]
fn fp8_kv_prefill_attention_equals_the_bf16_kernel_on_the_same_cache_values() {
    let gpu = gpu();
    let mut rng = Rng(0x5eed_0002);
    for (qh, kvh, hd) in [(8, 2, 64), (32, 8, 128)] {
        // (context, query tokens): a 1-token prompt, whole prompts, chunks of longer contexts.
        let seqs_spec = [(1usize, 1usize), (300, 300), (364, 64), (130, 7), (700, 100)];
        let lens: Vec<usize> = seqs_spec.iter().map(|s| s.0).collect();
        let cache = Cache::new(&mut rng, &lens, kvh, hd, 2.0);
        let [k8, v8, k16, v16, bts] = cache.upload(&gpu).unwrap();
        let t_total: usize = seqs_spec.iter().map(|s| s.1).sum();
        let qkv_dim = (qh + 2 * kvh) * hd;
        let qkv: Vec<u16> = (0..t_total * qkv_dim).map(|_| rng.bf(3.0)).collect();
        let qkv_d = upload(&gpu, &qkv).unwrap();
        let mut seqs = Vec::new();
        let mut start = 0;
        for (i, &(ctx, ql)) in seqs_spec.iter().enumerate() {
            seqs.push(PrefillSeq { query_start: start, query_len: ql, context_len: ctx, bt_offset: cache.bt_off[i] });
            start += ql;
        }
        let scale = 1.0 / (hd as f32).sqrt();
        let g = qh / kvh;
        let mut want = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            for r in 0..s.query_len {
                let row = s.query_start + r;
                let pos = s.context_len - s.query_len + r;
                for h in 0..qh {
                    let q: Vec<f32> = (0..hd).map(|d| from_bf(qkv[row * qkv_dim + h * hd + d])).collect();
                    want.extend(cache.attend(i, pos, h, g, &q, f64::from(scale)));
                }
            }
        }
        let dims = PrefillDims { q_heads: qh, kv_heads: kvh, head_dim: hd, block_size: BS };
        let out = DevBuf::zeroed(&gpu, t_total * qh * hd * 2).unwrap();
        let mut errs = [0.0; 2];
        for (i, fp8) in [false, true].into_iter().enumerate() {
            let mut pa =
                if fp8 { PrefillAttention::new_fp8_kv(&gpu, t_total) } else { PrefillAttention::new(&gpu, t_total) }
                    .unwrap();
            let (kc, vc) = if fp8 { (&k8, &v8) } else { (&k16, &v16) };
            gpu.fill_const(out.ptr, t_total * qh * hd, 1000.0).unwrap();
            let ptrs = PrefillPtrs { out: out.ptr, qkv: qkv_d.ptr, k_cache: kc.ptr, v_cache: vc.ptr, bts: bts.ptr };
            pa.launch(&gpu, &seqs, &ptrs, dims, scale).unwrap();
            errs[i] = max_err(&download_bf16(&gpu, out.ptr, t_total * qh * hd).unwrap(), &want);
        }
        println!("prefill hd {hd} g {g}: max |out - f64| bf16 kernel {:.5}, fp8-KV kernel {:.5}", errs[0], errs[1]);
        assert!(errs[0] < 2e-2, "bf16 prefill kernel off the f64 reference by {}", errs[0]);
        assert!(
            errs[1] < 2e-2 && errs[1] <= 1.5 * errs[0] + 2e-3,
            "fp8-KV prefill kernel off by {} (bf16 {})",
            errs[1],
            errs[0]
        );
    }
}

/// One matrix (`out × inp`, bf16) and `n` activation rows with a few outlier channels, as a
/// decoder layer's inputs have. Rows of the weight and tokens have amplitudes 1, 2, 4 or 8
/// (and the outliers' amplitude varies by token), so their scales differ by up to 8×: a
/// per-token or per-channel scale applied to the wrong row or column moves outputs by 100% or
/// more.
struct Product {
    n: usize,
    out: usize,
    inp: usize,
    x: Vec<f32>,
    w: Vec<f32>,
}

impl Product {
    fn new(rng: &mut Rng, n: usize, out: usize, inp: usize) -> Self {
        let amp = |r: usize| f32::from(1u8 << (r * 7 % 4));
        let x = (0..n * inp)
            .map(|i| {
                let (t, c) = (i / inp, i % inp);
                let a = if c % 509 == 7 { 4.0 + (t % 5) as f32 * 4.0 } else { 1.0 };
                uniform(rng, a * amp(t))
            })
            .collect();
        let w = (0..out * inp).map(|i| uniform(rng, 0.05 * amp(i / inp + 1))).collect();
        Self { n, out, inp, x, w }
    }

    /// The largest |a − b| of each token row over the rms of `b`'s row, then the largest over
    /// the tokens.
    fn row_err(&self, a: &[f32], b: &[f64]) -> f64 {
        (0..self.n)
            .map(|t| {
                let (ra, rb) = (&a[t * self.out..(t + 1) * self.out], &b[t * self.out..(t + 1) * self.out]);
                max_err(ra, rb) / rms(rb)
            })
            .fold(0.0, f64::max)
    }

    /// As `row_err` for two f64 results.
    fn row_diff(&self, a: &[f64], b: &[f64]) -> f64 {
        let a32: Vec<f32> = a.iter().map(|&v| v as f32).collect();
        self.row_err(&a32, b)
    }

    /// f64 `a [n, inp] · b [out, inp]ᵀ`.
    fn exact(&self, a: &[f64], b: &[f64]) -> Vec<f64> {
        let mut y = vec![0.0; self.n * self.out];
        for t in 0..self.n {
            let ar = &a[t * self.inp..(t + 1) * self.inp];
            for j in 0..self.out {
                y[t * self.out + j] = ar.iter().zip(&b[j * self.inp..(j + 1) * self.inp]).map(|(p, q)| p * q).sum();
            }
        }
        y
    }
}

/// `len` product values at `ptr` (f32, or bf16 unless `f32_out`) as f32, after the stream.
fn download_out(gpu: &Gpu, ptr: u64, len: usize, f32_out: bool) -> Result<Vec<f32>, CudaError> {
    if !f32_out {
        return download_bf16(gpu, ptr, len);
    }
    let mut h = vec![0f32; len];
    gpu.sync()?;
    gpu.download(&mut h, ptr)?;
    Ok(h)
}

/// Dequantized rows: `code · scale[row]` in f64.
fn dequantized(codes: &[u8], scales: &[f32], cols: usize) -> Vec<f64> {
    codes.iter().enumerate().map(|(i, &c)| f64::from(e4m3_to_f32(c)) * f64::from(scales[i / cols])).collect()
}

#[test]
fn fp8_gemm_and_gemv_equal_the_exact_products_of_their_quantized_operands() {
    let gpu = gpu();
    let mut rng = Rng(0x5eed_0003);
    let k = Fp8Kernels::new(&gpu).unwrap();
    let mut lt = Fp8Gemm::new(&gpu).unwrap();
    // Norm rows and staged activation rows up to the widest input below.
    let gemv = Gemv::new(&gpu, 4096, 4096, true).unwrap();
    // `Fp8Gemm::new` reads the same variable.
    let fast = std::env::var("PRISM_FP8_FAST_ACCUM").map_or(true, |v| v != "0");
    // Information: whether cuBLASLt would apply both scales itself (outer-vector scaling).
    for (n, out, inp) in [(256, 28672, 4096), (2048, 4096, 14336)] {
        let (fast_on, fast_off) =
            (lt.outer_vec_available(n, out, inp, true).unwrap(), lt.outer_vec_available(n, out, inp, false).unwrap());
        println!("cuBLASLt outer-vector FP8 scaling, {n}x{out}x{inp}: fast accumulation {fast_on}, without {fast_off}");
    }
    for (n, out, inp) in [(64, 1024, 4096), (300, 768, 1536), (4, 512, 512)] {
        let p = Product::new(&mut rng, n, out, inp);
        let xb: Vec<u16> = p.x.iter().map(|&v| bf(v)).collect();
        let wb: Vec<u16> = p.w.iter().map(|&v| bf(v)).collect();
        let (x_d, w_d) = (upload(&gpu, &xb).unwrap(), upload(&gpu, &wb).unwrap());
        // Device quantization of the weight (per output row) and of the activations (per token)
        // equals the host rule bit for bit.
        let (wq_d, ws_d) = (DevBuf::zeroed(&gpu, out * inp).unwrap(), DevBuf::zeroed(&gpu, out * 4).unwrap());
        let (xq_d, xs_d) = (DevBuf::zeroed(&gpu, n * inp).unwrap(), DevBuf::zeroed(&gpu, n * 4).unwrap());
        k.quantize(&gpu, wq_d.ptr, ws_d.ptr, w_d.ptr, out, inp).unwrap();
        k.quantize(&gpu, xq_d.ptr, xs_d.ptr, x_d.ptr, n, inp).unwrap();
        let (wq, ws) = quantize_rows(&p.w, inp);
        let (xq, xs) = quantize_rows(&p.x, inp);
        let (mut dwq, mut dws, mut dxq, mut dxs) =
            (vec![0u8; out * inp], vec![0f32; out], vec![0u8; n * inp], vec![0f32; n]);
        gpu.sync().unwrap();
        gpu.download(&mut dwq, wq_d.ptr).unwrap();
        gpu.download(&mut dws, ws_d.ptr).unwrap();
        gpu.download(&mut dxq, xq_d.ptr).unwrap();
        gpu.download(&mut dxs, xs_d.ptr).unwrap();
        assert_eq!((dwq == wq, dws == ws), (true, true), "weight quantization differs from the host rule");
        assert_eq!((dxq == xq, dxs == xs), (true, true), "activation quantization differs from the host rule");

        let x64: Vec<f64> = p.x.iter().map(|&v| f64::from(v)).collect();
        let w64: Vec<f64> = p.w.iter().map(|&v| f64::from(v)).collect();
        let (wdq, xdq) = (dequantized(&wq, &ws, inp), dequantized(&xq, &xs, inp));
        let y_bf16 = p.exact(&x64, &w64);
        let y_w8 = p.exact(&x64, &wdq); // what the GEMV and the dequantized GEMM compute
        let y_w8a8 = p.exact(&xdq, &wdq); // what the FP8 GEMM computes
        let rel = |a: &[f32], b: &[f64]| p.row_err(a, b);

        // FP8 GEMM (bf16 and f32 output).
        let y_d = DevBuf::zeroed(&gpu, n * out * 4).unwrap();
        let mut gemm_out = Vec::new();
        for f32_out in [false, true] {
            let a = Fp8GemmArgs { y: y_d.ptr, xq: xq_d.ptr, wq: wq_d.ptr, n, out, inp, f32_out };
            lt.matmul(&gpu, &a).unwrap();
            k.scale_rows_cols(&gpu, &ScaleArgs { y: y_d.ptr, xs: xs_d.ptr, ws: ws_d.ptr, n, out, f32_out }).unwrap();
            let y = download_out(&gpu, y_d.ptr, n * out, f32_out).unwrap();
            let e = rel(&y, &y_w8a8);
            println!(
                "FP8 GEMM {n}x{out}x{inp} (f32 out {f32_out}, fast accumulation {fast}): max |y - exact(xq, wq)| / rms(row) = {e:.5}"
            );
            // Without fast accumulation: f32 accumulation, and with bf16 output the unscaled and
            // the scaled product rounded once each (2 · 2^-9 of |y|, |y| up to ~10 row rms).
            // With it, Hopper's FP8 tensor cores accumulate in about 14 bits between promotions
            // (DeepSeek-V3 report, section 3.3.2: up to ~2% relative error at K = 4,096); first
            // device run, 64 × 1,024 × 4,096 with uniform scales, bf16 output: 0.036. A scale on
            // the wrong row or column, or a transposed operand, is off by 0.25 or more.
            let tol = if fast { 0.1 } else { 2e-2 };
            assert!(e < tol, "FP8 GEMM off the exact product of its quantized operands by {e} (row rms)");
            gemm_out = y;
        }
        // The same product with both scales applied in cuBLASLt's epilogue (outer-vector
        // scaling, `PRISM_FP8_OUTER_VEC=1`), where cuBLASLt has an algorithm for the shape: the
        // per-channel scales on the weight's rows and the per-token scales on the activations'
        // (swapped, or either missing, the rows are off by far more than the bound).
        lt.enable_outer_vec().unwrap();
        for f32_out in [false, true] {
            let a = Fp8GemmArgs { y: y_d.ptr, xq: xq_d.ptr, wq: wq_d.ptr, n, out, inp, f32_out };
            if !lt.matmul_scaled(&gpu, &a, xs_d.ptr, ws_d.ptr).unwrap() {
                println!("FP8 GEMM {n}x{out}x{inp} (f32 out {f32_out}): no outer-vector algorithm");
                continue;
            }
            let y = download_out(&gpu, y_d.ptr, n * out, f32_out).unwrap();
            let e = rel(&y, &y_w8a8);
            println!("FP8 GEMM {n}x{out}x{inp} scaled in the epilogue (f32 out {f32_out}): {e:.5} of the row rms");
            let tol = if fast { 0.1 } else { 2e-2 };
            assert!(e < tol, "outer-vector scaled FP8 GEMM off the exact product by {e} (row rms)");
        }
        // bf16 GEMM of the dequantized weight.
        let wdq_d = DevBuf::zeroed(&gpu, out * inp * 2).unwrap();
        k.dequantize(&gpu, wdq_d.ptr, wq_d.ptr, ws_d.ptr, out, inp).unwrap();
        gpu.gemm(&GemmArgs { y: y_d.ptr, x: x_d.ptr, w: wdq_d.ptr, shape: GemmShape { n, out, inp }, f32_out: true })
            .unwrap();
        let mut y_deq = vec![0f32; n * out];
        gpu.sync().unwrap();
        gpu.download(&mut y_deq, y_d.ptr).unwrap();
        let e_deq = rel(&y_deq, &y_w8);
        // The FP8 GEMV (up to 4 tokens per launch).
        let mut y_gemv = vec![0f32; n * out];
        for t0 in (0..n).step_by(4) {
            let m = (n - t0).min(4);
            let a = GemvArgs {
                kind: GemvKind::LogitsF32,
                m,
                y: y_d.ptr,
                w: wq_d.ptr,
                x: x_d.ptr + (t0 * inp * 2) as u64,
                gain: 0,
                wscale: ws_d.ptr,
                out,
                inp,
                eps: 0.0,
                rope: RopeArgs::default(),
            };
            gemv.launch(&gpu, &a).unwrap();
            gpu.sync().unwrap();
            gpu.download(&mut y_gemv[t0 * out..(t0 + m) * out], y_d.ptr).unwrap();
        }
        let e_gemv = rel(&y_gemv, &y_w8);
        let gemv64: Vec<f64> = y_gemv.iter().map(|&v| f64::from(v)).collect();
        let gemm_vs_gemv = p.row_err(&gemm_out, &gemv64);
        println!(
            "{n}x{out}x{inp}: dequantized bf16 GEMM vs exact(x, wq) {e_deq:.5}, FP8 GEMV vs exact(x, wq) {e_gemv:.5}; \
             FP8 GEMM vs FP8 GEMV {gemm_vs_gemv:.4} (host, activation rounding alone: {:.4}; FP8 weights vs bf16: {:.4}) of the row rms",
            p.row_diff(&y_w8a8, &y_w8),
            p.row_diff(&y_w8, &y_bf16)
        );
        // The dequantized weight is rounded to bf16 (2^-9 relative per element).
        assert!(e_deq < 2e-2, "dequantized bf16 GEMM off by {e_deq} (row rms)");
        // The default FP8 GEMV rounds each 16-product partial sum to f16 (2^-11 relative per
        // rounding) before adding it into f32: 0.0034 of the row rms measured on the H200, against
        // the 0.20 that FP8 weights themselves move the product by.
        assert!(e_gemv < 1e-2, "FP8 GEMV off the exact product of x and the dequantized weight by {e_gemv} (row rms)");
    }
}

/// Checks e4m3 rows (`codes`, `scales`) against f64 reference rows `y`: each row's scale is
/// max|y| / 448 within the bf16 rounding of the activations, each value within half an e4m3 step
/// (2^-4 relative), one bf16 rounding (2^-8) and the subnormal spacing of its row.
fn assert_e4m3_rows(codes: &[u8], scales: &[f32], y: &[f64], cols: usize, what: &str) {
    for (r, row) in y.chunks(cols).enumerate() {
        let m = row.iter().fold(0f64, |m, v| m.max(v.abs()));
        let s = f64::from(scales[r]);
        assert!((s - m / 448.0).abs() <= m / 448.0 * 2f64.powi(-7), "{what}: row {r} scale {s} for max {m}");
        for (c, &v) in row.iter().enumerate() {
            let back = f64::from(e4m3_to_f32(codes[r * cols + c])) * s;
            let tol = v.abs() * (1.0 / 16.0 + 1.0 / 256.0) + s * 2f64.powi(-9);
            assert!((back - v).abs() <= tol, "{what}: row {r} col {c}: {back} for {v}");
        }
    }
}

#[test]
fn fused_fp8_norm_and_silu_equal_the_host_with_the_products_scales_applied_on_load() {
    let gpu = gpu();
    let mut rng = Rng(0x5eed_0004);
    let k = Fp8Kernels::new(&gpu).unwrap();
    let (n, hidden, inter) = (37usize, 4096usize, 14336usize);
    let pos = |rng: &mut Rng, a: f32| 0.5 * a + uniform(rng, 0.5 * a).abs();
    // An FP8 GEMM's unscaled products (code products summed: large values) and their scales.
    let xs: Vec<f32> = (0..n).map(|_| pos(&mut rng, 2e-3)).collect();
    let xs_d = upload(&gpu, &xs).unwrap();

    // SiLU·mul of gate_up's product: scaled on load, quantized per token.
    let gu: Vec<u16> = (0..n * 2 * inter).map(|_| rng.bf(3e3)).collect();
    let ws: Vec<f32> = (0..2 * inter).map(|_| pos(&mut rng, 1e-3)).collect();
    let (gu_d, ws_d) = (upload(&gpu, &gu).unwrap(), upload(&gpu, &ws).unwrap());
    let (codes_d, sc_d) = (DevBuf::zeroed(&gpu, n * inter).unwrap(), DevBuf::zeroed(&gpu, n * 4).unwrap());
    let a =
        SiluIo { codes: codes_d.ptr, scales: sc_d.ptr, gu: gu_d.ptr, gu_scales: Some((xs_d.ptr, ws_d.ptr)), n, inter };
    k.silu_mul_fp8io(&gpu, &a).unwrap();
    let (mut codes, mut sc) = (vec![0u8; n * inter], vec![0f32; n]);
    gpu.sync().unwrap();
    gpu.download(&mut codes, codes_d.ptr).unwrap();
    gpu.download(&mut sc, sc_d.ptr).unwrap();
    let act: Vec<f64> = (0..n * inter)
        .map(|i| {
            let (t, j) = (i / inter, i % inter);
            let at = |c: usize| f64::from(from_bf(gu[t * 2 * inter + c])) * f64::from(xs[t]) * f64::from(ws[c]);
            let (g, u) = (at(j), at(inter + j));
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    assert_e4m3_rows(&codes, &sc, &act, inter, "silu_mul_fp8io");

    // Unscaled, the codes are those of silu_mul then quantize_rows_e4m3, bit for bit.
    let a = SiluIo { gu_scales: None, ..a };
    k.silu_mul_fp8io(&gpu, &a).unwrap();
    let act_d = DevBuf::zeroed(&gpu, n * inter * 2).unwrap();
    let (ref_codes_d, ref_sc_d) = (DevBuf::zeroed(&gpu, n * inter).unwrap(), DevBuf::zeroed(&gpu, n * 4).unwrap());
    let (n_i, inter_i) = (n as i32, inter as i32);
    let mut b = gpu.stream.launch_builder(&gpu.k.silu_mul);
    b.arg(&act_d.ptr).arg(&gu_d.ptr).arg(&n_i).arg(&inter_i);
    // SAFETY: gu holds n × 2·inter bf16, act n × inter.
    unsafe { b.launch(grid_stride(n * inter)) }.unwrap();
    k.quantize(&gpu, ref_codes_d.ptr, ref_sc_d.ptr, act_d.ptr, n, inter).unwrap();
    let (mut ref_codes, mut ref_sc) = (vec![0u8; n * inter], vec![0f32; n]);
    gpu.sync().unwrap();
    gpu.download(&mut codes, codes_d.ptr).unwrap();
    gpu.download(&mut sc, sc_d.ptr).unwrap();
    gpu.download(&mut ref_codes, ref_codes_d.ptr).unwrap();
    gpu.download(&mut ref_sc, ref_sc_d.ptr).unwrap();
    assert_eq!(sc, ref_sc, "unscaled silu_mul_fp8io scales differ from silu_mul + quantize");
    assert!(codes == ref_codes, "unscaled silu_mul_fp8io codes differ from silu_mul + quantize");

    // Residual add of an unscaled product + RMSNorm, over a subset of rows (the final norm's
    // `rows`), as e4m3 and as bf16.
    let x: Vec<f32> = (0..n * hidden).map(|_| uniform(&mut rng, 4.0)).collect();
    let delta: Vec<u16> = (0..n * hidden).map(|_| rng.bf(2e3)).collect();
    let dws: Vec<f32> = (0..hidden).map(|_| pos(&mut rng, 1e-3)).collect();
    let gain: Vec<u16> = (0..hidden).map(|_| bf(pos(&mut rng, 1.0))).collect();
    let rows: Vec<u32> = [5u32, 0, 36, 17, 2].to_vec();
    let (delta_d, dws_d, gain_d, rows_d) = (
        upload(&gpu, &delta).unwrap(),
        upload(&gpu, &dws).unwrap(),
        upload(&gpu, &gain).unwrap(),
        upload(&gpu, &rows).unwrap(),
    );
    let eps = 1e-5f32;
    let x_new: Vec<f64> = (0..n * hidden)
        .map(|i| {
            let (t, j) = (i / hidden, i % hidden);
            f64::from(x[i]) + f64::from(from_bf(delta[i])) * f64::from(xs[t]) * f64::from(dws[j])
        })
        .collect();
    let normed = |r: usize| -> Vec<f64> {
        let row = &x_new[r * hidden..(r + 1) * hidden];
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f64>() / hidden as f64 + f64::from(eps)).sqrt();
        row.iter().zip(&gain).map(|(v, g)| v * inv * f64::from(from_bf(*g))).collect()
    };
    for (q8, with_rows) in [(true, false), (true, true), (false, true)] {
        let x_d = upload(&gpu, &x).unwrap();
        let blocks = if with_rows { rows.len() } else { n };
        let out_d = DevBuf::zeroed(&gpu, blocks * hidden * 2).unwrap();
        let a = NormIo {
            x: x_d.ptr,
            delta: delta_d.ptr,
            delta_scales: Some((xs_d.ptr, dws_d.ptr)),
            gain: gain_d.ptr,
            out: out_d.ptr,
            out_scales: if q8 { sc_d.ptr } else { 0 },
            rows: if with_rows { rows_d.ptr } else { 0 },
            blocks,
            hidden,
            eps,
        };
        k.add_rmsnorm_fp8io(&gpu, &a).unwrap();
        let mut xd = vec![0f32; n * hidden];
        gpu.sync().unwrap();
        gpu.download(&mut xd, x_d.ptr).unwrap();
        let order: Vec<usize> = if with_rows { rows.iter().map(|&r| r as usize).collect() } else { (0..n).collect() };
        for &r in &order {
            for j in 0..hidden {
                let (got, want) = (f64::from(xd[r * hidden + j]), x_new[r * hidden + j]);
                assert!((got - want).abs() <= want.abs() * 1e-6 + 1e-6, "residual row {r} col {j}: {got} for {want}");
            }
        }
        let y: Vec<f64> = order.iter().flat_map(|&r| normed(r)).collect();
        if q8 {
            let mut codes = vec![0u8; blocks * hidden];
            gpu.download(&mut codes, out_d.ptr).unwrap();
            gpu.download(&mut sc[..blocks], sc_d.ptr).unwrap();
            assert_e4m3_rows(&codes, &sc[..blocks], &y, hidden, "add_rmsnorm_fp8io");
        } else {
            let got = download_bf16(&gpu, out_d.ptr, blocks * hidden).unwrap();
            for (i, (&g, &v)) in got.iter().zip(&y).enumerate() {
                assert!((f64::from(g) - v).abs() <= v.abs() * 2f64.powi(-8) + 1e-6, "bf16 norm {i}: {g} for {v}");
            }
        }
    }
}

/// The decode GEMVs whose prologue takes the RMSNorm of f32 residual rows, against f64 host
/// products of the normed rows: gate_up (`silu(g)·u`, bf16 out) with bf16 and with FP8 weights,
/// and the FP8 lm_head taking the final norm (f32 out) where its variant can, a clear launch
/// error where it cannot (and always for a bf16 lm_head): never a silently unnormed product.
#[test]
fn decode_gemvs_with_the_norm_prologue_equal_the_host() {
    let gpu = gpu();
    let mut rng = Rng(0x5eed_0005);
    let (inp, out, eps) = (512usize, 384usize, 1e-5f32);
    let gemv = Gemv::new(&gpu, inp, inp, true).unwrap();
    let gain: Vec<f32> = (0..inp).map(|_| from_bf(bf(1.0 + uniform(&mut rng, 0.5)))).collect();
    let gain_d = upload(&gpu, &gain.iter().map(|&v| bf(v)).collect::<Vec<u16>>()).unwrap();
    // Weights of the gate_up product [2·out, inp] and of an lm_head [out, inp], bf16 values.
    let w_gu: Vec<f32> = (0..2 * out * inp).map(|_| uniform(&mut rng, 0.05)).collect();
    let w_lm: Vec<f32> = (0..out * inp).map(|_| uniform(&mut rng, 0.05)).collect();
    // The bound on each token row's relative L2 error |device − host| / |host|: the bf16 (or f16)
    // roundings of the normed activations, of g and u and of the output, about 2^-9 relative
    // each, ~0.003-0.005 together; a missing norm or gain is off by 0.3 or more. (Not the
    // largest element error over the row rms: silu(g)·u is heavy-tailed, and the first device
    // run measured 0.035 of the row rms on the bf16 gate_up for one element.)
    let tol = 2e-2;
    for m in [1usize, 2] {
        let x: Vec<f32> = (0..m * inp).map(|i| uniform(&mut rng, 1.0 + (i / inp) as f32 * 3.0)).collect();
        let x_d = upload(&gpu, &x).unwrap();
        let normed: Vec<f64> = (0..m * inp)
            .map(|i| {
                let row = &x[i / inp * inp..(i / inp + 1) * inp];
                let ms = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / inp as f64;
                f64::from(x[i]) / (ms + f64::from(eps)).sqrt() * f64::from(gain[i % inp])
            })
            .collect();
        let prod =
            |w: &[f64], rows: usize| Product { n: m, out: rows, inp, x: Vec::new(), w: Vec::new() }.exact(&normed, w);
        let check = |what: &str, got: &[f32], want: &[f64], rows: usize| {
            let e = (0..m)
                .map(|t| {
                    let (g, h) = (&got[t * rows..(t + 1) * rows], &want[t * rows..(t + 1) * rows]);
                    let diff = g.iter().zip(h).map(|(&a, &b)| (f64::from(a) - b).powi(2)).sum::<f64>();
                    (diff / h.iter().map(|b| b * b).sum::<f64>()).sqrt()
                })
                .fold(0.0, f64::max);
            println!("{what}, m {m}: |device − host| / |host| per row, largest {e:.5}");
            assert!(e < tol, "{what}, m {m}: off the host by {e} (relative L2 of a row)");
        };
        // The weight as uploaded (bf16, or e4m3 codes with per-row scales) and as the host sees it.
        let weights = |w: &[f32], fp8: bool| -> (DevBuf, Option<DevBuf>, Vec<f64>) {
            if fp8 {
                let (codes, scales) = quantize_rows(w, inp);
                (upload(&gpu, &codes).unwrap(), Some(upload(&gpu, &scales).unwrap()), dequantized(&codes, &scales, inp))
            } else {
                let wb: Vec<u16> = w.iter().map(|&v| bf(v)).collect();
                (upload(&gpu, &wb).unwrap(), None, w.iter().map(|&v| f64::from(v)).collect())
            }
        };
        let args = |kind, y, w, wscale| GemvArgs {
            kind,
            m,
            y,
            w,
            x: x_d.ptr,
            gain: gain_d.ptr,
            wscale,
            out,
            inp,
            eps,
            rope: RopeArgs::default(),
        };
        for fp8 in [false, true] {
            // gate_up: [g; u] = rmsnorm(x)·[W_gate; W_up]ᵀ, act = silu(g)·u.
            let (w_d, ws_d, w64) = weights(&w_gu, fp8);
            let gu = prod(&w64, 2 * out);
            let act: Vec<f64> = (0..m * out)
                .map(|i| {
                    let (t, j) = (i / out, i % out);
                    let (g, u) = (gu[t * 2 * out + j], gu[t * 2 * out + out + j]);
                    g / (1.0 + (-g).exp()) * u
                })
                .collect();
            let y_d = DevBuf::zeroed(&gpu, m * out * 2).unwrap();
            let a = args(GemvKind::NormGateUpSilu, y_d.ptr, w_d.ptr, ws_d.as_ref().map_or(0, |b| b.ptr));
            gemv.launch(&gpu, &a).unwrap();
            let got = download_bf16(&gpu, y_d.ptr, m * out).unwrap();
            check(if fp8 { "FP8 gate_up" } else { "bf16 gate_up" }, &got, &act, out);

            // lm_head with the final norm in its prologue.
            let (w_d, ws_d, w64) = weights(&w_lm, fp8);
            let y_d = DevBuf::zeroed(&gpu, m * out * 4).unwrap();
            let a = args(GemvKind::LogitsF32, y_d.ptr, w_d.ptr, ws_d.as_ref().map_or(0, |b| b.ptr));
            let launched = gemv.launch(&gpu, &a);
            if fp8 && gemv.lm_head_takes_norm() {
                launched.unwrap();
                let mut got = vec![0f32; m * out];
                gpu.sync().unwrap();
                gpu.download(&mut got, y_d.ptr).unwrap();
                check("FP8 lm_head with the final norm", &got, &prod(&w64, out), out);
            } else {
                assert!(
                    matches!(launched, Err(CudaError::InvalidLaunch(_))),
                    "an lm_head launch with a gain it cannot apply must be refused (FP8 {fp8})"
                );
            }
        }
    }
}
