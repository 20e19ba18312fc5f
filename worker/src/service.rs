//! `WorkerService` (gRPC): `Generate` streams a hosted replica's engine outputs through a
//! bounded mpsc + `ReceiverStream` (a failed send means the client left: the engine stream
//! is dropped, which aborts the request); `Drain`; `Health`; `GetPromptCodec` and
//! `WatchPrefixCache` for cache-aware routers (`prefix_cache.rs`). Proto ↔ engine conversion
//! and the one mapping of [`EngineError`] to `tonic::Status` live here.
//!
//! `GetPromptCodec(replica_id)`: NOT_FOUND for a replica not hosted here, UNAVAILABLE while
//! its engine is not loaded, FAILED_PRECONDITION when its codec cannot be exported (route by
//! load alone); built once per replica and kept. `Generate` uses `prompt_token_ids` instead
//! of tokenizing only when `codec_fingerprint` equals that codec's fingerprint (the engine
//! still validates the ids); otherwise it ignores them and tokenizes the prompt.

mod prefix_cache;

use crate::agent::replica::{CodecRefusal, Refusal, Replica, ReplicaLoadGuard, ReplicaOutputStream};
use crate::agent::{Agent, DrainSource};
use crate::metrics::WorkerMetrics;
use futures::StreamExt;
use prism_common::RequestId;
use prism_common::proto::v1::{self as pb, worker_service_server::WorkerService};
use prism_engine::{
    ChatMessage, EngineError, EngineOutput, EngineRequest, FinishReason, Prompt, SamplingParams, StructuredOutput,
    TokenLogprob, ToolCall,
};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

/// Responses buffered per stream before the engine output waits for the client.
const STREAM_BUFFER: usize = 32;

/// Maps an engine error to a gRPC status (the one place that does).
pub fn engine_error_to_status(e: &EngineError) -> Status {
    match e {
        EngineError::InvalidRequest { field, message } => {
            let mut s = if message.contains(field) {
                Status::invalid_argument(message.clone())
            } else {
                Status::invalid_argument(format!("{field}: {message}"))
            };
            // The router names the field in its OpenAI error object (`param`).
            if let Ok(v) = tonic::metadata::MetadataValue::try_from(*field) {
                s.metadata_mut().insert("prism-param", v);
            }
            s
        }
        EngineError::Overloaded(m) => Status::resource_exhausted(format!("engine overloaded: {m}")),
        EngineError::Unavailable(m) => Status::unavailable(format!("engine unavailable: {m}")),
        EngineError::Internal(m) => Status::internal(format!("engine internal error: {m}")),
    }
}

/// Converts proto sampling parameters; unset fields take [`SamplingParams::default`].
pub fn sampling_from_proto(p: Option<pb::SamplingParams>) -> SamplingParams {
    let d = SamplingParams::default();
    let Some(p) = p else { return d };
    SamplingParams {
        temperature: p.temperature.unwrap_or(d.temperature),
        top_p: p.top_p.unwrap_or(d.top_p),
        top_k: p.top_k.unwrap_or(d.top_k),
        min_p: p.min_p.unwrap_or(d.min_p),
        seed: p.seed,
        repetition_penalty: p.repetition_penalty.unwrap_or(d.repetition_penalty),
        frequency_penalty: p.frequency_penalty.unwrap_or(d.frequency_penalty),
        presence_penalty: p.presence_penalty.unwrap_or(d.presence_penalty),
        stop: p.stop,
        stop_token_ids: p.stop_token_ids,
        max_tokens: p.max_tokens,
        ignore_eos: p.ignore_eos,
        n: p.n.unwrap_or(d.n),
        logprobs: p.logprobs,
        skip_special_tokens: p.skip_special_tokens.unwrap_or(d.skip_special_tokens),
        logit_bias: {
            let mut bias: Vec<(u32, f32)> = p.logit_bias.into_iter().collect();
            bias.sort_unstable_by_key(|(t, _)| *t);
            bias
        },
        min_tokens: p.min_tokens.unwrap_or(d.min_tokens),
        include_stop_str_in_output: p.include_stop_str_in_output,
        structured: p.structured_output.and_then(|s| s.constraint).map(structured_from_proto),
    }
}

fn structured_from_proto(c: pb::structured_output::Constraint) -> StructuredOutput {
    use pb::structured_output::Constraint;
    match c {
        Constraint::JsonSchema(s) => StructuredOutput::JsonSchema(s),
        Constraint::JsonObject(_) => StructuredOutput::JsonObject,
        Constraint::Regex(r) => StructuredOutput::Regex(r),
        Constraint::Choice(c) => StructuredOutput::Choice(c.choices),
        Constraint::Grammar(g) => StructuredOutput::Grammar(g),
    }
}

fn chat_message_from_proto(m: pb::ChatMessage) -> ChatMessage {
    ChatMessage {
        role: m.role,
        content: m.content,
        tool_calls: m
            .tool_calls
            .into_iter()
            .map(|c| ToolCall { id: c.id, name: c.name, arguments: c.arguments })
            .collect(),
        tool_call_id: m.tool_call_id,
        name: m.name,
    }
}

/// Converts a worker generate request into an engine request; `now` anchors the deadline.
/// `codec_fingerprint` is the replica's prompt-codec fingerprint (`None`: unknown or not
/// exportable): the router's `prompt_token_ids` replace the prompt only when the request's
/// `codec_fingerprint` equals it (non-zero), since only then are they the ids the engine
/// would compute.
///
/// # Errors
/// `INVALID_ARGUMENT` when the request has no prompt.
pub fn engine_request_from_proto(
    r: pb::WorkerGenerateRequest,
    now: Instant,
    codec_fingerprint: Option<u64>,
) -> Result<EngineRequest, Status> {
    let req = r.request.ok_or_else(|| Status::invalid_argument("request: missing"))?;
    let use_ids =
        !r.prompt_token_ids.is_empty() && r.codec_fingerprint != 0 && codec_fingerprint == Some(r.codec_fingerprint);
    if !r.prompt_token_ids.is_empty() && !use_ids {
        tracing::debug!(sent = r.codec_fingerprint, ours = ?codec_fingerprint, "codec fingerprint mismatch: tokenizing the prompt");
    }
    let prompt = match req.prompt {
        _ if use_ids => Prompt::TokenIds(r.prompt_token_ids),
        Some(pb::generate_request::Prompt::Text(t)) => Prompt::Text(t),
        Some(pb::generate_request::Prompt::TokenIds(t)) => Prompt::TokenIds(t.ids),
        Some(pb::generate_request::Prompt::Chat(c)) => {
            Prompt::Chat(c.messages.into_iter().map(chat_message_from_proto).collect())
        }
        None => return Err(Status::invalid_argument("prompt: missing (text, token_ids or chat)")),
    };
    let id = if req.request_id.is_empty() { RequestId::random() } else { RequestId(req.request_id) };
    let deadline = req.timeout_ms.filter(|ms| *ms > 0).map(|ms| now + Duration::from_millis(ms));
    Ok(EngineRequest {
        id,
        prompt,
        params: sampling_from_proto(req.sampling),
        prior_output_ids: r.prior_output_ids,
        deadline,
        cache_salt: req.cache_salt,
        tools: Some(req.tools_json).filter(|t| !t.is_empty()),
        chat_template_kwargs: Some(req.chat_template_kwargs_json).filter(|k| !k.is_empty()),
    })
}

/// Proto finish reason.
pub fn finish_reason_to_proto(f: Option<FinishReason>) -> pb::FinishReason {
    match f {
        None => pb::FinishReason::Unspecified,
        Some(FinishReason::Stop) => pb::FinishReason::Stop,
        Some(FinishReason::Length) => pb::FinishReason::Length,
        Some(FinishReason::Abort) => pb::FinishReason::Abort,
    }
}

fn logprob_to_proto(l: TokenLogprob) -> pb::TokenLogprob {
    pb::TokenLogprob {
        token_id: l.token_id,
        token: l.token,
        logprob: l.logprob,
        bytes: l.bytes,
        top_logprobs: l
            .top_logprobs
            .into_iter()
            .map(|t| pb::TopLogprob { token_id: t.token_id, token: t.token, logprob: t.logprob, bytes: t.bytes })
            .collect(),
    }
}

/// Converts one engine output. Token counts are the engine's own (`usage.prompt_tokens` is
/// the output's `prompt_tokens`); for a request that continues a migrated stream
/// (`prior_output_ids`) they describe this attempt, and the router rewrites them into the
/// client's view of the whole request.
pub fn output_to_proto(request_id: &str, o: EngineOutput) -> pb::GenerateResponse {
    let prompt_tokens = o.prompt_tokens;
    pb::GenerateResponse {
        request_id: request_id.to_owned(),
        index: o.index,
        token_ids: o.token_ids,
        text: o.text,
        logprobs: o.logprobs.into_iter().map(logprob_to_proto).collect(),
        finish_reason: finish_reason_to_proto(o.finish_reason) as i32,
        usage: o.usage.map(|u| pb::Usage {
            prompt_tokens,
            completion_tokens: u.completion_tokens,
            cached_tokens: u.cached_tokens,
        }),
        prompt_tokens,
        tool_calls: Vec::new(),
    }
}

/// The gRPC service.
#[derive(Clone)]
pub struct WorkerGrpc {
    agent: Arc<Agent>,
    metrics: Arc<WorkerMetrics>,
    /// Ends the long-lived `WatchPrefixCache` streams when the worker stops serving.
    stop: CancellationToken,
}

impl WorkerGrpc {
    /// A service over `agent`.
    pub fn new(agent: Arc<Agent>, metrics: Arc<WorkerMetrics>) -> Self {
        Self { agent, metrics, stop: CancellationToken::new() }
    }

    /// Ends watch streams when `stop` is cancelled (so a graceful server shutdown does not
    /// wait on them).
    #[must_use]
    pub fn with_stop(mut self, stop: CancellationToken) -> Self {
        self.stop = stop;
        self
    }

    fn replica(&self, id: &str) -> Result<Arc<Replica>, Status> {
        self.agent
            .replicas()
            .get(id)
            .ok_or_else(|| Status::not_found(format!("replica {id} is not hosted on this worker")))
    }
}

/// The replica's prompt codec, built off the async threads the first time.
async fn prompt_codec(replica: &Arc<Replica>) -> Result<Arc<pb::PromptCodec>, CodecRefusal> {
    if let Some(built) = replica.cached_prompt_codec() {
        return built.ok_or(CodecRefusal::NotExportable);
    }
    let r = Arc::clone(replica);
    tokio::task::spawn_blocking(move || r.prompt_codec()).await.unwrap_or(Err(CodecRefusal::NotExportable))
}

type GenerateStream = ReceiverStream<Result<pb::GenerateResponse, Status>>;

/// Moves engine outputs to the client and records metrics; ends with UNAVAILABLE when the
/// replica aborts its remaining requests (drain/stop deadline), so the router migrates, and
/// with the engine's error when a choice failed (a grammar past llguidance's limits:
/// INVALID_ARGUMENT naming `structured_output.*`, which the router neither migrates nor retries).
async fn forward(
    mut outputs: ReplicaOutputStream,
    tx: mpsc::Sender<Result<pb::GenerateResponse, Status>>,
    mut guard: ReplicaLoadGuard,
    metrics: Arc<WorkerMetrics>,
    request_id: String,
    arrived: Instant,
) {
    let replica = Arc::clone(guard.replica());
    let model = replica.model_name.clone();
    let mut last_token_at: Option<Instant> = None;
    let mut generated: u64 = 0;
    let mut prompt_tokens: u64 = 0;
    let mut finish: Option<FinishReason> = None;
    loop {
        let next = tokio::select! {
            o = outputs.next() => o,
            _ = replica.abort.cancelled() => {
                let _ = tx.send(Err(Status::unavailable("replica stopped: request handed back for migration"))).await;
                tracing::debug!(request = %request_id, "aborted by replica stop");
                finish = None;
                break;
            }
            _ = tx.closed() => {
                tracing::debug!(request = %request_id, "client left: aborting");
                finish = None;
                break;
            }
        };
        let Some(o) = next else { break };
        if prompt_tokens == 0 && o.prompt_tokens > 0 {
            prompt_tokens = u64::from(o.prompt_tokens);
            guard.add_tokens(prompt_tokens);
        }
        let n = o.token_ids.len() as u64;
        if n > 0 {
            let now = Instant::now();
            match last_token_at {
                None => metrics.observe_ttft(&model, now.duration_since(arrived).as_secs_f64()),
                Some(t) => metrics.observe_itl(&model, now.duration_since(t).as_secs_f64()),
            }
            last_token_at = Some(now);
            generated += n;
            guard.add_tokens(n);
        }
        if let Some(e) = &o.error {
            // A choice failed after the request was accepted (its grammar hit llguidance's
            // limits): the request ends with that error, never with finish reason `abort`.
            // Dropping `outputs` ends the other choices and frees their KV blocks.
            let _ = tx.send(Err(engine_error_to_status(e))).await;
            finish = None;
            break;
        }
        if o.finish_reason.is_some() {
            finish = o.finish_reason;
        }
        let done = o.usage.is_some();
        if tx.send(Ok(output_to_proto(&request_id, o))).await.is_err() {
            tracing::debug!(request = %request_id, "client left: aborting");
            if !done {
                finish = None;
            }
            break;
        }
        if done {
            break;
        }
    }
    // A request that ends without the engine's finish reason (client gone, replica
    // stopped, engine failure) counts as `abort`, as vLLM counts it.
    let reason = finish.unwrap_or(FinishReason::Abort);
    metrics.finish(&model, arrived.elapsed().as_secs_f64(), prompt_tokens, generated, reason.as_str());
}

#[tonic::async_trait]
impl WorkerService for WorkerGrpc {
    type GenerateStream = GenerateStream;
    type WatchPrefixCacheStream = ReceiverStream<Result<pb::PrefixCacheEvents, Status>>;

    async fn get_prompt_codec(
        &self,
        request: Request<pb::GetPromptCodecRequest>,
    ) -> Result<Response<pb::PromptCodec>, Status> {
        let id = request.into_inner().replica_id;
        let replica = self.replica(&id)?;
        match prompt_codec(&replica).await {
            Ok(codec) => Ok(Response::new(pb::PromptCodec::clone(&codec))),
            Err(CodecRefusal::NotLoaded) => Err(Status::unavailable(format!("replica {id} is not loaded yet"))),
            Err(CodecRefusal::NotExportable) => Err(Status::failed_precondition(format!(
                "replica {id}: the model's tokenizer cannot be exported; route by load"
            ))),
        }
    }

    async fn watch_prefix_cache(
        &self,
        request: Request<pb::WatchPrefixCacheRequest>,
    ) -> Result<Response<Self::WatchPrefixCacheStream>, Status> {
        let id = request.into_inner().replica_id;
        let replica = self.replica(&id)?;
        let engine =
            replica.engine().cloned().ok_or_else(|| Status::unavailable(format!("replica {id} is not loaded yet")))?;
        let (tx, rx) = mpsc::channel(prefix_cache::WATCH_BUFFER);
        tokio::spawn(prefix_cache::watch(replica, engine, tx, self.stop.clone()));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn generate(
        &self,
        request: Request<pb::WorkerGenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let arrived = Instant::now();
        let r = request.into_inner();
        let replica = self.replica(&r.replica_id)?;
        let (guard, engine) = replica.admit().map_err(|e| match e {
            Refusal::Draining => Status::unavailable(format!("replica {} is draining", r.replica_id)),
            Refusal::NotReady(s) => {
                Status::unavailable(format!("replica {} is not ready ({})", r.replica_id, s.as_str_name()))
            }
        })?;
        let fingerprint =
            if r.prompt_token_ids.is_empty() { None } else { prompt_codec(&replica).await.ok().map(|c| c.fingerprint) };
        let req = engine_request_from_proto(r, arrived, fingerprint)?;
        let request_id = req.id.0.clone();
        let outputs = engine.submit(req).map_err(|e| engine_error_to_status(&e))?;
        let (tx, rx) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(forward(outputs, tx, guard, Arc::clone(&self.metrics), request_id, arrived));
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn drain(
        &self,
        request: Request<pb::WorkerDrainRequest>,
    ) -> Result<Response<pb::WorkerDrainResponse>, Status> {
        let r = request.into_inner();
        let deadline =
            if r.deadline_ms == 0 { self.agent.cfg.sigterm_drain } else { Duration::from_millis(r.deadline_ms) };
        let reason = if r.reason.is_empty() { "drain requested" } else { r.reason.as_str() };
        let in_flight = self.agent.drain(deadline, reason, DrainSource::Rpc);
        Ok(Response::new(pb::WorkerDrainResponse { in_flight }))
    }

    async fn health(
        &self,
        _request: Request<pb::WorkerHealthRequest>,
    ) -> Result<Response<pb::WorkerHealthResponse>, Status> {
        let replicas = self
            .agent
            .replicas()
            .all()
            .iter()
            .map(|r| {
                let (state, reason) = r.state();
                let problem = self.agent.engine_problem(r);
                let load = r.engine().map(|e| e.load()).unwrap_or_default();
                let ready = state == pb::ReplicaState::Ready && r.engine().is_some() && problem.is_none();
                let reason = problem.unwrap_or(reason);
                pb::ReplicaHealth {
                    replica_id: r.id.0.clone(),
                    ready,
                    reason: if reason.is_empty() { state.as_str_name().to_owned() } else { reason },
                    running: load.running,
                    waiting: load.waiting,
                    kv_cache_usage: load.kv_cache_usage,
                }
            })
            .collect();
        Ok(Response::new(pb::WorkerHealthResponse {
            node_id: self.agent.node_id().0.clone(),
            draining: self.agent.is_draining(),
            replicas,
        }))
    }
}

#[cfg(test)]
mod tests;
