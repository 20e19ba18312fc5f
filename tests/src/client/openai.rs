//! The router's OpenAI-compatible HTTP API: JSON requests, SSE streams, `/v1/models`.

use anyhow::{Context, Result, bail};

/// POSTs JSON and returns (status, parsed body).
///
/// # Errors
/// Fails on transport errors or a body that is not JSON.
pub async fn post_json(url: &str, body: &serde_json::Value) -> Result<(u16, serde_json::Value)> {
    let response = reqwest::Client::new().post(url).json(body).send().await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    let json = serde_json::from_str(&text).with_context(|| format!("not JSON ({status}): {text}"))?;
    Ok((status, json))
}

/// POSTs a `stream: true` request and returns the JSON payload of every SSE `data:` event
/// before `[DONE]` (an error if `[DONE]` never comes).
///
/// # Errors
/// Fails on transport errors, a non-200 status, malformed events or a missing `[DONE]`.
pub async fn post_sse(url: &str, body: &serde_json::Value) -> Result<Vec<serde_json::Value>> {
    let response = reqwest::Client::new().post(url).json(body).send().await?;
    let status = response.status().as_u16();
    let text = response.text().await?;
    if status != 200 {
        bail!("stream request got {status}: {text}");
    }
    let mut events = Vec::new();
    for line in text.lines() {
        let Some(data) = line.strip_prefix("data:") else { continue };
        let data = data.trim();
        if data == "[DONE]" {
            return Ok(events);
        }
        events.push(serde_json::from_str(data).with_context(|| format!("bad SSE event {data}"))?);
    }
    bail!("stream ended without data: [DONE]:\n{text}")
}

/// `GET /v1/models` on the router's HTTP base `http` lists exactly `served`.
///
/// # Errors
/// Fails on transport errors or a body without `data`; a different list panics.
pub async fn check_models(http: &str, served: &str) -> Result<()> {
    let models: serde_json::Value = reqwest::get(format!("{http}/v1/models")).await?.json().await?;
    let listed: Vec<&str> =
        models["data"].as_array().context("data")?.iter().filter_map(|m| m["id"].as_str()).collect();
    assert_eq!(listed, [served], "/v1/models: {models}");
    Ok(())
}
