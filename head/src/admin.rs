//! Admin operations behind the `HeadService` admin RPCs: apply (create or update) / delete
//! / scale deployments, cordon / uncordon nodes, listings and cluster status (draining a
//! node is [`crate::drain::drain_node`]). Every write is validated first, so bad input
//! changes nothing.

use prism_common::DeploymentName;
use prism_common::deployment::served_name;
use prism_common::proto::v1::{
    ClusterStatusResponse, DeploymentRecord, DeploymentSpec, NodeInventory, NodeRecord, NodeState, ReplicaRecord,
};
use prism_common::time::unix_ms;

use crate::cluster::Cluster;
use crate::cluster::view::{ClusterView, world_size};
use crate::election::Leadership;
use crate::error::{HeadError, HeadResult};
use crate::placement::autoscaler::Params;

/// The spec's own checks are shared with `prism deploy --dry-run` (`prism_common::deployment`).
pub use prism_common::deployment::{MAX_TENSOR_PARALLEL, is_dns1123_label, validate_spec};

/// Refuses a spec whose `engine.model` is not under the model root (lexically: the head
/// cannot see the workers' disks; each worker checks again with symlinks resolved). No root:
/// any path.
///
/// # Errors
/// `InvalidArgument` naming `engine.model` and the root.
pub fn check_model_root(root: Option<&std::path::Path>, spec: &DeploymentSpec) -> HeadResult<()> {
    let (Some(root), Some(engine)) = (root, spec.engine.as_ref()) else { return Ok(()) };
    prism_common::model_root::check_lexical(root, &engine.model)
        .map(drop)
        .map_err(|e| HeadError::InvalidArgument(e.to_string()))
}

/// The validated autoscaling parameters of an autoscaled spec (None otherwise).
pub fn autoscaling_params(spec: &DeploymentSpec) -> Option<Params> {
    spec.autoscaling.as_ref().and_then(|a| Params::from_config(a).ok())
}

/// Refuses a spec whose replica's GPU group (`tensor_parallel_size x
/// pipeline_parallel_size` GPUs, CPU slots on CPU nodes) is larger than all the registered,
/// non-Dead nodes matching its `node_selector` hold together: no placement across nodes
/// could ever hold it. A cluster with no live node registered yet accepts any size and
/// keeps the replica Pending (naming what it needs): deployments are routinely applied
/// before the workers come up (`prism up`, a Helm install, a node pool scaled to zero), and
/// then nothing says what the cluster will hold.
///
/// # Errors
/// `InvalidArgument` naming the sizes and each matching node's slots.
pub fn check_capacity(view: &ClusterView, spec: &DeploymentSpec) -> HeadResult<()> {
    let Some(engine) = spec.engine.as_ref() else { return Ok(()) };
    let world = world_size(engine);
    let live: Vec<&NodeInventory> = view
        .nodes
        .values()
        .filter(|e| e.record.state() != NodeState::Dead)
        .filter_map(|e| e.record.inventory.as_ref())
        .collect();
    if live.is_empty() {
        return Ok(());
    }
    let matching: Vec<(&str, u32)> = live
        .iter()
        .filter(|i| spec.node_selector.iter().all(|(k, v)| i.labels.get(k) == Some(v)))
        .map(|i| {
            let slots = if i.gpus.is_empty() { i.cpu_slots } else { u32::try_from(i.gpus.len()).unwrap_or(u32::MAX) };
            (i.node_id.as_str(), slots)
        })
        .collect();
    let total: u32 = matching.iter().map(|(_, n)| *n).fold(0, u32::saturating_add);
    if world <= total {
        return Ok(());
    }
    let pp = engine.pipeline_parallel_size.unwrap_or(1).max(1);
    let nodes = if spec.node_selector.is_empty() {
        "the registered nodes".to_owned()
    } else {
        let mut sel: Vec<String> = spec.node_selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        sel.sort();
        format!("the registered nodes matching node_selector {{{}}}", sel.join(","))
    };
    let each: Vec<String> = matching.iter().map(|(id, n)| format!("{id} {n}")).collect();
    let each = if each.is_empty() { "none match".to_owned() } else { each.join(", ") };
    Err(HeadError::InvalidArgument(format!(
        "a replica needs {} (engine.tensor_parallel_size {} x engine.pipeline_parallel_size {pp}), \
         more than {nodes} have together: {total} ({each})",
        prism_common::text::count(u64::from(world), "GPU or CPU slot", "GPUs or CPU slots"),
        engine.tensor_parallel_size.max(1)
    )))
}

/// Fields whose change replaces running replicas (the replica template).
fn template_changed(a: &DeploymentSpec, b: &DeploymentSpec) -> bool {
    a.engine != b.engine || a.node_selector != b.node_selector
}

/// The record of a stored deployment (`old`) updated to `spec`. The generation counts
/// replica templates: it grows only when the engine or `node_selector` changes, since a new
/// generation replaces the running replicas (so adding or removing `autoscaling_config`
/// keeps it). The autoscaler's last decision is kept only while the deployment stays
/// autoscaled: without `autoscaling_config` nothing decides its count any more.
fn updated_record(old: &DeploymentRecord, spec: DeploymentSpec) -> DeploymentRecord {
    let old_spec = old.spec.clone().unwrap_or_default();
    let generation = old.generation + u64::from(template_changed(&old_spec, &spec));
    let last_scaling = if spec.autoscaling.is_some() { old.last_scaling.clone() } else { None };
    DeploymentRecord { spec: Some(spec), created_unix_ms: old.created_unix_ms, generation, last_scaling }
}

/// Creates or updates a deployment; an identical spec is a no-op (`created = false`).
///
/// # Errors
/// `InvalidArgument`, `NotLeader`, store failures.
pub async fn apply_deployment(cluster: &Cluster, spec: DeploymentSpec) -> HeadResult<(DeploymentRecord, bool)> {
    let mut spec = validate_spec(spec)?;
    check_model_root(cluster.cfg().model_root.as_deref(), &spec)?;
    let mut st = cluster.lock().await;
    cluster.require_leader(&st)?;
    let name = DeploymentName::from(spec.name.as_str());
    // An autoscaled deployment that exists keeps the autoscaler's current count (within
    // the new bounds): re-applying a file does not reset it to initial_replicas.
    if let (Some(p), Some(old)) =
        (autoscaling_params(&spec), st.view().deployments.get(&name).and_then(|e| e.record.spec.as_ref()))
    {
        spec.replicas = old.replicas.clamp(p.min_replicas, p.max_replicas);
    }
    if let Some(e) = st.view().deployments.get(&name)
        && e.record.spec.as_ref() == Some(&spec)
    {
        return Ok((e.record.clone(), false));
    }
    let served = served_name(&spec).to_owned();
    let specs = st.view().deployments.values().filter_map(|e| e.record.spec.as_ref());
    if let Some(other) = served_elsewhere(specs, &spec.name, &served) {
        return Err(HeadError::FailedPrecondition(format!(
            "served_model_name {served:?} is already served by deployment {other}: give this deployment another \
             served_model_name, or delete {other} first (`prism delete {other}`)"
        )));
    }
    check_capacity(st.view(), &spec)?;
    let rec = match st.view().deployments.get(&name) {
        Some(e) => updated_record(&e.record, spec),
        None => DeploymentRecord { spec: Some(spec), created_unix_ms: unix_ms(), generation: 1, last_scaling: None },
    };
    let created = rec.generation == 1 && !st.view().deployments.contains_key(&name);
    tracing::info!(deployment = %name, generation = rec.generation, created, "deployment applied");
    Ok((cluster.put_deployment(&mut st, rec).await?, created))
}

/// The deployment other than `name` among `specs` already served as `served`: one served name
/// routes to one deployment (two would split its requests between different models).
fn served_elsewhere<'a>(
    specs: impl IntoIterator<Item = &'a DeploymentSpec>,
    name: &str,
    served: &str,
) -> Option<&'a str> {
    specs.into_iter().find(|s| s.name != name && served_name(s) == served).map(|s| s.name.as_str())
}

/// Deletes a deployment; its replicas drain and stop.
///
/// # Errors
/// `NotFound`, `NotLeader`, store failures.
pub async fn delete_deployment(cluster: &Cluster, name: &str) -> HeadResult<()> {
    let mut st = cluster.lock().await;
    cluster.require_leader(&st)?;
    let name = DeploymentName::from(name);
    let Some(rev) = st.view().deployments.get(&name).map(|e| e.mod_revision) else {
        return Err(HeadError::NotFound(format!("deployment {:?}", name.as_str())));
    };
    cluster.delete_deployment(&mut st, &name, rev).await?;
    tracing::info!(deployment = %name, "deployment deleted");
    cluster.after_change(&st);
    cluster.kick();
    Ok(())
}

/// Sets a deployment's replica count (within its `min_replicas`/`max_replicas` bounds).
///
/// # Errors
/// `NotFound`, `InvalidArgument` (outside bounds), `FailedPrecondition` (the deployment is
/// autoscaled: the autoscaler owns its count), `NotLeader`, store failures.
pub async fn scale_deployment(cluster: &Cluster, name: &str, replicas: u32) -> HeadResult<DeploymentRecord> {
    let mut st = cluster.lock().await;
    cluster.require_leader(&st)?;
    let Some(mut rec) = st.view().deployments.get(&DeploymentName::from(name)).map(|e| e.record.clone()) else {
        return Err(HeadError::NotFound(format!("deployment {name:?}")));
    };
    let spec = rec.spec.get_or_insert_with(Default::default);
    if let Some(a) = &spec.autoscaling {
        return Err(HeadError::FailedPrecondition(format!(
            "deployment {name:?} is autoscaled (autoscaling_config min_replicas {}, max_replicas {}): \
             its replica count is the autoscaler's; change autoscaling_config with `prism deploy` instead",
            a.min_replicas, a.max_replicas
        )));
    }
    prism_common::deployment::check_replica_bounds(spec, replicas)?;
    if spec.replicas == replicas {
        return Ok(rec);
    }
    spec.replicas = replicas;
    tracing::info!(deployment = %name, replicas, "deployment scaled");
    cluster.put_deployment(&mut st, rec).await
}

/// Marks a node unschedulable (its replicas keep running).
///
/// # Errors
/// `NotFound`, `NotLeader`, store failures.
pub async fn cordon(cluster: &Cluster, node: &str) -> HeadResult<NodeRecord> {
    Ok(cluster.update_node(node, |r| r.cordoned = true).await?.0)
}

/// Makes a node schedulable again (also ends a finished drain).
///
/// # Errors
/// `NotFound`, `NotLeader`, store failures.
pub async fn uncordon(cluster: &Cluster, node: &str) -> HeadResult<NodeRecord> {
    Ok(cluster
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

/// A consistent snapshot for listings (the leader's view; followers read the store).
///
/// # Errors
/// Store failures.
pub async fn snapshot(cluster: &Cluster) -> HeadResult<ClusterStatusResponse> {
    let st = cluster.lock().await;
    let l = cluster.leadership();
    let is_leader = l.is_leader();
    let leader = match l {
        Leadership::Leader => cluster.cfg().advertise_address.clone(),
        Leadership::Follower { leader } => leader.unwrap_or_default(),
    };
    let (view, load) = if is_leader && st.is_loaded() {
        (st.view().clone(), st.loads().cloned().collect())
    } else {
        drop(st);
        (ClusterView::load(cluster.store()).await?, Vec::new())
    };
    Ok(ClusterStatusResponse {
        leader,
        is_leader,
        nodes: view.nodes.values().map(|e| e.record.clone()).collect(),
        deployments: view.deployments.values().map(|e| e.record.clone()).collect(),
        replicas: view.replicas.values().map(|e| e.record.clone()).collect::<Vec<ReplicaRecord>>(),
        load,
        pending_gpus: view.pending_gpus(),
    })
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
    fn model_paths_outside_the_root_are_refused_naming_engine_model() {
        let with = |model: &str| DeploymentSpec {
            engine: Some(EngineConfig { model: model.into(), tensor_parallel_size: 1, ..Default::default() }),
            ..spec()
        };
        let root = std::path::Path::new("/models");
        for ok in ["/models/smol.gguf", "smol.gguf", "/models/hf/llama"] {
            assert!(check_model_root(Some(root), &with(ok)).is_ok(), "{ok}");
        }
        for bad in ["/etc/passwd", "../etc/passwd", "/models/../etc/passwd", "/models-x/a.gguf", "a/../../b"] {
            let e = check_model_root(Some(root), &with(bad)).expect_err(bad);
            assert!(
                matches!(&e, HeadError::InvalidArgument(m) if m.starts_with("engine.model") && m.contains(bad)),
                "{bad}: {e}"
            );
        }
        // Without a root any path is accepted.
        assert!(check_model_root(None, &with("/etc/passwd")).is_ok());
    }

    #[test]
    fn autoscaling_changes_keep_the_generation_and_its_removal_forgets_the_last_decision() {
        use prism_common::proto::v1::{AutoscalingConfig, ScalingDecision};
        let autoscaled = DeploymentSpec {
            autoscaling: Some(AutoscalingConfig { min_replicas: 0, max_replicas: 2, ..Default::default() }),
            ..spec()
        };
        let decision = ScalingDecision { unix_ms: 1, from_replicas: 1, to_replicas: 0, reason: "idle".into() };
        let stored = DeploymentRecord {
            spec: Some(autoscaled.clone()),
            created_unix_ms: 7,
            generation: 1,
            last_scaling: Some(decision.clone()),
        };
        // Redeployed without autoscaling_config: same template, no decision any more.
        let fixed = updated_record(&stored, spec());
        assert_eq!((fixed.generation, fixed.created_unix_ms), (1, 7));
        assert_eq!(fixed.last_scaling, None);
        // Still autoscaled (other bounds): the decision stays.
        let rebounded = DeploymentSpec {
            autoscaling: Some(AutoscalingConfig { min_replicas: 1, max_replicas: 4, ..Default::default() }),
            ..spec()
        };
        let kept = updated_record(&stored, rebounded);
        assert_eq!((kept.generation, kept.last_scaling), (1, Some(decision)));
        // An engine change is a new template: a new generation.
        let mut engine = spec();
        if let Some(e) = engine.engine.as_mut() {
            e.max_model_len = Some(1024);
        }
        assert_eq!(updated_record(&fixed, engine).generation, 2);
    }

    #[test]
    fn a_served_name_belongs_to_one_deployment() {
        let named = |name: &str, served: &str| {
            let mut s = DeploymentSpec { name: name.into(), ..spec() };
            if let Some(e) = s.engine.as_mut() {
                e.served_model_name = served.into();
            }
            s
        };
        let stored = [named("smol", "SmolLM2"), named("gemma", "")];
        assert_eq!(served_elsewhere(&stored, "smol-v2", "SmolLM2"), Some("smol"));
        assert_eq!(served_elsewhere(&stored, "smol", "SmolLM2"), None, "re-applying the same deployment");
        assert_eq!(served_elsewhere(&stored, "other", "gemma"), Some("gemma"), "an empty served name is the name");
        assert_eq!(served_elsewhere(&stored, "other", "other"), None);
    }

    #[test]
    fn a_group_larger_than_every_live_node_together_is_refused() {
        use crate::cluster::view::Entry;
        use prism_common::proto::v1::GpuInfo;
        let node = |id: &str, gpus: u32, state: NodeState, zone: &str| NodeRecord {
            inventory: Some(NodeInventory {
                node_id: id.into(),
                gpus: (0..gpus).map(|index| GpuInfo { index, ..Default::default() }).collect(),
                labels: [("zone".to_owned(), zone.to_owned())].into_iter().collect(),
                ..Default::default()
            }),
            state: state as i32,
            ..Default::default()
        };
        let sized = |tp: u32, pp: u32| DeploymentSpec {
            engine: spec().engine.map(|e| EngineConfig {
                tensor_parallel_size: tp,
                pipeline_parallel_size: Some(pp),
                ..e
            }),
            ..spec()
        };
        let mut view = ClusterView::default();
        // No node yet: anything goes (it waits Pending).
        assert!(check_capacity(&view, &sized(8, 8)).is_ok());
        for (id, gpus, state, zone) in
            [("a", 2, NodeState::Ready, "x"), ("b", 2, NodeState::Ready, "y"), ("c", 8, NodeState::Dead, "x")]
        {
            view.nodes.insert(id.into(), Entry { record: node(id, gpus, state, zone), mod_revision: 1 });
        }
        // 4 GPUs across a and b (the Dead node does not count).
        assert!(check_capacity(&view, &sized(2, 2)).is_ok());
        let Err(HeadError::InvalidArgument(m)) = check_capacity(&view, &sized(2, 3)) else { panic!("6 accepted") };
        assert_eq!(
            m,
            "a replica needs 6 GPUs or CPU slots (engine.tensor_parallel_size 2 x engine.pipeline_parallel_size 3), \
             more than the registered nodes have together: 4 (a 2, b 2)"
        );
        let mut zoned = sized(2, 2);
        zoned.node_selector.insert("zone".into(), "x".into());
        let Err(HeadError::InvalidArgument(m)) = check_capacity(&view, &zoned) else { panic!("zone x holds 2") };
        assert!(
            m.ends_with("more than the registered nodes matching node_selector {zone=x} have together: 2 (a 2)"),
            "{m}"
        );
    }
}
