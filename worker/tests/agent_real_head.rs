//! The worker (in-process) against a real `prism-head` process with the embedded store (the
//! shared cluster fixture of `prism-tests`, with no worker process of its own):
//! register → deployment placed on it → Ready → Generate; then the head is killed (-9) and
//! restarted on the same state file: the worker keeps serving while the head is down,
//! re-registers, and the replica keeps its id and keeps serving (adopted, not restarted).
//! Skipped when the `prism-head` binary or the model is not built/present.

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::worker_service_client::WorkerServiceClient;
use prism_common::proto::v1::{self as pb, head_service_client::HeadServiceClient};
use prism_tests::{Cluster, Store};
use prism_worker::{WorkerConfig, run};
use std::path::PathBuf;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

async fn wait_until<T, F, Fut>(timeout: Duration, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(t) = f().await {
            return Ok(t);
        }
        if tokio::time::Instant::now() > deadline {
            bail!("condition not met within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn ready_replicas(head: &str) -> Option<Vec<pb::ReplicaRecord>> {
    let mut c = HeadServiceClient::connect(head.to_owned()).await.ok()?;
    let r = c.list_replicas(pb::ListReplicasRequest { deployment: "smol".into() }).await.ok()?.into_inner();
    let ready: Vec<_> = r.replicas.into_iter().filter(|r| r.state == pb::ReplicaState::Ready as i32).collect();
    (!ready.is_empty()).then_some(ready)
}

async fn generate(endpoint: &str, replica: &str) -> Result<usize> {
    let mut w = WorkerServiceClient::connect(endpoint.to_owned()).await?;
    let mut s = w
        .generate(pb::WorkerGenerateRequest {
            replica_id: replica.into(),
            request: Some(pb::GenerateRequest {
                model: "smol".into(),
                prompt: Some(pb::generate_request::Prompt::Text("Hello".into())),
                sampling: Some(pb::SamplingParams {
                    temperature: Some(0.0),
                    max_tokens: Some(6),
                    ignore_eos: true,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        })
        .await?
        .into_inner();
    let mut n = 0;
    while let Some(m) = s.message().await? {
        n += m.token_ids.len();
    }
    Ok(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_with_real_head_serves_and_survives_head_restart() -> Result<()> {
    let model = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if prism_tests::bin_path("prism-head").is_err() || !model.exists() {
        eprintln!("skipping: prism-head binary or model missing");
        return Ok(());
    }
    let mut cluster = Cluster::builder().store(Store::Embedded).env("RUST_LOG", "warn").start().await?;
    let head_addr = cluster.head_url().to_owned();

    let g = TcpListener::bind("127.0.0.1:0").await?;
    let h = TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", g.local_addr()?);
    let shutdown = CancellationToken::new();
    let mut cfg = WorkerConfig::for_test(head_addr.clone(), "real-head-node");
    cfg.max_backoff = Duration::from_millis(300);
    let worker = tokio::spawn(run(cfg, g, h, shutdown.clone()));

    let spec = pb::DeploymentSpec {
        name: "smol".into(),
        engine: Some(pb::EngineConfig {
            model: model.to_string_lossy().into_owned(),
            served_model_name: "smol".into(),
            tensor_parallel_size: 1,
            kv_cache_bytes: Some(32 * 1024 * 1024),
            ..Default::default()
        }),
        replicas: 1,
        ..Default::default()
    };
    wait_until(Duration::from_secs(20), || {
        let spec = spec.clone();
        let head_addr = head_addr.clone();
        async move {
            let mut c = HeadServiceClient::connect(head_addr).await.ok()?;
            c.apply_deployment(pb::ApplyDeploymentRequest { spec: Some(spec) }).await.ok().map(|_| ())
        }
    })
    .await
    .context("head accepts the deployment")?;
    let ready = wait_until(Duration::from_secs(180), || ready_replicas(&head_addr)).await?;
    let replica = ready[0].clone();
    assert_eq!(replica.node_id, "real-head-node");
    assert_eq!(replica.endpoint, endpoint);
    assert_eq!(generate(&endpoint, &replica.replica_id).await?, 6);

    // kill -9 the head, restart it on the same ports and state file.
    cluster.kill_head();
    assert_eq!(generate(&endpoint, &replica.replica_id).await?, 6, "the worker serves while the head is down");
    cluster.restart_head()?;
    let again = wait_until(Duration::from_secs(30), || ready_replicas(&head_addr)).await?;
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].replica_id, replica.replica_id, "same replica adopted, not replaced");
    assert_eq!(generate(&endpoint, &replica.replica_id).await?, 6);

    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(15), worker).await???;
    Ok(())
}
