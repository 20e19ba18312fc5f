//! Placement with real processes (the cluster fixture): a real `etcd`, a real `prism-head`
//! (`--store etcd://…`, `--worker-timeout 2s`) and real `prism-worker` processes started
//! with `--simulate-gpus 4`, serving the bundled SmolLM2 GGUF on the CPU backend: gangs on
//! one node, spread, Pending until a third worker joins, re-placement after kill -9. Unlike
//! `control_plane.rs`, no protocol test double is involved. Build the binaries first:
//! `cargo build --bins`.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::head_service_client::HeadServiceClient;
use prism_common::proto::v1::{
    ApplyDeploymentRequest, DeploymentSpec, EngineConfig, ListNodesRequest, ListReplicasRequest, ReplicaRecord,
    ReplicaState, ScaleDeploymentRequest,
};
use prism_common::state_store::{StateStore, keys};
use prism_tests::{Cluster, ClusterBuilder, poll_until, wait_until, workspace_root};
use prost::Message;
use tonic::transport::Channel;

const WORKER_TIMEOUT: Duration = Duration::from_secs(2);
const DEP: &str = "smollm2";
const TP: usize = 2;

/// etcd, a head that notices a silent worker after 2 s, and workers `nodes` with 4 simulated
/// GPUs each running the real engine on the CPU.
fn cluster(nodes: &[&str]) -> ClusterBuilder {
    Cluster::builder()
        .head_args(&["--worker-timeout", "2s"])
        .worker_nodes(nodes)
        .worker_args(&["--simulate-gpus", "4", "--kv-cache-bytes", "67108864", "--engine-threads", "1"])
        .env("RUST_LOG", "warn")
}

fn spec(replicas: u32) -> DeploymentSpec {
    let model = workspace_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    DeploymentSpec {
        name: DEP.into(),
        engine: Some(EngineConfig {
            model: model.to_string_lossy().into_owned(),
            served_model_name: DEP.into(),
            tensor_parallel_size: TP as u32,
            max_num_seqs: Some(4),
            kv_cache_bytes: Some(64 << 20),
            ..Default::default()
        }),
        replicas,
        ..Default::default()
    }
}

async fn replicas(c: &HeadServiceClient<Channel>) -> Option<Vec<ReplicaRecord>> {
    let mut c = c.clone();
    Some(c.list_replicas(ListReplicasRequest { deployment: DEP.into() }).await.ok()?.into_inner().replicas)
}

fn count(rs: &[ReplicaRecord], s: ReplicaState) -> usize {
    rs.iter().filter(|r| r.state() == s).count()
}

/// Every Ready replica holds `TP` GPUs on one node; no (node, GPU) twice. Returns the nodes.
fn check_gangs(rs: &[ReplicaRecord]) -> Result<BTreeSet<String>> {
    let mut used = BTreeSet::new();
    let mut nodes = BTreeSet::new();
    for r in rs.iter().filter(|r| r.state() == ReplicaState::Ready) {
        if r.gpu_indices.len() != TP || r.node_id.is_empty() {
            bail!("replica {} holds {:?} on {:?}", r.replica_id, r.gpu_indices, r.node_id);
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

/// Waits until the deployment has exactly `ready` Ready and `pending` Pending replicas (and
/// nothing else), failing fast on a Failed replica.
async fn wait_counts(
    c: &HeadServiceClient<Channel>,
    ready: usize,
    pending: usize,
    timeout: Duration,
) -> Result<Vec<ReplicaRecord>> {
    let what = format!("{ready} Ready + {pending} Pending");
    poll_until(timeout, &what, || async {
        let rs = replicas(c).await?;
        if let Some(f) = rs.iter().find(|r| r.state() == ReplicaState::Failed) {
            panic!("replica {} failed: {}", f.replica_id, f.reason);
        }
        (rs.len() == ready + pending
            && count(&rs, ReplicaState::Ready) == ready
            && count(&rs, ReplicaState::Pending) == pending)
            .then_some(rs)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_workers_gang_spread_pending_third_worker_and_kill9() -> Result<()> {
    let mut cluster = cluster(&["node-a", "node-b"]).start().await?;
    let outcome = async {
        let c = cluster.head().wait_leader(Duration::from_secs(30)).await?;
        wait_until(Duration::from_secs(60), "2 workers registered", || async {
            let mut c = c.clone();
            c.list_nodes(ListNodesRequest {}).await.is_ok_and(|r| r.into_inner().nodes.len() == 2)
        })
        .await?;

        // Three replicas of tp 2 on 2 × 4 simulated GPUs: all Ready, gangs on one node, spread.
        c.clone().apply_deployment(ApplyDeploymentRequest { spec: Some(spec(3)) }).await?;
        let rs = wait_counts(&c, 3, 0, Duration::from_secs(180)).await?;
        let nodes = check_gangs(&rs)?;
        assert_eq!(nodes.len(), 2, "replicas spread over both nodes: {rs:?}");

        // The replica records are in etcd.
        let store = prism_head::store::EtcdStore::connect(&cluster.etcd().context("etcd")?.endpoints()).await?;
        let (stored, _) = store.list(keys::REPLICAS).await?;
        assert_eq!(stored.len(), 3, "three replica records under {}", keys::REPLICAS);
        let ids: BTreeSet<_> = rs.iter().map(|r| r.replica_id.clone()).collect();
        for (k, v) in &stored {
            assert!(k.starts_with("/prism/v1/replicas/"), "key {k}");
            let r = ReplicaRecord::decode(v.value.as_slice())?;
            assert!(k.ends_with(&r.replica_id));
            assert!(ids.contains(&r.replica_id));
            assert_eq!(r.state(), ReplicaState::Ready);
        }

        // Five replicas on 8 GPUs: one stays Pending with a reason.
        c.clone().scale_deployment(ScaleDeploymentRequest { name: DEP.into(), replicas: 5 }).await?;
        let rs = wait_counts(&c, 4, 1, Duration::from_secs(120)).await?;
        check_gangs(&rs)?;
        let pending = rs.iter().find(|r| r.state() == ReplicaState::Pending).context("pending")?;
        assert!(!pending.reason.is_empty(), "pending replica has a reason");
        println!("pending reason: {}", pending.reason);
        let pending_id = pending.replica_id.clone();

        // A third real worker places it, with nothing restarted.
        cluster.add_worker("node-c")?;
        let rs = wait_counts(&c, 5, 0, Duration::from_secs(120)).await?;
        assert_eq!(check_gangs(&rs)?.len(), 3);
        let placed = rs.iter().find(|r| r.replica_id == pending_id).context("pending replica gone")?;
        assert_eq!(placed.node_id, "node-c", "the pending replica is Ready on the new worker");

        // Back to 3 replicas so that a lost worker's replicas fit elsewhere (3 × 2 ≤ 2 × 4).
        c.clone().scale_deployment(ScaleDeploymentRequest { name: DEP.into(), replicas: 3 }).await?;
        let rs = wait_counts(&c, 3, 0, Duration::from_secs(60)).await?;
        check_gangs(&rs)?;
        let victim = rs.iter().map(|r| r.node_id.clone()).next().context("a hosting node")?;
        let lost: BTreeSet<_> = rs.iter().filter(|r| r.node_id == victim).map(|r| r.replica_id.clone()).collect();
        let idx = ["node-a", "node-b", "node-c"].iter().position(|n| *n == victim).context("victim index")?;

        // kill -9 of that worker: its replicas are Ready elsewhere within worker_timeout + 10 s.
        let t0 = Instant::now();
        cluster.workers[idx].process.kill();
        let rs = poll_until(WORKER_TIMEOUT + Duration::from_secs(10), "lost replicas Ready elsewhere", || async {
            let rs = replicas(&c).await?;
            (count(&rs, ReplicaState::Ready) == 3 && rs.iter().all(|r| r.node_id != victim)).then_some(rs)
        })
        .await?;
        let elapsed = t0.elapsed();
        check_gangs(&rs)?;
        println!(
            "kill -9 of {victim} (hosting {lost:?}): replicas Ready elsewhere after {:.2} s (worker_timeout {:?})",
            elapsed.as_secs_f64(),
            WORKER_TIMEOUT
        );
        let (stored, _) = store.list(keys::REPLICAS).await?;
        for (_, v) in &stored {
            let r = ReplicaRecord::decode(v.value.as_slice())?;
            assert_ne!(r.node_id, victim, "etcd record {} still on the dead node", r.replica_id);
        }
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}
