//! The CUDA backend (feature `cuda`): the Llama forward pass of `cpu.rs` in bf16 on one GPU
//! (vLLM's GPU model runner shape). Weights are uploaded as bf16 (q/k/v and gate/up fused),
//! products go through cuBLAS (`cublasGemmEx`, bf16 in, f32 accumulate), everything else is
//! NVRTC-compiled CUDA C (`cuda/kernels/llama.cu`): embedding gather, residual add fused with
//! RMSNorm, RoPE (rotate-half, llama3 scaling through the precomputed inverse frequencies)
//! fused with the K/V write into the paged cache through the slot mapping, paged GQA
//! attention (PagedAttention, Kwon et al. 2023; one kernel serves prefill chunks and decode:
//! each query token attends over its sequence's block table up to its own position),
//! SiLU·mul and a greedy argmax on the device. The residual stream stays in f32.
//!
//! Batch invariance (deterministic inference, opt-in): a sequence's logits do not depend on what
//! else is in the step or how its prompt is chunked. GEMMs use one cuBLASLt algorithm per weight
//! shape for every row count, checked bitwise row-invariant on the device at load
//! ([`gemm`]); attention splits each token's context into fixed 128-position chunks merged in
//! chunk order; every other kernel is per row.
//!
//! CUDA graphs: a pure decode step is padded to a batch-size bucket (1, 2, 4, … up to
//! `max_num_seqs`; padding tokens write no KV) and replayed from a graph captured per
//! (bucket, context-chunk bucket) on its second use; metadata goes to fixed device addresses
//! before each replay, so a replay allocates and compiles nothing.
//!
//! The KV cache is preallocated after the weights and the step scratch from
//! `gpu_memory_utilization` (vLLM's rule: `total · utilization − in use`) unless an explicit
//! byte budget is given; its capacity in tokens is logged.
//!
//! Two modes. The default fast mode runs steps of at most `gemv_max_tokens` tokens through
//! fused decode GEMVs (`gemv.rs`: norms, RoPE + K/V write, residual adds and SiLU·mul inside),
//! larger steps through cuBLASLt's per-M heuristic, and attention through tensor-core kernels
//! (`attn_decode.rs`: FlashDecoding over the paged cache, all query heads of a KV head per
//! K/V read; `attn_prefill.rs`: FlashAttention-2 over prefill chunks). The batch-invariant mode
//! (`CudaOptions::batch_invariant`) keeps the fixed-algorithm GEMMs and the split-KV kernel
//! below, trading speed for logits that never depend on the rest of the step.
//!
//! Tensor parallelism: [`tp::CudaTpBackend`] runs one shard of this backend per GPU of a replica's
//! group with NCCL all-reduces after o_proj and down_proj (graphs and the fused GEMVs off there).

pub mod attn_decode;
pub mod attn_prefill;
pub mod device;
pub mod gemm;
pub mod gemv;
pub mod tp;
mod weights;

use std::collections::HashMap;

use device::{DevBuf, GemmShape, Gpu, per_row};

use super::{Backend, BackendError, Logits, StepBatch};
use crate::EngineError;
use crate::model::{LlamaWeights, ModelConfig};
use cudarc::driver::{LaunchConfig, PushKernelArg};
pub use device::cuda_available;
use weights::DeviceWeights;
pub use weights::SyntheticShape;

/// Options for [`CudaBackend::new`].
#[derive(Clone, Debug)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Fraction of the device's memory this replica may use (vLLM's `gpu_memory_utilization`).
    pub gpu_memory_utilization: f32,
    /// Explicit KV-cache budget in bytes; overrides `gpu_memory_utilization` when set.
    pub kv_cache_bytes: Option<u64>,
    /// Most tokens in one step (scratch rows).
    pub max_num_batched_tokens: usize,
    /// Most sequences in one step (logit rows).
    pub max_num_seqs: usize,
    /// Replay decode steps from CUDA graphs captured per batch-size bucket.
    pub cuda_graphs: bool,
    /// Batch-invariant (deterministic) mode: one fixed cuBLASLt algorithm per weight shape for
    /// every row count and no GEMV fast path, so a sequence's logits never depend on what else
    /// is in the step (vLLM's `VLLM_BATCH_INVARIANT`, SGLang's deterministic inference). Off by
    /// default: the fast mode uses fused decode GEMVs for steps of at most
    /// [`gemv::GEMV_MAX_M`] tokens and cuBLASLt's per-`M` heuristic choice above that.
    pub batch_invariant: bool,
    /// Fast mode: steps of at most this many tokens (≤ [`gemv::GEMV_MAX_M`]) run the fused
    /// decode GEMVs; larger steps use cuBLASLt.
    pub gemv_max_tokens: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device: 0,
            block_size: 16,
            gpu_memory_utilization: 0.9,
            kv_cache_bytes: None,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            cuda_graphs: true,
            batch_invariant: false,
            gemv_max_tokens: 2,
        }
    }
}

/// Model dimensions of the (local) shard.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub hidden: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub inter: usize,
    pub vocab: usize,
    pub layers: usize,
    pub eps: f32,
}

impl Dims {
    fn q_dim(&self) -> usize {
        self.q_heads * self.head_dim
    }
    fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    fn qkv_dim(&self) -> usize {
        self.q_dim() + 2 * self.kv_dim()
    }
}

/// Per-step activations (sized for `max_tokens` rows) and the step's metadata buffer.
struct Scratch {
    max_tokens: usize,
    max_rows: usize,
    /// f32 `[T, hidden]` residual stream.
    x: DevBuf,
    /// bf16 `[T, hidden]` normed activations (also the last rows' normed states).
    hn: DevBuf,
    /// bf16 `[T, qkv_dim]`.
    qkv: DevBuf,
    /// bf16 `[T, q_dim]`.
    attn: DevBuf,
    /// bf16 `[T, hidden]` o_proj / down_proj output (added to `x` by the next norm).
    proj: DevBuf,
    /// bf16 `[T, 2·inter]`.
    gu: DevBuf,
    /// bf16 `[T, inter]`.
    act: DevBuf,
    /// f32 `[R, vocab]`.
    logits: DevBuf,
    /// u32 `[R]` greedy tokens.
    argmax: DevBuf,
    /// u32 step metadata: ids, positions, slots, block-table offsets, logit rows, block tables.
    meta: DevBuf,
    /// f32 chunked-context attention partials (`[n, q_heads, chunks, head_dim + 2]`).
    part: DevBuf,
    /// Capacity of `part` in f32 values.
    part_cap: usize,
    /// f32 `[head_dim / 2]` RoPE inverse frequencies.
    inv_freq: DevBuf,
    host_meta: Vec<u32>,
}

/// A captured decode step (graphs hold raw driver handles; used from one thread at a time).
struct Graph(cudarc::driver::CudaGraph);
// SAFETY: the graph is only launched from the thread that runs the backend, one at a time.
unsafe impl Send for Graph {}

/// bf16 Llama on one CUDA device with a paged KV cache.
pub struct CudaBackend {
    gpu: Gpu,
    lt: gemm::LtGemm,
    /// Fused decode GEMVs (fast mode only; `None` when they cannot be built for this model).
    gemv: Option<gemv::Gemv>,
    /// [`CudaOptions::batch_invariant`].
    invariant: bool,
    /// [`CudaOptions::gemv_max_tokens`] (0 in batch-invariant mode).
    gemv_max: usize,
    /// Fast mode: tensor-core paged attention for decode rows and for prefill chunks (batch
    /// invariance keeps the split-KV kernel of `llama.cu` for every row).
    dattn: Option<attn_decode::DecodeAttention>,
    pattn: Option<attn_prefill::PrefillAttention>,
    /// This step's attention work: runs of decode rows (first token, count) and prefill chunks.
    plan_decode: Vec<(usize, usize)>,
    plan_prefill: Vec<attn_prefill::PrefillSeq>,
    /// Tensor-parallel shard: its communicator (all-reduce after o_proj and down_proj).
    tp: Option<tp::TpComm>,
    /// Per-launch events while [`CudaBackend::profile_step`] runs.
    prof: Option<Vec<(&'static str, cudarc::driver::CudaEvent)>>,
    /// Decode graphs by (bucket, context-chunk bucket); `None` = seen once, not captured yet.
    graphs: HashMap<(usize, usize), Option<Graph>>,
    /// Decode batch-size buckets (ascending); empty when graphs are off.
    buckets: Vec<usize>,
    /// Graph replays so far (benchmarks and tests).
    pub graph_replays: u64,
    d: Dims,
    w: DeviceWeights,
    s: Scratch,
    block_size: usize,
    num_blocks: usize,
    /// Per layer: K and V caches, bf16 `[num_blocks, block_size, kv_heads, head_dim]`.
    k_cache: Vec<DevBuf>,
    v_cache: Vec<DevBuf>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.gpu.name)
            .field("layers", &self.d.layers)
            .field("num_blocks", &self.num_blocks)
            .field("block_size", &self.block_size)
            .finish_non_exhaustive()
    }
}

/// Positions per attention context chunk (`ATTN_CHUNK` in `kernels/llama.cu`).
const ATTN_CHUNK: usize = 128;
/// Bytes of the attention partial buffer; larger steps are split into several launches.
const PART_BYTES: usize = 64 << 20;

/// Enqueues `add_rmsnorm` (`kernels/llama.cu`) over `blocks` rows: row `r = rows[b]` (or `b`
/// when `rows` is 0) of the f32 residual stream `x [*, hidden]` gets `delta[r]` (bf16) added when
/// `delta` is not 0, and `out[b] = bf16(x[r] · rsqrt(mean(x[r]²) + eps) · gain)`.
#[allow(clippy::too_many_arguments)]
fn add_rmsnorm(
    g: &Gpu,
    x: u64,
    delta: u64,
    gain: u64,
    out: u64,
    rows: u64,
    blocks: usize,
    d: Dims,
    threads: u32,
) -> Result<(), cudarc::driver::DriverError> {
    let (h, eps) = (d.hidden as i32, d.eps);
    let mut b = g.stream.launch_builder(&g.k.add_rmsnorm);
    b.arg(&x).arg(&delta).arg(&gain).arg(&out).arg(&rows).arg(&h).arg(&eps);
    // SAFETY: the caller passes x, delta with every indexed row of `hidden` values, gain
    // `hidden`, out `blocks` rows, and rows (when set) `blocks` indices of rows of x.
    unsafe { b.launch(per_row(blocks, threads)) }.map(|_| ())
}

fn invalid(msg: impl Into<String>) -> BackendError {
    BackendError::InvalidBatch(msg.into())
}

fn engine_err(e: BackendError) -> EngineError {
    EngineError::Internal(format!("cuda backend: {e}"))
}

impl CudaBackend {
    /// Uploads `weights` (f32 host, HF layout) as bf16 to device `opts.device` and allocates
    /// the step scratch and the KV cache.
    ///
    /// # Errors
    /// [`EngineError::Internal`] when CUDA is unavailable, the shapes are unsupported
    /// (head_dim must be 64 or 128, at most 8 query heads per KV head) or memory runs out;
    /// [`EngineError::InvalidRequest`] when the KV budget holds no block.
    pub fn new(weights: LlamaWeights, config: &ModelConfig, opts: &CudaOptions) -> Result<Self, EngineError> {
        let gpu = Gpu::new(opts.device).map_err(engine_err)?;
        let (w, d) = DeviceWeights::upload(&gpu, &weights, config).map_err(engine_err)?;
        drop(weights);
        Self::finish(gpu, w, d, &config.rope_inv_freq(), opts)
    }

    /// Loads a Hugging Face checkpoint straight from its mmapped `.safetensors` files, one
    /// tensor at a time (bf16 tensors copied as stored), so the host never holds an f32 copy
    /// of the model (an 8B model in f32 is 32 GB). Same weights and results as
    /// [`CudaBackend::new`] on the same checkpoint.
    ///
    /// # Errors
    /// As [`CudaBackend::new`]; missing tensors or shapes that disagree with `config` are
    /// [`EngineError::Internal`].
    pub fn from_safetensors(
        files: &crate::model::safetensors::SafetensorsFiles,
        config: &ModelConfig,
        opts: &CudaOptions,
        progress: &dyn Fn(u64, u64),
    ) -> Result<Self, EngineError> {
        let gpu = Gpu::new(opts.device).map_err(engine_err)?;
        let (w, d) = DeviceWeights::from_safetensors(&gpu, files, config, progress).map_err(engine_err)?;
        Self::finish(gpu, w, d, &config.rope_inv_freq(), opts)
    }

    /// One tensor-parallel shard: `weights` is the shard's slice ([`LlamaWeights::shard`]) and
    /// `comm` its rank's communicator. The fused GEMV path and CUDA graphs are off (the residual
    /// adds wait for the all-reduce; NCCL launches are not captured).
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub(crate) fn new_shard(
        weights: LlamaWeights,
        config: &ModelConfig,
        opts: &CudaOptions,
        comm: tp::TpComm,
    ) -> Result<Self, EngineError> {
        let opts = CudaOptions { cuda_graphs: false, ..opts.clone() };
        let mut be = Self::new(weights, config, &opts)?;
        be.gemv_max = 0;
        be.tp = Some(comm);
        Ok(be)
    }

    /// A model of the given shape with seeded random bf16 weights generated on the device
    /// (benchmarks at real model sizes without shipping checkpoints).
    ///
    /// # Errors
    /// As [`CudaBackend::new`].
    pub fn synthetic(shape: &SyntheticShape, opts: &CudaOptions) -> Result<Self, EngineError> {
        let gpu = Gpu::new(opts.device).map_err(engine_err)?;
        let (w, d) = DeviceWeights::synthetic(&gpu, shape).map_err(engine_err)?;
        Self::finish(gpu, w, d, &shape.inv_freq(), opts)
    }

    fn finish(gpu: Gpu, w: DeviceWeights, d: Dims, inv_freq: &[f32], opts: &CudaOptions) -> Result<Self, EngineError> {
        if opts.block_size == 0 {
            return Err(EngineError::InvalidRequest { field: "block_size", message: "block_size must be >= 1".into() });
        }
        let group_ok =
            d.kv_heads > 0 && d.q_heads.is_multiple_of(d.kv_heads) && matches!(d.q_heads / d.kv_heads, 1 | 2 | 4 | 8);
        if !(d.head_dim == 64 || d.head_dim == 128) || !group_ok {
            return Err(EngineError::Internal(format!(
                "cuda backend supports head_dim 64/128 and 1, 2, 4 or 8 query heads per KV head (got {} and {}/{})",
                d.head_dim, d.q_heads, d.kv_heads
            )));
        }
        let t = opts.max_num_batched_tokens.max(opts.max_num_seqs).max(1);
        let r = opts.max_num_seqs.max(1);
        let alloc = |bytes: usize| DevBuf::zeroed(&gpu, bytes).map_err(engine_err);
        let bf = 2usize;
        let s = Scratch {
            max_tokens: t,
            max_rows: r,
            x: alloc(t * d.hidden * 4)?,
            hn: alloc(t * d.hidden * bf)?,
            qkv: alloc(t * d.qkv_dim() * bf)?,
            attn: alloc(t * d.q_dim() * bf)?,
            proj: alloc(t * d.hidden * bf)?,
            gu: alloc(t * 2 * d.inter * bf)?,
            act: alloc(t * d.inter * bf)?,
            logits: alloc(r * d.vocab * 4)?,
            argmax: alloc(r * 4)?,
            meta: alloc((4 * t + r + 65_536) * 4)?,
            part: alloc(PART_BYTES)?,
            part_cap: PART_BYTES / 4,
            inv_freq: alloc(inv_freq.len() * 4)?,
            host_meta: Vec::new(),
        };
        gpu.upload(&s.inv_freq, 0, inv_freq).map_err(engine_err)?;
        // One batch-invariant GEMM algorithm per weight shape (checked on this device).
        let mut lt = gemm::LtGemm::new(&gpu).map_err(engine_err)?;
        // The GEMVs need 8-element (16-byte) rows; their norm prologue keeps GEMV_MAX_M
        // activation rows in shared memory (a model too wide for it runs without them).
        let gemv_shapes_ok = d.hidden.is_multiple_of(8) && d.inter.is_multiple_of(8) && d.q_dim().is_multiple_of(8);
        let gemv = if opts.batch_invariant || !gemv_shapes_ok {
            None
        } else {
            gemv::Gemv::new(&gpu, d.hidden)
                .map_err(|e| tracing::warn!(error = %e, "decode GEMVs unavailable; using cuBLASLt for every step"))
                .ok()
        };
        let gemv_max = if gemv.is_some() { opts.gemv_max_tokens.min(gemv::GEMV_MAX_M) } else { 0 };
        // The tensor-core attention kernels use bf16 mma (sm_80 and later); older GPUs keep the
        // split-KV kernel.
        let sm: u32 = gpu.arch.trim_start_matches("sm_").parse().unwrap_or(0);
        let (dattn, pattn) = if opts.batch_invariant || sm < 80 {
            (None, None)
        } else {
            let shape = attn_decode::AttnShape { q_heads: d.q_heads, kv_heads: d.kv_heads, head_dim: d.head_dim };
            (
                Some(attn_decode::DecodeAttention::new(&gpu, shape, r).map_err(engine_err)?),
                Some(attn_prefill::PrefillAttention::new(&gpu, t).map_err(engine_err)?),
            )
        };
        if let (true, Some(l0)) = (opts.batch_invariant, w.layers.first()) {
            for (wp, out, inp) in [
                (l0.qkv, d.qkv_dim(), d.hidden),
                (l0.o_proj, d.hidden, d.q_dim()),
                (l0.gate_up, 2 * d.inter, d.hidden),
                (l0.down, d.hidden, d.inter),
            ] {
                lt.plan(&gpu, wp, out, inp, false, t).map_err(engine_err)?;
            }
        }
        if opts.batch_invariant {
            lt.plan(&gpu, w.lm_head, d.vocab, d.hidden, true, r).map_err(engine_err)?;
        }
        let buckets: Vec<usize> = if opts.cuda_graphs {
            (0..16).map(|i| 1usize << i).take_while(|&b| b <= r.min(t)).collect()
        } else {
            Vec::new()
        };
        let per_token = d.layers * 2 * d.kv_dim() * bf;
        let per_block = per_token * opts.block_size;
        let (free, total) = gpu.mem_info().map_err(engine_err)?;
        let budget = match opts.kv_cache_bytes {
            Some(b) => b,
            None => {
                let used = total - free;
                let allowed = (total as f64 * f64::from(opts.gpu_memory_utilization)) as u64;
                // Leave 256 MiB for cuBLAS workspaces and the driver.
                allowed.saturating_sub(used as u64).saturating_sub(256 << 20)
            }
        };
        let num_blocks = usize::try_from(budget / per_block as u64).unwrap_or(usize::MAX);
        if num_blocks == 0 {
            return Err(EngineError::InvalidRequest {
                field: "gpu_memory_utilization",
                message: format!(
                    "KV budget {budget} B holds no block of {} tokens ({per_token} B/token)",
                    opts.block_size
                ),
            });
        }
        let layer_bytes = num_blocks * opts.block_size * d.kv_dim() * bf;
        let mut k_cache = Vec::with_capacity(d.layers);
        let mut v_cache = Vec::with_capacity(d.layers);
        for _ in 0..d.layers {
            k_cache.push(alloc(layer_bytes)?);
            v_cache.push(alloc(layer_bytes)?);
        }
        gpu.sync().map_err(engine_err)?;
        tracing::info!(
            device = %gpu.name,
            arch = gpu.arch,
            weight_bytes = w.bytes,
            kv_blocks = num_blocks,
            kv_tokens = num_blocks * opts.block_size,
            kv_bytes = num_blocks * per_block,
            "CUDA backend ready"
        );
        Ok(Self {
            gpu,
            lt,
            gemv,
            invariant: opts.batch_invariant,
            gemv_max,
            prof: None,
            tp: None,
            dattn,
            pattn,
            plan_decode: Vec::new(),
            plan_prefill: Vec::new(),
            graphs: HashMap::new(),
            buckets,
            graph_replays: 0,
            d,
            w,
            s,
            block_size: opts.block_size,
            num_blocks,
            k_cache,
            v_cache,
        })
    }

    /// Device name (e.g. "NVIDIA H200").
    pub fn device_name(&self) -> &str {
        &self.gpu.name
    }

    /// The GEMM plans chosen at load (algorithm, invariance check, timings).
    pub fn gemm_plans(&self) -> &[gemm::GemmPlanInfo] {
        &self.lt.infos
    }

    /// Bytes of weights on the device.
    pub fn weight_bytes(&self) -> usize {
        self.w.bytes
    }

    /// Runs one step and returns the greedy (argmax) token of each row that asked for
    /// logits, computed on the device: only `rows × 4` bytes come back to the host.
    ///
    /// # Errors
    /// As [`Backend::forward`].
    pub fn forward_greedy(&mut self, batch: &StepBatch) -> Result<Vec<u32>, BackendError> {
        let rows = self.run(batch)?;
        if rows == 0 {
            return Ok(Vec::new());
        }
        let cfg = per_row(rows, 1024);
        let vocab = self.d.vocab as i32;
        let mut b = self.gpu.stream.launch_builder(&self.gpu.k.argmax_rows);
        b.arg(&self.s.argmax.ptr).arg(&self.s.logits.ptr).arg(&vocab);
        // SAFETY: logits hold rows × vocab f32, argmax rows u32.
        unsafe { b.launch(cfg) }.map_err(|e| device::dev_err("argmax_rows", e))?;
        let mut out = vec![0u32; rows];
        self.gpu.download(&mut out, self.s.argmax.ptr)?;
        Ok(out)
    }

    /// Splits the step's rows into runs of decode rows (one query token; `rows` tokens when
    /// the step is a pure decode padded to a graph bucket) and prefill chunks, and uploads the
    /// prefill work list once for all layers.
    fn plan_attention(&mut self, batch: &StepBatch, rows: usize) -> Result<(), BackendError> {
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
                self.plan_prefill.push(attn_prefill::PrefillSeq {
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
            let dims = attn_prefill::PrefillDims {
                q_heads: self.d.q_heads,
                kv_heads: self.d.kv_heads,
                head_dim: self.d.head_dim,
                block_size: self.block_size,
            };
            pattn.prepare(&self.gpu, &self.plan_prefill, dims)?;
        }
        Ok(())
    }

    /// Selects a compiled decode-GEMV variant (benchmarks; see `gemv.rs`). Graphs are dropped.
    pub fn set_gemv_variant(&mut self, v: usize) {
        if let Some(g) = self.gemv.as_mut() {
            g.variant = v;
        }
        self.graphs.clear();
    }

    /// Sets [`CudaOptions::gemv_max_tokens`] (benchmarks; ignored in batch-invariant mode).
    /// Captured graphs are dropped.
    pub fn set_gemv_max_tokens(&mut self, m: usize) {
        if self.gemv.is_some() && self.tp.is_none() {
            self.gemv_max = m.min(gemv::GEMV_MAX_M);
            self.graphs.clear();
        }
    }

    /// Turns programmatic dependent launch of the decode GEMVs on or off (benchmarks); captured
    /// graphs are dropped.
    pub fn set_pdl(&mut self, on: bool) {
        if let Some(g) = self.gemv.as_mut() {
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
        self.gpu.bind()?;
        let n = batch.token_ids.len();
        let max_ctx = batch.seqs.iter().map(|q| q.context_len).max().unwrap_or(1);
        let chunks = max_ctx.div_ceil(ATTN_CHUNK).max(1);
        self.plan_attention(batch, n)?;
        let (ptrs, rows) = self.upload_meta(batch, n)?;
        let start = self
            .gpu
            .stream
            .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(|e| device::dev_err("event", e))?;
        self.prof = Some(vec![("start", start)]);
        let res = self.enqueue(n, rows, ptrs, chunks);
        let marks = self.prof.take().unwrap_or_default();
        res?;
        self.gpu.sync()?;
        let mut out: Vec<(String, f64, usize)> = Vec::new();
        for w in marks.windows(2) {
            let us = f64::from(w[0].1.elapsed_ms(&w[1].1).map_err(|e| device::dev_err("elapsed", e))?) * 1e3;
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

    /// Waits for all queued work (benchmarks).
    ///
    /// # Errors
    /// [`BackendError::Device`] on an asynchronous fault.
    pub fn synchronize(&self) -> Result<(), BackendError> {
        self.gpu.sync()
    }

    fn validate(&self, b: &StepBatch) -> Result<(), BackendError> {
        let n = b.token_ids.len();
        if n == 0 {
            return Err(invalid("empty batch"));
        }
        if b.positions.len() != n || b.slot_mapping.len() != n {
            return Err(invalid("token_ids, positions and slot_mapping differ in length"));
        }
        if n > self.s.max_tokens {
            return Err(invalid(format!("{n} tokens > max_num_batched_tokens {}", self.s.max_tokens)));
        }
        let rows = b.validate(self.d.vocab, self.num_blocks, self.block_size)?;
        if rows > self.s.max_rows {
            return Err(invalid(format!("{rows} logit rows > max_num_seqs {}", self.s.max_rows)));
        }
        Ok(())
    }

    /// Uploads the step metadata, padded to `pad_to` tokens (padding: token 0 at position 0,
    /// no KV slot, the first sequence's block table, its own logit row); returns device
    /// addresses of (ids, pos, slots, tok_bt, rows, bts) and the number of logit rows.
    fn upload_meta(&mut self, b: &StepBatch, pad_to: usize) -> Result<([u64; 6], usize), BackendError> {
        let n = b.token_ids.len();
        let pad = pad_to.saturating_sub(n);
        let np = n + pad;
        let m = &mut self.s.host_meta;
        m.clear();
        m.extend_from_slice(&b.token_ids);
        m.extend(std::iter::repeat_n(0, pad));
        m.extend_from_slice(&b.positions);
        m.extend(std::iter::repeat_n(0, pad));
        m.extend_from_slice(&b.slot_mapping);
        m.extend(std::iter::repeat_n(u32::MAX, pad));
        let mut bt_off = 0u32;
        for s in &b.seqs {
            m.extend(std::iter::repeat_n(bt_off, s.query_len));
            bt_off += s.block_table.len() as u32;
        }
        m.extend(std::iter::repeat_n(0, pad));
        let rows_at = m.len();
        m.extend(b.seqs.iter().filter(|s| s.want_logits).map(|s| (s.query_start + s.query_len - 1) as u32));
        let rows = m.len() - rows_at;
        m.extend((n..np).map(|i| i as u32));
        let bts_at = m.len();
        for s in &b.seqs {
            m.extend_from_slice(&s.block_table);
        }
        let need = m.len() * 4;
        if need > self.s.meta.bytes {
            self.gpu.sync()?;
            // Captured graphs hold the old addresses.
            self.graphs.clear();
            self.s.meta = DevBuf::zeroed(&self.gpu, need * 2)?;
        }
        self.gpu.upload(&self.s.meta, 0, &self.s.host_meta)?;
        let base = self.s.meta.ptr;
        let at = |i: usize| base + (i * 4) as u64;
        Ok(([at(0), at(np), at(2 * np), at(3 * np), at(rows_at), at(bts_at)], rows))
    }

    /// Runs the layers and the lm_head into `s.logits`; returns the number of valid logit rows
    /// (rows are in batch order). Pure decode steps replay a CUDA graph of their bucket.
    fn run(&mut self, batch: &StepBatch) -> Result<usize, BackendError> {
        self.validate(batch)?;
        self.gpu.bind()?;
        let n = batch.token_ids.len();
        let max_ctx = batch.seqs.iter().map(|q| q.context_len).max().unwrap_or(1);
        let chunks = max_ctx.div_ceil(ATTN_CHUNK).max(1);
        let per_token = self.d.q_heads * (self.d.head_dim + 2);
        let decode = batch.seqs.iter().all(|q| q.query_len == 1 && q.want_logits);
        let bucket = if decode { self.buckets.iter().copied().find(|&b| b >= n) } else { None };
        self.plan_attention(batch, bucket.unwrap_or(n))?;
        if let Some(bucket) = bucket {
            let c_cap = chunks.next_power_of_two();
            // (The split-KV partials bound only the batch-invariant kernel.)
            if self.dattn.is_some() || bucket * c_cap * per_token <= self.s.part_cap {
                let (ptrs, _) = self.upload_meta(batch, bucket)?;
                let key = (bucket, c_cap);
                match self.graphs.get(&key) {
                    Some(Some(g)) => {
                        g.0.launch().map_err(|e| device::dev_err("graph launch", e))?;
                        self.graph_replays += 1;
                    }
                    Some(None) => {
                        // Second use: capture (everything it launches is loaded by now).
                        self.gpu
                            .stream
                            .begin_capture(cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED)
                            .map_err(|e| device::dev_err("begin_capture", e))?;
                        let res = self.enqueue(bucket, bucket, ptrs, c_cap);
                        let graph = self
                            .gpu
                            .stream
                            .end_capture(cudarc::driver::sys::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
                            .map_err(|e| device::dev_err("end_capture", e))?;
                        res?;
                        let graph = graph.ok_or_else(|| BackendError::Device("empty graph capture".into()))?;
                        graph.launch().map_err(|e| device::dev_err("graph launch", e))?;
                        self.graphs.insert(key, Some(Graph(graph)));
                        self.graph_replays += 1;
                    }
                    None => {
                        self.enqueue(bucket, bucket, ptrs, c_cap)?;
                        self.graphs.insert(key, None);
                    }
                }
                return Ok(n);
            }
        }
        let (ptrs, rows) = self.upload_meta(batch, n)?;
        self.enqueue(n, rows, ptrs, chunks)?;
        Ok(rows)
    }

    /// Enqueues one forward pass over `n` tokens (`rows` logit rows, `chunks` context chunks
    /// per token at most) on the stream; no host synchronisation, no allocation (capturable).
    fn enqueue(&mut self, n: usize, rows: usize, ptrs: [u64; 6], chunks: usize) -> Result<(), BackendError> {
        let [ids, pos, slots, tok_bt, rows_ptr, bts] = ptrs;
        let d = self.d;
        // Fast mode, few tokens: fused GEMVs (norms, RoPE + K/V write, residual adds and
        // SiLU·mul inside).
        let small = n <= self.gemv_max;
        let invariant = self.invariant;
        let Self {
            tp,
            gpu: g,
            lt,
            gemv,
            s,
            w,
            k_cache,
            v_cache,
            block_size,
            prof,
            dattn,
            pattn,
            plan_decode,
            plan_prefill,
            ..
        } = self;
        // The small path's fused decode GEMVs over `m` tokens (see `gemv.rs` for the kinds).
        let gv = |kind: gemv::GemvKind,
                  m: usize,
                  y: u64,
                  wp: u64,
                  x: u64,
                  gain: u64,
                  out: usize,
                  inp: usize,
                  rope: &gemv::RopeArgs| {
            let gemv = gemv.as_ref().ok_or_else(|| BackendError::Device("decode GEMVs not built".into()))?;
            gemv.launch(g, kind, m, y, wp, x, gain, out, inp, d.eps, rope)
        };
        let mut matmul = |g: &Gpu, y: u64, x: u64, wp: u64, shape: GemmShape, f32_out: bool| {
            if invariant {
                lt.matmul(g, y, x, wp, shape, f32_out)
            } else {
                lt.matmul_heuristic(g, y, x, wp, shape, f32_out)
            }
        };
        let mut mark = |name: &'static str| -> Result<(), BackendError> {
            if let Some(p) = prof.as_mut() {
                let e = g
                    .stream
                    .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(|e| device::dev_err("event", e))?;
                p.push((name, e));
            }
            Ok(())
        };
        let st = &g.stream;
        let launch_err = |name: &'static str| move |e| device::dev_err(name, e);
        let h = d.hidden as i32;
        let null = 0u64;
        {
            let mut b = st.launch_builder(&g.k.embed_gather);
            b.arg(&s.x.ptr).arg(&w.embed).arg(&ids).arg(&h);
            // SAFETY: x holds n × hidden f32; ids are validated < vocab.
            unsafe { b.launch(per_row(n, 256)) }.map_err(launch_err("embed_gather"))?;
        }
        mark("embed")?;
        let norm_threads = if d.hidden >= 2048 { 1024 } else { 256 };
        let (qh, kvh, hd, bs) = (d.q_heads as i32, d.kv_heads as i32, d.head_dim as i32, *block_size as i32);
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let group = d.q_heads / d.kv_heads;
        let attn_fn = &g.k.attention[usize::from(d.head_dim == 128) * 4 + group.trailing_zeros() as usize];
        let (n_i, inter) = (n as i32, d.inter as i32);
        // Tokens per attention launch so that their partials fit (all of them with one chunk).
        let per_launch =
            if chunks == 1 { n } else { (s.part_cap / (chunks * d.q_heads * (d.head_dim + 2))).clamp(1, n) };
        let chunks_i = chunks as i32;
        for (li, lw) in w.layers.iter().enumerate() {
            let (kc, vc) = (k_cache[li].ptr, v_cache[li].ptr);
            if small {
                let rope = gemv::RopeArgs {
                    pos,
                    slots,
                    inv_freq: s.inv_freq.ptr,
                    k_cache: kc,
                    v_cache: vc,
                    q_heads: qh,
                    kv_heads: kvh,
                    head_dim: hd,
                };
                gv(
                    gemv::GemvKind::QkvRope,
                    n,
                    s.qkv.ptr,
                    lw.qkv,
                    s.x.ptr,
                    lw.input_norm,
                    d.qkv_dim(),
                    d.hidden,
                    &rope,
                )?;
                mark("gemv_qkv_rope_kv")?;
            } else {
                // Residual add of the previous layer's down_proj output fused with this norm.
                let delta = if li == 0 { null } else { s.proj.ptr };
                add_rmsnorm(g, s.x.ptr, delta, lw.input_norm, s.hn.ptr, null, n, d, norm_threads)
                    .map_err(|e| device::dev_err("add_rmsnorm", e))?;
                mark("add_rmsnorm")?;
                matmul(g, s.qkv.ptr, s.hn.ptr, lw.qkv, GemmShape { n, out: d.qkv_dim(), inp: d.hidden }, false)?;
                mark("gemm_qkv")?;
                let mut b = st.launch_builder(&g.k.rope_kv_write);
                b.arg(&s.qkv.ptr)
                    .arg(&pos)
                    .arg(&slots)
                    .arg(&s.inv_freq.ptr)
                    .arg(&kc)
                    .arg(&vc)
                    .arg(&qh)
                    .arg(&kvh)
                    .arg(&hd);
                // SAFETY: slots validated < num_blocks · block_size (u32::MAX = padding, skipped).
                unsafe { b.launch(per_row(n, 128)) }.map_err(launch_err("rope_kv_write"))?;
                mark("rope_kv_write")?;
            }
            if let (Some(da), Some(pa)) = (dattn.as_ref(), pattn.as_mut()) {
                let (qd, qkvd) = ((d.q_dim() * 2) as u64, (d.qkv_dim() * 2) as u64);
                for &(t0, cnt) in plan_decode.iter() {
                    let t = t0 as u64;
                    let args = attn_decode::DecodeArgs {
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
                        block_size: *block_size,
                        scale,
                    };
                    da.launch(g, &args)?;
                    mark("attn_decode")?;
                }
                if !plan_prefill.is_empty() {
                    let ptrs =
                        attn_prefill::PrefillPtrs { out: s.attn.ptr, qkv: s.qkv.ptr, k_cache: kc, v_cache: vc, bts };
                    let dims = attn_prefill::PrefillDims {
                        q_heads: d.q_heads,
                        kv_heads: d.kv_heads,
                        head_dim: d.head_dim,
                        block_size: *block_size,
                    };
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
                b.arg(&qh).arg(&kvh).arg(&bs).arg(&scale).arg(&t0_i);
                let cfg = LaunchConfig {
                    grid_dim: (cnt as u32, d.kv_heads as u32, chunks as u32),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: block tables validated to cover each position with valid block ids;
                // `part` holds cnt × q_heads × chunks × (head_dim + 2) f32 (per_launch above).
                unsafe { b.launch(cfg) }.map_err(launch_err("paged_attention"))?;
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
                    unsafe { b.launch(cfg) }.map_err(launch_err("attn_combine"))?;
                    mark("attn_combine")?;
                }
                t0 += cnt;
            }
            if small {
                let none = gemv::RopeArgs::default();
                gv(gemv::GemvKind::Residual, n, s.x.ptr, lw.o_proj, s.attn.ptr, null, d.hidden, d.q_dim(), &none)?;
                mark("gemv_o_proj")?;
                gv(
                    gemv::GemvKind::NormGateUpSilu,
                    n,
                    s.act.ptr,
                    lw.gate_up,
                    s.x.ptr,
                    lw.post_norm,
                    d.inter,
                    d.hidden,
                    &none,
                )?;
                mark("gemv_gate_up_silu")?;
                gv(gemv::GemvKind::Residual, n, s.x.ptr, lw.down, s.act.ptr, null, d.hidden, d.inter, &none)?;
                mark("gemv_down")?;
                continue;
            }
            matmul(g, s.proj.ptr, s.attn.ptr, lw.o_proj, GemmShape { n, out: d.hidden, inp: d.q_dim() }, false)?;
            mark("gemm_o_proj")?;
            if let Some(t) = tp.as_ref() {
                // Row-parallel o_proj: each shard holds a partial sum.
                t.all_reduce_bf16(g, s.proj.ptr, n * d.hidden)?;
                mark("all_reduce")?;
            }
            add_rmsnorm(g, s.x.ptr, s.proj.ptr, lw.post_norm, s.hn.ptr, null, n, d, norm_threads)
                .map_err(|e| device::dev_err("add_rmsnorm", e))?;
            mark("add_rmsnorm")?;
            matmul(g, s.gu.ptr, s.hn.ptr, lw.gate_up, GemmShape { n, out: 2 * d.inter, inp: d.hidden }, false)?;
            mark("gemm_gate_up")?;
            let mut b = st.launch_builder(&g.k.silu_mul);
            b.arg(&s.act.ptr).arg(&s.gu.ptr).arg(&n_i).arg(&inter);
            // SAFETY: gu holds n × 2·inter, act n × inter.
            unsafe { b.launch(device::grid_stride(n * d.inter)) }.map_err(launch_err("silu_mul"))?;
            mark("silu_mul")?;
            matmul(g, s.proj.ptr, s.act.ptr, lw.down, GemmShape { n, out: d.hidden, inp: d.inter }, false)?;
            mark("gemm_down")?;
            if let Some(t) = tp.as_ref() {
                t.all_reduce_bf16(g, s.proj.ptr, n * d.hidden)?;
                mark("all_reduce")?;
            }
        }
        // Tensor parallelism: rank 0 computes the logits (lm_head is replicated).
        if rows > 0 && tp.as_ref().is_none_or(|t| t.rank == 0) {
            // Last residual add (already done by the small path's down GEMV) + final norm,
            // only for the rows that want logits.
            let delta = if small { null } else { s.proj.ptr };
            add_rmsnorm(g, s.x.ptr, delta, w.norm, s.hn.ptr, rows_ptr, rows, d, norm_threads)
                .map_err(|e| device::dev_err("final_norm", e))?;
            mark("final_norm")?;
            if small {
                gv(
                    gemv::GemvKind::LogitsF32,
                    rows,
                    s.logits.ptr,
                    w.lm_head,
                    s.hn.ptr,
                    null,
                    d.vocab,
                    d.hidden,
                    &gemv::RopeArgs::default(),
                )?;
            } else {
                matmul(g, s.logits.ptr, s.hn.ptr, w.lm_head, GemmShape { n: rows, out: d.vocab, inp: d.hidden }, true)?;
            }
            mark("lm_head")?;
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits, BackendError> {
        let rows = self.run(batch)?;
        let mut data = vec![0f32; rows * self.d.vocab];
        if rows > 0 {
            self.gpu.download(&mut data, self.s.logits.ptr)?;
        } else {
            self.gpu.sync()?;
        }
        Ok(Logits { rows, vocab_size: self.d.vocab, data })
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
            self.gpu.sync()?;
        }
        Ok(ids)
    }

    fn num_kv_blocks(&self) -> usize {
        self.num_blocks
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.d.layers * 2 * self.d.kv_dim() * 2
    }

    fn name(&self) -> &'static str {
        "cuda"
    }
}
