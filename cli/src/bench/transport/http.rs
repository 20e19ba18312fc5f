//! The OpenAI HTTP transport: streamed `POST /v1/completions` (`--backend openai`) or
//! `/v1/chat/completions` (`--backend openai-chat`) with `stream_options.include_usage`, so
//! the last chunk carries `usage` (the exact prompt and completion token counts, and the prompt
//! tokens served from the prefix cache in `prompt_tokens_details.cached_tokens`). Server-sent
//! events are parsed here ([`SseParser`]); a chunk whose text (completions `text`, chat
//! `delta.content`) is not empty is a token arrival. Non-2xx answers count as `http CODE`
//! with the OpenAI error body's message.

use super::stream::{RequestOptions, Timeline};
use crate::bench::dataset::{BenchRequest, Prompt};
use crate::bench::stats::{Failure, Record};
use futures::StreamExt;
use serde_json::{Value, json};

/// Splits a byte stream into the `data:` payloads of server-sent events.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Adds bytes; returns the payloads of the events they complete, in order.
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        // `\r` never occurs inside a JSON payload (it is escaped), so dropping it turns
        // CRLF framing into LF framing.
        self.buf.extend(bytes.iter().filter(|&&b| b != b'\r'));
        let mut out = Vec::new();
        while let Some(end) = self.buf.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event[..end]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// An OpenAI-compatible endpoint.
#[derive(Debug, Clone)]
pub struct HttpClient {
    client: reqwest::Client,
    base_url: String,
    url: String,
    chat: bool,
}

fn failure(status: &str, message: impl Into<String>) -> Failure {
    Failure { status: status.to_owned(), message: message.into() }
}

/// An error with its causes (`error sending request: connection refused`).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        source = cause.source();
    }
    s
}

/// The message of an OpenAI error body (`{"error": {"message": …}}`), else the body.
fn error_message(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v.pointer("/error/message").and_then(Value::as_str).map(str::to_owned))
        .unwrap_or_else(|| body.chars().take(200).collect())
}

/// The request body for `req`; `chat` selects the chat completions shape.
///
/// # Errors
/// A prompt the endpoint cannot take (token ids on chat, a conversation on completions).
pub fn body(opts: &RequestOptions, req: &BenchRequest, chat: bool) -> Result<Value, Failure> {
    let mut body = json!({
        "model": opts.model,
        "max_tokens": req.output_len,
        "temperature": opts.temperature,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if opts.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    match (&req.prompt, chat) {
        (Prompt::TokenIds(ids), false) => body["prompt"] = json!(ids),
        (Prompt::Text(t), false) => body["prompt"] = json!(t),
        (Prompt::Text(t), true) => body["messages"] = json!([{"role": "user", "content": t}]),
        (Prompt::Chat(m), true) => {
            body["messages"] = Value::Array(m.iter().map(|m| json!({"role": m.role, "content": m.content})).collect());
        }
        (Prompt::TokenIds(_), true) => {
            return Err(failure("dataset", "token-id prompts need --backend openai or grpc"));
        }
        (Prompt::Chat(_), false) => return Err(failure("dataset", "chat prompts need --backend openai-chat or grpc")),
    }
    Ok(body)
}

/// What the chunks of one stream told so far.
#[derive(Debug, Default)]
pub struct ChunkState {
    /// `usage.prompt_tokens` of the last chunk that had it.
    pub prompt_tokens: Option<usize>,
    /// `usage.completion_tokens` of the last chunk that had it.
    pub completion_tokens: Option<usize>,
    /// `usage.prompt_tokens_details.cached_tokens` of the last chunk that had it.
    pub cached_tokens: Option<usize>,
    /// `data: [DONE]` arrived.
    pub done: bool,
}

impl ChunkState {
    /// Folds one event payload in; returns whether it carried new text (a token arrival).
    ///
    /// # Errors
    /// A payload that is not JSON, or an error object in the stream.
    pub fn absorb(&mut self, data: &str, chat: bool) -> Result<bool, Failure> {
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(false);
        }
        let v: Value = serde_json::from_str(data).map_err(|e| failure("stream", format!("bad SSE chunk: {e}")))?;
        if let Some(e) = v.get("error") {
            let message = e.get("message").and_then(Value::as_str).unwrap_or("error in stream");
            return Err(failure("stream", message));
        }
        if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
            let count = |k: &str| u.get(k).and_then(Value::as_u64).map(|n| n as usize);
            self.prompt_tokens = count("prompt_tokens").or(self.prompt_tokens);
            self.completion_tokens = count("completion_tokens").or(self.completion_tokens);
            let cached = u.pointer("/prompt_tokens_details/cached_tokens").and_then(Value::as_u64);
            self.cached_tokens = cached.map(|n| n as usize).or(self.cached_tokens);
        }
        let choice = v.get("choices").and_then(|c| c.get(0));
        let text = match (choice, chat) {
            (Some(c), false) => c.get("text"),
            (Some(c), true) => c.pointer("/delta/content"),
            (None, _) => None,
        };
        Ok(text.and_then(Value::as_str).is_some_and(|t| !t.is_empty()))
    }
}

impl HttpClient {
    /// A client for `base_url` (`http://host:port`) posting to `endpoint`.
    ///
    /// # Errors
    /// When the HTTP client cannot be built.
    pub fn new(base_url: &str, endpoint: &str, chat: bool, api_key: Option<&str>) -> anyhow::Result<Self> {
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(key) = api_key {
            let v = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
                .map_err(|_| anyhow::anyhow!("--api-key holds characters not allowed in a header"))?;
            headers.insert(reqwest::header::AUTHORIZATION, v);
        }
        let client = reqwest::Client::builder().tcp_nodelay(true).default_headers(headers).build()?;
        let base_url = base_url.trim_end_matches('/').to_owned();
        let url = format!("{base_url}/{}", endpoint.trim_start_matches('/'));
        Ok(Self { client, base_url, url, chat })
    }

    /// The served models (`GET /v1/models`).
    ///
    /// # Errors
    /// When the server does not answer or answers something else than a model list.
    pub async fn models(&self) -> anyhow::Result<Vec<String>> {
        let url = format!("{}/v1/models", self.base_url);
        let resp = self.client.get(&url).send().await.map_err(|e| anyhow::anyhow!("cannot reach {url}: {e}"))?;
        let status = resp.status();
        let text = resp.text().await?;
        if !status.is_success() {
            anyhow::bail!("GET {url}: HTTP {status}: {}", error_message(&text));
        }
        let v: Value = serde_json::from_str(&text)?;
        let data = v.get("data").and_then(Value::as_array).ok_or_else(|| anyhow::anyhow!("GET {url}: no data"))?;
        Ok(data.iter().filter_map(|m| m.get("id").and_then(Value::as_str).map(str::to_owned)).collect())
    }

    /// Sends one request and times its stream.
    ///
    /// # Errors
    /// A [`Failure`] classed by HTTP status, transport or stream error.
    pub async fn send(&self, opts: &RequestOptions, req: &BenchRequest) -> Result<Record, Failure> {
        let body = body(opts, req, self.chat)?;
        let mut timeline = Timeline::start();
        let resp = self.client.post(&self.url).json(&body).send().await.map_err(|e| failure("transport", chain(&e)))?;
        let status = resp.status();
        if !status.is_success() {
            let text = resp.text().await.unwrap_or_default();
            return Err(failure(&format!("http {}", status.as_u16()), error_message(&text)));
        }
        let mut parser = SseParser::default();
        let mut state = ChunkState::default();
        let mut bytes = resp.bytes_stream();
        while let Some(chunk) = bytes.next().await {
            let chunk = chunk.map_err(|e| failure("stream", chain(&e)))?;
            for data in parser.push(&chunk) {
                if state.absorb(&data, self.chat)? {
                    timeline.token_chunk();
                }
            }
        }
        if !state.done {
            return Err(failure("stream", "stream ended before data: [DONE]"));
        }
        let mut record = timeline.finish(state.prompt_tokens.unwrap_or(req.prompt_len), state.completion_tokens);
        record.cached_tokens = state.cached_tokens;
        Ok(record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::dataset::Message;

    fn opts() -> RequestOptions {
        RequestOptions { model: "m".into(), temperature: 0.0, ignore_eos: true, api_key: None }
    }

    #[test]
    fn sse_events_split_across_reads() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\"").is_empty());
        assert_eq!(p.push(b":1}\n\ndata: [DO"), vec!["{\"a\":1}".to_owned()]);
        assert_eq!(p.push(b"NE]\r\n\r\n: comment\n\n"), vec!["[DONE]".to_owned()]);
        assert_eq!(p.push(b"event: x\ndata: a\ndata: b\n\n"), vec!["a\nb".to_owned()]);
    }

    #[test]
    fn chunks_count_text_and_read_usage() {
        let mut s = ChunkState::default();
        assert!(s.absorb(r#"{"choices":[{"index":0,"text":"Hi"}],"usage":null}"#, false).unwrap());
        assert!(!s.absorb(r#"{"choices":[{"index":0,"text":""}]}"#, false).unwrap());
        assert!(!s.absorb(r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":8}}"#, false).unwrap());
        assert!(!s.absorb("[DONE]", false).unwrap());
        assert_eq!((s.prompt_tokens, s.completion_tokens, s.done), (Some(5), Some(8), true));
        assert_eq!(s.cached_tokens, None, "a server without prefix caching reports no cached tokens");
        let mut hit = ChunkState::default();
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":32}}}"#;
        assert!(!hit.absorb(usage, false).unwrap());
        assert_eq!((hit.prompt_tokens, hit.cached_tokens), (Some(40), Some(32)));
        let null_details = r#"{"choices":[],"usage":{"prompt_tokens":4,"prompt_tokens_details":null}}"#;
        assert_eq!(ChunkState::default().absorb(null_details, false).map(|_| ()), Ok(()));
        let mut c = ChunkState::default();
        assert!(!c.absorb(r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#, true).unwrap());
        assert!(c.absorb(r#"{"choices":[{"delta":{"content":" there"}}]}"#, true).unwrap());
        assert!(!c.absorb(r#"{"choices":[{"delta":{},"finish_reason":"length"}]}"#, true).unwrap());
        let err = c.absorb(r#"{"error":{"message":"boom"}}"#, true).unwrap_err();
        assert_eq!(err.status, "stream");
        assert_eq!(c.absorb("not json", true).unwrap_err().status, "stream");
    }

    #[test]
    fn bodies_follow_the_endpoint() {
        let ids = BenchRequest { prompt: Prompt::TokenIds(vec![7, 8]), prompt_len: 2, output_len: 4 };
        let b = body(&opts(), &ids, false).unwrap();
        assert_eq!(b["prompt"], json!([7, 8]));
        assert_eq!(b["max_tokens"], json!(4));
        assert_eq!(b["ignore_eos"], json!(true));
        assert_eq!(b["stream_options"]["include_usage"], json!(true));
        assert_eq!(body(&opts(), &ids, true).unwrap_err().status, "dataset");
        let chat = BenchRequest {
            prompt: Prompt::Chat(vec![Message { role: "user".into(), content: "hi".into() }]),
            prompt_len: 1,
            output_len: 4,
        };
        assert_eq!(body(&opts(), &chat, true).unwrap()["messages"], json!([{"role": "user", "content": "hi"}]));
        assert!(body(&opts(), &chat, false).is_err());
        let text = BenchRequest { prompt: Prompt::Text("hi".into()), prompt_len: 1, output_len: 4 };
        assert_eq!(body(&opts(), &text, true).unwrap()["messages"][0]["content"], json!("hi"));
        assert_eq!(body(&opts(), &text, false).unwrap()["prompt"], json!("hi"));
    }

    #[test]
    fn error_bodies() {
        assert_eq!(error_message(r#"{"error":{"message":"queue full","type":"x"}}"#), "queue full");
        assert_eq!(error_message("plain"), "plain");
    }
}
