//! The router's admission queue on real processes: etcd, `prism-head`, one `prism-worker`
//! serving the bundled model (CPU engine) with `max_num_seqs` 4, and routers.
//!
//! - A burst of 10 × `max_num_seqs` streaming requests at once (half gRPC, half OpenAI HTTP
//!   SSE) through a router with the default queue: none fails, each gives every token, the
//!   gRPC ones token-exact against an undisturbed greedy run and the HTTP ones text-exact
//!   against an undisturbed HTTP completion; the engine never holds more than the router's
//!   derived limit (`max_num_seqs` 4, no headroom below 16) while the rest waits in the router.
//! - A second router with `--max-queued-requests 4`: a burst past the bound gets 429 with
//!   `Retry-After` (HTTP) / RESOURCE_EXHAUSTED with `retry-after` (gRPC) for the overflow, and
//!   everything else completes; no other status, nothing hangs.
//! - Both routers' `prism_router_queue_depth` return to 0 afterwards.
//! - Scaled to zero (`prism scale smollm2 0`, no autoscaling) the model stays listed and a
//!   request is refused at once (UNAVAILABLE with `retry-after`: no replica will come);
//!   scaled back to 1, a request waits in the router's queue and is served token-exact by
//!   the replica that starts.
//! - A deployment whose replica cannot start (its model file does not exist) is not waited
//!   for: once the replica is Failed, a request gets 503 at once (HTTP: an OpenAI error body
//!   naming the failure and its reason, `Retry-After`; gRPC: UNAVAILABLE with `retry-after`).
//!   This one needs no model.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail, ensure};
use prism_common::proto::v1::ReplicaState;
use prism_tests::{
    Cluster, Deployment, PROMPTS, Router, SERVED, Store, eventually, greedy_request, metric_value, model, post_sse,
    reference, router_ready_replicas, stream,
};
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// The engine's batch limit in this test.
const MAX_NUM_SEQS: usize = 4;
/// What the router admits to the replica: `max_num_seqs` (a small engine gets no headroom).
const ROUTER_LIMIT: f64 = 4.0;
/// Tokens per request (EOS ignored).
const MAX_TOKENS: u32 = 8;
/// The bounded router's `--max-queued-requests`.
const SMALL_QUEUE: usize = 4;
/// Longest any request of the test may take before it counts as hung.
const HANG: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bursts_queue_in_the_router_and_only_the_overflow_is_refused() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let deployment = Deployment::new(&model).engine("max_num_seqs", MAX_NUM_SEQS);
    let mut cluster = Cluster::serving(&model, 1, 1).deploy(deployment).start().await?;
    let heads = cluster.head_url().to_owned();
    let args = ["--max-queued-requests".to_owned(), SMALL_QUEUE.to_string()];
    cluster.routers.push(Router::spawn("prism-router-bounded", &heads, &args, &[])?);
    let outcome = run(&cluster).await;
    cluster.with_logs(outcome)
}

/// A completion request of prompt `i` (token ids), greedy, EOS ignored.
fn http_body(i: usize, stream: bool) -> Value {
    json!({
        "model": SERVED, "prompt": PROMPTS[i % PROMPTS.len()], "max_tokens": MAX_TOKENS, "temperature": 0.0,
        "ignore_eos": true, "stream": stream, "stream_options": if stream { json!({"include_usage": true}) } else { Value::Null },
    })
}

/// One streamed request of the burst: `Ok(text or tokens)`, or the refusal it got.
#[derive(Debug)]
enum Outcome {
    Grpc(Vec<u32>),
    Http(String, u64),
    /// HTTP 429 with this `Retry-After`.
    Http429(u32),
    /// gRPC RESOURCE_EXHAUSTED with this `retry-after`.
    GrpcExhausted(u32),
}

async fn one(grpc: String, http: String, i: usize) -> Result<Outcome> {
    if i.is_multiple_of(2) {
        return match stream(&grpc, greedy_request(PROMPTS[i % PROMPTS.len()], MAX_TOKENS, true)).await {
            Ok(r) => Ok(Outcome::Grpc(r.tokens)),
            Err(e) => {
                let s = e.downcast_ref::<tonic::Status>().with_context(|| format!("{e:#}"))?;
                ensure!(s.code() == tonic::Code::ResourceExhausted, "gRPC request failed: {s:?}");
                let retry = s.metadata().get("retry-after").context("retry-after metadata")?.to_str()?.parse()?;
                Ok(Outcome::GrpcExhausted(retry))
            }
        };
    }
    let r = reqwest::Client::new().post(format!("{http}/v1/completions")).json(&http_body(i, true)).send().await?;
    if r.status().as_u16() == 429 {
        let retry = r.headers().get("retry-after").context("Retry-After")?.to_str()?.parse()?;
        let body: Value = r.json().await?;
        ensure!(body["error"]["type"] == "rate_limit_error", "429 body: {body}");
        return Ok(Outcome::Http429(retry));
    }
    ensure!(r.status().as_u16() == 200, "HTTP request got {}: {}", r.status(), r.text().await?);
    let text = r.text().await?;
    let (mut out, mut usage) = (String::new(), 0);
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")).filter(|d| *d != "[DONE]") {
        let v: Value = serde_json::from_str(data)?;
        out.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        usage = v["usage"]["completion_tokens"].as_u64().unwrap_or(usage);
    }
    ensure!(text.ends_with("data: [DONE]\n\n"), "stream without [DONE]: {text}");
    Ok(Outcome::Http(out, usage))
}

/// `n` requests at once through `router`; each must end within [`HANG`].
async fn burst(router: &Router, n: usize) -> Result<Vec<Outcome>> {
    let tasks: Vec<_> = (0..n)
        .map(|i| tokio::time::timeout(HANG, one(router.grpc.clone(), router.http.clone(), i)))
        .map(tokio::spawn)
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await?.map_err(|_| anyhow::anyhow!("a request hung past {HANG:?}"))??);
    }
    Ok(out)
}

async fn run(cluster: &Cluster) -> Result<()> {
    let (open, bounded) = (&cluster.routers[0], &cluster.routers[1]);
    eventually(Duration::from_secs(30), "the bounded router lists the replica", || async {
        Ok((router_ready_replicas(&bounded.grpc, SERVED).await? == 1).then_some(()))
    })
    .await?;
    // Undisturbed runs: gRPC token ids, HTTP text.
    let tokens = reference(&open.grpc, MAX_TOKENS).await?;
    let mut texts = Vec::new();
    for i in 0..PROMPTS.len() {
        let (status, v) =
            prism_tests::post_json(&format!("{}/v1/completions", open.http), &http_body(i, false)).await?;
        ensure!(status == 200, "reference completion: {v}");
        texts.push(v["choices"][0]["text"].as_str().context("text")?.to_owned());
    }
    ensure!(post_sse(&format!("{}/v1/completions", open.http), &http_body(0, true)).await?.len() > 1, "SSE works");

    // (a) 10 × max_num_seqs at once through the default queue, watching the engine's load.
    let worker = &cluster.workers[0];
    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let watch = {
        let (url, done, peak) = (worker.http.clone(), done.clone(), peak.clone());
        tokio::spawn(async move {
            while !done.load(Ordering::Relaxed) {
                if let Ok(r) = reqwest::get(format!("{url}/metrics")).await
                    && let Ok(m) = r.text().await
                {
                    let held =
                        metric_value(&m, "vllm:num_requests_running") + metric_value(&m, "vllm:num_requests_waiting");
                    peak.fetch_max(held as u64, Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };
    let n = 10 * MAX_NUM_SEQS;
    let started = std::time::Instant::now();
    let results = burst(open, n).await;
    done.store(true, Ordering::Relaxed);
    watch.await?;
    let results = results?;
    for (i, r) in results.iter().enumerate() {
        match r {
            Outcome::Grpc(t) => {
                ensure!(*t == tokens[i % PROMPTS.len()], "request {i}: tokens {t:?} differ from the reference")
            }
            Outcome::Http(text, usage) => {
                ensure!(*usage == u64::from(MAX_TOKENS), "request {i}: {usage} completion tokens");
                ensure!(
                    *text == texts[i % PROMPTS.len()],
                    "request {i}: {text:?} differs from {:?}",
                    texts[i % PROMPTS.len()]
                );
            }
            other => bail!("request {i} of the burst was refused: {other:?}"),
        }
    }
    let peak = peak.load(Ordering::Relaxed) as f64;
    let m = open.metrics().await?;
    let queued = metric_value(&m, "prism_router_queue_wait_seconds_count");
    eprintln!("burst of {n}: all served in {:?}; engine peak {peak} held; {queued} queued", started.elapsed());
    ensure!(peak <= ROUTER_LIMIT, "the engine held {peak} requests: the router must admit max_num_seqs + headroom");
    ensure!(peak >= 1.0, "the load watch saw nothing");
    ensure!(queued >= (n as f64) / 2.0, "only {queued} of {n} requests waited in the router's queue");
    ensure!(metric_value(&m, "prism_router_queue_rejected_total") == 0.0, "nothing refused: {m}");

    // (b) Past a small bound: the overflow is refused with a retry hint, the rest completes.
    let n = 5 * MAX_NUM_SEQS;
    let results = burst(bounded, n).await?;
    let (mut served, mut refused) = (0usize, 0usize);
    for (i, r) in results.iter().enumerate() {
        match r {
            Outcome::Grpc(t) => {
                ensure!(*t == tokens[i % PROMPTS.len()], "request {i}: tokens differ from the reference");
                served += 1;
            }
            Outcome::Http(_, usage) => {
                ensure!(*usage == u64::from(MAX_TOKENS), "request {i}: {usage} completion tokens");
                served += 1;
            }
            Outcome::Http429(s) | Outcome::GrpcExhausted(s) => {
                ensure!((1..=60).contains(s), "request {i}: retry after {s} s");
                refused += 1;
            }
        }
    }
    eprintln!("bounded burst of {n}: {served} served, {refused} refused");
    let admitted = ROUTER_LIMIT as usize + SMALL_QUEUE;
    ensure!(served >= admitted, "{served} served: at least the limit plus the queue must be");
    ensure!(refused >= 1, "{n} at once past {admitted} admitted must refuse some");
    let rejected = metric_value(&bounded.metrics().await?, "prism_router_queue_rejected_total");
    ensure!(rejected == refused as f64, "rejections counted {rejected}, clients saw {refused}");

    // (c) Both queues drained.
    for r in [open, bounded] {
        queue_empty(r).await?;
    }

    // (d) Scaled to zero (no autoscaling: no replica will come), the model stays listed and a
    // request is refused at once; scaled back up, a request waits in the queue for the
    // replica that starts, and completes token-exact.
    cluster.cli(&["scale", "smollm2", "0"])?;
    let refused = eventually(Duration::from_secs(30), "a request refused at once at zero", || async {
        let started = std::time::Instant::now();
        let s = stream(&open.grpc, greedy_request(PROMPTS[1], MAX_TOKENS, true)).await.err();
        let s = s.and_then(|e| e.downcast::<tonic::Status>().ok()).context("a gRPC status")?;
        ensure!(started.elapsed() < Duration::from_secs(3), "answered after {:?}", started.elapsed());
        Ok((s.code() == tonic::Code::Unavailable && s.metadata().get("retry-after").is_some()).then_some(s))
    })
    .await?;
    ensure!(router_ready_replicas(&open.grpc, SERVED).await? == 0, "still listed, with no Ready replica");
    eprintln!("scaled to 0: refused at once: {}", refused.message());
    cluster.cli(&["scale", "smollm2", "1"])?;
    let cold = std::time::Instant::now();
    let grpc = open.grpc.clone();
    let waiting = tokio::spawn(async move {
        // Sent until the router knows the replica is coming (the head's table after the scale).
        eventually(HANG, "served after scaling up", || async {
            match stream(&grpc, greedy_request(PROMPTS[1], MAX_TOKENS, true)).await {
                Ok(r) => Ok(Some(r)),
                Err(e) => Err(e),
            }
        })
        .await
    });
    eventually(Duration::from_secs(10), "the request queued for the cold model", || async {
        let depth = metric_value(&open.metrics().await?, "prism_router_queue_depth{model=\"smollm2\"}");
        Ok((depth == 1.0).then_some(()))
    })
    .await?;
    let r = tokio::time::timeout(HANG, waiting).await.context("the queued request hung")???;
    eprintln!("scale from zero: the queued request was served {:?} after scaling up", cold.elapsed());
    ensure!(r.tokens == tokens[1], "tokens after scale-from-zero differ from the reference");
    queue_empty(open).await
}

/// Waits until `router`'s queue gauge exists and reads 0.
async fn queue_empty(router: &Router) -> Result<()> {
    eventually(Duration::from_secs(5), "queue depth back to 0", || async {
        let m = router.metrics().await?;
        let depth = metric_value(&m, "prism_router_queue_depth");
        Ok((depth == 0.0 && m.contains("prism_router_queue_depth{")).then_some(()))
    })
    .await
}

/// A replica that cannot start (no such model file) is Failed for good: requests for its
/// model are answered at once, not after the queue's 30 s wait bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_whose_replicas_failed_to_start_is_refused_at_once() -> Result<()> {
    let mut cluster = Cluster::builder().store(Store::Embedded).workers(1).routers(1).start().await?;
    let missing = std::path::Path::new("/nonexistent/prism-test/model.gguf");
    cluster.deploy(&Deployment::new(missing))?;
    let reason = eventually(Duration::from_secs(60), "the replica Failed at the head", || async {
        let st = cluster.status().await?;
        Ok(st.replicas.iter().find(|r| r.state == ReplicaState::Failed as i32).map(|r| r.reason.clone()))
    })
    .await;
    let reason = cluster.with_logs(reason)?;
    ensure!(!reason.is_empty(), "the Failed replica has no reason");

    // The router learns it from the route table: poll until a request is refused, each
    // attempt bounded well below the queue's wait bound (30 s).
    let url = format!("{}/v1/chat/completions", cluster.http());
    let body = json!({"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let http = reqwest::Client::new();
    let (status, retry_after, error) = eventually(Duration::from_secs(30), "an immediate 503", || async {
        let started = std::time::Instant::now();
        let response = http.post(&url).json(&body).timeout(Duration::from_secs(5)).send().await?;
        let status = response.status().as_u16();
        let retry_after = response.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
        let error: Value = response.json().await?;
        ensure!(started.elapsed() < Duration::from_secs(3), "answered after {:?}", started.elapsed());
        Ok(Some((status, retry_after, error)))
    })
    .await?;
    assert_eq!(status, 503, "{error}");
    let seconds = retry_after.as_deref().and_then(|s| s.parse::<u32>().ok());
    assert!(seconds.is_some_and(|s| s >= 1), "Retry-After: {retry_after:?}");
    let message = error["error"]["message"].as_str().context("error.message")?;
    assert!(message.contains("failed to start") && message.contains("smollm2"), "{error}");
    assert!(message.contains(&reason), "the reason {reason:?} is not in {message:?}");

    let started = std::time::Instant::now();
    let refused = stream(cluster.grpc(), greedy_request(&[1, 2, 3], 4, false)).await;
    let status = refused.err().and_then(|e| e.downcast::<tonic::Status>().ok()).context("a gRPC status")?;
    assert!(started.elapsed() < Duration::from_secs(3), "gRPC answered after {:?}", started.elapsed());
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert!(status.message().contains("failed to start"), "{status:?}");
    assert!(status.metadata().get("retry-after").is_some(), "{status:?}");
    Ok(())
}
