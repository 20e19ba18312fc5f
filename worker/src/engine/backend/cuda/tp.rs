//! Tensor parallelism on one node (Megatron-LM, Shoeybi et al. 2019): a replica's GPU group runs
//! one [`CudaBackend`] shard per GPU. q/k/v and gate/up are split by output rows (whole heads),
//! o_proj and down_proj by input columns, so each shard's o_proj / down_proj output is a partial
//! sum that an NCCL all-reduce (bf16, sum — as vLLM's `RowParallelLinear`) completes before the
//! residual add; embeddings, norms and lm_head are replicated and rank 0 computes the logits.
//! Each shard keeps the K/V cache of its own KV heads (same block ids on every rank).
//!
//! Execution: every step runs on all ranks at once, one host thread per rank (scoped threads),
//! each enqueueing its shard's whole forward pass on its own stream; the collectives meet on
//! the devices. The batch is validated once before any rank starts, so either every rank
//! enqueues the step or none does (a rank that stopped half-way would leave the others
//! waiting in an all-reduce). CUDA graphs and the fused decode GEMVs are off in this mode.

use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::device::{Gpu, dev_err};
use super::{CudaBackend, CudaOptions};
use crate::engine::EngineError;
use crate::engine::backend::{Backend, BackendError, Logits, StepBatch};
use crate::engine::model::{LlamaWeights, ModelConfig};

/// One rank's NCCL communicator (from `ncclCommInitAll` over the replica's devices).
pub(crate) struct TpComm {
    comm: nccl_sys::ncclComm_t,
    /// This shard's rank.
    pub rank: usize,
}

// SAFETY: the communicator is used by one thread at a time (the rank's step thread); NCCL
// allows a communicator to move between threads.
unsafe impl Send for TpComm {}

impl Drop for TpComm {
    fn drop(&mut self) {
        // SAFETY: created by ncclCommInitAll, destroyed once; the stream is idle (the backend
        // synchronises before it is dropped).
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}

impl TpComm {
    /// In-place sum of `count` bf16 values at `ptr` over every rank, on the shard's stream.
    ///
    /// # Errors
    /// [`BackendError::Device`] when NCCL fails to enqueue it.
    pub(crate) fn all_reduce_bf16(
        &self,
        gpu: &Gpu,
        ptr: u64,
        count: usize,
    ) -> Result<(), BackendError> {
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

/// A tensor-parallel CUDA replica: one shard per device of its GPU group.
pub struct CudaTpBackend {
    shards: Vec<CudaBackend>,
}

impl std::fmt::Debug for CudaTpBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaTpBackend")
            .field("shards", &self.shards.len())
            .finish()
    }
}

impl CudaTpBackend {
    /// Splits `weights` over `devices` (ranks in that order) and builds one shard per device
    /// with `opts` (its `device` field is ignored).
    ///
    /// # Errors
    /// [`EngineError::Internal`] when NCCL is missing or fails, the group size does not divide
    /// the KV heads and the FFN size, or a shard cannot be built.
    pub fn new(
        weights: LlamaWeights,
        config: &ModelConfig,
        opts: &CudaOptions,
        devices: &[u32],
    ) -> Result<Self, EngineError> {
        let world = devices.len();
        if world < 2 {
            return Err(EngineError::Internal(
                "tensor parallelism needs at least 2 devices".into(),
            ));
        }
        // SAFETY: only opens the library (cudarc panics on a missing library otherwise).
        if !unsafe { nccl_sys::is_culib_present() } {
            return Err(EngineError::Internal(
                "tensor_parallel_size > 1 needs NCCL (libnccl.so.2 not found)".into(),
            ));
        }
        let shards_w: Vec<LlamaWeights> = (0..world)
            .map(|r| weights.shard(config, r, world))
            .collect::<Result<_, _>>()?;
        drop(weights);
        let ordinals: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); world];
        // SAFETY: `comms` has one slot per device in `ordinals`.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), world as i32, ordinals.as_ptr()) }
            .map_err(|e| {
                EngineError::Internal(format!("ncclCommInitAll over devices {devices:?}: {e:?}"))
            })?;
        let mut comms: Vec<Option<TpComm>> = comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| Some(TpComm { comm, rank }))
            .collect();
        let mut shards = Vec::with_capacity(world);
        for (rank, w) in shards_w.into_iter().enumerate() {
            let o = CudaOptions {
                device: devices[rank] as usize,
                ..opts.clone()
            };
            let comm = comms[rank]
                .take()
                .ok_or_else(|| EngineError::Internal("communicator used twice".into()))?;
            shards.push(CudaBackend::new_shard(w, config, &o, comm)?);
        }
        tracing::info!(devices = ?devices, kv_blocks = shards.iter().map(|s| s.num_blocks).min(), "CUDA tensor-parallel replica ready");
        Ok(Self { shards })
    }

    /// Runs `batch` on every rank at once; rank 0's result (`f`) is returned after every rank
    /// has finished the step.
    fn step<T: Send>(
        &mut self,
        batch: &StepBatch,
        f: impl FnOnce(&mut CudaBackend) -> Result<T, BackendError> + Send,
    ) -> Result<T, BackendError> {
        // Same checks on every rank; all pass or none starts.
        let blocks = self.num_kv_blocks();
        for s in &self.shards {
            s.validate(batch)?;
            if batch
                .seqs
                .iter()
                .flat_map(|q| &q.block_table)
                .any(|&b| b as usize >= blocks)
            {
                return Err(BackendError::InvalidBatch(format!("block id >= {blocks}")));
            }
        }
        let (first, rest) = self
            .shards
            .split_first_mut()
            .ok_or_else(|| BackendError::Device("no shards".into()))?;
        std::thread::scope(|sc| {
            let others: Vec<_> = rest
                .iter_mut()
                .map(|s| {
                    sc.spawn(move || -> Result<(), BackendError> {
                        s.run(batch)?;
                        s.synchronize()
                    })
                })
                .collect();
            let r0 = f(first);
            let mut res = r0;
            for h in others {
                let r = h
                    .join()
                    .map_err(|_| BackendError::Device("tensor-parallel rank panicked".into()))?;
                if let (Ok(_), Err(e)) = (&res, r) {
                    res = Err(e);
                }
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
        self.shards
            .iter()
            .map(Backend::num_kv_blocks)
            .min()
            .unwrap_or(0)
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
        self.step(batch, |s| s.forward_greedy(batch))
    }
}
