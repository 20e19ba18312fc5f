//! The head's shared cluster state: one [`Cluster`] owns the store handle, the leader's
//! mirror of stored records ([`view::ClusterView`]), the live worker sessions
//! ([`registry`]), load reports, drain timers and the route publisher. State sits behind
//! one async mutex: control-plane operations are few and each is a short series of store
//! transactions, so serialising them keeps every write a compare-and-swap on a view that
//! nothing else is changing.

pub mod registry;
pub mod view;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prism_common::proto::v1::{HeadMessage, LoadReport, NodeRecord, ReplicaRecord, RouteTable, head_message};
use prism_common::state_store::{Compare, StateStore, Txn, TxnOp, keys};
use prism_common::{NodeId, ReplicaId};
use prost::Message;
use tokio::sync::{Mutex, Notify, watch};
use tokio::time::Instant;

use crate::config::HeadConfig;
use crate::error::{HeadError, HeadResult};
use crate::metrics::Metrics;
use crate::placement::planner::holds_slots;
use registry::Session;

/// Extra time a new leader gives the known workers to reconnect before `worker_timeout`
/// starts: workers back off up to 5 s between attempts while no head answers, so without
/// it a head restarted after a short outage declared live workers Dead (and evicted their
/// replicas, streams included) moments before they reconnected.
pub const LEADER_ADOPTION_GRACE: Duration = Duration::from_secs(5);
use view::{ClusterView, Entry};

/// Who leads, as seen by this head.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leadership {
    /// This head is the leader.
    pub is_leader: bool,
    /// The leader's advertised address, when known.
    pub leader: Option<String>,
}

/// A replica being drained: routers stop sending work at once; it is stopped when idle or
/// at `deadline`.
#[derive(Clone, Copy, Debug)]
pub struct DrainTimer {
    /// When it became Draining.
    pub since: Instant,
    /// When it is stopped regardless of in-flight work.
    pub deadline: Instant,
}

/// Mutable state guarded by [`Cluster::state`].
#[derive(Default)]
pub struct State {
    /// Mirror of stored records (valid while `loaded`).
    pub view: ClusterView,
    /// The view was loaded for the current leadership term.
    pub loaded: bool,
    /// Live worker sessions by node.
    pub sessions: HashMap<NodeId, Session>,
    /// When each session-less node lost (or never had, this term) its session.
    pub disconnected_since: HashMap<NodeId, Instant>,
    /// Latest load report per replica (not persisted).
    pub loads: HashMap<ReplicaId, LoadReport>,
    /// Drain timers of Draining replicas.
    pub draining: HashMap<ReplicaId, DrainTimer>,
    /// Number of store transactions this head has committed (benchmarks).
    pub writes: u64,
}

/// A held lock on [`State`].
pub type StateGuard<'a> = tokio::sync::MutexGuard<'a, State>;

/// The head's shared state and store handle. Cheap to share through `Arc`.
pub struct Cluster {
    /// Validated configuration.
    pub cfg: HeadConfig,
    /// The state store.
    pub store: Arc<dyn StateStore>,
    /// Everything mutable.
    pub state: Mutex<State>,
    /// Current route table (routers subscribe).
    pub routes: watch::Sender<Arc<RouteTable>>,
    /// Wakes the reconciler.
    pub kick: Notify,
    /// Leadership as reported by the election.
    pub leadership: watch::Receiver<Leadership>,
    /// Prometheus metrics.
    pub metrics: Metrics,
    session_seq: AtomicU64,
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

impl Cluster {
    /// A cluster handle; nothing is loaded until leadership is gained.
    pub fn new(
        cfg: HeadConfig,
        store: Arc<dyn StateStore>,
        leadership: watch::Receiver<Leadership>,
        metrics: Metrics,
    ) -> Arc<Self> {
        let (routes, _) = watch::channel(Arc::new(RouteTable::default()));
        Arc::new(Self {
            cfg,
            store,
            state: Mutex::new(State::default()),
            routes,
            kick: Notify::new(),
            leadership,
            metrics,
            session_seq: AtomicU64::new(1),
        })
    }

    /// A fresh session id.
    pub fn next_session_id(&self) -> u64 {
        self.session_seq.fetch_add(1, Ordering::Relaxed)
    }

    /// Current leadership.
    pub fn leadership(&self) -> Leadership {
        self.leadership.borrow().clone()
    }

    /// Fails with [`HeadError::NotLeader`] unless this head leads and has loaded its view.
    ///
    /// # Errors
    /// `NotLeader` (followers), `Store(Unavailable)` while the new leader is loading.
    pub fn require_leader(&self, st: &State) -> HeadResult<()> {
        let l = self.leadership();
        if !l.is_leader {
            return Err(HeadError::NotLeader { leader: l.leader });
        }
        if !st.loaded {
            return Err(HeadError::Store(prism_common::state_store::StoreError::Unavailable(
                "leader is loading cluster state".into(),
            )));
        }
        Ok(())
    }

    /// Called when leadership is gained: reloads the view, drops reservations no replica
    /// holds, and gives every node [`LEADER_ADOPTION_GRACE`] + `worker_timeout` from now to
    /// (re)connect.
    ///
    /// # Errors
    /// Store failures (the caller retries).
    pub async fn on_elected(&self) -> HeadResult<()> {
        let mut st = self.state.lock().await;
        st.view = ClusterView::load(self.store.as_ref()).await?;
        self.gc_reservations(&st).await?;
        let now = Instant::now() + LEADER_ADOPTION_GRACE;
        let nodes: Vec<NodeId> = st.view.nodes.keys().cloned().collect();
        st.disconnected_since = nodes.into_iter().map(|n| (n, now)).collect();
        st.sessions.clear();
        st.loads.clear();
        st.draining.clear();
        st.loaded = true;
        tracing::info!(
            nodes = st.view.nodes.len(),
            deployments = st.view.deployments.len(),
            replicas = st.view.replicas.len(),
            "leader: cluster state loaded"
        );
        self.after_change(&mut st);
        drop(st);
        self.kick.notify_one();
        Ok(())
    }

    /// Called when leadership is lost: closes worker sessions (workers follow the new leader).
    pub async fn on_deposed(&self) {
        let mut st = self.state.lock().await;
        for (_, s) in st.sessions.drain() {
            s.cancel.cancel();
        }
        st.loaded = false;
        self.routes.send_replace(Arc::new(RouteTable::default()));
        self.metrics.set_leader(false);
    }

    async fn gc_reservations(&self, st: &State) -> HeadResult<()> {
        let held: HashSet<String> = st
            .view
            .replicas
            .values()
            .filter(|e| holds_slots(e.record.state()) && !e.record.node_id.is_empty())
            .flat_map(|e| {
                let n = NodeId::from(e.record.node_id.as_str());
                e.record.gpu_indices.iter().map(move |g| keys::reservation(&n, *g)).collect::<Vec<_>>()
            })
            .collect();
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
    pub async fn reload(&self, st: &mut State) -> HeadResult<()> {
        st.view = ClusterView::load(self.store.as_ref()).await?;
        Ok(())
    }

    async fn commit(&self, st: &mut State, txn: Txn, what: &str) -> HeadResult<i64> {
        let res = self.store.txn(txn).await?;
        st.writes += 1;
        if !res.succeeded {
            return Err(HeadError::Conflict(what.to_owned()));
        }
        Ok(res.revision)
    }

    /// Writes a node record (compare-and-swap on the mirrored revision).
    ///
    /// # Errors
    /// `Conflict` when the stored record changed, store failures.
    pub async fn put_node(&self, st: &mut State, rec: NodeRecord) -> HeadResult<()> {
        let id = view::node_id(&rec);
        let key = keys::node(&id);
        let prev = st.view.nodes.get(&id).map_or(0, |e| e.mod_revision);
        let txn = Txn {
            compares: vec![Compare::mod_revision(&key, prev)],
            success: vec![TxnOp::put(&key, rec.encode_to_vec())],
            failure: vec![],
        };
        let rev = self.commit(st, txn, &key).await?;
        st.view.nodes.insert(id, Entry { record: rec, mod_revision: rev });
        Ok(())
    }

    /// Writes a replica record. Reservation keys follow the record: created (if absent —
    /// the guard against double-booking a GPU) when it starts holding slots, deleted when
    /// it stops holding them.
    ///
    /// # Errors
    /// `Conflict` when the record changed or a GPU is already reserved; store failures.
    pub async fn put_replica(&self, st: &mut State, rec: ReplicaRecord) -> HeadResult<()> {
        let id = ReplicaId::from(rec.replica_id.as_str());
        let key = ClusterView::replica_key(&rec);
        let prev = st.view.replicas.get(&id);
        let prev_rev = prev.map_or(0, |e| e.mod_revision);
        let before: HashSet<String> = prev.map(|e| reservation_keys(&e.record)).unwrap_or_default();
        let after = reservation_keys(&rec);
        let mut txn = Txn {
            compares: vec![Compare::mod_revision(&key, prev_rev)],
            success: vec![TxnOp::put(&key, rec.encode_to_vec())],
            failure: vec![],
        };
        for k in after.difference(&before) {
            txn.compares.push(Compare::absent(k.clone()));
            txn.success.push(TxnOp::put(k.clone(), rec.replica_id.clone().into_bytes()));
        }
        for k in before.difference(&after) {
            txn.success.push(TxnOp::delete(k.clone()));
        }
        let rev = self.commit(st, txn, &key).await?;
        st.view.replicas.insert(id, Entry { record: rec, mod_revision: rev });
        Ok(())
    }

    /// Deletes a replica record and its reservations.
    ///
    /// # Errors
    /// `Conflict` when the record changed; store failures.
    pub async fn delete_replica(&self, st: &mut State, id: &ReplicaId) -> HeadResult<()> {
        let Some(e) = st.view.replicas.get(id) else { return Ok(()) };
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
        st.view.replicas.remove(id);
        st.loads.remove(id);
        st.draining.remove(id);
        Ok(())
    }

    /// Queues a command on a node's session; false when the node has none.
    pub fn send(&self, st: &State, node: &NodeId, msg: head_message::Msg) -> bool {
        let Some(s) = st.sessions.get(node) else { return false };
        match s.tx.try_send(Ok(HeadMessage { msg: Some(msg) })) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(node = %node, error = %e, "worker session queue full or closed");
                false
            }
        }
    }

    /// Publishes the route table and metrics after any change.
    pub fn after_change(&self, st: &mut State) {
        crate::routes::publish(self, st);
        self.metrics.observe(st, self.leadership().is_leader);
    }

    /// The default drain deadline from now.
    pub fn drain_deadline(&self, relative: Duration) -> DrainTimer {
        let now = Instant::now();
        let d = if relative.is_zero() { self.cfg.drain_timeout } else { relative };
        DrainTimer { since: now, deadline: now + d }
    }
}

/// Reservation keys a replica record holds (none unless placed and holding slots).
pub fn reservation_keys(r: &ReplicaRecord) -> HashSet<String> {
    if r.node_id.is_empty() || !holds_slots(r.state()) {
        return HashSet::new();
    }
    let n = NodeId::from(r.node_id.as_str());
    r.gpu_indices.iter().map(|g| keys::reservation(&n, *g)).collect()
}
