//! Unit tests: proto ↔ engine conversion and the engine-error mapping.

use super::*;
use prism_engine::{TopLogprob, Usage};
use tonic::Code;

fn wreq(req: pb::GenerateRequest) -> pb::WorkerGenerateRequest {
    pb::WorkerGenerateRequest {
        replica_id: "r".into(),
        request: Some(req),
        prior_output_ids: vec![5, 6],
        ..Default::default()
    }
}

#[test]
fn unset_sampling_fields_take_engine_defaults() {
    let s = sampling_from_proto(Some(pb::SamplingParams::default()));
    let d = SamplingParams::default();
    assert_eq!(s.temperature, d.temperature);
    assert_eq!(s.top_p, d.top_p);
    assert_eq!(s.top_k, d.top_k);
    assert_eq!(s.n, 1);
    assert_eq!(s.max_tokens, None);
    assert_eq!(s.seed, None);
    assert_eq!(s.logprobs, None);
    let none = sampling_from_proto(None);
    assert!(none.skip_special_tokens, "no sampling message = engine defaults");
    let unset = sampling_from_proto(Some(pb::SamplingParams::default()));
    assert!(unset.skip_special_tokens, "unset skip_special_tokens = true");
}

#[test]
fn set_sampling_fields_pass_through() {
    let p = pb::SamplingParams {
        temperature: Some(0.0),
        top_p: Some(0.5),
        top_k: Some(7),
        min_p: Some(0.1),
        seed: Some(42),
        repetition_penalty: Some(1.2),
        frequency_penalty: Some(-0.5),
        presence_penalty: Some(0.5),
        stop: vec!["\n".into()],
        stop_token_ids: vec![2],
        max_tokens: Some(-1),
        ignore_eos: true,
        n: Some(3),
        logprobs: Some(0),
        skip_special_tokens: Some(false),
        ..Default::default()
    };
    let s = sampling_from_proto(Some(p));
    assert_eq!(s.temperature, 0.0);
    assert_eq!(s.top_p, 0.5);
    assert_eq!(s.top_k, 7);
    assert_eq!(s.min_p, 0.1);
    assert_eq!(s.seed, Some(42));
    assert_eq!(s.repetition_penalty, 1.2);
    assert_eq!((s.frequency_penalty, s.presence_penalty), (-0.5, 0.5));
    assert_eq!(s.stop, vec!["\n".to_owned()]);
    assert_eq!(s.stop_token_ids, vec![2]);
    assert_eq!(s.max_tokens, Some(-1), "validation is the engine's job");
    assert!(s.ignore_eos);
    assert_eq!(s.n, 3);
    assert_eq!(s.logprobs, Some(0));
    assert!(!s.skip_special_tokens);
}

#[test]
fn request_conversion_prompts_deadline_and_prior_ids() -> anyhow::Result<()> {
    let now = Instant::now();
    let r = engine_request_from_proto(
        wreq(pb::GenerateRequest {
            model: "m".into(),
            prompt: Some(pb::generate_request::Prompt::TokenIds(pb::TokenIds { ids: vec![1, 2, 3] })),
            sampling: None,
            request_id: "abc".into(),
            timeout_ms: Some(1500),
            cache_salt: Some("tenant-a".into()),
            ..Default::default()
        }),
        now,
        None,
    )?;
    assert!(matches!(&r.prompt, Prompt::TokenIds(ids) if *ids == vec![1, 2, 3]));
    assert_eq!(r.id.as_str(), "abc");
    assert_eq!(r.deadline, Some(now + Duration::from_millis(1500)));
    assert_eq!(r.prior_output_ids, vec![5, 6]);
    assert_eq!(r.cache_salt.as_deref(), Some("tenant-a"));

    let chat = engine_request_from_proto(
        wreq(pb::GenerateRequest {
            prompt: Some(pb::generate_request::Prompt::Chat(pb::ChatMessages {
                messages: vec![pb::ChatMessage { role: "user".into(), content: "hi".into(), ..Default::default() }],
            })),
            timeout_ms: Some(0),
            ..Default::default()
        }),
        now,
        None,
    )?;
    assert!(
        matches!(&chat.prompt, Prompt::Chat(m) if *m == vec![ChatMessage { role: "user".into(), content: "hi".into(), ..Default::default() }])
    );
    assert_eq!(chat.deadline, None, "timeout 0 = no deadline");
    assert!(!chat.id.as_str().is_empty(), "empty request id gets a fresh one");
    assert_eq!(chat.cache_salt, None);
    Ok(())
}

fn with_router_ids(ids: Vec<u32>, fingerprint: u64) -> pb::WorkerGenerateRequest {
    pb::WorkerGenerateRequest {
        prompt_token_ids: ids,
        codec_fingerprint: fingerprint,
        ..wreq(pb::GenerateRequest {
            model: "m".into(),
            prompt: Some(pb::generate_request::Prompt::Text("hello".into())),
            ..Default::default()
        })
    }
}

/// The router's token ids replace the prompt only when they were computed with this
/// replica's codec (same fingerprint); otherwise the worker tokenizes the prompt itself.
#[test]
fn router_token_ids_are_used_only_with_the_replicas_codec_fingerprint() -> anyhow::Result<()> {
    let now = Instant::now();
    let matched = engine_request_from_proto(with_router_ids(vec![1, 9, 9], 42), now, Some(42))?;
    assert!(matches!(&matched.prompt, Prompt::TokenIds(ids) if *ids == vec![1, 9, 9]), "{:?}", matched.prompt);
    for (fp_sent, ours) in [(41, Some(42)), (42, None), (0, Some(0))] {
        let r = engine_request_from_proto(with_router_ids(vec![1, 9, 9], fp_sent), now, ours)?;
        assert!(matches!(&r.prompt, Prompt::Text(t) if t == "hello"), "sent {fp_sent}, ours {ours:?}: {:?}", r.prompt);
    }
    // No ids: the prompt as sent, whatever the fingerprints.
    let none = engine_request_from_proto(with_router_ids(vec![], 42), now, Some(42))?;
    assert!(matches!(&none.prompt, Prompt::Text(t) if t == "hello"));
    // Matching ids stand in for the prompt even when the request carries none.
    let mut bare = with_router_ids(vec![3, 4], 7);
    if let Some(req) = bare.request.as_mut() {
        req.prompt = None;
    }
    let r = engine_request_from_proto(bare.clone(), now, Some(7))?;
    assert!(matches!(&r.prompt, Prompt::TokenIds(ids) if *ids == vec![3, 4]));
    assert_eq!(engine_request_from_proto(bare, now, Some(8)).err().map(|e| e.code()), Some(Code::InvalidArgument));
    Ok(())
}

#[test]
fn missing_prompt_is_invalid_argument() {
    let err = engine_request_from_proto(wreq(pb::GenerateRequest::default()), Instant::now(), None).err();
    assert_eq!(err.map(|e| e.code()), Some(Code::InvalidArgument));
    let err = engine_request_from_proto(
        pb::WorkerGenerateRequest { replica_id: "r".into(), request: None, ..Default::default() },
        Instant::now(),
        None,
    )
    .err();
    assert_eq!(err.map(|e| e.code()), Some(Code::InvalidArgument));
}

#[test]
fn engine_errors_map_to_grpc_codes() {
    let inv =
        engine_error_to_status(&EngineError::InvalidRequest { field: "max_tokens", message: "must be >= 1".into() });
    assert_eq!(inv.code(), Code::InvalidArgument);
    assert!(inv.message().contains("max_tokens"), "message names the field");
    assert_eq!(inv.metadata().get("prism-param").and_then(|v| v.to_str().ok()), Some("max_tokens"));
    assert_eq!(engine_error_to_status(&EngineError::Overloaded("q".into())).code(), Code::ResourceExhausted);
    assert_eq!(engine_error_to_status(&EngineError::Unavailable("x".into())).code(), Code::Unavailable);
    assert_eq!(engine_error_to_status(&EngineError::Internal("x".into())).code(), Code::Internal);
}

#[test]
fn output_conversion_carries_tokens_logprobs_finish_and_usage() {
    let o = EngineOutput {
        index: 1,
        token_ids: vec![10, 11],
        text: "ab".into(),
        logprobs: vec![TokenLogprob {
            token_id: 10,
            token: "a".into(),
            logprob: -0.5,
            bytes: b"a".to_vec(),
            top_logprobs: vec![TopLogprob { token_id: 12, token: "c".into(), logprob: -1.0, bytes: b"c".to_vec() }],
        }],
        finish_reason: Some(FinishReason::Length),
        error: None,
        usage: Some(Usage { prompt_tokens: 4, completion_tokens: 9, cached_tokens: 0 }),
        prompt_tokens: 4,
    };
    let p = output_to_proto("rid", o);
    assert_eq!(p.request_id, "rid");
    assert_eq!((p.index, p.token_ids.clone(), p.text.as_str()), (1, vec![10, 11], "ab"));
    assert_eq!(p.finish_reason, pb::FinishReason::Length as i32);
    assert_eq!(p.usage, Some(pb::Usage { prompt_tokens: 4, completion_tokens: 9, cached_tokens: 0 }));
    assert_eq!(p.logprobs[0].top_logprobs[0].token_id, 12);
    assert_eq!(p.logprobs[0].bytes, b"a".to_vec());
    // The engine's own counts, also when the request continues a migrated stream: the
    // router alone rewrites those for its client (prism-router `dispatch::migrate`, whose
    // tests check that a continuation reporting 4 prompt tokens reaches the client as 7).
    assert_eq!(p.prompt_tokens, 4);
    assert_eq!(p.usage.map(|u| u.prompt_tokens), Some(4));
    assert_eq!(finish_reason_to_proto(None), pb::FinishReason::Unspecified);
    assert_eq!(finish_reason_to_proto(Some(FinishReason::Abort)), pb::FinishReason::Abort);
}
