//! One rank of a parallel CUDA replica as a [`StageBackend`]: its tensor-parallel shard of
//! its pipeline stage's layers, loaded straight from the safetensors, with NCCL (or, with
//! `host_collectives`, the host communicator) for the all-reduces and the stage-to-stage
//! activations.
//!
//! A micro-batch on a rank: receive the previous stage's `[tokens, hidden]` f32 residual
//! stream into the step scratch (not on the first stage), run the shard's forward pass
//! exactly as the single-GPU backend does (same kernels, fused decode GEMVs, CUDA graphs for
//! pure decode steps; NCCL all-reduces are captured into the graphs with the rest), send the
//! residual stream to the next stage (not on the last), wait for the stream within the
//! collective timeout ([`RankComm::wait`]), and on the last stage's tensor-parallel rank 0
//! bring back the logits or the argmax rows.
//!
//! Communicators: one world NCCL communicator per process from the driver's unique id
//! (`ncclCommInitRank`) and the stage's tensor-parallel group split off it by `pp_rank`.
//! A group of one rank uses none. With `host_collectives` every collective goes through the
//! host mesh instead, so several ranks can share one GPU (NCCL refuses two ranks on one
//! device); graphs are then off when a stage has more than one tensor-parallel rank.

use std::time::Duration;

use super::error::CudaError;
use super::nccl::{RankComm, RankCommSpec};
use super::options::CudaOptions;
use super::runner::CudaBackend;
use super::weights::ShardSpec;
use crate::backend::{Backend, BackendError, StepBatch};
use crate::parallel::comm::Communicator;
use crate::parallel::stage::types::{StageBackend, StageBackendKind, StageContext, StageOutput};

/// One rank's stage on its GPU.
pub struct CudaStage {
    be: CudaBackend,
    /// Global rank of the previous / next stage's peer.
    prev: Option<usize>,
    next: Option<usize>,
    /// Returns the logits (last stage, tensor-parallel rank 0).
    returns_logits: bool,
    hidden: usize,
    /// The host mesh, kept open for the group's lifetime when NCCL carries the collectives.
    _host: Option<Box<dyn Communicator>>,
}

impl std::fmt::Debug for CudaStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaStage")
            .field("backend", &self.be)
            .field("prev", &self.prev)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

fn device_err(message: String) -> BackendError {
    BackendError::Device(message)
}

/// Builds the CUDA stage of `ctx`'s rank on `ctx.device`.
///
/// # Errors
/// [`BackendError::Cuda`] / [`BackendError::Device`] when the shard cannot be loaded or the
/// communicator cannot be formed.
pub fn build_cuda_stage(ctx: StageContext) -> Result<Box<dyn StageBackend>, BackendError> {
    Ok(Box::new(CudaStage::build(ctx)?))
}

impl CudaStage {
    fn build(ctx: StageContext) -> Result<Self, BackendError> {
        let (prev, next) = (ctx.prev_stage_peer(), ctx.next_stage_peer());
        let (first_stage, last_stage) = (ctx.is_first_stage(), ctx.is_last_stage());
        let StageContext { init, coords, layers, device, comm } = ctx;
        if init.backend != StageBackendKind::Cuda {
            return Err(device_err(format!("a CUDA stage was asked for a {:?} group", init.backend)));
        }
        let device = device.ok_or_else(|| device_err(format!("rank {} has no CUDA device", coords.rank)))?;
        let sizes = init.sizes;
        let (tp, world) = (sizes.tensor_parallel_size, sizes.world_size());
        if init.batch_invariant && tp > 2 && !init.host_collectives {
            // NCCL's summation order over 3+ ranks depends on the message size.
            return Err(CudaError::InvalidOption {
                field: "batch_invariant",
                message: format!("batch_invariant is not supported with tensor_parallel_size {tp} (at most 2)"),
            }
            .into());
        }
        if !init.model.is_dir() {
            return Err(device_err(format!(
                "CUDA ranks load a Hugging Face safetensors directory; {} is not one",
                init.model.display()
            )));
        }
        let model = crate::model::safetensors::open_dir_model(&init.model).map_err(CudaError::from)?;
        let cfg = &model.config;
        let hidden = cfg.hidden_size;
        let spec = ShardSpec { tp_rank: coords.tp_rank, tp_size: tp, layers, first_stage, last_stage };
        let comm_spec = RankCommSpec {
            rank: coords.rank,
            world_size: world,
            tp_rank: coords.tp_rank,
            tp_size: tp,
            pp_rank: coords.pp_rank,
            timeout: Duration::from_millis(init.collective_timeout_ms.max(1)),
        };
        let nccl = world > 1 && !init.host_collectives;
        let opts = CudaOptions {
            device: device as usize,
            block_size: init.block_size,
            gpu_memory_utilization: init.gpu_memory_utilization,
            kv_cache_bytes: init.kv_cache_bytes,
            max_num_batched_tokens: init.max_num_batched_tokens,
            max_num_seqs: init.max_num_seqs,
            batch_invariant: init.batch_invariant,
            // Host all-reduces inside a step cannot be captured into a graph.
            cuda_graphs: !(init.host_collectives && tp > 1),
            ..CudaOptions::default()
        };
        let mut be = CudaBackend::from_safetensors_shard(&model.files, cfg, &opts, &spec)?;
        drop(model);
        let host = if world == 1 {
            Some(comm)
        } else if init.host_collectives {
            be.set_comm(RankComm::host(&comm_spec, comm, sizes.tp_group(coords.pp_rank)));
            None
        } else {
            let id = init.nccl_unique_id.as_deref().ok_or(CudaError::InvalidOption {
                field: "nccl_unique_id",
                message: "a CUDA group without host_collectives needs the driver's NCCL unique id".into(),
            })?;
            be.set_comm(RankComm::nccl(be.gpu(), &comm_spec, id)?);
            Some(comm)
        };
        tracing::info!(
            rank = coords.rank,
            tp_rank = coords.tp_rank,
            pp_rank = coords.pp_rank,
            layers = ?spec.layers,
            collectives = if nccl { "nccl" } else if world > 1 { "host" } else { "none" },
            "CUDA stage ready"
        );
        Ok(Self { be, prev, next, returns_logits: last_stage && coords.tp_rank == 0, hidden, _host: host })
    }
}

impl StageBackend for CudaStage {
    fn run_stage(&mut self, batch: &StepBatch, greedy: bool) -> Result<StageOutput, BackendError> {
        self.be.validate(batch)?;
        self.be.bind()?;
        let count = batch.token_ids.len() * self.hidden;
        if let Some(peer) = self.prev {
            self.be.recv_hidden(count, peer)?;
        }
        let rows = self.be.run(batch)?;
        if let Some(peer) = self.next {
            self.be.send_hidden(count, peer)?;
        }
        // A greedy step's argmax goes on the stream before the one wait for the step, so
        // the ids are ready when it returns (one synchronisation, as the unsharded path).
        let greedy_here = greedy && self.returns_logits;
        if greedy_here {
            self.be.launch_argmax(rows)?;
        }
        self.be.wait_step()?;
        if !self.returns_logits {
            return Ok(StageOutput::Forwarded);
        }
        if greedy_here {
            Ok(StageOutput::Greedy(self.be.download_argmax(rows)?))
        } else {
            Ok(StageOutput::Logits(self.be.logit_rows(rows)?))
        }
    }

    fn num_kv_blocks(&self) -> usize {
        self.be.num_kv_blocks()
    }

    fn block_size(&self) -> usize {
        self.be.block_size()
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.be.kv_bytes_per_token()
    }

    fn validate(&self, batch: &StepBatch) -> Result<(), BackendError> {
        self.be.validate(batch)
    }
}

/// A new NCCL unique id (128 bytes) for the group's world communicator; the driver creates
/// it and sends it to every rank in `InitSpec::nccl_unique_id`.
///
/// # Errors
/// [`BackendError::Cuda`] when NCCL is missing.
pub fn nccl_unique_id() -> Result<Vec<u8>, BackendError> {
    Ok(super::nccl::unique_id()?)
}
