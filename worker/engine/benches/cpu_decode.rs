//! Batch-1 greedy decode straight on the CPU backend (no engine, scheduler, sampler or
//! detokenizer): a 16-token prompt prefilled in one step, then one token per step, each
//! step's forward and argmax timed. Prints the median and best step in ms and the decode
//! tokens/s of the median, then one 512-token prefill. A quick figure for kernel work; the
//! engine's own (`benches/engine.rs`) adds the per-token engine overheads.
//!
//! Run: `cargo bench -p prism-engine --profile dev --bench cpu_decode`. Env: `PRISM_MODEL`
//! (default `models/gemma-3-270m-q4_k_m.gguf`), `PRISM_BENCH_DECODE_TOKENS` (default 64),
//! `PRISM_BENCH_ROUNDS` (decode runs from the same prompt, default 3).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Result;
use prism_engine::backend::cpu::CpuBackend;
use prism_engine::backend::{Backend, SeqStep, StepBatch};
use prism_engine::model::{LoadOptions, ModelSource, load_model_with};
use prism_engine::sampler::argmax;

const BLOCK: usize = 16;

/// One step of one sequence: `tokens` at positions `start..`, blocks `0..` in order.
fn step(tokens: &[u32], start: usize) -> StepBatch {
    let ctx = start + tokens.len();
    let mut b = StepBatch::default();
    for (i, &t) in tokens.iter().enumerate() {
        b.token_ids.push(t);
        b.positions.push((start + i) as u32);
        b.slot_mapping.push((start + i) as u32);
    }
    b.seqs.push(SeqStep {
        query_start: 0,
        query_len: tokens.len(),
        context_len: ctx,
        block_table: (0..ctx.div_ceil(BLOCK) as u32).collect(),
        want_logits: true,
    });
    b
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> Result<()> {
    let model = std::env::var_os("PRISM_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/gemma-3-270m-q4_k_m.gguf")
    });
    let tokens = env("PRISM_BENCH_DECODE_TOKENS", 64);
    let rounds = env("PRISM_BENCH_ROUNDS", 3);
    let m = load_model_with(&ModelSource::detect(&model)?, None, LoadOptions { keep_quantized: true })?;
    let vocab = m.config.vocab_size as u32;
    if std::env::var_os("PRISM_BENCH_KERNELS").is_some() {
        kernels(&m.weights);
    }
    let mut be = CpuBackend::new(m.weights, &m.config, 64 << 20, BLOCK)?;
    println!("model: {} ({} rayon threads)", model.display(), rayon::current_num_threads());
    let prompt: Vec<u32> = (0..16).map(|i| 1000 + i * 37).collect();
    for round in 0..rounds {
        let mut tok = argmax(&be.forward(&step(&prompt, 0))?.data);
        let mut steps = Vec::with_capacity(tokens);
        for i in 0..tokens {
            let t = Instant::now();
            let logits = be.forward(&step(&[tok], prompt.len() + i))?;
            tok = argmax(&logits.data) % vocab;
            steps.push(t.elapsed());
        }
        steps.sort();
        let median = steps[steps.len() / 2];
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        println!(
            "round {round}: decode step median {:.2} ms (best {:.2} ms) = {:.1} tokens/s",
            ms(median),
            ms(steps[0]),
            1.0 / median.as_secs_f64()
        );
    }
    let long: Vec<u32> = (0..512).map(|i| 1000 + (i * 7919) % 50_000).collect();
    let t = Instant::now();
    be.forward(&step(&long, 0))?;
    println!("prefill, 512 tokens: {:.0} tokens/s", 512.0 / t.elapsed().as_secs_f64());
    Ok(())
}

/// Batch-1 time of each matrix kind of the model (as the CPU backend packs it: ggml
/// numerics' 8-bit activations), every layer's copy in turn so the weights stream from
/// memory as in a decode step; prints µs per call and weight GB/s.
fn kernels(w: &prism_engine::model::LlamaWeights) {
    use prism_engine::backend::cpu::qmatmul::{PackedWeight, matmul};
    let kinds: [(&str, fn(&prism_engine::model::LayerWeights) -> Vec<prism_engine::model::Linear>); 4] = [
        ("qkv", |l| vec![l.q_proj.clone(), l.k_proj.clone(), l.v_proj.clone()]),
        ("o_proj", |l| vec![l.o_proj.clone()]),
        ("gate_up", |l| vec![l.gate_proj.clone(), l.up_proj.clone()]),
        ("down", |l| vec![l.down_proj.clone()]),
    ];
    let mut sets: Vec<(String, Vec<PackedWeight>)> = kinds
        .iter()
        .map(|(name, parts)| (name.to_string(), w.layers.iter().map(|l| PackedWeight::stack_q8(parts(l))).collect()))
        .collect();
    sets.push(("lm_head".into(), vec![PackedWeight::stack_q8(vec![w.embed_tokens.clone()])]));
    println!("| matrix | out × inp | µs per call | weight GB/s |");
    println!("| --- | --- | --- | --- |");
    for (name, ws) in &sets {
        let inp = w.embed_tokens.in_features.max(ws[0].out_features().min(0));
        let inp = match name.as_str() {
            "o_proj" => w.layers[0].o_proj.in_features,
            "down" => w.layers[0].down_proj.in_features,
            _ => inp,
        };
        let x: Vec<f32> = (0..inp).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
        let mut y = vec![0f32; ws[0].out_features()];
        let reps = (400 / ws.len()).max(1);
        let mut best = f64::INFINITY;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                for p in ws {
                    matmul(&x, 1, p, &mut y);
                }
            }
            best = best.min(t.elapsed().as_secs_f64() / (reps * ws.len()) as f64);
        }
        let bytes = ws[0].size_bytes() as f64;
        println!("| {name} | {} × {inp} | {:.1} | {:.1} |", ws[0].out_features(), best * 1e6, bytes / best / 1e9);
    }
}
