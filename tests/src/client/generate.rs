//! Greedy streaming requests through the router's gRPC API (`InferenceService.Generate`)
//! with their tokens, usage and inter-token gaps, and the router's view of the routes
//! (`ListModels`).

use anyhow::{Result, bail};
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{
    FinishReason, GenerateRequest, ListModelsRequest, SamplingParams, TokenIds, generate_request,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Served model name that [`crate::Deployment::new`] gives the bundled model.
pub const SERVED: &str = "smollm2";

/// Short prompts (token ids of the reference fixture's tokenizer cases).
pub const PROMPTS: &[&[u32]] = &[
    &[19556, 28, 905, 17],
    &[504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30],
    &[2899, 1898],
    &[256, 1296, 2899, 5600, 284, 35079, 333],
];

/// What one streaming request returned.
#[derive(Clone, Debug, Default)]
pub struct StreamResult {
    /// Every token id, in order.
    pub tokens: Vec<u32>,
    /// Largest gap between two messages carrying tokens.
    pub max_gap: Duration,
    /// When the largest gap ended.
    pub max_gap_at: Option<Instant>,
    /// When the request started.
    pub started: Option<Instant>,
    /// When the last message arrived.
    pub ended: Option<Instant>,
    /// Final finish reason (`FinishReason` as i32).
    pub finish: i32,
    /// Completion tokens from `usage`.
    pub completion_tokens: u32,
    /// Prompt tokens from `usage`.
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache, from `usage`.
    pub cached_tokens: u32,
}

/// A greedy request to [`SERVED`] for `prompt` (token ids) and `max_tokens`, stopping at
/// EOS unless `ignore_eos`.
pub fn greedy_request(prompt: &[u32], max_tokens: u32, ignore_eos: bool) -> GenerateRequest {
    GenerateRequest {
        model: SERVED.into(),
        prompt: Some(generate_request::Prompt::TokenIds(TokenIds { ids: prompt.to_vec() })),
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(i64::from(max_tokens)),
            ignore_eos,
            skip_special_tokens: Some(true),
            ..SamplingParams::default()
        }),
        ..GenerateRequest::default()
    }
}

/// Streams `req` through the router's gRPC API at `grpc` and records the tokens and gaps.
///
/// # Errors
/// Any gRPC error (a client-visible failure; the `tonic::Status` can be downcast).
pub async fn stream(grpc: &str, req: GenerateRequest) -> Result<StreamResult> {
    stream_counted(grpc, req, &AtomicUsize::new(0)).await
}

/// [`stream`], adding every token received to `received` as it arrives (so a test can act
/// mid-stream, once each stream has tokens).
///
/// # Errors
/// Any gRPC error (a client-visible failure; the `tonic::Status` can be downcast).
pub async fn stream_counted(grpc: &str, req: GenerateRequest, received: &AtomicUsize) -> Result<StreamResult> {
    let mut c = InferenceServiceClient::connect(grpc.to_owned()).await?;
    let started = Instant::now();
    let mut out = StreamResult { started: Some(started), ..StreamResult::default() };
    let mut s = c.generate(req).await?.into_inner();
    let mut last = started;
    let mut first = true;
    while let Some(m) = s.message().await? {
        let now = Instant::now();
        if !m.token_ids.is_empty() {
            if !first && now - last > out.max_gap {
                out.max_gap = now - last;
                out.max_gap_at = Some(now);
            }
            first = false;
            last = now;
            out.tokens.extend_from_slice(&m.token_ids);
            received.fetch_add(m.token_ids.len(), Ordering::SeqCst);
        }
        if m.finish_reason != FinishReason::Unspecified as i32 {
            out.finish = m.finish_reason;
        }
        if let Some(u) = m.usage {
            out.completion_tokens = u.completion_tokens;
            out.prompt_tokens = u.prompt_tokens;
            out.cached_tokens = u.cached_tokens;
        }
        out.ended = Some(now);
    }
    Ok(out)
}

/// Undisturbed greedy outputs of every prompt in [`PROMPTS`] (`max_tokens`, EOS ignored),
/// one concurrent request per prompt.
///
/// # Errors
/// Any request failure, or a run that gave fewer than `max_tokens` tokens.
pub async fn reference(grpc: &str, max_tokens: u32) -> Result<Vec<Vec<u32>>> {
    let runs = PROMPTS.iter().map(|p| stream(grpc, greedy_request(p, max_tokens, true)));
    let mut out = Vec::new();
    for r in futures::future::join_all(runs).await {
        let r = r?;
        if r.tokens.len() != max_tokens as usize {
            bail!("reference run gave {} tokens, expected {max_tokens}", r.tokens.len());
        }
        out.push(r.tokens);
    }
    Ok(out)
}

/// Ready replicas of `model` according to the router at `grpc` (`ListModels`).
///
/// # Errors
/// When the router does not answer.
pub async fn router_ready_replicas(grpc: &str, model: &str) -> Result<u32> {
    let mut c = InferenceServiceClient::connect(grpc.to_owned()).await?;
    let models = c.list_models(ListModelsRequest {}).await?.into_inner().models;
    Ok(models.iter().find(|m| m.id == model).map_or(0, |m| m.ready_replicas))
}

/// Polls the router every 2 ms until its ready replica count of `model` differs from
/// `from`; returns when that was seen.
///
/// # Errors
/// When the router does not answer, or on timeout.
pub async fn wait_route_change(grpc: &str, model: &str, from: u32, timeout: Duration) -> Result<Instant> {
    let mut c = InferenceServiceClient::connect(grpc.to_owned()).await?;
    let deadline = Instant::now() + timeout;
    loop {
        let models = c.list_models(ListModelsRequest {}).await?.into_inner().models;
        let n = models.iter().find(|m| m.id == model).map_or(0, |m| m.ready_replicas);
        if n != from {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            bail!("router still lists {from} ready replicas after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}
