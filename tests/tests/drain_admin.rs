//! Operator-initiated drains on a real local cluster (etcd, head, 3 workers on the bundled
//! SmolLM2 GGUF, router), under greedy streaming load checked token by token against an
//! undisturbed run:
//! - `prism_drain_then_uncordon_resumes_placement`: `prism drain w3`: its replacement stays
//!   Pending (no free slot), so its replica serves until the 20 s deadline; from the route
//!   update then on nothing is dispatched to it, no request fails, the replica stops and
//!   its node stays cordoned;
//!   `prism uncordon w3`: placement resumes on it.
//! - `scale_down_during_long_streams`: `prism scale smollm2 1` while streams run on
//!   every replica: no client error, token-exact streams, the removed replicas stop.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::{NodeState, ReplicaState};
use prism_tests::{Cluster, Load, eventually, model, reference};
use std::sync::Arc;
use std::time::Duration;

const MAX_TOKENS: u32 = 32;

async fn drain_and_uncordon(cluster: &mut Cluster) -> Result<()> {
    let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
    let load = Load::start(cluster.grpc(), 3, MAX_TOKENS, reference);
    load.wait_more(3, Duration::from_secs(60)).await?;
    let replica = cluster.replica_on("w3").await?.context("no replica on w3")?;
    let out = cluster.cli(&["drain", "w3", "--deadline", "20s"])?;
    // Not replaced (no free slot): it serves until the deadline.
    cluster.wait_route_change(3, Duration::from_secs(30)).await?;
    let after_update = cluster.router_dispatches(&replica).await?;
    eprintln!("prism drain: {}", out.trim());
    assert_eq!(cluster.node_state("w3").await?, (NodeState::Draining, true));
    // The drained replica stops (idle or at the deadline); nothing replaces it on w3. Its
    // dispatch count is sampled all along: unchanged while the router lists it, then gone
    // with it (the router drops a replica's series when it leaves the table).
    let seen = std::sync::Mutex::new(Vec::new());
    eventually(Duration::from_secs(40), "drained replica stopped", || {
        let (c, r, seen) = (&*cluster, replica.clone(), &seen);
        async move {
            let sent = c.router_dispatches(&r).await?;
            seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(sent);
            Ok(c.replicas().await?.iter().all(|x| x.replica_id != r).then_some(()))
        }
    })
    .await?;
    load.wait_more(3, Duration::from_secs(60)).await?;
    let mut seen = seen.into_inner().unwrap_or_else(std::sync::PoisonError::into_inner);
    seen.push(cluster.router_dispatches(&replica).await?);
    assert!(
        seen.iter().all(|&sent| sent.is_none() || sent == after_update),
        "dispatched after the route update: {after_update:?} then {seen:?}"
    );
    let recs = cluster.replicas().await?;
    assert!(recs.iter().all(|r| r.node_id != "w3"), "placed on a drained node: {recs:?}");
    assert_eq!(recs.iter().filter(|r| r.state() == ReplicaState::Ready).count(), 2);
    let status = cluster.cli(&["status"])?;
    assert!(status.lines().any(|l| l.starts_with("w3") && l.contains("cordoned")), "{status}");

    cluster.cli(&["uncordon", "w3"])?;
    cluster.wait_ready(3, Duration::from_secs(120)).await?;
    let on_w3 = cluster.replica_on("w3").await?.context("placement did not resume on w3")?;
    assert_ne!(on_w3, replica);
    assert_eq!(cluster.node_state("w3").await?, (NodeState::Ready, false));
    // The new replica takes traffic.
    eventually(Duration::from_secs(60), "traffic on the new replica", || {
        let (c, r) = (&*cluster, on_w3.clone());
        async move { Ok((c.router_dispatches(&r).await?.unwrap_or(0.0) >= 1.0).then_some(())) }
    })
    .await?;
    let report = load.stop().await?;
    report.check()?;
    eprintln!("drain/uncordon: {} streams token-exact, no error", report.ok);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prism_drain_then_uncordon_resumes_placement() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::serving(&model, 3, 3).start().await?;
    if let Err(e) = drain_and_uncordon(&mut cluster).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

async fn scale_down(cluster: &mut Cluster) -> Result<()> {
    let max_tokens = 64;
    let reference = Arc::new(reference(cluster.grpc(), max_tokens).await?);
    let load = Load::start(cluster.grpc(), 4, max_tokens, reference);
    load.wait_more(2, Duration::from_secs(90)).await?;
    let out = cluster.cli(&["scale", "smollm2", "1"])?;
    eprintln!("{}", out.trim());
    eventually(Duration::from_secs(60), "two replicas removed", || {
        let c = &*cluster;
        async move { Ok((c.replicas().await?.len() == 1).then_some(())) }
    })
    .await?;
    cluster.wait_ready(1, Duration::from_secs(30)).await?;
    load.wait_more(4, Duration::from_secs(120)).await?;
    let report = load.stop().await?;
    report.check()?;
    let migrations = cluster.router_metric("prism_router_migrations_total").await?;
    eprintln!("scale-down: {} streams token-exact, {migrations} migrations", report.ok);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scale_down_during_long_streams() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::serving(&model, 3, 3).start().await?;
    if let Err(e) = scale_down(&mut cluster).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
