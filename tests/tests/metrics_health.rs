//! Metrics and health against real processes (the cluster fixture): one `prism-head`
//! (embedded store), two `prism-worker`s serving the bundled SmolLM2 GGUF on the CPU backend
//! (fault injection enabled) and one `prism-router`, each its own process on loopback ports.
//!
//! - Under concurrent streaming load a worker's `/metrics` shows non-zero
//!   `vllm:num_requests_running`/`waiting` and `vllm:kv_cache_usage_perc`; within 1 s of the
//!   load ending they read 0.
//! - A mass abort of 100 streams (clients disconnect) brings running, waiting and KV usage
//!   back to 0 within 1 s.
//! - `vllm:request_success_total{finished_reason}` moves by exactly the number of requests
//!   that ended with `stop`, `length` and `abort`.
//! - Killing one replica's engine step thread (`POST /debug/replicas/{id}/kill-engine`, the
//!   CPU analogue of SIGKILL of a shard) turns its worker's `/readyz` and `grpc.health.v1`
//!   not-ready within 5 s, the router stops listing it, and every later request succeeds on
//!   the other worker (per-worker counters).
//! - Freezing the other engine (`stall-engine`, the SIGSTOP analogue) while it has work turns
//!   its worker not-ready within 5 s (`--engine-stall-timeout 3`); the request leaves the
//!   frozen replica at once (it never had a token) for the router's queue, and the router, now
//!   without a Ready replica but with replacements on their way, stays ready; the replacement
//!   serves that request.
//!
//! Budget: 2-core CI. The deployment runs `max_num_seqs` 4 and `max_num_batched_tokens` 32 so
//! each engine step is short (an abort is seen at the next step boundary), prompts are a few
//! tokens and `max_tokens` small.

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::head_service_client::HeadServiceClient;
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{
    ClusterStatusRequest, FinishReason, GenerateRequest, ReplicaState, SamplingParams, TokenIds, generate_request,
};
use prism_tests::{Cluster, Deployment, Store, eventually, model};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Served model name of the test deployment.
const SERVED: &str = "smollm2";
/// A short prompt (token ids of the reference fixture's tokenizer cases).
const PROMPT: &[u32] = &[19556, 28, 905, 17];
/// Streams opened and then dropped in the mass-abort phase.
const MASS_ABORT: usize = 100;

/// One head (embedded store), two workers with fault injection and one router, then two
/// replicas of the bundled model, one per worker.
async fn start_cluster(model: &std::path::Path) -> Result<Cluster> {
    let mut c = Cluster::builder()
        .store(Store::Embedded)
        // Failed replicas are replaced only after the scenario has checked that traffic
        // avoids them (step 5 checks the replacement).
        .head_args(&["--replica-restart-delay", "25s"])
        .workers(2)
        .worker_args(&["--kv-cache-bytes", "33554432", "--enable-fault-injection"])
        // Steps here take well under a second (32-token chunks), so 3 s of held work without
        // a completed step is a stall.
        .worker_extra(1, &["--engine-stall-timeout", "3"])
        .routers(1)
        .start()
        .await?;
    let outcome = deploy(&mut c, model).await;
    c.with_logs(outcome)?;
    Ok(c)
}

async fn deploy(c: &mut Cluster, model: &std::path::Path) -> Result<()> {
    let head = c.head_url().to_owned();
    eventually(Duration::from_secs(60), "both workers registered", || {
        let head = head.clone();
        async move {
            let st = HeadServiceClient::connect(head).await?.cluster_status(ClusterStatusRequest {}).await?;
            let st = st.into_inner();
            Ok((st.is_leader && st.nodes.len() == 2).then_some(()))
        }
    })
    .await?;
    // The router admits max_num_seqs + headroom (6) per replica unless the deployment sets
    // max_in_flight: the mass abort needs all 100 streams on the engines, not in the router's queue.
    let deployment = Deployment::new(model)
        .replicas(2)
        .engine("max_num_seqs", 4)
        .engine("max_num_batched_tokens", 32)
        .engine("max_in_flight", MASS_ABORT);
    c.deploy(&deployment)?;
    let c = &*c;
    eventually(Duration::from_secs(240), "2 replicas Ready, one per worker", || async {
        let placed = replica_by_node(c).await?;
        Ok((placed.len() == 2).then_some(()))
    })
    .await?;
    eventually(Duration::from_secs(30), "router lists 2 ready replicas", || async {
        Ok((c.router_ready_replicas().await? == 2).then_some(()))
    })
    .await
}

/// Ready replica id per node, from the head.
async fn replica_by_node(c: &Cluster) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for r in c.status().await?.replicas {
        if r.state == ReplicaState::Failed as i32 {
            bail!("replica {} failed: {}", r.replica_id, r.reason);
        }
        if r.state == ReplicaState::Ready as i32 {
            out.insert(r.node_id, r.replica_id);
        }
    }
    Ok(out)
}

/// Every worker's metrics.
async fn scrape(c: &Cluster) -> Result<Vec<WorkerMetrics>> {
    let mut out = Vec::new();
    for w in &c.workers {
        out.push(WorkerMetrics::scrape(&w.http).await?);
    }
    Ok(out)
}

/// The vLLM metrics of one worker that this test reads.
#[derive(Clone, Debug, Default, PartialEq)]
struct WorkerMetrics {
    running: f64,
    waiting: f64,
    kv: f64,
    kv_alias: f64,
    /// `vllm:request_success_total` by `finished_reason`.
    success: BTreeMap<String, f64>,
}

impl WorkerMetrics {
    async fn scrape(http: &str) -> Result<Self> {
        let text = reqwest::get(format!("{http}/metrics")).await?.error_for_status()?.text().await?;
        Ok(Self::parse(&text))
    }

    fn parse(text: &str) -> Self {
        let mut m = Self::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((series, value)) = line.rsplit_once(' ') else { continue };
            let Ok(v) = value.parse::<f64>() else { continue };
            let name = &series[..series.find('{').unwrap_or(series.len())];
            match name {
                "vllm:num_requests_running" => m.running += v,
                "vllm:num_requests_waiting" => m.waiting += v,
                "vllm:kv_cache_usage_perc" => m.kv += v,
                "vllm:gpu_cache_usage_perc" => m.kv_alias += v,
                "vllm:request_success_total" => {
                    let reason = series
                        .split_once("finished_reason=\"")
                        .and_then(|(_, rest)| rest.split_once('"'))
                        .map_or("", |(r, _)| r);
                    *m.success.entry(reason.to_owned()).or_default() += v;
                }
                _ => {}
            }
        }
        m
    }

    fn idle(&self) -> bool {
        self.running == 0.0 && self.waiting == 0.0 && self.kv == 0.0 && self.kv_alias == 0.0
    }

    fn success(&self, reason: &str) -> f64 {
        self.success.get(reason).copied().unwrap_or(0.0)
    }
}

/// Sum of a finish-reason counter over workers.
fn total(ms: &[WorkerMetrics], reason: &str) -> f64 {
    ms.iter().map(|m| m.success(reason)).sum()
}

/// Polls every 10 ms until every worker reads idle; returns how long after `since` that was.
async fn wait_idle(c: &Cluster, since: Instant, limit: Duration, what: &str) -> Result<Duration> {
    loop {
        let ms = scrape(c).await?;
        if ms.iter().all(WorkerMetrics::idle) {
            return Ok(since.elapsed());
        }
        if since.elapsed() > limit {
            bail!("{what}: workers not idle {limit:?} later: {ms:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn greedy(max_tokens: u32, ignore_eos: bool, stop_token_ids: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        model: SERVED.into(),
        prompt: Some(generate_request::Prompt::TokenIds(TokenIds { ids: PROMPT.to_vec() })),
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(i64::from(max_tokens)),
            ignore_eos,
            stop_token_ids,
            ..SamplingParams::default()
        }),
        ..GenerateRequest::default()
    }
}

/// Streams `req` to the end: (token ids, final finish reason).
async fn run_stream(grpc: String, req: GenerateRequest) -> Result<(Vec<u32>, i32)> {
    let mut c = InferenceServiceClient::connect(grpc).await?;
    let mut s = c.generate(req).await?.into_inner();
    let mut tokens = Vec::new();
    let mut finish = FinishReason::Unspecified as i32;
    while let Some(m) = s.message().await? {
        tokens.extend_from_slice(&m.token_ids);
        if m.finish_reason != FinishReason::Unspecified as i32 {
            finish = m.finish_reason;
        }
    }
    Ok((tokens, finish))
}

async fn grpc_health(endpoint: &str, service: &str) -> Result<i32> {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())?.connect().await?;
    let mut h = HealthClient::new(channel);
    Ok(h.check(HealthCheckRequest { service: service.to_owned() }).await?.into_inner().status)
}

async fn http_status(url: &str) -> Result<u16> {
    Ok(reqwest::get(url).await?.status().as_u16())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_and_health_under_load_mass_abort_and_engine_kill() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let c = start_cluster(&model).await?;
    let result = scenario(&c).await;
    if result.is_err() {
        for w in &c.workers {
            eprintln!("--- {} stderr ---\n{}", w.node, w.process.stderr());
        }
        eprintln!("--- router stderr ---\n{}", c.router().process.stderr());
        eprintln!("--- head stderr ---\n{}", c.head().process.stderr());
    }
    result
}

async fn scenario(c: &Cluster) -> Result<()> {
    // Health while everything is up: head = leader, router = a Ready replica, workers ready.
    assert_eq!(http_status(&format!("{}/readyz", c.head().http)).await?, 200, "head (leader) /readyz");
    assert_eq!(http_status(&format!("{}/readyz", c.http())).await?, 200, "router /readyz");
    for w in &c.workers {
        eventually(Duration::from_secs(10), "worker ready", || async {
            Ok((http_status(&format!("{}/readyz", w.http)).await? == 200).then_some(()))
        })
        .await?;
        // grpc.health is refreshed by the worker's health loop (every 500 ms), /readyz live.
        eventually(Duration::from_secs(5), "worker grpc health SERVING", || async {
            let serving = ServingStatus::Serving as i32;
            let all = grpc_health(&w.grpc, "").await?;
            let svc = grpc_health(&w.grpc, "prism.v1.WorkerService").await?;
            Ok((all == serving && svc == serving).then_some(()))
        })
        .await?;
        assert_eq!(
            http_status(&format!("{}/debug/replicas/nope/kill-engine", w.http)).await?,
            405,
            "GET is not a kill"
        );
    }
    eventually(Duration::from_secs(5), "router grpc health SERVING", || async {
        Ok((grpc_health(c.grpc(), "").await? == ServingStatus::Serving as i32).then_some(()))
    })
    .await?;

    // The first greedy token, for requests that stop on it (finish_reason "stop").
    let (reference, finish) = run_stream(c.grpc().to_owned(), greedy(4, true, Vec::new())).await?;
    assert_eq!((reference.len(), finish), (4, FinishReason::Length as i32), "reference run");
    let stop_on = reference[0];
    wait_idle(c, Instant::now(), Duration::from_secs(5), "after the reference run").await?;

    // 1. Concurrent streaming load: 6 run to max_tokens (length), 2 stop on their first token.
    let before = scrape(c).await?;
    let (n_length, n_stop) = (6usize, 2usize);
    let mut tasks = Vec::new();
    for i in 0..n_length + n_stop {
        let req = if i < n_length { greedy(32, true, Vec::new()) } else { greedy(32, false, vec![stop_on]) };
        tasks.push(tokio::spawn(run_stream(c.grpc().to_owned(), req)));
    }
    let mut busy_seen = false;
    let mut kv_seen = false;
    let mut per_worker_busy = vec![false; c.workers.len()];
    while tasks.iter().any(|t| !t.is_finished()) {
        for (i, m) in scrape(c).await?.iter().enumerate() {
            let busy = m.running + m.waiting > 0.0;
            per_worker_busy[i] |= busy;
            busy_seen |= busy;
            kv_seen |= busy && m.kv > 0.0 && m.kv_alias == m.kv;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut finishes = BTreeMap::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let (tokens, finish) = t.await??;
        if i < n_length {
            assert_eq!((tokens.len(), finish), (32, FinishReason::Length as i32), "length request {i}");
        } else {
            assert_eq!((tokens.as_slice(), finish), (&[stop_on][..], FinishReason::Stop as i32), "stop request {i}");
        }
        *finishes.entry(finish).or_insert(0usize) += 1;
    }
    let load_end = Instant::now();
    assert!(busy_seen, "vllm:num_requests_running/waiting never non-zero under load");
    assert!(kv_seen, "vllm:kv_cache_usage_perc (and its gpu_ alias) never non-zero under load");
    assert!(per_worker_busy.iter().all(|b| *b), "load reached both workers: {per_worker_busy:?}");
    let took = wait_idle(c, load_end, Duration::from_secs(1), "1 s after the load stopped").await?;
    eprintln!("gauges idle {took:?} after the load ended");
    let after = scrape(c).await?;
    assert_eq!(total(&after, "length") - total(&before, "length"), n_length as f64, "length delta");
    assert_eq!(total(&after, "stop") - total(&before, "stop"), n_stop as f64, "stop delta");
    assert_eq!(total(&after, "abort") - total(&before, "abort"), 0.0, "abort delta");

    // 2. Mass abort: 100 streams admitted by the workers, then every client disconnects.
    let before = after;
    let channel = tonic::transport::Endpoint::from_shared(c.grpc().to_owned())?.connect().await?;
    let mut opens = Vec::new();
    for _ in 0..MASS_ABORT {
        let mut client = InferenceServiceClient::new(channel.clone());
        opens.push(tokio::spawn(async move {
            // Held open (never read) until the task is aborted: that is the disconnect.
            let stream = client.generate(greedy(200, true, Vec::new())).await;
            let _keep = stream;
            std::future::pending::<()>().await;
        }));
    }
    let admitted = eventually(Duration::from_secs(60), "100 requests running or waiting on the workers", || async {
        let ms = scrape(c).await?;
        let n: f64 = ms.iter().map(|m| m.running + m.waiting).sum();
        Ok((n == MASS_ABORT as f64).then_some(ms))
    })
    .await?;
    assert!(admitted.iter().any(|m| m.kv > 0.0), "KV usage non-zero with 100 requests: {admitted:?}");
    for t in &opens {
        t.abort();
    }
    drop(channel);
    let dropped = Instant::now();
    for t in opens {
        let _ = t.await;
    }
    let took = wait_idle(c, dropped, Duration::from_secs(1), "after the mass abort").await?;
    eprintln!("gauges idle {took:?} after 100 clients disconnected");
    let after = eventually(Duration::from_secs(5), "100 aborts counted", || async {
        let ms = scrape(c).await?;
        Ok((total(&ms, "abort") - total(&before, "abort") >= MASS_ABORT as f64).then_some(ms))
    })
    .await?;
    assert_eq!(total(&after, "abort") - total(&before, "abort"), MASS_ABORT as f64, "abort delta");
    assert_eq!(total(&after, "length"), total(&before, "length"), "no length finish during the abort");
    assert_eq!(total(&after, "stop"), total(&before, "stop"), "no stop finish during the abort");

    // 3. Kill w1's engine step thread: not ready within 5 s, out of the routes, traffic on w2.
    let placed = replica_by_node(c).await?;
    let (dead, live) = (&c.workers[0], &c.workers[1]);
    let replica = placed.get(&dead.node).context("no replica on w1")?.clone();
    let kill =
        reqwest::Client::new().post(format!("{}/debug/replicas/{replica}/kill-engine", dead.http)).send().await?;
    assert_eq!(kill.status().as_u16(), 200, "kill-engine: {}", kill.text().await?);
    let killed = Instant::now();
    let readyz_failed = eventually(Duration::from_secs(5), "w1 /readyz fails", || async {
        let resp = reqwest::get(format!("{}/readyz", dead.http)).await?;
        Ok((resp.status().as_u16() == 503).then_some(killed.elapsed()))
    })
    .await?;
    let health_failed = eventually(Duration::from_secs(5), "w1 grpc.health NOT_SERVING", || async {
        let st = grpc_health(&dead.grpc, "").await?;
        let svc = grpc_health(&dead.grpc, "prism.v1.WorkerService").await?;
        let not = ServingStatus::NotServing as i32;
        Ok((st == not && svc == not).then_some(killed.elapsed()))
    })
    .await?;
    eprintln!("after the kill: /readyz 503 at {readyz_failed:?}, grpc NOT_SERVING at {health_failed:?}");
    assert!(readyz_failed <= Duration::from_secs(5) && health_failed <= Duration::from_secs(5));
    assert_eq!(http_status(&format!("{}/readyz", live.http)).await?, 200, "w2 stays ready");
    let before = scrape(c).await?;
    let n_after = 6usize;
    for i in 0..n_after {
        let (tokens, finish) = run_stream(c.grpc().to_owned(), greedy(8, true, Vec::new())).await?;
        assert_eq!((tokens.len(), finish), (8, FinishReason::Length as i32), "request {i} after the kill");
    }
    let after = scrape(c).await?;
    assert_eq!(after[0].success, before[0].success, "no request finished on the killed worker");
    assert_eq!(after[1].success("length") - before[1].success("length"), n_after as f64, "all on w2");
    eventually(Duration::from_secs(10), "router lists 1 ready replica", || async {
        Ok((c.router_ready_replicas().await? == 1).then_some(()))
    })
    .await?;
    let st = HeadServiceClient::connect(c.head_url().to_owned()).await?.cluster_status(ClusterStatusRequest {}).await?;
    let rec = st.into_inner().replicas.into_iter().find(|r| r.replica_id == replica).context("killed replica")?;
    assert_eq!(rec.state, ReplicaState::Failed as i32, "head sees the killed replica Failed: {rec:?}");
    assert_eq!(http_status(&format!("{}/readyz", c.http())).await?, 200, "router still has a Ready replica");

    // 4. Freeze w2's step thread (SIGSTOP analogue) while it has work: w2 turns not-ready
    //    within 5 s of the work arriving, the request leaves the frozen replica instead of
    //    hanging there (back to the router's queue: it never had a token), and the router,
    //    left without a Ready replica, stays ready on HTTP and gRPC (replacements come).
    let replica = placed.get(&live.node).context("no replica on w2")?.clone();
    let stall = reqwest::Client::new()
        .post(format!("{}/debug/replicas/{replica}/stall-engine?seconds=20", live.http))
        .send()
        .await?;
    assert_eq!(stall.status().as_u16(), 200, "stall-engine: {}", stall.text().await?);
    let sent = Instant::now();
    let stuck = tokio::spawn(run_stream(c.grpc().to_owned(), greedy(8, true, Vec::new())));
    let not_ready = eventually(Duration::from_secs(6), "w2 /readyz fails on the stalled engine", || async {
        Ok((http_status(&format!("{}/readyz", live.http)).await? == 503).then_some(sent.elapsed()))
    })
    .await?;
    eprintln!("stalled engine: w2 /readyz 503 {not_ready:?} after the request was sent");
    assert!(not_ready <= Duration::from_secs(5), "stall detected after {not_ready:?}");
    eventually(
        Duration::from_secs(10),
        "the request off the frozen replica, waiting in the router's queue",
        || async { Ok((c.router_metric("prism_router_queue_depth").await? == 1.0).then_some(())) },
    )
    .await?;
    if stuck.is_finished() {
        bail!("the request did not wait for a replacement: {:?}", stuck.await);
    }
    // Without a Ready replica the router still takes requests: both failed replicas were
    // Ready once, so the head replaces them and requests wait for the replacements.
    eventually(Duration::from_secs(10), "router lists no Ready replica", || async {
        Ok((c.router_ready_replicas().await? == 0).then_some(()))
    })
    .await?;
    let http = http_status(&format!("{}/readyz", c.http())).await?;
    let grpc = grpc_health(c.grpc(), "").await?;
    assert_eq!((http, grpc), (200, ServingStatus::Serving as i32), "ready: replacements are on their way");

    // 5. Replicas that failed after being Ready are replaced once the head's restart delay
    //    has passed (as Ray Serve restarts unhealthy replicas): two new Ready replicas with
    //    new ids, and requests succeed again through the same router.
    let failed: Vec<String> = placed.values().cloned().collect();
    eventually(Duration::from_secs(90), "failed replicas replaced and Ready", || async {
        let st =
            HeadServiceClient::connect(c.head_url().to_owned()).await?.cluster_status(ClusterStatusRequest {}).await?;
        let ready: Vec<_> = st
            .into_inner()
            .replicas
            .into_iter()
            .filter(|r| r.state == ReplicaState::Ready as i32 && !failed.contains(&r.replica_id))
            .collect();
        Ok((ready.len() == 2 && c.router_ready_replicas().await? == 2).then_some(()))
    })
    .await?;
    let (tokens, finish) = run_stream(c.grpc().to_owned(), greedy(8, true, Vec::new())).await?;
    assert_eq!((tokens.len(), finish), (8, FinishReason::Length as i32), "served again after replacement");
    let (tokens, finish) =
        tokio::time::timeout(Duration::from_secs(30), stuck).await.context("the queued request hung")???;
    assert_eq!((tokens.len(), finish), (8, FinishReason::Length as i32), "the queued request served by a replacement");
    Ok(())
}

#[test]
fn parses_worker_metrics() {
    let text = "# TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{model_name=\"m\"} 3\n\
        vllm:num_requests_waiting{model_name=\"m\"} 2\n\
        vllm:kv_cache_usage_perc{model_name=\"m\"} 0.25\n\
        vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.25\n\
        vllm:request_success_total{model_name=\"m\",finished_reason=\"stop\"} 4\n\
        vllm:request_success_total{model_name=\"m\",finished_reason=\"abort\"} 7\n";
    let m = WorkerMetrics::parse(text);
    assert_eq!((m.running, m.waiting, m.kv, m.kv_alias), (3.0, 2.0, 0.25, 0.25));
    assert_eq!((m.success("stop"), m.success("abort"), m.success("length")), (4.0, 7.0, 0.0));
    assert!(!m.idle());
}
