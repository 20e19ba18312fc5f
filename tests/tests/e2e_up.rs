//! End to end through `prism up` (issue 5): one `prism up` child process on free ports
//! serving the bundled model. Checks `/v1/models`, greedy tokens against the reference
//! fixture, streamed vs non-streamed chat, "capital of France" → Paris, the CLI's
//! `generate` and `status`, and that SIGINT exits 0 within 10 s leaving no process behind.
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

mod e2e_support;

use anyhow::{Context, Result, bail};
use e2e_support::{PrismUp, model, post_json, post_sse, prism_cli, workspace_root};
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{GenerateRequest, SamplingParams, TokenIds, generate_request::Prompt};
use serde_json::{Value, json};
use std::time::Duration;

const SERVED: &str = "SmolLM2-135M-Instruct";

/// One greedy case of the engine's reference fixture.
#[derive(Debug)]
struct ReferenceCase {
    prompt_ids: Option<Vec<u32>>,
    prompt: Option<String>,
    output_ids: Vec<u32>,
}

fn ids(v: &Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

/// Reads `tests/fixtures/smollm2_reference.json` (written by the engine's reference script).
/// Accepts a top-level array or an object with a `cases`/`prompts` array; each case has
/// `prompt_ids` (or `input_ids`) and/or a text `prompt`, and `output_ids` (or
/// `generated_ids`/`completion_ids`).
fn reference_cases() -> Result<Vec<ReferenceCase>> {
    let path = workspace_root().join("tests/fixtures/smollm2_reference.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let doc: Value = serde_json::from_str(&text)?;
    let list = doc
        .as_array()
        .or_else(|| ["cases", "prompts", "greedy"].iter().find_map(|k| doc.get(*k)?.as_array()))
        .context("reference fixture: no list of cases")?;
    let mut cases = Vec::new();
    for case in list {
        let pick = |keys: &[&str]| keys.iter().find_map(|k| case.get(*k).and_then(ids));
        let Some(output_ids) = pick(&["output_ids", "generated_ids", "completion_ids", "expected_ids"]) else {
            continue;
        };
        cases.push(ReferenceCase {
            prompt_ids: pick(&["prompt_ids", "input_ids", "prompt_token_ids"]),
            prompt: case.get("prompt").and_then(Value::as_str).map(str::to_owned),
            output_ids,
        });
    }
    if cases.is_empty() {
        bail!("reference fixture {} has no usable case", path.display());
    }
    Ok(cases)
}

async fn check_models(http: &str) -> Result<()> {
    let models: Value = reqwest::get(format!("{http}/v1/models")).await?.json().await?;
    let listed: Vec<&str> =
        models["data"].as_array().context("data")?.iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(listed, [SERVED], "/v1/models: {models}");
    Ok(())
}

async fn check_reference_greedy(grpc: &str) -> Result<()> {
    let mut client = InferenceServiceClient::connect(grpc.to_owned()).await?;
    for (i, case) in reference_cases()?.into_iter().enumerate() {
        let prompt = match (&case.prompt_ids, &case.prompt) {
            (Some(ids), _) => Prompt::TokenIds(TokenIds { ids: ids.clone() }),
            (None, Some(text)) => Prompt::Text(text.clone()),
            (None, None) => continue,
        };
        let request = GenerateRequest {
            model: SERVED.into(),
            prompt: Some(prompt),
            sampling: Some(SamplingParams {
                temperature: Some(0.0),
                max_tokens: Some(i64::try_from(case.output_ids.len())?),
                skip_special_tokens: true,
                ..SamplingParams::default()
            }),
            ..GenerateRequest::default()
        };
        let mut stream = client.generate(request).await?.into_inner();
        let mut got = Vec::new();
        while let Some(message) = stream.message().await? {
            got.extend(message.token_ids);
        }
        assert_eq!(got, case.output_ids, "reference case {i} ({:?})", case.prompt);
    }
    Ok(())
}

fn chat_body(question: &str, stream: bool) -> Value {
    json!({
        "model": SERVED,
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,
        "max_tokens": 48,
        "stream": stream,
    })
}

async fn check_stream_matches_non_stream(http: &str) -> Result<()> {
    let url = format!("{http}/v1/chat/completions");
    let question = "Name three colours of the rainbow.";
    let (status, whole) = post_json(&url, &chat_body(question, false)).await?;
    assert_eq!(status, 200, "{whole}");
    let text = whole["choices"][0]["message"]["content"].as_str().context("content")?.to_owned();
    assert!(!text.is_empty());
    let events = post_sse(&url, &chat_body(question, true)).await?;
    let joined: String = events
        .iter()
        .filter_map(|e| e["choices"].get(0)?.get("delta")?.get("content")?.as_str().map(str::to_owned))
        .collect();
    assert_eq!(joined, text, "streamed deltas differ from the non-streamed answer");
    let finish = events.iter().filter_map(|e| e["choices"].get(0)?.get("finish_reason")?.as_str()).last();
    assert_eq!(finish, whole["choices"][0]["finish_reason"].as_str());
    Ok(())
}

async fn check_paris(http: &str) -> Result<()> {
    let url = format!("{http}/v1/chat/completions");
    let (status, body) = post_json(&url, &chat_body("What is the capital of France?", false)).await?;
    assert_eq!(status, 200, "{body}");
    let answer = body["choices"][0]["message"]["content"].as_str().context("content")?;
    assert!(answer.contains("Paris"), "answer: {answer}");
    assert!(body["usage"]["completion_tokens"].as_u64().is_some_and(|n| n > 0), "{body}");
    Ok(())
}

fn check_cli(up: &PrismUp) -> Result<()> {
    let ep = &up.endpoints;
    let answer = prism_cli(&[
        "--router",
        &ep.grpc,
        "generate",
        "What is the capital of France?",
        "--temperature",
        "0",
        "--max-tokens",
        "48",
    ])?;
    assert!(answer.contains("Paris"), "prism generate: {answer}");
    let status = prism_cli(&["--head", &ep.head, "status"])?;
    assert!(status.contains("Nodes (1):"), "{status}");
    assert!(status.contains("Replicas (1):"), "{status}");
    let replica = status
        .lines()
        .find(|l| l.starts_with("smollm2-135m-instruct-"))
        .with_context(|| format!("no replica line:\n{status}"))?;
    assert!(replica.split_whitespace().any(|c| c == "Ready"), "{replica}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prism_up_serves_the_model_end_to_end_and_stops_on_sigint() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let up = tokio::task::spawn_blocking(move || PrismUp::start(&model, &[])).await??;
    let ep = up.endpoints.clone();

    let checks = async {
        check_models(&ep.http).await.context("/v1/models")?;
        check_reference_greedy(&ep.grpc).await.context("greedy reference")?;
        check_stream_matches_non_stream(&ep.http).await.context("stream vs non-stream")?;
        check_paris(&ep.http).await.context("Paris")?;
        anyhow::Ok(())
    };
    if let Err(e) = checks.await {
        bail!("{e:#}\nprism up stderr:\n{}", up.proc.stderr());
    }
    let up = tokio::task::spawn_blocking(move || check_cli(&up).map(|()| up)).await??;

    let mut up = up;
    let took = tokio::task::spawn_blocking(move || up.interrupt(Duration::from_secs(10))).await??;
    assert!(took < Duration::from_secs(10), "SIGINT to exit took {took:?}");
    // The ports are closed once it has exited.
    assert!(reqwest::get(format!("{}/v1/models", ep.http)).await.is_err());
    Ok(())
}
