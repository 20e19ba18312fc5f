//! Draining the node of a deployment's only replica on a real local cluster (etcd, head,
//! workers with one CPU slot each on the bundled SmolLM2 GGUF, router), under greedy
//! streaming load checked token by token against an undisturbed run:
//! - `only_replica_serves_until_the_deadline_or_its_replacement`: with one worker, `prism
//!   drain w1 --deadline 10s` leaves nowhere for the replacement: the replica keeps taking
//!   new requests (no client error, the router keeps dispatching to it, `prism status` says
//!   it serves until a replacement is Ready) and stops only at the deadline; after `prism
//!   uncordon w1` and a second worker `w2`, draining w1 again stops its replica as soon as
//!   the replacement on w2 is Ready, long before the deadline, without a client error.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail, ensure};
use prism_common::proto::v1::ReplicaState;
use prism_tests::{Cluster, Load, eventually, model, reference};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX_TOKENS: u32 = 16;

fn dispatch_metric(replica: &str) -> String {
    format!("prism_router_replica_dispatches_total{{replica_id=\"{replica}\"}}")
}

async fn serves_until_deadline(cluster: &mut Cluster, reference: &Arc<Vec<Vec<u32>>>) -> Result<()> {
    let load = Load::start(cluster.grpc(), 2, MAX_TOKENS, Arc::clone(reference));
    load.wait_more(2, Duration::from_secs(60)).await?;
    let replica = cluster.replica_on("w1").await?.context("no replica on w1")?;
    let t0 = Instant::now();
    let out = cluster.cli(&["drain", "w1", "--deadline", "10s"])?;
    eprintln!("prism drain: {}", out.trim());
    // Well inside the deadline the replica still takes new requests, and nothing fails.
    let before = cluster.router_metric(&dispatch_metric(&replica)).await?;
    eventually(Duration::from_secs(6), "new requests on the drained replica", || {
        let (c, r) = (&*cluster, replica.clone());
        async move { Ok((c.router_metric(&dispatch_metric(&r)).await? >= before + 3.0).then_some(())) }
    })
    .await?;
    assert_eq!(cluster.router_ready_replicas().await?, 1, "the router lists the drained replica as Ready");
    let status = cluster.cli(&["status"])?;
    assert!(status.contains("serving until a replacement is Ready"), "{status}");
    let served = load.stop().await?;
    served.check()?;
    eprintln!("during the drain: {} streams token-exact, no error, after {:?}", served.ok, t0.elapsed());
    // It stops at the deadline, not before.
    eventually(Duration::from_secs(30), "drained replica stopped", || {
        let (c, r) = (&*cluster, replica.clone());
        async move { Ok(c.replicas().await?.iter().all(|x| x.replica_id != r).then_some(())) }
    })
    .await?;
    let stopped = t0.elapsed();
    ensure!(stopped >= Duration::from_secs(9), "stopped {stopped:?} after a drain with a 10 s deadline");
    eprintln!("only replica stopped {stopped:?} after the drain (deadline 10 s)");
    Ok(())
}

async fn serves_until_replaced(cluster: &mut Cluster, reference: &Arc<Vec<Vec<u32>>>) -> Result<()> {
    cluster.cli(&["uncordon", "w1"])?;
    cluster.wait_ready(1, Duration::from_secs(120)).await?;
    let replica = cluster.replica_on("w1").await?.context("placement did not resume on w1")?;
    cluster.add_worker("w2")?;
    cluster.wait_registered(2, Duration::from_secs(30)).await?;
    let load = Load::start(cluster.grpc(), 2, MAX_TOKENS, Arc::clone(reference));
    load.wait_more(2, Duration::from_secs(60)).await?;
    let t0 = Instant::now();
    cluster.cli(&["drain", "w1", "--deadline", "120s"])?;
    eventually(Duration::from_secs(90), "replaced on w2, drained replica stopped", || {
        let (c, r) = (&*cluster, replica.clone());
        async move {
            let recs = c.replicas().await?;
            let gone = recs.iter().all(|x| x.replica_id != r);
            let on_w2 = recs.iter().any(|x| x.node_id == "w2" && x.state() == ReplicaState::Ready);
            Ok((gone && on_w2).then_some(()))
        }
    })
    .await?;
    eprintln!("replaced and stopped {:?} after the drain (deadline 120 s)", t0.elapsed());
    load.wait_more(2, Duration::from_secs(60)).await?;
    let report = load.stop().await?;
    report.check()?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_replica_serves_until_the_deadline_or_its_replacement() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::serving(&model, 1, 1).start().await?;
    let res = async {
        let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
        serves_until_deadline(&mut cluster, &reference).await?;
        serves_until_replaced(&mut cluster, &reference).await
    }
    .await;
    if let Err(e) = res {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
