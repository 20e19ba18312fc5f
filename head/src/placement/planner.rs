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
    /// Failed after having been Ready, and its restart delay has passed: stop it and
    /// create a replacement (startup failures keep `false`, so they never loop).
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

/// "N GPUs" / "N CPU slots", with the sizes when the group has more than one stage.
fn group_size(unit: &str, tp: usize, pp: usize) -> String {
    if pp > 1 {
        format!("{} {unit} (tensor_parallel_size {tp} x pipeline_parallel_size {pp})", tp * pp)
    } else {
        format!("{tp} {unit}")
    }
}

fn pending_reason(cap: &Capacity<'_>, d: &DeploymentView, eligible: &[&NodeView], tp: usize, pp: usize) -> String {
    let schedulable = cap.nodes.iter().filter(|n| n.schedulable).count();
    let one_node = if pp > 1 { "" } else { " on one node" };
    if schedulable == 0 {
        return format!("needs {}{one_node}; no schedulable node", group_size("slots", tp, pp));
    }
    if eligible.is_empty() {
        let sel: Vec<String> = d.node_selector.iter().map(|(k, v)| format!("{k}={v}")).collect();
        return format!(
            "needs {}{one_node}; no schedulable node matches node_selector {{{}}}",
            group_size("slots", tp, pp),
            sel.join(",")
        );
    }
    let unit = if eligible.iter().any(|n| n.gpu) { "GPUs" } else { "CPU slots" };
    let free: Vec<(&NodeView, usize)> = eligible.iter().map(|n| (*n, cap.free(n).len())).collect();
    let largest = free.iter().map(|(_, f)| *f).max().unwrap_or(0);
    if pp == 1 && free.iter().filter(|(_, f)| *f > 0).count() <= 1 {
        // No split is possible: the group needs one node with room for it.
        return format!("needs {tp} {unit} on one node; largest free group is {largest}");
    }
    let listed: Vec<String> = free.iter().map(|(n, f)| format!("{} {f}", n.id)).collect();
    format!("needs {}; free: {}", group_size(unit, tp, pp), listed.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, gpus: u32, labels: &[(&str, &str)]) -> NodeView {
        NodeView {
            id: id.into(),
            slots: (0..gpus).collect(),
            gpu: true,
            labels: labels.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect(),
            schedulable: true,
            alive: true,
        }
    }

    fn dep(name: &str, tp: u32, replicas: u32) -> DeploymentView {
        DeploymentView {
            name: name.into(),
            tensor_parallel_size: tp,
            pipeline_parallel_size: 1,
            replicas,
            strategy: PlacementStrategy::Spread,
            node_selector: BTreeMap::new(),
            min_on_demand: 0,
            generation: 1,
        }
    }

    /// Applies actions the way the reconciler does (placed replicas become Starting).
    fn apply(replicas: &mut Vec<ReplicaView>, actions: &[Action]) {
        let mut next = replicas.len();
        for a in actions {
            match a {
                Action::Create { deployment, generation, placement } => {
                    next += 1;
                    let mut r = ReplicaView {
                        id: format!("{deployment}-{next:04}").into(),
                        deployment: deployment.clone(),
                        node: None,
                        slots: vec![],
                        members: vec![],
                        state: ReplicaState::Pending,
                        reason: String::new(),
                        generation: *generation,
                        restart_due: false,
                        load: 0,
                    };
                    set(&mut r, placement);
                    replicas.push(r);
                }
                Action::Place { replica, placement } => {
                    if let Some(r) = replicas.iter_mut().find(|r| &r.id == replica) {
                        set(r, placement);
                    }
                }
                Action::Remove { replica } => {
                    if let Some(r) = replicas.iter_mut().find(|r| &r.id == replica) {
                        r.state = ReplicaState::Draining;
                    }
                }
                Action::Evict { replica } => replicas.retain(|r| &r.id != replica),
            }
        }
    }

    fn set(r: &mut ReplicaView, p: &PlacementDecision) {
        match p {
            PlacementDecision::Assigned { node, slots, groups } => {
                assert_eq!((&groups[0].node, &groups[0].slots), (node, slots), "the driver's part comes first");
                r.node = Some(node.clone());
                r.slots = slots.clone();
                r.members = groups[1..].iter().map(|g| (g.node.clone(), g.slots.clone())).collect();
                r.state = ReplicaState::Starting;
                r.reason.clear();
            }
            PlacementDecision::Pending { reason } => {
                r.state = ReplicaState::Pending;
                r.reason = reason.clone();
            }
        }
    }

    fn no_slot_twice(replicas: &[ReplicaView]) {
        let mut seen = BTreeSet::new();
        for r in replicas.iter().filter(|r| holds_slots(r.state)) {
            let driver = r.node.clone().map(|n| (n, r.slots.clone()));
            for (node, slots) in driver.into_iter().chain(r.members.iter().cloned()) {
                for s in slots {
                    assert!(seen.insert((node.0.clone(), s)), "slot {s} of {node} used twice");
                }
            }
        }
    }

    #[test]
    fn tp2_three_replicas_gang_and_spread_over_two_nodes() {
        let nodes = vec![node("a", 4, &[]), node("b", 4, &[])];
        let deps = vec![dep("llama", 2, 3)];
        let mut rs = Vec::new();
        let acts = plan(&nodes, &deps, &rs);
        assert_eq!(acts.len(), 3);
        apply(&mut rs, &acts);
        no_slot_twice(&rs);
        let mut per_node = BTreeMap::new();
        for r in &rs {
            assert_eq!(r.state, ReplicaState::Starting);
            assert_eq!(r.slots.len(), 2);
            *per_node.entry(r.node.clone().map(|n| n.0)).or_insert(0) += 1;
        }
        assert_eq!(per_node.len(), 2, "spread over both nodes: {per_node:?}");
        // Idempotent: nothing more to do.
        assert!(plan(&nodes, &deps, &rs).is_empty());
    }

    #[test]
    fn fifth_replica_pending_with_reason_then_third_node_places_it() {
        let mut nodes = vec![node("a", 4, &[]), node("b", 4, &[])];
        let deps = vec![dep("llama", 2, 5)];
        let mut rs = Vec::new();
        let acts = plan(&nodes, &deps, &rs);
        apply(&mut rs, &acts);
        no_slot_twice(&rs);
        let pending: Vec<_> = rs.iter().filter(|r| r.state == ReplicaState::Pending).collect();
        assert_eq!(pending.len(), 1);
        assert_eq!(pending[0].reason, "needs 2 GPUs on one node; largest free group is 0");
        // Unchanged reason: no rewrite.
        assert!(plan(&nodes, &deps, &rs).is_empty());
        nodes.push(node("c", 4, &[]));
        let acts = plan(&nodes, &deps, &rs);
        assert_eq!(acts.len(), 1);
        assert!(
            matches!(&acts[0], Action::Place { placement: PlacementDecision::Assigned { node, .. }, .. } if node.as_str() == "c")
        );
    }

    /// The groups of a placement as `node:first_rank:slots`.
    fn parts(p: &PlacementDecision) -> Vec<String> {
        let PlacementDecision::Assigned { groups, .. } = p else { panic!("not placed: {p:?}") };
        groups.iter().map(|g| format!("{}:{}:{:?}", g.node, g.first_rank, g.slots)).collect()
    }

    fn created(acts: &[Action]) -> Vec<&PlacementDecision> {
        acts.iter()
            .filter_map(|a| if let Action::Create { placement, .. } = a { Some(placement) } else { None })
            .collect()
    }

    fn dep_pp(name: &str, tp: u32, pp: u32, replicas: u32) -> DeploymentView {
        DeploymentView { pipeline_parallel_size: pp, ..dep(name, tp, replicas) }
    }

    #[test]
    fn eight_gpus_split_across_nodes_only_when_no_node_holds_them() {
        // A group splits only when no node holds it whole: 8 GPUs on two 4-GPU nodes is
        // tensor parallelism across the two, ranks in order.
        let nodes = vec![node("a", 4, &[]), node("b", 4, &[])];
        let acts = plan(&nodes, &[dep("big", 8, 1)], &[]);
        assert_eq!(
            created(&acts).iter().map(|p| parts(p)).collect::<Vec<_>>(),
            vec![vec!["a:0:[0, 1, 2, 3]".to_owned(), "b:4:[0, 1, 2, 3]".to_owned()]]
        );
        // A node with 8 GPUs holds it whole, even when the other nodes have room together.
        let nodes = vec![node("a", 4, &[]), node("b", 4, &[]), node("c", 8, &[])];
        let acts = plan(&nodes, &[dep("big", 8, 1)], &[]);
        assert_eq!(
            created(&acts).iter().map(|p| parts(p)).collect::<Vec<_>>(),
            vec![vec!["c:0:[0, 1, 2, 3, 4, 5, 6, 7]".to_owned()]]
        );
        // 9 GPUs fit nowhere, not even split: Pending, naming what is free.
        let acts = plan(&nodes[..2], &[dep("big", 9, 1)], &[]);
        assert_eq!(
            acts,
            vec![Action::Create {
                deployment: "big".into(),
                generation: 1,
                placement: PlacementDecision::Pending { reason: "needs 9 GPUs; free: a 4, b 4".into() },
            }]
        );
    }

    #[test]
    fn one_node_holding_the_group_gets_all_of_it() {
        let nodes = vec![node("a", 2, &[]), node("b", 4, &[])];
        let acts = plan(&nodes, &[dep_pp("m", 2, 2, 1)], &[]);
        assert_eq!(
            created(&acts).iter().map(|p| parts(p)).collect::<Vec<_>>(),
            vec![vec!["b:0:[0, 1, 2, 3]".to_owned()]]
        );
    }

    #[test]
    fn tp_inside_a_node_pp_across_nodes() {
        let nodes = vec![node("b", 2, &[]), node("a", 2, &[])];
        let deps = vec![dep_pp("m", 2, 2, 1)];
        let mut rs = Vec::new();
        let acts = plan(&nodes, &deps, &rs);
        assert_eq!(
            created(&acts).iter().map(|p| parts(p)).collect::<Vec<_>>(),
            vec![vec!["a:0:[0, 1]".to_owned(), "b:2:[0, 1]".to_owned()]]
        );
        apply(&mut rs, &acts);
        assert_eq!(rs[0].node.as_ref().map(NodeId::as_str), Some("a"), "rank 0's node is the driver's");
        assert!(plan(&nodes, &deps, &rs).is_empty(), "idempotent");
        // Whole stages first: a 3-GPU node takes one stage of 2 (not 3 ranks), the rest of
        // the stages go to the next nodes in order.
        let nodes = vec![node("a", 3, &[]), node("b", 2, &[]), node("c", 2, &[])];
        let acts = plan(&nodes, &[dep_pp("m", 2, 3, 1)], &[]);
        assert_eq!(
            created(&acts).iter().map(|p| parts(p)).collect::<Vec<_>>(),
            vec![vec!["a:0:[0, 1]".to_owned(), "b:2:[0, 1]".to_owned(), "c:4:[0, 1]".to_owned()]]
        );
    }

    #[test]
    fn tp_larger_than_any_node_splits_ranks_in_order() {
        let nodes = vec![node("a", 2, &[]), node("b", 2, &[])];
        let acts = plan(&nodes, &[dep("m", 4, 1)], &[]);
        assert_eq!(
            created(&acts).iter().map(|p| parts(p)).collect::<Vec<_>>(),
            vec![vec!["a:0:[0, 1]".to_owned(), "b:2:[0, 1]".to_owned()]]
        );
        // Fragmented free slots: whole stages cannot cover tp=2 x pp=2 on 3 + 1 free GPUs,
        // so the ranks go in order (rank 3 alone on b).
        let nodes = vec![node("a", 3, &[]), node("b", 1, &[])];
        let acts = plan(&nodes, &[dep_pp("m", 2, 2, 1)], &[]);
        assert_eq!(
            created(&acts).iter().map(|p| parts(p)).collect::<Vec<_>>(),
            vec![vec!["a:0:[0, 1, 2]".to_owned(), "b:3:[0]".to_owned()]]
        );
    }

    #[test]
    fn short_capacity_places_nothing_and_names_the_numbers() {
        let nodes = vec![node("node-a", 1, &[]), node("node-b", 1, &[])];
        let acts = plan(&nodes, &[dep_pp("m", 2, 2, 1)], &[]);
        assert_eq!(
            acts,
            vec![Action::Create {
                deployment: "m".into(),
                generation: 1,
                placement: PlacementDecision::Pending {
                    reason:
                        "needs 4 GPUs (tensor_parallel_size 2 x pipeline_parallel_size 2); free: node-a 1, node-b 1"
                            .into()
                },
            }]
        );
        let mut cpu = node("cpu", 2, &[]);
        cpu.gpu = false;
        let acts = plan(&[cpu], &[dep_pp("m", 1, 3, 1)], &[]);
        assert!(matches!(&acts[0], Action::Create { placement: PlacementDecision::Pending { reason }, .. }
            if reason == "needs 3 CPU slots (tensor_parallel_size 1 x pipeline_parallel_size 3); free: cpu 2"));
    }

    #[test]
    fn split_groups_are_counted_on_every_node() {
        let nodes = vec![node("a", 2, &[]), node("b", 3, &[])];
        let deps = vec![dep_pp("m", 2, 2, 2)];
        let mut rs = Vec::new();
        let acts = plan(&nodes, &deps, &rs);
        apply(&mut rs, &acts);
        no_slot_twice(&rs);
        assert_eq!(rs[0].node.as_ref().map(NodeId::as_str), Some("b"));
        assert_eq!(rs[0].slots, vec![0, 1]);
        assert_eq!(rs[0].members, vec![(NodeId::from("a"), vec![0, 1])]);
        // One GPU is left (b's third): the second replica waits, and stays waiting.
        assert_eq!(rs[1].state, ReplicaState::Pending);
        assert_eq!(rs[1].reason, "needs 4 GPUs (tensor_parallel_size 2 x pipeline_parallel_size 2); free: a 0, b 1");
        assert!(plan(&nodes, &deps, &rs).is_empty());
        // A third node: the second replica goes on b's last GPU and c's, still no slot twice.
        let nodes = vec![node("a", 2, &[]), node("b", 3, &[]), node("c", 3, &[])];
        let acts = plan(&nodes, &deps, &rs);
        // Whole stages do not cover it (c holds one stage, b one GPU): ranks in order.
        let placed: Vec<Vec<String>> = acts
            .iter()
            .map(|a| match a {
                Action::Place { placement, .. } => parts(placement),
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(placed, vec![vec!["c:0:[0, 1, 2]".to_owned(), "b:3:[2]".to_owned()]]);
        apply(&mut rs, &acts);
        no_slot_twice(&rs);
    }

    #[test]
    fn a_dead_member_node_evicts_the_replica() {
        let mut nodes = vec![node("a", 2, &[]), node("b", 2, &[]), node("c", 4, &[])];
        nodes[2].schedulable = false;
        let deps = vec![dep_pp("m", 2, 2, 1)];
        let mut rs = Vec::new();
        let acts = plan(&nodes, &deps, &rs);
        apply(&mut rs, &acts);
        assert_eq!(rs[0].members, vec![(NodeId::from("b"), vec![0, 1])]);
        nodes[1].alive = false;
        nodes[1].schedulable = false;
        nodes[2].schedulable = true;
        let acts = plan(&nodes, &deps, &rs);
        assert_eq!(acts[0], Action::Evict { replica: rs[0].id.clone() });
        assert_eq!(
            created(&acts).iter().map(|p| parts(p)).collect::<Vec<_>>(),
            vec![vec!["c:0:[0, 1, 2, 3]".to_owned()]]
        );
    }

    #[test]
    fn cordoned_dead_and_unselected_nodes_are_skipped() {
        let mut a = node("a", 4, &[("zone", "x")]);
        a.schedulable = false;
        let b = node("b", 4, &[("zone", "y")]);
        let c = node("c", 4, &[("zone", "x")]);
        let mut d = dep("m", 1, 2);
        d.node_selector.insert("zone".into(), "x".into());
        let mut rs = Vec::new();
        let acts = plan(&[a, b, c], &[d], &rs);
        apply(&mut rs, &acts);
        assert!(rs.iter().all(|r| r.node.as_ref().map(NodeId::as_str) == Some("c")));
        let mut d2 = dep("m", 1, 1);
        d2.node_selector.insert("gpu".into(), "h100".into());
        let acts = plan(&[node("z", 1, &[])], &[d2], &[]);
        assert!(matches!(&acts[0], Action::Create { placement: PlacementDecision::Pending { reason }, .. }
            if reason.contains("node_selector {gpu=h100}")));
    }

    #[test]
    fn on_demand_preferred_for_first_replicas() {
        let nodes = vec![
            node("a-spot", 2, &[(CAPACITY_TYPE_LABEL, "spot")]),
            node("b-spot", 2, &[(CAPACITY_TYPE_LABEL, "spot")]),
            node("z-od", 2, &[(CAPACITY_TYPE_LABEL, ON_DEMAND)]),
        ];
        let mut d = dep("m", 1, 3);
        d.min_on_demand = 2;
        let mut rs = Vec::new();
        let acts = plan(&nodes, &[d], &rs);
        apply(&mut rs, &acts);
        let od = rs.iter().filter(|r| r.node.as_ref().map(NodeId::as_str) == Some("z-od")).count();
        assert_eq!(od, 2);
    }

    #[test]
    fn dead_node_replicas_are_evicted_and_replaced() {
        let mut nodes = vec![node("a", 4, &[]), node("b", 4, &[])];
        let deps = vec![dep("m", 2, 2)];
        let mut rs = Vec::new();
        let acts = plan(&nodes, &deps, &rs);
        apply(&mut rs, &acts);
        nodes[0].alive = false;
        nodes[0].schedulable = false;
        let acts = plan(&nodes, &deps, &rs);
        assert_eq!(acts.iter().filter(|a| matches!(a, Action::Evict { .. })).count(), 1);
        apply(&mut rs, &acts);
        no_slot_twice(&rs);
        assert_eq!(rs.len(), 2);
        assert!(rs.iter().all(|r| r.node.as_ref().map(NodeId::as_str) == Some("b")));
    }

    #[test]
    fn scale_down_removes_pending_first_then_most_crowded() {
        let nodes = vec![node("a", 4, &[]), node("b", 2, &[])];
        let deps = vec![dep("m", 1, 6)];
        let mut rs = Vec::new();
        let acts = plan(&nodes, &deps, &rs);
        apply(&mut rs, &acts);
        assert_eq!(rs.iter().filter(|r| r.state == ReplicaState::Starting).count(), 6);
        let acts = plan(&nodes, &[dep("m", 1, 2)], &rs);
        assert_eq!(acts.len(), 4);
        apply(&mut rs, &acts);
        let left: Vec<_> =
            rs.iter().filter(|r| r.state == ReplicaState::Starting).filter_map(|r| r.node.clone()).collect();
        assert_eq!(left.len(), 2);
        assert_ne!(left[0], left[1], "survivors stay spread");
        // Draining replicas keep their GPUs until stopped.
        no_slot_twice(&rs);
        assert!(plan(&nodes, &[dep("m", 1, 2)], &rs).is_empty());
    }

    #[test]
    fn scale_down_goes_pending_then_starting_then_the_least_loaded_ready_one() {
        let nodes = vec![node("a", 2, &[]), node("b", 1, &[])];
        let mut rs = Vec::new();
        let acts = plan(&nodes, &[dep("m", 1, 3)], &rs);
        apply(&mut rs, &acts);
        for (r, load) in rs.iter_mut().zip([5, 1, 3]) {
            r.state = ReplicaState::Ready;
            r.load = load;
        }
        // Scale up by two (one Starting, one Pending: no slot left), then at once back to 3.
        let acts = plan(&nodes, &[dep("m", 1, 4)], &rs);
        apply(&mut rs, &acts);
        rs.push(ReplicaView { id: "m-pending".into(), node: None, slots: vec![], ..rs[0].clone() });
        rs.last_mut().expect("pushed").state = ReplicaState::Pending;
        assert_eq!(rs.iter().filter(|r| r.state == ReplicaState::Starting).count(), 0, "no free slot: {rs:?}");
        // Free a slot so the 4th is Starting.
        let mut nodes = nodes;
        nodes.push(node("c", 1, &[]));
        let acts = plan(&nodes, &[dep("m", 1, 5)], &rs);
        apply(&mut rs, &acts);
        let starting: Vec<ReplicaId> =
            rs.iter().filter(|r| r.state == ReplicaState::Starting).map(|r| r.id.clone()).collect();
        assert_eq!(starting.len(), 1, "{rs:?}");
        let ready_before: Vec<ReplicaId> =
            rs.iter().filter(|r| r.state == ReplicaState::Ready).map(|r| r.id.clone()).collect();
        // 5 -> 3: the Pending one and the Starting one go; every Ready replica stays.
        let acts = plan(&nodes, &[dep("m", 1, 3)], &rs);
        let removed: Vec<&ReplicaId> =
            acts.iter().filter_map(|a| if let Action::Remove { replica } = a { Some(replica) } else { None }).collect();
        assert_eq!(removed.len(), 2, "{acts:?}");
        assert!(removed.iter().all(|id| !ready_before.contains(id)), "a Ready replica removed: {acts:?}");
        assert!(removed.contains(&&starting[0]));
        apply(&mut rs, &acts);
        // 3 -> 2: the least-loaded Ready replica (load 1) drains.
        let acts = plan(&nodes, &[dep("m", 1, 2)], &rs);
        let Some(Action::Remove { replica }) = acts.first() else { panic!("{acts:?}") };
        assert_eq!(rs.iter().find(|r| &r.id == replica).map(|r| r.load), Some(1));
    }

    #[test]
    fn failed_replicas_count_and_free_their_slots() {
        let nodes = vec![node("a", 1, &[])];
        let deps = vec![dep("m", 1, 1)];
        let mut rs = Vec::new();
        let acts = plan(&nodes, &deps, &rs);
        apply(&mut rs, &acts);
        rs[0].state = ReplicaState::Failed;
        // Not retried in a loop.
        assert!(plan(&nodes, &deps, &rs).is_empty());
        // Once its restart is due (it failed after being Ready), it is removed and replaced
        // on the slot it frees.
        rs[0].restart_due = true;
        let acts = plan(&nodes, &deps, &rs);
        assert_eq!(acts.len(), 2, "{acts:?}");
        assert_eq!(acts[0], Action::Remove { replica: rs[0].id.clone() });
        assert!(
            matches!(&acts[1], Action::Create { placement: PlacementDecision::Assigned { slots, .. }, .. } if *slots == vec![0])
        );
        rs[0].restart_due = false;
        // A new generation replaces it, and its GPU is free again.
        let mut d2 = dep("m", 1, 1);
        d2.generation = 2;
        let acts = plan(&nodes, &[d2], &rs);
        assert_eq!(acts.len(), 2);
        assert!(matches!(&acts[1], Action::Create { placement: PlacementDecision::Assigned { .. }, .. }));
    }

    #[test]
    fn deleted_deployment_replicas_removed_and_cpu_nodes_offer_slots() {
        let mut cpu = node("cpu", 2, &[]);
        cpu.gpu = false;
        let mut rs = Vec::new();
        let acts = plan(&[cpu.clone()], &[dep("m", 2, 1)], &rs);
        apply(&mut rs, &acts);
        assert_eq!(rs[0].slots, vec![0, 1]);
        let acts = plan(&[cpu.clone()], &[dep("n", 1, 1)], &rs);
        assert!(acts.contains(&Action::Remove { replica: rs[0].id.clone() }));
        let acts = plan(&[cpu], &[dep("n", 3, 1)], &[]);
        assert!(matches!(&acts[0], Action::Create { placement: PlacementDecision::Pending { reason }, .. }
            if reason == "needs 3 CPU slots on one node; largest free group is 2"));
    }

    #[test]
    fn pack_fills_one_node_first() {
        let nodes = vec![node("a", 4, &[]), node("b", 4, &[])];
        let mut d = dep("m", 1, 3);
        d.strategy = PlacementStrategy::Pack;
        let mut rs = Vec::new();
        let acts = plan(&nodes, &[d], &rs);
        apply(&mut rs, &acts);
        let first = rs[0].node.clone();
        assert!(rs.iter().all(|r| r.node == first));
    }
}
