//! Which served models no replica is coming to serve ([`unavailable`]), published in the
//! route table so that routers answer their requests at once (503 / UNAVAILABLE with the
//! reason) instead of queueing them for `--max-queue-wait` for nothing.
//!
//! A model is on its way, and its requests wait, while one of its deployment's replicas is
//! Starting (loading), Ready or Draining, a Failed one is due for replacement, fewer replicas
//! exist than desired (the reconciler creates them on its next pass), an autoscaled
//! deployment is at zero (a queued request scales it up), or a Pending replica can be placed:
//! the planner would place it now (a node registered an instant ago; slots that replicas now
//! Stopping give back count as free), or a worker may still register (a node the head knows
//! has neither a session nor been declared Dead yet, or the leadership term is younger than
//! [`REGISTRATION_GRACE`]: `prism up` starts its worker beside its head, and a cluster's
//! workers register a moment after a new head takes office). Otherwise it is unavailable:
//! - `FAILED`: replicas that failed while starting and are never replaced (a missing model
//!   file, an engine setting its backend refuses), with a Failed replica's reason;
//! - `SCALED_TO_ZERO`: a deployment without autoscaling set to 0 replicas;
//! - `NO_NODE`: Pending replicas that no node can take (every worker gone, the nodes full,
//!   none matching `node_selector`), with the placer's reason.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::Duration;

use prism_common::deployment::served_name;
use prism_common::proto::v1::{NodeState, ReplicaState, UnavailableCause, UnavailableModel};
use prism_common::{DeploymentName, NodeId};

use crate::cluster::view::ClusterView;
use crate::placement::planner::{Action, PlacementDecision, plan};

/// How long after a leadership term began a Pending replica counts as on its way whatever
/// the placer says: workers back off up to 5 s between registration attempts while no head
/// answers, and `prism up`'s worker registers a moment after its head took office.
pub const REGISTRATION_GRACE: Duration = Duration::from_secs(5);

/// What is known of one deployment's replicas.
#[derive(Default)]
struct Replicas<'a> {
    /// One is Starting, Ready or Draining, or a Failed one will be replaced.
    coming: bool,
    /// Replicas that count towards the desired count (Pending, Starting, Ready, Failed).
    active: u32,
    /// Pending replicas.
    pending: u32,
    /// The earliest-named Failed (never replaced) replica's reason.
    failed: Option<&'a str>,
    /// The earliest-named Pending replica's reason.
    pending_reason: Option<&'a str>,
}

/// Served models with no replica coming, sorted by model (see the module documentation).
/// `connected`: the nodes with a live worker session; `new_term`: the leadership term is
/// younger than [`REGISTRATION_GRACE`].
pub fn unavailable(view: &ClusterView, connected: &HashSet<NodeId>, new_term: bool) -> Vec<UnavailableModel> {
    let mut by_deployment: BTreeMap<&str, Replicas<'_>> = BTreeMap::new();
    for e in view.replicas.values() {
        let r = &e.record;
        let d = by_deployment.entry(r.deployment.as_str()).or_default();
        match r.state() {
            ReplicaState::Starting | ReplicaState::Ready | ReplicaState::Draining => d.coming = true,
            ReplicaState::Pending => {
                d.active += 1;
                d.pending += 1;
                d.pending_reason.get_or_insert(r.reason.as_str());
            }
            // Replaced by the reconciler: one that was Ready once, or a GPU group (see
            // `ClusterView::planner_inputs`).
            ReplicaState::Failed if r.ready_unix_ms > 0 || view.tp_of(&r.deployment) > 1 => d.coming = true,
            ReplicaState::Failed => {
                d.active += 1;
                d.failed.get_or_insert(r.reason.as_str());
            }
            _ => {}
        }
    }
    // Asked only when some deployment has nothing but Pending (and failed) replicas, or is
    // autoscaled at zero.
    let mut placeable: Option<Placeable> = None;
    let workers_may_register =
        new_term || view.nodes.iter().any(|(id, n)| n.record.state() != NodeState::Dead && !connected.contains(id));
    let mut out = Vec::new();
    for (name, e) in &view.deployments {
        let Some(spec) = e.record.spec.as_ref() else { continue };
        let none = Replicas::default();
        let d = by_deployment.get(name.as_str()).unwrap_or(&none);
        let (cause, reason) = if spec.autoscaling.is_none() && spec.replicas == 0 {
            (UnavailableCause::ScaledToZero, "")
        } else if d.coming || d.active < spec.replicas {
            continue;
        } else if let Some(reason) = d.failed {
            (UnavailableCause::Failed, reason)
        } else if d.pending > 0
            && !workers_may_register
            && !placeable.get_or_insert_with(|| placeable_now(view, connected)).assigned.contains(name)
        {
            (UnavailableCause::NoNode, d.pending_reason.unwrap_or_default())
        } else if spec.autoscaling.is_some()
            && spec.replicas == 0
            && d.active == 0
            && !workers_may_register
            && let Some(reason) = placeable.get_or_insert_with(|| placeable_now(view, connected)).pending.get(name)
        {
            // At zero, a queued request would scale it up to a replica no node can take (every
            // worker gone, the nodes full or cordoned): refused at once as a Pending one is.
            (UnavailableCause::NoNode, reason.as_str())
        } else {
            // Pending replicas about to be placed, or an autoscaled deployment at zero.
            continue;
        };
        out.push(UnavailableModel {
            model: served_name(spec).to_owned(),
            deployment: name.to_string(),
            reason: reason.to_owned(),
            cause: cause as i32,
        });
    }
    out.sort_unstable_by(|a, b| a.model.cmp(&b.model));
    out
}

/// What the planner would do now, counting the slots of replicas now Stopping as free (they
/// give them back in a moment) and an autoscaled deployment at zero as wanting one replica
/// (what a queued request scales it to).
#[derive(Default)]
struct Placeable {
    /// Deployments of which a replica (a Pending one, or a new one) would be placed.
    assigned: HashSet<DeploymentName>,
    /// Deployments of which a new replica would stay Pending, with the placer's reason.
    pending: HashMap<DeploymentName, String>,
}

fn placeable_now(view: &ClusterView, connected: &HashSet<NodeId>) -> Placeable {
    // No replacement of a Failed replica is due here: they hold no slots either way.
    let never = Duration::from_secs(u64::from(u32::MAX));
    let (nodes, mut deployments, mut replicas) = view.planner_inputs(connected, never, &HashMap::new());
    for d in &mut deployments {
        let autoscaled =
            view.deployments.get(&d.name).and_then(|e| e.record.spec.as_ref()).and_then(|s| s.autoscaling.as_ref());
        if d.replicas == 0 && autoscaled.is_some() {
            d.replicas = 1;
        }
    }
    for r in &mut replicas {
        if r.state == ReplicaState::Stopping {
            r.state = ReplicaState::Stopped;
        }
    }
    let by_id: BTreeMap<_, _> = replicas.iter().map(|r| (r.id.clone(), r.deployment.clone())).collect();
    let mut out = Placeable::default();
    for a in plan(&nodes, &deployments, &replicas) {
        match a {
            Action::Create { deployment, placement: PlacementDecision::Assigned { .. }, .. } => {
                out.assigned.insert(deployment);
            }
            Action::Create { deployment, placement: PlacementDecision::Pending { reason }, .. } => {
                out.pending.entry(deployment).or_insert(reason);
            }
            Action::Place { replica, placement: PlacementDecision::Assigned { .. } } => {
                out.assigned.extend(by_id.get(&replica).cloned());
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
#[path = "availability/tests.rs"]
mod tests;
