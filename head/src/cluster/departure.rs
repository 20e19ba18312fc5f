//! Nodes that are gone for good leave the node list, as Kubernetes and Ray forget nodes
//! that left, so pod restarts and rollouts leave no trail of Dead nodes:
//! - a worker that drained and then closed its session on purpose (SIGTERM, pod deletion,
//!   spot preemption: its last drain progress said done, then its stream ended cleanly) is
//!   forgotten at once ([`on_worker_left`]). If a replica record still refers to the node,
//!   the node is Dead at once (no `--worker-timeout` wait: its worker said it was leaving),
//!   the planner replaces those replicas, and the node is forgotten once none is left. A node
//!   an operator drained (`prism drain`: cordoned) is kept as Dead instead, so its cordon
//!   holds if the same node id comes back within the retention;
//! - a Dead node (session lost for `--worker-timeout`) is forgotten once no replica record
//!   refers to it (they were evicted and replaced) and it was last seen
//!   `--dead-node-retention` ago ([`forget_dead_nodes`]).
//!
//! Only nodes without a live session are forgotten, so the one-process-per-node-id rule of
//! `registry.rs` is untouched: it is about sessions, not records. A worker that comes back
//! with a forgotten node id registers as a new node.
//!
//! Leadership: the retention counts from the record's `last_seen_unix_ms` (set when the node
//! is marked Dead), which is in the store, so a new leader neither restarts nor skips it; a
//! node whose worker left on purpose says so in its record (`left`, cleared when a worker
//! registers with its node id), so a new leader forgets it as soon as no replica names it.

use prism_common::NodeId;
use prism_common::proto::v1::NodeState;
use prism_common::time::unix_ms;

use super::Cluster;
use super::state::State;
use crate::error::HeadResult;

/// A worker whose drain was done closed its session cleanly (it has already been detached):
/// forgets its node, or marks it Dead until its replicas are replaced (see the module doc).
///
/// # Errors
/// Store failures.
pub async fn on_worker_left(cluster: &Cluster, st: &mut State, node: &NodeId) -> HeadResult<()> {
    if st.is_connected(node) {
        return Ok(());
    }
    let Some(mut rec) = st.view().nodes.get(node).map(|e| e.record.clone()) else { return Ok(()) };
    let referenced = st.view().replicas_touching(node).count();
    if referenced == 0 && !rec.cordoned {
        cluster.delete_node(st, node).await?;
        tracing::info!(node = %node, "worker drained and left: node forgotten");
        return Ok(());
    }
    if rec.cordoned {
        tracing::info!(node = %node, replicas = referenced, "worker drained and left: node Dead, kept for its cordon");
    } else {
        tracing::info!(node = %node, replicas = referenced, "worker drained and left: node Dead until its replicas are replaced");
    }
    let left = !rec.cordoned;
    if rec.state() != NodeState::Dead || rec.left != left {
        if rec.state() != NodeState::Dead {
            rec.state = NodeState::Dead as i32;
            rec.last_seen_unix_ms = unix_ms();
        }
        rec.left = left;
        cluster.put_node(st, rec).await?;
    }
    Ok(())
}

/// Forgets Dead nodes that no session and no replica record refer to any more, once their
/// worker left on purpose or they were last seen `--dead-node-retention` ago.
///
/// # Errors
/// Store failures.
pub async fn forget_dead_nodes(cluster: &Cluster, st: &mut State) -> HeadResult<()> {
    let now = unix_ms();
    let retention = u64::try_from(cluster.cfg().dead_node_retention.as_millis()).unwrap_or(u64::MAX);
    let gone: Vec<NodeId> = st
        .view()
        .nodes
        .iter()
        .filter(|(id, e)| e.record.state() == NodeState::Dead && !st.is_connected(id))
        .filter(|(_, e)| e.record.left || now.saturating_sub(e.record.last_seen_unix_ms) >= retention)
        .filter(|(id, _)| st.view().replicas_touching(id).next().is_none())
        .map(|(id, _)| id.clone())
        .collect();
    for id in gone {
        let last_seen = st.view().nodes.get(&id).map_or(0, |e| e.record.last_seen_unix_ms);
        cluster.delete_node(st, &id).await?;
        tracing::info!(
            node = %id, gone_s = now.saturating_sub(last_seen) / 1000,
            "dead node forgotten: its replicas were replaced and it did not come back"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use prism_common::proto::v1::{DeploymentSpec, EngineConfig, NodeInventory, ReplicaState};
    use prism_common::state_store::{EmbeddedStore, StateStore, keys};
    use tokio::sync::watch;
    use tokio::time::Instant;

    use super::*;
    use crate::cluster::registry::{self, Registration};
    use crate::config::{HeadConfig, StoreSpec};
    use crate::election::Leadership;
    use crate::metrics::Metrics;
    use crate::placement::reconciler::reconcile_once;

    fn inventory(node: &str) -> NodeInventory {
        NodeInventory {
            node_id: node.into(),
            address: "http://127.0.0.1:1".into(),
            cpu_slots: 1,
            instance_id: format!("{node}-process"),
            ..Default::default()
        }
    }

    /// A leader on `store` whose workers time out after 50 ms.
    async fn leader(store: Arc<dyn StateStore>, term: u64) -> (Arc<Cluster>, watch::Sender<Leadership>) {
        let (lead_tx, lead_rx) = watch::channel(Leadership::Leader);
        let mut cfg = HeadConfig::new(StoreSpec::Embedded("unused".into()), "http://127.0.0.1:50050");
        cfg.worker_timeout = Duration::from_millis(50);
        let cluster = Cluster::new(cfg, store, lead_rx, Metrics::new());
        cluster.on_elected(term).await.expect("elected");
        (cluster, lead_tx)
    }

    async fn deploy_one(cluster: &Cluster) {
        let spec = DeploymentSpec {
            name: "d".into(),
            engine: Some(EngineConfig { model: "/m.gguf".into(), tensor_parallel_size: 1, ..Default::default() }),
            replicas: 1,
            ..Default::default()
        };
        crate::admin::apply_deployment(cluster, spec).await.expect("applied");
        reconcile_once(cluster).await.expect("placed");
    }

    /// Node ids in the view, with their state.
    async fn nodes(cluster: &Cluster) -> Vec<(String, NodeState)> {
        let st = cluster.lock().await;
        st.view().nodes.iter().map(|(id, e)| (id.to_string(), e.record.state())).collect()
    }

    /// Nodes the replica records name.
    async fn replica_nodes(cluster: &Cluster) -> Vec<String> {
        cluster.lock().await.view().replicas.values().map(|e| e.record.node_id.clone()).collect()
    }

    /// Ends the worker's session as its stream closing after a finished drain does.
    async fn leave(cluster: &Cluster, w: &Registration) {
        let mut st = cluster.lock().await;
        st.note_drain_progress(&w.node, w.session, true);
        assert!(st.drain_done(&w.node, w.session));
        assert!(st.detach_session(&w.node, w.session, Instant::now()));
        on_worker_left(cluster, &mut st, &w.node).await.expect("left");
    }

    #[tokio::test]
    async fn a_worker_that_drained_and_left_is_forgotten_at_once_and_registers_again_as_new() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (cluster, _lead) = leader(Arc::clone(&store), 1).await;
        let w = registry::register(&cluster, inventory("n1"), None).await.expect("registered");
        leave(&cluster, &w).await;
        assert!(nodes(&cluster).await.is_empty());
        assert!(store.get(&keys::node(&NodeId::from("n1"))).await.expect("get").is_none(), "deleted in the store");

        let again = registry::register(&cluster, inventory("n1"), None).await.expect("registered again");
        assert_eq!(nodes(&cluster).await, [("n1".to_owned(), NodeState::Ready)]);
        // Another process with its node id is refused while that session lives.
        let mut other = inventory("n1");
        other.instance_id = "another-process".into();
        assert!(matches!(
            registry::register(&cluster, other, None).await,
            Err(crate::error::HeadError::NodeIdInUse { .. })
        ));
        drop(again);
    }

    #[tokio::test]
    async fn a_left_node_with_replicas_is_dead_at_once_and_forgotten_once_they_are_replaced() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (cluster, _lead) = leader(store, 1).await;
        let w1 = registry::register(&cluster, inventory("n1"), None).await.expect("n1");
        deploy_one(&cluster).await;
        assert_eq!(replica_nodes(&cluster).await, ["n1"]);
        let _w2 = registry::register(&cluster, inventory("n2"), None).await.expect("n2");

        // Its replica record is still there (the worker never reported it stopped).
        leave(&cluster, &w1).await;
        assert_eq!(nodes(&cluster).await, [("n1".into(), NodeState::Dead), ("n2".into(), NodeState::Ready)]);
        // One pass evicts the replica, places its replacement on n2, and forgets n1.
        reconcile_once(&cluster).await.expect("pass");
        assert_eq!(replica_nodes(&cluster).await, ["n2"]);
        assert_eq!(nodes(&cluster).await, [("n2".into(), NodeState::Ready)]);
    }

    #[tokio::test]
    async fn a_left_node_with_replicas_is_forgotten_at_once_by_the_next_leader() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (cluster, lead) = leader(Arc::clone(&store), 1).await;
        let w1 = registry::register(&cluster, inventory("n1"), None).await.expect("n1");
        deploy_one(&cluster).await;
        let _w2 = registry::register(&cluster, inventory("n2"), None).await.expect("n2");
        leave(&cluster, &w1).await;
        assert!(cluster.lock().await.view().nodes[&w1.node].record.left, "stored with the node");

        // Another head takes over before any pass replaced the replica: it forgets n1 as soon
        // as the replica is replaced, not after the dead-node retention.
        lead.send_replace(Leadership::Follower { leader: None });
        cluster.on_deposed().await;
        let (next, _lead) = leader(Arc::clone(&store), 2).await;
        let _w2 = registry::register(&next, inventory("n2"), None).await.expect("n2 follows the new leader");
        reconcile_once(&next).await.expect("pass");
        assert_eq!(replica_nodes(&next).await, ["n2"]);
        assert_eq!(nodes(&next).await, [("n2".into(), NodeState::Ready)]);
        assert!(store.get(&keys::node(&w1.node)).await.expect("get").is_none());
    }

    #[tokio::test]
    async fn a_worker_registering_with_a_left_node_id_clears_the_flag() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (cluster, _lead) = leader(store, 1).await;
        let w1 = registry::register(&cluster, inventory("n1"), None).await.expect("n1");
        deploy_one(&cluster).await;
        leave(&cluster, &w1).await;
        assert!(cluster.lock().await.view().nodes[&w1.node].record.left);
        let _again = registry::register(&cluster, inventory("n1"), None).await.expect("back");
        let rec = cluster.lock().await.view().nodes[&w1.node].record.clone();
        assert_eq!((rec.state(), rec.left), (NodeState::Ready, false));
    }

    #[tokio::test]
    async fn an_operator_drained_node_that_left_is_kept_dead_and_cordoned() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (cluster, _lead) = leader(store, 1).await;
        let w = registry::register(&cluster, inventory("n1"), None).await.expect("n1");
        drop(crate::drain::drain_node(&cluster, "n1", 0, "").await.expect("drained"));
        leave(&cluster, &w).await;
        reconcile_once(&cluster).await.expect("pass");
        let st = cluster.lock().await;
        let rec = &st.view().nodes[&NodeId::from("n1")].record;
        assert_eq!((rec.state(), rec.cordoned), (NodeState::Dead, true));
    }

    #[tokio::test]
    async fn a_dead_node_is_forgotten_after_the_retention_once_its_replicas_are_replaced_across_a_failover() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (cluster, lead) = leader(Arc::clone(&store), 1).await;
        let w1 = registry::register(&cluster, inventory("n1"), None).await.expect("n1");
        deploy_one(&cluster).await;
        let _w2 = registry::register(&cluster, inventory("n2"), None).await.expect("n2");

        // n1's session is lost (not a departure): Dead after the worker timeout.
        let lost_at = Instant::now();
        assert!(cluster.lock().await.detach_session(&w1.node, w1.session, lost_at));
        tokio::time::sleep(cluster.cfg().worker_timeout).await;
        reconcile_once(&cluster).await.expect("pass");
        assert_eq!(replica_nodes(&cluster).await, ["n2"], "the replica was replaced");
        assert_eq!(nodes(&cluster).await, [("n1".into(), NodeState::Dead), ("n2".into(), NodeState::Ready)]);
        let last_seen = cluster.lock().await.view().nodes[&NodeId::from("n1")].record.last_seen_unix_ms;
        assert!(unix_ms() - last_seen < 5_000, "last seen when the session was lost, not at registration");

        // Another head takes over: the retention is not restarted, nor is the node forgotten early.
        lead.send_replace(Leadership::Follower { leader: None });
        cluster.on_deposed().await;
        let (next, _lead) = leader(Arc::clone(&store), 2).await;
        let _w2 = registry::register(&next, inventory("n2"), None).await.expect("n2 follows the new leader");
        reconcile_once(&next).await.expect("pass");
        let kept = next.lock().await.view().nodes[&NodeId::from("n1")].record.clone();
        assert_eq!((kept.state(), kept.last_seen_unix_ms), (NodeState::Dead, last_seen));

        // The retention passes (10 minutes by default): forgotten.
        {
            let mut st = next.lock().await;
            let mut old = kept.clone();
            old.last_seen_unix_ms = unix_ms() - 601_000;
            next.put_node(&mut st, old).await.expect("aged");
        }
        reconcile_once(&next).await.expect("pass");
        assert_eq!(nodes(&next).await, [("n2".into(), NodeState::Ready)]);
        assert_eq!(replica_nodes(&next).await, ["n2"]);
        assert!(store.get(&keys::node(&NodeId::from("n1"))).await.expect("get").is_none());
    }

    #[tokio::test]
    async fn a_dead_node_that_replicas_still_name_is_kept_past_the_retention() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (cluster, _lead) = leader(store, 1).await;
        let w1 = registry::register(&cluster, inventory("n1"), None).await.expect("n1");
        deploy_one(&cluster).await;
        let mut st = cluster.lock().await;
        assert!(st.detach_session(&w1.node, w1.session, Instant::now()));
        let mut rec = st.view().nodes[&w1.node].record.clone();
        rec.state = NodeState::Dead as i32;
        rec.last_seen_unix_ms = 1;
        cluster.put_node(&mut st, rec).await.expect("dead");
        // A replica record still names it (its eviction has not been applied yet).
        forget_dead_nodes(&cluster, &mut st).await.expect("gc");
        assert!(st.view().nodes.contains_key(&w1.node));
        let rid = st.view().replicas.keys().next().cloned().expect("replica");
        assert_eq!(st.view().replicas[&rid].record.state(), ReplicaState::Starting);
    }
}
