//! Node registry: the `WorkerSession` stream of each worker. The first message must be
//! `register` with a valid inventory (else `INVALID_ARGUMENT`, nothing stored); then the
//! worker's full replica `status` is reconciled against the records (replicas it runs are
//! ADOPTED with their ids, records it lacks are started, replicas nobody owns are stopped),
//! `load` reports feed the route table and `drain` starts a worker-initiated drain (`drain.rs`).
//!
//! A node has one live session. A `register` from the same worker process (the same
//! `instance_id`: it reconnected) takes it over; one from another process is refused with
//! `ALREADY_EXISTS` while the live session lasts, so two workers given one `--node-id`
//! never take the node from each other. A restarted worker gets in once the old session has
//! ended: at once when its connection closed, else after `--worker-timeout` of silence.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use prism_common::proto::v1::{
    HeadMessage, NodeInventory, NodeRecord, NodeState, RegisterAck, ReplicaState, ReplicaStatus, StopReplica,
    WorkerMessage, head_message, worker_message,
};
use prism_common::time::unix_ms;
use prism_common::{DeploymentName, NodeId, ReplicaId};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};

use super::Cluster;
use super::departure;
use super::group;
use super::state::{Session, SessionOwner, State};
use super::view::member_part;
use crate::drain;
use crate::error::{HeadError, HeadResult};
use crate::events::EventKind;

/// Commands queued per worker session before it counts as stuck.
const SESSION_QUEUE: usize = 1024;

/// A worker session the head has accepted.
#[derive(Debug)]
pub struct Registration {
    /// The worker's node.
    pub node: NodeId,
    /// The session's id.
    pub session: u64,
    /// Commands to the worker (the first is the `RegisterAck`).
    pub commands: mpsc::Receiver<Result<HeadMessage, Status>>,
    /// Fires when the session ends (replaced by a newer one, or leadership lost).
    pub cancel: CancellationToken,
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

/// Opens a worker session: validates the `register` message, records the node, and
/// returns the command stream. Messages after `register` are handled by a spawned task.
///
/// # Errors
/// `NotLeader`, `InvalidArgument` (no register first, malformed inventory), store failures.
pub async fn open_session(
    cluster: &Arc<Cluster>,
    mut inbound: Streaming<WorkerMessage>,
    peer: Option<SocketAddr>,
) -> HeadResult<ReceiverStream<Result<HeadMessage, Status>>> {
    {
        let st = cluster.lock().await;
        cluster.require_leader(&st)?;
    }
    let first = inbound
        .message()
        .await
        .map_err(|s| HeadError::InvalidArgument(format!("worker stream failed before register: {s}")))?;
    let Some(WorkerMessage { msg: Some(worker_message::Msg::Register(inv)) }) = first else {
        return Err(HeadError::InvalidArgument("the first WorkerSession message must be register".into()));
    };
    let Registration { node, session, commands, cancel } = register(cluster, inv, peer).await?;
    let this = Arc::clone(cluster);
    tokio::spawn(async move { session_loop(this, node, session, inbound, cancel).await });
    cluster.kick();
    Ok(ReceiverStream::new(commands))
}

/// Accepts a worker's `register` (its connection from `peer`, when known): validates the
/// inventory, writes the node record (Ready, unless an operator's drain holds it), queues
/// the `RegisterAck` and makes this the node's live session, ending an earlier one of the
/// same worker process.
///
/// # Errors
/// `InvalidArgument` (malformed inventory), `NodeIdInUse` (the node's live session belongs
/// to another worker process), `NotLeader`, store failures.
pub async fn register(cluster: &Cluster, inv: NodeInventory, peer: Option<SocketAddr>) -> HeadResult<Registration> {
    validate_inventory(&inv)?;
    let node = NodeId::from(inv.node_id.as_str());
    let owner = SessionOwner { instance_id: inv.instance_id.clone(), address: inv.address.clone(), peer };
    let (tx, rx) = mpsc::channel(SESSION_QUEUE);
    let cancel = CancellationToken::new();
    let id = cluster.next_session_id();
    {
        let mut st = cluster.lock().await;
        cluster.require_leader(&st)?;
        if let Some((live, last_message)) = st.live_session(&node)
            && !live.instance_id.is_empty()
            && live.instance_id != owner.instance_id
        {
            return Err(node_id_in_use(&node, live, &owner, last_message, cluster.cfg().worker_timeout));
        }
        let mut rec = st
            .view()
            .nodes
            .get(&node)
            .map(|e| e.record.clone())
            .unwrap_or_else(|| NodeRecord { state: NodeState::Ready as i32, ..Default::default() });
        rec.inventory = Some(inv);
        rec.last_seen_unix_ms = unix_ms();
        drain::ready_on_register(&mut rec);
        // A worker is back with this node id: should it die, it is not one that left.
        rec.left = false;
        cluster.put_node(&mut st, rec).await?;
        let leader = cluster.cfg().advertise_address.clone();
        let ack = head_message::Msg::Ack(RegisterAck { node_id: node.to_string(), leader });
        let _ = tx.try_send(Ok(HeadMessage { msg: Some(ack) }));
        st.attach_session(node.clone(), Session::new(id, owner, tx, cancel.clone()));
        cluster.after_change(&st);
    }
    tracing::info!(node = %node, session = id, "worker registered");
    Ok(Registration { node, session: id, commands: rx, cancel })
}

/// The refusal of a registration by `new` for a node whose live session (last message at
/// `last_message`) belongs to another worker process `live`, logged as a warning.
fn node_id_in_use(
    node: &NodeId,
    live: &SessionOwner,
    new: &SessionOwner,
    last_message: Instant,
    worker_timeout: Duration,
) -> HeadError {
    let peer = |p: Option<SocketAddr>| p.map_or_else(|| "an unknown address".to_owned(), |p| p.to_string());
    let expires_in = (last_message + worker_timeout).saturating_duration_since(Instant::now());
    tracing::warn!(
        node = %node, live_address = %live.address, live_peer = %peer(live.peer), new_address = %new.address,
        new_peer = %peer(new.peer),
        "refused a worker registration: the node id has a live session from another worker process"
    );
    let message = format!(
        "node id {:?} is in use by another live worker process (advertising {}, connected from {}); \
         each worker needs a unique --node-id. If that worker is gone, the head ends its session after \
         {:.1} s without a message from it (--worker-timeout), in about {:.1} s, and a worker with this \
         node id can register then",
        node.as_str(),
        live.address,
        peer(live.peer),
        worker_timeout.as_secs_f64(),
        expires_in.as_secs_f64(),
    );
    HeadError::NodeIdInUse { message, expires_in }
}

async fn session_loop(
    cluster: Arc<Cluster>,
    node: NodeId,
    id: u64,
    mut inbound: Streaming<WorkerMessage>,
    cancel: CancellationToken,
) {
    let timeout = cluster.cfg().worker_timeout;
    // Workers report load about once a second, so once a session has sent a load report,
    // silence for `worker_timeout` means a frozen (SIGSTOP, hung host) or partitioned
    // worker whose TCP connection is still open: the session ends as if the stream had
    // gone at its last message. Sessions that never report load (test doubles) are only
    // ended by their stream.
    let mut last_message = Instant::now();
    let mut reports_load = false;
    let mut gone_since = None;
    // The worker ended its stream itself (a clean end, not an error or silence): with its
    // drain done, it is leaving on purpose.
    let mut closed_by_worker = false;
    loop {
        let silence = last_message + timeout;
        let m = tokio::select! {
            // A message already queued wins over the silence timer (the head may have
            // been busy handling the previous one).
            biased;
            () = cancel.cancelled() => break,
            m = inbound.message() => m,
            () = tokio::time::sleep_until(silence), if reports_load => {
                // Only time this head was running counts: after a stall of its own the
                // worker's messages may still sit unread, so the silence starts over.
                let watched = cluster.stall_watch().watched_from(last_message);
                if watched > last_message {
                    last_message = watched;
                    continue;
                }
                tracing::warn!(node = %node, ?timeout, "worker session silent; treating it as gone");
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
            Ok(None) => {
                closed_by_worker = true;
                break;
            }
            Err(e) => {
                tracing::info!(node = %node, error = %e, "worker stream error");
                break;
            }
        };
        let res = handle_message(&cluster, &node, id, msg).await;
        if let Err(e) = res {
            tracing::warn!(node = %node, error = %e, "worker message handling failed; reconciling");
            let mut st = cluster.lock().await;
            if let Err(e) = cluster.reload(&mut st).await {
                tracing::warn!(error = %e, "reload failed");
            }
        }
        cluster.kick();
    }
    let mut st = cluster.lock().await;
    let left = closed_by_worker && st.drain_done(&node, id);
    if st.detach_session(&node, id, gone_since.unwrap_or_else(Instant::now)) {
        if left && cluster.require_leader(&st).is_ok() {
            tracing::info!(node = %node, session = id, "worker session closed after its drain");
            if let Err(e) = departure::on_worker_left(&cluster, &mut st, &node).await {
                // The node goes the way of any lost worker: Dead after `worker_timeout`.
                tracing::warn!(node = %node, error = %e, "forgetting a departed node failed");
                if let Err(e) = cluster.reload(&mut st).await {
                    tracing::warn!(error = %e, "reload failed");
                }
            }
        } else {
            tracing::warn!(node = %node, session = id, "worker session ended");
        }
        cluster.after_change(&st);
    }
    drop(st);
    cluster.kick();
}

async fn handle_message(cluster: &Cluster, node: &NodeId, id: u64, msg: worker_message::Msg) -> HeadResult<()> {
    let mut st = cluster.lock().await;
    st.touch_session(node, id, Instant::now());
    if !st.is_current_session(node, id) || !st.is_loaded() {
        return Ok(());
    }
    match msg {
        worker_message::Msg::Register(_) => {
            tracing::debug!(node = %node, "ignoring a second register");
        }
        worker_message::Msg::Status(ws) => handle_status(cluster, &mut st, node, ws.replicas).await?,
        worker_message::Msg::Load(l) => {
            for r in l.reports {
                st.record_load(node, r);
            }
        }
        worker_message::Msg::Drain(d) => {
            st.note_drain_progress(node, id, d.done);
            drain::on_worker_drain(cluster, &mut st, node, d).await?;
        }
    }
    cluster.after_change(&st);
    Ok(())
}

/// Reconciles a worker's full replica list with the records of its node (the replicas
/// whose driver runs there, and the member ranks it hosts for groups driven elsewhere).
pub(crate) async fn handle_status(
    cluster: &Cluster,
    st: &mut State,
    node: &NodeId,
    reports: Vec<ReplicaStatus>,
) -> HeadResult<()> {
    let reported: HashMap<ReplicaId, ReplicaStatus> =
        reports.into_iter().map(|r| (ReplicaId::from(r.replica_id.as_str()), r)).collect();
    for (rid, rep) in &reported {
        let rs = rep.state();
        // Ranks of a group whose driver runs elsewhere: their report only fails the group.
        if st.view().replicas.get(rid).is_some_and(|e| member_part(&e.record, node).is_some()) {
            group::on_member_status(cluster, st, node, rep).await?;
            continue;
        }
        let Some(e) = st.view().replicas.get(rid).filter(|e| e.record.node_id == node.as_str()) else {
            if !matches!(rs, ReplicaState::Stopped | ReplicaState::Failed) {
                tracing::info!(node = %node, replica = %rid, "stopping a replica no record assigns to this node");
                st.send(node, head_message::Msg::Stop(StopReplica { replica_id: rid.to_string(), deadline_ms: 0 }));
            }
            continue;
        };
        if rep.group_member {
            // A member report from the driver's own node (never sent by a consistent
            // worker): it says nothing about the driver.
            continue;
        }
        let cur = e.record.state();
        let before = e.record.clone();
        let mut rec = before.clone();
        // The engine's effective context length, published with the route (kept when a
        // status comes from a worker that has not loaded the engine yet).
        if rep.max_model_len > 0 {
            rec.max_model_len = rep.max_model_len;
        }
        st.mark_started(node, rid);
        let spans = group::spans_nodes(&rec);
        match (cur, rs) {
            (ReplicaState::Failed, ReplicaState::Stopped) if spans => {
                // Stopped because the group failed: the Failed record stays until the
                // planner replaces it (after the restart delay; a group that failed while
                // starting backs off exponentially, so it is not retried in a hot loop).
                continue;
            }
            (_, ReplicaState::Stopped) => {
                cluster.delete_replica(st, rid).await?;
                cluster.events().push(
                    EventKind::ReplicaStopped,
                    &before.deployment,
                    rid.as_str(),
                    format!("on {node}"),
                );
                continue;
            }
            (ReplicaState::Draining | ReplicaState::Stopping, ReplicaState::Failed) => {
                cluster.delete_replica(st, rid).await?;
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
                    st.note_ready(&DeploymentName::from(rec.deployment.as_str()));
                    cluster.events().push(EventKind::ReplicaReady, &rec.deployment, rid.as_str(), format!("on {node}"));
                }
                if rs == ReplicaState::Failed && cur != ReplicaState::Failed {
                    rec.failed_unix_ms = unix_ms();
                    cluster.events().push(EventKind::ReplicaFailed, &rec.deployment, rid.as_str(), rep.reason.clone());
                    if spans {
                        // The driver failed: free the member nodes' ranks too.
                        group::stop_group(st, &rec, 0);
                    }
                }
                if !rep.rendezvous.is_empty() && rec.rendezvous != rep.rendezvous && rs != ReplicaState::Failed {
                    // The driver bound its rendezvous: the member nodes' ranks may join.
                    rec.rendezvous.clone_from(&rep.rendezvous);
                    if rec != before {
                        cluster.put_replica(st, rec).await?;
                    }
                    group::send_member_starts(st, rid);
                    continue;
                }
            }
            (ReplicaState::Starting | ReplicaState::Ready, ReplicaState::Draining | ReplicaState::Stopping) => {
                // The worker drains it (its own drain): routers see Draining at once.
                rec.state = ReplicaState::Draining as i32;
                rec.reason = rep.reason.clone();
                drain::start_timer(cluster, st, &mut rec, Duration::ZERO);
            }
            _ => continue,
        }
        if rec != before {
            cluster.put_replica(st, rec).await?;
        }
    }
    let mine: Vec<(ReplicaId, ReplicaState)> = st
        .view()
        .replicas_on(node)
        .map(|e| (ReplicaId::from(e.record.replica_id.as_str()), e.record.state()))
        .filter(|(id, _)| !reported.contains_key(id))
        .collect();
    let started = st.started_on(node);
    for (rid, state) in mine {
        match state {
            ReplicaState::Starting if !started.contains(&rid) => {
                let rec = st.view().replicas.get(&rid).map(|e| e.record.clone());
                match rec {
                    // Its member ranks were started at a rendezvous this worker no longer
                    // has: they cannot join a new one, so the group fails.
                    Some(rec) if group::spans_nodes(&rec) && !rec.rendezvous.is_empty() => {
                        let reason = format!("rank 0 on node {node} lost (its worker restarted)");
                        group::fail_group(cluster, st, rec, reason).await?;
                    }
                    _ => send_start(st, &rid),
                }
            }
            ReplicaState::Ready => {
                let Some(mut rec) = st.view().replicas.get(&rid).map(|e| e.record.clone()) else { continue };
                if group::spans_nodes(&rec) {
                    // The driver's worker lost rank 0: the other ranks cannot rejoin a new
                    // driver, so the group fails and is stopped everywhere.
                    let reason = format!("rank 0 on node {node} lost (its worker restarted)");
                    group::fail_group(cluster, st, rec, reason).await?;
                    continue;
                }
                // The worker lost it (restarted): start it again on the same GPUs.
                {
                    rec.state = ReplicaState::Starting as i32;
                    rec.reason = "worker lost the replica; restarting".into();
                    cluster.put_replica(st, rec).await?;
                    send_start(st, &rid);
                }
            }
            ReplicaState::Draining | ReplicaState::Stopping => {
                cluster.delete_replica(st, &rid).await?;
            }
            _ => {}
        }
    }
    group::reconcile_members(cluster, st, node, &reported).await
}

/// Sends `StartReplica` for a placed replica to its driver's node (when connected); a
/// group spanning nodes starts its other nodes once the driver reports its rendezvous.
pub fn send_start(st: &mut State, rid: &ReplicaId) {
    let Some(rec) = st.view().replicas.get(rid).map(|e| e.record.clone()) else { return };
    let node = NodeId::from(rec.node_id.as_str());
    let Some(start) = group::start_message(st, &rec, &node) else { return };
    if st.send(&node, head_message::Msg::Start(start)) {
        st.mark_started(&node, rid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HeadConfig, StoreSpec};
    use crate::election::Leadership;
    use crate::metrics::Metrics;
    use prism_common::proto::v1::GpuInfo;
    use prism_common::state_store::{EmbeddedStore, StateStore};
    use tokio::sync::watch;

    fn cpu_worker(instance: &str) -> NodeInventory {
        NodeInventory {
            node_id: "n1".into(),
            address: "http://127.0.0.1:1".into(),
            cpu_slots: 1,
            instance_id: instance.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn another_process_is_refused_while_the_live_session_lasts_and_the_same_one_takes_over() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (_lead_tx, lead_rx) = watch::channel(Leadership::Leader);
        let cfg = HeadConfig::new(StoreSpec::Embedded("unused".into()), "http://127.0.0.1:50050");
        let cluster = Cluster::new(cfg, store, lead_rx, Metrics::new());
        cluster.on_elected(1).await.expect("elected");
        let peer: SocketAddr = "127.0.0.1:40000".parse().expect("addr");
        let first = register(&cluster, cpu_worker("a"), Some(peer)).await.expect("a registered");

        let refused = register(&cluster, cpu_worker("b"), None).await.expect_err("b refused");
        assert!(matches!(refused, HeadError::NodeIdInUse { .. }), "{refused:?}");
        let status = Status::from(refused);
        assert_eq!(status.code(), tonic::Code::AlreadyExists);
        assert!(status.metadata().get(prism_common::proto::SESSION_EXPIRES_METADATA).is_some());
        assert!(!first.cancel.is_cancelled(), "the live session is kept");
        // A worker that sends no instance id cannot be told apart from the live one's process.
        let refused = register(&cluster, cpu_worker(""), None).await.expect_err("no instance id refused");
        assert!(matches!(refused, HeadError::NodeIdInUse { .. }));

        // The same process reconnecting takes its session over.
        let again = register(&cluster, cpu_worker("a"), None).await.expect("a again");
        assert!(first.cancel.is_cancelled(), "the earlier session of the same worker ended");
        // Once the live session ends, another process gets in.
        assert!(cluster.lock().await.detach_session(&again.node, again.session, Instant::now()));
        register(&cluster, cpu_worker("b"), None).await.expect("b after the session ended");
    }

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
