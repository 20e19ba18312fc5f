//! The engine's step loop, on its own OS thread (TGI's router/backend split, vLLM's
//! `EngineCore`): it owns the scheduler, the backend and every request's sampling and
//! detokenization state; callers reach it only through a command channel.
//!
//! Each iteration: take new commands (blocking only when idle) → drop requests whose
//! stream was dropped and abort those past their deadline → schedule → one backend
//! forward (`forward_greedy` instead when the backend has a device argmax and every row of
//! the step is plain greedy: only the token ids come back, not `rows × vocab` f32 logits) →
//! record the step's KV occupancy (waste statistics) → sample, detokenize, check stop
//! conditions → queue outputs → flush them with `try_send` (the thread never blocks on a
//! slow client: outputs of a full stream are merged and sent later). A backend failure ends every stream without a finish reason
//! and marks the engine dead.
//!
//! Stopping: the loop checks the replica's [`StepControl`] before every step, and the
//! backend checks it between layers, so a stop request ([`StopKind::Shutdown`]: abort
//! every request; [`StopKind::Fail`]: end streams without a finish reason) takes effect
//! within one layer's time even during a long prefill. The forward pass runs on the
//! replica's own compute pool (`install`), which is dropped, and its threads end, when
//! the loop returns. Gauges (running, waiting) are published as soon as requests are
//! admitted and scheduled, before the step runs, so `/metrics` shows work in progress.

use super::backend::{Backend, BackendError, LogitEdit, StepControl, StopKind};
use super::codec::TextCodec;
use super::constraint::{MaskJob, RowMask, SeqConstraint, StepMasks, assemble};
use super::detokenizer::Detokenizer;
use super::metrics::StatsRecorder;
use super::request::{EngineError, EngineOutput, FinishReason, TokenLogprob, TopLogprob, Usage};
use super::sampler::{Sampled, Sampler, SamplingConfig};
use super::scheduler::{Scheduler, SeqId, SeqOptions};
use prism_ids::RequestId;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::error::TrySendError;

/// Idle wake-up period (keeps `last_step_ok_at` fresh while idle).
const IDLE_TICK: Duration = Duration::from_secs(1);
/// Wait between flush attempts when only slow consumers are left.
const FLUSH_RETRY: Duration = Duration::from_millis(2);
/// How long shutdown waits for slow readers to take their final outputs.
const SHUTDOWN_FLUSH: Duration = Duration::from_secs(2);

/// A validated, tokenized request on its way to the step thread.
#[derive(Debug)]
pub(crate) struct NewRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    pub prior: Vec<u32>,
    pub sampling: SamplingConfig,
    pub seed: Option<u64>,
    pub n: u32,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub skip_special: bool,
    /// Keep a matched stop string at the end of the text.
    pub include_stop_str: bool,
    /// Validated `(token, bias)` pairs, one per token.
    pub logit_bias: Arc<[(u32, f32)]>,
    pub min_tokens: usize,
    /// The compiled grammar (`prior` already consumed), for choice 0; other choices clone it.
    pub grammar: Option<NewGrammar>,
    /// Total tokens the request may generate per choice (`prior` included).
    pub max_new: usize,
    pub deadline: Option<Instant>,
    pub arrival: Instant,
    /// Prefix-cache salt (validated by `submit`).
    pub cache_salt: Option<Arc<str>>,
    pub tx: tokio::sync::mpsc::Sender<EngineOutput>,
}

/// A request's compiled grammar.
pub(crate) struct NewGrammar {
    pub matcher: Box<llguidance::Matcher>,
    /// The token llguidance's masks use for "the grammar may end here".
    pub mask_eos: u32,
    /// The request field it came from (`structured_output.<variant>`), named in its errors.
    pub field: &'static str,
}

impl std::fmt::Debug for NewGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewGrammar").field("mask_eos", &self.mask_eos).finish_non_exhaustive()
    }
}

/// A fault to inject into a running engine (opt-in: the worker exposes it only with
/// `--enable-fault-injection`). The CPU backend has no shard processes, so stopping the
/// step thread is its analogue of SIGKILL / SIGSTOP of a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The step thread ends as if the backend had failed: every stream ends without a
    /// finish reason and [`EngineHandle::is_alive`](crate::EngineHandle::is_alive) turns false.
    KillStepThread,
    /// The step thread sleeps this long before its next step (a frozen shard); a stop
    /// request ([`EngineHandle::stop`](crate::EngineHandle::stop), [`EngineHandle::shutdown`](crate::EngineHandle::shutdown)) ends the sleep early.
    Stall(std::time::Duration),
}

/// Messages to the step thread.
#[derive(Debug)]
pub(crate) enum Command {
    Submit(Box<NewRequest>),
    Shutdown,
    /// Opt-in fault injection (tests, chaos drills): see [`Fault`].
    Fault(Fault),
}

struct SeqState {
    req: u64,
    index: u32,
    sampler: Sampler,
    detok: Detokenizer,
    /// Tokens generated (`prior` included).
    generated: usize,
    last_token_at: Option<Instant>,
    /// Grammar, `logit_bias`, `min_tokens`; `None` for free sequences.
    constraint: Option<SeqConstraint>,
}

struct ReqState {
    id: RequestId,
    tx: tokio::sync::mpsc::Sender<EngineOutput>,
    seqs: Vec<SeqId>,
    unfinished: usize,
    pending: VecDeque<EngineOutput>,
    prompt_len: usize,
    completion_tokens: u32,
    max_new: usize,
    stop_token_ids: Vec<u32>,
    ignore_eos: bool,
    want_logprobs: Option<usize>,
    deadline: Option<Instant>,
    arrival: Instant,
    first_token_at: Option<Instant>,
    /// Choice 0's prompt tokens taken from the prefix cache at its first admission.
    cached_tokens: Option<u32>,
}

/// State owned by the step thread.
pub(crate) struct EngineCore {
    pub sched: Scheduler,
    pub backend: Box<dyn Backend>,
    pub codec: Arc<dyn TextCodec>,
    pub eos_ids: HashSet<u32>,
    pub max_model_len: usize,
    pub stats: Arc<StatsRecorder>,
    /// This replica's compute threads (dropped with the core when the loop returns).
    compute: rayon::ThreadPool,
    reqs: HashMap<u64, ReqState>,
    seqs: HashMap<SeqId, SeqState>,
    next_req: u64,
    next_seq: SeqId,
}

impl EngineCore {
    pub fn new(
        sched: Scheduler,
        backend: Box<dyn Backend>,
        codec: Arc<dyn TextCodec>,
        eos_ids: &[u32],
        max_model_len: usize,
        stats: Arc<StatsRecorder>,
        compute: rayon::ThreadPool,
    ) -> Self {
        Self {
            sched,
            backend,
            codec,
            eos_ids: eos_ids.iter().copied().collect(),
            max_model_len,
            stats,
            compute,
            reqs: HashMap::new(),
            seqs: HashMap::new(),
            next_req: 0,
            next_seq: 0,
        }
    }

    /// Runs until shutdown, until every handle is gone and no work is left, or until the
    /// backend fails.
    pub fn run(mut self, rx: Receiver<Command>) {
        let mut handles_gone = false;
        loop {
            if self.stop_if_requested() {
                return;
            }
            // 1. Commands: block only when there is nothing to do.
            let first = if self.reqs.is_empty() {
                if handles_gone {
                    break;
                }
                match rx.recv_timeout(IDLE_TICK) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => {
                        self.stats.mark_step_ok(Instant::now());
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            } else if self.sched.is_idle() {
                // Only outputs waiting for slow consumers.
                match rx.recv_timeout(FLUSH_RETRY) {
                    Ok(c) => Some(c),
                    Err(RecvTimeoutError::Timeout) => {
                        // The loop is responsive; only slow consumers hold it.
                        self.stats.mark_step_ok(Instant::now());
                        None
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        handles_gone = true;
                        None
                    }
                }
            } else {
                None
            };
            let mut shutdown = false;
            let mut killed = false;
            let mut next = first;
            loop {
                match next.take() {
                    Some(Command::Submit(r)) => {
                        self.add_request(*r);
                        self.publish();
                    }
                    Some(Command::Shutdown) => shutdown = true,
                    Some(Command::Fault(Fault::KillStepThread)) => killed = true,
                    Some(Command::Fault(Fault::Stall(d))) => {
                        tracing::warn!(secs = d.as_secs_f64(), "fault injection: stalling the step thread");
                        stall(&self.stats.control, d);
                    }
                    None => {}
                }
                match rx.try_recv() {
                    Ok(c) => next = Some(c),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        handles_gone = true;
                        break;
                    }
                }
            }
            if self.stop_if_requested() {
                return;
            }
            if shutdown {
                self.abort_all();
                break;
            }
            if killed {
                tracing::error!("fault injection: engine step thread killed; failing all requests");
                self.stats.set_failure("engine step thread killed (fault injection)".into());
                self.die();
                return;
            }
            // 2. Dropped streams and deadlines.
            self.reap();
            // 3. One step.
            if !self.sched.is_idle() {
                if let Err(e) = self.step() {
                    if matches!(e, BackendError::Cancelled) && self.stop_if_requested() {
                        return;
                    }
                    tracing::error!(error = %e, backend = self.backend.name(), "engine step failed; failing all requests");
                    self.stats.set_failure(format!("engine step failed: {e}"));
                    self.die();
                    return;
                }
                self.stats.mark_step_ok(Instant::now());
            }
            // 4. Deliver.
            self.flush();
            self.publish();
        }
        self.stats.alive.store(false, Ordering::Relaxed);
        self.publish();
    }

    /// Acts on a stop request, if there is one: `Shutdown` aborts every request (finish
    /// reason `abort`), `Fail` ends every stream without one. Returns whether the loop must
    /// end.
    fn stop_if_requested(&mut self) -> bool {
        match self.stats.control.stop_requested() {
            None => false,
            Some(StopKind::Shutdown) => {
                self.abort_all();
                self.stats.alive.store(false, Ordering::Relaxed);
                self.publish();
                true
            }
            Some(StopKind::Fail) => {
                tracing::warn!(backend = self.backend.name(), "engine stopped: replica failed; ending all streams");
                self.die();
                true
            }
        }
    }

    /// Marks the engine dead and ends every stream without a finish reason (dropping the
    /// senders), so callers retry or migrate; the KV blocks are freed.
    fn die(&mut self) {
        // Count first: dropping the senders below ends the streams, and a reader that
        // then sees `is_alive() == false` must also see nothing in flight.
        self.stats.in_flight.store(0, Ordering::Relaxed);
        self.reqs.clear();
        let live: Vec<SeqId> = self.seqs.keys().copied().collect();
        for s in live {
            self.sched.remove(s);
        }
        self.seqs.clear();
        self.publish();
        self.stats.alive.store(false, Ordering::Relaxed);
    }

    fn publish(&self) {
        self.stats.running.store(self.sched.num_running(), Ordering::Relaxed);
        self.stats.waiting.store(self.sched.num_waiting(), Ordering::Relaxed);
        self.stats.preemptions.store(self.sched.num_preemptions(), Ordering::Relaxed);
        let c = self.sched.prefix_counters();
        self.stats.prefix_cache_queries.store(c.queries, Ordering::Relaxed);
        self.stats.prefix_cache_hits.store(c.hits, Ordering::Relaxed);
        self.stats.prompt_tokens_computed.store(c.prompt_tokens_computed, Ordering::Relaxed);
    }

    fn add_request(&mut self, r: NewRequest) {
        let key = self.next_req;
        self.next_req += 1;
        let mut seqs = Vec::with_capacity(r.n as usize);
        let constrained = r.grammar.is_some() || !r.logit_bias.is_empty() || r.min_tokens > r.prior.len();
        let (enders, end_ids): (Arc<[u32]>, Arc<[u32]>) = if constrained {
            let mut end_ids: Vec<u32> = self.eos_ids.iter().copied().chain(r.stop_token_ids.iter().copied()).collect();
            end_ids.sort_unstable();
            end_ids.dedup();
            let enders = end_ids.iter().copied().filter(|t| !r.ignore_eos || r.stop_token_ids.contains(t)).collect();
            (enders, end_ids.into())
        } else {
            (Arc::from([]), Arc::from([]))
        };
        let (mask_eos, field) = r.grammar.as_ref().map_or((0, "structured_output"), |g| (g.mask_eos, g.field));
        let mut grammar = r.grammar;
        for index in 0..r.n {
            let seq = self.next_seq;
            self.next_seq += 1;
            let seed = r.seed.map(|s| s.wrapping_add(u64::from(index)));
            let sampler = Sampler::new(r.sampling.clone(), seed, &r.prompt, &r.prior);
            let mut detok = Detokenizer::new(&r.stop, r.skip_special, r.include_stop_str);
            for &t in &r.prior {
                detok.prime(self.codec.token_bytes(t), self.codec.is_special(t));
            }
            let mut tokens = r.prompt.clone();
            tokens.extend_from_slice(&r.prior);
            // Choices 1.. follow choice 0, so the prompt is prefilled once and shared.
            let opts = SeqOptions { salt: r.cache_salt.clone(), follows: seqs.first().copied() };
            self.sched.add_with(seq, tokens, opts);
            let constraint = constrained.then(|| {
                // Each choice walks the grammar on its own (a deep clone shares no lexer state,
                // so choices' masks compute in parallel).
                let matcher = if index + 1 == r.n {
                    grammar.take().map(|g| g.matcher)
                } else {
                    grammar.as_ref().map(|g| Box::new(g.matcher.deep_clone()))
                };
                SeqConstraint {
                    grammar: matcher.is_some(),
                    matcher,
                    pending: None,
                    mask_eos,
                    field,
                    logit_bias: r.logit_bias.clone(),
                    min_tokens: r.min_tokens,
                    enders: enders.clone(),
                    end_ids: end_ids.clone(),
                }
            });
            self.seqs.insert(
                seq,
                SeqState { req: key, index, sampler, detok, generated: r.prior.len(), last_token_at: None, constraint },
            );
            seqs.push(seq);
        }
        tracing::debug!(request_id = %r.id, prompt_tokens = r.prompt.len(), n = r.n, "request added");
        self.reqs.insert(
            key,
            ReqState {
                id: r.id,
                tx: r.tx,
                unfinished: seqs.len(),
                seqs,
                pending: VecDeque::new(),
                prompt_len: r.prompt.len(),
                completion_tokens: (r.prior.len() * r.n as usize) as u32,
                max_new: r.max_new,
                stop_token_ids: r.stop_token_ids,
                ignore_eos: r.ignore_eos,
                want_logprobs: r.sampling.logprobs,
                deadline: r.deadline,
                arrival: r.arrival,
                first_token_at: None,
                cached_tokens: None,
            },
        );
    }

    /// Removes requests whose stream is gone; aborts those past their deadline.
    fn reap(&mut self) {
        let now = Instant::now();
        let mut gone = Vec::new();
        let mut expired = Vec::new();
        for (&k, r) in &self.reqs {
            if r.tx.is_closed() {
                gone.push(k);
            } else if r.unfinished > 0 && r.deadline.is_some_and(|d| now >= d) {
                expired.push(k);
            }
        }
        for k in gone {
            if let Some(r) = self.reqs.remove(&k) {
                tracing::debug!(request_id = %r.id, "stream dropped; request aborted");
                for s in &r.seqs {
                    self.sched.remove(*s);
                    self.seqs.remove(s);
                }
                if r.unfinished > 0 {
                    self.stats.count_finished(FinishReason::Abort);
                }
                self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            }
        }
        for k in expired {
            let live: Vec<SeqId> = self.reqs.get(&k).map(|r| r.seqs.clone()).unwrap_or_default();
            for s in live {
                if self.seqs.contains_key(&s) {
                    self.finish_seq(s, FinishReason::Abort, EngineOutput::default());
                }
            }
        }
    }

    fn abort_all(&mut self) {
        let live: Vec<SeqId> = self.seqs.keys().copied().collect();
        for s in live {
            self.finish_seq(s, FinishReason::Abort, EngineOutput::default());
        }
        // Give readers a bounded chance to take the final outputs from full channels.
        let deadline = Instant::now() + SHUTDOWN_FLUSH;
        self.flush();
        while !self.reqs.is_empty() && Instant::now() < deadline {
            std::thread::sleep(FLUSH_RETRY);
            self.flush();
        }
    }

    fn step(&mut self) -> Result<(), super::backend::BackendError> {
        let out = self.sched.schedule();
        for s in out.unschedulable {
            self.finish_seq(s, FinishReason::Length, EngineOutput::default());
        }
        for &(seq, cached) in &out.admitted {
            let Some(s) = self.seqs.get(&seq) else { continue };
            if s.index == 0
                && let Some(r) = self.reqs.get_mut(&s.req)
                && r.cached_tokens.is_none()
            {
                r.cached_tokens = Some(cached.min(r.prompt_len) as u32);
            }
        }
        // Gauges before the (possibly long) forward pass.
        self.publish();
        if out.scheduled.is_empty() {
            return Ok(());
        }
        // Device argmax when every row's sampler is a plain argmax of the logits (the
        // sampler says so; grammar masks, logit_bias and min_tokens are applied there too);
        // otherwise full logits to the host.
        let greedy = self.backend.has_device_greedy()
            && out
                .scheduled
                .iter()
                .filter(|s| s.want_logits)
                .all(|sc| self.seqs.get(&sc.seq).is_none_or(|s| s.sampler.is_plain_greedy()));
        let rows: Vec<SeqId> = out.scheduled.iter().filter(|s| s.want_logits).map(|s| s.seq).collect();
        // Grammar masks compute on the pool while the forward runs.
        let (masks, mut edits) = self.start_constraints(&rows);
        let constrained = masks.is_some() || !edits.is_empty();
        let mut joined: Vec<RowMask> = Vec::new();
        let mut masks = masks;
        let mask_words = masks.as_ref().map_or(0, StepMasks::mask_words);
        let backend = &mut self.backend;
        let started = Instant::now();
        let result = if greedy && constrained {
            let mut constraints = || {
                if let Some(m) = masks.take() {
                    joined = m.join();
                }
                assemble(rows.len(), mask_words, &joined, std::mem::take(&mut edits))
            };
            let ids = self.compute.install(|| backend.forward_greedy_constrained(&out.batch, &mut constraints));
            StepResult::Greedy(ids?)
        } else if greedy {
            StepResult::Greedy(self.compute.install(|| backend.forward_greedy(&out.batch))?)
        } else {
            let mut logits = self.compute.install(|| backend.forward(&out.batch))?;
            if constrained {
                if let Some(m) = masks.take() {
                    joined = m.join();
                }
                assemble(rows.len(), mask_words, &joined, std::mem::take(&mut edits)).apply(&mut logits);
            }
            StepResult::Logits(logits)
        };
        let forward_time = started.elapsed();
        let (failed, done) = self.restore_matchers(&rows, joined);
        self.sched.commit(&out.scheduled);
        let (allocated, stored) = self.sched.kv_occupancy();
        self.stats.observe_step(allocated, stored, forward_time, greedy);
        let now = Instant::now();
        let n_rows = result.rows();
        if rows.len() > n_rows {
            return Err(super::backend::BackendError::InvalidBatch(format!(
                "backend returned {n_rows} logit rows, {} were asked for",
                rows.len()
            )));
        }
        for (row, &seq) in rows.iter().enumerate() {
            if failed.iter().any(|(f, _)| *f == seq) || done.contains(&seq) {
                continue;
            }
            let sampled = match self.seqs.get_mut(&seq) {
                Some(s) => match &result {
                    StepResult::Logits(l) => s.sampler.sample(l.row(row)),
                    StepResult::Greedy(ids) => s.sampler.accept_greedy(ids[row]),
                },
                None => continue,
            };
            self.on_token(seq, sampled, now);
        }
        for (seq, e) in failed {
            self.finish_seq(seq, FinishReason::Abort, EngineOutput { error: Some(e), ..EngineOutput::default() });
        }
        // The previous step's token completed these grammars (found by this step's job).
        for seq in done {
            self.finish_seq(seq, FinishReason::Stop, EngineOutput::default());
        }
        Ok(())
    }

    /// This step's grammar mask jobs (started on the compute pool, each holding its row's
    /// matcher) and additive logit edits of the logit rows `rows`.
    fn start_constraints(&mut self, rows: &[SeqId]) -> (Option<StepMasks>, Vec<LogitEdit>) {
        let mut jobs = Vec::new();
        let mut edits = Vec::new();
        for (row, seq) in rows.iter().enumerate() {
            let Some(s) = self.seqs.get_mut(seq) else { continue };
            let Some(c) = s.constraint.as_mut() else { continue };
            c.push_edits(row as u32, s.generated, &mut edits);
            if let Some(matcher) = c.matcher.take() {
                let (enders, end_ids, mask_eos) = (c.enders.clone(), c.end_ids.clone(), c.mask_eos);
                jobs.push(MaskJob { row, matcher, pending: c.pending.take(), enders, end_ids, mask_eos });
            }
        }
        let masks = (!jobs.is_empty()).then(|| StepMasks::start(&self.compute, jobs, self.codec.vocab_size()));
        (masks, edits)
    }

    /// Gives each row's matcher back to its sequence; returns the grammar sequences whose
    /// mask failed, with the error that ends them (llguidance's: the request's; a job that
    /// did not return: internal), and those whose grammar the previous token completed (`stop`).
    fn restore_matchers(&mut self, rows: &[SeqId], joined: Vec<RowMask>) -> (Vec<(SeqId, EngineError)>, Vec<SeqId>) {
        let (mut failed, mut done) = (Vec::new(), Vec::new());
        for m in joined {
            let Some(&seq) = rows.get(m.row) else { continue };
            let Some(c) = self.seqs.get_mut(&seq).and_then(|s| s.constraint.as_mut()) else { continue };
            if let Err(e) = &m.mask {
                tracing::warn!(error = %e, "grammar mask failed; the sequence ends with an error");
                failed.push((seq, c.failure(e)));
            } else if m.done {
                done.push(seq);
            }
            c.matcher = Some(m.matcher);
        }
        for &seq in rows {
            let lost = self
                .seqs
                .get(&seq)
                .and_then(|s| s.constraint.as_ref())
                .is_some_and(|c| c.grammar && c.matcher.is_none());
            if lost && !failed.iter().any(|(f, _)| *f == seq) {
                tracing::warn!("grammar mask job did not return; the sequence ends with an error");
                failed.push((seq, EngineError::Internal("the grammar mask job did not return".into())));
            }
        }
        (failed, done)
    }

    fn on_token(&mut self, seq: SeqId, sampled: Sampled, now: Instant) {
        let tok = sampled.token;
        let Some(s) = self.seqs.get_mut(&seq) else { return };
        let Some(r) = self.reqs.get_mut(&s.req) else { return };
        s.sampler.observe(tok);
        s.generated += 1;
        r.completion_tokens += 1;
        self.sched.append_token(seq, tok);
        self.stats.generation_tokens.fetch_add(1, Ordering::Relaxed);
        if let Some(prev) = s.last_token_at {
            self.stats.observe_itl(now - prev);
        }
        s.last_token_at = Some(now);
        if r.first_token_at.is_none() {
            r.first_token_at = Some(now);
            self.stats.observe_ttft(now - r.arrival);
            self.stats.prompt_tokens.fetch_add(r.prompt_len as u64, Ordering::Relaxed);
        }
        let eos = !r.ignore_eos && self.eos_ids.contains(&tok);
        let stop_id = r.stop_token_ids.contains(&tok);
        let total_len = r.prompt_len + s.generated;
        let at_length = s.generated >= r.max_new || total_len >= self.max_model_len;
        // The grammar follows every token that does not end the sequence: in the next step's
        // mask job, or now when this is the sequence's last token by length (a grammar it
        // completes makes the reason `stop`).
        let (grammar_done, error) = match s.constraint.as_mut() {
            Some(c) if !(eos || stop_id) => match if at_length { c.advance(tok) } else { c.defer(tok) } {
                Ok(done) => (done, None),
                Err(e) => {
                    tracing::warn!(error = %e, "the grammar rejected a sampled token; the sequence ends with an error");
                    (false, Some(c.failure(&e)))
                }
            },
            _ => (false, None),
        };
        let (text, stop_str) = if eos || stop_id {
            (s.detok.push_end(self.codec.token_bytes(tok), self.codec.is_special(tok)), false)
        } else {
            s.detok.push(self.codec.token_bytes(tok), self.codec.is_special(tok))
        };
        let logprobs = match (r.want_logprobs, sampled.logprob) {
            (Some(_), Some(lp)) => vec![token_logprob(&*self.codec, tok, lp, &sampled.top)],
            _ => Vec::new(),
        };
        let reason = if error.is_some() {
            Some(FinishReason::Abort)
        } else if eos || stop_id || stop_str || grammar_done {
            Some(FinishReason::Stop)
        } else if at_length {
            Some(FinishReason::Length)
        } else {
            None
        };
        let out =
            EngineOutput { index: s.index, token_ids: vec![tok], text, logprobs, error, ..EngineOutput::default() };
        match reason {
            Some(reason) => self.finish_seq(seq, reason, out),
            None => {
                let key = s.req;
                self.queue(key, out);
            }
        }
    }

    /// Ends one choice: flushes held-back text into `out`, marks it finished, frees its
    /// blocks, and completes the request (usage, e2e latency) when it was the last choice.
    fn finish_seq(&mut self, seq: SeqId, reason: FinishReason, mut out: EngineOutput) {
        self.sched.remove(seq);
        let Some(mut s) = self.seqs.remove(&seq) else { return };
        out.index = s.index;
        out.text.push_str(&s.detok.finish());
        out.finish_reason = Some(reason);
        let Some(r) = self.reqs.get_mut(&s.req) else { return };
        r.unfinished = r.unfinished.saturating_sub(1);
        if r.unfinished == 0 {
            out.usage = Some(Usage {
                prompt_tokens: r.prompt_len as u32,
                completion_tokens: r.completion_tokens,
                cached_tokens: r.cached_tokens.unwrap_or(0),
            });
            self.stats.count_finished(reason);
            self.stats.observe_e2e(r.arrival.elapsed());
            tracing::debug!(request_id = %r.id, reason = reason.as_str(), "request finished");
        }
        self.queue(s.req, out);
    }

    /// Queues an output, merging it into an unsent one of the same choice.
    fn queue(&mut self, key: u64, mut out: EngineOutput) {
        let Some(r) = self.reqs.get_mut(&key) else { return };
        out.prompt_tokens = r.prompt_len as u32;
        // At most one unsent output per choice: merge into it and move it to the back, so
        // the output carrying `usage` is always the request's last.
        let prev = r.pending.iter().position(|p| p.index == out.index && p.finish_reason.is_none());
        if let Some(mut prev) = prev.and_then(|i| r.pending.remove(i)) {
            prev.token_ids.extend(out.token_ids);
            prev.text.push_str(&out.text);
            prev.logprobs.extend(out.logprobs);
            prev.finish_reason = out.finish_reason;
            prev.error = out.error;
            prev.usage = out.usage;
            out = prev;
        }
        r.pending.push_back(out);
    }

    /// Sends queued outputs without blocking; drops requests that are complete and
    /// delivered, or whose stream is gone.
    fn flush(&mut self) {
        let mut done = Vec::new();
        for (&k, r) in &mut self.reqs {
            while let Some(out) = r.pending.pop_front() {
                match r.tx.try_send(out) {
                    Ok(()) => {}
                    Err(TrySendError::Full(out)) => {
                        r.pending.push_front(out);
                        break;
                    }
                    Err(TrySendError::Closed(_)) => {
                        r.pending.clear();
                        break;
                    }
                }
            }
            if r.unfinished == 0 && (r.pending.is_empty() || r.tx.is_closed()) {
                done.push(k);
            }
        }
        for k in done {
            if self.reqs.remove(&k).is_some() {
                self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }
}

/// What one forward step returned: full logits (sampled on the host) or, when every row is
/// plain greedy and the backend has a device argmax, one token per row.
enum StepResult {
    Logits(super::backend::Logits),
    Greedy(Vec<u32>),
}

impl StepResult {
    fn rows(&self) -> usize {
        match self {
            Self::Logits(l) => l.rows,
            Self::Greedy(ids) => ids.len(),
        }
    }
}

/// Sleeps `d` (fault injection: a frozen step thread), waking early on a stop request.
fn stall(control: &StepControl, d: Duration) {
    let end = Instant::now() + d;
    while control.stop_requested().is_none() {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        std::thread::sleep(left.min(Duration::from_millis(10)));
    }
}

/// Logprob entry of a sampled token and its alternatives.
fn token_logprob(codec: &dyn TextCodec, tok: u32, logprob: f32, top: &[(u32, f32)]) -> TokenLogprob {
    let text = |t: u32| {
        let b = codec.token_bytes(t);
        (String::from_utf8_lossy(b).into_owned(), b.to_vec())
    };
    let (token, bytes) = text(tok);
    TokenLogprob {
        token_id: tok,
        token,
        logprob,
        bytes,
        top_logprobs: top
            .iter()
            .map(|&(t, lp)| {
                let (token, bytes) = text(t);
                TopLogprob { token_id: t, token, logprob: lp, bytes }
            })
            .collect(),
    }
}
