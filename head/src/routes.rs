//! The route table published to routers through `WatchRoutes`: every Ready or Draining
//! replica with its endpoint, served model name, load and limits. A new table (with a
//! higher `version`) is published only when its content changes.

use std::sync::Arc;

use prism_common::DeploymentName;
use prism_common::proto::v1::{ReplicaState, RouteEntry, RouteTable};

use crate::cluster::{Cluster, State};

/// Builds the route table content (version 0) from the leader's state.
pub fn build(st: &State) -> Vec<RouteEntry> {
    st.view
        .replicas
        .iter()
        .filter(|(_, e)| matches!(e.record.state(), ReplicaState::Ready | ReplicaState::Draining))
        .map(|(id, e)| {
            let r = &e.record;
            let engine = st
                .view
                .deployments
                .get(&DeploymentName::from(r.deployment.as_str()))
                .and_then(|d| d.record.spec.as_ref())
                .and_then(|s| s.engine.as_ref());
            RouteEntry {
                replica_id: r.replica_id.clone(),
                deployment: r.deployment.clone(),
                model: r.served_model_name.clone(),
                endpoint: r.endpoint.clone(),
                state: r.state,
                load: st.loads.get(id).cloned(),
                node_id: r.node_id.clone(),
                max_model_len: engine.map_or(0, |e| e.max_model_len),
                max_in_flight: engine.map_or(0, |e| e.max_in_flight),
            }
        })
        .collect()
}

/// Served model names of every deployment, sorted (routers answer 503, not 404, for a
/// model whose replicas are all gone, e.g. while every worker is down).
pub fn models(st: &State) -> Vec<String> {
    let mut names: Vec<String> = st
        .view
        .deployments
        .values()
        .filter_map(|d| d.record.spec.as_ref()?.engine.as_ref().map(|e| e.served_model_name.clone()))
        .filter(|n| !n.is_empty())
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// Publishes a new table when the routes changed.
pub fn publish(cluster: &Cluster, st: &State) {
    let routes = build(st);
    let models = models(st);
    let cur = cluster.routes.borrow().clone();
    if cur.routes == routes && cur.models == models {
        return;
    }
    // Monotonic across leaders too: a new leader never publishes a lower version.
    let version = (cur.version + 1).max(crate::cluster::unix_ms());
    cluster.routes.send_replace(Arc::new(RouteTable { version, routes, models }));
    cluster.metrics.route_updates.inc();
}
