//! Scale from zero under a burst on a real local cluster (etcd, head, one worker with 2 CPU
//! slots on the bundled SmolLM2 GGUF, router): a deployment autoscaled between 0 and 2
//! replicas with `max_num_seqs: 2` gets 8 concurrent requests while it has no replica.
//! The first replica to become Ready must get at most its limit (2: `max_num_seqs` with no
//! headroom under 16) from the router's queue, never the whole burst; the rest wait in the
//! router and the second replica, Ready later, serves some of them. A replica's limit comes
//! from its load report, so the first table that lists it Ready must already carry one.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, ensure};
use prism_common::proto::v1::{ClusterStatusResponse, ReplicaState};
use prism_tests::{Cluster, Deployment, PROMPTS, greedy_request, model, stream};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Tokens per request (ignore_eos): long enough that the burst overlaps the second
/// replica's start on a loaded 2-core machine.
const MAX_TOKENS: u32 = 64;
/// Concurrent requests of the burst.
const BURST: usize = 8;
/// The deployment's `max_num_seqs`, and so each replica's limit in the router.
const MAX_NUM_SEQS: u32 = 2;

/// Ready replica ids in the order first seen Ready.
fn note_ready(st: &ClusterStatusResponse, order: &mut Vec<String>) {
    for r in &st.replicas {
        if r.state == ReplicaState::Ready as i32 && !order.contains(&r.replica_id) {
            order.push(r.replica_id.clone());
        }
    }
}

async fn burst_from_zero(cluster: &Cluster) -> Result<()> {
    let st = cluster.status().await?;
    ensure!(st.replicas.is_empty(), "the deployment starts with replicas: {:?}", st.replicas);
    let t0 = Instant::now();
    let clients: Vec<_> = (0..BURST)
        .map(|i| {
            let grpc = cluster.grpc().to_owned();
            tokio::spawn(
                async move { stream(&grpc, greedy_request(PROMPTS[i % PROMPTS.len()], MAX_TOKENS, true)).await },
            )
        })
        .collect();
    // Per replica: the most requests its engine held (running + waiting) in any report.
    let mut held: BTreeMap<String, u32> = BTreeMap::new();
    let mut order = Vec::new();
    while !clients.iter().all(tokio::task::JoinHandle::is_finished) {
        ensure!(t0.elapsed() < Duration::from_secs(240), "the burst did not finish in 240 s");
        let st = cluster.status().await?;
        note_ready(&st, &mut order);
        for l in &st.load {
            let n = held.entry(l.replica_id.clone()).or_default();
            *n = (*n).max(l.running + l.waiting);
        }
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let took = t0.elapsed();
    for c in clients {
        let r = c.await?.context("a request of the burst")?;
        ensure!(r.tokens.len() == MAX_TOKENS as usize, "{} tokens", r.tokens.len());
    }
    let first = order.first().context("no replica was seen Ready")?;
    let first_held = held.get(first).copied().unwrap_or(0);
    ensure!(
        first_held <= MAX_NUM_SEQS,
        "the first replica held {first_held} requests (limit {MAX_NUM_SEQS}): the queue was released to it \
         before its limit was known; per replica: {held:?}"
    );
    let second = order.get(1).context("no second replica became Ready during the burst")?;
    let served = cluster.router_dispatches(second).await?.unwrap_or(0.0);
    ensure!(served >= 1.0, "the second replica served none of the burst (dispatches {served}); per replica: {held:?}");
    eprintln!(
        "burst of {BURST} from zero in {:.1} s: first replica held at most {first_held}, the second got {served} \
         dispatches; most held per replica {held:?}",
        took.as_secs_f64()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_from_zero_gets_no_more_than_its_limit_of_a_queued_burst() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let deployment = Deployment::new(&model).engine("max_num_seqs", MAX_NUM_SEQS).autoscaling(&[
        ("min_replicas", "0"),
        ("max_replicas", "2"),
        ("initial_replicas", "0"),
        ("target_ongoing_requests", "1"),
        ("upscale_delay_s", "1"),
        ("downscale_delay_s", "60"),
    ]);
    let cluster = Cluster::builder()
        .head_args(&["--worker-timeout", "2s"])
        .workers(1)
        .worker_args(&["--kv-cache-bytes", "67108864", "--cpu-slots", "2"])
        .routers(1)
        .router_args(&["--max-queue-wait", "240"])
        .deploy(deployment)
        .start()
        .await?;
    let res = burst_from_zero(&cluster).await;
    cluster.with_logs(res)
}
