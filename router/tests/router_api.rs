//! Router integration tests: the real router (`prism_router::run` on 127.0.0.1:0) in front
//! of `MockEngineWorker`s (mock engine, no model) reached through static routes.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use prism_router::config::{RouterConfig, StaticRoute};
use prism_router::mock_engine::{MockBehavior, MockEngineWorker};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

struct Cluster {
    http: String,
    grpc: String,
    mocks: Vec<MockEngineWorker>,
    shutdown: CancellationToken,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn cluster_with(behaviors: Vec<MockBehavior>, tweak: impl FnOnce(&mut RouterConfig)) -> anyhow::Result<Cluster> {
    let shutdown = CancellationToken::new();
    let mut mocks = Vec::new();
    let mut static_routes = Vec::new();
    for b in behaviors {
        let m = MockEngineWorker::new(b);
        let addr = m.clone().spawn(shutdown.clone()).await?;
        static_routes.push(StaticRoute { model: "mock".into(), endpoint: format!("http://{addr}") });
        mocks.push(m);
    }
    let mut cfg = RouterConfig { static_routes, ..Default::default() };
    tweak(&mut cfg);
    let h = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let g = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let http = format!("http://{}", h.local_addr()?);
    let grpc = format!("http://{}", g.local_addr()?);
    tokio::spawn(prism_router::run(cfg, h, g, shutdown.clone()));
    Ok(Cluster { http, grpc, mocks, shutdown })
}

async fn cluster(n: usize) -> anyhow::Result<Cluster> {
    cluster_with(vec![MockBehavior::default(); n], |_| {}).await
}

async fn post(c: &Cluster, path: &str, body: Value) -> anyhow::Result<(u16, Value)> {
    let r = reqwest::Client::new().post(format!("{}{path}", c.http)).json(&body).send().await?;
    let s = r.status().as_u16();
    let v = r.json::<Value>().await.unwrap_or(Value::Null);
    Ok((s, v))
}

/// Parses an SSE body into its `data:` payloads.
fn events(body: &str) -> Vec<String> {
    assert!(body.ends_with("data: [DONE]\n\n"), "stream must end with [DONE]: {body:?}");
    body.split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| e.strip_prefix("data: ").expect("data: prefix").to_owned())
        .collect()
}

#[tokio::test]
async fn openai_completion_and_chat_shapes() -> anyhow::Result<()> {
    let c = cluster(1).await?;
    let (s, v) =
        post(&c, "/v1/completions", json!({"model": "mock", "prompt": "a b c", "max_tokens": 3, "logprobs": 2}))
            .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], "t0 t1 t2 ");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!(["t0 ", "t1 ", "t2 "]));
    assert_eq!(v["choices"][0]["logprobs"]["text_offset"], json!([0, 3, 6]));
    assert_eq!(v["choices"][0]["logprobs"]["top_logprobs"][0].as_object().map(|o| o.len()), Some(2));
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
               "prompt_tokens_details": {"cached_tokens": 0}})
    );

    let (s, v) = post(&c, "/v1/completions", json!({"model": "mock", "prompt": "a", "max_tokens": null})).await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], 8);

    let (s, v) = post(
        &c,
        "/v1/chat/completions",
        json!({
            "model": "mock", "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_completion_tokens": 2,
            "logprobs": true, "top_logprobs": 3
        }),
    )
    .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"].as_array().map(Vec::len), Some(2));
    for i in 0..2 {
        let ch = &v["choices"][i];
        assert_eq!(ch["index"], i);
        assert_eq!(ch["message"], json!({"role": "assistant", "content": "t0 t1 "}));
        let content = ch["logprobs"]["content"].as_array().expect("content");
        assert_eq!(content.len(), 2);
        assert_eq!(content[0]["token"], "t0 ");
        assert_eq!(content[0]["bytes"], json!([116, 48, 32]));
        assert_eq!(content[0]["top_logprobs"].as_array().map(Vec::len), Some(3));
    }
    assert_eq!(v["usage"]["completion_tokens"], 4);

    let r = reqwest::get(format!("{}/v1/models", c.http)).await?.json::<Value>().await?;
    assert_eq!(r["data"][0]["id"], "mock");
    assert_eq!(reqwest::get(format!("{}/health", c.http)).await?.status().as_u16(), 200);
    Ok(())
}

#[tokio::test]
async fn sse_stream_framing_and_usage() -> anyhow::Result<()> {
    let c = cluster(1).await?;
    let body = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", c.http))
        .json(&json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                      "stream": true, "stream_options": {"include_usage": true}, "logprobs": true}))
        .send()
        .await?;
    assert_eq!(body.headers()["content-type"], "text/event-stream");
    let evs = events(&body.text().await?);
    let chunks: Vec<Value> = evs[..evs.len() - 1].iter().map(|e| serde_json::from_str(e)).collect::<Result<_, _>>()?;
    assert_eq!(chunks[0]["choices"][0]["delta"], json!({"role": "assistant", "content": ""}));
    let text: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(text, "t0 t1 t2 ");
    for ch in &chunks {
        assert_eq!(ch["object"], "chat.completion.chunk");
        if let Some(lp) = ch["choices"][0]["logprobs"]["content"].as_array() {
            assert_eq!(lp.len(), 1, "each chunk carries exactly its own token's logprobs");
        }
    }
    let finish = &chunks[chunks.len() - 2];
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage = &chunks[chunks.len() - 1];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 3);

    let body = reqwest::Client::new()
        .post(format!("{}/v1/completions", c.http))
        .json(&json!({"model": "mock", "prompt": "x", "max_tokens": 2, "stream": true}))
        .send()
        .await?
        .text()
        .await?;
    let evs = events(&body);
    assert_eq!(evs.len(), 3);
    let last: Value = serde_json::from_str(&evs[1])?;
    assert_eq!(last["choices"][0]["text"], "t1 ");
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    Ok(())
}

/// A lone UTF-16 surrogate escape (`"\ud800"`, which Python clients can send) is read as
/// U+FFFD instead of failing the body as "unexpected end of hex escape".
#[tokio::test]
async fn lone_surrogate_escapes_are_read_as_replacement_characters() -> anyhow::Result<()> {
    let c = cluster(1).await?;
    let http = reqwest::Client::new();
    for (path, body) in [
        ("/v1/completions", r#"{"model":"mock","prompt":"a\ud800b","max_tokens":1}"#),
        ("/v1/chat/completions", r#"{"model":"mock","messages":[{"role":"user","content":"\udc00"}],"max_tokens":1}"#),
    ] {
        let r =
            http.post(format!("{}{path}", c.http)).header("content-type", "application/json").body(body).send().await?;
        assert_eq!(r.status().as_u16(), 200, "{path}: {}", r.text().await?);
        let last = c.mocks[0].stats.last_request.lock().map(|g| g.clone()).ok().flatten().expect("a request");
        let prompt = format!("{:?}", last.request.and_then(|r| r.prompt));
        assert!(prompt.contains('\u{FFFD}'), "{path}: {prompt}");
    }
    Ok(())
}

#[tokio::test]
async fn bad_bodies_get_4xx_error_objects() -> anyhow::Result<()> {
    let c = cluster(1).await?;
    let http = reqwest::Client::new();
    let url = format!("{}/v1/completions", c.http);
    let r = http.post(&url).body(r#"{"model":"mock","prompt":"a"}"#).send().await?;
    assert_eq!(r.status().as_u16(), 415);
    assert!(r.json::<Value>().await?["error"]["message"].is_string());
    for body in [
        "[]",
        "123",
        "null",
        "\"abc\"",
        r#"{"model": "mock", "prom"#,
        "{}",
        r#"{"model":"mock","prompt":"a","max_tokens":-1}"#,
    ] {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            let r = http
                .post(format!("{}{path}", c.http))
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await?;
            assert_eq!(r.status().as_u16(), 400, "{path} {body}");
            let v: Value = r.json().await?;
            assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
            assert!(v["error"].get("param").is_some() && v["error"].get("code").is_some());
        }
    }
    let (s, v) = post(&c, "/v1/completions", json!({"model": "mock", "prompt": "a", "max_tokens": 0})).await?;
    assert_eq!((s, v["error"]["param"].clone()), (400, json!("max_tokens")));
    let (s, _) = post(&c, "/v1/completions", json!({"model": "nope", "prompt": "a"})).await?;
    assert_eq!(s, 404);
    // Worker-side validation (empty prompt) maps to 400 too.
    let (s, _) = post(&c, "/v1/completions", json!({"model": "mock", "prompt": ""})).await?;
    assert_eq!(s, 400);
    let (s, _) = post(&c, "/v1/completions", json!({"model": "mock", "prompt": "a", "max_tokens": 1})).await?;
    assert_eq!(s, 200, "server still healthy");
    Ok(())
}

#[tokio::test]
async fn body_over_limit_is_413() -> anyhow::Result<()> {
    let c = cluster_with(vec![MockBehavior::default()], |cfg| cfg.max_body_bytes = 1024).await?;
    let big = "x".repeat(4096);
    let (s, v) = post(&c, "/v1/completions", json!({"model": "mock", "prompt": big})).await?;
    assert_eq!(s, 413);
    assert!(v["error"]["message"].is_string());
    Ok(())
}

#[tokio::test]
async fn api_keys_guard_http_and_grpc() -> anyhow::Result<()> {
    let c = cluster_with(vec![MockBehavior::default()], |cfg| cfg.api_keys = vec!["sekret".into()]).await?;
    let http = reqwest::Client::new();
    let body = json!({"model": "mock", "prompt": "a", "max_tokens": 1});
    let r = http.post(format!("{}/v1/completions", c.http)).json(&body).send().await?;
    assert_eq!(r.status().as_u16(), 401);
    // OpenAI's 401 shape: type invalid_request_error, code invalid_api_key.
    let v = r.json::<Value>().await?;
    assert_eq!(
        (&v["error"]["type"], &v["error"]["code"]),
        (&json!("invalid_request_error"), &json!("invalid_api_key"))
    );
    let r = http.post(format!("{}/v1/completions", c.http)).bearer_auth("wrong").json(&body).send().await?;
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(http.get(format!("{}/v1/models", c.http)).send().await?.status().as_u16(), 401);
    assert_eq!(http.get(format!("{}/health", c.http)).send().await?.status().as_u16(), 200);
    // /metrics needs the key too unless --metrics-without-auth.
    assert_eq!(http.get(format!("{}/metrics", c.http)).send().await?.status().as_u16(), 401);

    use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
    use prism_common::proto::v1::{GenerateRequest, generate_request::Prompt};
    let mut g = InferenceServiceClient::connect(c.grpc.clone()).await?;
    let req = GenerateRequest { model: "mock".into(), prompt: Some(Prompt::Text("a".into())), ..Default::default() };
    let Err(e) = g.generate(req.clone()).await else { panic!("accepted without a key") };
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    assert_eq!(c.mocks[0].stats.requests.load(Ordering::Relaxed), 0, "nothing reached a worker");

    let r = http.post(format!("{}/v1/completions", c.http)).bearer_auth("sekret").json(&body).send().await?;
    assert_eq!(r.status().as_u16(), 200);
    let mut r = tonic::Request::new(req);
    r.metadata_mut().insert("authorization", "Bearer sekret".parse()?);
    let mut s = g.generate(r).await?.into_inner();
    let mut n = 0;
    while let Some(m) = s.message().await? {
        n += m.token_ids.len();
    }
    assert_eq!(n, 8);
    Ok(())
}

#[tokio::test]
async fn grpc_generate_list_models_and_health() -> anyhow::Result<()> {
    use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
    use prism_common::proto::v1::{GenerateRequest, ListModelsRequest, SamplingParams, generate_request::Prompt};
    let c = cluster(2).await?;
    let mut g = InferenceServiceClient::connect(c.grpc.clone()).await?;
    let models = g.list_models(ListModelsRequest {}).await?.into_inner().models;
    assert_eq!((models[0].id.as_str(), models[0].ready_replicas), ("mock", 2));
    let req = GenerateRequest {
        model: "mock".into(),
        prompt: Some(Prompt::Text("a b".into())),
        sampling: Some(SamplingParams { max_tokens: Some(4), ..Default::default() }),
        ..Default::default()
    };
    let mut s = g.generate(req).await?.into_inner();
    let mut ids = vec![];
    let mut usage = None;
    while let Some(m) = s.message().await? {
        ids.extend(m.token_ids);
        usage = m.usage.or(usage);
    }
    assert_eq!(ids, vec![0, 1, 2, 3]);
    assert_eq!(usage.map(|u| (u.prompt_tokens, u.completion_tokens)), Some((2, 4)));
    let ch = tonic::transport::Endpoint::from_shared(c.grpc.clone())?.connect().await?;
    let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
    let st = h.check(tonic_health::pb::HealthCheckRequest { service: String::new() }).await?.into_inner();
    assert_eq!(st.status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    Ok(())
}

/// With no admission queue (`max_queued_requests` 0) a full replica refuses at once.
#[tokio::test]
async fn all_full_is_429_with_retry_after() -> anyhow::Result<()> {
    let slow = MockBehavior { token_delay: Duration::from_millis(200), ..Default::default() };
    let c = cluster_with(vec![slow], |cfg| {
        cfg.max_in_flight_per_replica = 2;
        cfg.max_queued_requests = 0;
    })
    .await?;
    let http = reqwest::Client::new();
    let body = json!({"model": "mock", "prompt": "a", "max_tokens": 50, "stream": true});
    let mut open = vec![];
    for _ in 0..2 {
        let r = http.post(format!("{}/v1/completions", c.http)).json(&body).send().await?;
        assert_eq!(r.status().as_u16(), 200);
        open.push(r);
    }
    let r = http.post(format!("{}/v1/completions", c.http)).json(&body).send().await?;
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    assert_eq!(r.json::<Value>().await?["error"]["type"], "rate_limit_error");
    drop(open);
    Ok(())
}

#[tokio::test]
async fn p2c_spreads_200_concurrent_requests_evenly() -> anyhow::Result<()> {
    let b = MockBehavior { token_delay: Duration::from_millis(20), ..Default::default() };
    let c = cluster_with(vec![b.clone(), b], |_| {}).await?;
    let http = reqwest::Client::new();
    let tasks: Vec<_> = (0..200)
        .map(|_| {
            let http = http.clone();
            let url = format!("{}/v1/completions", c.http);
            tokio::spawn(async move {
                http.post(url)
                    .json(&json!({"model": "mock", "prompt": "a", "max_tokens": 3}))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await??, 200);
    }
    let a = c.mocks[0].stats.requests.load(Ordering::Relaxed);
    let b = c.mocks[1].stats.requests.load(Ordering::Relaxed);
    assert_eq!(a + b, 200);
    assert!((80..=120).contains(&a), "split {a}/{b} is not within ±20%");
    Ok(())
}

#[tokio::test]
async fn long_prompts_spread_by_load_counted_at_dispatch() -> anyhow::Result<()> {
    // max_tokens 1 with a slow first token: no byte streams back while the load builds up.
    let b = MockBehavior { token_delay: Duration::from_millis(300), ..Default::default() };
    let c = cluster_with(vec![b.clone(), b.clone(), b], |_| {}).await?;
    let http = reqwest::Client::new();
    let prompt: Vec<u32> = (0..4000).collect();
    let tasks: Vec<_> = (0..60)
        .map(|i| {
            let http = http.clone();
            let url = format!("{}/v1/completions", c.http);
            let mut p = prompt.clone();
            p[0] = i; // unique prefix
            tokio::spawn(async move {
                http.post(url)
                    .json(&json!({"model": "mock", "prompt": p, "max_tokens": 1}))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await??, 200);
    }
    for m in &c.mocks {
        let n = m.stats.requests.load(Ordering::Relaxed);
        assert!((16..=24).contains(&n), "replica got {n} of 60");
    }
    Ok(())
}

#[tokio::test]
async fn retry_before_first_token_and_ejection() -> anyhow::Result<()> {
    let bad = MockBehavior { fail_before_first: true, ..Default::default() };
    let c = cluster_with(vec![bad, MockBehavior::default()], |_| {}).await?;
    for _ in 0..20 {
        let (s, v) = post(&c, "/v1/completions", json!({"model": "mock", "prompt": "a", "max_tokens": 2})).await?;
        assert_eq!(s, 200, "{v}");
    }
    assert_eq!(c.mocks[1].stats.requests.load(Ordering::Relaxed), 20);
    assert_eq!(c.mocks[0].stats.requests.load(Ordering::Relaxed), 1, "failing replica ejected after one failure");
    let m = reqwest::get(format!("{}/metrics", c.http)).await?.text().await?;
    assert!(m.contains("prism_router_retries_total 1"), "{m}");
    assert!(m.contains("prism_router_requests_total{outcome=\"ok\"} 20"), "{m}");
    Ok(())
}

#[tokio::test]
async fn frozen_replica_times_out_then_leaves_rotation() -> anyhow::Result<()> {
    // SIGSTOP analogue: the mock process accepts TCP but never reads, writes or answers PINGs.
    let frozen = MockBehavior { freeze_process: true, ..Default::default() };
    let c = cluster_with(vec![frozen, MockBehavior::default()], |cfg| {
        cfg.request_timeout = Duration::from_secs(5);
        cfg.worker_header_timeout = Duration::from_secs(1);
        cfg.ejection_base = Duration::from_secs(30);
    })
    .await?;
    let t0 = Instant::now();
    let mut slow = 0;
    for _ in 0..20 {
        let t = Instant::now();
        let (s, v) = post(&c, "/v1/completions", json!({"model": "mock", "prompt": "a", "max_tokens": 2})).await?;
        assert_eq!(s, 200, "a frozen replica's request is retried elsewhere: {v}");
        let took = t.elapsed();
        assert!(took < Duration::from_millis(1800), "no request waits past the header bound + retry: {took:?}");
        if took >= Duration::from_millis(900) {
            slow += 1;
        }
    }
    assert!(slow <= 1, "only the first request to the frozen replica waits for its headers, got {slow}");
    assert!(t0.elapsed() < Duration::from_secs(4));
    assert_eq!(c.mocks[0].stats.requests.load(Ordering::Relaxed), 0, "the frozen process read nothing");
    assert_eq!(c.mocks[1].stats.requests.load(Ordering::Relaxed), 20);
    Ok(())
}

#[tokio::test]
async fn tiny_client_deadlines_do_not_eject_replicas() -> anyhow::Result<()> {
    use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
    use prism_common::proto::v1::{GenerateRequest, SamplingParams, generate_request::Prompt};
    let slow = MockBehavior { token_delay: Duration::from_millis(50), ..Default::default() };
    let c = cluster_with(vec![slow.clone(), slow], |cfg| cfg.ejection_base = Duration::from_secs(30)).await?;
    let mut g = InferenceServiceClient::connect(c.grpc.clone()).await?;
    for ms in [1u64, 3, 10, 1, 3, 10] {
        let req = GenerateRequest {
            model: "mock".into(),
            prompt: Some(Prompt::Text("a".into())),
            sampling: Some(SamplingParams { max_tokens: Some(1), ..Default::default() }),
            timeout_ms: Some(ms),
            ..Default::default()
        };
        let Err(e) = g.generate(req).await else { panic!("a {ms} ms deadline cannot be met by a 50 ms token") };
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
        // grpc-timeout header: the same, through the client's own deadline.
        let mut r = tonic::Request::new(GenerateRequest {
            model: "mock".into(),
            prompt: Some(Prompt::Text("a".into())),
            sampling: Some(SamplingParams { max_tokens: Some(1), ..Default::default() }),
            ..Default::default()
        });
        r.set_timeout(Duration::from_millis(ms));
        assert!(g.generate(r).await.is_err());
        let (s, v) =
            post(&c, "/v1/completions", json!({"model": "mock", "prompt": "a", "max_tokens": 1, "timeout_ms": ms}))
                .await?;
        assert_eq!((s, v["error"]["type"].as_str()), (504, Some("timeout_error")), "{v}");
    }
    let before: Vec<u64> = c.mocks.iter().map(|m| m.stats.requests.load(Ordering::Relaxed)).collect();
    for _ in 0..20 {
        let (s, v) = post(&c, "/v1/completions", json!({"model": "mock", "prompt": "a", "max_tokens": 1})).await?;
        assert_eq!(s, 200, "client deadlines must not take replicas out of rotation: {v}");
    }
    for (m, b) in c.mocks.iter().zip(before) {
        assert!(m.stats.requests.load(Ordering::Relaxed) > b, "both replicas stay in rotation");
    }
    Ok(())
}

#[tokio::test]
async fn no_replica_is_a_fast_503() -> anyhow::Result<()> {
    // A route to a port where nothing listens: the worker is gone.
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    let dead = format!("http://{}", l.local_addr()?);
    drop(l);
    let c = cluster_with(vec![], |cfg| cfg.static_routes = vec![StaticRoute { model: "mock".into(), endpoint: dead }])
        .await?;
    for _ in 0..5 {
        let t = Instant::now();
        let r = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", c.http))
            .json(&json!({"model": "mock", "messages": [{"role": "user", "content": "a"}]}))
            .send()
            .await?;
        assert_eq!(r.status().as_u16(), 503);
        assert!(r.headers().contains_key("retry-after"));
        assert!(t.elapsed() < Duration::from_millis(500), "503 must be fast, took {:?}", t.elapsed());
    }
    Ok(())
}

#[tokio::test]
async fn migration_continues_the_stream_token_exact() -> anyhow::Result<()> {
    let flaky = MockBehavior { fail_after_tokens: Some(3), ..Default::default() };
    let c = cluster_with(vec![flaky, MockBehavior::default()], |_| {}).await?;
    // The first request that lands on the flaky replica migrates; the flaky one is then ejected.
    // P2C picks either replica with equal odds while both are idle: 12 tries miss the flaky one with p = 1/4096.
    for _ in 0..12 {
        let body = reqwest::Client::new()
            .post(format!("{}/v1/completions", c.http))
            .json(&json!({"model": "mock", "prompt": "a b", "max_tokens": 10, "stream": true,
                          "stream_options": {"include_usage": true}}))
            .send()
            .await?
            .text()
            .await?;
        let evs = events(&body);
        let chunks: Vec<Value> =
            evs[..evs.len() - 1].iter().map(|e| serde_json::from_str(e)).collect::<Result<_, _>>()?;
        let text: String =
            chunks.iter().filter_map(|c| c["choices"].get(0).and_then(|ch| ch["text"].as_str())).collect();
        assert_eq!(text, (0..10).map(|i| format!("t{i} ")).collect::<String>());
        assert_eq!(chunks[chunks.len() - 1]["usage"]["completion_tokens"], 10);
        assert_eq!(chunks[chunks.len() - 1]["usage"]["prompt_tokens"], 2);
    }
    assert_eq!(c.mocks[0].stats.requests.load(Ordering::Relaxed), 1, "flaky replica ejected after its failure");
    let m = reqwest::get(format!("{}/metrics", c.http)).await?.text().await?;
    assert!(m.contains("prism_router_migrations_total 1"), "{m}");
    Ok(())
}

#[tokio::test]
async fn client_disconnect_cancels_the_worker_stream() -> anyhow::Result<()> {
    let slow = MockBehavior { token_delay: Duration::from_millis(20), ..Default::default() };
    let c = cluster_with(vec![slow], |_| {}).await?;
    for stream in [true, false] {
        let mut r = reqwest::Client::new()
            .post(format!("{}/v1/completions", c.http))
            .json(&json!({"model": "mock", "prompt": "a", "max_tokens": 100000, "ignore_eos": true, "stream": stream}))
            .send();
        if stream {
            let mut resp = r.await?;
            assert!(resp.chunk().await?.is_some());
            drop(resp);
        } else {
            // Give up on the whole response after a moment: the connection closes.
            let _ = tokio::time::timeout(Duration::from_millis(300), &mut r).await;
            drop(r);
        }
        let deadline = Instant::now() + Duration::from_secs(1);
        while c.mocks[0].stats.active.load(Ordering::Relaxed) != 0 {
            assert!(Instant::now() < deadline, "worker stream still open after disconnect (stream={stream})");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert_eq!(c.mocks[0].stats.cancelled.load(Ordering::Relaxed), 2);
    let m = reqwest::get(format!("{}/metrics", c.http)).await?.text().await?;
    assert!(m.contains("prism_router_in_flight 0"), "{m}");
    Ok(())
}

#[tokio::test]
async fn deadline_propagates_to_the_worker() -> anyhow::Result<()> {
    let c = cluster(1).await?;
    let (s, _) =
        post(&c, "/v1/completions", json!({"model": "mock", "prompt": "a", "max_tokens": 1, "timeout_ms": 5000}))
            .await?;
    assert_eq!(s, 200);
    let last = c.mocks[0].stats.last_request.lock().map(|g| g.clone()).ok().flatten().expect("request");
    let sampling = last.request.as_ref().and_then(|r| r.sampling.clone()).expect("sampling");
    assert_eq!(sampling.skip_special_tokens, Some(true), "OpenAI default made explicit for the worker");
    let t = last.request.and_then(|r| r.timeout_ms).expect("timeout_ms set");
    assert!((4000..=5000).contains(&t), "timeout_ms {t}");
    Ok(())
}

#[tokio::test]
async fn unsupported_openai_params_are_400_naming_the_field() -> anyhow::Result<()> {
    let c = cluster(1).await?;
    let chat = |extra: Value| {
        let mut b = json!({"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1});
        if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        b
    };
    let cmpl = |extra: Value| {
        let mut b = json!({"model": "mock", "prompt": "a", "max_tokens": 1});
        if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        b
    };
    let cases = [
        ("/v1/completions", cmpl(json!({"suffix": "x"})), "suffix"),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function", "function": {"name": "bad name"}}]})),
            "tools",
        ),
        ("/v1/completions", cmpl(json!({"tools": [{"type": "function", "function": {"name": "f"}}]})), "tools"),
        (
            "/v1/chat/completions",
            chat(json!({"tools": [{"type": "function", "function": {"name": "f"}}],
                        "tool_choice": {"type": "function", "function": {"name": "g"}}})),
            "tool_choice",
        ),
        ("/v1/chat/completions", chat(json!({"guided_json": "{not json"})), "guided_json"),
        (
            "/v1/chat/completions",
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}})),
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", cmpl(json!({"guided_regex": "a", "guided_choice": ["b"]})), "guided_choice"),
        ("/v1/chat/completions", chat(json!({"functions": [{"name": "f"}]})), "functions"),
        ("/v1/chat/completions", chat(json!({"tool_choice": "auto"})), "tool_choice"),
        ("/v1/chat/completions", chat(json!({"response_format": {"type": "xml"}})), "response_format.type"),
        ("/v1/completions", cmpl(json!({"logit_bias": {"50256": -100.5}})), "logit_bias"),
        ("/v1/completions", cmpl(json!({"logit_bias": {"tok": 1}})), "logit_bias"),
        ("/v1/completions", cmpl(json!({"logit_bias": [1, 2]})), "logit_bias"),
        ("/v1/completions", cmpl(json!({"best_of": 3})), "best_of"),
        ("/v1/completions", cmpl(json!({"n": 2, "best_of": 1})), "best_of"),
        ("/v1/completions", cmpl(json!({"use_beam_search": true})), "use_beam_search"),
        ("/v1/chat/completions", chat(json!({"logprobs": true, "top_logprobs": 25})), "top_logprobs"),
        ("/v1/chat/completions", chat(json!({"echo": true})), "echo"),
        ("/v1/chat/completions", chat(json!({"add_generation_prompt": false})), "add_generation_prompt"),
        ("/v1/chat/completions", chat(json!({"continue_final_message": true})), "continue_final_message"),
        // chat_template_kwargs: a JSON object naming no standard template variable.
        ("/v1/chat/completions", chat(json!({"chat_template_kwargs": "enable_thinking"})), "chat_template_kwargs"),
        ("/v1/chat/completions", chat(json!({"chat_template_kwargs": [1]})), "chat_template_kwargs"),
        ("/v1/chat/completions", chat(json!({"chat_template_kwargs": {"messages": []}})), "chat_template_kwargs"),
        ("/v1/chat/completions", chat(json!({"chat_template": "{{ messages }}"})), "chat_template"),
        ("/v1/completions", cmpl(json!({"min_tokens": 5})), "min_tokens"),
        ("/v1/completions", cmpl(json!({"min_tokens": -1})), "min_tokens"),
        ("/v1/completions", cmpl(json!({"include_stop_str_in_output": "yes"})), "include_stop_str_in_output"),
        // n: one limit for both APIs.
        ("/v1/completions", cmpl(json!({"n": 17})), "n"),
        // Type errors name the field (also flattened sampling fields).
        ("/v1/completions", cmpl(json!({"temperature": "hot"})), "temperature"),
        ("/v1/completions", cmpl(json!({"n": "two"})), "n"),
        ("/v1/chat/completions", chat(json!({"logprobs": "yes"})), "logprobs"),
        ("/v1/completions", json!({"prompt": "a"}), "model"),
        // cache_salt: a non-empty string of at most 256 bytes.
        ("/v1/completions", cmpl(json!({"cache_salt": 5})), "cache_salt"),
        ("/v1/chat/completions", chat(json!({"cache_salt": ["a"]})), "cache_salt"),
        ("/v1/chat/completions", chat(json!({"cache_salt": ""})), "cache_salt"),
        ("/v1/completions", cmpl(json!({"cache_salt": "x".repeat(300)})), "cache_salt"),
    ];
    for (path, body, param) in cases {
        let (s, v) = post(&c, path, body.clone()).await?;
        assert_eq!(s, 400, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], param, "{path} {body}: {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["code"].is_null() || v["error"]["code"].is_string(), "{v}");
    }
    // Accepted no-op forms.
    for body in [
        chat(json!({"tool_choice": "none", "tools": [], "response_format": {"type": "text"}, "logit_bias": {},
                    "best_of": 1, "min_tokens": 0, "include_stop_str_in_output": false, "add_generation_prompt": true})),
        chat(json!({"n": 16, "max_tokens": 1, "cache_salt": "x".repeat(256), "use_beam_search": false})),
        // Qwen3's switch (vLLM passes kwargs into the template's render context).
        chat(json!({"max_tokens": 1, "chat_template_kwargs": {"enable_thinking": false}, "chat_template": null})),
    ] {
        let (s, v) = post(&c, "/v1/chat/completions", body).await?;
        assert_eq!(s, 200, "{v}");
    }
    assert_eq!(c.mocks[0].stats.requests.load(Ordering::Relaxed), 3, "rejected requests never reach a worker");
    let last = c.mocks[0].stats.last_request.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
    let kwargs = last.and_then(|w| w.request).map(|r| r.chat_template_kwargs_json).unwrap_or_default();
    assert_eq!(serde_json::from_str::<Value>(&kwargs)?, json!({"enable_thinking": false}), "carried to the worker");
    Ok(())
}

#[tokio::test]
async fn malformed_chat_messages_are_400_over_http_and_grpc() -> anyhow::Result<()> {
    let c = cluster(1).await?;
    let bad = [
        json!([{"role": "wizard", "content": "hi"}]),
        json!([{"role": "", "content": "hi"}]),
        json!([{"role": "user"}]),
        json!([{"role": "user", "content": null}]),
        json!([{"role": "user", "content": []}]),
        json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        json!([{"role": "user", "content": [{"type": "text"}]}]),
        json!([{"role": "user", "content": [{"type": "text", "text": 5}]}]),
        json!([{"role": "user", "content": 5}]),
        json!([]),
    ];
    for messages in bad {
        let (s, v) = post(&c, "/v1/chat/completions", json!({"model": "mock", "messages": messages})).await?;
        assert_eq!(s, 400, "{messages}: {v}");
        assert_eq!(v["error"]["param"], "messages", "{messages}: {v}");
    }
    let (s, v) = post(
        &c,
        "/v1/chat/completions",
        json!({"model": "mock", "max_tokens": 1, "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": null}, {"role": "tool", "content": "42"}, {"role": "user", "content": "ok"}]}),
    )
    .await?;
    assert_eq!(s, 200, "{v}");
    assert_eq!(c.mocks[0].stats.requests.load(Ordering::Relaxed), 1);

    use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
    use prism_common::proto::v1::{
        ChatMessage, ChatMessages, GenerateRequest, SamplingParams, generate_request::Prompt,
    };
    let mut g = InferenceServiceClient::connect(c.grpc.clone()).await?;
    let msg = |role: &str| ChatMessage { role: role.into(), content: "hi".into(), ..Default::default() };
    for (messages, n) in
        [(vec![], None), (vec![msg("")], None), (vec![msg("user")], Some(17)), (vec![msg("user")], Some(128))]
    {
        let req = GenerateRequest {
            model: "mock".into(),
            prompt: Some(Prompt::Chat(ChatMessages { messages })),
            sampling: Some(SamplingParams { n, ..Default::default() }),
            ..Default::default()
        };
        let Err(e) = g.generate(req).await else { panic!("accepted") };
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    }
    // cache_salt: the same rule as over HTTP, the status naming the field.
    for salt in [String::new(), "x".repeat(257)] {
        let req = GenerateRequest {
            model: "mock".into(),
            prompt: Some(Prompt::Chat(ChatMessages { messages: vec![msg("user")] })),
            cache_salt: Some(salt),
            ..Default::default()
        };
        let Err(e) = g.generate(req).await else { panic!("accepted") };
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("cache_salt"), "{e:?}");
    }
    assert_eq!(c.mocks[0].stats.requests.load(Ordering::Relaxed), 1);
    let req = GenerateRequest {
        model: "mock".into(),
        prompt: Some(Prompt::Chat(ChatMessages { messages: vec![msg("user")] })),
        sampling: Some(SamplingParams { max_tokens: Some(1), ..Default::default() }),
        cache_salt: Some("x".repeat(256)),
        ..Default::default()
    };
    let mut s = g.generate(req).await?.into_inner();
    while s.message().await?.is_some() {}
    assert_eq!(c.mocks[0].stats.requests.load(Ordering::Relaxed), 2, "a 256-byte salt is accepted");
    Ok(())
}

#[tokio::test]
async fn error_objects_models_and_405() -> anyhow::Result<()> {
    let c = cluster(1).await?;
    let http = reqwest::Client::new();
    let r = http.get(format!("{}/v1/completions", c.http)).send().await?;
    assert_eq!(r.status().as_u16(), 405);
    let v: Value = r.json().await?;
    assert!(v["error"]["message"].is_string() && v["error"]["code"].is_string(), "{v}");
    let (s, v) = post(&c, "/v1/completions", json!({"model": "nope", "prompt": "a"})).await?;
    assert_eq!(
        (s, v["error"]["code"].clone(), v["error"]["param"].clone()),
        (404, json!("model_not_found"), json!("model"))
    );
    // Worker-side "prompt is empty" names the prompt (`prism-param` metadata).
    let (s, v) = post(&c, "/v1/completions", json!({"model": "mock", "prompt": ""})).await?;
    assert_eq!((s, v["error"]["param"].clone(), v["error"]["code"].clone()), (400, json!("prompt"), Value::Null));

    let list = http.get(format!("{}/v1/models", c.http)).send().await?.json::<Value>().await?;
    let created = list["data"][0]["created"].as_i64().unwrap_or(0);
    assert!(created > 1_700_000_000, "created is a real time: {list}");
    let one = http.get(format!("{}/v1/models/mock", c.http)).send().await?;
    assert_eq!(one.status().as_u16(), 200);
    assert_eq!(one.json::<Value>().await?, list["data"][0]);
    let r = http.get(format!("{}/v1/models/nope", c.http)).send().await?;
    assert_eq!(r.status().as_u16(), 404);
    assert_eq!(r.json::<Value>().await?["error"]["code"], "model_not_found");
    Ok(())
}

#[tokio::test]
async fn half_sent_heads_are_closed_and_truncated_bodies_are_400() -> anyhow::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c =
        cluster_with(vec![MockBehavior::default()], |cfg| cfg.http_header_read_timeout = Duration::from_millis(500))
            .await?;
    let addr = c.http.trim_start_matches("http://").to_owned();
    // Half a request head, then silence: the router closes the connection after the timeout.
    let mut s = tokio::net::TcpStream::connect(&addr).await?;
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl").await?;
    let t = Instant::now();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await??;
    assert!(t.elapsed() < Duration::from_secs(3), "closed after {:?}", t.elapsed());
    // Content-Length 100, 10 bytes, then EOF: 400 incomplete body, not 413.
    let mut s = tokio::net::TcpStream::connect(&addr).await?;
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":").await?;
    s.shutdown().await?;
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await??;
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(text.contains("incomplete request body"), "{text}");
    Ok(())
}
