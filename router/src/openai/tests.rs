//! Tests of the response shaping: usage, echo.

use super::*;
use prism_common::proto::v1::Usage;

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
    assert_eq!(c["logprobs"]["top_logprobs"], json!([null, null, {}, {}]));
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
