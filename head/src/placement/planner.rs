//! The placement planner: a pure function from (nodes, deployments, replicas) to the
//! actions that move observed state towards desired state, as kube-rs controllers keep
//! their decision logic pure.
//!
//! Rules (Ray placement groups with STRICT_PACK per replica, SPREAD across replicas):
//! - a replica's GPU group is `tensor_parallel_size x pipeline_parallel_size` slots (GPUs;
//!   CPU slots on CPU-only nodes); one node holds the whole group when any can, and a slot
//!   is never given to two replicas;
//! - when no node holds the group whole it is gang-scheduled across nodes, all-or-nothing
//!   ([`split_group`]): whole pipeline stages (`tensor_parallel_size` contiguous ranks) per
//!   node — TP inside a node, PP across nodes — on the nodes with the most free slots first
//!   (ties by id), stages in rank order; only when whole stages cannot cover the group are
//!   its ranks split in order over the nodes (TP across nodes, the last resort). The node
//!   holding rank 0 is the driver's node: the replica's `node` / `slots`, its endpoint;
//! - replicas of one deployment spread over nodes (fewest of its replicas first; best fit
//!   among equals, to keep large free groups for large gangs), or pack (`PACK`);
//! - cordoned, draining, dead and disconnected nodes take no new replicas; `node_selector`
//!   must match the node's labels;
//! - the first `min_on_demand` replicas prefer `capacity-type=on-demand` nodes;
//! - a replica that fits nowhere stays Pending with a reason such as
//!   "needs 8 GPUs on one node; largest free group is 4" (at most one node has free slots)
//!   or "needs 4 GPUs (tensor_parallel_size 2 x pipeline_parallel_size 2); free: a 1, b 1".

use std::collections::{BTreeMap, BTreeSet, HashMap};

use prism_common::proto::v1::{PlacementStrategy, ReplicaState};
use prism_common::text::count;
use prism_common::{DeploymentName, NodeId, ReplicaId};

/// Label naming a node's capacity type (`spot` or `on-demand`).
pub const CAPACITY_TYPE_LABEL: &str = "capacity-type";
/// Value of [`CAPACITY_TYPE_LABEL`] for on-demand nodes.
pub const ON_DEMAND: &str = "on-demand";

/// What the planner needs to know about a node.
#[derive(Debug, Clone)]
pub struct NodeView {
    /// Node id.
    pub id: NodeId,
    /// Slot indices the node offers: GPU indices, or `0..cpu_slots` on CPU-only nodes.
    pub slots: Vec<u32>,
    /// True when the slots are GPUs.
    pub gpu: bool,
    /// Node labels (`capacity-type`, `zone`, …).
    pub labels: BTreeMap<String, String>,
    /// May take new replicas: Ready, connected, not cordoned, not draining.
    pub schedulable: bool,
    /// Not Dead: replicas on a node that is not alive are evicted and replaced.
    pub alive: bool,
}

/// What the planner needs to know about a deployment.
#[derive(Debug, Clone)]
pub struct DeploymentView {
    /// Deployment name.
    pub name: DeploymentName,
    /// Tensor-parallel ranks per stage (`tensor_parallel_size`, ≥ 1).
    pub tensor_parallel_size: u32,
    /// Pipeline stages per replica (`pipeline_parallel_size`, ≥ 1): a replica holds
    /// `tensor_parallel_size x pipeline_parallel_size` slots.
    pub pipeline_parallel_size: u32,
    /// Desired replica count.
    pub replicas: u32,
    /// Spread or pack.
    pub strategy: PlacementStrategy,
    /// Labels a node must carry.
    pub node_selector: BTreeMap<String, String>,
    /// The first N replicas prefer on-demand nodes.
    pub min_on_demand: u32,
    /// Spec generation; replicas of an older one are replaced.
    pub generation: u64,
}

/// What the planner needs to know about a replica.
#[derive(Debug, Clone)]
pub struct ReplicaView {
    /// Replica id.
    pub id: ReplicaId,
    /// Owning deployment.
    pub deployment: DeploymentName,
    /// Node it is placed on: the driver's node, holding rank 0 (None while Pending).
    pub node: Option<NodeId>,
    /// Slots it holds on that node.
    pub slots: Vec<u32>,
    /// The rest of its GPU group, when it spans nodes: (node, slots) per other node.
    pub members: Vec<(NodeId, Vec<u32>)>,
    /// Current state.
    pub state: ReplicaState,
    /// Current Pending reason (to avoid rewriting an unchanged one).
    pub reason: String,
    /// Spec generation it was created for.
    pub generation: u64,
    /// Failed and due for replacement: stop it and create a replacement (after having
    /// been Ready, once its restart delay has passed; a GPU group that failed while
    /// starting, after an exponential backoff; a one-rank startup failure never).
    pub restart_due: bool,
    /// Requests on it (running + waiting, from its latest load report; 0 when none): a
    /// scale-down drains the least-loaded Ready replica.
    pub load: u32,
}

/// The ranks of a GPU group on one node: rank `first_rank + i` runs on `slots[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupPart {
    /// The node.
    pub node: NodeId,
    /// Its first rank (vLLM's order: `rank = pp_rank * tp + tp_rank`).
    pub first_rank: u32,
    /// GPU indices (or CPU slot indices), one per rank.
    pub slots: Vec<u32>,
}

/// Where a replica goes: the planner's decision for one replica.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlacementDecision {
    /// Its driver (rank 0) on `node`, holding `slots`; the whole group is `groups`.
    Assigned {
        /// The driver's node (`groups[0].node`).
        node: NodeId,
        /// The driver node's GPU indices (or CPU slot indices): the whole group's
        /// `tensor_parallel_size x pipeline_parallel_size` when one node holds it.
        slots: Vec<u32>,
        /// The group in rank order, one part per node (one part when one node holds it).
        groups: Vec<GroupPart>,
    },
    /// Nowhere yet.
    Pending {
        /// Why nothing fits.
        reason: String,
    },
}

/// One step towards desired state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Create a replica record for `deployment`.
    Create {
        /// Owning deployment.
        deployment: DeploymentName,
        /// Generation of the spec it runs.
        generation: u64,
        /// Where it goes, or Pending with a reason.
        placement: PlacementDecision,
    },
    /// Place an existing Pending replica (or update its Pending reason).
    Place {
        /// The Pending replica.
        replica: ReplicaId,
        /// Where it goes.
        placement: PlacementDecision,
    },
    /// Scale-down, spec change or deleted deployment: drain the replica, then stop it.
    Remove {
        /// The replica to remove.
        replica: ReplicaId,
    },
    /// The replica's node is dead or unknown: drop the record (a replacement is created).
    Evict {
        /// The replica to drop.
        replica: ReplicaId,
    },
}

/// States whose replica counts towards a deployment's desired count.
fn is_active(s: ReplicaState) -> bool {
    matches!(s, ReplicaState::Pending | ReplicaState::Starting | ReplicaState::Ready | ReplicaState::Failed)
}

/// States whose replica holds its slots.
pub fn holds_slots(s: ReplicaState) -> bool {
    matches!(s, ReplicaState::Starting | ReplicaState::Ready | ReplicaState::Draining | ReplicaState::Stopping)
}

/// Removal preference: lower goes first (then, among Ready replicas, the least loaded), so
/// a scale-down never drains a Ready replica while a Pending or Starting one could go.
fn removal_rank(s: ReplicaState) -> u8 {
    match s {
        ReplicaState::Pending => 0,
        ReplicaState::Failed => 1,
        ReplicaState::Starting => 2,
        _ => 3,
    }
}

struct Capacity<'a> {
    nodes: Vec<&'a NodeView>,
    /// Used slots per node.
    used: HashMap<&'a NodeId, BTreeSet<u32>>,
    /// Active placed replicas per (deployment, node).
    per_dep: HashMap<(DeploymentName, NodeId), u32>,
}

impl<'a> Capacity<'a> {
    fn free(&self, n: &NodeView) -> Vec<u32> {
        let used = self.used.get(&n.id);
        n.slots.iter().copied().filter(|s| used.is_none_or(|u| !u.contains(s))).collect()
    }
    fn dep_count(&self, d: &DeploymentName, n: &NodeId) -> u32 {
        self.per_dep.get(&(d.clone(), n.clone())).copied().unwrap_or(0)
    }
}

fn on_demand(n: &NodeView) -> bool {
    n.labels.get(CAPACITY_TYPE_LABEL).map(String::as_str) == Some(ON_DEMAND)
}

fn selector_matches(n: &NodeView, sel: &BTreeMap<String, String>) -> bool {
    sel.iter().all(|(k, v)| n.labels.get(k) == Some(v))
}

/// Computes the actions that bring `replicas` to what `deployments` ask for on `nodes`.
///
/// Pure and deterministic (nodes are considered in id order). Running it again on the
/// state that results from applying its actions yields no actions.
pub fn plan(nodes: &[NodeView], deployments: &[DeploymentView], replicas: &[ReplicaView]) -> Vec<Action> {
    let mut actions = Vec::new();
    let mut sorted_nodes: Vec<&NodeView> = nodes.iter().collect();
    sorted_nodes.sort_by(|a, b| a.id.cmp(&b.id));
    let node_by_id: HashMap<&NodeId, &NodeView> = nodes.iter().map(|n| (&n.id, n)).collect();
    let deps: BTreeMap<&DeploymentName, &DeploymentView> = deployments.iter().map(|d| (&d.name, d)).collect();

    let mut cap = Capacity { nodes: sorted_nodes, used: HashMap::new(), per_dep: HashMap::new() };
    // Replicas still counted per deployment after evictions and removals.
    let mut active: BTreeMap<&DeploymentName, Vec<&ReplicaView>> = BTreeMap::new();

    for r in replicas {
        let alive = |id: &NodeId| node_by_id.get(id).is_some_and(|n| n.alive);
        // Every node of the group must live: ranks on a dead member node are gone too.
        let group_alive = r.node.as_ref().is_some_and(alive) && r.members.iter().all(|(id, _)| alive(id));
        if r.node.is_some() && !group_alive && r.state != ReplicaState::Stopped {
            actions.push(Action::Evict { replica: r.id.clone() });
            continue;
        }
        if let (Some(node), true) = (&r.node, holds_slots(r.state)) {
            for (id, slots) in std::iter::once((node, &r.slots)).chain(r.members.iter().map(|(n, s)| (n, s))) {
                if let Some(n) = node_by_id.get(id) {
                    cap.used.entry(&n.id).or_default().extend(slots.iter().copied());
                }
            }
        }
        let Some(d) = deps.get(&r.deployment) else {
            if is_active(r.state) {
                actions.push(Action::Remove { replica: r.id.clone() });
            }
            continue;
        };
        if !is_active(r.state) {
            continue;
        }
        if r.generation < d.generation || (r.state == ReplicaState::Failed && r.restart_due) {
            actions.push(Action::Remove { replica: r.id.clone() });
            continue;
        }
        if let (Some(node), true) = (&r.node, r.state != ReplicaState::Failed) {
            *cap.per_dep.entry((r.deployment.clone(), node.clone())).or_default() += 1;
        }
        active.entry(&r.deployment).or_default().push(r);
    }

    for d in deps.values() {
        let mut mine = active.remove(&d.name).unwrap_or_default();
        let want = d.replicas as usize;
        // Scale down: least useful first (Pending, Failed, Starting, then the least-loaded
        // Ready replica, which drains), from the most crowded node among equals.
        while mine.len() > want {
            let Some((idx, _)) = mine.iter().enumerate().min_by(|(_, a), (_, b)| {
                let ca = a.node.as_ref().map_or(0, |n| cap.dep_count(&d.name, n));
                let cb = b.node.as_ref().map_or(0, |n| cap.dep_count(&d.name, n));
                removal_rank(a.state)
                    .cmp(&removal_rank(b.state))
                    .then(a.load.cmp(&b.load))
                    .then(cb.cmp(&ca))
                    .then(b.id.cmp(&a.id))
            }) else {
                break;
            };
            let r = mine.swap_remove(idx);
            if let Some(n) = &r.node
                && let Some(c) = cap.per_dep.get_mut(&(d.name.clone(), n.clone()))
            {
                *c = c.saturating_sub(1);
            }
            actions.push(Action::Remove { replica: r.id.clone() });
        }
        let mut on_demand_count = mine
            .iter()
            .filter(|r| {
                r.state != ReplicaState::Failed
                    && r.node.as_ref().and_then(|n| node_by_id.get(n)).is_some_and(|n| on_demand(n))
            })
            .count() as u32;
        // Place existing Pending replicas, oldest id order for determinism.
        let mut pending: Vec<&ReplicaView> =
            mine.iter().copied().filter(|r| r.state == ReplicaState::Pending).collect();
        pending.sort_by(|a, b| a.id.cmp(&b.id));
        for r in pending {
            let p = place_one(&mut cap, d, &mut on_demand_count);
            let unchanged = matches!(&p, PlacementDecision::Pending { reason } if *reason == r.reason);
            if !unchanged {
                actions.push(Action::Place { replica: r.id.clone(), placement: p });
            }
        }
        for _ in mine.len()..want {
            let p = place_one(&mut cap, d, &mut on_demand_count);
            actions.push(Action::Create { deployment: d.name.clone(), generation: d.generation, placement: p });
        }
    }
    actions
}

/// Picks a node and slots for one replica of `d` — or, when no node holds its group whole,
/// the nodes of a group split across nodes — updating `cap`.
fn place_one(cap: &mut Capacity<'_>, d: &DeploymentView, on_demand_count: &mut u32) -> PlacementDecision {
    let tp = d.tensor_parallel_size.max(1) as usize;
    let pp = d.pipeline_parallel_size.max(1) as usize;
    let world = tp * pp;
    let eligible: Vec<&NodeView> =
        cap.nodes.iter().copied().filter(|n| n.schedulable && selector_matches(n, &d.node_selector)).collect();
    let fits: Vec<(&NodeView, Vec<u32>)> =
        eligible.iter().map(|n| (*n, cap.free(n))).filter(|(_, f)| f.len() >= world).collect();
    let prefer_od = *on_demand_count < d.min_on_demand;
    let pool: Vec<&(&NodeView, Vec<u32>)> = if prefer_od && fits.iter().any(|(n, _)| on_demand(n)) {
        fits.iter().filter(|(n, _)| on_demand(n)).collect()
    } else {
        fits.iter().collect()
    };
    let best = pool.into_iter().min_by(|(a, fa), (b, fb)| {
        let ca = cap.dep_count(&d.name, &a.id);
        let cb = cap.dep_count(&d.name, &b.id);
        let by_count = match d.strategy {
            PlacementStrategy::Pack => cb.cmp(&ca),
            _ => ca.cmp(&cb),
        };
        by_count.then(fa.len().cmp(&fb.len())).then(a.id.cmp(&b.id))
    });
    let parts: Vec<(&NodeView, Vec<u32>)> = match best {
        Some((node, free)) => vec![(*node, free.iter().copied().take(world).collect())],
        None => match split_group(cap, &eligible, tp, pp) {
            Some(parts) => parts,
            None => return PlacementDecision::Pending { reason: pending_reason(cap, d, &eligible, tp, pp) },
        },
    };
    let mut groups = Vec::with_capacity(parts.len());
    let mut first_rank = 0;
    for (n, slots) in &parts {
        cap.used.entry(&n.id).or_default().extend(slots.iter().copied());
        groups.push(GroupPart { node: n.id.clone(), first_rank, slots: slots.clone() });
        first_rank += slots.len() as u32;
    }
    let (driver, slots) = parts.into_iter().next().expect("a placed group has a part");
    *cap.per_dep.entry((d.name.clone(), driver.id.clone())).or_default() += 1;
    if on_demand(driver) {
        *on_demand_count += 1;
    }
    PlacementDecision::Assigned { node: driver.id.clone(), slots, groups }
}

/// Splits a group of `tp x pp` ranks over `eligible` nodes, all-or-nothing (None when
/// their free slots together cannot hold it). Nodes go most free first (ties by id). Whole
/// stages (`tp` contiguous ranks) per node first: tensor-parallel all-reduces stay inside a
/// node and only pipeline activations cross nodes. When whole stages cannot cover the group
/// (a stage is larger than any node's free slots, or free slots are fragmented), the ranks
/// are split in order over the nodes: tensor parallelism across nodes, the last resort.
fn split_group<'a>(
    cap: &Capacity<'_>,
    eligible: &[&'a NodeView],
    tp: usize,
    pp: usize,
) -> Option<Vec<(&'a NodeView, Vec<u32>)>> {
    let world = tp * pp;
    let mut free: Vec<(&NodeView, Vec<u32>)> =
        eligible.iter().map(|n| (*n, cap.free(n))).filter(|(_, f)| !f.is_empty()).collect();
    if free.len() < 2 || free.iter().map(|(_, f)| f.len()).sum::<usize>() < world {
        return None;
    }
    free.sort_by(|(a, fa), (b, fb)| fb.len().cmp(&fa.len()).then(a.id.cmp(&b.id)));
    let mut stages_left = pp;
    let mut parts = Vec::new();
    for (n, f) in &free {
        let k = (f.len() / tp).min(stages_left);
        if k > 0 {
            parts.push((*n, f[..k * tp].to_vec()));
            stages_left -= k;
        }
        if stages_left == 0 {
            return Some(parts);
        }
    }
    let mut left = world;
    let mut parts = Vec::new();
    for (n, f) in free {
        let k = f.len().min(left);
        parts.push((n, f[..k].to_vec()));
        left -= k;
        if left == 0 {
            break;
        }
    }
    Some(parts)
}

/// "1 GPU" / "N CPU slots" (`unit` is (singular, plural)), with the sizes when the group
/// has more than one stage.
fn group_size(unit: (&str, &str), tp: usize, pp: usize) -> String {
    let n = count((tp * pp) as u64, unit.0, unit.1);
    if pp > 1 { format!("{n} (tensor_parallel_size {tp} x pipeline_parallel_size {pp})") } else { n }
}

fn pending_reason(cap: &Capacity<'_>, d: &DeploymentView, eligible: &[&NodeView], tp: usize, pp: usize) -> String {
    let schedulable = cap.nodes.iter().filter(|n| n.schedulable).count();
    let one_node = if pp > 1 { "" } else { " on one node" };
    if schedulable == 0 {
        return format!("needs {}{one_node}; no schedulable node", group_size(("slot", "slots"), tp, pp));
    }
    if eligible.is_empty() {
        let sel: Vec<String> = d.node_selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        return format!(
            "needs {}{one_node}; no schedulable node matches node_selector {{{}}}",
            group_size(("slot", "slots"), tp, pp),
            sel.join(",")
        );
    }
    let unit = if eligible.iter().any(|n| n.gpu) { ("GPU", "GPUs") } else { ("CPU slot", "CPU slots") };
    let free: Vec<(&NodeView, usize)> = eligible.iter().map(|n| (*n, cap.free(n).len())).collect();
    let largest = free.iter().map(|(_, f)| *f).max().unwrap_or(0);
    if pp == 1 && free.iter().filter(|(_, f)| *f > 0).count() <= 1 {
        // No split is possible: the group needs one node with room for it.
        return format!("needs {} on one node; largest free group is {largest}", count(tp as u64, unit.0, unit.1));
    }
    let listed: Vec<String> = free.iter().map(|(n, f)| format!("{} {f}", n.id)).collect();
    format!("needs {}; free: {}", group_size(unit, tp, pp), listed.join(", "))
}

#[cfg(test)]
mod tests;
