//! Node registry: the `WorkerSession` stream of each worker. The first message must be
//! `register` with a valid inventory (else `INVALID_ARGUMENT`, nothing stored); then the
//! worker's full replica `status` is reconciled against the records (replicas it runs are
//! ADOPTED with their ids, records it lacks are started, replicas nobody owns are stopped),
//! `load` reports feed the route table and `drain` marks a worker-initiated drain.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use prism_common::proto::v1::{
    DrainProgress, HeadMessage, NodeInventory, NodeRecord, NodeState, RegisterAck, ReplicaState, ReplicaStatus,
    StartReplica, StopReplica, WorkerMessage, head_message, worker_message,
};
use prism_common::{NodeId, ReplicaId};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};

use super::{Cluster, State, unix_ms};
use crate::error::{HeadError, HeadResult};

/// Commands queued per worker session before it counts as stuck.
const SESSION_QUEUE: usize = 1024;

/// One live worker session.
pub struct Session {
    /// Distinguishes a reconnected session from the one it replaced.
    pub id: u64,
    /// Commands to the worker.
    pub tx: mpsc::Sender<Result<HeadMessage, Status>>,
    /// Ends the session (replaced, or leadership lost).
    pub cancel: CancellationToken,
    /// Replicas the worker knows about in this session (reported or sent a start).
    pub started: HashSet<ReplicaId>,
    /// The worker has sent its first full status.
    pub synced: bool,
}

/// Checks a worker's inventory.
///
/// # Errors
/// `InvalidArgument` naming the bad field.
pub fn validate_inventory(inv: &NodeInventory) -> HeadResult<()> {
    let bad = |m: String| Err(HeadError::InvalidArgument(format!("malformed inventory: {m}")));
    if inv.node_id.is_empty() || inv.node_id.len() > 253 {
        return bad("node_id must be 1-253 characters".into());
    }
    if !inv.node_id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_')) {
        return bad(format!("node_id {:?} may only hold letters, digits, '-', '.', '_'", inv.node_id));
    }
    if !(inv.address.starts_with("http://") || inv.address.starts_with("https://"))
        || inv.address.parse::<http::Uri>().is_err()
    {
        return bad(format!("address {:?} is not an http(s) URL", inv.address));
    }
    let mut seen = HashSet::new();
    for g in &inv.gpus {
        if !seen.insert(g.index) {
            return bad(format!("GPU index {} listed twice", g.index));
        }
    }
    if inv.gpus.is_empty() && inv.cpu_slots == 0 {
        return bad("no GPUs and no CPU slots".into());
    }
    if inv.labels.keys().any(String::is_empty) {
        return bad("empty label key".into());
    }
    Ok(())
}

impl Cluster {
    /// Opens a worker session: validates the `register` message, records the node, and
    /// returns the command stream. Messages after `register` are handled by a spawned task.
    ///
    /// # Errors
    /// `NotLeader`, `InvalidArgument` (no register first, malformed inventory), store failures.
    pub async fn open_session(
        self: &Arc<Self>,
        mut inbound: Streaming<WorkerMessage>,
    ) -> HeadResult<ReceiverStream<Result<HeadMessage, Status>>> {
        {
            let st = self.state.lock().await;
            self.require_leader(&st)?;
        }
        let first = inbound
            .message()
            .await
            .map_err(|s| HeadError::InvalidArgument(format!("worker stream failed before register: {s}")))?;
        let Some(WorkerMessage { msg: Some(worker_message::Msg::Register(inv)) }) = first else {
            return Err(HeadError::InvalidArgument("the first WorkerSession message must be register".into()));
        };
        validate_inventory(&inv)?;
        let node = NodeId::from(inv.node_id.as_str());
        let (tx, rx) = mpsc::channel(SESSION_QUEUE);
        let cancel = CancellationToken::new();
        let id = self.next_session_id();
        {
            let mut st = self.state.lock().await;
            self.require_leader(&st)?;
            let mut rec = st
                .view
                .nodes
                .get(&node)
                .map(|e| e.record.clone())
                .unwrap_or_else(|| NodeRecord { state: NodeState::Ready as i32, ..Default::default() });
            rec.inventory = Some(inv);
            rec.last_seen_unix_ms = unix_ms();
            // A Draining node that is not cordoned was drained by its own worker (SIGTERM,
            // spot notice): a new session is a new worker process, schedulable again. If it
            // is still draining, its drain progress follows and marks the node again.
            // An operator's drain (cordoned) lasts until `uncordon`.
            if rec.state() != NodeState::Draining || !rec.cordoned {
                rec.state = NodeState::Ready as i32;
                rec.drain_deadline_unix_ms = 0;
                rec.drain_reason.clear();
            }
            self.put_node(&mut st, rec).await?;
            let leader = self.cfg.advertise_address.clone();
            let ack = head_message::Msg::Ack(RegisterAck { node_id: node.to_string(), leader });
            let _ = tx.try_send(Ok(HeadMessage { msg: Some(ack) }));
            let session = Session { id, tx, cancel: cancel.clone(), started: HashSet::new(), synced: false };
            if let Some(old) = st.sessions.insert(node.clone(), session) {
                old.cancel.cancel();
            }
            st.disconnected_since.remove(&node);
            self.after_change(&mut st);
        }
        tracing::info!(node = %node, session = id, "worker registered");
        let this = Arc::clone(self);
        tokio::spawn(async move { this.session_loop(node, id, inbound, cancel).await });
        self.kick.notify_one();
        Ok(ReceiverStream::new(rx))
    }

    async fn session_loop(
        self: Arc<Self>,
        node: NodeId,
        id: u64,
        mut inbound: Streaming<WorkerMessage>,
        cancel: CancellationToken,
    ) {
        // Workers report load about once a second, so once a session has sent a load report,
        // silence for `worker_timeout` means a frozen (SIGSTOP, hung host) or partitioned
        // worker whose TCP connection is still open: the session ends as if the stream had
        // gone at its last message (case C12). Sessions that never report load (test
        // doubles) are only ended by their stream.
        let mut last_message = Instant::now();
        let mut reports_load = false;
        let mut gone_since = None;
        loop {
            let silence = last_message + self.cfg.worker_timeout;
            let m = tokio::select! {
                // A message already queued wins over the silence timer (the head may have
                // been busy handling the previous one).
                biased;
                () = cancel.cancelled() => break,
                m = inbound.message() => m,
                () = tokio::time::sleep_until(silence), if reports_load => {
                    tracing::warn!(node = %node, timeout = ?self.cfg.worker_timeout, "worker session silent; treating it as gone");
                    gone_since = Some(last_message);
                    break;
                }
            };
            last_message = Instant::now();
            if let Ok(Some(WorkerMessage { msg: Some(worker_message::Msg::Load(_)) })) = &m {
                reports_load = true;
            }
            let msg = match m {
                Ok(Some(WorkerMessage { msg: Some(msg) })) => msg,
                Ok(Some(_)) => continue,
                Ok(None) => break,
                Err(e) => {
                    tracing::info!(node = %node, error = %e, "worker stream error");
                    break;
                }
            };
            let res = self.handle_message(&node, id, msg).await;
            if let Err(e) = res {
                tracing::warn!(node = %node, error = %e, "worker message handling failed; reconciling");
                let mut st = self.state.lock().await;
                if let Err(e) = self.reload(&mut st).await {
                    tracing::warn!(error = %e, "reload failed");
                }
            }
            self.kick.notify_one();
        }
        let mut st = self.state.lock().await;
        if st.sessions.get(&node).is_some_and(|s| s.id == id) {
            st.sessions.remove(&node);
            st.disconnected_since.insert(node.clone(), gone_since.unwrap_or_else(Instant::now));
            tracing::warn!(node = %node, session = id, "worker session ended");
            self.after_change(&mut st);
        }
        drop(st);
        self.kick.notify_one();
    }

    async fn handle_message(&self, node: &NodeId, id: u64, msg: worker_message::Msg) -> HeadResult<()> {
        let mut st = self.state.lock().await;
        if st.sessions.get(node).is_none_or(|s| s.id != id) || !st.loaded {
            return Ok(());
        }
        match msg {
            worker_message::Msg::Register(_) => {
                tracing::debug!(node = %node, "ignoring a second register");
            }
            worker_message::Msg::Status(ws) => self.handle_status(&mut st, node, ws.replicas).await?,
            worker_message::Msg::Load(l) => {
                for r in l.reports {
                    let rid = ReplicaId::from(r.replica_id.as_str());
                    if st.view.replicas.get(&rid).is_some_and(|e| e.record.node_id == node.as_str()) {
                        st.loads.insert(rid, r);
                    }
                }
            }
            worker_message::Msg::Drain(d) => self.handle_worker_drain(&mut st, node, d).await?,
        }
        self.after_change(&mut st);
        Ok(())
    }

    /// Reconciles a worker's full replica list with the records of its node.
    async fn handle_status(&self, st: &mut State, node: &NodeId, reports: Vec<ReplicaStatus>) -> HeadResult<()> {
        let reported: HashMap<ReplicaId, ReplicaStatus> =
            reports.into_iter().map(|r| (ReplicaId::from(r.replica_id.as_str()), r)).collect();
        for (rid, rep) in &reported {
            let rs = rep.state();
            let Some(e) = st.view.replicas.get(rid).filter(|e| e.record.node_id == node.as_str()) else {
                if !matches!(rs, ReplicaState::Stopped | ReplicaState::Failed) {
                    tracing::info!(node = %node, replica = %rid, "stopping a replica no record assigns to this node");
                    self.send(
                        st,
                        node,
                        head_message::Msg::Stop(StopReplica { replica_id: rid.to_string(), deadline_ms: 0 }),
                    );
                }
                continue;
            };
            let cur = e.record.state();
            let mut rec = e.record.clone();
            // The engine's effective context length, published with the route (kept when a
            // status comes from a worker that has not loaded the engine yet).
            if rep.max_model_len > 0 {
                rec.max_model_len = rep.max_model_len;
            }
            if let Some(s) = st.sessions.get_mut(node) {
                s.started.insert(rid.clone());
            }
            match (cur, rs) {
                (_, ReplicaState::Stopped) => {
                    self.delete_replica(st, rid).await?;
                    continue;
                }
                (ReplicaState::Draining | ReplicaState::Stopping, ReplicaState::Failed) => {
                    self.delete_replica(st, rid).await?;
                    continue;
                }
                (
                    ReplicaState::Starting | ReplicaState::Ready,
                    ReplicaState::Starting | ReplicaState::Ready | ReplicaState::Failed,
                ) => {
                    rec.state = rs as i32;
                    rec.reason = if rs == ReplicaState::Failed { rep.reason.clone() } else { String::new() };
                    if rs == ReplicaState::Ready && rec.ready_unix_ms == 0 {
                        rec.ready_unix_ms = unix_ms();
                    }
                    if rs == ReplicaState::Failed && cur != ReplicaState::Failed {
                        rec.failed_unix_ms = unix_ms();
                    }
                }
                (ReplicaState::Starting | ReplicaState::Ready, ReplicaState::Draining | ReplicaState::Stopping) => {
                    rec.state = ReplicaState::Draining as i32;
                    rec.reason = rep.reason.clone();
                    let t = self.drain_deadline(Duration::ZERO);
                    st.draining.insert(rid.clone(), t);
                }
                _ => continue,
            }
            if rec != e.record {
                self.put_replica(st, rec).await?;
            }
        }
        let mine: Vec<(ReplicaId, ReplicaState)> = st
            .view
            .replicas_on(node)
            .map(|e| (ReplicaId::from(e.record.replica_id.as_str()), e.record.state()))
            .filter(|(id, _)| !reported.contains_key(id))
            .collect();
        let started = st.sessions.get(node).map(|s| s.started.clone()).unwrap_or_default();
        for (rid, state) in mine {
            match state {
                ReplicaState::Starting if !started.contains(&rid) => self.send_start(st, &rid),
                ReplicaState::Ready => {
                    // The worker lost it (restarted): start it again on the same GPUs.
                    if let Some(mut rec) = st.view.replicas.get(&rid).map(|e| e.record.clone()) {
                        rec.state = ReplicaState::Starting as i32;
                        rec.reason = "worker lost the replica; restarting".into();
                        self.put_replica(st, rec).await?;
                        self.send_start(st, &rid);
                    }
                }
                ReplicaState::Draining | ReplicaState::Stopping => {
                    self.delete_replica(st, &rid).await?;
                }
                _ => {}
            }
        }
        if let Some(s) = st.sessions.get_mut(node) {
            s.synced = true;
        }
        Ok(())
    }

    /// Sends `StartReplica` for a placed replica to its node (when connected).
    pub fn send_start(&self, st: &mut State, rid: &ReplicaId) {
        let Some(rec) = st.view.replicas.get(rid).map(|e| e.record.clone()) else { return };
        let node = NodeId::from(rec.node_id.as_str());
        let Some(mut engine) = st
            .view
            .deployments
            .get(&prism_common::DeploymentName::from(rec.deployment.as_str()))
            .and_then(|d| d.record.spec.as_ref())
            .and_then(|s| s.engine.clone())
        else {
            return;
        };
        engine.served_model_name.clone_from(&rec.served_model_name);
        let start = StartReplica {
            replica_id: rec.replica_id.clone(),
            deployment: rec.deployment.clone(),
            engine: Some(engine),
            gpu_indices: rec.gpu_indices.clone(),
        };
        if self.send(st, &node, head_message::Msg::Start(start))
            && let Some(s) = st.sessions.get_mut(&node)
        {
            s.started.insert(rid.clone());
        }
    }

    /// A worker-initiated drain (SIGTERM, spot notice): mark the node and its replicas
    /// Draining so routers stop using them and replacements start elsewhere.
    async fn handle_worker_drain(&self, st: &mut State, node: &NodeId, d: DrainProgress) -> HeadResult<()> {
        let Some(mut rec) = st.view.nodes.get(node).map(|e| e.record.clone()) else { return Ok(()) };
        if d.done || rec.state() == NodeState::Draining {
            return Ok(());
        }
        // Not cordoned: Draining alone keeps placement away, and the next worker process on
        // this node (same node id, e.g. a StatefulSet pod) becomes schedulable on register.
        rec.state = NodeState::Draining as i32;
        rec.drain_deadline_unix_ms = d.deadline_unix_ms;
        rec.drain_reason.clone_from(&d.reason);
        self.put_node(st, rec).await?;
        let rel = Duration::from_millis(d.deadline_unix_ms.saturating_sub(unix_ms()));
        self.mark_node_replicas_draining(st, node, rel, &d.reason).await
    }

    /// Marks every Starting/Ready replica of `node` Draining with a deadline `rel` from now.
    ///
    /// # Errors
    /// Store failures.
    pub async fn mark_node_replicas_draining(
        &self,
        st: &mut State,
        node: &NodeId,
        rel: Duration,
        reason: &str,
    ) -> HeadResult<()> {
        let ids: Vec<ReplicaRecordRef> = st
            .view
            .replicas_on(node)
            .filter(|e| matches!(e.record.state(), ReplicaState::Starting | ReplicaState::Ready))
            .map(|e| e.record.clone())
            .collect();
        for mut rec in ids {
            rec.state = ReplicaState::Draining as i32;
            rec.reason = if reason.is_empty() { "node draining".into() } else { reason.to_owned() };
            let rid = ReplicaId::from(rec.replica_id.as_str());
            self.put_replica(st, rec).await?;
            let t = self.drain_deadline(rel);
            st.draining.insert(rid, t);
        }
        Ok(())
    }
}

type ReplicaRecordRef = prism_common::proto::v1::ReplicaRecord;

#[cfg(test)]
mod tests {
    use super::*;
    use prism_common::proto::v1::GpuInfo;

    fn inv() -> NodeInventory {
        NodeInventory {
            node_id: "n1".into(),
            address: "http://127.0.0.1:50061".into(),
            gpus: vec![GpuInfo { index: 0, ..Default::default() }, GpuInfo { index: 1, ..Default::default() }],
            ..Default::default()
        }
    }

    #[test]
    fn inventory_validation() {
        assert!(validate_inventory(&inv()).is_ok());
        let mut i = inv();
        i.node_id.clear();
        assert!(validate_inventory(&i).is_err());
        let mut i = inv();
        i.node_id = "a/b".into();
        assert!(validate_inventory(&i).is_err());
        let mut i = inv();
        i.address = "not a url".into();
        assert!(validate_inventory(&i).is_err());
        let mut i = inv();
        i.gpus[1].index = 0;
        assert!(validate_inventory(&i).is_err());
        let mut i = inv();
        i.gpus.clear();
        assert!(validate_inventory(&i).is_err());
        i.cpu_slots = 2;
        assert!(validate_inventory(&i).is_ok());
    }
}
