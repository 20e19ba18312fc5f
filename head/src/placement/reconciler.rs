//! The level-triggered reconciler (kube-rs style): on every change and on a periodic tick
//! the leader compares desired state (deployments) with observed state (replica records,
//! worker sessions and reports) and acts — marks nodes whose session is gone for
//! `worker_timeout` Dead, stops drained replicas when idle or at their deadline
//! ([`drain::stop_drained`]), and applies the [`planner`](super::planner)'s actions
//! (create, place, remove — by draining, evict).
//! Every pass is idempotent; a failed pass (store error, lost compare-and-swap) reloads the
//! view and is requeued with a short backoff.

use std::sync::Arc;
use std::time::Duration;

use prism_common::proto::v1::{NodeState, ReplicaRecord, ReplicaState, StopReplica, head_message};
use prism_common::time::unix_ms;
use prism_common::{DeploymentName, NodeId, ReplicaId};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::planner::{Action, PlacementDecision, plan};
use crate::cluster::Cluster;
use crate::cluster::registry::send_start;
use crate::cluster::state::State;
use crate::drain;
use crate::error::HeadResult;

/// Runs the reconciler until `shutdown`.
pub async fn run(cluster: Arc<Cluster>, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(50);
    let mut leadership = cluster.watch_leadership();
    loop {
        let requeue = match reconcile_once(&cluster).await {
            Ok(()) => {
                backoff = Duration::from_millis(50);
                None
            }
            Err(e) => {
                tracing::warn!(error = %e, "reconcile failed; requeued");
                let mut st = cluster.lock().await;
                if let Err(e) = cluster.reload(&mut st).await {
                    tracing::warn!(error = %e, "reload after failed reconcile failed");
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
                Some(backoff)
            }
        };
        let wait = requeue.unwrap_or(cluster.cfg().reconcile_interval);
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = cluster.kicked() => {}
            _ = leadership.changed() => {}
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// One reconcile pass (no-op unless this head leads and has loaded its view).
///
/// # Errors
/// Store failures and conflicts (the caller reloads and requeues).
pub async fn reconcile_once(cluster: &Cluster) -> HeadResult<()> {
    let mut st = cluster.lock().await;
    if !cluster.leadership().is_leader() || !st.is_loaded() {
        return Ok(());
    }
    let res = pass(cluster, &mut st).await;
    cluster.after_change(&st);
    res
}

async fn pass(cluster: &Cluster, st: &mut State) -> HeadResult<()> {
    mark_dead_nodes(cluster, st).await?;
    drain::stop_drained(cluster, st).await?;
    let connected = st.connected_nodes();
    let (nodes, deps, replicas) = st.view().planner_inputs(&connected, cluster.cfg().replica_restart_delay);
    let actions = plan(&nodes, &deps, &replicas);
    for a in actions {
        apply(cluster, st, a).await?;
    }
    Ok(())
}

async fn mark_dead_nodes(cluster: &Cluster, st: &mut State) -> HeadResult<()> {
    let now = Instant::now();
    let timeout = cluster.cfg().worker_timeout;
    let dead: Vec<NodeId> = st
        .view()
        .nodes
        .iter()
        .filter(|(id, e)| e.record.state() != NodeState::Dead && !st.is_connected(id))
        .filter(|(id, _)| st.disconnected_since(id).is_none_or(|t| now.duration_since(t) >= timeout))
        .map(|(id, _)| id.clone())
        .collect();
    for id in dead {
        let Some(mut rec) = st.view().nodes.get(&id).map(|e| e.record.clone()) else { continue };
        let gone = st.disconnected_since(&id).map_or(Duration::ZERO, |t| now.duration_since(t));
        tracing::warn!(node = %id, session_gone_ms = gone.as_millis() as u64, "worker timed out: node Dead, re-placing its replicas");
        rec.state = NodeState::Dead as i32;
        cluster.put_node(st, rec).await?;
    }
    Ok(())
}

/// Applies one planner action to the store and the workers.
async fn apply(cluster: &Cluster, st: &mut State, a: Action) -> HeadResult<()> {
    match a {
        Action::Create { deployment, generation, placement } => {
            let id = ReplicaId::new_for(&deployment);
            let served = st
                .view()
                .deployments
                .get(&deployment)
                .and_then(|d| d.record.spec.as_ref())
                .and_then(|s| s.engine.as_ref())
                .map(|e| e.served_model_name.clone())
                .filter(|s| !s.is_empty())
                .unwrap_or_else(|| deployment.to_string());
            let rec = ReplicaRecord {
                replica_id: id.to_string(),
                deployment: deployment.to_string(),
                created_unix_ms: unix_ms(),
                served_model_name: served,
                generation,
                state: ReplicaState::Pending as i32,
                ..Default::default()
            };
            place(cluster, st, rec, placement).await
        }
        Action::Place { replica, placement } => {
            let Some(rec) = st.view().replicas.get(&replica).map(|e| e.record.clone()) else { return Ok(()) };
            place(cluster, st, rec, placement).await
        }
        Action::Remove { replica } => {
            let Some(rec) = st.view().replicas.get(&replica).map(|e| e.record.clone()) else { return Ok(()) };
            let node = NodeId::from(rec.node_id.as_str());
            match rec.state() {
                ReplicaState::Pending => cluster.delete_replica(st, &replica).await,
                ReplicaState::Failed => {
                    st.send(
                        &node,
                        head_message::Msg::Stop(StopReplica { replica_id: replica.to_string(), deadline_ms: 0 }),
                    );
                    cluster.delete_replica(st, &replica).await
                }
                _ => {
                    tracing::info!(replica = %replica, deployment = %rec.deployment, "removing replica: draining");
                    drain::drain_replica(cluster, st, rec, Duration::ZERO, "removed by scale-down or spec change").await
                }
            }
        }
        Action::Evict { replica } => {
            tracing::info!(replica = %replica, "evicting replica of a dead node");
            cluster.delete_replica(st, &replica).await
        }
    }
}

async fn place(cluster: &Cluster, st: &mut State, mut rec: ReplicaRecord, p: PlacementDecision) -> HeadResult<()> {
    match p {
        PlacementDecision::Assigned { node, slots } => {
            let endpoint = st
                .view()
                .nodes
                .get(&node)
                .and_then(|e| e.record.inventory.as_ref())
                .map(|i| i.address.clone())
                .unwrap_or_default();
            rec.node_id = node.to_string();
            rec.gpu_indices = slots;
            rec.endpoint = endpoint;
            rec.state = ReplicaState::Starting as i32;
            rec.reason.clear();
            let id = ReplicaId::from(rec.replica_id.as_str());
            tracing::info!(replica = %id, node = %node, gpus = ?rec.gpu_indices, "replica placed");
            cluster.put_replica(st, rec).await?;
            cluster.metrics().placement_decisions.inc();
            send_start(st, &id);
        }
        PlacementDecision::Pending { reason } => {
            tracing::info!(replica = %rec.replica_id, deployment = %DeploymentName::from(rec.deployment.as_str()), %reason, "replica pending");
            rec.state = ReplicaState::Pending as i32;
            rec.reason = reason;
            cluster.put_replica(st, rec).await?;
        }
    }
    Ok(())
}
