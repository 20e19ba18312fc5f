use super::*;
use crate::cluster::view::Entry;
use ReplicaState::{Draining, Failed, Pending, Ready, Starting, Stopped, Stopping};
use prism_common::ReplicaId;
use prism_common::proto::v1::{
    AutoscalingConfig, DeploymentRecord, DeploymentSpec, EngineConfig, NodeInventory, NodeRecord, ReplicaRecord,
};

/// A cluster under test: deployments, nodes, replicas and which nodes have a session.
#[derive(Default)]
struct Cluster {
    view: ClusterView,
    connected: HashSet<NodeId>,
}

impl Cluster {
    /// Deployment `name` served as `name`-model, with `replicas` desired (autoscaled with
    /// min 0 when `autoscaled`).
    fn deployment(mut self, name: &str, replicas: u32, autoscaled: bool) -> Self {
        let engine = EngineConfig { served_model_name: format!("{name}-model"), ..EngineConfig::default() };
        let autoscaling =
            autoscaled.then(|| AutoscalingConfig { min_replicas: 0, max_replicas: 2, ..Default::default() });
        let spec =
            DeploymentSpec { name: name.into(), engine: Some(engine), replicas, autoscaling, ..Default::default() };
        let record = DeploymentRecord { spec: Some(spec), ..DeploymentRecord::default() };
        self.view.deployments.insert(DeploymentName::from(name), Entry { record, mod_revision: 1 });
        self
    }

    /// Node `id` with one CPU slot, in `state`, with a session when `connected`.
    fn node(mut self, id: &str, state: NodeState, connected: bool) -> Self {
        let inventory = NodeInventory {
            node_id: id.into(),
            address: "http://127.0.0.1:1".into(),
            cpu_slots: 1,
            ..Default::default()
        };
        let record = NodeRecord { inventory: Some(inventory), state: state as i32, ..NodeRecord::default() };
        self.view.nodes.insert(NodeId::from(id), Entry { record, mod_revision: 1 });
        if connected {
            self.connected.insert(NodeId::from(id));
        }
        self
    }

    /// Replica `id` of `deployment` in `state`, on slot 0 of `node` (empty: not placed);
    /// Failed ones were never Ready.
    fn replica(mut self, id: &str, deployment: &str, state: ReplicaState, node: &str) -> Self {
        let record = ReplicaRecord {
            replica_id: id.into(),
            deployment: deployment.into(),
            served_model_name: format!("{deployment}-model"),
            state: state as i32,
            node_id: node.into(),
            gpu_indices: if node.is_empty() { vec![] } else { vec![0] },
            reason: match state {
                Failed => format!("{id} cannot start"),
                Pending => "needs 1 slots on one node; no schedulable node".into(),
                _ => String::new(),
            },
            ..ReplicaRecord::default()
        };
        self.view.replicas.insert(ReplicaId::from(id), Entry { record, mod_revision: 1 });
        self
    }

    /// `(model, cause, reason)` of every unavailable model.
    fn unavailable(&self, new_term: bool) -> Vec<(String, UnavailableCause, String)> {
        unavailable(&self.view, &self.connected, new_term)
            .into_iter()
            .map(|u| (u.cause(), u))
            .map(|(c, u)| (u.model, c, u.reason))
            .collect()
    }
}

fn one(model: &str, cause: UnavailableCause, reason: &str) -> Vec<(String, UnavailableCause, String)> {
    vec![(model.to_owned(), cause, reason.to_owned())]
}

/// Replicas that failed while starting are never replaced: the model is unavailable with a
/// failed replica's reason, unless another replica is loading, serving or draining, or the
/// failed one was Ready once (the reconciler replaces it). Stopped replicas count for nothing.
#[test]
fn replicas_that_failed_to_start_make_a_model_unavailable_unless_another_is_on_its_way() {
    let base = || Cluster::default().deployment("d", 1, false).node("n1", NodeState::Ready, true);
    let failed = one("d-model", UnavailableCause::Failed, "a cannot start");
    assert_eq!(base().replica("a", "d", Failed, "").unavailable(false), failed);
    let two = Cluster::default().deployment("d", 2, false).replica("a", "d", Failed, "").replica("b", "d", Failed, "");
    assert_eq!(two.unavailable(false), failed);
    assert_eq!(base().replica("a", "d", Failed, "").replica("b", "d", Stopped, "").unavailable(false), failed);
    for on_its_way in [Starting, Ready, Draining] {
        let c = Cluster::default().deployment("d", 2, false).replica("a", "d", Failed, "");
        assert_eq!(c.replica("b", "d", on_its_way, "n1").unavailable(false), [], "{on_its_way:?}");
    }
    let mut was_ready = base().replica("a", "d", Failed, "");
    for e in was_ready.view.replicas.values_mut() {
        e.record.ready_unix_ms = 1;
    }
    assert_eq!(was_ready.unavailable(false), [], "a replica that was Ready is replaced");
    // A failure outweighs a Pending replica that has nowhere to go.
    let mixed =
        Cluster::default().deployment("d", 2, false).replica("a", "d", Failed, "").replica("b", "d", Pending, "");
    assert_eq!(mixed.unavailable(false), failed);
}

/// `prism scale d 0` on a deployment without autoscaling: no replica will ever come. An
/// autoscaled deployment at zero is not unavailable while a node could take the replica a
/// queued request scales it up to; with no such node (every worker gone) it is, as a Pending
/// replica would be.
#[test]
fn a_deployment_scaled_to_zero_is_unavailable_unless_it_autoscales() {
    let c = Cluster::default().deployment("d", 0, false).node("n1", NodeState::Ready, true);
    assert_eq!(c.unavailable(false), one("d-model", UnavailableCause::ScaledToZero, ""));
    let draining = c.replica("a", "d", Draining, "n1");
    assert_eq!(draining.unavailable(true), one("d-model", UnavailableCause::ScaledToZero, ""), "drained away");
    let autoscaled = Cluster::default().deployment("d", 0, true).node("n1", NodeState::Ready, true);
    assert_eq!(autoscaled.unavailable(false), [], "scale from zero");
    let nowhere = Cluster::default().deployment("d", 0, true).node("n1", NodeState::Dead, false);
    let no_node = nowhere.unavailable(false);
    assert!(
        no_node.len() == 1 && no_node[0].1 == UnavailableCause::NoNode && no_node[0].2.contains("no schedulable node"),
        "every worker gone: {no_node:?}"
    );
    assert_eq!(nowhere.unavailable(true), [], "a new term: workers may still register");
    let full = Cluster::default().deployment("d", 0, true).deployment("e", 1, false).node("n1", NodeState::Ready, true);
    let full = full.replica("b", "e", Ready, "n1");
    assert_eq!(full.unavailable(false).len(), 1, "the only slot taken: {:?}", full.unavailable(false));
    let fewer = Cluster::default().deployment("d", 1, false);
    assert_eq!(fewer.unavailable(false), [], "the reconciler creates the replica on its next pass");
}

/// A Pending replica that no node can take makes its model unavailable with the placer's
/// reason: every node Dead (every worker killed), or the only node full. It is on its way
/// while a node can take it (the placer's reason is from before a worker registered), while
/// the slot it needs is being given back (a replica Stopping), while a known node may still
/// reconnect (not Dead yet), and during a new term's registration grace.
#[test]
fn a_pending_replica_counts_as_on_its_way_only_while_a_node_can_take_it() {
    let no_node = one("d-model", UnavailableCause::NoNode, "needs 1 slots on one node; no schedulable node");
    let dead = Cluster::default().deployment("d", 1, false).node("n1", NodeState::Dead, false);
    let dead = dead.replica("a", "d", Pending, "");
    assert_eq!(dead.unavailable(false), no_node, "every worker gone");
    assert_eq!(dead.unavailable(true), [], "a new term: workers may still register");
    assert_eq!(Cluster::default().deployment("d", 1, false).replica("a", "d", Pending, "").unavailable(false), no_node);

    let registered = Cluster::default().deployment("d", 1, false).node("n1", NodeState::Ready, true);
    assert_eq!(registered.replica("a", "d", Pending, "").unavailable(false), [], "a node just registered");
    let reconnecting = Cluster::default().deployment("d", 1, false).node("n1", NodeState::Ready, false);
    assert_eq!(reconnecting.replica("a", "d", Pending, "").unavailable(false), [], "n1 is not Dead yet");

    let full = || {
        Cluster::default()
            .deployment("d", 1, false)
            .deployment("other", 1, false)
            .node("n1", NodeState::Ready, true)
            .replica("a", "d", Pending, "")
    };
    assert_eq!(full().replica("o", "other", Ready, "n1").unavailable(false), no_node, "n1's slot is taken");
    assert_eq!(full().replica("o", "other", Stopping, "n1").unavailable(false), [], "n1's slot comes free");
}
