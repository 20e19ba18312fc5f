//! Stream migration on a real local cluster (etcd, head, 3 workers on the bundled SmolLM2
//! GGUF, router), greedy streams compared token by token with an undisturbed run:
//! - `short_deadline_migrates_streams_token_exact`: SIGTERM with a 2 s drain deadline while
//!   streams longer than that run: the worker hands them back at the deadline, the router
//!   migrates them (`prior_output_ids`), every client gets exactly the reference tokens and
//!   usage; the largest inter-token gap around the migration is printed.
//! - `kill_9_mid_stream_migrates_token_exact`: SIGKILL of a worker with streams in flight
//!   (no notice): the same guarantee.
//! - `frozen_worker_mid_stream_migrates_when_its_replica_leaves_the_routes`: SIGSTOP of a
//!   worker with streams in flight: they move once the head drops its replica from the
//!   routes (worker timeout 2 s), not when the connection's keepalive gives up (~10 s).
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Result, bail};
use nix::sys::signal::Signal;
use prism_tests::{Cluster, Load, eventually, metric_value, model, reference};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Long enough that a stream outlives the 2 s deadline on a 2-core machine.
const MAX_TOKENS: u32 = 96;
/// Stream length for the short-deadline test (streams must outlast the deadline).
const LONG_MAX_TOKENS: u32 = 512;

/// A worker with at least `n` requests running, by its vLLM gauge.
async fn busy_worker(cluster: &Cluster, n: f64) -> Result<String> {
    eventually(Duration::from_secs(60), "a worker with running streams", || async move {
        for w in &cluster.workers {
            if metric_value(&w.metrics().await?, "vllm:num_requests_running") >= n {
                return Ok(Some(w.node.clone()));
            }
        }
        Ok(None)
    })
    .await
}

/// Runs load, disturbs the busiest worker with `signal`, and checks every stream.
async fn disturb(cluster: &mut Cluster, signal: Signal, deadline: Duration, max_tokens: u32) -> Result<()> {
    let reference = Arc::new(reference(cluster.grpc(), max_tokens).await?);
    let load = Load::start(cluster.grpc(), 4, max_tokens, reference);
    let node = fresh_stream_on_busy_worker(cluster, &load).await?;
    let t0 = Instant::now();
    let worker = cluster.worker_mut(&node)?;
    worker.process.signal(signal)?;
    let status = worker.process.wait_exit(Duration::from_secs(20)).await?;
    let exited = t0.elapsed();
    if signal == Signal::SIGTERM {
        assert!(status.success(), "{node} exited with {status}");
    }
    // Let the migrated streams and a few more finish.
    // Bound scaled with the stream length (about 0.5 s per token on a loaded 2-core machine).
    load.wait_more(6, Duration::from_secs(120).max(Duration::from_millis(u64::from(max_tokens) * 500))).await?;
    let report = load.stop().await?;
    report.check()?;
    let migrations = cluster.router_metric("prism_router_migrations_total").await?;
    anyhow::ensure!(migrations >= 1.0, "no stream was migrated ({} ok)", report.ok);
    let around = report.max_gap_around(t0 + deadline);
    eprintln!(
        "{signal}: {node} gone after {exited:?}; {} streams token-exact, {migrations} migrations; \
         largest inter-token gap of streams in flight at the hand-back {around:?} (all streams {:?})",
        report.ok,
        report.max_gap()
    );
    Ok(())
}

/// Under `load`, the busiest worker right after one of its streams produced its first token:
/// that stream then has (almost) all of its tokens left, so it outlives a disturbance and
/// must be migrated. (The router retries a request whose replica leaves the routes before
/// its first token, and a stream near its end finishes first: neither migrates.)
async fn fresh_stream_on_busy_worker(cluster: &Cluster, load: &Load) -> Result<String> {
    load.wait_more(2, Duration::from_secs(90)).await?;
    let node = busy_worker(cluster, 2.0).await?;
    let http = cluster.worker(&node)?.http.clone();
    let ttft = |http: String| async move {
        let text = reqwest::get(format!("{http}/metrics")).await?.text().await?;
        anyhow::Ok(metric_value(&text, "vllm:time_to_first_token_seconds_count"))
    };
    let first0 = ttft(http.clone()).await?;
    eventually(Duration::from_secs(60), "a fresh stream decoding on the busy worker", || {
        let http = http.clone();
        async move { Ok((ttft(http).await? > first0).then_some(())) }
    })
    .await?;
    Ok(node)
}

/// A worker frozen (SIGSTOP) with streams in flight: its connections stay open and silent.
/// The head marks the node Dead after its `--worker-timeout` (2 s here) and drops the replica
/// from the routes; the router moves the streams then, token-exact, instead of waiting for the
/// connection's keepalive to give up (5 s without data, then 5 s for the ping's answer).
async fn freeze_mid_stream(cluster: &mut Cluster) -> Result<()> {
    /// Below the keepalive's 10 s with room for the head's timeout, the table's trip and the
    /// continuation's prefill on a loaded 2-core machine.
    const GAP_BOUND: Duration = Duration::from_secs(7);
    let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
    let load = Load::start(cluster.grpc(), 4, MAX_TOKENS, reference);
    let node = fresh_stream_on_busy_worker(cluster, &load).await?;
    let t0 = Instant::now();
    cluster.worker(&node)?.process.signal(Signal::SIGSTOP)?;
    let finished = load.wait_more(6, Duration::from_secs(120)).await;
    let report = load.stop().await;
    // Thawed, it finds itself replaced and stops its replica (and can be shut down).
    cluster.worker(&node)?.process.signal(Signal::SIGCONT)?;
    finished?;
    let report = report?;
    report.check()?;
    let migrations = cluster.router_metric("prism_router_migrations_total").await?;
    anyhow::ensure!(migrations >= 1.0, "no stream was migrated ({} ok)", report.ok);
    let around = report.max_gap_around(t0);
    eprintln!(
        "SIGSTOP: {} streams token-exact, {migrations} migrations; largest gap at the freeze {around:?}",
        report.ok
    );
    anyhow::ensure!(around < GAP_BOUND, "streams on the frozen worker stalled {around:?} (bound {GAP_BOUND:?})");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn short_deadline_migrates_streams_token_exact() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster =
        Cluster::serving(&model, 3, 3).worker_args(&["--drain-grace", "3", "--drain-margin", "1"]).start().await?;
    // Streams must outlast the 2 s deadline however fast the engine is on the machine: the
    // clients' streams run in waves and SIGTERM lands early in one, and a 512-token stream
    // takes ~5 s even at ~100 tok/s, so the streams running at the hand-back still have work
    // left and must be migrated (256 tokens finished inside the deadline on an idle machine).
    if let Err(e) = disturb(&mut cluster, Signal::SIGTERM, Duration::from_secs(2), LONG_MAX_TOKENS).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_mid_stream_migrates_token_exact() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::serving(&model, 3, 3).start().await?;
    if let Err(e) = disturb(&mut cluster, Signal::SIGKILL, Duration::ZERO, MAX_TOKENS).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn frozen_worker_mid_stream_migrates_when_its_replica_leaves_the_routes() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::serving(&model, 3, 3).start().await?;
    if let Err(e) = freeze_mid_stream(&mut cluster).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
