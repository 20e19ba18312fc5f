//! One rank's part of a forward step, and what the driver tells each rank at start.
//!
//! A rank holds tensor-parallel shard `tp_rank` of stage `pp_rank`'s layers (and the
//! embedding on the first stage, the final norm and `lm_head` on the last), with the KV cache
//! of its own KV heads for its own layers; block ids and slots are the same on every rank.
//! The driver sends every rank the same [`StepBatch`] split into the same micro-batches
//! ([`split_micro_batches`]); each rank runs [`StageBackend::run_stage`] on them in order, so
//! stage `p` works on micro-batch `i + 1` while stage `p + 1` works on micro-batch `i`.

use std::ops::Range;
use std::path::PathBuf;

use super::comm::Communicator;
use super::layout::{ParallelSizes, RankCoords};
use crate::backend::{BackendError, Logits, SeqStep, StepBatch};

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

/// Builds this rank's stage backend (loading only its shard of its layers): the CPU stage
/// ([`crate::backend::cpu::stage::CpuStage`]) or, with feature `cuda`, the CUDA stage.
///
/// # Errors
/// [`BackendError::Device`] when the model cannot be loaded or split, or the backend is not
/// built into this binary.
pub fn build_stage_backend(ctx: StageContext) -> Result<Box<dyn StageBackend>, BackendError> {
    match ctx.init.backend {
        StageBackendKind::Cpu => Ok(Box::new(crate::backend::cpu::stage::build_cpu_stage(ctx, None, None)?)),
        #[cfg(feature = "cuda")]
        StageBackendKind::Cuda => crate::backend::cuda::stage::build_cuda_stage(ctx),
        #[cfg(not(feature = "cuda"))]
        StageBackendKind::Cuda => Err(BackendError::Device("the CUDA backend is not built into this binary".into())),
    }
}

/// The model's architecture (layer count, heads, vocabulary) without its weights: the
/// GGUF header, or a Hugging Face directory's `config.json` (and tokenizer files).
///
/// # Errors
/// [`crate::request::EngineError`] when the path is missing or the model unreadable.
pub fn read_model_config(path: &std::path::Path) -> Result<crate::model::ModelConfig, crate::request::EngineError> {
    use crate::model::{ModelSource, gguf::GgufFile, safetensors};
    let internal = |e: crate::model::ModelError| crate::request::EngineError::Internal(e.to_string());
    match ModelSource::detect(path)? {
        ModelSource::Gguf(p) => GgufFile::open(&p).and_then(|f| f.model_config()).map_err(internal),
        ModelSource::HfDir(d) => safetensors::open_dir_model(&d).map(|m| m.config).map_err(internal),
    }
}

/// Runs one step on a rank: splits it ([`split_micro_batches`]) and runs the stage on each
/// micro-batch in order, returning one output per micro-batch.
///
/// # Errors
/// The first micro-batch's failure.
pub fn run_micro_batches(
    stage: &mut dyn StageBackend,
    batch: &StepBatch,
    greedy: bool,
    micro_batches: usize,
) -> Result<Vec<StageOutput>, BackendError> {
    split_micro_batches(batch, micro_batches).iter().map(|mb| stage.run_stage(mb, greedy)).collect()
}

/// Splits a step into at most `micro_batches` micro-batches of whole sequences with about
/// equal token counts, in order (each re-based so its first sequence starts at token 0).
/// The logit rows of the micro-batches, concatenated, are the step's rows in batch order.
/// Every rank calls it with the same batch and count and gets the same split. A batch with
/// fewer sequences than `micro_batches` gets one micro-batch per sequence; `0` counts as 1.
pub fn split_micro_batches(batch: &StepBatch, micro_batches: usize) -> Vec<StepBatch> {
    let n = batch.seqs.len();
    let k = micro_batches.clamp(1, n.max(1));
    if k == 1 {
        return vec![batch.clone()];
    }
    let total: usize = batch.seqs.iter().map(|s| s.query_len).sum();
    let mut bounds = Vec::with_capacity(k + 1);
    bounds.push(0);
    let mut acc = 0;
    for (i, s) in batch.seqs.iter().enumerate() {
        acc += s.query_len;
        let formed = bounds.len(); // micro-batches formed once this one is cut
        let (seqs_left, groups_left) = (n - i - 1, k - formed);
        if formed < k && seqs_left >= groups_left && (acc * k >= total * formed || seqs_left == groups_left) {
            bounds.push(i + 1);
        }
    }
    bounds.push(n);
    bounds.windows(2).map(|w| sub_batch(batch, w[0]..w[1])).collect()
}

/// Sequences `seqs` of `batch` as a batch of their own (tokens re-based to 0).
fn sub_batch(batch: &StepBatch, seqs: Range<usize>) -> StepBatch {
    let part = &batch.seqs[seqs];
    let t0 = part.first().map_or(0, |s| s.query_start);
    let t1 = part.last().map_or(0, |s| s.query_start + s.query_len);
    StepBatch {
        token_ids: batch.token_ids[t0..t1].to_vec(),
        positions: batch.positions[t0..t1].to_vec(),
        slot_mapping: batch.slot_mapping[t0..t1].to_vec(),
        seqs: part.iter().map(|s| SeqStep { query_start: s.query_start - t0, ..s.clone() }).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(lens: &[usize], want: &[bool]) -> StepBatch {
        let mut b = StepBatch::default();
        for (i, (&len, &w)) in lens.iter().zip(want).enumerate() {
            let start = b.token_ids.len();
            for p in 0..len {
                b.token_ids.push((i * 100 + p) as u32);
                b.positions.push(p as u32);
                b.slot_mapping.push((i * 64 + p) as u32);
            }
            b.seqs.push(SeqStep {
                query_start: start,
                query_len: len,
                context_len: len,
                block_table: vec![i as u32 * 4, i as u32 * 4 + 1, i as u32 * 4 + 2, i as u32 * 4 + 3],
                want_logits: w,
            });
        }
        b
    }

    #[test]
    fn micro_batches_are_whole_sequences_of_about_equal_tokens_rebased_to_zero() {
        let b = batch(&[10, 2, 3, 5, 20], &[true, false, true, true, true]);
        let parts = split_micro_batches(&b, 2);
        assert_eq!(parts.iter().map(|p| p.seqs.len()).collect::<Vec<_>>(), vec![4, 1]);
        assert_eq!(parts.iter().map(|p| p.token_ids.len()).collect::<Vec<_>>(), vec![20, 20]);
        for p in &parts {
            p.validate(1000, 64, 16).unwrap();
        }
        assert_eq!(parts[1].seqs[0].query_start, 0);
        assert_eq!(parts[1].token_ids[0], 400);
        assert_eq!(parts[1].slot_mapping[0], 256);
        // The concatenated parts are the batch.
        let ids: Vec<u32> = parts.iter().flat_map(|p| p.token_ids.clone()).collect();
        assert_eq!(ids, b.token_ids);
        let rows: usize = parts.iter().map(|p| p.seqs.iter().filter(|s| s.want_logits).count()).sum();
        assert_eq!(rows, 4);
    }

    #[test]
    fn more_micro_batches_than_sequences_gives_one_per_sequence() {
        let b = batch(&[1, 1, 1], &[true; 3]);
        let parts = split_micro_batches(&b, 8);
        assert_eq!(parts.len(), 3);
        assert!(parts.iter().all(|p| p.seqs.len() == 1 && p.seqs[0].query_start == 0));
        let b = batch(&[30, 1, 1, 1], &[true; 4]);
        let parts = split_micro_batches(&b, 3);
        assert_eq!(parts.iter().map(|p| p.token_ids.len()).collect::<Vec<_>>(), vec![30, 1, 2]);
        assert_eq!(split_micro_batches(&b, 0).len(), 1);
        assert_eq!(split_micro_batches(&StepBatch::default(), 4).len(), 1);
    }
}
