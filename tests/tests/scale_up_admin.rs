//! Admin calls stay answered while the head creates thousands of replicas: a real
//! `prism-head` without workers, on the embedded store and on a real etcd, is scaled to
//! 10,000 replicas (the most a deployment may have), and `ClusterStatus` is asked in a loop
//! (and another deployment applied) until all 10,000 exist, Pending. Every call must answer
//! within [`ANSWER_WITHIN`]: the reconciler applies the planner's actions in short passes and
//! lets waiting calls in between, instead of holding the state lock for the whole scale-up
//! (minutes, when each replica was its own store write and the embedded store rewrote its
//! whole file on every write). Needs only the head: `cargo build -p prism-head --bin prism-head`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::{
    ApplyDeploymentRequest, ClusterStatusRequest, ClusterStatusResponse, DeploymentSpec, EngineConfig, ReplicaState,
    ScaleDeploymentRequest,
};
use prism_tests::{Cluster, Store};
use tonic::transport::Channel;

type Client = prism_common::proto::v1::head_service_client::HeadServiceClient<Channel>;

/// The scale-up: `MAX_REPLICAS`.
const REPLICAS: usize = 10_000;
/// Bound on one admin call during the scale-up, generous for a debug build on two busy cores
/// (a status of 10,000 replicas takes about 0.5 s there; before, calls waited for minutes).
const ANSWER_WITHIN: Duration = Duration::from_secs(5);
/// Bound on the whole scale-up (about 3 s on the 2-core machine, embedded store).
const SCALED_WITHIN: Duration = Duration::from_secs(180);

fn spec(name: &str, replicas: u32) -> DeploymentSpec {
    DeploymentSpec {
        name: name.into(),
        engine: Some(EngineConfig {
            model: "/models/SmolLM2-135M-Instruct.Q4_1.gguf".into(),
            tensor_parallel_size: 1,
            ..Default::default()
        }),
        replicas,
        ..Default::default()
    }
}

/// `ClusterStatus`, failing when it takes longer than [`ANSWER_WITHIN`]; with its latency.
async fn timed_status(c: &mut Client) -> Result<(ClusterStatusResponse, Duration)> {
    let t = Instant::now();
    let status = tokio::time::timeout(ANSWER_WITHIN, c.cluster_status(ClusterStatusRequest {}))
        .await
        .with_context(|| format!("ClusterStatus did not answer within {ANSWER_WITHIN:?} during the scale-up"))??
        .into_inner();
    Ok((status, t.elapsed()))
}

async fn admin_calls_answer_during_a_large_scale_up(store: Store) -> Result<()> {
    let cluster = Cluster::builder().store(store).start().await?;
    let outcome = async {
        let mut c = cluster.head().wait_leader(Duration::from_secs(30)).await?;
        c.apply_deployment(ApplyDeploymentRequest { spec: Some(spec("big", 1)) }).await?;
        let started = Instant::now();
        c.scale_deployment(ScaleDeploymentRequest { name: "big".into(), replicas: REPLICAS as u32 }).await?;
        let (mut slowest, mut in_flight) = (Duration::ZERO, 0);
        let status = loop {
            let (status, took) = timed_status(&mut c).await?;
            slowest = slowest.max(took);
            let big = status.replicas.iter().filter(|r| r.deployment == "big").count();
            if big >= REPLICAS {
                break status;
            }
            in_flight += 1;
            if in_flight == 1 {
                // A write too: it needs the same lock as the reconciler.
                let t = Instant::now();
                let apply = c.apply_deployment(ApplyDeploymentRequest { spec: Some(spec("probe", 0)) });
                tokio::time::timeout(ANSWER_WITHIN, apply)
                    .await
                    .with_context(|| format!("ApplyDeployment did not answer within {ANSWER_WITHIN:?}"))??;
                slowest = slowest.max(t.elapsed());
            }
            if started.elapsed() > SCALED_WITHIN {
                bail!("{big} of {REPLICAS} replicas after {SCALED_WITHIN:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        eprintln!(
            "{store:?}: {REPLICAS} replicas after {:.1} s; {in_flight} status calls answered during the scale-up, \
             slowest admin call {:.0} ms",
            started.elapsed().as_secs_f64(),
            slowest.as_secs_f64() * 1e3
        );
        let big: Vec<_> = status.replicas.iter().filter(|r| r.deployment == "big").collect();
        assert_eq!(big.len(), REPLICAS, "no replica created twice");
        assert!(big.iter().all(|r| r.state() == ReplicaState::Pending && !r.reason.is_empty()));
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_answer_during_a_scale_to_10000_on_the_embedded_store() -> Result<()> {
    admin_calls_answer_during_a_large_scale_up(Store::Embedded).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_calls_answer_during_a_scale_to_10000_on_etcd() -> Result<()> {
    admin_calls_answer_during_a_large_scale_up(Store::Etcd).await
}
