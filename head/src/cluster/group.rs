//! GPU groups that span nodes: the two-phase start and the group's failure handling.
//!
//! A replica whose ranks do not fit one node has a [`RankGroup`] per node in its record
//! (`rank_groups`, rank order; the first is the driver's node, which holds rank 0 and
//! serves the replica). Start: `StartReplica` goes to the driver's node first (the group,
//! an empty rendezvous, the placement's `group_token`); its worker binds a rendezvous and
//! reports it in `ReplicaStatus.rendezvous`; the head stores it in the record and sends
//! `StartReplica` with that rendezvous and the token to every other node of the group (each
//! with its own `gpu_indices`), whose ranks join the driver there. Member nodes report the
//! replica with `group_member: true`; those reports only ever fail the group, never stand
//! for the driver's state. Any rank that goes (a member reports FAILED or loses the
//! replica, the driver fails, a member node dies) fails the whole group: the replica turns
//! Failed and every node of the group is told to stop it, freeing all its slots; it is
//! replaced as any Failed replica is.

use prism_common::proto::v1::{
    RankGroup, ReplicaRecord, ReplicaState, ReplicaStatus, StartReplica, StopReplica, head_message,
};
use prism_common::time::unix_ms;
use prism_common::{DeploymentName, NodeId, ReplicaId};

use super::Cluster;
use super::state::State;
use super::view::{group_nodes, member_part, member_parts};
use crate::error::HeadResult;
use crate::events::EventKind;

/// A rank group's ranks as `first-last` (`first` for one rank).
pub fn rank_range(g: &RankGroup) -> String {
    let n = g.gpu_indices.len() as u32;
    if n <= 1 { g.first_rank.to_string() } else { format!("{}-{}", g.first_rank, g.first_rank + n - 1) }
}

/// True when the replica's GPU group spans more than one node.
pub fn spans_nodes(r: &ReplicaRecord) -> bool {
    member_parts(r).next().is_some()
}

/// Sends `StopReplica` to every connected node of a replica's GPU group.
pub fn stop_group(st: &State, rec: &ReplicaRecord, deadline_ms: u64) {
    for (node, _) in group_nodes(rec) {
        st.send(&node, head_message::Msg::Stop(StopReplica { replica_id: rec.replica_id.clone(), deadline_ms }));
    }
}

/// The `StartReplica` for `node`'s part of a placed replica: the driver's (empty
/// rendezvous) or a member's (the driver's rendezvous; None until the driver reported one).
/// The group and token are set only when the group spans nodes.
pub fn start_message(st: &State, rec: &ReplicaRecord, node: &NodeId) -> Option<StartReplica> {
    let mut engine = st
        .view()
        .deployments
        .get(&DeploymentName::from(rec.deployment.as_str()))
        .and_then(|d| d.record.spec.as_ref())
        .and_then(|s| s.engine.clone())?;
    engine.served_model_name.clone_from(&rec.served_model_name);
    let mut start = StartReplica {
        replica_id: rec.replica_id.clone(),
        deployment: rec.deployment.clone(),
        engine: Some(engine),
        gpu_indices: rec.gpu_indices.clone(),
        ..StartReplica::default()
    };
    if spans_nodes(rec) {
        start.rank_groups.clone_from(&rec.rank_groups);
        start.group_token.clone_from(&rec.group_token);
        if node.as_str() != rec.node_id {
            let part = member_part(rec, node)?;
            if rec.rendezvous.is_empty() {
                return None;
            }
            start.gpu_indices.clone_from(&part.gpu_indices);
            start.rendezvous.clone_from(&rec.rendezvous);
        }
    }
    Some(start)
}

/// Sends the member nodes' `StartReplica` (once the driver's rendezvous is known) to every
/// member node that has not been sent it in its current session.
pub fn send_member_starts(st: &mut State, rid: &ReplicaId) {
    let Some(rec) = st.view().replicas.get(rid).map(|e| e.record.clone()) else { return };
    for g in member_parts(&rec) {
        let node = NodeId::from(g.node_id.as_str());
        if st.started_on(&node).contains(rid) {
            continue;
        }
        if let Some(start) = start_message(st, &rec, &node)
            && st.send(&node, head_message::Msg::Start(start))
        {
            st.mark_started(&node, rid);
        }
    }
}

/// Fails a Starting/Ready group replica (`reason` says which rank went) and stops it on
/// every node of its group.
///
/// # Errors
/// Store failures.
pub async fn fail_group(cluster: &Cluster, st: &mut State, mut rec: ReplicaRecord, reason: String) -> HeadResult<()> {
    if !matches!(rec.state(), ReplicaState::Starting | ReplicaState::Ready) {
        return Ok(());
    }
    tracing::warn!(replica = %rec.replica_id, %reason, "GPU group failed; stopping it on every node");
    rec.state = ReplicaState::Failed as i32;
    rec.failed_unix_ms = unix_ms();
    rec.reason.clone_from(&reason);
    cluster.events().push(EventKind::ReplicaFailed, &rec.deployment, &rec.replica_id, reason);
    stop_group(st, &rec, 0);
    cluster.put_replica(st, rec).await
}

/// Handles a member node's report of a replica whose driver runs on another node.
///
/// # Errors
/// Store failures.
pub async fn on_member_status(cluster: &Cluster, st: &mut State, node: &NodeId, rep: &ReplicaStatus) -> HeadResult<()> {
    let rid = ReplicaId::from(rep.replica_id.as_str());
    let Some(rec) = st.view().replicas.get(&rid).map(|e| e.record.clone()) else { return Ok(()) };
    let Some(part) = member_part(&rec, node) else { return Ok(()) };
    st.mark_started(node, &rid);
    let rs = rep.state();
    if matches!(rs, ReplicaState::Failed | ReplicaState::Stopped)
        && matches!(rec.state(), ReplicaState::Starting | ReplicaState::Ready)
    {
        let what = if rs == ReplicaState::Failed { "failed" } else { "stopped" };
        let detail = if rep.reason.is_empty() { String::new() } else { format!(": {}", rep.reason) };
        let reason = format!("ranks {} on node {node} {what}{detail}", rank_range(part));
        return fail_group(cluster, st, rec, reason).await;
    }
    Ok(())
}

/// For a node's full status: starts the member ranks this node was not sent yet (the
/// driver's rendezvous is known), and fails groups whose ranks this node's worker lost (it
/// does not report a Ready group it was never sent this session: a restarted worker).
///
/// # Errors
/// Store failures.
pub async fn reconcile_members(
    cluster: &Cluster,
    st: &mut State,
    node: &NodeId,
    reported: &std::collections::HashMap<ReplicaId, ReplicaStatus>,
) -> HeadResult<()> {
    let started = st.started_on(node);
    let mine: Vec<ReplicaRecord> = st
        .view()
        .members_on(node)
        .filter(|e| !reported.contains_key(&ReplicaId::from(e.record.replica_id.as_str())))
        .map(|e| e.record.clone())
        .collect();
    for rec in mine {
        let rid = ReplicaId::from(rec.replica_id.as_str());
        if started.contains(&rid) {
            continue;
        }
        match rec.state() {
            ReplicaState::Starting => send_member_starts(st, &rid),
            ReplicaState::Ready => {
                let ranks = member_part(&rec, node).map(rank_range).unwrap_or_default();
                let reason = format!("ranks {ranks} on node {node} lost (its worker restarted)");
                fail_group(cluster, st, rec, reason).await?;
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use prism_common::proto::v1::{DeploymentSpec, EngineConfig, HeadMessage, NodeInventory};
    use prism_common::state_store::{EmbeddedStore, StateStore};
    use tokio::sync::watch;

    use super::*;
    use crate::cluster::registry::{self, Registration, handle_status};
    use crate::config::{HeadConfig, StoreSpec};
    use crate::election::Leadership;
    use crate::metrics::Metrics;
    use crate::placement::reconciler::reconcile_once;

    fn inventory(node: &str) -> NodeInventory {
        NodeInventory {
            node_id: node.into(),
            address: format!("http://{node}.test:50061"),
            cpu_slots: 2,
            ..Default::default()
        }
    }

    /// A leader with two 2-slot CPU workers `a` and `b` and one replica of `d`
    /// (tensor_parallel_size 2 x pipeline_parallel_size 2) placed across them.
    async fn group_of_two_nodes() -> (Arc<Cluster>, watch::Sender<Leadership>, Registration, Registration, ReplicaId) {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let (lead_tx, lead_rx) = watch::channel(Leadership::Leader);
        let mut cfg = HeadConfig::new(StoreSpec::Embedded("unused".into()), "http://127.0.0.1:50050");
        cfg.replica_restart_delay = Duration::ZERO;
        let cluster = Cluster::new(cfg, store, lead_rx, Metrics::new());
        cluster.on_elected(1).await.expect("elected");
        let a = registry::register(&cluster, inventory("a"), None).await.expect("a registered");
        let b = registry::register(&cluster, inventory("b"), None).await.expect("b registered");
        let spec = DeploymentSpec {
            name: "d".into(),
            engine: Some(EngineConfig {
                model: "/m.gguf".into(),
                tensor_parallel_size: 2,
                pipeline_parallel_size: Some(2),
                ..Default::default()
            }),
            replicas: 1,
            ..Default::default()
        };
        crate::admin::apply_deployment(&cluster, spec).await.expect("applied");
        reconcile_once(&cluster).await.expect("placed");
        let rid = cluster.lock().await.view().replicas.keys().next().cloned().expect("a replica");
        (cluster, lead_tx, a, b, rid)
    }

    fn commands(worker: &mut Registration) -> Vec<head_message::Msg> {
        let mut out = Vec::new();
        while let Ok(Ok(HeadMessage { msg: Some(m) })) = worker.commands.try_recv() {
            out.push(m);
        }
        out
    }

    fn starts(msgs: &[head_message::Msg]) -> Vec<StartReplica> {
        msgs.iter().filter_map(|m| if let head_message::Msg::Start(s) = m { Some(s.clone()) } else { None }).collect()
    }

    fn stops(msgs: &[head_message::Msg]) -> Vec<String> {
        msgs.iter()
            .filter_map(|m| if let head_message::Msg::Stop(s) = m { Some(s.replica_id.clone()) } else { None })
            .collect()
    }

    fn status(rid: &ReplicaId, state: ReplicaState, rendezvous: &str, member: bool, reason: &str) -> ReplicaStatus {
        ReplicaStatus {
            replica_id: rid.to_string(),
            state: state as i32,
            rendezvous: rendezvous.into(),
            group_member: member,
            reason: reason.into(),
            ..Default::default()
        }
    }

    async fn report(cluster: &Cluster, node: &str, reports: Vec<ReplicaStatus>) {
        let mut st = cluster.lock().await;
        handle_status(cluster, &mut st, &NodeId::from(node), reports).await.expect("status handled");
    }

    async fn record(cluster: &Cluster, rid: &ReplicaId) -> ReplicaRecord {
        cluster.lock().await.view().replicas[rid].record.clone()
    }

    fn parts(rec: &ReplicaRecord) -> Vec<(String, u32, Vec<u32>)> {
        rec.rank_groups.iter().map(|g| (g.node_id.clone(), g.first_rank, g.gpu_indices.clone())).collect()
    }

    #[tokio::test]
    async fn driver_starts_first_then_members_join_its_rendezvous_and_a_member_failure_stops_both() {
        let (cluster, _lead, mut a, mut b, rid) = group_of_two_nodes().await;
        let rec = record(&cluster, &rid).await;
        assert_eq!(parts(&rec), vec![("a".to_owned(), 0, vec![0, 1]), ("b".to_owned(), 2, vec![0, 1])]);
        assert_eq!((rec.node_id.as_str(), rec.gpu_indices.clone()), ("a", vec![0, 1]), "the driver's part");
        assert_eq!(rec.endpoint, "http://a.test:50061", "routes point at the driver");
        assert_eq!(rec.group_token.len(), 36, "a uuid: {:?}", rec.group_token);
        // Phase 1: only the driver's node is started, with the group and the token.
        let sa = starts(&commands(&mut a));
        assert_eq!(sa.len(), 1);
        assert_eq!((sa[0].rendezvous.as_str(), sa[0].gpu_indices.clone()), ("", vec![0, 1]));
        assert_eq!(
            (sa[0].rank_groups.clone(), sa[0].group_token.clone()),
            (rec.rank_groups.clone(), rec.group_token.clone())
        );
        assert!(starts(&commands(&mut b)).is_empty(), "members wait for the rendezvous");
        // Phase 2: the driver reports its rendezvous; the member node is started there.
        report(&cluster, "a", vec![status(&rid, ReplicaState::Starting, "10.0.0.1:41000", false, "")]).await;
        assert_eq!(record(&cluster, &rid).await.rendezvous, "10.0.0.1:41000");
        let sb = starts(&commands(&mut b));
        assert_eq!(sb.len(), 1);
        assert_eq!((sb[0].rendezvous.as_str(), sb[0].gpu_indices.clone()), ("10.0.0.1:41000", vec![0, 1]));
        assert_eq!(
            (sb[0].rank_groups.clone(), sb[0].group_token.clone()),
            (rec.rank_groups.clone(), rec.group_token.clone())
        );
        assert!(starts(&commands(&mut a)).is_empty(), "the driver is not started twice");
        // The member's reports are its own: they do not stand for the driver's state, and
        // a repeated status starts nothing again.
        report(&cluster, "b", vec![status(&rid, ReplicaState::Ready, "", true, "")]).await;
        assert_eq!(record(&cluster, &rid).await.state(), ReplicaState::Starting);
        report(&cluster, "a", vec![status(&rid, ReplicaState::Ready, "10.0.0.1:41000", false, "")]).await;
        assert_eq!(record(&cluster, &rid).await.state(), ReplicaState::Ready);
        report(&cluster, "b", vec![status(&rid, ReplicaState::Ready, "", true, "")]).await;
        assert!(commands(&mut a).is_empty() && commands(&mut b).is_empty());
        // A member rank fails: the replica is Failed naming the ranks and node, and both
        // nodes are told to stop it.
        report(&cluster, "b", vec![status(&rid, ReplicaState::Failed, "", true, "rank 3 exited with status 1")]).await;
        let rec = record(&cluster, &rid).await;
        assert_eq!(rec.state(), ReplicaState::Failed);
        assert_eq!(rec.reason, "ranks 2-3 on node b failed: rank 3 exited with status 1");
        assert_eq!(stops(&commands(&mut a)), vec![rid.to_string()]);
        assert_eq!(stops(&commands(&mut b)), vec![rid.to_string()]);
        // The driver's stopped report keeps the Failed record until it is replaced.
        report(&cluster, "a", vec![status(&rid, ReplicaState::Stopped, "", false, "")]).await;
        assert_eq!(record(&cluster, &rid).await.state(), ReplicaState::Failed);
        // It had been Ready: it is replaced (restart delay 0 here) by a new group with a new
        // token, whose driver is started first again.
        report(&cluster, "a", vec![]).await;
        report(&cluster, "b", vec![]).await;
        reconcile_once(&cluster).await.expect("pass");
        let st = cluster.lock().await;
        let reps: Vec<&ReplicaRecord> = st.view().replicas.values().map(|e| &e.record).collect();
        assert_eq!(reps.len(), 1, "{reps:?}");
        let new = reps[0].clone();
        drop(st);
        assert_ne!(new.replica_id, rid.to_string());
        assert_eq!(new.state(), ReplicaState::Starting);
        assert_eq!(parts(&new), vec![("a".to_owned(), 0, vec![0, 1]), ("b".to_owned(), 2, vec![0, 1])]);
        assert_ne!(new.group_token, rec.group_token);
        let sa = starts(&commands(&mut a));
        assert_eq!(sa.iter().map(|s| s.replica_id.clone()).collect::<Vec<_>>(), vec![new.replica_id.clone()]);
        assert!(starts(&commands(&mut b)).is_empty());
    }

    #[tokio::test]
    async fn a_member_worker_with_a_new_session_is_started_from_the_record_and_a_driver_failure_frees_it() {
        let (cluster, _lead, mut a, b, rid) = group_of_two_nodes().await;
        report(&cluster, "a", vec![status(&rid, ReplicaState::Starting, "10.0.0.1:41000", false, "")]).await;
        // The member's worker has a new session (it restarted, or a new leader took over):
        // its unreported Starting ranks are started from the stored rendezvous and token, once.
        let b2 = {
            drop(b);
            registry::register(&cluster, inventory("b"), None).await.expect("b again")
        };
        let mut b = b2;
        report(&cluster, "b", vec![]).await;
        let sb = starts(&commands(&mut b));
        assert_eq!(sb.len(), 1);
        assert_eq!(sb[0].rendezvous, "10.0.0.1:41000");
        assert_eq!(sb[0].group_token, record(&cluster, &rid).await.group_token);
        report(&cluster, "b", vec![]).await;
        assert!(starts(&commands(&mut b)).is_empty(), "sent once per session");
        commands(&mut a);
        report(&cluster, "a", vec![status(&rid, ReplicaState::Failed, "10.0.0.1:41000", false, "engine died")]).await;
        let rec = record(&cluster, &rid).await;
        assert_eq!((rec.state(), rec.reason.as_str()), (ReplicaState::Failed, "engine died"));
        assert_eq!(stops(&commands(&mut b)), vec![rid.to_string()], "member ranks are freed");
        assert_eq!(stops(&commands(&mut a)), vec![rid.to_string()]);
    }

    #[tokio::test]
    async fn a_driver_worker_that_lost_a_starting_group_fails_it_instead_of_restarting_rank_0() {
        let (cluster, _lead, a, mut b, rid) = group_of_two_nodes().await;
        report(&cluster, "a", vec![status(&rid, ReplicaState::Starting, "10.0.0.1:41000", false, "")]).await;
        assert_eq!(starts(&commands(&mut b)).len(), 1, "the member was started at the rendezvous");
        // The driver's worker restarts (a new session) and reports nothing.
        drop(a);
        let mut a = registry::register(&cluster, inventory("a"), None).await.expect("a again");
        report(&cluster, "a", vec![]).await;
        let rec = record(&cluster, &rid).await;
        assert_eq!(
            (rec.state(), rec.reason.as_str()),
            (ReplicaState::Failed, "rank 0 on node a lost (its worker restarted)")
        );
        let sent = commands(&mut a);
        assert!(starts(&sent).is_empty(), "rank 0 is not restarted alone: {sent:?}");
        assert_eq!(stops(&sent), vec![rid.to_string()]);
        assert_eq!(stops(&commands(&mut b)), vec![rid.to_string()]);
    }

    #[tokio::test]
    async fn draining_a_member_node_drains_the_replica_and_stops_it_on_every_node() {
        let (cluster, _lead, mut a, mut b, rid) = group_of_two_nodes().await;
        report(&cluster, "a", vec![status(&rid, ReplicaState::Ready, "10.0.0.1:41000", false, "")]).await;
        commands(&mut a);
        commands(&mut b);
        // Nowhere to place a replacement: it serves until the deadline.
        crate::drain::drain_node(&cluster, "b", 800, "").await.expect("drained");
        let rec = record(&cluster, &rid).await;
        let serving = format!("drained by operator: {}", crate::drain::SERVING);
        assert_eq!((rec.state(), rec.reason.as_str()), (ReplicaState::Draining, serving.as_str()));
        tokio::time::sleep(Duration::from_millis(900)).await;
        reconcile_once(&cluster).await.expect("pass");
        assert_eq!(record(&cluster, &rid).await.state(), ReplicaState::Stopping);
        assert_eq!(stops(&commands(&mut a)), vec![rid.to_string()]);
        assert_eq!(stops(&commands(&mut b)), vec![rid.to_string()]);
    }

    #[tokio::test]
    async fn a_dead_member_node_evicts_the_group_and_stops_the_driver() {
        let (cluster, _lead, mut a, b, rid) = group_of_two_nodes().await;
        report(&cluster, "a", vec![status(&rid, ReplicaState::Ready, "10.0.0.1:41000", false, "")]).await;
        commands(&mut a);
        {
            let mut st = cluster.lock().await;
            let gone = tokio::time::Instant::now() - Duration::from_secs(3600);
            assert!(st.detach_session(&NodeId::from("b"), b.session, gone));
        }
        reconcile_once(&cluster).await.expect("pass");
        let st = cluster.lock().await;
        assert!(!st.view().replicas.contains_key(&rid), "evicted");
        let ev = cluster.events().recent();
        assert!(
            ev.iter()
                .any(|e| e.kind == EventKind::ReplicaEvicted
                    && e.message == "node b (ranks 2-3) of its GPU group is dead"),
            "{ev:?}"
        );
        // Its replacement waits: one node cannot hold 4 ranks.
        let reps: Vec<&ReplicaRecord> = st.view().replicas.values().map(|e| &e.record).collect();
        assert_eq!(reps.len(), 1);
        assert_eq!(reps[0].reason, "needs 4 CPU slots (tensor_parallel_size 2 x pipeline_parallel_size 2); free: a 2");
        drop(st);
        assert_eq!(stops(&commands(&mut a)), vec![rid.to_string()]);
    }
}
