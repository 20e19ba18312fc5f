//! FP8 (e4m3) on the device (`kernels/fp8.cu`): per-row quantization of bf16 matrices (the
//! weights at load, per output channel; the activations of the FP8 GEMMs, per token) and the
//! dequantization of a matrix back to bf16, plus the host reference of the quantization rule
//! ([`quantize_rows`]) the unit tests check the format against.
//!
//! The rule (vLLM's `--quantization fp8`, per-channel weights and dynamic per-token
//! activations): `scale[r] = max|x[r]| / 448` (1 for an all-zero row), `code = e4m3(x · (1 /
//! scale))` rounded to nearest even and saturated to ±448; a value is `code · scale`.

use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::device::{Gpu, grid_stride, nvrtc_include_paths};
use super::error::{CudaError, CudaResultExt};

/// The kernels' CUDA C source.
pub const FP8_SRC: &str = include_str!("kernels/fp8.cu");

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// The loaded FP8 kernels.
pub(crate) struct Fp8Kernels {
    quantize: CudaFunction,
    dequantize: CudaFunction,
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
        })
    }

    /// Enqueues the quantization of the bf16 matrix `x [rows, cols]` into e4m3 `codes` and f32
    /// `scales [rows]` (the rule in the module docs).
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] unless `cols` is a multiple of 8 and `x` 16-byte aligned;
    /// [`CudaError`] on launch failure.
    pub fn quantize(&self, gpu: &Gpu, codes: u64, scales: u64, x: u64, rows: usize, cols: usize) -> Result<(), CudaError> {
        if rows == 0 {
            return Ok(());
        }
        if !cols.is_multiple_of(8) || !x.is_multiple_of(16) || !codes.is_multiple_of(8) {
            return Err(CudaError::InvalidLaunch(format!("quantize_rows_e4m3: {cols} columns (a multiple of 8)")));
        }
        let (r, c) = (rows as i32, cols as i32);
        let mut b = gpu.stream.launch_builder(&self.quantize);
        b.arg(&codes).arg(&scales).arg(&x).arg(&r).arg(&c);
        let cfg = LaunchConfig { grid_dim: (rows.min(65_535) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: the caller passes x of rows × cols bf16, codes of rows × cols bytes and
        // scales of rows f32.
        unsafe { b.launch(cfg) }.map(|_| ()).op("quantize_rows_e4m3")
    }

    /// Enqueues `y [rows, cols] = bf16(code · scale[row])`.
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] unless `cols` is a multiple of 8; [`CudaError`] on launch
    /// failure.
    pub fn dequantize(&self, gpu: &Gpu, y: u64, codes: u64, scales: u64, rows: usize, cols: usize) -> Result<(), CudaError> {
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

/// The e4m3 code nearest to `x` (ties to even), saturating at ±448 (the device's
/// `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`); NaN gives `0x7f` with `x`'s sign.
pub fn e4m3_from_f32(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 31) as u8) << 7;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= 464.0 {
        // Halfway between 448 and the next (absent) step rounds up past the range: saturate.
        return sign | 0x7e;
    }
    if a < 1.0 / 64.0 {
        // Subnormals are multiples of 2^-9; 2^-6 (code 8) is also the smallest normal.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let exp = (bits >> 23) as i32 - 127;
    let (keep, rest) = ((bits >> 20) & 7, bits & 0xf_ffff);
    let up = rest > 0x8_0000 || (rest == 0x8_0000 && keep & 1 == 1);
    // A carry out of the mantissa moves to the next exponent, as the encoding wants.
    let code = (((exp + 7) as u32) << 3) + keep + u32::from(up);
    sign | code.min(0x7e) as u8
}

/// The value of an e4m3 code (NaN for `0x7f` and `0xff`).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from((code >> 3) & 0xf), f32::from(code & 7));
    if exp == 0xf && code & 7 == 7 {
        return f32::NAN;
    }
    sign * if exp == 0 { man / 8.0 * 2f32.powi(-6) } else { (1.0 + man / 8.0) * 2f32.powi(exp - 7) }
}

/// The host reference of the device quantization: `x [rows, cols]` (bf16 values held as f32)
/// to (codes, per-row scales), the rule in the module docs.
pub fn quantize_rows(x: &[f32], cols: usize) -> (Vec<u8>, Vec<f32>) {
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(x.len() / cols.max(1));
    for row in x.chunks(cols.max(1)) {
        let m = row.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = if m > 0.0 { m / E4M3_MAX } else { 1.0 };
        let inv = 1.0 / s;
        codes.extend(row.iter().map(|&v| e4m3_from_f32(v * inv)));
        scales.push(s);
    }
    (codes, scales)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_codes_have_their_ocp_values() {
        // OCP 8-bit FP spec v1.0: bias 7, max 448 = S.1111.110, min normal 2^-6, min subnormal 2^-9.
        let known = [
            (0x00, 0.0),
            (0x01, 2f32.powi(-9)),
            (0x07, 7.0 * 2f32.powi(-9)),
            (0x08, 2f32.powi(-6)),
            (0x38, 1.0),
            (0x39, 1.125),
            (0x40, 2.0),
            (0x7e, 448.0),
            (0xb8, -1.0),
            (0xfe, -448.0),
        ];
        for (code, v) in known {
            assert_eq!(e4m3_to_f32(code), v, "code {code:#x}");
            assert_eq!(e4m3_from_f32(v), code, "value {v}");
        }
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
    }

    #[test]
    fn encoding_rounds_to_nearest_even_and_saturates() {
        // Every finite code round-trips.
        for c in (0u8..=255).filter(|c| c & 0x7f != 0x7f) {
            assert_eq!(e4m3_from_f32(e4m3_to_f32(c)), c, "code {c:#x}");
        }
        // 1.0625 is halfway between 1 (0x38, even) and 1.125: ties to even.
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.1875), 0x3a); // halfway 1.125/1.25 → 1.25 (even)
        assert_eq!(e4m3_from_f32(1.07), 0x39);
        assert_eq!(e4m3_from_f32(1000.0), 0x7e);
        assert_eq!(e4m3_from_f32(-f32::INFINITY), 0xfe);
        assert_eq!(e4m3_from_f32(450.0), 0x7e);
        // Subnormal halfway 0.5·2^-9 → 0 (even); 1.5·2^-9 → 2·2^-9.
        assert_eq!(e4m3_from_f32(0.5 * 2f32.powi(-9)), 0x00);
        assert_eq!(e4m3_from_f32(1.5 * 2f32.powi(-9)), 0x02);
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
