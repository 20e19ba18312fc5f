//! Batch-invariant GEMMs through cuBLASLt (deterministic inference): one fixed algorithm per
//! weight shape, chosen once at load time and used for every row count `M`, so a token's output
//! row never depends on how many other tokens share the step (cuBLAS's default heuristic picks
//! a different kernel, tile and split-K for different `M`, which changes the per-row reduction
//! order; see Thinking Machines, "Defeating Nondeterminism in LLM Inference", 2025).
//!
//! Selection ([`LtGemm::plan`]): candidates are cuBLASLt's heuristic answers for several `M`
//! (plus each one with split-K forced off); a candidate must be valid for every `M` up to the
//! step's maximum and pass an on-device check that rows of an `M`-row product are bitwise equal
//! to the same rows of the `M_max`-row product for a set of `M` values, on random inputs with
//! the real weights. Among those, the best by `4·t(1)/best + t(64)/best + t(512)/best` wins
//! (decode-weighted). The same check is run on `cublasGemmEx` with `CUBLAS_GEMM_DEFAULT` and
//! reported, so the choice is backed by a measurement on the machine itself.

use std::collections::HashMap;
use std::time::Instant;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::device::{DevBuf, GemmArgs, GemmShape, Gpu, grid_stride};
use super::error::{CudaError, CudaResultExt};

/// cuBLASLt workspace (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// What [`LtGemm::plan`] found for one shape (reported by `cuda_check`).
#[derive(Clone, Debug, serde::Serialize)]
pub struct GemmPlanInfo {
    /// Output features.
    pub out: usize,
    /// Input features.
    pub inp: usize,
    /// f32 output (lm_head).
    pub f32_out: bool,
    /// Largest `M` the plan was checked for.
    pub m_max: usize,
    /// Row counts checked.
    pub m_checked: Vec<usize>,
    /// Candidates valid for every `M`.
    pub candidates: usize,
    /// Candidates whose rows were bitwise equal across all checked `M`.
    pub invariant: usize,
    /// Whether the chosen algorithm passed the invariance check.
    pub chosen_invariant: bool,
    /// Chosen algorithm: (algo id, tile id, split-K, reduction scheme, stages id).
    pub chosen: [i32; 5],
    /// Chosen algorithm's time at `M = 1`, µs.
    pub t_m1_us: f64,
    /// Chosen algorithm's time at the mid-size `M`, µs.
    pub t_mid_us: f64,
    /// Chosen algorithm's time at `M = 64`, µs.
    pub t_m64_us: f64,
    /// Best time at `M = 1` among the candidates in the pool, µs.
    pub best_t_m1_us: f64,
    /// Mid-size `M` timed.
    pub m_mid: usize,
    /// Whether `cublasGemmEx` (`CUBLAS_GEMM_DEFAULT`) was bitwise row-invariant on the same check.
    pub cublas_default_invariant: bool,
    /// `cublasGemmEx` time at `M = 1`, µs.
    pub cublas_t_m1_us: f64,
}

struct Plan {
    algo: lt::cublasLtMatmulAlgo_t,
}

/// The buffers of [`LtGemm::check_invariance`], shared by every candidate of one plan: the row
/// counts checked (ascending), one u32 mismatch counter per count, the reference output of the
/// largest count, the output under test, the output features per row and bytes per value.
#[derive(Clone, Copy)]
struct InvarianceCheck<'a> {
    ms: &'a [usize],
    counters: &'a DevBuf,
    y_ref: &'a DevBuf,
    y: &'a DevBuf,
    out: usize,
    elem_bytes: usize,
}

/// cuBLASLt handle, one matmul descriptor (bf16 × bf16 → bf16/f32, f32 accumulate,
/// `D = Wᵀ-op · X`), cached layouts and the per-shape plans.
pub struct LtGemm {
    handle: lt::cublasLtHandle_t,
    desc: lt::cublasLtMatmulDesc_t,
    ws: DevBuf,
    layouts: HashMap<(u64, u64, bool), lt::cublasLtMatrixLayout_t>,
    plans: HashMap<(usize, usize, bool), Plan>,
    /// Fast mode: cuBLASLt's first heuristic answer per (M, out, inp, f32 output).
    fast: HashMap<(usize, usize, usize, bool), lt::cublasLtMatmulAlgo_t>,
    /// Plans as chosen (for reports).
    pub infos: Vec<GemmPlanInfo>,
}

// SAFETY: the handle, descriptor and layouts are plain host objects used by one thread at a
// time (the engine thread); cuBLASLt allows use from any thread.
unsafe impl Send for LtGemm {}

fn lt_err(what: &'static str, s: lt::cublasStatus_t) -> Result<(), CudaError> {
    s.result().op(what)
}

fn dtype(f32_out: bool) -> lt::cudaDataType {
    if f32_out { lt::cudaDataType::CUDA_R_32F } else { lt::cudaDataType::CUDA_R_16BF }
}

fn algo_cfg(algo: &lt::cublasLtMatmulAlgo_t, attr: lt::cublasLtMatmulAlgoConfigAttributes_t) -> i32 {
    let mut v: u32 = 0;
    let mut written = 0usize;
    // SAFETY: reads one 4-byte attribute of a valid algo into `v`.
    let s = unsafe {
        lt::cublasLtMatmulAlgoConfigGetAttribute(algo, attr, (&mut v) as *mut u32 as *mut _, 4, &mut written)
    };
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS { v as i32 } else { -1 }
}

impl LtGemm {
    /// Creates the handle, descriptor and workspace.
    ///
    /// # Errors
    /// [`CudaError::Unavailable`] when cuBLASLt is missing; [`CudaError`] when it fails.
    pub fn new(gpu: &Gpu) -> Result<Self, CudaError> {
        // SAFETY: only opens the library.
        if !unsafe { lt::is_culib_present() } {
            return Err(CudaError::Unavailable("libcublasLt not found"));
        }
        let mut handle = std::ptr::null_mut();
        // SAFETY: out-pointers to locals.
        lt_err("cublasLtCreate", unsafe { lt::cublasLtCreate(&mut handle) })?;
        let mut desc = std::ptr::null_mut();
        lt_err("cublasLtMatmulDescCreate", unsafe {
            lt::cublasLtMatmulDescCreate(
                &mut desc,
                lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                lt::cudaDataType::CUDA_R_32F,
            )
        })?;
        let trans_a = cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_T as i32;
        // SAFETY: sets the 4-byte TRANSA attribute of the descriptor created above.
        lt_err("TRANSA", unsafe {
            lt::cublasLtMatmulDescSetAttribute(
                desc,
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&trans_a) as *const i32 as *const _,
                4,
            )
        })?;
        let ws = DevBuf::zeroed(gpu, WORKSPACE_BYTES)?;
        Ok(Self {
            handle,
            desc,
            ws,
            layouts: HashMap::new(),
            plans: HashMap::new(),
            fast: HashMap::new(),
            infos: Vec::new(),
        })
    }

    fn layout(&mut self, rows: u64, cols: u64, f32_t: bool) -> Result<lt::cublasLtMatrixLayout_t, CudaError> {
        if let Some(l) = self.layouts.get(&(rows, cols, f32_t)) {
            return Ok(*l);
        }
        let mut l = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; column-major rows × cols with ld = rows.
        lt_err("cublasLtMatrixLayoutCreate", unsafe {
            lt::cublasLtMatrixLayoutCreate(&mut l, dtype(f32_t), rows, cols, rows as i64)
        })?;
        self.layouts.insert((rows, cols, f32_t), l);
        Ok(l)
    }

    /// (A = weight, B = activations, D = output) layouts for `m` rows.
    fn layouts_for(
        &mut self,
        m: usize,
        out: usize,
        inp: usize,
        f32_out: bool,
    ) -> Result<[lt::cublasLtMatrixLayout_t; 3], CudaError> {
        Ok([
            self.layout(inp as u64, out as u64, false)?,
            self.layout(inp as u64, m as u64, false)?,
            self.layout(out as u64, m as u64, f32_out)?,
        ])
    }

    fn heuristics(
        &mut self,
        m: usize,
        out: usize,
        inp: usize,
        f32_out: bool,
        want: usize,
    ) -> Result<Vec<lt::cublasLtMatmulAlgo_t>, CudaError> {
        let [a, b, d] = self.layouts_for(m, out, inp, f32_out)?;
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
        // SAFETY: a zeroed result array is a valid out-buffer for the heuristic query.
        let mut res: Vec<lt::cublasLtMatmulHeuristicResult_t> = vec![unsafe { std::mem::zeroed() }; want];
        let mut got = 0i32;
        let q = if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            // SAFETY: layouts and descriptor are valid; `res` holds `want` entries.
            unsafe {
                lt::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    self.desc,
                    a,
                    b,
                    d,
                    d,
                    pref,
                    want as i32,
                    res.as_mut_ptr(),
                    &mut got,
                )
            }
        } else {
            s
        };
        // SAFETY: created above, destroyed once.
        unsafe { lt::cublasLtMatmulPreferenceDestroy(pref) };
        lt_err("cublasLtMatmulAlgoGetHeuristic", q)?;
        Ok(res
            .into_iter()
            .take(got.max(0) as usize)
            .filter(|r| r.state == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= WORKSPACE_BYTES)
            .map(|r| r.algo)
            .collect())
    }

    fn valid(&mut self, algo: &lt::cublasLtMatmulAlgo_t, m: usize, out: usize, inp: usize, f32_out: bool) -> bool {
        let Ok([a, b, d]) = self.layouts_for(m, out, inp, f32_out) else {
            return false;
        };
        // SAFETY: zeroed out-struct; valid handle, descriptor, layouts, algo.
        let mut r: lt::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
        let s = unsafe { lt::cublasLtMatmulAlgoCheck(self.handle, self.desc, a, b, d, d, algo, &mut r) };
        s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= WORKSPACE_BYTES
    }

    fn matmul_with(&mut self, gpu: &Gpu, algo: &lt::cublasLtMatmulAlgo_t, g: &GemmArgs) -> Result<(), CudaError> {
        let GemmArgs { y, x, w, shape: s, f32_out } = *g;
        let [a, b, d] = self.layouts_for(s.n, s.out, s.inp, f32_out)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: the caller passes buffers of at least n·inp (x), out·inp (w), n·out (y)
        // elements; the workspace is ours; all on the shard's stream.
        lt_err("cublasLtMatmul", unsafe {
            lt::cublasLtMatmul(
                self.handle,
                self.desc,
                (&alpha) as *const f32 as *const _,
                w as *const _,
                a,
                x as *const _,
                b,
                (&beta) as *const f32 as *const _,
                y as *const _,
                d,
                y as *mut _,
                d,
                algo,
                self.ws.ptr as *mut _,
                WORKSPACE_BYTES,
                gpu.stream.cu_stream() as lt::cudaStream_t,
            )
        })
    }

    /// Row-major `y[n, out] = x[n, inp] · w[out, inp]ᵀ` with the shape's fixed algorithm.
    ///
    /// # Errors
    /// [`CudaError::NoAlgorithm`] when the shape was not planned; [`CudaError`] when cuBLASLt
    /// fails.
    pub fn matmul(&mut self, gpu: &Gpu, g: &GemmArgs) -> Result<(), CudaError> {
        let s = g.shape;
        let algo = self
            .plans
            .get(&(s.out, s.inp, g.f32_out))
            .map(|p| p.algo)
            .ok_or_else(|| CudaError::NoAlgorithm { out: s.out, inp: s.inp, detail: "not planned".into() })?;
        self.matmul_with(gpu, &algo, g)
    }

    /// Fast mode: `y = x · wᵀ` with cuBLASLt's best heuristic algorithm for this exact `M`
    /// (cached per shape; what cuBLAS itself would pick, so rows may change with `M`: not
    /// batch-invariant). Uses the handle's fixed workspace, so it is safe inside a CUDA-graph
    /// capture.
    ///
    /// # Errors
    /// [`CudaError::NoAlgorithm`] when cuBLASLt has no algorithm; [`CudaError`] when it fails.
    pub fn matmul_heuristic(&mut self, gpu: &Gpu, g: &GemmArgs) -> Result<(), CudaError> {
        let s = g.shape;
        let key = (s.n, s.out, s.inp, g.f32_out);
        let algo = match self.fast.get(&key) {
            Some(a) => *a,
            None => {
                let a =
                    self.heuristics(s.n, s.out, s.inp, g.f32_out, 1)?.into_iter().next().ok_or_else(|| {
                        CudaError::NoAlgorithm { out: s.out, inp: s.inp, detail: format!("M {}", s.n) }
                    })?;
                self.fast.insert(key, a);
                a
            }
        };
        self.matmul_with(gpu, &algo, g)
    }

    /// Chooses the fixed algorithm for `out × inp` weights at `w` (see the module docs).
    ///
    /// # Errors
    /// [`CudaError::NoAlgorithm`] when no algorithm is valid; [`CudaError`] on device failure.
    pub fn plan(
        &mut self,
        gpu: &Gpu,
        w: u64,
        out: usize,
        inp: usize,
        f32_out: bool,
        m_max: usize,
    ) -> Result<(), CudaError> {
        if self.plans.contains_key(&(out, inp, f32_out)) {
            return Ok(());
        }
        let m_max = m_max.max(1);
        let ob = if f32_out { 4 } else { 2 };
        let x = DevBuf::zeroed(gpu, m_max * inp * 2)?;
        gpu.fill_uniform(x.ptr, m_max * inp, 0x5eed ^ out as u32, 1.0)?;
        let y_ref = DevBuf::zeroed(gpu, m_max * out * ob)?;
        let y = DevBuf::zeroed(gpu, m_max * out * ob)?;
        let mut ms: Vec<usize> = [1, 2, 3, 5, 8, 13, 16, 31, 64, 100, 129, 255, 512, 1000, m_max]
            .into_iter()
            .filter(|&m| m <= m_max)
            .collect();
        ms.dedup();
        let counters = DevBuf::zeroed(gpu, ms.len() * 4)?;
        let m_mid = m_max.min(512);
        let m_small = m_max.min(64);

        let mut cands: Vec<lt::cublasLtMatmulAlgo_t> = Vec::new();
        for m in [1, 4, 16, 64, 256, m_max] {
            for a in self.heuristics(m.min(m_max), out, inp, f32_out, 16)? {
                let mut no_split = a;
                let one: u32 = 1;
                let none: u32 = lt::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
                // SAFETY: 4-byte config attributes of a local copy of a valid algo.
                unsafe {
                    lt::cublasLtMatmulAlgoConfigSetAttribute(
                        &mut no_split,
                        lt::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
                        (&one) as *const u32 as *const _,
                        4,
                    );
                    lt::cublasLtMatmulAlgoConfigSetAttribute(
                        &mut no_split,
                        lt::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                        (&none) as *const u32 as *const _,
                        4,
                    );
                }
                for c in [a, no_split] {
                    if !cands.iter().any(|k| k.data == c.data) {
                        cands.push(c);
                    }
                }
            }
        }
        cands.retain(|c| {
            self.valid(c, 1, out, inp, f32_out)
                && self.valid(c, m_max, out, inp, f32_out)
                && self.valid(c, m_mid, out, inp, f32_out)
        });
        if cands.is_empty() {
            return Err(CudaError::NoAlgorithm { out, inp, detail: format!("valid for M 1..{m_max}") });
        }
        let check = InvarianceCheck { ms: &ms, counters: &counters, y_ref: &y_ref, y: &y, out, elem_bytes: ob };
        // The product of `m` rows into `y`.
        let args = |y: u64, m: usize| GemmArgs { y, x: x.ptr, w, shape: GemmShape { n: m, out, inp }, f32_out };
        let mut scored = Vec::new();
        let mut n_inv = 0;
        for c in &cands {
            let c = *c;
            let inv = self.check_invariance(gpu, &check, |me, m, yp| me.matmul_with(gpu, &c, &args(yp, m)))?;
            let Some(inv) = inv else { continue };
            n_inv += usize::from(inv);
            let t1 = self.time(gpu, |me| me.matmul_with(gpu, &c, &args(y.ptr, 1)))?;
            let ts = self.time(gpu, |me| me.matmul_with(gpu, &c, &args(y.ptr, m_small)))?;
            let tm = self.time(gpu, |me| me.matmul_with(gpu, &c, &args(y.ptr, m_mid)))?;
            scored.push((c, inv, t1, tm, ts));
        }
        let cublas_inv = self.check_invariance(gpu, &check, |_, m, yp| gpu.gemm(&args(yp, m)))?.unwrap_or(false);
        let cublas_t1 = self.time(gpu, |_| gpu.gemm(&args(y.ptr, 1)))?;
        let any_inv = scored.iter().any(|s| s.1);
        let pool: Vec<_> = scored.iter().filter(|s| s.1 || !any_inv).collect();
        let best1 = pool.iter().map(|s| s.2).fold(f64::INFINITY, f64::min);
        let bestm = pool.iter().map(|s| s.3).fold(f64::INFINITY, f64::min);
        let bests = pool.iter().map(|s| s.4).fold(f64::INFINITY, f64::min);
        // Decode (M = 1) counts four times: it is the latency-critical, bandwidth-bound case
        // (measured: the decode-best down_proj algorithm is 25% faster at M = 1 than the
        // balanced pick, which cost 0.35 ms per Llama-3-8B step).
        let score =
            |c: &&&(lt::cublasLtMatmulAlgo_t, bool, f64, f64, f64)| 4.0 * c.2 / best1 + c.4 / bests + c.3 / bestm;
        let chosen = pool
            .iter()
            .min_by(|a, b| score(a).total_cmp(&score(b)))
            .ok_or_else(|| CudaError::NoAlgorithm { out, inp, detail: "none of the candidates ran".into() })?;
        use lt::cublasLtMatmulAlgoConfigAttributes_t as A;
        let info = GemmPlanInfo {
            out,
            inp,
            f32_out,
            m_max,
            m_checked: ms.clone(),
            candidates: cands.len(),
            invariant: n_inv,
            chosen_invariant: chosen.1,
            chosen: [
                algo_cfg(&chosen.0, A::CUBLASLT_ALGO_CONFIG_ID),
                algo_cfg(&chosen.0, A::CUBLASLT_ALGO_CONFIG_TILE_ID),
                algo_cfg(&chosen.0, A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                algo_cfg(&chosen.0, A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                algo_cfg(&chosen.0, A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
            ],
            t_m1_us: chosen.2 * 1e6,
            t_mid_us: chosen.3 * 1e6,
            t_m64_us: chosen.4 * 1e6,
            best_t_m1_us: best1 * 1e6,
            m_mid,
            cublas_default_invariant: cublas_inv,
            cublas_t_m1_us: cublas_t1 * 1e6,
        };
        if chosen.1 {
            tracing::info!(?info, "GEMM plan (batch-invariant)");
        } else {
            tracing::warn!(?info, "GEMM plan: no candidate was batch-invariant; using the fastest");
        }
        self.infos.push(info);
        self.plans.insert((out, inp, f32_out), Plan { algo: chosen.0 });
        gpu.sync()
    }

    /// Runs `f(m, y)` for the largest of `c.ms` into `c.y_ref` and each `m` into `c.y`, counting
    /// 16-bit words of the first `m` rows that differ. `Some(true)` when none differ; `None` when
    /// a launch failed.
    fn check_invariance(
        &mut self,
        gpu: &Gpu,
        c: &InvarianceCheck<'_>,
        mut f: impl FnMut(&mut Self, usize, u64) -> Result<(), CudaError>,
    ) -> Result<Option<bool>, CudaError> {
        let InvarianceCheck { ms, counters, y_ref, y, out, elem_bytes: ob } = *c;
        let m_max = *ms.last().unwrap_or(&1);
        if f(self, m_max, y_ref.ptr).is_err() {
            return Ok(None);
        }
        // SAFETY: counters holds ms.len() u32.
        unsafe { cudarc::driver::result::memset_d8_async(counters.ptr, 0, ms.len() * 4, gpu.stream.cu_stream()) }
            .op("memset")?;
        for (i, &m) in ms.iter().enumerate() {
            // Poison, run, compare.
            // SAFETY: y holds m_max · out · ob bytes.
            unsafe { cudarc::driver::result::memset_d8_async(y.ptr, 0xff, m * out * ob, gpu.stream.cu_stream()) }
                .op("memset")?;
            if f(self, m, y.ptr).is_err() {
                return Ok(None);
            }
            let words = (m * out * ob / 2) as u64;
            let cnt = counters.ptr + (i * 4) as u64;
            let mut b = gpu.stream.launch_builder(&gpu.k.count_neq_u16);
            b.arg(&y.ptr).arg(&y_ref.ptr).arg(&words).arg(&cnt);
            let cfg: LaunchConfig = grid_stride(words as usize);
            // SAFETY: both buffers hold at least `words` u16; cnt is one u32.
            unsafe { b.launch(cfg) }.op("count_neq_u16")?;
        }
        let mut host = vec![0u32; ms.len()];
        gpu.download(&mut host, counters.ptr)?;
        Ok(Some(host.iter().all(|&c| c == 0)))
    }

    /// Median-free quick timing: 2 warm-up runs, then the mean of 10 (host clock around a sync).
    fn time(&mut self, gpu: &Gpu, mut f: impl FnMut(&mut Self) -> Result<(), CudaError>) -> Result<f64, CudaError> {
        for _ in 0..2 {
            f(self)?;
        }
        gpu.sync()?;
        let t = Instant::now();
        for _ in 0..10 {
            f(self)?;
        }
        gpu.sync()?;
        Ok(t.elapsed().as_secs_f64() / 10.0)
    }
}

impl Drop for LtGemm {
    fn drop(&mut self) {
        // SAFETY: each object was created by this struct and is destroyed once.
        unsafe {
            for l in self.layouts.values() {
                lt::cublasLtMatrixLayoutDestroy(*l);
            }
            lt::cublasLtMatmulDescDestroy(self.desc);
            lt::cublasLtDestroy(self.handle);
        }
    }
}
