//! Cache-aware routing on real processes and the real model
//! (`models/SmolLM2-135M-Instruct.Q4_1.gguf`, CPU engine, prefix caching on): `prism-head`,
//! 3 `prism-worker`s with one replica each (48 MiB KV cache: about three of the prompt
//! prefixes below fit on one replica, not all six), the fixture's router (`--routing-policy
//! prefix-aware`, the default) and a second router with `--routing-policy p2c`.
//!
//! The same traffic goes through each router: 6 distinct shared prefixes of about 300 tokens,
//! short suffixes, 6 closed-loop clients, greedy text prompts. Each router's phase has its own
//! `cache_salt`, so neither finds the other's blocks. Checked:
//! - the cluster hit rate (prompt tokens served from the prefix cache over prompt tokens,
//!   from each response's `usage.cached_tokens`) is clearly higher through the prefix-aware
//!   router than through the P2C one;
//! - the prefix-aware router spreads the requests: no replica serves more than 1.5× the mean
//!   (its `prism_router_replica_dispatches_total`), and it routed by the replicas' prefix
//!   caches (`prism_router_routing_decisions_total{reason="prefix_hit"}`);
//! - every output equals the greedy reference of its prompt computed on one replica with a
//!   salt of its own (no cached block), whatever replica and cached prefix served it.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::worker_service_client::WorkerServiceClient;
use prism_common::proto::v1::{GenerateRequest, SamplingParams, WorkerGenerateRequest, generate_request};
use prism_tests::{Cluster, Deployment, Router, SERVED, metric_value, model, poll_until};
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Distinct shared prefixes and the words in each.
const PREFIXES: usize = 6;
const PREFIX_WORDS: usize = 240;
/// Suffixes per prefix (distinct prompts = PREFIXES × SUFFIXES).
const SUFFIXES: usize = 2;
/// Closed-loop clients and requests per client in each phase.
const CLIENTS: usize = 6;
const PER_CLIENT: usize = 6;
/// KV cache per replica: 48 MiB, about 1,090 tokens of this model (f32 K/V, 45 KiB a token):
/// the two prefixes a replica owns under prefix-aware routing fit with the requests in
/// flight, not the four to six that P2C sends each replica.
const KV_CACHE_BYTES: u64 = 48 << 20;
/// Tokens generated per request (EOS ignored: equal lengths to compare).
const MAX_TOKENS: u32 = 4;

/// Words the prefixes are drawn from (common English words: about one token each).
const WORDS: &[&str] = &[
    "river", "mountain", "table", "window", "garden", "yellow", "market", "silver", "thunder", "pencil", "forest",
    "engine", "harbor", "candle", "winter", "summer", "orange", "bridge", "castle", "letter", "number", "planet",
    "rocket", "school", "sister", "doctor", "music", "paper", "stone", "water", "light", "green", "house", "train",
];

/// Prefix `p`: a document of [`PREFIX_WORDS`] words drawn by a fixed generator seeded by `p`.
fn prefix(p: usize) -> String {
    let mut x = 0x9E37_79B9_u64.wrapping_mul(p as u64 + 1);
    let mut s = format!("Document {p}. ");
    for _ in 0..PREFIX_WORDS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
        s.push(' ');
    }
    s
}

/// Distinct prompt `k` (prefix `k % PREFIXES`, suffix `k / PREFIXES`).
fn prompt(k: usize) -> String {
    let (p, q) = (k % PREFIXES, k / PREFIXES % SUFFIXES);
    format!("{}\nQuestion {q}: which word comes first?", prefix(p))
}

fn request(text: String, salt: &str) -> GenerateRequest {
    GenerateRequest {
        model: SERVED.into(),
        prompt: Some(generate_request::Prompt::Text(text)),
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(i64::from(MAX_TOKENS)),
            ignore_eos: true,
            ..SamplingParams::default()
        }),
        cache_salt: Some(salt.to_owned()),
        ..GenerateRequest::default()
    }
}

/// What one request gave: its tokens, prompt tokens and prompt tokens found cached.
#[derive(Debug, Default)]
struct Answer {
    tokens: Vec<u32>,
    prompt: u64,
    cached: u64,
}

async fn collect(mut s: tonic::Streaming<prism_common::proto::v1::GenerateResponse>) -> Result<Answer> {
    let mut a = Answer::default();
    while let Some(m) = s.message().await? {
        a.tokens.extend(m.token_ids);
        if let Some(u) = m.usage {
            (a.prompt, a.cached) = (u64::from(u.prompt_tokens), u64::from(u.cached_tokens));
        }
    }
    Ok(a)
}

/// The traffic of one phase through the router at `grpc`: answers by distinct prompt index.
async fn phase(grpc: &str, salt: &str) -> Result<Vec<(usize, Answer)>> {
    let mut tasks = Vec::new();
    for c in 0..CLIENTS {
        let (grpc, salt) = (grpc.to_owned(), salt.to_owned());
        tasks.push(tokio::spawn(async move {
            let mut client = InferenceServiceClient::connect(grpc).await?;
            let mut out = Vec::new();
            for i in 0..PER_CLIENT {
                // Client c starts on prefix c: every prefix is in use from the first wave on.
                let k = (c + i * (CLIENTS + 1)) % (PREFIXES * SUFFIXES);
                let s = client.generate(request(prompt(k), &salt)).await?.into_inner();
                out.push((k, collect(s).await?));
            }
            anyhow::Ok(out)
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await??);
    }
    Ok(all)
}

fn hit_rate(answers: &[(usize, Answer)]) -> f64 {
    let prompt: u64 = answers.iter().map(|(_, a)| a.prompt).sum();
    let cached: u64 = answers.iter().map(|(_, a)| a.cached).sum();
    cached as f64 / prompt.max(1) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prefix_aware_routing_raises_the_hit_rate_and_keeps_the_spread() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    // The serving cluster's settings, with a KV cache of its own size.
    let mut c = Cluster::builder()
        .head_args(&["--worker-timeout", "2s", "--drain-timeout", "30s"])
        .workers(3)
        .worker_args(&["--kv-cache-bytes", &KV_CACHE_BYTES.to_string()])
        .routers(1)
        .deploy(Deployment::new(&model).replicas(3))
        .start()
        .await?;
    let result = scenario(&mut c).await;
    c.with_logs(result)
}

async fn scenario(c: &mut Cluster) -> Result<()> {
    let p2c = Router::spawn("router-p2c", c.head_url(), &["--routing-policy".into(), "p2c".into()], &[])?;
    c.routers.push(p2c);
    let (aware, p2c) = (c.routers[0].grpc.clone(), c.routers[1].grpc.clone());
    // The prefix-aware router has every replica's codec and prefix index; the other lists them.
    poll_until(Duration::from_secs(60), "prefix indexes of 3 replicas", || async {
        let m = c.routers[0].metrics().await.ok()?;
        (m.lines().filter(|l| l.starts_with("prism_router_prefix_index_blocks{")).count() == 3).then_some(())
    })
    .await?;
    poll_until(Duration::from_secs(30), "the p2c router's routes", || async {
        let m = c.routers[1].metrics().await.ok()?;
        (metric_value(&m, "prism_route_table_replicas") == 3.0).then_some(())
    })
    .await?;

    // Greedy references on one replica, each prompt with a salt of its own (nothing cached).
    let replica = c.replica_on("w1").await?.context("a replica on w1")?;
    let mut worker = WorkerServiceClient::connect(c.worker("w1")?.grpc.clone()).await?;
    let mut reference: HashMap<usize, Vec<u32>> = HashMap::new();
    let started = Instant::now();
    for k in 0..PREFIXES * SUFFIXES {
        let req = WorkerGenerateRequest {
            replica_id: replica.clone(),
            request: Some(request(prompt(k), &format!("reference-{k}"))),
            ..WorkerGenerateRequest::default()
        };
        let a = collect(worker.generate(req).await?.into_inner()).await?;
        assert_eq!((a.cached, a.tokens.len()), (0, MAX_TOKENS as usize), "reference {k} computed whole");
        reference.insert(k, a.tokens);
    }
    println!("references: {} prompts in {:?}", reference.len(), started.elapsed());

    let started = Instant::now();
    let by_p2c = phase(&p2c, "phase-p2c").await?;
    println!("p2c phase: {:?}", started.elapsed());
    let started = Instant::now();
    let by_prefix = phase(&aware, "phase-prefix-aware").await?;
    println!("prefix-aware phase: {:?}", started.elapsed());

    for (k, a) in by_p2c.iter().chain(&by_prefix) {
        assert_eq!(a.tokens, reference[k], "prompt {k}: output differs from the single-replica reference");
    }
    let (p2c_rate, aware_rate) = (hit_rate(&by_p2c), hit_rate(&by_prefix));
    let m = c.routers[0].metrics().await?;
    let counts: Vec<f64> = m
        .lines()
        .filter(|l| l.starts_with("prism_router_replica_dispatches_total{"))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse().ok()))
        .collect();
    let mean = counts.iter().sum::<f64>() / counts.len().max(1) as f64;
    let max = counts.iter().copied().fold(0.0, f64::max);
    let hits = metric_value(&m, "prism_router_routing_decisions_total{policy=\"prefix-aware\",reason=\"prefix_hit\"}");
    println!(
        "hit rate: p2c {p2c_rate:.3}, prefix-aware {aware_rate:.3}; prefix-aware dispatches {counts:?} (max/mean {:.2}); prefix_hit decisions {hits}",
        max / mean.max(1.0)
    );
    for l in m.lines().filter(|l| l.starts_with("prism_router_routing_decisions_total{")) {
        println!("{l}");
    }
    let (t_sum, t_n) = (
        metric_value(&m, "prism_router_prefix_tokenize_seconds_sum"),
        metric_value(&m, "prism_router_prefix_tokenize_seconds_count"),
    );
    println!("tokenize + hash: {:.0} µs per prompt over {t_n} prompts", t_sum / t_n.max(1.0) * 1e6);
    if counts.len() != 3 {
        bail!("dispatch counts of 3 replicas expected, got {counts:?}");
    }
    assert!(aware_rate >= p2c_rate + 0.15, "prefix-aware hit rate {aware_rate:.3} vs p2c {p2c_rate:.3}");
    assert!(max <= 1.5 * mean, "a replica served {max} requests, mean {mean}: {counts:?}");
    assert!(hits >= (CLIENTS * PER_CLIENT / 2) as f64, "only {hits} requests routed to a cached prefix");
    Ok(())
}
