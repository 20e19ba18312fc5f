//! One rank of a parallel CUDA replica as a [`StageBackend`]: its tensor-parallel shard of
//! its pipeline stage's layers, loaded straight from the safetensors, with NCCL (or, with
//! `host_collectives`, the host communicator) for the all-reduces and the stage-to-stage
//! activations.

use crate::backend::BackendError;
use crate::parallel::stage::{StageBackend, StageContext};

/// Builds the CUDA stage of `ctx`'s rank on `ctx.device`.
///
/// # Errors
/// [`BackendError::Cuda`] / [`BackendError::Device`] when the shard cannot be loaded or the
/// communicator cannot be formed.
pub fn build_cuda_stage(ctx: StageContext) -> Result<Box<dyn StageBackend>, BackendError> {
    let _ = ctx;
    Err(BackendError::Device("CUDA stages are not built yet".into()))
}

/// A new NCCL unique id (128 bytes) for the group's world communicator; the driver creates
/// it and sends it to every rank in `InitSpec::nccl_unique_id`.
///
/// # Errors
/// [`BackendError::Cuda`] when NCCL is missing.
pub fn nccl_unique_id() -> Result<Vec<u8>, BackendError> {
    Err(BackendError::Device("NCCL unique ids are not built yet".into()))
}
