//! Correctness check of the CUDA backend on the model families (Qwen2, Qwen3, Mistral, Gemma 3)
//! against Hugging Face (run on the GPU machine after `scripts/gpu/hf_arch_cuda.py DIR`; built
//! with `--features cuda`).
//!
//! `cargo run --release -p prism-engine --features cuda --example cuda_arch_check -- DIR OUT.json`
//!
//! For each `DIR/<name>/` (seeded random weights, bf16 safetensors, reference.json with HF's
//! last-token logits in f32 and bf16 and the bound `2 · e_hf + 0.01` of `hf_reference.py`) and in
//! both backend modes (batch-invariant from the loaded f32 host weights, fast straight from the
//! safetensors): each prompt's last-token logits (a) from one prefill step of the whole prompt
//! and (b) from a prefill of all but the last token followed by a one-token decode step must be
//! within the bound of HF f32. Prints one line per prompt and `cuda_arch_check: PASS|FAIL`;
//! writes a JSON report to OUT.json; exits 1 on failure.

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    check::main()
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_arch_check needs --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
mod check {
    use anyhow::Context;
    use prism_engine::backend::cuda::{CudaBackend, CudaOptions};
    use prism_engine::backend::{Backend, SeqStep, StepBatch};
    use prism_engine::model::{ModelSource, load_model};
    use serde_json::{Value, json};
    use std::path::{Path, PathBuf};

    const BS: usize = 16;
    const NAMES: [&str; 4] = ["qwen2", "qwen3", "mistral", "gemma3"];

    /// One step over `tokens[ctx - qlen..ctx]` of a sequence whose blocks start at `first_block`.
    fn step(tokens: &[u32], ctx: usize, qlen: usize, first_block: u32, want: bool) -> StepBatch {
        let mut b = StepBatch::default();
        let blocks: Vec<u32> = (first_block..first_block + ctx.div_ceil(BS) as u32).collect();
        for p in ctx - qlen..ctx {
            b.token_ids.push(tokens[p]);
            b.positions.push(p as u32);
            b.slot_mapping.push(blocks[p / BS] * BS as u32 + (p % BS) as u32);
        }
        b.seqs.push(SeqStep {
            query_start: 0,
            query_len: qlen,
            context_len: ctx,
            block_table: blocks,
            want_logits: want,
        });
        b
    }

    fn max_abs(a: &[f32], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(x, y)| (f64::from(*x) - y).abs()).fold(0.0, f64::max)
    }

    fn check_model(dir: &Path) -> anyhow::Result<(Value, bool)> {
        let r: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
        let prompts: Vec<Vec<u32>> = serde_json::from_value(r["prompts"].clone())?;
        let f32s: Vec<Vec<f64>> = serde_json::from_value(r["logits_f32"].clone())?;
        let bound = r["bound"].as_f64().context("bound")?;
        let loaded = load_model(&ModelSource::detect(dir)?, None)?;
        let c = &loaded.config;
        let mut modes = Vec::new();
        let mut pass = true;
        for invariant in [true, false] {
            let mode = if invariant { "batch-invariant" } else { "fast" };
            let opts = CudaOptions {
                kv_cache_bytes: Some(64 << 20),
                block_size: BS,
                max_num_batched_tokens: 1024,
                max_num_seqs: 8,
                batch_invariant: invariant,
                ..CudaOptions::default()
            };
            let mut cuda = if invariant {
                CudaBackend::new(loaded.weights.clone(), c, &opts)?
            } else {
                let m = prism_engine::model::safetensors::open_dir_model(dir)?;
                CudaBackend::from_safetensors(&m.files, &m.config, &opts, &|_, _| {})?
            };
            let mut rows = Vec::new();
            for (i, p) in prompts.iter().enumerate() {
                let n = p.len();
                // Each prompt twice, in its own blocks: 32 blocks (512 positions) per run.
                let (b0, b1) = ((2 * i * 32) as u32, ((2 * i + 1) * 32) as u32);
                let lg = cuda.forward(&step(p, n, n, b0, true))?;
                let e_prefill = max_abs(lg.row(0), &f32s[i]);
                let e_decode = if n > 1 {
                    cuda.forward(&step(p, n - 1, n - 1, b1, false))?;
                    let lg = cuda.forward(&step(p, n, 1, b1, true))?;
                    max_abs(lg.row(0), &f32s[i])
                } else {
                    e_prefill
                };
                let ok = e_prefill <= bound && e_decode <= bound;
                pass &= ok;
                println!(
                    "{} / {mode} prompt {i} ({n} tokens): max |CUDA - HF f32| prefill {e_prefill:.4}, decode \
                     {e_decode:.4} (bound {bound:.4}) {}",
                    c.arch.architecture.hf_name(),
                    if ok { "ok" } else { "FAIL" }
                );
                rows.push(json!({"len": n, "prefill": e_prefill, "decode": e_decode, "ok": ok}));
            }
            modes.push(json!({"mode": mode, "prompts": rows}));
        }
        Ok((
            json!({"bound": bound, "hf_bf16_vs_f32_max_abs": r["hf_bf16_vs_f32_max_abs"], "modes": modes, "pass": pass}),
            pass,
        ))
    }

    pub fn main() -> anyhow::Result<()> {
        let args: Vec<String> = std::env::args().collect();
        let dir = PathBuf::from(args.get(1).context("usage: cuda_arch_check DIR OUT.json")?);
        let out = PathBuf::from(args.get(2).context("usage: cuda_arch_check DIR OUT.json")?);
        let mut report = serde_json::Map::new();
        let mut pass = true;
        for name in NAMES {
            match check_model(&dir.join(name)) {
                Ok((v, ok)) => {
                    println!("cuda_arch_check {name}: {}", if ok { "PASS" } else { "FAIL" });
                    report.insert(name.into(), v);
                    pass &= ok;
                }
                Err(e) => {
                    println!("cuda_arch_check {name}: ERROR {e:#} -> FAIL");
                    report.insert(name.into(), json!({"error": format!("{e:#}"), "pass": false}));
                    pass = false;
                }
            }
        }
        report.insert("pass".into(), json!(pass));
        std::fs::write(&out, serde_json::to_string_pretty(&Value::Object(report))?)?;
        println!("cuda_arch_check: {}", if pass { "PASS" } else { "FAIL" });
        if !pass {
            std::process::exit(1);
        }
        Ok(())
    }
}
