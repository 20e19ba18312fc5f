//! A stall of the head itself is not held against the workers. A head process that was stopped
//! (SIGSTOP here: a frozen VM or container, a host starved of CPU) sees every worker's silence
//! timer expired when it resumes, before it has read what the workers sent meanwhile; it must
//! read on instead of declaring them Dead, so no Ready replica is evicted or replaced.
//!
//! Real cluster (`Cluster::serving`): etcd, `prism-head` with `--worker-timeout 2s` (leader lease
//! 5 s), two `prism-worker`s with one replica each of the bundled SmolLM2 GGUF (CPU engine), a
//! router. The head is stopped for twice the worker timeout, under the lease, so it stays the
//! leader and judges its own sessions when it resumes; then for 9 s, past the lease, so it
//! leads again with a reloaded state.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Result, bail};
use prism_common::proto::v1::{NodeState, ReplicaState};
use prism_tests::{Cluster, PROMPTS, greedy_request, model, stream};

/// The head's `--worker-timeout` in the serving fixture.
const WORKER_TIMEOUT: Duration = Duration::from_secs(2);
/// How long the head is stopped: twice the worker timeout, under the 5 s lease.
const STOPPED: Duration = Duration::from_secs(4);
/// The second stop: past the head's 5 s leader lease.
const PAST_LEASE: Duration = Duration::from_secs(9);
/// Time after the resume for a wrong verdict to show: the worker timeout again, a reconcile
/// pass and the stop/start of a replica would all be visible by then.
const AFTER: Duration = Duration::from_secs(5);

/// Ready replicas by id, with their node.
async fn ready(c: &Cluster) -> Result<BTreeMap<String, String>> {
    Ok(c.status()
        .await?
        .replicas
        .into_iter()
        .filter(|r| r.state() == ReplicaState::Ready)
        .map(|r| (r.replica_id, r.node_id))
        .collect())
}

async fn scenario(c: &Cluster) -> Result<()> {
    let before = ready(c).await?;
    assert_eq!(before.len(), 2, "both replicas Ready before the stall: {before:?}");
    c.head().process.freeze()?;
    tokio::time::sleep(STOPPED).await;
    c.head().process.thaw()?;
    tokio::time::sleep(AFTER).await;

    let status = c.status().await?;
    let dead: Vec<String> = status
        .nodes
        .iter()
        .filter(|n| n.state() == NodeState::Dead)
        .map(|n| n.inventory.as_ref().map(|i| i.node_id.clone()).unwrap_or_default())
        .collect();
    assert!(dead.is_empty(), "workers declared Dead after a {STOPPED:?} stall of the head: {dead:?}");
    assert_eq!(ready(c).await?, before, "the same replicas on the same nodes, all Ready");
    let log = c.head().process.stderr();
    assert!(log.contains("this head was not running"), "the head logs its own stall");
    assert!(!log.contains("worker session silent"), "no session judged silent over the stall");

    let reply = stream(c.grpc(), greedy_request(PROMPTS[0], 8, true)).await?;
    assert_eq!(reply.tokens.len(), 8, "served after the stall: {reply:?}");

    // Stopped past its lease: the head loses its leadership, wins it again, reloads the state
    // and gives the known workers their adoption grace; again no replica moves.
    c.head().process.freeze()?;
    tokio::time::sleep(PAST_LEASE).await;
    c.head().process.thaw()?;
    c.wait_leader(Duration::from_secs(30)).await?;
    tokio::time::sleep(AFTER).await;
    assert!(c.head().process.stderr().contains("leadership lost"), "the lease lapsed during the stop");
    assert_eq!(ready(c).await?, before, "the same replicas after a stop past the lease");
    let reply = stream(c.grpc(), greedy_request(PROMPTS[0], 8, true)).await?;
    assert_eq!(reply.tokens.len(), 8, "served after the second stall: {reply:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopped_head_declares_no_healthy_worker_dead_when_it_resumes() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    assert!(STOPPED > WORKER_TIMEOUT);
    let c = Cluster::serving(&model, 2, 2).start().await?;
    let result = scenario(&c).await;
    // Never leave a stopped process behind, whatever happened.
    let _ = c.head().process.thaw();
    if let Err(e) = result {
        bail!("{e:#}\n{}", c.logs());
    }
    Ok(())
}
