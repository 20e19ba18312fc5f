//! A short outage of every replica of a model is a wait in the router's queue, not a 503:
//! requests that arrive while the only replica's worker is dead (`kill -9`) or frozen
//! (SIGSTOP), before the head declares the node dead and a replacement is Ready, wait in the
//! admission queue and are served by the replacement. None is told that its replica "lost its
//! worker" (none had started), and none is refused at once.
//!
//! Real cluster (the serving cluster fixture, `Cluster::serving`): etcd, `prism-head`
//! (`--worker-timeout 2s`), 2 `prism-worker`s on the bundled SmolLM2 GGUF (CPU engine), one
//! replica (so one worker holds all of them and the other has free slots), `prism-router`
//! (default 30 s `--max-queue-wait`). After the outage starts, a completion is sent every
//! [`PERIOD`] for [`REQUESTS`] requests; each must answer 200 with text.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail, ensure};
use prism_common::proto::v1::ReplicaState;
use prism_tests::{Cluster, SERVED, eventually, model};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

/// Time between two requests during the outage.
const PERIOD: Duration = Duration::from_millis(700);
/// Requests sent from the start of the outage: they span ~7 s, past the ~4–6 s it takes the
/// head to declare the node dead and a replacement to be Ready.
const REQUESTS: usize = 10;
/// The client's limit on one request: the queue's 30 s wait bound and then some.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug)]
enum Outage {
    Kill,
    Freeze,
}

/// The node of the one Ready replica, once there is exactly one and it is not on `not`.
async fn ready_node(c: &Cluster, not: &str) -> Result<String> {
    eventually(Duration::from_secs(120), "one Ready replica", || async {
        let ready: Vec<String> =
            c.replicas().await?.into_iter().filter(|r| r.state() == ReplicaState::Ready).map(|r| r.node_id).collect();
        Ok(match ready.as_slice() {
            [one] if one != not => Some(one.clone()),
            _ => None,
        })
    })
    .await
}

/// `(status, Retry-After, error message or text, time taken)` of one completion.
async fn completion(http: String) -> Result<(u16, Option<String>, String, Duration)> {
    let body = json!({"model": SERVED, "prompt": "The capital of France is", "max_tokens": 4});
    let started = Instant::now();
    let r = reqwest::Client::new()
        .post(format!("{http}/v1/completions"))
        .json(&body)
        .timeout(CLIENT_TIMEOUT)
        .send()
        .await?;
    let status = r.status().as_u16();
    let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let v: Value = r.json().await?;
    let text = v["choices"][0]["text"].as_str().or_else(|| v["error"]["message"].as_str()).unwrap_or_default();
    Ok((status, retry, text.to_owned(), started.elapsed()))
}

async fn scenario(c: &mut Cluster, how: Outage, stopped: &mut Option<String>) -> Result<()> {
    let (status, _, text, _) = completion(c.http().to_owned()).await?;
    ensure!(status == 200, "before the outage: {status} {text}");
    let holder = ready_node(c, "").await?;
    match how {
        Outage::Kill => c.worker_mut(&holder)?.process.kill(),
        Outage::Freeze => {
            c.worker(&holder)?.process.freeze()?;
            *stopped = Some(holder.clone());
        }
    }
    let began = Instant::now();
    let mut calls = Vec::new();
    let mut pace = tokio::time::interval(PERIOD);
    for _ in 0..REQUESTS {
        pace.tick().await;
        let sent = began.elapsed();
        calls.push((sent, tokio::spawn(completion(c.http().to_owned()))));
    }
    let mut failures = Vec::new();
    for (sent, call) in calls {
        let (status, retry, text, took) = call.await.context("join")??;
        println!("{how:?}: sent {sent:?} after the outage began: {status} in {took:?} {text:?}");
        if status != 200 || text.is_empty() {
            failures.push(format!("sent at {sent:?}: {status} (Retry-After {retry:?}) after {took:?}: {text}"));
        }
    }
    if !failures.is_empty() {
        bail!("{how:?}: requests during the outage failed instead of waiting:\n{}", failures.join("\n"));
    }
    let replacement = ready_node(c, &holder).await?;
    println!("{how:?}: the replica on {holder} was replaced on {replacement}");
    Ok(())
}

async fn run(how: Outage) -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut c = Cluster::serving(&model, 2, 1).start().await?;
    let mut stopped = None;
    let result = scenario(&mut c, how, &mut stopped).await;
    if let Some(w) = stopped.and_then(|node| c.worker(&node).ok()) {
        // Never leave a stopped process behind, whatever happened.
        let _ = w.process.thaw();
    }
    c.with_logs(result)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_wait_while_the_only_replicas_worker_is_killed_and_replaced() -> Result<()> {
    run(Outage::Kill).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_wait_while_the_only_replicas_worker_is_frozen_and_replaced() -> Result<()> {
    run(Outage::Freeze).await
}
