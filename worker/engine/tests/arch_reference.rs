//! The non-Llama architectures on the CPU backend against Hugging Face transformers: each
//! fixture under `tests/fixtures/arch/` (Qwen2, Qwen3, Mistral with a sliding window, Gemma 3
//! with local and global layers) is a seeded-random checkpoint written by
//! `tests/reference/hf_arch_reference.py` with transformers' last-token logits for a short
//! prompt and for one longer than the sliding window, and the logits of greedy decode steps
//! after it. The engine must match them within 1e-4 and pick the same greedy tokens, prefilled
//! at once, in chunks, and decoded token by token. The same weights as GGUF files
//! (`tests/fixtures/arch/<name>.gguf`, laid out as llama.cpp's converter does: `qwen2`, `qwen3`,
//! `gemma3`, and `llama` with permuted Q/K for Mistral) must give the script's `gguf_logits`.

use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use prism_engine::backend::cpu::CpuBackend;
use prism_engine::backend::{Backend, SeqStep, StepBatch};
use prism_engine::model::{Activation, Architecture, LoadedModel, ModelSource, load_model};

const BOUND: f64 = 1e-4;
const BLOCK: usize = 4;

fn fixture_dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/arch").join(name)
}

fn load(name: &str) -> Result<(LoadedModel, serde_json::Value)> {
    let dir = fixture_dir(name);
    let model = load_model(&ModelSource::detect(&dir)?, None)?;
    let p = dir.join("reference.json");
    let reference = serde_json::from_str(&std::fs::read_to_string(&p).with_context(|| p.display().to_string())?)?;
    Ok((model, reference))
}

fn ids(v: &serde_json::Value) -> Result<Vec<u32>> {
    v.as_array().context("not an array")?.iter().map(|x| x.as_u64().map(|x| x as u32).context("not an id")).collect()
}

fn floats(v: &serde_json::Value) -> Result<Vec<f64>> {
    v.as_array().context("not an array")?.iter().map(|x| x.as_f64().context("not a number")).collect()
}

/// Tokens `tokens` at positions `start..` of one sequence in blocks `first_block..`.
fn seq_step(batch: &mut StepBatch, tokens: &[u32], start: usize, first_block: u32, want: bool) {
    let ctx = start + tokens.len();
    let blocks: Vec<u32> = (0..ctx.div_ceil(BLOCK) as u32).map(|b| first_block + b).collect();
    let qs = batch.token_ids.len();
    for (i, &t) in tokens.iter().enumerate() {
        let p = start + i;
        batch.token_ids.push(t);
        batch.positions.push(p as u32);
        batch.slot_mapping.push(blocks[p / BLOCK] * BLOCK as u32 + (p % BLOCK) as u32);
    }
    batch.seqs.push(SeqStep {
        query_start: qs,
        query_len: tokens.len(),
        context_len: ctx,
        block_table: blocks,
        want_logits: want,
    });
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0usize, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0 as u32
}

fn check_row(what: &str, got: &[f32], want: &[f64]) -> Result<()> {
    ensure!(got.len() == want.len(), "{what}: {} logits, reference has {}", got.len(), want.len());
    let d = got.iter().zip(want).map(|(x, y)| (f64::from(*x) - y).abs()).fold(0.0, f64::max);
    ensure!(d <= BOUND, "{what}: max |Δlogit| {d} > {BOUND}");
    let want_top =
        want.iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
    ensure!(argmax(got) as usize == want_top, "{what}: greedy token {} != {want_top}", argmax(got));
    Ok(())
}

/// Prefill at once, prefill in chunks (3 then the rest, in other blocks) and greedy decode
/// after the long prompt, against the fixture.
fn check_fixture(name: &str) -> Result<LoadedModel> {
    let (model, reference) = load(name)?;
    let cfg = model.config.clone();
    let mut backend = CpuBackend::new(model.weights.clone(), &cfg, 1 << 20, BLOCK)?;
    let prompts = reference["prompts"].as_array().context("prompts")?;
    let logits = reference["logits"].as_array().context("logits")?;
    for (i, (p, want)) in prompts.iter().zip(logits).enumerate() {
        let prompt = ids(p)?;
        let want = floats(want)?;
        let mut b = StepBatch::default();
        seq_step(&mut b, &prompt, 0, 0, true);
        check_row(&format!("{name} prompt {i} prefill"), backend.forward(&b)?.row(0), &want)?;
        let mut b = StepBatch::default();
        seq_step(&mut b, &prompt[..3], 0, 100, false);
        backend.forward(&b)?;
        let mut b = StepBatch::default();
        seq_step(&mut b, &prompt[3..], 3, 100, true);
        check_row(&format!("{name} prompt {i} chunked prefill"), backend.forward(&b)?.row(0), &want)?;
    }
    let long = ids(&prompts[1])?;
    let mut b = StepBatch::default();
    seq_step(&mut b, &long, 0, 0, true);
    backend.forward(&b)?;
    let steps = reference["decode_logits"].as_array().context("decode_logits")?;
    for (s, step) in steps.iter().enumerate() {
        let token = step["token"].as_u64().context("token")? as u32;
        let mut b = StepBatch::default();
        seq_step(&mut b, &[token], long.len() + s, 0, true);
        check_row(&format!("{name} decode step {s}"), backend.forward(&b)?.row(0), &floats(&step["logits"])?)?;
    }
    Ok(model)
}

/// The GGUF file of fixture `name` against `gguf_logits` (prefill at once and in chunks).
fn check_gguf(name: &str) -> Result<LoadedModel> {
    let path = fixture_dir(name).with_extension("gguf");
    let model = load_model(&ModelSource::detect(&path)?, None)?;
    let p = fixture_dir(name).join("reference.json");
    let reference: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p)?)?;
    let cfg = model.config.clone();
    let mut backend = CpuBackend::new(model.weights.clone(), &cfg, 1 << 20, BLOCK)?;
    let prompts = reference["prompts"].as_array().context("prompts")?;
    let logits = reference["gguf_logits"].as_array().context("gguf_logits")?;
    for (i, (p, want)) in prompts.iter().zip(logits).enumerate() {
        let prompt = ids(p)?;
        let want = floats(want)?;
        let mut b = StepBatch::default();
        seq_step(&mut b, &prompt, 0, 0, true);
        check_row(&format!("{name}.gguf prompt {i} prefill"), backend.forward(&b)?.row(0), &want)?;
        let mut b = StepBatch::default();
        seq_step(&mut b, &prompt[..3], 0, 100, false);
        backend.forward(&b)?;
        let mut b = StepBatch::default();
        seq_step(&mut b, &prompt[3..], 3, 100, true);
        check_row(&format!("{name}.gguf prompt {i} chunked prefill"), backend.forward(&b)?.row(0), &want)?;
    }
    Ok(model)
}

#[test]
fn gguf_files_match_transformers() -> Result<()> {
    for (name, arch) in [
        ("qwen2", Architecture::Qwen2),
        ("qwen3", Architecture::Qwen3),
        ("mistral", Architecture::Llama),
        ("gemma3", Architecture::Gemma3),
    ] {
        let m = check_gguf(name)?;
        assert_eq!(m.config.arch.architecture, arch, "{name}");
    }
    let g = check_gguf("gemma3")?;
    let windows: Vec<_> = g.config.arch.layers.iter().map(|l| l.sliding_window).collect();
    assert_eq!(windows, [Some(8), Some(8), None, Some(8)]);
    assert_eq!(g.config.arch.norm_weight_offset, 0.0, "llama.cpp's converter stored 1 + w");
    assert_eq!(check_gguf("mistral")?.config.uniform_sliding_window(), Some(8));
    Ok(())
}

#[test]
fn qwen2_matches_transformers() -> Result<()> {
    let m = check_fixture("qwen2")?;
    assert_eq!(m.config.arch.architecture, Architecture::Qwen2);
    assert!(m.config.arch.attention_bias && m.weights.layers[0].qkv_bias.is_some());
    assert!(m.config.tie_word_embeddings);
    Ok(())
}

#[test]
fn qwen3_matches_transformers() -> Result<()> {
    let m = check_fixture("qwen3")?;
    assert_eq!(m.config.arch.architecture, Architecture::Qwen3);
    assert!(m.config.arch.qk_norm && !m.config.arch.attention_bias);
    assert_eq!(m.config.q_dim(), 64, "head_dim 16 × 4 heads, wider than hidden 32");
    Ok(())
}

#[test]
fn mistral_matches_transformers_with_a_sliding_window() -> Result<()> {
    let m = check_fixture("mistral")?;
    assert_eq!(m.config.arch.architecture, Architecture::Mistral);
    assert_eq!(m.config.uniform_sliding_window(), Some(8));
    Ok(())
}

#[test]
fn gemma3_matches_transformers_with_local_and_global_layers() -> Result<()> {
    let m = check_fixture("gemma3")?;
    let a = &m.config.arch;
    assert_eq!(a.architecture, Architecture::Gemma3);
    assert_eq!(a.hidden_activation, Activation::GeluTanh);
    assert_eq!(a.embedding_scale, Some(32f32.sqrt()));
    assert_eq!(a.query_pre_attn_scalar, Some(24.0));
    let windows: Vec<_> = a.layers.iter().map(|l| l.sliding_window).collect();
    assert_eq!(windows, [Some(8), Some(8), None, Some(8)]);
    let thetas: Vec<_> = a.layers.iter().map(|l| l.rope_theta).collect();
    assert_eq!(thetas, [10_000.0, 10_000.0, 1_000_000.0, 10_000.0]);
    assert_eq!(m.config.uniform_sliding_window(), None, "the global layer reads the whole context");
    Ok(())
}

#[test]
fn unknown_architectures_are_named() -> Result<()> {
    let dir = std::env::temp_dir().join(format!("prism-arch-unknown-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture_dir("qwen2").join(f), dir.join(f))?;
    }
    let cfg = std::fs::read_to_string(fixture_dir("qwen2").join("config.json"))?
        .replace("Qwen2ForCausalLM", "FalconForCausalLM");
    std::fs::write(dir.join("config.json"), cfg)?;
    let err = load_model(&ModelSource::detect(&dir)?, None).err().context("an unknown architecture must not load")?;
    std::fs::remove_dir_all(&dir)?;
    let msg = err.to_string();
    assert!(msg.contains("architectures") && msg.contains("FalconForCausalLM"), "{msg}");
    assert!(msg.contains("Gemma3ForCausalLM"), "the message lists the supported ones: {msg}");
    Ok(())
}
