//! Tests of the response shaping: usage, echo, tool calls.

use super::*;
use crate::dispatch::DispatchError;
use crate::metrics::Outcome;
use crate::openai::errors::ApiError;
use axum::http::StatusCode;
use prism_common::proto::v1::{TopLogprob, Usage};

fn last(cached_tokens: u32) -> GenerateResponse {
    GenerateResponse {
        token_ids: vec![7],
        text: "x".into(),
        finish_reason: FinishReason::Length as i32,
        usage: Some(Usage { prompt_tokens: 40, completion_tokens: 1, cached_tokens }),
        prompt_tokens: 40,
        ..GenerateResponse::default()
    }
}

/// The worker's cached-token count is OpenAI's `usage.prompt_tokens_details.cached_tokens`,
/// in whole responses and in the streamed usage chunk of both endpoints.
#[test]
fn usage_carries_cached_tokens_whole_and_streamed() {
    for kind in [Kind::Completion, Kind::Chat] {
        let mut whole = Shaper::new(kind, "m".into(), 1, false, false);
        whole.absorb(&last(32));
        let v = whole.whole();
        assert_eq!(v["usage"]["prompt_tokens_details"], json!({"cached_tokens": 32}));
        assert_eq!(v["usage"]["total_tokens"], 41);

        let mut streamed = Shaper::new(kind, "m".into(), 1, false, true);
        let mut out = BytesMut::new();
        streamed.stream_events(&last(0), &mut out);
        streamed.stream_end(&mut out);
        let text = String::from_utf8_lossy(&out).into_owned();
        let usage_chunk = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .find(|c| c["usage"].is_object())
            .expect("a usage chunk");
        assert_eq!(usage_chunk["choices"], json!([]));
        assert_eq!(usage_chunk["usage"]["prompt_tokens_details"]["cached_tokens"], 0, "a miss reports 0");
    }
}

fn out_token(text: &str, lp: f32, finish: bool) -> GenerateResponse {
    GenerateResponse {
        token_ids: vec![9],
        text: text.into(),
        logprobs: vec![TokenLogprob { token: text.into(), logprob: lp, ..Default::default() }],
        finish_reason: if finish { FinishReason::Length as i32 } else { 0 },
        ..GenerateResponse::default()
    }
}

/// `echo`: the prompt precedes the output in `text` (whole) or in each choice's first
/// chunk (streamed); with logprobs its tokens come first with null logprobs and offsets
/// counted from the prompt's start.
#[test]
fn echo_prefixes_text_and_logprobs_whole_and_streamed() {
    let echo = Echo { text: "Hi there".into(), tokens: vec!["Hi".into(), " there".into()], prompt_tokens: Some(2) };
    let mut whole = Shaper::new(Kind::Completion, "m".into(), 1, true, false).with_echo(echo.clone());
    whole.absorb(&out_token(" you", -0.5, false));
    whole.absorb(&out_token("!", -1.0, true));
    let v = whole.whole();
    let c = &v["choices"][0];
    assert_eq!(c["text"], "Hi there you!");
    assert_eq!(c["logprobs"]["tokens"], json!(["Hi", " there", " you", "!"]));
    assert_eq!(c["logprobs"]["token_logprobs"], json!([null, null, -0.5, -1.0]));
    // `logprobs: 0`: each generated token's entry lists the sampled token alone.
    assert_eq!(c["logprobs"]["top_logprobs"], json!([null, null, {" you": -0.5}, {"!": -1.0}]));
    assert_eq!(c["logprobs"]["text_offset"], json!([0, 2, 8, 12]));
    assert_eq!(v["usage"]["prompt_tokens"], 2);

    let mut streamed = Shaper::new(Kind::Completion, "m".into(), 1, true, false).with_echo(echo);
    let mut out = BytesMut::new();
    streamed.stream_events(&out_token(" you", -0.5, false), &mut out);
    streamed.stream_events(&out_token("!", -1.0, true), &mut out);
    let chunks: Vec<Value> = String::from_utf8_lossy(&out)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|e| serde_json::from_str(e).ok())
        .collect();
    assert_eq!(chunks.len(), 2);
    assert_eq!(chunks[0]["choices"][0]["text"], "Hi there you");
    assert_eq!(chunks[0]["choices"][0]["logprobs"]["token_logprobs"], json!([null, null, -0.5]));
    assert_eq!(chunks[0]["choices"][0]["logprobs"]["text_offset"], json!([0, 2, 8]));
    assert_eq!(chunks[1]["choices"][0]["text"], "!", "the prompt goes out once");
    assert_eq!(chunks[1]["choices"][0]["logprobs"]["text_offset"], json!([12]));
}

/// `echo` with `max_tokens: 0`: every choice is the prompt alone, usage counts the prompt.
#[test]
fn echo_with_zero_max_tokens_is_the_prompt_alone() {
    let echo = Echo { text: "abc".into(), tokens: vec![], prompt_tokens: Some(3) };
    let mut s = Shaper::new(Kind::Completion, "m".into(), 2, false, false).with_echo(echo);
    for m in s.prompt_only() {
        s.absorb(&m);
    }
    let v = s.whole();
    for i in 0..2 {
        assert_eq!(v["choices"][i]["text"], "abc");
        assert_eq!(v["choices"][i]["finish_reason"], "length");
    }
    assert_eq!((v["usage"]["prompt_tokens"].as_u64(), v["usage"]["completion_tokens"].as_u64()), (Some(3), Some(0)));
}

/// The messages of one choice whose text is `text`, cut into pieces of `size` bytes
/// (on char boundaries), the last one ending with `stop`.
fn pieces(text: &str, size: usize) -> Vec<GenerateResponse> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < text.len() {
        let mut end = (at + size).min(text.len());
        while !text.is_char_boundary(end) {
            end += 1;
        }
        out.push(GenerateResponse { token_ids: vec![1], text: text[at..end].into(), ..Default::default() });
        at = end;
    }
    if let Some(last) = out.last_mut() {
        last.finish_reason = FinishReason::Stop as i32;
    }
    out
}

fn events(out: &BytesMut) -> Vec<Value> {
    String::from_utf8_lossy(out)
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|e| serde_json::from_str::<Value>(e).ok())
        .collect()
}

const CALLS: &str = "Checking.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>";

/// Whole: `message.tool_calls` with ids, JSON-text arguments, the text outside the calls
/// as content, finish reason `tool_calls`; only calls → `content: null`.
#[test]
fn whole_chat_returns_tool_calls() {
    let mut sh = Shaper::new(Kind::Chat, "m".into(), 1, false, false);
    sh.parse_tools(ParserKind::Hermes);
    for m in pieces(CALLS, 7) {
        sh.absorb(&m);
    }
    let v = sh.whole();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Checking.");
    let calls = choice["message"]["tool_calls"].as_array().expect("calls");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"], json!({"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}));
    assert!(calls[0]["id"].as_str().is_some_and(|id| id.starts_with("call_")));
    assert_ne!(calls[0]["id"], calls[1]["id"]);

    let mut only = Shaper::new(Kind::Chat, "m".into(), 1, false, false);
    only.parse_tools(ParserKind::Hermes);
    only.absorb(&pieces("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", 100)[0]);
    assert_eq!(only.whole()["choices"][0]["message"]["content"], Value::Null);
    // Without tools nothing is parsed.
    let mut plain = Shaper::new(Kind::Chat, "m".into(), 1, false, false);
    for m in pieces(CALLS, 100) {
        plain.absorb(&m);
    }
    let v = plain.whole();
    assert_eq!(
        (v["choices"][0]["message"]["content"].as_str(), v["choices"][0]["finish_reason"].as_str()),
        (Some(CALLS), Some("stop"))
    );
}

/// Streamed, cut at any size: content deltas carry only the text outside calls, each call
/// comes as a head chunk (index, id, type, name, empty arguments) then its arguments, and
/// the last chunk has finish reason `tool_calls`.
#[test]
fn streamed_chat_sends_tool_call_deltas() {
    for size in [1, 2, 3, 5, 8, 13, 1000] {
        let mut sh = Shaper::new(Kind::Chat, "m".into(), 1, false, false);
        sh.parse_tools(ParserKind::Hermes);
        let mut out = BytesMut::new();
        for m in pieces(CALLS, size) {
            sh.stream_events(&m, &mut out);
        }
        sh.stream_end(&mut out);
        let mut content = String::new();
        let mut calls: Vec<(String, String, String)> = Vec::new();
        let mut finish = Vec::new();
        for e in events(&out) {
            let ch = &e["choices"][0];
            if let Some(t) = ch["delta"]["content"].as_str() {
                content.push_str(t);
            }
            for d in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
                let idx = d["index"].as_u64().expect("index") as usize;
                if idx == calls.len() {
                    assert_eq!(d["type"], "function");
                    assert_eq!(d["function"]["arguments"], "", "the head chunk has empty arguments");
                    let id = d["id"].as_str().expect("id").to_owned();
                    calls.push((id, d["function"]["name"].as_str().expect("name").to_owned(), String::new()));
                } else {
                    assert!(d.get("id").is_none() && d["function"].get("name").is_none(), "{d}");
                    calls[idx].2.push_str(d["function"]["arguments"].as_str().expect("args"));
                }
            }
            if let Some(f) = ch["finish_reason"].as_str() {
                finish.push(f.to_owned());
            }
        }
        assert_eq!(content, "Checking.", "size {size}");
        assert!(!content.contains("tool_call"));
        let got: Vec<(&str, &str)> = calls.iter().map(|(_, n, a)| (n.as_str(), a.as_str())).collect();
        assert_eq!(got, [("get_weather", "{\"city\":\"Paris\"}"), ("add", "{\"a\":1}")], "size {size}");
        assert_eq!(finish, ["tool_calls"]);
        assert!(out.ends_with(sse::DONE));
    }
}

/// Completions `logprobs: N`: each entry holds the top N and the sampled token, which is
/// added when it is not among them (up to N + 1 entries, as OpenAI and vLLM return).
#[test]
fn completion_top_logprobs_always_hold_the_sampled_token() {
    let top = |pairs: &[(&str, f32)]| -> Vec<TopLogprob> {
        pairs.iter().map(|&(t, l)| TopLogprob { token: t.into(), logprob: l, ..Default::default() }).collect()
    };
    let mut shaper = Shaper::new(Kind::Completion, "m".into(), 1, true, false);
    let mut outside = out_token(" z", -3.0, false);
    outside.logprobs[0].top_logprobs = top(&[(" a", -0.25), (" b", -1.5)]);
    let mut inside = out_token(" a", -0.25, true);
    inside.logprobs[0].top_logprobs = top(&[(" a", -0.25), (" b", -1.5)]);
    shaper.absorb(&outside);
    shaper.absorb(&inside);
    let v = shaper.whole();
    assert_eq!(
        v["choices"][0]["logprobs"]["top_logprobs"],
        json!([{" a": -0.25, " b": -1.5, " z": -3.0}, {" a": -0.25, " b": -1.5}])
    );
}

/// tonic's refusal of a message over its size limit on the router ↔ worker hop (OUT_OF_RANGE)
/// is the router's problem: 500 / INTERNAL with a message of ours, never a 400 quoting tonic.
#[test]
fn an_internal_hop_size_refusal_is_a_500_without_tonic_text() {
    let tonic_text = "Error, decoded message length too large: found 4200132 bytes, the limit is: 4194304 bytes";
    let refused = || DispatchError::Worker(tonic::Status::out_of_range(tonic_text));
    let api = ApiError::from(refused());
    assert_eq!(api.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!api.message.contains("length too large"), "{}", api.message);
    assert_eq!(api.outcome(), Outcome::Error);
    let grpc = crate::grpc::to_status(refused());
    assert_eq!(grpc.code(), tonic::Code::Internal);
    assert!(!grpc.message().contains("length too large"), "{}", grpc.message());
}
