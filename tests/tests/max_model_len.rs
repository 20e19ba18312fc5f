//! The context length a replica serves, on real processes (head with the embedded store, a
//! worker whose CPU KV cache holds fewer tokens than the bundled model's 8192, a router):
//!
//! - a deployment that sets no `max_model_len` serves the model's own capped to what the KV
//!   cache holds (vLLM's auto-fit), and `/v1/models` and `prism status` (MAX LEN) show it;
//! - a deployment whose `max_model_len` the KV cache cannot hold is not served with less:
//!   its replica fails to start, `prism status` shows why, and its requests get a 503 at once
//!   naming the reason (as vLLM refuses to start).
//!
//! Skipped when the bundled model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, ensure};
use prism_common::proto::v1::ReplicaState;
use prism_tests::{Cluster, Deployment, Store, eventually, model};
use serde_json::{Value, json};
use std::time::Duration;

/// The worker's CPU KV-cache budget: 16 MiB.
const KV_CACHE_BYTES: u64 = 16 << 20;

/// What that cache holds for the bundled model: 16-token blocks of 30 layers · K and V · 3 KV
/// heads · 64 dims · 4 bytes (f32) = 737 280 bytes each, 22 blocks, 352 tokens.
const CAPACITY: u64 = KV_CACHE_BYTES / (16 * 30 * 2 * 3 * 64 * 4) * 16;

/// The model's own context length (GGUF `llama.context_length`).
const MODEL_CONTEXT: u64 = 8192;

const FITTED: &str = "fitted";
const GIVEN: &str = "given";

async fn run(cluster: &mut Cluster, model: &std::path::Path) -> Result<()> {
    cluster.deploy(&Deployment::new(model).named(FITTED).served_as(FITTED))?;
    cluster.wait_listed(&[FITTED], Duration::from_secs(120)).await?;
    let models: Value = reqwest::get(format!("{}/v1/models", cluster.http())).await?.json().await?;
    let fitted =
        models["data"].as_array().into_iter().flatten().find(|m| m["id"] == FITTED).context("fitted listed")?;
    ensure!(fitted["max_model_len"].as_u64() == Some(CAPACITY), "auto-fit to {CAPACITY} tokens: {models}");

    let too_long = Deployment::new(model).named(GIVEN).served_as(GIVEN).engine("max_model_len", MODEL_CONTEXT);
    cluster.deploy(&too_long)?;
    let reason = eventually(Duration::from_secs(120), "the replica of `given` failed", || async {
        let st = cluster.status().await?;
        let r = st.replicas.iter().find(|r| r.deployment == GIVEN);
        let failed = r.filter(|r| r.state == ReplicaState::Failed as i32);
        ensure!(
            r.is_none_or(|r| r.state != ReplicaState::Ready as i32),
            "served although its max_model_len does not fit: {r:?}"
        );
        Ok(failed.map(|r| r.reason.clone()))
    })
    .await?;
    let fits = format!("holds {CAPACITY} tokens");
    ensure!(reason.contains("max_model_len 8192 does not fit") && reason.contains(&fits), "reason: {reason}");

    // `prism status`: the failed replica's reason, and the context length the other serves.
    let text = cluster.cli(&["status"])?;
    ensure!(text.contains("MAX LEN"), "{text}");
    let given = text.lines().find(|l| l.contains("does not fit")).context("the reason in prism status")?;
    ensure!(given.contains(GIVEN), "{text}");
    let row = text.lines().find(|l| l.starts_with(&format!("{FITTED} "))).context("fitted's row")?;
    ensure!(row.split_whitespace().any(|c| c == CAPACITY.to_string()), "MAX LEN {CAPACITY}: {text}");

    // Its requests: a 503 at once naming the reason, not a shorter context.
    let body = json!({"model": GIVEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let url = format!("{}/v1/chat/completions", cluster.http());
    let message = eventually(Duration::from_secs(30), "given's requests refused", || async {
        let r = reqwest::Client::new().post(&url).json(&body).timeout(Duration::from_secs(10)).send().await?;
        let status = r.status().as_u16();
        let v: Value = r.json().await?;
        let message = v["error"]["message"].as_str().unwrap_or_default().to_owned();
        Ok((status == 503 && message.contains("does not fit")).then_some(message))
    })
    .await?;
    ensure!(message.contains("lower max_model_len"), "{message}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_model_len_the_kv_cache_cannot_hold_fails_the_replica_and_an_unset_one_is_fitted() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let kv = KV_CACHE_BYTES.to_string();
    let mut cluster = Cluster::builder()
        .store(Store::Embedded)
        .workers(1)
        .worker_args(&["--kv-cache-bytes", &kv, "--cpu-slots", "2", "--engine-threads", "1"])
        .routers(1)
        .start()
        .await?;
    let res = run(&mut cluster, &model).await;
    cluster.with_logs(res)
}
