//! A node id belongs to one worker process at a time, on a real local cluster (etcd, a head
//! with `--worker-timeout 2s`, real `prism-worker` processes, the bundled SmolLM2 GGUF):
//! - `a_second_worker_with_a_node_id_in_use_is_refused_and_a_restarted_one_gets_in`: a second
//!   worker started with the live worker's `--node-id` is refused by the head (the message
//!   names the node id, where the live worker is, and that node ids must be unique) and exits
//!   non-zero at start-up; the live worker keeps its session and its replica (same id, never
//!   replaced). A worker restarted while the head still holds its frozen predecessor's
//!   session gets in once that session times out, and the replica is Ready on it again.
//!   The frozen predecessor, resumed, has been superseded: refused by the head, it stops its
//!   replica and exits non-zero saying so, instead of retrying forever with its engine loaded.
//! - `a_worker_with_nothing_to_offer_fails_at_start_up`: `--cpu-slots 0` on a node without
//!   GPUs exits non-zero at once with a clear error instead of retrying a registration the
//!   head refuses.
//!
//! The first test is skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::{ReplicaRecord, ReplicaState};
use prism_tests::{Cluster, Deployment, Process, bin_path, eventually, free_port, model};
use std::time::Duration;

const NODE: &str = "w1";

fn ready(replicas: &[ReplicaRecord]) -> Vec<(String, String)> {
    replicas
        .iter()
        .filter(|r| r.state() == ReplicaState::Ready)
        .map(|r| (r.replica_id.clone(), r.node_id.clone()))
        .collect()
}

/// The worker address the head holds for `NODE`.
async fn registered_address(cluster: &Cluster) -> Result<String> {
    let st = cluster.status().await?;
    st.nodes
        .iter()
        .filter_map(|n| n.inventory.as_ref())
        .find(|i| i.node_id == NODE)
        .map(|i| i.address.clone())
        .context("node not registered")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_worker_with_a_node_id_in_use_is_refused_and_a_restarted_one_gets_in() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::builder()
        .head_args(&["--worker-timeout", "2s"])
        .worker_nodes(&[NODE])
        .worker_args(&["--kv-cache-bytes", "67108864", "--engine-threads", "1"])
        .deploy(Deployment::new(&model).replicas(1))
        .start()
        .await?;
    let outcome = async {
        let before = ready(&cluster.replicas().await?);
        assert_eq!(before.len(), 1, "{before:?}");
        let first_address = registered_address(&cluster).await?;
        assert_eq!(first_address, cluster.workers[0].grpc);

        // Another process with the same node id: refused, and it gives up at start-up.
        cluster.add_worker(NODE)?;
        let status = cluster.workers[1].process.wait_exit(Duration::from_secs(30)).await?;
        cluster.workers[1].process.wait_stderr_closed(Duration::from_secs(5)).await?;
        let log = cluster.workers[1].process.stderr();
        assert!(!status.success(), "the refused worker exited with {status}");
        for part in [
            "refused to register this worker",
            "node id \"w1\" is in use by another live worker process",
            &format!("advertising {first_address}"),
            "connected from 127.0.0.1:",
            "each worker needs a unique --node-id",
            "--worker-timeout",
        ] {
            assert!(log.contains(part), "the refused worker's log lacks {part:?}:\n{log}");
        }
        let head_log = cluster.head().process.stderr();
        assert!(
            head_log.contains("refused a worker registration"),
            "the head logged no warning about the refusal:\n{head_log}"
        );
        // The live worker never lost its session, and its replica was neither stopped nor replaced.
        let first_log = cluster.workers[0].process.stderr();
        assert!(!first_log.contains("head session ended"), "the live worker lost its session:\n{first_log}");
        let after = cluster.replicas().await?;
        assert_eq!(ready(&after), before, "replicas changed: {after:?}");
        assert_eq!(after.len(), 1, "{after:?}");
        assert_eq!(registered_address(&cluster).await?, first_address);

        // The worker restarts before the head noticed that its old process is gone (frozen:
        // its connection stays open): the new process is refused until the head ends the
        // silent session, then registers instead of giving up.
        cluster.workers[0].process.freeze()?;
        cluster.workers.remove(1);
        cluster.add_worker(NODE)?;
        let (c, new_address) = (&cluster, cluster.workers[1].grpc.as_str());
        eventually(Duration::from_secs(30), "the restarted worker registered", || async move {
            Ok((registered_address(c).await? == new_address).then_some(()))
        })
        .await?;
        // The old process resumes: superseded, it stops its replica and exits non-zero.
        cluster.workers[0].process.thaw()?;
        let status = cluster.workers[0].process.wait_exit(Duration::from_secs(30)).await?;
        cluster.workers[0].process.wait_stderr_closed(Duration::from_secs(5)).await?;
        let old_log = cluster.workers[0].process.stderr();
        assert!(!status.success(), "the superseded worker exited with {status}:\n{old_log}");
        for part in ["this worker was superseded", "node id \"w1\" is in use by another live worker process"] {
            assert!(old_log.contains(part), "the superseded worker's log lacks {part:?}:\n{old_log}");
        }
        if cluster.workers[1].process.exited() {
            bail!("the restarted worker exited:\n{}", cluster.workers[1].process.stderr());
        }
        // The replica comes back on the restarted worker.
        cluster.wait_ready(1, Duration::from_secs(120)).await?;
        let back = ready(&cluster.replicas().await?);
        assert_eq!(back.len(), 1, "{back:?}");
        assert_eq!(back[0].1, NODE);
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_nothing_to_offer_fails_at_start_up() -> Result<()> {
    let (gp, hp) = (free_port()?, free_port()?);
    let args: Vec<String> = [
        "--head",
        "http://127.0.0.1:9",
        "--node-id",
        "empty",
        "--cpu-slots",
        "0",
        "--listen",
        &format!("127.0.0.1:{gp}"),
        "--http-listen",
        &format!("127.0.0.1:{hp}"),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let mut worker = Process::spawn("empty", &bin_path("prism-worker")?, &args, &[])?;
    let status = worker.wait_exit(Duration::from_secs(20)).await?;
    worker.wait_stderr_closed(Duration::from_secs(5)).await?;
    let log = worker.stderr();
    assert!(!status.success(), "exited with {status}:\n{log}");
    assert!(log.contains("no GPUs and --cpu-slots is 0"), "{log}");
    assert!(!log.contains("reconnecting"), "it tried to register:\n{log}");
    Ok(())
}
