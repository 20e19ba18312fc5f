//! Step-time overhead of structured outputs on the CPU backend: aggregate decode tokens/s
//! of `batch` sequences constrained by a JSON schema against the same sequences
//! unconstrained, in one run, at batch 1 and 32. Runs alternate free, json, json, free so
//! that drift in the machine's load cancels out of the means. The schema needs more tokens
//! than are generated (an array of at least 64 strings), so no constrained sequence ends
//! early and every step carries the same rows.
//!
//! Run: `cargo bench -p prism-engine --bench structured`. Env: `PRISM_MODEL` (default: the
//! bundled GGUF), `PRISM_BENCH_DECODE_TOKENS` (default 48).

use anyhow::{Context, Result};
use prism_engine::{EngineConfig, EngineHandle, EngineRequest, Prompt, SamplingParams, StructuredOutput};
use std::path::PathBuf;
use std::time::Instant;

const SCHEMA: &str = r#"{"type": "object", "properties": {
  "title": {"type": "string", "maxLength": 40},
  "notes": {"type": "array", "minItems": 64, "items": {"type": "string", "maxLength": 24}}},
  "required": ["title", "notes"], "additionalProperties": false}"#;

fn request(prompt: Vec<u32>, max_tokens: i64, json: bool) -> EngineRequest {
    EngineRequest {
        id: "bench".into(),
        prompt: Prompt::TokenIds(prompt),
        params: SamplingParams {
            temperature: 0.0,
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            structured: json.then(|| StructuredOutput::JsonSchema(SCHEMA.to_owned())),
            ..SamplingParams::default()
        },
        prior_output_ids: Vec::new(),
        deadline: None,
        cache_salt: None,
        tools: None,
        chat_template_kwargs: None,
    }
}

/// Aggregate decode tokens/s of `batch` concurrent sequences after every one has its first
/// token, and how many tokens each generated.
fn decode(e: &EngineHandle, prompt: &[u32], batch: usize, tokens: i64, json: bool) -> Result<(f64, usize)> {
    let handles: Vec<_> = (0..batch)
        .map(|_| {
            let mut s = e.submit(request(prompt.to_vec(), tokens, json))?;
            Ok(std::thread::spawn(move || {
                let mut times = Vec::new();
                while let Some(o) = s.blocking_recv() {
                    let now = Instant::now();
                    times.extend(std::iter::repeat_n(now, o.token_ids.len()));
                }
                times
            }))
        })
        .collect::<Result<_>>()?;
    let runs: Vec<Vec<Instant>> = handles.into_iter().map(|h| h.join().unwrap_or_default()).collect();
    let start = runs.iter().filter_map(|r| r.first()).max().copied().context("no tokens")?;
    let end = runs.iter().filter_map(|r| r.last()).max().copied().context("no tokens")?;
    let after: usize = runs.iter().map(|r| r.iter().filter(|t| **t > start).count()).sum();
    let min_len = runs.iter().map(Vec::len).min().unwrap_or(0);
    Ok((after as f64 / (end - start).as_secs_f64(), min_len))
}

fn main() -> Result<()> {
    let model = std::env::var_os("PRISM_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    let tokens: i64 = std::env::var("PRISM_BENCH_DECODE_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(48);
    let mut cfg = EngineConfig::new(&model);
    cfg.max_num_seqs = 64;
    cfg.enable_prefix_caching = false;
    let e = EngineHandle::start(cfg, None)?;
    let prompt = e.codec().encode("Write a JSON object with a title and a list of notes about lighthouses:", false)?;
    // Warm-up: page in weights, build the grammar compiler, size buffers.
    decode(&e, &prompt, 2, 8, true)?;
    decode(&e, &prompt, 2, 8, false)?;
    println!("model: {} ({} threads)", model.display(), std::thread::available_parallelism().map_or(1, usize::from));
    println!("| batch | free tokens/s | JSON-schema tokens/s | step-time overhead |");
    println!("| --- | --- | --- | --- |");
    for batch in [1usize, 32] {
        let (mut free, mut json) = (Vec::new(), Vec::new());
        for constrained in [false, true, true, false] {
            let (tps, min_len) = decode(&e, &prompt, batch, tokens, constrained)?;
            anyhow::ensure!(min_len == tokens as usize, "a sequence ended early ({min_len} < {tokens} tokens)");
            if constrained { json.push(tps) } else { free.push(tps) }
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let (f, j) = (mean(&free), mean(&json));
        println!(
            "| {batch} | {f:.1} | {j:.1} | {:+.1}% (runs free {free:.1?}, json {json:.1?}) |",
            (f / j - 1.0) * 100.0
        );
    }
    e.shutdown();
    Ok(())
}
