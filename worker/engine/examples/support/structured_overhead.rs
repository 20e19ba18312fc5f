//! `cuda_bench --json-schema VOCAB[,VOCAB2…]`: the step-time overhead of grammar masks on the
//! device greedy path, with the host time of every phase of a constrained step
//! (`#[path]`-included by `cuda_bench`).
//!
//! Each constrained step does what the engine's step loop does: one job per row on a rayon pool
//! (started before the forward is enqueued), the forward enqueued, the masks joined and
//! assembled into one [`LogitConstraints`], uploaded, the masked argmax. Variants, measured in
//! one process, interleaved with free (unconstrained) runs:
//! - `serial_advance_pageable`: the step loop as it was: the matchers consume the chosen tokens
//!   one after the other on the step thread after the argmax; masks copied from pageable memory;
//! - `serial_advance_pinned`: the same with the constraints staged in page-locked memory;
//! - `advance_in_jobs_pinned`: each job first consumes its row's token of the previous step,
//!   then computes the mask; page-locked staging;
//! - `advance_in_jobs_pinned_one_spawn`: the step loop now: as the last, with the rows handed
//!   to the pool as one task that fans out (`into_par_iter`) instead of one spawn per row
//!   from the step thread before the forward is enqueued.
//!
//! Per variant and batch (means over the timed steps, milliseconds): the step, each job's
//! consume and mask time, when the last job finished (from the step's start), and the backend's
//! phases ([`ConstrainedTiming`]): enqueueing the forward, the join (the constraints closure),
//! the upload, the argmax and its download (the forward's remainder); the serial advance.

use super::LLAMA3_VOCAB;
use super::bench::{batch as step_batch, time_greedy as time_free};
use anyhow::Context;
use llguidance::Matcher;
use prism_engine::backend::cuda::{ConstrainedTiming, CudaBackend};
use prism_engine::backend::{Backend, LogitConstraints, StepBatch};
use prism_engine::codec::TextCodec;
use prism_engine::structured::GrammarCompiler;
use prism_engine::{ChatMessage, EngineError, StructuredOutput};
use rayon::iter::{IntoParallelIterator, ParallelIterator};
use serde_json::json;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

/// The schema of `benches/structured.rs`: needs more tokens than a run generates.
const SCHEMA: &str = r#"{"type": "object", "properties": {
  "title": {"type": "string", "maxLength": 40},
  "notes": {"type": "array", "minItems": 64, "items": {"type": "string", "maxLength": 24}}},
  "required": ["title", "notes"], "additionalProperties": false}"#;

/// Timed steps per run; runs per variant (interleaved with the others and free runs).
const STEPS: usize = 40;

/// Token bytes read from a vocabulary file (no encoder: llguidance splits text greedily).
struct VocabCodec {
    bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
}

impl TextCodec for VocabCodec {
    fn encode(&self, _: &str, _: bool) -> Result<Vec<u32>, EngineError> {
        Err(EngineError::Internal("the benchmark vocabulary has no encoder".into()))
    }
    fn token_bytes(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }
    fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }
    fn vocab_size(&self) -> usize {
        self.bytes.len()
    }
    fn render_chat(&self, _: &[ChatMessage]) -> Result<String, EngineError> {
        Err(EngineError::Internal("the benchmark vocabulary has no chat template".into()))
    }
}

/// Records `special: u8, len: u16 LE, bytes` (`cuda_bench --write-vocab`,
/// `scripts/gpu/llama3_like_vocab.py`).
fn read_vocab(path: &str) -> anyhow::Result<VocabCodec> {
    let data = std::fs::read(path).with_context(|| format!("read {path}"))?;
    let (mut bytes, mut special) = (Vec::new(), Vec::new());
    let mut at = 0;
    while at + 3 <= data.len() {
        let len = u16::from_le_bytes([data[at + 1], data[at + 2]]) as usize;
        special.push(data[at] != 0);
        bytes.push(data.get(at + 3..at + 3 + len).context("truncated vocabulary")?.to_vec());
        at += 3 + len;
    }
    anyhow::ensure!(bytes.len() == LLAMA3_VOCAB, "{path} has {} tokens, want {LLAMA3_VOCAB}", bytes.len());
    Ok(VocabCodec { bytes, special })
}

#[derive(Clone, Copy)]
struct Variant {
    name: &'static str,
    advance_in_jobs: bool,
    pinned: bool,
    one_spawn: bool,
}

const VARIANTS: [Variant; 4] = [
    Variant { name: "serial_advance_pageable", advance_in_jobs: false, pinned: false, one_spawn: false },
    Variant { name: "serial_advance_pinned", advance_in_jobs: false, pinned: true, one_spawn: false },
    Variant { name: "advance_in_jobs_pinned", advance_in_jobs: true, pinned: true, one_spawn: false },
    Variant { name: "advance_in_jobs_pinned_one_spawn", advance_in_jobs: true, pinned: true, one_spawn: true },
];

/// One row's grammar: its matcher and the token it has not consumed yet.
struct Slot {
    m: Matcher,
    pending: Option<u32>,
}

/// What a row's job sends back.
struct JobOut {
    row: usize,
    slot: Slot,
    /// `None`: the grammar ended or failed (the row restarts it after the step).
    mask: Option<Vec<u32>>,
    consume: Duration,
    mask_time: Duration,
    end: Instant,
}

/// Sums of one variant's phases over its timed steps.
#[derive(Default)]
struct Phases {
    steps: usize,
    jobs: usize,
    step: Duration,
    consume: Duration,
    mask: Duration,
    jobs_done: Duration,
    spawn: Duration,
    advance: Duration,
    be: ConstrainedTiming,
}

impl Phases {
    fn add(&mut self, t: &ConstrainedTiming) {
        self.be.enqueue += t.enqueue;
        self.be.constraints += t.constraints;
        self.be.upload += t.upload;
        self.be.finish += t.finish;
    }

    fn report(&self) -> serde_json::Value {
        let per_step = |d: Duration| d.as_secs_f64() * 1e3 / self.steps.max(1) as f64;
        let per_job = |d: Duration| d.as_secs_f64() * 1e3 / self.jobs.max(1) as f64;
        json!({
            "step_ms": per_step(self.step), "job_consume_ms": per_job(self.consume),
            "job_mask_ms": per_job(self.mask), "jobs_done_ms": per_step(self.jobs_done),
            "enqueue_ms": per_step(self.be.enqueue), "join_ms": per_step(self.be.constraints),
            "upload_ms": per_step(self.be.upload), "argmax_wait_ms": per_step(self.be.finish),
            "spawn_ms": per_step(self.spawn), "serial_advance_ms": per_step(self.advance),
        })
    }
}

/// One constrained decode step of `variant`; adds its phases to `ph` when given.
fn step(
    be: &mut CudaBackend,
    b: &StepBatch,
    pool: &rayon::ThreadPool,
    slots: &mut Vec<Slot>,
    compiler: &GrammarCompiler,
    variant: Variant,
    ph: Option<&mut Phases>,
) -> anyhow::Result<()> {
    let words = LLAMA3_VOCAB.div_ceil(32);
    let n = slots.len();
    let t0 = Instant::now();
    let (tx, rx) = mpsc::channel();
    let job = |row: usize, mut slot: Slot, tx: &mpsc::Sender<JobOut>| {
        let s = Instant::now();
        let live = slot.pending.take().is_none_or(|t| slot.m.consume_token(t).is_ok() && !slot.m.is_stopped());
        let consume = s.elapsed();
        let mask = if live { slot.m.compute_mask().ok().map(|v| v.as_slice().to_vec()) } else { None };
        let end = Instant::now();
        let _ = tx.send(JobOut { row, slot, mask, consume, mask_time: end - s - consume, end });
    };
    if variant.one_spawn {
        let rows: Vec<(usize, Slot)> = slots.drain(..).enumerate().collect();
        pool.spawn(move || rows.into_par_iter().for_each_with(tx, |tx, (row, slot)| job(row, slot, tx)));
    } else {
        for (row, slot) in slots.drain(..).enumerate() {
            let tx = tx.clone();
            pool.spawn(move || job(row, slot, &tx));
        }
    }
    let spawn = t0.elapsed();
    let mut back: Vec<Option<JobOut>> = (0..n).map(|_| None).collect();
    let ids = be.forward_greedy_constrained(b, &mut || {
        let mut c = LogitConstraints {
            mask_words: words,
            masks: Vec::with_capacity(n * words),
            mask_of_row: vec![-1; n],
            edits: Vec::new(),
        };
        for _ in 0..n {
            let Ok(out) = rx.recv() else { break };
            if let Some(w) = &out.mask {
                c.mask_of_row[out.row] = (c.masks.len() / words) as i32;
                c.masks.extend_from_slice(&w[..words.min(w.len())]);
                c.masks.resize(c.masks.len().next_multiple_of(words), 0);
            }
            let row = out.row;
            back[row] = Some(out);
        }
        c
    })?;
    let timing = be.constrained_timing;
    let t_adv = Instant::now();
    let mut jobs_done = Duration::ZERO;
    let (mut consume, mut mask) = (Duration::ZERO, Duration::ZERO);
    for (row, out) in back.into_iter().enumerate() {
        let out = out.context("a mask job did not return")?;
        jobs_done = jobs_done.max(out.end - t0);
        (consume, mask) = (consume + out.consume, mask + out.mask_time);
        let mut slot = out.slot;
        let mut live = out.mask.is_some();
        if live {
            if variant.advance_in_jobs {
                slot.pending = Some(ids[row]);
            } else {
                live = slot.m.consume_token(ids[row]).is_ok() && !slot.m.is_stopped();
            }
        }
        if !live {
            slot = Slot { m: compiler.compile(&StructuredOutput::JsonSchema(SCHEMA.into()), &[])?, pending: None };
        }
        slots.push(slot);
    }
    if let Some(ph) = ph {
        ph.steps += 1;
        ph.jobs += n;
        ph.step += t0.elapsed();
        ph.spawn += spawn;
        ph.advance += t_adv.elapsed();
        (ph.consume, ph.mask, ph.jobs_done) = (ph.consume + consume, ph.mask + mask, ph.jobs_done + jobs_done);
        ph.add(&timing);
    }
    Ok(())
}

/// Runs every variant against free decoding at batch 1 and 64 for each vocabulary in
/// `vocabs` (comma-separated paths).
pub fn overhead(
    be: &mut CudaBackend,
    vocabs: &str,
    results: &mut serde_json::Map<String, serde_json::Value>,
) -> anyhow::Result<()> {
    let pool = rayon::ThreadPoolBuilder::new().build()?;
    println!("mask pool: {} threads", pool.current_num_threads());
    results.insert("pool_threads".into(), json!(pool.current_num_threads()));
    for vocab in vocabs.split(',') {
        let name = std::path::Path::new(vocab).file_stem().and_then(|s| s.to_str()).unwrap_or(vocab).to_owned();
        let codec = Arc::new(read_vocab(vocab)?);
        let mean_len = codec.bytes.iter().map(Vec::len).sum::<usize>() as f64 / LLAMA3_VOCAB as f64;
        let eos = (0..LLAMA3_VOCAB as u32).find(|&t| codec.is_special(t)).unwrap_or(0);
        let t = Instant::now();
        let compiler = GrammarCompiler::new(codec, eos).map_err(anyhow::Error::msg)?;
        let factory_s = t.elapsed().as_secs_f64();
        let spec = StructuredOutput::JsonSchema(SCHEMA.into());
        let t = Instant::now();
        drop(compiler.compile(&spec, &[])?);
        let compile_ms = t.elapsed().as_secs_f64() * 1e3;
        println!(
            "[{name}] mean token {mean_len:.2} B; compiler {factory_s:.2} s; schema compiled in {compile_ms:.2} ms"
        );
        let mut per_vocab = serde_json::Map::new();
        per_vocab.insert("mean_token_bytes".into(), json!(mean_len));
        per_vocab.insert("compiler_seconds".into(), json!(factory_s));
        per_vocab.insert("schema_compile_ms".into(), json!(compile_ms));
        for bsz in [1usize, 64] {
            let b = step_batch(bsz, 1024, 1, true);
            let mut free = Vec::new();
            let mut phases: Vec<Phases> = VARIANTS.iter().map(|_| Phases::default()).collect();
            // free, v0, v1, v2, v2, v1, v0, free: each variant's two runs around the middle.
            let order: Vec<Option<usize>> = std::iter::once(None)
                .chain((0..VARIANTS.len()).map(Some))
                .chain((0..VARIANTS.len()).rev().map(Some))
                .chain(std::iter::once(None))
                .collect();
            for run in order {
                let Some(v) = run else {
                    free.push(time_free(be, &b, 3, STEPS)?);
                    continue;
                };
                let variant = VARIANTS[v];
                be.set_pinned_constraints(variant.pinned);
                let mut slots: Vec<Slot> = (0..bsz)
                    .map(|_| compiler.compile(&spec, &[]).map(|m| Slot { m, pending: None }))
                    .collect::<Result<_, _>>()?;
                for _ in 0..3 {
                    step(be, &b, &pool, &mut slots, &compiler, variant, None)?;
                }
                for _ in 0..STEPS {
                    step(be, &b, &pool, &mut slots, &compiler, variant, Some(&mut phases[v]))?;
                }
            }
            be.set_pinned_constraints(true);
            let f = free.iter().sum::<f64>() / free.len() as f64 * 1e3;
            println!(
                "[{name}] b={bsz} ctx=1024 free {f:.3} ms/step (runs {:?})",
                free.iter().map(|x| x * 1e3).collect::<Vec<_>>()
            );
            let mut row = serde_json::Map::new();
            row.insert("free_ms".into(), json!(f));
            row.insert("free_runs_ms".into(), json!(free.iter().map(|x| x * 1e3).collect::<Vec<_>>()));
            for (v, ph) in VARIANTS.iter().zip(&phases) {
                let mut r = ph.report();
                let j = r["step_ms"].as_f64().unwrap_or(0.0);
                r["overhead"] = json!(j / f - 1.0);
                println!("[{name}] b={bsz} {:<24} {j:.3} ms/step ({:+.2}%): {r}", v.name, (j / f - 1.0) * 100.0);
                row.insert(v.name.into(), r);
            }
            per_vocab.insert(format!("b{bsz}_ctx1024"), serde_json::Value::Object(row));
        }
        results.insert(name, serde_json::Value::Object(per_vocab));
    }
    Ok(())
}
