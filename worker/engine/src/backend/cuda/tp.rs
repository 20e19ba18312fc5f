//! Tensor parallelism on one node (Megatron-LM, Shoeybi et al. 2019): a replica's GPU group runs
//! one [`CudaBackend`] shard per GPU. q/k/v and gate/up are split by output rows (whole heads),
//! o_proj and down_proj by input columns, so each shard's o_proj / down_proj output is a partial
//! sum that an NCCL all-reduce (bf16, sum — as vLLM's `RowParallelLinear`) completes before the
//! residual add; embeddings, norms and lm_head are replicated and rank 0 computes the logits.
//! Each shard keeps the K/V cache of its own KV heads (same block ids on every rank).
//!
//! Execution: every step runs on all ranks at once, one host thread per rank (scoped threads),
//! each enqueueing its shard's whole forward pass on its own stream; the collectives meet on
//! the devices. The batch is validated on every rank before any starts, so bad input never
//! leaves a rank half-way. A rank that fails anyway (device fault, out of memory, panic) aborts
//! every communicator (`ncclCommAbort`, which releases ranks blocked in a collective) and the
//! replica refuses every later step, so the engine reports it dead instead of hanging. CUDA
//! graphs and the fused decode GEMVs are off in this mode.

use super::error::CudaError;
use super::nccl::CommGroup;
use super::options::CudaOptions;
use super::runner::CudaBackend;
use crate::backend::{Backend, BackendError, Logits, StepBatch};
use crate::model::config::ModelConfig;
use crate::model::llama::LlamaWeights;

/// A tensor-parallel CUDA replica: one shard per device of its GPU group.
pub struct CudaTpBackend {
    shards: Vec<CudaBackend>,
    /// Every rank's communicator (aborted together when a rank fails).
    comms: CommGroup,
}

impl std::fmt::Debug for CudaTpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTpBackend").field("shards", &self.shards.len()).finish()
    }
}

impl CudaTpBackend {
    /// Splits `weights` over `devices` (ranks in that order) and builds one shard per device
    /// with `opts` (its `device` field is ignored; an explicit `kv_cache_bytes` is the
    /// replica's total, split evenly over the ranks). Shards are cut and uploaded one at a
    /// time, so the host holds the f32 model plus one shard.
    ///
    /// # Errors
    /// [`CudaError::TensorParallel`] for fewer than 2 devices; [`CudaError::InvalidOption`] for
    /// `batch_invariant` with more than 2 ranks (NCCL's summation order over 3+ ranks depends on
    /// the message size, so results would depend on the batch); [`CudaError::Model`] when the
    /// group size does not divide the KV heads and the FFN size; [`CudaError`] when NCCL is
    /// missing or fails, or a shard cannot be built.
    pub fn new(
        weights: LlamaWeights,
        config: &ModelConfig,
        opts: &CudaOptions,
        devices: &[u32],
    ) -> Result<Self, CudaError> {
        let world = devices.len();
        if world < 2 {
            return Err(CudaError::TensorParallel("needs at least 2 devices"));
        }
        if opts.batch_invariant && world > 2 {
            return Err(CudaError::InvalidOption {
                field: "batch_invariant",
                message: format!("batch_invariant is not supported with tensor_parallel_size {world} (at most 2)"),
            });
        }
        let (comms, ranks) = CommGroup::init(devices)?;
        let mut shards = Vec::with_capacity(world);
        for ((rank, &device), comm) in devices.iter().enumerate().zip(ranks) {
            let o = CudaOptions {
                device: device as usize,
                kv_cache_bytes: opts.kv_cache_bytes.map(|b| b / world as u64),
                ..opts.clone()
            };
            let w = weights.shard(config, rank, world)?;
            shards.push(CudaBackend::new_shard(w, config, &o, comm)?);
        }
        drop(weights);
        tracing::info!(devices = ?devices, kv_blocks = shards.iter().map(Backend::num_kv_blocks).min(), "CUDA tensor-parallel replica ready");
        Ok(Self { shards, comms })
    }

    /// Runs `batch` on every rank at once; rank 0's result (`f`) is returned after every rank
    /// has finished the step.
    fn step<T: Send>(
        &mut self,
        batch: &StepBatch,
        f: impl FnOnce(&mut CudaBackend) -> Result<T, BackendError> + Send,
    ) -> Result<T, BackendError> {
        if self.comms.aborted() {
            return Err(CudaError::TensorParallel("the replica failed earlier (communicators aborted)").into());
        }
        // Same checks on every rank (each against its own cache); all pass or none starts.
        for s in &self.shards {
            s.validate(batch)?;
        }
        let comms = &self.comms;
        let (first, rest) =
            self.shards.split_first_mut().ok_or(BackendError::Cuda(CudaError::TensorParallel("no shards")))?;
        std::thread::scope(|sc| {
            let others: Vec<_> = rest
                .iter_mut()
                .map(|s| {
                    sc.spawn(move || -> Result<(), BackendError> {
                        let r = s.run(batch).and_then(|_| s.synchronize());
                        if r.is_err() {
                            comms.abort();
                        }
                        r
                    })
                })
                .collect();
            let mut res = f(first);
            if res.is_err() {
                comms.abort();
            }
            for h in others {
                let r = h.join().unwrap_or_else(|_| {
                    comms.abort();
                    Err(CudaError::TensorParallel("a rank panicked").into())
                });
                if let (Ok(_), Err(e)) = (&res, r) {
                    res = Err(e);
                }
            }
            // What a rank computed after an abort must not be returned as a result.
            if res.is_ok() && comms.aborted() {
                res = Err(CudaError::TensorParallel("the step was aborted").into());
            }
            res
        })
    }
}

impl Backend for CudaTpBackend {
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits, BackendError> {
        self.step(batch, |s| s.forward(batch))
    }

    fn num_kv_blocks(&self) -> usize {
        self.shards.iter().map(Backend::num_kv_blocks).min().unwrap_or(0)
    }

    fn block_size(&self) -> usize {
        self.shards.first().map_or(16, Backend::block_size)
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.shards.iter().map(Backend::kv_bytes_per_token).sum()
    }

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn has_device_greedy(&self) -> bool {
        true
    }

    fn forward_greedy(&mut self, batch: &StepBatch) -> Result<Vec<u32>, BackendError> {
        // The trait method: it synchronises even for a step without logit rows.
        self.step(batch, |s| Backend::forward_greedy(s, batch))
    }
}
