//! OpenAI-compatible HTTP API (axum): `/v1/completions`, `/v1/chat/completions`,
//! `/v1/models`, vLLM's `/tokenize` and `/detokenize` ([`tokenize`]), plus `/health`, `/healthz`, `/readyz` and `/metrics`.
//!
//! Bodies are read by hand so that every failure is an OpenAI error object: no or wrong
//! Content-Type → 415, over `max_body_bytes` → 413 before parsing, a body that ends before
//! its Content-Length or stalls past [`BODY_READ_TIMEOUT`] → 400 / 408, anything that is not
//! a valid request object → 400 with `param` naming the field (serde's error path). Wrong
//! method on a known path → 405 and unknown paths → 404, both as error objects. Streams are
//! server-sent events in OpenAI's chunk format ending with `data: [DONE]`; dropping the
//! response body (client gone) drops the dispatch receiver, which cancels the request on the
//! worker. Both generation endpoints run one handler, `generate`, generic over the request
//! type (`GenerationEndpoint`), with responses shaped by `shaper`; a completion with several
//! prompts is split and merged by [`batch`].

pub mod batch;
pub mod errors;
pub mod guard;
pub mod json;
pub mod models;
mod shaper;
pub mod sse;
pub mod structured;
pub mod tokenize;
pub mod types;

use std::convert::Infallible;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::BytesMut;
use futures::StreamExt;
use prism_common::proto::v1::{GenerateRequest, GenerateResponse};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::auth::{ApiKeys, Caller, TokenCharge};
use crate::dispatch::{DispatchError, Dispatched, Dispatcher};
use crate::metrics::{Metrics, Outcome, RequestTracker};
use crate::tools::ParserChoice;
use errors::ApiError;
pub use shaper::unix_now;
use shaper::{Kind, Shaper};
use structured::ErrorFields;
use types::{ChatRequest, CompletionRequest, SamplingFields};

/// Longest time to receive a whole request body; a client that stalls mid-body gets 408.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Shared state of the HTTP handlers.
#[derive(Clone)]
pub struct HttpState {
    /// Sends requests to workers.
    pub dispatcher: Dispatcher,
    /// Router metrics.
    pub metrics: Metrics,
    /// Accepted API keys (checked by [`guard`]; the token limit is applied here).
    pub keys: ApiKeys,
    /// Whether `/metrics` needs no key (`--metrics-without-auth`).
    pub metrics_open: bool,
    /// Body size limit in bytes.
    pub max_body_bytes: usize,
    /// `created` of models whose deployment time is unknown: the router's start (Unix seconds).
    pub started_at: i64,
    /// Most prompts in one completion request (`--max-prompts-per-request`, [`batch`]).
    pub max_prompts: usize,
    /// The models' prompt codecs (`/tokenize`, `/detokenize`, `echo`, batch length checks).
    pub codecs: std::sync::Arc<crate::tokenize::ModelCodecs>,
    /// `--tool-call-parser`: the format tool calls are read in (auto: by chat template).
    pub tool_parser: ParserChoice,
}

/// The HTTP application: the routes behind the API-key guard ([`guard`]), which runs before
/// routing so that it answers for every path, known or not.
pub fn router(state: HttpState) -> Router {
    let g = guard::Guard { keys: state.keys.clone(), metrics_open: state.metrics_open };
    let routes = Router::new()
        .route("/v1/completions", post(generate::<CompletionRequest>))
        .route("/v1/chat/completions", post(generate::<ChatRequest>))
        .route("/v1/models", get(models_route))
        .route("/tokenize", post(tokenize_route))
        .route("/detokenize", post(detokenize_route))
        .route("/v1/models/{id}", get(model_route))
        .route("/health", get(|State(s): State<HttpState>| async move { readiness(&s, "ok") }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|State(s): State<HttpState>| async move { readiness(&s, "ready") }))
        .route("/metrics", get(metrics))
        .fallback(|| async { ApiError::new(StatusCode::NOT_FOUND, "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method not allowed on this path")
        })
        .with_state(state);
    let guarded = tower_layer::Layer::layer(&axum::middleware::from_fn_with_state(g, guard::require_key), routes);
    Router::new().fallback_service(guarded)
}

/// Reads the body: 413 over the limit, 400 when it ends early (a Content-Length not met,
/// a broken connection), 408 when it does not arrive within [`BODY_READ_TIMEOUT`].
async fn read_body(state: &HttpState, headers: &HeaderMap, body: Body) -> Result<BytesMut, ApiError> {
    let too_large =
        || ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("request body exceeds {} bytes", state.max_body_bytes));
    if let Some(len) =
        headers.get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<usize>().ok())
        && len > state.max_body_bytes
    {
        return Err(too_large());
    }
    let read = async {
        let mut stream = body.into_data_stream();
        let mut buf = BytesMut::new();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|_| ApiError::new(StatusCode::BAD_REQUEST, "incomplete request body"))?;
            if buf.len() + chunk.len() > state.max_body_bytes {
                return Err(too_large());
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf)
    };
    tokio::time::timeout(BODY_READ_TIMEOUT, read)
        .await
        .map_err(|_| ApiError::new(StatusCode::REQUEST_TIMEOUT, "request body not received in time"))?
}

/// The parameter a serde error is about: its path, or the field of "missing field `x`".
fn error_param<E: std::fmt::Display>(e: &serde_path_to_error::Error<E>) -> Option<String> {
    let path = e.path().to_string();
    if !path.is_empty() && path != "." && path != "?" {
        return Some(path);
    }
    let msg = e.inner().to_string();
    let rest = msg.strip_prefix("missing field `")?;
    rest.split('`').next().map(str::to_owned)
}

fn parse_as<T: DeserializeOwned>(value: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize::<_, T>(value).map_err(|e| {
        let message = format!("invalid request: {}", e.inner());
        ApiError { param: error_param(&e), ..ApiError::new(StatusCode::BAD_REQUEST, message) }
    })
}

/// Checks Content-Type and size, reads the body and parses it as a JSON object of type `T`
/// (whose sampling fields are checked first, so a type error in one names it).
async fn read_json<T: DeserializeOwned>(state: &HttpState, headers: &HeaderMap, body: Body) -> Result<T, ApiError> {
    let ct = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if !ct.trim_start().to_ascii_lowercase().starts_with("application/json") {
        return Err(ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "Content-Type must be application/json"));
    }
    let bytes = read_body(state, headers, body).await?;
    let value: Value = json::parse_body(&bytes).map_err(|e| match e {
        json::BodyError::Duplicate(ref k) => ApiError::invalid(k.clone(), e.to_string()),
        e => ApiError::invalid("body", e.to_string()),
    })?;
    if !value.is_object() {
        return Err(ApiError::invalid("body", "request body must be a JSON object"));
    }
    // `#[serde(flatten)]` loses the error path: check the flattened fields on their own.
    parse_as::<SamplingFields>(&value)?;
    parse_as::<T>(&value)
}

/// What the two generation endpoints differ in: the request body they parse and how its
/// fields size the response ([`Shaper`]); everything else is [`generate`].
trait GenerationEndpoint: DeserializeOwned + Send + 'static {
    /// The response shape.
    const KIND: Kind;
    /// The validated proto request (checks `n` before the shaper sizes its choices).
    fn proto(&self) -> Result<GenerateRequest, ApiError>;
    /// The requested model name.
    fn model(&self) -> &str;
    /// The sampling fields both endpoints share.
    fn sampling(&self) -> &SamplingFields;
    /// Whether the response carries logprobs.
    fn wants_logprobs(&self) -> bool;
    /// The field a structured output came from, to name it when the engine rejects it.
    fn structured_param(&self) -> Option<&'static str> {
        structured::structured(&self.sampling().structured_fields()).ok().flatten().map(|(_, s)| s.param)
    }
    /// A completion with several prompts, served by [`batch`]; `None` for one prompt.
    fn as_batch(&self) -> Option<&CompletionRequest> {
        None
    }
}

impl GenerationEndpoint for CompletionRequest {
    const KIND: Kind = Kind::Completion;
    fn proto(&self) -> Result<GenerateRequest, ApiError> {
        self.to_proto()
    }
    fn model(&self) -> &str {
        &self.model
    }
    fn sampling(&self) -> &SamplingFields {
        &self.sampling
    }
    fn wants_logprobs(&self) -> bool {
        self.logprobs.is_some()
    }
    fn as_batch(&self) -> Option<&CompletionRequest> {
        (self.prompt.len() > 1).then_some(self)
    }
}

impl GenerationEndpoint for ChatRequest {
    const KIND: Kind = Kind::Chat;
    fn proto(&self) -> Result<GenerateRequest, ApiError> {
        self.to_proto()
    }
    fn model(&self) -> &str {
        &self.model
    }
    fn sampling(&self) -> &SamplingFields {
        &self.sampling
    }
    fn wants_logprobs(&self) -> bool {
        self.logprobs == Some(true)
    }
}

/// `POST /v1/completions` (`R` = [`CompletionRequest`]) and `POST /v1/chat/completions`
/// (`R` = [`ChatRequest`]): parse, apply the key's token limit, dispatch, answer as JSON or SSE.
/// A completion with several prompts is served by [`batch`].
async fn generate<R: GenerationEndpoint>(
    State(state): State<HttpState>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let tracker = RequestTracker::new(&state.metrics);
    let caller = caller.map(|c| c.0);
    let req: R = match read_json(&state, &headers, body).await {
        Ok(r) => r,
        Err(e) => return serve(state, tracker, Err(e)).await,
    };
    if let Some(batch) = req.as_batch() {
        let b = batch::Batching {
            dispatcher: state.dispatcher.clone(),
            keys: state.keys.clone(),
            codecs: state.codecs.clone(),
            max_prompts: state.max_prompts,
        };
        let one = |r: CompletionRequest| {
            let state = state.clone();
            async move { prepare(&state, &r).await }
        };
        return batch::serve(b, tracker, caller, batch, one).await;
    }
    let prepared = async {
        let (proto, shaper, ctx) = prepare(&state, &req).await?;
        // The key's tokens-per-minute limit (admission's estimate), given back unless accepted.
        let tokens = crate::dispatch::estimated_tokens(&proto);
        let charge = state.keys.admit_tokens(caller, tokens).map_err(guard::limited)?;
        Ok::<_, ApiError>((proto, shaper, req.sampling().stream.unwrap_or(false), ctx, charge))
    }
    .await;
    serve(state, tracker, prepared).await
}

/// One prompt's generation, ready to dispatch: the validated proto, the shaper of its answer
/// (echo applied) and what names the client's fields in a worker's error.
async fn prepare<R: GenerationEndpoint>(state: &HttpState, req: &R) -> Result<batch::Prepared, ApiError> {
    let mut proto = req.proto()?; // validates `n` before the shaper sizes its choices
    let parser = state.dispatcher.tool_parser(&proto.model, state.tool_parser);
    let plan = crate::tools::plan(&mut proto, parser)?;
    state.dispatcher.check_model(&proto.model)?; // a 404 stays a 404 with the budget spent
    let sampling = req.sampling();
    let mut shaper = Shaper::new(
        R::KIND,
        req.model().to_owned(),
        sampling.n.unwrap_or(1),
        req.wants_logprobs(),
        sampling.include_usage(),
    );
    if let Some(p) = &plan {
        shaper.parse_tools(p.parser);
    }
    if proto.echo {
        let echo =
            crate::tokenize::echo_of(&state.codecs, &proto, req.wants_logprobs()).await.map_err(|e| match e {
                crate::tokenize::EchoError::Lookup(d) => ApiError::from(d),
                crate::tokenize::EchoError::Tokenize(t) => ApiError::from(t),
            })?;
        shaper = shaper.with_echo(echo);
    }
    Ok((proto, shaper, ErrorFields { structured: req.structured_param(), tools: plan }))
}

type Prepared = Result<(GenerateRequest, Shaper, bool, ErrorFields, TokenCharge), ApiError>;

/// What a dispatched request turned into.
enum Answer {
    Whole(Value),
    Stream(BytesMut, tokio::sync::mpsc::Receiver<Result<GenerateResponse, DispatchError>>, Shaper, ErrorFields),
}

/// Dispatches; errors before the first token come back as `Err` with a proper status.
async fn answer(state: &HttpState, tracker: &RequestTracker, prepared: Prepared) -> Result<Answer, ApiError> {
    let (req, mut shaper, stream, fields, charge) = prepared?;
    let kind = shaper.kind;
    // A worker's `prompt` (empty, over the context length) is `messages` in a chat request;
    // its `structured_output.*` is the field the constraint came from.
    let chat_param = |e: ApiError| fields.client_error(kind == Kind::Chat, e);
    if req.echo && req.sampling.as_ref().and_then(|s| s.max_tokens) == Some(0) {
        // vLLM's echo with max_tokens 0: the prompt alone, nothing generated.
        charge.commit();
        let msgs = shaper.prompt_only();
        let mut buf = BytesMut::new();
        for m in &msgs {
            if stream {
                shaper.stream_events(m, &mut buf);
            } else {
                shaper.absorb(m);
            }
        }
        if !stream {
            return Ok(Answer::Whole(shaper.whole()));
        }
        let (_, rx) = tokio::sync::mpsc::channel(1); // closed: the stream ends after `buf`
        return Ok(Answer::Stream(buf, rx, shaper, fields));
    }
    // Refused before a replica accepted it (404, context length, 503, ...): `charge` is refunded.
    let Dispatched { first, mut rest, .. } = state.dispatcher.dispatch(req).await.map_err(|e| chat_param(e.into()))?;
    charge.commit();
    tracker.first_token();
    if !stream {
        shaper.absorb(&first);
        // A worker error after the first token (a grammar past its limits mid-way) names the
        // client's field too.
        while let Some(m) = rest.recv().await {
            shaper.absorb(&m.map_err(|e| chat_param(e.into()))?);
        }
        return Ok(Answer::Whole(shaper.whole()));
    }
    let mut buf = BytesMut::new();
    shaper.stream_events(&first, &mut buf);
    Ok(Answer::Stream(buf, rest, shaper, fields))
}

/// Shapes the answer as JSON or as an SSE body; the tracker lives until the last byte.
async fn serve(state: HttpState, mut tracker: RequestTracker, prepared: Prepared) -> Response {
    let (first, rest, shaper) = match answer(&state, &tracker, prepared).await {
        Err(e) => {
            tracker.set(e.outcome());
            return e.into_response();
        }
        Ok(Answer::Whole(v)) => {
            tracker.set(Outcome::Ok);
            return axum::Json(v).into_response();
        }
        Ok(Answer::Stream(first, rest, shaper, fields)) => (first, rest, (shaper, fields)),
    };
    // `s`: the shaper, and what names the client's fields in a worker's error.
    let init = (Some(first), rest, shaper, tracker, false);
    let body = futures::stream::unfold(init, |(pending, mut rest, mut s, mut tracker, done)| async move {
        if let Some(b) = pending {
            return Some((Ok::<_, Infallible>(b.freeze()), (None, rest, s, tracker, done)));
        }
        if done {
            return None;
        }
        let (shaper, fields) = (&mut s.0, &s.1);
        let mut out = BytesMut::new();
        let mut finished = false;
        match rest.recv().await {
            Some(Ok(m)) => shaper.stream_events(&m, &mut out),
            Some(Err(e)) => {
                let e = fields.client_error(shaper.kind == Kind::Chat, ApiError::from(e));
                tracker.set(e.outcome());
                sse::push_event(&mut out, &e.body());
                out.extend_from_slice(sse::DONE);
                finished = true;
            }
            None => {
                tracker.set(Outcome::Ok);
                shaper.stream_end(&mut out);
                finished = true;
            }
        }
        Some((Ok(out.freeze()), (None, rest, s, tracker, finished)))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// `POST /tokenize` (vLLM's): see [`tokenize`].
async fn tokenize_route(State(state): State<HttpState>, headers: HeaderMap, body: Body) -> Response {
    let answer = async {
        let b: tokenize::TokenizeBody = read_json(&state, &headers, body).await?;
        tokenize::tokenize_answer(&state.codecs, b).await
    };
    match answer.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `POST /detokenize` (vLLM's): see [`tokenize`].
async fn detokenize_route(State(state): State<HttpState>, headers: HeaderMap, body: Body) -> Response {
    let answer = async {
        let b: tokenize::DetokenizeBody = read_json(&state, &headers, body).await?;
        tokenize::detokenize_answer(&state.codecs, b).await
    };
    match answer.await {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

/// `GET /v1/models` ([`models::list`]).
async fn models_route(State(s): State<HttpState>) -> Response {
    models::list(&s.dispatcher.routes().snapshot(), s.started_at)
}

/// `GET /v1/models/{id}` ([`models::one`]).
async fn model_route(State(s): State<HttpState>, Path(id): Path<String>) -> Response {
    models::one(&s.dispatcher.routes().snapshot(), s.started_at, &id)
}

/// `/health` (load balancers) and `/readyz` (a Kubernetes Service): 200 while the router can
/// take requests (`RouteSnapshot::readiness`: scale from zero included), else 503 saying why.
fn readiness(state: &HttpState, ok: &'static str) -> Response {
    match state.dispatcher.routes().snapshot().readiness() {
        Ok(()) => (StatusCode::OK, ok).into_response(),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
}

async fn metrics(State(state): State<HttpState>) -> Response {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], state.metrics.encode())
        .into_response()
}
