//! Tests of grammars past llguidance's per-step limits (`max_items_in_row`): one over them
//! at its first tokens is refused at submit, naming its field; one that reaches them only
//! later ends its request with that error (never a bare `abort`), frees its KV blocks and
//! leaves a neighbouring request untouched.

use super::test_double::{ByteCodec, EOS, PagedEchoBackend};
use super::{
    EngineError, EngineHandle, EngineOutput, EngineParts, EngineRequest, FinishReason, OutputStream, Prompt,
    RuntimeConfig, SamplingParams, StructuredOutput,
};
use crate::backend::StepControl;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn engine() -> EngineHandle {
    let parts = EngineParts {
        backend: Box::new(PagedEchoBackend::new(256, 4)),
        codec: Arc::new(ByteCodec::new()),
        eos_ids: vec![EOS],
        model_max_len: 512,
        control: StepControl::default(),
    };
    EngineHandle::start_with_parts(parts, RuntimeConfig::default()).expect("engine starts")
}

fn request(structured: Option<StructuredOutput>, logit_bias: Vec<(u32, f32)>) -> EngineRequest {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(24),
        ignore_eos: true,
        structured,
        logit_bias,
        ..SamplingParams::default()
    };
    EngineRequest {
        id: "g".into(),
        prompt: Prompt::Text("json please".into()),
        params,
        prior_output_ids: Vec::new(),
        deadline: None,
        cache_salt: None,
        tools: None,
        chat_template_kwargs: None,
    }
}

/// `{"type":"object","properties":{"f0":{"type":"integer"}, …}}` with `n` optional properties
/// (about 4 Earley items each in the row after `{`: over 2000 from ~500 on).
fn wide_object(n: usize) -> String {
    let props: Vec<String> = (0..n).map(|i| format!(r#""f{i}":{{"type":"integer"}}"#)).collect();
    format!(r#"{{"type":"object","properties":{{{}}}}}"#, props.join(","))
}

fn drain(mut s: OutputStream) -> Vec<EngineOutput> {
    let mut out = Vec::new();
    while let Some(o) = s.blocking_recv() {
        out.push(o);
    }
    out
}

fn wait_idle(e: &EngineHandle) {
    let t0 = Instant::now();
    loop {
        let s = e.stats();
        if s.requests_in_flight == 0 && s.running == 0 && s.free_blocks == s.total_blocks {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "engine did not return to idle: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_grammar_over_the_row_limit_at_its_first_token_is_refused_at_submit() {
    let e = engine();
    let wide = StructuredOutput::JsonSchema(wide_object(3000));
    match e.submit(request(Some(wide), Vec::new())) {
        Err(EngineError::InvalidRequest { field, message }) => {
            assert_eq!(field, "structured_output.json_schema");
            assert!(!message.contains("<non-verbose/>"), "llguidance's marker is left out: {message}");
        }
        Err(other) => panic!("expected InvalidRequest, got {other:?}"),
        Ok(_) => panic!("a schema whose first token exceeds max_items_in_row was accepted"),
    }
    // Well under the limit: accepted, and the output is the schema's.
    let s = e.submit(request(Some(StructuredOutput::JsonSchema(wide_object(100))), Vec::new())).expect("accepted");
    let out = drain(s);
    assert!(out.iter().all(|o| o.error.is_none()), "{out:?}");
    assert!(out.iter().map(|o| o.text.as_str()).collect::<String>().starts_with('{'));
    wait_idle(&e);
    e.shutdown();
}

#[test]
fn a_grammar_that_fails_mid_generation_ends_with_its_error_and_frees_its_blocks() {
    let e = engine();
    // The wide object sits under an optional property: the first steps (`{`, then `"` or `}`)
    // are small, so submit accepts it; a bias towards `"` walks into `{"a":{`, whose row is
    // over the limit.
    let nested = format!(r#"{{"type":"object","properties":{{"a":{}}}}}"#, wide_object(600));
    let failing = e
        .submit(request(Some(StructuredOutput::JsonSchema(nested)), vec![(u32::from(b'"'), 100.0)]))
        .expect("accepted: its first tokens are within the limits");
    let neighbour = e.submit(request(None, Vec::new())).expect("accepted");
    let out = drain(failing);
    let last = out.last().expect("an output");
    assert_eq!(last.finish_reason, Some(FinishReason::Abort));
    match &last.error {
        Some(EngineError::InvalidRequest { field, .. }) => assert_eq!(*field, "structured_output.json_schema"),
        other => panic!("the failed choice must carry the grammar's error, got {other:?} after {out:?}"),
    }
    assert!(out.iter().rev().skip(1).all(|o| o.error.is_none() && o.finish_reason.is_none()));
    let text: String = out.iter().map(|o| o.text.as_str()).collect();
    assert!(text.starts_with(r#"{"a":"#), "the bias walked into the wide object: {text:?}");
    // The neighbour is untouched: all its tokens, finish `length`.
    let n = drain(neighbour);
    assert_eq!(n.iter().map(|o| o.token_ids.len()).sum::<usize>(), 24);
    assert_eq!(n.last().and_then(|o| o.finish_reason), Some(FinishReason::Length));
    assert!(n.iter().all(|o| o.error.is_none()));
    wait_idle(&e);
    e.shutdown();
}
