//! Tensor parallelism on CUDA (two GPUs, NCCL) against Hugging Face, on the trained reference
//! model that `scripts/gpu/hf_reference.py DIR` writes to `DIR/trained` (clear greedy margins).
//!
//! `cuda_tp_check DIR/trained OUT.json` (needs 2 GPUs):
//! 1. backend level: `CudaTpBackend` over devices 0 and 1 prefills each of the 8 prompts alone;
//!    last-token logits must be within the reference's bound of HF f32 (`2·e_hf + 0.01`);
//! 2. engine level: an `EngineHandle` with `BackendKind::Cuda { devices: [0, 1] }` (the path a
//!    worker takes for a GPU group) runs all 8 prompts together, 64 greedy tokens each, which
//!    must equal HF f32's exactly.
//!
//! Exits 1 on any failure.

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    check::main()
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_tp_check needs --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
mod check {
    use anyhow::{Context, Result, bail};
    use prism_engine::backend::cuda::CudaOptions;
    use prism_engine::backend::cuda::tp::CudaTpBackend;
    use prism_engine::backend::{Backend, SeqStep, StepBatch};
    use prism_engine::model::{ModelSource, load_model};
    use prism_engine::{BackendKind, EngineConfig, EngineHandle, EngineRequest, Prompt, SamplingParams};
    use serde_json::{Value, json};
    use std::path::PathBuf;

    const BS: usize = 16;
    const NEW: usize = 64;

    fn col<T: serde::de::DeserializeOwned>(v: &Value, k: &str) -> Result<T> {
        serde_json::from_value(v.get(k).cloned().with_context(|| format!("reference.json has no {k}"))?)
            .with_context(|| format!("reference.json {k}"))
    }

    pub fn main() -> Result<()> {
        let mut args = std::env::args().skip(1);
        let dir = PathBuf::from(args.next().context("usage: cuda_tp_check MODEL_DIR [OUT.json]")?);
        let out = args.next().unwrap_or_else(|| "cuda_tp_check.json".into());
        let v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json"))?)?;
        let prompts: Vec<Vec<u32>> = col(&v, "prompts")?;
        let logits_f32: Vec<Vec<f64>> = col(&v, "logits_f32")?;
        let greedy_f32: Vec<Vec<u32>> = col(&v, "greedy_f32")?;
        let e_hf: f64 = col(&v, "hf_bf16_vs_f32_max_abs")?;
        let bound = 2.0 * e_hf + 0.01;
        let loaded = load_model(&ModelSource::detect(&dir)?, None)?;
        let c = &loaded.config;
        println!(
            "model: {} layers, hidden {}, {} heads / {} KV heads, FFN {}; tensor_parallel_size 2; logit bound {bound:.4}",
            c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.intermediate_size
        );
        let mut pass = true;

        // 1. Backend level: one prompt at a time, last-token logits vs HF f32.
        let opts = CudaOptions {
            block_size: BS,
            kv_cache_bytes: Some(64 << 20),
            max_num_seqs: 16,
            max_num_batched_tokens: 4096,
            ..CudaOptions::default()
        };
        let mut tp = CudaTpBackend::new(loaded.weights.clone(), c, &opts, &[0, 1])?;
        let mut errs = Vec::new();
        for (i, p) in prompts.iter().enumerate() {
            let blocks: Vec<u32> = (0..p.len().div_ceil(BS) as u32).collect();
            let mut b = StepBatch::default();
            for (pos, &t) in p.iter().enumerate() {
                b.token_ids.push(t);
                b.positions.push(pos as u32);
                b.slot_mapping.push(blocks[pos / BS] * BS as u32 + (pos % BS) as u32);
            }
            b.seqs.push(SeqStep {
                query_start: 0,
                query_len: p.len(),
                context_len: p.len(),
                block_table: blocks,
                want_logits: true,
            });
            let l = tp.forward(&b)?;
            let err = l.row(0).iter().zip(&logits_f32[i]).map(|(a, b)| (f64::from(*a) - b).abs()).fold(0.0, f64::max);
            let ok = err.is_finite() && err <= bound;
            pass &= ok;
            println!(
                "{} prompt {i} (len {}): max |tp2 - hf_f32| {err:.4} (bound {bound:.4})",
                if ok { "PASS" } else { "FAIL" },
                p.len()
            );
            errs.push(err);
        }
        drop(tp);

        // 2. Engine level: all prompts together through EngineHandle on a 2-GPU group.
        let mut cfg = EngineConfig::new(&dir);
        cfg.served_model_name = "tp2".into();
        cfg.backend = BackendKind::Cuda { devices: vec![0, 1] };
        cfg.gpu_memory_utilization = 0.2;
        let e = EngineHandle::start(cfg, None)?;
        let streams: Vec<_> = prompts
            .iter()
            .map(|p| {
                let params = SamplingParams {
                    temperature: 0.0,
                    max_tokens: Some(NEW as i64),
                    ignore_eos: true,
                    ..SamplingParams::default()
                };
                e.submit(EngineRequest {
                    id: "tp".into(),
                    prompt: Prompt::TokenIds(p.clone()),
                    params,
                    prior_output_ids: Vec::new(),
                    deadline: None,
                    cache_salt: None,
                })
            })
            .collect::<Result<_, _>>()?;
        let mut equal = Vec::new();
        for (i, mut s) in streams.into_iter().enumerate() {
            let mut toks: Vec<u32> = Vec::new();
            while let Some(o) = s.blocking_recv() {
                toks.extend(&o.token_ids);
            }
            let ok = toks == greedy_f32[i];
            pass &= ok;
            let first = toks.iter().zip(&greedy_f32[i]).position(|(a, b)| a != b);
            println!(
                "{} prompt {i}: {} greedy tokens through the engine on devices [0, 1] == HF f32: {ok} (first diff {first:?})",
                if ok { "PASS" } else { "FAIL" },
                toks.len()
            );
            equal.push(ok);
        }
        e.shutdown();
        let report = json!({"tensor_parallel_size": 2, "bound": bound, "max_abs_tp2_vs_hf_f32": errs, "greedy_equal_hf_f32": equal, "pass": pass});
        std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
        println!("cuda_tp_check: {}", if pass { "PASS" } else { "FAIL" });
        if !pass {
            bail!("tensor-parallel check failed");
        }
        Ok(())
    }
}
