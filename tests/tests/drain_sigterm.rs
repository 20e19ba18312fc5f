//! SIGTERM drains on a real local cluster (etcd, head, 3 workers on the bundled SmolLM2
//! GGUF, router):
//! - `sigterm_under_streaming_load_loses_nothing`: closed-loop streaming clients; SIGTERM one
//!   worker (30 s grace): no client error, every stream token-exact, nothing dispatched to the
//!   drained replica after the router's route update, exit 0 within the grace. Measures
//!   SIGTERM → route update; `PRISM_DRAIN_TRIALS=N` repeats it on the workers in turn and
//!   `PRISM_DRAIN_BENCH_OUT=FILE` writes the latencies as JSON (`bench/drain/run.sh`).
//! - `long_stream_survives_sigterm`: a `max_tokens` 1000 stream in flight, SIGTERM its
//!   worker (60 s grace): the stream completes normally; no new request reaches the worker;
//!   it exits 0 once idle.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::{
    ChatMessage, ChatMessages, FinishReason, GenerateRequest, SamplingParams, generate_request,
};
use prism_tests::{
    Cluster, Load, PROMPTS, SERVED, eventually, greedy_request, metric_value, model, quantile, reference, stream,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX_TOKENS: u32 = 32;

/// One SIGTERM trial on `node`: returns SIGTERM → route update.
async fn sigterm_trial(cluster: &mut Cluster, node: &str, grace: Duration) -> Result<Duration> {
    let replica = cluster.replica_on(node).await?.context("no replica on the node")?;
    let ready = cluster.router_ready_replicas().await?;
    let t0 = Instant::now();
    cluster.worker(node)?.process.terminate()?;
    let t1 = cluster.wait_route_change(ready, Duration::from_secs(10)).await?;
    let after_update = cluster.router_dispatches(&replica).await?;
    // Exit 0 within the grace period.
    let left = grace.saturating_sub(t0.elapsed());
    let status = cluster.worker_mut(node)?.process.wait_exit(left).await?;
    let exited_after = t0.elapsed();
    if !status.success() {
        bail!("{node} exited with {status}");
    }
    // Unchanged, or gone with the replica (the router drops the series of a replica that left
    // its table: nothing can be dispatched to it then).
    let at_end = cluster.router_dispatches(&replica).await?;
    assert!(
        at_end.is_none() || at_end == after_update,
        "requests dispatched to {replica} after the route update: {after_update:?} then {at_end:?}"
    );
    eprintln!("{node}: route update {:?} after SIGTERM, exit 0 after {exited_after:?}", t1 - t0);
    Ok(t1 - t0)
}

/// Brings `node` back: restart the process (same node id, as a StatefulSet pod comes
/// back); a node drained by its own worker is schedulable again without `uncordon`, so
/// the deployment becomes whole again.
async fn bring_back(cluster: &mut Cluster, node: &str, replicas: usize) -> Result<()> {
    cluster.restart_worker(node)?;
    cluster.wait_worker_ready(node, Duration::from_secs(30)).await?;
    cluster.wait_ready(replicas, Duration::from_secs(120)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_under_streaming_load_loses_nothing() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let trials: usize = std::env::var("PRISM_DRAIN_TRIALS").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
    let grace = Duration::from_secs(30);
    let mut cluster =
        Cluster::serving(&model, 3, 3).worker_args(&["--drain-grace", "30", "--drain-margin", "5"]).start().await?;
    let outcome = async {
        let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
        let load = Load::start(cluster.grpc(), 4, MAX_TOKENS, reference);
        load.wait_more(4, Duration::from_secs(60)).await?;
        let mut latencies = Vec::new();
        for t in 0..trials {
            let node = format!("w{}", t % 3 + 1);
            latencies.push(sigterm_trial(&mut cluster, &node, grace).await.with_context(|| format!("trial {t} on {node}"))?);
            load.wait_more(2, Duration::from_secs(60)).await?;
            if t + 1 < trials {
                bring_back(&mut cluster, &node, 3).await?;
                load.wait_more(2, Duration::from_secs(60)).await?;
            }
        }
        let report = load.stop().await?;
        report.check()?;
        assert!(report.ok >= 6, "too few streams finished: {}", report.ok);
        let migrations = cluster.router_metric("prism_router_migrations_total").await?;
        let (p50, p99) = (quantile(&latencies, 0.5), quantile(&latencies, 0.99));
        eprintln!(
            "SIGTERM -> route update over {trials} trials: p50 {p50:?}, p99 {p99:?}; {} streams ok, {migrations} migrations",
            report.ok
        );
        if let Ok(path) = std::env::var("PRISM_DRAIN_BENCH_OUT") {
            let ms: Vec<f64> = latencies.iter().map(|d| d.as_secs_f64() * 1e3).collect();
            let json = serde_json::json!({
                "trials": trials, "sigterm_to_route_update_ms": ms,
                "p50_ms": p50.as_secs_f64() * 1e3, "p99_ms": p99.as_secs_f64() * 1e3,
                "streams_ok": report.ok, "errors": report.errors.len(), "migrations": migrations,
            });
            std::fs::write(path, serde_json::to_string_pretty(&json)?)?;
        }
        assert!(p99 < Duration::from_secs(2), "route update too slow: {latencies:?}");
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = outcome {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn long_stream_survives_sigterm() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let grace = Duration::from_secs(60);
    let mut cluster =
        Cluster::serving(&model, 2, 2).worker_args(&["--drain-grace", "60", "--drain-margin", "5"]).start().await?;
    let outcome = async {
        let req = GenerateRequest {
            model: SERVED.into(),
            prompt: Some(generate_request::Prompt::Chat(ChatMessages {
                messages: vec![ChatMessage {
                    role: "user".into(),
                    content: "Explain in three sentences why the sky is blue.".into(),
                    ..Default::default()
                }],
            })),
            sampling: Some(SamplingParams {
                temperature: Some(0.0),
                max_tokens: Some(1000),
                ..SamplingParams::default()
            }),
            ..GenerateRequest::default()
        };
        let grpc = cluster.grpc().to_owned();
        let long = tokio::spawn(async move { stream(&grpc, req).await });
        // Find the worker running it: the one whose replica has a request in flight.
        let node = eventually(Duration::from_secs(30), "long stream running", || {
            let c = &cluster;
            async move {
                for w in &c.workers {
                    if metric_value(&w.metrics().await?, "vllm:num_requests_running") >= 1.0 {
                        return Ok(Some(w.node.clone()));
                    }
                }
                Ok(None)
            }
        })
        .await?;
        let replica = cluster.replica_on(&node).await?.context("replica")?;
        let before = cluster.router_dispatches(&replica).await?;
        let t0 = Instant::now();
        cluster.worker(&node)?.process.terminate()?;
        cluster.wait_route_change(2, Duration::from_secs(10)).await?;
        // New short requests while it drains: none reaches the drained replica.
        for p in PROMPTS {
            let r = stream(cluster.grpc(), greedy_request(p, 8, true)).await?;
            assert_eq!(r.tokens.len(), 8);
        }
        let r = long.await??;
        eprintln!("long stream: finished {:?} after SIGTERM", t0.elapsed());
        assert!(r.finish == FinishReason::Stop as i32 || r.finish == FinishReason::Length as i32, "{r:?}");
        assert_eq!(r.completion_tokens as usize, r.tokens.len());
        assert!(!r.tokens.is_empty());
        let left = grace.saturating_sub(t0.elapsed());
        let status = cluster.worker_mut(&node)?.process.wait_exit(left).await?;
        assert!(status.success(), "{status}");
        let after = cluster.router_dispatches(&replica).await?;
        assert!(
            after.is_none() || after == before,
            "a request reached the draining replica: {before:?} then {after:?}"
        );
        let migrations = cluster.router_metric("prism_router_migrations_total").await?;
        assert_eq!(migrations, 0.0, "the long stream should finish on its own worker");
        eprintln!("long stream: {} tokens, worker exited 0 after {:?}", r.tokens.len(), t0.elapsed());
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = outcome {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
