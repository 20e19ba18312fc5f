//! The engine's greedy reference fixture (`tests/fixtures/smollm2_reference.json`, written by
//! the engine's reference script) and a check that a router serves exactly those tokens.

use crate::paths::workspace_root;
use anyhow::{Context, Result, bail};
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{GenerateRequest, SamplingParams, TokenIds, generate_request};

/// One greedy case of the reference fixture.
#[derive(Debug)]
pub struct ReferenceCase {
    /// Prompt token ids.
    pub prompt_ids: Option<Vec<u32>>,
    /// Prompt text.
    pub prompt: Option<String>,
    /// Expected greedy ids.
    pub output_ids: Vec<u32>,
}

fn ids(v: &serde_json::Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok())).collect()
}

/// Reads `tests/fixtures/smollm2_reference.json`. Accepts a top-level array or an object
/// with a `cases`/`prompts` array; each case has `prompt_ids` (or `input_ids`) and/or a text
/// `prompt`/`text`, and `greedy_ids` (or `output_ids`/`generated_ids`/`completion_ids`). The
/// reference does not stop at EOS, so neither does the request (`ignore_eos`).
///
/// # Errors
/// When the file is missing, not JSON, or has no usable case.
pub fn reference_cases() -> Result<Vec<ReferenceCase>> {
    let path = workspace_root().join("tests/fixtures/smollm2_reference.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let doc: serde_json::Value = serde_json::from_str(&text)?;
    let list = doc
        .as_array()
        .or_else(|| ["prompts", "cases"].iter().find_map(|k| doc.get(*k)?.as_array()))
        .context("reference fixture: no list of cases")?;
    let mut cases = Vec::new();
    for case in list {
        let pick = |keys: &[&str]| keys.iter().find_map(|k| case.get(*k).and_then(ids));
        let Some(output_ids) = pick(&["greedy_ids", "output_ids", "generated_ids", "completion_ids"]) else {
            continue;
        };
        cases.push(ReferenceCase {
            prompt_ids: pick(&["prompt_ids", "input_ids", "prompt_token_ids"]),
            prompt: ["prompt", "text"].iter().find_map(|k| case.get(*k)?.as_str()).map(str::to_owned),
            output_ids,
        });
    }
    if cases.is_empty() {
        bail!("reference fixture {} has no usable case", path.display());
    }
    Ok(cases)
}

/// Greedy generations of `served` through the router at `grpc` equal the reference
/// fixture's ids.
///
/// # Errors
/// Fails on a gRPC error; a mismatch panics with both sequences.
pub async fn check_reference_greedy(grpc: &str, served: &str) -> Result<()> {
    let mut client = InferenceServiceClient::connect(grpc.to_owned()).await?;
    for (i, case) in reference_cases()?.into_iter().enumerate() {
        let prompt = match (&case.prompt_ids, &case.prompt) {
            (Some(ids), _) => generate_request::Prompt::TokenIds(TokenIds { ids: ids.clone() }),
            (None, Some(text)) => generate_request::Prompt::Text(text.clone()),
            (None, None) => continue,
        };
        let request = GenerateRequest {
            model: served.into(),
            prompt: Some(prompt),
            sampling: Some(SamplingParams {
                temperature: Some(0.0),
                max_tokens: Some(i64::try_from(case.output_ids.len())?),
                ignore_eos: true,
                skip_special_tokens: Some(true),
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
