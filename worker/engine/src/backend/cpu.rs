//! The CPU reference backend: the Llama forward pass in f32 over a flattened batch with a
//! paged KV cache (vLLM's CPU model runner shape). Per layer: RMSNorm → fused QKV product →
//! RoPE (rotate-half) → K/V written to their slots → paged GQA attention → o_proj →
//! all-reduce hook → residual; RMSNorm → fused gate/up → SiLU·mul → down_proj → all-reduce
//! hook → residual. Logits only for the rows that ask for them (tied lm_head when the model
//! has no separate one). Scratch buffers live in the backend and are reused every step.
//!
//! Weights stay as loaded: f32, or GGUF Q4_0/Q4_1/Q8_0 blocks (a model loaded with
//! `keep_quantized`) that [`qmatmul`] dequantizes in registers — about a fifth of the bytes
//! per decoded token and of the resident memory, with outputs bit-identical to the f32
//! dequantization. Every matrix product and the attention compute each output row the same
//! way whatever the batch holds, so batching and chunking never change a sequence's tokens.
//!
//! Tensor parallelism: the backend runs whatever shard [`LlamaWeights::shard`] produced
//! (local heads and MLP columns are read off the weight shapes); an [`AllReduce`] given
//! with [`CpuBackend::with_all_reduce`] sums the row-parallel outputs across ranks.
//!
//! Files: [`forward`] (the pass in parts: embed, layers, logits — [`CpuModel`]), [`stage`]
//! (one rank of a parallel replica: [`stage::CpuStage`]), [`attention`], [`ops`], [`qmatmul`].

pub mod attention;
pub mod forward;
pub mod ops;
pub mod qmatmul;
pub mod stage;

use super::{Backend, BackendError, Logits, StepBatch};
use crate::model::{LlamaWeights, ModelConfig};
use crate::request::EngineError;
pub use forward::{CpuModel, ModelParts};

/// Default CPU KV-cache budget: 1 GiB (about 23k tokens of SmolLM2-135M).
pub const DEFAULT_KV_CACHE_BYTES: u64 = 1 << 30;

/// Sums a buffer element-wise across tensor-parallel ranks (NCCL's all-reduce on CUDA;
/// shared memory in tests). Every rank calls it with the same shape in the same order.
pub trait AllReduce: Send {
    /// Replaces `buf` with the element-wise sum of every rank's `buf`.
    ///
    /// # Errors
    /// [`BackendError::Device`] when a peer is gone.
    fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), BackendError>;
}

/// The identity: a whole model on one rank has nothing to sum.
struct NoReduce;

impl AllReduce for NoReduce {
    fn all_reduce_sum(&mut self, _buf: &mut [f32]) -> Result<(), BackendError> {
        Ok(())
    }
}

/// CPU backend for Llama-family models (or one tensor-parallel shard of one): f32
/// arithmetic over f32 or block-quantized weights.
pub struct CpuBackend {
    model: CpuModel,
    all_reduce: Box<dyn AllReduce>,
}

impl std::fmt::Debug for CpuBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CpuBackend")
            .field("num_blocks", &self.model.num_blocks())
            .field("block_size", &self.model.block_size())
            .finish_non_exhaustive()
    }
}

impl CpuBackend {
    /// Takes ownership of the weights (fusing q/k/v and gate/up; quantized matrices stay
    /// quantized) and allocates
    /// `kv_cache_bytes / (block_size · kv_bytes_per_token)` KV blocks.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (field `kv_cache_bytes`) when the budget holds no
    /// block, or `block_size` is 0; [`EngineError::Internal`] when weights and config disagree.
    pub fn new(
        weights: LlamaWeights,
        config: &ModelConfig,
        kv_cache_bytes: u64,
        block_size: usize,
    ) -> Result<Self, EngineError> {
        if weights.embed_tokens.out_features != config.vocab_size {
            return Err(EngineError::Internal("embedding rows do not match vocab_size".into()));
        }
        let parts = ModelParts {
            embed: Some(weights.embed_tokens),
            layers: weights.layers,
            head: Some((weights.norm, weights.lm_head)),
            embeds_tokens: true,
            first_layer: 0,
        };
        Ok(Self { model: CpuModel::new(parts, config, kv_cache_bytes, block_size)?, all_reduce: Box::new(NoReduce) })
    }

    /// Bytes held by the weight matrices (f32 or blocks; norms excluded).
    pub fn weight_bytes(&self) -> usize {
        self.model.weight_bytes()
    }

    /// Installs the all-reduce used after o_proj and down_proj (tensor-parallel shards).
    pub fn with_all_reduce(mut self, all_reduce: Box<dyn AllReduce>) -> Self {
        self.all_reduce = all_reduce;
        self
    }
}

impl Backend for CpuBackend {
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits, BackendError> {
        self.model.validate(batch)?;
        self.model.begin(batch);
        self.model.embed(batch)?;
        self.model.run_layers(batch, self.all_reduce.as_mut())?;
        self.model.logits(batch)
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

    fn kv_sliding_window(&self) -> Option<usize> {
        self.model.uniform_sliding_window()
    }

    fn name(&self) -> &'static str {
        "cpu"
    }
}
