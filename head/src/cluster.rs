//! The head's cluster handle: one [`Cluster`] owns the store handle, the leader's
//! [`State`] (mirror of stored records, worker sessions, load reports, drain timers) behind
//! one async mutex, the route publisher and the metrics. Control-plane operations are few
//! and each is a short series of store transactions, so serialising them keeps every write
//! a compare-and-swap on a view that nothing else is changing. The store writers here are
//! the only code that changes the mirrored records, and only after their transaction
//! committed; the flows built on them live in `cluster/registry.rs` (worker sessions),
//! `cluster/departure.rs` (forgetting nodes that left or died), `admin.rs`, `drain.rs` and
//! `placement/reconciler.rs`.

pub mod departure;
pub mod group;
pub mod registry;
pub mod stall;
pub mod state;
pub mod view;

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use prism_common::proto::v1::{DeploymentRecord, NodeRecord, ReplicaRecord, RouteTable};
use prism_common::state_store::{Compare, MAX_TXN_OPS, Revision, StateStore, Txn, TxnOp, keys};
use prism_common::{DeploymentName, NodeId, ReplicaId};
use prost::Message;
use tokio::sync::futures::Notified;
use tokio::sync::{Mutex, Notify, watch};
use tokio::time::Instant;

use crate::config::HeadConfig;
use crate::election::Leadership;
use crate::error::{HeadError, HeadResult};
use crate::events::EventLog;
use crate::metrics::Metrics;
use crate::placement::planner::holds_slots;
use crate::routes::RoutePublisher;
use state::{State, StateGuard};
use view::{ClusterView, Entry};

/// Extra time a new leader gives the known workers to reconnect before `worker_timeout`
/// starts: workers back off up to 5 s between attempts while no head answers, so without
/// it a head restarted after a short outage declared live workers Dead (and evicted their
/// replicas, streams included) moments before they reconnected.
pub const LEADER_ADOPTION_GRACE: Duration = Duration::from_secs(5);

/// Whether the leader has loaded the cluster state for its term: a leader serves nothing
/// before it has (`/readyz` is 503 until then, saying why).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StateLoad {
    /// Not leading, or leading and loading.
    NotLoaded,
    /// The last load attempt failed with this error; the leader retries.
    Failed(String),
    /// Loaded for the current term.
    Loaded,
}

/// The head's shared state and store handle. Cheap to share through `Arc`.
pub struct Cluster {
    /// Validated configuration.
    cfg: HeadConfig,
    /// The state store.
    store: Arc<dyn StateStore>,
    /// Everything mutable.
    state: Mutex<State>,
    /// Current route table (routers subscribe).
    routes: RoutePublisher,
    /// Wakes the reconciler.
    kick: Notify,
    /// Leadership as this head acts on it (follows the election).
    leadership: watch::Receiver<Leadership>,
    /// Prometheus metrics.
    metrics: Metrics,
    /// Recent control-plane events (`GET /v1/events`).
    events: EventLog,
    session_seq: AtomicU64,
    /// Whether this head was running (stalls of its own do not count against workers).
    stall: Arc<stall::StallWatch>,
    /// Whether the state is loaded for the current term. A plain mutex, never held across an
    /// await, so `/readyz` answers while `state` is busy.
    load: std::sync::Mutex<StateLoad>,
}

impl Cluster {
    /// A cluster handle; nothing is loaded until leadership is gained.
    pub fn new(
        cfg: HeadConfig,
        store: Arc<dyn StateStore>,
        leadership: watch::Receiver<Leadership>,
        metrics: Metrics,
    ) -> Arc<Self> {
        Arc::new(Self {
            cfg,
            store,
            state: Mutex::new(State::default()),
            routes: RoutePublisher::new(metrics.route_updates.clone()),
            kick: Notify::new(),
            leadership,
            metrics,
            events: EventLog::default(),
            session_seq: AtomicU64::new(1),
            stall: stall::StallWatch::started(),
            load: std::sync::Mutex::new(StateLoad::NotLoaded),
        })
    }

    /// Validated configuration.
    pub fn cfg(&self) -> &HeadConfig {
        &self.cfg
    }

    /// Prometheus metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Recent control-plane events.
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    /// This head's own liveness clock: judge a worker by time only from
    /// [`stall::StallWatch::watched_from`].
    pub fn stall_watch(&self) -> &stall::StallWatch {
        &self.stall
    }

    /// Current leadership.
    pub fn leadership(&self) -> Leadership {
        self.leadership.borrow().clone()
    }

    /// Whether the cluster state is loaded for the current term.
    pub fn state_load(&self) -> StateLoad {
        self.load.lock().map_or(StateLoad::NotLoaded, |l| l.clone())
    }

    fn set_state_load(&self, now: StateLoad) {
        if let Ok(mut l) = self.load.lock() {
            *l = now;
        }
    }

    /// Leadership changes, as this head acts on them.
    pub fn watch_leadership(&self) -> watch::Receiver<Leadership> {
        self.leadership.clone()
    }

    /// The current route table and its changes.
    pub fn subscribe_routes(&self) -> watch::Receiver<Option<Arc<RouteTable>>> {
        self.routes.subscribe()
    }

    /// Store transactions this head has committed (benchmarks).
    pub async fn store_writes(&self) -> u64 {
        self.state.lock().await.writes()
    }

    /// Locks the state.
    pub(crate) async fn lock(&self) -> StateGuard<'_> {
        self.state.lock().await
    }

    /// The state store.
    pub(crate) fn store(&self) -> &dyn StateStore {
        self.store.as_ref()
    }

    /// Wakes the reconciler.
    pub(crate) fn kick(&self) {
        self.kick.notify_one();
    }

    /// Completes on the next [`kick`](Self::kick) (or at once if one is pending).
    pub(crate) fn kicked(&self) -> Notified<'_> {
        self.kick.notified()
    }

    /// A fresh session id.
    pub(crate) fn next_session_id(&self) -> u64 {
        self.session_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Fails with [`HeadError::NotLeader`] unless this head leads and has loaded its view.
    ///
    /// # Errors
    /// `NotLeader` (followers), `Store(Unavailable)` while the new leader is loading.
    pub(crate) fn require_leader(&self, st: &State) -> HeadResult<()> {
        if let Leadership::Follower { leader } = self.leadership() {
            return Err(HeadError::NotLeader { leader });
        }
        if !st.is_loaded() {
            return Err(HeadError::Store(prism_common::state_store::StoreError::Unavailable(
                "leader is loading cluster state".into(),
            )));
        }
        Ok(())
    }

    /// Called when leadership `term` (the election key's store revision) is gained: reloads
    /// the view, drops reservations no replica holds, gives every node
    /// [`LEADER_ADOPTION_GRACE`] + `worker_timeout` from now to (re)connect, and starts
    /// publishing routes for the term.
    ///
    /// # Errors
    /// Store failures (the caller retries); [`Cluster::state_load`] holds the last one.
    pub async fn on_elected(&self, term: u64) -> HeadResult<()> {
        // A failed attempt stays reported while the next one runs (the caller retries).
        let loaded = self.load_term(term).await;
        self.set_state_load(match &loaded {
            Ok(()) => StateLoad::Loaded,
            Err(e) => StateLoad::Failed(e.to_string()),
        });
        loaded
    }

    async fn load_term(&self, term: u64) -> HeadResult<()> {
        let mut st = self.state.lock().await;
        let view = ClusterView::load(self.store.as_ref()).await?;
        self.gc_reservations(&view).await?;
        st.begin_term(view, Instant::now() + LEADER_ADOPTION_GRACE);
        self.routes.begin_term(term, &st);
        tracing::info!(
            nodes = st.view().nodes.len(),
            deployments = st.view().deployments.len(),
            replicas = st.view().replicas.len(),
            "leader: cluster state loaded"
        );
        self.after_change(&st);
        drop(st);
        self.kick.notify_one();
        Ok(())
    }

    /// Called when leadership is lost: closes worker sessions (workers follow the new leader).
    pub async fn on_deposed(&self) {
        self.set_state_load(StateLoad::NotLoaded);
        let mut st = self.state.lock().await;
        st.end_term();
        self.routes.end_term();
        self.metrics.set_leader(false);
    }

    async fn gc_reservations(&self, view: &ClusterView) -> HeadResult<()> {
        let held: HashSet<String> = view.replicas.values().flat_map(|e| reservation_keys(&e.record)).collect();
        let (all, _) = self.store.list(keys::RESERVATIONS).await?;
        for (k, _) in all.into_iter().filter(|(k, _)| !held.contains(k)) {
            tracing::info!(key = %k, "dropping orphan reservation");
            self.store.delete(&k).await?;
        }
        Ok(())
    }

    /// Reloads the view after a conflict (another writer changed the store).
    ///
    /// # Errors
    /// Store failures.
    pub(crate) async fn reload(&self, st: &mut State) -> HeadResult<()> {
        *st.view_mut() = ClusterView::load(self.store.as_ref()).await?;
        Ok(())
    }

    async fn commit(&self, st: &mut State, txn: Txn, what: &str) -> HeadResult<i64> {
        let res = self.store.txn(txn).await?;
        st.count_write();
        if !res.succeeded {
            return Err(HeadError::Conflict(what.to_owned()));
        }
        Ok(res.revision)
    }

    /// Writes a node record (compare-and-swap on the mirrored revision).
    ///
    /// # Errors
    /// `Conflict` when the stored record changed, store failures.
    pub(crate) async fn put_node(&self, st: &mut State, rec: NodeRecord) -> HeadResult<()> {
        let id = view::node_id(&rec);
        let key = keys::node(&id);
        let prev = st.view().nodes.get(&id).map_or(0, |e| e.mod_revision);
        let txn = Txn {
            compares: vec![Compare::mod_revision(&key, prev)],
            success: vec![TxnOp::put(&key, rec.encode_to_vec())],
            failure: vec![],
        };
        let rev = self.commit(st, txn, &key).await?;
        st.view_mut().nodes.insert(id, Entry { record: rec, mod_revision: rev });
        Ok(())
    }

    /// Deletes a node record (compare-and-swap on the mirrored revision) and what is kept
    /// about the node besides it. The caller makes sure no session or replica record refers
    /// to the node; a worker with its id that registers later gets a new record.
    ///
    /// # Errors
    /// `Conflict` when the stored record changed, store failures.
    pub(crate) async fn delete_node(&self, st: &mut State, id: &NodeId) -> HeadResult<()> {
        let Some(e) = st.view().nodes.get(id) else { return Ok(()) };
        let key = keys::node(id);
        let txn = Txn {
            compares: vec![Compare::mod_revision(&key, e.mod_revision)],
            success: vec![TxnOp::delete(&key)],
            failure: vec![],
        };
        self.commit(st, txn, &key).await?;
        st.view_mut().nodes.remove(id);
        st.forget_node(id);
        Ok(())
    }

    /// Writes a replica record. Reservation keys follow the record: created (if absent —
    /// the guard against double-booking a GPU) when it starts holding slots, deleted when
    /// it stops holding them.
    ///
    /// # Errors
    /// `Conflict` when the record changed or a GPU is already reserved; store failures.
    pub(crate) async fn put_replica(&self, st: &mut State, rec: ReplicaRecord) -> HeadResult<()> {
        self.put_replicas(st, vec![rec], |_, _| {}).await
    }

    /// Writes replica records as [`put_replica`](Self::put_replica) does, several per store
    /// transaction (as many as fit in [`MAX_TXN_OPS`] compares and operations, and never two
    /// touching one key), and calls `committed` with each record's index in `recs` once its
    /// transaction has committed and the view holds it. A scale-up of thousands of replicas
    /// is then tens of transactions (round trips to etcd, fsyncs of the embedded store)
    /// instead of thousands.
    ///
    /// # Errors
    /// `Conflict` when a record changed or a GPU is already reserved; store failures. The
    /// records of the transactions before the failed one stay written.
    pub(crate) async fn put_replicas(
        &self,
        st: &mut State,
        recs: Vec<ReplicaRecord>,
        mut committed: impl FnMut(&mut State, usize),
    ) -> HeadResult<()> {
        let mut txn = Txn::default();
        let mut batch: Vec<(usize, ReplicaRecord)> = Vec::new();
        let mut touched: HashSet<String> = HashSet::new();
        for (i, rec) in recs.into_iter().enumerate() {
            let (compares, ops) = replica_writes(st, &rec);
            let keys: Vec<String> = compares.iter().map(|Compare::ModRevision { key, .. }| key.clone()).collect();
            let fits = txn.compares.len() + compares.len() <= MAX_TXN_OPS
                && txn.success.len() + ops.len() <= MAX_TXN_OPS
                && keys.iter().chain(ops.iter().map(op_key)).all(|k| !touched.contains(k));
            if !fits && !batch.is_empty() {
                self.commit_replicas(st, std::mem::take(&mut txn), std::mem::take(&mut batch), &mut committed).await?;
                touched.clear();
            }
            touched.extend(keys);
            touched.extend(ops.iter().map(op_key).cloned());
            txn.compares.extend(compares);
            txn.success.extend(ops);
            batch.push((i, rec));
        }
        if batch.is_empty() {
            return Ok(());
        }
        self.commit_replicas(st, txn, batch, &mut committed).await
    }

    async fn commit_replicas(
        &self,
        st: &mut State,
        txn: Txn,
        recs: Vec<(usize, ReplicaRecord)>,
        committed: &mut impl FnMut(&mut State, usize),
    ) -> HeadResult<()> {
        let what = recs.first().map(|(_, r)| ClusterView::replica_key(r)).unwrap_or_default();
        match self.commit(st, txn, &what).await {
            Ok(rev) => {
                for (i, rec) in recs {
                    insert_replica(st, rec, rev);
                    committed(st, i);
                }
                Ok(())
            }
            Err(HeadError::Conflict(_)) if recs.len() > 1 => {
                // Which record lost its compare is unknown: one transaction each, so the
                // records before it are written, as when each record was its own transaction.
                for (i, rec) in recs {
                    let (compares, success) = replica_writes(st, &rec);
                    let txn = Txn { compares, success, failure: vec![] };
                    let rev = self.commit(st, txn, &ClusterView::replica_key(&rec)).await?;
                    insert_replica(st, rec, rev);
                    committed(st, i);
                }
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Deletes a replica record and its reservations.
    ///
    /// # Errors
    /// `Conflict` when the record changed; store failures.
    pub(crate) async fn delete_replica(&self, st: &mut State, id: &ReplicaId) -> HeadResult<()> {
        let Some(e) = st.view().replicas.get(id) else { return Ok(()) };
        let key = ClusterView::replica_key(&e.record);
        let mut txn = Txn {
            compares: vec![Compare::mod_revision(&key, e.mod_revision)],
            success: vec![TxnOp::delete(&key)],
            failure: vec![],
        };
        for k in reservation_keys(&e.record) {
            txn.success.push(TxnOp::delete(k));
        }
        self.commit(st, txn, &key).await?;
        st.view_mut().replicas.remove(id);
        st.forget_replica(id);
        Ok(())
    }

    /// Writes a deployment record (compare-and-swap on the mirrored revision), then
    /// publishes and wakes the reconciler. A lost compare reloads the view.
    ///
    /// # Errors
    /// `Conflict` when the stored record changed, store failures.
    pub(crate) async fn put_deployment(&self, st: &mut State, rec: DeploymentRecord) -> HeadResult<DeploymentRecord> {
        let name = DeploymentName::from(rec.spec.as_ref().map(|s| s.name.as_str()).unwrap_or_default());
        let key = keys::deployment(&name);
        let prev = st.view().deployments.get(&name).map_or(0, |e| e.mod_revision);
        let res = self
            .store
            .txn(Txn {
                compares: vec![Compare::mod_revision(&key, prev)],
                success: vec![TxnOp::put(&key, rec.encode_to_vec())],
                failure: vec![],
            })
            .await?;
        st.count_write();
        if !res.succeeded {
            self.reload(st).await?;
            return Err(HeadError::Conflict(key));
        }
        st.view_mut().deployments.insert(name, Entry { record: rec.clone(), mod_revision: res.revision });
        self.after_change(st);
        self.kick.notify_one();
        Ok(rec)
    }

    /// Deletes a deployment record read at `mod_revision`. A lost compare reloads the view.
    ///
    /// # Errors
    /// `Conflict` when the stored record changed, store failures.
    pub(crate) async fn delete_deployment(
        &self,
        st: &mut State,
        name: &DeploymentName,
        mod_revision: Revision,
    ) -> HeadResult<()> {
        let key = keys::deployment(name);
        let res = self
            .store
            .txn(Txn {
                compares: vec![Compare::mod_revision(&key, mod_revision)],
                success: vec![TxnOp::delete(&key)],
                failure: vec![],
            })
            .await?;
        st.count_write();
        if !res.succeeded {
            self.reload(st).await?;
            return Err(HeadError::Conflict(key));
        }
        st.view_mut().deployments.remove(name);
        Ok(())
    }

    /// Changes a node record with `f` under the lock (leader only), writes it when it
    /// changed, publishes and wakes the reconciler; returns the record and the still-held
    /// lock so a caller can continue under it.
    ///
    /// # Errors
    /// `NotFound`, `NotLeader`, store failures (a conflict reloads the view).
    pub(crate) async fn update_node(
        &self,
        node: &str,
        f: impl FnOnce(&mut NodeRecord),
    ) -> HeadResult<(NodeRecord, StateGuard<'_>)> {
        let mut st = self.state.lock().await;
        self.require_leader(&st)?;
        let id = NodeId::from(node);
        let Some(mut rec) = st.view().nodes.get(&id).map(|e| e.record.clone()) else {
            return Err(HeadError::NotFound(format!("node {node:?}")));
        };
        f(&mut rec);
        if st.view().nodes.get(&id).is_some_and(|e| e.record != rec)
            && let Err(e) = self.put_node(&mut st, rec.clone()).await
        {
            if matches!(e, HeadError::Conflict(_)) {
                self.reload(&mut st).await?;
            }
            return Err(e);
        }
        self.after_change(&st);
        self.kick.notify_one();
        Ok((rec, st))
    }

    /// Publishes the route table and metrics after any change.
    pub(crate) fn after_change(&self, st: &State) {
        self.routes.publish(st);
        self.metrics.observe(st.view(), self.leadership().is_leader());
    }
}

/// The compares and operations that write `rec` over the view's copy of it: compare-and-swap
/// on the record, create-if-absent for each slot it starts holding, delete for each it frees.
fn replica_writes(st: &State, rec: &ReplicaRecord) -> (Vec<Compare>, Vec<TxnOp>) {
    let key = ClusterView::replica_key(rec);
    let prev = st.view().replicas.get(&ReplicaId::from(rec.replica_id.as_str()));
    let prev_rev = prev.map_or(0, |e| e.mod_revision);
    let before: HashSet<String> = prev.map(|e| reservation_keys(&e.record)).unwrap_or_default();
    let after = reservation_keys(rec);
    let mut compares = vec![Compare::mod_revision(&key, prev_rev)];
    let mut ops = vec![TxnOp::put(&key, rec.encode_to_vec())];
    for k in after.difference(&before) {
        compares.push(Compare::absent(k.clone()));
        ops.push(TxnOp::put(k.clone(), rec.replica_id.clone().into_bytes()));
    }
    for k in before.difference(&after) {
        ops.push(TxnOp::delete(k.clone()));
    }
    (compares, ops)
}

fn insert_replica(st: &mut State, rec: ReplicaRecord, mod_revision: Revision) {
    st.view_mut().replicas.insert(ReplicaId::from(rec.replica_id.as_str()), Entry { record: rec, mod_revision });
}

fn op_key(op: &TxnOp) -> &String {
    match op {
        TxnOp::Put { key, .. } | TxnOp::Delete { key } => key,
    }
}

/// Reservation keys a replica record holds (none unless placed and holding slots): every
/// slot of its GPU group, on every node of it.
pub fn reservation_keys(r: &ReplicaRecord) -> HashSet<String> {
    if r.node_id.is_empty() || !holds_slots(r.state()) {
        return HashSet::new();
    }
    view::group_nodes(r)
        .into_iter()
        .flat_map(|(n, slots)| slots.into_iter().map(move |g| keys::reservation(&n, g)))
        .collect()
}

#[cfg(test)]
mod tests {
    use prism_common::proto::v1::ReplicaState;
    use prism_common::state_store::embedded::EmbeddedStore;

    use super::*;
    use crate::config::StoreSpec;

    fn placed(id: &str, gpu: u32) -> ReplicaRecord {
        ReplicaRecord {
            replica_id: id.into(),
            deployment: "d".into(),
            node_id: "n1".into(),
            gpu_indices: vec![gpu],
            state: ReplicaState::Starting as i32,
            ..Default::default()
        }
    }

    /// Records that fit go in one transaction; when it loses a compare (here a GPU reserved
    /// behind the head's back), the records are written one each up to the one that conflicts,
    /// as when every record was its own transaction.
    #[tokio::test]
    async fn a_batch_that_conflicts_writes_the_records_before_the_conflict() {
        let store = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (_tx, rx) = watch::channel(Leadership::Leader);
        let cfg = HeadConfig::new(StoreSpec::Embedded("unused".into()), "http://127.0.0.1:50050");
        let cluster = Cluster::new(cfg, store.clone(), rx, Metrics::new());
        cluster.on_elected(1).await.expect("elected");
        let mut st = cluster.lock().await;
        let mut done = Vec::new();
        let recs = vec![placed("d-1", 0), placed("d-2", 1)];
        cluster.put_replicas(&mut st, recs, |_, i| done.push(i)).await.expect("written");
        assert_eq!((done.as_slice(), st.writes()), ([0, 1].as_slice(), 1), "one transaction");

        store.put(&keys::reservation(&NodeId::from("n1"), 3), b"elsewhere".to_vec(), None).await.expect("put");
        let mut done = Vec::new();
        let recs = vec![placed("d-3", 2), placed("d-4", 3), placed("d-5", 4)];
        let res = cluster.put_replicas(&mut st, recs, |_, i| done.push(i)).await;
        assert!(matches!(res, Err(HeadError::Conflict(_))), "{res:?}");
        assert_eq!(done, [0]);
        let ids: Vec<&str> = st.view().replicas.keys().map(ReplicaId::as_str).collect();
        assert_eq!(ids, ["d-1", "d-2", "d-3"]);
    }
}
