//! `prism bench`: benchmarks. One subcommand per benchmark; each is a function taking its
//! own `Args` struct, so the engine and router benchmarks plug in as new variants of
//! [`BenchCommand`] without touching the rest of the CLI.
//!
//! `prism bench serve` is a serving benchmark comparable with `vllm bench serve` (same flag
//! names, metrics and result keys): datasets (`dataset.rs`), arrival times (`arrivals.rs`),
//! transports (`transport.rs`: OpenAI HTTP streaming or gRPC), metrics (`stats.rs`), the
//! table and JSON result (`report.rs`), workers' counters (`worker_metrics.rs`, `--metrics-url`),
//! and the run itself (`serve.rs`). See docs/bench.md.

pub mod args;
pub mod arrivals;
pub mod dataset;
pub mod report;
pub mod serve;
pub mod stats;
pub mod transport;
pub mod worker_metrics;

use anyhow::Result;
use clap::Subcommand;

/// The benchmarks `prism bench` can run.
#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Load a router (gRPC or OpenAI HTTP) with a dataset at a request rate; report TTFT,
    /// TPOT, ITL, E2E latency, throughput and goodput.
    Serve(Box<args::ServeArgs>),
}

/// Runs the chosen benchmark (`router`: the global `--router` gRPC address).
///
/// # Errors
/// Fails when the benchmark cannot run (bad flags, server unreachable, every request failing, …).
pub async fn run(router: &crate::client::RouterTarget, command: BenchCommand) -> Result<()> {
    match command {
        BenchCommand::Serve(args) => serve::run(router, *args).await,
    }
}
