//! Planner tests: gangs, spread and pack, Pending reasons, GPU groups across nodes, evictions and scale-down order.

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
    acts.iter().filter_map(|a| if let Action::Create { placement, .. } = a { Some(placement) } else { None }).collect()
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
    assert_eq!(created(&acts).iter().map(|p| parts(p)).collect::<Vec<_>>(), vec![vec!["b:0:[0, 1, 2, 3]".to_owned()]]);
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
                reason: "needs 4 GPUs (tensor_parallel_size 2 x pipeline_parallel_size 2); free: node-a 1, node-b 1"
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
    assert_eq!(created(&acts).iter().map(|p| parts(p)).collect::<Vec<_>>(), vec![vec!["c:0:[0, 1, 2, 3]".to_owned()]]);
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
    let left: Vec<_> = rs.iter().filter(|r| r.state == ReplicaState::Starting).filter_map(|r| r.node.clone()).collect();
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

#[test]
fn pending_reasons_say_one_slot_in_the_singular() {
    let mut cpu = node("cpu", 1, &[]);
    cpu.gpu = false;
    let acts = plan(std::slice::from_ref(&cpu), &[dep("m", 1, 2)], &[]);
    let pending: Vec<&str> = acts
        .iter()
        .filter_map(|a| match a {
            Action::Create { placement: PlacementDecision::Pending { reason }, .. } => Some(reason.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(pending, vec!["needs 1 CPU slot on one node; largest free group is 0"]);
    cpu.schedulable = false;
    let acts = plan(&[cpu], &[dep("m", 1, 1)], &[]);
    assert!(
        matches!(&acts[0], Action::Create { placement: PlacementDecision::Pending { reason }, .. }
        if reason == "needs 1 slot on one node; no schedulable node"),
        "{acts:?}"
    );
}
