//! One rank's part of a forward step, and what the driver tells each rank at start.
//!
//! A rank holds tensor-parallel shard `tp_rank` of stage `pp_rank`'s layers (and the
//! embedding on the first stage, the final norm and `lm_head` on the last), with the KV cache
//! of its own KV heads for its own layers; block ids and slots are the same on every rank.
//! The driver sends every rank the same [`StepBatch`] split into the same micro-batches
//! ([`split_micro_batches`]); each rank runs [`StageBackend::run_stage`] on them in order, so
//! stage `p` works on micro-batch `i + 1` while stage `p + 1` works on micro-batch `i`.

use std::ops::Range;

use crate::backend::{BackendError, SeqStep, StepBatch};

pub mod types;

pub use types::{InitSpec, StageBackend, StageBackendKind, StageContext, StageOutput};

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
