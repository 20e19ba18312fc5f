//! This node's part of a parallel replica's rank group: which global ranks run here and on
//! which devices ([`LocalShare::of`], from `StartReplica.rank_groups`), how the node's cores
//! are split among them ([`threads_per_rank`]), and the member role: the rank processes a
//! node starts for a group whose driver (rank 0) runs on another node ([`spawn_members`]),
//! supervised through [`MemberRanks`].

use prism_common::NodeId;
use prism_common::proto::v1 as pb;
use prism_engine::parallel::ParallelSizes;
use prism_engine::parallel::rank::RankSpec;
use prism_engine::parallel::spawn::{RankProcess, RankProgram, spawn_rank};
use std::net::IpAddr;
use std::sync::Mutex;

/// The ranks of one replica's group on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalShare {
    /// Global ranks here, ascending (rank 0 first on the driver's node).
    pub ranks: Vec<usize>,
    /// The GPU index (CPU slot on CPU nodes) of each rank in `ranks`.
    pub devices: Vec<u32>,
    /// Some rank of the group runs on another node (the driver binds a reachable rendezvous).
    pub spans_nodes: bool,
}

/// A `StartReplica` whose rank groups do not describe the replica's group.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// No rank group names this node.
    #[error("rank_groups has no group for node {0}")]
    NotInGroup(NodeId),
    /// The groups do not hold each rank of the replica exactly once.
    #[error("rank_groups must hold each of the {world} ranks exactly once: {message}")]
    BadCover {
        /// `tensor_parallel_size × pipeline_parallel_size`.
        world: usize,
        /// What is wrong.
        message: String,
    },
    /// A member start (a `rendezvous` to join) whose ranks include rank 0, the driver's.
    #[error("a start with a rendezvous to join gives node {0} rank 0, the driver's own")]
    MemberWithRankZero(NodeId),
    /// A driver start (no `rendezvous`) on a node that does not hold rank 0.
    #[error("this node ({0}) got the driver's start (no rendezvous) but does not hold rank 0")]
    NoRankZero(NodeId),
}

impl LocalShare {
    /// This node's share of a group of `sizes` laid out as `groups` (empty: every rank here,
    /// on `gpu_indices` in rank order).
    ///
    /// # Errors
    /// [`GroupError`] when `groups` misses this node or does not cover `0..world` once.
    pub fn of(
        node: &NodeId,
        sizes: ParallelSizes,
        groups: &[pb::RankGroup],
        gpu_indices: &[u32],
    ) -> Result<Self, GroupError> {
        let world = sizes.world_size();
        if groups.is_empty() {
            return Ok(Self { ranks: (0..world).collect(), devices: gpu_indices.to_vec(), spans_nodes: false });
        }
        let mut seen = vec![false; world];
        let (mut ranks, mut devices) = (Vec::new(), Vec::new());
        let mut mine: Vec<&pb::RankGroup> = Vec::new();
        for g in groups {
            for i in 0..g.gpu_indices.len() {
                let rank = g.first_rank as usize + i;
                let bad = |message: String| GroupError::BadCover { world, message };
                let slot = seen.get_mut(rank).ok_or_else(|| bad(format!("node {} holds rank {rank}", g.node_id)))?;
                if std::mem::replace(slot, true) {
                    return Err(bad(format!("rank {rank} appears twice")));
                }
            }
            if g.node_id == node.as_str() {
                mine.push(g);
            }
        }
        if let Some(missing) = seen.iter().position(|s| !s) {
            return Err(GroupError::BadCover { world, message: format!("no node holds rank {missing}") });
        }
        if mine.is_empty() {
            return Err(GroupError::NotInGroup(node.clone()));
        }
        mine.sort_by_key(|g| g.first_rank);
        for g in &mine {
            ranks.extend((0..g.gpu_indices.len()).map(|i| g.first_rank as usize + i));
            devices.extend_from_slice(&g.gpu_indices);
        }
        let spans_nodes = groups.iter().any(|g| g.node_id != node.as_str());
        Ok(Self { ranks, devices, spans_nodes })
    }

    /// Whether this node hosts the driver (rank 0).
    pub fn holds_rank_zero(&self) -> bool {
        self.ranks.first() == Some(&0)
    }
}

/// Compute threads of each of `local_ranks` CPU ranks on this node: the replica's threads
/// (`--engine-threads`, else every core) split evenly, at least one each, so the ranks of
/// one group do not oversubscribe the cores they share (the driver's engine splits its own
/// node's share the same way).
pub fn threads_per_rank(engine_threads: Option<usize>, local_ranks: usize) -> usize {
    let total =
        engine_threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get));
    (total / local_ranks.max(1)).max(1)
}

/// The host part of an advertised endpoint (`http://host:port` → `host`, `[::1]:5` → `::1`):
/// where ranks of other nodes reach this node's rendezvous and rank listeners.
pub fn advertise_host(address: &str) -> String {
    let rest = address.split_once("://").map_or(address, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6).to_owned();
    }
    authority.rsplit_once(':').map_or(authority, |(h, _)| h).to_owned()
}

/// How this node's member ranks are started.
#[derive(Clone, Debug)]
pub struct MemberLaunch {
    /// The program every rank runs.
    pub program: RankProgram,
    /// The driver's rendezvous, `host:port`.
    pub rendezvous: String,
    /// The group's secret.
    pub token: String,
    /// IP the ranks' host-communicator listeners bind.
    pub bind_ip: Option<IpAddr>,
    /// Host other ranks reach them at.
    pub advertise_host: String,
    /// Threads per rank (`None` on CUDA: the backend's default).
    pub engine_threads: Option<usize>,
    /// CUDA: rank `share.ranks[i]` runs on GPU `share.devices[i]`; `false` = CPU ranks.
    pub cuda: bool,
}

/// Starts one rank process per rank of `share`. On an error the ranks already started are
/// killed (dropped) before it is returned.
///
/// # Errors
/// The spawn's I/O error, naming the rank.
pub fn spawn_members(launch: &MemberLaunch, share: &LocalShare) -> Result<Vec<RankProcess>, String> {
    let mut ranks = Vec::with_capacity(share.ranks.len());
    for (i, &rank) in share.ranks.iter().enumerate() {
        let spec = RankSpec {
            rendezvous: launch.rendezvous.clone(),
            token: launch.token.clone(),
            rank,
            device: if launch.cuda { share.devices.get(i).copied() } else { None },
            bind_ip: launch.bind_ip,
            advertise_host: launch.advertise_host.clone(),
            engine_threads: launch.engine_threads,
        };
        match spawn_rank(&launch.program, &spec) {
            Ok(p) => ranks.push(p),
            Err(e) => return Err(format!("rank {rank} did not start: {e}")),
        }
    }
    Ok(ranks)
}

/// The rank processes of a member entry: killed together when one exits, on stop, drain
/// and when dropped (a [`RankProcess`] kills its process when dropped).
#[derive(Debug, Default)]
pub struct MemberRanks {
    ranks: Mutex<Vec<RankProcess>>,
}

impl MemberRanks {
    /// Takes over `ranks`.
    pub fn set(&self, ranks: Vec<RankProcess>) {
        if let Ok(mut r) = self.ranks.lock() {
            *r = ranks;
        }
    }

    /// Process ids of the ranks still held.
    pub fn pids(&self) -> Vec<u32> {
        self.ranks.lock().map(|r| r.iter().map(RankProcess::pid).collect()).unwrap_or_default()
    }

    /// Why the group is broken: every rank that exited, the root cause first. A rank
    /// killed by a signal (kill -9, the OOM killer) comes before ranks that exited with an
    /// error code, which usually did so because their peer died
    /// (`rank 4 exited (killed by signal 9); ranks 3, 5 exited (exit code 1)`).
    pub fn exited(&self) -> Option<String> {
        use std::os::unix::process::ExitStatusExt;
        let mut ranks = self.ranks.lock().ok()?;
        // (signalled first, rank, what)
        let mut gone: Vec<(bool, usize, String)> = ranks
            .iter_mut()
            .filter_map(|p| match p.try_wait() {
                Ok(Some(status)) => Some((status.signal().is_none(), p.rank, describe_exit(status))),
                Ok(None) => None,
                Err(e) => Some((false, p.rank, format!("cannot be waited for: {e}"))),
            })
            .collect();
        if gone.is_empty() {
            return None;
        }
        gone.sort_by_key(|(not_signalled, rank, _)| (*not_signalled, *rank));
        // One clause per cause, in root-cause order: `rank 4 exited (..)`, `ranks 3, 5 exited (..)`.
        let mut causes: Vec<(String, Vec<usize>)> = Vec::new();
        for (_, rank, what) in gone {
            match causes.iter_mut().find(|(w, _)| *w == what) {
                Some((_, rs)) => rs.push(rank),
                None => causes.push((what, vec![rank])),
            }
        }
        let clause = |(what, rs): &(String, Vec<usize>)| {
            let list = rs.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
            let who = if rs.len() == 1 { format!("rank {list}") } else { format!("ranks {list}") };
            if what.starts_with("cannot") { format!("{who} {what}") } else { format!("{who} exited ({what})") }
        };
        Some(causes.iter().map(clause).collect::<Vec<_>>().join("; "))
    }

    /// Kills (SIGKILL) and reaps every rank; returns how many were held.
    pub fn kill_all(&self) -> usize {
        let Ok(mut ranks) = self.ranks.lock() else { return 0 };
        let n = ranks.len();
        for p in ranks.iter_mut() {
            p.kill();
        }
        ranks.clear();
        n
    }
}

/// `exit code 3`, `killed by signal 9`.
pub fn describe_exit(status: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        (None, None) => status.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(node: &str, first_rank: u32, gpus: &[u32]) -> pb::RankGroup {
        pb::RankGroup { node_id: node.into(), first_rank, gpu_indices: gpus.to_vec() }
    }

    #[test]
    fn a_node_finds_its_ranks_in_the_group() {
        let a = NodeId::from("a".to_owned());
        let b = NodeId::from("b".to_owned());
        let sizes = ParallelSizes::new(2, 2);
        let all = LocalShare::of(&a, sizes, &[], &[3, 1, 0, 2]);
        assert_eq!(all, Ok(LocalShare { ranks: vec![0, 1, 2, 3], devices: vec![3, 1, 0, 2], spans_nodes: false }));
        let groups = [group("a", 0, &[4, 5]), group("b", 2, &[0, 1])];
        let share = LocalShare::of(&b, sizes, &groups, &[0, 1]).expect("b holds stage 1");
        assert_eq!(share, LocalShare { ranks: vec![2, 3], devices: vec![0, 1], spans_nodes: true });
        assert!(!share.holds_rank_zero());
        assert!(LocalShare::of(&a, sizes, &groups, &[4, 5]).expect("a").holds_rank_zero());
        let c = NodeId::from("c".to_owned());
        assert_eq!(LocalShare::of(&c, sizes, &groups, &[]), Err(GroupError::NotInGroup(c)));
        let holes = [group("a", 0, &[4, 5]), group("b", 3, &[0])];
        assert_eq!(
            LocalShare::of(&a, sizes, &holes, &[4, 5]).err().map(|e| e.to_string()).as_deref(),
            Some("rank_groups must hold each of the 4 ranks exactly once: no node holds rank 2")
        );
        let twice = [group("a", 0, &[4, 5]), group("b", 1, &[0, 1, 2])];
        assert!(matches!(LocalShare::of(&a, sizes, &twice, &[4, 5]), Err(GroupError::BadCover { .. })));
    }

    #[test]
    fn cores_are_split_among_local_ranks_unless_threads_are_set() {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        assert_eq!(threads_per_rank(None, 1), cores);
        assert_eq!(threads_per_rank(None, cores * 4), 1, "at least one thread per rank");
        assert_eq!(threads_per_rank(Some(6), 3), 2, "--engine-threads is the replica's, split among its ranks");
    }

    #[test]
    fn advertise_host_is_the_endpoints_host() {
        assert_eq!(advertise_host("http://10.0.0.5:50061"), "10.0.0.5");
        assert_eq!(advertise_host("http://worker-0.pool:50061/"), "worker-0.pool");
        assert_eq!(advertise_host("[::1]:7"), "::1");
        assert_eq!(advertise_host("host"), "host");
    }

    /// A member's ranks are watched: one that exits is reported with its signal, the others
    /// are killed with it, and none outlives the entry.
    #[test]
    fn an_exited_rank_is_named_and_the_others_are_killed() {
        let sleep = RankProgram { program: "/bin/sleep".into(), args: vec!["30".into()] };
        let launch = MemberLaunch {
            program: sleep,
            rendezvous: "127.0.0.1:1".into(),
            token: "t".into(),
            bind_ip: None,
            advertise_host: "127.0.0.1".into(),
            engine_threads: Some(1),
            cuda: false,
        };
        let share = LocalShare { ranks: vec![2, 3], devices: vec![0, 1], spans_nodes: true };
        let members = MemberRanks::default();
        members.set(spawn_members(&launch, &share).expect("sleep starts"));
        let pids = members.pids();
        assert_eq!(pids.len(), 2);
        assert_eq!(members.exited(), None);
        let killed = std::process::Command::new("kill").args(["-9", &pids[1].to_string()]).status();
        assert!(killed.is_ok_and(|s| s.success()), "kill -9 of rank 3");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let why = loop {
            if let Some(why) = members.exited() {
                break why;
            }
            assert!(std::time::Instant::now() < deadline, "the killed rank is seen within 5 s");
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_eq!(why, "rank 3 exited (killed by signal 9)");
        assert_eq!(members.kill_all(), 2);
        assert!(members.pids().is_empty());
        assert!(!std::path::Path::new(&format!("/proc/{}", pids[0])).exists(), "rank 2 is killed and reaped");
    }

    /// When a rank is killed and its peers then exit with an error (their peer died), the
    /// killed rank is named first and every exited rank is listed.
    #[test]
    fn the_killed_rank_is_named_before_the_peers_that_exited_after_it() {
        // Rank 4 waits to be killed; ranks 3 and 5 exit 1 a little later, as peers do.
        let script = r#"case "$PRISM_RANK_SPEC" in *'"rank":4'*) exec sleep 30;; *) sleep 0.5; exit 1;; esac"#;
        let sh = RankProgram { program: "/bin/sh".into(), args: vec!["-c".into(), script.into()] };
        let launch = MemberLaunch {
            program: sh,
            rendezvous: "127.0.0.1:1".into(),
            token: "t".into(),
            bind_ip: None,
            advertise_host: "127.0.0.1".into(),
            engine_threads: Some(1),
            cuda: false,
        };
        let share = LocalShare { ranks: vec![3, 4, 5], devices: vec![0, 1, 2], spans_nodes: true };
        let members = MemberRanks::default();
        members.set(spawn_members(&launch, &share).expect("sh starts"));
        let pids = members.pids();
        assert_eq!(pids.len(), 3);
        let killed = std::process::Command::new("kill").args(["-9", &pids[1].to_string()]).status();
        assert!(killed.is_ok_and(|s| s.success()), "kill -9 of rank 4");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let why = loop {
            match members.exited() {
                Some(why) if why.contains("ranks 3, 5") => break why,
                Some(why) => assert!(why.starts_with("rank 4 exited (killed by signal 9)"), "{why}"),
                None => {}
            }
            assert!(std::time::Instant::now() < deadline, "all three ranks exit within 5 s");
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        assert_eq!(why, "rank 4 exited (killed by signal 9); ranks 3, 5 exited (exit code 1)");
        assert_eq!(members.kill_all(), 3);
    }
}
