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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::device::{Gpu, dev_err};
use super::{CudaBackend, CudaOptions};
use crate::EngineError;
use crate::backend::{Backend, BackendError, Logits, StepBatch};
use crate::model::{LlamaWeights, ModelConfig};

/// One rank's NCCL communicator (from `ncclCommInitAll` over the replica's devices).
pub(crate) struct TpComm {
    comm: nccl_sys::ncclComm_t,
    /// This shard's rank.
    pub rank: usize,
    /// Set once the communicators were aborted (then they must not be destroyed).
    aborted: Arc<AtomicBool>,
}

// SAFETY: the communicator is used by one thread at a time (the rank's step thread); NCCL
// allows a communicator to move between threads.
unsafe impl Send for TpComm {}

impl Drop for TpComm {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::SeqCst) {
            return;
        }
        // SAFETY: created by ncclCommInitAll, destroyed once; no collective is pending (every
        // step ends with every rank's stream synchronised).
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}

impl TpComm {
    /// In-place sum of `count` bf16 values at `ptr` over every rank, on the shard's stream.
    ///
    /// # Errors
    /// [`BackendError::Device`] when NCCL fails to enqueue it.
    pub(crate) fn all_reduce_bf16(&self, gpu: &Gpu, ptr: u64, count: usize) -> Result<(), BackendError> {
        // SAFETY: `ptr` holds `count` bf16 values on this rank's device; in-place all-reduce
        // on the stream every other launch of the shard uses.
        unsafe {
            nccl::all_reduce(
                ptr as *const _,
                ptr as *mut _,
                count,
                nccl_sys::ncclDataType_t::ncclBfloat16,
                nccl_sys::ncclRedOp_t::ncclSum,
                self.comm,
                gpu.stream.cu_stream() as nccl_sys::cudaStream_t,
            )
        }
        .map(|_| ())
        .map_err(|e| dev_err("ncclAllReduce", e))
    }
}

/// A raw communicator handle shared with the rank threads (only for `ncclCommAbort`).
#[derive(Clone, Copy)]
struct RawComm(nccl_sys::ncclComm_t);
// SAFETY: ncclCommAbort may be called from any thread, also while a collective is blocked.
unsafe impl Send for RawComm {}
// SAFETY: as above; the handle is only passed to ncclCommAbort.
unsafe impl Sync for RawComm {}

/// Aborts every communicator once (releases ranks blocked in a collective).
fn abort_all(raw: &[RawComm], aborted: &AtomicBool) {
    if aborted.swap(true, Ordering::SeqCst) {
        return;
    }
    tracing::error!("tensor-parallel rank failed: aborting the NCCL communicators");
    for c in raw {
        // SAFETY: valid communicators, aborted once (guarded by `aborted`), never destroyed
        // afterwards (TpComm::drop checks the same flag).
        let _ = unsafe { nccl::comm_abort(c.0) };
    }
}

/// A tensor-parallel CUDA replica: one shard per device of its GPU group.
pub struct CudaTpBackend {
    shards: Vec<CudaBackend>,
    /// Every rank's communicator (aborted together when a rank fails).
    raw: Vec<RawComm>,
    aborted: Arc<AtomicBool>,
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
    /// [`EngineError::Internal`] when NCCL is missing or fails, the group size does not divide
    /// the KV heads and the FFN size, or a shard cannot be built;
    /// [`EngineError::InvalidRequest`] for `batch_invariant` with more than 2 ranks (NCCL's
    /// summation order over 3+ ranks depends on the message size, so results would depend on
    /// the batch).
    pub fn new(
        weights: LlamaWeights,
        config: &ModelConfig,
        opts: &CudaOptions,
        devices: &[u32],
    ) -> Result<Self, EngineError> {
        let world = devices.len();
        if world < 2 {
            return Err(EngineError::Internal("tensor parallelism needs at least 2 devices".into()));
        }
        if opts.batch_invariant && world > 2 {
            return Err(EngineError::InvalidRequest {
                field: "batch_invariant",
                message: format!("batch_invariant is not supported with tensor_parallel_size {world} (at most 2)"),
            });
        }
        // SAFETY: only opens the library (cudarc panics on a missing library otherwise).
        if !unsafe { nccl_sys::is_culib_present() } {
            return Err(EngineError::Internal("tensor_parallel_size > 1 needs NCCL (libnccl.so.2 not found)".into()));
        }
        let ordinals: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); world];
        // SAFETY: `comms` has one slot per device in `ordinals`.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), world as i32, ordinals.as_ptr()) }
            .map_err(|e| EngineError::Internal(format!("ncclCommInitAll over devices {devices:?}: {e:?}")))?;
        let aborted = Arc::new(AtomicBool::new(false));
        let raw: Vec<RawComm> = comms.iter().map(|&c| RawComm(c)).collect();
        let mut comms: Vec<Option<TpComm>> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| Some(TpComm { comm, rank, aborted: aborted.clone() }))
            .collect();
        let mut shards = Vec::with_capacity(world);
        for (rank, &device) in devices.iter().enumerate() {
            let o = CudaOptions {
                device: device as usize,
                kv_cache_bytes: opts.kv_cache_bytes.map(|b| b / world as u64),
                ..opts.clone()
            };
            let comm = comms[rank].take().ok_or_else(|| EngineError::Internal("communicator used twice".into()))?;
            let w = weights.shard(config, rank, world)?;
            shards.push(CudaBackend::new_shard(w, config, &o, comm)?);
        }
        drop(weights);
        tracing::info!(devices = ?devices, kv_blocks = shards.iter().map(|s| s.num_blocks).min(), "CUDA tensor-parallel replica ready");
        Ok(Self { shards, raw, aborted })
    }

    /// Runs `batch` on every rank at once; rank 0's result (`f`) is returned after every rank
    /// has finished the step.
    fn step<T: Send>(
        &mut self,
        batch: &StepBatch,
        f: impl FnOnce(&mut CudaBackend) -> Result<T, BackendError> + Send,
    ) -> Result<T, BackendError> {
        if self.aborted.load(Ordering::SeqCst) {
            return Err(BackendError::Device("tensor-parallel replica failed earlier (communicators aborted)".into()));
        }
        // Same checks on every rank (each against its own cache); all pass or none starts.
        for s in &self.shards {
            s.validate(batch)?;
        }
        let (raw, aborted) = (&self.raw, &*self.aborted);
        let (first, rest) = self.shards.split_first_mut().ok_or_else(|| BackendError::Device("no shards".into()))?;
        std::thread::scope(|sc| {
            let others: Vec<_> = rest
                .iter_mut()
                .map(|s| {
                    sc.spawn(move || -> Result<(), BackendError> {
                        let r = s.run(batch).and_then(|_| s.synchronize());
                        if r.is_err() {
                            abort_all(raw, aborted);
                        }
                        r
                    })
                })
                .collect();
            let mut res = f(first);
            if res.is_err() {
                abort_all(raw, aborted);
            }
            for h in others {
                let r = h.join().unwrap_or_else(|_| {
                    abort_all(raw, aborted);
                    Err(BackendError::Device("tensor-parallel rank panicked".into()))
                });
                if let (Ok(_), Err(e)) = (&res, r) {
                    res = Err(e);
                }
            }
            // What a rank computed after an abort must not be returned as a result.
            if res.is_ok() && aborted.load(Ordering::SeqCst) {
                res = Err(BackendError::Device("tensor-parallel step aborted".into()));
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
