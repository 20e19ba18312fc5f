//! Rank processes of parallel replicas, found from `/proc`: every process started with
//! `PRISM_RANK_SPEC` in its environment (the rank spec, JSON), grouped by the driver's
//! rendezvous they joined (one rendezvous per replica's group; [`crate::Cluster::rank_groups`]
//! keeps those of one cluster's workers); and signals to them.

use anyhow::{Context, Result};
use nix::sys::signal::Signal;
use std::collections::BTreeMap;

/// The environment variable a rank process is started with (the engine's `RANK_SPEC_ENV`).
pub const RANK_SPEC_ENV: &str = "PRISM_RANK_SPEC";

/// One running rank process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankProcess {
    /// Process id.
    pub pid: u32,
    /// Global rank.
    pub rank: usize,
    /// The driver's rendezvous it joined (`host:port`): the same for every rank of a group.
    pub rendezvous: String,
    /// Parent process id (the driver's worker for ranks on the driver's node, the member
    /// node's worker otherwise).
    pub parent: u32,
}

/// Every live rank process on this machine (zombies excluded), by pid.
pub fn rank_processes() -> Vec<RankProcess> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return out };
    for entry in entries.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if !crate::process::alive(pid) {
            continue;
        }
        // Another user's process (unreadable environment) is not one of ours.
        let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) else { continue };
        let prefix = format!("{RANK_SPEC_ENV}=");
        let Some(spec) = env.split(|b| *b == 0).find_map(|kv| kv.strip_prefix(prefix.as_bytes())) else {
            continue;
        };
        let Ok(spec) = serde_json::from_slice::<serde_json::Value>(spec) else { continue };
        let rank = spec.get("rank").and_then(serde_json::Value::as_u64).and_then(|r| usize::try_from(r).ok());
        let rendezvous = spec.get("rendezvous").and_then(serde_json::Value::as_str);
        let parent = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok()));
        if let (Some(rank), Some(rendezvous), Some(parent)) = (rank, rendezvous, parent) {
            out.push(RankProcess { pid, rank, rendezvous: rendezvous.to_owned(), parent });
        }
    }
    out.sort_by_key(|p| p.pid);
    out
}

/// The live rank processes started by one of `parents` (a cluster's workers: other
/// programs on the machine may run rank processes too), grouped by rendezvous (one entry per
/// replica's group), each group's ranks in rank order.
pub fn rank_groups(parents: &[u32]) -> BTreeMap<String, Vec<RankProcess>> {
    let mut groups: BTreeMap<String, Vec<RankProcess>> = BTreeMap::new();
    for p in rank_processes().into_iter().filter(|p| parents.contains(&p.parent)) {
        groups.entry(p.rendezvous.clone()).or_default().push(p);
    }
    for ranks in groups.values_mut() {
        ranks.sort_by_key(|p| p.rank);
    }
    groups
}

/// Sends `signal` to process `pid` (`kill -9`, `SIGSTOP`, `SIGCONT` of a rank).
///
/// # Errors
/// When the signal cannot be sent (the process is gone, say).
pub fn signal_pid(pid: u32, signal: Signal) -> Result<()> {
    let target = nix::unistd::Pid::from_raw(i32::try_from(pid)?);
    nix::sys::signal::kill(target, signal).with_context(|| format!("kill -{signal} {pid}"))
}
