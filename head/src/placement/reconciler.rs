//! The level-triggered reconciler (kube-rs style): on every change and on a periodic tick
//! the leader compares desired state (deployments) with observed state (replica records,
//! worker sessions and reports) and acts — marks nodes whose session is gone for
//! `worker_timeout` Dead, stops drained replicas when idle or at their deadline
//! ([`drain::stop_drained`]), feeds each autoscaled deployment's load to the
//! [`autoscaler`](super::autoscaler) and writes its decisions (`spec.replicas` and
//! `last_scaling`, one write per change), and applies the [`planner`](super::planner)'s
//! actions (create, place, remove — by draining, evict), then forgets Dead nodes nothing
//! refers to any more ([`departure::forget_dead_nodes`]).
//! Every pass is idempotent; a failed pass (store error, lost compare-and-swap) reloads the
//! view and is requeued with a short backoff.
//!
//! A pass holds the cluster state's lock, which admin calls and worker sessions also need, so
//! it applies the planner's actions for at most [`PASS_BUDGET`] (after at least
//! [`PASS_MIN_ACTIONS`]) and leaves the rest to the next pass, which is queued at once behind
//! whoever waited for the lock meanwhile: a scale to thousands of replicas becomes many short
//! passes instead of one that keeps `prism status` waiting for minutes. Consecutive creates
//! and placements are written several per store transaction.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use prism_common::proto::v1::{DeploymentRecord, NodeState, RankGroup, ReplicaRecord, ReplicaState, ScalingDecision};
use prism_common::time::unix_ms;
use prism_common::{DeploymentName, NodeId, ReplicaId};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::autoscaler::{Autoscaler, Inputs};
use super::planner::{Action, PlacementDecision, plan};
use crate::admin::autoscaling_params;
use crate::cluster::group::{rank_range, stop_group};
use crate::cluster::registry::send_start;
use crate::cluster::state::State;
use crate::cluster::view::member_parts;
use crate::cluster::{Cluster, departure};
use crate::drain;
use crate::error::HeadResult;
use crate::events::EventKind;

/// How long one pass applies planner actions before it lets other users of the state lock in.
pub const PASS_BUDGET: Duration = Duration::from_millis(100);
/// Actions a pass applies whatever the time (a slow store still makes progress, and a few
/// actions, as most passes have, are never split across passes).
pub const PASS_MIN_ACTIONS: usize = 16;
/// Most creates and placements written in one go (one or a few store transactions).
const WRITE_BATCH: usize = 128;

/// What a reconcile pass left undone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Observed state is as planned (or the pass had nothing to do).
    Done,
    /// The pass ran out of its budget with planner actions left: run another at once.
    More,
}

/// Runs the reconciler until `shutdown`.
pub async fn run(cluster: Arc<Cluster>, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(50);
    let mut leadership = cluster.watch_leadership();
    loop {
        let requeue = match reconcile_once(&cluster).await {
            Ok(pass) => {
                backoff = Duration::from_millis(50);
                // Requeued behind the admin calls and worker sessions that waited for the lock
                // (tokio's mutex is fair).
                (pass == Pass::More).then_some(Duration::ZERO)
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

/// One reconcile pass (no-op unless this head leads and has loaded its view). Returns
/// [`Pass::More`] when it stopped at its budget with actions left.
///
/// # Errors
/// Store failures and conflicts (the caller reloads and requeues).
pub async fn reconcile_once(cluster: &Cluster) -> HeadResult<Pass> {
    let mut st = cluster.lock().await;
    if !cluster.leadership().is_leader() || !st.is_loaded() {
        return Ok(Pass::Done);
    }
    let res = pass(cluster, &mut st).await;
    cluster.after_change(&st);
    res
}

async fn pass(cluster: &Cluster, st: &mut State) -> HeadResult<Pass> {
    mark_dead_nodes(cluster, st).await?;
    drain::stop_drained(cluster, st).await?;
    let mut autoscaler = st.take_autoscaler();
    let scaled = autoscale(cluster, st, &mut autoscaler).await;
    st.put_autoscaler(autoscaler);
    scaled?;
    let connected = st.connected_nodes();
    let (nodes, deps, mut replicas) =
        st.view().planner_inputs(&connected, cluster.cfg().replica_restart_delay, st.group_start_retries());
    for r in &mut replicas {
        r.load = st.load(&r.id).map_or(0, |l| l.running.saturating_add(l.waiting));
    }
    let actions = plan(&nodes, &deps, &replicas);
    if apply_actions(cluster, st, actions).await? == Pass::More {
        return Ok(Pass::More);
    }
    // After the planner evicted (and replaced) the replicas of dead nodes.
    departure::forget_dead_nodes(cluster, st).await?;
    Ok(Pass::Done)
}

/// Applies `actions` in the planner's order until [`PASS_BUDGET`] has passed (and at least
/// [`PASS_MIN_ACTIONS`] were applied); runs of creates and placements are written in batches.
///
/// Stopping after any prefix is safe: the planner lists evictions and removals (whose slots
/// the creates and placements after them may use) first, a removal frees no slot within the
/// pass, and the next pass plans what is left from the state this one reached.
async fn apply_actions(cluster: &Cluster, st: &mut State, actions: Vec<Action>) -> HeadResult<Pass> {
    let started = Instant::now();
    let mut actions = VecDeque::from(actions);
    let mut applied = 0;
    while let Some(front) = actions.front() {
        if applied >= PASS_MIN_ACTIONS && started.elapsed() >= PASS_BUDGET {
            return Ok(Pass::More);
        }
        if is_write(front) {
            let mut writes = Vec::new();
            let mut taken = 0;
            while taken < WRITE_BATCH
                && actions.front().is_some_and(is_write)
                && let Some(a) = actions.pop_front()
            {
                taken += 1;
                writes.extend(to_write(st, a));
            }
            applied += taken;
            write_placements(cluster, st, writes).await?;
        } else if let Some(a) = actions.pop_front() {
            applied += 1;
            apply(cluster, st, a).await?;
        }
    }
    Ok(Pass::Done)
}

/// Observes every autoscaled deployment's load and writes the decisions that are due.
async fn autoscale(cluster: &Cluster, st: &mut State, autoscaler: &mut Autoscaler) -> HeadResult<()> {
    let now = std::time::Instant::now();
    let tnow = Instant::now();
    let mut due: Vec<(DeploymentRecord, super::autoscaler::Decision)> = Vec::new();
    let view = st.view();
    autoscaler.retain(|d| {
        view.deployments.get(d).is_some_and(|e| e.record.spec.as_ref().is_some_and(|s| s.autoscaling.is_some()))
    });
    for (name, e) in &view.deployments {
        let Some(spec) = e.record.spec.as_ref() else { continue };
        let Some(p) = autoscaling_params(spec) else { continue };
        let served = prism_common::deployment::served_name(spec);
        let ready: Vec<ReplicaId> = st
            .view()
            .replicas
            .iter()
            .filter(|(_, r)| r.record.deployment == name.as_str() && r.record.state() == ReplicaState::Ready)
            .map(|(id, _)| id.clone())
            .collect();
        let loads: Vec<_> = ready.iter().filter_map(|id| st.load(id)).collect();
        if loads.len() < ready.len() {
            // A Ready replica has not reported yet (a new leader, a replica just Ready): no
            // observation from missing data.
            continue;
        }
        let queued = st.queued_for(served, tnow);
        let running: f64 = loads.iter().map(|l| f64::from(l.running) + f64::from(l.waiting)).sum();
        let kv = (!loads.is_empty()).then(|| {
            loads.iter().map(|l| f64::from(l.kv_cache_usage.clamp(0.0, 1.0))).sum::<f64>() / loads.len() as f64
        });
        let starting = st
            .view()
            .replicas
            .values()
            .filter(|r| r.record.deployment == name.as_str() && r.record.state() == ReplicaState::Starting)
            .count();
        let starting = u32::try_from(starting).unwrap_or(u32::MAX);
        let inputs = Inputs { ongoing: running + f64::from(queued), queued, kv_cache_usage: kv, starting };
        if let Some(d) = autoscaler.observe(name, &p, now, spec.replicas, inputs) {
            due.push((e.record.clone(), d));
        }
    }
    for (mut rec, d) in due {
        let spec = rec.spec.get_or_insert_with(Default::default);
        let name = spec.name.clone();
        spec.replicas = d.to;
        rec.last_scaling = Some(ScalingDecision {
            unix_ms: unix_ms(),
            from_replicas: d.from,
            to_replicas: d.to,
            reason: d.reason.clone(),
        });
        cluster.put_deployment(st, rec).await?;
        cluster.metrics().count_scaling(&name, d.to > d.from);
        cluster.events().push(EventKind::Scaling, &name, "", format!("{} -> {}: {}", d.from, d.to, d.reason));
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
        // Counted from the end of a stall of this head, if one came after the disconnect.
        .filter(|(id, _)| {
            st.disconnected_since(id)
                .is_none_or(|t| now.duration_since(cluster.stall_watch().watched_from(t)) >= timeout)
        })
        .map(|(id, _)| id.clone())
        .collect();
    for id in dead {
        let Some(mut rec) = st.view().nodes.get(&id).map(|e| e.record.clone()) else { continue };
        let gone = st.disconnected_since(&id).map_or(Duration::ZERO, |t| now.duration_since(t));
        tracing::warn!(node = %id, session_gone_ms = gone.as_millis() as u64, "worker timed out: node Dead, re-placing its replicas");
        rec.state = NodeState::Dead as i32;
        // When the head last heard from it: the dead-node retention counts from here.
        rec.last_seen_unix_ms = unix_ms().saturating_sub(u64::try_from(gone.as_millis()).unwrap_or(u64::MAX));
        cluster.put_node(st, rec).await?;
    }
    Ok(())
}

/// Whether `a` writes a replica record with a placement (batched with its neighbours).
fn is_write(a: &Action) -> bool {
    matches!(a, Action::Create { .. } | Action::Place { .. })
}

/// A Create's new record, or a Place's current one (None when it is gone), with where it goes.
fn to_write(st: &State, a: Action) -> Option<(ReplicaRecord, PlacementDecision)> {
    match a {
        Action::Create { deployment, generation, placement } => {
            let served = st
                .view()
                .deployments
                .get(&deployment)
                .and_then(|d| d.record.spec.as_ref())
                .map(|s| prism_common::deployment::served_name(s).to_owned())
                .unwrap_or_else(|| deployment.to_string());
            let rec = ReplicaRecord {
                replica_id: ReplicaId::new_for(&deployment).to_string(),
                deployment: deployment.to_string(),
                created_unix_ms: unix_ms(),
                served_model_name: served,
                generation,
                state: ReplicaState::Pending as i32,
                ..Default::default()
            };
            Some((rec, placement))
        }
        Action::Place { replica, placement } => st.view().replicas.get(&replica).map(|e| (e.record.clone(), placement)),
        Action::Remove { .. } | Action::Evict { .. } => None,
    }
}

/// Applies one planner action to the store and the workers.
async fn apply(cluster: &Cluster, st: &mut State, a: Action) -> HeadResult<()> {
    match a {
        Action::Create { .. } | Action::Place { .. } => {
            let write = to_write(st, a);
            write_placements(cluster, st, write.into_iter().collect()).await
        }
        Action::Remove { replica } => {
            let Some(rec) = st.view().replicas.get(&replica).map(|e| e.record.clone()) else { return Ok(()) };
            match rec.state() {
                ReplicaState::Pending => cluster.delete_replica(st, &replica).await,
                ReplicaState::Failed => {
                    if rec.ready_unix_ms == 0 && st.view().tp_of(&rec.deployment) > 1 {
                        // A GPU group that failed while starting is replaced: its next
                        // start failure waits twice as long.
                        st.note_group_start_retry(&replica_deployment(&rec));
                    }
                    stop_group(st, &rec, 0);
                    cluster.delete_replica(st, &replica).await
                }
                _ => {
                    let msg = format!("{:?} replica removed: draining", rec.state());
                    cluster.events().push(EventKind::ReplicaRemoved, &rec.deployment, replica.as_str(), msg);
                    drain::drain_replica(cluster, st, rec, Duration::ZERO, "removed by scale-down or spec change").await
                }
            }
        }
        Action::Evict { replica } => {
            let Some(rec) = st.view().replicas.get(&replica).map(|e| e.record.clone()) else { return Ok(()) };
            let why = dead_part(st, &rec);
            cluster.events().push(EventKind::ReplicaEvicted, &rec.deployment, replica.as_str(), why);
            // Ranks on the group's other (live) nodes cannot go on without the dead ones.
            stop_group(st, &rec, 0);
            cluster.delete_replica(st, &replica).await
        }
    }
}

fn replica_deployment(rec: &ReplicaRecord) -> DeploymentName {
    DeploymentName::from(rec.deployment.as_str())
}

/// Why an evicted replica's group cannot run: "its node is dead" for the driver's node,
/// else which member node (and ranks) is.
fn dead_part(st: &State, rec: &ReplicaRecord) -> String {
    let dead = |id: &str| st.view().nodes.get(&NodeId::from(id)).is_none_or(|n| n.record.state() == NodeState::Dead);
    if rec.rank_groups.len() < 2 || dead(&rec.node_id) {
        return "its node is dead".into();
    }
    match member_parts(rec).find(|g| dead(&g.node_id)) {
        Some(g) => format!("node {} (ranks {}) of its GPU group is dead", g.node_id, rank_range(g)),
        None => "a node of its GPU group is dead".into(),
    }
}

/// Writes replica records placed (or left Pending) as the planner decided, several per store
/// transaction; then tells each: an event, and for a placed one the placement metric and the
/// StartReplica to its worker.
async fn write_placements(
    cluster: &Cluster,
    st: &mut State,
    writes: Vec<(ReplicaRecord, PlacementDecision)>,
) -> HeadResult<()> {
    let mut recs = Vec::with_capacity(writes.len());
    let mut told = Vec::with_capacity(writes.len());
    for (rec, p) in writes {
        let (rec, event) = placed(rec, p, st);
        told.push((rec.deployment.clone(), rec.replica_id.clone(), event));
        recs.push(rec);
    }
    cluster
        .put_replicas(st, recs, |st, i| {
            let Some((deployment, replica, (kind, msg))) = told.get_mut(i) else { return };
            cluster.events().push(*kind, deployment, replica, std::mem::take(msg));
            if *kind == EventKind::ReplicaPlaced {
                cluster.metrics().placement_decisions.inc();
                send_start(st, &ReplicaId::from(replica.as_str()));
            }
        })
        .await
}

/// `rec` as the planner placed it (Starting on its GPU group, with a new rendezvous token) or
/// left it (Pending with the reason), and the event that says so.
fn placed(mut rec: ReplicaRecord, p: PlacementDecision, st: &State) -> (ReplicaRecord, (EventKind, String)) {
    match p {
        PlacementDecision::Assigned { node, slots, groups } => {
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
            rec.rank_groups = groups
                .iter()
                .map(|g| RankGroup {
                    node_id: g.node.to_string(),
                    first_rank: g.first_rank,
                    gpu_indices: g.slots.clone(),
                })
                .collect();
            // A new placement is a new group: the driver binds a new rendezvous, and only
            // ranks holding this placement's token may join it.
            rec.rendezvous.clear();
            rec.group_token = uuid::Uuid::new_v4().to_string();
            let msg = if rec.rank_groups.len() > 1 {
                let parts: Vec<String> = rec
                    .rank_groups
                    .iter()
                    .map(|g| format!("{} ranks {} slots {:?}", g.node_id, rank_range(g), g.gpu_indices))
                    .collect();
                format!("GPU group across nodes: {}", parts.join("; "))
            } else {
                format!("on {node}, slots {:?}", rec.gpu_indices)
            };
            (rec, (EventKind::ReplicaPlaced, msg))
        }
        PlacementDecision::Pending { reason } => {
            rec.state = ReplicaState::Pending as i32;
            rec.reason = reason.clone();
            (rec, (EventKind::ReplicaPending, reason))
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prism_common::proto::v1::{
        AutoscalingConfig, DeploymentSpec, EngineConfig, LoadReport, ModelDemand, NodeInventory,
    };
    use prism_common::state_store::StateStore;
    use prism_common::state_store::embedded::EmbeddedStore;
    use tokio::sync::watch;

    use super::*;
    use crate::cluster::registry;
    use crate::config::{HeadConfig, StoreSpec};
    use crate::election::Leadership;
    use crate::error::HeadError;
    use crate::metrics::Metrics;

    fn autoscaled(min: u32, max: u32) -> DeploymentSpec {
        DeploymentSpec {
            name: "d".into(),
            engine: Some(EngineConfig {
                model: "/m.gguf".into(),
                served_model_name: "served".into(),
                tensor_parallel_size: 1,
                ..Default::default()
            }),
            autoscaling: Some(AutoscalingConfig {
                min_replicas: min,
                max_replicas: max,
                upscale_delay_s: Some(0.0),
                downscale_delay_s: Some(0.0),
                look_back_period_s: Some(0.0),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    async fn leader() -> (Arc<Cluster>, watch::Sender<Leadership>) {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (lead_tx, lead_rx) = watch::channel(Leadership::Leader);
        let cfg = HeadConfig::new(StoreSpec::Embedded("unused".into()), "http://127.0.0.1:50050");
        let cluster = Cluster::new(cfg, store, lead_rx, Metrics::new());
        cluster.on_elected(1).await.expect("elected");
        (cluster, lead_tx)
    }

    async fn replicas_of(cluster: &Cluster) -> (u32, Option<ScalingDecision>) {
        let st = cluster.lock().await;
        let rec = &st.view().deployments[&prism_common::DeploymentName::from("d")].record;
        (rec.spec.as_ref().map_or(0, |s| s.replicas), rec.last_scaling.clone())
    }

    /// A scale-up of 1,000 replicas with no node to place them: passes until one reports
    /// `Done`, every replica created once (Pending with the reason), and written several per
    /// store transaction rather than one each.
    #[tokio::test]
    async fn a_large_scale_up_is_written_in_batches() {
        let (cluster, _lead) = leader().await;
        let spec = DeploymentSpec { replicas: 1_000, autoscaling: None, ..autoscaled(0, 0) };
        crate::admin::apply_deployment(&cluster, spec).await.expect("applied");
        let before = cluster.store_writes().await;
        let mut passes = 0;
        while reconcile_once(&cluster).await.expect("pass") == Pass::More {
            passes += 1;
            assert!(passes < 1_000, "passes never finish");
        }
        let writes = cluster.store_writes().await - before;
        let st = cluster.lock().await;
        let replicas = &st.view().replicas;
        assert_eq!(replicas.len(), 1_000);
        assert!(replicas.values().all(|e| e.record.state() == ReplicaState::Pending && !e.record.reason.is_empty()));
        // One compare and one put per record: 128 records a transaction.
        assert_eq!(writes, 8, "store transactions");
        drop(st);
        assert_eq!(reconcile_once(&cluster).await.expect("pass"), Pass::Done);
        assert_eq!(cluster.store_writes().await - before, writes, "a pass after it writes nothing");
    }

    #[tokio::test]
    async fn queued_demand_scales_from_zero_and_an_idle_deployment_back_to_zero() {
        let (cluster, _lead) = leader().await;
        let inv = NodeInventory {
            node_id: "n1".into(),
            address: "http://127.0.0.1:1".into(),
            cpu_slots: 2,
            ..Default::default()
        };
        let _worker = registry::register(&cluster, inv, None).await.expect("registered");
        crate::admin::apply_deployment(&cluster, autoscaled(0, 2)).await.expect("applied");
        reconcile_once(&cluster).await.expect("pass");
        assert_eq!(replicas_of(&cluster).await, (0, None), "initial = min = 0, nothing queued");
        // A router queues 3 requests for the served model: 1 replica at the next pass.
        let demand = vec![ModelDemand { model: "served".into(), queued: 3, ..Default::default() }];
        cluster.lock().await.record_demand("router-1".into(), demand, Instant::now());
        reconcile_once(&cluster).await.expect("pass");
        let (n, last) = replicas_of(&cluster).await;
        assert_eq!(n, 1);
        let last = last.expect("a decision");
        assert_eq!((last.from_replicas, last.to_replicas), (0, 1));
        assert!(last.reason.starts_with("scale from zero: 3 requests queued"), "{}", last.reason);
        assert_eq!(cluster.lock().await.view().replicas.len(), 1, "the planner created the replica");
        assert!(
            cluster.events().recent().iter().any(|e| e.kind == EventKind::Scaling && e.message.starts_with("0 -> 1"))
        );
        // `prism scale` is refused on an autoscaled deployment; re-applying keeps the count.
        let refused = crate::admin::scale_deployment(&cluster, "d", 2).await;
        assert!(matches!(refused, Err(HeadError::FailedPrecondition(m)) if m.contains("autoscaled")));
        crate::admin::apply_deployment(&cluster, autoscaled(0, 3)).await.expect("re-applied");
        assert_eq!(replicas_of(&cluster).await.0, 1);
        // The queue drains and the router goes silent while the replica still loads: the cold
        // start is not cut short.
        cluster.lock().await.record_demand("router-1".into(), vec![], Instant::now());
        reconcile_once(&cluster).await.expect("pass");
        assert_eq!(replicas_of(&cluster).await.0, 1, "scaled down during the cold start");
        // Ready (and reporting an idle engine): back to zero (delays 0 here).
        {
            let mut st = cluster.lock().await;
            let mut rec = st.view().replicas.values().next().expect("the replica").record.clone();
            rec.state = ReplicaState::Ready as i32;
            let report = LoadReport { replica_id: rec.replica_id.clone(), ..Default::default() };
            cluster.put_replica(&mut st, rec).await.expect("Ready");
            st.record_load(&NodeId::from("n1"), report);
        }
        reconcile_once(&cluster).await.expect("pass");
        let (n, last) = replicas_of(&cluster).await;
        assert_eq!(n, 0, "{last:?}");
        assert!(last.expect("a decision").reason.starts_with("no ongoing or queued requests"));
    }
}
