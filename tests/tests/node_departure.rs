//! Nodes that are gone leave the node list, on a real local cluster (etcd, a head with
//! `--worker-timeout 2s --dead-node-retention 3s`, two real `prism-worker`s, one replica of
//! the bundled SmolLM2 GGUF):
//! - `a_worker_that_drains_and_leaves_is_forgotten_and_a_dead_one_after_the_retention`:
//!   SIGTERM the replica's worker: it drains and exits 0, and its node leaves the node list
//!   as its session ends — well before `--worker-timeout`, and never shown Ready once the
//!   process is gone; the replica is Ready on the other worker. The same node id then comes
//!   back and registers as usual. `kill -9` of the other worker (now holding the replica):
//!   its node is Dead after `--worker-timeout`, the replica is replaced on the first worker,
//!   and the node is forgotten the retention after it was last seen, when no replica names
//!   it any more; it too registers again when restarted.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::{NodeState, ReplicaState};
use prism_tests::{Cluster, Deployment, eventually, model};
use std::time::{Duration, Instant};

const WORKER_TIMEOUT: Duration = Duration::from_secs(2);
const RETENTION: Duration = Duration::from_secs(3);

/// The node's state at the head, `None` when it is not listed.
async fn listed(cluster: &Cluster, node: &str) -> Result<Option<NodeState>> {
    Ok(cluster
        .status()
        .await?
        .nodes
        .iter()
        .find(|n| n.inventory.as_ref().is_some_and(|i| i.node_id == node))
        .map(|n| n.state()))
}

/// The node holding the one Ready replica, once there is exactly one and it is not on `not`.
async fn ready_replica_node(cluster: &Cluster, not: &str) -> Result<String> {
    eventually(Duration::from_secs(120), "the replica Ready on another node", || async {
        let ready: Vec<String> = cluster
            .replicas()
            .await?
            .into_iter()
            .filter(|r| r.state() == ReplicaState::Ready)
            .map(|r| r.node_id)
            .collect();
        Ok(match ready.as_slice() {
            [one] if one != not => Some(one.clone()),
            _ => None,
        })
    })
    .await
}

async fn comes_back(cluster: &mut Cluster, node: &str) -> Result<()> {
    cluster.restart_worker(node)?;
    eventually(Duration::from_secs(30), "the node registered again", || async {
        Ok((listed(cluster, node).await? == Some(NodeState::Ready)).then_some(()))
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_drains_and_leaves_is_forgotten_and_a_dead_one_after_the_retention() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::builder()
        .head_args(&["--worker-timeout", "2s", "--dead-node-retention", "3s"])
        .worker_nodes(&["w1", "w2"])
        .worker_args(&["--kv-cache-bytes", "67108864", "--engine-threads", "1"])
        .deploy(Deployment::new(&model).replicas(1))
        .start()
        .await?;
    let outcome = async {
        // SIGTERM: drained, exits 0, and its node goes with its session.
        let leaving = ready_replica_node(&cluster, "").await?;
        let other = if leaving == "w1" { "w2" } else { "w1" }.to_owned();
        cluster.worker(&leaving)?.process.terminate()?;
        let status = cluster.worker_mut(&leaving)?.process.wait_exit(Duration::from_secs(30)).await?;
        let exited = Instant::now();
        if !status.success() {
            bail!("{leaving} exited with {status}");
        }
        // Every state the head shows for it from the exit on, until it is no longer listed.
        let seen = std::sync::Mutex::new(Vec::new());
        eventually(WORKER_TIMEOUT + Duration::from_secs(3), "the departed node forgotten", || async {
            let state = listed(&cluster, &leaving).await?;
            seen.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.extend(state);
            Ok(state.is_none().then_some(()))
        })
        .await
        .with_context(|| format!("{leaving} after it left: {seen:?}"))?;
        let forgotten_after = exited.elapsed();
        let seen = seen.into_inner().map_err(|_| anyhow::anyhow!("poisoned"))?;
        assert!(!seen.contains(&NodeState::Ready), "{leaving} shown Ready after it exited: {seen:?}");
        assert!(forgotten_after < WORKER_TIMEOUT, "{leaving} forgotten only after {forgotten_after:?}");
        assert_eq!(ready_replica_node(&cluster, &leaving).await?, other);
        comes_back(&mut cluster, &leaving).await?;

        // kill -9: Dead after the worker timeout, shown as such, forgotten after the retention
        // once its replica has been replaced.
        let killed_at = Instant::now();
        cluster.worker_mut(&other)?.process.kill();
        eventually(WORKER_TIMEOUT + Duration::from_secs(5), "the killed node Dead", || async {
            Ok((listed(&cluster, &other).await? == Some(NodeState::Dead)).then_some(()))
        })
        .await?;
        assert_eq!(ready_replica_node(&cluster, &other).await?, leaving);
        let forgotten = eventually(RETENTION + Duration::from_secs(10), "the dead node forgotten", || async {
            let st = cluster.status().await?;
            let known = st.nodes.iter().any(|n| n.inventory.as_ref().is_some_and(|i| i.node_id == other));
            Ok((!known).then_some(st))
        })
        .await?;
        let gone_for = killed_at.elapsed();
        assert!(gone_for >= RETENTION, "forgotten {gone_for:?} after it was last seen, before the retention");
        assert!(
            forgotten.replicas.iter().all(|r| r.node_id != other && r.rank_groups.iter().all(|g| g.node_id != other)),
            "a replica still names the forgotten node: {:?}",
            forgotten.replicas
        );
        comes_back(&mut cluster, &other).await.context("the killed worker restarted")?;
        assert_eq!(cluster.status().await?.nodes.len(), 2);
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}
