//! [`CudaBackend`]: the [`Backend`] of one GPU (vLLM's GPU model runner). It builds the shard
//! ([`ShardModel`]) from host weights, a mmapped checkpoint or a synthetic shape, validates each
//! step, uploads its metadata and enqueues it — replaying a CUDA graph for pure decode steps —
//! and brings back logits or, for greedy steps, only the argmax token ids.
//!
//! CUDA graphs: a pure decode step is padded to a batch-size bucket (1, 2, 4, … up to
//! `max_num_seqs`; padding tokens write no KV) and replayed from a graph captured per
//! (bucket, context-chunk bucket) on its second use; metadata goes to fixed device addresses
//! before each replay, so a replay allocates and compiles nothing.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cudarc::driver::{LaunchConfig, PinnedHostSlice, PushKernelArg};

use super::arch::ArchPlan;
use super::device::{DevBuf, Gpu, grid_stride};
use super::error::{CudaError, CudaResultExt};
use super::forward::{ATTN_CHUNK, ShardModel};
use super::gemm::GemmPlanInfo;
use super::gemv::GEMV_MAX_M;
use super::kv_cache::KvCache;
use super::nccl::RankComm;
use super::options::{CudaOptions, Dims, Quantization, SyntheticShape};
use super::scratch::{ARGMAX_MAX_SPLITS, Uploaded};
use super::weights::{DeviceWeights, ShardSpec, WeightFormat};
use crate::backend::{Backend, BackendError, LogitConstraints, Logits, StepBatch};
use crate::model::config::ModelConfig;
use crate::model::llama::LlamaWeights;
use crate::model::safetensors::SafetensorsFiles;

/// A captured decode step (graphs hold raw driver handles; used from one thread at a time).
struct Graph(cudarc::driver::CudaGraph);
// SAFETY: the graph is only launched from the thread that runs the backend, one at a time.
unsafe impl Send for Graph {}

/// bf16 Llama on one CUDA device with a paged KV cache.
pub struct CudaBackend {
    pub(super) m: ShardModel,
    /// Decode graphs by (bucket, context-chunk bucket); `None` = seen once, not captured yet.
    graphs: HashMap<(usize, usize), Option<Graph>>,
    /// Decode batch-size buckets (ascending); empty when graphs are off.
    buckets: Vec<usize>,
    /// Graph replays so far (benchmarks and tests).
    pub graph_replays: u64,
    /// Device copy of a step's [`LogitConstraints`] (grown on demand).
    constraints_buf: Option<DevBuf>,
    /// Page-locked staging of that copy, so it is a true asynchronous copy in stream order
    /// (grown on demand; `None` until a constrained step, or when pinned staging is off).
    constraints_host: Option<PinnedHostSlice<u32>>,
    /// Whether constraints are staged in page-locked memory (default) or copied from
    /// pageable memory (benchmark comparison).
    pinned_constraints: bool,
    /// Page-locked landing place of the greedy ids (allocated at the first greedy step): the
    /// copy back is one DMA into it instead of a pageable copy staged by the driver.
    argmax_host: Option<PinnedHostSlice<u32>>,
    /// Host-side phases of the last [`Backend::forward_greedy_constrained`] (benchmarks).
    pub constrained_timing: ConstrainedTiming,
}

/// Where the host's time went in one [`Backend::forward_greedy_constrained`] call.
#[derive(Clone, Copy, Debug, Default)]
pub struct ConstrainedTiming {
    /// Validating the step, uploading its metadata and enqueueing the forward.
    pub enqueue: Duration,
    /// The caller's constraints closure (waiting for grammar masks, assembling them).
    pub constraints: Duration,
    /// Staging the constraints and enqueueing their copy and the edits kernel.
    pub upload: Duration,
    /// Enqueueing the masked argmax and waiting for its ids (the forward's remainder).
    pub finish: Duration,
}

/// Where uploaded masks are, for the argmax kernel.
#[derive(Clone, Copy, Debug)]
struct MaskPtrs {
    masks: u64,
    mask_of_row: u64,
    words: i32,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.m.gpu.name)
            .field("layers", &self.m.d.layers)
            .field("num_blocks", &self.m.kv.num_blocks)
            .field("block_size", &self.m.kv.block_size)
            .finish_non_exhaustive()
    }
}

fn invalid(msg: impl Into<String>) -> BackendError {
    BackendError::InvalidBatch(msg.into())
}

/// The device weight format `opts` asks for.
///
/// # Errors
/// [`CudaError::InvalidOption`] (`quantization`) for FP8 in batch-invariant mode: its GEMMs
/// are cuBLASLt's per-`M` choice, not one fixed algorithm per shape.
fn weight_format(opts: &CudaOptions) -> Result<WeightFormat, CudaError> {
    weight_format_for(opts, false)
}

/// As [`weight_format`] for a checkpoint that is FP8 itself (`fp8_checkpoint`): FP8 weights
/// unless the batch-invariant mode is asked for (which then loads it dequantized to bf16).
fn weight_format_for(opts: &CudaOptions, fp8_checkpoint: bool) -> Result<WeightFormat, CudaError> {
    if fp8_checkpoint && opts.quantization == Quantization::None && !opts.batch_invariant {
        return Ok(WeightFormat { fp8: true, fp8_lm_head: opts.fp8_lm_head });
    }
    let fp8 = opts.quantization == Quantization::Fp8;
    if fp8 && opts.batch_invariant {
        return Err(CudaError::InvalidOption {
            field: "quantization",
            message: "quantization fp8 is not available with batch_invariant".into(),
        });
    }
    Ok(WeightFormat { fp8, fp8_lm_head: fp8 && opts.fp8_lm_head })
}

impl CudaBackend {
    /// Uploads `weights` (f32 host, HF layout) as bf16 to device `opts.device` and allocates
    /// the step scratch and the KV cache.
    ///
    /// # Errors
    /// [`CudaError::Unavailable`] when CUDA is unavailable; [`CudaError::Unsupported`] for
    /// unsupported shapes (head_dim 64 or 128 with at most 8 query heads per KV head, 256 with at most 4);
    /// [`CudaError::InvalidOption`] when the KV budget holds no block; [`CudaError`] when
    /// memory runs out or a kernel cannot be built.
    pub fn new(weights: LlamaWeights, config: &ModelConfig, opts: &CudaOptions) -> Result<Self, CudaError> {
        let gpu = Gpu::new(opts.device)?;
        let (w, d) = DeviceWeights::upload(&gpu, &weights, config, weight_format(opts)?)?;
        let plan = ArchPlan::new(config, 0..weights.layers.len());
        drop(weights);
        Self::finish(gpu, w, d, plan, opts)
    }

    /// Loads a Hugging Face checkpoint straight from its mmapped `.safetensors` files, one
    /// tensor at a time (bf16 tensors copied as stored), so the host never holds an f32 copy
    /// of the model (an 8B model in f32 is 32 GB). Same weights and results as
    /// [`CudaBackend::new`] on the same checkpoint.
    ///
    /// # Errors
    /// As [`CudaBackend::new`]; missing tensors or shapes that disagree with `config` are
    /// [`CudaError::Model`].
    pub fn from_safetensors(
        files: &SafetensorsFiles,
        config: &ModelConfig,
        opts: &CudaOptions,
        progress: &dyn Fn(u64, u64),
    ) -> Result<Self, CudaError> {
        let gpu = Gpu::new(opts.device)?;
        let spec = ShardSpec::full(config.num_hidden_layers);
        let (w, d) = DeviceWeights::from_safetensors(
            &gpu,
            files,
            config,
            &spec,
            weight_format_for(opts, config.quantization.is_some())?,
            progress,
        )?;
        Self::finish(gpu, w, d, ArchPlan::new(config, spec.layers), opts)
    }

    /// One rank's part of a parallel replica, straight from the mmapped checkpoint:
    /// `spec`'s layers and tensor-parallel slice ([`ShardSpec`]). The same kernels, GEMVs and
    /// CUDA graphs as the whole model (`opts.cuda_graphs` as the caller decides); its
    /// collectives come with [`CudaBackend::set_comm`].
    ///
    /// # Errors
    /// As [`CudaBackend::from_safetensors`].
    pub(super) fn from_safetensors_shard(
        files: &SafetensorsFiles,
        config: &ModelConfig,
        opts: &CudaOptions,
        spec: &ShardSpec,
    ) -> Result<Self, CudaError> {
        let gpu = Gpu::new(opts.device)?;
        let (w, d) = DeviceWeights::from_safetensors(
            &gpu,
            files,
            config,
            spec,
            weight_format_for(opts, config.quantization.is_some())?,
            &|_, _| {},
        )?;
        let mut be = Self::finish(gpu, w, d, ArchPlan::new(config, spec.layers.clone()), opts)?;
        be.m.first_stage = spec.first_stage;
        be.m.last_stage = spec.last_stage;
        Ok(be)
    }

    /// Gives a rank's shard its collectives (before its first step).
    pub(super) fn set_comm(&mut self, comm: RankComm) {
        self.m.comm = Some(comm);
        self.graphs.clear();
    }

    /// The shard's device.
    pub(super) fn gpu(&self) -> &Gpu {
        &self.m.gpu
    }

    /// Makes the device current on this thread.
    ///
    /// # Errors
    /// [`BackendError::Cuda`] when the context cannot be bound.
    pub(super) fn bind(&self) -> Result<(), BackendError> {
        Ok(self.m.gpu.bind()?)
    }

    /// Enqueues the receive of the previous stage's `count` f32 residual values (`count ≤`
    /// the scratch's tokens × hidden: the batch was validated) into the residual stream.
    ///
    /// # Errors
    /// [`BackendError::Cuda`] when the shard has no collectives or the receive fails.
    pub(super) fn recv_hidden(&mut self, count: usize, peer: usize) -> Result<(), BackendError> {
        let m = &mut self.m;
        let c = m.comm.as_mut().ok_or(CudaError::TensorParallel("a pipeline stage without collectives"))?;
        Ok(c.recv_f32(&m.gpu, m.s.x.ptr, count, peer)?)
    }

    /// Enqueues the send of the residual stream's first `count` f32 values to the next stage.
    ///
    /// # Errors
    /// As [`CudaBackend::recv_hidden`].
    pub(super) fn send_hidden(&mut self, count: usize, peer: usize) -> Result<(), BackendError> {
        let m = &mut self.m;
        let c = m.comm.as_mut().ok_or(CudaError::TensorParallel("a pipeline stage without collectives"))?;
        Ok(c.send_f32(&m.gpu, m.s.x.ptr, count, peer)?)
    }

    /// Waits for the step's work, bounded by the collective timeout when NCCL is in it.
    ///
    /// # Errors
    /// [`BackendError::Cuda`] on a fault, an NCCL error or a timeout.
    pub(super) fn wait_step(&mut self) -> Result<(), BackendError> {
        let m = &mut self.m;
        match m.comm.as_mut() {
            Some(c) => Ok(c.wait(&m.gpu)?),
            None => Ok(m.gpu.sync()?),
        }
    }

    /// The argmax of the first `rows` logit rows of the last step, computed on the device.
    ///
    /// # Errors
    /// [`BackendError::Cuda`] on a launch or copy failure.
    pub(super) fn greedy_rows(&mut self, rows: usize) -> Result<Vec<u32>, BackendError> {
        self.launch_argmax(rows)?;
        self.download_argmax(rows)
    }

    /// Enqueues the argmax of the first `rows` logit rows on the step's stream (a rank
    /// queues it before its one wait for the step, see [`CudaBackend::download_argmax`]).
    ///
    /// # Errors
    /// [`BackendError::Cuda`] on a launch failure.
    pub(super) fn launch_argmax(&self, rows: usize) -> Result<(), BackendError> {
        self.launch_argmax_masked(rows, None)
    }

    /// [`CudaBackend::launch_argmax`] over rows restricted by uploaded masks
    /// ([`CudaBackend::upload_constraints`]).
    fn launch_argmax_masked(&self, rows: usize, masks: Option<MaskPtrs>) -> Result<(), BackendError> {
        if rows == 0 {
            return Ok(());
        }
        let m = &self.m;
        // A few rows: each split over several blocks (about 256 blocks in all), so that a row
        // is not read by one SM alone; from 64 rows on, one 1,024-thread block per row.
        let splits = if rows >= 64 { 1 } else { 256usize.div_ceil(rows).min(ARGMAX_MAX_SPLITS) };
        let threads = if splits > 1 { 256 } else { 1024 };
        let cfg =
            LaunchConfig { grid_dim: (rows as u32, splits as u32, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 };
        let vocab = m.d.vocab as i32;
        let MaskPtrs { masks, mask_of_row, words } = masks.unwrap_or(MaskPtrs { masks: 0, mask_of_row: 0, words: 0 });
        let (part_v, part_i, done) = m.s.argmax_partials();
        let mut b = m.gpu.stream.launch_builder(&m.gpu.k.argmax_rows);
        b.arg(&m.s.argmax.ptr).arg(&m.s.logits.ptr).arg(&vocab).arg(&masks).arg(&mask_of_row).arg(&words);
        b.arg(&part_v).arg(&part_i).arg(&done);
        // SAFETY: logits hold rows × vocab f32, argmax rows u32; masks (when not null) hold
        // `words` u32 per mask and mask_of_row one i32 per row; the partials hold
        // max_rows × ARGMAX_MAX_SPLITS values and indices and max_rows zeroed counts.
        unsafe { b.launch(cfg) }.op("argmax_rows")?;
        Ok(())
    }

    /// Stages constraints in page-locked memory (`true`, the default) or copies them from
    /// pageable memory (`false`: the host waits for the copy, which waits for the forward).
    pub fn set_pinned_constraints(&mut self, on: bool) {
        self.pinned_constraints = on;
    }

    /// Uploads `c` (one copy) and applies its edits to the logits; returns where its masks
    /// are for the argmax (`None` when no row is masked).
    fn upload_constraints(&mut self, c: &LogitConstraints, rows: usize) -> Result<Option<MaskPtrs>, BackendError> {
        // Layout (u32 words): mask_of_row [rows] | edit rows [n] | edit tokens [n] |
        // edit values [n] (f32 bits) | masks.
        let n = c.edits.len();
        let masked = !c.masks.is_empty();
        let edits_at = if masked { rows } else { 0 };
        let masks_at = edits_at + 3 * n;
        let words = masks_at + c.masks.len();
        if self.constraints_buf.as_ref().is_none_or(|b| b.bytes < words * 4) {
            self.constraints_buf = Some(DevBuf::zeroed(&self.m.gpu, (words * 4).next_power_of_two())?);
        }
        let fill = |host: &mut [u32]| {
            let (of_row, rest) = host.split_at_mut(edits_at);
            for (r, w) in of_row.iter_mut().enumerate() {
                *w = c.mask_of_row.get(r).copied().unwrap_or(-1) as u32;
            }
            let (edits, masks) = rest.split_at_mut(3 * n);
            for (i, e) in c.edits.iter().enumerate() {
                (edits[i], edits[n + i], edits[2 * n + i]) = (e.row, e.token, e.value.to_bits());
            }
            masks.copy_from_slice(&c.masks);
        };
        let Some(buf) = self.constraints_buf.as_ref() else { return Ok(None) };
        let m = &self.m;
        if self.pinned_constraints {
            if self.constraints_host.as_ref().is_none_or(|h| h.len() < words) {
                // SAFETY: `fill` writes every word a copy reads before the copy is enqueued.
                let h = unsafe { m.gpu.ctx.alloc_pinned::<u32>(words.next_power_of_two()) }.op("cuMemHostAlloc")?;
                self.constraints_host = Some(h);
            }
            let Some(host) = self.constraints_host.as_mut() else { return Ok(None) };
            // The staging is free again: every constrained step ends by waiting for the stream
            // (the argmax download), so the last step's copy has completed.
            let host = &mut host.as_mut_slice().op("pinned staging")?[..words];
            fill(host);
            m.gpu.upload(buf, 0, host)?;
        } else {
            let mut host = vec![0u32; words];
            fill(&mut host);
            m.gpu.upload(buf, 0, &host)?;
        }
        let at = |words: usize| buf.ptr + 4 * words as u64;
        if n > 0 {
            let (vocab, count) = (m.d.vocab as i32, n as i32);
            let (er, et, ev) = (at(edits_at), at(edits_at + n), at(edits_at + 2 * n));
            let mut b = m.gpu.stream.launch_builder(&m.gpu.k.logit_edits);
            b.arg(&m.s.logits.ptr).arg(&er).arg(&et).arg(&ev).arg(&count).arg(&vocab);
            // SAFETY: the edit arrays hold n entries each; rows < the step's logit rows.
            unsafe { b.launch(grid_stride(n)) }.op("logit_edits")?;
        }
        Ok(masked.then(|| MaskPtrs { masks: at(masks_at), mask_of_row: at(0), words: c.mask_words as i32 }))
    }

    /// The ids [`CudaBackend::launch_argmax`] computed.
    ///
    /// # Errors
    /// [`BackendError::Cuda`] on a copy failure (or an earlier asynchronous fault).
    pub(super) fn download_argmax(&mut self, rows: usize) -> Result<Vec<u32>, BackendError> {
        if rows == 0 {
            return Ok(Vec::new());
        }
        let m = &self.m;
        if self.argmax_host.as_ref().is_none_or(|h| h.len() < rows) {
            // SAFETY: only the ids a copy below wrote are read.
            let h = unsafe { m.gpu.ctx.alloc_pinned::<u32>(m.s.max_rows.max(rows)) }.op("cuMemHostAlloc")?;
            self.argmax_host = Some(h);
        }
        let Some(host) = self.argmax_host.as_mut() else { return Ok(vec![0; rows]) };
        let host = &mut host.as_mut_slice().op("pinned ids")?[..rows];
        m.gpu.download(host, m.s.argmax.ptr)?;
        Ok(host.to_vec())
    }

    /// The first `rows` logit rows of the last step.
    ///
    /// # Errors
    /// [`BackendError::Cuda`] on a copy failure (or an earlier asynchronous fault).
    pub(super) fn logit_rows(&self, rows: usize) -> Result<Logits, BackendError> {
        let vocab = self.m.d.vocab;
        let mut data = vec![0f32; rows * vocab];
        if rows > 0 {
            self.m.gpu.download(&mut data, self.m.s.logits.ptr)?;
        } else {
            self.m.gpu.sync()?;
        }
        Ok(Logits { rows, vocab_size: vocab, data })
    }

    /// A model of the given shape with seeded random bf16 weights generated on the device
    /// (benchmarks at real model sizes without shipping checkpoints).
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub fn synthetic(shape: &SyntheticShape, opts: &CudaOptions) -> Result<Self, CudaError> {
        let gpu = Gpu::new(opts.device)?;
        let (w, d) = DeviceWeights::synthetic(&gpu, shape, weight_format(opts)?)?;
        let plan = ArchPlan::llama(shape.inv_freq(), d.layers, d.head_dim);
        Self::finish(gpu, w, d, plan, opts)
    }

    fn finish(gpu: Gpu, w: DeviceWeights, d: Dims, plan: ArchPlan, opts: &CudaOptions) -> Result<Self, CudaError> {
        let m = ShardModel::new(gpu, w, d, plan, opts)?;
        let (t, r) = (m.s.max_tokens, m.s.max_rows);
        let buckets: Vec<usize> = if opts.cuda_graphs {
            (0..16).map(|i| 1usize << i).take_while(|&b| b <= r.min(t)).collect()
        } else {
            Vec::new()
        };
        tracing::info!(
            device = %m.gpu.name,
            arch = m.gpu.arch,
            weight_bytes = m.w.bytes,
            kv_blocks = m.kv.num_blocks,
            kv_tokens = m.kv.num_blocks * m.kv.block_size,
            kv_bytes = m.kv.bytes(),
            "CUDA backend ready"
        );
        Ok(Self {
            m,
            graphs: HashMap::new(),
            buckets,
            graph_replays: 0,
            constraints_buf: None,
            constraints_host: None,
            pinned_constraints: true,
            argmax_host: None,
            constrained_timing: ConstrainedTiming::default(),
        })
    }

    /// FP8 weights: how large steps multiply (see `ShardModel::fp8_gemm_path`).
    pub fn fp8_gemm_path(&self) -> Option<&'static str> {
        self.m.fp8_gemm_path()
    }

    /// Device name (e.g. "NVIDIA H200").
    pub fn device_name(&self) -> &str {
        &self.m.gpu.name
    }

    /// The GEMM plans chosen at load (algorithm, invariance check, timings).
    pub fn gemm_plans(&self) -> &[GemmPlanInfo] {
        &self.m.lt.infos
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.m.w.bytes
    }

    /// Runs one step and returns the greedy (argmax) token of each row that asked for
    /// logits, computed on the device: only `rows × 4` bytes come back to the host.
    ///
    /// # Errors
    /// As [`Backend::forward`].
    pub fn forward_greedy(&mut self, batch: &StepBatch) -> Result<Vec<u32>, BackendError> {
        let rows = self.run(batch)?;
        self.greedy_rows(rows)
    }

    /// Selects a compiled decode-GEMV variant (benchmarks; see `gemv.rs`). Graphs are dropped.
    pub fn set_gemv_variant(&mut self, v: usize) {
        if let Some(g) = self.m.gemv.as_mut() {
            g.variant = v;
        }
        self.graphs.clear();
    }

    /// The compiled FP8 decode-GEMV variants (benchmarks; see `gemv.rs`): their indices and the
    /// one in use. Empty without FP8 weights or GEMVs.
    pub fn gemv_fp8_variants(&self) -> (Vec<usize>, usize) {
        self.m.gemv.as_ref().map_or((Vec::new(), 0), |g| (g.fp8_variants(), g.fp8_variant()))
    }

    /// Selects a compiled FP8 decode-GEMV variant (benchmarks); false when it was not compiled.
    /// Graphs are dropped.
    pub fn set_gemv_fp8_variant(&mut self, v: usize) -> bool {
        self.graphs.clear();
        self.m.gemv.as_mut().is_some_and(|g| g.set_fp8_variant(v))
    }

    /// The decode GEMVs' per-block timing records since the last call (benchmarks; see
    /// [`super::gemv::Gemv::trace_take`]): empty unless built with `PRISM_GEMV_TRACE=1`.
    ///
    /// # Errors
    /// [`BackendError::Cuda`] on a copy failure.
    pub fn gemv_trace_take(&self) -> Result<Vec<u64>, BackendError> {
        self.m.gpu.bind()?;
        Ok(match self.m.gemv.as_ref() {
            Some(g) => g.trace_take(&self.m.gpu)?,
            None => Vec::new(),
        })
    }

    /// The decode attention's trace records (see [`super::attn_decode::DecodeAttention::trace_take`]); empty
    /// without the trace build.
    ///
    /// # Errors
    /// As [`Backend::forward`].
    pub fn attn_trace_take(&self) -> Result<Vec<u64>, BackendError> {
        self.m.gpu.bind()?;
        Ok(match self.m.dattn.as_ref() {
            Some(a) => a.trace_take(&self.m.gpu)?,
            None => Vec::new(),
        })
    }

    /// Sets [`CudaOptions::gemv_max_tokens`] (benchmarks; ignored in batch-invariant mode).
    /// Captured graphs are dropped.
    pub fn set_gemv_max_tokens(&mut self, m: usize) {
        if self.m.gemv.is_some() {
            self.m.gemv_max = m.min(GEMV_MAX_M);
            self.graphs.clear();
        }
    }

    /// Whether the decode GEMVs launch with programmatic dependent launch (see `gemv.rs`).
    pub fn pdl(&self) -> bool {
        self.m.gemv.as_ref().is_some_and(|g| g.pdl)
    }

    /// Turns programmatic dependent launch of the decode GEMVs on or off (benchmarks); captured
    /// graphs are dropped.
    pub fn set_pdl(&mut self, on: bool) {
        if let Some(g) = self.m.gemv.as_mut() {
            g.pdl = on;
        }
        self.graphs.clear();
    }

    /// Runs one step eagerly (no graph) with a CUDA event after every launch and returns the
    /// device time per kernel name summed over the step: (name, µs, launches), in first-launch
    /// order. For benchmarks: the events cost a little time themselves.
    ///
    /// # Errors
    /// As [`Backend::forward`].
    pub fn profile_step(&mut self, batch: &StepBatch) -> Result<Vec<(String, f64, usize)>, BackendError> {
        self.validate(batch)?;
        self.m.gpu.bind()?;
        let n = batch.token_ids.len();
        let max_ctx = batch.seqs.iter().map(|q| q.context_len).max().unwrap_or(1);
        let chunks = max_ctx.div_ceil(ATTN_CHUNK).max(1);
        self.m.plan_attention(batch, n)?;
        let Uploaded { ptrs, rows, .. } = self.upload_meta(batch, n)?;
        let start =
            self.m.gpu.stream.record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT)).op("event")?;
        self.m.prof = Some(vec![("start", start)]);
        let res = self.m.enqueue(n, rows, ptrs, chunks);
        let marks = self.m.prof.take().unwrap_or_default();
        res?;
        self.m.gpu.sync()?;
        let mut out: Vec<(String, f64, usize)> = Vec::new();
        for w in marks.windows(2) {
            let us = f64::from(w[0].1.elapsed_ms(&w[1].1).op("elapsed")?) * 1e3;
            match out.iter_mut().find(|o| o.0 == w[1].0) {
                Some(o) => {
                    o.1 += us;
                    o.2 += 1;
                }
                None => out.push((w[1].0.to_owned(), us, 1)),
            }
        }
        Ok(out)
    }

    /// Seconds per step of `iters` steps of `batch` enqueued back to back (metadata upload,
    /// forward pass or graph replay, device argmax; one wait at the end). Against
    /// [`CudaBackend::forward_greedy`], which waits for each step's tokens, the difference is
    /// the host's part of a step: the wait, the copy back and the next step's launch
    /// (benchmarks).
    ///
    /// # Errors
    /// As [`Backend::forward`].
    pub fn time_enqueued_steps(&mut self, batch: &StepBatch, iters: usize) -> Result<f64, BackendError> {
        let rows = self.run(batch)?;
        self.launch_argmax(rows)?;
        self.m.gpu.sync()?;
        let t = std::time::Instant::now();
        for _ in 0..iters.max(1) {
            let rows = self.run(batch)?;
            self.launch_argmax(rows)?;
        }
        self.m.gpu.sync()?;
        Ok(t.elapsed().as_secs_f64() / iters.max(1) as f64)
    }

    /// Waits for all queued work (benchmarks).
    ///
    /// # Errors
    /// [`BackendError::Cuda`] on an asynchronous fault.
    pub fn synchronize(&self) -> Result<(), BackendError> {
        Ok(self.m.gpu.sync()?)
    }

    /// Checks `b` against this shard's limits and cache geometry.
    ///
    /// # Errors
    /// [`BackendError::InvalidBatch`] naming the first violation.
    pub(crate) fn validate(&self, b: &StepBatch) -> Result<(), BackendError> {
        let n = b.token_ids.len();
        if n == 0 {
            return Err(invalid("empty batch"));
        }
        if b.positions.len() != n || b.slot_mapping.len() != n {
            return Err(invalid("token_ids, positions and slot_mapping differ in length"));
        }
        let s = &self.m.s;
        if n > s.max_tokens {
            return Err(invalid(format!("{n} tokens > max_num_batched_tokens {}", s.max_tokens)));
        }
        let rows = b.validate(self.m.d.vocab, self.m.kv.num_blocks, self.m.kv.block_size)?;
        if rows > s.max_rows {
            return Err(invalid(format!("{rows} logit rows > max_num_seqs {}", s.max_rows)));
        }
        Ok(())
    }

    /// Uploads the step metadata padded to `pad_to` tokens; drops the captured graphs when the
    /// metadata buffer moved (they hold the old addresses).
    fn upload_meta(&mut self, b: &StepBatch, pad_to: usize) -> Result<Uploaded, CudaError> {
        let up = self.m.s.upload_meta(&self.m.gpu, b, pad_to)?;
        if up.moved {
            self.graphs.clear();
        }
        Ok(up)
    }

    /// Runs the layers and the lm_head into the logits buffer; returns the number of valid
    /// logit rows (rows are in batch order). Pure decode steps replay a CUDA graph of their
    /// bucket.
    ///
    /// # Errors
    /// As [`Backend::forward`].
    pub(crate) fn run(&mut self, batch: &StepBatch) -> Result<usize, BackendError> {
        self.validate(batch)?;
        self.m.gpu.bind()?;
        let n = batch.token_ids.len();
        let max_ctx = batch.seqs.iter().map(|q| q.context_len).max().unwrap_or(1);
        let chunks = max_ctx.div_ceil(ATTN_CHUNK).max(1);
        let per_token = self.m.d.q_heads * (self.m.d.head_dim + 2);
        let decode = batch.seqs.iter().all(|q| q.query_len == 1 && q.want_logits);
        let bucket = if decode { self.buckets.iter().copied().find(|&b| b >= n) } else { None };
        self.m.plan_attention(batch, bucket.unwrap_or(n))?;
        if let Some(bucket) = bucket {
            let c_cap = chunks.next_power_of_two();
            // (The split-KV partials bound only the batch-invariant kernel.)
            if self.m.dattn.is_some() || bucket * c_cap * per_token <= self.m.s.part_cap {
                self.replay_or_capture(batch, bucket, c_cap)?;
                return Ok(n);
            }
        }
        let Uploaded { ptrs, rows, .. } = self.upload_meta(batch, n)?;
        self.m.enqueue(n, rows, ptrs, chunks)?;
        Ok(rows)
    }

    /// Runs a pure decode step padded to `bucket` tokens with `c_cap` context chunks: replays
    /// its graph, captures it on the second use, or runs it eagerly on the first.
    fn replay_or_capture(&mut self, batch: &StepBatch, bucket: usize, c_cap: usize) -> Result<(), CudaError> {
        let Uploaded { ptrs, .. } = self.upload_meta(batch, bucket)?;
        let key = (bucket, c_cap);
        match self.graphs.get(&key) {
            Some(Some(g)) => {
                g.0.launch().op("graph launch")?;
                self.graph_replays += 1;
            }
            Some(None) => {
                // Second use: capture (everything it launches is loaded by now).
                self.m
                    .gpu
                    .stream
                    .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                    .op("begin_capture")?;
                let res = self.m.enqueue(bucket, bucket, ptrs, c_cap);
                let graph = self
                    .m
                    .gpu
                    .stream
                    .end_capture(
                        cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH,
                    )
                    .op("end_capture")?;
                res?;
                let graph = graph.ok_or(CudaError::EmptyGraph)?;
                graph.launch().op("graph launch")?;
                self.graphs.insert(key, Some(Graph(graph)));
                self.graph_replays += 1;
            }
            None => {
                self.m.enqueue(bucket, bucket, ptrs, c_cap)?;
                self.graphs.insert(key, None);
            }
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits, BackendError> {
        let rows = self.run(batch)?;
        self.logit_rows(rows)
    }

    fn has_device_greedy(&self) -> bool {
        true
    }

    /// [`CudaBackend::forward_greedy`]: `argmax_rows` on the device (NaN skipped, lowest id on
    /// ties, as the host sampler); a step without logit rows is synchronised here, so its
    /// faults surface in this step as with `forward`.
    fn forward_greedy(&mut self, batch: &StepBatch) -> Result<Vec<u32>, BackendError> {
        let ids = CudaBackend::forward_greedy(self, batch)?;
        if ids.is_empty() {
            self.m.gpu.sync()?;
        }
        Ok(ids)
    }

    /// The forward is enqueued first; `constraints` (the host joining its grammar masks) runs
    /// while the device computes it; masks and edits then go up in one copy, edits are added
    /// in place and the argmax skips masked tokens: the logits still never reach the host.
    fn forward_greedy_constrained(
        &mut self,
        batch: &StepBatch,
        constraints: &mut dyn FnMut() -> LogitConstraints,
    ) -> Result<Vec<u32>, BackendError> {
        let t0 = Instant::now();
        let rows = self.run(batch)?;
        let t1 = Instant::now();
        let c = constraints();
        let t2 = Instant::now();
        let masks = if c.is_empty() || rows == 0 { None } else { self.upload_constraints(&c, rows)? };
        let t3 = Instant::now();
        self.launch_argmax_masked(rows, masks)?;
        let ids = self.download_argmax(rows)?;
        if ids.is_empty() {
            self.m.gpu.sync()?;
        }
        self.constrained_timing =
            ConstrainedTiming { enqueue: t1 - t0, constraints: t2 - t1, upload: t3 - t2, finish: t3.elapsed() };
        Ok(ids)
    }

    fn num_kv_blocks(&self) -> usize {
        self.m.kv.num_blocks
    }

    fn block_size(&self) -> usize {
        self.m.kv.block_size
    }

    fn kv_bytes_per_token(&self) -> usize {
        KvCache::bytes_per_token(&self.m.d, self.m.kv.dtype)
    }

    fn name(&self) -> &'static str {
        "cuda"
    }
}
