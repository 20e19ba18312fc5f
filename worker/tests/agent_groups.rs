//! The agent's two roles in a parallel replica, driven through `Agent::start_replica` as the
//! head session would: the driver's node binds the rendezvous for ranks of other nodes and
//! reports it while the engine still loads, and hands the engine its rank group; a member
//! node starts one rank process per local rank, reports the entry as a group member, fails
//! it when a rank exits (killing the others), kills its ranks on stop, and keeps them through
//! a node drain until the head stops the group or the deadline passes. Rank
//! processes are stood in for by `/bin/sleep`, which lets the supervision be tested without
//! a driver to join.

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::{self as pb, ReplicaState};
use prism_engine::EngineError;
use prism_engine::parallel::spawn::RankProgram;
use prism_worker::WorkerConfig;
use prism_worker::agent::replica::{EngineLauncher, LaunchSpec, ReplicaEngine};
use prism_worker::agent::{Agent, DrainSource, gpu};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A launcher double: records each launch spec and holds the load until the test releases it
/// (the engine then fails to start, which is all these tests need of it).
struct HeldLauncher {
    specs: Mutex<Vec<LaunchSpec>>,
    release: Mutex<mpsc::Receiver<()>>,
}

impl EngineLauncher for HeldLauncher {
    fn launch(&self, spec: &LaunchSpec) -> Result<Arc<dyn ReplicaEngine>, EngineError> {
        if let Ok(mut s) = self.specs.lock() {
            s.push(spec.clone());
        }
        let _ = self.release.lock().map(|r| r.recv_timeout(Duration::from_secs(20)));
        Err(EngineError::Internal("test launcher: no engine".into()))
    }
}

fn agent(node: &str, slots: u32) -> (Arc<Agent>, Arc<HeldLauncher>, mpsc::Sender<()>) {
    let (tx, rx) = mpsc::channel();
    let launcher = Arc::new(HeldLauncher { specs: Mutex::new(Vec::new()), release: Mutex::new(rx) });
    let mut cfg = WorkerConfig::for_test("http://127.0.0.1:1", node);
    cfg.cpu_slots = slots;
    cfg.rendezvous_bind = Some("127.0.0.1".parse().expect("ip"));
    cfg.rank_program = Some(RankProgram { program: "/bin/sleep".into(), args: vec!["60".into()] });
    cfg.engine_threads = Some(1);
    let devices = gpu::discover(0, slots);
    let a = Arc::new(Agent::new(cfg, devices, "http://127.0.0.1:50061".into(), Arc::clone(&launcher) as _));
    (a, launcher, tx)
}

fn start(id: &str, tp: u32, pp: u32, gpus: &[u32], groups: Vec<pb::RankGroup>, rendezvous: &str) -> pb::StartReplica {
    pb::StartReplica {
        replica_id: id.into(),
        deployment: "d".into(),
        engine: Some(pb::EngineConfig {
            model: "/m".into(),
            tensor_parallel_size: tp,
            pipeline_parallel_size: Some(pp),
            ..Default::default()
        }),
        gpu_indices: gpus.to_vec(),
        rank_groups: groups,
        rendezvous: rendezvous.into(),
        group_token: "secret".into(),
    }
}

fn group(node: &str, first_rank: u32, slots: &[u32]) -> pb::RankGroup {
    pb::RankGroup { node_id: node.into(), first_rank, gpu_indices: slots.to_vec() }
}

fn status(a: &Agent, id: &str) -> Option<pb::ReplicaStatus> {
    a.status_snapshot().replicas.into_iter().find(|r| r.replica_id == id)
}

async fn wait_state(a: &Agent, id: &str, want: ReplicaState) -> Result<pb::ReplicaStatus> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        a.check_engines();
        if let Some(s) = status(a, id)
            && s.state() == want
        {
            return Ok(s);
        }
        if Instant::now() > deadline {
            bail!("{id} not {want:?} within 5 s: {:?}", status(a, id));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.rsplit(')').next().is_some_and(|rest| !rest.trim_start().starts_with('Z')))
}

/// The driver of a group over two nodes binds its rendezvous before the model loads and
/// reports it in the Starting status (the head needs it to start the other node); the launch
/// spec carries the sizes, this node's ranks and the worker's timeouts.
#[tokio::test]
async fn the_driver_reports_its_rendezvous_while_loading_and_launches_its_ranks() -> Result<()> {
    let (a, launcher, release) = agent("node-a", 3);
    let groups = vec![group("node-a", 0, &[0, 1, 2]), group("node-b", 3, &[0, 1, 2])];
    a.start_replica(start("r-driver", 3, 2, &[0, 1, 2], groups, ""));
    let s = wait_state(&a, "r-driver", ReplicaState::Starting).await?;
    assert!(!s.group_member);
    let (host, port) = s.rendezvous.rsplit_once(':').context("rendezvous is host:port")?;
    assert_eq!(host, "127.0.0.1", "the advertised address's host");
    let port: u16 = port.parse()?;
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        "the rendezvous accepts connections while loading"
    );
    let spec = loop {
        if let Some(s) = launcher.specs.lock().ok().and_then(|s| s.first().cloned()) {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let p = &spec.parallel;
    assert_eq!((p.sizes.tensor_parallel_size, p.sizes.pipeline_parallel_size), (3, 2));
    assert_eq!(p.local_ranks, vec![0, 1, 2]);
    assert_eq!(
        p.rendezvous.as_ref().map(|r| (r.address().to_owned(), r.token().to_owned())),
        Some((s.rendezvous.clone(), "secret".to_owned()))
    );
    assert_eq!((p.collective_timeout, p.join_timeout), (Duration::from_secs(30), Duration::from_secs(600)));
    assert_eq!(spec.engine_threads, Some(1), "--engine-threads as given (the engine splits it among its ranks)");
    release.send(())?;
    let failed = wait_state(&a, "r-driver", ReplicaState::Failed).await?;
    assert_eq!(failed.reason, "model failed to load: test launcher: no engine");

    // Every rank on this node: no rendezvous to report (the engine binds one on loopback).
    a.start_replica(start("r-local", 3, 1, &[0, 1, 2], vec![], ""));
    let local = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Some(s) = launcher.specs.lock().ok().and_then(|s| s.get(1).cloned()) {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .context("the local group's launch")?;
    assert!(local.parallel.rendezvous.is_none(), "no rendezvous bound by the agent for a group on one node");
    assert_eq!(status(&a, "r-local").map(|s| s.rendezvous), Some(String::new()));
    release.send(())?;
    Ok(())
}

/// Bad group descriptions fail the replica with a reason naming the problem.
#[tokio::test]
async fn a_start_that_does_not_fit_the_group_fails_with_the_reason() -> Result<()> {
    let (a, _launcher, _release) = agent("node-a", 3);
    a.start_replica(start("r1", 3, 1, &[0], vec![], ""));
    let s = wait_state(&a, "r1", ReplicaState::Failed).await?;
    assert_eq!(
        s.reason,
        "got 1 GPU indices for this node's 3 of the 3 ranks of tensor_parallel_size 3 x pipeline_parallel_size 1"
    );
    a.start_replica(start("r2", 1, 2, &[0], vec![group("node-a", 1, &[0]), group("node-b", 0, &[0])], ""));
    let s = wait_state(&a, "r2", ReplicaState::Failed).await?;
    assert_eq!(s.reason, "this node (node-a) got the driver's start (no rendezvous) but does not hold rank 0");
    a.start_replica(start("r3", 1, 2, &[0], vec![group("node-b", 0, &[0]), group("node-c", 1, &[0])], "h:1"));
    let s = wait_state(&a, "r3", ReplicaState::Failed).await?;
    assert_eq!(s.reason, "rank_groups has no group for node node-a");
    a.start_replica(start("r5", 1, 2, &[0, 1], vec![], "h:1"));
    let s = wait_state(&a, "r5", ReplicaState::Failed).await?;
    assert_eq!(s.reason, "a start with a rendezvous to join gives node node-a rank 0, the driver's own");
    let mut no_token = start("r4", 1, 2, &[0], vec![group("node-a", 0, &[0]), group("node-b", 1, &[0])], "");
    no_token.group_token.clear();
    a.start_replica(no_token);
    let s = wait_state(&a, "r4", ReplicaState::Failed).await?;
    assert_eq!(s.reason, "group_token is empty for a rank group over several nodes");
    Ok(())
}

/// A member entry: its ranks start, it is reported Ready as a group member; a rank that
/// exits fails it with the rank and its signal, and its other ranks are killed with it.
#[tokio::test]
async fn a_member_whose_rank_exits_fails_and_kills_the_others() -> Result<()> {
    let (a, _launcher, _release) = agent("node-b", 2);
    let groups = vec![group("node-a", 0, &[0]), group("node-b", 1, &[0, 1])];
    a.start_replica(start("r-member", 3, 1, &[0, 1], groups, "127.0.0.1:9"));
    let s = wait_state(&a, "r-member", ReplicaState::Ready).await?;
    assert!(s.group_member);
    a.set_registered(true);
    assert!(a.readiness().is_ok(), "a member entry with live ranks is ready: {:?}", a.readiness());
    let r = a.replicas().get("r-member").context("entry")?;
    let pids = r.member_ranks().pids();
    assert_eq!(pids.len(), 2);
    let killed = std::process::Command::new("kill").args(["-9", &pids[0].to_string()]).status()?;
    assert!(killed.success());
    let s = wait_state(&a, "r-member", ReplicaState::Failed).await?;
    assert_eq!(s.reason, "rank 1 exited (killed by signal 9)");
    assert!(s.group_member);
    assert!(!alive(pids[1]), "rank 2 is killed with the group");
    assert!(r.member_ranks().pids().is_empty());
    Ok(())
}

/// A stop (whatever its deadline) kills a member's ranks at once; a node drain leaves them
/// serving their group until the head stops it (or the deadline passes).
#[tokio::test]
async fn stop_kills_member_ranks_at_once_and_a_drain_waits_for_the_heads_stop() -> Result<()> {
    let (a, _launcher, _release) = agent("node-b", 3);
    let groups = |slot: u32| vec![group("node-a", 0, &[0]), group("node-b", 1, &[slot])];
    a.start_replica(start("r-stop", 1, 2, &[0], groups(0), "127.0.0.1:9"));
    wait_state(&a, "r-stop", ReplicaState::Ready).await?;
    let pids = a.replicas().get("r-stop").context("entry")?.member_ranks().pids();
    let t = Instant::now();
    a.stop_replica("r-stop", Duration::from_secs(30));
    wait_state(&a, "r-stop", ReplicaState::Stopped).await?;
    assert!(t.elapsed() < Duration::from_secs(2), "a member has no requests to wait for: {:?}", t.elapsed());
    assert!(pids.iter().all(|p| !alive(*p)), "stopped member's ranks are gone");

    // Drain with the head's stop: the ranks serve on, the drain ends once the head stopped them.
    a.start_replica(start("r-drain", 1, 2, &[1], groups(1), "127.0.0.1:9"));
    wait_state(&a, "r-drain", ReplicaState::Ready).await?;
    let pids = a.replicas().get("r-drain").context("entry")?.member_ranks().pids();
    a.drain(Duration::from_secs(30), "test drain", DrainSource::Rpc);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(status(&a, "r-drain").map(|s| s.state()), Some(ReplicaState::Ready), "members serve on while draining");
    assert!(pids.iter().all(|p| alive(*p)));
    assert!(!a.drain_state().is_some_and(|d| d.done), "the drain waits for the group's stop");
    a.stop_replica("r-drain", Duration::from_secs(30));
    tokio::time::timeout(Duration::from_secs(5), a.node_drain().wait_done())
        .await
        .context("drain done after the stop")?;
    assert!(pids.iter().all(|p| !alive(*p)), "drained member's ranks are gone");
    a.node_drain().reopen_if_finished();

    // Drain without a stop: the deadline kills them.
    a.start_replica(start("r-deadline", 1, 2, &[2], groups(2), "127.0.0.1:9"));
    wait_state(&a, "r-deadline", ReplicaState::Ready).await?;
    let pids = a.replicas().get("r-deadline").context("entry")?.member_ranks().pids();
    let t = Instant::now();
    a.drain(Duration::from_millis(800), "test drain", DrainSource::Rpc);
    tokio::time::timeout(Duration::from_secs(5), a.node_drain().wait_done()).await.context("drain done")?;
    assert!(t.elapsed() >= Duration::from_millis(700), "kept until the deadline: {:?}", t.elapsed());
    assert_eq!(status(&a, "r-deadline").map(|s| s.state()), Some(ReplicaState::Stopped));
    assert!(pids.iter().all(|p| !alive(*p)), "ranks are gone at the deadline");
    Ok(())
}
