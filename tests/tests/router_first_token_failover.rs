//! A request accepted by a replica that is then frozen before its first token is retried
//! elsewhere as soon as the head evicts the replica (its worker stopped heartbeating for
//! `--worker-timeout`, 2 s in the fixture), not at its deadline and not only when HTTP/2
//! keep-alive (5 s + 5 s) gives up on the connection.
//!
//! Real cluster (the serving cluster fixture, `Cluster::serving`): etcd, `prism-head`, 2 `prism-worker`s on the
//! bundled SmolLM2 GGUF (CPU engine), `prism-router`. A greedy request with a prompt of
//! [`PROMPT_TOKENS`] tokens (one prefill chunk: a second or more on 2 cores, the window) is
//! sent; as soon as a worker's engine holds it (`vllm:num_requests_waiting` +
//! `vllm:num_requests_running` > 0, published at submit), that worker gets SIGSTOP. The request
//! must complete from the other worker with the reference tokens, one retry, no migration,
//! within `worker_timeout` + a slack + the reference run time.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_tests::{Cluster, PROMPTS, eventually, greedy_request, metric_value, model, stream};
use std::time::{Duration, Instant};

/// Prompt length: under one CPU prefill chunk (512), long enough that the first token is
/// a second or more away when the engine accepts the request.
const PROMPT_TOKENS: usize = 384;
const MAX_TOKENS: u32 = 16;
/// The head's `--worker-timeout` in the fixture.
const WORKER_TIMEOUT: Duration = Duration::from_secs(2);
/// Time allowed on top of `worker_timeout` (load-report period, reconcile, route push,
/// retry) and the undisturbed run time; keep-alive alone would take ~10 s.
const SLACK: Duration = Duration::from_secs(3);
/// The request's own deadline: far past the expected time, so waiting for it shows.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(40);

fn prompt() -> Vec<u32> {
    PROMPTS.iter().flat_map(|p| p.iter().copied()).cycle().take(PROMPT_TOKENS).collect()
}

/// Requests the engine of the worker at `http` holds (running + waiting).
async fn engine_requests(http: &str) -> Result<f64> {
    let text = reqwest::get(format!("{http}/metrics")).await?.text().await?;
    Ok(metric_value(&text, "vllm:num_requests_running") + metric_value(&text, "vllm:num_requests_waiting"))
}

async fn scenario(c: &mut Cluster, frozen: &mut Option<usize>) -> Result<()> {
    let ids = prompt();
    let mut req = greedy_request(&ids, MAX_TOKENS, true);
    req.timeout_ms = Some(u64::try_from(REQUEST_TIMEOUT.as_millis())?);

    // Undisturbed reference (tokens and time) with the same prompt.
    let reference = stream(c.grpc(), req.clone()).await.context("reference run")?;
    let reference_took = reference.ended.zip(reference.started).map(|(e, s)| e - s).context("reference timing")?;
    assert_eq!(reference.tokens.len(), MAX_TOKENS as usize, "reference run: {reference:?}");
    let https: Vec<String> = c.workers.iter().map(|w| w.http.clone()).collect();
    for h in &https {
        eventually(Duration::from_secs(30), "worker idle", || async move {
            Ok((engine_requests(h).await? == 0.0).then_some(()))
        })
        .await?;
    }
    let retries = c.router_metric("prism_router_retries_total").await?;
    let migrations = c.router_metric("prism_router_migrations_total").await?;

    let grpc = c.grpc().to_owned();
    let sent = Instant::now();
    let call = tokio::spawn(async move { stream(&grpc, req).await });
    // The worker whose engine accepted it: a 5 ms poll (the prefill takes a second or more).
    let poll_end = Instant::now() + Duration::from_secs(10);
    let holder = 'found: loop {
        for (i, h) in https.iter().enumerate() {
            if engine_requests(h).await? > 0.0 {
                break 'found i;
            }
        }
        if Instant::now() > poll_end || call.is_finished() {
            bail!("no worker's engine was seen holding the request");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    c.workers[holder].process.freeze()?;
    *frozen = Some(holder);
    let frozen_at = Instant::now();
    if call.is_finished() {
        bail!("the request finished before the freeze ({:?} after sending): the window is too short", frozen_at - sent);
    }

    let bound = WORKER_TIMEOUT + SLACK + reference_took;
    let done = tokio::time::timeout(REQUEST_TIMEOUT + Duration::from_secs(5), call).await.context("request hung")??;
    let took = sent.elapsed();
    let r = done.context("request failed after its replica froze")?;
    println!(
        "first-token failover: reference {reference_took:?}; {} frozen {:?} after sending; request done after {took:?} \
         (bound {bound:?}, deadline {REQUEST_TIMEOUT:?})",
        c.workers[holder].node,
        frozen_at - sent,
    );
    assert_eq!(r.tokens, reference.tokens, "tokens differ from the undisturbed run");
    assert_eq!(r.completion_tokens, MAX_TOKENS);
    assert_eq!(r.prompt_tokens as usize, PROMPT_TOKENS);
    assert!(took < bound, "request took {took:?}, over worker_timeout + slack + reference run ({bound:?})");
    assert_eq!(c.router_metric("prism_router_retries_total").await? - retries, 1.0, "one retry before the first token");
    assert_eq!(
        c.router_metric("prism_router_migrations_total").await?,
        migrations,
        "no migration (no token came from the frozen worker)"
    );
    assert_eq!(c.router_ready_replicas().await?, 1, "the frozen replica left the routes");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn frozen_replica_before_first_token_is_retried_elsewhere() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut c = Cluster::serving(&model, 2, 2).start().await?;
    let mut frozen = None;
    let result = scenario(&mut c, &mut frozen).await;
    if let Some(w) = frozen.and_then(|i| c.workers.get(i)) {
        // Never leave a stopped process behind, whatever happened.
        let _ = w.process.thaw();
    }
    if let Err(e) = result {
        bail!("{e:#}\n{}", c.logs());
    }
    Ok(())
}
