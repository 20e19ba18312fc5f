//! Structured outputs past llguidance's per-step limits, end to end through one `prism up`
//! serving the bundled model (`models/SmolLM2-135M-Instruct.Q4_1.gguf`, CPU engine):
//!
//! - a JSON schema of 3000 optional properties (its row after `{` holds ~12,000 Earley items,
//!   over `max_items_in_row` = 2000) is a 400 naming `response_format.json_schema.schema` with
//!   llguidance's message, streamed or not, before any token (it was a 200 with `"{"` and
//!   finish reason `abort`);
//! - one whose wide object sits under an optional property passes that check, and fails only
//!   when the model walks into it (`}` banned by `logit_bias`): not streamed a 400 naming the
//!   field, streamed an error event then `[DONE]`; `abort` never reaches the client;
//! - a valid structured request sent alongside succeeds, and the worker ends idle with every
//!   KV block free.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail, ensure};
use prism_tests::metrics::metric_sum;
use prism_tests::{PrismUp, model};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const SERVED: &str = "smollm2";
const PARAM: &str = "response_format.json_schema.schema";

/// An object schema with `n` optional integer properties `f0 … f{n-1}`.
fn wide_object(n: usize) -> Value {
    let props: serde_json::Map<String, Value> = (0..n).map(|i| (format!("f{i}"), json!({"type": "integer"}))).collect();
    json!({"type": "object", "properties": props})
}

fn chat(schema: &Value, extra: Value) -> Value {
    let mut body = json!({
        "model": SERVED,
        "messages": [{"role": "user", "content": "Describe a person as JSON."}],
        "max_tokens": 40,
        "temperature": 0.0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": schema}},
    });
    for (k, v) in extra.as_object().into_iter().flatten() {
        body[k] = v.clone();
    }
    body
}

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    async fn post(&self, body: &Value) -> Result<(u16, String)> {
        let r = self.http.post(format!("{}/v1/chat/completions", self.base)).json(body).send().await?;
        Ok((r.status().as_u16(), r.text().await?))
    }

    /// A 400 naming [`PARAM`] whose message contains `needle`; returns the message.
    async fn refused(&self, body: &Value, needle: &str) -> Result<String> {
        let (status, text) = self.post(body).await?;
        ensure!(status == 400, "wanted 400, got {status}: {text}");
        let v: Value = serde_json::from_str(&text)?;
        let message = v["error"]["message"].as_str().context("message")?.to_owned();
        ensure!(v["error"]["param"] == PARAM, "param: {text}");
        ensure!(v["error"]["type"] == "invalid_request_error", "type: {text}");
        ensure!(message.contains(needle), "message without {needle:?}: {message}");
        ensure!(!message.contains("<non-verbose/>"), "llguidance's marker leaked: {message}");
        Ok(message)
    }
}

/// The `data:` events of an SSE body, `[DONE]` included.
fn sse_events(text: &str) -> Vec<&str> {
    text.split("\n\n").filter_map(|e| e.trim().strip_prefix("data: ")).collect()
}

async fn too_wide_at_the_first_token(api: &Api) -> Result<()> {
    let wide = wide_object(3000);
    let message = api.refused(&chat(&wide, json!({})), "Current row has").await?;
    ensure!(message.starts_with(PARAM), "the message names the field: {message}");
    // Streamed: refused before the stream starts, the same 400.
    api.refused(&chat(&wide, json!({"stream": true})), "Current row has").await?;
    Ok(())
}

async fn too_wide_mid_generation(api: &Api, close_brace: u32) -> Result<()> {
    let nested = json!({"type": "object", "properties": {"details": wide_object(600)}});
    let steer = json!({"logit_bias": {close_brace.to_string(): -100}});
    api.refused(&chat(&nested, steer.clone()), "during generation").await?;
    let (status, text) = api.post(&chat(&nested, json!({"stream": true, "logit_bias": steer["logit_bias"]}))).await?;
    ensure!(status == 200, "streamed: {status} {text}");
    let events = sse_events(&text);
    ensure!(events.last() == Some(&"[DONE]"), "no [DONE]: {text}");
    ensure!(events.len() >= 2, "too few events: {text}");
    let error: Value = serde_json::from_str(events[events.len() - 2])?;
    ensure!(error["error"]["param"] == PARAM, "the last event is the error naming the field: {text}");
    ensure!(!text.contains("\"abort\""), "abort reached the client: {text}");
    Ok(())
}

async fn valid_alongside(api: &Api) -> Result<()> {
    let schema = json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
    });
    let (status, text) = api.post(&chat(&schema, json!({"max_tokens": 60}))).await?;
    ensure!(status == 200, "valid request: {status} {text}");
    let v: Value = serde_json::from_str(&text)?;
    let choice = &v["choices"][0];
    ensure!(choice["finish_reason"] == "stop", "finish: {text}");
    let content: Value = serde_json::from_str(choice["message"]["content"].as_str().context("content")?)?;
    ensure!(content["name"].is_string() && content["age"].is_u64(), "content: {content}");
    Ok(())
}

async fn close_brace_id(api: &Api) -> Result<u32> {
    let body = json!({"model": SERVED, "prompt": "}", "add_special_tokens": false});
    let v: Value = api.http.post(format!("{}/tokenize", api.base)).json(&body).send().await?.json().await?;
    let tokens = v["tokens"].as_array().context("tokens")?;
    ensure!(tokens.len() == 1, "`}}` is one token: {v}");
    Ok(tokens[0].as_u64().context("token id")? as u32)
}

async fn worker_idle(metrics_url: &str) -> Result<()> {
    let t0 = Instant::now();
    loop {
        let body = reqwest::get(metrics_url).await?.text().await?;
        let running = metric_sum(&body, "vllm:num_requests_running").context("running")?;
        let kv = metric_sum(&body, "vllm:kv_cache_usage_perc").context("kv usage")?;
        if running == 0.0 && kv == 0.0 {
            return Ok(());
        }
        if t0.elapsed() > Duration::from_secs(20) {
            bail!("worker not idle: running {running}, kv usage {kv}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemas_past_the_parser_limits_are_400s_and_neighbours_succeed() -> Result<()> {
    let Some(path) = model() else { return Ok(()) };
    let mut up = PrismUp::start(&path, &["--served-model-name", SERVED]).await?;
    let api = Api {
        http: reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?,
        base: up.endpoints.http.clone(),
    };
    let outcome = async {
        let close_brace = close_brace_id(&api).await?;
        let (first, mid, valid) = tokio::join!(
            too_wide_at_the_first_token(&api),
            too_wide_mid_generation(&api, close_brace),
            valid_alongside(&api)
        );
        first.context("too wide at the first token")?;
        mid.context("too wide mid-generation")?;
        valid.context("valid request alongside")?;
        worker_idle(&up.endpoints.worker_metrics).await
    }
    .await;
    if let Err(e) = outcome {
        bail!("{e:#}\nprism up stderr:\n{}", up.proc.stderr());
    }
    up.interrupt(Duration::from_secs(10)).await?;
    Ok(())
}
