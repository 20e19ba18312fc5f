//! Network partitions on a real local cluster (etcd, head, two workers on the bundled SmolLM2
//! GGUF), cut with a [`TcpProxy`] between two components, under four streaming clients whose
//! every stream is compared token by token with an undisturbed run:
//! - `router_cut_from_head_keeps_serving_and_learns_the_drain`: the router reaches the head
//!   only through the proxy; the link is cut for 60 s. The router keeps serving from its last
//!   table; an operator drain of one worker started meanwhile reaches the router when the link
//!   heals, and from then on no request goes to the drained replica.
//! - `worker_cut_from_head_is_replaced_then_reconciled`: one worker reaches the head only
//!   through the proxy; the link is cut for longer than `--worker-timeout`. The head declares
//!   the worker dead and places its replica on a spare worker; the routers move the streams it
//!   held (token-exact) once its replica leaves the routes. After healing, the worker re-registers, the head
//!   stops the replica no record assigns to it, and the deployment is back at its desired
//!   count on the two reachable workers, with no request lost.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_tests::{Cluster, Deployment, Load, Router, TcpProxy, Worker, eventually, model, reference};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX_TOKENS: u32 = 24;
const CLIENTS: usize = 4;
const PARTITION: Duration = Duration::from_secs(60);

async fn router_cut_from_head(cluster: &mut Cluster) -> Result<()> {
    let head: SocketAddr = cluster.head_url().trim_start_matches("http://").parse()?;
    let proxy = TcpProxy::start(head).await?;
    let args = ["--ejection-base".to_owned(), "0.5".to_owned()];
    cluster.routers.push(Router::spawn("prism-router", &proxy.url(), &args, &[])?);
    let c: &Cluster = cluster;
    eventually(Duration::from_secs(60), "the router sees both replicas", || async {
        Ok((c.router_ready_replicas().await? >= 2).then_some(()))
    })
    .await?;
    let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
    let drained = cluster.replica_on("w1").await?.context("w1 hosts no replica")?;
    let load = Load::start(cluster.grpc(), CLIENTS, MAX_TOKENS, reference);
    load.wait_more(CLIENTS, Duration::from_secs(60)).await?;

    proxy.cut();
    let cut = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;
    cluster.cli(&["drain", "w1", "--deadline", "20s"])?;
    let before_drain = load.finished();
    tokio::time::sleep(PARTITION.saturating_sub(cut.elapsed())).await;
    let during = load.finished() - before_drain;
    proxy.heal();
    let healed = Instant::now();

    let c: &Cluster = cluster;
    eventually(Duration::from_secs(30), "the router learns the drain", || async {
        Ok((c.router_ready_replicas().await? == 1).then_some(()))
    })
    .await?;
    let learned = healed.elapsed();
    let sent = cluster.router_dispatches(&drained).await?;
    load.wait_more(2 * CLIENTS, Duration::from_secs(60)).await?;
    let sent_after = cluster.router_dispatches(&drained).await?;
    let report = load.stop().await?;
    report.check()?;
    assert!(during > 0, "nothing was served during the partition");
    // Unchanged, or gone with the replica (the router drops a replica's series when it leaves
    // the table).
    assert!(
        sent_after.is_none() || sent_after == sent,
        "requests went to the drained replica {drained} after the router learned the drain: {sent:?} then {sent_after:?}"
    );
    eprintln!(
        "router <-> head cut {} s: {} streams token-exact ({during} finished after the drain, during the cut), 0 failed; \
         the router learned the drain {:.1} s after healing; {} requests had gone to the drained replica, none after",
        PARTITION.as_secs(),
        report.ok,
        learned.as_secs_f64(),
        sent.unwrap_or(0.0)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn router_cut_from_head_keeps_serving_and_learns_the_drain() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::serving(&model, 2, 2).routers(0).start().await?;
    if let Err(e) = router_cut_from_head(&mut cluster).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

async fn worker_cut_from_head(cluster: &mut Cluster, model: &std::path::Path) -> Result<()> {
    let head: SocketAddr = cluster.head_url().trim_start_matches("http://").parse()?;
    let proxy = TcpProxy::start(head).await?;
    let args = ["--kv-cache-bytes".to_owned(), "67108864".to_owned()];
    cluster.workers.push(Worker::spawn("w1", &proxy.url(), &args, &[])?);
    cluster.add_worker("w2")?;
    cluster.wait_registered(2, Duration::from_secs(60)).await?;
    cluster.deploy(&Deployment::new(model).replicas(2))?;
    cluster.wait_ready(2, Duration::from_secs(180)).await?;
    let cut_off = cluster.replica_on("w1").await?.context("w1 hosts no replica")?;
    // A spare worker: capacity for the replacement.
    cluster.add_worker("w3")?;
    cluster.wait_registered(3, Duration::from_secs(60)).await?;
    let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
    let load = Load::start(cluster.grpc(), CLIENTS, MAX_TOKENS, reference);
    load.wait_more(CLIENTS, Duration::from_secs(60)).await?;

    proxy.cut();
    let cut = Instant::now();
    let c: &Cluster = cluster;
    eventually(Duration::from_secs(120), "a replacement Ready on w3", || async {
        Ok(c.replica_on("w3").await?.is_some().then_some(()))
    })
    .await?;
    let replaced = cut.elapsed();
    load.wait_more(CLIENTS, Duration::from_secs(60)).await?;
    proxy.heal();
    let healed = Instant::now();
    eventually(Duration::from_secs(60), "back at the desired count, nothing on w1", || async {
        let replicas = c.replicas().await?;
        let live: Vec<_> = replicas
            .iter()
            .filter(|r| matches!(r.state(), prism_common::proto::v1::ReplicaState::Ready))
            .map(|r| r.node_id.clone())
            .collect();
        let mut nodes = live.clone();
        nodes.sort();
        Ok((nodes == ["w2", "w3"]).then_some(()))
    })
    .await?;
    // The cut-off worker re-registers and the head stops the replica it still holds.
    eventually(Duration::from_secs(60), "w1 re-registered and its orphan replica stopped", || async {
        let (state, _) = c.node_state("w1").await?;
        let log = c.head().process.stderr();
        let stopped = log.lines().any(|l| l.contains("stopping a replica no record assigns") && l.contains(&cut_off));
        Ok((state == prism_common::proto::v1::NodeState::Ready && stopped).then_some(()))
    })
    .await?;
    let reconciled = healed.elapsed();
    load.wait_more(CLIENTS, Duration::from_secs(60)).await?;
    let report = load.stop().await?;
    report.check()?;
    eprintln!(
        "worker <-> head cut: replica {cut_off} replaced on w3 {:.1} s after the cut; after healing w1 \
         re-registered and its orphan was stopped within {:.1} s, the deployment at 2 Ready (w2, w3); {} streams token-exact, 0 failed",
        replaced.as_secs_f64(),
        reconciled.as_secs_f64(),
        report.ok
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_cut_from_head_is_replaced_then_reconciled() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::builder()
        .head_args(&["--worker-timeout", "2s", "--drain-timeout", "30s"])
        .routers(1)
        .router_args(&["--ejection-base", "0.5"])
        .start()
        .await?;
    if let Err(e) = worker_cut_from_head(&mut cluster, &model).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
