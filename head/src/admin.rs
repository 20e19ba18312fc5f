//! Admin operations behind the `HeadService` admin RPCs: apply (create or update) / delete
//! / scale deployments, cordon / uncordon / drain nodes, listings and cluster status.
//! Every write is validated first, so bad input changes nothing.

use std::time::Duration;

use prism_common::DeploymentName;
use prism_common::NodeId;
use prism_common::proto::v1::{
    ClusterStatusResponse, DeploymentRecord, DeploymentSpec, DrainCommand, NodeRecord, NodeState, ReplicaRecord,
    head_message,
};
use prism_common::state_store::{Compare, Txn, TxnOp, keys};
use prost::Message;

use crate::cluster::view::{ClusterView, Entry};
use crate::cluster::{Cluster, unix_ms};
use crate::error::{HeadError, HeadResult};

/// Largest accepted `tensor_parallel_size` (no node has more GPUs than this).
pub const MAX_TENSOR_PARALLEL: u32 = 1024;

/// True for a DNS-1123 label: 1–63 of `[a-z0-9-]`, starting and ending alphanumeric.
pub fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Validates a deployment spec and fills defaults (`served_model_name` = name; a knob set to
/// 0 is unset).
///
/// # Errors
/// `InvalidArgument` naming the field.
pub fn validate_spec(mut spec: DeploymentSpec) -> HeadResult<DeploymentSpec> {
    let bad = |m: String| Err(HeadError::InvalidArgument(m));
    if !is_dns1123_label(&spec.name) {
        return bad(format!(
            "deployment name {:?} is not a DNS-1123 label (1-63 of a-z, 0-9, '-', alphanumeric at both ends)",
            spec.name
        ));
    }
    let Some(engine) = spec.engine.as_mut() else {
        return bad("engine is required".into());
    };
    if engine.model.trim().is_empty() {
        return bad("engine.model must not be empty".into());
    }
    if engine.tensor_parallel_size == 0 || engine.tensor_parallel_size > MAX_TENSOR_PARALLEL {
        return bad(format!(
            "engine.tensor_parallel_size must be between 1 and {MAX_TENSOR_PARALLEL}, got {}",
            engine.tensor_parallel_size
        ));
    }
    if let Some(u) = engine.gpu_memory_utilization
        && !(0.0..=1.0).contains(&u)
    {
        return bad(format!("engine.gpu_memory_utilization must be in [0, 1], got {u}"));
    }
    if !matches!(engine.backend.as_str(), "" | "auto" | "cpu" | "cuda") {
        return bad(format!("engine.backend must be auto, cpu or cuda, got {:?}", engine.backend));
    }
    if engine.served_model_name.is_empty() {
        engine.served_model_name.clone_from(&spec.name);
    }
    prism_common::engine_flags::unset_zeros(engine);
    check_bounds(&spec, spec.replicas)?;
    Ok(spec)
}

fn check_bounds(spec: &DeploymentSpec, replicas: u32) -> HeadResult<()> {
    let min = spec.min_replicas;
    let max = if spec.max_replicas == 0 { u32::MAX } else { spec.max_replicas };
    if min > max {
        return Err(HeadError::InvalidArgument(format!("min_replicas {min} is greater than max_replicas {max}")));
    }
    if replicas < min || replicas > max {
        return Err(HeadError::InvalidArgument(format!(
            "replicas {replicas} is outside [min_replicas {min}, max_replicas {}]",
            spec.max_replicas
        )));
    }
    Ok(())
}

/// Fields whose change replaces running replicas (the replica template).
fn template_changed(a: &DeploymentSpec, b: &DeploymentSpec) -> bool {
    a.engine != b.engine || a.node_selector != b.node_selector
}

impl Cluster {
    async fn put_deployment(
        &self,
        st: &mut crate::cluster::State,
        rec: DeploymentRecord,
    ) -> HeadResult<DeploymentRecord> {
        let name = DeploymentName::from(rec.spec.as_ref().map(|s| s.name.as_str()).unwrap_or_default());
        let key = keys::deployment(&name);
        let prev = st.view.deployments.get(&name).map_or(0, |e| e.mod_revision);
        let res = self
            .store
            .txn(Txn {
                compares: vec![Compare::mod_revision(&key, prev)],
                success: vec![TxnOp::put(&key, rec.encode_to_vec())],
                failure: vec![],
            })
            .await?;
        st.writes += 1;
        if !res.succeeded {
            self.reload(st).await?;
            return Err(HeadError::Conflict(key));
        }
        st.view.deployments.insert(name, Entry { record: rec.clone(), mod_revision: res.revision });
        self.after_change(st);
        self.kick.notify_one();
        Ok(rec)
    }

    /// Creates or updates a deployment; an identical spec is a no-op (`created = false`).
    ///
    /// # Errors
    /// `InvalidArgument`, `NotLeader`, store failures.
    pub async fn apply_deployment(&self, spec: DeploymentSpec) -> HeadResult<(DeploymentRecord, bool)> {
        let spec = validate_spec(spec)?;
        let mut st = self.state.lock().await;
        self.require_leader(&st)?;
        let name = DeploymentName::from(spec.name.as_str());
        let rec = match st.view.deployments.get(&name) {
            Some(e) if e.record.spec.as_ref() == Some(&spec) => return Ok((e.record.clone(), false)),
            Some(e) => {
                let old = e.record.spec.clone().unwrap_or_default();
                let generation = e.record.generation + u64::from(template_changed(&old, &spec));
                DeploymentRecord { spec: Some(spec), created_unix_ms: e.record.created_unix_ms, generation }
            }
            None => DeploymentRecord { spec: Some(spec), created_unix_ms: unix_ms(), generation: 1 },
        };
        let created = rec.generation == 1 && !st.view.deployments.contains_key(&name);
        tracing::info!(deployment = %name, generation = rec.generation, created, "deployment applied");
        Ok((self.put_deployment(&mut st, rec).await?, created))
    }

    /// Deletes a deployment; its replicas drain and stop.
    ///
    /// # Errors
    /// `NotFound`, `NotLeader`, store failures.
    pub async fn delete_deployment(&self, name: &str) -> HeadResult<()> {
        let mut st = self.state.lock().await;
        self.require_leader(&st)?;
        let name = DeploymentName::from(name);
        let Some(e) = st.view.deployments.get(&name) else {
            return Err(HeadError::NotFound(format!("deployment {name:?}")));
        };
        let key = keys::deployment(&name);
        let res = self
            .store
            .txn(Txn {
                compares: vec![Compare::mod_revision(&key, e.mod_revision)],
                success: vec![TxnOp::delete(&key)],
                failure: vec![],
            })
            .await?;
        st.writes += 1;
        if !res.succeeded {
            self.reload(&mut st).await?;
            return Err(HeadError::Conflict(key));
        }
        st.view.deployments.remove(&name);
        tracing::info!(deployment = %name, "deployment deleted");
        self.after_change(&mut st);
        self.kick.notify_one();
        Ok(())
    }

    /// Sets a deployment's replica count (within its autoscaling bounds).
    ///
    /// # Errors
    /// `NotFound`, `InvalidArgument` (outside bounds), `NotLeader`, store failures.
    pub async fn scale_deployment(&self, name: &str, replicas: u32) -> HeadResult<DeploymentRecord> {
        let mut st = self.state.lock().await;
        self.require_leader(&st)?;
        let Some(mut rec) = st.view.deployments.get(&DeploymentName::from(name)).map(|e| e.record.clone()) else {
            return Err(HeadError::NotFound(format!("deployment {name:?}")));
        };
        let spec = rec.spec.get_or_insert_with(Default::default);
        check_bounds(spec, replicas)?;
        if spec.replicas == replicas {
            return Ok(rec);
        }
        spec.replicas = replicas;
        tracing::info!(deployment = %name, replicas, "deployment scaled");
        self.put_deployment(&mut st, rec).await
    }

    async fn update_node(
        &self,
        node: &str,
        f: impl FnOnce(&mut NodeRecord),
    ) -> HeadResult<(NodeRecord, crate::cluster::StateGuard<'_>)> {
        let mut st = self.state.lock().await;
        self.require_leader(&st)?;
        let id = NodeId::from(node);
        let Some(mut rec) = st.view.nodes.get(&id).map(|e| e.record.clone()) else {
            return Err(HeadError::NotFound(format!("node {node:?}")));
        };
        f(&mut rec);
        if st.view.nodes.get(&id).is_some_and(|e| e.record != rec)
            && let Err(e) = self.put_node(&mut st, rec.clone()).await
        {
            if matches!(e, HeadError::Conflict(_)) {
                self.reload(&mut st).await?;
            }
            return Err(e);
        }
        self.after_change(&mut st);
        self.kick.notify_one();
        Ok((rec, st))
    }

    /// Marks a node unschedulable (its replicas keep running).
    ///
    /// # Errors
    /// `NotFound`, `NotLeader`, store failures.
    pub async fn cordon(&self, node: &str) -> HeadResult<NodeRecord> {
        Ok(self.update_node(node, |r| r.cordoned = true).await?.0)
    }

    /// Makes a node schedulable again (also ends a finished drain).
    ///
    /// # Errors
    /// `NotFound`, `NotLeader`, store failures.
    pub async fn uncordon(&self, node: &str) -> HeadResult<NodeRecord> {
        Ok(self
            .update_node(node, |r| {
                r.cordoned = false;
                if r.state() == NodeState::Draining {
                    r.state = NodeState::Ready as i32;
                    r.drain_deadline_unix_ms = 0;
                    r.drain_reason.clear();
                }
            })
            .await?
            .0)
    }

    /// Drains a node: cordon, mark its replicas Draining (replacements are placed
    /// elsewhere), tell the worker, and stop the replicas when idle or at the deadline.
    ///
    /// # Errors
    /// `NotFound`, `NotLeader`, store failures.
    pub async fn drain_node(&self, node: &str, deadline_ms: u64, reason: &str) -> HeadResult<NodeRecord> {
        let rel = if deadline_ms == 0 { self.cfg.drain_timeout } else { Duration::from_millis(deadline_ms) };
        let reason = if reason.is_empty() { "drained by operator" } else { reason };
        let (rec, mut st) = self
            .update_node(node, |r| {
                r.cordoned = true;
                if r.state() != NodeState::Dead {
                    r.state = NodeState::Draining as i32;
                }
                r.drain_deadline_unix_ms = unix_ms() + rel.as_millis() as u64;
                r.drain_reason = reason.to_owned();
            })
            .await?;
        let id = NodeId::from(node);
        self.mark_node_replicas_draining(&mut st, &id, rel, reason).await?;
        self.send(
            &st,
            &id,
            head_message::Msg::Drain(DrainCommand { deadline_ms: rel.as_millis() as u64, reason: reason.to_owned() }),
        );
        tracing::info!(node = %node, deadline_ms = rel.as_millis() as u64, "node draining");
        self.after_change(&mut st);
        Ok(rec)
    }

    /// A consistent snapshot for listings (the leader's view; followers read the store).
    ///
    /// # Errors
    /// `NotLeader` on followers, store failures.
    pub async fn snapshot(&self) -> HeadResult<ClusterStatusResponse> {
        let st = self.state.lock().await;
        let l = self.leadership();
        let (view, load) = if l.is_leader && st.loaded {
            (st.view.clone(), st.loads.values().cloned().collect())
        } else {
            drop(st);
            (ClusterView::load(self.store.as_ref()).await?, Vec::new())
        };
        Ok(ClusterStatusResponse {
            leader: l.leader.unwrap_or_default(),
            is_leader: l.is_leader,
            nodes: view.nodes.values().map(|e| e.record.clone()).collect(),
            deployments: view.deployments.values().map(|e| e.record.clone()).collect(),
            replicas: view.replicas.values().map(|e| e.record.clone()).collect::<Vec<ReplicaRecord>>(),
            load,
            pending_gpus: view.pending_gpus(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_common::proto::v1::EngineConfig;

    fn spec() -> DeploymentSpec {
        DeploymentSpec {
            name: "smollm".into(),
            engine: Some(EngineConfig { model: "/m.gguf".into(), tensor_parallel_size: 1, ..Default::default() }),
            replicas: 1,
            ..Default::default()
        }
    }

    #[test]
    fn names() {
        assert!(is_dns1123_label("llama-3-8b"));
        for bad in ["", "-a", "a-", "Llama", "a_b", "a.b", &"a".repeat(64)] {
            assert!(!is_dns1123_label(bad), "{bad}");
        }
    }

    #[test]
    fn spec_validation() {
        let s = validate_spec(spec()).expect("valid");
        assert_eq!(s.engine.map(|e| e.served_model_name), Some("smollm".to_owned()));
        let mut s = spec();
        s.engine = s.engine.map(|e| EngineConfig { tensor_parallel_size: 0, ..e });
        assert!(matches!(validate_spec(s), Err(HeadError::InvalidArgument(_))));
        let mut s = spec();
        s.engine = s.engine.map(|e| EngineConfig { model: " ".into(), ..e });
        assert!(validate_spec(s).is_err());
        let mut s = spec();
        s.name = "Bad_Name".into();
        assert!(validate_spec(s).is_err());
        let mut s = spec();
        s.engine = None;
        assert!(validate_spec(s).is_err());
        let mut s = spec();
        s.replicas = 5;
        s.max_replicas = 3;
        assert!(validate_spec(s).is_err());
        let mut s = spec();
        s.min_replicas = 2;
        assert!(validate_spec(s).is_err());
    }
}
