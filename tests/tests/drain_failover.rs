//! An operator's drain survives a head failover, on a real local cluster (etcd, two heads
//! with a 2 s leader lease, one worker with one CPU slot on the bundled SmolLM2 GGUF, router),
//! under greedy streaming load checked token by token against an undisturbed run:
//! - `a_new_leader_keeps_the_drained_replica_serving_until_the_original_deadline`: `prism
//!   drain w1 --deadline 25s` leaves nowhere for the replacement, so the only replica keeps
//!   serving; the leading head is SIGKILLed 8 s in. The follower that takes over publishes
//!   the replica as Ready (the router lists it under the new term), streams keep succeeding
//!   across the takeover, `prism status` at the new leader still says it serves until a
//!   replacement is Ready, and it stops serving at the deadline the operator asked for
//!   (counted from the drain, not from the takeover).
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail, ensure};
use prism_common::proto::v1::ReplicaState;
use prism_tests::{Cluster, Load, eventually, model, reference};
use std::sync::Arc;
use std::time::{Duration, Instant};

const MAX_TOKENS: u32 = 16;
const DEADLINE: Duration = Duration::from_secs(25);
/// When the leader is killed, counted from the drain.
const KILL_AFTER: Duration = Duration::from_secs(8);
/// From the deadline to the router's table without the replica: a reconcile pass (1 s) and
/// the table's way to the router. A takeover that restarted the deadline would end it at
/// least `KILL_AFTER` later.
const STOP_SLACK: Duration = Duration::from_secs(6);

/// SIGKILLs the leading head and waits for the follower to lead (it becomes the first head).
async fn kill_leader(cluster: &mut Cluster) -> Result<Duration> {
    let leader = cluster.wait_leader(Duration::from_secs(10)).await?;
    cluster.heads[leader].process.kill();
    let killed = Instant::now();
    cluster.heads.swap(0, 1 - leader.min(1));
    cluster.heads[0].wait_leader(Duration::from_secs(30)).await?;
    Ok(killed.elapsed())
}

async fn drain_through_failover(cluster: &mut Cluster) -> Result<()> {
    let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
    let load = Load::start(cluster.grpc(), 2, MAX_TOKENS, Arc::clone(&reference));
    load.wait_more(2, Duration::from_secs(60)).await?;
    let replica = cluster.replica_on("w1").await?.context("no replica on w1")?;
    let t0 = Instant::now();
    let deadline = format!("{}s", DEADLINE.as_secs());
    cluster.cli(&["drain", "w1", "--deadline", &deadline])?;
    let drained = Instant::now();
    ensure!(cluster.router_ready_replicas().await? == 1, "the drained replica serves before the failover");
    tokio::time::sleep(KILL_AFTER.saturating_sub(t0.elapsed())).await;

    let term_before = cluster.router_metric("prism_route_table_term").await?;
    let took = kill_leader(cluster).await?;
    eprintln!("leader SIGKILLed {:?} into the drain; the follower leads after {took:?}", KILL_AFTER);
    let c: &Cluster = cluster;
    eventually(Duration::from_secs(30), "the router applies the new leader's table", || async {
        Ok((c.router_metric("prism_route_table_term").await? > term_before).then_some(()))
    })
    .await?;
    ensure!(t0.elapsed() < DEADLINE, "the takeover outlasted the drain's deadline");
    ensure!(cluster.router_ready_replicas().await? == 1, "the new leader publishes the drained replica as Ready");
    let rec = cluster.replicas().await?.into_iter().find(|r| r.replica_id == replica).context("replica gone")?;
    ensure!(
        rec.state() == ReplicaState::Draining && rec.reason.contains("serving until a replacement is Ready"),
        "at the new leader: {:?} {:?}",
        rec.state(),
        rec.reason
    );
    // Streams started under the new leader's table are served too.
    load.wait_more(2, Duration::from_secs(30)).await?;
    ensure!(t0.elapsed() < DEADLINE, "the streams after the takeover outlasted the drain's deadline");
    let served = load.stop().await?;
    served.check()?;
    eprintln!("through the failover: {} streams token-exact, no error, after {:?}", served.ok, t0.elapsed());

    // It stops serving at the original deadline, not one restarted by the new leader.
    let stopped = cluster.wait_route_change(1, DEADLINE * 2).await?;
    let (after_t0, after_drained) = (stopped - t0, stopped.saturating_duration_since(drained));
    eprintln!("stopped serving {after_t0:?} after the drain (deadline {DEADLINE:?})");
    ensure!(after_t0 >= DEADLINE - Duration::from_secs(1), "stopped serving {after_t0:?} into a {DEADLINE:?} drain");
    ensure!(
        after_drained <= DEADLINE + STOP_SLACK,
        "stopped serving {after_drained:?} after a {DEADLINE:?} drain: the new leader did not keep its deadline"
    );
    let rec = cluster.replicas().await?.into_iter().find(|r| r.replica_id == replica);
    if let Some(rec) = rec {
        ensure!(rec.reason.ends_with("drain deadline passed"), "{:?} {:?}", rec.state(), rec.reason);
    }
    eventually(Duration::from_secs(30), "drained replica stopped", || {
        let (c, r) = (&*cluster, replica.clone());
        async move { Ok(c.replicas().await?.iter().all(|x| x.replica_id != r).then_some(())) }
    })
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_new_leader_keeps_the_drained_replica_serving_until_the_original_deadline() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::serving(&model, 1, 1).heads(2).head_args(&["--lease-ttl", "2s"]).start().await?;
    if let Err(e) = drain_through_failover(&mut cluster).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
