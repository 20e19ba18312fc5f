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
//! The KV cache is preallocated after the weights and the step scratch from
//! `gpu_memory_utilization` (vLLM's rule: `total · utilization − in use`) unless an explicit
//! byte budget is given; its capacity in tokens is logged.
//!
//! Not here yet: CUDA graphs for decode buckets, tensor parallelism (NCCL), and
//! tensor-core attention for long prefills.

pub mod device;
mod weights;

use device::{DevBuf, GemmShape, Gpu, per_row};

use super::{Backend, BackendError, Logits, StepBatch};
use crate::engine::EngineError;
use crate::engine::model::{LlamaWeights, ModelConfig};
use cudarc::driver::{LaunchConfig, PushKernelArg};
pub use device::cuda_available;
pub use weights::SyntheticShape;
use weights::DeviceWeights;

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
    /// f32 split-context attention partials (`[n, q_heads, splits, head_dim + 2]`).
    part: DevBuf,
    /// Capacity of `part` in f32 values.
    part_cap: usize,
    /// f32 `[head_dim / 2]` RoPE inverse frequencies.
    inv_freq: DevBuf,
    host_meta: Vec<u32>,
}

/// bf16 Llama on one CUDA device with a paged KV cache.
pub struct CudaBackend {
    gpu: Gpu,
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

/// Split-context attention is used while `tokens × kv_heads × splits` stays under this many
/// blocks (two waves on a 132-SM H200); partial buffers are sized for it.
const SPLIT_TARGET_BLOCKS: usize = 264;
/// Token-splits the partial buffer holds (`tokens × splits`).
const PART_ROWS: usize = 2 * SPLIT_TARGET_BLOCKS;

/// Context splits for attention: enough blocks to fill the GPU when few tokens are in the
/// step, each split at least 64 positions, at most 32.
fn attn_splits(n: usize, kv_heads: usize, max_ctx: usize) -> usize {
    let blocks = n * kv_heads;
    if blocks >= SPLIT_TARGET_BLOCKS {
        return 1;
    }
    SPLIT_TARGET_BLOCKS.div_ceil(blocks).min(max_ctx.div_ceil(64)).clamp(1, 32)
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
        let group_ok = d.kv_heads > 0 && d.q_heads % d.kv_heads == 0 && matches!(d.q_heads / d.kv_heads, 1 | 2 | 4 | 8);
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
            part: alloc(PART_ROWS * d.q_heads * (d.head_dim + 2) * 4)?,
            part_cap: PART_ROWS * d.q_heads * (d.head_dim + 2),
            inv_freq: alloc(inv_freq.len() * 4)?,
            host_meta: Vec::new(),
        };
        gpu.upload(&s.inv_freq, 0, inv_freq).map_err(engine_err)?;
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
                message: format!("KV budget {budget} B holds no block of {} tokens ({per_token} B/token)", opts.block_size),
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
        Ok(Self { gpu, d, w, s, block_size: opts.block_size, num_blocks, k_cache, v_cache })
    }

    /// Device name (e.g. "NVIDIA H200").
    pub fn device_name(&self) -> &str {
        &self.gpu.name
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
        let slots = self.num_blocks * self.block_size;
        if let Some(&id) = b.token_ids.iter().find(|&&id| id as usize >= self.d.vocab) {
            return Err(invalid(format!("token id {id} >= vocab {}", self.d.vocab)));
        }
        if b.slot_mapping.iter().any(|&s| s as usize >= slots) {
            return Err(invalid("slot out of range"));
        }
        let mut next = 0;
        let mut rows = 0;
        for s in &b.seqs {
            if s.query_start != next || s.query_len == 0 || s.query_len > s.context_len {
                return Err(invalid("sequences must tile the batch in order with query_len in 1..=context_len"));
            }
            next += s.query_len;
            if next > n || s.block_table.len() * self.block_size < s.context_len {
                return Err(invalid("block table does not cover context_len"));
            }
            if s.block_table.iter().any(|&blk| blk as usize >= self.num_blocks) {
                return Err(invalid("block id out of range"));
            }
            for i in 0..s.query_len {
                if b.positions[s.query_start + i] as usize != s.context_len - s.query_len + i {
                    return Err(invalid("positions must be context_len - query_len + i"));
                }
            }
            rows += usize::from(s.want_logits);
        }
        if next != n {
            return Err(invalid("sequences do not cover every token"));
        }
        if rows > self.s.max_rows {
            return Err(invalid(format!("{rows} logit rows > max_num_seqs {}", self.s.max_rows)));
        }
        Ok(())
    }

    /// Uploads the step metadata; returns device addresses of (ids, pos, slots, tok_bt,
    /// rows, bts) and the number of logit rows.
    fn upload_meta(&mut self, b: &StepBatch) -> Result<([u64; 6], usize), BackendError> {
        let n = b.token_ids.len();
        let m = &mut self.s.host_meta;
        m.clear();
        m.extend_from_slice(&b.token_ids);
        m.extend_from_slice(&b.positions);
        m.extend_from_slice(&b.slot_mapping);
        let mut bt_off = 0u32;
        for s in &b.seqs {
            m.extend(std::iter::repeat_n(bt_off, s.query_len));
            bt_off += s.block_table.len() as u32;
        }
        let rows_at = m.len();
        m.extend(b.seqs.iter().filter(|s| s.want_logits).map(|s| (s.query_start + s.query_len - 1) as u32));
        let rows = m.len() - rows_at;
        let bts_at = m.len();
        for s in &b.seqs {
            m.extend_from_slice(&s.block_table);
        }
        let need = m.len() * 4;
        if need > self.s.meta.bytes {
            self.gpu.sync()?;
            self.s.meta = DevBuf::zeroed(&self.gpu, need * 2)?;
        }
        self.gpu.upload(&self.s.meta, 0, &self.s.host_meta)?;
        let base = self.s.meta.ptr;
        let at = |i: usize| base + (i * 4) as u64;
        Ok(([at(0), at(n), at(2 * n), at(3 * n), at(rows_at), at(bts_at)], rows))
    }

    /// Runs the layers and the lm_head into `s.logits` (rows × vocab f32); returns rows.
    fn run(&mut self, batch: &StepBatch) -> Result<usize, BackendError> {
        self.validate(batch)?;
        self.gpu.bind()?;
        let n = batch.token_ids.len();
        let ([ids, pos, slots, tok_bt, rows_ptr, bts], rows) = self.upload_meta(batch)?;
        let d = self.d;
        let (g, s) = (&self.gpu, &self.s);
        let st = &g.stream;
        let launch_err = |name: &'static str| move |e| device::dev_err(name, e);
        let (h, eps) = (d.hidden as i32, d.eps);
        let null = 0u64;
        {
            let mut b = st.launch_builder(&g.k.embed_gather);
            b.arg(&s.x.ptr).arg(&self.w.embed).arg(&ids).arg(&h);
            // SAFETY: x holds n × hidden f32; ids are validated < vocab.
            unsafe { b.launch(per_row(n, 256)) }.map_err(launch_err("embed_gather"))?;
        }
        let norm_threads = if d.hidden >= 2048 { 1024 } else { 256 };
        let (qh, kvh, hd, bs) = (d.q_heads as i32, d.kv_heads as i32, d.head_dim as i32, self.block_size as i32);
        let scale = 1.0 / (d.head_dim as f32).sqrt();
        let group = d.q_heads / d.kv_heads;
        let attn_fn = &g.k.attention[usize::from(d.head_dim == 128) * 4 + group.trailing_zeros() as usize];
        let (n_i, inter) = (n as i32, d.inter as i32);
        let max_ctx = batch.seqs.iter().map(|q| q.context_len).max().unwrap_or(1);
        let mut splits = attn_splits(n, d.kv_heads, max_ctx);
        if n * d.q_heads * splits * (d.head_dim + 2) > s.part_cap {
            splits = 1;
        }
        let splits_i = splits as i32;
        for (li, lw) in self.w.layers.iter().enumerate() {
            // Residual add of the previous layer's down_proj output fused with this norm.
            let delta = if li == 0 { null } else { s.proj.ptr };
            let mut b = st.launch_builder(&g.k.add_rmsnorm);
            b.arg(&s.x.ptr).arg(&delta).arg(&lw.input_norm).arg(&s.hn.ptr).arg(&null).arg(&h).arg(&eps);
            // SAFETY: all buffers hold n rows of hidden.
            unsafe { b.launch(per_row(n, norm_threads)) }.map_err(launch_err("add_rmsnorm"))?;
            g.gemm(s.qkv.ptr, s.hn.ptr, lw.qkv, GemmShape { n, out: d.qkv_dim(), inp: d.hidden }, false)?;
            let (kc, vc) = (self.k_cache[li].ptr, self.v_cache[li].ptr);
            let mut b = st.launch_builder(&g.k.rope_kv_write);
            b.arg(&s.qkv.ptr).arg(&pos).arg(&slots).arg(&s.inv_freq.ptr).arg(&kc).arg(&vc).arg(&qh).arg(&kvh).arg(&hd);
            // SAFETY: slots validated < num_blocks · block_size.
            unsafe { b.launch(per_row(n, 128)) }.map_err(launch_err("rope_kv_write"))?;
            let mut b = st.launch_builder(attn_fn);
            b.arg(&s.attn.ptr).arg(&s.part.ptr).arg(&s.qkv.ptr).arg(&kc).arg(&vc).arg(&pos).arg(&tok_bt).arg(&bts);
            b.arg(&qh).arg(&kvh).arg(&bs).arg(&scale);
            let grid = (n as u32, d.kv_heads as u32, splits as u32);
            let cfg = LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: block tables validated to cover each position with valid block ids;
            // `part` holds n × q_heads × splits × (head_dim + 2) f32 (checked below).
            unsafe { b.launch(cfg) }.map_err(launch_err("paged_attention"))?;
            if splits > 1 {
                let mut b = st.launch_builder(&g.k.attn_combine);
                b.arg(&s.attn.ptr).arg(&s.part.ptr).arg(&qh).arg(&hd).arg(&splits_i);
                let cfg = LaunchConfig { grid_dim: (n as u32, d.q_heads as u32, 1), block_dim: (d.head_dim as u32, 1, 1), shared_mem_bytes: 0 };
                // SAFETY: as above.
                unsafe { b.launch(cfg) }.map_err(launch_err("attn_combine"))?;
            }
            g.gemm(s.proj.ptr, s.attn.ptr, lw.o_proj, GemmShape { n, out: d.hidden, inp: d.q_dim() }, false)?;
            let mut b = st.launch_builder(&g.k.add_rmsnorm);
            b.arg(&s.x.ptr).arg(&s.proj.ptr).arg(&lw.post_norm).arg(&s.hn.ptr).arg(&null).arg(&h).arg(&eps);
            // SAFETY: as above.
            unsafe { b.launch(per_row(n, norm_threads)) }.map_err(launch_err("add_rmsnorm"))?;
            g.gemm(s.gu.ptr, s.hn.ptr, lw.gate_up, GemmShape { n, out: 2 * d.inter, inp: d.hidden }, false)?;
            let mut b = st.launch_builder(&g.k.silu_mul);
            b.arg(&s.act.ptr).arg(&s.gu.ptr).arg(&n_i).arg(&inter);
            // SAFETY: gu holds n × 2·inter, act n × inter.
            unsafe { b.launch(device::grid_stride(n * d.inter)) }.map_err(launch_err("silu_mul"))?;
            g.gemm(s.proj.ptr, s.act.ptr, lw.down, GemmShape { n, out: d.hidden, inp: d.inter }, false)?;
        }
        if rows > 0 {
            // Last residual add + final norm, only for the rows that want logits.
            let mut b = st.launch_builder(&g.k.add_rmsnorm);
            b.arg(&s.x.ptr).arg(&s.proj.ptr).arg(&self.w.norm).arg(&s.hn.ptr).arg(&rows_ptr).arg(&h).arg(&eps);
            // SAFETY: rows index tokens < n; hn holds at least rows × hidden.
            unsafe { b.launch(per_row(rows, norm_threads)) }.map_err(launch_err("final_norm"))?;
            g.gemm(s.logits.ptr, s.hn.ptr, self.w.lm_head, GemmShape { n: rows, out: d.vocab, inp: d.hidden }, true)?;
        }
        Ok(rows)
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
