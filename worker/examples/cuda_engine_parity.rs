//! The engine's "batching changes nothing" test body (`tests/engine_real_model.rs`) on the CUDA
//! backend, through the real engine (`EngineHandle`, `BackendKind::Cuda`), on the Hugging Face
//! random-weight model that `scripts/gpu/hf_reference.py DIR` writes (run on the GPU machine).
//!
//! `cargo run --release -p prism-worker --features cuda --example cuda_engine_parity -- DIR [OUT.json]`
//!
//! Greedy tokens (16 per prompt, five prompts of 9–200 tokens: the longer ones span several
//! 128-position attention chunks) must be identical:
//! 1. one request at a time (KV cache sized from `gpu_memory_utilization`);
//! 2. all five submitted together (continuous batching, decode steps replayed from CUDA graphs
//!    of a larger bucket);
//! 3. together with a 7-token step budget (chunked prefill mixed with decodes);
//! 4. together with a 16-block KV cache (the first four prompts fill it, their decodes need more
//!    blocks: preemption by recompute; at least one must happen).
//!
//! Exits 1 on any difference.

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    parity::main()
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_engine_parity needs --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
mod parity {
    use anyhow::{Context, Result, ensure};
    use prism_worker::engine::{BackendKind, EngineConfig, EngineHandle, EngineRequest, Prompt, SamplingParams};
    use serde_json::json;
    use std::path::PathBuf;
    use std::time::{Duration, Instant};

    const LENS: [usize; 5] = [9, 21, 45, 150, 200];
    const NEW: i64 = 16;

    fn prompts(vocab: usize) -> Vec<Vec<u32>> {
        LENS.iter()
            .enumerate()
            .map(|(i, &len)| (0..len).map(|p| ((p * 37 + i * 101 + 11) % (vocab - 4) + 3) as u32).collect())
            .collect()
    }

    fn start(dir: &PathBuf, tweak: impl FnOnce(&mut EngineConfig)) -> Result<EngineHandle> {
        let mut cfg = EngineConfig::new(dir);
        cfg.served_model_name = "hf-random".into();
        cfg.backend = BackendKind::Cuda { devices: vec![0] };
        cfg.gpu_memory_utilization = 0.2;
        tweak(&mut cfg);
        Ok(EngineHandle::start(cfg, None)?)
    }

    fn req(ids: &[u32]) -> EngineRequest {
        let params = SamplingParams { temperature: 0.0, max_tokens: Some(NEW), ignore_eos: true, ..SamplingParams::default() };
        EngineRequest {
            id: "parity".into(),
            prompt: Prompt::TokenIds(ids.to_vec()),
            params,
            prior_output_ids: Vec::new(),
            deadline: None,
        }
    }

    fn collect(mut s: prism_worker::engine::OutputStream) -> Vec<u32> {
        let mut toks = Vec::new();
        while let Some(o) = s.blocking_recv() {
            toks.extend(&o.token_ids);
        }
        toks
    }

    fn run(e: &EngineHandle, ps: &[Vec<u32>], together: bool) -> Result<Vec<Vec<u32>>> {
        if together {
            let streams: Vec<_> = ps.iter().map(|p| e.submit(req(p))).collect::<Result<_, _>>()?;
            Ok(streams.into_iter().map(collect).collect())
        } else {
            ps.iter().map(|p| Ok(collect(e.submit(req(p))?))).collect()
        }
    }

    fn wait_idle(e: &EngineHandle) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = e.stats();
            if s.requests_in_flight == 0 && s.running == 0 && s.waiting == 0 && s.free_blocks == s.total_blocks {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "engine did not return to idle: {s:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn main() -> Result<()> {
        let dir = PathBuf::from(std::env::args().nth(1).context("usage: cuda_engine_parity DIR [OUT.json]")?);
        let out = std::env::args().nth(2).map(PathBuf::from);
        let e = start(&dir, |_| {})?;
        let info = e.model_info();
        let ps = prompts(info.vocab_size);
        println!("engine on CUDA: {} KV blocks of {} tokens", info.num_kv_blocks, info.block_size);
        let alone = run(&e, &ps, false)?;
        ensure!(alone.iter().all(|t| t.len() == NEW as usize), "short output: {alone:?}");
        let batched = run(&e, &ps, true)?;
        wait_idle(&e)?;
        e.shutdown();

        let chunked_e = start(&dir, |c| c.max_num_batched_tokens = 7)?;
        let chunked = run(&chunked_e, &ps, true)?;
        wait_idle(&chunked_e)?;
        chunked_e.shutdown();

        let kv = 16 * 16 * info.kv_bytes_per_token as u64;
        let tiny = start(&dir, |c| c.kv_cache_bytes = Some(kv))?;
        ensure!(tiny.model_info().num_kv_blocks == 16, "{:?}", tiny.model_info());
        let preempted = run(&tiny, &ps, true)?;
        let preemptions = tiny.stats().num_preemptions_total;
        wait_idle(&tiny)?;
        tiny.shutdown();

        let checks = [
            ("batched", batched == alone),
            ("chunked_prefill_7_tokens", chunked == alone),
            ("preemption", preempted == alone),
            ("preemptions_happened", preemptions > 0),
        ];
        for (name, ok) in checks {
            println!("{name}: {}", if ok { "ok" } else { "FAIL" });
        }
        let pass = checks.iter().all(|c| c.1);
        if !pass {
            println!("alone     {alone:?}\nbatched   {batched:?}\nchunked   {chunked:?}\npreempted {preempted:?}");
        }
        if let Some(out) = out {
            let report = json!({
                "prompt_lens": LENS, "new_tokens": NEW, "kv_blocks": info.num_kv_blocks,
                "checks": checks.iter().map(|(n, ok)| json!({"name": n, "pass": ok})).collect::<Vec<_>>(),
                "preemptions": preemptions, "alone": alone, "pass": pass,
            });
            std::fs::write(out, serde_json::to_string_pretty(&report)?)?;
        }
        println!("cuda_engine_parity: {}", if pass { "PASS" } else { "FAIL" });
        if !pass {
            std::process::exit(1);
        }
        Ok(())
    }
}
