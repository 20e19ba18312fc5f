//! Head and worker outages on a real local cluster (etcd, head, 2 workers on the bundled
//! SmolLM2 GGUF, router):
//! - `head_killed_traffic_continues_and_state_rebuilt`: SIGKILL the head under load:
//!   streams keep completing token-exact while it is down (routers fail static, workers keep
//!   serving); the restarted head rebuilds state from etcd: the deployment and the same
//!   replicas come back without resubmission, and it never reports leadership with zero
//!   deployments; the workers log the lost session as a gRPC code and message.
//! - `all_workers_killed_then_back`: SIGKILL every worker: requests fail fast with
//!   UNAVAILABLE (no hang: at once while the dead replicas are listed and ejected; once the
//!   head has removed them the model has no Ready replica, so a request waits in the router's
//!   admission queue for one, here `--max-queue-wait 1`, then gets UNAVAILABLE); workers restarted with the same node ids get their replicas
//!   back and the same router serves again, token-exact.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Result, bail};
use prism_common::proto::v1::ClusterStatusRequest;
use prism_common::proto::v1::head_service_client::HeadServiceClient;
use prism_tests::{Cluster, Load, PROMPTS, SERVED, eventually, greedy_request, model, reference, stream};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX_TOKENS: u32 = 32;

async fn head_restart(cluster: &mut Cluster) -> Result<()> {
    let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
    let mut before: Vec<String> = cluster.replicas().await?.into_iter().map(|r| r.replica_id).collect();
    before.sort();
    let load = Load::start(cluster.grpc(), 2, MAX_TOKENS, reference);
    load.wait_more(2, Duration::from_secs(60)).await?;
    cluster.kill_head();
    // Traffic continues while the head is down.
    load.wait_more(4, Duration::from_secs(60)).await?;
    cluster.restart_head()?;
    let head = cluster.head_url().to_owned();
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
    eprintln!("head restart: {} streams token-exact across it", report.ok);
    // Each worker logged losing its head session as a code and a message, not as a dump of
    // the gRPC status (its code's description, quoted message and the cause's Debug form).
    for w in &cluster.workers {
        let log = w.process.stderr();
        let lost: Vec<&str> = log.lines().filter(|l| l.contains("head session ended; reconnecting")).collect();
        assert!(!lost.is_empty(), "{} did not log losing its head session:\n{log}", w.node);
        for line in lost {
            assert!(!line.contains("code: '") && !line.contains("source: "), "{line}");
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn head_killed_traffic_continues_and_state_rebuilt() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::serving(&model, 2, 2).start().await?;
    if let Err(e) = head_restart(&mut cluster).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

async fn workers_gone(cluster: &mut Cluster) -> Result<()> {
    let reference = reference(cluster.grpc(), MAX_TOKENS).await?;
    for w in &mut cluster.workers {
        w.process.signal(nix::sys::signal::Signal::SIGKILL)?;
        let _ = w.process.wait_exit(Duration::from_secs(5)).await?;
    }
    // Every request fails fast with UNAVAILABLE: no panic, no hang.
    let t = Instant::now();
    let mut failures = 0;
    while t.elapsed() < Duration::from_secs(6) {
        let sent = Instant::now();
        let res =
            tokio::time::timeout(Duration::from_secs(5), stream(cluster.grpc(), greedy_request(PROMPTS[0], 8, true)))
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
        .post(format!("{}/v1/completions", cluster.http()))
        .json(&serde_json::json!({"model": SERVED, "prompt": "Hi", "max_tokens": 4}))
        .send()
        .await?;
    assert_eq!(http.status().as_u16(), 503, "{}", http.text().await?);
    eprintln!("no worker up: {failures} requests failed fast with UNAVAILABLE");
    for node in ["w1", "w2"] {
        cluster.restart_worker(node)?;
    }
    cluster.wait_ready(2, Duration::from_secs(120)).await?;
    let grpc = cluster.grpc().to_owned();
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
    reference_check(cluster.grpc(), &reference).await
}

async fn reference_check(grpc: &str, expected: &[Vec<u32>]) -> Result<()> {
    let got = reference(grpc, MAX_TOKENS).await?;
    assert_eq!(got, expected);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn all_workers_killed_then_back() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::serving(&model, 2, 2).router_args(&["--max-queue-wait", "1"]).start().await?;
    if let Err(e) = workers_gone(&mut cluster).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
