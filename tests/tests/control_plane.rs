//! Control-plane integration tests: a real `etcd` or the embedded store, real `prism-head`
//! processes on loopback ports (the cluster fixture, without workers or routers), and workers
//! played by [`FakeWorker`], a test client that speaks the `WorkerSession` protocol exactly
//! as `prism-worker --simulate-gpus N` does (register, full status, Ready after StartReplica,
//! gone after StopReplica; for a GPU group across nodes, the driver reports a rendezvous and
//! the member nodes report their ranks with `group_member`). None of these tests need the real worker binary. Build the head
//! first:
//! `cargo build -p prism-head --bin prism-head`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::head_service_client::HeadServiceClient;
use prism_common::proto::v1::{
    self as pb, ApplyDeploymentRequest, ClusterStatusRequest, DeploymentSpec, EngineConfig, GpuInfo, ListNodesRequest,
    NodeInventory, ReplicaRecord, ReplicaState, ReplicaStatus, ScaleDeploymentRequest, StartReplica, WorkerMessage,
    WorkerStatus, head_message, worker_message,
};
use prism_common::state_store::{StateStore, keys};
use prism_tests::{Cluster, ClusterBuilder, Store, poll_until, wait_until};
use prost::Message;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

const WORKER_TIMEOUT: Duration = Duration::from_secs(2);
const LEASE_TTL: Duration = Duration::from_secs(2);

/// Heads that notice a silent worker after 2 s, hand leadership over within a 2 s lease and
/// reconcile every 200 ms, on `store`.
fn control_plane(store: Store) -> ClusterBuilder {
    Cluster::builder()
        .store(store)
        .head_args(&["--worker-timeout", "2s", "--lease-ttl", "2s", "--reconcile-interval", "200ms"])
        .env("RUST_LOG", "info")
}

/// Plays a worker: keeps a session to `head` open (reconnecting), runs what it is told.
struct FakeWorker {
    task: tokio::task::JoinHandle<()>,
    /// Every StartReplica received (replica ids), across sessions.
    starts: Arc<Mutex<Vec<String>>>,
    /// Every StartReplica received in full, across sessions.
    start_msgs: Arc<Mutex<Vec<StartReplica>>>,
    /// Changes the reported state of a replica it runs (a rank failing): id, state, reason.
    inject: mpsc::UnboundedSender<(String, ReplicaState, String)>,
    /// While set, replicas it is told to start stay Starting (still loading) instead of
    /// turning Ready at once.
    hold_starting: Arc<AtomicBool>,
}

type Injected = mpsc::UnboundedReceiver<(String, ReplicaState, String)>;

fn gpus(n: u32) -> Vec<GpuInfo> {
    (0..n).map(|i| GpuInfo { index: i, name: "simulated".into(), memory_bytes: 80 << 30 }).collect()
}

impl FakeWorker {
    fn spawn(head: String, node: &str, n_gpus: u32) -> Self {
        let inv = NodeInventory {
            node_id: node.into(),
            address: format!("http://127.0.0.1:{}", 40000 + n_gpus),
            gpus: gpus(n_gpus),
            simulated_gpus: true,
            ..Default::default()
        };
        let starts = Arc::new(Mutex::new(Vec::new()));
        let start_msgs = Arc::new(Mutex::new(Vec::new()));
        let (inject, mut injected) = mpsc::unbounded_channel();
        let (s2, m2) = (starts.clone(), start_msgs.clone());
        let hold_starting = Arc::new(AtomicBool::new(false));
        let h2 = hold_starting.clone();
        let task = tokio::spawn(async move {
            let mut running: BTreeMap<String, ReplicaStatus> = BTreeMap::new();
            loop {
                let _ = session(&head, &inv, &mut running, &s2, &m2, &mut injected, &h2).await;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        Self { task, starts, start_msgs, inject, hold_starting }
    }

    fn start_msgs(&self) -> Result<Vec<StartReplica>> {
        Ok(self.start_msgs.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone())
    }

    fn kill(&self) {
        self.task.abort();
    }
}

fn status(running: &BTreeMap<String, ReplicaStatus>) -> WorkerMessage {
    WorkerMessage {
        msg: Some(worker_message::Msg::Status(WorkerStatus { replicas: running.values().cloned().collect() })),
    }
}

async fn session(
    head: &str,
    inv: &NodeInventory,
    running: &mut BTreeMap<String, ReplicaStatus>,
    starts: &Mutex<Vec<String>>,
    start_msgs: &Mutex<Vec<StartReplica>>,
    injected: &mut Injected,
    hold_starting: &AtomicBool,
) -> Result<()> {
    let mut c = HeadServiceClient::new(Channel::from_shared(head.to_owned())?.connect().await?);
    let (tx, rx) = mpsc::channel(64);
    tx.send(WorkerMessage { msg: Some(worker_message::Msg::Register(inv.clone())) }).await?;
    tx.send(status(running)).await?;
    let mut inbound = c.worker_session(ReceiverStream::new(rx)).await?.into_inner();
    loop {
        let m = tokio::select! {
            m = inbound.message() => match m? {
                Some(m) => m,
                None => break,
            },
            Some((id, state, reason)) = injected.recv() => {
                if let Some(r) = running.get_mut(&id) {
                    r.state = state as i32;
                    r.reason = reason;
                }
                tx.send(status(running)).await?;
                continue;
            }
        };
        match m.msg {
            Some(head_message::Msg::Start(s)) => {
                starts.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.push(s.replica_id.clone());
                start_msgs.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.push(s.clone());
                // A group across nodes: the driver (no rendezvous given) reports the one it
                // bound; a member node (rendezvous given) reports its ranks as a member.
                let member = !s.rendezvous.is_empty();
                let rendezvous = if s.rank_groups.is_empty() || member {
                    String::new()
                } else {
                    format!("{}.fake:41000", inv.node_id)
                };
                running.insert(
                    s.replica_id.clone(),
                    ReplicaStatus {
                        replica_id: s.replica_id,
                        deployment: s.deployment,
                        state: if hold_starting.load(Ordering::SeqCst) {
                            ReplicaState::Starting as i32
                        } else {
                            ReplicaState::Ready as i32
                        },
                        reason: String::new(),
                        gpu_indices: s.gpu_indices,
                        max_model_len: 0,
                        rendezvous,
                        group_member: member,
                    },
                );
            }
            Some(head_message::Msg::Stop(s)) => {
                running.remove(&s.replica_id);
            }
            _ => continue,
        }
        tx.send(status(running)).await?;
    }
    Ok(())
}

fn spec(name: &str, tp: u32, replicas: u32) -> DeploymentSpec {
    DeploymentSpec {
        name: name.into(),
        engine: Some(EngineConfig {
            model: "/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            tensor_parallel_size: tp,
            ..Default::default()
        }),
        replicas,
        ..Default::default()
    }
}

async fn replicas(c: &mut HeadServiceClient<Channel>, dep: &str) -> Result<Vec<ReplicaRecord>> {
    Ok(c.list_replicas(pb::ListReplicasRequest { deployment: dep.into() }).await?.into_inner().replicas)
}

fn count(rs: &[ReplicaRecord], s: ReplicaState) -> usize {
    rs.iter().filter(|r| r.state() == s).count()
}

/// Every Ready replica holds tp GPUs on one node; no (node, GPU) twice.
fn check_gangs(rs: &[ReplicaRecord], tp: usize) -> Result<BTreeSet<String>> {
    let mut used = BTreeSet::new();
    let mut nodes = BTreeSet::new();
    for r in rs.iter().filter(|r| r.state() == ReplicaState::Ready) {
        if r.gpu_indices.len() != tp {
            bail!("replica {} holds {:?}", r.replica_id, r.gpu_indices);
        }
        for g in &r.gpu_indices {
            if !used.insert((r.node_id.clone(), *g)) {
                bail!("GPU {g} on {} used twice", r.node_id);
            }
        }
        nodes.insert(r.node_id.clone());
    }
    Ok(nodes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_gang_spread_pending_then_third_worker_etcd() -> Result<()> {
    let cluster = control_plane(Store::Etcd).start().await?;
    let outcome = async {
        let head = cluster.head();
        let mut c = head.wait_leader(Duration::from_secs(20)).await?;
        let w1 = FakeWorker::spawn(head.url.clone(), "node-a", 4);
        let w2 = FakeWorker::spawn(head.url.clone(), "node-b", 4);
        c.apply_deployment(ApplyDeploymentRequest { spec: Some(spec("llama", 2, 3)) }).await?;
        let rs = poll_until(Duration::from_secs(10), "3 Ready replicas", || {
            let mut c = c.clone();
            async move { replicas(&mut c, "llama").await.ok().filter(|rs| count(rs, ReplicaState::Ready) == 3) }
        })
        .await?;
        let nodes = check_gangs(&rs, 2)?;
        assert_eq!(nodes.len(), 2, "replicas spread over both nodes");

        // The records are in etcd.
        let store = prism_head::store::EtcdStore::connect(&cluster.etcd().context("etcd")?.endpoints()).await?;
        let (stored, _) = store.list(keys::REPLICAS).await?;
        assert_eq!(stored.len(), 3);
        for (k, v) in &stored {
            let r = ReplicaRecord::decode(v.value.as_slice())?;
            assert!(k.ends_with(&r.replica_id));
            assert_eq!(r.state(), ReplicaState::Ready);
        }
        let (resv, _) = store.list(keys::RESERVATIONS).await?;
        assert_eq!(resv.len(), 6, "one reservation per GPU in use");

        // Identical apply is idempotent.
        let again = c.apply_deployment(ApplyDeploymentRequest { spec: Some(spec("llama", 2, 3)) }).await?.into_inner();
        assert!(!again.created);

        // Five replicas of tp 2 on 8 GPUs: the 5th is Pending with a reason.
        c.scale_deployment(ScaleDeploymentRequest { name: "llama".into(), replicas: 5 }).await?;
        let rs = poll_until(Duration::from_secs(10), "4 Ready + 1 Pending", || {
            let mut c = c.clone();
            async move {
                replicas(&mut c, "llama")
                    .await
                    .ok()
                    .filter(|rs| count(rs, ReplicaState::Ready) == 4 && count(rs, ReplicaState::Pending) == 1)
            }
        })
        .await?;
        check_gangs(&rs, 2)?;
        let pending = rs.iter().find(|r| r.state() == ReplicaState::Pending).context("pending")?;
        assert_eq!(pending.reason, "needs 2 GPUs on one node; largest free group is 0");
        let st = c.cluster_status(ClusterStatusRequest {}).await?.into_inner();
        assert_eq!(st.pending_gpus, 2);

        // A third worker places it, without a restart.
        let w3 = FakeWorker::spawn(head.url.clone(), "node-c", 4);
        let rs = poll_until(Duration::from_secs(10), "5 Ready", || {
            let mut c = c.clone();
            async move { replicas(&mut c, "llama").await.ok().filter(|rs| count(rs, ReplicaState::Ready) == 5) }
        })
        .await?;
        assert_eq!(check_gangs(&rs, 2)?.len(), 3);
        assert!(rs.iter().any(|r| r.node_id == "node-c"));

        // kill -9 of a worker: its replicas are Ready elsewhere within worker_timeout + 2 s.
        c.scale_deployment(ScaleDeploymentRequest { name: "llama".into(), replicas: 3 }).await?;
        let rs = poll_until(Duration::from_secs(10), "back to 3", || {
            let mut c = c.clone();
            async move {
                replicas(&mut c, "llama").await.ok().filter(|rs| rs.len() == 3 && count(rs, ReplicaState::Ready) == 3)
            }
        })
        .await?;
        let victim = rs[0].node_id.clone();
        let on_victim: Vec<String> = rs.iter().filter(|r| r.node_id == victim).map(|r| r.replica_id.clone()).collect();
        let killed = Instant::now();
        match victim.as_str() {
            "node-a" => w1.kill(),
            "node-b" => w2.kill(),
            _ => w3.kill(),
        }
        poll_until(WORKER_TIMEOUT + Duration::from_secs(3), "node Dead", || {
            let mut c = c.clone();
            let victim = victim.clone();
            async move {
                let nodes = c.list_nodes(ListNodesRequest {}).await.ok()?.into_inner().nodes;
                nodes
                    .iter()
                    .any(|n| {
                        n.inventory.as_ref().is_some_and(|i| i.node_id == victim) && n.state() == pb::NodeState::Dead
                    })
                    .then_some(())
            }
        })
        .await?;
        let detected = killed.elapsed();
        poll_until(WORKER_TIMEOUT + Duration::from_secs(2) - detected.min(WORKER_TIMEOUT), "re-placed", || {
            let mut c = c.clone();
            let victim = victim.clone();
            async move {
                let rs = replicas(&mut c, "llama").await.ok()?;
                (count(&rs, ReplicaState::Ready) == 3 && rs.iter().all(|r| r.node_id != victim)).then_some(())
            }
        })
        .await?;
        let replaced = killed.elapsed();
        eprintln!(
            "worker kill -9 of {victim} ({} replicas): detected Dead after {:.2} s, Ready elsewhere after {:.2} s \
         (worker_timeout {:?})",
            on_victim.len(),
            detected.as_secs_f64(),
            replaced.as_secs_f64(),
            WORKER_TIMEOUT
        );
        assert!(replaced <= WORKER_TIMEOUT + Duration::from_secs(2));
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_rejected_and_changes_nothing() -> Result<()> {
    let cluster = control_plane(Store::Etcd).start().await?;
    let outcome = async {
        let head = cluster.head();
        let mut c = head.wait_leader(Duration::from_secs(20)).await?;
        let _w = FakeWorker::spawn(head.url.clone(), "node-a", 4);
        for (s, what) in [
            (spec("tp-zero", 0, 1), "tensor_parallel_size 0"),
            (spec("Bad_Name", 1, 1), "invalid name"),
            (spec("", 1, 1), "empty name"),
            (DeploymentSpec { engine: None, ..spec("no-engine", 1, 1) }, "no engine"),
            (spec("x", 1, 1).tap_model(""), "empty model"),
        ] {
            let e = c.apply_deployment(ApplyDeploymentRequest { spec: Some(s) }).await.err().context(what)?;
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{what}: {e:?}");
        }
        let deps = c.list_deployments(pb::ListDeploymentsRequest {}).await?.into_inner().deployments;
        assert!(deps.is_empty(), "nothing stored");

        // A GPU group larger than all registered nodes together: refused, naming the numbers.
        let e = c
            .apply_deployment(ApplyDeploymentRequest { spec: Some(spec("huge", 8, 1)) })
            .await
            .err()
            .context("8 GPUs")?;
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert_eq!(
            e.message(),
            "a replica needs 8 GPUs or CPU slots (engine.tensor_parallel_size 8 x engine.pipeline_parallel_size 1), \
             more than the registered nodes have together: 4 (node-a 4)"
        );
        // More GPUs than any node has free: Pending with a reason, not an error loop.
        c.apply_deployment(ApplyDeploymentRequest { spec: Some(spec("big", 4, 2)) }).await?;
        let r =
            poll_until(Duration::from_secs(10), "big pending", || {
                let mut c = c.clone();
                async move {
                    replicas(&mut c, "big").await.ok().and_then(|rs| rs.into_iter().find(|r| !r.reason.is_empty()))
                }
            })
            .await?;
        assert_eq!(r.state(), ReplicaState::Pending);
        assert_eq!(r.reason, "needs 4 GPUs on one node; largest free group is 0");
        // Changing the same name's spec is an update, scaling outside bounds is rejected.
        let mut bounded = spec("big", 4, 2);
        bounded.max_replicas = 2;
        c.apply_deployment(ApplyDeploymentRequest { spec: Some(bounded) }).await?;
        let e = c
            .scale_deployment(ScaleDeploymentRequest { name: "big".into(), replicas: 3 })
            .await
            .err()
            .context("bounds")?;
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let e = c
            .scale_deployment(ScaleDeploymentRequest { name: "nope".into(), replicas: 1 })
            .await
            .err()
            .context("nf")?;
        assert_eq!(e.code(), tonic::Code::NotFound);

        // A worker with a malformed inventory: INVALID_ARGUMENT, nothing stored.
        let (tx, rx) = mpsc::channel(4);
        let bad = NodeInventory { node_id: "bad/node".into(), address: "nowhere".into(), ..Default::default() };
        tx.send(WorkerMessage { msg: Some(worker_message::Msg::Register(bad)) }).await?;
        let mut raw = head.client().await?;
        let res = raw.worker_session(ReceiverStream::new(rx)).await;
        let code = match res {
            Err(s) => s.code(),
            Ok(r) => r.into_inner().message().await.err().map_or(tonic::Code::Ok, |s| s.code()),
        };
        assert_eq!(code, tonic::Code::InvalidArgument);
        let nodes = c.list_nodes(ListNodesRequest {}).await?.into_inner().nodes;
        assert_eq!(nodes.len(), 1, "only the good worker is stored");
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}

trait TapModel {
    fn tap_model(self, m: &str) -> Self;
}
impl TapModel for DeploymentSpec {
    fn tap_model(mut self, m: &str) -> Self {
        if let Some(e) = self.engine.as_mut() {
            e.model = m.into();
        }
        self
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_heads_one_leader_and_failover_within_ttl() -> Result<()> {
    let mut cluster = control_plane(Store::Etcd).start().await?;
    let outcome = async {
        cluster.head().wait_leader(Duration::from_secs(20)).await?;
        cluster.add_head()?;
        let (a, b) = (&cluster.heads[0], &cluster.heads[1]);
        // b is up and a follower.
        let mut bc = poll_until(Duration::from_secs(20), "b up", || async {
            let mut c = b.client().await.ok()?;
            let s = c.cluster_status(ClusterStatusRequest {}).await.ok()?.into_inner();
            (!s.is_leader && s.leader == a.url).then_some(c)
        })
        .await?;
        let e = bc
            .apply_deployment(ApplyDeploymentRequest { spec: Some(spec("m", 1, 1)) })
            .await
            .err()
            .context("follower write")?;
        assert_eq!(e.code(), tonic::Code::Unavailable);
        assert_eq!(e.metadata().get("prism-leader").and_then(|v| v.to_str().ok()), Some(a.url.as_str()));
        // A worker pointed at the follower is refused with the leader's address.
        let w = FakeWorker::spawn(a.url.clone(), "node-a", 2);
        let mut ac = a.client().await?;
        ac.apply_deployment(ApplyDeploymentRequest { spec: Some(spec("m", 1, 1)) }).await?;
        wait_until(Duration::from_secs(10), "ready on a", || {
            let mut c = ac.clone();
            async move { replicas(&mut c, "m").await.is_ok_and(|rs| count(&rs, ReplicaState::Ready) == 1) }
        })
        .await?;

        let killed = Instant::now();
        cluster.heads[0].process.kill();
        let b = &cluster.heads[1];
        let mut bc = b.wait_leader(LEASE_TTL + Duration::from_secs(1)).await?;
        let took = killed.elapsed();
        eprintln!("leader kill -9: follower leads after {:.2} s (lease TTL {LEASE_TTL:?})", took.as_secs_f64());
        // The new leader kept the deployment.
        let deps = bc.list_deployments(pb::ListDeploymentsRequest {}).await?.into_inner().deployments;
        assert_eq!(deps.len(), 1);
        w.kill();
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}

/// Two heads on one embedded state file: the second exits at once with an error naming the
/// file (the first holds the lock on `<file>.lock`) and leaves the first one's state alone;
/// once the first is killed (-9) a new head opens the file and keeps its deployment.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_head_on_one_embedded_file_fails_fast() -> Result<()> {
    let mut cluster = control_plane(Store::Embedded).start().await?;
    let outcome = async {
        let file = cluster.store_file();
        let mut c = cluster.head().wait_leader(Duration::from_secs(20)).await?;
        c.apply_deployment(ApplyDeploymentRequest { spec: Some(spec("llama", 1, 1)) }).await?;
        let second = &mut cluster.add_head()?.process;
        let exit = second.wait_exit(Duration::from_secs(10)).await.context("the second head to exit")?;
        second.wait_stderr_closed(Duration::from_secs(5)).await?;
        let stderr = second.stderr();
        assert!(!exit.success(), "the second head must fail: {exit:?}\n{stderr}");
        assert!(stderr.contains(&file.display().to_string()) && stderr.contains("another Prism process"), "{stderr}");
        let deps = c.list_deployments(pb::ListDeploymentsRequest {}).await?.into_inner().deployments;
        assert_eq!(deps.len(), 1, "the first head still serves its state");
        // kill -9 of the first, then a new head on its port and the same file.
        cluster.kill_head();
        cluster.restart_head()?;
        let mut c = cluster.head().wait_leader(Duration::from_secs(20)).await?;
        let deps = c.list_deployments(pb::ListDeploymentsRequest {}).await?.into_inner().deployments;
        assert_eq!(deps.len(), 1, "the deployment survives on the reopened file");
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_head_restart_keeps_deployments_and_adopts_replicas() -> Result<()> {
    let mut cluster = control_plane(Store::Embedded).start().await?;
    let outcome = async {
        let mut c = cluster.head().wait_leader(Duration::from_secs(20)).await?;
        let w = FakeWorker::spawn(cluster.head_url().to_owned(), "node-a", 4);
        c.apply_deployment(ApplyDeploymentRequest { spec: Some(spec("llama", 2, 2)) }).await?;
        let before = poll_until(Duration::from_secs(10), "2 Ready", || {
            let mut c = c.clone();
            async move { replicas(&mut c, "llama").await.ok().filter(|rs| count(rs, ReplicaState::Ready) == 2) }
        })
        .await?;
        let starts_before = w.starts.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.len();
        // kill -9, then a new head on the same port and state file.
        cluster.kill_head();
        cluster.restart_head()?;
        let mut c = cluster.head().wait_leader(Duration::from_secs(20)).await?;
        let deps = c.list_deployments(pb::ListDeploymentsRequest {}).await?.into_inner().deployments;
        assert_eq!(deps.len(), 1, "deployment survives the restart");
        let ids = |rs: &[ReplicaRecord]| rs.iter().map(|r| r.replica_id.clone()).collect::<BTreeSet<_>>();
        // The worker reconnects; its replicas are adopted with the same ids, none restarted.
        wait_until(Duration::from_secs(10), "worker reconnected", || {
            let mut c = c.clone();
            async move {
                c.list_nodes(ListNodesRequest {})
                    .await
                    .is_ok_and(|n| n.into_inner().nodes.iter().any(|n| n.state() == pb::NodeState::Ready))
            }
        })
        .await?;
        let after = poll_until(Duration::from_secs(10), "2 Ready again", || {
            let mut c = c.clone();
            async move { replicas(&mut c, "llama").await.ok().filter(|rs| count(rs, ReplicaState::Ready) == 2) }
        })
        .await?;
        assert_eq!(ids(&before), ids(&after));
        // Stay past a reconcile pass and a worker timeout window: still no restart.
        tokio::time::sleep(WORKER_TIMEOUT).await;
        let after = replicas(&mut c, "llama").await?;
        assert_eq!(ids(&before), ids(&after));
        let starts_after = w.starts.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.len();
        assert_eq!(starts_before, starts_after, "no StartReplica after the head restart");
        w.kill();
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}

/// A replica of tensor_parallel_size 2 x pipeline_parallel_size 2 on two 2-GPU workers: stage 0
/// on one, stage 1 on the other. The driver's node is started first; the member node once the
/// driver reported its rendezvous, with that rendezvous and the group token. A member rank's
/// failure fails the replica, stops it on both nodes, and a replacement group is placed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_across_two_workers_starts_in_two_phases_and_a_member_failure_replaces_it() -> Result<()> {
    let cluster = Cluster::builder()
        .store(Store::Embedded)
        .head_args(&["--worker-timeout", "2s", "--reconcile-interval", "200ms", "--replica-restart-delay", "200ms"])
        .env("RUST_LOG", "info")
        .start()
        .await?;
    let outcome = async {
        let head = cluster.head();
        let mut c = head.wait_leader(Duration::from_secs(20)).await?;
        let a = FakeWorker::spawn(head.url.clone(), "node-a", 2);
        let b = FakeWorker::spawn(head.url.clone(), "node-b", 2);
        wait_until(Duration::from_secs(10), "two workers", || {
            let mut c = c.clone();
            async move { c.list_nodes(ListNodesRequest {}).await.is_ok_and(|n| n.into_inner().nodes.len() == 2) }
        })
        .await?;
        let mut big = spec("big", 2, 1);
        if let Some(e) = big.engine.as_mut() {
            e.pipeline_parallel_size = Some(2);
        }
        c.apply_deployment(ApplyDeploymentRequest { spec: Some(big) }).await?;
        let rs = poll_until(Duration::from_secs(10), "the group Ready", || {
            let mut c = c.clone();
            async move { replicas(&mut c, "big").await.ok().filter(|rs| count(rs, ReplicaState::Ready) == 1) }
        })
        .await?;
        let r = rs[0].clone();
        let groups: Vec<(String, u32, Vec<u32>)> =
            r.rank_groups.iter().map(|g| (g.node_id.clone(), g.first_rank, g.gpu_indices.clone())).collect();
        assert_eq!(groups, vec![("node-a".into(), 0, vec![0, 1]), ("node-b".into(), 2, vec![0, 1])]);
        assert_eq!((r.node_id.as_str(), r.rendezvous.as_str()), ("node-a", "node-a.fake:41000"));
        let (sa, sb) = (a.start_msgs()?, b.start_msgs()?);
        assert_eq!(sa.len(), 1, "{sa:?}");
        assert_eq!(sb.len(), 1, "{sb:?}");
        assert_eq!((sa[0].rendezvous.as_str(), sa[0].gpu_indices.clone()), ("", vec![0, 1]));
        assert_eq!((sb[0].rendezvous.as_str(), sb[0].gpu_indices.clone()), ("node-a.fake:41000", vec![0, 1]));
        assert!(!r.group_token.is_empty());
        for s in [&sa[0], &sb[0]] {
            assert_eq!((&s.group_token, &s.rank_groups), (&r.group_token, &r.rank_groups));
        }
        // A member rank fails: the replica is Failed naming it, both nodes stop it, and a new
        // group takes its place (it had been Ready; restart delay 200 ms here).
        b.inject.send((r.replica_id.clone(), ReplicaState::Failed, "rank 3 exited".into()))?;
        let next = poll_until(Duration::from_secs(10), "a replacement group Ready", || {
            let mut c = c.clone();
            let old = r.replica_id.clone();
            async move {
                replicas(&mut c, "big")
                    .await
                    .ok()
                    .filter(|rs| rs.len() == 1 && rs[0].replica_id != old && rs[0].state() == ReplicaState::Ready)
            }
        })
        .await?;
        let (sa, sb) = (a.start_msgs()?, b.start_msgs()?);
        assert_eq!(sa.iter().map(|s| &s.replica_id).collect::<Vec<_>>(), [&r.replica_id, &next[0].replica_id]);
        assert_eq!(sb.iter().map(|s| &s.replica_id).collect::<Vec<_>>(), [&r.replica_id, &next[0].replica_id]);
        assert_ne!(next[0].group_token, r.group_token);
        let events: serde_json::Value = reqwest::get(format!("{}/v1/events", head.http)).await?.json().await?;
        let failed =
            events["events"].as_array().context("events")?.iter().any(|e| {
                e["kind"] == "replica_failed" && e["message"] == "ranks 2-3 on node node-b failed: rank 3 exited"
            });
        assert!(failed, "{events}");
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}

/// A rank that dies while its GPU group is still loading (a member node reports FAILED
/// during Starting) is transient: the Failed group is replaced after the restart delay,
/// and a second start failure of the deployment waits twice as long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_that_fails_while_starting_is_replaced_with_a_backoff() -> Result<()> {
    let cluster = Cluster::builder()
        .store(Store::Embedded)
        .head_args(&["--worker-timeout", "2s", "--reconcile-interval", "100ms", "--replica-restart-delay", "500ms"])
        .env("RUST_LOG", "info")
        .start()
        .await?;
    let outcome = async {
        let head = cluster.head();
        let mut c = head.wait_leader(Duration::from_secs(20)).await?;
        let a = FakeWorker::spawn(head.url.clone(), "node-a", 2);
        let b = FakeWorker::spawn(head.url.clone(), "node-b", 2);
        for w in [&a, &b] {
            w.hold_starting.store(true, Ordering::SeqCst);
        }
        wait_until(Duration::from_secs(10), "two workers", || {
            let mut c = c.clone();
            async move { c.list_nodes(ListNodesRequest {}).await.is_ok_and(|n| n.into_inner().nodes.len() == 2) }
        })
        .await?;
        let mut big = spec("big", 2, 1);
        if let Some(e) = big.engine.as_mut() {
            e.pipeline_parallel_size = Some(2);
        }
        c.apply_deployment(ApplyDeploymentRequest { spec: Some(big) }).await?;
        // Fails the member ranks of the group now Starting (after the member node got its
        // start) and returns its Failed record and the replacement's record.
        let fail_starting = |old: Option<String>| {
            let (c, b) = (c.clone(), &b);
            async move {
                let r = poll_until(Duration::from_secs(10), "a new group Starting on both nodes", || {
                    let mut c = c.clone();
                    let (old, b) = (old.clone(), b);
                    async move {
                        let rs = replicas(&mut c, "big").await.ok()?;
                        let r = rs.into_iter().find(|r| Some(&r.replica_id) != old.as_ref())?;
                        let on_b = b.start_msgs().ok()?.iter().any(|s| s.replica_id == r.replica_id);
                        (r.state() == ReplicaState::Starting && on_b).then_some(r)
                    }
                })
                .await?;
                b.inject.send((r.replica_id.clone(), ReplicaState::Failed, "rank 3 killed by signal 9".into()))?;
                let failed = poll_until(Duration::from_secs(10), "the group Failed", || {
                    let mut c = c.clone();
                    let id = r.replica_id.clone();
                    async move {
                        let rs = replicas(&mut c, "big").await.ok()?;
                        rs.into_iter().find(|x| x.replica_id == id && x.state() == ReplicaState::Failed)
                    }
                })
                .await?;
                assert_eq!(failed.reason, "ranks 2-3 on node node-b failed: rank 3 killed by signal 9");
                assert_eq!(failed.ready_unix_ms, 0, "it failed while starting");
                let next = poll_until(Duration::from_secs(15), "a replacement group", || {
                    let mut c = c.clone();
                    let id = r.replica_id.clone();
                    async move {
                        let rs = replicas(&mut c, "big").await.ok()?;
                        (rs.len() == 1 && rs[0].replica_id != id).then(|| rs[0].clone())
                    }
                })
                .await?;
                anyhow::Ok((failed, next))
            }
        };
        let (first, second) = fail_starting(None).await?;
        let waited = second.created_unix_ms.saturating_sub(first.failed_unix_ms);
        assert!(waited >= 500, "replaced {waited} ms after it failed (restart delay 500 ms)");
        let (second_failed, third) = fail_starting(Some(first.replica_id.clone())).await?;
        assert_eq!(second_failed.replica_id, second.replica_id);
        let waited = third.created_unix_ms.saturating_sub(second_failed.failed_unix_ms);
        assert!(waited >= 1000, "second start failure replaced after {waited} ms (backoff 2 x 500 ms)");
        // The third group loads: it turns Ready (and the deployment's backoff resets).
        wait_until(Duration::from_secs(10), "the third group started on node-b", || {
            let id = third.replica_id.clone();
            let b = &b;
            async move { b.start_msgs().is_ok_and(|m| m.iter().any(|s| s.replica_id == id)) }
        })
        .await?;
        for w in [&a, &b] {
            w.inject.send((third.replica_id.clone(), ReplicaState::Ready, String::new()))?;
        }
        poll_until(Duration::from_secs(10), "the third group Ready", || {
            let mut c = c.clone();
            let id = third.replica_id.clone();
            async move {
                let rs = replicas(&mut c, "big").await.ok()?;
                (rs.len() == 1 && rs[0].replica_id == id && rs[0].state() == ReplicaState::Ready).then_some(())
            }
        })
        .await?;
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}
