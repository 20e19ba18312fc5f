//! Property harnesses over hostile requests, against the real router (`prism_router::run` on
//! 127.0.0.1:0, a mock engine behind a static route), seeded and bounded so they run in CI:
//! random JSON values and mutated valid bodies on the OpenAI routes must get a 200 or a 4xx
//! with an OpenAI error body, never a 5xx or a dropped connection; random field values in a
//! gRPC `GenerateRequest` must get OK or INVALID_ARGUMENT / NOT_FOUND, never INTERNAL or
//! UNKNOWN (what a panicking handler turns into). `PRISM_FUZZ_CASES=N` runs N cases per
//! harness (default 300), `PRISM_FUZZ_SEED=S` changes the seed.

use std::time::Duration;

use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{
    ChatMessage, ChatMessages, GenerateRequest, SamplingParams, TokenIds, generate_request::Prompt,
};
use prism_router::config::{RouterConfig, StaticRoute};
use prism_router::mock_engine::{MockBehavior, MockEngineWorker};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

fn cases() -> usize {
    std::env::var("PRISM_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300)
}

fn rng(harness: u64) -> (StdRng, u64) {
    let seed = std::env::var("PRISM_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0x5eed_0000) ^ harness;
    (StdRng::seed_from_u64(seed), seed)
}

async fn router(shutdown: &CancellationToken) -> anyhow::Result<(String, String)> {
    let mock = MockEngineWorker::new(MockBehavior::default());
    let addr = mock.spawn(shutdown.clone()).await?;
    let static_routes = vec![StaticRoute { model: "mock".into(), endpoint: format!("http://{addr}") }];
    let cfg = RouterConfig { static_routes, ..Default::default() };
    let h = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let g = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let urls = (format!("http://{}", h.local_addr()?), format!("http://{}", g.local_addr()?));
    tokio::spawn(prism_router::run(cfg, h, g, shutdown.clone()));
    Ok(urls)
}

fn random_string(rng: &mut StdRng) -> String {
    const PIECES: [&str; 8] = ["mock", "", "user", "system", "<|im_end|>", "\u{0}", "é🦀", "assistant"];
    match rng.random_range(0..3) {
        0 => PIECES[rng.random_range(0..PIECES.len())].to_owned(),
        1 => (0..rng.random_range(0..12)).map(|_| rng.random::<char>()).collect(),
        _ => "x".repeat(rng.random_range(0..300)),
    }
}

fn random_json(rng: &mut StdRng, depth: u32) -> Value {
    match rng.random_range(0..if depth > 2 { 6 } else { 8 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.random()),
        2 => match rng.random_range(0..10) {
            9 => json!(u64::MAX),
            i => json!([-1, 0, 1, 2, 16, 17, 21, i64::MAX, i64::MIN][i]),
        },
        3 => json!([0.0, -0.5, 0.5, 1.0, 2.5, 1e308, -1e308, 1e-310][rng.random_range(0..8)]),
        4 | 5 => Value::String(random_string(rng)),
        6 => Value::Array((0..rng.random_range(0..4)).map(|_| random_json(rng, depth + 1)).collect()),
        _ => {
            let keys = ["role", "content", "type", "text", "model", "x"];
            Value::Object(
                (0..rng.random_range(0..4))
                    .map(|_| (keys[rng.random_range(0..keys.len())].to_owned(), random_json(rng, depth + 1)))
                    .collect(),
            )
        }
    }
}

fn valid_body(rng: &mut StdRng, chat: bool) -> Value {
    let mut b = if chat {
        json!({"model": "mock", "messages": [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 3})
    } else {
        json!({"model": "mock", "prompt": "a b c", "max_tokens": 3})
    };
    for (k, v) in [
        ("temperature", json!(0.7)),
        ("top_p", json!(0.9)),
        ("top_k", json!(5)),
        ("n", json!(2)),
        ("stop", json!(["\n"])),
        ("seed", json!(7)),
        ("stream", json!(true)),
        ("logprobs", if chat { json!(true) } else { json!(2) }),
        ("presence_penalty", json!(0.5)),
        ("stream_options", json!({"include_usage": true})),
    ] {
        if rng.random_bool(0.3) {
            b[k] = v;
        }
    }
    b
}

/// Replaces a random value somewhere in `v` (or removes or adds a key).
fn mutate_json(rng: &mut StdRng, v: &mut Value) {
    match v {
        Value::Object(map) if !map.is_empty() && rng.random_bool(0.7) => {
            let keys: Vec<String> = map.keys().cloned().collect();
            let k = &keys[rng.random_range(0..keys.len())];
            match rng.random_range(0..4) {
                0 => {
                    map.remove(k);
                }
                1 => {
                    if let Some(child) = map.get_mut(k) {
                        mutate_json(rng, child);
                    }
                }
                _ => {
                    map.insert(k.clone(), random_json(rng, 0));
                }
            }
        }
        Value::Array(items) if !items.is_empty() && rng.random_bool(0.7) => {
            let i = rng.random_range(0..items.len());
            mutate_json(rng, &mut items[i]);
        }
        _ => *v = random_json(rng, 0),
    }
}

/// The mock engine makes `max_tokens` tokens without pausing: a valid huge count is a long
/// answer, not a validation case, so it is cut to a few tokens.
fn bound_lengths(v: &mut Value) {
    for k in ["max_tokens", "max_completion_tokens"] {
        if let Some(n) = v.get(k).and_then(Value::as_u64)
            && n > 8
        {
            v[k] = json!(8);
        }
    }
}

async fn check_http(client: &reqwest::Client, url: &str, body: Vec<u8>, what: &str) -> anyhow::Result<u16> {
    let r = client.post(url).header("content-type", "application/json").body(body).send().await?;
    let status = r.status().as_u16();
    let text = r.text().await?;
    assert!(status == 200 || (400..500).contains(&status), "{what}: status {status}: {text}");
    if status != 200 {
        let v: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
        assert!(
            v["error"]["message"].is_string() && v["error"]["type"].is_string(),
            "{what}: a {status} without an OpenAI error body: {text}"
        );
    }
    Ok(status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_and_mutated_openai_bodies_get_200_or_a_4xx_error_body() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let (http, _) = router(&shutdown).await?;
    let client = reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?;
    let (mut rng, seed) = rng(11);
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for case in 0..cases() {
        let chat = case % 2 == 0;
        let url = format!("{http}{}", if chat { "/v1/chat/completions" } else { "/v1/completions" });
        let body: Vec<u8> = match case % 5 {
            // Any JSON value at all.
            0 => serde_json::to_vec(&random_json(&mut rng, 0))?,
            // Bytes of a valid body, mutated: broken JSON, invalid UTF-8.
            1 => {
                let mut b = serde_json::to_vec(&valid_body(&mut rng, chat))?;
                for _ in 0..rng.random_range(1..4) {
                    if b.is_empty() {
                        break;
                    }
                    let at = rng.random_range(0..b.len());
                    match rng.random_range(0..3) {
                        0 => b[at] = rng.random(),
                        1 => b.truncate(at),
                        _ => b.insert(at, [b'{', b'[', b'"', b'\\', 0xff][rng.random_range(0..5)]),
                    }
                }
                b
            }
            // A valid body with one to three values replaced, removed or added.
            _ => {
                let mut v = valid_body(&mut rng, chat);
                for _ in 0..rng.random_range(1..4) {
                    mutate_json(&mut rng, &mut v);
                }
                bound_lengths(&mut v);
                serde_json::to_vec(&v)?
            }
        };
        let what = format!("seed {seed} case {case}: {}", String::from_utf8_lossy(&body));
        let s = check_http(&client, &url, body, &what).await?;
        *statuses.entry(s).or_default() += 1;
    }
    // The harness reaches both outcomes.
    assert!(statuses.contains_key(&200) && statuses.keys().any(|s| *s >= 400), "{statuses:?}");
    eprintln!("openai: statuses {statuses:?}");
    Ok(())
}

/// Regression cases for what the harness above reaches (kept explicit).
#[tokio::test]
async fn edge_values_in_openai_bodies_are_4xx_not_5xx() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let (http, _) = router(&shutdown).await?;
    let client = reqwest::Client::new();
    let deep = (0..200).fold(json!(1), |v, _| json!([v]));
    for (path, body) in [
        ("/v1/completions", json!({"model": "mock", "prompt": "a", "max_tokens": u64::MAX})),
        ("/v1/completions", json!({"model": "mock", "prompt": "a", "temperature": 1e308})),
        ("/v1/completions", json!({"model": "mock", "prompt": [[u64::MAX]]})),
        ("/v1/completions", json!({"model": "mock", "prompt": deep})),
        ("/v1/chat/completions", json!({"model": "mock", "messages": [{"role": "user", "content": [{"type": 1}]}]})),
        ("/v1/chat/completions", json!({"model": "mock", "messages": [{"role": "nobody", "content": "x"}]})),
        ("/v1/chat/completions", json!({"model": "mock", "messages": []})),
        ("/v1/chat/completions", json!({"model": "mock", "messages": "hi", "n": 0})),
    ] {
        let what = format!("{path} {body}");
        let s = check_http(&client, &format!("{http}{path}"), serde_json::to_vec(&body)?, &what).await?;
        assert!((400..500).contains(&s), "{what}: {s}");
    }
    Ok(())
}

fn random_request(rng: &mut StdRng) -> GenerateRequest {
    let opt = |rng: &mut StdRng| rng.random_bool(0.5);
    let f = |rng: &mut StdRng| {
        [0.0f32, -1.0, 0.5, 1.0, 2.0, 3.0, f32::NAN, f32::INFINITY, -f32::INFINITY, f32::MAX][rng.random_range(0..10)]
    };
    let prompt = match rng.random_range(0..4) {
        0 => None,
        1 => Some(Prompt::Text(random_string(rng))),
        2 => Some(Prompt::TokenIds(TokenIds {
            ids: (0..rng.random_range(0..6))
                .map(|_| [0, 1, 7, 49_151, 49_152, u32::MAX][rng.random_range(0..6)])
                .collect(),
        })),
        _ => Some(Prompt::Chat(ChatMessages {
            messages: (0..rng.random_range(0..4))
                .map(|_| ChatMessage { role: random_string(rng), content: random_string(rng), ..Default::default() })
                .collect(),
        })),
    };
    let sampling = SamplingParams {
        temperature: opt(rng).then(|| f(rng)),
        top_p: opt(rng).then(|| f(rng)),
        top_k: opt(rng).then(|| [-2, -1, 0, 1, 50, i32::MAX, i32::MIN][rng.random_range(0..7)]),
        min_p: opt(rng).then(|| f(rng)),
        seed: opt(rng).then(|| rng.random()),
        repetition_penalty: opt(rng).then(|| f(rng)),
        frequency_penalty: opt(rng).then(|| f(rng)),
        presence_penalty: opt(rng).then(|| f(rng)),
        stop: (0..rng.random_range(0..3)).map(|_| random_string(rng)).collect(),
        stop_token_ids: (0..rng.random_range(0..3)).map(|_| rng.random()).collect(),
        max_tokens: opt(rng).then(|| [i64::MIN, -1, 0, 1, 4][rng.random_range(0..5)]),
        ignore_eos: rng.random(),
        n: opt(rng).then(|| [0, 1, 2, 16, 17, u32::MAX][rng.random_range(0..6)]),
        logprobs: opt(rng).then(|| [0, 1, 20, 21, u32::MAX][rng.random_range(0..5)]),
        skip_special_tokens: opt(rng).then(|| rng.random()),
        ..Default::default()
    };
    GenerateRequest {
        model: if rng.random_bool(0.9) { "mock".into() } else { random_string(rng) },
        prompt,
        sampling: rng.random_bool(0.9).then_some(sampling),
        request_id: if rng.random_bool(0.7) { String::new() } else { random_string(rng) },
        timeout_ms: opt(rng).then(|| [0, 1, 1000, u64::MAX][rng.random_range(0..4)]),
        cache_salt: opt(rng).then(|| random_string(rng)),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_grpc_generate_requests_get_ok_or_a_client_error() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let (_, grpc) = router(&shutdown).await?;
    let mut client = InferenceServiceClient::connect(grpc).await?;
    let (mut rng, seed) = rng(12);
    let mut codes = std::collections::BTreeMap::<String, usize>::new();
    for case in 0..cases() {
        let req = random_request(&mut rng);
        let what = format!("seed {seed} case {case}: {req:?}");
        let code = match client.generate(req).await {
            Ok(stream) => {
                let mut s = stream.into_inner();
                loop {
                    match s.message().await {
                        Ok(Some(_)) => {}
                        Ok(None) => break tonic::Code::Ok,
                        Err(e) => break e.code(),
                    }
                }
            }
            Err(e) => e.code(),
        };
        // DEADLINE_EXCEEDED: a 1 ms `timeout_ms` is honoured.
        assert!(
            matches!(
                code,
                tonic::Code::Ok | tonic::Code::InvalidArgument | tonic::Code::NotFound | tonic::Code::DeadlineExceeded
            ),
            "{what}: {code:?}"
        );
        *codes.entry(format!("{code:?}")).or_default() += 1;
    }
    assert!(codes.contains_key("Ok") && codes.contains_key("InvalidArgument"), "{codes:?}");
    eprintln!("grpc: codes {codes:?}");
    Ok(())
}
