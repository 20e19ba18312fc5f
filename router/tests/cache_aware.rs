//! Cache-aware routing through the real router (`prism_router::run` on 127.0.0.1:0) in front
//! of two `MockEngineWorker`s that serve a prompt codec (a small word-level tokenizer) and a
//! prefix-cache stream the test controls: the router fetches both codecs, follows both
//! streams, sends a request to the replica that reports its prompt's blocks, and forwards the
//! token ids it computed with that replica's codec fingerprint; with `--routing-policy p2c`
//! it tokenizes nothing.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use prism_common::proto::v1 as pb;
use prism_engine::Prompt;
use prism_engine::codec::{CodecExport, PromptCodec};
use prism_engine::kv_cache::prefix_hash::block_hashes;
use prism_engine::model::TokenizerExport;
use prism_router::config::{RouterConfig, RoutingPolicy, StaticRoute};
use prism_router::mock_engine::{MockBehavior, MockEngineWorker};
use serde_json::json;
use tokio_util::sync::CancellationToken;

const BLOCK: u32 = 2;
const NAMESPACE: u64 = 7;

fn export() -> CodecExport {
    let json = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "c": 2, "d": 3, "[UNK]": 4}, "unk_token": "[UNK]"}
    });
    CodecExport {
        tokenizer: TokenizerExport { json: json.to_string(), add_bos: false, bos_id: None },
        chat_template: None,
        chat_content_special_tokens: false,
    }
}

fn codec_message() -> anyhow::Result<pb::PromptCodec> {
    let e = export();
    Ok(pb::PromptCodec {
        replica_id: String::new(),
        codec_json: e.to_json()?,
        fingerprint: e.fingerprint(),
        block_size: BLOCK,
        cache_namespace: NAMESPACE,
        prefix_caching: true,
    })
}

async fn router(endpoints: &[String], policy: RoutingPolicy, shutdown: &CancellationToken) -> anyhow::Result<String> {
    let static_routes = endpoints.iter().map(|e| StaticRoute { model: "mock".into(), endpoint: e.clone() }).collect();
    let cfg = RouterConfig { static_routes, routing_policy: policy, ..Default::default() };
    let h = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let g = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let http = format!("http://{}", h.local_addr()?);
    tokio::spawn(prism_router::run(cfg, h, g, shutdown.child_token()));
    Ok(http)
}

async fn metrics(http: &str) -> String {
    match reqwest::get(format!("{http}/metrics")).await {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Waits until the router's `/metrics` has a line starting with `line`.
async fn wait_metric(http: &str, line: &str) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        if metrics(http).await.lines().any(|l| l.starts_with(line)) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    anyhow::bail!("no `{line}` in the router's metrics:\n{}", metrics(http).await)
}

async fn complete(http: &str, prompt: &str) -> anyhow::Result<()> {
    let body = json!({"model": "mock", "prompt": prompt, "max_tokens": 2});
    let r = reqwest::Client::new().post(format!("{http}/v1/completions")).json(&body).send().await?;
    anyhow::ensure!(r.status().is_success(), "status {}", r.status());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_follow_the_reported_prefix_and_carry_their_token_ids() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let codec = codec_message()?;
    let mocks: Vec<MockEngineWorker> =
        (0..2).map(|_| MockEngineWorker::new(MockBehavior::default()).with_codec(codec.clone())).collect();
    let mut endpoints = Vec::new();
    for m in &mocks {
        endpoints.push(format!("http://{}", m.clone().spawn(shutdown.clone()).await?));
    }
    let http = router(&endpoints, RoutingPolicy::PrefixAware, &shutdown).await?;
    for i in 0..2 {
        wait_metric(&http, &format!("prism_router_prefix_index_blocks{{replica_id=\"static-mock-{i}\"}} 0")).await?;
    }

    // Replica 1 reports the blocks of the shared prefix.
    let prefix = "a b c d a b c d a b c d";
    let prompt_codec = PromptCodec::from_export(&export())?;
    let prefix_ids = prompt_codec.prompt_ids(&Prompt::Text(prefix.into()))?;
    let hashes = block_hashes(NAMESPACE, None, &prefix_ids, BLOCK as usize);
    mocks[1].set_cached(hashes.clone());
    wait_metric(&http, &format!("prism_router_prefix_index_blocks{{replica_id=\"static-mock-1\"}} {}", hashes.len()))
        .await?;
    // Three requests: a fourth would find replica 1 over its share of recent dispatches (3 of 3
    // against the mean 1.5: the share guard) and go to replica 0 to spread the prefix.
    for q in ["a", "b", "c d"] {
        complete(&http, &format!("{prefix} {q}")).await?;
    }
    let served: Vec<u64> = mocks.iter().map(|m| m.stats.requests.load(Ordering::Relaxed)).collect();
    assert_eq!(served, vec![0, 3], "every request went to the replica holding the prefix");
    let last = mocks[1].stats.last_request.lock().map(|g| g.clone()).ok().flatten().expect("a request");
    let want = prompt_codec.prompt_ids(&Prompt::Text(format!("{prefix} c d")))?;
    assert_eq!(last.prompt_token_ids, want, "the router's token ids go along");
    assert_eq!(last.codec_fingerprint, codec.fingerprint);
    let m = metrics(&http).await;
    assert!(m.contains("prism_router_routing_decisions_total{policy=\"prefix-aware\",reason=\"prefix_hit\"} 3"), "{m}");

    // The same traffic through a P2C router: nothing tokenized, nothing forwarded.
    let p2c = router(&endpoints, RoutingPolicy::P2c, &shutdown).await?;
    wait_metric(&p2c, "prism_route_table_replicas 2").await?;
    for _ in 0..4 {
        complete(&p2c, &format!("{prefix} a")).await?;
    }
    for m in &mocks {
        if let Some(r) = m.stats.last_request.lock().map(|g| g.clone()).ok().flatten()
            && r.codec_fingerprint == 0
        {
            assert!(r.prompt_token_ids.is_empty());
        }
    }
    let total: u64 = mocks.iter().map(|m| m.stats.requests.load(Ordering::Relaxed)).sum();
    assert_eq!(total, 7);
    let fresh: Vec<_> = mocks
        .iter()
        .filter_map(|m| m.stats.last_request.lock().map(|g| g.clone()).ok().flatten())
        .filter(|r| r.codec_fingerprint == 0)
        .collect();
    assert!(!fresh.is_empty(), "the P2C router sent its requests without token ids");
    Ok(())
}
