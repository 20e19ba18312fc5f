//! `prism bench serve` (the real binary) against a real serving cluster (`Cluster::serving`:
//! etcd, a head, one worker with the bundled model on the CPU engine, a router):
//!
//! - `random` prompts (32 tokens in, 8 out, `--ignore-eos`), 16 of them at once (capped at 8
//!   in flight), over OpenAI HTTP (`--backend openai`) and over gRPC: the JSON result counts
//!   16 completed, 0 failed, 16 × 8 output tokens and 16 × 32 input tokens (from the servers'
//!   usage), and TTFT p50 is positive and at most the E2E latency p50.
//! - the `multi-turn` chat set over `/v1/chat/completions` (`--backend openai-chat`).
//! - `prefix_repetition`: token ids over `/v1/completions` (3 prefixes of 32 tokens, 8-token
//!   suffixes: exactly 6 × 40 input tokens) and one shared system prompt over chat, with the
//!   worker's `/metrics` as `--metrics-url`: the worker counted every request of the run, and the
//!   cached prompt tokens, when the server reports them, are at most the prompt tokens.
//! - `--request-rate 8 --burstiness 1000` (nearly constant gaps of 125 ms): the 16th request
//!   leaves ≈ 1.875 s after the first, so the run lasts at least that and at most that plus
//!   the slowest request.
//! - an unknown `--model`: every request fails, counted as `http 404` / `grpc NotFound`, the
//!   result is still written and the command exits non-zero.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, ensure};
use prism_tests::{Cluster, model};
use serde_json::Value;
use std::path::Path;

const PROMPTS: u64 = 16;
const INPUT_LEN: u64 = 32;
const OUTPUT_LEN: u64 = 8;

/// Runs `prism bench serve` with `args` against `cluster`, returns the JSON result.
fn bench(cluster: &Cluster, dir: &Path, name: &str, args: &[&str]) -> Result<Value> {
    bench_exit(cluster, dir, name, args, true)
}

/// As [`bench`]; `ok` says whether the command must exit 0 (a run whose requests all fail
/// exits non-zero after writing its result).
fn bench_exit(cluster: &Cluster, dir: &Path, name: &str, args: &[&str], ok: bool) -> Result<Value> {
    let file = dir.join(format!("{name}.json"));
    let file_arg = file.to_string_lossy().into_owned();
    let mut all = vec![
        "--router",
        cluster.grpc(),
        "bench",
        "serve",
        "--base-url",
        cluster.http(),
        "--ignore-eos",
        "--seed",
        "1",
        "--no-progress",
        "--result-file",
        &file_arg,
    ];
    all.extend_from_slice(args);
    let out = cluster.cli(&all);
    match (out, ok) {
        (Ok(stdout), true) => println!("{name}:\n{stdout}"),
        (Err(e), true) => return Err(e),
        (Ok(stdout), false) => anyhow::bail!("{name}: expected a non-zero exit, got success:\n{stdout}"),
        (Err(e), false) => println!("{name} (failed as expected): {e:#}"),
    }
    let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    Ok(serde_json::from_str(&text)?)
}

fn num(v: &Value, key: &str) -> Result<f64> {
    v[key].as_f64().with_context(|| format!("{key} missing from the result: {v}"))
}

fn check_complete(v: &Value, prompts: u64, output_tokens: u64) -> Result<()> {
    ensure!(v["completed"] == prompts, "completed: {}", v["completed"]);
    ensure!(v["failed"] == 0, "failed: {} ({})", v["failed"], v["failures"]);
    ensure!(v["total_output_tokens"] == output_tokens, "output tokens: {}", v["total_output_tokens"]);
    let (ttft, e2el) = (num(v, "median_ttft_ms")?, num(v, "median_e2el_ms")?);
    ensure!(ttft > 0.0 && ttft <= e2el, "TTFT p50 {ttft} ms, E2E p50 {e2el} ms");
    ensure!(num(v, "median_tpot_ms")? > 0.0 && num(v, "mean_itl_ms")? > 0.0, "TPOT/ITL missing: {v}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bench_serve_http_grpc_chat_and_rate() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let cluster = Cluster::serving(&model, 1, 1).start().await?;
    let dir = tempfile::tempdir()?;
    let (n, input, output) = (PROMPTS.to_string(), INPUT_LEN.to_string(), OUTPUT_LEN.to_string());
    let random = [
        "--dataset-name",
        "random",
        "--num-prompts",
        &n,
        "--random-input-len",
        &input,
        "--random-output-len",
        &output,
        "--max-concurrency",
        "8",
        "--goodput",
        "ttft:60000",
    ];
    for backend in ["openai", "grpc"] {
        let mut args = vec!["--backend", backend];
        args.extend_from_slice(&random);
        let v = cluster.with_logs(bench(&cluster, dir.path(), backend, &args))?;
        check_complete(&v, PROMPTS, PROMPTS * OUTPUT_LEN).with_context(|| format!("--backend {backend}"))?;
        ensure!(v["total_input_tokens"] == PROMPTS * INPUT_LEN, "{backend}: input tokens {}", v["total_input_tokens"]);
        ensure!(v["backend"] == backend && v["request_rate"] == "inf", "{backend}: {v}");
        // Every request meets a 60 s TTFT objective: goodput = throughput.
        let (good, all) = (num(&v, "request_goodput")?, num(&v, "request_throughput")?);
        ensure!((good - all).abs() < 1e-9 && all > 0.0, "{backend}: goodput {good}, throughput {all}");
    }

    let chat = [
        "--backend",
        "openai-chat",
        "--dataset-name",
        "multi-turn",
        "--multi-turn-conversations",
        "4",
        "--multi-turn-turns",
        "2",
        "--multi-turn-system-len",
        "24",
        "--multi-turn-user-len",
        "8",
        "--multi-turn-output-len",
        &output,
    ];
    let v = cluster.with_logs(bench(&cluster, dir.path(), "chat", &chat))?;
    check_complete(&v, 8, 8 * OUTPUT_LEN).context("--backend openai-chat")?;
    ensure!(v["dataset_name"] == "multi-turn", "{v}");

    let worker_metrics = format!("{}/metrics", cluster.workers[0].http);
    let shared_ids = [
        "--backend",
        "openai",
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-num-prefixes",
        "3",
        "--prefix-repetition-prefix-len",
        "32",
        "--prefix-repetition-suffix-len",
        "8",
        "--prefix-repetition-output-len",
        &output,
        "--num-prompts",
        "6",
        "--metrics-url",
        &worker_metrics,
    ];
    let system_prompt = [
        "--backend",
        "openai-chat",
        "--dataset-name",
        "prefix_repetition",
        "--prefix-repetition-num-prefixes",
        "1",
        "--prefix-repetition-prefix-len",
        "48",
        "--prefix-repetition-suffix-len",
        "8",
        "--prefix-repetition-output-len",
        &output,
        "--num-prompts",
        "4",
        "--metrics-url",
        &worker_metrics,
    ];
    for (name, args, n) in [("shared-prefix", &shared_ids[..], 6u64), ("system-prompt", &system_prompt[..], 4)] {
        let v = cluster.with_logs(bench(&cluster, dir.path(), name, args))?;
        check_complete(&v, n, n * OUTPUT_LEN).with_context(|| name.to_owned())?;
        ensure!(v["dataset_name"] == "prefix_repetition", "{name}: {v}");
        ensure!(v["workers"]["requests"] == serde_json::json!([n as f64]), "{name}: workers {}", v["workers"]);
        ensure!(v["workers"]["max_over_mean_requests"] == 1.0, "{name}: one worker: {}", v["workers"]);
        let input = num(&v, "total_input_tokens")?;
        if name == "shared-prefix" {
            ensure!(input == 240.0, "token-id prompts of exactly 40 tokens: {input}");
        }
        match v["total_cached_tokens"].as_f64() {
            None => ensure!(v["prefix_cache_hit_rate"].is_null(), "{name}: a rate without cached tokens: {v}"),
            Some(cached) => {
                let rate = num(&v, "prefix_cache_hit_rate")?;
                ensure!(cached <= input && (rate - cached / input).abs() < 1e-9, "{name}: cached {cached} of {input}");
            }
        }
    }

    let rated = [
        "--backend",
        "grpc",
        "--num-prompts",
        &n,
        "--random-input-len",
        &input,
        "--random-output-len",
        &output,
        "--request-rate",
        "8",
        "--burstiness",
        "1000",
        "--save-detailed",
    ];
    let v = cluster.with_logs(bench(&cluster, dir.path(), "rate", &rated))?;
    check_complete(&v, PROMPTS, PROMPTS * OUTPUT_LEN).context("--request-rate 8")?;
    let last_send = (PROMPTS - 1) as f64 / 8.0;
    let slowest = v["e2els"].as_array().context("e2els")?.iter().filter_map(Value::as_f64).fold(0.0, f64::max);
    let duration = num(&v, "duration")?;
    ensure!(
        duration >= last_send * 0.97 && duration <= last_send * 1.03 + slowest + 0.5,
        "duration {duration:.3} s for a last send at {last_send:.3} s and a slowest request of {slowest:.3} s"
    );
    ensure!(v["request_rate"] == 8.0, "{v}");

    // Failures are counted by status: an unknown model is HTTP 404 / gRPC NotFound.
    for (backend, status) in [("openai", "http 404"), ("grpc", "grpc NotFound")] {
        let args = ["--backend", backend, "--model", "no-such-model", "--num-prompts", "4", "--random-input-len", "4"];
        let v = bench_exit(&cluster, dir.path(), &format!("{backend}-unknown-model"), &args, false)?;
        ensure!(v["completed"] == 0 && v["failed"] == 4, "{backend}: {v}");
        ensure!(v["failures"][status] == 4, "{backend}: failures {}", v["failures"]);
    }
    Ok(())
}
