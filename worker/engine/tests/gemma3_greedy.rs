//! Gemma 3 270M (`models/gemma-3-270m-q4_k_m.gguf`, `scripts/fetch-gemma.sh`) greedy
//! decoding on the CPU backend against llama.cpp's (`tests/fixtures/gemma3_reference.json`,
//! `tests/reference/gemma_reference.py`): the model's K-quant matrices select ggml's
//! numerics (8-bit activations, f16 K/V, GELU table), so the argmax continuation of the
//! fixture prompts is llama.cpp's, token for token, up to the same end-of-turn (one prompt,
//! where llama.cpp itself parts at a near-tie, is compared up to it: [`NEAR_TIES`]).
//!
//! Prompts are prefilled in one step and decoded one token per step, as the engine does;
//! the fixture's prompt ids are llama.cpp's (the tokenizer is checked by `gemma3_codec`).
//! Skipped (with a notice) when the file is missing, unless `PRISM_REQUIRE_MODEL` is set.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use prism_engine::backend::cpu::CpuBackend;
use prism_engine::backend::{Backend, SeqStep, StepBatch};
use prism_engine::model::{LoadOptions, ModelSource, load_model_with};
use serde_json::Value;

const BLOCK: usize = 16;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn ids(v: &Value) -> Result<Vec<u32>> {
    v.as_array().context("not an array")?.iter().map(|x| x.as_u64().map(|x| x as u32).context("not an id")).collect()
}

/// One step of one sequence: `tokens` at positions `start..`, blocks `0..` in order.
fn step(tokens: &[u32], start: usize) -> StepBatch {
    let ctx = start + tokens.len();
    let table: Vec<u32> = (0..ctx.div_ceil(BLOCK) as u32).collect();
    let mut b = StepBatch::default();
    for (i, &t) in tokens.iter().enumerate() {
        let p = start + i;
        b.token_ids.push(t);
        b.positions.push(p as u32);
        b.slot_mapping.push((p / BLOCK * BLOCK + p % BLOCK) as u32);
    }
    b.seqs.push(SeqStep {
        query_start: 0,
        query_len: tokens.len(),
        context_len: ctx,
        block_table: table,
        want_logits: true,
    });
    b
}

/// First index of the largest logit (numpy's argmax).
fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// Prompts (their last message or text) where llama.cpp's own greedy parts at a near-tie,
/// and how many new tokens are compared there: at the 8th new token of this chat,
/// llama.cpp's token-by-token decode puts token 144096 0.015 logits above 217716 and its
/// batched evaluation of the same sequence puts 217716 0.04 above (its kernels differ by
/// batch size); Prism, close to but not bit for bit llama.cpp, takes 217716.
const NEAR_TIES: &[(&str, usize)] = &[("What is the capital of France?", 7)];

#[test]
fn gemma3_greedy_equals_llama_cpp() -> Result<()> {
    let path = repo_root().join("models/gemma-3-270m-q4_k_m.gguf");
    if !path.exists() {
        if std::env::var_os("PRISM_REQUIRE_MODEL").is_some() {
            bail!("{} is missing and PRISM_REQUIRE_MODEL is set (run scripts/fetch-gemma.sh)", path.display());
        }
        eprintln!("SKIPPED: {} not found (run scripts/fetch-gemma.sh)", path.display());
        return Ok(());
    }
    let fx_path = repo_root().join("tests/fixtures/gemma3_reference.json");
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(&fx_path)?)?;
    let new_tokens = fx["new_tokens"].as_u64().context("new_tokens")? as usize;
    let m = load_model_with(&ModelSource::detect(&path)?, None, LoadOptions { keep_quantized: true })?;
    let eos = m.config.eos_token_ids.clone();
    let mut be = CpuBackend::new(m.weights, &m.config, 64 << 20, BLOCK)?;
    let mut report = Vec::new();
    let mut all = true;
    for p in fx["prompts"].as_array().context("prompts")? {
        let prompt = ids(&p["prompt_ids"])?;
        let want = ids(&p["greedy_ids"])?;
        let mut got = Vec::new();
        let mut logits = be.forward(&step(&prompt, 0))?;
        while got.len() < new_tokens {
            let tok = argmax(&logits.data);
            if eos.contains(&tok) {
                break;
            }
            got.push(tok);
            logits = be.forward(&step(&[tok], prompt.len() + got.len() - 1))?;
        }
        let same = got.iter().zip(&want).take_while(|(a, b)| a == b).count();
        let last = p["messages"].as_array().and_then(|m| m.last()).map_or(&p["text"], |m| &m["content"]);
        all &= match NEAR_TIES.iter().find(|(t, _)| last.as_str() == Some(*t)) {
            Some((_, k)) => same >= *k,
            None => got == want,
        };
        report.push(format!(
            "{:?}: {same}/{} equal (got {}, llama.cpp {})",
            p["text"],
            want.len(),
            got.len(),
            want.len()
        ));
    }
    eprintln!("{}", report.join("\n"));
    assert!(all, "greedy ids differ from llama.cpp's:\n{}", report.join("\n"));
    Ok(())
}
