//! Batched prompts on `/v1/completions`: a `prompt` that lists several prompts (`["A", "B"]`
//! or a list of token-id lists) is answered as OpenAI and vLLM answer it, one response whose
//! choices are indexed `prompt_index * n + j`.
//!
//! - The batch is split into one generation per prompt, each with the request's `n`,
//!   sampling, `seed` (the same for every prompt, as in vLLM), `logprobs`, `echo` and stops.
//!   Every prompt is validated before anything is dispatched: its fields, and its length
//!   against the model's context when the router knows the model's tokenizer (a 400 naming
//!   `prompt[i]`, nothing generated). At most `--max-prompts-per-request` prompts.
//! - The generations are dispatched at once, each through the admission queue as a request of
//!   its own (a batch cannot take more slots than as many requests would) and each routed on
//!   its own (prefix-aware per prompt). The key's tokens-per-minute limit is charged the
//!   batch's whole estimate once, before dispatch, and kept once every prompt was accepted.
//! - The answer begins once every generation was accepted by a replica, so an error before
//!   that (queue full, no replica, a worker's 400) is the status of the whole request, as for
//!   one prompt. After that, streamed chunks of all prompts go out interleaved as they come,
//!   each choice with its batch index, then one usage chunk (`include_usage`) and one
//!   `[DONE]`; a generation failing ends the stream with an error event.
//! - Dropping the merged stream (an error, the client gone) drops every generation's receiver,
//!   which cancels it on its worker, and every dispatch still in the queue.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::BytesMut;
use futures::stream::{self, BoxStream, SelectAll, StreamExt};
use prism_common::proto::v1::generate_request::Prompt;
use prism_common::proto::v1::{GenerateRequest, GenerateResponse};
use serde_json::Value;
use tokio_stream::wrappers::ReceiverStream;

use super::errors::ApiError;
use super::shaper::{Kind, Shaper};
use super::structured::ErrorFields;
use super::types::CompletionRequest;
use super::{guard, sse};
use crate::auth::{ApiKeys, Caller};
use crate::dispatch::{DispatchError, Dispatched, Dispatcher, estimated_tokens};
use crate::metrics::{Outcome, RequestTracker};
use crate::tokenize::ModelCodecs;

/// What a batch is served with: the HTTP handlers' dispatcher, keys and codecs.
pub(super) struct Batching {
    /// Dispatches each prompt's generation.
    pub dispatcher: Dispatcher,
    /// The key's tokens-per-minute limit.
    pub keys: ApiKeys,
    /// The model's tokenizer and context length, for the length check.
    pub codecs: Arc<ModelCodecs>,
    /// `--max-prompts-per-request`.
    pub max_prompts: usize,
}

/// One prompt's generation as the handler prepares a request of one prompt: the validated
/// proto, the shaper of its answer (echo applied) and what names the client's fields.
pub(super) type Prepared = (GenerateRequest, Shaper, ErrorFields);

/// A message of one generation, with its prompt's index.
type Tagged = (usize, Result<GenerateResponse, DispatchError>);

/// The messages of all the batch's generations, interleaved as they come.
type Merged = SelectAll<BoxStream<'static, Tagged>>;

/// A batch split into its prompts' generations, validated, not yet dispatched.
struct Batch {
    protos: Vec<GenerateRequest>,
    /// One per prompt, its choices' indexes starting at `prompt_index * n`.
    shapers: Vec<Shaper>,
    /// What names the client's field in each generation's worker errors.
    fields: Vec<ErrorFields>,
}

/// A streamed answer under way: what is still to send and the generations still running.
struct Streaming {
    pending: Option<BytesMut>,
    /// `None` once the stream has ended (dropping it cancels what still runs).
    merged: Option<Merged>,
    shapers: Vec<Shaper>,
    fields: Vec<ErrorFields>,
    tracker: RequestTracker,
}

enum Answer {
    Whole(Value),
    /// The events of every generation's output so far, and the generations.
    Stream(BytesMut, Merged, Vec<Shaper>, Vec<ErrorFields>),
}

/// `POST /v1/completions` with several prompts (see the module header); `prepare` readies a
/// request of one prompt as the handler does for one.
pub(super) async fn serve<P, F>(
    state: Batching,
    mut tracker: RequestTracker,
    caller: Option<Caller>,
    req: &CompletionRequest,
    prepare: P,
) -> Response
where
    P: Fn(CompletionRequest) -> F,
    F: Future<Output = Result<Prepared, ApiError>>,
{
    let (pending, merged, shapers, fields) = match answer(&state, &tracker, caller, req, prepare).await {
        Err(e) => {
            tracker.set(e.outcome());
            return e.into_response();
        }
        Ok(Answer::Whole(v)) => {
            tracker.set(Outcome::Ok);
            return axum::Json(v).into_response();
        }
        Ok(Answer::Stream(pending, merged, shapers, fields)) => (pending, merged, shapers, fields),
    };
    let init = Streaming { pending: Some(pending), merged: Some(merged), shapers, fields, tracker };
    let body = stream::unfold(init, |mut s| async move {
        if let Some(b) = s.pending.take() {
            return Some((Ok::<_, Infallible>(b.freeze()), s));
        }
        let merged = s.merged.as_mut()?;
        let next = merged.next().await;
        let mut out = BytesMut::new();
        match next {
            Some((i, Ok(m))) => s.shapers[i].stream_events(&m, &mut out),
            Some((i, Err(e))) => {
                let e = failed(&s.fields[i], i, e);
                s.tracker.set(e.outcome());
                sse::push_event(&mut out, &e.body());
                out.extend_from_slice(sse::DONE);
                s.merged = None; // cancels the other generations
            }
            None => {
                s.tracker.set(Outcome::Ok);
                stream_end(&s.shapers, &mut out);
                s.merged = None;
            }
        }
        Some((Ok(out.freeze()), s))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// Validates, charges and dispatches the batch; the whole answer, or a stream's start once
/// every generation was accepted.
async fn answer<P, F>(
    state: &Batching,
    tracker: &RequestTracker,
    caller: Option<Caller>,
    req: &CompletionRequest,
    prepare: P,
) -> Result<Answer, ApiError>
where
    P: Fn(CompletionRequest) -> F,
    F: Future<Output = Result<Prepared, ApiError>>,
{
    let Batch { protos, mut shapers, fields } = split(state, req, prepare).await?;
    let stream = req.sampling.stream.unwrap_or(false);
    // vLLM's echo with max_tokens 0: each prompt alone, nothing generated.
    let echo_only = protos.iter().all(|p| p.echo && p.sampling.as_ref().and_then(|s| s.max_tokens) == Some(0));
    if !echo_only {
        check_lengths(state, &protos).await?;
    }
    let tokens = protos.iter().map(estimated_tokens).sum();
    let charge = state.keys.admit_tokens(caller, tokens).map_err(guard::limited)?;
    let mut out = BytesMut::new();
    let mut merged = if echo_only {
        for s in &mut shapers {
            for m in s.prompt_only() {
                feed(s, &m, stream, &mut out);
            }
        }
        stream::select_all(Vec::new())
    } else {
        dispatch_all(state, protos)
    };
    // Until every generation is accepted, an error is the whole request's status.
    let mut waiting = vec![!echo_only; shapers.len()];
    let mut left = waiting.iter().filter(|w| **w).count();
    while left > 0 {
        let Some((i, m)) = merged.next().await else { break };
        let m = m.map_err(|e| failed(&fields[i], i, e))?;
        if std::mem::take(&mut waiting[i]) {
            if left == shapers.len() {
                tracker.first_token();
            }
            left -= 1;
        }
        feed(&mut shapers[i], &m, stream, &mut out);
    }
    charge.commit();
    if stream {
        return Ok(Answer::Stream(out, merged, shapers, fields));
    }
    while let Some((i, m)) = merged.next().await {
        shapers[i].absorb(&m.map_err(|e| failed(&fields[i], i, e))?);
    }
    Ok(Answer::Whole(whole(&shapers)))
}

/// One generation per prompt, each validated as a request of its own (`prepare`): a
/// prompt's own error names it (`prompt[i]: …`).
async fn split<P, F>(state: &Batching, req: &CompletionRequest, prepare: P) -> Result<Batch, ApiError>
where
    P: Fn(CompletionRequest) -> F,
    F: Future<Output = Result<Prepared, ApiError>>,
{
    let prompts = req.prompt.split();
    if prompts.len() > state.max_prompts {
        return Err(ApiError::invalid(
            "prompt",
            format!(
                "a list of {} prompts: at most {} prompts per request (--max-prompts-per-request)",
                prompts.len(),
                state.max_prompts
            ),
        ));
    }
    let n = req.sampling.n.unwrap_or(1).max(1) as usize;
    let mut batch = Batch { protos: Vec::new(), shapers: Vec::new(), fields: Vec::new() };
    for (i, prompt) in prompts.into_iter().enumerate() {
        let one = CompletionRequest {
            model: req.model.clone(),
            prompt,
            sampling: req.sampling.clone(),
            logprobs: req.logprobs,
            echo: req.echo,
            suffix: req.suffix.clone(),
            chat_template: req.chat_template.clone(),
            chat_template_kwargs: req.chat_template_kwargs.clone(),
        };
        let (proto, mut shaper, fields) = prepare(one).await.map_err(|e| {
            // Other fields are the same for every prompt: their errors name no prompt.
            if e.param.as_deref() == Some("prompt") { at_prompt(i, e) } else { e }
        })?;
        shaper.index_base = i * n;
        if let Some(first) = batch.shapers.first() {
            shaper.id.clone_from(&first.id);
            shaper.created = first.created;
        }
        batch.protos.push(proto);
        batch.shapers.push(shaper);
        batch.fields.push(fields);
    }
    Ok(batch)
}

/// Every prompt's length against the model's context and its token ids against the
/// vocabulary, before anything is dispatched (the engine's own rules,
/// `prism_engine::check_lengths` and `check_token_ids`): 400 naming the prompt. Skipped when the
/// router has no tokenizer or context length for the model yet; a worker refusing a prompt
/// then fails the batch ([`failed`]) with the same message.
async fn check_lengths(state: &Batching, protos: &[GenerateRequest]) -> Result<(), ApiError> {
    let Some(model) = protos.first().map(|p| p.model.clone()) else { return Ok(()) };
    let Ok(mc) = state.codecs.get(&model).await else { return Ok(()) };
    if mc.max_model_len == 0 {
        return Ok(());
    }
    let prompts: Vec<(Option<Prompt>, Option<i64>)> =
        protos.iter().map(|p| (p.prompt.clone(), p.sampling.as_ref().and_then(|s| s.max_tokens))).collect();
    let codec = mc.codec;
    let max_len = mc.max_model_len as usize;
    let check = move || {
        for (i, (prompt, max_tokens)) in prompts.iter().enumerate() {
            let checked = match prompt {
                Some(Prompt::Text(t)) => match codec.encode_text(t, true) {
                    Ok(ids) => prism_engine::check_lengths(ids.len(), 0, *max_tokens, max_len),
                    Err(_) => continue, // the worker says what is wrong with it
                },
                Some(Prompt::TokenIds(t)) => prism_engine::check_token_ids(&t.ids, codec.vocab_size(), "prompt")
                    .and_then(|()| prism_engine::check_lengths(t.ids.len(), 0, *max_tokens, max_len)),
                _ => continue,
            };
            if let Err(prism_engine::EngineError::InvalidRequest { field, message }) = checked {
                return Err(at_prompt(i, ApiError::invalid(field, message)));
            }
        }
        Ok(())
    };
    tokio::task::spawn_blocking(check)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("prompt length check failed: {e}")))?
}

/// Dispatches every generation at once; their messages interleaved, tagged by prompt.
fn dispatch_all(state: &Batching, protos: Vec<GenerateRequest>) -> Merged {
    let subs = protos.into_iter().enumerate().map(|(i, proto)| {
        let dispatcher = state.dispatcher.clone();
        stream::once(async move { dispatcher.dispatch(proto).await })
            .flat_map(|started| match started {
                Ok(Dispatched { first, rest, .. }) => {
                    stream::once(async move { Ok(first) }).chain(ReceiverStream::new(rest)).boxed()
                }
                Err(e) => stream::once(async move { Err(e) }).boxed(),
            })
            .map(move |m| (i, m))
            .boxed()
    });
    stream::select_all(subs)
}

/// Folds a message into its prompt's shaper, as SSE events when streamed.
fn feed(shaper: &mut Shaper, m: &GenerateResponse, stream: bool, out: &mut BytesMut) {
    if stream {
        shaper.stream_events(m, out);
    } else {
        shaper.absorb(m);
    }
}

/// A prompt's 400 names the prompt: `prompt[i]: …`.
fn at_prompt(i: usize, mut e: ApiError) -> ApiError {
    if e.status == StatusCode::BAD_REQUEST {
        e.message = format!("prompt[{i}]: {}", e.message);
    }
    e
}

/// The whole request's error for a generation that failed: the client's field named as for
/// one prompt, and the prompt named in a 400.
fn failed(fields: &ErrorFields, i: usize, e: DispatchError) -> ApiError {
    at_prompt(i, fields.client_error(false, ApiError::from(e)))
}

/// The batch's usage: every prompt's tokens summed (OpenAI and vLLM count each prompt).
fn usage(shapers: &[Shaper]) -> Value {
    let mut total = Shaper::new(Kind::Completion, String::new(), 1, false, false);
    for s in shapers {
        total.prompt_tokens += s.prompt_tokens;
        total.completion_tokens += s.completion_tokens;
        total.cached_tokens += s.cached_tokens;
    }
    total.usage()
}

/// The non-streamed answer: every prompt's choices in index order, usage summed.
fn whole(shapers: &[Shaper]) -> Value {
    let mut choices = Vec::new();
    let mut v = Value::Null;
    for s in shapers {
        let mut one = s.whole();
        if let Some(c) = one.get_mut("choices").and_then(Value::as_array_mut) {
            choices.append(c);
        }
        if v.is_null() {
            v = one;
        }
    }
    v["choices"] = Value::Array(choices);
    v["usage"] = usage(shapers);
    v
}

/// The end of a streamed answer: the usage chunk when asked for, then `[DONE]`.
fn stream_end(shapers: &[Shaper], out: &mut BytesMut) {
    if let Some(first) = shapers.first().filter(|s| s.include_usage) {
        let mut v = first.chunk(vec![]);
        v["usage"] = usage(shapers);
        sse::push_event(out, &v);
    }
    out.extend_from_slice(sse::DONE);
}

#[cfg(test)]
#[path = "batch_tests.rs"]
mod tests;
