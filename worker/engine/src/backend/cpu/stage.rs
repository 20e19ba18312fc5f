//! One rank of a parallel CPU replica as a [`StageBackend`]: its tensor-parallel shard of
//! its pipeline stage's layers ([`CpuModel`] with only that stage's weights and KV cache),
//! the all-reduces after o_proj and down_proj over the stage's tensor-parallel group and the
//! stage-to-stage activations (`[tokens, hidden]` f32, the residual stream) through the
//! host [`Communicator`].

use super::AllReduce;
use super::forward::{CpuModel, ModelParts};
use crate::backend::{BackendError, StepBatch, StepControl};
use crate::model::{self, LlamaWeights, ModelConfig, ModelSource};
use crate::parallel::comm::{CommError, Communicator};
use crate::parallel::stage::types::{StageBackend, StageContext, StageOutput};

/// One rank's stage on the CPU (see the module docs).
pub struct CpuStage {
    model: CpuModel,
    comm: Box<dyn Communicator>,
    tp_group: Vec<usize>,
    tp_rank: usize,
    prev: Option<usize>,
    next: Option<usize>,
    /// The replica's stop requests (rank 0 in the driver's process), checked between layers.
    control: Option<StepControl>,
}

impl std::fmt::Debug for CpuStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuStage")
            .field("tp_group", &self.tp_group)
            .field("prev", &self.prev)
            .field("next", &self.next)
            .finish_non_exhaustive()
    }
}

/// A communicator failure as a step failure; an abort after a stop request is the stop.
fn comm_error(e: CommError, control: Option<&StepControl>) -> BackendError {
    if matches!(e, CommError::Aborted) && control.is_some_and(|c| c.stop_requested().is_some()) {
        return BackendError::Cancelled;
    }
    BackendError::Device(e.to_string())
}

/// The tensor-parallel all-reduce over a stage's group (skipped for a group of one),
/// after the replica's stop check.
struct TpReduce<'a> {
    comm: &'a mut dyn Communicator,
    group: &'a [usize],
    control: Option<&'a StepControl>,
}

impl AllReduce for TpReduce<'_> {
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), BackendError> {
        if let Some(c) = self.control {
            c.checkpoint()?;
        }
        if self.group.len() > 1 {
            self.comm.all_reduce_sum(self.group, buf).map_err(|e| comm_error(e, self.control))?;
        }
        Ok(())
    }
}

/// Builds `ctx`'s CPU stage. `preloaded` is the whole model already loaded by the caller
/// (rank 0 in the driver's process shares the driver's load; other ranks load from
/// `ctx.init.model`, keeping GGUF blocks quantized); `control` is checked between layers.
///
/// # Errors
/// [`BackendError::Device`] when the model cannot be loaded or split this way, or the KV
/// budget holds no block.
pub fn build_cpu_stage(
    ctx: StageContext,
    preloaded: Option<(LlamaWeights, ModelConfig)>,
    control: Option<StepControl>,
) -> Result<CpuStage, BackendError> {
    let dev = |e: &dyn std::fmt::Display| BackendError::Device(format!("rank {}: {e}", ctx.coords.rank));
    let (mut weights, config) = match preloaded {
        Some(p) => p,
        None => {
            let source = ModelSource::detect(&ctx.init.model).map_err(|e| dev(&e))?;
            let loaded = model::load_model_with(&source, None, model::LoadOptions { keep_quantized: true })
                .map_err(|e| dev(&e))?;
            (loaded.weights, loaded.config)
        }
    };
    let sizes = ctx.init.sizes;
    sizes.validate(&config).map_err(|e| dev(&e))?;
    let layers = ctx.layers.clone();
    if layers != sizes.stage_layers(ctx.coords.pp_rank, config.num_hidden_layers) {
        return Err(dev(&format!("layers {layers:?} are not stage {}'s", ctx.coords.pp_rank)));
    }
    let first_layer = layers.start;
    // Keep the stage's layers before sharding, so only they are copied.
    weights.layers = weights.layers.drain(layers).collect();
    let tp = sizes.tensor_parallel_size;
    if tp > 1 {
        weights = weights.shard(&config, ctx.coords.tp_rank, tp).map_err(|e| dev(&e))?;
    }
    let (first, last) = (ctx.is_first_stage(), ctx.is_last_stage());
    let tied = weights.lm_head.is_none();
    let parts = ModelParts {
        embed: (first || (last && tied)).then_some(weights.embed_tokens),
        layers: weights.layers,
        head: last.then_some((weights.norm, weights.lm_head)),
        embeds_tokens: first,
        first_layer,
    };
    let kv_bytes = ctx.init.kv_cache_bytes.unwrap_or(super::DEFAULT_KV_CACHE_BYTES);
    let model = CpuModel::new(parts, &config, kv_bytes, ctx.init.block_size).map_err(|e| dev(&e))?;
    Ok(CpuStage {
        model,
        tp_group: sizes.tp_group(ctx.coords.pp_rank),
        tp_rank: ctx.coords.tp_rank,
        prev: ctx.prev_stage_peer(),
        next: ctx.next_stage_peer(),
        comm: ctx.comm,
        control,
    })
}

impl CpuStage {
    /// The handle that aborts this stage's communicator (the driver aborts rank 0's when the
    /// group fails or the replica stops).
    pub fn abort_handle(&self) -> crate::parallel::comm::AbortHandle {
        self.comm.abort_handle()
    }
}

impl StageBackend for CpuStage {
    fn run_stage(&mut self, batch: &StepBatch, greedy: bool) -> Result<StageOutput, BackendError> {
        let control = self.control.as_ref();
        self.model.validate(batch)?;
        self.model.begin(batch);
        match self.prev {
            None => self.model.embed(batch)?,
            Some(p) => self.comm.recv(p, self.model.hidden_mut()).map_err(|e| comm_error(e, control))?,
        }
        let mut reduce = TpReduce { comm: self.comm.as_mut(), group: &self.tp_group, control };
        self.model.run_layers(batch, &mut reduce)?;
        if let Some(n) = self.next {
            self.comm.send(n, self.model.hidden_mut()).map_err(|e| comm_error(e, control))?;
            return Ok(StageOutput::Forwarded);
        }
        if self.tp_rank != 0 {
            return Ok(StageOutput::Forwarded);
        }
        let logits = self.model.logits(batch)?;
        if greedy {
            return Ok(StageOutput::Greedy((0..logits.rows).map(|r| crate::sampler::argmax(logits.row(r))).collect()));
        }
        Ok(StageOutput::Logits(logits))
    }

    fn num_kv_blocks(&self) -> usize {
        self.model.num_blocks()
    }

    fn block_size(&self) -> usize {
        self.model.block_size()
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.model.kv_bytes_per_token()
    }

    fn validate(&self, batch: &StepBatch) -> Result<(), BackendError> {
        self.model.validate(batch)
    }
}
