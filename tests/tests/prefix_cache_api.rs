//! Prefix caching as clients and routers see it, on real processes: etcd, `prism-head`, one
//! `prism-worker` (two CPU slots) serving the bundled model twice — deployment `smollm2`
//! (prefix caching on, the default) and `nocache` (`engine: {enable_prefix_caching: false}`,
//! served as `smol-nocache`) — and a router.
//!
//! - Through the router, OpenAI HTTP (completions, streamed chat with `include_usage`) and
//!   gRPC: `cached_tokens` is 0 on a cold request of a long prompt and > 0 (below the prompt's
//!   length) on an exact repeat, with the same output; another `cache_salt` gets 0 (and hits
//!   its own cache on a repeat); `nocache` always reports 0 and gives the same output.
//! - A `cache_salt` of the wrong type, empty or over 256 bytes is a 400 naming `cache_salt`
//!   (INVALID_ARGUMENT over gRPC) and the cluster keeps serving.
//! - The worker's `/metrics`: `vllm:prefix_cache_hits_total` of `smollm2` grows, the one of
//!   `smol-nocache` stays 0; `prism status` prints a hit rate for `smollm2`.
//! - `GetPromptCodec`: the codec's `PromptCodec::prompt_ids` count exactly the prompt tokens
//!   the replica reports (completion and chat); NOT_FOUND for an unknown replica; `Generate`
//!   with the router's token ids uses them when the fingerprint matches and tokenizes the
//!   prompt itself when it does not.
//! - `WatchPrefixCache`: the first message is a reset holding the blocks of the prompts sent
//!   before; a later request's blocks arrive as `stored`.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, ensure};
use prism_common::proto::v1::worker_service_client::WorkerServiceClient;
use prism_common::proto::v1::{self as pb, GenerateRequest, SamplingParams, generate_request::Prompt as PbPrompt};
use prism_engine::codec::{CodecExport, PromptCodec};
use prism_engine::kv_cache::block_hashes;
use prism_engine::{ChatMessage, Prompt};
use prism_tests::{Cluster, Deployment, SERVED, eventually, metric_value, model, post_json, post_sse, stream};
use serde_json::{Value, json};
use std::collections::HashSet;
use std::time::Duration;

/// Tokens generated per request (EOS ignored, greedy).
const MAX_TOKENS: u32 = 8;
/// The deployment with prefix caching off, and the name it is served as.
const NOCACHE: &str = "nocache";
const NOCACHE_SERVED: &str = "smol-nocache";

/// A prompt of about 250 tokens (many KV blocks) whose first block names `topic`, so prompts
/// of different topics share no block.
fn long_prompt(topic: &str) -> String {
    (0..12)
        .map(|i| {
            format!("Report on {topic}, part {i}: the {topic} committee reviewed item {i} and found it in order. ")
        })
        .collect()
}

/// A greedy completion through the router: (text, prompt tokens, cached tokens).
async fn complete(http: &str, model: &str, prompt: &str, salt: Option<&str>) -> Result<(String, u64, u64)> {
    let mut body =
        json!({"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": true});
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    let (status, v) = post_json(&format!("{http}/v1/completions"), &body).await?;
    ensure!(status == 200, "completion got {status}: {v}");
    let usage = &v["usage"];
    Ok((
        v["choices"][0]["text"].as_str().context("text")?.to_owned(),
        usage["prompt_tokens"].as_u64().context("prompt_tokens")?,
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .with_context(|| format!("cached_tokens in {usage}"))?,
    ))
}

/// A streamed greedy chat through the router with `include_usage`: (text, prompt tokens,
/// cached tokens from the usage chunk).
async fn chat_streamed(http: &str, messages: &Value) -> Result<(String, u64, u64)> {
    let body = json!({"model": SERVED, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                      "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}});
    let events = post_sse(&format!("{http}/v1/chat/completions"), &body).await?;
    let text: String = events.iter().filter_map(|e| e["choices"][0]["delta"]["content"].as_str()).collect();
    let usage = events.iter().rev().find(|e| e["usage"].is_object()).context("a usage chunk")?["usage"].clone();
    Ok((
        text,
        usage["prompt_tokens"].as_u64().context("prompt_tokens")?,
        usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .with_context(|| format!("cached_tokens in {usage}"))?,
    ))
}

fn grpc_text(prompt: &str, salt: Option<&str>) -> GenerateRequest {
    GenerateRequest {
        model: SERVED.into(),
        prompt: Some(PbPrompt::Text(prompt.into())),
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(i64::from(MAX_TOKENS)),
            ignore_eos: true,
            ..SamplingParams::default()
        }),
        cache_salt: salt.map(str::to_owned),
        ..GenerateRequest::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cached_tokens_salts_metrics_codec_and_watch_through_the_real_stack() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::builder()
        .workers(1)
        .worker_args(&["--kv-cache-bytes", "67108864", "--cpu-slots", "2"])
        .routers(1)
        .deploy(Deployment::new(&model))
        .start()
        .await?;
    let mut nocache = Deployment::new(&model).served_as(NOCACHE_SERVED).engine("enable_prefix_caching", false);
    NOCACHE.clone_into(&mut nocache.name);
    let outcome = async {
        cluster.deploy(&nocache)?;
        cluster.wait_listed(&[SERVED, NOCACHE_SERVED], Duration::from_secs(120)).await?;
        run(&cluster).await
    }
    .await;
    cluster.with_logs(outcome)
}

async fn run(cluster: &Cluster) -> Result<()> {
    let http = cluster.http().to_owned();
    let grpc = cluster.grpc().to_owned();
    let worker = &cluster.workers[0];
    let hits_line = |m: &str| format!("vllm:prefix_cache_hits_total{{model_name=\"{m}\"}}");
    let hits_before = metric_value(&worker.metrics().await?, &hits_line(SERVED));

    // HTTP completions: cold, exact repeat, another salt (cold, then a hit of its own).
    let a = long_prompt("bridges");
    let (text, prompt_tokens, cold) = complete(&http, SERVED, &a, None).await?;
    ensure!(prompt_tokens > 64, "a long prompt: {prompt_tokens} tokens");
    ensure!(cold == 0, "cold request: {cold} cached tokens");
    let (again, _, warm_http) = complete(&http, SERVED, &a, None).await?;
    ensure!(warm_http > 0 && warm_http < prompt_tokens, "exact repeat: {warm_http} of {prompt_tokens} cached");
    ensure!(again == text, "the cached prefix changes nothing: {again:?} vs {text:?}");
    let (salted, _, other_salt) = complete(&http, SERVED, &a, Some("tenant-b")).await?;
    ensure!(other_salt == 0, "another cache_salt shares no block: {other_salt} cached");
    ensure!(salted == text);
    let (_, _, same_salt) = complete(&http, SERVED, &a, Some("tenant-b")).await?;
    ensure!(same_salt > 0, "requests with equal salts share blocks: {same_salt} cached");

    // Prefix caching off: always 0, the same output.
    for _ in 0..2 {
        let (t, _, cached) = complete(&http, NOCACHE_SERVED, &a, None).await?;
        ensure!(cached == 0, "nocache reported {cached} cached tokens");
        ensure!(t == text, "cache on and off give the same output: {t:?} vs {text:?}");
    }

    // Streamed chat with a long system prompt: the usage chunk carries cached_tokens.
    let messages =
        json!([{"role": "system", "content": long_prompt("harbours")}, {"role": "user", "content": "Summarise."}]);
    let (chat_text, chat_prompt_tokens, chat_cold) = chat_streamed(&http, &messages).await?;
    ensure!(chat_cold == 0, "cold chat: {chat_cold}");
    let (chat_again, _, chat_warm) = chat_streamed(&http, &messages).await?;
    ensure!(chat_warm > 0 && chat_warm < chat_prompt_tokens, "repeated chat: {chat_warm} of {chat_prompt_tokens}");
    ensure!(chat_again == chat_text);

    // gRPC: the same rules.
    let b = long_prompt("tunnels");
    let cold = stream(&grpc, grpc_text(&b, None)).await?;
    ensure!(cold.cached_tokens == 0 && cold.prompt_tokens > 64, "gRPC cold: {cold:?}");
    let warm = stream(&grpc, grpc_text(&b, None)).await?;
    ensure!(warm.cached_tokens > 0 && warm.cached_tokens < warm.prompt_tokens, "gRPC repeat: {warm:?}");
    ensure!(warm.tokens == cold.tokens);
    let salted = stream(&grpc, grpc_text(&b, Some("g"))).await?;
    ensure!(salted.cached_tokens == 0 && salted.tokens == cold.tokens, "gRPC other salt: {salted:?}");

    bad_salts_are_refused(&http, &grpc).await?;
    worker_rpcs(cluster, &a, prompt_tokens, &messages, chat_prompt_tokens, &b, &cold.tokens).await?;

    // Metrics and status.
    let m = worker.metrics().await?;
    let hits = metric_value(&m, &hits_line(SERVED));
    ensure!(hits > hits_before, "vllm:prefix_cache_hits_total grew: {hits_before} -> {hits}");
    ensure!(metric_value(&m, "vllm:prefix_cache_queries_total{model_name=\"smollm2\"}") >= hits);
    ensure!(metric_value(&m, &hits_line(NOCACHE_SERVED)) < 0.5, "nocache never hits");
    // Prefilled tokens leave the hits out: fewer than the prompt tokens served.
    let computed = metric_value(&m, "prism:prompt_tokens_computed_total{model_name=\"smollm2\"}");
    let prompts = metric_value(&m, "vllm:prompt_tokens_total{model_name=\"smollm2\"}");
    ensure!(computed > 0.0 && computed < prompts, "computed {computed} of {prompts} prompt tokens");
    ensure!(m.contains(&hits_line(NOCACHE_SERVED)), "nocache's counter is exported: {m}");
    let rate = eventually(Duration::from_secs(20), "prism status shows a hit rate", || async {
        let out = cluster.cli(&["status"])?;
        let line = out.lines().find(|l| l.starts_with("smollm2 ")).with_context(|| out.clone())?;
        let cell = line.split_whitespace().last().unwrap_or_default().to_owned();
        Ok(cell.strip_suffix('%').and_then(|p| p.parse::<f64>().ok()).filter(|p| *p > 0.0))
    })
    .await?;
    ensure!(rate <= 100.0, "hit rate {rate}%");
    eprintln!(
        "completion of {prompt_tokens} tokens: repeat {warm_http} cached; chat of {chat_prompt_tokens}: repeat {chat_warm} \
         cached; gRPC {} of {}; worker hits {hits_before} -> {hits}, prompt tokens computed {computed} of {prompts}; prism status {rate}%",
        warm.cached_tokens, warm.prompt_tokens
    );
    Ok(())
}

async fn bad_salts_are_refused(http: &str, grpc: &str) -> Result<()> {
    let cmpl = |salt: Value| json!({"model": SERVED, "prompt": "hi", "max_tokens": 1, "cache_salt": salt});
    let chat = |salt: Value| json!({"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": salt});
    for (path, body) in [
        ("/v1/completions", cmpl(json!(5))),
        ("/v1/completions", cmpl(json!(""))),
        ("/v1/completions", cmpl(json!("x".repeat(300)))),
        ("/v1/chat/completions", chat(json!(5))),
        ("/v1/chat/completions", chat(json!(""))),
        ("/v1/chat/completions", chat(json!("x".repeat(300)))),
    ] {
        let (status, v) = post_json(&format!("{http}{path}"), &body).await?;
        ensure!(status == 400, "{path} {body}: {status} {v}");
        ensure!(v["error"]["param"] == "cache_salt", "{path}: {v}");
        ensure!(v["error"]["type"] == "invalid_request_error", "{v}");
    }
    let e = stream(grpc, grpc_text("hi", Some(&"x".repeat(300)))).await.err().context("gRPC accepted 300 bytes")?;
    let s = e.downcast_ref::<tonic::Status>().with_context(|| format!("{e:#}"))?;
    ensure!(s.code() == tonic::Code::InvalidArgument && s.message().contains("cache_salt"), "{s:?}");
    // Still serving.
    let (status, v) = post_json(&format!("{http}/v1/completions"), &cmpl(json!("ok"))).await?;
    ensure!(status == 200, "after bad salts: {status} {v}");
    Ok(())
}

/// GetPromptCodec, Generate with the router's token ids, and WatchPrefixCache, straight to
/// the worker.
async fn worker_rpcs(
    cluster: &Cluster,
    a: &str,
    a_prompt_tokens: u64,
    messages: &Value,
    chat_prompt_tokens: u64,
    b: &str,
    b_tokens: &[u32],
) -> Result<()> {
    let replicas = cluster.replicas().await?;
    let id_of = |d: &str| replicas.iter().find(|r| r.deployment == d).map(|r| r.replica_id.clone());
    let replica = id_of("smollm2").context("smollm2 replica")?;
    let mut w = WorkerServiceClient::connect(cluster.workers[0].grpc.clone()).await?;

    let codec = w.get_prompt_codec(pb::GetPromptCodecRequest { replica_id: replica.clone() }).await?.into_inner();
    ensure!(codec.replica_id == replica && codec.prefix_caching && codec.block_size == 16, "{:?}", codec.block_size);
    let export = CodecExport::from_json(&codec.codec_json)?;
    ensure!(export.fingerprint() == codec.fingerprint, "the fingerprint names the JSON");
    let pc = PromptCodec::from_export(&export)?;
    let a_ids = pc.prompt_ids(&Prompt::Text(a.to_owned()))?;
    ensure!(a_ids.len() as u64 == a_prompt_tokens, "codec: {} ids, replica: {a_prompt_tokens}", a_ids.len());
    let chat: Vec<ChatMessage> = messages
        .as_array()
        .context("messages")?
        .iter()
        .map(|m| ChatMessage {
            role: m["role"].as_str().unwrap_or("").into(),
            content: m["content"].as_str().unwrap_or("").into(),
            ..Default::default()
        })
        .collect();
    let chat_ids = pc.prompt_ids(&Prompt::Chat(chat))?;
    ensure!(chat_ids.len() as u64 == chat_prompt_tokens, "chat: {} ids vs {chat_prompt_tokens}", chat_ids.len());
    let off = w
        .get_prompt_codec(pb::GetPromptCodecRequest { replica_id: id_of(NOCACHE).context("nocache replica")? })
        .await?
        .into_inner();
    ensure!(!off.prefix_caching, "nocache's codec says it caches nothing");
    let unknown = w.get_prompt_codec(pb::GetPromptCodecRequest { replica_id: "nope".into() }).await.err();
    ensure!(unknown.map(|s| s.code()) == Some(tonic::Code::NotFound));

    // Generate with the router's ids: used with the right fingerprint, ignored otherwise.
    let b_ids = pc.prompt_ids(&Prompt::Text(b.to_owned()))?;
    let decoy = "Unrelated words.";
    let generate = |fingerprint: u64| pb::WorkerGenerateRequest {
        replica_id: replica.clone(),
        request: Some(grpc_text(decoy, None)),
        prompt_token_ids: b_ids.clone(),
        codec_fingerprint: fingerprint,
        ..pb::WorkerGenerateRequest::default()
    };
    let (tokens, prompt_tokens) = worker_generate(&mut w, generate(codec.fingerprint)).await?;
    ensure!(prompt_tokens as usize == b_ids.len() && tokens == b_tokens, "ids used: {prompt_tokens} prompt tokens");
    let (_, prompt_tokens) = worker_generate(&mut w, generate(codec.fingerprint ^ 1)).await?;
    let decoy_len = pc.prompt_ids(&Prompt::Text(decoy.to_owned()))?.len();
    ensure!(prompt_tokens as usize == decoy_len, "stale fingerprint: tokenized ({prompt_tokens} vs {decoy_len})");

    // WatchPrefixCache: a reset with what is cached, then a new request's blocks.
    let mut watch =
        w.watch_prefix_cache(pb::WatchPrefixCacheRequest { replica_id: replica.clone() }).await?.into_inner();
    let first = tokio::time::timeout(Duration::from_secs(10), watch.message()).await?.context("watch ended")?;
    let first = first.context("a first message")?;
    ensure!(first.reset, "the first message is a reset");
    let mut held: HashSet<u64> = first.stored.iter().copied().collect();
    let block = codec.block_size as usize;
    let a_hashes = block_hashes(codec.cache_namespace, None, &a_ids, block);
    ensure!(
        a_hashes.iter().all(|h| held.contains(h)),
        "the reset holds the earlier prompt's {} blocks",
        a_hashes.len()
    );
    let c = long_prompt("canals");
    let c_hashes = block_hashes(codec.cache_namespace, None, &pc.prompt_ids(&Prompt::Text(c.clone()))?, block);
    ensure!(!c_hashes.iter().any(|h| held.contains(h)), "a new prompt is not cached yet");
    stream(cluster.grpc(), grpc_text(&c, None)).await?;
    tokio::time::timeout(Duration::from_secs(10), async {
        while !c_hashes.iter().all(|h| held.contains(h)) {
            let m = watch.message().await?.context("watch ended")?;
            if m.reset {
                held.clear();
            }
            for h in &m.removed {
                held.remove(h);
            }
            held.extend(m.stored);
        }
        anyhow::Ok(())
    })
    .await
    .context("the new request's blocks were not reported as stored within 10 s")??;
    Ok(())
}

/// Streams a request straight to the worker: (tokens, prompt tokens).
async fn worker_generate(
    w: &mut WorkerServiceClient<tonic::transport::Channel>,
    req: pb::WorkerGenerateRequest,
) -> Result<(Vec<u32>, u32)> {
    let mut s = w.generate(req).await?.into_inner();
    let (mut tokens, mut prompt_tokens) = (Vec::new(), 0);
    while let Some(m) = s.message().await? {
        tokens.extend(m.token_ids);
        prompt_tokens = prompt_tokens.max(m.prompt_tokens);
    }
    Ok((tokens, prompt_tokens))
}
