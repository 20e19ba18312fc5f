//! Micro-benchmark: a batch-1 GEMV over K-quant weights kept in their GGUF blocks (Q4_K, Q6_K)
//! against the bf16 GEMVs the CUDA backend runs on the same weights dequantized at load.
//!
//! `cargo run --release -p prism-engine --features cuda --example cuda_kquant_gemv -- [OUT.json]`
//!
//! Shapes: Llama-3-8B's MLP matrices, `[out, inp]` = 14,336 × 4,096 (gate or up) and
//! 4,096 × 14,336 (down). Weights: seeded random GGUF super-blocks (random quants and packed
//! scales, f16 `d`/`dmin` of realistic size), dequantized on the host by the engine's
//! `dequant_k::dequantize` (ggml's reference decoding) and rounded to bf16 as the CUDA loader
//! does; activations: one random bf16 row.
//!
//! Kernels timed (same run, same weights):
//! - `q4k_gemv` / `q6k_gemv` (this file): one warp per output row, one super-block per warp
//!   iteration (Q4_K: 4 bytes of quants per lane; Q6_K: 2 + 2 + 2 bytes, the block being only
//!   2-byte aligned at 210 bytes), `KQ_U` super-blocks' loads issued before any is used, the
//!   weights dequantized in registers (`d·sc·Σ x·q − dmin·m·Σ x` per sub-block), x read through
//!   the read-only cache, f32 sums reduced over the warp;
//! - the engine's bf16 decode GEMV (`gemv.rs`, `GemvKind::LogitsF32`, f32 out: the plain product
//!   without a fused prologue or epilogue);
//! - cuBLAS `cublasGemmEx` with one activation row (families other than Llama run their decode
//!   products through cuBLASLt; this is the nearest plain cuBLAS call).
//!
//! Timing: median (and min) of 30 single launches between CUDA events, each after a 256 MiB
//! memset that evicts the weights from the 60 MB L2 (in a decode step every layer's weights
//! stream through L2 between their uses); effective TB/s = weight bytes / time.
//!
//! Check: each kernel's output against a host f64 product over the weights it reads (the f32
//! dequantized values for the K-quant kernels, their bf16 rounding for the bf16 ones): every
//! row within `1e-4 · Σ |x·w|` (f32 accumulation). Also reported: max |K-quant kernel − bf16
//! GEMV| relative to max |y| (the bf16 rounding of the weights). Exit status 1 on a failed check.

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    bench::main()
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_kquant_gemv needs --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
#[path = "support/cold_timing.rs"]
mod cold_timing;
#[cfg(feature = "cuda")]
#[path = "support/splitmix.rs"]
#[allow(dead_code)]
mod splitmix;

#[cfg(feature = "cuda")]
mod bench {
    use anyhow::{Context, Result};
    use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
    use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
    use half::{bf16, f16};
    use prism_engine::backend::cuda::device::{DevBuf, GemmArgs, GemmShape, Gpu, nvrtc_include_paths};
    use prism_engine::backend::cuda::gemv::{Gemv, GemvArgs, GemvKind, RopeArgs};
    use prism_engine::model::gguf::dequant_k::{KQuant, QK_K, dequantize};
    use rayon::prelude::*;
    use serde_json::{Value, json};

    use crate::cold_timing::time_cold;
    use crate::splitmix::Rng;

    /// Largest accepted |kernel − host| of a row, relative to the row's Σ |x·w|.
    const REL_TOL: f64 = 1e-4;
    const REPS: usize = 30;
    /// Bytes of the memset that evicts the weights from L2 before each timed launch.
    const FLUSH_BYTES: usize = 256 << 20;
    const WARPS: u32 = 8;

    /// The K-quant GEMV kernels. y[r] = Σ_k W[r, k] · x[k], W in GGUF super-blocks of 256
    /// weights along k (row r = `inp / 256` consecutive blocks), x bf16, y f32.
    const SRC: &str = r#"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef unsigned long long u64;
#define KQ_U 4  // super-blocks whose loads are in flight together per warp

__device__ __forceinline__ float kq_warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float kq_h2f(u32 bits) { return __half2float(__ushort_as_half((u16)bits)); }
// n consecutive bf16 of x (read-only path) as f32.
__device__ __forceinline__ void kq_x4(const __nv_bfloat16* p, float (&v)[4]) {
    uint2 r = __ldg(reinterpret_cast<const uint2*>(p));
    float2 a = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r.x));
    float2 b = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r.y));
    v[0] = a.x; v[1] = a.y; v[2] = b.x; v[3] = b.y;
}
__device__ __forceinline__ float2 kq_x2(const __nv_bfloat16* p) {
    u32 r = __ldg(reinterpret_cast<const u32*>(p));
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&r));
}
// Streaming loads (weights are read once).
__device__ __forceinline__ uint4 kq_ld16(const u8* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 kq_ld4(const u8* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ u32 kq_ld2(const u8* p) {
    unsigned short v;
    asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];" : "=h"(v) : "l"(p));
    return v;
}

// Q4_K (144 bytes): f16 d @0, f16 dmin @2, 12 bytes of 6-bit scales/mins @4, 128 bytes of quants
// @16 where byte 32j + l holds weight 64j + l (low nibble, sub-block 2j) and 64j + 32 + l (high
// nibble, sub-block 2j + 1). Weight = d·sc·q − dmin·m. Lane L takes quant bytes 4L..4L+3:
// j = L / 8, l = 4·(L % 8) + 0..3.
// Byte i of the 16-byte block header h (selects, no local-memory array).
__device__ __forceinline__ int kq_byte(const uint4& h, int i) {
    const u32 v = i < 8 ? (i < 4 ? h.x : h.y) : (i < 12 ? h.z : h.w);
    return (int)((v >> (8 * (i & 3))) & 0xffu);
}
// 6-bit scale and minimum of sub-block j (ggml's get_scale_min_k4 over header bytes 4..15).
__device__ __forceinline__ void kq_scale_min(int j, const uint4& h, int& sc, int& m) {
    if (j < 4) {
        sc = kq_byte(h, 4 + j) & 63;
        m = kq_byte(h, 8 + j) & 63;
    } else {
        sc = (kq_byte(h, 8 + j) & 0xF) | ((kq_byte(h, j) >> 6) << 4);
        m = (kq_byte(h, 8 + j) >> 4) | ((kq_byte(h, 4 + j) >> 6) << 4);
    }
}
extern "C" __global__ void __launch_bounds__(256) q4k_gemv(float* y, const u8* w, const __nv_bfloat16* x, int rows, int inp) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int nb = inp / 256, j = lane >> 3, l0 = 4 * (lane & 7);
    const u8* row = w + (u64)r * nb * 144;
    float acc = 0.f;
    for (int b0 = 0; b0 < nb; b0 += KQ_U) {
        uint4 h[KQ_U];
        u32 q[KQ_U];
#pragma unroll
        for (int u = 0; u < KQ_U; u++) {
            const int b = min(b0 + u, nb - 1);
            h[u] = kq_ld16(row + b * 144);
            q[u] = kq_ld4(row + b * 144 + 16 + 4 * lane);
        }
#pragma unroll
        for (int u = 0; u < KQ_U; u++) {
            if (b0 + u >= nb) break;
            int sc0, m0, sc1, m1;
            kq_scale_min(2 * j, h[u], sc0, m0);
            kq_scale_min(2 * j + 1, h[u], sc1, m1);
            const float d = kq_h2f(h[u].x & 0xffffu), dmin = kq_h2f(h[u].x >> 16);
            float xa[4], xb[4];
            const __nv_bfloat16* xp = x + (b0 + u) * 256 + 64 * j + l0;
            kq_x4(xp, xa);
            kq_x4(xp + 32, xb);
            float sa = 0.f, sb = 0.f, ta = 0.f, tb = 0.f;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u32 byte = (q[u] >> (8 * i)) & 0xffu;
                sa += xa[i] * (float)(byte & 0xF);
                sb += xb[i] * (float)(byte >> 4);
                ta += xa[i];
                tb += xb[i];
            }
            acc += d * (float)sc0 * sa - dmin * (float)m0 * ta + d * (float)sc1 * sb - dmin * (float)m1 * tb;
        }
    }
    acc = kq_warp_sum(acc);
    if (lane == 0) y[r] = acc;
}

// Q6_K (210 bytes, so only 2-byte aligned): ql[128] @0, qh[64] @128, i8 scales[16] @192, f16 d
// @208. For half n (128 weights) and l < 32: ql[64n + l] low/high nibble = weights 128n + l /
// 128n + 64 + l, ql[64n + 32 + l] low/high = 128n + 32 + l / 128n + 96 + l, qh[32n + l] bits 2k..2k+1
// the top two bits of quarter k; weight 128n + 32k + l = d·scales[8n + 2k + l / 16]·(q − 32).
// Lane L takes n = L / 16, l = 2·(L % 16) + 0..1 (three 2-byte loads of quants, 4 scale bytes).
extern "C" __global__ void __launch_bounds__(256) q6k_gemv(float* y, const u8* w, const __nv_bfloat16* x, int rows, int inp) {
    const int lane = threadIdx.x & 31;
    const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;
    const int nb = inp / 256, n = lane >> 4, l0 = 2 * (lane & 15);
    const u8* row = w + (u64)r * nb * 210;
    float acc = 0.f;
    for (int b0 = 0; b0 < nb; b0 += KQ_U) {
        u32 qa[KQ_U], qb[KQ_U], qh[KQ_U], dd[KQ_U], sc[KQ_U][4];
#pragma unroll
        for (int u = 0; u < KQ_U; u++) {
            const u8* blk = row + min(b0 + u, nb - 1) * 210;
            qa[u] = kq_ld2(blk + 64 * n + l0);
            qb[u] = kq_ld2(blk + 64 * n + 32 + l0);
            qh[u] = kq_ld2(blk + 128 + 32 * n + l0);
            dd[u] = kq_ld2(blk + 208);
#pragma unroll
            for (int k = 0; k < 4; k++) sc[u][k] = blk[192 + 8 * n + 2 * k + (l0 >> 4)];
        }
#pragma unroll
        for (int u = 0; u < KQ_U; u++) {
            if (b0 + u >= nb) break;
            const __nv_bfloat16* xp = x + (b0 + u) * 256 + 128 * n + l0;
            float part = 0.f;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const float2 xv = kq_x2(xp + 32 * k);
                const u32 ql = (k & 1) ? qb[u] : qa[u];
                float s = 0.f;
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    const u32 lo = (ql >> (8 * e + 4 * (k >> 1))) & 0xF;
                    const u32 hi = (qh[u] >> (8 * e + 2 * k)) & 3;
                    s += (e ? xv.y : xv.x) * (float)((int)(lo | (hi << 4)) - 32);
                }
                part += (float)(signed char)sc[u][k] * s;
            }
            acc += kq_h2f(dd[u]) * part;
        }
    }
    acc = kq_warp_sum(acc);
    if (lane == 0) y[r] = acc;
}
"#;

    /// A random K-quant matrix `[out, inp]` in GGUF blocks, rows of `inp / 256` blocks.
    fn random_blocks(ty: KQuant, out: usize, inp: usize, rng: &mut Rng) -> Vec<u8> {
        let nbytes = ty.block_bytes();
        let blocks = out * inp / QK_K;
        let mut v = vec![0u8; blocks * nbytes];
        for b in v.chunks_exact_mut(nbytes) {
            for c in b.chunks_mut(8) {
                let r = rng.next().to_le_bytes();
                c.copy_from_slice(&r[..c.len()]);
            }
            // f16 scales of about the size real files have (weights of magnitude ~0.02–0.2).
            let mut f16_at = |i: usize, lo: f32, hi: f32| {
                let u = (rng.next() >> 40) as f32 / 16_777_216.0;
                b[i..i + 2].copy_from_slice(&f16::from_f32(lo + (hi - lo) * u).to_le_bytes());
            };
            match ty {
                KQuant::Q4K => {
                    f16_at(0, 1e-4, 4e-4);
                    f16_at(2, 1e-4, 4e-4);
                }
                KQuant::Q6K => f16_at(208, 2e-5, 8e-5),
                _ => unreachable!("only Q4_K and Q6_K are benchmarked"),
            }
        }
        v
    }

    /// Host f64 `y = W·x` and the per-row Σ |x·w| (for the tolerance).
    fn host_gemv(w: &[f32], x: &[f32], inp: usize) -> (Vec<f64>, Vec<f64>) {
        w.par_chunks(inp)
            .map(|row| {
                row.iter().zip(x).fold((0f64, 0f64), |(s, a), (&wv, &xv)| {
                    let p = f64::from(wv) * f64::from(xv);
                    (s + p, a + p.abs())
                })
            })
            .unzip()
    }

    /// Rows within `REL_TOL · Σ|x·w|`; returns (pass, max |Δ| / Σ|x·w| over rows).
    fn check(y: &[f32], want: &[f64], abs: &[f64]) -> (bool, f64) {
        let worst = y
            .iter()
            .zip(want.iter().zip(abs))
            .map(|(&g, (&r, &a))| if g.is_finite() { (f64::from(g) - r).abs() / a.max(1e-30) } else { f64::INFINITY })
            .fold(0f64, f64::max);
        (worst <= REL_TOL, worst)
    }

    fn download(gpu: &Gpu, ptr: u64, n: usize) -> Result<Vec<f32>> {
        let mut v = vec![0f32; n];
        gpu.download(&mut v, ptr)?;
        Ok(v)
    }

    fn launch_kq(gpu: &Gpu, f: &CudaFunction, y: u64, w: u64, x: u64, out: usize, inp: usize) -> Result<()> {
        let (rows, inp_i) = (out as i32, inp as i32);
        let cfg = LaunchConfig {
            grid_dim: ((out as u32).div_ceil(WARPS), 1, 1),
            block_dim: (WARPS * 32, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = gpu.stream.launch_builder(f);
        b.arg(&y).arg(&w).arg(&x).arg(&rows).arg(&inp_i);
        // SAFETY: w holds out · inp / 256 blocks of the kernel's type, x inp bf16, y out f32.
        unsafe { b.launch(cfg) }.context("kquant gemv")?;
        Ok(())
    }

    pub fn main() -> Result<()> {
        let path = std::env::args().nth(1).unwrap_or_else(|| "cuda_kquant_gemv.json".into());
        let gpu = Gpu::new(0)?;
        println!("device {} ({})", gpu.name, gpu.arch);
        let opts = CompileOptions { arch: Some(gpu.arch), include_paths: nvrtc_include_paths(), ..Default::default() };
        let module = gpu.ctx.load_module(compile_ptx_with_opts(SRC, opts).context("NVRTC")?).context("load")?;
        let q4k = module.load_function("q4k_gemv").context("q4k_gemv")?;
        let q6k = module.load_function("q6k_gemv").context("q6k_gemv")?;
        let gemv = Gemv::new(&gpu, 4096, 14336, false)?;
        let flush = DevBuf::zeroed(&gpu, FLUSH_BYTES)?;
        let mut rng = Rng(0x6B51_4B47);
        let mut pass = true;
        let mut rows = Vec::new();
        for (ty, name, f) in [(KQuant::Q4K, "Q4_K", &q4k), (KQuant::Q6K, "Q6_K", &q6k)] {
            for (out, inp) in [(14336usize, 4096usize), (4096, 14336)] {
                let blocks = random_blocks(ty, out, inp, &mut rng);
                let nb = ty.block_bytes() * inp / QK_K;
                let mut wf = vec![0f32; out * inp];
                wf.par_chunks_mut(inp).zip(blocks.par_chunks(nb)).for_each(|(o, b)| dequantize(ty, b, o));
                let wb: Vec<u16> = wf.par_iter().map(|&v| bf16::from_f32(v).to_bits()).collect();
                let wbf: Vec<f32> = wb.par_iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
                let xb: Vec<u16> = (0..inp).map(|_| rng.bf(1.0)).collect();
                let xf: Vec<f32> = xb.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
                let (ref_q, abs_q) = host_gemv(&wf, &xf, inp);
                let (ref_b, abs_b) = host_gemv(&wbf, &xf, inp);
                drop((wf, wbf));
                let d_q = DevBuf::zeroed(&gpu, blocks.len())?;
                gpu.upload(&d_q, 0, &blocks)?;
                let d_w = DevBuf::zeroed(&gpu, wb.len() * 2)?;
                gpu.upload(&d_w, 0, &wb)?;
                let d_x = DevBuf::zeroed(&gpu, inp * 2)?;
                gpu.upload(&d_x, 0, &xb)?;
                let d_y = DevBuf::zeroed(&gpu, out * 4)?;
                let gv_args = GemvArgs {
                    kind: GemvKind::LogitsF32,
                    m: 1,
                    y: d_y.ptr,
                    w: d_w.ptr,
                    x: d_x.ptr,
                    gain: 0,
                    wscale: 0,
                    out,
                    inp,
                    eps: 0.0,
                    rope: RopeArgs::default(),
                };
                let gemm_args =
                    GemmArgs { y: d_y.ptr, x: d_x.ptr, w: d_w.ptr, shape: GemmShape { n: 1, out, inp }, f32_out: true };
                let mut run_kq = || launch_kq(&gpu, f, d_y.ptr, d_q.ptr, d_x.ptr, out, inp);
                run_kq()?;
                let y_kq = download(&gpu, d_y.ptr, out)?;
                let (t_kq, t_kq_min) = time_cold(&gpu, &flush, REPS, &mut run_kq)?;
                let mut run_gv = || Ok(gemv.launch(&gpu, &gv_args)?);
                run_gv()?;
                let y_gv = download(&gpu, d_y.ptr, out)?;
                let (t_gv, t_gv_min) = time_cold(&gpu, &flush, REPS, &mut run_gv)?;
                let mut run_blas = || Ok(gpu.gemm(&gemm_args)?);
                run_blas()?;
                let y_blas = download(&gpu, d_y.ptr, out)?;
                let (t_blas, t_blas_min) = time_cold(&gpu, &flush, REPS, &mut run_blas)?;
                let (ok_kq, e_kq) = check(&y_kq, &ref_q, &abs_q);
                let (ok_gv, e_gv) = check(&y_gv, &ref_b, &abs_b);
                let (ok_blas, e_blas) = check(&y_blas, &ref_b, &abs_b);
                let ymax = y_gv.iter().fold(0f32, |m, v| m.max(v.abs()));
                let kq_vs_bf16 = y_kq.iter().zip(&y_gv).fold(0f32, |m, (a, b)| m.max((a - b).abs())) / ymax;
                let ok = ok_kq && ok_gv && ok_blas;
                pass &= ok;
                let (qb, bb) = (blocks.len() as f64, (wb.len() * 2) as f64);
                let tbs = |bytes: f64, us: f64| bytes / (us * 1e-6) / 1e12;
                println!(
                    "{} {name} [{out} x {inp}]: kept {name} {t_kq:6.1} us ({:.2} TB/s of {:.1} MB, min {t_kq_min:.1}) | \
                     bf16 GEMV {t_gv:6.1} us ({:.2} TB/s of {:.1} MB, min {t_gv_min:.1}) | cuBLAS {t_blas:6.1} us \
                     (min {t_blas_min:.1}) | speedup vs bf16 GEMV x{:.2}; max rel err: {name} {e_kq:.1e}, GEMV {e_gv:.1e}, \
                     cuBLAS {e_blas:.1e} (bound {REL_TOL:.0e}); max |{name} - bf16| / max|y| {kq_vs_bf16:.1e}",
                    if ok { "PASS" } else { "FAIL" },
                    tbs(qb, t_kq),
                    qb / 1e6,
                    tbs(bb, t_gv),
                    bb / 1e6,
                    t_gv / t_kq
                );
                rows.push(json!({
                    "type": name, "out": out, "inp": inp, "quant_bytes": qb, "bf16_bytes": bb,
                    "kquant_us": t_kq, "kquant_min_us": t_kq_min, "kquant_tb_s": tbs(qb, t_kq),
                    "bf16_gemv_us": t_gv, "bf16_gemv_min_us": t_gv_min, "bf16_gemv_tb_s": tbs(bb, t_gv),
                    "cublas_us": t_blas, "cublas_min_us": t_blas_min, "cublas_tb_s": tbs(bb, t_blas),
                    "speedup_vs_bf16_gemv": t_gv / t_kq, "speedup_vs_cublas": t_blas / t_kq,
                    "max_rel_err_kquant": e_kq, "max_rel_err_bf16_gemv": e_gv, "max_rel_err_cublas": e_blas,
                    "max_abs_kquant_minus_bf16_over_max_y": kq_vs_bf16, "pass": ok,
                }));
            }
        }
        let j: Value = json!({"device": gpu.name, "arch": gpu.arch, "reps": REPS, "rel_tol": REL_TOL,
                              "results": rows, "pass": pass});
        std::fs::write(&path, serde_json::to_string_pretty(&j)?).with_context(|| format!("write {path}"))?;
        println!("cuda_kquant_gemv: {}; JSON in {path}", if pass { "PASS" } else { "FAIL" });
        if !pass {
            std::process::exit(1);
        }
        Ok(())
    }
}
