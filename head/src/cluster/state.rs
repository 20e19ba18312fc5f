//! The leader's mutable state: the mirror of stored records, the live worker sessions,
//! load reports and drain timers. Its fields are private: the rest of the head reads it
//! through accessors and changes it through the narrow methods here, and only the store
//! writers of `Cluster` (`cluster.rs`) change the mirrored records, after their transaction
//! committed. It is reached only through `Cluster::lock`, one async mutex, so every change
//! happens under that lock.

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use prism_common::proto::v1::{HeadMessage, LoadReport, ModelDemand, head_message};
use prism_common::{DeploymentName, NodeId, ReplicaId};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::view::ClusterView;
use crate::placement::autoscaler::Autoscaler;

/// A router's demand report counts this long after it came (routers report about once a
/// second; one silent for longer is gone or cut off, and its queue with it).
pub const ROUTER_DEMAND_TTL: Duration = Duration::from_secs(5);

/// A held lock on [`State`].
pub type StateGuard<'a> = tokio::sync::MutexGuard<'a, State>;

/// A Draining replica's timer: it is stopped when idle (the grace counting from `since`) or
/// at `deadline`. Whether it still serves, and its deadline as wall-clock time, are in its
/// record (`drain_serving`, `drain_deadline_unix_ms`), from which a new leader starts the
/// timer again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DrainTimer {
    /// When it became Draining, when it stopped serving, or when this leader took its drain
    /// over (the grace counts from there).
    pub since: Instant,
    /// When it is stopped regardless of in-flight work.
    pub deadline: Instant,
}

/// Who holds a worker session: what tells the same worker reconnecting from another
/// process registering with the same node id.
#[derive(Clone, Debug, Default)]
pub struct SessionOwner {
    /// The worker process's `NodeInventory.instance_id` (empty: the worker sent none).
    pub instance_id: String,
    /// The endpoint the worker advertises.
    pub address: String,
    /// Where its connection comes from, when known.
    pub peer: Option<std::net::SocketAddr>,
}

/// One live worker session.
#[derive(Debug)]
pub struct Session {
    /// Distinguishes a reconnected session from the one it replaced.
    id: u64,
    /// The worker process holding it.
    owner: SessionOwner,
    /// When the worker's last message came (the registration, at first).
    last_message: Instant,
    /// Commands to the worker.
    tx: mpsc::Sender<Result<HeadMessage, Status>>,
    /// Ends the session (replaced, or leadership lost).
    cancel: CancellationToken,
    /// Replicas the worker knows about in this session (reported or sent a start).
    started: HashSet<ReplicaId>,
    /// The worker's latest drain progress in this session said its drain was done.
    drain_done: bool,
}

impl Session {
    /// A session of `owner` that has told the worker nothing yet.
    pub fn new(
        id: u64,
        owner: SessionOwner,
        tx: mpsc::Sender<Result<HeadMessage, Status>>,
        cancel: CancellationToken,
    ) -> Self {
        Self { id, owner, last_message: Instant::now(), tx, cancel, started: HashSet::new(), drain_done: false }
    }
}

/// Mutable state guarded by the cluster handle's lock.
#[derive(Default)]
pub struct State {
    /// Mirror of stored records (valid while `loaded`).
    view: ClusterView,
    /// The view was loaded for the current leadership term.
    loaded: bool,
    /// Live worker sessions by node.
    sessions: HashMap<NodeId, Session>,
    /// When each session-less node lost (or never had, this term) its session.
    disconnected_since: HashMap<NodeId, Instant>,
    /// Latest load report per replica (not persisted).
    loads: HashMap<ReplicaId, LoadReport>,
    /// Drain timers of Draining replicas (started again from their records in a new term).
    draining: HashMap<ReplicaId, DrainTimer>,
    /// Latest demand report per router id, with when it came (not persisted).
    demand: HashMap<String, (Instant, Vec<ModelDemand>)>,
    /// The autoscaler's load windows (this term's observations only).
    autoscaler: Autoscaler,
    /// GPU-group replicas of each deployment replaced after failing while starting, since
    /// one of its replicas was last Ready (this term only): the exponent of their backoff.
    group_start_retries: HashMap<DeploymentName, u32>,
    /// Number of store transactions this head has committed (benchmarks).
    writes: u64,
}

impl State {
    /// A state holding `view` and nothing else (unit tests of the readers).
    #[cfg(test)]
    pub(crate) fn with_view(view: ClusterView) -> Self {
        Self { view, ..Self::default() }
    }

    /// The mirror of stored records.
    pub fn view(&self) -> &ClusterView {
        &self.view
    }

    /// The mirror, for the store writers once their transaction committed.
    pub(super) fn view_mut(&mut self) -> &mut ClusterView {
        &mut self.view
    }

    /// The view was loaded for the current leadership term.
    pub fn is_loaded(&self) -> bool {
        self.loaded
    }

    /// Number of store transactions committed by this head.
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// Counts one committed (or attempted) store transaction.
    pub(super) fn count_write(&mut self) {
        self.writes += 1;
    }

    /// Starts a leadership term on a freshly loaded `view`: every stored node has until
    /// `reconnect_from` + `worker_timeout` to (re)connect; sessions, loads and drain timers
    /// of an earlier term are dropped.
    pub(super) fn begin_term(&mut self, view: ClusterView, reconnect_from: Instant) {
        self.view = view;
        let nodes: Vec<NodeId> = self.view.nodes.keys().cloned().collect();
        self.disconnected_since = nodes.into_iter().map(|n| (n, reconnect_from)).collect();
        self.sessions.clear();
        self.loads.clear();
        self.draining.clear();
        self.demand.clear();
        self.autoscaler = Autoscaler::default();
        self.group_start_retries.clear();
        self.loaded = true;
    }

    /// Ends the leadership term: closes every worker session (workers follow the new leader).
    pub(super) fn end_term(&mut self) {
        for (_, s) in self.sessions.drain() {
            s.cancel.cancel();
        }
        self.loaded = false;
    }

    /// Forgets what is kept about a replica besides its record (its deletion committed).
    pub(super) fn forget_replica(&mut self, id: &ReplicaId) {
        self.loads.remove(id);
        self.draining.remove(id);
    }

    /// Forgets what is kept about a node besides its record (its deletion committed).
    pub(super) fn forget_node(&mut self, node: &NodeId) {
        self.disconnected_since.remove(node);
    }

    /// Makes `session` the node's live session, ending the one it replaces.
    pub fn attach_session(&mut self, node: NodeId, session: Session) {
        if let Some(old) = self.sessions.insert(node.clone(), session) {
            old.cancel.cancel();
        }
        self.disconnected_since.remove(&node);
    }

    /// Notes the drain progress of session `id` of the node: whether its drain is done
    /// (ignored when it is not the live session).
    pub fn note_drain_progress(&mut self, node: &NodeId, id: u64, done: bool) {
        if let Some(s) = self.sessions.get_mut(node).filter(|s| s.id == id) {
            s.drain_done = done;
        }
    }

    /// True when session `id` is the node's live session and its worker's latest drain
    /// progress said the drain was done.
    pub fn drain_done(&self, node: &NodeId, id: u64) -> bool {
        self.sessions.get(node).is_some_and(|s| s.id == id && s.drain_done)
    }

    /// Removes the node's session if it is still session `id` (not replaced meanwhile),
    /// recording the node as disconnected since `gone_since`. True when it was removed.
    pub fn detach_session(&mut self, node: &NodeId, id: u64, gone_since: Instant) -> bool {
        if !self.is_current_session(node, id) {
            return false;
        }
        self.sessions.remove(node);
        self.disconnected_since.insert(node.clone(), gone_since);
        true
    }

    /// True when session `id` is the node's live session.
    pub fn is_current_session(&self, node: &NodeId, id: u64) -> bool {
        self.sessions.get(node).is_some_and(|s| s.id == id)
    }

    /// The node's live session: who holds it and when its last message came.
    pub fn live_session(&self, node: &NodeId) -> Option<(&SessionOwner, Instant)> {
        self.sessions.get(node).map(|s| (&s.owner, s.last_message))
    }

    /// Notes a message of session `id` of the node (ignored when it is not the live one).
    pub fn touch_session(&mut self, node: &NodeId, id: u64, at: Instant) {
        if let Some(s) = self.sessions.get_mut(node).filter(|s| s.id == id) {
            s.last_message = at;
        }
    }

    /// True when the node has a live session.
    pub fn is_connected(&self, node: &NodeId) -> bool {
        self.sessions.contains_key(node)
    }

    /// Nodes with a live session.
    pub fn connected_nodes(&self) -> HashSet<NodeId> {
        self.sessions.keys().cloned().collect()
    }

    /// When a session-less node lost its session (`None` for a connected node, or one
    /// never seen this term).
    pub fn disconnected_since(&self, node: &NodeId) -> Option<Instant> {
        self.disconnected_since.get(node).copied()
    }

    /// Replicas the node's worker knows about in its current session.
    pub fn started_on(&self, node: &NodeId) -> HashSet<ReplicaId> {
        self.sessions.get(node).map(|s| s.started.clone()).unwrap_or_default()
    }

    /// Records that the node's worker knows about `replica` (it reported it or was sent a start).
    pub fn mark_started(&mut self, node: &NodeId, replica: &ReplicaId) {
        if let Some(s) = self.sessions.get_mut(node) {
            s.started.insert(replica.clone());
        }
    }

    /// Queues a command on a node's session; false when the node has none (or its queue is
    /// full or closed).
    pub fn send(&self, node: &NodeId, msg: head_message::Msg) -> bool {
        let Some(s) = self.sessions.get(node) else { return false };
        match s.tx.try_send(Ok(HeadMessage { msg: Some(msg) })) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(node = %node, error = %e, "worker session queue full or closed");
                false
            }
        }
    }

    /// Keeps a load report from `node` when the replica is placed there.
    pub fn record_load(&mut self, node: &NodeId, report: LoadReport) {
        let rid = ReplicaId::from(report.replica_id.as_str());
        if self.view.replicas.get(&rid).is_some_and(|e| e.record.node_id == node.as_str()) {
            self.loads.insert(rid, report);
        }
    }

    /// The latest load report of a replica.
    pub fn load(&self, replica: &ReplicaId) -> Option<&LoadReport> {
        self.loads.get(replica)
    }

    /// Every latest load report.
    pub fn loads(&self) -> impl Iterator<Item = &LoadReport> {
        self.loads.values()
    }

    /// Sets (or replaces) a Draining replica's timer.
    pub fn set_drain_timer(&mut self, replica: ReplicaId, timer: DrainTimer) {
        self.draining.insert(replica, timer);
    }

    /// A Draining replica's timer, if it has one.
    pub fn drain_timer(&self, replica: &ReplicaId) -> Option<&DrainTimer> {
        self.draining.get(replica)
    }

    /// A Draining replica's timer, starting it with `start` if it has none (a head that
    /// took over a drain from an earlier leader starts it from the replica's record).
    pub fn drain_timer_or_start(&mut self, replica: &ReplicaId, start: impl FnOnce() -> DrainTimer) -> DrainTimer {
        *self.draining.entry(replica.clone()).or_insert_with(start)
    }

    /// Ends a replica's drain timer (it is being stopped).
    pub fn clear_drain_timer(&mut self, replica: &ReplicaId) {
        self.draining.remove(replica);
    }

    /// Keeps `router`'s latest demand report (received at `now`), replacing its previous
    /// one, and forgets routers silent for [`ROUTER_DEMAND_TTL`].
    pub fn record_demand(&mut self, router: String, models: Vec<ModelDemand>, now: Instant) {
        self.demand.retain(|_, (at, _)| now.duration_since(*at) <= ROUTER_DEMAND_TTL);
        self.demand.insert(router, (now, models));
    }

    /// Requests queued for served model `model` over the routers that reported within
    /// [`ROUTER_DEMAND_TTL`] of `now`.
    pub fn queued_for(&self, model: &str, now: Instant) -> u32 {
        self.demand
            .values()
            .filter(|(at, _)| now.duration_since(*at) <= ROUTER_DEMAND_TTL)
            .flat_map(|(_, models)| models.iter().filter(|m| m.model == model))
            .fold(0u32, |sum, m| sum.saturating_add(m.queued))
    }

    /// Routers whose demand report still counts at `now`.
    pub fn reporting_routers(&self, now: Instant) -> usize {
        self.demand.values().filter(|(at, _)| now.duration_since(*at) <= ROUTER_DEMAND_TTL).count()
    }

    /// Replacements of the deployment's GPU groups that failed while starting, since one of
    /// its replicas was last Ready.
    pub fn group_start_retries(&self) -> &HashMap<DeploymentName, u32> {
        &self.group_start_retries
    }

    /// Counts one replacement of a GPU group of `deployment` that failed while starting.
    pub fn note_group_start_retry(&mut self, deployment: &DeploymentName) {
        *self.group_start_retries.entry(deployment.clone()).or_default() += 1;
    }

    /// A replica of `deployment` became Ready: its next group start failure backs off from
    /// the shortest delay again.
    pub fn note_ready(&mut self, deployment: &DeploymentName) {
        self.group_start_retries.remove(deployment);
    }

    /// Takes the autoscaler's windows out (put them back with [`put_autoscaler`](Self::put_autoscaler)),
    /// so a pass can read the view while it updates them.
    pub fn take_autoscaler(&mut self) -> Autoscaler {
        std::mem::take(&mut self.autoscaler)
    }

    /// Puts the autoscaler's windows back after a pass (dropped if the term ended meanwhile).
    pub fn put_autoscaler(&mut self, a: Autoscaler) {
        if self.loaded {
            self.autoscaler = a;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn demand(model: &str, queued: u32) -> ModelDemand {
        ModelDemand { model: model.into(), queued, ..Default::default() }
    }

    #[test]
    fn demand_is_the_sum_of_the_latest_report_per_router_and_silent_routers_are_forgotten() {
        let mut st = State::default();
        let t0 = Instant::now();
        st.record_demand("r1".into(), vec![demand("a", 3), demand("b", 1)], t0);
        st.record_demand("r2".into(), vec![demand("a", 2)], t0 + Duration::from_secs(1));
        assert_eq!(st.queued_for("a", t0 + Duration::from_secs(1)), 5);
        assert_eq!(st.queued_for("b", t0 + Duration::from_secs(1)), 1);
        assert_eq!(st.queued_for("c", t0 + Duration::from_secs(1)), 0);
        // A newer report replaces the router's previous one.
        st.record_demand("r1".into(), vec![demand("a", 1)], t0 + Duration::from_secs(2));
        assert_eq!(st.queued_for("a", t0 + Duration::from_secs(2)), 3);
        assert_eq!(st.queued_for("b", t0 + Duration::from_secs(2)), 0);
        // r2 falls silent: its queue stops counting after the TTL.
        let later = t0 + Duration::from_secs(1) + ROUTER_DEMAND_TTL + Duration::from_millis(1);
        assert_eq!(st.queued_for("a", later), 1);
        assert_eq!(st.reporting_routers(later), 1);
        st.record_demand("r1".into(), vec![], later);
        assert_eq!(st.queued_for("a", later), 0);
        assert_eq!(st.demand.len(), 1, "the silent router was dropped");
    }
}
