//! Response shaping of the generation endpoints: [`Shaper`] turns a generation's worker
//! messages into OpenAI objects, whole (`text_completion`, `chat.completion`) or as streamed
//! chunks, with usage, logprobs in either endpoint's shape, `echo`, and tool calls read out of
//! the text. A batch of prompts ([`super::batch`]) has one shaper per prompt, its choices'
//! indexes offset by [`Shaper::index_base`].

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::BytesMut;
use prism_common::proto::v1::{FinishReason, GenerateResponse, TokenLogprob};
use serde_json::{Value, json};

use super::sse;
use crate::tokenize::Echo;
use crate::tools::ParserKind;
use crate::tools::parse::{ParsedCall, Piece, ToolParser};

/// Now in Unix seconds.
pub fn unix_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs() as i64).unwrap_or(0)
}

/// Which endpoint a response is shaped for.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Completion,
    Chat,
}

fn finish_str(f: i32) -> Option<&'static str> {
    match FinishReason::try_from(f).unwrap_or(FinishReason::Unspecified) {
        FinishReason::Unspecified => None,
        FinishReason::Stop => Some("stop"),
        FinishReason::Length => Some("length"),
        FinishReason::Abort => Some("abort"),
    }
}

/// Per-choice accumulated state.
#[derive(Default)]
struct Choice {
    /// The content (text outside tool calls when calls are parsed).
    text: String,
    /// Reads tool calls out of the text (requests with tools).
    parser: Option<ToolParser>,
    /// The calls parsed so far.
    calls: Vec<ParsedCall>,
    role_sent: bool,
    finish: Option<&'static str>,
    // completions logprobs
    tokens: Vec<String>,
    /// `None` for echoed prompt tokens (JSON null).
    token_logprobs: Vec<Option<f32>>,
    top: Vec<Value>,
    offsets: Vec<usize>,
    /// The echoed prompt went out in a streamed chunk.
    echo_sent: bool,
    // chat logprobs
    content: Vec<Value>,
}

/// Converts worker messages into OpenAI objects (both streamed and whole).
pub(super) struct Shaper {
    pub(super) kind: Kind,
    pub(super) id: String,
    pub(super) model: String,
    pub(super) created: i64,
    pub(super) logprobs: bool,
    pub(super) include_usage: bool,
    choices: Vec<Choice>,
    pub(super) prompt_tokens: u32,
    pub(super) completion_tokens: u32,
    /// Prompt tokens served from the replica's prefix cache (`usage.prompt_tokens_details`).
    pub(super) cached_tokens: u32,
    pub(super) usage_seen: bool,
    /// The prompt echoed before each choice's output (completions `echo`).
    pub(super) echo: Option<Echo>,
    /// Whether the output is read for tool calls (then `content` is null without text).
    pub(super) tools: bool,
    /// Added to every choice's index: `prompt_index * n` in a batch ([`super::batch`]).
    pub(super) index_base: usize,
}

fn bytes_json(b: &[u8]) -> Value {
    Value::Array(b.iter().map(|x| json!(x)).collect())
}

fn chat_lp(l: &TokenLogprob) -> Value {
    json!({
        "token": l.token, "logprob": l.logprob, "bytes": bytes_json(&l.bytes),
        "top_logprobs": l.top_logprobs.iter()
            .map(|t| json!({"token": t.token, "logprob": t.logprob, "bytes": bytes_json(&t.bytes)}))
            .collect::<Vec<_>>(),
    })
}

impl Shaper {
    pub(super) fn new(kind: Kind, model: String, n: u32, logprobs: bool, include_usage: bool) -> Self {
        let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
        Self {
            kind,
            id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()),
            model,
            created: unix_now(),
            logprobs,
            include_usage,
            choices: (0..n.max(1)).map(|_| Choice::default()).collect(),
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_tokens: 0,
            usage_seen: false,
            echo: None,
            tools: false,
            index_base: 0,
        }
    }

    /// Reads every choice's output for tool calls in `parser`'s format.
    pub(super) fn parse_tools(&mut self, parser: ParserKind) {
        self.tools = true;
        for c in &mut self.choices {
            c.parser = Some(ToolParser::new(parser));
        }
    }

    /// OpenAI's finish reason of a choice: `tool_calls` when it ended by calling tools.
    fn finish_of(c: &Choice, finish: Option<&'static str>) -> Option<&'static str> {
        match finish {
            Some("stop") if !c.calls.is_empty() => Some("tool_calls"),
            f => f,
        }
    }

    /// Puts the prompt before every choice's text; with logprobs, its tokens come first with
    /// null logprobs (the engine computes none for prompt tokens).
    pub(super) fn with_echo(mut self, echo: Echo) -> Self {
        for c in &mut self.choices {
            c.text.clone_from(&echo.text);
            if self.logprobs {
                let mut off = 0;
                for t in &echo.tokens {
                    c.tokens.push(t.clone());
                    c.token_logprobs.push(None);
                    c.top.push(Value::Null);
                    c.offsets.push(off);
                    off += t.len();
                }
            }
        }
        if let Some(n) = echo.prompt_tokens {
            self.prompt_tokens = n;
        }
        self.echo = Some(echo);
        self
    }

    /// The answer of an `echo` request with `max_tokens: 0`: each choice is the prompt alone
    /// (finish reason `length`), no replica involved.
    pub(super) fn prompt_only(&self) -> Vec<GenerateResponse> {
        let n = self.choices.len();
        (0..n)
            .map(|i| GenerateResponse {
                index: i as u32,
                finish_reason: FinishReason::Length as i32,
                usage: (i + 1 == n).then_some(prism_common::proto::v1::Usage {
                    prompt_tokens: self.prompt_tokens,
                    completion_tokens: 0,
                    cached_tokens: 0,
                }),
                prompt_tokens: self.prompt_tokens,
                ..GenerateResponse::default()
            })
            .collect()
    }

    /// OpenAI's usage object, with `prompt_tokens_details.cached_tokens` (0 on a miss).
    pub(super) fn usage(&self) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}})
    }

    /// Folds a message into the state; returns the choice index, this message's logprobs
    /// object and what its text became (content, and tool calls when they are parsed).
    pub(super) fn absorb(&mut self, m: &GenerateResponse) -> (usize, Value, Vec<Piece>) {
        let i = (m.index as usize).min(self.choices.len() - 1);
        if m.prompt_tokens > 0 && self.prompt_tokens == 0 {
            self.prompt_tokens = m.prompt_tokens;
        }
        if let Some(u) = &m.usage {
            self.prompt_tokens = u.prompt_tokens;
            self.completion_tokens = u.completion_tokens;
            self.cached_tokens = u.cached_tokens;
            self.usage_seen = true;
        } else if !self.usage_seen {
            self.completion_tokens += m.token_ids.len() as u32;
        }
        let c = &mut self.choices[i];
        let mut lp = Value::Null;
        if self.logprobs {
            match self.kind {
                Kind::Chat => {
                    let entries: Vec<Value> = m.logprobs.iter().map(chat_lp).collect();
                    c.content.extend(entries.iter().cloned());
                    lp = json!({"content": entries});
                }
                Kind::Completion => {
                    let mut off = c.text.len();
                    let (mut toks, mut lps, mut tops, mut offs) = (vec![], vec![], vec![], vec![]);
                    for l in &m.logprobs {
                        toks.push(l.token.clone());
                        lps.push(l.logprob);
                        let mut top: serde_json::Map<String, Value> =
                            l.top_logprobs.iter().map(|t| (t.token.clone(), json!(t.logprob))).collect();
                        // The legacy completions API always lists the sampled token, so an entry
                        // holds up to `logprobs` + 1 alternatives (OpenAI's and vLLM's shape).
                        top.entry(l.token.clone()).or_insert_with(|| json!(l.logprob));
                        tops.push(Value::Object(top));
                        offs.push(off);
                        off += l.token.len();
                    }
                    c.tokens.extend(toks.iter().cloned());
                    c.token_logprobs.extend(lps.iter().map(|&l| Some(l)));
                    c.top.extend(tops.iter().cloned());
                    c.offsets.extend(offs.iter().copied());
                    lp = json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs});
                }
            }
        }
        let finish = finish_str(m.finish_reason);
        let pieces = match &mut c.parser {
            None => vec![Piece::Content(m.text.clone())],
            Some(p) => {
                let mut pieces = p.push(&m.text);
                if finish.is_some() {
                    pieces.extend(p.finish());
                }
                pieces
            }
        };
        for piece in &pieces {
            match piece {
                Piece::Content(t) => c.text.push_str(t),
                Piece::Call(call) => c.calls.push(call.clone()),
            }
        }
        if let Some(f) = finish {
            c.finish = Some(f);
        }
        (i, lp, pieces)
    }

    pub(super) fn chunk(&self, mut choices: Vec<Value>) -> Value {
        for c in &mut choices {
            c["index"] = json!(c["index"].as_u64().unwrap_or(0) as usize + self.index_base);
        }
        let object = if self.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
        let mut v =
            json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": choices});
        if self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }

    /// SSE events for one message.
    pub(super) fn stream_events(&mut self, m: &GenerateResponse, out: &mut BytesMut) {
        let (i, lp, pieces) = self.absorb(m);
        let finish = Self::finish_of(&self.choices[i], finish_str(m.finish_reason));
        match self.kind {
            Kind::Completion => {
                let (mut text, mut lp) = (m.text.clone(), lp);
                let c = &mut self.choices[i];
                if let Some(e) = &self.echo
                    && !c.echo_sent
                {
                    // The choice's first chunk carries the prompt (and its tokens' entries).
                    c.echo_sent = true;
                    text.insert_str(0, &e.text);
                    if self.logprobs {
                        let k = e.tokens.len();
                        let join = |head: Value, tail: &Value| {
                            let mut v = head.as_array().cloned().unwrap_or_default();
                            v.extend(tail.as_array().cloned().unwrap_or_default());
                            Value::Array(v)
                        };
                        lp = json!({
                            "tokens": join(json!(c.tokens[..k]), &lp["tokens"]),
                            "token_logprobs": join(json!(c.token_logprobs[..k]), &lp["token_logprobs"]),
                            "top_logprobs": join(json!(c.top[..k]), &lp["top_logprobs"]),
                            "text_offset": join(json!(c.offsets[..k]), &lp["text_offset"]),
                        });
                    }
                }
                let ch = json!({"index": i, "text": text, "logprobs": lp, "finish_reason": finish});
                sse::push_event(out, &self.chunk(vec![ch]));
            }
            Kind::Chat => {
                if !self.choices[i].role_sent {
                    self.choices[i].role_sent = true;
                    let ch = json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
                    sse::push_event(out, &self.chunk(vec![ch]));
                }
                let mut lp = Some(lp).filter(|_| !m.logprobs.is_empty());
                let mut calls = Vec::new();
                let mut content = String::new();
                for piece in pieces {
                    match piece {
                        Piece::Content(t) => content.push_str(&t),
                        Piece::Call(c) => calls.push(c),
                    }
                }
                if !content.is_empty() || lp.is_some() {
                    let lp = lp.take().unwrap_or(Value::Null);
                    let ch = json!({"index": i, "delta": {"content": content}, "logprobs": lp, "finish_reason": null});
                    sse::push_event(out, &self.chunk(vec![ch]));
                }
                // As OpenAI streams a call: id, type and name with empty arguments, then the
                // arguments (here in one piece, the call being complete).
                for c in calls {
                    let head = json!({"index": c.index, "id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": ""}});
                    let ch =
                        json!({"index": i, "delta": {"tool_calls": [head]}, "logprobs": null, "finish_reason": null});
                    sse::push_event(out, &self.chunk(vec![ch]));
                    let args = json!({"index": c.index, "function": {"arguments": c.arguments}});
                    let ch =
                        json!({"index": i, "delta": {"tool_calls": [args]}, "logprobs": null, "finish_reason": null});
                    sse::push_event(out, &self.chunk(vec![ch]));
                }
                if finish.is_some() {
                    let ch = json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": finish});
                    sse::push_event(out, &self.chunk(vec![ch]));
                }
            }
        }
    }

    pub(super) fn stream_end(&self, out: &mut BytesMut) {
        if self.include_usage {
            let mut v = self.chunk(vec![]);
            v["usage"] = self.usage();
            sse::push_event(out, &v);
        }
        out.extend_from_slice(sse::DONE);
    }

    pub(super) fn whole(&self) -> Value {
        let choices: Vec<Value> = self
            .choices
            .iter()
            .enumerate()
            .map(|(i, c)| (i + self.index_base, c))
            .map(|(i, c)| match self.kind {
                Kind::Completion => {
                    let lp = if self.logprobs {
                        json!({"tokens": c.tokens, "token_logprobs": c.token_logprobs, "top_logprobs": c.top, "text_offset": c.offsets})
                    } else {
                        Value::Null
                    };
                    json!({"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish})
                }
                Kind::Chat => {
                    let lp = if self.logprobs { json!({"content": c.content}) } else { Value::Null };
                    let mut message = json!({"role": "assistant", "content": c.text});
                    if self.tools && c.text.is_empty() {
                        message["content"] = Value::Null;
                    }
                    if !c.calls.is_empty() {
                        let calls: Vec<Value> = c
                            .calls
                            .iter()
                            .map(|t| json!({"id": t.id, "type": "function",
                                            "function": {"name": t.name, "arguments": t.arguments}}))
                            .collect();
                        message["tool_calls"] = Value::Array(calls);
                    }
                    let finish = Self::finish_of(c, c.finish);
                    json!({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
                }
            })
            .collect();
        let object = if self.kind == Kind::Chat { "chat.completion" } else { "text_completion" };
        json!({"id": self.id, "object": object, "created": self.created, "model": self.model,
               "choices": choices, "usage": self.usage()})
    }
}

#[cfg(test)]
#[path = "shaper_tests.rs"]
mod tests;
