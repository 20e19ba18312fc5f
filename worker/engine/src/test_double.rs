//! Test doubles for the engine's own unit tests (never used outside `#[cfg(test)]`):
//! [`ByteCodec`], a byte-level tokenizer (ids 0..256 are bytes, 256 = EOS, 257 = BOS),
//! and [`PagedEchoBackend`], a deterministic pure-logic "model" that really stores token
//! ids in a paged cache and reads each sequence's context back through its block table,
//! so a wrong slot mapping, block table or chunk boundary changes its output.

use super::backend::{Backend, BackendError, Logits, StepBatch, StepControl};
use super::codec::TextCodec;
use super::request::{ChatMessage, EngineError};

/// EOS id of the double.
pub const EOS: u32 = 256;
/// BOS id of the double.
pub const BOS: u32 = 257;
const VOCAB: usize = 258;

/// Byte-level codec: text ↔ UTF-8 bytes; BOS prepended with special tokens.
pub struct ByteCodec {
    bytes: Vec<Vec<u8>>,
}

impl ByteCodec {
    pub fn new() -> Self {
        let mut bytes: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        bytes.push(b"</s>".to_vec());
        bytes.push(b"<s>".to_vec());
        Self { bytes }
    }
}

impl TextCodec for ByteCodec {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EngineError> {
        let mut ids: Vec<u32> = if add_special_tokens && !text.is_empty() { vec![BOS] } else { vec![] };
        ids.extend(text.bytes().map(u32::from));
        Ok(ids)
    }
    fn token_bytes(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }
    fn is_special(&self, id: u32) -> bool {
        id >= EOS
    }
    fn vocab_size(&self) -> usize {
        VOCAB
    }
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        Ok(messages.iter().map(|m| format!("{}: {}\n", m.role, m.content)).collect::<String>() + "assistant: ")
    }
}

/// Deterministic paged "model": the next token is a hash of the whole cached context,
/// read back through the block table (a printable ASCII byte; EOS after a '~').
pub struct PagedEchoBackend {
    /// `(token, position)` per KV slot.
    cache: Vec<Option<(u32, u32)>>,
    num_blocks: usize,
    block_size: usize,
    /// Steps run so far (tests assert batching actually happened).
    pub steps: usize,
    /// Time each step takes (simulated compute), in "layers" of at most [`SIM_LAYER`].
    pub step_time: std::time::Duration,
    /// Polled between the simulated layers, as the CPU backend does.
    pub control: Option<StepControl>,
    /// Reported as [`Backend::has_device_greedy`], so the step loop takes its greedy path
    /// (`forward_greedy`: the trait's host argmax over these same logits).
    pub device_greedy: bool,
}

/// Longest simulated layer of a step.
pub const SIM_LAYER: std::time::Duration = std::time::Duration::from_millis(100);

impl PagedEchoBackend {
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        Self {
            cache: vec![None; num_blocks * block_size],
            num_blocks,
            block_size,
            steps: 0,
            step_time: std::time::Duration::ZERO,
            control: None,
            device_greedy: false,
        }
    }
}

fn mix(h: u64, x: u64) -> u64 {
    (h ^ x).wrapping_mul(0x100_0000_01b3).rotate_left(17)
}

impl Backend for PagedEchoBackend {
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits, BackendError> {
        self.steps += 1;
        let layers = self.step_time.as_nanos().div_ceil(SIM_LAYER.as_nanos()).max(1);
        for _ in 0..layers {
            if !self.step_time.is_zero() {
                std::thread::sleep(self.step_time.min(SIM_LAYER));
            }
            if let Some(c) = &self.control {
                c.checkpoint()?;
            }
        }
        for (i, &slot) in batch.slot_mapping.iter().enumerate() {
            let cell = self
                .cache
                .get_mut(slot as usize)
                .ok_or_else(|| BackendError::InvalidBatch(format!("slot {slot} out of range")))?;
            *cell = Some((batch.token_ids[i], batch.positions[i]));
        }
        let rows = batch.seqs.iter().filter(|s| s.want_logits).count();
        let mut data = Vec::with_capacity(rows * VOCAB);
        for s in batch.seqs.iter().filter(|s| s.want_logits) {
            let mut h = 0xcbf2_9ce4_8422_2325u64;
            let mut last = 0u32;
            for pos in 0..s.context_len {
                let block = s.block_table[pos / self.block_size] as usize;
                let slot = block * self.block_size + pos % self.block_size;
                match self.cache[slot] {
                    Some((tok, p)) if p as usize == pos => {
                        h = mix(h, u64::from(tok) + 1);
                        last = tok;
                    }
                    other => {
                        return Err(BackendError::InvalidBatch(format!("slot {slot} holds {other:?}, want pos {pos}")));
                    }
                }
            }
            let target = if last == u32::from(b'~') { EOS as usize } else { 32 + (h % 95) as usize };
            for i in 0..VOCAB {
                let noise = (mix(h, i as u64) % 1000) as f32 / 1000.0;
                data.push(if i == target { 4.0 + noise } else { noise });
            }
        }
        Ok(Logits { rows, vocab_size: VOCAB, data })
    }
    fn has_device_greedy(&self) -> bool {
        self.device_greedy
    }
    fn num_kv_blocks(&self) -> usize {
        self.num_blocks
    }
    fn block_size(&self) -> usize {
        self.block_size
    }
    fn kv_bytes_per_token(&self) -> usize {
        8
    }
    fn name(&self) -> &'static str {
        "test-double"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        EngineError, EngineHandle, EngineOutput, EngineParts, EngineRequest, FinishReason, OutputStream, Prompt,
        RuntimeConfig, SamplingParams,
    };
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    fn engine(num_blocks: usize, block_size: usize, rt: RuntimeConfig) -> EngineHandle {
        engine_with(PagedEchoBackend::new(num_blocks, block_size), rt)
    }

    fn engine_with(backend: PagedEchoBackend, rt: RuntimeConfig) -> EngineHandle {
        engine_on(Box::new(backend), 512, rt)
    }

    /// An engine over any backend with the byte codec and EOS.
    fn engine_on(backend: Box<dyn Backend>, model_max_len: usize, rt: RuntimeConfig) -> EngineHandle {
        let parts = EngineParts {
            backend,
            codec: Arc::new(ByteCodec::new()),
            eos_ids: vec![EOS],
            model_max_len,
            control: Default::default(),
        };
        EngineHandle::start_with_parts(parts, rt).expect("engine starts")
    }

    fn greedy(max_tokens: i64) -> SamplingParams {
        SamplingParams { temperature: 0.0, max_tokens: Some(max_tokens), ignore_eos: true, ..SamplingParams::default() }
    }

    fn req(prompt: &str, params: SamplingParams) -> EngineRequest {
        EngineRequest {
            id: format!("r-{prompt}").into(),
            prompt: Prompt::Text(prompt.to_owned()),
            params,
            prior_output_ids: Vec::new(),
            deadline: None,
            cache_salt: None,
            tools: None,
            chat_template_kwargs: None,
        }
    }

    /// One choice: (tokens, text, finish reason).
    type Choice = (Vec<u32>, String, Option<FinishReason>);

    /// Drains a stream; returns per-choice results and every output.
    fn drain(mut s: OutputStream) -> (Vec<Choice>, Vec<EngineOutput>) {
        let mut all = Vec::new();
        while let Some(o) = s.blocking_recv() {
            all.push(o);
        }
        let n = all.iter().map(|o| o.index + 1).max().unwrap_or(0) as usize;
        let mut choices = vec![(Vec::new(), String::new(), None); n];
        for o in &all {
            let c = &mut choices[o.index as usize];
            c.0.extend(&o.token_ids);
            c.1.push_str(&o.text);
            if o.finish_reason.is_some() {
                c.2 = o.finish_reason;
            }
        }
        (choices, all)
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

    const PROMPTS: [&str; 5] = ["a", "hello there", "the quick brown fox jumps", "0123456789abcdefghij", "xy"];

    fn run_all(e: &EngineHandle, together: bool) -> Vec<Vec<u32>> {
        if together {
            let streams: Vec<_> = PROMPTS.iter().map(|p| e.submit(req(p, greedy(24))).expect("submit")).collect();
            streams.into_iter().map(|s| drain(s).0[0].0.clone()).collect()
        } else {
            PROMPTS.iter().map(|p| drain(e.submit(req(p, greedy(24))).expect("submit")).0[0].0.clone()).collect()
        }
    }

    #[test]
    fn batching_chunking_and_preemption_change_nothing() {
        let alone = run_all(&engine(256, 4, RuntimeConfig::default()), false);
        assert!(alone.iter().all(|t| t.len() == 24));
        let together = run_all(&engine(256, 4, RuntimeConfig::default()), true);
        assert_eq!(alone, together);
        let rt = RuntimeConfig { max_num_batched_tokens: 7, ..RuntimeConfig::default() };
        assert_eq!(alone, run_all(&engine(256, 4, rt), true));
        // 16 blocks of 4 = 64 slots; five sequences of 26 to 51 tokens must preempt.
        let tiny = engine(16, 4, RuntimeConfig::default());
        assert_eq!(alone, run_all(&tiny, true));
        assert!(tiny.stats().num_preemptions_total > 0, "{:?}", tiny.stats());
        wait_idle(&tiny);
    }

    /// Unset, the context window is the model's own capped to the KV cache (auto-fit); a
    /// value given is served as given, and one the model or the cache cannot hold stops the
    /// engine from starting (field `max_model_len`) instead of being lowered.
    #[test]
    fn max_model_len_is_fitted_when_unset_and_refused_when_given_and_too_long() {
        let start = |num_blocks: usize, max_model_len: Option<usize>| {
            let parts = EngineParts {
                backend: Box::new(PagedEchoBackend::new(num_blocks, 4)),
                codec: Arc::new(ByteCodec::new()),
                eos_ids: vec![EOS],
                model_max_len: 512,
                control: Default::default(),
            };
            EngineHandle::start_with_parts(parts, RuntimeConfig { max_model_len, ..RuntimeConfig::default() })
        };
        let len = |r: Result<EngineHandle, EngineError>| r.expect("engine starts").model_info().max_model_len;
        assert_eq!(len(start(64, None)), 256, "the model's 512 capped to 64 blocks of 4");
        assert_eq!(len(start(256, None)), 512, "the model's own when the cache holds it");
        assert_eq!(len(start(64, Some(256))), 256, "exactly the capacity fits");
        assert_eq!(len(start(64, Some(100))), 100);
        for (blocks, wanted) in [(64, 257), (256, 513)] {
            match start(blocks, Some(wanted)) {
                Err(EngineError::InvalidRequest { field: "max_model_len", .. }) => {}
                other => panic!("max_model_len {wanted} on {blocks} blocks: expected a refusal, got {other:?}"),
            }
        }
    }

    fn greedy_engine(num_blocks: usize, rt: RuntimeConfig) -> EngineHandle {
        let mut b = PagedEchoBackend::new(num_blocks, 4);
        b.device_greedy = true;
        engine_with(b, rt)
    }

    #[test]
    fn device_greedy_path_changes_no_token() {
        let host = run_all(&engine(256, 4, RuntimeConfig::default()), true);
        let e = greedy_engine(256, RuntimeConfig::default());
        assert_eq!(host, run_all(&e, false));
        assert_eq!(host, run_all(&e, true));
        let st = e.stats();
        assert!(st.steps_total > 0 && st.device_greedy_steps_total == st.steps_total, "{st:?}");
        let chunked = greedy_engine(256, RuntimeConfig { max_num_batched_tokens: 7, ..RuntimeConfig::default() });
        assert_eq!(host, run_all(&chunked, true));
        let tiny = greedy_engine(16, RuntimeConfig::default());
        assert_eq!(host, run_all(&tiny, true));
        assert!(tiny.stats().num_preemptions_total > 0);
        wait_idle(&tiny);
        // Without the capability every step copies logits.
        let plain = engine(256, 4, RuntimeConfig::default());
        run_all(&plain, true);
        assert_eq!(plain.stats().device_greedy_steps_total, 0);
    }

    #[test]
    fn device_greedy_falls_back_when_a_row_needs_logits() {
        // Greedy rows batched with a seeded sampled row, a logprobs row and a penalised
        // greedy row: every token equals the host-sampled run's, stop strings and ids included.
        let params = || {
            vec![
                greedy(20),
                SamplingParams { temperature: 1.3, seed: Some(11), ..greedy(20) },
                SamplingParams { logprobs: Some(2), ..greedy(12) },
                SamplingParams { presence_penalty: 1.5, ..greedy(20) },
                SamplingParams { stop: vec!["q".into()], stop_token_ids: vec![b'Z'.into()], ..greedy(30) },
                greedy(3),
                greedy(40),
            ]
        };
        let run = |e: &EngineHandle| {
            let streams: Vec<_> = params()
                .into_iter()
                .zip(PROMPTS.iter().cycle())
                .map(|(p, t)| e.submit(req(t, p)).expect("submit"))
                .collect();
            streams.into_iter().map(|s| drain(s).0).collect::<Vec<_>>()
        };
        let host = run(&engine(256, 4, RuntimeConfig::default()));
        let e = greedy_engine(256, RuntimeConfig::default());
        let dev = run(&e);
        assert_eq!(host, dev);
        let st = e.stats();
        assert!(st.device_greedy_steps_total > 0, "greedy-only steps once the others finished: {st:?}");
        assert!(st.device_greedy_steps_total < st.steps_total, "mixed steps copy logits: {st:?}");
        // Greedy alone after the mixed batch: still the host's tokens.
        assert_eq!(host[0], drain(e.submit(req(PROMPTS[0], greedy(20))).expect("submit")).0);
    }

    #[test]
    fn kv_waste_is_recorded_per_step() {
        let e = engine(256, 4, RuntimeConfig::default());
        run_all(&e, true);
        let w = e.stats().kv_waste;
        assert!(w.steps > 0 && w.allocated_slot_steps > w.stored_token_steps, "{w:?}");
        assert!(w.max < 1.0 && w.mean > 0.0 && w.mean <= w.max && w.time_weighted <= w.max, "{w:?}");
        // Each sequence wastes less than one block after every step.
        assert!(w.allocated_slot_steps - w.stored_token_steps < w.steps * 5 * 4, "{w:?}");
    }

    #[test]
    fn nothing_leaks_after_mixed_and_dropped_requests() {
        let e = engine(64, 4, RuntimeConfig { max_num_seqs: 8, ..RuntimeConfig::default() });
        let mut kept = Vec::new();
        for i in 0..200u32 {
            let mut p = SamplingParams { temperature: 0.8, seed: Some(u64::from(i)), ..greedy(5 + i64::from(i % 30)) };
            p.n = 1 + i % 3;
            p.ignore_eos = i % 2 == 0;
            if i % 7 == 0 {
                p.stop = vec!["e".into(), "ab".into()];
            }
            let mut r = req(&format!("prompt number {i}"), p);
            if i % 11 == 0 {
                r.deadline = Some(Instant::now() + Duration::from_millis(3));
            }
            let mut s = e.submit(r).expect("submit");
            match i % 5 {
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
            assert!(choices.iter().all(|c| c.2.is_some()), "every choice finishes");
            assert!(outs.last().and_then(|o| o.usage).is_some(), "last output carries usage");
        }
        wait_idle(&e);
        let st = e.stats();
        assert_eq!(st.kv_cache_usage, 0.0);
        assert!(st.finished.abort > 0 && st.finished.length > 0, "{:?}", st.finished);
        assert!(e.is_alive());
    }

    #[test]
    fn bad_input_is_typed_and_engine_keeps_serving() {
        let e = engine(64, 4, RuntimeConfig { max_model_len: Some(40), ..RuntimeConfig::default() });
        let background = e.submit(req("keep going", greedy(29))).expect("submit");
        let field = |r: Result<OutputStream, EngineError>| match r {
            Err(EngineError::InvalidRequest { field, .. }) => field,
            other => panic!("expected InvalidRequest, got {other:?}"),
        };
        assert_eq!(field(e.submit(req("", greedy(4)))), "prompt");
        assert_eq!(field(e.submit(req(&"x".repeat(40), greedy(4)))), "prompt");
        assert_eq!(field(e.submit(req(&"x".repeat(30), greedy(11)))), "max_tokens");
        assert_eq!(field(e.submit(req("hi", greedy(0)))), "max_tokens");
        assert_eq!(field(e.submit(req("hi", greedy(-1)))), "max_tokens");
        assert_eq!(field(e.submit(req("hi", SamplingParams { temperature: -1.0, ..greedy(3) }))), "temperature");
        assert_eq!(field(e.submit(req("hi", SamplingParams { top_p: 0.0, ..greedy(3) }))), "top_p");
        assert_eq!(field(e.submit(req("hi", SamplingParams { top_k: -5, ..greedy(3) }))), "top_k");
        assert_eq!(field(e.submit(req("hi", SamplingParams { n: 0, ..greedy(3) }))), "n");
        let mut bad_ids = req("hi", greedy(3));
        bad_ids.prompt = Prompt::TokenIds(vec![1, 2, 9999]);
        assert_eq!(field(e.submit(bad_ids)), "prompt");
        let stop_ids = SamplingParams { stop_token_ids: vec![99_999_999], ..greedy(3) };
        assert_eq!(field(e.submit(req("hi", stop_ids))), "stop_token_ids");
        let (c, _) = drain(background);
        assert_eq!((c[0].0.len(), c[0].2), (29, Some(FinishReason::Length)));
        // max_tokens None: until the window (40) is full.
        let (c, outs) =
            drain(e.submit(req("0123456789", SamplingParams { max_tokens: None, ..greedy(1) })).expect("ok"));
        assert_eq!((c[0].0.len(), c[0].2), (29, Some(FinishReason::Length)), "11 prompt tokens incl. BOS");
        assert_eq!(outs.last().and_then(|o| o.usage).map(|u| (u.prompt_tokens, u.completion_tokens)), Some((11, 29)));
        wait_idle(&e);
    }

    #[test]
    fn seeds_stops_logprobs_and_n() {
        let e = engine(256, 4, RuntimeConfig::default());
        let sampled = |seed| {
            let p = SamplingParams { temperature: 1.5, seed: Some(seed), n: 2, ..greedy(16) };
            drain(e.submit(req("seeded", p)).expect("submit")).0
        };
        let a = sampled(7);
        assert_eq!(a, sampled(7));
        assert_ne!(a[0].0, a[1].0, "choices use different streams");
        assert_ne!(a, sampled(8));
        // A stop string taken from the greedy output: cut before it, never in a delta.
        let (full, _) = drain(e.submit(req("stop test", greedy(24))).expect("submit"));
        let text = &full[0].1;
        let stop = text[10..13].to_owned();
        let p = SamplingParams { stop: vec![stop.clone()], ..greedy(24) };
        let (c, outs) = drain(e.submit(req("stop test", p)).expect("submit"));
        assert_eq!(c[0].2, Some(FinishReason::Stop));
        assert_eq!(c[0].1, text[..text.find(&stop).expect("present")]);
        assert!(outs.iter().all(|o| !o.text.contains(&stop)));
        // Stop token id: the first generated token.
        let p = SamplingParams { stop_token_ids: vec![full[0].0[0]], ..greedy(24) };
        let (c, _) = drain(e.submit(req("stop test", p)).expect("submit"));
        assert_eq!((c[0].0.len(), c[0].1.as_str(), c[0].2), (1, "", Some(FinishReason::Stop)));
        // Logprobs: one entry per token with 3 alternatives, the greedy token first.
        let p = SamplingParams { logprobs: Some(3), ..greedy(5) };
        let (_, outs) = drain(e.submit(req("lp", p)).expect("submit"));
        let lps: Vec<_> = outs.iter().flat_map(|o| o.logprobs.clone()).collect();
        assert_eq!(lps.len(), 5);
        assert!(lps.iter().all(|l| l.top_logprobs.len() == 3 && l.top_logprobs[0].token_id == l.token_id));
        assert!(lps.iter().all(|l| l.logprob < 0.0 && l.logprob.is_finite()));
    }

    /// `include_stop_str_in_output` keeps the stop string, never streaming part of it early;
    /// a stop string that is the EOS token's text stops there with `ignore_eos`, though the
    /// token is hidden from the text.
    #[test]
    fn kept_stop_strings_and_special_token_stops() {
        let e = engine(256, 4, RuntimeConfig::default());
        let (full, _) = drain(e.submit(req("stop test", greedy(24))).expect("submit"));
        let text = &full[0].1;
        let stop = text[10..13].to_owned();
        let cut = text.find(&stop).expect("present");
        let p = SamplingParams { stop: vec![stop.clone()], include_stop_str_in_output: true, ..greedy(24) };
        let (c, outs) = drain(e.submit(req("stop test", p)).expect("submit"));
        assert_eq!((c[0].1.as_str(), c[0].2), (&text[..cut + stop.len()], Some(FinishReason::Stop)));
        let last = outs.iter().rev().find(|o| !o.text.is_empty()).expect("text");
        assert!(last.text.ends_with(&stop), "the stop string goes out whole: {:?}", last.text);
        assert!(outs.iter().all(|o| o.text.ends_with(&stop) || !o.text.contains(&stop)));
        // A prompt whose greedy continuation (EOS ignored) contains EOS.
        let (prompt, tokens, text) = (0..40)
            .find_map(|i| {
                let prompt = format!("p{i}");
                let (c, _) = drain(e.submit(req(&prompt, greedy(64))).expect("submit"));
                let (tokens, text, _) = c.into_iter().next()?;
                tokens.contains(&EOS).then_some((prompt, tokens, text))
            })
            .expect("some continuation reaches EOS");
        let at = tokens.iter().position(|&t| t == EOS).expect("EOS");
        let p = SamplingParams { stop: vec!["</s>".into()], ..greedy(64) };
        let (c, _) = drain(e.submit(req(&prompt, p)).expect("submit"));
        assert_eq!(c[0].0, tokens[..=at].to_vec(), "stops at the EOS token");
        assert_eq!(c[0].2, Some(FinishReason::Stop));
        let before: Vec<u8> = tokens[..at].iter().filter(|&&t| t < EOS).map(|&t| t as u8).collect();
        assert_eq!(c[0].1, String::from_utf8_lossy(&before), "the hidden token stays out of the text");
        assert!(text.starts_with(&c[0].1));
        // EOS ending the sequence by itself: its text only with include_stop_str_in_output and
        // skip_special_tokens false (vLLM's rule), streamed deltas adding up to the same text.
        let ends = |include: bool, skip: bool| SamplingParams {
            ignore_eos: false,
            include_stop_str_in_output: include,
            skip_special_tokens: skip,
            ..greedy(64)
        };
        let (plain, _) = drain(e.submit(req(&prompt, ends(false, true))).expect("submit"));
        assert_eq!((plain[0].0.last(), plain[0].2), (Some(&EOS), Some(FinishReason::Stop)));
        for (include, skip) in [(false, true), (false, false), (true, true)] {
            let (c, _) = drain(e.submit(req(&prompt, ends(include, skip))).expect("submit"));
            assert_eq!(c[0].1, plain[0].1, "include {include} skip {skip}: no EOS text");
        }
        let (c, outs) = drain(e.submit(req(&prompt, ends(true, false))).expect("submit"));
        assert_eq!(c[0].1, format!("{}</s>", plain[0].1));
        assert_eq!(
            outs.last().map(|o| (o.text.ends_with("</s>"), o.finish_reason)),
            Some((true, Some(FinishReason::Stop)))
        );
        wait_idle(&e);
    }

    #[test]
    fn migration_continues_without_re_emitting() {
        let e = engine(256, 4, RuntimeConfig::default());
        let (full, _) = drain(e.submit(req("migrate me", greedy(20))).expect("submit"));
        let mut r = req("migrate me", greedy(20));
        r.prior_output_ids = full[0].0[..8].to_vec();
        let (rest, outs) = drain(e.submit(r).expect("submit"));
        assert_eq!(rest[0].0, full[0].0[8..].to_vec());
        assert_eq!(full[0].1, String::from_utf8_lossy(&full[0].0.iter().map(|&t| t as u8).collect::<Vec<_>>()));
        assert_eq!(outs.last().and_then(|o| o.usage).map(|u| u.completion_tokens), Some(20));
    }

    #[test]
    fn deadline_and_shutdown_abort() {
        let e = engine(256, 4, RuntimeConfig::default());
        let mut r = req("slow", greedy(400));
        r.deadline = Some(Instant::now());
        let (c, _) = drain(e.submit(r).expect("submit"));
        assert_eq!(c[0].2, Some(FinishReason::Abort));
        // A slow backend (1 ms/step) so 400 tokens cannot finish before the shutdown.
        let mut backend = PagedEchoBackend::new(256, 4);
        backend.step_time = Duration::from_millis(1);
        let e = engine_with(backend, RuntimeConfig::default());
        let mut s = e.submit(req("long", greedy(400))).expect("submit");
        let first = s.blocking_recv().expect("a first output");
        let reader = std::thread::spawn(move || drain(s));
        e.shutdown();
        let (c, _) = reader.join().expect("reader");
        assert!(c[0].0.len() + first.token_ids.len() < 400);
        assert_eq!(c[0].2, Some(FinishReason::Abort));
        assert!(!e.is_alive());
        assert!(matches!(e.submit(req("late", greedy(3))), Err(EngineError::Unavailable(_))));
    }

    struct FailingBackend;

    impl Backend for FailingBackend {
        fn forward(&mut self, _: &StepBatch) -> Result<Logits, BackendError> {
            Err(BackendError::Device("simulated device loss".into()))
        }
        fn num_kv_blocks(&self) -> usize {
            8
        }
        fn block_size(&self) -> usize {
            4
        }
        fn kv_bytes_per_token(&self) -> usize {
            8
        }
        fn name(&self) -> &'static str {
            "failing"
        }
    }

    #[test]
    fn backend_failure_ends_streams_without_finish_and_marks_dead() {
        let e = engine_on(Box::new(FailingBackend), 32, RuntimeConfig::default());
        let (c, outs) = drain(e.submit(req("doomed", greedy(4))).expect("submit"));
        assert!(outs.is_empty() && c.is_empty(), "no output, no finish reason: {outs:?}");
        let deadline = Instant::now() + Duration::from_secs(5);
        while e.is_alive() {
            assert!(Instant::now() < deadline, "engine still alive after a failed step");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(e.stats().requests_in_flight, 0);
        assert!(matches!(e.submit(req("next", greedy(2))), Err(EngineError::Unavailable(_))));
    }
}
