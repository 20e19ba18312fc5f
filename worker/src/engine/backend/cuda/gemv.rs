//! Decode GEMVs (`kernels/gemv.cu`): the fast mode's matrix products for steps of at most
//! [`GEMV_MAX_M`] tokens, with RMSNorm, the residual add and SiLU·mul fused in (see the kernel
//! file for the modes). A decode step is bound by reading the weights from HBM; these kernels
//! stream each weight row once with 16-byte loads and keep several in flight per warp, and the
//! fusions remove four small kernels per layer (two norms, SiLU·mul, and the residual adds move
//! into the GEMV epilogues).

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::device::{Gpu, dev_err};
use crate::engine::backend::BackendError;

/// The kernels' CUDA C source.
pub const GEMV_SRC: &str = include_str!("kernels/gemv.cu");

/// Largest token count the GEMV kernels are instantiated for.
pub const GEMV_MAX_M: usize = 8;
/// Warps per block and rows per warp (`GEMV_WARPS`, `GEMV_R` in the kernel file).
const WARPS: usize = 8;
const ROWS_PER_WARP: usize = 2;

/// What a GEMV computes (kernel `MODE` and prologue).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvKind {
    /// bf16 `y = rmsnorm(x)·Wᵀ` from the f32 residual stream (qkv).
    NormBf16,
    /// f32 `y = x·Wᵀ` (lm_head; `x` already normed).
    LogitsF32,
    /// f32 `x_res += bf16(x·Wᵀ)` (o_proj, down_proj).
    Residual,
    /// bf16 `act = silu(g)·u`, `[g; u] = rmsnorm(x)·[W_gate; W_up]ᵀ` (gate_up).
    NormGateUpSilu,
    /// bf16 `y = x·Wᵀ` (no fusion).
    Bf16,
}

impl GemvKind {
    fn index(self) -> usize {
        match self {
            Self::NormBf16 => 0,
            Self::LogitsF32 => 1,
            Self::Residual => 2,
            Self::NormGateUpSilu => 3,
            Self::Bf16 => 4,
        }
    }
    fn name(self) -> &'static str {
        ["gemv_qkv", "gemv_logits", "gemv_residual", "gemv_gate_up", "gemv_bf16"][self.index()]
    }
    fn norm(self) -> bool {
        matches!(self, Self::NormBf16 | Self::NormGateUpSilu)
    }
}

/// The loaded GEMV kernels: `fns[m - 1][kind]`.
pub struct Gemv {
    fns: Vec<[CudaFunction; 5]>,
    /// Input width the norm prologues' shared memory was sized for.
    norm_inp: usize,
}

impl Gemv {
    /// Compiles and loads `kernels/gemv.cu` for the device and sizes the norm kernels' dynamic
    /// shared memory for activation rows of `norm_inp` (the model's hidden size).
    ///
    /// # Errors
    /// [`BackendError::Device`] on compile or load failure, or when `norm_inp` rows of
    /// [`GEMV_MAX_M`] tokens do not fit in shared memory.
    pub fn new(gpu: &Gpu, norm_inp: usize) -> Result<Self, BackendError> {
        let opts = CompileOptions {
            arch: Some(gpu.arch),
            include_paths: vec!["/usr/local/cuda/include".into()],
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(GEMV_SRC, opts).map_err(|e| dev_err("NVRTC compile of gemv.cu", e))?;
        let module = gpu.ctx.load_module(ptx).map_err(|e| dev_err("load_module gemv", e))?;
        let mut fns = Vec::with_capacity(GEMV_MAX_M);
        for m in 1..=GEMV_MAX_M {
            let f = |k: GemvKind| -> Result<CudaFunction, BackendError> {
                let name = format!("{}_m{m}", k.name());
                let f = module.load_function(&name).map_err(|e| dev_err("load gemv", e))?;
                if k.norm() {
                    let bytes = Self::smem(m, norm_inp);
                    f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
                        .map_err(|e| dev_err("gemv shared memory", e))?;
                }
                Ok(f)
            };
            fns.push([
                f(GemvKind::NormBf16)?,
                f(GemvKind::LogitsF32)?,
                f(GemvKind::Residual)?,
                f(GemvKind::NormGateUpSilu)?,
                f(GemvKind::Bf16)?,
            ]);
        }
        Ok(Self { fns, norm_inp })
    }

    fn smem(m: usize, inp: usize) -> usize {
        m * inp * 2 + WARPS * m * 4
    }

    /// Enqueues one GEMV over `m` tokens: `w` is `[out, inp]` bf16 (`[2·out, inp]` for
    /// [`GemvKind::NormGateUpSilu`]), `x` the bf16 activations `[m, inp]` (f32 residual rows
    /// for the norm kinds, with `gain` the norm weight `[inp]`), `y` as the kind says.
    ///
    /// # Errors
    /// [`BackendError::InvalidBatch`] when `m` is 0 or above [`GEMV_MAX_M`], `inp` is not a
    /// multiple of 8, or a norm kind's `inp` differs from the one planned;
    /// [`BackendError::Device`] on launch failure.
    #[allow(clippy::too_many_arguments)]
    pub fn launch(&self, gpu: &Gpu, kind: GemvKind, m: usize, y: u64, w: u64, x: u64, gain: u64, out: usize, inp: usize, eps: f32) -> Result<(), BackendError> {
        if m == 0 || m > GEMV_MAX_M || !inp.is_multiple_of(8) || (kind.norm() && inp != self.norm_inp) {
            return Err(BackendError::InvalidBatch(format!("gemv: m {m}, inp {inp} not supported")));
        }
        let f = &self.fns[m - 1][kind.index()];
        let blocks = out.div_ceil(WARPS * ROWS_PER_WARP) as u32;
        let shared = if kind.norm() { Self::smem(m, inp) as u32 } else { 0 };
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: ((WARPS * 32) as u32, 1, 1), shared_mem_bytes: shared };
        let (out_i, inp_i) = (out as i32, inp as i32);
        let mut b = gpu.stream.launch_builder(f);
        b.arg(&y).arg(&w).arg(&x).arg(&gain).arg(&out_i).arg(&inp_i).arg(&eps);
        // SAFETY: the caller passes buffers of the documented shapes; rows past `out` are
        // clamped in the kernel; shared memory matches the attribute set in `new`.
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| dev_err(kind.name(), e))
    }
}
