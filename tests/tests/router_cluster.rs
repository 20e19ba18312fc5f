//! The router on real processes and the real model
//! (`models/SmolLM2-135M-Instruct.Q4_1.gguf`, CPU engine):
//!
//! - `openai_python_client_against_prism_up`: the official `openai` Python client (version
//!   pinned in `tests/openai_client/requirements.txt`, installed into `target/openai-venv` by
//!   `tests/openai_client/setup.sh`) runs `tests/openai_client/test_openai_client.py` against
//!   a `prism up`: completions and chat, streamed and not, `n: 2`, stop strings, logprobs.
//! - `two_replicas_spread_long_prompts_and_frozen_replica`: `prism-head` + 2 `prism-worker`s +
//!   `prism-router` (the serving cluster fixture, `Cluster::serving`). 200 concurrent requests
//!   spread within ±20% of even (counted from each worker's `vllm:request_success_total`); a
//!   steady stream of long prompts with unique prefixes and `max_tokens` 1 spreads within
//!   ±20% too (load counted from dispatch, not from the first streamed byte); one worker
//!   frozen with SIGSTOP while closed-loop clients send requests with a 3 s deadline —
//!   successes keep their median latency, every failure is a deadline/unavailable error at
//!   the deadline (none hangs past it), the frozen replica leaves rotation and the requests
//!   that follow all succeed fast; SIGCONT at the end.
//!
//! The two tests run one after the other (a lock) so latencies are not disturbed on 2 cores.
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_tests::{
    Cluster, PROMPTS, PrismUp, greedy_request, metric_sum, model, openai_venv, quantile, run_openai_script, stream,
    workspace_root,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Serialises the tests of this file (both are timing-sensitive on a 2-core machine).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Concurrent requests of the spread check.
const CONCURRENT: usize = 200;
/// Requests of the long-prompt stream and the length of each (unique) prompt in tokens.
const LONG_PROMPT_REQUESTS: usize = 32;
const LONG_PROMPT_TOKENS: usize = 128;
/// The per-request deadline of the frozen-replica phase.
const DEADLINE: Duration = Duration::from_secs(3);
/// How long past the deadline a request may take before it counts as hung.
const HANG_SLACK: Duration = Duration::from_secs(1);
/// Closed-loop clients of the frozen-replica phase.
const CLIENTS: usize = 4;
/// How soon a frozen worker's replica must leave the router's rotation.
const OUT_OF_ROTATION: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn openai_python_client_against_prism_up() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let _serial = SERIAL.lock().await;
    let python = openai_venv().await?;
    let up = PrismUp::start(&model, &["--served-model-name", "smollm2"]).await?;
    run_openai_script(&python, &up, "tests/openai_client/test_openai_client.py", "smollm2", &[]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_replicas_spread_long_prompts_and_frozen_replica() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::serving(&model, 2, 2).start().await?;
    let result = scenario(&mut c).await;
    // Never leave a stopped process behind, whatever happened.
    let _ = c.workers[1].process.thaw();
    if let Err(e) = result {
        // The tails below may be flooded by one process; keep every full log for diagnosis.
        let dir = workspace_root().join("target/router_cluster-logs");
        let _ = std::fs::create_dir_all(&dir);
        for w in &c.workers {
            let _ = std::fs::write(dir.join(format!("{}.log", w.node)), w.process.stderr());
        }
        let _ = std::fs::write(dir.join("router.log"), c.router().process.stderr());
        bail!("{e:#}\n(full logs in {})\n{}", dir.display(), c.logs());
    }
    Ok(())
}

async fn scenario(c: &mut Cluster) -> Result<()> {
    spread_200_concurrent(c).await?;
    long_unique_prompts_spread(c).await?;
    frozen_replica_leaves_rotation(c).await
}

/// `vllm:request_success_total` (every finished_reason) of each worker.
async fn successes(c: &Cluster) -> Result<Vec<f64>> {
    let mut out = Vec::new();
    for w in &c.workers {
        let text = reqwest::get(format!("{}/metrics", w.http)).await?.error_for_status()?.text().await?;
        out.push(metric_sum(&text, "vllm:request_success_total").unwrap_or(0.0));
    }
    Ok(out)
}

/// Requests each worker finished since `before`.
async fn per_worker_since(c: &Cluster, before: &[f64]) -> Result<Vec<usize>> {
    Ok(successes(c).await?.iter().zip(before).map(|(a, b)| (a - b).round() as usize).collect())
}

/// Polls until the workers together finished `n` requests since `before`.
async fn wait_counted(c: &Cluster, before: &[f64], n: usize) -> Result<Vec<usize>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = per_worker_since(c, before).await?;
        if got.iter().sum::<usize>() >= n || Instant::now() > deadline {
            return Ok(got);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Fails unless every count is within ±20% of an even split of `total`.
fn assert_even(what: &str, counts: &[usize], total: usize) -> Result<()> {
    let even = total as f64 / counts.len() as f64;
    let sum: usize = counts.iter().sum();
    println!("{what}: per worker {counts:?} of {total} (even {even:.0}, ±20% = {:.0}..={:.0})", even * 0.8, even * 1.2);
    if sum != total {
        bail!("{what}: workers counted {sum} finished requests, sent {total}: {counts:?}");
    }
    if let Some(bad) = counts.iter().find(|&&n| (n as f64 - even).abs() > even * 0.2) {
        bail!("{what}: a worker got {bad}, outside ±20% of {even:.0}: {counts:?}");
    }
    Ok(())
}

async fn spread_200_concurrent(c: &Cluster) -> Result<()> {
    let before = successes(c).await?;
    let started = Instant::now();
    let runs = (0..CONCURRENT).map(|i| {
        let grpc = c.grpc().to_owned();
        let max_tokens = (i % 4) as u32 + 1;
        let prompt = PROMPTS[i % PROMPTS.len()];
        tokio::spawn(async move { stream(&grpc, greedy_request(prompt, max_tokens, true)).await })
    });
    let results = futures::future::join_all(runs).await;
    for (i, r) in results.into_iter().enumerate() {
        let r = r?.with_context(|| format!("concurrent request {i}"))?;
        assert_eq!(r.tokens.len(), i % 4 + 1, "request {i} tokens");
    }
    println!("{CONCURRENT} concurrent requests done in {:?}", started.elapsed());
    let counts = wait_counted(c, &before, CONCURRENT).await?;
    assert_even("200 concurrent", &counts, CONCURRENT)
}

/// A prompt of [`LONG_PROMPT_TOKENS`] ids whose first tokens are unique to `i`.
fn long_prompt(i: usize) -> Vec<u32> {
    (0..LONG_PROMPT_TOKENS).map(|j| 1000 + ((i * 7919 + j * 104_729 + i * j) % 39_000) as u32).collect()
}

async fn long_unique_prompts_spread(c: &Cluster) -> Result<()> {
    // One request alone gives the prefill time; the stream arrives a bit faster than that,
    // so a request is nearly always in prefill somewhere, and load seen only at the first
    // streamed byte (here: the end of the request) would pile the stream onto one replica.
    let t0 = Instant::now();
    stream(c.grpc(), greedy_request(&long_prompt(10_000), 1, true)).await?;
    let prefill = t0.elapsed();
    let interval = (prefill * 3 / 4).clamp(Duration::from_millis(10), Duration::from_secs(2));
    let before = successes(c).await?;
    let started = Instant::now();
    let mut tasks = Vec::new();
    let mut tick = tokio::time::interval(interval);
    for i in 0..LONG_PROMPT_REQUESTS {
        tick.tick().await;
        let grpc = c.grpc().to_owned();
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            let r = stream(&grpc, greedy_request(&long_prompt(i), 1, true)).await;
            r.map(|r| (r, t.elapsed()))
        }));
    }
    let mut latencies = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let (r, took) = t.await?.with_context(|| format!("long-prompt request {i}"))?;
        assert_eq!((r.tokens.len(), r.prompt_tokens as usize), (1, LONG_PROMPT_TOKENS), "long-prompt request {i}");
        latencies.push(took);
    }
    println!(
        "long prompts: {LONG_PROMPT_REQUESTS} prompts of {LONG_PROMPT_TOKENS} tokens every {interval:?} \
         (lone prefill {prefill:?}) in {:?}; latency p50 {:?} max {:?}",
        started.elapsed(),
        quantile(&latencies, 0.5),
        quantile(&latencies, 1.0)
    );
    let counts = wait_counted(c, &before, LONG_PROMPT_REQUESTS).await?;
    assert_even("long unique prompts", &counts, LONG_PROMPT_REQUESTS)
}

/// One timed request of the frozen-replica phase.
#[derive(Debug, Clone)]
struct Timed {
    started: Instant,
    took: Duration,
    /// `None` on success, else the gRPC code (or `Cancelled` for a client-side hang).
    error: Option<tonic::Code>,
    hung: bool,
}

/// A short greedy request with the frozen-replica phase's deadline, and how it ended.
async fn timed_request(grpc: &str, i: usize) -> Timed {
    let mut req = greedy_request(PROMPTS[i % PROMPTS.len()], 4, true);
    req.timeout_ms = Some(DEADLINE.as_millis() as u64);
    let started = Instant::now();
    let r = tokio::time::timeout(DEADLINE + HANG_SLACK, stream(grpc, req)).await;
    let took = started.elapsed();
    match r {
        Err(_) => Timed { started, took, error: Some(tonic::Code::Cancelled), hung: true },
        Ok(Ok(s)) if s.tokens.len() == 4 => Timed { started, took, error: None, hung: false },
        Ok(Ok(_)) => Timed { started, took, error: Some(tonic::Code::DataLoss), hung: false },
        Ok(Err(e)) => {
            let code = e.downcast_ref::<tonic::Status>().map_or(tonic::Code::Unknown, tonic::Status::code);
            Timed { started, took, error: Some(code), hung: false }
        }
    }
}

/// Closed-loop clients recording every request until stopped.
struct Clients {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    log: Arc<Mutex<Vec<Timed>>>,
}

impl Clients {
    fn start(grpc: &str, n: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let log = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..n)
            .map(|k| {
                let (grpc, stop, log) = (grpc.to_owned(), stop.clone(), log.clone());
                tokio::spawn(async move {
                    let mut i = k;
                    while !stop.load(Ordering::SeqCst) {
                        let t = timed_request(&grpc, i).await;
                        i += n;
                        if let Ok(mut l) = log.lock() {
                            l.push(t);
                        }
                    }
                })
            })
            .collect();
        Self { stop, tasks, log }
    }

    fn count(&self) -> usize {
        self.log.lock().map(|l| l.len()).unwrap_or(0)
    }

    async fn wait_count(&self, n: usize, timeout: Duration) -> Result<()> {
        prism_tests::wait_until(timeout, "client progress", || std::future::ready(self.count() >= n)).await
    }

    async fn stop(self) -> Result<Vec<Timed>> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            t.await?;
        }
        let l = self.log.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        Ok(l.clone())
    }
}

fn median_ok(ts: &[Timed]) -> Duration {
    let ok: Vec<Duration> = ts.iter().filter(|t| t.error.is_none()).map(|t| t.took).collect();
    quantile(&ok, 0.5)
}

/// Latency allowed for healthy-replica requests relative to the undisturbed median.
fn close_to(before: Duration) -> Duration {
    before * 2 + Duration::from_millis(100)
}

async fn frozen_replica_leaves_rotation(c: &mut Cluster) -> Result<()> {
    // Undisturbed baseline with the same clients and requests.
    let base = Clients::start(c.grpc(), CLIENTS);
    base.wait_count(40, Duration::from_secs(60)).await?;
    let base = base.stop().await?;
    if let Some(bad) = base.iter().find(|t| t.error.is_some()) {
        bail!("baseline request failed: {bad:?}");
    }
    let before = median_ok(&base);

    // Freeze w2 while requests flow.
    let load = Clients::start(c.grpc(), CLIENTS);
    load.wait_count(8, Duration::from_secs(30)).await?;
    let frozen_at = Instant::now();
    c.workers[1].process.freeze()?;
    // The head ends a worker session silent for --worker-timeout (2 s in the fixture; load
    // reports come every second), which takes its replica out of the routes.
    let out_at = c.wait_route_change(2, OUT_OF_ROTATION).await?;
    // Let every request started before the route change reach its deadline.
    let settle = out_at + DEADLINE + HANG_SLACK;
    tokio::time::sleep(settle.saturating_duration_since(Instant::now())).await;
    let during = load.stop().await?;

    // After the frozen replica left rotation: everything succeeds, fast.
    let after = Clients::start(c.grpc(), CLIENTS);
    after.wait_count(20, Duration::from_secs(60)).await?;
    let after = after.stop().await?;

    let frozen: Vec<&Timed> = during.iter().filter(|t| t.started + t.took >= frozen_at).collect();
    let failed: Vec<&Timed> = frozen.iter().copied().filter(|t| t.error.is_some()).collect();
    let ok: Vec<Timed> = frozen.iter().filter(|t| t.error.is_none()).map(|t| (*t).clone()).collect();
    let during_median = median_ok(&ok);
    let after_median = median_ok(&after);
    let slowest_fail = failed.iter().map(|t| t.took).max().unwrap_or_default();
    let slowest = during.iter().chain(&after).map(|t| t.took).max().unwrap_or_default();
    println!(
        "frozen replica: baseline p50 {before:?} ({} requests); w2 frozen: out of rotation after {:?}; {} requests overlapped \
         the freeze: {} ok (p50 {during_median:?}), {} failed {:?} (slowest failure {slowest_fail:?}, deadline \
         {DEADLINE:?}); afterwards {} requests p50 {after_median:?}; slowest request {slowest:?}",
        base.len(),
        out_at - frozen_at,
        frozen.len(),
        ok.len(),
        failed.len(),
        failed.iter().map(|t| t.error).collect::<Vec<_>>(),
        after.len(),
    );
    if let Some(h) = during.iter().chain(&after).find(|t| t.hung) {
        bail!("a request hung past its deadline ({DEADLINE:?} + {HANG_SLACK:?}): {h:?}");
    }
    for f in &failed {
        let code = f.error.unwrap_or(tonic::Code::Ok);
        assert!(
            matches!(code, tonic::Code::DeadlineExceeded | tonic::Code::Unavailable),
            "a request to the frozen replica failed with {code:?}, not at the deadline / unavailable: {f:?}"
        );
        assert!(f.took <= DEADLINE + HANG_SLACK, "failure took {:?} (deadline {DEADLINE:?})", f.took);
    }
    assert!(ok.len() >= 2 * CLIENTS, "too few requests succeeded during the freeze: {}", ok.len());
    assert!(
        during_median <= close_to(before),
        "healthy replica slowed down: p50 {during_median:?} during the freeze vs {before:?} before"
    );
    if let Some(bad) = after.iter().find(|t| t.error.is_some() || t.took >= DEADLINE) {
        bail!("after the frozen replica left rotation a request failed or was slow: {bad:?}");
    }
    assert!(after_median <= close_to(before), "after the freeze p50 {after_median:?} vs {before:?} before");
    assert_eq!(c.router_ready_replicas().await?, 1, "the frozen replica is out of rotation");

    // Thaw it; the cluster keeps serving.
    c.workers[1].process.thaw()?;
    let thawed = Instant::now();
    let t = timed_request(c.grpc(), 0).await;
    assert!(t.error.is_none(), "request after SIGCONT: {t:?}");
    // The thawed worker reconnects and its replica comes back into rotation.
    c.wait_ready(2, Duration::from_secs(60)).await.context("2 replicas Ready again after SIGCONT")?;
    println!("frozen replica: after SIGCONT both replicas Ready again within {:?}", thawed.elapsed());
    Ok(())
}
