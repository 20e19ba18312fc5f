//! Serving edge cases against a real `prism up` (head + worker + router, the bundled model on
//! the CPU engine) over the OpenAI HTTP API, one helper per case of the serving-cases table
//! (`cNN_…`): `max_tokens` null; `max_tokens` 0 / -1 while others decode; empty prompts;
//! a prompt past the context window; chat logprobs, streamed and not; UTF-8-safe streaming;
//! client disconnects free everything; malformed bodies. After each case the server must
//! still answer a normal request.
//! The router's own tests cover frozen replicas, long unique prompts, no replica at all and
//! malformed bodies against its mock engine.
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_tests::{PrismUp, eventually, metric_sum, model, post_json, post_sse};
use serde_json::{Value, json};
use std::time::Duration;

const SERVED: &str = "SmolLM2-135M-Instruct";
/// Context window the cluster runs with (small so the context-window case is cheap).
const MAX_MODEL_LEN: usize = 256;

fn chat(content: &str) -> Value {
    json!({"model": SERVED, "messages": [{"role": "user", "content": content}], "temperature": 0})
}

fn with(mut body: Value, extra: Value) -> Value {
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    body
}

/// An OpenAI error object with a message and type.
fn assert_error_object(status: u16, body: &Value) {
    assert!((400..500).contains(&status), "status {status}: {body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(body["error"]["type"].is_string(), "{body}");
}

async fn healthy(http: &str) -> Result<()> {
    let (status, body) =
        post_json(&format!("{http}/v1/chat/completions"), &with(chat("Hi"), json!({"max_tokens": 4}))).await?;
    assert_eq!(status, 200, "server unhealthy after the case: {body}");
    Ok(())
}

async fn c01_max_tokens_null(http: &str) -> Result<()> {
    let url = format!("{http}/v1/chat/completions");
    let (status, body) =
        post_json(&url, &with(chat("What is the capital of France?"), json!({"max_tokens": null}))).await?;
    assert_eq!(status, 200, "{body}");
    let reason = body["choices"][0]["finish_reason"].as_str();
    assert!(matches!(reason, Some("stop" | "length")), "{body}");
    let (status, body) = post_json(
        &format!("{http}/v1/completions"),
        &json!({"model": SERVED, "prompt": "The capital of France is", "max_tokens": null, "temperature": 0}),
    )
    .await?;
    assert_eq!(status, 200, "{body}");
    assert!(matches!(body["choices"][0]["finish_reason"].as_str(), Some("stop" | "length")), "{body}");
    Ok(())
}

async fn c02_bad_max_tokens_while_decoding(http: &str) -> Result<()> {
    let url = format!("{http}/v1/completions");
    let long =
        json!({"model": SERVED, "prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": true, "temperature": 0});
    let background = tokio::spawn({
        let url = url.clone();
        async move { post_json(&url, &long).await }
    });
    for bad in [json!(0), json!(-1)] {
        let (status, body) =
            post_json(&url, &json!({"model": SERVED, "prompt": "hi", "max_tokens": bad.clone()})).await?;
        if status == 200 {
            // The documented alternative for 0: an empty completion.
            assert_eq!(bad, json!(0), "max_tokens {bad} accepted: {body}");
            assert_eq!(body["choices"][0]["text"], "", "{body}");
        } else {
            assert_eq!(status, 400, "max_tokens {bad}: {body}");
            assert_error_object(status, &body);
            assert_eq!(body["error"]["param"], "max_tokens", "{body}");
        }
    }
    let (status, body) = background.await??;
    assert_eq!(status, 200, "running request broke: {body}");
    assert_eq!(body["usage"]["completion_tokens"], 64, "{body}");
    healthy(http).await
}

async fn c03_empty_prompts(http: &str) -> Result<()> {
    let url = format!("{http}/v1/completions");
    for prompt in [json!(""), json!([""])] {
        let (status, body) =
            post_json(&url, &json!({"model": SERVED, "prompt": prompt.clone(), "max_tokens": 4})).await?;
        assert_eq!(status, 400, "prompt {prompt}: {body}");
        assert_error_object(status, &body);
    }
    // The chat template adds tokens around an empty message: a normal answer.
    let (status, body) =
        post_json(&format!("{http}/v1/chat/completions"), &with(chat(""), json!({"max_tokens": 8}))).await?;
    assert_eq!(status, 200, "{body}");
    healthy(http).await
}

async fn c04_context_window(http: &str) -> Result<()> {
    let url = format!("{http}/v1/completions");
    // "hello" repeated: one token per repetition, well past the window.
    let too_long = "hello ".repeat(MAX_MODEL_LEN + 1);
    let (status, body) = post_json(&url, &json!({"model": SERVED, "prompt": too_long, "max_tokens": 1})).await?;
    assert_eq!(status, 400, "{body}");
    assert_error_object(status, &body);
    // Fits alone, not with max_tokens: the same outcome every time (400, or capped at length).
    let fits = "hello ".repeat(MAX_MODEL_LEN - 40);
    let request = json!({"model": SERVED, "prompt": fits, "max_tokens": 100, "temperature": 0});
    let first = post_json(&url, &request).await?;
    let second = post_json(&url, &request).await?;
    assert_eq!(first.0, second.0, "{first:?} vs {second:?}");
    match first.0 {
        400 => assert_error_object(first.0, &first.1),
        200 => {
            assert_eq!(first.1["choices"][0]["finish_reason"], "length", "{}", first.1);
            assert_eq!(first.1["choices"][0]["text"], second.1["choices"][0]["text"]);
        }
        other => bail!("unexpected status {other}: {}", first.1),
    }
    healthy(http).await
}

fn check_logprob_entries(entries: &[Value], top: usize) {
    for e in entries {
        assert!(e["token"].is_string(), "{e}");
        assert!(e["logprob"].as_f64().is_some_and(|l| l <= 0.0), "{e}");
        assert!(e["bytes"].is_array(), "{e}");
        let alternatives = e["top_logprobs"].as_array().map_or(usize::MAX, Vec::len);
        assert_eq!(alternatives, top, "{e}");
    }
}

async fn c05_chat_logprobs(http: &str) -> Result<()> {
    let url = format!("{http}/v1/chat/completions");
    let base = with(chat("Count from one to five."), json!({"max_tokens": 12, "logprobs": true}));
    let (status, body) = post_json(&url, &base).await?;
    assert_eq!(status, 200, "{body}");
    let tokens = body["usage"]["completion_tokens"].as_u64().context("usage")?;
    let entries = body["choices"][0]["logprobs"]["content"].as_array().context("logprobs.content")?;
    assert_eq!(entries.len() as u64, tokens, "{body}");
    check_logprob_entries(entries, 0);

    let (status, body) = post_json(&url, &with(base.clone(), json!({"top_logprobs": 3}))).await?;
    assert_eq!(status, 200, "{body}");
    let entries = body["choices"][0]["logprobs"]["content"].as_array().context("logprobs.content")?;
    assert_eq!(entries.len() as u64, tokens);
    check_logprob_entries(entries, 3);
    let whole: Vec<Value> = entries.clone();

    let events = post_sse(&url, &with(base, json!({"top_logprobs": 3, "stream": true}))).await?;
    let mut streamed = Vec::new();
    for event in &events {
        let Some(choice) = event["choices"].get(0) else { continue };
        let content = choice["delta"]["content"].as_str().unwrap_or_default();
        let chunk: Vec<Value> = choice["logprobs"]["content"].as_array().cloned().unwrap_or_default();
        if !chunk.is_empty() {
            // A chunk's entries are its own tokens: their bytes spell (at most) its text.
            let bytes: Vec<u8> = chunk
                .iter()
                .flat_map(|e| e["bytes"].as_array().cloned().unwrap_or_default())
                .filter_map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
                .collect();
            let text = String::from_utf8_lossy(&bytes);
            assert!(
                content.is_empty() || text.contains(content) || content.contains(text.trim_end_matches('\u{fffd}')),
                "chunk text {content:?} vs its logprob bytes {text:?}"
            );
        }
        streamed.extend(chunk);
    }
    assert_eq!(streamed.len(), whole.len(), "streamed logprob entries differ in number");
    for (s, w) in streamed.iter().zip(&whole) {
        assert_eq!(s["token"], w["token"]);
    }
    Ok(())
}

async fn c06_utf8_streaming(http: &str) -> Result<()> {
    let url = format!("{http}/v1/completions");
    let prompt = "Emoji and Korean: 😀🎉🚀 안녕하세요 반갑습니다 𠜎𠜱𠝹 😀🎉🚀 안녕하세요";
    for sampling in [json!({"temperature": 0}), json!({"temperature": 1.0, "seed": 7})] {
        let body = with(json!({"model": SERVED, "prompt": prompt, "max_tokens": 48}), sampling);
        let (status, whole) = post_json(&url, &body).await?;
        assert_eq!(status, 200, "{whole}");
        let text = whole["choices"][0]["text"].as_str().context("text")?.to_owned();
        let events = post_sse(&url, &with(body, json!({"stream": true}))).await?;
        let deltas: Vec<String> =
            events.iter().filter_map(|e| e["choices"].get(0)?.get("text")?.as_str().map(str::to_owned)).collect();
        for d in &deltas {
            assert!(!d.contains('\u{fffd}'), "delta with U+FFFD: {d:?}");
        }
        assert_eq!(deltas.concat(), text);
    }
    Ok(())
}

async fn worker_idle(metrics_url: &str) -> Result<Option<()>> {
    let body = reqwest::get(metrics_url).await?.text().await?;
    let running = metric_sum(&body, "vllm:num_requests_running").context("no vllm:num_requests_running")?;
    let waiting = metric_sum(&body, "vllm:num_requests_waiting").unwrap_or(0.0);
    let kv = metric_sum(&body, "vllm:kv_cache_usage_perc").context("no vllm:kv_cache_usage_perc")?;
    Ok((running == 0.0 && waiting == 0.0 && kv == 0.0).then_some(()))
}

async fn c07_disconnects_free_everything(http: &str, metrics_url: &str) -> Result<()> {
    let url = format!("{http}/v1/completions");
    let body = json!({"model": SERVED, "prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": true});
    let client = reqwest::Client::builder().timeout(Duration::from_millis(400)).build()?;
    for round in 0..5 {
        // Not streamed: the client gives up (timeout) mid-generation.
        let r = client.post(&url).json(&body).send().await;
        assert!(r.is_err() || r.is_ok_and(|r| r.status().as_u16() != 500), "round {round}");
        // Streamed: read the first bytes, then drop the connection.
        let streaming =
            reqwest::Client::new().post(&url).json(&with(body.clone(), json!({"stream": true}))).send().await?;
        assert_eq!(streaming.status().as_u16(), 200);
        let mut streaming = streaming;
        let _first = streaming.chunk().await?;
        drop(streaming);
    }
    eventually(Duration::from_secs(5), "worker back to idle (running 0, waiting 0, KV 0)", || worker_idle(metrics_url))
        .await?;
    healthy(http).await
}

async fn c16_malformed_bodies(http: &str) -> Result<()> {
    let url = format!("{http}/v1/chat/completions");
    let client = reqwest::Client::new();
    let r = client.post(&url).body(chat("hi").to_string()).send().await?;
    let status = r.status().as_u16();
    assert!(status == 415 || status == 400, "no Content-Type: {status}");
    for raw in ["[]", "123", "null", "\"abc\"", "{\"model\": \"x\", \"messages\": [", ""] {
        let r = client.post(&url).header("content-type", "application/json").body(raw).send().await?;
        let status = r.status().as_u16();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        assert!(matches!(status, 400 | 415 | 422), "body {raw:?}: {status} {body}");
        assert_error_object(status, &body);
    }
    healthy(http).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serving_edge_cases_on_the_real_model() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let len = MAX_MODEL_LEN.to_string();
    let up = PrismUp::start(&model, &["--max-model-len", &len]).await?;
    let ep = up.endpoints.clone();
    let outcome = async {
        c01_max_tokens_null(&ep.http).await.context("C01")?;
        c02_bad_max_tokens_while_decoding(&ep.http).await.context("C02")?;
        c03_empty_prompts(&ep.http).await.context("C03")?;
        c04_context_window(&ep.http).await.context("C04")?;
        c05_chat_logprobs(&ep.http).await.context("C05")?;
        c06_utf8_streaming(&ep.http).await.context("C06")?;
        c07_disconnects_free_everything(&ep.http, &ep.worker_metrics).await.context("C07")?;
        c16_malformed_bodies(&ep.http).await.context("C16")
    }
    .await;
    if let Err(e) = outcome {
        bail!("{e:#}\nprism up stderr:\n{}", up.proc.stderr());
    }
    Ok(())
}
