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
                max_model_len: max_model_len(r.max_model_len, engine.and_then(|e| e.max_model_len).unwrap_or(0)),
                max_in_flight: engine.and_then(|e| e.max_in_flight).unwrap_or(0),
            }
        })
        .collect()
}

/// A route's context length: what the replica's engine reported (the deployment's value or
/// the model's own, capped to its KV cache, as vLLM reports it), else the deployment's
/// `max_model_len` (a replica whose worker has not reported it yet); 0 = unknown.
fn max_model_len(reported: u32, configured: u32) -> u32 {
    if reported > 0 { reported } else { configured }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::view::Entry;
    use prism_common::ReplicaId;
    use prism_common::proto::v1::{DeploymentRecord, DeploymentSpec, EngineConfig, ReplicaRecord};

    fn state(configured: u32, replicas: &[(&str, ReplicaState, u32)]) -> State {
        let mut st = State::default();
        let engine =
            EngineConfig { served_model_name: "m".into(), max_model_len: Some(configured), ..EngineConfig::default() };
        let spec = DeploymentSpec { name: "d".into(), engine: Some(engine), ..DeploymentSpec::default() };
        let record = DeploymentRecord { spec: Some(spec), ..DeploymentRecord::default() };
        st.view.deployments.insert(DeploymentName::from("d"), Entry { record, mod_revision: 1 });
        for (id, state, reported) in replicas {
            let record = ReplicaRecord {
                replica_id: (*id).into(),
                deployment: "d".into(),
                served_model_name: "m".into(),
                state: *state as i32,
                max_model_len: *reported,
                ..ReplicaRecord::default()
            };
            st.view.replicas.insert(ReplicaId::from(*id), Entry { record, mod_revision: 1 });
        }
        st
    }

    fn lens(st: &State) -> Vec<(String, u32)> {
        build(st).into_iter().map(|r| (r.replica_id, r.max_model_len)).collect()
    }

    /// The engine's reported value wins (it is the deployment's or the model's own, capped to
    /// the KV cache); a replica that has not reported one yet gets the deployment's.
    #[test]
    fn routes_carry_the_reported_max_model_len_else_the_deployments() {
        let ready = ReplicaState::Ready;
        let st = state(0, &[("a", ready, 8192), ("b", ready, 0), ("c", ReplicaState::Starting, 8192)]);
        assert_eq!(lens(&st), [("a".to_owned(), 8192), ("b".to_owned(), 0)]);
        let st = state(2048, &[("a", ready, 1456), ("b", ReplicaState::Draining, 0)]);
        assert_eq!(lens(&st), [("a".to_owned(), 1456), ("b".to_owned(), 2048)]);
    }
}
