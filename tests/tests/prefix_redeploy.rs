//! No stale prefix-cache hit across models: a deployment redeployed under the same name with
//! another checkpoint starts with an empty cache, and the router does not match the old
//! replica's blocks for the new one. Real processes: etcd, `prism-head`, one `prism-worker`,
//! one router; the bundled model, then the same file under another path (another model
//! identity: the engine folds the model's path into the first block's hash, so even the same
//! tokens hash differently, and the replica is replaced).
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, ensure};
use prism_tests::{Cluster, Deployment, SERVED, eventually, model, post_json, router_ready_replicas};
use serde_json::json;
use std::time::Duration;

/// A prompt of about 250 tokens (15 full KV blocks).
fn prompt() -> String {
    (0..12)
        .map(|i| format!("Ledger entry {i}: the harbour office recorded cargo {i} as delivered and paid. "))
        .collect()
}

/// A greedy completion through the router: (text, prompt tokens, cached tokens).
async fn complete(http: &str) -> Result<(String, u64, u64)> {
    let body = json!({"model": SERVED, "prompt": prompt(), "max_tokens": 8, "temperature": 0.0, "ignore_eos": true});
    let (status, v) = post_json(&format!("{http}/v1/completions"), &body).await?;
    ensure!(status == 200, "completion got {status}: {v}");
    let text = v["choices"][0]["text"].as_str().context("no text")?.to_owned();
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().context("no prompt_tokens")?;
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().context("no cached_tokens")?;
    Ok((text, prompt_tokens, cached))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redeploy_under_the_same_name_never_hits_the_old_models_cache() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::builder().workers(1).routers(1).deploy(Deployment::new(&model)).start().await?;
    let outcome = async {
        let http = cluster.http().to_owned();
        let (text, prompt_tokens, cold) = complete(&http).await?;
        ensure!(prompt_tokens > 200 && cold == 0, "cold request: {prompt_tokens} prompt tokens, {cold} cached");
        let (again, _, warm) = complete(&http).await?;
        ensure!(warm > 0 && again == text, "repeat on the first model: {warm} cached, {again:?} vs {text:?}");
        let old: Vec<String> = cluster.replicas().await?.into_iter().map(|r| r.replica_id).collect();

        // The "other checkpoint": the same file under another path.
        let other = cluster.dir().join("other-model.gguf");
        std::os::unix::fs::symlink(std::fs::canonicalize(&model)?, &other)?;
        cluster.deploy(&Deployment::new(&other))?;
        eventually(Duration::from_secs(120), "only the new model's replica is Ready and routed", || async {
            let replicas = cluster.replicas().await?;
            let ready_new = replicas.iter().any(|r| {
                !old.contains(&r.replica_id) && r.state == prism_common::proto::v1::ReplicaState::Ready as i32
            });
            let old_left = replicas.iter().all(|r| !old.contains(&r.replica_id));
            let routed = router_ready_replicas(cluster.grpc(), SERVED).await?;
            Ok((ready_new && old_left && routed == 1).then_some(()))
        })
        .await?;

        let (after, prompt_after, first) = complete(&http).await?;
        ensure!(first == 0, "first request after the redeploy reused {first} cached tokens");
        ensure!(prompt_after == prompt_tokens && after == text, "same weights, same output: {after:?} vs {text:?}");
        let (_, _, second) = complete(&http).await?;
        ensure!(second == warm, "the new model caches its own blocks: {second} vs {warm} before");
        Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}
