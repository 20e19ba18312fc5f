//! One shard's Llama forward pass on the device ([`ShardModel`]): the weights, KV cache, step
//! scratch and compiled kernels of a shard, and [`ShardModel::enqueue`], which puts a whole
//! step on the shard's stream — embedding gather, per layer the QKV projection with RoPE and
//! the K/V write, paged attention, o_proj, the MLP, and the final norm and lm_head for the rows
//! that want logits. `enqueue` neither allocates nor synchronises, so a decode step can be
//! captured into a CUDA graph (the runner does that).
//!
//! Paths: in fast mode a step of at most `gemv_max` tokens runs the fused decode GEMVs
//! (`gemv.rs`: norms, RoPE + K/V write, residual adds and SiLU·mul inside) and larger steps go
//! through cuBLASLt's per-`M` heuristic; batch-invariant mode uses one fixed cuBLASLt algorithm
//! per weight shape. Attention is the tensor-core pair (`attn_decode.rs` for decode rows,
//! `attn_prefill.rs` for prefill chunks) on sm_80 and later in fast mode, else the split-KV
//! kernel of `kernels/llama.cu` with fixed 128-position chunks merged in chunk order.
//!
//! A rank of a parallel replica ([`RankComm`]) holds whole heads and MLP rows of its stage's
//! layers: with tensor parallelism the o_proj and down_proj outputs are all-reduced before the
//! residual add (the GEMM path reduces the bf16 products; the GEMV path, whose GEMVs add into
//! the residual themselves, reduces the f32 residual rows, every rank but 0 contributing only
//! its product). A stage other than the first starts from the residual stream it was sent; one
//! other than the last ends with it complete (no final norm, no lm_head).

use cudarc::driver::{CudaEvent, LaunchConfig, PushKernelArg};

use super::arch::ArchPlan;
use super::attn_decode::{AttnShape, DecodeArgs, DecodeAttention};
use super::attn_prefill::{PrefillAttention, PrefillDims, PrefillPtrs, PrefillSeq};
use super::device::{GemmArgs, GemmShape, Gpu, SPLIT_KV_SHAPES, grid_stride, per_row};
use super::error::{CudaError, CudaResultExt};
use super::fp8::{NormIo, SiluIo};
use super::fp8_path::{Fp8Path, FusedIo, GemmIn, Product};
use super::gemm::LtGemm;
use super::gemv::{GEMV_MAX_M, Gemv, GemvArgs, GemvKind, RopeArgs};
use super::kv_cache::KvCache;
use super::nccl::{Elem, RankComm};
use super::options::{CudaOptions, Dims, KvCacheDtype};
use super::scratch::{Scratch, StepPtrs};
use super::weights::DeviceWeights;
use crate::backend::StepBatch;

/// Positions per attention context chunk (`ATTN_CHUNK` in `kernels/llama.cu`).
pub(crate) const ATTN_CHUNK: usize = 128;

/// One shard's model on its device and the state a step uses.
pub(crate) struct ShardModel {
    pub gpu: Gpu,
    pub lt: LtGemm,
    /// Fused decode GEMVs (fast mode only; `None` when they cannot be built for this model).
    pub gemv: Option<Gemv>,
    /// [`CudaOptions::batch_invariant`].
    invariant: bool,
    /// Steps of at most this many tokens run the GEMVs ([`CudaOptions::gemv_max_tokens`]; 0 in
    /// batch-invariant mode and for tensor-parallel shards).
    pub gemv_max: usize,
    /// Fast mode: tensor-core paged attention for decode rows and for prefill chunks (batch
    /// invariance keeps the split-KV kernel of `llama.cu` for every row).
    pub dattn: Option<DecodeAttention>,
    pattn: Option<PrefillAttention>,
    /// This step's attention work: runs of decode rows (first token, count) and prefill chunks.
    plan_decode: Vec<(usize, usize)>,
    plan_prefill: Vec<PrefillSeq>,
    /// A rank of a parallel replica: its collectives (the tensor-parallel all-reduce after
    /// o_proj and down_proj; the stage runner sends and receives hidden states with it).
    pub comm: Option<RankComm>,
    /// Embeds the tokens (first pipeline stage); otherwise the step starts from the hidden
    /// states the stage runner put into the residual stream.
    pub first_stage: bool,
    /// Applies the final norm and lm_head (last pipeline stage); otherwise the step ends with
    /// the complete residual stream in `s.x` for the next stage.
    pub last_stage: bool,
    /// Per-launch events while a profiled step runs.
    pub prof: Option<Vec<(&'static str, CudaEvent)>>,
    pub d: Dims,
    /// Per-layer RoPE tables and windows, attention scale, activation, embedding scale and
    /// logit soft-capping (Llama: [`ArchPlan::llama`]).
    pub plan: ArchPlan,
    pub w: DeviceWeights,
    pub s: Scratch,
    pub kv: KvCache,
    /// FP8 weights: the GEMM path of steps above the GEMVs' token count.
    fp8: Option<Fp8Path>,
}

impl ShardModel {
    /// FP8 weights: how steps above the GEMVs' token count multiply
    /// ([`Fp8Path::gemm_path`]); `None` for bf16 weights.
    pub fn fp8_gemm_path(&self) -> Option<&'static str> {
        self.fp8.as_ref().map(Fp8Path::gemm_path)
    }
}

/// Operands of one `add_rmsnorm` launch (`kernels/llama.cu`) over `blocks` rows: row
/// `r = rows[b]` (or `b` when `rows` is 0) of the f32 residual stream `x [*, hidden]` gets
/// `delta[r]` (bf16) added when `delta` is not 0, and `out[b] = bf16(x[r] · rsqrt(mean(x[r]²) +
/// eps) · gain)`.
struct NormArgs {
    x: u64,
    delta: u64,
    gain: u64,
    out: u64,
    rows: u64,
    blocks: usize,
    threads: u32,
}

/// Enqueues `add_rmsnorm` (see [`NormArgs`]) with the model's width and epsilon.
fn add_rmsnorm(g: &Gpu, d: &Dims, a: &NormArgs) -> Result<(), cudarc::driver::DriverError> {
    let (h, eps) = (d.hidden as i32, d.eps);
    let mut b = g.stream.launch_builder(&g.k.add_rmsnorm);
    b.arg(&a.x).arg(&a.delta).arg(&a.gain).arg(&a.out).arg(&a.rows).arg(&h).arg(&eps);
    // SAFETY: the caller passes x, delta with every indexed row of `hidden` values, gain
    // `hidden`, out `blocks` rows, and rows (when set) `blocks` indices of rows of x.
    unsafe { b.launch(per_row(a.blocks, a.threads)) }.map(|_| ())
}

/// Enqueues the residual add + RMSNorm of [`NormArgs`], the delta first RMS-normalised with
/// gain `delta_gain` when that is not 0 (`add_normed_rmsnorm`; Gemma 3's output norms).
fn add_norm(g: &Gpu, d: &Dims, a: &NormArgs, delta_gain: u64) -> Result<(), cudarc::driver::DriverError> {
    if delta_gain == 0 || a.delta == 0 {
        return add_rmsnorm(g, d, a);
    }
    let (h, eps) = (d.hidden as i32, d.eps);
    let mut b = g.stream.launch_builder(&g.k.add_normed_rmsnorm);
    b.arg(&a.x).arg(&a.delta).arg(&delta_gain).arg(&a.gain).arg(&a.out).arg(&a.rows).arg(&h).arg(&eps);
    // SAFETY: as add_rmsnorm; delta_gain holds `hidden` values.
    unsafe { b.launch(per_row(a.blocks, a.threads)) }.map(|_| ())
}

/// The FP8 path of a step that uses its fused passes (`q8` comes from it, so it is there).
fn fp8_of(fp8: &Option<Fp8Path>) -> Result<&Fp8Path, CudaError> {
    fp8.as_ref().ok_or_else(|| CudaError::InvalidLaunch("fused FP8 pass without FP8 weights".into()))
}

/// Enqueues a zero fill of `bytes` bytes at `ptr` (capturable into a graph).
fn zero(g: &Gpu, ptr: u64, bytes: usize) -> Result<(), CudaError> {
    // SAFETY: the caller passes a device range of at least `bytes` bytes.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, g.stream.cu_stream()) }.op("memset")
}

impl ShardModel {
    /// Builds the shard around uploaded weights: step scratch, cuBLASLt (with the fixed plans
    /// in batch-invariant mode, checked on this device), the decode GEMVs and tensor-core
    /// attention in fast mode, then the KV cache from what memory is left.
    ///
    /// # Errors
    /// [`CudaError::InvalidOption`] for a block size of 0 or a KV budget without a block;
    /// [`CudaError::Unsupported`] unless head_dim is 64 or 128 with 1, 2, 4 or 8 query heads per
    /// KV head, or 256 with 1, 2 or 4; [`CudaError`] when a kernel, plan or allocation fails.
    pub fn new(gpu: Gpu, w: DeviceWeights, d: Dims, plan: ArchPlan, opts: &CudaOptions) -> Result<Self, CudaError> {
        if opts.block_size == 0 {
            return Err(CudaError::InvalidOption { field: "block_size", message: "block_size must be >= 1".into() });
        }
        let group_ok = d.kv_heads > 0
            && d.q_heads.is_multiple_of(d.kv_heads)
            && SPLIT_KV_SHAPES.contains(&(d.head_dim, d.q_heads / d.kv_heads));
        if !group_ok {
            return Err(CudaError::Unsupported(format!(
                "head_dim {} with {}/{} query/KV heads (the kernels take head_dim 64 or 128 with 1, 2, 4 or 8 \
                 query heads per KV head, 256 with 1, 2 or 4)",
                d.head_dim, d.q_heads, d.kv_heads
            )));
        }
        if plan.layers.len() != w.layers.len() {
            return Err(CudaError::Unsupported(format!(
                "{} layer plans for {} layers",
                plan.layers.len(),
                w.layers.len()
            )));
        }
        // q/k/v biases and q/k norms run in `qkv_prep_rope_kv_write`, which holds a QKV row in
        // f32 shared memory.
        let prep = w.layers.iter().any(|l| l.qkv_bias != 0 || l.q_norm != 0);
        if prep && d.qkv_dim() * 4 > 48 * 1024 {
            return Err(CudaError::Unsupported(format!(
                "q/k/v bias or q/k norm with a QKV width of {} (at most 12288)",
                d.qkv_dim()
            )));
        }
        let sm: u32 = gpu.arch.trim_start_matches("sm_").parse().unwrap_or(0);
        if opts.kv_cache_dtype == KvCacheDtype::Fp8 && (opts.batch_invariant || sm < 80) {
            return Err(CudaError::InvalidOption {
                field: "kv_cache_dtype",
                message: "kv_cache_dtype fp8 needs the fast mode on sm_80 or newer (not batch_invariant)".into(),
            });
        }
        // `qkv_prep_rope_kv_write` and the split-KV attention (sliding windows) write and read
        // bf16 K/V only; the e4m3 builds of the tensor-core kernels are unchecked at head_dim 256.
        if opts.kv_cache_dtype == KvCacheDtype::Fp8 && (prep || plan.windowed() || d.head_dim == 256) {
            return Err(CudaError::InvalidOption {
                field: "kv_cache_dtype",
                message: "kv_cache_dtype fp8 is not supported for models with q/k/v biases, q/k norms, \
                          sliding-window attention or head_dim 256; use auto"
                    .into(),
            });
        }
        let t = opts.max_num_batched_tokens.max(opts.max_num_seqs).max(1);
        let r = opts.max_num_seqs.max(1);
        let s = Scratch::new(&gpu, &d, t, r, &plan.inv_freq_concat())?;
        // One batch-invariant GEMM algorithm per weight shape (checked on this device).
        let mut lt = LtGemm::new(&gpu)?;
        // The GEMVs need 8-element (16-byte) rows; their norm prologue keeps GEMV_MAX_M
        // activation rows in shared memory (a model too wide for it runs without them).
        let gemv_shapes_ok = d.hidden.is_multiple_of(8) && d.inter.is_multiple_of(8) && d.q_dim().is_multiple_of(8);
        // The fused GEMVs are Llama's layer: plain QKV before RoPE, SiLU, residual adds of the
        // raw o_proj / down_proj outputs.
        let llama_layers = !prep && !plan.gelu && w.layers.iter().all(|l| l.attn_out_norm == 0);
        let gemv = if opts.batch_invariant || !gemv_shapes_ok || !llama_layers {
            None
        } else {
            Gemv::new(&gpu, d.hidden, d.hidden.max(d.q_dim()).max(d.inter), w.has_fp8())
                .map_err(|e| tracing::warn!(error = %e, "decode GEMVs unavailable; using cuBLASLt for every step"))
                .ok()
        };
        let gemv_max = if gemv.is_some() { opts.gemv_max_tokens.min(GEMV_MAX_M) } else { 0 };
        // The tensor-core attention kernels use bf16 mma (sm_80 and later); older GPUs keep the
        // split-KV kernel.
        // Sliding windows: the split-KV kernel (the tensor-core pair attends over whole contexts).
        let (dattn, pattn) = if opts.batch_invariant || sm < 80 || plan.windowed() {
            (None, None)
        } else {
            let shape = AttnShape { q_heads: d.q_heads, kv_heads: d.kv_heads, head_dim: d.head_dim };
            let kv8 = opts.kv_cache_dtype == KvCacheDtype::Fp8;
            let pa = if kv8 { PrefillAttention::new_fp8_kv(&gpu, t)? } else { PrefillAttention::new(&gpu, t)? };
            (Some(DecodeAttention::with_kv(&gpu, shape, r, kv8)?), Some(pa))
        };
        if let (true, Some(l0)) = (opts.batch_invariant, w.layers.first()) {
            for (wp, out, inp) in [
                (l0.qkv, d.qkv_dim(), d.hidden),
                (l0.o_proj, d.hidden, d.q_dim()),
                (l0.gate_up, 2 * d.inter, d.hidden),
                (l0.down, d.hidden, d.inter),
            ] {
                lt.plan(&gpu, wp, out, inp, false, t)?;
            }
        }
        if opts.batch_invariant {
            lt.plan(&gpu, w.lm_head, d.vocab, d.hidden, true, r)?;
        }
        let fp8 = if w.has_fp8() { Some(Fp8Path::new(&gpu, &d, &w, t, llama_layers)?) } else { None };
        let kv = KvCache::allocate(&gpu, &d, opts)?;
        gpu.sync()?;
        Ok(Self {
            gpu,
            lt,
            gemv,
            invariant: opts.batch_invariant,
            gemv_max,
            dattn,
            pattn,
            plan_decode: Vec::new(),
            plan_prefill: Vec::new(),
            comm: None,
            first_stage: true,
            last_stage: true,
            prof: None,
            d,
            plan,
            w,
            s,
            kv,
            fp8,
        })
    }

    /// Splits the step's rows into runs of decode rows (one query token; `rows` tokens when
    /// the step is a pure decode padded to a graph bucket) and prefill chunks, and uploads the
    /// prefill work list once for all layers.
    ///
    /// # Errors
    /// As [`PrefillAttention::prepare`].
    pub fn plan_attention(&mut self, batch: &StepBatch, rows: usize) -> Result<(), CudaError> {
        self.plan_decode.clear();
        self.plan_prefill.clear();
        let Some(pattn) = self.pattn.as_mut() else {
            return Ok(());
        };
        let mut bt_off = 0usize;
        for q in &batch.seqs {
            if q.query_len == 1 {
                match self.plan_decode.last_mut() {
                    Some((t0, cnt)) if *t0 + *cnt == q.query_start => *cnt += 1,
                    _ => self.plan_decode.push((q.query_start, 1)),
                }
            } else if q.query_len > 1 {
                self.plan_prefill.push(PrefillSeq {
                    query_start: q.query_start,
                    query_len: q.query_len,
                    context_len: q.context_len,
                    bt_offset: bt_off,
                });
            }
            bt_off += q.block_table.len();
        }
        if self.plan_prefill.is_empty() {
            // Pure decode: one run over every row, graph padding included.
            self.plan_decode.clear();
            self.plan_decode.push((0, rows));
        } else {
            let dims = PrefillDims {
                q_heads: self.d.q_heads,
                kv_heads: self.d.kv_heads,
                head_dim: self.d.head_dim,
                block_size: self.kv.block_size,
            };
            pattn.prepare(&self.gpu, &self.plan_prefill, dims)?;
        }
        Ok(())
    }

    /// Enqueues one forward pass over `n` tokens (`rows` logit rows, `chunks` context chunks
    /// per token at most) on the stream; no host synchronisation, no allocation (capturable).
    ///
    /// # Errors
    /// [`CudaError`] when a launch, GEMM or all-reduce fails to enqueue.
    pub fn enqueue(&mut self, n: usize, rows: usize, ptrs: StepPtrs, chunks: usize) -> Result<(), CudaError> {
        let StepPtrs { ids, pos, slots, tok_bt, rows: rows_ptr, bts } = ptrs;
        let d = self.d;
        // Fast mode, few tokens: fused GEMVs (norms, RoPE + K/V write, residual adds and
        // SiLU·mul inside).
        let small = n <= self.gemv_max;
        let invariant = self.invariant;
        let (first_stage, last_stage) = (self.first_stage, self.last_stage);
        let Self { comm, gpu: g, lt, gemv, s, w, kv, prof, dattn, pattn, plan_decode, plan_prefill, plan, fp8, .. } =
            self;
        // Tensor parallelism: the all-reduce and this rank's place in its group.
        let mut tp = comm.as_mut().filter(|c| c.tp_size > 1);
        let tp_rank = tp.as_ref().map_or(0, |c| c.tp_rank);
        let block_size = kv.block_size;
        let kv_fp8 = kv.dtype == KvCacheDtype::Fp8;
        // The small path's fused decode GEMVs over `m` tokens (see `gemv.rs` for the kinds).
        let gv = |a: GemvArgs| {
            let gemv = gemv.as_ref().ok_or_else(|| CudaError::InvalidLaunch("decode GEMVs not built".into()))?;
            gemv.launch(g, &a)
        };
        // FP8 weights with the fused passes (`fp8_path.rs`): the norms and SiLU·mul write the
        // next GEMM's e4m3 input, and the QKV, o_proj, gate_up and down products stay unscaled
        // for RoPE, the residual adds and SiLU·mul to scale as they read them.
        let q8 = fp8.as_ref().and_then(|f| f.fused_io(tp.is_some()));
        // `p.ws`: an FP8 weight's row scales (0 for bf16).
        let mut matmul = |fp8: &mut Option<Fp8Path>, g: &Gpu, p: Product| {
            if let (Some(f), true) = (fp8.as_mut(), p.ws != 0) {
                return f.matmul(g, lt, &p);
            }
            let GemmIn::Bf16(x) = p.x else {
                return Err(CudaError::InvalidLaunch("e4m3 activations for a bf16 weight".into()));
            };
            let a = GemmArgs { y: p.y, x, w: p.w, shape: p.shape, f32_out: p.f32_out };
            if invariant { lt.matmul(g, &a) } else { lt.matmul_heuristic(g, &a) }
        };
        // The fused residual add + RMSNorm over the step's rows: the down or o_proj product
        // (`delta`, unscaled; `ws` its weight's scales; 0: none) into the residual stream, then
        // the norm with `gain` to `out`, as e4m3 codes with scales at `out_scales` (0: bf16).
        let norm_io = |io: FusedIo, delta: u64, ws: u64, gain: u64, out: u64, out_scales: u64| NormIo {
            x: s.x.ptr,
            delta,
            delta_scales: if delta != 0 { io.reader_scales(io.act_scales, ws) } else { None },
            gain,
            out,
            out_scales,
            rows: 0,
            blocks: n,
            hidden: d.hidden,
            eps: d.eps,
        };
        let mut mark = |name: &'static str| -> Result<(), CudaError> {
            if let Some(p) = prof.as_mut() {
                let e =
                    g.stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).op("event")?;
                p.push((name, e));
            }
            Ok(())
        };
        let st = &g.stream;
        let h = d.hidden as i32;
        let null = 0u64;
        if first_stage {
            let mut b = st.launch_builder(&g.k.embed_gather);
            b.arg(&s.x.ptr).arg(&w.embed).arg(&ids).arg(&h);
            // SAFETY: x holds n × hidden f32; ids are validated < vocab.
            unsafe { b.launch(per_row(n, 256)) }.op("embed_gather")?;
            if let Some(es) = plan.embedding_scale {
                let mut b = st.launch_builder(&g.k.scale_f32);
                let len = (n * d.hidden) as u64;
                b.arg(&s.x.ptr).arg(&len).arg(&es);
                // SAFETY: x holds n × hidden f32.
                unsafe { b.launch(grid_stride(n * d.hidden)) }.op("scale_f32")?;
            }
            mark("embed")?;
        }
        let norm_threads = if d.hidden >= 2048 { 1024 } else { 256 };
        let (qh, kvh, hd, bs) = (d.q_heads as i32, d.kv_heads as i32, d.head_dim as i32, block_size as i32);
        let scale = plan.attention_scale;
        let group = d.q_heads / d.kv_heads;
        let attn_fn = g.k.attention_for(d.head_dim, group).ok_or_else(|| {
            CudaError::Unsupported(format!("no paged attention kernel for head_dim {} group {group}", d.head_dim))
        })?;
        let (n_i, inter) = (n as i32, d.inter as i32);
        // Tokens per attention launch so that their partials fit (all of them with one chunk).
        let per_launch =
            if chunks == 1 { n } else { (s.part_cap / (chunks * d.q_heads * (d.head_dim + 2))).clamp(1, n) };
        let chunks_i = chunks as i32;
        // The previous layer's MLP output norm (applied with its residual add).
        let mut prev_ffn_out_norm = null;
        // The previous layer's down_proj scales (its product is added unscaled on the fused
        // FP8 path).
        let mut prev_down_scale = null;
        for (li, lw) in w.layers.iter().enumerate() {
            let (kc, vc) = (kv.k[li].ptr, kv.v[li].ptr);
            let lp = plan.layers[li];
            let inv_freq = s.inv_freq.ptr + (lp.rope * d.head_dim / 2 * 4) as u64;
            let window = lp.window;
            if small {
                let rope = RopeArgs {
                    pos,
                    slots,
                    inv_freq,
                    k_cache: kc,
                    v_cache: vc,
                    q_heads: qh,
                    kv_heads: kvh,
                    head_dim: hd,
                    kv_fp8: i32::from(kv_fp8),
                };
                gv(GemvArgs {
                    kind: GemvKind::QkvRope,
                    m: n,
                    y: s.qkv.ptr,
                    w: lw.qkv,
                    wscale: lw.qkv_scale,
                    x: s.x.ptr,
                    gain: lw.input_norm,
                    out: d.qkv_dim(),
                    inp: d.hidden,
                    eps: d.eps,
                    rope,
                })?;
                mark("gemv_qkv_rope_kv")?;
            } else {
                // Residual add of the previous layer's down_proj output fused with this norm.
                let delta = if li == 0 { null } else { s.proj.ptr };
                let x = if let Some(io) = q8 {
                    let a = norm_io(io, delta, prev_down_scale, lw.input_norm, io.codes, io.norm_scales);
                    fp8_of(fp8)?.norm(g, &a)?;
                    mark("add_rmsnorm_fp8io")?;
                    GemmIn::Codes(io.norm_scales)
                } else {
                    let norm = NormArgs {
                        x: s.x.ptr,
                        delta,
                        gain: lw.input_norm,
                        out: s.hn.ptr,
                        rows: null,
                        blocks: n,
                        threads: norm_threads,
                    };
                    add_norm(g, &d, &norm, prev_ffn_out_norm).op("add_rmsnorm")?;
                    mark("add_rmsnorm")?;
                    GemmIn::Bf16(s.hn.ptr)
                };
                let shape = GemmShape { n, out: d.qkv_dim(), inp: d.hidden };
                let (w, ws, scaled) = (lw.qkv, lw.qkv_scale, q8.is_none());
                matmul(fp8, g, Product { y: s.qkv.ptr, x, w, ws, shape, f32_out: false, scaled })?;
                mark("gemm_qkv")?;
                if lw.qkv_bias != 0 || lw.q_norm != 0 {
                    let mut b = st.launch_builder(&g.k.qkv_prep_rope_kv_write);
                    b.arg(&s.qkv.ptr).arg(&lw.qkv_bias).arg(&lw.q_norm).arg(&lw.k_norm);
                    b.arg(&pos).arg(&slots).arg(&inv_freq).arg(&kc).arg(&vc).arg(&qh).arg(&kvh).arg(&hd).arg(&d.eps);
                    let cfg = LaunchConfig {
                        grid_dim: (n as u32, 1, 1),
                        block_dim: (128, 1, 1),
                        shared_mem_bytes: (d.qkv_dim() * 4) as u32,
                    };
                    // SAFETY: as rope_kv_write; bias (qkv_dim) and q/k norms (head_dim) are
                    // device tensors or 0; the shared row fits (checked in `new`).
                    unsafe { b.launch(cfg) }.op("qkv_prep_rope_kv_write")?;
                    mark("qkv_prep_rope_kv_write")?;
                } else {
                    let k = if kv_fp8 { &g.k.rope_kv_write_fp8 } else { &g.k.rope_kv_write };
                    // The fused FP8 path's QKV product is scaled here.
                    let (xs, ws) =
                        q8.and_then(|io| io.reader_scales(io.norm_scales, lw.qkv_scale)).unwrap_or((null, null));
                    let mut b = st.launch_builder(k);
                    b.arg(&s.qkv.ptr)
                        .arg(&pos)
                        .arg(&slots)
                        .arg(&inv_freq)
                        .arg(&kc)
                        .arg(&vc)
                        .arg(&qh)
                        .arg(&kvh)
                        .arg(&hd)
                        .arg(&xs)
                        .arg(&ws);
                    // SAFETY: slots validated < num_blocks · block_size (u32::MAX = padding,
                    // skipped); xs (n) and ws (qkv_dim) f32 or both 0.
                    unsafe { b.launch(per_row(n, 128)) }.op("rope_kv_write")?;
                    mark("rope_kv_write")?;
                }
            }
            if let (Some(da), Some(pa)) = (dattn.as_ref(), pattn.as_mut()) {
                let (qd, qkvd) = ((d.q_dim() * 2) as u64, (d.qkv_dim() * 2) as u64);
                // Right behind the QKV GEMV (which lets its dependents launch early), the first
                // launch overlaps its metadata reads and K/V prefetch with the GEMV's tail.
                let early = small && gemv.as_ref().is_some_and(|g| g.pdl);
                for (i, &(t0, cnt)) in plan_decode.iter().enumerate() {
                    let t = t0 as u64;
                    let args = DecodeArgs {
                        n_tokens: cnt,
                        max_ctx: chunks * ATTN_CHUNK,
                        split_cap: da.occupancy_split_cap(cnt),
                        out: s.attn.ptr + t * qd,
                        qkv: s.qkv.ptr + t * qkvd,
                        k_cache: kc,
                        v_cache: vc,
                        pos: pos + t * 4,
                        tok_bt: tok_bt + t * 4,
                        bts,
                        block_size,
                        scale,
                    };
                    da.launch_with(g, &args, early && i == 0)?;
                    mark("attn_decode")?;
                }
                if !plan_prefill.is_empty() {
                    let ptrs = PrefillPtrs { out: s.attn.ptr, qkv: s.qkv.ptr, k_cache: kc, v_cache: vc, bts };
                    let dims =
                        PrefillDims { q_heads: d.q_heads, kv_heads: d.kv_heads, head_dim: d.head_dim, block_size };
                    pa.launch(g, plan_prefill, &ptrs, dims, scale)?;
                    mark("attn_prefill")?;
                }
            }
            let mut t0 = if dattn.is_some() { n } else { 0 };
            while t0 < n {
                let cnt = per_launch.min(n - t0);
                let t0_i = t0 as i32;
                let mut b = st.launch_builder(attn_fn);
                b.arg(&s.attn.ptr).arg(&s.part.ptr).arg(&s.qkv.ptr).arg(&kc).arg(&vc).arg(&pos).arg(&tok_bt).arg(&bts);
                b.arg(&qh).arg(&kvh).arg(&bs).arg(&scale).arg(&t0_i).arg(&window);
                let cfg = LaunchConfig {
                    grid_dim: (cnt as u32, d.kv_heads as u32, chunks as u32),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: block tables validated to cover each position with valid block ids;
                // `part` holds cnt × q_heads × chunks × (head_dim + 2) f32 (per_launch above).
                unsafe { b.launch(cfg) }.op("paged_attention")?;
                mark("attention")?;
                if chunks > 1 {
                    let mut b = st.launch_builder(&g.k.attn_combine);
                    b.arg(&s.attn.ptr).arg(&s.part.ptr).arg(&pos).arg(&qh).arg(&hd).arg(&chunks_i).arg(&t0_i);
                    let cfg = LaunchConfig {
                        grid_dim: (cnt as u32, d.q_heads as u32, 1),
                        block_dim: (d.head_dim as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: as above.
                    unsafe { b.launch(cfg) }.op("attn_combine")?;
                    mark("attn_combine")?;
                }
                t0 += cnt;
            }
            if small {
                let none = RopeArgs::default();
                // Tensor parallelism: the Residual GEMV adds its partial product into the
                // residual rows; every rank but tp_rank 0 zeroes its copy first, so the f32
                // all-reduce of the rows yields residual + the sum of the partials on all ranks.
                let x_bytes = n * d.hidden * 4;
                if tp.is_some() && tp_rank != 0 {
                    zero(g, s.x.ptr, x_bytes)?;
                }
                gv(GemvArgs {
                    kind: GemvKind::Residual,
                    m: n,
                    y: s.x.ptr,
                    w: lw.o_proj,
                    wscale: lw.o_proj_scale,
                    x: s.attn.ptr,
                    gain: null,
                    out: d.hidden,
                    inp: d.q_dim(),
                    eps: d.eps,
                    rope: none,
                })?;
                mark("gemv_o_proj")?;
                if let Some(c) = tp.as_mut() {
                    c.all_reduce(g, s.x.ptr, n * d.hidden, Elem::F32)?;
                    mark("all_reduce")?;
                }
                gv(GemvArgs {
                    kind: GemvKind::NormGateUpSilu,
                    m: n,
                    y: s.act.ptr,
                    w: lw.gate_up,
                    wscale: lw.gate_up_scale,
                    x: s.x.ptr,
                    gain: lw.post_norm,
                    out: d.inter,
                    inp: d.hidden,
                    eps: d.eps,
                    rope: none,
                })?;
                mark("gemv_gate_up_silu")?;
                if tp.is_some() && tp_rank != 0 {
                    zero(g, s.x.ptr, x_bytes)?;
                }
                gv(GemvArgs {
                    kind: GemvKind::Residual,
                    m: n,
                    y: s.x.ptr,
                    w: lw.down,
                    wscale: lw.down_scale,
                    x: s.act.ptr,
                    gain: null,
                    out: d.hidden,
                    inp: d.inter,
                    eps: d.eps,
                    rope: none,
                })?;
                mark("gemv_down")?;
                if let Some(c) = tp.as_mut() {
                    c.all_reduce(g, s.x.ptr, n * d.hidden, Elem::F32)?;
                    mark("all_reduce")?;
                }
                continue;
            }
            let (scaled, f32_out) = (q8.is_none(), false);
            let (shape, x) = (GemmShape { n, out: d.hidden, inp: d.q_dim() }, GemmIn::Bf16(s.attn.ptr));
            let (w, ws) = (lw.o_proj, lw.o_proj_scale);
            matmul(fp8, g, Product { y: s.proj.ptr, x, w, ws, shape, f32_out, scaled })?;
            mark("gemm_o_proj")?;
            if let Some(c) = tp.as_mut() {
                // Row-parallel o_proj: each shard holds a partial sum.
                c.all_reduce(g, s.proj.ptr, n * d.hidden, Elem::Bf16)?;
                mark("all_reduce")?;
            }
            let x = if let Some(io) = q8 {
                let a = norm_io(io, s.proj.ptr, lw.o_proj_scale, lw.post_norm, io.codes, io.norm_scales);
                fp8_of(fp8)?.norm(g, &a)?;
                mark("add_rmsnorm_fp8io")?;
                GemmIn::Codes(io.norm_scales)
            } else {
                let norm = NormArgs {
                    x: s.x.ptr,
                    delta: s.proj.ptr,
                    gain: lw.post_norm,
                    out: s.hn.ptr,
                    rows: null,
                    blocks: n,
                    threads: norm_threads,
                };
                add_norm(g, &d, &norm, lw.attn_out_norm).op("add_rmsnorm")?;
                mark("add_rmsnorm")?;
                GemmIn::Bf16(s.hn.ptr)
            };
            let (shape, w, ws) = (GemmShape { n, out: 2 * d.inter, inp: d.hidden }, lw.gate_up, lw.gate_up_scale);
            matmul(fp8, g, Product { y: s.gu.ptr, x, w, ws, shape, f32_out, scaled })?;
            mark("gemm_gate_up")?;
            let x = if let Some(io) = q8 {
                let (codes, scales, gu) = (io.codes, io.act_scales, s.gu.ptr);
                let a = SiluIo {
                    codes,
                    scales,
                    gu,
                    gu_scales: io.reader_scales(io.norm_scales, lw.gate_up_scale),
                    n,
                    inter: d.inter,
                };
                fp8_of(fp8)?.silu(g, &a)?;
                mark("silu_mul_fp8io")?;
                GemmIn::Codes(io.act_scales)
            } else {
                let act_fn = if plan.gelu { &g.k.gelu_tanh_mul } else { &g.k.silu_mul };
                let mut b = st.launch_builder(act_fn);
                b.arg(&s.act.ptr).arg(&s.gu.ptr).arg(&n_i).arg(&inter);
                // SAFETY: gu holds n × 2·inter, act n × inter.
                unsafe { b.launch(grid_stride(n * d.inter)) }.op("silu_mul")?;
                mark("silu_mul")?;
                GemmIn::Bf16(s.act.ptr)
            };
            let (shape, w, ws) = (GemmShape { n, out: d.hidden, inp: d.inter }, lw.down, lw.down_scale);
            matmul(fp8, g, Product { y: s.proj.ptr, x, w, ws, shape, f32_out, scaled })?;
            mark("gemm_down")?;
            if let Some(c) = tp.as_mut() {
                c.all_reduce(g, s.proj.ptr, n * d.hidden, Elem::Bf16)?;
                mark("all_reduce")?;
            }
            prev_ffn_out_norm = lw.ffn_out_norm;
            prev_down_scale = lw.down_scale;
        }
        if !last_stage {
            // The next stage gets the complete residual stream: add the last down_proj
            // output (the small path's down GEMV already did). The norm written to `hn` is
            // not used.
            if let (false, Some(last), Some(io)) = (small, w.layers.last(), q8) {
                fp8_of(fp8)?.norm(g, &norm_io(io, s.proj.ptr, last.down_scale, last.post_norm, s.hn.ptr, null))?;
                mark("residual_add")?;
            } else if let (false, Some(last)) = (small, w.layers.last()) {
                let norm = NormArgs {
                    x: s.x.ptr,
                    delta: s.proj.ptr,
                    gain: last.post_norm,
                    out: s.hn.ptr,
                    rows: null,
                    blocks: n,
                    threads: norm_threads,
                };
                add_norm(g, &d, &norm, last.ffn_out_norm).op("residual_add")?;
                mark("residual_add")?;
            }
            return Ok(());
        }
        // Tensor parallelism: tp_rank 0 computes the logits (lm_head is replicated).
        if rows > 0 && tp_rank == 0 {
            // The small path's FP8 lm_head GEMV takes the final norm in its prologue when every
            // token is a logit row (pure decode: the rows are the tokens in order).
            static LM_HEAD_NORM: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            let fuse_norm = small
                && w.lm_head_scale != 0
                && rows == n
                && prev_ffn_out_norm == null
                && plan.softcap.is_none()
                && gemv.as_ref().is_some_and(Gemv::lm_head_takes_norm)
                && *LM_HEAD_NORM.get_or_init(|| std::env::var("PRISM_LM_HEAD_NORM").map_or(true, |v| v != "0"));
            // Last residual add (already done by the small path's down GEMV) + final norm,
            // only for the rows that want logits.
            let delta = if small { null } else { s.proj.ptr };
            let x = match q8.filter(|_| !small) {
                _ if fuse_norm => GemmIn::Bf16(null),
                Some(io) => {
                    // An FP8 lm_head takes the norm's rows as e4m3.
                    let (out, out_scales, x) = if w.lm_head_scale != 0 {
                        (io.codes, io.norm_scales, GemmIn::Codes(io.norm_scales))
                    } else {
                        (s.hn.ptr, null, GemmIn::Bf16(s.hn.ptr))
                    };
                    let a = norm_io(io, delta, prev_down_scale, w.norm, out, out_scales);
                    fp8_of(fp8)?.norm(g, &NormIo { rows: rows_ptr, blocks: rows, ..a })?;
                    x
                }
                None => {
                    let norm = NormArgs {
                        x: s.x.ptr,
                        delta,
                        gain: w.norm,
                        out: s.hn.ptr,
                        rows: rows_ptr,
                        blocks: rows,
                        threads: norm_threads,
                    };
                    add_norm(g, &d, &norm, prev_ffn_out_norm).op("final_norm")?;
                    GemmIn::Bf16(s.hn.ptr)
                }
            };
            if !fuse_norm {
                mark("final_norm")?;
            }
            if small {
                gv(GemvArgs {
                    kind: GemvKind::LogitsF32,
                    m: rows,
                    y: s.logits.ptr,
                    w: w.lm_head,
                    wscale: w.lm_head_scale,
                    x: if fuse_norm { s.x.ptr } else { s.hn.ptr },
                    gain: if fuse_norm { w.norm } else { null },
                    out: d.vocab,
                    inp: d.hidden,
                    eps: d.eps,
                    rope: RopeArgs::default(),
                })?;
            } else {
                let shape = GemmShape { n: rows, out: d.vocab, inp: d.hidden };
                let (y, w, ws) = (s.logits.ptr, w.lm_head, w.lm_head_scale);
                matmul(fp8, g, Product { y, x, w, ws, shape, f32_out: true, scaled: true })?;
            }
            mark("lm_head")?;
            if let Some(cap) = plan.softcap {
                let mut b = st.launch_builder(&g.k.softcap_f32);
                let len = (rows * d.vocab) as u64;
                b.arg(&s.logits.ptr).arg(&len).arg(&cap);
                // SAFETY: logits holds rows × vocab f32.
                unsafe { b.launch(grid_stride(rows * d.vocab)) }.op("softcap_f32")?;
                mark("softcap")?;
            }
        }
        Ok(())
    }
}
