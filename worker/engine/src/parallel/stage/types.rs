//! The stage contract shared by the driver, the rank process and every backend's stage:
//! [`StageBackend`] (one rank's part of a forward step), [`StageOutput`], [`InitSpec`] (what
//! the driver sends every rank) and [`StageContext`] (what a backend builds a stage from).
//! Backends import these from here, so the builder in `stage.rs` can call the backends
//! without an import loop.

use std::ops::Range;
use std::path::PathBuf;

use crate::backend::{BackendError, Logits, StepBatch};
use crate::parallel::comm::Communicator;
use crate::parallel::layout::{ParallelSizes, RankCoords};

/// What one micro-batch's stage produced.
#[derive(Debug)]
pub enum StageOutput {
    /// Nothing for the driver: hidden states went to the next stage, or this is a
    /// tensor-parallel rank other than 0 of the last stage.
    Forwarded,
    /// Last stage, tensor-parallel rank 0: the logit rows of the micro-batch.
    Logits(Logits),
    /// Last stage, tensor-parallel rank 0, a greedy step: the argmax per logit row.
    Greedy(Vec<u32>),
}

/// One rank's shard of its stage: owns its weights, its KV cache and its communicators
/// (tensor-parallel all-reduce inside the layers; receiving the previous stage's hidden
/// states and sending to the next stage around them).
pub trait StageBackend: Send {
    /// Runs this rank's part of one micro-batch: embeds (first stage) or receives the
    /// previous stage's `[tokens, hidden]` states, runs its layers (K/V written to the
    /// batch's slots), then sends them on (not last) or computes the logit rows (last stage;
    /// returned by tensor-parallel rank 0 only). With `greedy`, the last stage returns
    /// [`StageOutput::Greedy`] instead of logits.
    ///
    /// # Errors
    /// [`BackendError`] on device, communicator (`BackendError::Device`) or batch failures.
    fn run_stage(&mut self, batch: &StepBatch, greedy: bool) -> Result<StageOutput, BackendError>;

    /// KV-cache blocks allocated on this rank.
    fn num_kv_blocks(&self) -> usize;

    /// Tokens per block.
    fn block_size(&self) -> usize;

    /// Bytes of KV cache one token uses on this rank (its layers, its KV heads).
    fn kv_bytes_per_token(&self) -> usize;

    /// Checks a batch against this rank's cache geometry before any rank starts it.
    ///
    /// # Errors
    /// [`BackendError::InvalidBatch`] naming the first violation.
    fn validate(&self, batch: &StepBatch) -> Result<(), BackendError>;
}

/// Which backend the ranks run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum StageBackendKind {
    /// The f32 CPU backend.
    Cpu,
    /// CUDA (bf16), one device per rank.
    Cuda,
}

/// What the driver sends every rank once it has joined: the model, the cache geometry and
/// the mesh. The same for every rank except what [`StageContext`] adds.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct InitSpec {
    /// Model file or directory (the same path on every node).
    pub model: PathBuf,
    /// Backend of every rank.
    pub backend: StageBackendKind,
    /// The group's shape.
    pub sizes: ParallelSizes,
    /// KV block size in tokens.
    pub block_size: usize,
    /// This rank's KV budget in bytes (CPU; CUDA: `None` = from `gpu_memory_utilization`).
    pub kv_cache_bytes: Option<u64>,
    /// CUDA: fraction of the device's memory the rank may use.
    pub gpu_memory_utilization: f32,
    /// Step token budget (CUDA sizes scratch and graphs from it).
    pub max_num_batched_tokens: usize,
    /// Most sequences per step (CUDA graph sizes).
    pub max_num_seqs: usize,
    /// CUDA: batch-invariant kernels.
    pub batch_invariant: bool,
    /// Host-communicator listen address of every rank, indexed by rank.
    pub mesh: Vec<String>,
    /// Bound of every collective, milliseconds.
    pub collective_timeout_ms: u64,
    /// CUDA: the NCCL unique id the driver created (128 bytes), for `ncclCommInitRank`.
    pub nccl_unique_id: Option<Vec<u8>>,
    /// Threads of the rank's compute pool (`None` = every core / the backend's default).
    pub engine_threads: Option<usize>,
    /// CUDA: collectives and activations through the host communicator instead of NCCL.
    pub host_collectives: bool,
}

/// Everything a rank needs to build its [`StageBackend`].
pub struct StageContext {
    /// What the driver sent.
    pub init: InitSpec,
    /// This rank.
    pub coords: RankCoords,
    /// This stage's decoder layers.
    pub layers: Range<usize>,
    /// CUDA device ordinal of this rank (`None` on CPU).
    pub device: Option<u32>,
    /// The host mesh (CPU collectives and point-to-point; rendezvous data on CUDA).
    pub comm: Box<dyn Communicator>,
}

impl StageContext {
    /// First pipeline stage (embeds the tokens).
    pub fn is_first_stage(&self) -> bool {
        self.coords.pp_rank == 0
    }

    /// Last pipeline stage (final norm, `lm_head`).
    pub fn is_last_stage(&self) -> bool {
        self.coords.pp_rank + 1 == self.init.sizes.pipeline_parallel_size
    }

    /// Global rank of the same tensor-parallel rank in the previous stage.
    pub fn prev_stage_peer(&self) -> Option<usize> {
        (!self.is_first_stage()).then(|| self.init.sizes.rank_of(self.coords.tp_rank, self.coords.pp_rank - 1))
    }

    /// Global rank of the same tensor-parallel rank in the next stage.
    pub fn next_stage_peer(&self) -> Option<usize> {
        (!self.is_last_stage()).then(|| self.init.sizes.rank_of(self.coords.tp_rank, self.coords.pp_rank + 1))
    }
}
