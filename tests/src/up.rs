//! [`PrismUp`]: `prism up` (head with the embedded store, worker and router in one process,
//! the one-machine mode) as a child process on free ports, with the endpoints it prints.

use crate::paths::bin_path;
use crate::process::{Process, alive, descendants};
use anyhow::{Context, Result, bail};
use nix::sys::signal::Signal;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long `prism up` may take to load the model and print its endpoints.
const START_TIMEOUT: Duration = Duration::from_secs(300);

/// Endpoints printed by `prism up`.
#[derive(Debug, Clone)]
pub struct UpEndpoints {
    /// Router HTTP base, e.g. `http://127.0.0.1:41234` (the OpenAI API is under `/v1`).
    pub http: String,
    /// Router gRPC, e.g. `http://127.0.0.1:41235`.
    pub grpc: String,
    /// Head gRPC.
    pub head: String,
    /// Worker `/metrics` URL (vLLM metric names).
    pub worker_metrics: String,
    /// The head's admin token file, printed with `--head-auth`.
    pub head_token_file: Option<String>,
}

/// A running `prism up` on free ports; dropping it kills the process.
pub struct PrismUp {
    /// The process.
    pub proc: Process,
    /// Where it serves.
    pub endpoints: UpEndpoints,
}

fn field_after(line: &str, label: &str) -> Option<String> {
    line.trim_start().strip_prefix(label)?.split_whitespace().next().map(str::to_owned)
}

impl PrismUp {
    /// Starts `prism up --model MODEL` with every port 0 (each listener binds a free port
    /// and the process prints where), plus `extra` flags, and waits until it prints its
    /// endpoints (the replica is Ready and the router lists the model).
    ///
    /// # Errors
    /// Fails when it does not come up within 300 s.
    pub async fn start(model: &Path, extra: &[&str]) -> Result<Self> {
        let mut args: Vec<String> = ["up", "--model"].iter().map(|s| (*s).to_owned()).collect();
        args.push(model.to_string_lossy().into_owned());
        for flag in ["--port", "--grpc-port", "--head-port", "--head-http-port", "--worker-port", "--worker-http-port"]
        {
            args.push(flag.to_owned());
            args.push("0".to_owned());
        }
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let envs = [("RUST_LOG".to_owned(), "info".to_owned())];
        let mut proc = Process::spawn("prism up", &bin_path("prism")?, &args, &envs)?;
        let mut http = None;
        let mut grpc = None;
        let mut head = None;
        let mut worker_metrics = None;
        let mut head_token_file = None;
        while http.is_none() || grpc.is_none() || head.is_none() || worker_metrics.is_none() {
            let line = proc
                .wait_for_line(START_TIMEOUT, |l| {
                    ["OpenAI API:", "gRPC:", "Head:", "Metrics:"].iter().any(|p| l.trim_start().starts_with(p))
                })
                .await?;
            if let Some(rest) = line.trim_start().strip_prefix("Metrics:") {
                // router, worker, head: the worker's is the second.
                worker_metrics = rest.split_whitespace().nth(1).map(str::to_owned);
                continue;
            }
            if let Some(v) = field_after(&line, "OpenAI API:") {
                http = Some(v.trim_end_matches("/v1").to_owned());
            } else if let Some(v) = field_after(&line, "gRPC:") {
                grpc = Some(format!("http://{v}"));
            } else if let Some(v) = field_after(&line, "Head:") {
                head = Some(v);
                head_token_file =
                    line.split_once("--token-file ").and_then(|(_, f)| f.split(['`', ' ']).next()).map(str::to_owned);
            }
        }
        let endpoints = UpEndpoints {
            http: http.context("http")?,
            grpc: grpc.context("grpc")?,
            head: head.context("head")?,
            worker_metrics: worker_metrics.context("worker metrics")?,
            head_token_file,
        };
        Ok(Self { proc, endpoints })
    }

    /// Sends SIGINT and checks the exit: status 0 within `limit`, and no process it started
    /// is left behind. Returns the time it took.
    ///
    /// # Errors
    /// Fails on a late or non-zero exit or an orphaned descendant.
    pub async fn interrupt(&mut self, limit: Duration) -> Result<Duration> {
        let children = descendants(self.proc.pid());
        let started = Instant::now();
        self.proc.signal(Signal::SIGINT)?;
        let status = self.proc.wait_exit(limit).await?;
        let took = started.elapsed();
        if !status.success() {
            bail!("prism up exited with {status} after SIGINT; stderr:\n{}", self.proc.stderr());
        }
        let left: Vec<u32> = children.into_iter().filter(|p| alive(*p)).collect();
        if !left.is_empty() {
            bail!("processes left behind by prism up: {left:?}");
        }
        Ok(took)
    }
}
