//! End-to-end engine tests on the bundled SmolLM2-135M-Instruct GGUF with the
//! CPU backend: batching changes nothing, nothing leaks, bad input is typed and the engine
//! keeps serving, streamed text is valid UTF-8 without stop-string leaks, seeded sampling
//! is reproducible.
//!
//! The tests skip (printing a notice) only when the model file is missing and
//! `PRISM_REQUIRE_MODEL` is unset (`scripts/fetch-model.sh` fetches it).

use anyhow::{Context, Result, bail, ensure};
use prism_engine::{
    ChatMessage, EngineConfig, EngineError, EngineHandle, EngineOutput, EngineRequest, FinishReason, OutputStream,
    Prompt, SamplingParams,
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

fn start(tweak: impl FnOnce(&mut EngineConfig)) -> Result<Option<EngineHandle>> {
    let Some(path) = model_path()? else { return Ok(None) };
    let mut cfg = EngineConfig::new(path);
    cfg.served_model_name = "smollm2".into();
    tweak(&mut cfg);
    Ok(Some(EngineHandle::start(cfg, None)?))
}

fn greedy(max_tokens: i64) -> SamplingParams {
    SamplingParams { temperature: 0.0, max_tokens: Some(max_tokens), ignore_eos: true, ..SamplingParams::default() }
}

fn req(prompt: Prompt, params: SamplingParams) -> EngineRequest {
    EngineRequest {
        id: "test".into(),
        prompt,
        params,
        prior_output_ids: Vec::new(),
        deadline: None,
        cache_salt: None,
        tools: None,
        chat_template_kwargs: None,
    }
}

fn text(p: &str) -> Prompt {
    Prompt::Text(p.to_owned())
}

/// One choice's collected stream.
#[derive(Debug, Default, Clone)]
struct Choice {
    tokens: Vec<u32>,
    deltas: Vec<String>,
    finish: Option<FinishReason>,
}

impl Choice {
    fn text(&self) -> String {
        self.deltas.concat()
    }
}

fn drain(mut s: OutputStream) -> (Vec<Choice>, Vec<EngineOutput>) {
    let mut outs = Vec::new();
    while let Some(o) = s.blocking_recv() {
        outs.push(o);
    }
    let n = outs.iter().map(|o| o.index as usize + 1).max().unwrap_or(0);
    let mut choices = vec![Choice::default(); n];
    for o in &outs {
        let c = &mut choices[o.index as usize];
        c.tokens.extend(&o.token_ids);
        c.deltas.push(o.text.clone());
        c.finish = c.finish.or(o.finish_reason);
    }
    (choices, outs)
}

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

const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "1, 2, 3, 4,",
];

fn chat_prompt() -> Prompt {
    Prompt::Chat(vec![ChatMessage {
        role: "user".into(),
        content: "What is the tallest mountain?".into(),
        ..Default::default()
    }])
}

fn all_prompts() -> Vec<Prompt> {
    let mut v: Vec<Prompt> = PROMPTS.iter().map(|p| text(p)).collect();
    v.push(chat_prompt());
    v
}

fn run(e: &EngineHandle, together: bool) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    if together {
        let streams: Vec<_> =
            all_prompts().into_iter().map(|p| e.submit(req(p, greedy(16)))).collect::<Result<_, _>>()?;
        for s in streams {
            out.push(drain(s).0[0].tokens.clone());
        }
    } else {
        for p in all_prompts() {
            out.push(drain(e.submit(req(p, greedy(16)))?).0[0].tokens.clone());
        }
    }
    Ok(out)
}

#[test]
fn engine_batching_chunking_and_preemption_change_nothing() -> Result<()> {
    let Some(e) = start(|_| {})? else { return Ok(()) };
    let alone = run(&e, false)?;
    ensure!(alone.iter().all(|t| t.len() == 16));
    ensure!(run(&e, true)? == alone, "batched greedy tokens differ from one-at-a-time");
    wait_idle(&e)?;
    e.shutdown();

    let Some(chunked) = start(|c| c.max_num_batched_tokens = 7)? else { return Ok(()) };
    ensure!(run(&chunked, true)? == alone, "7-token chunked prefill changed the tokens");
    chunked.shutdown();

    // 8 blocks of 16 tokens; five sequences of 21..51 tokens cannot all fit.
    let kv = 8 * 16 * e.model_info().kv_bytes_per_token as u64;
    let Some(tiny) = start(|c| c.kv_cache_bytes = Some(kv))? else { return Ok(()) };
    ensure!(tiny.model_info().num_kv_blocks == 8, "{:?}", tiny.model_info());
    ensure!(run(&tiny, true)? == alone, "preemption (recompute) changed the tokens");
    let st = tiny.stats();
    ensure!(st.num_preemptions_total > 0, "expected preemptions with 8 blocks: {st:?}");
    wait_idle(&tiny)?;
    Ok(())
}

#[test]
fn engine_nothing_leaks_after_200_mixed_requests() -> Result<()> {
    let Some(e) = start(|c| c.max_num_seqs = 16)? else { return Ok(()) };
    let mut kept = Vec::new();
    for i in 0..200u32 {
        let mut p = SamplingParams {
            temperature: if i % 2 == 0 { 0.0 } else { 0.9 },
            seed: Some(u64::from(i)),
            max_tokens: Some(1 + i64::from(i % 6)),
            n: 1 + i % 2,
            ..SamplingParams::default()
        };
        if i % 9 == 0 {
            p.stop = vec![" the".into(), ".".into()];
        }
        let prompt = if i % 10 == 3 { chat_prompt() } else { text(&format!("Item {i}: a short note about")) };
        let mut s = e.submit(req(prompt, p))?;
        match i % 4 {
            0 => drop(s),
            1 => {
                let _ = s.blocking_recv();
                drop(s);
            }
            _ => kept.push(s),
        }
    }
    for s in kept {
        let (choices, outs) = drain(s);
        ensure!(choices.iter().all(|c| c.finish.is_some()), "a choice ended without finish_reason");
        ensure!(outs.last().and_then(|o| o.usage).is_some(), "last output has no usage");
    }
    wait_idle(&e)?;
    let st = e.stats();
    ensure!(st.kv_cache_usage == 0.0 && st.running == 0 && st.waiting == 0, "{st:?}");
    ensure!(st.finished.abort > 0, "dropped streams count as aborted: {:?}", st.finished);
    ensure!(e.is_alive());
    Ok(())
}

#[test]
fn engine_bad_input_is_typed_and_serving_continues() -> Result<()> {
    let Some(e) = start(|c| c.max_model_len = Some(64))? else { return Ok(()) };
    let background = e.submit(req(text("Count slowly:"), greedy(20)))?;
    let field = |r: Result<OutputStream, EngineError>| match r {
        Err(EngineError::InvalidRequest { field, .. }) => Ok(field),
        Err(other) => bail!("expected InvalidRequest, got {other:?}"),
        Ok(_) => bail!("expected InvalidRequest, got a stream"),
    };
    ensure!(field(e.submit(req(text(""), greedy(4))))? == "prompt", "empty prompt");
    let long = "word ".repeat(80);
    let long_err = e.submit(req(text(&long), greedy(4)));
    match &long_err {
        Err(EngineError::InvalidRequest { field: "prompt", message }) => {
            ensure!(message.contains("64"), "message names the limit: {message}");
        }
        other => bail!("prompt over the window: {other:?}"),
    }
    ensure!(field(e.submit(req(text("Hello there"), greedy(63))))? == "max_tokens", "prompt + max_tokens");
    ensure!(field(e.submit(req(text("Hi"), greedy(0))))? == "max_tokens");
    ensure!(field(e.submit(req(text("Hi"), greedy(-1))))? == "max_tokens");
    ensure!(field(e.submit(req(text("Hi"), SamplingParams { temperature: -0.5, ..greedy(2) })))? == "temperature");
    ensure!(field(e.submit(req(text("Hi"), SamplingParams { top_p: 1.5, ..greedy(2) })))? == "top_p");
    ensure!(field(e.submit(req(text("Hi"), SamplingParams { top_k: -3, ..greedy(2) })))? == "top_k");
    ensure!(field(e.submit(req(text("Hi"), SamplingParams { n: 0, ..greedy(2) })))? == "n");
    ensure!(field(e.submit(req(Prompt::TokenIds(vec![1, 49_152]), greedy(2))))? == "prompt", "unknown id");
    // A chat message with empty content still renders template tokens: normal output.
    let empty_chat =
        Prompt::Chat(vec![ChatMessage { role: "user".into(), content: String::new(), ..Default::default() }]);
    let (c, _) = drain(e.submit(req(empty_chat, greedy(2)))?);
    ensure!(c[0].tokens.len() == 2);
    let (c, _) = drain(background);
    ensure!(c[0].tokens.len() == 20 && c[0].finish == Some(FinishReason::Length), "{c:?}");
    let (c, _) = drain(e.submit(req(text("Still serving?"), greedy(3)))?);
    ensure!(c[0].tokens.len() == 3);
    wait_idle(&e)?;
    Ok(())
}

#[test]
fn engine_streams_valid_utf8_and_never_leaks_stop_strings() -> Result<()> {
    let Some(e) = start(|_| {})? else { return Ok(()) };
    let codec = e.codec();
    let prompts = [
        "😀😃😄😁😆😅😂🤣😊😇🙂🙃😉😌😍🥰😘😗😙😚😋😛😝😜🤪🤨🧐🤓😎🥸🤩🥳",
        "한국어 문장: 안녕하세요 만나서 반갑습니다 오늘 날씨가 좋네요 감사합니다 한국어 문장: 안녕하세요",
        "中文：龘靐齉爩鱻麤龖纛，生僻字测试。中文：龘靐齉爩鱻麤龖纛，",
    ];
    let mut split_seen = false;
    let mut non_ascii_seen = false;
    for p in prompts {
        let (c, _) = drain(e.submit(req(text(p), greedy(24)))?);
        let c = &c[0];
        for d in &c.deltas {
            ensure!(!d.contains('\u{FFFD}'), "replacement character in delta {d:?}");
            non_ascii_seen |= !d.is_ascii();
        }
        split_seen |= c.tokens.iter().any(|&t| std::str::from_utf8(codec.token_bytes(t)).is_err());
        let all: Vec<u8> = c.tokens.iter().flat_map(|&t| codec.token_bytes(t).to_vec()).collect();
        let joined = c.text();
        ensure!(all.starts_with(joined.as_bytes()), "deltas are not the decoded bytes");
    }
    ensure!(non_ascii_seen, "the model never produced non-ASCII text");
    ensure!(split_seen, "no token split a UTF-8 character: the hold-back path was not exercised");

    // A stop string spanning several tokens of the greedy continuation.
    let prompt = text(PROMPTS[2]);
    let (full, _) = drain(e.submit(req(prompt.clone(), greedy(32)))?);
    let full = &full[0];
    let mut offsets = vec![0usize];
    for &t in &full.tokens {
        offsets.push(offsets.last().copied().unwrap_or(0) + codec.token_bytes(t).len());
    }
    let full_text = full.text();
    let (a, b) = (offsets[8], offsets[11]);
    let stop = full_text.get(a + 1..b - 1).context("stop string on char boundaries")?.to_owned();
    ensure!(stop.len() >= 4, "stop {stop:?} too short");
    let cut = full_text.find(&stop).context("stop occurs")?;
    let p = SamplingParams { stop: vec![stop.clone()], ..greedy(32) };
    let (c, outs) = drain(e.submit(req(prompt, p))?);
    ensure!(c[0].finish == Some(FinishReason::Stop));
    ensure!(c[0].text() == full_text[..cut], "text {:?} != {:?}", c[0].text(), &full_text[..cut]);
    for o in &outs {
        ensure!(!o.text.contains(&stop), "delta {:?} contains the stop string", o.text);
    }
    // No delta ends with a proper prefix of the stop string that the next delta completes.
    let joined: String = outs.iter().map(|o| o.text.as_str()).collect();
    ensure!(!joined.contains(&stop));
    Ok(())
}

#[test]
fn engine_seeded_sampling_is_reproducible() -> Result<()> {
    let Some(e) = start(|_| {})? else { return Ok(()) };
    let sample = |seed: u64| -> Result<Vec<Vec<u32>>> {
        let p = SamplingParams { temperature: 0.9, top_p: 0.95, top_k: 50, seed: Some(seed), n: 2, ..greedy(24) };
        Ok(drain(e.submit(req(text(PROMPTS[2]), p))?).0.into_iter().map(|c| c.tokens).collect())
    };
    let a = sample(1234)?;
    ensure!(a == sample(1234)?, "same seed, different tokens");
    ensure!(a[0] != a[1], "the two choices should differ");
    ensure!(a != sample(4321)?, "different seeds, same tokens");
    // Logprobs: one entry per token, top-3 alternatives sorted, finite.
    let p = SamplingParams { logprobs: Some(3), ..greedy(6) };
    let (_, outs) = drain(e.submit(req(text(PROMPTS[0]), p))?);
    let lps: Vec<_> = outs.iter().flat_map(|o| o.logprobs.clone()).collect();
    ensure!(lps.len() == 6);
    for lp in &lps {
        ensure!(lp.top_logprobs.len() == 3 && lp.top_logprobs[0].token_id == lp.token_id, "{lp:?}");
        ensure!(lp.logprob.is_finite() && lp.logprob <= 0.0);
    }
    Ok(())
}

/// A replica declared failed must not keep a long prefill running on its threads: `stop`
/// interrupts the real CPU forward pass of a 2048-token prefill at a layer boundary, and the
/// step thread and the replica's compute threads exit.
#[test]
fn engine_stop_interrupts_a_long_real_prefill_and_ends_its_threads() -> Result<()> {
    ensure!(EngineConfig::new("m").max_num_batched_tokens == 512, "CPU default step budget");
    let Some(e) = start(|c| {
        c.max_num_batched_tokens = 2048; // the old default: one long step
        c.engine_threads = Some(2);
    })?
    else {
        return Ok(());
    };
    let prompt = Prompt::TokenIds(vec![100; 2000]);
    let mut s = e.submit(req(prompt, greedy(20)))?;
    let t0 = Instant::now();
    while e.stats().running == 0 {
        ensure!(t0.elapsed() < Duration::from_secs(10), "request not scheduled");
        std::thread::sleep(Duration::from_millis(2));
    }
    // Let the forward pass get into its layers.
    let started = e.stats().last_progress_at;
    while e.stats().last_progress_at == started {
        ensure!(t0.elapsed() < Duration::from_secs(60), "no layer progress");
        std::thread::sleep(Duration::from_millis(2));
    }
    let stop_at = Instant::now();
    e.stop();
    while !(e.step_thread_finished() && e.stats().compute_threads_alive == 0) {
        ensure!(stop_at.elapsed() < Duration::from_secs(10), "threads still running: {:?}", e.stats());
        std::thread::sleep(Duration::from_millis(5));
    }
    let stopped_in = stop_at.elapsed();
    let st = e.stats();
    ensure!(st.generation_tokens_total == 0, "the prefill step completed instead of being interrupted");
    ensure!(st.free_blocks == st.total_blocks && st.requests_in_flight == 0, "{st:?}");
    let mut finish = None;
    while let Some(o) = s.blocking_recv() {
        finish = finish.or(o.finish_reason);
    }
    ensure!(finish.is_none(), "a failed replica's stream ends without a finish reason");
    eprintln!("stopped a 2000-token prefill in {stopped_in:?}");
    Ok(())
}
