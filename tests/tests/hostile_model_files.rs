//! Hostile model files against a real cluster (etcd, one head and one worker with
//! `--model-root`, a router): a truncated copy of the bundled GGUF, a GGUF header claiming
//! 2^40 tensors, one with a 2^60-byte metadata key, Hugging Face directories with a corrupt
//! safetensors header, a malformed `tokenizer.json` and absurd `config.json` sizes, and a
//! symlink out of the model root: each replica Failed with a reason naming the problem, the
//! worker process alive, its peak RSS (VmHWM) under 500 MB above where it started, and the
//! same worker then serving the good model. A path outside the root is refused by the head
//! at deploy time with INVALID_ARGUMENT naming `engine.model`.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result};
use prism_common::proto::v1::{ApplyDeploymentRequest, DeploymentSpec, EngineConfig, ReplicaState};
use prism_engine::model::Tokenizer;
use prism_engine::model::gguf::GgufFile;
use prism_tests::{Cluster, alive, eventually, model, post_json};
use serde_json::json;
use std::path::Path;
use std::time::Duration;

/// Peak resident memory of `pid` in kB (`VmHWM` in `/proc/PID/status`).
fn peak_rss_kb(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).context("no VmHWM")?;
    line.split_whitespace().nth(1).context("VmHWM value")?.parse().context("VmHWM number")
}

/// One replica of `model` served as `name` (sent to the head directly: `prism deploy` reads
/// a local model file itself first and would refuse these before the head saw them).
fn spec(name: &str, model: &str) -> ApplyDeploymentRequest {
    ApplyDeploymentRequest {
        spec: Some(DeploymentSpec {
            name: name.into(),
            engine: Some(EngineConfig { model: model.into(), tensor_parallel_size: 1, ..Default::default() }),
            replicas: 1,
            ..Default::default()
        }),
    }
}

fn gguf_head(n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b
}

/// Writes the hostile files under `root`; returns `(deployment name, path, what the reason
/// must contain)` for each.
fn write_hostile_files(root: &Path, good: &Path) -> Result<Vec<(&'static str, String, &'static str)>> {
    let bytes = std::fs::read(good)?;
    std::fs::write(root.join("truncated.gguf"), &bytes[..bytes.len() / 2])?;
    let mut many = gguf_head(1 << 40, 0);
    many.resize(4096, 0);
    std::fs::write(root.join("many-tensors.gguf"), many)?;
    let mut long = gguf_head(0, 1);
    long.extend_from_slice(&(1u64 << 60).to_le_bytes());
    long.resize(4096, 0);
    std::fs::write(root.join("long-string.gguf"), long)?;

    let tokenizer = Tokenizer::from_gguf(&GgufFile::open(good)?)?.export()?.json;
    let config = json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
        "num_attention_heads": 9, "num_key_value_heads": 3, "num_hidden_layers": 30, "vocab_size": 49152,
        "max_position_embeddings": 8192, "tie_word_embeddings": true, "eos_token_id": 2});
    let hf = |name: &str, config: &serde_json::Value, tokenizer: &str, weights: &[u8]| -> Result<()> {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir)?;
        std::fs::write(dir.join("config.json"), serde_json::to_vec(config)?)?;
        std::fs::write(dir.join("tokenizer.json"), tokenizer)?;
        std::fs::write(dir.join("model.safetensors"), weights)?;
        Ok(())
    };
    // A header length of 2^40 in a 1 KiB file.
    let mut weights = (1u64 << 40).to_le_bytes().to_vec();
    weights.resize(1024, b' ');
    hf("bad-safetensors", &config, &tokenizer, &weights)?;
    // Broken JSON inside the decoder object (the tokenizers crate used to panic on it).
    let broken = tokenizer.replacen("\"decoder\":{", "\"decoder\":{\"type\":nul,", 1);
    assert_ne!(broken, tokenizer, "the exported tokenizer has a decoder object");
    hf("bad-tokenizer", &config, &broken, &weights)?;
    let mut absurd = config.clone();
    absurd["hidden_size"] = json!(1u64 << 40);
    absurd["num_hidden_layers"] = json!(1_000_000_000u64);
    hf("absurd-config", &absurd, &tokenizer, &weights)?;
    // A link inside the root to the bundled model outside it.
    std::os::unix::fs::symlink(good, root.join("escape.gguf"))?;
    let p = |n: &str| root.join(n).display().to_string();
    Ok(vec![
        ("truncated", p("truncated.gguf"), "lies outside the file"),
        ("many-tensors", p("many-tensors.gguf"), "tensor count larger than the file"),
        ("long-string", p("long-string.gguf"), "string length past the end of the file"),
        ("bad-safetensors", p("bad-safetensors"), "model.safetensors"),
        ("bad-tokenizer", p("bad-tokenizer"), "tokenizer.json"),
        ("absurd-config", p("absurd-config"), "hidden_size 1099511627776 is larger than the supported maximum"),
        ("escape", p("escape.gguf"), "outside the model root"),
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn corrupted_model_files_fail_their_replica_and_the_worker_keeps_serving() -> Result<()> {
    let Some(good) = model() else { return Ok(()) };
    let root_dir = tempfile::tempdir()?;
    let root = root_dir.path().join("models");
    std::fs::create_dir_all(&root)?;
    let cases = write_hostile_files(&root, &good)?;
    std::fs::copy(&good, root.join("good.gguf"))?;
    let root_s = root.display().to_string();
    let mut cluster = Cluster::builder()
        .head_args(&["--model-root", &root_s])
        .workers(1)
        .worker_args(&["--model-root", &root_s, "--kv-cache-bytes", "67108864", "--cpu-slots", "8"])
        .routers(1)
        .start()
        .await?;
    let pid = cluster.workers[0].process.pid();
    let base_kb = peak_rss_kb(pid)?;

    let mut head = cluster.head().client().await?;
    // The head refuses paths outside the root before anything is stored.
    for outside in [format!("{root_s}/../x.gguf"), good.display().to_string(), "/etc/passwd".into()] {
        let e = head.apply_deployment(spec("outside", &outside)).await.expect_err("outside the model root");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{outside}: {e}");
        assert!(e.message().starts_with("engine.model") && e.message().contains(&root_s), "{outside}: {e}");
    }
    assert!(cluster.replicas().await?.is_empty(), "nothing was stored for a refused deployment");

    for (name, path, _) in &cases {
        head.apply_deployment(spec(name, path)).await?;
    }
    let failed = eventually(Duration::from_secs(120), "every hostile replica Failed", || async {
        let replicas = cluster.replicas().await?;
        let failed: Vec<_> = replicas.iter().filter(|r| r.state == ReplicaState::Failed as i32).cloned().collect();
        Ok((failed.len() == cases.len()).then_some(failed))
    })
    .await;
    let failed = cluster.with_logs(failed)?;
    for (name, _, needle) in &cases {
        let r = failed.iter().find(|r| r.deployment == *name).with_context(|| format!("no replica of {name}"))?;
        assert!(r.reason.contains(needle), "{name}: reason {:?} should mention {needle:?}", r.reason);
    }
    assert!(alive(pid), "the worker survived every hostile file");
    let after_kb = peak_rss_kb(pid)?;
    eprintln!("worker VmHWM: {base_kb} kB at start, {after_kb} kB after the hostile files");
    assert!(after_kb < base_kb + 500 * 1024, "peak RSS grew from {base_kb} kB to {after_kb} kB");

    // The same worker still loads and serves a good model from under the root.
    head.apply_deployment(spec("good", &root.join("good.gguf").display().to_string())).await?;
    let ready = eventually(Duration::from_secs(240), "the good replica Ready", || async {
        let replicas = cluster.replicas().await?;
        Ok(replicas.iter().any(|r| r.deployment == "good" && r.state == ReplicaState::Ready as i32).then_some(()))
    })
    .await;
    cluster.with_logs(ready)?;
    let url = format!("{}/v1/completions", cluster.http());
    let body = json!({"model": "good", "prompt": "The capital of France is", "max_tokens": 4, "temperature": 0});
    let answer = eventually(Duration::from_secs(30), "a completion from the good replica", || async {
        let (status, v) = post_json(&url, &body).await?;
        Ok((status == 200).then_some(v))
    })
    .await?;
    assert_eq!(answer["usage"]["completion_tokens"], 4, "{answer}");
    assert!(alive(pid));
    cluster.check_alive()?;
    Ok(())
}
