//! End to end on the distributed layout of the README: a real etcd, one
//! `prism-head`, two `prism-worker`s and one `prism-router`, each its own process on
//! loopback. A deployment of two replicas of the bundled model lands one replica on each
//! worker; the router serves the same greedy answers as the reference fixture and as
//! `prism up`; `prism status` lists both workers and both replicas.
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::head_service_client::HeadServiceClient;
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{ClusterStatusRequest, ListModelsRequest, ReplicaState};
use prism_tests::{Cluster, Deployment, check_models, check_reference_greedy, eventually, model, post_json};
use serde_json::json;
use std::time::Duration;

const SERVED: &str = "SmolLM2-135M-Instruct";

/// Starts etcd, head, two workers and a router, the way the README does (default flags).
async fn start_cluster() -> Result<Cluster> {
    Cluster::builder().worker_nodes(&["worker-1", "worker-2"]).routers(1).start().await
}

async fn deploy_and_wait(cluster: &mut Cluster, model: &std::path::Path) -> Result<()> {
    // Both workers registered.
    let head_url = cluster.head_url().to_owned();
    eventually(Duration::from_secs(60), "two workers registered", || {
        let head_url = head_url.clone();
        async move {
            let mut head = HeadServiceClient::connect(head_url).await?;
            let status = head.cluster_status(ClusterStatusRequest {}).await?.into_inner();
            Ok((status.is_leader && status.nodes.len() == 2).then_some(()))
        }
    })
    .await?;
    cluster.check_alive()?;

    let out = cluster.deploy(&Deployment::new(model).served_as(SERVED).replicas(2))?;
    assert!(out.contains("deployment smollm2 created"), "{out}");

    let head_url = cluster.head_url().to_owned();
    eventually(Duration::from_secs(240), "two Ready replicas on two nodes", || {
        let head_url = head_url.clone();
        async move {
            let mut head = HeadServiceClient::connect(head_url).await?;
            let status = head.cluster_status(ClusterStatusRequest {}).await?.into_inner();
            if let Some(failed) = status.replicas.iter().find(|r| r.state == ReplicaState::Failed as i32) {
                bail!("replica {} failed: {}", failed.replica_id, failed.reason);
            }
            let ready: Vec<_> = status.replicas.iter().filter(|r| r.state == ReplicaState::Ready as i32).collect();
            let spread = ready.len() == 2 && ready[0].node_id != ready[1].node_id;
            Ok(spread.then_some(()))
        }
    })
    .await?;
    let grpc = cluster.grpc().to_owned();
    eventually(Duration::from_secs(30), "router sees both replicas", || {
        let grpc = grpc.clone();
        async move {
            let mut router = InferenceServiceClient::connect(grpc).await?;
            let models = router.list_models(ListModelsRequest {}).await?.into_inner().models;
            Ok(models.iter().any(|m| m.id == SERVED && m.ready_replicas == 2).then_some(()))
        }
    })
    .await
}

async fn check_serving(cluster: &Cluster) -> Result<()> {
    check_models(cluster.http(), SERVED).await?;
    // Several rounds so both replicas answer: each must give the reference tokens.
    for _ in 0..2 {
        check_reference_greedy(cluster.grpc(), SERVED).await?;
    }
    let body = json!({
        "model": SERVED,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 48,
    });
    let (status, reply) = post_json(&format!("{}/v1/chat/completions", cluster.http()), &body).await?;
    assert_eq!(status, 200, "{reply}");
    let answer = reply["choices"][0]["message"]["content"].as_str().context("content")?;
    assert!(answer.contains("Paris"), "{answer}");
    Ok(())
}

fn check_status(cluster: &Cluster) -> Result<()> {
    let status = cluster.cli(&["status"])?;
    assert!(status.contains("Nodes (2):"), "{status}");
    for node in ["worker-1", "worker-2"] {
        let line =
            status.lines().find(|l| l.starts_with(node)).with_context(|| format!("{node} missing:\n{status}"))?;
        assert!(line.split_whitespace().any(|c| c == "Ready"), "{line}");
    }
    assert!(status.contains("Replicas (2):"), "{status}");
    let replicas: Vec<&str> = status.lines().filter(|l| l.starts_with("smollm2-")).collect();
    assert_eq!(replicas.len(), 2, "{status}");
    let mut nodes: Vec<&str> = replicas.iter().filter_map(|l| l.split_whitespace().nth(2)).collect();
    nodes.sort_unstable();
    assert_eq!(nodes, ["worker-1", "worker-2"], "{status}");
    assert!(replicas.iter().all(|l| l.split_whitespace().any(|c| c == "Ready")), "{status}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_head_two_workers_and_router_serve_the_reference_answer() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = start_cluster().await?;
    let outcome = async {
        deploy_and_wait(&mut cluster, &model).await.context("deploy")?;
        check_serving(&cluster).await.context("serving")?;
        check_status(&cluster).context("prism status")
    }
    .await;
    if let Err(e) = outcome {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
