//! End to end through `prism up`: one `prism up` child process on free ports
//! serving the bundled model. Checks `/v1/models` (with the engine's max_model_len), greedy tokens against the reference
//! fixture, streamed vs non-streamed chat, "capital of France" → Paris, the CLI's
//! `generate` and `status`, and that SIGINT exits 0 within 10 s leaving no process behind.
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_tests::{PrismUp, check_models, check_reference_greedy, model, post_json, post_sse, prism_cli};
use serde_json::{Value, json};
use std::time::Duration;

const SERVED: &str = "SmolLM2-135M-Instruct";

/// The context length `prism up` serves the bundled model with when no `--max-model-len` is
/// given, as vLLM reports it: the model's own (GGUF `llama.context_length` = 8192) capped to
/// what the CPU KV cache holds — `prism up`'s 256 MiB budget in 16-token blocks of 30 layers
/// · K and V · 3 KV heads · 64 dims · 4 bytes (f32) = 46 080 bytes per token: 364 blocks.
const SERVED_MAX_MODEL_LEN: u64 = {
    let bytes_per_block: u64 = 16 * 30 * 2 * 3 * 64 * 4;
    let capacity = (256 << 20) / bytes_per_block * 16;
    if capacity < 8192 { capacity } else { 8192 }
};

/// `/v1/models` shows the engine's effective context length although the deployment set none
/// (it travels worker status → replica record → route table → router).
async fn check_max_model_len(http: &str) -> Result<()> {
    let models: Value = reqwest::get(format!("{http}/v1/models")).await?.json().await?;
    assert_eq!(models["data"][0]["max_model_len"].as_u64(), Some(SERVED_MAX_MODEL_LEN), "/v1/models: {models}");
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
    let finish = events.iter().filter_map(|e| e["choices"].get(0)?.get("finish_reason")?.as_str()).next_back();
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
    let up = PrismUp::start(&model, &[]).await?;
    let ep = up.endpoints.clone();

    let checks = async {
        check_models(&ep.http, SERVED).await.context("/v1/models")?;
        check_max_model_len(&ep.http).await.context("/v1/models max_model_len")?;
        check_reference_greedy(&ep.grpc, SERVED).await.context("greedy reference")?;
        check_stream_matches_non_stream(&ep.http).await.context("stream vs non-stream")?;
        check_paris(&ep.http).await.context("Paris")?;
        anyhow::Ok(())
    };
    if let Err(e) = checks.await {
        bail!("{e:#}\nprism up stderr:\n{}", up.proc.stderr());
    }
    let up = tokio::task::spawn_blocking(move || check_cli(&up).map(|()| up)).await??;

    let mut up = up;
    let took = up.interrupt(Duration::from_secs(10)).await?;
    assert!(took < Duration::from_secs(10), "SIGINT to exit took {took:?}");
    // The ports are closed once it has exited.
    assert!(reqwest::get(format!("{}/v1/models", ep.http)).await.is_err());
    Ok(())
}
