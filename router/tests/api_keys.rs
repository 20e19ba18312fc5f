//! API keys against the real router (`prism_router::run` on 127.0.0.1:0, a mock engine behind
//! a static route): a table over every route, method and path spelling sent as raw HTTP/1.1
//! (an HTTP client would normalise the paths), compared with a router without keys; gRPC
//! inference, reflection and health; per-key request and token limits (tokens charged only for
//! requests a replica accepted).

use std::time::Duration;

use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{GenerateRequest, ListModelsRequest, SamplingParams, generate_request::Prompt};
use prism_router::auth::ApiKeyEntry;
use prism_router::config::{RouterConfig, StaticRoute};
use prism_router::mock_engine::{MockBehavior, MockEngineWorker};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

const KEY: &str = "sk-prism-test-0123456789";

struct Router {
    http: std::net::SocketAddr,
    grpc: String,
}

async fn router(shutdown: &CancellationToken, tweak: impl FnOnce(&mut RouterConfig)) -> anyhow::Result<Router> {
    router_over(shutdown, vec![("mock", MockBehavior::default())], tweak).await
}

/// A router over one mock engine per model.
async fn router_over(
    shutdown: &CancellationToken,
    models: Vec<(&str, MockBehavior)>,
    tweak: impl FnOnce(&mut RouterConfig),
) -> anyhow::Result<Router> {
    let mut static_routes = Vec::new();
    for (model, behavior) in models {
        let addr = MockEngineWorker::new(behavior).spawn(shutdown.clone()).await?;
        static_routes.push(StaticRoute { model: model.into(), endpoint: format!("http://{addr}") });
    }
    let mut cfg = RouterConfig { static_routes, ..Default::default() };
    tweak(&mut cfg);
    let h = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let g = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let r = Router { http: h.local_addr()?, grpc: format!("http://{}", g.local_addr()?) };
    tokio::spawn(prism_router::run(cfg, h, g, shutdown.clone()));
    Ok(r)
}

/// A raw answer: status, headers (lower-case names), body.
struct Raw {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Raw {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
    }
}

/// Sends one HTTP/1.1 request with the request target exactly as given.
async fn raw(addr: std::net::SocketAddr, method: &str, target: &str, auth: Option<&str>) -> anyhow::Result<Raw> {
    let body = r#"{"model": "mock", "prompt": "a b", "max_tokens": 40}"#;
    let mut req = format!("{method} {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(a) = auth {
        req.push_str(&format!("Authorization: {a}\r\n"));
    }
    if method != "GET" && method != "HEAD" {
        req.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()));
    } else {
        req.push_str("\r\n");
    }
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(req.as_bytes()).await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out)).await??;
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split_whitespace().nth(1)).and_then(|s| s.parse().ok()).unwrap_or(0);
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Ok(Raw { status, headers, body: body.to_owned() })
}

/// The request targets of the table: every route of the app and spellings of them.
const TARGETS: &[&str] = &[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/models/mock",
    "/v1/models/nope",
    "/health",
    "/healthz",
    "/readyz",
    "/metrics",
    "/V1/models",
    "/V1/MODELS",
    "//v1//models",
    "/v1/./models",
    "/x/../v1/models",
    "/v1/%6Dodels",
    "/v1%2Fmodels",
    "/v1/models/",
    "/v1/models;x=1",
    "/v1/models?x=1",
    "/v1/models#x",
    "/healthz/../v1/models",
    "/health/../v1/completions",
    "/healthz/",
    "/HEALTHZ",
    "//healthz",
    "/healthz;x=1",
    "/health%2F..%2Fv1%2Fmodels",
    "/metrics/",
    "/invocations",
    "/v2/models",
    "/nope",
    "*",
    "http://example.com/v1/models",
];

const METHODS: &[&str] = &["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];

fn is_probe(method: &str, target: &str) -> bool {
    matches!(method, "GET" | "HEAD") && matches!(target, "/health" | "/healthz" | "/readyz")
}

#[tokio::test]
async fn every_route_method_and_spelling_needs_the_key_but_the_probes() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let keyed = router(&shutdown, |c| c.api_keys = vec![KEY.into(), "sk-other-key".into()]).await?;
    let open = router(&shutdown, |_| {}).await?;
    let bearer = format!("Bearer {KEY}");
    let lower = format!("bearer {KEY}");
    let upper = format!("BEARER {KEY}");
    let refused: [Option<&str>; 6] = [
        None,
        Some("Bearer sk-wrong"),
        Some(KEY),
        Some("Basic c2stcHJpc20="),
        Some("Bearer "),
        Some("Bearer sk-prism"),
    ];
    let mut checked = 0;
    for method in METHODS {
        for target in TARGETS {
            let reference = raw(open.http, method, target, None).await?;
            for auth in refused {
                let r = raw(keyed.http, method, target, auth).await?;
                if is_probe(method, target) {
                    assert_eq!(r.status, reference.status, "{method} {target} (probe) with {auth:?}");
                    continue;
                }
                assert_eq!(r.status, 401, "{method} {target} with {auth:?}: {}", r.body);
                assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{method} {target}");
                if *method != "HEAD" {
                    let v: Value = serde_json::from_str(&r.body)?;
                    assert_eq!(v["error"]["code"], "invalid_api_key", "{method} {target}: {v}");
                    assert_eq!(v["error"]["type"], "invalid_request_error");
                    assert_eq!(v["error"]["param"], Value::Null);
                    assert!(!r.body.contains("sk-"), "the body echoes a key: {}", r.body);
                }
                checked += 1;
            }
            for auth in [&bearer, &lower, &upper] {
                let r = raw(keyed.http, method, target, Some(auth)).await?;
                assert_eq!(
                    r.status, reference.status,
                    "{method} {target} with the key: {} vs {}",
                    r.body, reference.body
                );
                assert_ne!(r.status, 401, "{method} {target}");
            }
        }
    }
    assert_eq!(raw(keyed.http, "GET", "/v1/models", Some(&bearer)).await?.status, 200);
    assert_eq!(raw(keyed.http, "POST", "/v1/completions", Some(&bearer)).await?.status, 200);
    assert_eq!(
        raw(keyed.http, "GET", "/nope", Some(&bearer)).await?.status,
        404,
        "unknown path: 404 only with the key"
    );
    assert_eq!(raw(keyed.http, "GET", "/healthz", None).await?.status, 200);
    assert!(checked > 1000, "{checked} refusals checked");

    // Not a request target at all: the HTTP parser answers 400 before any route or key check.
    for target in ["%2Fv1%2Fmodels", "v1/models"] {
        for auth in [None, Some(bearer.as_str())] {
            let r = raw(keyed.http, "GET", target, auth).await?;
            assert_eq!((r.status, r.body.as_str()), (400, ""), "{target} with {auth:?}");
        }
    }

    // Two Authorization headers: refused even when one holds the key. Only Authorization is
    // read: the key in x-api-key, api-key or the query string is no key.
    for headers in [
        format!("Authorization: Bearer {KEY}\r\nAuthorization: Bearer x\r\n"),
        format!("X-Api-Key: {KEY}\r\n"),
        format!("Api-Key: {KEY}\r\n"),
    ] {
        let mut s = tokio::net::TcpStream::connect(keyed.http).await?;
        let req = format!("GET /v1/models HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await?;
        let mut out = String::new();
        s.read_to_string(&mut out).await?;
        assert!(out.starts_with("HTTP/1.1 401"), "{headers}: {out}");
    }
    let q = raw(keyed.http, "GET", &format!("/v1/models?api_key={KEY}"), None).await?;
    assert_eq!(q.status, 401);

    let m = raw(keyed.http, "GET", "/metrics", Some(&bearer)).await?;
    assert!(m.body.contains(r#"prism_router_auth_rejected_total{reason="missing"}"#), "{}", m.body);
    assert!(m.body.contains(r#"prism_router_auth_rejected_total{reason="invalid"}"#));
    assert!(m.body.contains(r#"prism_router_auth_rejected_total{reason="malformed"}"#));
    assert!(!m.body.contains(KEY), "metrics name a key");
    Ok(())
}

#[tokio::test]
async fn metrics_without_auth_opens_only_metrics() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let r = router(&shutdown, |c| {
        c.api_keys = vec![KEY.into()];
        c.metrics_without_auth = true;
    })
    .await?;
    assert_eq!(raw(r.http, "GET", "/metrics", None).await?.status, 200);
    for (m, t) in [("GET", "/metrics/"), ("GET", "/METRICS"), ("POST", "/metrics"), ("GET", "/metrics/../v1/models")] {
        assert_eq!(raw(r.http, m, t, None).await?.status, 401, "{m} {t}");
    }
    assert_eq!(raw(r.http, "GET", "/v1/models", None).await?.status, 401);
    Ok(())
}

fn generate_request(max_tokens: i64) -> GenerateRequest {
    GenerateRequest {
        model: "mock".into(),
        prompt: Some(Prompt::Text("a".into())),
        sampling: Some(SamplingParams { max_tokens: Some(max_tokens), ..Default::default() }),
        ..Default::default()
    }
}

fn with_key<T>(msg: T, auth: &str) -> anyhow::Result<tonic::Request<T>> {
    let mut r = tonic::Request::new(msg);
    r.metadata_mut().insert("authorization", auth.parse()?);
    Ok(r)
}

#[tokio::test]
async fn grpc_needs_the_key_on_every_service_but_health() -> anyhow::Result<()> {
    use tonic_health::pb::HealthCheckRequest;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::{ServerReflectionRequest, server_reflection_request::MessageRequest};

    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let r = router(&shutdown, |c| c.api_keys = vec![KEY.into()]).await?;
    let mut g = InferenceServiceClient::connect(r.grpc.clone()).await?;
    let bearer = format!("Bearer {KEY}");
    for auth in [None, Some("Bearer wrong"), Some(KEY)] {
        let gen_req = match auth {
            Some(a) => with_key(generate_request(2), a)?,
            None => tonic::Request::new(generate_request(2)),
        };
        let e = g.generate(gen_req).await.err().map(|s| s.code());
        assert_eq!(e, Some(tonic::Code::Unauthenticated), "Generate with {auth:?}");
        let list = match auth {
            Some(a) => with_key(ListModelsRequest {}, a)?,
            None => tonic::Request::new(ListModelsRequest {}),
        };
        assert_eq!(g.list_models(list).await.err().map(|s| s.code()), Some(tonic::Code::Unauthenticated));
    }
    let mut s = g.generate(with_key(generate_request(3), &bearer)?).await?.into_inner();
    let mut n = 0;
    while let Some(m) = s.message().await? {
        n += m.token_ids.len();
    }
    assert_eq!(n, 3);
    let models = g.list_models(with_key(ListModelsRequest {}, &format!("bearer {KEY}"))?).await?.into_inner();
    assert_eq!(models.models[0].id, "mock");

    let channel = tonic::transport::Channel::from_shared(r.grpc.clone())?.connect().await?;
    let mut refl = ServerReflectionClient::new(channel.clone());
    let ask = || ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let e = refl.server_reflection_info(tokio_stream::iter(vec![ask()])).await.err().map(|s| s.code());
    assert_eq!(e, Some(tonic::Code::Unauthenticated), "reflection lists the API");
    let mut ok = refl.server_reflection_info(with_key(tokio_stream::iter(vec![ask()]), &bearer)?).await?.into_inner();
    assert!(ok.message().await?.is_some(), "reflection with the key");

    let mut health = HealthClient::new(channel);
    let h = health.check(HealthCheckRequest { service: String::new() }).await;
    assert_ne!(h.err().map(|s| s.code()), Some(tonic::Code::Unauthenticated), "grpc.health.v1 is a probe");
    Ok(())
}

#[tokio::test]
async fn per_key_limits_answer_429_with_retry_after_and_spare_other_keys() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let limited = ApiKeyEntry { label: "team-a".into(), rps: Some(2.0), ..ApiKeyEntry::from("sk-limited") };
    let tokens = ApiKeyEntry { label: "team-t".into(), tpm: Some(100), ..ApiKeyEntry::from("sk-tokens") };
    let r = router(&shutdown, |c| c.api_keys = vec![limited, tokens, KEY.into()]).await?;
    let (a, t, other) = ("Bearer sk-limited", "Bearer sk-tokens", format!("Bearer {KEY}"));
    assert_eq!(raw(r.http, "GET", "/v1/models", Some(a)).await?.status, 200);
    assert_eq!(raw(r.http, "GET", "/v1/models", Some(a)).await?.status, 200);
    let third = raw(r.http, "GET", "/v1/models", Some(a)).await?;
    assert_eq!(third.status, 429, "{}", third.body);
    let wait: u32 = third.header("retry-after").unwrap_or_default().parse()?;
    assert!(wait >= 1, "Retry-After {wait}");
    let v: Value = serde_json::from_str(&third.body)?;
    assert_eq!(v["error"]["code"], "rate_limit_exceeded");
    for _ in 0..5 {
        assert_eq!(raw(r.http, "GET", "/v1/models", Some(&other)).await?.status, 200, "another key is not limited");
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(raw(r.http, "GET", "/v1/models", Some(a)).await?.status, 200, "refilled after 0.5 s");

    // gRPC shares the key's bucket: full again after a second, two pass and the third waits.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut g = InferenceServiceClient::connect(r.grpc.clone()).await?;
    g.list_models(with_key(ListModelsRequest {}, a)?).await?;
    g.list_models(with_key(ListModelsRequest {}, a)?).await?;
    let e = g.list_models(with_key(ListModelsRequest {}, a)?).await.expect_err("over 2 requests/s");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted);
    let wait: u32 = e.metadata().get("retry-after").and_then(|v| v.to_str().ok()).unwrap_or_default().parse()?;
    assert!(wait >= 1);

    // 100 tokens/min: prompt "a" (1) + 80 decode tokens fits once; the next asks for 81 more,
    // and the HTTP body (1 + 40) does not fit the 19 left either.
    let mut first = g.generate(with_key(generate_request(80), t)?).await?.into_inner();
    while first.message().await?.is_some() {}
    let e = g.generate(with_key(generate_request(80), t)?).await.expect_err("over 100 tokens/min");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted);
    let wait: u32 = e.metadata().get("retry-after").and_then(|v| v.to_str().ok()).unwrap_or_default().parse()?;
    assert!((30..=60).contains(&wait), "62 missing tokens at 100/min: {wait} s");
    let http = raw(r.http, "POST", "/v1/completions", Some(t)).await?;
    assert_eq!(http.status, 429, "HTTP shares the token bucket: {}", http.body);
    assert!(http.header("retry-after").is_some());
    let m = raw(r.http, "GET", "/metrics", Some(&other)).await?.body;
    assert!(m.contains(r#"prism_router_rate_limited_total{key="team-a",limit="requests"} 2"#), "{m}");
    assert!(m.contains(r#"prism_router_rate_limited_total{key="team-t",limit="tokens"} 2"#), "{m}");
    Ok(())
}

/// The token limit charges only requests a replica accepted: ones refused for the context
/// length (400 from the worker), an unknown model (404) or a failing replica (503) give their
/// tokens back, over HTTP and gRPC alike, so the identical next request is not a 429.
#[tokio::test]
async fn token_limit_charges_only_requests_a_replica_accepted() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let key = ApiKeyEntry { label: "team-a".into(), tpm: Some(20_000), ..ApiKeyEntry::from("sk-team-a-0123456789") };
    let bounded = MockBehavior { max_model_len: Some(16_000), ..Default::default() };
    let down = MockBehavior { fail_before_first: true, ..Default::default() };
    let r = router_over(&shutdown, vec![("mock", bounded), ("down", down)], |c| {
        c.api_keys = vec![key];
        c.max_queue_wait = Duration::from_millis(300);
    })
    .await?;
    let auth = "Bearer sk-team-a-0123456789";
    let http = reqwest::Client::new();
    let post = |model: &str, max_tokens: u32| {
        http.post(format!("http://{}/v1/completions", r.http))
            .header("authorization", auth)
            .json(&serde_json::json!({"model": model, "prompt": "a b", "max_tokens": max_tokens}))
            .send()
    };
    // 17,001 tokens each against 20,000 a minute: a second charge would not fit.
    for (model, want) in [("mock", 400), ("mock", 400), ("nope", 404), ("nope", 404), ("down", 503), ("down", 503)] {
        let res = post(model, 17_000).await?;
        let status = res.status().as_u16();
        assert_eq!(status, want, "{model}: {}", res.text().await?);
    }
    let mut g = InferenceServiceClient::connect(r.grpc.clone()).await?;
    for _ in 0..2 {
        let e = g.generate(with_key(generate_request(17_000), auth)?).await.expect_err("over the context length");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    }
    // An accepted request is charged: 15,001 of the 20,000 are gone, the next one waits.
    let mut accepted = g.generate(with_key(generate_request(15_000), auth)?).await?.into_inner();
    accepted.message().await?;
    drop(accepted);
    let res = post("mock", 15_000).await?;
    assert_eq!(res.status().as_u16(), 429, "the accepted request was charged");
    // With the budget spent, a request the router refuses anyway gets that answer, not 429.
    assert_eq!(post("nope", 15_000).await?.status().as_u16(), 404, "unknown model over HTTP");
    let res = http
        .post(format!("http://{}/v1/completions", r.http))
        .header("authorization", auth)
        .json(&serde_json::json!({"model": "mock", "prompt": "a", "max_tokens": 15_000, "temperature": -1}))
        .send()
        .await?;
    assert_eq!(res.status().as_u16(), 400, "bad temperature over HTTP");
    let mut bad = generate_request(15_000);
    bad.sampling = Some(SamplingParams { temperature: Some(-1.0), max_tokens: Some(15_000), ..Default::default() });
    let e = g.generate(with_key(bad, auth)?).await.expect_err("temperature -1");
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let unknown = GenerateRequest { model: "nope".into(), ..generate_request(15_000) };
    let e = g.generate(with_key(unknown, auth)?).await.expect_err("unknown model");
    assert_eq!(e.code(), tonic::Code::NotFound, "{e:?}");
    let m = http.get(format!("http://{}/metrics", r.http)).header("authorization", auth).send().await?.text().await?;
    assert!(m.contains(r#"prism_router_rate_limited_total{key="team-a",limit="tokens"} 1"#), "{m}");
    Ok(())
}
