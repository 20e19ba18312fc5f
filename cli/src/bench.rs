//! `prism bench`: benchmarks. One subcommand per benchmark; each is a function taking its
//! own `Args` struct, so the engine and router benchmarks plug in as new variants of
//! [`BenchCommand`] without touching the rest of the CLI.
//!
//! `prism bench serve` (here) is a closed-loop load generator against a router's gRPC
//! `InferenceService`: `concurrency` clients each send requests back to back until
//! `requests` are done, then it reports requests/s, output tokens/s and latency/TTFT
//! percentiles.

use crate::client::{self, ModelArg};
use crate::generate::{self, Generation};
use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use prism_common::proto::v1::{GenerateRequest, SamplingParams, generate_request::Prompt};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The benchmarks `prism bench` can run.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Load a running router over gRPC and report throughput and latency.
    Serve(ServeArgs),
}

/// `prism bench serve` flags.
#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// `--model`: the served model to load.
    #[command(flatten)]
    pub model: ModelArg,
    /// Concurrent clients.
    #[arg(long, env = "PRISM_BENCH_CONCURRENCY", default_value_t = 8)]
    pub concurrency: usize,
    /// Total requests.
    #[arg(long, env = "PRISM_BENCH_REQUESTS", default_value_t = 64)]
    pub requests: usize,
    /// Prompt text sent by every request.
    #[arg(long, env = "PRISM_BENCH_PROMPT", default_value = "Write a short story about a lighthouse keeper.")]
    pub prompt: String,
    /// New tokens per request (EOS ignored so every request generates exactly this many).
    #[arg(long, env = "PRISM_BENCH_MAX_TOKENS", default_value_t = 32)]
    pub max_tokens: i64,
}

/// Runs the chosen benchmark.
///
/// # Errors
/// Fails when the benchmark cannot run (router unreachable, every request failing, …).
pub async fn run(router_addr: &str, command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Serve(args) => serve(router_addr, args).await,
    }
}

/// Nearest-rank percentile of sorted samples (`p` in [0, 100]).
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

async fn serve(router_addr: &str, args: ServeArgs) -> Result<()> {
    if args.concurrency == 0 || args.requests == 0 {
        bail!("--concurrency and --requests must be at least 1");
    }
    let mut probe = client::router(router_addr).await?;
    let model = args.model.clone().resolve(&mut probe).await?;
    let request = GenerateRequest {
        model,
        prompt: Some(Prompt::Text(args.prompt.clone())),
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(args.max_tokens),
            ignore_eos: true,
            ..SamplingParams::default()
        }),
        ..GenerateRequest::default()
    };
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..args.concurrency {
        let mut client = probe.clone();
        let request = request.clone();
        let next = next.clone();
        let total = args.requests;
        tasks.push(tokio::spawn(async move {
            let mut results: Vec<Result<(Duration, Generation)>> = Vec::new();
            while next.fetch_add(1, Ordering::Relaxed) < total {
                let t0 = Instant::now();
                let outcome = generate::stream(&mut client, request.clone(), &mut std::io::sink()).await;
                results.push(outcome.map(|g| (t0.elapsed(), g)));
            }
            results
        }));
    }
    let mut latencies = Vec::new();
    let mut ttfts = Vec::new();
    let mut tokens = 0usize;
    let mut errors = Vec::new();
    for task in tasks {
        for result in task.await.context("benchmark client panicked")? {
            match result {
                Ok((latency, g)) => {
                    latencies.push(latency);
                    ttfts.extend(g.ttft);
                    tokens += g.tokens;
                }
                Err(e) => errors.push(e),
            }
        }
    }
    let elapsed = started.elapsed();
    if latencies.is_empty() {
        let first = errors.into_iter().next().map_or_else(|| "no result".to_owned(), |e| format!("{e:#}"));
        bail!("every request failed; first error: {first}");
    }
    latencies.sort();
    ttfts.sort();
    let secs = elapsed.as_secs_f64();
    println!(
        "prism bench serve: {} requests, concurrency {}, {} new tokens each",
        args.requests, args.concurrency, args.max_tokens
    );
    println!("  ok / failed        {} / {}", latencies.len(), errors.len());
    println!("  duration           {secs:.2} s");
    println!("  requests/s         {:.2}", latencies.len() as f64 / secs);
    println!("  output tokens/s    {:.1}", tokens as f64 / secs);
    println!("  latency p50 / p99  {} / {}", ms(percentile(&latencies, 50.0)), ms(percentile(&latencies, 99.0)));
    println!("  TTFT p50 / p99     {} / {}", ms(percentile(&ttfts, 50.0)), ms(percentile(&ttfts, 99.0)));
    if let Some(e) = errors.first() {
        eprintln!("first error: {e:#}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&samples, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&samples, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&samples, 100.0), Duration::from_millis(100));
        assert_eq!(percentile(&samples[..1], 99.0), Duration::from_millis(1));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
    }
}
