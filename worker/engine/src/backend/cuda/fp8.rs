//! FP8 (e4m3) on the device (`kernels/fp8.cu`): per-row quantization of bf16 matrices (the
//! weights at load, per output channel; the activations of the FP8 GEMMs, per token) and the
//! dequantization of a matrix back to bf16; the host reference of the quantization rule is
//! [`quantize_rows`] (`model::fp8`, which `scripts/quantize_fp8.py` also follows bit for bit).
//! The FP8 GEMM path's fused passes live here too: the residual add + RMSNorm and SiLU·mul
//! variants that read an FP8 GEMM's unscaled product (applying its per-token and per-channel
//! scales as they load it) and write the next GEMM's e4m3 input with its per-token scales
//! ([`Fp8Kernels::add_rmsnorm_fp8io`], [`Fp8Kernels::silu_mul_fp8io`]).
//!
//! The rule (vLLM's `--quantization fp8`, per-channel weights and dynamic per-token
//! activations): `scale[r] = max|x[r]| / 448` (1 for an all-zero row), `code = e4m3(x · (1 /
//! scale))` rounded to nearest even and saturated to ±448; a value is `code · scale`.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::device::{Gpu, grid_stride, nvrtc_include_paths};
use super::error::{CudaError, CudaResultExt};
/// The host reference of the device quantization (the rule in the module docs).
pub use crate::model::fp8::quantize_rows;
#[cfg(test)]
use crate::model::fp8::{e4m3_to_f32, f32_to_e4m3};

/// The kernels' CUDA C source.
pub const FP8_SRC: &str = include_str!("kernels/fp8.cu");

pub use crate::model::fp8::E4M3_MAX;

/// Groups of 8 values a thread of the fused kernels holds (`FQ_CHUNKS` in `kernels/fp8.cu`).
const FQ_CHUNKS: usize = 4;

/// Threads per block of the fused kernels at most (their `__launch_bounds__`).
const FQ_THREADS: usize = 512;

/// Threads per row of the fused kernels for rows of `cols` values (a multiple of 8): about two
/// groups of 8 per thread, at most [`FQ_CHUNKS`]; `None` for a row too wide or not of 8s.
fn fused_threads(cols: usize) -> Option<u32> {
    let n8 = cols / 8;
    let t = n8.div_ceil(2).next_multiple_of(32).clamp(64, FQ_THREADS);
    (cols.is_multiple_of(8) && cols > 0 && n8 <= t * FQ_CHUNKS).then_some(t as u32)
}

/// Whether the fused kernels take rows of `hidden` (norms) and `inter` (SiLU·mul) values.
pub fn fused_supported(hidden: usize, inter: usize) -> bool {
    fused_threads(hidden).is_some() && fused_threads(inter).is_some()
}

/// The loaded FP8 kernels.
pub struct Fp8Kernels {
    quantize: CudaFunction,
    dequantize: CudaFunction,
    scale: CudaFunction,
    norm: CudaFunction,
    silu: CudaFunction,
}

impl Fp8Kernels {
    /// Compiles and loads `kernels/fp8.cu`.
    ///
    /// # Errors
    /// [`CudaError`] on compile or load failure.
    pub fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        let opts = CompileOptions { arch: Some(gpu.arch), include_paths: nvrtc_include_paths(), ..Default::default() };
        let ptx = compile_ptx_with_opts(FP8_SRC, opts).op("NVRTC compile of fp8.cu")?;
        let module = gpu.ctx.load_module(ptx).op("load_module fp8")?;
        Ok(Self {
            quantize: module.load_function("quantize_rows_e4m3").op("load quantize_rows_e4m3")?,
            dequantize: module.load_function("dequantize_rows_e4m3").op("load dequantize_rows_e4m3")?,
            scale: module.load_function("scale_rows_cols").op("load scale_rows_cols")?,
            norm: module.load_function("add_rmsnorm_fp8io").op("load add_rmsnorm_fp8io")?,
            silu: module.load_function("silu_mul_fp8io").op("load silu_mul_fp8io")?,
        })
    }

    /// Enqueues the residual add + RMSNorm of [`NormIo`] (`add_rmsnorm_fp8io`).
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] unless `hidden` is a multiple of 8 the kernel takes
    /// ([`fused_supported`]) and the vectors are 16-byte aligned (8 bytes for codes);
    /// [`CudaError`] on launch failure.
    pub fn add_rmsnorm_fp8io(&self, gpu: &Gpu, a: &NormIo) -> Result<(), CudaError> {
        let NormIo { x, delta, delta_scales, gain, out, out_scales, rows, blocks, hidden, eps } = *a;
        let (dxs, dws) = delta_scales.unwrap_or((0, 0));
        let threads = fused_threads(hidden);
        let out_align = if out_scales == 0 { 16 } else { 8 };
        let aligned = [x, delta, dws, gain].iter().all(|p| p.is_multiple_of(16)) && out.is_multiple_of(out_align);
        let Some(threads) = threads.filter(|_| aligned) else {
            return Err(CudaError::InvalidLaunch(format!("add_rmsnorm_fp8io: {hidden} columns or unaligned rows")));
        };
        if blocks == 0 {
            return Ok(());
        }
        let h = hidden as i32;
        let mut b = gpu.stream.launch_builder(&self.norm);
        b.arg(&x).arg(&delta).arg(&dxs).arg(&dws).arg(&gain).arg(&out).arg(&out_scales).arg(&rows).arg(&h).arg(&eps);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the caller passes the shapes of `NormIo`; alignment and width checked above.
        unsafe { b.launch(cfg) }.map(|_| ()).op("add_rmsnorm_fp8io")
    }

    /// Enqueues SiLU·mul of [`SiluIo`] (`silu_mul_fp8io`).
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] unless `inter` is a multiple of 8 the kernel takes
    /// ([`fused_supported`]) and `gu` and the scales are 16-byte aligned; [`CudaError`] on
    /// launch failure.
    pub fn silu_mul_fp8io(&self, gpu: &Gpu, a: &SiluIo) -> Result<(), CudaError> {
        let SiluIo { codes, scales, gu, gu_scales, n, inter } = *a;
        let (gxs, gws) = gu_scales.unwrap_or((0, 0));
        let aligned = gu.is_multiple_of(16) && gws.is_multiple_of(16) && codes.is_multiple_of(8);
        let Some(threads) = fused_threads(inter).filter(|_| aligned) else {
            return Err(CudaError::InvalidLaunch(format!("silu_mul_fp8io: {inter} columns or unaligned rows")));
        };
        if n == 0 {
            return Ok(());
        }
        let i = inter as i32;
        let mut b = gpu.stream.launch_builder(&self.silu);
        b.arg(&codes).arg(&scales).arg(&gu).arg(&gxs).arg(&gws).arg(&i);
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the caller passes the shapes of `SiluIo`; alignment and width checked above.
        unsafe { b.launch(cfg) }.map(|_| ()).op("silu_mul_fp8io")
    }

    /// Enqueues `y[t, j] *= xs[t] · ws[j]` (see [`ScaleArgs`]).
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] for an odd `out`; [`CudaError`] on launch failure.
    pub fn scale_rows_cols(&self, gpu: &Gpu, a: &ScaleArgs) -> Result<(), CudaError> {
        let ScaleArgs { y, xs, ws, n, out, f32_out } = *a;
        if !out.is_multiple_of(2) {
            return Err(CudaError::InvalidLaunch(format!("scale_rows_cols: {out} columns (even)")));
        }
        let (ni, oi, fi) = (n as i32, out as i32, i32::from(f32_out));
        let mut b = gpu.stream.launch_builder(&self.scale);
        b.arg(&y).arg(&xs).arg(&ws).arg(&ni).arg(&oi).arg(&fi);
        // SAFETY: the caller passes y of n × out values, xs of n and ws of out f32.
        unsafe { b.launch(grid_stride(n * out / 2)) }.map(|_| ()).op("scale_rows_cols")
    }

    /// Enqueues the quantization of the bf16 matrix `x [rows, cols]` into e4m3 `codes` and f32
    /// `scales [rows]` (the rule in the module docs).
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] unless `cols` is a multiple of 8 and `x` 16-byte aligned;
    /// [`CudaError`] on launch failure.
    pub fn quantize(
        &self,
        gpu: &Gpu,
        codes: u64,
        scales: u64,
        x: u64,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        if rows == 0 {
            return Ok(());
        }
        if !cols.is_multiple_of(8) || !x.is_multiple_of(16) || !codes.is_multiple_of(8) {
            return Err(CudaError::InvalidLaunch(format!("quantize_rows_e4m3: {cols} columns (a multiple of 8)")));
        }
        let (r, c) = (rows as i32, cols as i32);
        let mut b = gpu.stream.launch_builder(&self.quantize);
        b.arg(&codes).arg(&scales).arg(&x).arg(&r).arg(&c);
        let cfg =
            LaunchConfig { grid_dim: (rows.min(65_535) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the caller passes x of rows × cols bf16, codes of rows × cols bytes and
        // scales of rows f32.
        unsafe { b.launch(cfg) }.map(|_| ()).op("quantize_rows_e4m3")
    }

    /// Enqueues `y [rows, cols] = bf16(code · scale[row])`.
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] unless `cols` is a multiple of 8; [`CudaError`] on launch
    /// failure.
    pub fn dequantize(
        &self,
        gpu: &Gpu,
        y: u64,
        codes: u64,
        scales: u64,
        rows: usize,
        cols: usize,
    ) -> Result<(), CudaError> {
        if !cols.is_multiple_of(8) {
            return Err(CudaError::InvalidLaunch(format!("dequantize_rows_e4m3: {cols} columns (a multiple of 8)")));
        }
        let (r, c) = (rows as i32, cols as i32);
        let mut b = gpu.stream.launch_builder(&self.dequantize);
        b.arg(&y).arg(&codes).arg(&scales).arg(&r).arg(&c);
        // SAFETY: the caller passes y of rows × cols bf16, codes of rows × cols bytes and
        // scales of rows f32.
        unsafe { b.launch(grid_stride(rows * cols / 8)) }.map(|_| ()).op("dequantize_rows_e4m3")
    }
}

/// Operands of [`Fp8Kernels::scale_rows_cols`]: `y [n, out]` (bf16, or f32 with `f32_out`)
/// scaled by the per-token `xs [n]` and the per-output-channel `ws [out]` (f32).
#[derive(Clone, Copy, Debug)]
pub struct ScaleArgs {
    pub y: u64,
    pub xs: u64,
    pub ws: u64,
    pub n: usize,
    pub out: usize,
    pub f32_out: bool,
}

/// Operands of [`Fp8Kernels::add_rmsnorm_fp8io`] (device addresses; 0 for none). Block `b`
/// of `blocks` handles row `r = rows[b]` (or `b` when `rows` is 0) of the f32 residual stream
/// `x [*, hidden]`: when `delta` (bf16 `[*, hidden]`) is set, `x[r] += delta[r]`, scaled by
/// `xs[r] · ws[j]` when `delta_scales = Some((xs, ws))` (an FP8 GEMM's unscaled product: `xs`
/// its input's per-token scales, `ws` the weight's `hidden` per-channel scales, f32); then
/// `y = bf16(x[r] · rsqrt(mean(x[r]²) + eps) · gain)` goes to `out[b]` as bf16 when
/// `out_scales` is 0, else as e4m3 codes (`out [blocks, hidden]` bytes) with the per-token scale
/// in `out_scales[b]` (f32; the rule of [`quantize_rows`] applied to the bf16 `y`).
#[derive(Clone, Copy, Debug)]
pub struct NormIo {
    pub x: u64,
    pub delta: u64,
    pub delta_scales: Option<(u64, u64)>,
    pub gain: u64,
    pub out: u64,
    pub out_scales: u64,
    pub rows: u64,
    pub blocks: usize,
    pub hidden: usize,
    pub eps: f32,
}

/// Operands of [`Fp8Kernels::silu_mul_fp8io`]: for each of `n` tokens, `g = gu[t, j]` and
/// `u = gu[t, inter + j]` (bf16 `[n, 2·inter]`), scaled by `xs[t] · ws[j]` and `xs[t] ·
/// ws[inter + j]` when `gu_scales = Some((xs, ws))` (gate_up's unscaled FP8 product), `act =
/// bf16(silu(g) · u)` quantized per token into e4m3 `codes [n, inter]` and f32 `scales [n]` (the
/// rule of [`quantize_rows`]).
#[derive(Clone, Copy, Debug)]
pub struct SiluIo {
    pub codes: u64,
    pub scales: u64,
    pub gu: u64,
    pub gu_scales: Option<(u64, u64)>,
    pub n: usize,
    pub inter: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fused_kernels_take_llama_widths_and_refuse_rows_they_cannot_hold() {
        // Llama-3-8B: hidden 4,096 (256 threads, 2 groups of 8 each), FFN 14,336 (512, 3.5).
        assert_eq!(fused_threads(4096), Some(256));
        assert_eq!(fused_threads(14336), Some(512));
        assert_eq!(fused_threads(64), Some(64));
        assert_eq!(fused_threads(16384), Some(512));
        assert_eq!(fused_threads(16392), None); // more than 4 groups per thread
        assert_eq!(fused_threads(4100), None); // not a multiple of 8
        assert_eq!(fused_threads(0), None);
        assert!(fused_supported(4096, 14336));
        assert!(!fused_supported(4096, 14340));
    }

    #[test]
    fn encoding_saturates_as_the_devices_satfinite_conversion() {
        assert_eq!(f32_to_e4m3(1000.0), 0x7e);
        assert_eq!(f32_to_e4m3(-f32::INFINITY), 0xfe);
        assert_eq!(f32_to_e4m3(450.0), 0x7e);
        assert_eq!(f32_to_e4m3(1.0625), 0x38); // ties to even
    }

    #[test]
    fn rows_get_their_own_scale_and_the_max_maps_to_448() {
        let x = [0.5, -1.0, 0.25, 0.0, 0.0, 0.0, 0.0, 0.0, 3.0, 1.5, -0.75, 0.1];
        let (codes, scales) = quantize_rows(&x, 4);
        assert_eq!(scales, vec![1.0 / 448.0, 1.0, 3.0 / 448.0]);
        assert_eq!(codes[1], 0xfe); // -1.0 / (1/448) = -448
        assert_eq!(&codes[4..8], &[0, 0, 0, 0]); // an all-zero row: scale 1, codes 0
        assert_eq!(codes[8], 0x7e);
        // Every value comes back within half an e4m3 step (relative 2^-4) of the row's scale.
        for (r, row) in x.chunks(4).enumerate() {
            for (c, &v) in row.iter().enumerate() {
                let back = e4m3_to_f32(codes[r * 4 + c]) * scales[r];
                assert!((back - v).abs() <= v.abs() / 16.0 + scales[r] * 2f32.powi(-10), "{v} -> {back}");
            }
        }
    }

    /// The GEMV's decode (`unpack_w` in `kernels/gemv.cu`): the sign and the 7 low bits of a
    /// code moved to bits 31 and 26..20 of an f32 are the code's value times 2^-120, so the
    /// row scale times 2^120 restores it — subnormals included.
    #[test]
    fn the_gemv_bit_decode_is_the_value_times_two_to_the_minus_120() {
        for c in (0u8..=255).filter(|c| c & 0x7f != 0x7f) {
            let t = (u32::from(c) << 24) as i32 >> 4;
            let f = f32::from_bits(t as u32 & 0x87f0_0000);
            assert_eq!(f * 2f32.powi(120), e4m3_to_f32(c), "code {c:#x}");
        }
    }
}
