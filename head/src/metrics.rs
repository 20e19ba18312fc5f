//! Head metrics (prometheus-client): cluster gauges refreshed from the leader's view after
//! every change (nodes, replicas, target / ready replicas per deployment, unmet and total
//! GPU demand for KEDA), counters of route updates, placement and autoscaler decisions. Served on `/metrics`
//! by `http.rs`.

use std::collections::BTreeMap;
use std::sync::Arc;

use prism_common::NodeId;
use prism_common::proto::v1::{NodeState, ReplicaState};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::cluster::view::ClusterView;
use crate::placement::planner::{CAPACITY_TYPE_LABEL, ON_DEMAND, holds_slots};

type StateLabel = Vec<(String, String)>;

/// The head's metrics. Cheap to clone (shared counters).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// `prism_nodes{state}`.
    pub nodes: Family<StateLabel, Gauge>,
    /// `prism_replicas{state}`.
    pub replicas: Family<StateLabel, Gauge>,
    /// `prism_pending_gpus`: GPUs asked for by Pending replicas (unmet demand; 0 on followers).
    pub pending_gpus: Gauge,
    /// `prism_gpu_demand{capacity_type}`: GPUs replicas hold on GPU nodes, by the node's
    /// `capacity-type` label (`on-demand`, `spot`, `other`), plus `capacity_type="pending"`
    /// for the GPUs of Pending replicas: what a GPU pool must offer. KEDA sizes the spot pool
    /// on `spot` + `pending` (k8s/components/keda). 0 on followers.
    pub gpu_demand: Family<StateLabel, Gauge>,
    /// `prism_route_updates_total`.
    pub route_updates: Counter,
    /// `prism_placement_decisions_total`: replicas assigned to a node.
    pub placement_decisions: Counter,
    /// `prism_drains_in_progress`: nodes draining.
    pub drains_in_progress: Gauge,
    /// `prism_head_is_leader`: 1 on the leader.
    pub is_leader: Gauge,
    /// `prism_deployment_target_replicas{deployment}`: desired replica count (the
    /// autoscaler's target on autoscaled deployments).
    pub target_replicas: Family<StateLabel, Gauge>,
    /// `prism_deployment_ready_replicas{deployment}`: Ready replicas.
    pub ready_replicas: Family<StateLabel, Gauge>,
    /// `prism_autoscaler_decisions_total{deployment,direction}`: replica-count changes the
    /// autoscaler made (`direction` = up | down).
    pub autoscaler_decisions: Family<StateLabel, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

fn label(s: &str) -> StateLabel {
    vec![("state".to_owned(), s.to_owned())]
}

const NODE_STATES: [(NodeState, &str); 3] =
    [(NodeState::Ready, "ready"), (NodeState::Draining, "draining"), (NodeState::Dead, "dead")];
const REPLICA_STATES: [(ReplicaState, &str); 7] = [
    (ReplicaState::Pending, "pending"),
    (ReplicaState::Starting, "starting"),
    (ReplicaState::Ready, "ready"),
    (ReplicaState::Draining, "draining"),
    (ReplicaState::Stopping, "stopping"),
    (ReplicaState::Stopped, "stopped"),
    (ReplicaState::Failed, "failed"),
];

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut r = Registry::default();
        let m = Self {
            registry: Arc::new(Registry::default()),
            nodes: Family::default(),
            replicas: Family::default(),
            pending_gpus: Gauge::default(),
            gpu_demand: Family::default(),
            route_updates: Counter::default(),
            placement_decisions: Counter::default(),
            drains_in_progress: Gauge::default(),
            is_leader: Gauge::default(),
            target_replicas: Family::default(),
            ready_replicas: Family::default(),
            autoscaler_decisions: Family::default(),
        };
        r.register("prism_nodes", "Worker nodes by state", m.nodes.clone());
        r.register("prism_replicas", "Replicas by state", m.replicas.clone());
        r.register("prism_pending_gpus", "GPUs requested by Pending replicas", m.pending_gpus.clone());
        r.register(
            "prism_gpu_demand",
            "GPUs held by replicas by node capacity type, and requested by Pending replicas (pending)",
            m.gpu_demand.clone(),
        );
        r.register("prism_route_updates", "Route tables published", m.route_updates.clone());
        r.register("prism_placement_decisions", "Replicas assigned to a node", m.placement_decisions.clone());
        r.register("prism_drains_in_progress", "Nodes draining", m.drains_in_progress.clone());
        r.register("prism_head_is_leader", "1 when this head is the leader", m.is_leader.clone());
        r.register(
            "prism_deployment_target_replicas",
            "Desired replicas per deployment (the autoscaler's target when autoscaled)",
            m.target_replicas.clone(),
        );
        r.register("prism_deployment_ready_replicas", "Ready replicas per deployment", m.ready_replicas.clone());
        r.register(
            "prism_autoscaler_decisions",
            "Replica-count changes made by the autoscaler",
            m.autoscaler_decisions.clone(),
        );
        Self { registry: Arc::new(r), ..m }
    }

    /// Sets the leader gauge; a follower reports no demand (so sums over every head are the
    /// leader's values).
    pub fn set_leader(&self, leader: bool) {
        self.is_leader.set(i64::from(leader));
        if !leader {
            self.pending_gpus.set(0);
            self.gpu_demand.clear();
        }
    }

    /// Refreshes the gauges from the leader's view.
    pub fn observe(&self, view: &ClusterView, leader: bool) {
        self.set_leader(leader);
        for (s, name) in NODE_STATES {
            let n = view.nodes.values().filter(|e| e.record.state() == s).count();
            self.nodes.get_or_create(&label(name)).set(n as i64);
        }
        for (s, name) in REPLICA_STATES {
            let n = view.replicas.values().filter(|e| e.record.state() == s).count();
            self.replicas.get_or_create(&label(name)).set(n as i64);
        }
        if !leader {
            return;
        }
        self.pending_gpus.set(i64::from(view.pending_gpus()));
        let mut demand: BTreeMap<&str, i64> = [(ON_DEMAND, 0), ("spot", 0), ("other", 0)].into_iter().collect();
        demand.insert("pending", i64::from(view.pending_gpus()));
        for r in view.replicas.values().filter(|e| holds_slots(e.record.state())) {
            let Some(n) = view.nodes.get(&NodeId::from(r.record.node_id.as_str())) else { continue };
            let Some(inv) = n.record.inventory.as_ref().filter(|i| !i.gpus.is_empty()) else { continue };
            let kind = match inv.labels.get(CAPACITY_TYPE_LABEL).map(String::as_str) {
                Some(ON_DEMAND) => ON_DEMAND,
                Some("spot") => "spot",
                _ => "other",
            };
            *demand.entry(kind).or_default() += r.record.gpu_indices.len() as i64;
        }
        for (kind, gpus) in demand {
            self.gpu_demand.get_or_create(&vec![("capacity_type".to_owned(), kind.to_owned())]).set(gpus);
        }
        let draining = view.nodes.values().filter(|e| e.record.state() == NodeState::Draining).count();
        self.drains_in_progress.set(draining as i64);
        self.target_replicas.clear();
        self.ready_replicas.clear();
        for (name, e) in &view.deployments {
            let d = vec![("deployment".to_owned(), name.to_string())];
            self.target_replicas.get_or_create(&d).set(i64::from(e.record.spec.as_ref().map_or(0, |s| s.replicas)));
            let ready = view
                .replicas
                .values()
                .filter(|r| r.record.deployment == name.as_str() && r.record.state() == ReplicaState::Ready)
                .count();
            self.ready_replicas.get_or_create(&d).set(ready as i64);
        }
    }

    /// Counts one autoscaler decision of `deployment`.
    pub fn count_scaling(&self, deployment: &str, up: bool) {
        let l = vec![
            ("deployment".to_owned(), deployment.to_owned()),
            ("direction".to_owned(), if up { "up" } else { "down" }.to_owned()),
        ];
        self.autoscaler_decisions.get_or_create(&l).inc();
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use prism_common::proto::v1::{
        DeploymentRecord, DeploymentSpec, EngineConfig, GpuInfo, NodeInventory, NodeRecord, ReplicaRecord,
    };
    use prism_common::{DeploymentName, ReplicaId};

    use super::*;
    use crate::cluster::view::Entry;

    fn entry<T>(record: T) -> Entry<T> {
        Entry { record, mod_revision: 1 }
    }

    #[test]
    fn gpu_demand_is_held_gpus_by_capacity_type_plus_pending_and_zero_on_followers() {
        let mut view = ClusterView::default();
        let gpus = (0..8).map(|index| GpuInfo { index, ..Default::default() }).collect();
        let inv = NodeInventory {
            node_id: "s1".into(),
            gpus,
            labels: [(CAPACITY_TYPE_LABEL.to_owned(), "spot".to_owned())].into_iter().collect(),
            ..Default::default()
        };
        view.nodes.insert(NodeId::from("s1"), entry(NodeRecord { inventory: Some(inv), ..Default::default() }));
        let engine = EngineConfig { tensor_parallel_size: 4, ..Default::default() };
        let spec = DeploymentSpec { name: "d".into(), engine: Some(engine), replicas: 2, ..Default::default() };
        view.deployments
            .insert(DeploymentName::from("d"), entry(DeploymentRecord { spec: Some(spec), ..Default::default() }));
        let replica = |id: &str, state: ReplicaState, node: &str, gpus: Vec<u32>| ReplicaRecord {
            replica_id: id.into(),
            deployment: "d".into(),
            node_id: node.into(),
            gpu_indices: gpus,
            state: state as i32,
            ..Default::default()
        };
        view.replicas.insert(ReplicaId::from("a"), entry(replica("a", ReplicaState::Ready, "s1", vec![0, 1, 2, 3])));
        view.replicas.insert(ReplicaId::from("b"), entry(replica("b", ReplicaState::Pending, "", vec![])));
        let m = Metrics::new();
        m.observe(&view, true);
        let text = m.render();
        assert!(text.contains("prism_gpu_demand{capacity_type=\"spot\"} 4"), "{text}");
        assert!(text.contains("prism_gpu_demand{capacity_type=\"pending\"} 4"), "{text}");
        assert!(text.contains("prism_gpu_demand{capacity_type=\"on-demand\"} 0"), "{text}");
        assert!(text.contains("prism_deployment_target_replicas{deployment=\"d\"} 2"), "{text}");
        assert!(text.contains("prism_deployment_ready_replicas{deployment=\"d\"} 1"), "{text}");
        m.set_leader(false);
        let text = m.render();
        assert!(!text.contains("prism_gpu_demand{"), "{text}");
        assert!(text.contains("prism_pending_gpus 0"), "{text}");
    }
}
