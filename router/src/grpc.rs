//! gRPC `prism.v1.InferenceService` (Generate, ListModels, Tokenize, Detokenize). API keys
//! are checked by [`guard`] in front of every service; `Generate` applies the key's token
//! limit. Dispatch errors map to gRPC codes in [`to_status`]. Dropping the response stream
//! (client gone) cancels the worker request. `GenerateRequest.echo` puts the prompt's text
//! before the first message's text of each choice (with `max_tokens: 0`, the prompt alone);
//! Tokenize / Detokenize answer in the router with the model's codec ([`crate::tokenize`]).
//! A request with tools (`tools_json`) gets its tool calls parsed out of the text into
//! `GenerateResponse.tool_calls` ([`ToolStream`]).

pub mod guard;

use std::pin::Pin;
use std::time::Duration;

use futures::Stream;
use prism_common::proto::v1::inference_service_server::InferenceService;
use prism_common::proto::v1::{
    DetokenizeRequest, DetokenizeResponse, FinishReason, GenerateRequest, GenerateResponse, ListModelsRequest,
    ListModelsResponse, ModelInfo, TokenizeRequest, TokenizeResponse, ToolCallDelta, Usage, tokenize_request,
};
use tonic::{Request, Response, Status};

use crate::auth::{ApiKeys, Caller};
use crate::dispatch::{DispatchError, Dispatcher};
use crate::metrics::{Metrics, Outcome, RequestTracker};
use crate::tokenize::{Echo, EchoError, TokenizeError, TokenizeInput, TokenizeOptions, detokenize, echo_of, tokenize};
use crate::tools::parse::{Piece, ToolParser};
use crate::tools::{ParserChoice, ParserKind};
use prism_engine::ChatMessage;

/// The public gRPC service.
#[derive(Clone)]
pub struct InferenceApi {
    /// Sends requests to workers.
    pub dispatcher: Dispatcher,
    /// Accepted API keys (checked by [`guard`]; the token limit is applied in `Generate`).
    pub keys: ApiKeys,
    /// Router metrics.
    pub metrics: Metrics,
    /// `ModelInfo.created` (Unix seconds): the router's start, deployment times being unknown here.
    pub started_at: i64,
    /// The models' prompt codecs (Tokenize, Detokenize, echo).
    pub codecs: std::sync::Arc<crate::tokenize::ModelCodecs>,
    /// `--tool-call-parser`.
    pub tool_parser: ParserChoice,
}

/// Tool-call parsing of a stream: per choice, the text becomes content and call deltas
/// (each call whole: index, id, name and arguments in one delta).
struct ToolStream {
    kind: ParserKind,
    parsers: Vec<ToolParser>,
}

impl ToolStream {
    fn apply(&mut self, m: &mut GenerateResponse) {
        let i = m.index as usize;
        while self.parsers.len() <= i {
            self.parsers.push(ToolParser::new(self.kind));
        }
        let p = &mut self.parsers[i];
        let mut pieces = p.push(&m.text);
        let finish = FinishReason::try_from(m.finish_reason).unwrap_or(FinishReason::Unspecified);
        if finish != FinishReason::Unspecified {
            pieces.extend(p.finish());
        }
        m.text.clear();
        for piece in pieces {
            match piece {
                Piece::Content(t) => m.text.push_str(&t),
                Piece::Call(c) => {
                    m.tool_calls.push(ToolCallDelta { index: c.index, id: c.id, name: c.name, arguments: c.arguments })
                }
            }
        }
    }
}

pub use crate::admission::RETRY_AFTER_METADATA;

/// Dispatch error → gRPC status (the only such mapping for the gRPC API).
pub fn to_status(e: DispatchError) -> Status {
    let retry_after = e.retry_after_s();
    let mut s = match e {
        DispatchError::UnknownModel(_) => Status::not_found(e.to_string()),
        DispatchError::NoReplica(_)
        | DispatchError::NoReplicaInTime { .. }
        | DispatchError::ReplicaLost { .. }
        | DispatchError::Unavailable { .. }
        | DispatchError::NoRouteTable => Status::unavailable(e.to_string()),
        DispatchError::Overloaded { .. } => Status::resource_exhausted(e.to_string()),
        DispatchError::DeadlineExceeded => Status::deadline_exceeded(e.to_string()),
        // tonic's message-size refusal on the internal hop (see `INTERNAL_HOP_MESSAGE`).
        DispatchError::Worker(s) if s.code() == tonic::Code::OutOfRange => {
            tracing::warn!(message = s.message(), "internal gRPC hop refused a message");
            return Status::internal(crate::openai::errors::INTERNAL_HOP_MESSAGE);
        }
        DispatchError::Worker(s) => return s,
    };
    if let Some(secs) = retry_after {
        s.metadata_mut().insert(RETRY_AFTER_METADATA, tonic::metadata::MetadataValue::from(secs));
    }
    s
}

fn outcome_of(s: &Status) -> Outcome {
    use tonic::Code;
    match s.code() {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => Outcome::BadRequest,
        Code::Unauthenticated => Outcome::Unauthenticated,
        Code::NotFound => Outcome::NotFound,
        Code::ResourceExhausted => Outcome::Overloaded,
        Code::Unavailable => Outcome::Unavailable,
        Code::DeadlineExceeded => Outcome::Timeout,
        Code::Cancelled => Outcome::Cancelled,
        _ => Outcome::Error,
    }
}

/// Parses a `grpc-timeout` header value (`<digits><H|M|S|m|u|n>`).
fn grpc_timeout(v: &str) -> Option<Duration> {
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

fn tokenize_status(e: TokenizeError) -> Status {
    match e {
        TokenizeError::Invalid(i) => Status::invalid_argument(i.message),
        TokenizeError::Internal(m) => Status::internal(m),
    }
}

/// The answer to `echo` with `max_tokens: 0`: per choice, the prompt alone (finish reason
/// length; usage on the last message).
fn prompt_only(e: &Echo, n: u32) -> Vec<GenerateResponse> {
    let prompt_tokens = e.prompt_tokens.unwrap_or(0);
    let n = n.max(1);
    (0..n)
        .map(|index| GenerateResponse {
            index,
            text: e.text.clone(),
            finish_reason: FinishReason::Length as i32,
            usage: (index + 1 == n).then_some(Usage { prompt_tokens, completion_tokens: 0, cached_tokens: 0 }),
            prompt_tokens,
            ..Default::default()
        })
        .collect()
}

impl InferenceApi {
    /// The prompt's echo, for a valid `echo` request (validated first, so a bad one is
    /// refused before any codec is fetched).
    async fn echo(&self, req: &GenerateRequest) -> Result<Option<Echo>, Status> {
        if !req.echo {
            return Ok(None);
        }
        crate::validate::check_request(req).map_err(|e| Status::invalid_argument(e.message))?;
        echo_of(&self.codecs, req, false).await.map(Some).map_err(|e| match e {
            EchoError::Lookup(d) => to_status(d),
            EchoError::Tokenize(t) => tokenize_status(t),
        })
    }

    async fn start(
        &self,
        request: Request<GenerateRequest>,
    ) -> Result<(crate::dispatch::Dispatched, Option<ToolStream>), Status> {
        let caller = request.extensions().get::<Caller>().copied();
        let header_timeout =
            request.metadata().get("grpc-timeout").and_then(|v| v.to_str().ok()).and_then(grpc_timeout);
        let mut req = request.into_inner();
        crate::validate::check_request(&req).map_err(|e| Status::invalid_argument(e.message))?;
        let parser = self.dispatcher.tool_parser(&req.model, self.tool_parser);
        let plan = crate::tools::plan(&mut req, parser).map_err(|e| Status::invalid_argument(e.message))?;
        let tools = plan.map(|p| ToolStream { kind: p.parser, parsers: Vec::new() });
        // Validated and the model looked up first: a 400 or 404 stays one with the budget spent.
        self.dispatcher.check_model(&req.model).map_err(to_status)?;
        // The key's tokens-per-minute limit, on the same estimate the admission queue counts;
        // given back (the charge dropped) unless a replica accepts the request.
        let charge =
            self.keys.admit_tokens(caller, crate::dispatch::estimated_tokens(&req)).map_err(guard::limited_status)?;
        if let Some(t) = header_timeout {
            let ms = u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1);
            req.timeout_ms = Some(req.timeout_ms.filter(|&x| x > 0).map_or(ms, |x| x.min(ms)));
        }
        let dispatched = self.dispatcher.dispatch(req).await.map_err(to_status)?;
        charge.commit();
        Ok((dispatched, tools))
    }
}

#[tonic::async_trait]
impl InferenceService for InferenceApi {
    type GenerateStream = GenStream;

    async fn generate(&self, request: Request<GenerateRequest>) -> Result<Response<GenStream>, Status> {
        let mut tracker = RequestTracker::new(&self.metrics);
        let echo = match self.echo(request.get_ref()).await {
            Ok(e) => e,
            Err(s) => {
                tracker.set(outcome_of(&s));
                return Err(s);
            }
        };
        if let Some(e) = &echo
            && request.get_ref().sampling.as_ref().and_then(|s| s.max_tokens) == Some(0)
        {
            tracker.set(Outcome::Ok);
            let n = request.get_ref().sampling.as_ref().and_then(|s| s.n).unwrap_or(1);
            return Ok(Response::new(Box::pin(futures::stream::iter(
                prompt_only(e, n).into_iter().map(Ok::<_, Status>),
            ))));
        }
        let (d, mut tools) = match self.start(request).await {
            Ok(d) => {
                tracker.first_token();
                d
            }
            Err(s) => {
                tracker.set(outcome_of(&s));
                return Err(s);
            }
        };
        let mut first = d.first;
        if let Some(t) = &mut tools {
            t.apply(&mut first);
        }
        let init = (Some(first), d.rest, tracker, false, tools);
        let s = futures::stream::unfold(init, |(first, mut rest, mut tracker, done, mut tools)| async move {
            if let Some(f) = first {
                return Some((Ok(f), (None, rest, tracker, done, tools)));
            }
            if done {
                return None;
            }
            match rest.recv().await {
                Some(Ok(mut m)) => {
                    if let Some(t) = &mut tools {
                        t.apply(&mut m);
                    }
                    Some((Ok(m), (None, rest, tracker, false, tools)))
                }
                Some(Err(e)) => {
                    let s = to_status(e);
                    tracker.set(outcome_of(&s));
                    Some((Err(s), (None, rest, tracker, true, tools)))
                }
                None => {
                    tracker.set(Outcome::Ok);
                    None
                }
            }
        });
        match echo {
            None => Ok(Response::new(Box::pin(s))),
            Some(e) => {
                // The first message of each choice carries the prompt before its text.
                let mut echoed = std::collections::HashSet::new();
                let s = futures::StreamExt::map(s, move |m| {
                    m.map(|mut m| {
                        if echoed.insert(m.index) {
                            m.text.insert_str(0, &e.text);
                        }
                        m
                    })
                });
                Ok(Response::new(Box::pin(s)))
            }
        }
    }

    async fn tokenize(&self, request: Request<TokenizeRequest>) -> Result<Response<TokenizeResponse>, Status> {
        let r = request.into_inner();
        let input = match r.input {
            Some(tokenize_request::Input::Text(t)) => TokenizeInput::Text(t),
            Some(tokenize_request::Input::Chat(c)) => TokenizeInput::Chat(
                c.messages
                    .into_iter()
                    .map(|m| ChatMessage { role: m.role, content: m.content, ..Default::default() })
                    .collect(),
            ),
            None => return Err(Status::invalid_argument("input: text or chat is required")),
        };
        let mc = self.codecs.get(&r.model).await.map_err(to_status)?;
        let codec = mc.codec;
        let opts = TokenizeOptions {
            template_kwargs: Some(r.chat_template_kwargs_json).filter(|k| !k.is_empty()),
            add_special_tokens: r.add_special_tokens,
            add_generation_prompt: r.add_generation_prompt,
            return_token_strs: r.return_token_strs,
        };
        let t = tokio::task::spawn_blocking(move || tokenize(&codec, &input, &opts))
            .await
            .map_err(|e| Status::internal(format!("tokenizer task failed: {e}")))?
            .map_err(tokenize_status)?;
        Ok(Response::new(TokenizeResponse {
            count: u32::try_from(t.tokens.len()).unwrap_or(u32::MAX),
            tokens: t.tokens,
            max_model_len: mc.max_model_len,
            token_strs: t.token_strs.unwrap_or_default(),
        }))
    }

    async fn detokenize(&self, request: Request<DetokenizeRequest>) -> Result<Response<DetokenizeResponse>, Status> {
        let r = request.into_inner();
        let codec = self.codecs.get(&r.model).await.map_err(to_status)?.codec;
        let prompt = tokio::task::spawn_blocking(move || detokenize(&codec, &r.tokens))
            .await
            .map_err(|e| Status::internal(format!("tokenizer task failed: {e}")))?
            .map_err(tokenize_status)?;
        Ok(Response::new(DetokenizeResponse { prompt }))
    }

    async fn list_models(&self, _request: Request<ListModelsRequest>) -> Result<Response<ListModelsResponse>, Status> {
        let snap = self.dispatcher.routes().snapshot();
        if !snap.loaded {
            // An empty list would say that no model exists.
            return Err(to_status(DispatchError::NoRouteTable));
        }
        let models = snap
            .models
            .iter()
            // Also models with no Ready replica (scaled to zero, starting): ready_replicas 0.
            .map(|(name, rs)| ModelInfo {
                id: name.clone(),
                ready_replicas: u32::try_from(rs.iter().filter(|r| r.is_ready()).count()).unwrap_or(u32::MAX),
                max_model_len: snap.max_model_len(name),
                created: self.started_at,
            })
            .collect();
        Ok(Response::new(ListModelsResponse { models }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_grpc_timeout() {
        assert_eq!(grpc_timeout("250m"), Some(Duration::from_millis(250)));
        assert_eq!(grpc_timeout("3S"), Some(Duration::from_secs(3)));
        assert_eq!(grpc_timeout("x"), None);
        assert_eq!(grpc_timeout(""), None);
    }
}
