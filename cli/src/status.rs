//! `prism status`: the cluster as the head sees it — nodes (GPUs or, on nodes without GPUs,
//! CPU slots; state, cordon), deployments
//! (ready / current / target replicas, autoscaling bounds, prefix-cache hit rate and the
//! autoscaler's last decision with its reason and age), replicas (node, GPU group, state, reason) and their load — as
//! readable tables. A node without GPUs shows its CPU slots as used/total (CPU SLOTS
//! USED/TOTAL). A replica shows the indices of the GPUs or CPU slots it holds (GPUS, CPU SLOT
//! IDX; `-` for the other kind, and for both once it holds none: Pending, Stopped, Failed).
//! A replica of more than one rank shows its ranks per node (RANKS, e.g. `node-a:0-1
//! node-b:2-3` for a group across two nodes; NODE / GPUS / CPU SLOT IDX are the driver's).
//! Pending replicas of one deployment waiting for the same reason are shown as one row with
//! their count (a deployment scaled past the cluster's room may have thousands);
//! `prism status --all` lists each.

use crate::client;
use crate::table::Table;
use anyhow::Result;
use clap::Args;
use prism_common::proto::v1::{
    ClusterStatusRequest, ClusterStatusResponse, LoadReport, NodeRecord, NodeState, ReplicaRecord, ReplicaState,
};
use std::collections::{HashMap, HashSet};

/// `Ready` from `REPLICA_STATE_READY` (the enum's name without its prefix, capitalised).
fn pretty(name: &str, prefix: &str) -> String {
    let rest = name.strip_prefix(prefix).unwrap_or(name).to_ascii_lowercase();
    let mut chars = rest.chars();
    chars.next().map_or_else(String::new, |c| c.to_ascii_uppercase().to_string() + chars.as_str())
}

/// A replica state's display name (`Ready`, `Starting`, …).
pub fn replica_state_name(state: i32) -> String {
    ReplicaState::try_from(state).map_or_else(|_| format!("?{state}"), |s| pretty(s.as_str_name(), "REPLICA_STATE_"))
}

fn node_state_name(state: i32) -> String {
    NodeState::try_from(state).map_or_else(|_| format!("?{state}"), |s| pretty(s.as_str_name(), "NODE_STATE_"))
}

fn join_indices(indices: &[u32]) -> String {
    indices.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// A replica's ranks per node (`node-a:0-1 node-b:2-3`); empty for a one-rank replica.
fn ranks(r: &ReplicaRecord) -> String {
    let range = |first: u32, n: usize| {
        if n <= 1 { first.to_string() } else { format!("{first}-{}", first as usize + n - 1) }
    };
    if r.rank_groups.is_empty() {
        // Records from before groups could span nodes: every rank on `node_id`.
        return if r.gpu_indices.len() > 1 {
            format!("{}:{}", r.node_id, range(0, r.gpu_indices.len()))
        } else {
            String::new()
        };
    }
    if r.rank_groups.iter().map(|g| g.gpu_indices.len()).sum::<usize>() <= 1 {
        return String::new();
    }
    r.rank_groups
        .iter()
        .map(|g| format!("{}:{}", g.node_id, range(g.first_rank, g.gpu_indices.len())))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Whether the replica holds its GPUs or CPU slots now (the planner's rule: Starting,
/// Ready, Draining, Stopping); a Pending, Stopped or Failed replica's record may still name
/// the slots it had, which another replica may hold by now.
fn holds_slots(r: &ReplicaRecord) -> bool {
    ReplicaState::try_from(r.state).is_ok_and(prism_head::placement::planner::holds_slots)
}

/// The CPU slots in use on `node`: distinct slot indices held there by replicas (their
/// driver or a member part).
fn used_slots(node: &str, replicas: &[ReplicaRecord]) -> usize {
    let mut used = HashSet::new();
    for r in replicas.iter().filter(|r| holds_slots(r)) {
        if r.rank_groups.is_empty() {
            if r.node_id == node {
                used.extend(r.gpu_indices.iter().copied());
            }
        } else {
            used.extend(r.rank_groups.iter().filter(|g| g.node_id == node).flat_map(|g| g.gpu_indices.iter().copied()));
        }
    }
    used.len()
}

/// True when any rank of the replica runs on `node` (its driver or a member part).
fn on_node(r: &ReplicaRecord, node: &str) -> bool {
    r.node_id == node || r.rank_groups.iter().any(|g| g.node_id == node)
}

/// Drain progress of a node: time left to its deadline and requests still in flight on its
/// replicas (running + waiting, from the latest load reports); `drained` once no replica is
/// left on it (it stays cordoned until `prism uncordon`); `-` when not draining.
fn drain_progress(node: &NodeRecord, status: &ClusterStatusResponse, now_unix_ms: u64) -> String {
    if node.drain_deadline_unix_ms == 0 {
        return "-".to_owned();
    }
    let id = node.inventory.as_ref().map_or("", |i| i.node_id.as_str());
    let mine: Vec<&str> = status.replicas.iter().filter(|r| on_node(r, id)).map(|r| r.replica_id.as_str()).collect();
    if mine.is_empty() {
        return "drained".to_owned();
    }
    let in_flight: u32 =
        status.load.iter().filter(|l| mine.contains(&l.replica_id.as_str())).map(|l| l.running + l.waiting).sum();
    let left = node.drain_deadline_unix_ms.saturating_sub(now_unix_ms) / 1000;
    format!("{left}s left, {in_flight} in flight")
}

/// A deployment's prefix-cache hit rate: prompt tokens found cached over prompt tokens looked
/// up, summed over its replicas' latest load reports (cumulative since each engine started);
/// `-` before any lookup.
fn prefix_cache_hit_rate(deployment: &str, status: &ClusterStatusResponse) -> String {
    let mine: Vec<&str> =
        status.replicas.iter().filter(|r| r.deployment == deployment).map(|r| r.replica_id.as_str()).collect();
    let (queries, hits) = status
        .load
        .iter()
        .filter(|l| mine.contains(&l.replica_id.as_str()))
        .fold((0u64, 0u64), |(q, h), l| (q + l.prefix_cache_queries, h + l.prefix_cache_hits));
    if queries == 0 { "-".to_owned() } else { format!("{:.1}%", hits as f64 * 100.0 / queries as f64) }
}

/// The context length a deployment serves: what its replicas' engines reported (the
/// `max_model_len` given, or the model's own fitted to the KV cache when none was given),
/// else the one given, else `-`.
fn max_model_len(deployment: &str, configured: Option<u32>, status: &ClusterStatusResponse) -> String {
    let reported = status.replicas.iter().filter(|r| r.deployment == deployment).map(|r| r.max_model_len).max();
    match (reported.filter(|&n| n > 0), configured.filter(|&n| n > 0)) {
        (Some(n), _) | (None, Some(n)) => n.to_string(),
        (None, None) => "-".to_owned(),
    }
}

/// `prism status` arguments.
#[derive(Args, Debug, Default)]
pub struct StatusArgs {
    /// List every replica: by default Pending replicas of one deployment waiting for the
    /// same reason are shown as one row with their count.
    #[arg(long, short = 'a')]
    pub all: bool,
}

/// Renders a `ClusterStatusResponse` as the text `prism status` prints (`all`: one row per
/// replica, Pending ones included).
pub fn render(status: &ClusterStatusResponse, all: bool) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    render_at(status, now, all)
}

/// The rows of the replica table: each replica, except that Pending replicas with no node
/// are grouped by deployment and reason (unless `all`), a group shown once, where its first
/// replica comes, with how many it holds.
fn replica_rows(replicas: &[ReplicaRecord], all: bool) -> Vec<(&ReplicaRecord, usize)> {
    let unplaced = |r: &ReplicaRecord| r.state == ReplicaState::Pending as i32 && r.node_id.is_empty();
    let mut counts: HashMap<(&str, &str), usize> = HashMap::new();
    if !all {
        for r in replicas.iter().filter(|r| unplaced(r)) {
            *counts.entry((r.deployment.as_str(), r.reason.as_str())).or_default() += 1;
        }
    }
    let mut rows = Vec::new();
    for r in replicas {
        if all || !unplaced(r) {
            rows.push((r, 1));
        } else if let Some(n) = counts.remove(&(r.deployment.as_str(), r.reason.as_str())) {
            rows.push((r, n));
        }
    }
    rows
}

/// [`render`] at a given wall-clock time (unix milliseconds), for tests.
pub fn render_at(status: &ClusterStatusResponse, now_unix_ms: u64, all: bool) -> String {
    let mut out = String::new();
    let leader = if status.leader.is_empty() { "?" } else { status.leader.as_str() };
    out.push_str(&format!("Head leader: {leader}\n\n"));

    let mut nodes =
        Table::new(&["NODE", "ADDRESS", "STATE", "SCHED", "DRAIN", "GPUS", "CPU SLOTS USED/TOTAL", "LABELS"]);
    for node in &status.nodes {
        let inv = node.inventory.clone().unwrap_or_default();
        // A node offers GPUs, or CPU slots when it has none (the placer counts one or the other).
        let (gpus, cpu_slots) = if inv.gpus.is_empty() {
            ("-".to_owned(), format!("{}/{}", used_slots(&inv.node_id, &status.replicas), inv.cpu_slots))
        } else {
            let names: Vec<String> =
                inv.gpus.iter().map(|g| format!("{}:{} {}GiB", g.index, g.name, g.memory_bytes >> 30)).collect();
            let sim = if inv.simulated_gpus { " (simulated)" } else { "" };
            (format!("{}{sim}", names.join(", ")), "-".to_owned())
        };
        let mut labels: Vec<String> = inv.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
        labels.sort();
        // The planner places replicas only on Ready, uncordoned nodes: a node draining
        // itself (SIGTERM, spot notice) or Dead takes none though it is not cordoned.
        let sched = if node.cordoned {
            "cordoned"
        } else if node.state == NodeState::Ready as i32 {
            "schedulable"
        } else {
            "unschedulable"
        };
        let drain = drain_progress(node, status, now_unix_ms);
        nodes.row(vec![
            inv.node_id,
            inv.address,
            node_state_name(node.state),
            sched.into(),
            drain,
            gpus,
            cpu_slots,
            labels.join(","),
        ]);
    }
    out.push_str(&format!("Nodes ({}):\n", status.nodes.len()));
    out.push_str(&if nodes.is_empty() { "  (none)\n".to_owned() } else { nodes.render() });

    let mut deployments = Table::new(&[
        "DEPLOYMENT",
        "MODEL",
        "SERVED AS",
        "TP",
        "PP",
        "MAX LEN",
        "READY/DESIRED",
        "CURRENT",
        "AUTOSCALE",
        "PREFIX HIT",
    ]);
    let mut decisions = Vec::new();
    for d in &status.deployments {
        let spec = d.spec.clone().unwrap_or_default();
        let engine = spec.engine.clone().unwrap_or_default();
        let mine = || status.replicas.iter().filter(|r| r.deployment == spec.name);
        let ready = mine().filter(|r| r.state == ReplicaState::Ready as i32).count();
        // Replicas counted towards the target: Pending, Starting, Ready (not Draining/Stopping).
        let current = mine()
            .filter(|r| {
                [ReplicaState::Pending, ReplicaState::Starting, ReplicaState::Ready]
                    .map(|s| s as i32)
                    .contains(&r.state)
            })
            .count();
        let autoscale = spec
            .autoscaling
            .as_ref()
            .map_or_else(|| "-".to_owned(), |a| format!("{}-{}", a.min_replicas, a.max_replicas));
        if let Some(last) = &d.last_scaling {
            let age = now_unix_ms.saturating_sub(last.unix_ms) / 1000;
            decisions.push(format!(
                "  {}: {} -> {}, {age}s ago: {}\n",
                spec.name,
                last.from_replicas,
                prism_common::text::count(u64::from(last.to_replicas), "replica", "replicas"),
                last.reason
            ));
        }
        let hit_rate = prefix_cache_hit_rate(&spec.name, status);
        let max_len = max_model_len(&spec.name, engine.max_model_len, status);
        deployments.row(vec![
            spec.name,
            engine.model,
            engine.served_model_name,
            engine.tensor_parallel_size.to_string(),
            engine.pipeline_parallel_size.unwrap_or(1).to_string(),
            max_len,
            format!("{ready}/{}", spec.replicas),
            format!("{current}/{}", spec.replicas),
            autoscale,
            hit_rate,
        ]);
    }
    out.push_str(&format!("\nDeployments ({}):\n", status.deployments.len()));
    out.push_str(&if deployments.is_empty() { "  (none)\n".to_owned() } else { deployments.render() });
    if !decisions.is_empty() {
        out.push_str("\nLast scaling decisions:\n");
        out.push_str(&decisions.concat());
    }

    let load: HashMap<&str, &LoadReport> = status.load.iter().map(|l| (l.replica_id.as_str(), l)).collect();
    let cpu_nodes: HashSet<&str> = status
        .nodes
        .iter()
        .filter_map(|n| n.inventory.as_ref())
        .filter(|i| i.gpus.is_empty())
        .map(|i| i.node_id.as_str())
        .collect();
    let mut replicas = Table::new(&[
        "REPLICA",
        "DEPLOYMENT",
        "NODE",
        "GPUS",
        "CPU SLOT IDX",
        "STATE",
        "RUNNING",
        "WAITING",
        "KV",
        "RANKS",
        "REASON",
    ]);
    let rows = replica_rows(&status.replicas, all);
    let grouped = rows.iter().any(|(_, n)| *n > 1);
    for (r, n) in rows {
        // A group of identical Pending replicas: its count in place of a replica id.
        let id = if n > 1 { format!("×{n}") } else { r.replica_id.clone() };
        let (running, waiting, kv) = load.get(r.replica_id.as_str()).map_or_else(
            || ("-".to_owned(), "-".to_owned(), "-".to_owned()),
            |l| (l.running.to_string(), l.waiting.to_string(), format!("{:.0}%", l.kv_cache_usage * 100.0)),
        );
        let node = if r.node_id.is_empty() { "-".to_owned() } else { r.node_id.clone() };
        // The record's slots are GPU indices, or CPU slot indices on a node without GPUs;
        // shown only while the replica holds them.
        let slots =
            if r.gpu_indices.is_empty() || !holds_slots(r) { "-".to_owned() } else { join_indices(&r.gpu_indices) };
        let (gpus, cpu_slots) =
            if cpu_nodes.contains(r.node_id.as_str()) { ("-".to_owned(), slots) } else { (slots, "-".to_owned()) };
        replicas.row(vec![
            id,
            r.deployment.clone(),
            node,
            gpus,
            cpu_slots,
            replica_state_name(r.state),
            running,
            waiting,
            kv,
            ranks(r),
            r.reason.clone(),
        ]);
    }
    out.push_str(&format!("\nReplicas ({}):\n", status.replicas.len()));
    out.push_str(&if replicas.is_empty() { "  (none)\n".to_owned() } else { replicas.render() });
    if grouped {
        out.push_str("(×N: N Pending replicas of the deployment, waiting for the same reason; `prism status --all` lists each)\n");
    }
    if status.pending_gpus > 0 {
        // Pending replicas' devices: GPUs, or CPU slots on CPU-only clusters.
        let unmet = prism_common::text::count(u64::from(status.pending_gpus), "GPU or CPU slot", "GPUs or CPU slots");
        out.push_str(&format!("\nUnmet demand (Pending replicas): {unmet}\n"));
    }
    out
}

/// Runs `prism status`.
///
/// # Errors
/// Fails when the head is unreachable or refuses.
pub async fn run(head_addr: &client::HeadTarget, args: StatusArgs) -> Result<()> {
    let mut head = client::Head::connect(head_addr).await?;
    let status = head.call(|mut h| async move { h.cluster_status(ClusterStatusRequest {}).await }).await?;
    crate::output::write_stdout(&render(&status, args.all))
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_common::proto::v1::{GpuInfo, NodeInventory, RankGroup};

    #[test]
    fn render_lists_nodes_replicas_and_load() {
        let status = ClusterStatusResponse {
            leader: "127.0.0.1:50050".into(),
            is_leader: true,
            nodes: vec![NodeRecord {
                inventory: Some(NodeInventory {
                    node_id: "w1".into(),
                    address: "http://127.0.0.1:50061".into(),
                    gpus: vec![GpuInfo { index: 0, name: "H200".into(), memory_bytes: 141 << 30 }],
                    ..NodeInventory::default()
                }),
                state: NodeState::Ready as i32,
                cordoned: true,
                ..NodeRecord::default()
            }],
            replicas: vec![ReplicaRecord {
                replica_id: "smol-1234abcd".into(),
                deployment: "smol".into(),
                node_id: "w1".into(),
                gpu_indices: vec![0],
                state: ReplicaState::Ready as i32,
                ..ReplicaRecord::default()
            }],
            load: vec![LoadReport {
                replica_id: "smol-1234abcd".into(),
                running: 3,
                waiting: 1,
                kv_cache_usage: 0.25,
                tokens_in_flight: 10,
                ..LoadReport::default()
            }],
            ..ClusterStatusResponse::default()
        };
        let text = render(&status, false);
        assert!(text.contains("Nodes (1):"), "{text}");
        assert!(text.contains("0:H200 141GiB"), "{text}");
        assert!(text.contains("cordoned"), "{text}");
        let replica_line = text.lines().find(|l| l.starts_with("smol-1234abcd")).unwrap_or_default();
        let cells: Vec<&str> = replica_line.split_whitespace().collect();
        assert_eq!(cells, ["smol-1234abcd", "smol", "w1", "0", "-", "Ready", "3", "1", "25%"]);
    }

    #[test]
    fn cpu_nodes_show_cpu_slots_and_no_gpus() {
        let node = |id: &str, inv: NodeInventory| NodeRecord {
            inventory: Some(NodeInventory { node_id: id.into(), ..inv }),
            state: NodeState::Ready as i32,
            ..NodeRecord::default()
        };
        let replica = |id: &str, node: &str, slots: Vec<u32>| ReplicaRecord {
            replica_id: id.into(),
            deployment: "smol".into(),
            node_id: node.into(),
            gpu_indices: slots,
            state: ReplicaState::Ready as i32,
            ..ReplicaRecord::default()
        };
        let h200 = GpuInfo { index: 0, name: "H200".into(), memory_bytes: 141 << 30 };
        let status = ClusterStatusResponse {
            nodes: vec![
                node("cpu-1", NodeInventory { cpu_slots: 2, ..NodeInventory::default() }),
                node("gpu-1", NodeInventory { gpus: vec![h200], ..NodeInventory::default() }),
            ],
            replicas: vec![
                replica("on-cpu", "cpu-1", vec![1]),
                replica("on-gpu", "gpu-1", vec![0]),
                ReplicaRecord {
                    replica_id: "waiting".into(),
                    deployment: "smol".into(),
                    state: ReplicaState::Pending as i32,
                    ..ReplicaRecord::default()
                },
            ],
            ..ClusterStatusResponse::default()
        };
        let text = render_at(&status, 0, false);
        let cells = |first: &str| -> Vec<String> {
            let line = text.lines().find(|l| l.starts_with(first)).unwrap_or_default();
            line.split_whitespace().map(str::to_owned).collect()
        };
        assert!(text.contains("GPUS") && text.contains("CPU SLOTS USED/TOTAL"), "{text}");
        assert!(text.contains("CPU SLOT IDX"), "{text}");
        // Nodes: NODE ADDRESS(empty here) STATE SCHED DRAIN GPUS CPU SLOTS USED/TOTAL.
        assert_eq!(cells("cpu-1")[4..], ["-", "1/2"], "{text}");
        assert_eq!(cells("gpu-1")[4..], ["0:H200", "141GiB", "-"], "{text}");
        // Replicas: REPLICA DEPLOYMENT NODE GPUS CPU SLOT IDX STATE.
        assert_eq!(cells("on-cpu")[..6], ["on-cpu", "smol", "cpu-1", "-", "1", "Ready"], "{text}");
        assert_eq!(cells("on-gpu")[..6], ["on-gpu", "smol", "gpu-1", "0", "-", "Ready"], "{text}");
        assert_eq!(cells("waiting")[..6], ["waiting", "smol", "-", "-", "-", "Pending"], "{text}");
    }

    /// A Failed replica's record keeps the slot it had, which a new replica may hold now: it
    /// shows `-`, and only held slots count as used.
    #[test]
    fn replicas_that_hold_no_slot_show_none_and_nodes_count_the_held_ones() {
        let replica = |id: &str, state: ReplicaState, slots: Vec<u32>| ReplicaRecord {
            replica_id: id.into(),
            deployment: "smol".into(),
            node_id: "cpu-1".into(),
            gpu_indices: slots,
            state: state as i32,
            ..ReplicaRecord::default()
        };
        let status = ClusterStatusResponse {
            nodes: vec![NodeRecord {
                inventory: Some(NodeInventory { node_id: "cpu-1".into(), cpu_slots: 3, ..NodeInventory::default() }),
                state: NodeState::Ready as i32,
                ..NodeRecord::default()
            }],
            replicas: vec![
                replica("ready", ReplicaState::Ready, vec![0]),
                replica("failed", ReplicaState::Failed, vec![0]),
                replica("stopped", ReplicaState::Stopped, vec![2]),
                replica("draining", ReplicaState::Draining, vec![1]),
            ],
            ..ClusterStatusResponse::default()
        };
        let text = render_at(&status, 0, false);
        let cells = |first: &str| -> Vec<String> {
            let line = text.lines().find(|l| l.starts_with(first)).unwrap_or_default();
            line.split_whitespace().map(str::to_owned).collect()
        };
        assert_eq!(cells("cpu-1")[2..], ["schedulable", "-", "-", "2/3"], "{text}");
        assert_eq!(cells("ready")[3..6], ["-", "0", "Ready"], "{text}");
        assert_eq!(cells("failed")[3..6], ["-", "-", "Failed"], "{text}");
        assert_eq!(cells("stopped")[3..6], ["-", "-", "Stopped"], "{text}");
        assert_eq!(cells("draining")[3..6], ["-", "1", "Draining"], "{text}");
    }

    #[test]
    fn draining_node_shows_time_left_and_in_flight() {
        let status = ClusterStatusResponse {
            nodes: vec![NodeRecord {
                inventory: Some(NodeInventory { node_id: "w2".into(), cpu_slots: 1, ..NodeInventory::default() }),
                state: NodeState::Draining as i32,
                drain_deadline_unix_ms: 100_000,
                ..NodeRecord::default()
            }],
            replicas: vec![
                ReplicaRecord { replica_id: "a".into(), node_id: "w2".into(), ..ReplicaRecord::default() },
                ReplicaRecord { replica_id: "b".into(), node_id: "w9".into(), ..ReplicaRecord::default() },
            ],
            load: vec![
                LoadReport { replica_id: "a".into(), running: 2, waiting: 1, ..LoadReport::default() },
                LoadReport { replica_id: "b".into(), running: 7, ..LoadReport::default() },
            ],
            ..ClusterStatusResponse::default()
        };
        let text = render_at(&status, 58_000, false);
        assert!(text.contains("42s left, 3 in flight"), "{text}");
        // Draining itself (SIGTERM, not cordoned): nothing is placed on it.
        let line = text.lines().find(|l| l.starts_with("w2")).unwrap_or_default();
        assert!(line.contains("unschedulable"), "{line}");

        // Once its last replica has gone, the node reads as drained, at any time.
        let mut done = status.clone();
        done.replicas.retain(|r| r.node_id != "w2");
        for now in [58_000, 200_000] {
            let line =
                render_at(&done, now, false).lines().find(|l| l.starts_with("w2")).unwrap_or_default().to_owned();
            assert!(line.contains("drained") && !line.contains("left"), "{line}");
        }
    }

    #[test]
    fn deployments_show_current_vs_target_and_the_last_scaling_decision() {
        use prism_common::proto::v1::{AutoscalingConfig, DeploymentRecord, DeploymentSpec, ScalingDecision};
        let replica = |id: &str, state: ReplicaState| ReplicaRecord {
            replica_id: id.into(),
            deployment: "smol".into(),
            state: state as i32,
            ..ReplicaRecord::default()
        };
        let status = ClusterStatusResponse {
            deployments: vec![DeploymentRecord {
                spec: Some(DeploymentSpec {
                    name: "smol".into(),
                    replicas: 3,
                    autoscaling: Some(AutoscalingConfig { min_replicas: 1, max_replicas: 4, ..Default::default() }),
                    ..DeploymentSpec::default()
                }),
                last_scaling: Some(ScalingDecision {
                    unix_ms: 40_000,
                    from_replicas: 1,
                    to_replicas: 3,
                    reason: "ongoing 7.9 over 1 replica > target 2.0 for 2.0 s".into(),
                }),
                ..DeploymentRecord::default()
            }],
            replicas: vec![
                replica("a", ReplicaState::Ready),
                replica("b", ReplicaState::Starting),
                replica("c", ReplicaState::Draining),
            ],
            ..ClusterStatusResponse::default()
        };
        let text = render_at(&status, 52_500, false);
        let line = text.lines().find(|l| l.starts_with("smol ")).unwrap_or_default();
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cells[cells.len() - 4..cells.len() - 1], ["1/3", "2/3", "1-4"], "{text}");
        assert_eq!(cells[cells.len() - 1], "-", "no prefix-cache lookups yet: {text}");
        assert_eq!(cells[cells.len() - 5], "-", "no context length given or reported yet: {text}");
        assert!(
            text.contains("smol: 1 -> 3 replicas, 12s ago: ongoing 7.9 over 1 replica > target 2.0 for 2.0 s"),
            "{text}"
        );
    }

    /// MAX LEN: the context length the replicas' engines reported, else the one given.
    #[test]
    fn deployments_show_the_context_length_served() {
        use prism_common::proto::v1::{DeploymentRecord, DeploymentSpec, EngineConfig};
        let dep = |name: &str, max_model_len: Option<u32>| DeploymentRecord {
            spec: Some(DeploymentSpec {
                name: name.into(),
                replicas: 1,
                engine: Some(EngineConfig { max_model_len, ..EngineConfig::default() }),
                ..DeploymentSpec::default()
            }),
            ..DeploymentRecord::default()
        };
        let replica = |d: &str, max_model_len: u32| ReplicaRecord {
            replica_id: format!("{d}-1"),
            deployment: d.into(),
            max_model_len,
            ..ReplicaRecord::default()
        };
        let status = ClusterStatusResponse {
            deployments: vec![dep("fitted", None), dep("given", Some(2048)), dep("loading", Some(1024))],
            replicas: vec![replica("fitted", 5824), replica("given", 2048), replica("loading", 0)],
            ..ClusterStatusResponse::default()
        };
        let text = render_at(&status, 0, false);
        let cell = |name: &str| {
            let line = text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_default();
            let cells: Vec<&str> = line.split_whitespace().collect();
            cells.get(cells.len().wrapping_sub(5)).copied().unwrap_or_default().to_owned()
        };
        assert!(text.contains("MAX LEN"), "{text}");
        assert_eq!((cell("fitted"), cell("given"), cell("loading")), ("5824".into(), "2048".into(), "1024".into()));
    }

    /// The hit rate sums hits and queries over the deployment's own replicas only.
    #[test]
    fn deployments_show_their_prefix_cache_hit_rate() {
        use prism_common::proto::v1::{DeploymentRecord, DeploymentSpec};
        let dep = |name: &str| DeploymentRecord {
            spec: Some(DeploymentSpec { name: name.into(), replicas: 2, ..DeploymentSpec::default() }),
            ..DeploymentRecord::default()
        };
        let replica = |id: &str, d: &str| ReplicaRecord {
            replica_id: id.into(),
            deployment: d.into(),
            state: ReplicaState::Ready as i32,
            ..ReplicaRecord::default()
        };
        let load = |id: &str, q: u64, h: u64| LoadReport {
            replica_id: id.into(),
            prefix_cache_queries: q,
            prefix_cache_hits: h,
            ..LoadReport::default()
        };
        let status = ClusterStatusResponse {
            deployments: vec![dep("chat"), dep("cold"), dep("rag")],
            replicas: vec![replica("a", "chat"), replica("b", "chat"), replica("c", "cold"), replica("d", "rag")],
            load: vec![load("a", 300, 200), load("b", 100, 50), load("c", 0, 0), load("d", 64, 64)],
            ..ClusterStatusResponse::default()
        };
        let text = render_at(&status, 0, false);
        let last_cell = |name: &str| {
            let line = text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_default();
            line.split_whitespace().last().unwrap_or_default().to_owned()
        };
        assert!(text.contains("PREFIX HIT"), "{text}");
        assert_eq!(last_cell("chat"), "62.5%", "{text}");
        assert_eq!(last_cell("cold"), "-", "{text}");
        assert_eq!(last_cell("rag"), "100.0%", "{text}");
    }

    #[test]
    fn group_replicas_show_their_ranks_per_node_and_pending_reasons_whole() {
        let group =
            |node: &str, first_rank: u32| RankGroup { node_id: node.into(), first_rank, gpu_indices: vec![0, 1] };
        let reason = "needs 4 GPUs (tensor_parallel_size 2 x pipeline_parallel_size 2); free: node-a 1, node-b 1";
        let status = ClusterStatusResponse {
            nodes: vec![NodeRecord {
                inventory: Some(NodeInventory { node_id: "node-b".into(), cpu_slots: 2, ..NodeInventory::default() }),
                state: NodeState::Draining as i32,
                drain_deadline_unix_ms: 10_000,
                ..NodeRecord::default()
            }],
            replicas: vec![
                ReplicaRecord {
                    replica_id: "big-1".into(),
                    deployment: "big".into(),
                    node_id: "node-a".into(),
                    gpu_indices: vec![0, 1],
                    rank_groups: vec![group("node-a", 0), group("node-b", 2)],
                    state: ReplicaState::Ready as i32,
                    ..ReplicaRecord::default()
                },
                ReplicaRecord {
                    replica_id: "big-2".into(),
                    deployment: "big".into(),
                    state: ReplicaState::Pending as i32,
                    reason: reason.into(),
                    ..ReplicaRecord::default()
                },
                ReplicaRecord {
                    replica_id: "tp2-1".into(),
                    node_id: "node-c".into(),
                    gpu_indices: vec![2, 3],
                    ..ReplicaRecord::default()
                },
            ],
            load: vec![LoadReport { replica_id: "big-1".into(), running: 4, ..LoadReport::default() }],
            ..ClusterStatusResponse::default()
        };
        let text = render_at(&status, 0, false);
        assert!(text.contains("RANKS"), "{text}");
        let line = |id: &str| text.lines().find(|l| l.starts_with(id)).unwrap_or_default().to_owned();
        assert!(line("big-1").ends_with("node-a:0-1 node-b:2-3"), "{text}");
        assert!(line("big-2").ends_with(reason), "the reason is shown whole: {text}");
        assert!(line("tp2-1").ends_with("node-c:0-1"), "{text}");
        // The member node's drain counts the group's requests.
        assert!(text.contains("10s left, 4 in flight"), "{text}");
    }

    /// Pending replicas of a deployment waiting for the same reason make one row with their
    /// count; `--all` lists each.
    #[test]
    fn identical_pending_replicas_show_once_with_their_count() {
        let replica = |id: String, d: &str, state: ReplicaState, reason: &str| ReplicaRecord {
            replica_id: id,
            deployment: d.into(),
            state: state as i32,
            reason: reason.into(),
            node_id: if state == ReplicaState::Pending { String::new() } else { "w1".into() },
            ..ReplicaRecord::default()
        };
        let no_room = "needs 1 CPU slot on one node; largest free group is 0";
        let mut replicas = vec![replica("smol-ready".into(), "smol", ReplicaState::Ready, "")];
        replicas.extend((0..4997).map(|i| replica(format!("smol-{i}"), "smol", ReplicaState::Pending, no_room)));
        replicas
            .extend((0..2).map(|i| replica(format!("smol-sel-{i}"), "smol", ReplicaState::Pending, "no node matches")));
        replicas.extend((0..3).map(|i| replica(format!("gemma-{i}"), "gemma", ReplicaState::Pending, no_room)));
        let status = ClusterStatusResponse { replicas, ..ClusterStatusResponse::default() };

        let text = render_at(&status, 0, false);
        let pending: Vec<Vec<&str>> = text
            .lines()
            .filter(|l| l.contains("Pending") && !l.starts_with('('))
            .map(|l| l.split_whitespace().take(3).collect())
            .collect();
        assert_eq!(pending, [["×4997", "smol", "-"], ["×2", "smol", "-"], ["×3", "gemma", "-"]], "{text}");
        assert!(text.contains("Replicas (5003):") && text.contains("smol-ready"), "{text}");
        assert!(text.lines().any(|l| l.starts_with("×4997") && l.ends_with(no_room)), "{text}");
        assert!(text.contains("`prism status --all` lists each"), "{text}");

        let all = render_at(&status, 0, true);
        assert_eq!(all.lines().filter(|l| l.contains("Pending")).count(), 5002, "one line per replica");
        assert!(!all.contains('×'), "nothing grouped with --all");
    }

    #[test]
    fn state_names_are_readable() {
        assert_eq!(replica_state_name(ReplicaState::Starting as i32), "Starting");
        assert_eq!(node_state_name(NodeState::Draining as i32), "Draining");
        assert_eq!(replica_state_name(99), "?99");
    }
}
