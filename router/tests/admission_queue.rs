//! The router's admission queue in front of a `MockEngineWorker` (static route, so the
//! replica reports no capacity and `max_in_flight_per_replica` is its limit): a burst beyond
//! the limit queues and completes, only the overflow past the queue's bound is refused with a
//! retry hint, and clients that disconnect while queued leave at once.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use prism_router::config::RouterConfig;
use prism_router::mock_engine::MockBehavior;
use prism_router::mock_router::MockRouter;
use serde_json::{Value, json};

/// A router with one slow mock replica; `tweak` adjusts its config.
async fn cluster_with(b: MockBehavior, tweak: impl FnOnce(&mut RouterConfig)) -> anyhow::Result<MockRouter> {
    MockRouter::start(vec![b], tweak).await
}

async fn post(c: &MockRouter, path: &str, body: Value) -> anyhow::Result<(u16, Value)> {
    let r = reqwest::Client::new().post(format!("{}{path}", c.http)).json(&body).send().await?;
    let s = r.status().as_u16();
    Ok((s, r.json::<Value>().await.unwrap_or(Value::Null)))
}

/// A burst beyond the replica's limit waits in the admission queue and completes; past the
/// queue's bound the overflow gets 429 (HTTP, with Retry-After) or RESOURCE_EXHAUSTED with a
/// `retry-after` entry (gRPC), and the queue gauge returns to 0.
#[tokio::test]
async fn a_burst_beyond_the_limit_queues_and_only_the_overflow_is_refused() -> anyhow::Result<()> {
    use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
    use prism_common::proto::v1::{GenerateRequest, SamplingParams, generate_request::Prompt};
    // 100 ms a token: each request holds its slot 0.5 s, so the queue stays full a while.
    let slow = MockBehavior { token_delay: Duration::from_millis(100), ..Default::default() };
    let c = cluster_with(slow, |cfg| {
        cfg.max_in_flight_per_replica = 2;
        cfg.max_queued_requests = 4;
    })
    .await?;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", c.http);
    let body = json!({"model": "mock", "prompt": "a", "max_tokens": 5, "stream": true});
    // 2 take the slots, 4 queue: all 6 complete with every token.
    let burst: Vec<_> = (0..6)
        .map(|_| {
            let (http, url, body) = (http.clone(), url.clone(), body.clone());
            tokio::spawn(async move {
                let r = http.post(url).json(&body).send().await?;
                anyhow::Ok((r.status().as_u16(), r.text().await?))
            })
        })
        .collect();
    let until = Instant::now() + Duration::from_secs(5);
    while !reqwest::get(format!("{}/metrics", c.http)).await?.text().await?.contains("queue_depth{model=\"mock\"} 4") {
        anyhow::ensure!(Instant::now() < until, "4 requests never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The queue is full: HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED with retry-after.
    let r = http.post(&url).json(&body).send().await?;
    assert_eq!(r.status().as_u16(), 429);
    let retry: u32 = r.headers()["retry-after"].to_str()?.parse()?;
    assert!((1..=60).contains(&retry), "Retry-After {retry}");
    assert_eq!(r.json::<Value>().await?["error"]["code"], "rate_limit_exceeded");
    let mut g = InferenceServiceClient::connect(c.grpc.clone()).await?;
    let req = GenerateRequest {
        model: "mock".into(),
        prompt: Some(Prompt::Text("a".into())),
        sampling: Some(SamplingParams { max_tokens: Some(5), ..Default::default() }),
        ..Default::default()
    };
    let e = g.generate(req).await.expect_err("refused");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted);
    let retry: u32 = e.metadata().get("retry-after").expect("retry-after").to_str()?.parse()?;
    assert!((1..=60).contains(&retry), "retry-after {retry}");
    for t in burst {
        let (status, text) = t.await??;
        assert_eq!(status, 200, "{text}");
        assert_eq!(text.matches("\"text\":\"t").count(), 5, "every token: {text}");
    }
    let m = reqwest::get(format!("{}/metrics", c.http)).await?.text().await?;
    assert!(m.contains("prism_router_queue_depth{model=\"mock\"} 0"), "{m}");
    assert!(m.contains("prism_router_queue_rejected_total{model=\"mock\",reason=\"full\"} 2"), "{m}");
    assert_eq!(c.mocks[0].stats.requests.load(Ordering::Relaxed), 6, "the refused ones never reached the worker");
    Ok(())
}

/// Clients that disconnect while queued (HTTP: the connection closes; gRPC: the call is
/// dropped) leave the queue at once, and the slots they waited for go to the next request.
#[tokio::test]
async fn queued_clients_that_disconnect_leave_the_queue() -> anyhow::Result<()> {
    use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
    use prism_common::proto::v1::{GenerateRequest, SamplingParams, generate_request::Prompt};
    let slow = MockBehavior { token_delay: Duration::from_millis(100), ..Default::default() };
    let c = cluster_with(slow, |cfg| cfg.max_in_flight_per_replica = 1).await?;
    let depth = || async {
        let m = reqwest::get(format!("{}/metrics", c.http)).await?.text().await?;
        anyhow::Ok(
            m.lines().find_map(|l| l.strip_prefix("prism_router_queue_depth{model=\"mock\"} ")?.parse::<u32>().ok()),
        )
    };
    let body = json!({"model": "mock", "prompt": "a", "max_tokens": 10, "stream": true});
    let holder = reqwest::Client::new().post(format!("{}/v1/completions", c.http)).json(&body).send().await?;
    assert_eq!(holder.status().as_u16(), 200);
    // Both wait behind the holder, then give up after 300 ms.
    let http = reqwest::Client::builder().timeout(Duration::from_millis(300)).build()?;
    let h = tokio::spawn(http.post(format!("{}/v1/completions", c.http)).json(&body).send());
    let mut g = InferenceServiceClient::connect(c.grpc.clone()).await?;
    let req = GenerateRequest {
        model: "mock".into(),
        prompt: Some(Prompt::Text("a".into())),
        sampling: Some(SamplingParams { max_tokens: Some(3), ..Default::default() }),
        ..Default::default()
    };
    let grpc =
        tokio::spawn(async move { tokio::time::timeout(Duration::from_millis(300), g.generate(req)).await.is_err() });
    let until = Instant::now() + Duration::from_secs(5);
    while depth().await? != Some(2) {
        anyhow::ensure!(Instant::now() < until, "the two requests never queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(h.await?.is_err(), "the HTTP client timed out");
    assert!(grpc.await?, "the gRPC call was dropped");
    let until = Instant::now() + Duration::from_secs(1);
    while depth().await? != Some(0) {
        anyhow::ensure!(Instant::now() < until, "disconnected clients stayed queued");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(holder);
    // The slot is free again at once: nobody who left holds it.
    let t = Instant::now();
    let (s, v) = post(&c, "/v1/completions", json!({"model": "mock", "prompt": "a", "max_tokens": 1})).await?;
    assert_eq!(s, 200, "{v}");
    assert!(t.elapsed() < Duration::from_secs(1), "took {:?}", t.elapsed());
    assert_eq!(c.mocks[0].stats.requests.load(Ordering::Relaxed), 2, "the departed requests never reached the worker");
    Ok(())
}
