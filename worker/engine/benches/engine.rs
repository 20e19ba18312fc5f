//! Engine benchmark on the bundled model: prefill tokens/s for a 512-token
//! prompt, TTFT, decode tokens/s at batch 1, 8 and 32 (continuous batching, aggregate),
//! resident memory and KV-cache bytes per token. Compare with `bench/llama_cpp_engine.py`.
//! Those run with the prefix cache off (the prefill figure repeats one prompt). Then the
//! prefix cache's overhead where it cannot help: a random trace (64 prompts of 192 random
//! token ids, 32 tokens each, all at once) on fresh engines with the cache on and off, in the
//! order on, off, off, on so that drift in the machine's load cancels out of the means.
//!
//! Run: `cargo bench -p prism-engine --bench engine` (or `--profile dev`, whose engine and
//! dependencies are optimised too). Env: `PRISM_MODEL` (default: the bundled GGUF),
//! `PRISM_BENCH_DECODE_TOKENS` (default 64), `PRISM_BENCH_QUICK` (set: only prefill and
//! batch-1 decode, three decode runs, no batch 8/32 and no prefix-cache trace).

use anyhow::{Context, Result};
use prism_engine::{EngineConfig, EngineHandle, EngineRequest, Prompt, SamplingParams};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn rss_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

fn request(prompt: Vec<u32>, max_tokens: i64) -> EngineRequest {
    EngineRequest {
        id: "bench".into(),
        prompt: Prompt::TokenIds(prompt),
        params: SamplingParams {
            temperature: 0.0,
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            ..SamplingParams::default()
        },
        prior_output_ids: Vec::new(),
        deadline: None,
        cache_salt: None,
        tools: None,
        chat_template_kwargs: None,
    }
}

/// Arrival times of each token of one request, relative to `t0`.
fn collect(e: &EngineHandle, prompt: Vec<u32>, max_tokens: i64) -> Result<std::thread::JoinHandle<Vec<Instant>>> {
    let mut s = e.submit(request(prompt, max_tokens))?;
    Ok(std::thread::spawn(move || {
        let mut times = Vec::new();
        while let Some(o) = s.blocking_recv() {
            let now = Instant::now();
            times.extend(std::iter::repeat_n(now, o.token_ids.len()));
        }
        times
    }))
}

/// Aggregate steady-state decode tokens/s with `batch` concurrent sequences: tokens
/// generated after every sequence has its first token, over that window.
fn decode(e: &EngineHandle, prompt: &[u32], batch: usize, tokens: i64) -> Result<(f64, Duration)> {
    let t0 = Instant::now();
    let handles: Vec<_> = (0..batch).map(|_| collect(e, prompt.to_vec(), tokens)).collect::<Result<_>>()?;
    let runs: Vec<Vec<Instant>> = handles.into_iter().map(|h| h.join().unwrap_or_default()).collect();
    let start = runs.iter().filter_map(|r| r.first()).max().copied().context("no tokens")?;
    let end = runs.iter().filter_map(|r| r.last()).max().copied().context("no tokens")?;
    let after: usize = runs.iter().map(|r| r.iter().filter(|t| **t > start).count()).sum();
    let ttft = runs.iter().filter_map(|r| r.first()).min().copied().context("no tokens")? - t0;
    Ok((after as f64 / (end - start).as_secs_f64(), ttft))
}

fn main() -> Result<()> {
    let model = std::env::var_os("PRISM_MODEL").map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    let tokens: i64 = std::env::var("PRISM_BENCH_DECODE_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(64);
    let load = Instant::now();
    let mut cfg = EngineConfig::new(&model);
    cfg.max_num_seqs = 64;
    cfg.enable_prefix_caching = false;
    let e = EngineHandle::start(cfg.clone(), None)?;
    let load_s = load.elapsed().as_secs_f64();
    let info = e.model_info();
    let codec = e.codec();
    let text = "The history of the lighthouse begins in antiquity, when fires were lit on hilltops to guide ships. ";
    let mut long = Vec::new();
    while long.len() < 512 {
        long.extend(codec.encode(text, false)?);
    }
    long.truncate(512);
    let short: Vec<u32> = long[..16].to_vec();

    // Warm-up (page in weights, size buffers).
    let _ = collect(&e, short.clone(), 4)?.join();

    // Prefill: TTFT of one 512-token prompt (max_tokens 1), best of 3.
    let mut prefill = Duration::MAX;
    for _ in 0..3 {
        let t = Instant::now();
        let times = collect(&e, long.clone(), 1)?.join().unwrap_or_default();
        let first = times.first().copied().context("no token")?;
        prefill = prefill.min(first - t);
    }
    let prefill_tps = 512.0 / prefill.as_secs_f64();

    let quick = std::env::var_os("PRISM_BENCH_QUICK").is_some();
    let batches: &[usize] = if quick { &[1, 1, 1] } else { &[1, 8, 32] };
    let mut rows = Vec::new();
    for &batch in batches {
        let (tps, ttft) = decode(&e, &short, batch, tokens)?;
        rows.push((batch, tps, ttft));
    }
    let st = e.stats();
    let rss_mib = rss_kib("VmRSS:") as f64 / 1024.0;
    let hwm_mib = rss_kib("VmHWM:") as f64 / 1024.0;
    e.shutdown();

    println!("model: {} (backend {}, {} threads)", model.display(), info.backend, rayon_threads());
    println!(
        "load: {load_s:.2} s; KV cache: {} blocks x {} tokens, {} bytes/token",
        info.num_kv_blocks, info.block_size, info.kv_bytes_per_token
    );
    println!("| metric | value |");
    println!("| --- | --- |");
    println!("| prefill, 512-token prompt | {prefill_tps:.0} tokens/s (TTFT {:.0} ms) |", prefill.as_secs_f64() * 1e3);
    for (b, tps, ttft) in &rows {
        println!("| decode, batch {b} | {tps:.1} tokens/s aggregate (first TTFT {:.0} ms) |", ttft.as_secs_f64() * 1e3);
    }
    if let (Some(b1), Some(b32)) = (rows.first(), rows.last().filter(|r| r.0 == 32)) {
        println!("| batch 32 / batch 1 | {:.1}x |", b32.1 / b1.1);
    }
    println!("| resident memory | {rss_mib:.0} MiB (peak {hwm_mib:.0} MiB, KV cache reserved up front) |");
    println!("| KV bytes per token | {} |", info.kv_bytes_per_token);
    println!("| preemptions during run | {} |", st.num_preemptions_total);
    if quick {
        return Ok(());
    }

    let mut on = Vec::new();
    let mut off = Vec::new();
    for (i, cache) in [true, false, false, true].into_iter().enumerate() {
        let mut c = cfg.clone();
        c.enable_prefix_caching = cache;
        let tps = random_trace(c, info.vocab_size, 1 + i as u64 / 2)?;
        if cache { on.push(tps) } else { off.push(tps) }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    println!(
        "| random trace (64 x 192 tokens, 32 out), prefix cache on / off | {:.1} / {:.1} output tokens/s ({:.3}x; runs on {on:.1?}, off {off:.1?}) |",
        mean(&on),
        mean(&off),
        mean(&on) / mean(&off)
    );
    Ok(())
}

/// Output tokens/s of the random trace on a fresh engine: every request at once, wall time
/// from the first submission to the last token.
fn random_trace(cfg: EngineConfig, vocab: usize, seed: u64) -> Result<f64> {
    let e = EngineHandle::start(cfg, None)?;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % (vocab as u64 - 1)) as u32 + 1
    };
    let prompts: Vec<Vec<u32>> = (0..64).map(|_| (0..192).map(|_| next()).collect()).collect();
    let t0 = Instant::now();
    let handles: Vec<_> = prompts.into_iter().map(|p| collect(&e, p, 32)).collect::<Result<_>>()?;
    let tokens: usize = handles.into_iter().map(|h| h.join().unwrap_or_default().len()).sum();
    let wall = t0.elapsed().as_secs_f64();
    e.shutdown();
    Ok(tokens as f64 / wall)
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}
