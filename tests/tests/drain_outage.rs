//! Serving cases C13 and C15 on a real local cluster (etcd, head, 2 workers on the bundled
//! SmolLM2 GGUF, router):
//! - `c13_head_killed_traffic_continues_and_state_rebuilt`: SIGKILL the head under load:
//!   streams keep completing token-exact while it is down (routers fail static, workers keep
//!   serving); the restarted head rebuilds state from etcd: the deployment and the same
//!   replicas come back without resubmission, and it never reports leadership with zero
//!   deployments.
//! - `c15_all_workers_killed_then_back`: SIGKILL every worker: requests fail fast with
//!   UNAVAILABLE (no hang); workers restarted with the same node ids get their replicas
//!   back and the same router serves again, token-exact.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

mod drain_support;
mod e2e_support;

use anyhow::{Result, bail};
use drain_support::{Cluster, ClusterOptions, Load, PROMPTS, greedy_request, reference, stream};
use e2e_support::{eventually, model};
use prism_common::proto::v1::ClusterStatusRequest;
use prism_common::proto::v1::head_service_client::HeadServiceClient;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX_TOKENS: u32 = 32;

fn two() -> ClusterOptions {
    ClusterOptions { workers: 2, replicas: 2, ..Default::default() }
}

async fn head_restart(cluster: &mut Cluster) -> Result<()> {
    let reference = Arc::new(reference(&cluster.grpc, MAX_TOKENS).await?);
    let mut before: Vec<String> = cluster.replicas().await?.into_iter().map(|r| r.replica_id).collect();
    before.sort();
    let load = Load::start(&cluster.grpc, 2, MAX_TOKENS, reference);
    load.wait_more(2, Duration::from_secs(60)).await?;
    cluster.kill_head();
    // Traffic continues while the head is down.
    load.wait_more(4, Duration::from_secs(60)).await?;
    cluster.restart_head()?;
    let head = cluster.head.clone();
    eventually(Duration::from_secs(60), "restarted head leads with the deployment", || {
        let head = head.clone();
        async move {
            let st =
                HeadServiceClient::connect(head).await?.cluster_status(ClusterStatusRequest {}).await?.into_inner();
            if st.is_leader && st.deployments.is_empty() {
                bail!("head is leader with zero deployments");
            }
            Ok((st.is_leader && !st.deployments.is_empty()).then_some(()))
        }
    })
    .await?;
    cluster.wait_ready(2, Duration::from_secs(60)).await?;
    let mut after: Vec<String> = cluster.replicas().await?.into_iter().map(|r| r.replica_id).collect();
    after.sort();
    assert_eq!(before, after, "replicas were not adopted");
    load.wait_more(2, Duration::from_secs(60)).await?;
    let report = load.stop().await?;
    report.check()?;
    eprintln!("C13: {} streams token-exact across the head restart", report.ok);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn c13_head_killed_traffic_continues_and_state_rebuilt() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::start(&model, two()).await?;
    if let Err(e) = head_restart(&mut cluster).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

async fn workers_gone(cluster: &mut Cluster) -> Result<()> {
    let reference = reference(&cluster.grpc, MAX_TOKENS).await?;
    for w in &mut cluster.workers {
        if let Some(mut p) = w.proc.take() {
            p.signal(nix::sys::signal::Signal::SIGKILL)?;
            let _ = p.wait_exit(Duration::from_secs(5))?;
        }
    }
    // Every request fails fast with UNAVAILABLE: no panic, no hang.
    let t = Instant::now();
    let mut failures = 0;
    while t.elapsed() < Duration::from_secs(6) {
        let sent = Instant::now();
        let res =
            tokio::time::timeout(Duration::from_secs(5), stream(&cluster.grpc, greedy_request(PROMPTS[0], 8, true)))
                .await;
        let took = sent.elapsed();
        match res {
            Ok(Err(e)) => {
                let code = e.downcast_ref::<tonic::Status>().map(tonic::Status::code);
                assert_eq!(code, Some(tonic::Code::Unavailable), "{e:#}");
                assert!(took < Duration::from_secs(3), "slow failure: {took:?}");
                failures += 1;
            }
            Ok(Ok(r)) => bail!("served with no worker alive: {r:?}"),
            Err(_) => bail!("request hung with no worker alive"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let http = reqwest::Client::new()
        .post(format!("{}/v1/completions", cluster.http))
        .json(&serde_json::json!({"model": drain_support::SERVED, "prompt": "Hi", "max_tokens": 4}))
        .send()
        .await?;
    assert_eq!(http.status().as_u16(), 503, "{}", http.text().await?);
    eprintln!("C15: {failures} requests failed fast with UNAVAILABLE while no worker was up");
    for node in ["w1", "w2"] {
        cluster.restart_worker(node)?;
    }
    cluster.wait_ready(2, Duration::from_secs(120)).await?;
    let grpc = cluster.grpc.clone();
    let first = reference[0].clone();
    eventually(Duration::from_secs(30), "router serves again", || {
        let (grpc, first) = (grpc.clone(), first.clone());
        async move {
            let r = stream(&grpc, greedy_request(PROMPTS[0], MAX_TOKENS, true)).await?;
            assert_eq!(r.tokens, first);
            Ok(Some(()))
        }
    })
    .await?;
    reference_check(&cluster.grpc, &reference).await
}

async fn reference_check(grpc: &str, expected: &[Vec<u32>]) -> Result<()> {
    let got = reference(grpc, MAX_TOKENS).await?;
    assert_eq!(got, expected);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn c15_all_workers_killed_then_back() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::start(&model, two()).await?;
    if let Err(e) = workers_gone(&mut cluster).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
