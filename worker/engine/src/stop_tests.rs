//! Tests of how an engine stops and shares the CPU, so that one failed replica cannot starve
//! the others: a stop interrupts a long step and ends the step thread and the replica's compute
//! threads; a stalled engine shuts down at once; each replica computes on its own pool;
//! gauges show work during a long step; progress inside a step is visible to the stall check.

use super::backend::{Backend, BackendError, Logits, StepBatch, StepControl};
use super::test_double::{ByteCodec, EOS, PagedEchoBackend};
use super::{EngineHandle, EngineParts, EngineRequest, Fault, OutputStream, Prompt, RuntimeConfig, SamplingParams};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bound for a stop to take effect (a simulated layer is at most 100 ms).
const STOP_BOUND: Duration = Duration::from_secs(3);

fn slow_engine(step_time: Duration, rt: RuntimeConfig) -> EngineHandle {
    let control = StepControl::default();
    let mut backend = PagedEchoBackend::new(256, 4);
    backend.step_time = step_time;
    backend.control = Some(control.clone());
    let parts = EngineParts {
        backend: Box::new(backend),
        codec: Arc::new(ByteCodec::new()),
        eos_ids: vec![EOS],
        model_max_len: 512,
        control,
    };
    EngineHandle::start_with_parts(parts, rt).expect("engine starts")
}

fn submit(e: &EngineHandle, prompt: &str, max_tokens: i64) -> OutputStream {
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: Some(max_tokens),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let req = EngineRequest {
        id: "t".into(),
        prompt: Prompt::Text(prompt.into()),
        params,
        prior_output_ids: Vec::new(),
        deadline: None,
        cache_salt: None,
        tools: None,
        chat_template_kwargs: None,
    };
    e.submit(req).expect("submit")
}

/// Polls `f` every 2 ms until it holds; panics after `bound`.
fn wait_for(bound: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < bound, "{what}: not within {bound:?}");
        std::thread::sleep(Duration::from_millis(2));
    }
    t0.elapsed()
}

fn assert_threads_gone(e: &EngineHandle) {
    wait_for(STOP_BOUND, "step thread exits", || e.step_thread_finished());
    wait_for(STOP_BOUND, "compute threads exit", || e.stats().compute_threads_alive == 0);
}

#[test]
fn stop_interrupts_a_long_step_and_ends_every_engine_thread() {
    // A 60 s step (a 2048-token prefill on a loaded CPU, in miniature).
    let e = slow_engine(Duration::from_secs(60), RuntimeConfig { engine_threads: Some(2), ..RuntimeConfig::default() });
    wait_for(Duration::from_secs(5), "2 compute threads start", || e.stats().compute_threads_alive == 2);
    let mut s = submit(&e, "hello", 4);
    wait_for(Duration::from_secs(5), "request scheduled", || e.stats().running == 1);
    let t0 = Instant::now();
    e.stop();
    assert!(!e.is_alive());
    assert_threads_gone(&e);
    assert!(t0.elapsed() < STOP_BOUND, "stopped in {:?}", t0.elapsed());
    // The stream ends without a finish reason: handed back for migration.
    let mut finish = None;
    while let Some(o) = s.blocking_recv() {
        finish = finish.or(o.finish_reason);
    }
    assert_eq!(finish, None);
    let st = e.stats();
    assert_eq!((st.running, st.waiting, st.requests_in_flight), (0, 0, 0));
    assert_eq!(st.free_blocks, st.total_blocks);
    assert!(e.submit(EngineRequest { id: "late".into(), ..req_template() }).is_err());
    e.shutdown(); // only joins
}

fn req_template() -> EngineRequest {
    EngineRequest {
        id: "x".into(),
        prompt: Prompt::Text("x".into()),
        params: SamplingParams { max_tokens: Some(1), ..SamplingParams::default() },
        prior_output_ids: Vec::new(),
        deadline: None,
        cache_salt: None,
        tools: None,
        chat_template_kwargs: None,
    }
}

#[test]
fn shutdown_of_a_stalled_engine_returns_at_once_and_ends_its_threads() {
    let e = slow_engine(Duration::ZERO, RuntimeConfig::default());
    e.inject_fault(Fault::Stall(Duration::from_secs(600))).expect("fault");
    let s = submit(&e, "hello", 4);
    let t0 = Instant::now();
    e.shutdown();
    assert!(t0.elapsed() < STOP_BOUND, "shutdown took {:?}", t0.elapsed());
    assert_threads_gone(&e);
    drop(s);
}

#[test]
fn shutdown_during_a_long_step_aborts_requests_within_a_layer() {
    let e = slow_engine(Duration::from_secs(60), RuntimeConfig::default());
    let mut s = submit(&e, "hello", 4);
    wait_for(Duration::from_secs(5), "request scheduled", || e.stats().running == 1);
    let t0 = Instant::now();
    e.shutdown();
    assert!(t0.elapsed() < STOP_BOUND, "shutdown took {:?}", t0.elapsed());
    let mut finish = None;
    while let Some(o) = s.blocking_recv() {
        finish = finish.or(o.finish_reason);
    }
    assert_eq!(finish, Some(super::FinishReason::Abort));
    assert_threads_gone(&e);
}

#[test]
fn gauges_show_running_waiting_and_kv_during_a_long_step() {
    let rt = RuntimeConfig { max_num_seqs: 2, ..RuntimeConfig::default() };
    let e = slow_engine(Duration::from_secs(60), rt);
    let streams: Vec<OutputStream> = (0..3).map(|i| submit(&e, &format!("prompt {i}"), 4)).collect();
    // The first step (2 sequences admitted, 1 waiting) is running for a minute: the gauges
    // must already say so.
    wait_for(Duration::from_secs(5), "gauges published before the step", || {
        let s = e.stats();
        s.running == 2 && s.waiting == 1
    });
    let s = e.stats();
    assert!(s.kv_cache_usage > 0.0, "kv usage {}", s.kv_cache_usage);
    assert_eq!(s.generation_tokens_total, 0, "the step has not completed");
    e.stop();
    drop(streams);
    assert_threads_gone(&e);
}

#[test]
fn progress_inside_a_long_step_is_visible_to_the_stall_check() {
    let e = slow_engine(Duration::from_secs(60), RuntimeConfig::default());
    let _s = submit(&e, "hello", 4);
    wait_for(Duration::from_secs(5), "request scheduled", || e.stats().running == 1);
    let scheduled_at = Instant::now();
    // Layers of 100 ms: progress lands long before the 60 s step ends.
    wait_for(Duration::from_secs(5), "layer progress during the step", || {
        e.stats().last_progress_at.is_some_and(|t| t > scheduled_at + Duration::from_millis(500))
    });
    assert_eq!(e.stats().generation_tokens_total, 0, "still inside the first step");
    e.stop();
    assert_threads_gone(&e);
}

/// Records the thread and pool size each forward pass ran on.
struct PoolProbe {
    inner: PagedEchoBackend,
    seen: Arc<Mutex<Vec<(String, usize)>>>,
}

impl Backend for PoolProbe {
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits, BackendError> {
        let name = std::thread::current().name().unwrap_or("").to_owned();
        if let Ok(mut v) = self.seen.lock() {
            v.push((name, rayon::current_num_threads()));
        }
        self.inner.forward(batch)
    }
    fn num_kv_blocks(&self) -> usize {
        self.inner.num_kv_blocks()
    }
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn kv_bytes_per_token(&self) -> usize {
        self.inner.kv_bytes_per_token()
    }
    fn name(&self) -> &'static str {
        "pool-probe"
    }
}

#[test]
fn each_replica_computes_on_its_own_pool() {
    let mut engines = Vec::new();
    for threads in [1usize, 3] {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let parts = EngineParts {
            backend: Box::new(PoolProbe { inner: PagedEchoBackend::new(64, 4), seen: seen.clone() }),
            codec: Arc::new(ByteCodec::new()),
            eos_ids: vec![EOS],
            model_max_len: 512,
            control: StepControl::default(),
        };
        let rt = RuntimeConfig { engine_threads: Some(threads), ..RuntimeConfig::default() };
        let e = EngineHandle::start_with_parts(parts, rt).expect("starts");
        let mut s = submit(&e, "abc", 3);
        while s.blocking_recv().is_some() {}
        engines.push((e, seen, threads));
    }
    for (e, seen, threads) in engines {
        let seen = seen.lock().expect("probe lock").clone();
        assert_eq!(seen.len(), 3, "one forward per token");
        for (name, n) in seen {
            assert!(name.starts_with("prism-compute-"), "forward ran on {name:?}");
            assert_eq!(n, threads, "pool size seen inside forward");
        }
        e.shutdown();
        assert_threads_gone(&e);
    }
}
