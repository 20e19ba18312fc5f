//! The GEMM path of FP8 weights for steps above the decode GEMVs' token count ([`Fp8Path`]):
//! cuBLASLt's FP8 GEMM over e4m3 activations quantized per token (`gemm_fp8.rs`), or, where
//! cuBLASLt has no FP8 GEMM, the weight dequantized to bf16 and the bf16 GEMM.
//!
//! Unfused, a product takes three kernels: the activation quantization, the GEMM (the unscaled
//! product of the codes) and `scale_rows_cols` (its per-token × per-channel scales). Fused
//! ([`Fp8Path::fused_io`], Llama layers on one GPU), the kernels around the GEMMs do that work
//! as they read and write the rows anyway: they quantize on output (as vLLM's fused RMSNorm +
//! dynamic per-token quantization) and scale on input. The residual add + RMSNorm writes the
//! QKV and gate_up inputs as e4m3 with their scales and SiLU·mul the down input
//! (`kernels/fp8.cu`); the readers of the products apply the scales as they load them:
//! `rope_kv_write` for QKV, SiLU·mul for gate_up, the next residual add for o_proj and down.
//! Only o_proj's input (the attention output) and the lm_head keep a separate quantization /
//! scale pass. The activation codes are those of the unfused path for the same bf16
//! activations (one rounding fewer on the products: no bf16 copy of the scaled product).
//!
//! With `PRISM_FP8_OUTER_VEC=1` the GEMMs scale their products in cuBLASLt's epilogue instead
//! ([`Fp8Gemm::matmul_scaled`]; [`FusedIo::products_scaled`]): the readers then load no
//! per-channel scales (a f32 per element from L2 on every row) and the o_proj and lm_head
//! products need no scale pass; a shape cuBLASLt has no such algorithm for is scaled by
//! `scale_rows_cols` after the plain GEMM, so every product leaves the path scaled.

use super::device::{DevBuf, GemmArgs, GemmShape, Gpu};
use super::error::CudaError;
use super::fp8::{Fp8Kernels, NormIo, ScaleArgs, SiluIo, fused_supported};
use super::gemm::LtGemm;
use super::gemm_fp8::{Fp8Gemm, Fp8GemmArgs};
use super::options::Dims;
use super::weights::DeviceWeights;

/// What the GEMM path needs for FP8 weights: the activations of a product quantized per
/// token (`xq` e4m3 `[tokens, widest input]`, `xs` and `xs2` f32 `[tokens]`: the scales of
/// o_proj's and down's inputs, and of the norms' outputs), then cuBLASLt's FP8 GEMM, or, where
/// cuBLASLt has no FP8 GEMM, the weight dequantized to bf16 (`wtmp`, the largest layer matrix)
/// and the bf16 GEMM.
pub(crate) struct Fp8Path {
    k: Fp8Kernels,
    gemm: Fp8Gemm,
    xq: DevBuf,
    xs: DevBuf,
    xs2: DevBuf,
    wtmp: Option<DevBuf>,
    /// The fused passes apply to this model (see the module docs).
    fused: bool,
    /// The GEMMs scale their products (outer-vector epilogue; see the module docs).
    outer: bool,
}

/// A GEMM's input.
#[derive(Clone, Copy, Debug)]
pub(crate) enum GemmIn {
    /// bf16 rows (quantized per token first for an FP8 weight).
    Bf16(u64),
    /// Rows a fused kernel wrote as e4m3 codes into the path's activation buffer
    /// ([`FusedIo::codes`]), with their per-token scales at this address.
    Codes(u64),
}

/// One product of a step: `y [n, out] = x [n, inp] · wᵀ` (f32 `y` with `f32_out`), `ws` the
/// FP8 weight's per-row scales (0 for a bf16 weight). With `scaled` false the FP8 GEMM leaves
/// the unscaled product of the codes for a fused consumer to scale.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Product {
    pub y: u64,
    pub x: GemmIn,
    pub w: u64,
    pub ws: u64,
    pub shape: GemmShape,
    pub f32_out: bool,
    pub scaled: bool,
}

/// The buffers of the fused passes (device addresses): e4m3 activation rows, the per-token
/// scales of the rows the norms write (QKV, gate_up and lm_head inputs) and of the o_proj and
/// down inputs (the latter are also where [`GemmIn::Bf16`] rows' scales go).
#[derive(Clone, Copy, Debug)]
pub(crate) struct FusedIo {
    pub codes: u64,
    pub norm_scales: u64,
    pub act_scales: u64,
    /// The products come out of the path scaled: their readers take no scales.
    pub products_scaled: bool,
}

impl FusedIo {
    /// The scales a reader of a product applies as it loads it (the product's input scales at
    /// `xs`, its weight's at `ws`), or none when the path already scaled it.
    pub fn reader_scales(&self, xs: u64, ws: u64) -> Option<(u64, u64)> {
        (!self.products_scaled).then_some((xs, ws))
    }
}

impl Fp8Path {
    /// Buffers for steps of up to `tokens` tokens; probes cuBLASLt's FP8 GEMM at the gate_up
    /// shape. `llama_layers`: the layers are Llama's (no q/k/v bias or q/k norm, SiLU, no
    /// output norms), a condition of the fused passes.
    ///
    /// # Errors
    /// [`CudaError`] when cuBLASLt, the kernels or an allocation fail.
    pub fn new(gpu: &Gpu, d: &Dims, w: &DeviceWeights, tokens: usize, llama_layers: bool) -> Result<Self, CudaError> {
        let mut gemm = Fp8Gemm::new(gpu)?;
        let widest = d.hidden.max(d.inter).max(d.q_dim());
        let lt_ok = gemm.supports(tokens.min(256), 2 * d.inter, d.hidden);
        let wtmp = if lt_ok {
            None
        } else {
            tracing::warn!("cuBLASLt has no FP8 GEMM here: dequantizing weights for large steps");
            let most = [d.qkv_dim() * d.hidden, d.hidden * d.q_dim(), 2 * d.inter * d.hidden, d.hidden * d.inter];
            Some(DevBuf::zeroed(gpu, most.into_iter().max().unwrap_or(0).max(d.vocab * d.hidden) * 2)?)
        };
        // Every layer matrix in FP8 and the norm gains 16-byte aligned (the fused kernels'
        // vector loads; the weight layout aligns every tensor to 256 bytes).
        let all_fp8 = w
            .layers
            .iter()
            .all(|l| [l.qkv_scale, l.o_proj_scale, l.gate_up_scale, l.down_scale].iter().all(|&s| s != 0));
        let gains_aligned =
            w.layers.iter().flat_map(|l| [l.input_norm, l.post_norm]).chain([w.norm]).all(|p| p.is_multiple_of(16));
        let fused = lt_ok && llama_layers && all_fp8 && gains_aligned && fused_supported(d.hidden, d.inter);
        let off = std::env::var("PRISM_FP8_FUSED").is_ok_and(|v| v == "0");
        let want_outer = std::env::var("PRISM_FP8_OUTER_VEC").is_ok_and(|v| v == "1");
        let outer = lt_ok
            && want_outer
            && gemm.outer_vec_available(tokens.min(256), 2 * d.inter, d.hidden, true).unwrap_or(false);
        if outer {
            gemm.enable_outer_vec()?;
        } else if want_outer {
            tracing::warn!("PRISM_FP8_OUTER_VEC=1: cuBLASLt has no outer-vector FP8 GEMM here; scaling separately");
        }
        Ok(Self {
            k: Fp8Kernels::new(gpu)?,
            gemm,
            xq: DevBuf::zeroed(gpu, tokens * widest)?,
            xs: DevBuf::zeroed(gpu, tokens * 4)?,
            xs2: DevBuf::zeroed(gpu, tokens * 4)?,
            wtmp,
            fused: fused && !off,
            outer,
        })
    }

    /// How steps above the GEMVs' token count multiply: "cublaslt_fp8_fused",
    /// "cublaslt_fp8" (fused passes off: `PRISM_FP8_FUSED=0`, or a model they do not take) or
    /// "dequantize_bf16" (cuBLASLt has no FP8 GEMM); "_outer_vec" added when the GEMMs scale
    /// their products.
    pub fn gemm_path(&self) -> &'static str {
        match (&self.wtmp, self.fused, self.outer) {
            (Some(_), _, _) => "dequantize_bf16",
            (None, true, true) => "cublaslt_fp8_fused_outer_vec",
            (None, true, false) => "cublaslt_fp8_fused",
            (None, false, true) => "cublaslt_fp8_outer_vec",
            (None, false, false) => "cublaslt_fp8",
        }
    }

    /// The fused passes' buffers, when they apply (`tensor_parallel`: this shard's o_proj and
    /// down products are all-reduced, so their scales are applied before the reduction).
    pub fn fused_io(&self, tensor_parallel: bool) -> Option<FusedIo> {
        (self.fused && !tensor_parallel).then_some(FusedIo {
            codes: self.xq.ptr,
            norm_scales: self.xs2.ptr,
            act_scales: self.xs.ptr,
            products_scaled: self.outer,
        })
    }

    /// Enqueues `p` with an FP8 weight (`p.ws` set).
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] for [`GemmIn::Codes`] on the dequantizing fallback;
    /// [`CudaError`] when a kernel or the GEMM fails.
    pub fn matmul(&mut self, g: &Gpu, lt: &mut LtGemm, p: &Product) -> Result<(), CudaError> {
        let Product { y, x, w, ws, shape, f32_out, scaled } = *p;
        let GemmShape { n, out, inp } = shape;
        if let Some(tmp) = &self.wtmp {
            let GemmIn::Bf16(x) = x else {
                return Err(CudaError::InvalidLaunch("e4m3 activations for the dequantizing FP8 path".into()));
            };
            self.k.dequantize(g, tmp.ptr, w, ws, out, inp)?;
            return lt.matmul_heuristic(g, &GemmArgs { y, x, w: tmp.ptr, shape, f32_out });
        }
        let xs = match x {
            GemmIn::Bf16(x) => {
                self.k.quantize(g, self.xq.ptr, self.xs.ptr, x, n, inp)?;
                self.xs.ptr
            }
            GemmIn::Codes(xs) => xs,
        };
        let args = Fp8GemmArgs { y, xq: self.xq.ptr, wq: w, n, out, inp, f32_out };
        if self.gemm.matmul_scaled(g, &args, xs, ws)? {
            return Ok(());
        }
        self.gemm.matmul(g, &args)?;
        // With outer-vector scaling on, every product leaves the path scaled (its readers
        // take no scales), this one too.
        if !scaled && !self.outer {
            return Ok(());
        }
        self.k.scale_rows_cols(g, &ScaleArgs { y, xs, ws, n, out, f32_out })
    }

    /// Enqueues the fused residual add + RMSNorm ([`Fp8Kernels::add_rmsnorm_fp8io`]).
    ///
    /// # Errors
    /// As [`Fp8Kernels::add_rmsnorm_fp8io`].
    pub fn norm(&self, g: &Gpu, a: &NormIo) -> Result<(), CudaError> {
        self.k.add_rmsnorm_fp8io(g, a)
    }

    /// Enqueues the fused SiLU·mul ([`Fp8Kernels::silu_mul_fp8io`]).
    ///
    /// # Errors
    /// As [`Fp8Kernels::silu_mul_fp8io`].
    pub fn silu(&self, g: &Gpu, a: &SiluIo) -> Result<(), CudaError> {
        self.k.silu_mul_fp8io(g, a)
    }
}
