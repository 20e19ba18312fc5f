//! The prefix cache on the bundled SmolLM2-135M-Instruct GGUF (CPU backend): with the cache
//! on, every token id and logprob equals the cache-off run (greedy and seeded sampling) —
//! cold, warm, partial prefixes ending mid-block, after eviction, with chunked prefill and
//! with preemption; `usage.cached_tokens`, cache salts, `n = 4` prefilling the prompt once,
//! no leaked block; and the router's `PromptCodec` computing exactly the engine's prompt ids.
//!
//! The tests skip (printing a notice) only when the model file is missing and
//! `PRISM_REQUIRE_MODEL` is unset (`scripts/fetch-model.sh` fetches it).

use anyhow::{Context, Result, bail, ensure};
use prism_engine::codec::PromptCodec;
use prism_engine::{
    ChatMessage, EngineConfig, EngineError, EngineHandle, EngineOutput, EngineRequest, Prompt, SamplingParams,
};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn model_path() -> Result<Option<PathBuf>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return Ok(Some(path));
    }
    if std::env::var_os("PRISM_REQUIRE_MODEL").is_some() {
        bail!("{} is missing and PRISM_REQUIRE_MODEL is set", path.display());
    }
    eprintln!("SKIPPED: {} not found (run scripts/fetch-model.sh)", path.display());
    Ok(None)
}

/// Starts an engine with the prefix cache on or off; `tweak` sets the rest.
fn start(caching: bool, tweak: impl Fn(&mut EngineConfig)) -> Result<Option<EngineHandle>> {
    let Some(path) = model_path()? else { return Ok(None) };
    let mut cfg = EngineConfig::new(path);
    cfg.served_model_name = "smollm2".into();
    cfg.enable_prefix_caching = caching;
    // 256 MiB (about 5,800 tokens): room for every case, several engines at once.
    cfg.kv_cache_bytes = Some(256 << 20);
    tweak(&mut cfg);
    Ok(Some(EngineHandle::start(cfg, None)?))
}

/// KV bytes of `blocks` blocks of 16 tokens (SmolLM2-135M: 30 layers × 3 KV heads × 64 × K,V × f32).
fn kv_bytes(e: &EngineHandle, blocks: u64) -> u64 {
    blocks * 16 * e.model_info().kv_bytes_per_token as u64
}

fn greedy(max_tokens: i64) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        logprobs: Some(1),
        ..SamplingParams::default()
    }
}

fn seeded(max_tokens: i64, seed: u64) -> SamplingParams {
    SamplingParams { temperature: 0.8, seed: Some(seed), ..greedy(max_tokens) }
}

fn req(prompt: Prompt, params: SamplingParams) -> EngineRequest {
    EngineRequest {
        id: "pc".into(),
        prompt,
        params,
        prior_output_ids: Vec::new(),
        deadline: None,
        cache_salt: None,
        tools: None,
        chat_template_kwargs: None,
    }
}

/// One request's result: per choice (token ids, logprobs), and the usage.
#[derive(Debug, Clone)]
struct Done {
    choices: Vec<(Vec<u32>, Vec<f32>)>,
    prompt_tokens: u32,
    cached_tokens: u32,
}

fn collect(outs: Vec<EngineOutput>) -> Result<Done> {
    let n = outs.iter().map(|o| o.index as usize + 1).max().unwrap_or(0);
    let mut choices = vec![(Vec::new(), Vec::new()); n];
    for o in &outs {
        let c = &mut choices[o.index as usize];
        c.0.extend(&o.token_ids);
        c.1.extend(o.logprobs.iter().map(|l| l.logprob));
    }
    let usage = outs.last().and_then(|o| o.usage).context("no usage")?;
    Ok(Done { choices, prompt_tokens: usage.prompt_tokens, cached_tokens: usage.cached_tokens })
}

/// Submits every request at once (so they batch, chunk and preempt together) and drains them.
fn run_all(e: &EngineHandle, reqs: &[EngineRequest]) -> Result<Vec<Done>> {
    let streams: Vec<_> = reqs.iter().map(|r| e.submit(r.clone())).collect::<Result<_, _>>()?;
    streams
        .into_iter()
        .map(|mut s| {
            let mut outs = Vec::new();
            while let Some(o) = s.blocking_recv() {
                outs.push(o);
            }
            collect(outs)
        })
        .collect()
}

fn run_one(e: &EngineHandle, r: EngineRequest) -> Result<Done> {
    Ok(run_all(e, &[r])?.remove(0))
}

/// Same token ids, logprobs within 1e-5.
fn same(case: &str, want: &[Done], got: &[Done]) -> Result<()> {
    ensure!(want.len() == got.len(), "{case}: {} vs {} results", want.len(), got.len());
    for (i, (w, g)) in want.iter().zip(got).enumerate() {
        ensure!(w.choices.len() == g.choices.len(), "{case} #{i}: choice count");
        for (c, (wc, gc)) in w.choices.iter().zip(&g.choices).enumerate() {
            ensure!(wc.0 == gc.0, "{case} #{i} choice {c}: tokens {:?} (off) != {:?} (on)", wc.0, gc.0);
            ensure!(wc.1.len() == gc.1.len() && !wc.1.is_empty(), "{case} #{i}: logprob count");
            for (a, b) in wc.1.iter().zip(&gc.1) {
                ensure!((a - b).abs() <= 1e-5, "{case} #{i} choice {c}: logprob {a} (off) vs {b} (on)");
            }
        }
    }
    Ok(())
}

/// Waits until nothing runs and every block is free or evictable (no leak).
fn wait_idle(e: &EngineHandle) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = e.stats();
        if s.requests_in_flight == 0 && s.running == 0 && s.waiting == 0 && s.free_blocks == s.total_blocks {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "engine did not return to idle: {s:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

const PREFIXES: [&str; 3] = [
    "You are a careful assistant. Read the question, think about what is being asked, and answer in one short \
     sentence without repeating the question. Question:",
    "def parse_config(path):\n    \"\"\"Read a TOML file and return a dict of settings, raising ValueError on \
     a missing key.\"\"\"\n    with open(path) as f:\n",
    "The history of the city begins with a small fishing village on the northern bank of the river, where",
];

/// 16 distinct prompts: 12 share one of three long prefixes (4 each), 4 stand alone.
fn prompts() -> Vec<String> {
    let tails = [" what is the capital of Peru?", " why is the sky blue?", " how do bees fly?", " who wrote Hamlet?"];
    let mut v = Vec::new();
    for p in PREFIXES {
        for t in tails {
            v.push(format!("{p}{t}"));
        }
    }
    v.extend(
        ["Hello", "1, 1, 2, 3, 5, 8,", "Translate to French: good morning", "A haiku about autumn rain:"]
            .map(str::to_owned),
    );
    v
}

/// Each prompt greedy and seeded.
fn requests(prompts: &[String], max_tokens: i64) -> Vec<EngineRequest> {
    prompts
        .iter()
        .enumerate()
        .flat_map(|(i, p)| {
            let text = Prompt::Text(p.clone());
            [req(text.clone(), greedy(max_tokens)), req(text, seeded(max_tokens, 1000 + i as u64))]
        })
        .collect()
}

#[test]
fn cache_on_equals_cache_off_cold_warm_partial_and_evicted() -> Result<()> {
    let Some(off) = start(false, |_| {})? else { return Ok(()) };
    let Some(on) = start(true, |_| {})? else { return Ok(()) };
    let reqs = requests(&prompts(), 6);
    // Cold: one request alone reports nothing cached.
    let first = run_one(&on, reqs[0].clone())?;
    ensure!(first.cached_tokens == 0, "a cold request has no cached tokens: {first:?}");
    let want = run_all(&off, &reqs)?;
    let cold = run_all(&on, &reqs)?;
    same("cold", &want, &cold)?;
    // Warm: an exact repeat takes every full block but the one holding the last token.
    let warm = run_all(&on, &reqs)?;
    same("warm", &want, &warm)?;
    for (i, d) in warm.iter().enumerate() {
        let full = (d.prompt_tokens as usize - 1) / 16 * 16;
        ensure!(d.cached_tokens as usize == full, "warm #{i}: {} cached of {}", d.cached_tokens, d.prompt_tokens);
    }
    ensure!(warm.iter().any(|d| d.cached_tokens > 0));
    // Partial: a cached prefix ending mid-block, then other tokens.
    let codec = on.codec();
    let mut partial = Vec::new();
    for (i, p) in PREFIXES.iter().enumerate() {
        let mut ids = codec.encode(p, true)?;
        ids.truncate(16 + 5 + i * 9);
        ids.extend(codec.encode(" and then something else entirely happened", false)?);
        partial.push(req(Prompt::TokenIds(ids.clone()), greedy(6)));
        partial.push(req(Prompt::TokenIds(ids), seeded(6, 77 + i as u64)));
    }
    let want_p = run_all(&off, &partial)?;
    let got_p = run_all(&on, &partial)?;
    same("partial prefix", &want_p, &got_p)?;
    ensure!(got_p.iter().all(|d| d.cached_tokens > 0 && d.cached_tokens % 16 == 0), "{got_p:?}");
    let st = on.stats();
    ensure!(st.prefix_cache_hits_total > 0 && st.prefix_cache_hits_total < st.prefix_cache_queries_total, "{st:?}");
    ensure!(st.prompt_tokens_computed_total < off.stats().prompt_tokens_computed_total, "{st:?}");
    ensure!(off.stats().prefix_cache_queries_total == 0 && off.prefix_cache_events(0) == Default::default());
    ensure!(on.prefix_cache_events(0).snapshot.is_some_and(|s| !s.is_empty()));
    wait_idle(&on)?;
    wait_idle(&off)?;

    // Eviction: 12 blocks hold about one prefix family; one request at a time, later
    // prompts evict earlier ones, then the first ones come back partly cached at most.
    let kv = kv_bytes(&on, 12);
    let Some(small_off) = start(false, |c| c.kv_cache_bytes = Some(kv))? else { return Ok(()) };
    let Some(small_on) = start(true, |c| c.kv_cache_bytes = Some(kv))? else { return Ok(()) };
    let seq: Vec<EngineRequest> = reqs.iter().chain(reqs.iter().take(8)).cloned().collect();
    let mut want_e = Vec::new();
    let mut got_e = Vec::new();
    for r in &seq {
        want_e.push(run_one(&small_off, r.clone())?);
        got_e.push(run_one(&small_on, r.clone())?);
        let st = small_on.stats();
        ensure!(st.free_blocks == st.total_blocks, "between requests every block is free or evictable: {st:?}");
    }
    same("after eviction", &want_e, &got_e)?;
    let full = |d: &Done| (d.prompt_tokens as usize - 1) / 16 * 16;
    ensure!(got_e[32..].iter().any(|d| (d.cached_tokens as usize) < full(d)), "the second pass found evictions");
    ensure!(got_e.iter().any(|d| d.cached_tokens > 0), "some requests hit");
    let events = small_on.prefix_cache_events(1);
    ensure!(
        events.snapshot.is_some()
            || events.events.iter().any(|e| matches!(e, prism_engine::kv_cache::CacheEvent::Removed(_))),
        "evictions are reported"
    );
    wait_idle(&small_on)?;
    Ok(())
}

#[test]
fn cache_on_equals_cache_off_with_chunked_prefill_and_preemption() -> Result<()> {
    let reqs = requests(&prompts(), 6);
    let chunk = |c: &mut EngineConfig| c.max_num_batched_tokens = 7;
    let Some(off) = start(false, chunk)? else { return Ok(()) };
    let Some(on) = start(true, chunk)? else { return Ok(()) };
    let want = run_all(&off, &reqs)?;
    same("chunked cold", &want, &run_all(&on, &reqs)?)?;
    let warm = run_all(&on, &reqs)?;
    same("chunked warm", &want, &warm)?;
    ensure!(warm.iter().any(|d| d.cached_tokens > 0));
    wait_idle(&on)?;
    off.shutdown();
    on.shutdown();

    // 8 blocks of 16 tokens, 32 concurrent requests: preemption by recompute.
    let Some(probe) = start(false, |_| {})? else { return Ok(()) };
    let kv = kv_bytes(&probe, 8);
    probe.shutdown();
    let tiny = |c: &mut EngineConfig| c.kv_cache_bytes = Some(kv);
    let Some(off) = start(false, tiny)? else { return Ok(()) };
    let Some(on) = start(true, tiny)? else { return Ok(()) };
    let want = run_all(&off, &reqs)?;
    for round in ["preemption cold", "preemption warm"] {
        same(round, &want, &run_all(&on, &reqs)?)?;
    }
    let st = on.stats();
    ensure!(st.num_preemptions_total > 0, "expected preemptions with 8 blocks: {st:?}");
    ensure!(st.prefix_cache_hits_total > 0, "{st:?}");
    wait_idle(&on)?;
    Ok(())
}

#[test]
fn cached_tokens_salts_n4_and_bad_salt() -> Result<()> {
    let Some(on) = start(true, |_| {})? else { return Ok(()) };
    let p = Prompt::Text(format!("{} who painted the Mona Lisa?", PREFIXES[0]));
    ensure!(run_one(&on, req(p.clone(), greedy(2)))?.cached_tokens == 0, "cold");
    let warm = run_one(&on, req(p.clone(), greedy(2)))?;
    ensure!(warm.cached_tokens > 0, "repeat: {warm:?}");
    let mut salted = req(p.clone(), greedy(2));
    salted.cache_salt = Some("tenant-a".into());
    ensure!(run_one(&on, salted.clone())?.cached_tokens == 0, "another salt shares nothing");
    ensure!(run_one(&on, salted)?.cached_tokens == warm.cached_tokens, "the same salt shares");
    for bad in [String::new(), "s".repeat(prism_engine::MAX_CACHE_SALT_BYTES + 1)] {
        let mut r = req(p.clone(), greedy(2));
        r.cache_salt = Some(bad);
        match on.submit(r) {
            Err(EngineError::InvalidRequest { field: "cache_salt", .. }) => {}
            other => bail!("bad cache_salt: expected InvalidRequest naming cache_salt, got {other:?}"),
        }
    }

    // n = 4 over a ~1000-token prompt: the prompt is prefilled once.
    let tail = on.codec().encode(". My favourite colour is", false)?;
    let mut long: Vec<u32> = on.codec().encode(&PREFIXES[2].repeat(60), true)?;
    long.truncate(1000 - tail.len());
    long.extend(tail);
    ensure!(long.len() == 1000);
    let n4 = SamplingParams { n: 4, temperature: 1.0, ..seeded(8, 99) };
    let Some(off) = start(false, |_| {})? else { return Ok(()) };
    let before_off = off.stats().prompt_tokens_computed_total;
    let want = run_one(&off, req(Prompt::TokenIds(long.clone()), n4.clone()))?;
    let off_computed = off.stats().prompt_tokens_computed_total - before_off;
    off.shutdown();
    let before = on.stats().prompt_tokens_computed_total;
    let got = run_one(&on, req(Prompt::TokenIds(long), n4))?;
    let computed = on.stats().prompt_tokens_computed_total - before;
    same("n = 4", std::slice::from_ref(&want), std::slice::from_ref(&got))?;
    ensure!(off_computed == 4000, "cache off computes the prompt 4 times: {off_computed}");
    ensure!((1000..1000 + 3 * 16).contains(&computed), "cache on computes it once: {computed}");
    ensure!(got.choices.iter().any(|c| c.0 != got.choices[0].0), "the choices sample differently");
    wait_idle(&on)?;
    Ok(())
}

/// What routers rely on: a `PromptCodec` rebuilt from the engine's export gives exactly the
/// ids the engine computes, for text and chat prompts.
#[test]
fn prompt_codec_from_export_matches_the_engine() -> Result<()> {
    let Some(e) = start(true, |_| {})? else { return Ok(()) };
    let export = e.codec_export().context("the bundled model's codec is exportable")?;
    let rebuilt = PromptCodec::from_export(&prism_engine::codec::CodecExport::from_json(&export.to_json()?)?)?;
    let codec = e.codec();
    let chat = vec![
        ChatMessage { role: "system".into(), content: "You are terse.".into(), ..Default::default() },
        ChatMessage {
            role: "user".into(), content: "Name three primes. 😀 ünïcödé".into(), ..Default::default()
        },
    ];
    let mut cases: Vec<(Prompt, Vec<u32>)> = prompts()
        .into_iter()
        .chain(["  leading spaces\tand\ttabs\n\n".to_owned(), "<|im_start|>user\nhi<|im_end|>".to_owned()])
        .map(|t| Ok((Prompt::Text(t.clone()), codec.encode(&t, true)?)))
        .collect::<Result<_>>()?;
    cases.push((Prompt::Chat(chat.clone()), codec.encode(&codec.render_chat(&chat)?, false)?));
    for (prompt, engine_ids) in cases {
        let ids = rebuilt.prompt_ids(&prompt)?;
        ensure!(ids == engine_ids, "{prompt:?}: router ids {ids:?} != engine ids {engine_ids:?}");
        // The engine's own count, and a full prefix hit when the router's ids are sent back.
        let by_text = run_one(&e, req(prompt.clone(), greedy(1)))?;
        ensure!(by_text.prompt_tokens as usize == ids.len(), "{prompt:?}: usage {}", by_text.prompt_tokens);
        let by_ids = run_one(&e, req(Prompt::TokenIds(ids.clone()), greedy(1)))?;
        ensure!(by_ids.cached_tokens as usize == (ids.len() - 1) / 16 * 16, "{prompt:?}: {by_ids:?}");
        same("ids from the router's codec", std::slice::from_ref(&by_text), std::slice::from_ref(&by_ids))?;
    }
    wait_idle(&e)?;
    Ok(())
}
