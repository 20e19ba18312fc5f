//! Batch-1 greedy decode straight on the CPU backend (no engine, scheduler, sampler or
//! detokenizer): a 16-token prompt prefilled in one step, then one token per step, each
//! step's forward and argmax timed. Prints the median and best step in ms and the decode
//! tokens/s of the median, then one 512-token prefill. A quick figure for kernel work; the
//! engine's own (`benches/engine.rs`) adds the per-token engine overheads.
//!
//! Run: `cargo bench -p prism-engine --profile dev --bench cpu_decode`. Env: `PRISM_MODEL`
//! (default `models/gemma-3-270m-q4_k_m.gguf`), `PRISM_BENCH_DECODE_TOKENS` (default 64),
//! `PRISM_BENCH_ROUNDS` (decode runs from the same prompt, default 3), `PRISM_BENCH_AB`
//! (set: odd rounds run with `PRISM_CPU_NO_AVX512=1`, the AVX2 kernels),
//! `PRISM_BENCH_KERNELS` (set: first a table of each matrix kind's batch-1 time).

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

/// Sets or clears `PRISM_CPU_NO_AVX512` (read by the kernels on every product).
fn set_avx2(on: bool) {
    // SAFETY: set between products, while no other thread of the bench reads the
    // environment (rayon's workers are idle).
    unsafe {
        match on {
            true => std::env::set_var("PRISM_CPU_NO_AVX512", "1"),
            false => std::env::remove_var("PRISM_CPU_NO_AVX512"),
        }
    }
}

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() -> Result<()> {
    let model = std::env::var_os("PRISM_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/gemma-3-270m-q4_k_m.gguf"));
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
    let ab = std::env::var_os("PRISM_BENCH_AB").is_some();
    for round in 0..rounds {
        let avx2 = ab && round % 2 == 1;
        if ab {
            set_avx2(avx2);
        }
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
            "round {round}{}: decode step median {:.2} ms (best {:.2} ms) = {:.1} tokens/s",
            if avx2 { " (AVX2)" } else { "" },
            ms(median),
            ms(steps[0]),
            1.0 / median.as_secs_f64()
        );
    }
    let long: Vec<u32> = (0..512).map(|i| 1000 + (i * 7919) % 50_000).collect();
    for avx2 in if ab { vec![false, true] } else { vec![false] } {
        set_avx2(avx2);
        let t = Instant::now();
        be.forward(&step(&long, 0))?;
        let tps = 512.0 / t.elapsed().as_secs_f64();
        println!("prefill, 512 tokens{}: {tps:.0} tokens/s", if avx2 { " (AVX2)" } else { "" });
    }
    Ok(())
}

/// Batch-1 time of each matrix kind of the model (as the CPU backend packs it: ggml
/// numerics' 8-bit activations), every layer's copy in turn so the weights stream from
/// memory as in a decode step: µs per call (fastest of seven rounds) and weight GB/s, with
/// the CPU's best kernels and with `PRISM_CPU_NO_AVX512=1` (AVX2), rounds alternating
/// between the two so that the machine's load hits both alike.
fn kernels(w: &prism_engine::model::LlamaWeights) {
    use prism_engine::backend::cpu::qmatmul::{PackedWeight, matmul};
    use prism_engine::model::{LayerWeights, Linear};
    type Parts = fn(&LayerWeights) -> Vec<Linear>;
    let kinds: [(&str, Parts); 4] = [
        ("qkv", |l| vec![l.q_proj.clone(), l.k_proj.clone(), l.v_proj.clone()]),
        ("o_proj", |l| vec![l.o_proj.clone()]),
        ("gate_up", |l| vec![l.gate_proj.clone(), l.up_proj.clone()]),
        ("down", |l| vec![l.down_proj.clone()]),
    ];
    let mut sets: Vec<(&str, usize, Vec<PackedWeight>)> = kinds
        .iter()
        .map(|(name, parts)| {
            let inp = parts(&w.layers[0])[0].in_features;
            (*name, inp, w.layers.iter().map(|l| PackedWeight::stack_q8(parts(l))).collect())
        })
        .collect();
    sets.push(("lm_head", w.embed_tokens.in_features, vec![PackedWeight::stack_q8(vec![w.embed_tokens.clone()])]));
    let no_avx512 = std::env::var_os("PRISM_CPU_NO_AVX512");
    println!("| matrix | out × inp | µs per call (best) | µs per call (AVX2) | GB/s (best) | GB/s (AVX2) |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (name, inp, ws) in &sets {
        let x: Vec<f32> = (0..*inp).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
        let mut y = vec![0f32; ws[0].out_features()];
        let t = Instant::now();
        for p in ws {
            matmul(&x, 1, p, &mut y);
        }
        // About 0.1 s per round.
        let reps = (0.1 / t.elapsed().as_secs_f64()).ceil() as usize;
        let mut best = [f64::INFINITY; 2];
        for round in 0..14 {
            set_avx2(round % 2 == 1);
            let t = Instant::now();
            for _ in 0..reps {
                for p in ws {
                    matmul(&x, 1, p, &mut y);
                }
            }
            let b = &mut best[round % 2];
            *b = b.min(t.elapsed().as_secs_f64() / (reps * ws.len()) as f64);
        }
        let gbs = |s: f64| ws[0].size_bytes() as f64 / s / 1e9;
        println!(
            "| {name} | {} × {inp} | {:.1} | {:.1} | {:.1} | {:.1} |",
            ws[0].out_features(),
            best[0] * 1e6,
            best[1] * 1e6,
            gbs(best[0]),
            gbs(best[1])
        );
    }
    set_avx2(no_avx512.is_some());
}
