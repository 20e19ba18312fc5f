//! Tests of the batch's merging: choice indexes `prompt_index * n + j`, usage summed over
//! prompts, one usage chunk and one `[DONE]` per stream, and errors naming the prompt.

use super::*;
use crate::tokenize::Echo;
use prism_common::proto::v1::{FinishReason, Usage};
use serde_json::json;

/// The shapers of a batch of `prompts` prompts with `n` choices each, as [`split`] sets them.
fn shapers(prompts: usize, n: u32, include_usage: bool) -> Vec<Shaper> {
    let mut out: Vec<Shaper> = Vec::new();
    for i in 0..prompts {
        let mut s = Shaper::new(Kind::Completion, "m".into(), n, false, include_usage);
        s.index_base = i * n as usize;
        if let Some(first) = out.first() {
            s.id.clone_from(&first.id);
            s.created = first.created;
        }
        out.push(s);
    }
    out
}

/// Choice `index` of one generation: `text`, and the last message (with the generation's
/// usage, as workers send it) when `usage` is given.
fn msg(index: u32, text: &str, usage: Option<(u32, u32)>) -> GenerateResponse {
    GenerateResponse {
        index,
        token_ids: vec![1],
        text: text.into(),
        finish_reason: if usage.is_some() { FinishReason::Length as i32 } else { 0 },
        usage: usage.map(|(p, c)| Usage { prompt_tokens: p, completion_tokens: c, cached_tokens: p / 2 }),
        prompt_tokens: usage.map_or(0, |(p, _)| p),
        ..GenerateResponse::default()
    }
}

fn events(out: &BytesMut) -> Vec<String> {
    String::from_utf8_lossy(out).split("\n\n").filter_map(|e| e.strip_prefix("data: ")).map(str::to_owned).collect()
}

/// Two prompts, n = 2: choices 0, 1 are prompt 0's, 2, 3 prompt 1's, whatever order the
/// messages came in; usage counts both prompts.
#[test]
fn whole_answer_orders_choices_by_prompt_and_sums_usage() {
    let mut s = shapers(2, 2, false);
    // Prompt 1 finishes first; its second choice before its first.
    s[1].absorb(&msg(1, "b1", Some((7, 1))));
    s[1].absorb(&msg(0, "b0", None));
    s[0].absorb(&msg(0, "a0", None));
    s[0].absorb(&msg(1, "a1", Some((5, 1))));
    let v = whole(&s);
    let got: Vec<(u64, &str)> = v["choices"]
        .as_array()
        .expect("choices")
        .iter()
        .map(|c| (c["index"].as_u64().unwrap_or(99), c["text"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(got, vec![(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]);
    assert_eq!(v["usage"]["prompt_tokens"], 12, "every prompt's tokens: {v}");
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert_eq!(v["usage"]["total_tokens"], 14);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 2 + 3);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["id"], json!(s[0].id), "one id for the batch");
}

/// Streamed: each chunk's choice carries its batch index, all chunks share the batch's id,
/// and the end is one usage chunk with every prompt's tokens, then one `[DONE]`.
#[test]
fn streamed_chunks_carry_batch_indexes_and_one_usage_chunk() {
    let mut s = shapers(3, 1, true);
    let mut out = BytesMut::new();
    s[2].stream_events(&msg(0, "c", Some((3, 1))), &mut out);
    s[0].stream_events(&msg(0, "a", Some((4, 1))), &mut out);
    s[1].stream_events(&msg(0, "b", Some((5, 1))), &mut out);
    stream_end(&s, &mut out);
    let ev = events(&out);
    assert_eq!(ev.iter().filter(|e| *e == "[DONE]").count(), 1);
    assert_eq!(ev.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = ev[..ev.len() - 1].iter().map(|e| serde_json::from_str(e).expect("json")).collect();
    let indexes: Vec<(u64, &str)> = chunks[..3]
        .iter()
        .map(|c| (c["choices"][0]["index"].as_u64().unwrap_or(99), c["choices"][0]["text"].as_str().unwrap_or("")))
        .collect();
    assert_eq!(indexes, vec![(2, "c"), (0, "a"), (1, "b")]);
    assert!(chunks.iter().all(|c| c["id"] == json!(s[0].id)));
    assert!(chunks[..3].iter().all(|c| c["usage"].is_null()));
    let usage = &chunks[3];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        (usage["usage"]["prompt_tokens"].as_u64(), usage["usage"]["completion_tokens"].as_u64()),
        (Some(12), Some(3))
    );

    // Without include_usage: only `[DONE]`.
    let s = shapers(2, 1, false);
    let mut out = BytesMut::new();
    stream_end(&s, &mut out);
    assert_eq!(events(&out), vec!["[DONE]".to_owned()]);
}

/// `echo` with `max_tokens: 0`: each prompt's choices hold that prompt, usage counts all.
#[test]
fn echo_only_batch_echoes_each_prompt() {
    let mut s: Vec<Shaper> = shapers(2, 2, false)
        .into_iter()
        .zip(["one", "two three"])
        .map(|(s, t)| s.with_echo(Echo { text: t.into(), tokens: vec![], prompt_tokens: Some(t.len() as u32) }))
        .collect();
    for sh in &mut s {
        for m in sh.prompt_only() {
            sh.absorb(&m);
        }
    }
    let v = whole(&s);
    let texts: Vec<&str> =
        v["choices"].as_array().expect("choices").iter().filter_map(|c| c["text"].as_str()).collect();
    assert_eq!(texts, vec!["one", "one", "two three", "two three"]);
    assert_eq!(v["usage"]["prompt_tokens"], 3 + 9);
    assert_eq!(v["usage"]["completion_tokens"], 0);
}

/// A generation's 400 names its prompt; other errors are the request's as they are.
#[test]
fn errors_name_the_prompt_of_a_400() {
    let fields = ErrorFields { structured: None, tools: None };
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert(super::super::errors::PARAM_METADATA, "prompt".parse().expect("ascii"));
    let worker = tonic::Status::with_metadata(tonic::Code::InvalidArgument, "prompt is too long", md);
    let e = failed(&fields, 1, DispatchError::Worker(worker));
    assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("prompt")));
    assert!(e.message.starts_with("prompt[1]: "), "{}", e.message);
    let e = failed(&fields, 1, DispatchError::NoReplica("m".into()));
    assert_eq!(e.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!e.message.starts_with("prompt["), "{}", e.message);
}

/// A grammar failing mid-generation names the client's field, as for one prompt, never the
/// engine's `structured_output.*`.
#[test]
fn a_grammar_failure_names_the_clients_field() {
    let fields = ErrorFields { structured: Some("guided_json"), tools: None };
    let mut md = tonic::metadata::MetadataMap::new();
    md.insert(super::super::errors::PARAM_METADATA, "structured_output.json_schema".parse().expect("ascii"));
    let message = "structured_output.json_schema: the grammar failed mid-generation";
    let worker = tonic::Status::with_metadata(tonic::Code::InvalidArgument, message, md);
    let e = failed(&fields, 0, DispatchError::Worker(worker));
    assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some("guided_json")));
    assert_eq!(e.message, "prompt[0]: guided_json: the grammar failed mid-generation");
}
