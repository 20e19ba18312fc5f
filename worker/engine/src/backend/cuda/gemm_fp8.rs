//! FP8 GEMMs through cuBLASLt (Hopper tensor cores, twice the bf16 rate): row-major
//! `y[n, out] = (xq[n, inp] · xs[n]) · (wq[out, inp] · ws[out])ᵀ` with e4m3 weights and
//! activations and f32 scales per output channel (`ws`) and per token (`xs`): cuBLASLt computes
//! the unscaled product of the codes (f32 accumulation, bf16 or f32 output: a quantized lm_head)
//! and `scale_rows_cols` (`kernels/fp8.cu`) or the product's fused consumer (`fp8_path.rs`)
//! multiplies it by both scales. With [`Fp8Gemm::enable_outer_vec`] the GEMM applies both
//! scales itself in its epilogue (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F` on A and B,
//! [`Fp8Gemm::matmul_scaled`]), so the product leaves it scaled and its readers load no scales;
//! that needs the scale pointers set before the heuristic query (without them cuBLASLt 13.0
//! answered no algorithm on 2026-12-01). As the bf16 fast mode, the algorithm is cuBLASLt's
//! first heuristic answer per `(n, out, inp)`, cached, with a fixed workspace (capturable into a
//! CUDA graph).

use std::collections::HashMap;

use cudarc::cublaslt::sys as lt;

use super::device::{DevBuf, Gpu};
use super::error::{CudaError, CudaResultExt};

/// cuBLASLt workspace.
const WORKSPACE_BYTES: usize = 32 << 20;

/// One FP8 product (device addresses).
#[derive(Clone, Copy, Debug)]
pub struct Fp8GemmArgs {
    /// Output `[n, out]`, bf16 (f32 when `f32_out`).
    pub y: u64,
    /// e4m3 activations `[n, inp]`.
    pub xq: u64,
    /// e4m3 weight `[out, inp]`.
    pub wq: u64,
    pub n: usize,
    pub out: usize,
    pub inp: usize,
    pub f32_out: bool,
}

/// cuBLASLt handle, the FP8 matmul descriptor, layouts and algorithms.
pub struct Fp8Gemm {
    handle: lt::cublasLtHandle_t,
    desc: lt::cublasLtMatmulDesc_t,
    ws: DevBuf,
    /// (rows, cols, type) → layout (column-major, leading dimension = rows).
    layouts: HashMap<(u64, u64, i32), lt::cublasLtMatrixLayout_t>,
    /// Per `(n, out, inp, f32_out, outer)`: the algorithm, or none for an outer-vector product
    /// cuBLASLt has no algorithm for (those fall back to the unscaled product).
    algos: HashMap<(usize, usize, usize, bool, bool), Option<lt::cublasLtMatmulAlgo_t>>,
    /// The descriptor with outer-vector scaling of A (per output channel) and B (per token),
    /// when enabled.
    outer: Option<lt::cublasLtMatmulDesc_t>,
}

// SAFETY: plain host objects used by one thread at a time (the engine thread).
unsafe impl Send for Fp8Gemm {}

fn lt_err(what: &'static str, s: lt::cublasStatus_t) -> Result<(), CudaError> {
    s.result().op(what)
}

/// Sets one attribute of `desc` from `v`.
fn set_desc<T>(
    desc: lt::cublasLtMatmulDesc_t,
    attr: lt::cublasLtMatmulDescAttributes_t,
    v: &T,
) -> Result<(), CudaError> {
    // SAFETY: `v` is the attribute's value of its documented size.
    lt_err("cublasLtMatmulDescSetAttribute", unsafe {
        lt::cublasLtMatmulDescSetAttribute(desc, attr, v as *const T as *const _, std::mem::size_of::<T>())
    })
}

/// Hopper's fast FP8 accumulation (no periodic promotion of the tensor-core accumulator to full
/// f32): on unless PRISM_FP8_FAST_ACCUM=0 (measured on an H200 in docs/benchmarks.md, with its
/// accuracy).
fn fast_accumulation() -> bool {
    std::env::var("PRISM_FP8_FAST_ACCUM").map_or(true, |v| v != "0")
}

impl Fp8Gemm {
    /// Creates the handle, the descriptor (A = weight transposed, fast accumulation) and the
    /// workspace.
    ///
    /// # Errors
    /// [`CudaError::Unavailable`] when cuBLASLt is missing; [`CudaError`] when it fails.
    pub fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        // SAFETY: only opens the library.
        if !unsafe { lt::is_culib_present() } {
            return Err(CudaError::Unavailable("libcublasLt not found"));
        }
        let mut handle = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        lt_err("cublasLtCreate", unsafe { lt::cublasLtCreate(&mut handle) })?;
        let mut desc = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        lt_err("cublasLtMatmulDescCreate", unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType::CUDA_R_32F,
            )
        })?;
        use lt::cublasLtMatmulDescAttributes_t as D;
        let me = Self {
            handle,
            desc,
            ws: DevBuf::zeroed(gpu, WORKSPACE_BYTES)?,
            layouts: HashMap::new(),
            algos: HashMap::new(),
            outer: None,
        };
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_TRANSA, &(cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32))?;
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &i8::from(fast_accumulation()))?;
        Ok(me)
    }

    fn layout(&mut self, rows: u64, cols: u64, ty: lt::cudaDataType) -> Result<lt::cublasLtMatrixLayout_t, CudaError> {
        let key = (rows, cols, ty as i32);
        if let Some(l) = self.layouts.get(&key) {
            return Ok(*l);
        }
        let mut l = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; column-major rows × cols with ld = rows.
        lt_err("cublasLtMatrixLayoutCreate", unsafe {
            lt::cublasLtMatrixLayoutCreate(&mut l, ty, rows, cols, rows as i64)
        })?;
        self.layouts.insert(key, l);
        Ok(l)
    }

    fn layouts_for(&mut self, a: &Fp8GemmArgs) -> Result<[lt::cublasLtMatrixLayout_t; 3], CudaError> {
        let e4m3 = lt::cudaDataType::CUDA_R_8F_E4M3;
        let out_t = if a.f32_out { lt::cudaDataType::CUDA_R_32F } else { lt::cudaDataType::CUDA_R_16BF };
        Ok([
            self.layout(a.inp as u64, a.out as u64, e4m3)?,
            self.layout(a.inp as u64, a.n as u64, e4m3)?,
            self.layout(a.out as u64, a.n as u64, out_t)?,
        ])
    }

    fn heuristic(&mut self, a: &Fp8GemmArgs) -> Result<lt::cublasLtMatmulAlgo_t, CudaError> {
        self.heuristic_for(self.desc, a)
    }

    fn heuristic_for(
        &mut self,
        desc: lt::cublasLtMatmulDesc_t,
        a: &Fp8GemmArgs,
    ) -> Result<lt::cublasLtMatmulAlgo_t, CudaError> {
        let found = self.heuristics_for(desc, a, 1)?;
        found.first().copied().ok_or_else(|| CudaError::NoAlgorithm {
            out: a.out,
            inp: a.inp,
            detail: format!("FP8, M {}", a.n),
        })
    }

    /// cuBLASLt's first `count` heuristic answers for `a` under `desc`, best first.
    fn heuristics_for(
        &mut self,
        desc: lt::cublasLtMatmulDesc_t,
        a: &Fp8GemmArgs,
        count: usize,
    ) -> Result<Vec<lt::cublasLtMatmulAlgo_t>, CudaError> {
        let [la, lb, ld] = self.layouts_for(a)?;
        let mut pref = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        lt_err("cublasLtMatmulPreferenceCreate", unsafe { lt::cublasLtMatmulPreferenceCreate(&mut pref) })?;
        let ws = WORKSPACE_BYTES as u64;
        // SAFETY: 8-byte attribute of the preference created above.
        let s = unsafe {
            lt::cublasLtMatmulPreferenceSetAttribute(
                pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws) as *const u64 as *const _,
                8,
            )
        };
        // SAFETY: zeroed results are valid out-buffers.
        let mut res: Vec<lt::cublasLtMatmulHeuristicResult_t> = vec![unsafe { std::mem::zeroed() }; count.max(1)];
        let mut got = 0i32;
        let q = if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            // SAFETY: valid handle, descriptor, layouts; `res.len()` result slots.
            unsafe {
                lt::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    desc,
                    la,
                    lb,
                    ld,
                    ld,
                    pref,
                    res.len() as i32,
                    res.as_mut_ptr(),
                    &mut got,
                )
            }
        } else {
            s
        };
        // SAFETY: created above, destroyed once.
        unsafe { lt::cublasLtMatmulPreferenceDestroy(pref) };
        lt_err("cublasLtMatmulAlgoGetHeuristic (FP8)", q)?;
        let got = usize::try_from(got).unwrap_or(0).min(res.len());
        Ok(res[..got].iter().filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS).map(|r| r.algo).collect())
    }

    /// Times cuBLASLt's first `count` heuristic answers for the product `a` (µs per launch,
    /// the median of `reps` launches after one warm-up, each between two events), in the
    /// heuristic's order; with `scales` = `(xs, ws)` the outer-vector descriptor (enabled
    /// first). A benchmark tool: it synchronizes the stream.
    ///
    /// # Errors
    /// [`CudaError`] when cuBLASLt or an event fails.
    pub fn time_algorithms(
        &mut self,
        gpu: &Gpu,
        a: &Fp8GemmArgs,
        scales: Option<(u64, u64)>,
        count: usize,
        reps: usize,
    ) -> Result<Vec<f64>, CudaError> {
        use lt::cublasLtMatmulDescAttributes_t as D;
        let desc = match scales {
            None => self.desc,
            Some((xs, ws)) => {
                self.enable_outer_vec()?;
                let desc = self.outer.unwrap_or(self.desc);
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws)?;
                set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs)?;
                desc
            }
        };
        let algos = self.heuristics_for(desc, a, count)?;
        let mut out = Vec::with_capacity(algos.len());
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        for algo in &algos {
            self.launch(gpu, desc, a, algo)?;
            let mut t = Vec::with_capacity(reps);
            for _ in 0..reps.max(1) {
                let e0 = gpu.stream.record_event(flags).op("event")?;
                self.launch(gpu, desc, a, algo)?;
                let e1 = gpu.stream.record_event(flags).op("event")?;
                e1.synchronize().op("event sync")?;
                t.push(f64::from(e0.elapsed_ms(&e1).op("elapsed")?) * 1e3);
            }
            t.sort_by(f64::total_cmp);
            out.push(t[t.len() / 2]);
        }
        Ok(out)
    }

    /// Whether cuBLASLt has an FP8 algorithm for this shape (probed once at load; without one
    /// the backend dequantizes the weight to bf16 for large steps).
    pub fn supports(&mut self, n: usize, out: usize, inp: usize) -> bool {
        let a = Fp8GemmArgs { y: 0, xq: 0, wq: 0, n, out, inp, f32_out: false };
        self.heuristic(&a).is_ok()
    }

    /// A matmul descriptor as [`Fp8Gemm::new`]'s with outer-vector scaling of A and B
    /// (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F`), its scale pointers set to `scales`.
    fn outer_desc(fast: bool, scales: u64) -> Result<lt::cublasLtMatmulDesc_t, CudaError> {
        use lt::cublasLtMatmulDescAttributes_t as D;
        let mut desc = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        lt_err("cublasLtMatmulDescCreate", unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType::CUDA_R_32F,
            )
        })?;
        let outer = lt::cublasLtMatmulMatrixScale_t::CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F as i32;
        let set = || -> Result<(), CudaError> {
            set_desc(
                desc,
                D::CUBLASLT_MATMUL_DESC_TRANSA,
                &(cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32),
            )?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &i8::from(fast))?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &outer)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &outer)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scales)?;
            set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scales)
        };
        if let Err(e) = set() {
            // SAFETY: created above, destroyed once.
            unsafe { lt::cublasLtMatmulDescDestroy(desc) };
            return Err(e);
        }
        Ok(desc)
    }

    /// Whether cuBLASLt has an algorithm for this shape (bf16 output) with its outer-vector
    /// scaling (`CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F` on A and B: the per-channel ×
    /// per-token scales applied in the GEMM's epilogue), with or without fast accumulation
    /// (`tests/cuda_fp8.rs` prints it).
    ///
    /// # Errors
    /// [`CudaError`] when the descriptor cannot be made.
    pub fn outer_vec_available(&mut self, n: usize, out: usize, inp: usize, fast: bool) -> Result<bool, CudaError> {
        // Any device address stands for the scale vectors: the heuristic does not read them.
        let desc = Self::outer_desc(fast, self.ws.ptr)?;
        let a = Fp8GemmArgs { y: 0, xq: 0, wq: 0, n, out, inp, f32_out: false };
        let found = self.heuristic_for(desc, &a).is_ok();
        // SAFETY: created above, destroyed once.
        unsafe { lt::cublasLtMatmulDescDestroy(desc) };
        Ok(found)
    }

    /// Turns on [`Fp8Gemm::matmul_scaled`]'s epilogue scaling (same accumulation mode as the
    /// plain descriptor).
    ///
    /// # Errors
    /// [`CudaError`] when the descriptor cannot be made.
    pub fn enable_outer_vec(&mut self) -> Result<(), CudaError> {
        if self.outer.is_none() {
            self.outer = Some(Self::outer_desc(fast_accumulation(), self.ws.ptr)?);
        }
        Ok(())
    }

    /// Enqueues the scaled product `y[t, j] = xs[t] · ws[j] · Σ xq[t, ·] · wq[j, ·]` with the
    /// scales applied in cuBLASLt's epilogue. `Ok(false)` (nothing enqueued) when outer-vector
    /// scaling is off or cuBLASLt has no such algorithm for the shape: the caller then runs
    /// [`Fp8Gemm::matmul`] and scales the product itself.
    ///
    /// # Errors
    /// [`CudaError`] when cuBLASLt fails.
    pub fn matmul_scaled(&mut self, gpu: &Gpu, a: &Fp8GemmArgs, xs: u64, ws: u64) -> Result<bool, CudaError> {
        use lt::cublasLtMatmulDescAttributes_t as D;
        let Some(desc) = self.outer else { return Ok(false) };
        // The pointers go in before the heuristic query (cuBLASLt answers none without them)
        // and before the launch reads the descriptor.
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &ws)?;
        set_desc(desc, D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &xs)?;
        let key = (a.n, a.out, a.inp, a.f32_out, true);
        let algo = match self.algos.get(&key) {
            Some(x) => *x,
            None => {
                let x = self.heuristic_for(desc, a).ok();
                if x.is_none() {
                    tracing::debug!(n = a.n, out = a.out, inp = a.inp, "no outer-vector FP8 GEMM: scaling separately");
                }
                self.algos.insert(key, x);
                x
            }
        };
        let Some(algo) = algo else { return Ok(false) };
        self.launch(gpu, desc, a, &algo)?;
        Ok(true)
    }

    /// Enqueues the unscaled product of the codes on the shard's stream (the caller applies
    /// the activation and weight scales).
    ///
    /// # Errors
    /// [`CudaError::NoAlgorithm`] when cuBLASLt has no algorithm; [`CudaError`] when it fails.
    pub fn matmul(&mut self, gpu: &Gpu, a: &Fp8GemmArgs) -> Result<(), CudaError> {
        let key = (a.n, a.out, a.inp, a.f32_out, false);
        let algo = match self.algos.get(&key) {
            Some(Some(x)) => *x,
            _ => {
                let x = self.heuristic(a)?;
                self.algos.insert(key, Some(x));
                x
            }
        };
        self.launch(gpu, self.desc, a, &algo)
    }

    fn launch(
        &mut self,
        gpu: &Gpu,
        desc: lt::cublasLtMatmulDesc_t,
        a: &Fp8GemmArgs,
        algo: &lt::cublasLtMatmulAlgo_t,
    ) -> Result<(), CudaError> {
        let [la, lb, ld] = self.layouts_for(a)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller passes buffers of the documented shapes on this device; the
        // workspace is ours; all on the shard's stream.
        lt_err("cublasLtMatmul (FP8)", unsafe {
            lt::cublasLtMatmul(
                self.handle,
                desc,
                (&alpha) as *const f32 as *const _,
                a.wq as *const _,
                la,
                a.xq as *const _,
                lb,
                (&beta) as *const f32 as *const _,
                a.y as *const _,
                ld,
                a.y as *mut _,
                ld,
                algo,
                self.ws.ptr as *mut _,
                WORKSPACE_BYTES,
                gpu.stream.cu_stream() as lt::cudaStream_t,
            )
        })
    }
}

impl Drop for Fp8Gemm {
    fn drop(&mut self) {
        // SAFETY: each object was created by this struct and is destroyed once.
        unsafe {
            for l in self.layouts.values() {
                lt::cublasLtMatrixLayoutDestroy(*l);
            }
            lt::cublasLtMatmulDescDestroy(self.desc);
            if let Some(d) = self.outer {
                lt::cublasLtMatmulDescDestroy(d);
            }
            lt::cublasLtDestroy(self.handle);
        }
    }
}
