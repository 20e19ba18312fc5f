//! FP8 (e4m3) on the device (`kernels/fp8.cu`): per-row quantization of bf16 matrices (the
//! weights at load, per output channel; the activations of the FP8 GEMMs, per token) and the
//! dequantization of a matrix back to bf16; the host reference of the quantization rule is
//! [`quantize_rows`] (`model::fp8`, which `scripts/quantize_fp8.py` also follows bit for bit).
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

/// The loaded FP8 kernels.
pub struct Fp8Kernels {
    quantize: CudaFunction,
    dequantize: CudaFunction,
    scale: CudaFunction,
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
        })
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

#[cfg(test)]
mod tests {
    use super::*;

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
