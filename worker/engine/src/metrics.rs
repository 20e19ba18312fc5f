//! Engine-side statistics for the worker to export under vLLM's metric names
//! (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, `vllm:time_to_first_token_seconds`, ...).
//!
//! The step thread records into [`StatsRecorder`] (atomics and a short, uncontended
//! `std::sync::Mutex` for the histograms); callers read an [`EngineStats`] snapshot.
//! Histograms use vLLM's bucket bounds and report per-bucket (non-cumulative) counts, the
//! shape `prometheus_client`'s `MetricEncoder::encode_histogram` takes.

use super::backend::StepControl;
use super::request::FinishReason;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// vLLM's `vllm:time_to_first_token_seconds` buckets.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
/// vLLM's `vllm:inter_token_latency_seconds` buckets.
pub const ITL_BUCKETS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
/// vLLM's `vllm:e2e_request_latency_seconds` buckets.
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0,
];

/// A latency histogram snapshot (seconds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LatencyHistogram {
    /// `(upper_bound, count in this bucket)`, non-cumulative, the last bound `+Inf`.
    pub buckets: Vec<(f64, u64)>,
    /// Sum of observations (seconds).
    pub sum: f64,
    /// Number of observations.
    pub count: u64,
}

impl LatencyHistogram {
    /// An empty histogram with the given finite upper bounds (plus `+Inf`).
    pub fn new(bounds: &[f64]) -> Self {
        let mut buckets: Vec<(f64, u64)> = bounds.iter().map(|b| (*b, 0)).collect();
        buckets.push((f64::INFINITY, 0));
        Self { buckets, sum: 0.0, count: 0 }
    }

    /// Records one observation.
    pub fn observe(&mut self, d: Duration) {
        let v = d.as_secs_f64();
        self.sum += v;
        self.count += 1;
        if let Some(b) = self.buckets.iter_mut().find(|b| v <= b.0) {
            b.1 += 1;
        }
    }
}

/// Requests finished, by reason.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FinishedCounts {
    /// finish_reason "stop".
    pub stop: u64,
    /// finish_reason "length".
    pub length: u64,
    /// finish_reason "abort" (client gone, deadline, shutdown).
    pub abort: u64,
}

/// KV-cache waste sampled after every forward step: `(allocated slots − tokens stored) /
/// allocated slots`, where allocated slots are the blocks held by sequences times the block
/// size and stored tokens are the tokens whose K/V the cache holds (vLLM's PagedAttention
/// paper, §6, measures the same "internal fragmentation"). Steps that hold no block are not
/// sampled.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct KvWasteStats {
    /// Steps sampled.
    pub steps: u64,
    /// Mean of the per-step waste fractions (each step counts once).
    pub mean: f64,
    /// Per-step waste weighted by the step's forward-pass time (a time average).
    pub time_weighted: f64,
    /// Largest per-step waste fraction.
    pub max: f64,
    /// Waste of the last sampled step.
    pub last: f64,
    /// Sum over steps of allocated slots (tokens).
    pub allocated_slot_steps: u64,
    /// Sum over steps of stored tokens.
    pub stored_token_steps: u64,
}

#[derive(Debug, Default)]
struct KvWasteAcc {
    steps: u64,
    sum: f64,
    weighted_sum: f64,
    weight: f64,
    max: f64,
    last: f64,
    allocated: u64,
    stored: u64,
}

impl KvWasteAcc {
    fn observe(&mut self, allocated: usize, stored: usize, step: Duration) {
        if allocated == 0 {
            return;
        }
        let w = allocated.saturating_sub(stored) as f64 / allocated as f64;
        let secs = step.as_secs_f64();
        self.steps += 1;
        self.sum += w;
        self.weighted_sum += w * secs;
        self.weight += secs;
        self.max = self.max.max(w);
        self.last = w;
        self.allocated += allocated as u64;
        self.stored += stored.min(allocated) as u64;
    }

    fn snapshot(&self) -> KvWasteStats {
        let div = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        KvWasteStats {
            steps: self.steps,
            mean: div(self.sum, self.steps as f64),
            time_weighted: div(self.weighted_sum, self.weight),
            max: self.max,
            last: self.last,
            allocated_slot_steps: self.allocated,
            stored_token_steps: self.stored,
        }
    }
}

/// A snapshot of the engine's state and counters.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    /// Sequences in the running set.
    pub running: usize,
    /// Sequences waiting (queued or preempted).
    pub waiting: usize,
    /// Fraction of KV-cache blocks in use, `[0, 1]`.
    pub kv_cache_usage: f64,
    /// Free KV-cache blocks.
    pub free_blocks: usize,
    /// Total KV-cache blocks.
    pub total_blocks: usize,
    /// Preemptions since start.
    pub num_preemptions_total: u64,
    /// Prompt tokens of requests that produced a first token.
    pub prompt_tokens_total: u64,
    /// Tokens generated.
    pub generation_tokens_total: u64,
    /// Requests finished, by reason.
    pub finished: FinishedCounts,
    /// Requests accepted and not yet finished.
    pub requests_in_flight: usize,
    /// Last time the step loop completed a step or an idle tick (at least once a second
    /// while healthy); `None` before the first.
    pub last_step_ok_at: Option<Instant>,
    /// Last time the engine made progress: a completed step or idle tick (as
    /// `last_step_ok_at`), or a layer of a running step on backends that report layers
    /// (the CPU backend); the engine's start before any of these. The stall check uses
    /// this, so one legitimately long step that is still advancing does not count as a stall.
    pub last_progress_at: Option<Instant>,
    /// Threads of this replica's compute pool that are still running (0 once the engine
    /// has stopped and its pool is gone).
    pub compute_threads_alive: usize,
    /// Whether the step thread is running and healthy.
    pub alive: bool,
    /// Time to first token.
    pub ttft: LatencyHistogram,
    /// Inter-token latency (TPOT/ITL).
    pub itl: LatencyHistogram,
    /// End-to-end request latency.
    pub e2e: LatencyHistogram,
    /// KV-cache waste per step since start.
    pub kv_waste: KvWasteStats,
    /// Forward steps run since start.
    pub steps_total: u64,
    /// Of those, steps whose tokens were picked by the backend's device argmax
    /// (`Backend::forward_greedy`) without copying logits to the host.
    pub device_greedy_steps_total: u64,
    /// Prefix cache: prompt tokens looked up at scheduling (vLLM's `prefix_cache_queries`).
    pub prefix_cache_queries_total: u64,
    /// Of those, tokens found cached (vLLM's `prefix_cache_hits`).
    pub prefix_cache_hits_total: u64,
    /// Prompt tokens actually run through the model in prefill (cache hits excluded,
    /// recomputation after preemption included).
    pub prompt_tokens_computed_total: u64,
    /// Seconds spent in forward passes (the backend's step call, device work and its wait
    /// included) since start: against wall time, what the host spends between steps.
    pub forward_seconds_total: f64,
}

#[derive(Debug)]
struct Histograms {
    ttft: LatencyHistogram,
    itl: LatencyHistogram,
    e2e: LatencyHistogram,
    last_step_ok_at: Option<Instant>,
    kv_waste: KvWasteAcc,
    forward_seconds: f64,
}

/// Shared counters written by the step thread, read by [`super::EngineHandle::stats`].
#[derive(Debug)]
pub struct StatsRecorder {
    pub(crate) running: AtomicUsize,
    pub(crate) waiting: AtomicUsize,
    pub(crate) preemptions: AtomicU64,
    pub(crate) prompt_tokens: AtomicU64,
    pub(crate) generation_tokens: AtomicU64,
    pub(crate) finished_stop: AtomicU64,
    pub(crate) finished_length: AtomicU64,
    pub(crate) finished_abort: AtomicU64,
    pub(crate) in_flight: AtomicUsize,
    pub(crate) steps: AtomicU64,
    pub(crate) device_greedy_steps: AtomicU64,
    pub(crate) prefix_cache_queries: AtomicU64,
    pub(crate) prefix_cache_hits: AtomicU64,
    pub(crate) prompt_tokens_computed: AtomicU64,
    pub(crate) alive: AtomicBool,
    /// Live threads of the replica's compute pool (counted by the pool's start/exit handlers).
    pub(crate) compute_threads: AtomicUsize,
    /// Stop requests and layer-level progress, shared with the backend.
    pub(crate) control: StepControl,
    /// Why the step thread died (the failed step's error), once it has.
    failure: Mutex<Option<String>>,
    hist: Mutex<Histograms>,
}

impl Default for StatsRecorder {
    fn default() -> Self {
        Self {
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            preemptions: AtomicU64::new(0),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            finished_stop: AtomicU64::new(0),
            finished_length: AtomicU64::new(0),
            finished_abort: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            steps: AtomicU64::new(0),
            device_greedy_steps: AtomicU64::new(0),
            prefix_cache_queries: AtomicU64::new(0),
            prefix_cache_hits: AtomicU64::new(0),
            prompt_tokens_computed: AtomicU64::new(0),
            alive: AtomicBool::new(true),
            compute_threads: AtomicUsize::new(0),
            control: StepControl::default(),
            failure: Mutex::new(None),
            hist: Mutex::new(Histograms {
                ttft: LatencyHistogram::new(TTFT_BUCKETS),
                itl: LatencyHistogram::new(ITL_BUCKETS),
                e2e: LatencyHistogram::new(E2E_BUCKETS),
                last_step_ok_at: None,
                kv_waste: KvWasteAcc::default(),
                forward_seconds: 0.0,
            }),
        }
    }
}

impl StatsRecorder {
    /// A recorder sharing `control` with the backend.
    pub(crate) fn with_control(control: StepControl) -> Self {
        Self { control, ..Self::default() }
    }

    fn with_hist(&self, f: impl FnOnce(&mut Histograms)) {
        f(&mut self.hist.lock().unwrap_or_else(PoisonError::into_inner));
    }

    pub(crate) fn observe_ttft(&self, d: Duration) {
        self.with_hist(|h| h.ttft.observe(d));
    }

    pub(crate) fn observe_itl(&self, d: Duration) {
        self.with_hist(|h| h.itl.observe(d));
    }

    pub(crate) fn observe_e2e(&self, d: Duration) {
        self.with_hist(|h| h.e2e.observe(d));
    }

    /// Records one forward step: its KV occupancy after the step (`allocated` slots held by
    /// sequences, `stored` tokens in them), the forward pass's duration, and whether the
    /// tokens came from the device argmax.
    pub(crate) fn observe_step(&self, allocated: usize, stored: usize, forward: Duration, device_greedy: bool) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        if device_greedy {
            self.device_greedy_steps.fetch_add(1, Ordering::Relaxed);
        }
        self.with_hist(|h| {
            h.kv_waste.observe(allocated, stored, forward);
            h.forward_seconds += forward.as_secs_f64();
        });
    }

    /// Records why the step thread died.
    pub(crate) fn set_failure(&self, why: String) {
        *self.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(why);
    }

    /// Why the step thread died, if it did after a failed step.
    pub(crate) fn failure(&self) -> Option<String> {
        self.failure.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    pub(crate) fn mark_step_ok(&self, at: Instant) {
        self.control.mark_progress();
        self.with_hist(|h| h.last_step_ok_at = Some(at));
    }

    pub(crate) fn count_finished(&self, reason: FinishReason) {
        let c = match reason {
            FinishReason::Stop => &self.finished_stop,
            FinishReason::Length => &self.finished_length,
            FinishReason::Abort => &self.finished_abort,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// A consistent-enough snapshot (each counter is read atomically).
    pub(crate) fn snapshot(&self, free_blocks: usize, total_blocks: usize) -> EngineStats {
        let h = self.hist.lock().unwrap_or_else(PoisonError::into_inner);
        let r = |a: &AtomicU64| a.load(Ordering::Relaxed);
        EngineStats {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            kv_cache_usage: if total_blocks == 0 { 0.0 } else { 1.0 - free_blocks as f64 / total_blocks as f64 },
            free_blocks,
            total_blocks,
            num_preemptions_total: r(&self.preemptions),
            prompt_tokens_total: r(&self.prompt_tokens),
            generation_tokens_total: r(&self.generation_tokens),
            finished: FinishedCounts {
                stop: r(&self.finished_stop),
                length: r(&self.finished_length),
                abort: r(&self.finished_abort),
            },
            requests_in_flight: self.in_flight.load(Ordering::Relaxed),
            last_step_ok_at: h.last_step_ok_at,
            last_progress_at: Some(self.control.last_progress()),
            compute_threads_alive: self.compute_threads.load(Ordering::Relaxed),
            alive: self.alive.load(Ordering::Relaxed),
            ttft: h.ttft.clone(),
            itl: h.itl.clone(),
            e2e: h.e2e.clone(),
            kv_waste: h.kv_waste.snapshot(),
            steps_total: r(&self.steps),
            device_greedy_steps_total: r(&self.device_greedy_steps),
            prefix_cache_queries_total: r(&self.prefix_cache_queries),
            prefix_cache_hits_total: r(&self.prefix_cache_hits),
            prompt_tokens_computed_total: r(&self.prompt_tokens_computed),
            forward_seconds_total: h.forward_seconds,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_per_bucket() {
        let mut h = LatencyHistogram::new(&[0.1, 1.0]);
        h.observe(Duration::from_millis(50));
        h.observe(Duration::from_millis(500));
        h.observe(Duration::from_millis(700));
        h.observe(Duration::from_secs(5));
        assert_eq!(h.buckets, vec![(0.1, 1), (1.0, 2), (f64::INFINITY, 1)]);
        assert_eq!(h.count, 4);
        assert!((h.sum - 6.25).abs() < 1e-9);
    }

    #[test]
    fn kv_waste_mean_time_weighted_and_max() {
        let mut a = KvWasteAcc::default();
        a.observe(0, 0, Duration::from_secs(9)); // nothing held: not a sample
        a.observe(16, 12, Duration::from_millis(100)); // 0.25
        a.observe(32, 32, Duration::from_millis(300)); // 0
        let s = a.snapshot();
        assert_eq!((s.steps, s.allocated_slot_steps, s.stored_token_steps), (2, 48, 44));
        assert!((s.mean - 0.125).abs() < 1e-12);
        assert!((s.time_weighted - 0.0625).abs() < 1e-12);
        assert_eq!((s.max, s.last), (0.25, 0.0));
        assert_eq!(KvWasteAcc::default().snapshot(), KvWasteStats::default());
    }
}
