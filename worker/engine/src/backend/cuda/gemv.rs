//! Decode GEMVs (`kernels/gemv.cu`): the fast mode's matrix products for steps of at most
//! [`GEMV_MAX_M`] tokens, with RMSNorm, the residual add and SiLU·mul fused in (see the kernel
//! file for the modes). A decode step is bound by reading the weights from HBM; these kernels
//! stream each weight row once with 16-byte loads and keep several in flight per warp, and the
//! fusions remove four small kernels per layer (both norms, RoPE + the K/V cache write, and
//! SiLU·mul; the residual adds move into the GEMV epilogues). Blocks are persistent (grid =
//! resident blocks, looping over row tiles) so each block's norm prologue runs once; the
//! prologue's loads are vectorised and unrolled (issued one L2 round trip at a time they cost
//! ~9 µs per kernel on an H200).
//!
//! Above a few tokens these CUDA-core kernels become bound by re-reading the activations from
//! L1 and by registers (measured on an H200: 8 tokens took 16.5 ms per Llama-3-8B step against
//! 6.3 ms through cuBLASLt), so the backend uses them only up to
//! `CudaOptions::gemv_max_tokens` tokens.

use cudarc::driver::sys::CUfunction_attribute_enum;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::device::{Gpu, nvrtc_include_paths};
use super::error::{CudaError, CudaResultExt};

/// The kernels' CUDA C source.
pub const GEMV_SRC: &str = include_str!("kernels/gemv.cu");

/// Largest token count the GEMV kernels are instantiated for.
pub const GEMV_MAX_M: usize = 4;
/// Warps per block (`GEMV_WARPS` in the kernel file) unless a variant says otherwise, and rows
/// per warp (`GEMV_R`).
const WARPS: usize = 8;
const ROWS_PER_WARP: usize = 2;
/// u64 words per block record of the `GEMV_TRACE` build (see the kernel file).
pub const TRACE_WORDS: usize = 8;

/// What a GEMV computes (kernel `MODE` and prologue).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvKind {
    /// Fused QKV: `rmsnorm(x)·Wᵀ` with RoPE and the K/V cache write (see [`RopeArgs`]).
    QkvRope,
    /// f32 `y = x·Wᵀ` (lm_head; `x` already normed), or with FP8 weights and a gain
    /// `y = rmsnorm(x)·Wᵀ` of the f32 residual rows (the final norm in the prologue).
    LogitsF32,
    /// f32 `x_res += bf16(x·Wᵀ)` (o_proj, down_proj).
    Residual,
    /// bf16 `act = silu(g)·u`, `[g; u] = rmsnorm(x)·[W_gate; W_up]ᵀ` (gate_up).
    NormGateUpSilu,
}

/// One GEMV launch ([`Gemv::launch`]) over `m` tokens.
#[derive(Clone, Copy, Debug)]
pub struct GemvArgs {
    /// What the launch computes.
    pub kind: GemvKind,
    /// Tokens (activation rows), 1..=[`GEMV_MAX_M`].
    pub m: usize,
    /// Output, as `kind` says.
    pub y: u64,
    /// bf16 weight `[out, inp]` (`[2·out, inp]` for [`GemvKind::NormGateUpSilu`]), 16-byte
    /// aligned.
    pub w: u64,
    /// Activations `[m, inp]`: bf16, or the f32 residual rows for the norm kinds.
    pub x: u64,
    /// The norm kinds' RMSNorm gain `[inp]` (0 otherwise).
    pub gain: u64,
    /// FP8 weights: the f32 scale of each physical weight row (`w` holds e4m3 codes); 0 for
    /// bf16 weights.
    pub wscale: u64,
    /// The weight's row count, except for gate_up (`inter`).
    pub out: usize,
    /// Input features, a multiple of 8 (for the norm kinds, the width `Gemv::new` sized for).
    pub inp: usize,
    /// RMSNorm epsilon (norm kinds).
    pub eps: f32,
    /// Positions, slots and caches of [`GemvKind::QkvRope`] (default otherwise).
    pub rope: RopeArgs,
}

/// Extra arguments of [`GemvKind::QkvRope`]: per-token positions and cache slots (u32, `m`
/// each; slot `u32::MAX` = no write), RoPE inverse frequencies (f32 `[hd/2]`), this layer's K
/// and V caches (bf16 `[blocks, block_size, kv_heads, hd]`) and the head counts.
#[derive(Clone, Copy, Debug, Default)]
pub struct RopeArgs {
    pub pos: u64,
    pub slots: u64,
    pub inv_freq: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub q_heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    /// 1: the caches hold e4m3 (per-tensor scale 1) instead of bf16.
    pub kv_fp8: i32,
}

impl GemvKind {
    fn index(self) -> usize {
        match self {
            Self::QkvRope => 0,
            Self::LogitsF32 => 1,
            Self::Residual => 2,
            Self::NormGateUpSilu => 3,
        }
    }
    fn name(self) -> &'static str {
        ["gemv_qkv_rope", "gemv_logits", "gemv_residual", "gemv_gate_up"][self.index()]
    }
    fn norm(self) -> bool {
        matches!(self, Self::QkvRope | Self::NormGateUpSilu)
    }
}

/// One compiled variant: `fns[m - 1][kind]` with its grid size cap.
struct Variant {
    fns: Vec<[(CudaFunction, u32); 4]>,
    /// Every kind stages its activations in shared memory (`GEMV_FP8H`), not only the norm
    /// kinds.
    staged: bool,
    /// Rows per warp group (`GEMV_R`).
    rows: usize,
    /// Warps per block of each kind (indexed as [`GemvKind::index`]).
    warps: [usize; 4],
    /// The module (its `gv_trace` globals in the `GEMV_TRACE` build).
    module: Arc<CudaModule>,
}

/// Compile-time variants (NVRTC defines, blocks per SM; 0 = as many as fit):
/// 0: 4 chunks in flight per weight row, every resident block;
/// 1: 16 loads in flight per lane, one block per SM (room for the next kernel's blocks to start
///    early under programmatic dependent launch);
/// 2: as 0 with one token's norm prologue held in registers (`GEMV_XREG=4`, see the kernel file).
const VARIANTS: [(&str, u32); 3] = [("-DGEMV_DEPTH=0", 0), ("-DGEMV_DEPTH=16", 1), ("-DGEMV_DEPTH=0 -DGEMV_XREG=4", 0)];

/// The FP8-weight variants (NVRTC defines besides `GEMV_FP8`, blocks per SM, staged
/// activations, rows per warp group), selected by `PRISM_GEMV_FP8_VARIANT` (default
/// [`FP8_DEFAULT`]):
/// 0: packed-f16 products, codes decoded by the hardware (`cvt.rn.f16x2.e4m3x2`);
/// 1 (the default before 16): as 0 with one row per warp group (half the registers, finer work split);
/// 2: as 0 with 8 loads in flight per weight row (two rows per warp) instead of 4;
/// 3: packed-f16 products, codes decoded with integer ops;
/// 4: f32 products, codes decoded with integer ops into f32 bit places (the first FP8 kernel);
/// 5, 6: as 2 and 0 with one block per SM (room for the next kernel's blocks under
///    programmatic dependent launch, `PRISM_CUDA_PDL=1`);
/// 7: as 1 with one token's activations held in registers through the prologue (`GEMV_XREG=4`:
///    one L2 read of the residual row per block instead of two), loaded after the first weights;
/// 8: as 1 with 16 warps per block (half the blocks, so half the prologues);
/// 9, 10: as 7 with the activations loaded before the first weights (`GEMV_XFIRST`), with 8 /
///    16 warps per block; 11: as 9 with 8 chunks per thread in registers; 12: as 7 with 16 warps;
/// 13, 14: as 9, 10 with the whole prologue before the first weight load (`GEMV_XFIRST=2`);
/// 15: as 7 with the QKV kernel compiled for three resident blocks per SM (`GEMV_QKV_MINB=3`);
/// 16 (default): each product as it measured best on an H200 (2026-12-02, batch-1 Llama-3-8B
///    shapes): QKV as 15, gate_up and lm_head as 7, o_proj and down_proj as 14
///    (`GEMV_WARPS_RES=16 GEMV_XFIRST_RES=2`); 17: as 16 with the residual kind's activations
///    loaded after the first weights (as 12), so its weight loads can start under PDL.
/// The last fields are the warps per block of every kind but the residual one, and of it.
const FP8_VARIANTS: [(&str, u32, bool, usize, usize, usize); 18] = [
    ("-DGEMV_FP8H=1", 0, true, 2, WARPS, WARPS),
    ("-DGEMV_FP8H=1 -DGEMV_R=1", 0, true, 1, WARPS, WARPS),
    ("-DGEMV_FP8H=1 -DGEMV_DEPTH=16", 0, true, 2, WARPS, WARPS),
    ("-DGEMV_FP8H=2", 0, true, 2, WARPS, WARPS),
    ("-DGEMV_DEPTH=0", 0, false, 2, WARPS, WARPS),
    ("-DGEMV_FP8H=1 -DGEMV_DEPTH=16", 1, true, 2, WARPS, WARPS),
    ("-DGEMV_FP8H=1", 1, true, 2, WARPS, WARPS),
    ("-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_XREG=4", 0, true, 1, WARPS, WARPS),
    ("-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_WARPS=16", 0, true, 1, 16, 16),
    ("-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_XREG=4 -DGEMV_XFIRST=1", 0, true, 1, WARPS, WARPS),
    ("-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_XREG=4 -DGEMV_XFIRST=1 -DGEMV_WARPS=16", 0, true, 1, 16, 16),
    ("-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_XREG=8 -DGEMV_XFIRST=1", 0, true, 1, WARPS, WARPS),
    ("-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_XREG=4 -DGEMV_WARPS=16", 0, true, 1, 16, 16),
    ("-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_XREG=4 -DGEMV_XFIRST=2", 0, true, 1, WARPS, WARPS),
    ("-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_XREG=4 -DGEMV_XFIRST=2 -DGEMV_WARPS=16", 0, true, 1, 16, 16),
    ("-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_XREG=4 -DGEMV_QKV_MINB=3", 0, true, 1, WARPS, WARPS),
    (
        "-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_XREG=4 -DGEMV_QKV_MINB=3 -DGEMV_WARPS_RES=16 -DGEMV_XFIRST_RES=2",
        0,
        true,
        1,
        WARPS,
        16,
    ),
    ("-DGEMV_FP8H=1 -DGEMV_R=1 -DGEMV_XREG=4 -DGEMV_QKV_MINB=3 -DGEMV_WARPS_RES=16", 0, true, 1, WARPS, 16),
];
/// FP8 variant used unless `PRISM_GEMV_FP8_VARIANT` says otherwise
/// (`PRISM_GEMV_FP8_KINDS=qkv=1,down=2` picks one per product): 16, the per-product choice of one
/// module (2.56 against 2.85 ms for variant 1 per batch-1 step on an H200 in one run, same
/// logits; the figures are in docs/benchmarks.md).
const FP8_DEFAULT: usize = 16;
/// bf16 variant used unless `PRISM_GEMV_VARIANT` says otherwise: 2 (4.18 against 4.28 ms for 0
/// per batch-1 step on an H200 in one run, same logits).
const BF16_DEFAULT: usize = 2;
/// The products `PRISM_GEMV_FP8_KINDS` names.
const PRODUCTS: [&str; 5] = ["qkv", "o_proj", "gate_up", "down", "lm_head"];

/// One module to compile: NVRTC defines, blocks per SM (0 = as many as fit), FP8 weights,
/// staged activations, rows per warp group, warps per block of the kinds other than the
/// residual one and of the residual one, and whether it is wanted (unwanted FP8 variants keep their index as `None`).
struct Build {
    defines: &'static str,
    per_sm_cap: u32,
    fp8: bool,
    staged: bool,
    rows: usize,
    warps: usize,
    warps_res: usize,
    wanted: bool,
}

/// The loaded GEMV kernels.
pub struct Gemv {
    variants: Vec<Variant>,
    /// The same kernels over FP8 weights, indexed as [`FP8_VARIANTS`] (compiled with
    /// `GEMV_FP8`; none unless the model has FP8 weights, only the one in use unless
    /// `PRISM_GEMV_FP8_SWEEP=1`).
    variants_fp8: Vec<Option<Variant>>,
    /// Variant in use (index into the compiled variants; benchmarks switch it).
    pub variant: usize,
    /// FP8 variant in use (index into [`FP8_VARIANTS`]).
    variant_fp8: usize,
    /// Per-product FP8 variants that override `variant_fp8` (`PRISM_GEMV_FP8_KINDS`), indexed
    /// by [`Gemv::product`].
    kind_fp8: [Option<usize>; 5],
    /// Input width the norm prologues' shared memory was sized for.
    norm_inp: usize,
    /// Widest input of the other kinds (the staged variants keep it in shared memory).
    stage_inp: usize,
    /// Launch with programmatic dependent launch (Hopper and later; on by default for models
    /// with FP8 weights, `PRISM_CUDA_PDL=1` / `0` forces it on / off).
    pub pdl: bool,
}

impl Gemv {
    /// Compiles and loads `kernels/gemv.cu` for the device and sizes the norm kernels' dynamic
    /// shared memory for activation rows of `norm_inp` (the model's hidden size), and, for the
    /// FP8 variants that stage every kind's activations, the others' for `stage_inp` (the
    /// widest input of o_proj, down_proj and lm_head).
    ///
    /// # Errors
    /// [`CudaError`] on compile or load failure, or when `norm_inp` rows of [`GEMV_MAX_M`]
    /// tokens do not fit in shared memory.
    pub fn new(gpu: &Gpu, norm_inp: usize, stage_inp: usize, fp8: bool) -> Result<Self, CudaError> {
        let sms = gpu
            .ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .op("SM count")?
            .max(1) as u32;
        let variant_fp8 = std::env::var("PRISM_GEMV_FP8_VARIANT")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v| v < FP8_VARIANTS.len())
            .unwrap_or(FP8_DEFAULT);
        // "1": every variant; else a comma-separated list of them.
        let sweep: Vec<usize> = match std::env::var("PRISM_GEMV_FP8_SWEEP") {
            Ok(v) if v == "1" => (0..FP8_VARIANTS.len()).collect(),
            Ok(v) => v.split(',').filter_map(|i| i.trim().parse().ok()).collect(),
            Err(_) => Vec::new(),
        };
        // Per-product overrides, e.g. "qkv=1,o_proj=1,down=2" (names as in `PRODUCTS`).
        let mut kind_fp8 = [None; 5];
        for item in std::env::var("PRISM_GEMV_FP8_KINDS").unwrap_or_default().split(',') {
            if let Some((name, v)) = item.split_once('=')
                && let (Some(slot), Ok(v)) = (PRODUCTS.iter().position(|&p| p == name.trim()), v.trim().parse())
                && v < FP8_VARIANTS.len()
            {
                kind_fp8[slot] = Some(v);
            }
        }
        // Per-block timing records (`GEMV_TRACE`, see the kernel file) for `cuda_bench`.
        let trace = std::env::var("PRISM_GEMV_TRACE").is_ok_and(|v| v == "1");
        let mut variants = Vec::new();
        let mut variants_fp8 = Vec::new();
        let mut builds: Vec<Build> = VARIANTS
            .iter()
            .map(|&(defines, per_sm_cap)| Build {
                defines,
                per_sm_cap,
                fp8: false,
                staged: false,
                rows: ROWS_PER_WARP,
                warps: WARPS,
                warps_res: WARPS,
                wanted: true,
            })
            .collect();
        if fp8 {
            builds.extend(FP8_VARIANTS.iter().enumerate().map(
                |(i, &(defines, per_sm_cap, staged, rows, warps, warps_res))| Build {
                    defines,
                    per_sm_cap,
                    fp8: true,
                    staged,
                    rows,
                    warps,
                    warps_res,
                    wanted: sweep.contains(&i) || i == variant_fp8 || kind_fp8.contains(&Some(i)),
                },
            ));
        }
        for Build { defines, per_sm_cap, fp8: fp8_w, staged, rows, warps: warps_other, warps_res, wanted } in builds {
            let warps_of = |k: GemvKind| if k == GemvKind::Residual { warps_res } else { warps_other };
            if !wanted {
                variants_fp8.push(None);
                continue;
            }
            let mut options: Vec<String> = defines.split_whitespace().map(str::to_owned).collect();
            if fp8_w {
                options.push("-DGEMV_FP8".to_owned());
            }
            if trace {
                options.push("-DGEMV_TRACE".to_owned());
            }
            let opts = CompileOptions {
                arch: Some(gpu.arch),
                include_paths: nvrtc_include_paths(),
                options,
                ..Default::default()
            };
            let ptx = compile_ptx_with_opts(GEMV_SRC, opts).op("NVRTC compile of gemv.cu")?;
            let module = gpu.ctx.load_module(ptx).op("load_module gemv")?;
            let mut fns = Vec::with_capacity(GEMV_MAX_M);
            for m in 1..=GEMV_MAX_M {
                let f = |k: GemvKind| -> Result<(CudaFunction, u32), CudaError> {
                    let warps = warps_of(k);
                    let name = format!("{}_m{m}", k.name());
                    let f = module.load_function(&name).map_err(|e| CudaError::op(name, e))?;
                    let bytes = if k.norm() {
                        Self::smem(m, norm_inp, staged, warps)
                    } else if staged {
                        Self::smem(m, stage_inp, true, warps)
                    } else {
                        0
                    };
                    if bytes > 0 {
                        f.set_attribute(
                            CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            bytes as i32,
                        )
                        .op("gemv shared memory")?;
                    }
                    let per_sm = f
                        .occupancy_max_active_blocks_per_multiprocessor((warps * 32) as u32, bytes, None)
                        .op("gemv occupancy")?
                        .max(1);
                    let per_sm = if per_sm_cap > 0 { per_sm.min(per_sm_cap) } else { per_sm };
                    Ok((f, per_sm * sms))
                };
                fns.push([
                    f(GemvKind::QkvRope)?,
                    f(GemvKind::LogitsF32)?,
                    f(GemvKind::Residual)?,
                    f(GemvKind::NormGateUpSilu)?,
                ]);
            }
            let warps =
                [GemvKind::QkvRope, GemvKind::LogitsF32, GemvKind::Residual, GemvKind::NormGateUpSilu].map(warps_of);
            let v = Variant { fns, staged, rows, warps, module };
            if fp8_w { variants_fp8.push(Some(v)) } else { variants.push(v) }
        }
        let variant = std::env::var("PRISM_GEMV_VARIANT")
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|&v| v < VARIANTS.len())
            .unwrap_or(BF16_DEFAULT);
        let (major, _) = gpu.ctx.compute_capability().op("compute_capability")?;
        // Measured on an H200 (2026-12-02, one run, batch-1 Llama-3-8B shapes): with FP8
        // weights it saves 0.05 ms per step (2.516 vs 2.562 ms), with bf16 weights it costs as
        // much (4.227 vs 4.176 ms: the persistent bf16 grids leave little room for the next
        // kernel's blocks). So on for FP8 models, off otherwise.
        let pdl = major >= 9
            && match std::env::var("PRISM_CUDA_PDL").as_deref() {
                Ok("1") => true,
                Ok("0") => false,
                _ => fp8,
            };
        Ok(Self { variants, variants_fp8, variant, variant_fp8, kind_fp8, norm_inp, stage_inp, pdl })
    }

    /// Dynamic shared memory of a kernel staging `m` rows of `inp` activations (2-byte
    /// values, then f32 reduction slots: one set per warp and token, two for the staged
    /// variants' row maxima).
    fn smem(m: usize, inp: usize, staged: bool, warps: usize) -> usize {
        m * inp * 2 + (1 + usize::from(staged)) * warps * m * 4
    }

    /// Which product of a layer a launch is ([`PRODUCTS`] index): the residual kind is o_proj
    /// up to the hidden width (`norm_inp`) and down_proj above it.
    fn product(kind: GemvKind, inp: usize, norm_inp: usize) -> usize {
        match kind {
            GemvKind::QkvRope => 0,
            GemvKind::Residual if inp <= norm_inp => 1,
            GemvKind::NormGateUpSilu => 2,
            GemvKind::Residual => 3,
            GemvKind::LogitsF32 => 4,
        }
    }

    /// Whether an FP8 lm_head launch ([`GemvKind::LogitsF32`] with FP8 weights) can take the
    /// final RMSNorm in its prologue (a gain given): only the staged variants can, so the
    /// caller norms the rows itself otherwise.
    pub fn lm_head_takes_norm(&self) -> bool {
        let v =
            self.kind_fp8[Self::product(GemvKind::LogitsF32, self.norm_inp, self.norm_inp)].unwrap_or(self.variant_fp8);
        self.variants_fp8.get(v).and_then(Option::as_ref).is_some_and(|v| v.staged)
    }

    /// The FP8 variants compiled (indices into [`FP8_VARIANTS`]).
    pub fn fp8_variants(&self) -> Vec<usize> {
        self.variants_fp8.iter().enumerate().filter_map(|(i, v)| v.as_ref().map(|_| i)).collect()
    }

    /// The FP8 variant in use.
    pub fn fp8_variant(&self) -> usize {
        self.variant_fp8
    }

    /// Selects a compiled FP8 variant (benchmarks); false when `v` was not compiled.
    pub fn set_fp8_variant(&mut self, v: usize) -> bool {
        let ok = self.variants_fp8.get(v).is_some_and(Option::is_some);
        if ok {
            self.variant_fp8 = v;
        }
        ok
    }

    /// The block records the variant in use (the FP8 one when the model has FP8 weights) wrote
    /// since the last call,
    /// [`TRACE_WORDS`] u64 each (benchmarks; empty unless built with `PRISM_GEMV_TRACE=1`), and
    /// clears them. Synchronises the stream.
    ///
    /// # Errors
    /// [`CudaError`] on a copy failure.
    pub fn trace_take(&self, gpu: &Gpu) -> Result<Vec<u64>, CudaError> {
        let v = if self.variants_fp8.iter().any(Option::is_some) {
            self.variants_fp8.get(self.variant_fp8).and_then(Option::as_ref)
        } else {
            self.variants.get(self.variant)
        };
        let Some(v) = v else { return Ok(Vec::new()) };
        let Ok(mut count) = v.module.get_global("gv_trace_n", &gpu.stream) else { return Ok(Vec::new()) };
        let mut n = [0u8; 4];
        gpu.stream.memcpy_dtoh(&count, &mut n).op("trace count")?;
        let n = (u32::from_le_bytes(n) as usize)
            .min(v.module.get_global("gv_trace", &gpu.stream).op("trace")?.len() / 8 / TRACE_WORDS);
        let mut words = vec![0u8; n * TRACE_WORDS * 8];
        if n > 0 {
            let buf = v.module.get_global("gv_trace", &gpu.stream).op("trace")?;
            gpu.stream.memcpy_dtoh(&buf.slice(..words.len()), &mut words).op("trace records")?;
        }
        gpu.stream.memcpy_htod(&[0u8; 4], &mut count).op("trace reset")?;
        gpu.stream.synchronize().op("trace sync")?;
        Ok(words.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
    }

    /// Enqueues one GEMV over `a.m` tokens (see [`GemvArgs`] for the operands; `a.rope` is
    /// used by [`GemvKind::QkvRope`] only).
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] when `m` is 0 or above [`GEMV_MAX_M`], `inp` is not a
    /// multiple of 8, or a norm kind's `inp` differs from the one planned; [`CudaError`] on
    /// launch failure.
    pub fn launch(&self, gpu: &Gpu, a: &GemvArgs) -> Result<(), CudaError> {
        let GemvArgs { kind, m, y, w, wscale, x, gain, out, inp, eps, ref rope } = *a;
        // 16-byte rows and activations; the norm prologue reads the gain 4 values at a time.
        let aligned = w.is_multiple_of(16) && x.is_multiple_of(16) && gain.is_multiple_of(8);
        // The lm_head with its norm (a gain given): the FP8 (staged) kernels only.
        let norm = kind.norm() || (kind == GemvKind::LogitsF32 && gain != 0);
        if norm && !kind.norm() && wscale == 0 {
            return Err(CudaError::InvalidLaunch("gemv: the lm_head takes its norm with FP8 weights only".into()));
        }
        // A 16-byte load holds 8 bf16 or 16 FP8 weights.
        let chunk = if wscale != 0 { 16 } else { 8 };
        if m == 0 || m > GEMV_MAX_M || !aligned || !inp.is_multiple_of(chunk) || (norm && inp != self.norm_inp) {
            return Err(CudaError::InvalidLaunch(format!("gemv: m {m}, inp {inp} not supported")));
        }
        let v = if wscale != 0 {
            let v = self.kind_fp8[Self::product(kind, inp, self.norm_inp)].unwrap_or(self.variant_fp8);
            self.variants_fp8.get(v).and_then(Option::as_ref)
        } else {
            self.variants.get(self.variant.min(self.variants.len().saturating_sub(1)))
        }
        .ok_or_else(|| CudaError::InvalidLaunch("gemv: FP8 weights but the FP8 kernels were not built".into()))?;
        if norm && !kind.norm() && !v.staged {
            return Err(CudaError::InvalidLaunch("gemv: the lm_head's norm needs a staged variant".into()));
        }
        if v.staged && !kind.norm() && inp > self.stage_inp {
            return Err(CudaError::InvalidLaunch(format!("gemv: inp {inp} wider than the {} planned", self.stage_inp)));
        }
        let (f, resident) = &v.fns[m - 1][kind.index()];
        // Logical rows: RoPE pairs for the fused QKV.
        let rows = if kind == GemvKind::QkvRope { out / 2 } else { out };
        let warps = v.warps[kind.index()];
        let blocks = (rows.div_ceil(warps * v.rows) as u32).min(*resident);
        let shared = if norm || v.staged { Self::smem(m, inp, v.staged, warps) as u32 } else { 0 };
        let cfg =
            LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: ((warps * 32) as u32, 1, 1), shared_mem_bytes: shared };
        let (out_i, inp_i) = (rows as i32, inp as i32);
        if self.pdl {
            use std::ffi::c_void;
            let p = |v: &u64| v as *const u64 as *mut c_void;
            let pi = |v: &i32| v as *const i32 as *mut c_void;
            let mut params: Vec<*mut c_void> = vec![
                p(&y),
                p(&w),
                p(&x),
                p(&gain),
                pi(&out_i),
                pi(&inp_i),
                &eps as *const f32 as *mut c_void,
                p(&wscale),
            ];
            if kind == GemvKind::QkvRope {
                params.extend([p(&rope.pos), p(&rope.slots), p(&rope.inv_freq), p(&rope.k_cache), p(&rope.v_cache)]);
                params.extend([pi(&rope.q_heads), pi(&rope.kv_heads), pi(&rope.head_dim), pi(&rope.kv_fp8)]);
            }
            // SAFETY: `params` points at locals that outlive the call, in the kernel's parameter
            // order and types; buffers as for the plain launch below.
            return unsafe { gpu.launch_programmatic(f, cfg, &mut params) }.op(kind.name());
        }
        let mut b = gpu.stream.launch_builder(f);
        b.arg(&y).arg(&w).arg(&x).arg(&gain).arg(&out_i).arg(&inp_i).arg(&eps).arg(&wscale);
        if kind == GemvKind::QkvRope {
            b.arg(&rope.pos).arg(&rope.slots).arg(&rope.inv_freq).arg(&rope.k_cache).arg(&rope.v_cache);
            b.arg(&rope.q_heads).arg(&rope.kv_heads).arg(&rope.head_dim).arg(&rope.kv_fp8);
        }
        // SAFETY: the caller passes buffers of the documented shapes; rows past `out` are
        // clamped in the kernel; shared memory matches the attribute set in `new`.
        unsafe { b.launch(cfg) }.map(|_| ()).op(kind.name())
    }
}
