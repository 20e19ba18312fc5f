//! Drain: taking replicas out of service without dropping their requests.
//!
//! A drain starts in one of three ways:
//! - an operator drains a node ([`drain_node`], `prism drain`): the node is cordoned and
//!   Draining, the worker is told (`DrainCommand`), and its replicas become Draining with
//!   the requested deadline (default `--drain-timeout`); it lasts until `uncordon`;
//! - a worker drains itself on SIGTERM or a spot-preemption notice ([`on_worker_drain`]):
//!   the node becomes Draining but not cordoned, so the next worker process on it (same
//!   node id) is schedulable again when it registers ([`ready_on_register`]);
//! - the reconciler removes a replica (scale-down, spec change, deleted deployment:
//!   [`drain_replica`] with the default deadline).
//!
//! The planner places a Draining replica's replacement elsewhere. A replica drained with its
//! node by an operator keeps serving (published to routers as Ready, shown Draining with
//! "serving until a replacement is Ready") until its deployment has its desired count of
//! Ready replicas again or the deadline passes, whichever comes first, like a
//! PodDisruptionBudget that never lets a drain take the last replica away early; only then
//! is the worker told to drain (`DrainCommand`). Any other Draining replica is published as
//! Draining at once (routers stop sending it new work). Each reconcile pass ([`stop_drained`])
//! stops a replica that no longer serves once it is idle (after [`DRAIN_GRACE`]) or at its
//! deadline, and its record goes once the worker reports it stopped.
//!
//! "Replaced" counts Ready replicas only: a deployment whose other replicas are Failed or still
//! Starting is short of Ready replicas, so the drained one keeps serving until the deadline —
//! the drain never leaves the deployment with fewer replicas serving than it had.
//!
//! Leadership: a Draining replica's record holds its deadline (`drain_deadline_unix_ms`) and
//! whether it still serves (`drain_serving`), so a new leader publishes it the same way and
//! stops it at the same deadline; only the idle grace starts again at the takeover.

use std::time::Duration;

use prism_common::proto::v1::{
    DrainCommand, DrainProgress, NodeRecord, NodeState, ReplicaRecord, ReplicaState, head_message,
};
use prism_common::time::unix_ms;
use prism_common::{DeploymentName, NodeId, ReplicaId};
use tokio::time::Instant;

use crate::cluster::Cluster;
use crate::cluster::group::stop_group;
use crate::cluster::state::{DrainTimer, State};
use crate::cluster::view::serves_while_draining;
use crate::error::HeadResult;

/// Minimum time a Draining replica stays routable-as-Draining before it may be stopped, so
/// routers see the Draining state first.
pub const DRAIN_GRACE: Duration = Duration::from_millis(500);

/// A drain timer starting at `now` that ends `relative` later (`default` when `relative`
/// is zero).
pub fn drain_timer(default: Duration, relative: Duration, now: Instant) -> DrainTimer {
    let d = if relative.is_zero() { default } else { relative };
    DrainTimer { since: now, deadline: now + d }
}

/// The timer of a Draining replica whose drain this leader takes over (`now` is `now_unix`
/// in wall-clock milliseconds): ending at the record's `drain_deadline_unix_ms` (at once when
/// that passed), or `default` from now for a record that has none.
pub fn resumed_timer(rec: &ReplicaRecord, default: Duration, now: Instant, now_unix: u64) -> DrainTimer {
    if rec.drain_deadline_unix_ms == 0 {
        return drain_timer(default, Duration::ZERO, now);
    }
    let left = Duration::from_millis(rec.drain_deadline_unix_ms.saturating_sub(now_unix));
    DrainTimer { since: now, deadline: now + left }
}

/// A drain timer starting now that ends `relative` from now (the configured
/// `drain_timeout` when `relative` is zero).
pub fn timer(cluster: &Cluster, relative: Duration) -> DrainTimer {
    drain_timer(cluster.cfg().drain_timeout, relative, Instant::now())
}

/// Drains a node for an operator: cordon, mark its replicas Draining (replacements are
/// placed elsewhere) but serving until replaced, tell the worker once none serves (at once
/// when nothing waits for a replacement), and stop the replicas when idle or at the deadline
/// (`deadline_ms` from now; 0 = the configured `drain_timeout`).
///
/// # Errors
/// `NotFound`, `NotLeader`, store failures.
pub async fn drain_node(cluster: &Cluster, node: &str, deadline_ms: u64, reason: &str) -> HeadResult<NodeRecord> {
    let rel = if deadline_ms == 0 { cluster.cfg().drain_timeout } else { Duration::from_millis(deadline_ms) };
    let reason = if reason.is_empty() { "drained by operator" } else { reason };
    let (rec, mut st) = cluster
        .update_node(node, |r| {
            r.cordoned = true;
            if r.state() != NodeState::Dead {
                r.state = NodeState::Draining as i32;
            }
            r.drain_deadline_unix_ms = unix_ms() + rel.as_millis() as u64;
            r.drain_reason = reason.to_owned();
        })
        .await?;
    let id = NodeId::from(node);
    mark_node_replicas_draining(cluster, &mut st, &id, rel, reason, true).await?;
    tracing::info!(node = %node, deadline_ms = rel.as_millis() as u64, "node draining");
    command_drains(&mut st, &[id]);
    cluster.after_change(&st);
    Ok(rec)
}

/// A worker-initiated drain (SIGTERM, spot notice): mark the node and its replicas
/// Draining so routers stop using them and replacements start elsewhere.
///
/// # Errors
/// Store failures.
pub async fn on_worker_drain(cluster: &Cluster, st: &mut State, node: &NodeId, d: DrainProgress) -> HeadResult<()> {
    let Some(mut rec) = st.view().nodes.get(node).map(|e| e.record.clone()) else { return Ok(()) };
    if d.done {
        return Ok(());
    }
    if rec.state() == NodeState::Draining {
        // Already drained by an operator: the worker now refuses new work, so replicas still
        // serving there stop serving (stopped when idle or at their deadline).
        let serving: Vec<ReplicaRecord> = st
            .view()
            .replicas_touching(node)
            .filter(|e| serves_while_draining(&e.record))
            .map(|e| e.record.clone())
            .collect();
        let why =
            if d.reason.is_empty() { "worker draining".to_owned() } else { format!("worker draining ({})", d.reason) };
        for rec in serving {
            stop_serving(cluster, st, rec, &why, Instant::now()).await?;
        }
        return Ok(());
    }
    // Not cordoned: Draining alone keeps placement away, and the next worker process on
    // this node (same node id, e.g. a StatefulSet pod) becomes schedulable on register.
    rec.state = NodeState::Draining as i32;
    rec.drain_deadline_unix_ms = d.deadline_unix_ms;
    rec.drain_reason.clone_from(&d.reason);
    cluster.put_node(st, rec).await?;
    let rel = Duration::from_millis(d.deadline_unix_ms.saturating_sub(unix_ms()));
    // The worker already refuses new work: its replicas stop serving at once.
    mark_node_replicas_draining(cluster, st, node, rel, &d.reason, false).await
}

/// The node state a (re)registering worker gets: Ready, with any drain cleared — unless an
/// operator's drain (Draining and cordoned) holds the node, which lasts until `uncordon`.
/// A Draining node that is not cordoned was drained by its own worker (SIGTERM, spot
/// notice): a new session is a new worker process, schedulable again; if it is still
/// draining, its drain progress follows and marks the node again.
pub fn ready_on_register(rec: &mut NodeRecord) {
    if rec.state() != NodeState::Draining || !rec.cordoned {
        rec.state = NodeState::Ready as i32;
        rec.drain_deadline_unix_ms = 0;
        rec.drain_reason.clear();
    }
}

/// Marks every Starting/Ready replica with ranks on `node` Draining with a deadline `rel`
/// from now (reason "node draining" when `reason` is empty); with `until_replaced`, a Ready
/// one keeps serving until it is replaced or the deadline passes. A replica whose GPU group only
/// has member ranks there drains exactly like one whose driver runs there: routers stop
/// sending it work, its replacement is placed on schedulable nodes (a Draining node takes
/// none), and it is stopped on every node of its group when idle or at the deadline — the
/// member ranks must serve its in-flight requests until then, since the driver cannot
/// step without them.
///
/// # Errors
/// Store failures.
pub async fn mark_node_replicas_draining(
    cluster: &Cluster,
    st: &mut State,
    node: &NodeId,
    rel: Duration,
    reason: &str,
    until_replaced: bool,
) -> HeadResult<()> {
    let recs: Vec<ReplicaRecord> = st
        .view()
        .replicas_touching(node)
        .filter(|e| matches!(e.record.state(), ReplicaState::Starting | ReplicaState::Ready))
        .map(|e| e.record.clone())
        .collect();
    let reason = if reason.is_empty() { "node draining" } else { reason };
    for rec in recs {
        if until_replaced && rec.state() == ReplicaState::Ready {
            start_drain(cluster, st, rec, rel, &format!("{reason}: {SERVING}"), true).await?;
        } else {
            start_drain(cluster, st, rec, rel, reason, false).await?;
        }
    }
    Ok(())
}

/// What a Draining replica that still serves says in its reason.
pub const SERVING: &str = "serving until a replacement is Ready";

/// Whether a Draining replica still takes new requests (the route table lists it as Ready).
pub fn is_serving(st: &State, replica: &ReplicaId) -> bool {
    st.view().replicas.get(replica).is_some_and(|e| serves_while_draining(&e.record))
}

/// Makes a Draining replica that still serves stop taking new requests (routers see it
/// Draining from the next table on): its reason says `why` instead of [`SERVING`], and its
/// idle grace counts from `now`.
///
/// # Errors
/// Store failures.
async fn stop_serving(
    cluster: &Cluster,
    st: &mut State,
    mut rec: ReplicaRecord,
    why: &str,
    now: Instant,
) -> HeadResult<ReplicaRecord> {
    let id = ReplicaId::from(rec.replica_id.as_str());
    let base = rec.reason.strip_suffix(&format!(": {SERVING}")).unwrap_or(&rec.reason).to_owned();
    rec.reason = format!("{base}: {why}");
    rec.drain_serving = false;
    tracing::info!(replica = %id, node = %rec.node_id, why, "drained replica stops serving");
    cluster.put_replica(st, rec.clone()).await?;
    if let Some(t) = st.drain_timer(&id).copied() {
        st.set_drain_timer(id, DrainTimer { since: now, ..t });
    }
    Ok(rec)
}

/// Whether `deployment` no longer needs its Draining replicas: it is gone, or it has at
/// least its desired count of Ready replicas (Draining, Starting and Failed ones do not count:
/// while the deployment is short of Ready replicas, a drained one keeps serving).
fn replaced(st: &State, deployment: &str) -> bool {
    let view = st.view();
    let Some(spec) = view.deployments.get(&DeploymentName::from(deployment)).and_then(|d| d.record.spec.as_ref())
    else {
        return true;
    };
    let ready = view
        .replicas
        .values()
        .filter(|e| e.record.deployment == deployment && e.record.state() == ReplicaState::Ready)
        .count();
    ready >= spec.replicas as usize
}

/// Tells the worker of each operator-drained (Draining and cordoned) node in `nodes` to
/// drain (refuse new work, finish or hand back in-flight requests by the node's deadline)
/// once none of the replicas with ranks on it still serves.
fn command_drains(st: &mut State, nodes: &[NodeId]) {
    let now = unix_ms();
    for id in nodes {
        let Some(rec) = st.view().nodes.get(id).map(|e| &e.record) else { continue };
        if rec.state() != NodeState::Draining || !rec.cordoned {
            continue;
        }
        let (deadline_ms, reason) = (rec.drain_deadline_unix_ms.saturating_sub(now), rec.drain_reason.clone());
        let waiting =
            st.view().replicas_touching(id).any(|e| is_serving(st, &ReplicaId::from(e.record.replica_id.as_str())));
        if waiting {
            tracing::info!(node = %id, "drain waits for replacements before the worker drains");
            continue;
        }
        // 0 would mean the worker's default: at least 1 ms.
        st.send(id, head_message::Msg::Drain(DrainCommand { deadline_ms: deadline_ms.max(1), reason }));
    }
}

/// Marks one replica Draining (routers stop sending it work) with a drain timer ending
/// `rel` from now (the configured `drain_timeout` when zero).
///
/// # Errors
/// Store failures.
pub async fn drain_replica(
    cluster: &Cluster,
    st: &mut State,
    rec: ReplicaRecord,
    rel: Duration,
    reason: &str,
) -> HeadResult<()> {
    start_drain(cluster, st, rec, rel, reason, false).await
}

/// Marks one replica Draining, still `serving` or not, with a drain timer ending `rel` from
/// now (the configured `drain_timeout` when zero), both kept in its record.
async fn start_drain(
    cluster: &Cluster,
    st: &mut State,
    mut rec: ReplicaRecord,
    rel: Duration,
    reason: &str,
    serving: bool,
) -> HeadResult<()> {
    rec.state = ReplicaState::Draining as i32;
    reason.clone_into(&mut rec.reason);
    rec.drain_serving = serving;
    start_timer(cluster, st, &mut rec, rel);
    cluster.put_replica(st, rec).await
}

/// Starts the drain timer of a replica becoming Draining, ending `rel` from now (the
/// configured `drain_timeout` when zero), and writes its deadline into `rec` (the caller
/// stores the record).
pub fn start_timer(cluster: &Cluster, st: &mut State, rec: &mut ReplicaRecord, rel: Duration) {
    let t = timer(cluster, rel);
    let left = u64::try_from(t.deadline.duration_since(t.since).as_millis()).unwrap_or(u64::MAX);
    rec.drain_deadline_unix_ms = unix_ms().saturating_add(left);
    st.set_drain_timer(ReplicaId::from(rec.replica_id.as_str()), t);
}

/// Stops Draining replicas that are idle (after [`DRAIN_GRACE`]) or past their deadline:
/// sends `StopReplica` with the time left and marks them Stopping. A replica whose worker is
/// not connected waits (stopped once the worker is back, or evicted when its node dies).
///
/// # Errors
/// Store failures.
pub async fn stop_drained(cluster: &Cluster, st: &mut State) -> HeadResult<()> {
    let (now, now_unix) = (Instant::now(), unix_ms());
    let draining: Vec<(ReplicaId, ReplicaRecord)> = st
        .view()
        .replicas
        .iter()
        .filter(|(_, e)| e.record.state() == ReplicaState::Draining)
        .map(|(id, e)| (id.clone(), e.record.clone()))
        .collect();
    let mut stopped_serving = Vec::new();
    for (id, mut rec) in draining {
        let default = cluster.cfg().drain_timeout;
        let mut t = st.drain_timer_or_start(&id, || resumed_timer(&rec, default, now, now_unix));
        let node = NodeId::from(rec.node_id.as_str());
        if rec.drain_serving {
            let past = now >= t.deadline;
            if !past && !replaced(st, &rec.deployment) {
                continue;
            }
            // Replaced (or out of time): routers stop sending it work from the next table
            // on; the grace counts from now.
            let why = if past { "drain deadline passed" } else { "replacement Ready" };
            rec = stop_serving(cluster, st, rec, why, now).await?;
            t.since = now;
            stopped_serving.extend(crate::cluster::view::group_nodes(&rec).into_iter().map(|(n, _)| n));
        }
        if !st.is_connected(&node) {
            continue;
        }
        let idle = st.load(&id).is_none_or(|l| l.running == 0 && l.waiting == 0);
        let past = now >= t.deadline;
        if !(past || (idle && now.duration_since(t.since) >= DRAIN_GRACE)) {
            continue;
        }
        let left = t.deadline.saturating_duration_since(now);
        // Every node of its GPU group (the driver's first): each frees its ranks' slots.
        stop_group(st, &rec, left.as_millis() as u64);
        rec.state = ReplicaState::Stopping as i32;
        cluster.put_replica(st, rec).await?;
        st.clear_drain_timer(&id);
    }
    stopped_serving.sort_unstable();
    stopped_serving.dedup();
    command_drains(st, &stopped_serving);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prism_common::proto::v1::{DeploymentSpec, EngineConfig, HeadMessage, NodeInventory};
    use prism_common::state_store::{EmbeddedStore, StateStore};
    use tokio::sync::watch;

    use super::*;
    use crate::cluster::registry::{self, Registration};
    use crate::config::{HeadConfig, StoreSpec};
    use crate::election::Leadership;
    use crate::metrics::Metrics;
    use crate::placement::reconciler::reconcile_once;

    #[test]
    fn a_zero_relative_deadline_means_the_default() {
        let now = Instant::now();
        let t = drain_timer(Duration::from_secs(30), Duration::ZERO, now);
        assert_eq!(t, DrainTimer { since: now, deadline: now + Duration::from_secs(30) });
        let t = drain_timer(Duration::from_secs(30), Duration::from_secs(2), now);
        assert_eq!(t.deadline, now + Duration::from_secs(2));
    }

    #[test]
    fn registering_ends_a_worker_drain_but_not_an_operator_drain() {
        let draining = NodeRecord {
            state: NodeState::Draining as i32,
            drain_deadline_unix_ms: 5,
            drain_reason: "spot".into(),
            ..Default::default()
        };
        let mut worker_drained = draining.clone();
        ready_on_register(&mut worker_drained);
        assert_eq!(worker_drained.state(), NodeState::Ready);
        assert_eq!((worker_drained.drain_deadline_unix_ms, worker_drained.drain_reason.as_str()), (0, ""));

        let operator_drained = NodeRecord { cordoned: true, ..draining };
        let mut rec = operator_drained.clone();
        ready_on_register(&mut rec);
        assert_eq!(rec, operator_drained);

        let mut dead = NodeRecord { state: NodeState::Dead as i32, cordoned: true, ..Default::default() };
        ready_on_register(&mut dead);
        assert_eq!(dead.state(), NodeState::Ready);
        assert!(dead.cordoned, "registering does not uncordon");
    }

    fn inventory() -> NodeInventory {
        NodeInventory { node_id: "n1".into(), address: "http://127.0.0.1:1".into(), cpu_slots: 1, ..Default::default() }
    }

    /// A head leading in `term` on `store`.
    async fn leader(store: Arc<dyn StateStore>, term: u64) -> (Arc<Cluster>, watch::Sender<Leadership>) {
        let (lead_tx, lead_rx) = watch::channel(Leadership::Leader);
        let cfg = HeadConfig::new(StoreSpec::Embedded("unused".into()), "http://127.0.0.1:50050");
        let cluster = Cluster::new(cfg, store, lead_rx, Metrics::new());
        cluster.on_elected(term).await.expect("elected");
        (cluster, lead_tx)
    }

    /// A leader on an in-memory store with one CPU worker running one replica of `d`.
    async fn one_replica() -> (Arc<Cluster>, watch::Sender<Leadership>, Registration, ReplicaId) {
        one_replica_on(Arc::new(EmbeddedStore::in_memory().expect("store"))).await
    }

    /// [`one_replica`] on `store`.
    async fn one_replica_on(
        store: Arc<dyn StateStore>,
    ) -> (Arc<Cluster>, watch::Sender<Leadership>, Registration, ReplicaId) {
        let (cluster, lead_tx) = leader(store, 1).await;
        let worker = registry::register(&cluster, inventory(), None).await.expect("registered");
        let spec = DeploymentSpec {
            name: "d".into(),
            engine: Some(EngineConfig { model: "/m.gguf".into(), tensor_parallel_size: 1, ..Default::default() }),
            replicas: 1,
            ..Default::default()
        };
        crate::admin::apply_deployment(&cluster, spec).await.expect("applied");
        reconcile_once(&cluster).await.expect("placed");
        let rid = cluster.lock().await.view().replicas.keys().next().cloned().expect("a replica");
        report_ready(&cluster, &rid).await;
        (cluster, lead_tx, worker, rid)
    }

    /// The worker on n1 reports `rid` Ready.
    async fn report_ready(cluster: &Cluster, rid: &ReplicaId) {
        let ready = prism_common::proto::v1::ReplicaStatus {
            replica_id: rid.to_string(),
            state: ReplicaState::Ready as i32,
            ..Default::default()
        };
        let mut st = cluster.lock().await;
        registry::handle_status(cluster, &mut st, &NodeId::from("n1"), vec![ready]).await.expect("Ready");
    }

    fn replica_state(st: &State, rid: &ReplicaId) -> (ReplicaState, String) {
        let r = &st.view().replicas[rid].record;
        (r.state(), r.reason.clone())
    }

    fn commands(worker: &mut Registration) -> Vec<head_message::Msg> {
        let mut out = Vec::new();
        while let Ok(Ok(HeadMessage { msg: Some(m) })) = worker.commands.try_recv() {
            out.push(m);
        }
        out
    }

    #[tokio::test]
    async fn operator_drain_keeps_an_unreplaced_replica_serving_until_the_deadline() {
        let (cluster, _lead, mut worker, rid) = one_replica().await;
        assert!(commands(&mut worker).iter().any(|m| matches!(m, head_message::Msg::Start(_))));

        // The only node is drained: the replacement has nowhere to go.
        let node = drain_node(&cluster, "n1", 1_500, "").await.expect("drained");
        assert!(node.cordoned);
        assert_eq!((node.state(), node.drain_reason.as_str()), (NodeState::Draining, "drained by operator"));
        {
            let st = cluster.lock().await;
            assert_eq!(replica_state(&st, &rid), (ReplicaState::Draining, format!("drained by operator: {SERVING}")));
            let routes = crate::routes::build(&st);
            assert_eq!(routes.iter().map(|r| r.state()).collect::<Vec<_>>(), [ReplicaState::Ready], "still routable");
        }
        assert!(commands(&mut worker).is_empty(), "the worker is not told to drain while its replica serves");

        // Idle past the grace, but not replaced: it keeps serving.
        tokio::time::sleep(DRAIN_GRACE + Duration::from_millis(100)).await;
        reconcile_once(&cluster).await.expect("pass");
        assert_eq!(replica_state(&*cluster.lock().await, &rid).0, ReplicaState::Draining);
        assert!(is_serving(&*cluster.lock().await, &rid));
        assert!(
            !commands(&mut worker)
                .iter()
                .any(|m| matches!(m, head_message::Msg::Stop(_) | head_message::Msg::Drain(_)))
        );

        // At the deadline it stops serving and is stopped; the worker drains.
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        reconcile_once(&cluster).await.expect("pass");
        let st = cluster.lock().await;
        assert_eq!(
            replica_state(&st, &rid),
            (ReplicaState::Stopping, "drained by operator: drain deadline passed".into())
        );
        assert!(crate::routes::build(&st).iter().all(|r| r.state() != ReplicaState::Ready));
        drop(st);
        let sent = commands(&mut worker);
        assert!(sent.iter().any(|m| matches!(m, head_message::Msg::Drain(_))), "{sent:?}");
        assert!(sent.iter().any(|m| matches!(m, head_message::Msg::Stop(s) if s.replica_id == rid.to_string())));
    }

    #[tokio::test]
    async fn operator_drain_of_a_replaced_replica_stops_it_after_the_grace() {
        let (cluster, _lead, mut worker, rid) = one_replica().await;
        // Scaled to zero: nothing needs the drained replica.
        let mut spec =
            cluster.lock().await.view().deployments.values().next().and_then(|d| d.record.spec.clone()).expect("spec");
        spec.replicas = 0;
        crate::admin::apply_deployment(&cluster, spec).await.expect("applied");
        let _ = commands(&mut worker);
        drain_node(&cluster, "n1", 60_000, "").await.expect("drained");
        reconcile_once(&cluster).await.expect("pass");
        assert!(!is_serving(&*cluster.lock().await, &rid));
        assert!(
            commands(&mut worker).iter().any(|m| matches!(m, head_message::Msg::Drain(d) if d.deadline_ms > 59_000))
        );
        tokio::time::sleep(DRAIN_GRACE + Duration::from_millis(100)).await;
        reconcile_once(&cluster).await.expect("pass");
        assert_eq!(replica_state(&*cluster.lock().await, &rid).0, ReplicaState::Stopping);
    }

    #[tokio::test]
    async fn worker_drain_marks_node_and_replicas_draining_without_cordon() {
        let (cluster, _lead, _worker, rid) = one_replica().await;
        let node = NodeId::from("n1");
        let progress =
            DrainProgress { deadline_unix_ms: unix_ms() + 30_000, reason: "spot".into(), ..Default::default() };
        {
            let mut st = cluster.lock().await;
            on_worker_drain(&cluster, &mut st, &node, progress).await.expect("drain");
            let rec = &st.view().nodes[&node].record;
            assert_eq!((rec.state(), rec.cordoned, rec.drain_reason.as_str()), (NodeState::Draining, false, "spot"));
            assert_eq!(replica_state(&st, &rid), (ReplicaState::Draining, "spot".to_owned()));
            let t = st.drain_timer_or_start(&rid, || unreachable!("the drain set a timer"));
            let left = t.deadline - t.since;
            assert!(left > Duration::from_secs(28) && left <= Duration::from_secs(30), "{left:?}");
        }
        // The next worker process on the node is schedulable again.
        let _again = registry::register(&cluster, inventory(), None).await.expect("registered");
        assert_eq!(cluster.lock().await.view().nodes[&node].record.state(), NodeState::Ready);
    }

    #[tokio::test]
    async fn a_new_leader_keeps_an_operator_drained_replica_serving_until_the_original_deadline() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (cluster, lead, _worker, rid) = one_replica_on(Arc::clone(&store)).await;
        drain_node(&cluster, "n1", 2_000, "").await.expect("drained");
        tokio::time::sleep(Duration::from_millis(1_000)).await;

        // Another head takes over halfway through the drain.
        lead.send_replace(Leadership::Follower { leader: None });
        cluster.on_deposed().await;
        let (next, _lead) = leader(store, 2).await;
        {
            // Its first table, before any reconcile pass, still routes to the replica.
            let st = next.lock().await;
            assert_eq!(replica_state(&st, &rid), (ReplicaState::Draining, format!("drained by operator: {SERVING}")));
            let routes = crate::routes::build(&st);
            assert_eq!(routes.iter().map(|r| r.state()).collect::<Vec<_>>(), [ReplicaState::Ready]);
        }
        let mut worker = registry::register(&next, inventory(), None).await.expect("registered again");
        report_ready(&next, &rid).await;
        reconcile_once(&next).await.expect("pass");
        assert!(is_serving(&*next.lock().await, &rid), "still serving after the takeover");
        assert!(
            !commands(&mut worker)
                .iter()
                .any(|m| matches!(m, head_message::Msg::Stop(_) | head_message::Msg::Drain(_)))
        );

        // The original deadline (2 s after the drain) ends it, not one restarted at the takeover.
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        reconcile_once(&next).await.expect("pass");
        let st = next.lock().await;
        assert_eq!(
            replica_state(&st, &rid),
            (ReplicaState::Stopping, "drained by operator: drain deadline passed".into())
        );
        assert!(!st.view().replicas[&rid].record.drain_serving);
        drop(st);
        let sent = commands(&mut worker);
        assert!(sent.iter().any(|m| matches!(m, head_message::Msg::Drain(_))), "{sent:?}");
        assert!(sent.iter().any(|m| matches!(m, head_message::Msg::Stop(s) if s.replica_id == rid.to_string())));
    }

    #[tokio::test]
    async fn a_worker_draining_itself_during_an_operator_drain_stops_its_replicas_serving_and_says_why() {
        let (cluster, _lead, _worker, rid) = one_replica().await;
        drain_node(&cluster, "n1", 60_000, "").await.expect("drained");
        let progress = DrainProgress {
            deadline_unix_ms: unix_ms() + 30_000,
            reason: "worker shutting down".into(),
            ..Default::default()
        };
        let mut st = cluster.lock().await;
        on_worker_drain(&cluster, &mut st, &NodeId::from("n1"), progress).await.expect("drain");
        assert_eq!(
            replica_state(&st, &rid),
            (ReplicaState::Draining, "drained by operator: worker draining (worker shutting down)".into())
        );
        assert!(!is_serving(&st, &rid));
        let routes = crate::routes::build(&st);
        assert_eq!(routes.iter().map(|r| r.state()).collect::<Vec<_>>(), [ReplicaState::Draining]);
    }
}
