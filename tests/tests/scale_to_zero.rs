//! Scale to zero and back on a real local cluster (etcd, head, one worker on the bundled
//! SmolLM2 GGUF, router), with a deployment autoscaled between 0 and 1 replicas
//! (downscale after 3 s idle, look-back 2 s):
//! - after the idle period the deployment has 0 replicas, the model stays listed and the
//!   router stays ready (`/readyz`, `/health`);
//! - 5 clients that send a request and disconnect during the cold start (no replica Ready yet)
//!   do not abort it: the replica still becomes Ready, and the router's queue is empty again;
//! - back at zero, the next request waits in the router's queue while the head starts a
//!   replica and is answered token-exact (the cold start is its time to first token).
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, ensure};
use prism_common::proto::v1::{ClusterStatusResponse, ReplicaState};
use prism_tests::{Cluster, Deployment, PROMPTS, eventually, greedy_request, model, reference, stream};
use std::time::{Duration, Instant};

const MAX_TOKENS: u32 = 16;

fn active(st: &ClusterStatusResponse) -> usize {
    st.replicas
        .iter()
        .filter(|r| {
            [ReplicaState::Pending, ReplicaState::Starting, ReplicaState::Ready, ReplicaState::Draining]
                .iter()
                .any(|s| *s as i32 == r.state)
        })
        .count()
}

fn ready(st: &ClusterStatusResponse) -> usize {
    st.replicas.iter().filter(|r| r.state == ReplicaState::Ready as i32).count()
}

/// Waits until the deployment has no replica left (and its target is 0).
async fn wait_zero(cluster: &Cluster) -> Result<Duration> {
    let t = Instant::now();
    eventually(Duration::from_secs(60), "0 replicas", || async {
        let st = cluster.status().await?;
        let target = st.deployments.first().and_then(|d| d.spec.as_ref()).map_or(u32::MAX, |s| s.replicas);
        Ok((target == 0 && active(&st) == 0).then_some(()))
    })
    .await?;
    Ok(t.elapsed())
}

async fn scale_to_zero_and_back(cluster: &Cluster) -> Result<()> {
    let reference = reference(cluster.grpc(), MAX_TOKENS).await?;
    let idle = wait_zero(cluster).await?;
    let models = reqwest::get(format!("{}/v1/models", cluster.http())).await?.text().await?;
    ensure!(models.contains("\"smollm2\""), "the model is no longer listed at zero replicas: {models}");
    // The router stays ready at zero: a Service that dropped it would never pass it the
    // request that scales the model up.
    for probe in ["/readyz", "/health"] {
        let status = reqwest::get(format!("{}{probe}", cluster.http())).await?.status().as_u16();
        ensure!(status == 200, "{probe} answers {status} at zero replicas");
    }

    // Five impatient clients: each gives up 50 ms into the cold start (placing and loading
    // the replica takes longer), which the head has begun by then.
    let impatient = (0..5).map(|i| {
        let grpc = cluster.grpc().to_owned();
        async move {
            let req = greedy_request(PROMPTS[i % PROMPTS.len()], MAX_TOKENS, true);
            tokio::time::timeout(Duration::from_millis(50), stream(&grpc, req)).await.is_err()
        }
    });
    let gave_up = futures::future::join_all(impatient).await.into_iter().filter(|g| *g).count();
    ensure!(gave_up == 5, "only {gave_up} of 5 clients were still waiting after 50 ms (no cold start?)");
    let t = Instant::now();
    let st = cluster.status().await?;
    let during = ready(&st) == 0;
    eventually(Duration::from_secs(120), "the cold start to finish", || async {
        Ok((ready(&cluster.status().await?) == 1).then_some(()))
    })
    .await?;
    let cold_start = t.elapsed();
    ensure!(during, "the replica was Ready before the clients gave up: {:?}", st.replicas);
    ensure!(cluster.router_metric("prism_router_queue_depth").await? == 0.0, "requests left in the router's queue");

    // Back to zero; then a patient request is served after a cold start.
    wait_zero(cluster).await?;
    let t = Instant::now();
    let r =
        stream(cluster.grpc(), greedy_request(PROMPTS[0], MAX_TOKENS, true)).await.context("the request at zero")?;
    let served_after = t.elapsed();
    ensure!(r.tokens == reference[0], "tokens differ from the undisturbed run: {:?} vs {:?}", r.tokens, reference[0]);
    let st = cluster.status().await?;
    ensure!(ready(&st) == 1, "{:?}", st.replicas);
    let last = st.deployments.first().and_then(|d| d.last_scaling.clone()).context("no scaling decision")?;
    ensure!((last.from_replicas, last.to_replicas) == (0, 1), "{last:?}");
    eprintln!(
        "scale to zero after {:.1} s idle; 5 clients gone 50 ms into a cold start: Ready {:.1} s later anyway; \
         a request at zero answered token-exact in {:.1} s (cold start included; reason {:?})",
        idle.as_secs_f64(),
        cold_start.as_secs_f64(),
        served_after.as_secs_f64(),
        last.reason
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scale_to_zero_then_cold_start_on_demand() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let deployment = Deployment::new(&model).autoscaling(&[
        ("min_replicas", "0"),
        ("max_replicas", "1"),
        ("initial_replicas", "1"),
        ("upscale_delay_s", "1"),
        ("downscale_delay_s", "3"),
        ("look_back_period_s", "2"),
    ]);
    let cluster = Cluster::builder()
        .head_args(&["--worker-timeout", "2s", "--drain-timeout", "30s"])
        .workers(1)
        .worker_args(&["--kv-cache-bytes", "67108864"])
        .routers(1)
        .router_args(&["--max-queue-wait", "120"])
        .deploy(deployment)
        .start()
        .await?;
    let res = scale_to_zero_and_back(&cluster).await;
    cluster.with_logs(res)
}
