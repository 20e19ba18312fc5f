//! The engine with the prefix cache over the paged test double (which reads every token's
//! context back through the block table, so a wrong hit changes its output): same tokens as
//! with the cache off, `cached_tokens`, salts, `n > 1`, events, counters and no leak.

use super::test_double::{ByteCodec, EOS, PagedEchoBackend};
use super::{
    EngineError, EngineHandle, EngineOutput, EngineParts, EngineRequest, Prompt, RuntimeConfig, SamplingParams,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn engine(num_blocks: usize, caching: bool, budget: usize) -> EngineHandle {
    let parts = EngineParts {
        backend: Box::new(PagedEchoBackend::new(num_blocks, 4)),
        codec: Arc::new(ByteCodec::new()),
        eos_ids: vec![EOS],
        model_max_len: 512,
        control: Default::default(),
    };
    let rt =
        RuntimeConfig { enable_prefix_caching: caching, max_num_batched_tokens: budget, ..RuntimeConfig::default() };
    EngineHandle::start_with_parts(parts, rt).expect("engine starts")
}

fn params(seed: u64, n: u32) -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        seed: Some(seed),
        n,
        max_tokens: Some(12),
        ignore_eos: true,
        logprobs: Some(2),
        ..SamplingParams::default()
    }
}

fn req(prompt: &str, p: SamplingParams, salt: Option<&str>) -> EngineRequest {
    EngineRequest {
        id: "prefix".into(),
        prompt: Prompt::Text(prompt.to_owned()),
        params: p,
        prior_output_ids: Vec::new(),
        deadline: None,
        cache_salt: salt.map(str::to_owned),
        tools: None,
        chat_template_kwargs: None,
    }
}

/// One choice's tokens and their logprobs.
type Choice = (Vec<u32>, Vec<f32>);

/// Per-choice results and the usage's cached tokens.
fn run(e: &EngineHandle, r: EngineRequest) -> (Vec<Choice>, u32) {
    let mut s = e.submit(r).expect("submit");
    let mut outs: Vec<EngineOutput> = Vec::new();
    while let Some(o) = s.blocking_recv() {
        outs.push(o);
    }
    let n = outs.iter().map(|o| o.index as usize + 1).max().unwrap_or(0);
    let mut c = vec![(Vec::new(), Vec::new()); n];
    for o in &outs {
        c[o.index as usize].0.extend(&o.token_ids);
        c[o.index as usize].1.extend(o.logprobs.iter().map(|l| l.logprob));
    }
    (c, outs.last().and_then(|o| o.usage).expect("usage").cached_tokens)
}

fn wait_idle(e: &EngineHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = e.stats();
        if s.requests_in_flight == 0 && s.running == 0 && s.waiting == 0 && s.free_blocks == s.total_blocks {
            return;
        }
        assert!(Instant::now() < deadline, "engine did not go idle: {s:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

const SHARED: &str = "You are a helpful assistant. Answer briefly and precisely. ";

fn prompts() -> Vec<String> {
    let mut v: Vec<String> = (0..6).map(|i| format!("{SHARED}Question {i}: why?")).collect();
    v.push("short".into());
    v.push(format!("{SHARED}Q"));
    v
}

#[test]
fn cache_on_gives_the_same_tokens_and_reports_cached_tokens() {
    for (blocks, budget) in [(512, 2048), (512, 7), (40, 2048)] {
        let off = engine(blocks, false, budget);
        let on = engine(blocks, true, budget);
        for round in 0..2 {
            for (i, p) in prompts().iter().enumerate() {
                let (want, cached_off) = run(&off, req(p, params(i as u64, 1), None));
                let (got, cached) = run(&on, req(p, params(i as u64, 1), None));
                assert_eq!(want, got, "prompt {i} round {round} ({blocks} blocks, budget {budget})");
                assert_eq!(cached_off, 0);
                if round == 1 && blocks == 512 {
                    assert!(cached > 0 && cached % 4 == 0, "a repeat hits: {cached}");
                }
            }
        }
        let st = on.stats();
        assert!(st.prefix_cache_hits_total > 0 && st.prefix_cache_hits_total < st.prefix_cache_queries_total, "{st:?}");
        assert_eq!(off.stats().prefix_cache_queries_total, 0);
        assert!(st.prompt_tokens_computed_total < off.stats().prompt_tokens_computed_total);
        wait_idle(&on);
        wait_idle(&off);
        assert_eq!(off.prefix_cache_events(0), Default::default(), "no events with the cache off");
    }
}

#[test]
fn salts_isolate_and_bad_salts_are_rejected() {
    let e = engine(512, true, 2048);
    let p = format!("{SHARED}salted");
    assert_eq!(run(&e, req(&p, params(1, 1), None)).1, 0, "cold");
    assert!(run(&e, req(&p, params(1, 1), None)).1 > 0, "warm");
    assert_eq!(run(&e, req(&p, params(1, 1), Some("tenant-a"))).1, 0, "another salt: cold");
    assert!(run(&e, req(&p, params(1, 1), Some("tenant-a"))).1 > 0, "same salt: warm");
    for bad in [String::new(), "x".repeat(crate::MAX_CACHE_SALT_BYTES + 1)] {
        match e.submit(req("hi", params(1, 1), Some(&bad))) {
            Err(EngineError::InvalidRequest { field, .. }) => assert_eq!(field, "cache_salt"),
            other => panic!("expected InvalidRequest, got {other:?}"),
        }
    }
    assert!(e.submit(req("hi", params(1, 1), Some(&"x".repeat(crate::MAX_CACHE_SALT_BYTES)))).is_ok());
    wait_idle(&e);
}

#[test]
fn n_choices_prefill_the_prompt_once() {
    let prompt = "p".repeat(200);
    let off = engine(512, false, 2048);
    let on = engine(512, true, 2048);
    let (want, _) = run(&off, req(&prompt, params(5, 4), None));
    let (got, cached) = run(&on, req(&prompt, params(5, 4), None));
    assert_eq!(want, got);
    assert_eq!(cached, 0, "choice 0 computed the prompt");
    let len = 201; // BOS + 200
    let computed = on.stats().prompt_tokens_computed_total;
    assert!(computed < len + 3 * 4, "prompt computed once plus each follower's last block: {computed}");
    assert_eq!(off.stats().prompt_tokens_computed_total, 4 * len);
    wait_idle(&on);
}

#[test]
fn events_follow_the_cache() {
    let e = engine(32, true, 2048);
    let ev = e.prefix_cache_events(0);
    assert_eq!(ev.snapshot, Some(vec![]));
    run(&e, req(&format!("{SHARED}one"), params(1, 1), None));
    let ev = e.prefix_cache_events(0);
    let held = ev.snapshot.clone().expect("snapshot");
    assert!(!held.is_empty() && ev.next > 0);
    let codec = ByteCodec::new();
    let ids = crate::codec::TextCodec::encode(&codec, &format!("{SHARED}one"), true).expect("encode");
    let want = crate::kv_cache::block_hashes(0, None, &ids, 4);
    assert!(want.iter().all(|h| held.contains(h)), "the snapshot holds the prompt's block hashes");
    assert!(held.len() > want.len(), "generated tokens' full blocks are cached too");
    // A different long prompt evicts (32 blocks): Removed events arrive after `next`.
    run(&e, req(&"z".repeat(100), params(1, 1), None));
    let later = e.prefix_cache_events(ev.next);
    assert!(later.snapshot.is_none());
    assert!(later.events.iter().any(|x| matches!(x, crate::kv_cache::CacheEvent::Removed(_))), "{later:?}");
    wait_idle(&e);
}
