//! Engine configuration (vLLM's knob names) and [`EngineHandle::start`]: load the model,
//! build the backend, start the step thread. The flags and deployment-file keys that set
//! these knobs live in `prism_common::engine_flags`; the worker's launcher maps the
//! protocol's `EngineConfig` onto [`EngineConfig`], taking the defaults from here.
//!
//! Per-backend defaults live in one place, [`BackendKind`]: the step token budget
//! (`max_num_batched_tokens`) and the size of the replica's compute pool.

use super::backend::cpu::AllReduce;
use super::backend::{Backend, BackendError, StepControl};
use super::codec::ModelCodec;
use super::handle::{EngineHandle, EngineParts, RuntimeConfig};
use super::model::{self, ModelSource, ProgressFn};
use super::parallel::ParallelSizes;
use super::parallel::driver::{DriverModel, ParallelBackend, ParallelConfig, rank_kv_budget};
use super::parallel::stage::{InitSpec, StageBackendKind};
use super::request::EngineError;
pub use crate::dtypes::{KvCacheDtype, Quantization};
use std::path::PathBuf;
use std::sync::Arc;

/// Default CPU KV-cache budget: 1 GiB (about 23k tokens of SmolLM2-135M).
pub const DEFAULT_KV_CACHE_BYTES: u64 = super::backend::cpu::DEFAULT_KV_CACHE_BYTES;

/// CPU default of `max_num_batched_tokens`: small prefill chunks keep each step short
/// (Sarathi-Serve's point: decodes keep flowing between chunks, and no single step runs
/// long enough on a loaded CPU to look like a stall). A 512-token chunk of SmolLM2-135M is
/// about 2-4 s on 2 cores; 2048 was 4× that and starved everything else on the node.
pub const CPU_MAX_NUM_BATCHED_TOKENS: usize = 512;
/// GPU default of `max_num_batched_tokens` (vLLM's chunked-prefill default for online
/// serving is of this order; a 2048-token step takes milliseconds on a GPU).
pub const CUDA_MAX_NUM_BATCHED_TOKENS: usize = 2048;
/// Compute threads of a CUDA replica's pool (host-side work only: sampling, copies).
pub const CUDA_ENGINE_THREADS: usize = 2;

/// Which backend runs the model.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum BackendKind {
    /// f32 reference on all CPU cores.
    #[default]
    Cpu,
    /// CUDA on these device ordinals (rank 0 first).
    Cuda {
        /// GPU ordinals, one per tensor-parallel rank.
        devices: Vec<u32>,
    },
}

impl BackendKind {
    /// The step token budget used when the deployment does not set one:
    /// [`CPU_MAX_NUM_BATCHED_TOKENS`] or [`CUDA_MAX_NUM_BATCHED_TOKENS`].
    pub fn default_max_num_batched_tokens(&self) -> usize {
        match self {
            Self::Cpu => CPU_MAX_NUM_BATCHED_TOKENS,
            Self::Cuda { .. } => CUDA_MAX_NUM_BATCHED_TOKENS,
        }
    }

    /// Threads of a replica's compute pool when not set: every core for the CPU backend
    /// (the matrix products run there), [`CUDA_ENGINE_THREADS`] for CUDA.
    pub fn default_engine_threads(&self) -> usize {
        match self {
            Self::Cpu => std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get),
            Self::Cuda { .. } => CUDA_ENGINE_THREADS,
        }
    }
}

/// Everything needed to start one engine replica.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// GGUF file or Hugging Face directory.
    pub model: PathBuf,
    /// Name clients use for the model.
    pub served_model_name: String,
    /// Context window; `None` = the model's own.
    pub max_model_len: Option<usize>,
    /// KV-cache block size in tokens.
    pub block_size: usize,
    /// Most sequences running at once.
    pub max_num_seqs: usize,
    /// Most tokens per step. [`EngineConfig::new`] sets the CPU default; callers that pick
    /// another backend and have no explicit value use [`BackendKind::default_max_num_batched_tokens`].
    pub max_num_batched_tokens: usize,
    /// Threads of this replica's own compute pool; `None` = [`BackendKind::default_engine_threads`].
    pub engine_threads: Option<usize>,
    /// KV-cache budget in bytes. CPU: `None` = [`DEFAULT_KV_CACHE_BYTES`]; CUDA: `None` =
    /// sized from `gpu_memory_utilization` after the weights are loaded.
    pub kv_cache_bytes: Option<u64>,
    /// Fraction of the GPU's memory a CUDA replica may use (vLLM's knob; default 0.9).
    pub gpu_memory_utilization: f32,
    /// Backend.
    pub backend: BackendKind,
    /// CUDA: batch-invariant (deterministic) kernels; see `CudaOptions::batch_invariant`.
    pub batch_invariant: bool,
    /// Most unfinished requests before `submit` answers `Overloaded`.
    pub max_pending_requests: usize,
    /// Automatic prefix caching (on by default, as in vLLM).
    pub enable_prefix_caching: bool,
    /// Parse special-token text inside chat messages (the opt-out; off: only the template makes special tokens).
    pub chat_content_special_tokens: bool,
    /// Tensor/pipeline parallelism and where the ranks run (default: one rank, in-process).
    pub parallel: super::parallel::ParallelConfig,
    /// CUDA (one rank): weight format of the decoder layers (vLLM's `--quantization`).
    pub quantization: Quantization,
    /// CUDA (one rank): KV-cache element type (vLLM's `--kv-cache-dtype`).
    pub kv_cache_dtype: KvCacheDtype,
}

impl EngineConfig {
    /// Defaults: block 16, 256 sequences (vLLM's), CPU backend with its token budget
    /// ([`CPU_MAX_NUM_BATCHED_TOKENS`]), a compute pool of every core.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        let rt = RuntimeConfig::default();
        let backend = BackendKind::Cpu;
        Self {
            model: model.into(),
            served_model_name: rt.served_model_name,
            max_model_len: None,
            block_size: 16,
            max_num_seqs: rt.max_num_seqs,
            max_num_batched_tokens: backend.default_max_num_batched_tokens(),
            engine_threads: None,
            kv_cache_bytes: None,
            gpu_memory_utilization: 0.9,
            backend,
            batch_invariant: false,
            max_pending_requests: rt.max_pending_requests,
            enable_prefix_caching: rt.enable_prefix_caching,
            chat_content_special_tokens: rt.chat_content_special_tokens,
            quantization: Quantization::None,
            kv_cache_dtype: KvCacheDtype::Bf16,
            parallel: super::parallel::ParallelConfig::default(),
        }
    }

    fn runtime(&self) -> RuntimeConfig {
        RuntimeConfig {
            served_model_name: self.served_model_name.clone(),
            max_model_len: self.max_model_len,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            max_pending_requests: self.max_pending_requests,
            engine_threads: Some(self.engine_threads.unwrap_or_else(|| self.backend.default_engine_threads())),
            enable_prefix_caching: self.enable_prefix_caching,
            chat_content_special_tokens: self.chat_content_special_tokens,
            // The model's identity for block hashes: its path as configured (a redeploy of
            // another checkpoint under the same served name gets other hashes).
            cache_namespace: super::kv_cache::prefix_hash::fingerprint(self.model.as_os_str().as_encoded_bytes()),
            ..RuntimeConfig::default()
        }
    }
}

impl EngineHandle {
    /// Loads the model (blocking: call from `spawn_blocking` or a plain thread), builds
    /// the backend with its KV cache and starts the step thread.
    ///
    /// # Errors
    /// `InvalidRequest` (field `model`) for a missing path, `Internal` for a model that
    /// cannot be loaded or a backend that is not available.
    pub fn start(cfg: EngineConfig, progress: Option<ProgressFn<'_>>) -> Result<Self, EngineError> {
        if cfg.block_size == 0 {
            return Err(EngineError::InvalidRequest { field: "block_size", message: "block_size must be >= 1".into() });
        }
        let source = ModelSource::detect(&cfg.model)?;
        let parallel = effective_parallel(&cfg);
        check_number_formats(&cfg, &parallel)?;
        if !parallel.sizes.is_single() || !parallel.rank0_in_process {
            return start_parallel(&cfg, &parallel, &source, progress);
        }
        // A CUDA replica of a Hugging Face checkpoint uploads the tensors straight from the
        // mmapped files (no f32 copy of the model on the host).
        #[cfg(feature = "cuda")]
        if let (BackendKind::Cuda { devices }, ModelSource::HfDir(dir)) = (&cfg.backend, &source)
            && devices.len() <= 1
        {
            let m = model::safetensors::open_dir_model(dir)?;
            let noop = |_: u64, _: u64| {};
            let backend = super::backend::cuda::CudaBackend::from_safetensors(
                &m.files,
                &m.config,
                &cuda_options(&cfg, devices),
                progress.unwrap_or(&noop),
            )?;
            let parts = EngineParts {
                backend: Box::new(backend),
                eos_ids: m.config.eos_token_ids.clone(),
                model_max_len: m.config.max_position_embeddings,
                codec: Arc::new(ModelCodec { tokenizer: m.tokenizer, chat_template: m.chat_template }),
                control: StepControl::default(),
            };
            return Self::start_with_parts(parts, cfg.runtime());
        }
        // The CPU backend reads GGUF blocks directly; other backends take f32.
        let options = model::LoadOptions { keep_quantized: matches!(cfg.backend, BackendKind::Cpu) };
        let loaded = model::load_model_with(&source, progress, options)?;
        let model_max_len = loaded.config.max_position_embeddings;
        let eos_ids = loaded.config.eos_token_ids.clone();
        let kv_bytes = cfg.kv_cache_bytes.unwrap_or(DEFAULT_KV_CACHE_BYTES);
        let control = StepControl::default();
        let backend: Box<dyn Backend> = match &cfg.backend {
            BackendKind::Cpu => Box::new(
                super::backend::cpu::CpuBackend::new(loaded.weights, &loaded.config, kv_bytes, cfg.block_size)?
                    .with_all_reduce(Box::new(LayerCheckpoint(control.clone()))),
            ),
            #[cfg(feature = "cuda")]
            BackendKind::Cuda { devices } => Box::new(super::backend::cuda::CudaBackend::new(
                loaded.weights,
                &loaded.config,
                &cuda_options(&cfg, devices),
            )?),
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda { .. } => {
                return Err(EngineError::Internal("the CUDA backend is not built into this worker".into()));
            }
        };
        let codec = Arc::new(ModelCodec { tokenizer: loaded.tokenizer, chat_template: loaded.chat_template });
        let parts = EngineParts { backend, codec, eos_ids, model_max_len, control };
        Self::start_with_parts(parts, cfg.runtime())
    }
}

/// `--quantization fp8` and `--kv-cache-dtype fp8` are built for one-GPU CUDA replicas: refuses
/// them elsewhere instead of serving bf16 while the deployment says FP8 (vLLM likewise refuses
/// FP8 on its CPU backend). FP8 checkpoints are not affected: they load on every backend
/// (dequantized where FP8 kernels are missing).
fn check_number_formats(cfg: &EngineConfig, parallel: &ParallelConfig) -> Result<(), EngineError> {
    let one_gpu = matches!(&cfg.backend, BackendKind::Cuda { devices } if devices.len() <= 1)
        && parallel.sizes.is_single()
        && parallel.rank0_in_process;
    let (field, asked, hint) = if cfg.quantization != Quantization::None {
        ("quantization", "quantization fp8", " FP8 checkpoints load on every backend without it.")
    } else if cfg.kv_cache_dtype != KvCacheDtype::Bf16 {
        ("kv_cache_dtype", "kv_cache_dtype fp8", " Leave it at auto (bf16) here.")
    } else {
        return Ok(());
    };
    if one_gpu {
        return Ok(());
    }
    let replica = match &cfg.backend {
        BackendKind::Cpu => "the CPU backend".to_owned(),
        BackendKind::Cuda { .. } => format!(
            "a parallel CUDA replica (tensor_parallel_size {}, pipeline_parallel_size {})",
            parallel.sizes.tensor_parallel_size, parallel.sizes.pipeline_parallel_size
        ),
    };
    Err(EngineError::InvalidRequest {
        field,
        message: format!("{asked} needs a one-GPU CUDA replica; this one runs on {replica}.{hint}"),
    })
}

/// The replica's rank layout: `cfg.parallel`, except that a CUDA replica given several
/// devices with single sizes is tensor-parallel over them (`tensor_parallel_size` = the
/// number of devices, every rank on this node), as a GPU group has always meant.
fn effective_parallel(cfg: &EngineConfig) -> ParallelConfig {
    let mut par = cfg.parallel.clone();
    if let BackendKind::Cuda { devices } = &cfg.backend
        && devices.len() > 1
        && par.sizes.is_single()
    {
        par.sizes = ParallelSizes::new(devices.len(), 1);
        par.local_ranks = (0..devices.len()).collect();
    }
    par
}

/// A replica of several ranks ([`ParallelBackend`]): reads the model's architecture and
/// tokenizer (for a CPU replica the whole model, whose weights rank 0 then shards in this
/// process), checks the split against the model, and starts the rank group. The CPU KV
/// budget `kv_cache_bytes` is the replica's total ([`rank_kv_budget`]: as many blocks as the
/// unsharded replica); the compute cores are split among this node's ranks.
fn start_parallel(
    cfg: &EngineConfig,
    par: &ParallelConfig,
    source: &ModelSource,
    progress: Option<ProgressFn<'_>>,
) -> Result<EngineHandle, EngineError> {
    let (kind, devices) = match &cfg.backend {
        BackendKind::Cpu => (StageBackendKind::Cpu, Vec::new()),
        BackendKind::Cuda { devices } => (StageBackendKind::Cuda, devices.clone()),
    };
    let (config, codec, weights) = match (kind, source) {
        (StageBackendKind::Cuda, ModelSource::HfDir(dir)) => {
            let m = model::safetensors::open_dir_model(dir)?;
            (m.config, ModelCodec { tokenizer: m.tokenizer, chat_template: m.chat_template }, None)
        }
        _ => {
            let loaded = model::load_model_with(source, progress, model::LoadOptions { keep_quantized: true })?;
            let keep = kind == StageBackendKind::Cpu && par.rank0_in_process;
            let codec = ModelCodec { tokenizer: loaded.tokenizer, chat_template: loaded.chat_template };
            (loaded.config, codec, keep.then_some(loaded.weights))
        }
    };
    par.sizes.validate(&config)?;
    let kv_cache_bytes = match kind {
        StageBackendKind::Cpu => Some(rank_kv_budget(
            cfg.kv_cache_bytes.unwrap_or(DEFAULT_KV_CACHE_BYTES),
            &config,
            par.sizes,
            cfg.block_size,
        )),
        StageBackendKind::Cuda => cfg.kv_cache_bytes,
    };
    let threads = cfg.engine_threads.filter(|n| *n > 0).unwrap_or_else(|| cfg.backend.default_engine_threads());
    let init = InitSpec {
        model: cfg.model.clone(),
        backend: kind,
        sizes: par.sizes,
        block_size: cfg.block_size,
        kv_cache_bytes,
        gpu_memory_utilization: cfg.gpu_memory_utilization,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        max_num_seqs: cfg.max_num_seqs,
        batch_invariant: cfg.batch_invariant,
        mesh: Vec::new(),
        collective_timeout_ms: u64::try_from(par.collective_timeout.as_millis()).unwrap_or(u64::MAX),
        nccl_unique_id: None,
        engine_threads: Some(threads),
        host_collectives: par.host_collectives,
    };
    let control = StepControl::default();
    let (eos_ids, model_max_len) = (config.eos_token_ids.clone(), config.max_position_embeddings);
    let driver_model = DriverModel { config, weights, devices };
    let backend = ParallelBackend::start_with_model(par, init, control.clone(), driver_model)
        .map_err(|e| EngineError::Internal(format!("parallel replica: {e}")))?;
    let mut runtime = cfg.runtime();
    // Rank 0 computes in this process on its share of the cores; a driver without a stage
    // only schedules.
    let share = if par.rank0_in_process { (threads / par.local_ranks.len().max(1)).max(1) } else { 1 };
    runtime.engine_threads = Some(share);
    let parts = EngineParts { backend: Box::new(backend), codec: Arc::new(codec), eos_ids, model_max_len, control };
    EngineHandle::start_with_parts(parts, runtime)
}

/// The CUDA backend's options for a replica on `devices` (the first one: one shard).
#[cfg(feature = "cuda")]
fn cuda_options(cfg: &EngineConfig, devices: &[u32]) -> super::backend::cuda::CudaOptions {
    super::backend::cuda::CudaOptions {
        device: devices.first().copied().unwrap_or(0) as usize,
        block_size: cfg.block_size,
        kv_cache_bytes: cfg.kv_cache_bytes,
        gpu_memory_utilization: cfg.gpu_memory_utilization,
        max_num_batched_tokens: cfg.max_num_batched_tokens,
        max_num_seqs: cfg.max_num_seqs,
        batch_invariant: cfg.batch_invariant,
        quantization: cfg.quantization,
        kv_cache_dtype: cfg.kv_cache_dtype,
        ..Default::default()
    }
}

/// The CPU backend's per-layer hook: it calls its all-reduce after o_proj and after
/// down_proj of every layer. A single-shard replica has nothing to sum, so this "all-reduce"
/// is the identity that checks the replica's [`StepControl`]: it records progress and stops
/// the forward pass ([`BackendError::Cancelled`]) when the engine is stopping. (A
/// tensor-parallel CPU replica would wrap its real all-reduce the same way.)
struct LayerCheckpoint(StepControl);

impl AllReduce for LayerCheckpoint {
    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<(), BackendError> {
        self.0.checkpoint()
    }
}
