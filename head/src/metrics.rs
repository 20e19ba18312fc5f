//! Head metrics (prometheus-client): cluster gauges refreshed from the leader's view after
//! every change, counters of route updates and placement decisions. Served on `/metrics`
//! by `http.rs`.

use std::sync::Arc;

use prism_common::proto::v1::{NodeState, ReplicaState};
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::cluster::view::ClusterView;

type StateLabel = Vec<(String, String)>;

/// The head's metrics. Cheap to clone (shared counters).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// `prism_nodes{state}`.
    pub nodes: Family<StateLabel, Gauge>,
    /// `prism_replicas{state}`.
    pub replicas: Family<StateLabel, Gauge>,
    /// `prism_pending_gpus`: GPUs asked for by Pending replicas (unmet demand).
    pub pending_gpus: Gauge,
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

    /// Sets the leader gauge.
    pub fn set_leader(&self, leader: bool) {
        self.is_leader.set(i64::from(leader));
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
        self.pending_gpus.set(i64::from(view.pending_gpus()));
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
