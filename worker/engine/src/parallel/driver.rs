//! The driver side of a parallel replica: [`ParallelBackend`] is the `Backend` the step loop
//! drives. Rank 0 (first stage, tensor-parallel rank 0) runs in the driver's process; every
//! other rank is a process ([`super::spawn`]) that joined through the [`Rendezvous`]. Each
//! step the driver validates the batch, sends it to every rank, runs rank 0's micro-batches
//! and collects the logit rows from the last stage's tensor-parallel rank 0. A rank that
//! exits, fails its step or stalls past the collective timeout fails the step; the backend
//! then aborts the group, kills the ranks it started and refuses every later step, so the
//! engine reports the replica dead (and the agent replaces it).

use std::sync::Arc;
use std::time::Duration;

use super::layout::ParallelSizes;
use super::rank::Rendezvous;
use super::spawn::RankProgram;
use crate::backend::{Backend, BackendError, Logits, StepBatch, StepControl};

/// How a replica's ranks are laid out and started (part of `EngineConfig`).
#[derive(Clone, Debug)]
pub struct ParallelConfig {
    /// `tensor_parallel_size × pipeline_parallel_size`; 1 × 1 = today's single-process path.
    pub sizes: ParallelSizes,
    /// Global ranks on this node, rank 0 first (ranks `local_ranks[i]` use
    /// `BackendKind::Cuda.devices[i]` on CUDA). Rank 0 runs in this process; the driver
    /// starts the others as processes. Ranks not listed join from other nodes.
    pub local_ranks: Vec<usize>,
    /// Where ranks connect; `None` = bound on loopback by the driver (every rank local).
    pub rendezvous: Option<Arc<Rendezvous>>,
    /// The executable the driver starts its local ranks with.
    pub rank_program: Option<RankProgram>,
    /// Every rank joined and loaded its shard within this, or the replica fails to start.
    pub join_timeout: Duration,
    /// Bound of every collective and of each step's answer from a rank.
    pub collective_timeout: Duration,
    /// Micro-batches per step with pipeline parallelism (`None` = the number of stages).
    pub micro_batches: Option<usize>,
    /// Rank 0 runs in the driver's process (the default). `false`: rank 0 is a child process
    /// too and the driver only schedules (vLLM's multiprocessing executor); this is how the
    /// rank-process overhead of a one-rank replica is measured.
    pub rank0_in_process: bool,
    /// CUDA ranks sum and pass activations through the host communicator (staged through
    /// host memory) instead of NCCL: several ranks on one device (NCCL refuses that), tests.
    pub host_collectives: bool,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            sizes: ParallelSizes::default(),
            local_ranks: vec![0],
            rendezvous: None,
            rank_program: None,
            join_timeout: Duration::from_secs(600),
            collective_timeout: Duration::from_secs(30),
            micro_batches: None,
            rank0_in_process: true,
            host_collectives: false,
        }
    }
}

/// A replica whose ranks are processes (see the module docs).
pub struct ParallelBackend {
    sizes: ParallelSizes,
    control: StepControl,
}

impl std::fmt::Debug for ParallelBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelBackend").field("sizes", &self.sizes).finish_non_exhaustive()
    }
}

impl ParallelBackend {
    /// Starts the group: binds (or takes) the rendezvous, starts the local ranks, waits for
    /// every rank to join and load, builds rank 0's stage. `init` is the spec every rank gets
    /// (its `mesh` is filled in here).
    ///
    /// # Errors
    /// [`BackendError::Device`] naming the rank that did not join, failed to load or exited.
    pub fn start(
        cfg: &ParallelConfig,
        init: super::stage::InitSpec,
        control: StepControl,
    ) -> Result<Self, BackendError> {
        let _ = (init, &control);
        Err(BackendError::Device(format!("parallel replicas ({:?}) are not built yet", cfg.sizes)))
    }
}

impl Backend for ParallelBackend {
    fn forward(&mut self, _batch: &StepBatch) -> Result<Logits, BackendError> {
        let _ = &self.control;
        Err(BackendError::Device("not built yet".into()))
    }

    fn num_kv_blocks(&self) -> usize {
        0
    }

    fn block_size(&self) -> usize {
        16
    }

    fn kv_bytes_per_token(&self) -> usize {
        0
    }

    fn name(&self) -> &'static str {
        "parallel"
    }
}
