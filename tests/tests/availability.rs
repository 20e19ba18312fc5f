//! What the router answers when no replica can serve a model, on real processes (head with
//! the embedded store, workers, router):
//!
//! - Readiness (`/readyz`, `/health`, `grpc.health.v1`) means "can take requests": with only
//!   an autoscaled model at zero replicas the router is ready (a request scales it up); with
//!   nothing deployed, or every model unavailable, it is not.
//! - A deployment without autoscaling scaled to 0, and one whose replica no node can take
//!   (its only node cordoned), get a 503 at once (HTTP: OpenAI error saying why, with
//!   `Retry-After`; gRPC: UNAVAILABLE with `retry-after`), not after the 30 s queue wait;
//!   once the node is uncordoned the replica is placed and the router learns it.
//! - `/tokenize`, `/detokenize` and gRPC `Tokenize` of those models get the same answer.
//! - An autoscaled model at zero still queues its request (scale from zero), and `/v1/models`
//!   lists it with the `max_model_len` its deployment sets though no replica reported one.
//! - An autoscaled model back at zero after serving keeps `/tokenize`, `/detokenize` and gRPC
//!   `Tokenize` answering with the codec its replica had, token-exact and without waking a
//!   replica, until a deploy changes its engine config (then 503 until a replica is Ready).
//! - Every worker killed (C15): once the head replaced the lost replica by a Pending one that
//!   no node can take, requests get a fast 503 / UNAVAILABLE naming the reason; when the
//!   worker comes back the same router serves again, token-exact.
//!
//! The first scenario needs no model (its model files do not exist); the others are skipped
//! when the bundled model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, ensure};
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{ReplicaState, TokenizeRequest, tokenize_request};
use prism_tests::{Cluster, Deployment, SERVED, Store, eventually, greedy_request, model, stream};
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Longest a refusal may take: far below the queue's 30 s wait bound.
const FAST: Duration = Duration::from_secs(2);

/// A model file that does not exist (no replica of it ever starts).
const MISSING: &str = "/nonexistent/prism-test/model.gguf";

/// `(status, Retry-After seconds, error message, time taken)` of a chat request for `model`,
/// given up after `limit`.
async fn chat(http: &str, model: &str, limit: Duration) -> Result<(u16, Option<u32>, String, Duration)> {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let started = Instant::now();
    let r =
        reqwest::Client::new().post(format!("{http}/v1/chat/completions")).json(&body).timeout(limit).send().await?;
    let status = r.status().as_u16();
    let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|s| s.parse().ok());
    let v: Value = r.json().await?;
    let message = v["error"]["message"].as_str().unwrap_or_default().to_owned();
    Ok((status, retry, message, started.elapsed()))
}

/// `(status, Retry-After seconds, error message)` of a chat request for `model`, which must
/// be answered within [`FAST`].
async fn answer(http: &str, model: &str) -> Result<(u16, Option<u32>, String)> {
    let (status, retry, message, took) = chat(http, model, Duration::from_secs(10)).await?;
    ensure!(took < FAST, "{model}: answered after {took:?}: {status} {message}");
    Ok((status, retry, message))
}

/// Polls until a request for `model` is refused at once (503 with `Retry-After`) with a
/// message containing `why`; returns the message.
async fn refused(http: &str, model: &str, why: &str) -> Result<String> {
    eventually(Duration::from_secs(30), &format!("{model} refused at once ({why})"), || async {
        let (status, retry, message) = answer(http, model).await?;
        ensure!(status == 404 || status == 503, "{model}: {status} {message}");
        Ok((status == 503 && message.contains(why)).then_some((retry, message)))
    })
    .await
    .and_then(|(retry, message)| {
        ensure!(retry.is_some_and(|s| s >= 1), "{model}: Retry-After {retry:?}");
        Ok(message)
    })
}

/// `max_model_len` of `model` in the router's `GET /v1/models` (`None`: no such key).
async fn listed_max_model_len(http: &str, model: &str) -> Result<Option<u64>> {
    let models: Value = reqwest::get(format!("{http}/v1/models")).await?.json().await?;
    let obj = models["data"].as_array().into_iter().flatten().find(|m| m["id"] == model);
    let obj = obj.with_context(|| format!("{model} not listed: {models}"))?;
    Ok(obj.get("max_model_len").and_then(Value::as_u64))
}

/// `/tokenize`, `/detokenize` and gRPC `Tokenize` for `model`, which the head lists as
/// unavailable: refused at once like its chat requests (503 naming `why`, `Retry-After:
/// retry_after`; gRPC UNAVAILABLE with `retry-after`), not with the generic "no ready replica".
async fn tokenize_refused(cluster: &Cluster, model: &str, why: &str, retry_after: u32) -> Result<()> {
    let client = reqwest::Client::new();
    let bodies = [
        ("/tokenize", json!({"model": model, "prompt": "hi"})),
        ("/tokenize", json!({"model": model, "messages": [{"role": "user", "content": "hi"}]})),
        ("/detokenize", json!({"model": model, "tokens": [1, 2]})),
    ];
    for (path, body) in bodies {
        let started = Instant::now();
        let r = client.post(format!("{}{path}", cluster.http())).json(&body).timeout(FAST).send().await?;
        let status = r.status().as_u16();
        let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let v: Value = r.json().await?;
        let message = v["error"]["message"].as_str().unwrap_or_default();
        ensure!(status == 503 && message.contains(why), "{path} {model}: {status} {v}");
        ensure!(retry == Some(retry_after.to_string()), "{path} {model}: Retry-After {retry:?}");
        ensure!(started.elapsed() < FAST, "{path} {model}: answered after {:?}", started.elapsed());
    }
    let channel = tonic::transport::Endpoint::from_shared(cluster.grpc().to_owned())?.connect().await?;
    let mut grpc = InferenceServiceClient::new(channel);
    let req = TokenizeRequest {
        model: model.into(),
        input: Some(tokenize_request::Input::Text("hi".into())),
        ..Default::default()
    };
    let status = grpc.tokenize(req).await.err().context("gRPC Tokenize of an unavailable model answered")?;
    ensure!(status.code() == tonic::Code::Unavailable && status.message().contains(why), "{model}: {status:?}");
    let retry = status.metadata().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
    ensure!(retry == Some(retry_after.to_string()), "gRPC {model}: retry-after {retry:?}");
    Ok(())
}

/// `(/readyz, /health, grpc.health.v1 "")` of the router.
async fn probes(cluster: &Cluster) -> Result<(u16, u16, i32)> {
    let get = |p: &str| reqwest::get(format!("{}{p}", cluster.http()));
    let (readyz, health) = (get("/readyz").await?.status().as_u16(), get("/health").await?.status().as_u16());
    let channel = tonic::transport::Endpoint::from_shared(cluster.grpc().to_owned())?.connect().await?;
    let grpc = HealthClient::new(channel).check(HealthCheckRequest { service: String::new() }).await?;
    Ok((readyz, health, grpc.into_inner().status))
}

async fn wait_probes(cluster: &Cluster, want: (u16, u16, ServingStatus), what: &str) -> Result<()> {
    let want = (want.0, want.1, want.2 as i32);
    eventually(Duration::from_secs(10), what, || async { Ok((probes(cluster).await? == want).then_some(())) }).await
}

fn missing(name: &str) -> Deployment {
    Deployment::new(std::path::Path::new(MISSING)).named(name).served_as(name)
}

async fn without_model(cluster: &mut Cluster) -> Result<()> {
    let http = cluster.http().to_owned();
    wait_probes(cluster, (503, 503, ServingStatus::NotServing), "not ready with nothing deployed").await?;

    // Only an autoscaled model at zero: ready, a request would scale it up.
    let auto =
        missing("auto").autoscaling(&[("min_replicas", "0"), ("max_replicas", "1")]).engine("max_model_len", 1024);
    cluster.deploy(&auto)?;
    wait_probes(cluster, (200, 200, ServingStatus::Serving), "ready with a model at zero").await?;
    // No replica ever reported a context length: the deployment's is listed.
    let len = listed_max_model_len(&http, "auto").await?;
    ensure!(len == Some(1024), "auto at zero lists max_model_len {len:?}, not its configured 1024");

    // Scaled to 0 without autoscaling: refused at once, on HTTP and gRPC.
    cluster.deploy(&missing("fixed").replicas(0))?;
    refused(&http, "fixed", "scaled to 0 replicas").await?;
    tokenize_refused(cluster, "fixed", "scaled to 0 replicas", 10).await?;
    let mut req = greedy_request(&[1, 2, 3], 4, false);
    req.model = "fixed".into();
    let started = Instant::now();
    let status = stream(cluster.grpc(), req).await.err().and_then(|e| e.downcast::<tonic::Status>().ok());
    let status = status.context("a gRPC status")?;
    ensure!(started.elapsed() < FAST, "gRPC answered after {:?}", started.elapsed());
    ensure!(status.code() == tonic::Code::Unavailable, "{status:?}");
    ensure!(status.metadata().get("retry-after").is_some(), "{status:?}");

    // No node can take the replica (its only node cordoned): refused at once with the
    // placer's reason; uncordoned, the replica is placed (and fails: no such file).
    cluster.cli(&["cordon", "w1"])?;
    cluster.deploy(&missing("placed"))?;
    let message = refused(&http, "placed", "no node can run a replica").await?;
    ensure!(message.contains("no schedulable node"), "{message}");
    tokenize_refused(cluster, "placed", "no node can run a replica", 5).await?;
    cluster.cli(&["uncordon", "w1"])?;
    refused(&http, "placed", "failed to start").await?;
    tokenize_refused(cluster, "placed", "failed to start", 10).await?;
    wait_probes(cluster, (200, 200, ServingStatus::Serving), "still ready: auto can come").await?;

    // The autoscaled model at zero queues its request instead (scale from zero): the queued
    // request scales it up, its replica fails to start (no such file) and only then is the
    // request answered, naming that failure. Scale-up, placement and the failure can all
    // happen within milliseconds, so the queue depth may be 1 too briefly to observe: the
    // answer's reason and the replica the request created are what show it was queued.
    let (status, _, message, took) = chat(&http, "auto", Duration::from_secs(60)).await?;
    ensure!(status == 503 && message.contains("failed to start"), "auto: {status} {message}");
    ensure!(took < Duration::from_secs(25), "auto: answered after {took:?}");
    let st = cluster.status().await?;
    ensure!(st.replicas.iter().any(|r| r.deployment == "auto"), "no replica of auto: the request scaled nothing");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_and_fast_refusals_follow_whether_a_replica_can_come() -> Result<()> {
    let mut cluster = Cluster::builder().store(Store::Embedded).workers(1).routers(1).start().await?;
    let res = without_model(&mut cluster).await;
    cluster.with_logs(res)
}

async fn workers_lost_and_back(cluster: &mut Cluster) -> Result<()> {
    let reference = stream(cluster.grpc(), greedy_request(&[1, 2, 3], 8, true)).await?.tokens;
    cluster.worker_mut("w1")?.process.kill();
    let lost = Instant::now();
    eventually(Duration::from_secs(30), "the lost replica replaced by a Pending one", || async {
        let st = cluster.status().await?;
        let pending = st.replicas.iter().all(|r| r.state == ReplicaState::Pending as i32);
        Ok((pending && !st.replicas.is_empty()).then_some(()))
    })
    .await?;
    let message = refused(cluster.http(), SERVED, "no node can run a replica").await?;
    eprintln!("every worker lost: fast 503 {:?} after the kill: {message}", lost.elapsed());
    for _ in 0..5 {
        let (status, retry, _) = answer(cluster.http(), SERVED).await?;
        ensure!(status == 503 && retry.is_some(), "{status} {retry:?}");
        let started = Instant::now();
        let s = stream(cluster.grpc(), greedy_request(&[1, 2, 3], 8, true)).await.err();
        let s = s.and_then(|e| e.downcast::<tonic::Status>().ok()).context("a gRPC status")?;
        ensure!(started.elapsed() < FAST && s.code() == tonic::Code::Unavailable, "{s:?} {:?}", started.elapsed());
        ensure!(s.metadata().get("retry-after").is_some(), "{s:?}");
    }

    // The worker comes back: the same router serves again (requests sent while the replica
    // loads wait for it).
    cluster.restart_worker("w1")?;
    let back = Instant::now();
    let served = eventually(Duration::from_secs(240), "served again", || async {
        match stream(cluster.grpc(), greedy_request(&[1, 2, 3], 8, true)).await {
            Ok(r) => Ok(Some(r.tokens)),
            Err(e) => Err(e),
        }
    })
    .await?;
    ensure!(served == reference, "tokens after the outage {served:?} differ from {reference:?}");
    eprintln!("worker back: served again {:?} after its restart", back.elapsed());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_worker_lost_is_a_fast_503_and_the_router_serves_again_when_one_returns() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::builder()
        .store(Store::Embedded)
        .head_args(&["--worker-timeout", "2s"])
        .workers(1)
        .worker_args(&["--kv-cache-bytes", "67108864"])
        .routers(1)
        .deploy(Deployment::new(&model))
        .start()
        .await?;
    let res = workers_lost_and_back(&mut cluster).await;
    cluster.with_logs(res)
}

/// `(text ids, chat ids, detokenized text, gRPC ids)` of the router's tokenizer for `model`;
/// `Err` naming the status when any is not answered with 200 / OK.
async fn tokenized(cluster: &Cluster, model: &str) -> Result<(Value, Value, Value, Vec<u32>)> {
    let client = reqwest::Client::new();
    let post = |path: &str, body: Value| {
        let req = client.post(format!("{}{path}", cluster.http())).json(&body).timeout(Duration::from_secs(10));
        async move {
            let r = req.send().await?;
            let status = r.status().as_u16();
            let v: Value = r.json().await?;
            ensure!(status == 200, "{status} {v}");
            Ok(v)
        }
    };
    let text = post("/tokenize", json!({"model": model, "prompt": "The capital of France is"})).await?;
    let chat =
        post("/tokenize", json!({"model": model, "messages": [{"role": "user", "content": "Hi there"}]})).await?;
    let back = post("/detokenize", json!({"model": model, "tokens": text["tokens"]})).await?;
    let channel = tonic::transport::Endpoint::from_shared(cluster.grpc().to_owned())?.connect().await?;
    let req = TokenizeRequest {
        model: model.into(),
        input: Some(tokenize_request::Input::Text("The capital of France is".into())),
        ..Default::default()
    };
    let grpc = InferenceServiceClient::new(channel).tokenize(req).await?.into_inner().tokens;
    Ok((text, chat, back, grpc))
}

async fn tokenizer_at_zero(cluster: &mut Cluster, model: &std::path::Path) -> Result<()> {
    cluster.wait_ready(1, Duration::from_secs(120)).await?;
    let ready = tokenized(cluster, SERVED).await?;
    ensure!(ready.0["max_model_len"] == json!(1024), "{}", ready.0);
    eventually(Duration::from_secs(60), "scaled to zero", || async {
        let st = cluster.status().await?;
        let target = st.deployments.first().and_then(|d| d.spec.as_ref()).map_or(u32::MAX, |s| s.replicas);
        Ok((target == 0 && !st.replicas.iter().any(active)).then_some(()))
    })
    .await?;
    eventually(Duration::from_secs(10), "the router's table without the replica", || async {
        Ok((cluster.router_ready_replicas().await? == 0).then_some(()))
    })
    .await?;

    // At zero: the deployment's context length is listed and the tokenizer answers as the
    // replica's did, without waking a replica.
    let len = listed_max_model_len(cluster.http(), SERVED).await?;
    ensure!(len == Some(1024), "at zero /v1/models lists max_model_len {len:?}");
    let zero = tokenized(cluster, SERVED).await.context("tokenize at zero")?;
    ensure!(zero == ready, "at zero {zero:?}\nwhile Ready {ready:?}");
    tokio::time::sleep(Duration::from_secs(2)).await;
    let st = cluster.status().await?;
    ensure!(!st.replicas.iter().any(active), "tokenizing woke a replica: {:?}", st.replicas);

    // A deploy that changes the engine config (the model could have changed with it): the
    // kept tokenizer no longer says what the next replica loads.
    cluster.deploy(&at_zero(model).engine("max_model_len", 512))?;
    eventually(Duration::from_secs(10), "the new max_model_len listed", || async {
        Ok((listed_max_model_len(cluster.http(), SERVED).await? == Some(512)).then_some(()))
    })
    .await?;
    let r = reqwest::Client::new()
        .post(format!("{}/tokenize", cluster.http()))
        .json(&json!({"model": SERVED, "prompt": "hi"}))
        .timeout(FAST)
        .send()
        .await?;
    ensure!(r.status().as_u16() == 503, "tokenize after a new spec at zero: {}", r.status());
    Ok(())
}

/// Whether `r` serves or is on its way to (Pending, Starting, Ready, Draining).
fn active(r: &prism_common::proto::v1::ReplicaRecord) -> bool {
    [ReplicaState::Pending, ReplicaState::Starting, ReplicaState::Ready, ReplicaState::Draining]
        .iter()
        .any(|s| *s as i32 == r.state)
}

/// The bundled model autoscaled between 0 and 1 replica, starting at 1 and back at 0 after
/// 6 s idle.
fn at_zero(model: &std::path::Path) -> Deployment {
    Deployment::new(model).autoscaling(&[
        ("min_replicas", "0"),
        ("max_replicas", "1"),
        ("initial_replicas", "1"),
        ("downscale_delay_s", "6"),
        ("look_back_period_s", "2"),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_autoscaled_model_at_zero_keeps_its_max_model_len_and_its_tokenizer() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::builder()
        .store(Store::Embedded)
        .workers(1)
        .worker_args(&["--kv-cache-bytes", "67108864"])
        .routers(1)
        .start()
        .await?;
    cluster.deploy(&at_zero(&model).engine("max_model_len", 1024))?;
    let res = tokenizer_at_zero(&mut cluster, &model).await;
    cluster.with_logs(res)
}
