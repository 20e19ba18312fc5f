//! Batched prompts on `/v1/completions` (`"prompt": ["A", "B"]`, or token-id lists), end to
//! end through one `prism up` serving the bundled model with a 256-token context:
//!
//! - greedy outputs of a batch equal, token for token, those of one request per prompt, with
//!   choices indexed `prompt_index * n + j` in order and usage summed over the prompts; the
//!   same with token-id lists, with `n: 2`, and streamed with `include_usage` (chunks carry
//!   their batch index, one usage chunk, one `[DONE]`);
//! - a prompt over the context at index 1 is a 400 naming `prompt[1]`, and nothing is
//!   dispatched.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use prism_tests::{PrismUp, metric_sum, model};
use serde_json::{Value, json};

const MODEL: &str = "SmolLM2-135M-Instruct";
const PROMPTS: [&str; 2] = ["The capital of France is", "Once upon a time, in a small village,"];
const MAX_MODEL_LEN: usize = 256;

struct Api {
    http: reqwest::Client,
    base: String,
}

impl Api {
    async fn post(&self, body: &Value) -> Result<(u16, Value)> {
        let r = self.http.post(format!("{}/v1/completions", self.base)).json(body).send().await?;
        let status = r.status().as_u16();
        Ok((status, r.json().await?))
    }

    async fn ok(&self, body: &Value) -> Result<Value> {
        let (status, v) = self.post(body).await?;
        ensure!(status == 200, "{body}: {status} {v}");
        Ok(v)
    }

    /// Every `data:` event of a streamed answer, `[DONE]` included as a string.
    async fn stream(&self, body: &Value) -> Result<Vec<Value>> {
        let r = self.http.post(format!("{}/v1/completions", self.base)).json(body).send().await?;
        ensure!(r.status().as_u16() == 200, "stream {body}: {}", r.status());
        let text = r.text().await?;
        let events = text.split("\n\n").filter_map(|e| e.strip_prefix("data: "));
        events.map(|e| if e == "[DONE]" { Ok(json!("[DONE]")) } else { Ok(serde_json::from_str(e)?) }).collect()
    }

    /// Replicas dispatched to so far (the router's count, every replica).
    async fn dispatches(&self) -> Result<f64> {
        let body = self.http.get(format!("{}/metrics", self.base)).send().await?.text().await?;
        Ok(metric_sum(&body, "prism_router_replica_dispatches_total").unwrap_or(0.0))
    }
}

fn completion(prompt: Value, extra: Value) -> Value {
    let mut v = json!({"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": true,
                       "logprobs": 1});
    for (k, x) in extra.as_object().into_iter().flatten() {
        v[k] = x.clone();
    }
    v
}

/// `(index, text, generated tokens)` of every choice, in the order given.
fn choices(v: &Value) -> Vec<(u64, String, Value)> {
    v["choices"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            (
                c["index"].as_u64().unwrap_or(u64::MAX),
                c["text"].as_str().unwrap_or("").to_owned(),
                c["logprobs"]["tokens"].clone(),
            )
        })
        .collect()
}

fn usage(v: &Value) -> (u64, u64) {
    (v["usage"]["prompt_tokens"].as_u64().unwrap_or(0), v["usage"]["completion_tokens"].as_u64().unwrap_or(0))
}

/// Greedy batch == one request per prompt, token for token; indexes `p * n + j`; usage summed.
async fn batch_equals_single_requests(api: &Api) -> Result<()> {
    let mut singles = Vec::new();
    for p in PROMPTS {
        singles.push(api.ok(&completion(json!(p), json!({}))).await?);
    }
    let batch = api.ok(&completion(json!(PROMPTS), json!({}))).await?;
    let got = choices(&batch);
    ensure!(got.len() == 2, "{batch}");
    for (p, single) in singles.iter().enumerate() {
        let (_, text, tokens) = &choices(single)[0];
        assert_eq!(got[p].0, p as u64, "{batch}");
        assert_eq!((&got[p].1, &got[p].2), (text, tokens), "prompt {p}: batch {batch} vs single {single}");
    }
    let summed = singles.iter().map(usage).fold((0, 0), |a, u| (a.0 + u.0, a.1 + u.1));
    assert_eq!(usage(&batch), summed, "{batch}");
    assert_eq!(batch["usage"]["total_tokens"].as_u64(), Some(summed.0 + summed.1));

    // The same prompts as token-id lists (the ids the router's /tokenize gives).
    let mut lists = Vec::new();
    for p in PROMPTS {
        let r = api.http.post(format!("{}/tokenize", api.base)).json(&json!({"model": MODEL, "prompt": p}));
        let v: Value = r.send().await?.json().await?;
        ensure!(v["tokens"].is_array(), "{v}");
        lists.push(v["tokens"].clone());
    }
    let by_ids = api.ok(&completion(json!(lists), json!({}))).await?;
    assert_eq!(choices(&by_ids), got, "id lists: {by_ids}");
    assert_eq!(usage(&by_ids), summed);

    // n = 2: choices 0, 1 of prompt 0, then 2, 3 of prompt 1 (greedy: both equal).
    let two = api.ok(&completion(json!(PROMPTS), json!({"n": 2}))).await?;
    let c = choices(&two);
    assert_eq!(c.iter().map(|c| c.0).collect::<Vec<_>>(), vec![0, 1, 2, 3], "{two}");
    for (i, (_, text, _)) in c.iter().enumerate() {
        assert_eq!(text, &got[i / 2].1, "choice {i}: {two}");
    }
    assert_eq!(usage(&two), (summed.0, summed.1 * 2), "{two}");
    Ok(())
}

/// Streamed with `include_usage`: each chunk's choice carries its batch index, the texts
/// joined per index are the whole answer's, one usage chunk, one `[DONE]`, last.
async fn streamed_batch(api: &Api) -> Result<()> {
    let whole = api.ok(&completion(json!(PROMPTS), json!({"n": 2}))).await?;
    let body = completion(json!(PROMPTS), json!({"n": 2, "stream": true, "stream_options": {"include_usage": true}}));
    let events = api.stream(&body).await?;
    ensure!(events.last() == Some(&json!("[DONE]")), "{events:?}");
    ensure!(events.iter().filter(|e| **e == json!("[DONE]")).count() == 1, "{events:?}");
    let chunks = &events[..events.len() - 1];
    let mut texts: BTreeMap<u64, String> = BTreeMap::new();
    let mut finished = 0;
    let mut usage_chunks = Vec::new();
    for c in chunks {
        ensure!(c["id"] == chunks[0]["id"], "one id for the batch: {c}");
        if c["usage"].is_object() {
            usage_chunks.push(c.clone());
            continue;
        }
        for ch in c["choices"].as_array().into_iter().flatten() {
            let i = ch["index"].as_u64().context("index")?;
            texts.entry(i).or_default().push_str(ch["text"].as_str().unwrap_or(""));
            finished += usize::from(ch["finish_reason"].is_string());
        }
    }
    let wanted: BTreeMap<u64, String> = choices(&whole).into_iter().map(|(i, t, _)| (i, t)).collect();
    assert_eq!(texts, wanted);
    assert_eq!(finished, 4, "each choice finishes once");
    ensure!(usage_chunks.len() == 1, "{usage_chunks:?}");
    assert_eq!(usage(&usage_chunks[0]), usage(&whole));
    assert!(chunks.last().is_some_and(|c| c["usage"].is_object()), "the usage chunk comes last");
    Ok(())
}

/// A prompt over the context at index 1: 400 naming `prompt[1]`, nothing dispatched.
async fn over_long_prompt_is_refused_before_dispatch(api: &Api) -> Result<()> {
    let before = api.dispatches().await?;
    let too_long = "hello ".repeat(MAX_MODEL_LEN + 1);
    let (status, v) = api.post(&completion(json!([PROMPTS[0], too_long]), json!({}))).await?;
    ensure!(status == 400 && v["error"]["param"] == "prompt", "{status} {v}");
    let message = v["error"]["message"].as_str().unwrap_or("");
    ensure!(message.starts_with("prompt[1]: ") && message.contains("maximum context length"), "{v}");
    // Streamed too: refused before the stream starts.
    let r = api
        .http
        .post(format!("{}/v1/completions", api.base))
        .json(&completion(json!([too_long, PROMPTS[0]]), json!({"stream": true})))
        .send()
        .await?;
    ensure!(r.status().as_u16() == 400, "streamed: {}", r.status());
    let v: Value = r.json().await?;
    ensure!(v["error"]["message"].as_str().is_some_and(|m| m.starts_with("prompt[0]: ")), "{v}");
    assert_eq!(api.dispatches().await?, before, "nothing was dispatched");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_completion_prompts_match_single_requests() -> Result<()> {
    let Some(path) = model() else { return Ok(()) };
    let len = MAX_MODEL_LEN.to_string();
    let mut up = PrismUp::start(&path, &["--max-model-len", &len]).await?;
    let api = Api {
        http: reqwest::Client::builder().timeout(Duration::from_secs(120)).build()?,
        base: up.endpoints.http.clone(),
    };
    let outcome = async {
        batch_equals_single_requests(&api).await.context("batch vs single")?;
        streamed_batch(&api).await.context("streamed")?;
        over_long_prompt_is_refused_before_dispatch(&api).await.context("over-long prompt")
    }
    .await;
    if let Err(e) = outcome {
        bail!("{e:#}\nprism up stderr:\n{}", up.proc.stderr());
    }
    up.interrupt(Duration::from_secs(10)).await?;
    Ok(())
}
