//! API keys through a real `prism up` child process serving the bundled model: `--api-key`
//! and `--api-key-file` (a key with `rps=2`); the key opens the API, no key gets 401 (gRPC
//! UNAUTHENTICATED), the probes stay open, `/metrics` needs the key, the limited key gets 429
//! with Retry-After on its third immediate request, `prism up`'s own `--prompt` runs with the key,
//! and neither key appears in what the process logs. Skipped when the model is absent unless
//! `PRISM_REQUIRE_MODEL=1`. `prism generate --api-key` is checked against it too, and
//! `prism generate` / `prism bench serve` with `PRISM_API_KEY` holding a comma-separated list.

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::ListModelsRequest;
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_tests::{PrismUp, model, prism_cli};
use std::time::Duration;

const KEY: &str = "sk-up-flag-5d41402abc4b2a76";
const FILE_KEY: &str = "sk-up-file-7d793037a0760186";

async fn status(http: &reqwest::Client, url: &str, key: Option<&str>) -> Result<reqwest::Response> {
    let mut r = http.get(url);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    Ok(r.send().await?)
}

async fn checks(up: &mut PrismUp) -> Result<()> {
    let ep = up.endpoints.clone();
    let http = reqwest::Client::new();
    let models = format!("{}/v1/models", ep.http);
    let r = status(&http, &models, Some(KEY)).await?;
    assert_eq!(r.status().as_u16(), 200);
    let v: serde_json::Value = r.json().await?;
    assert_eq!(v["data"][0]["id"], "SmolLM2-135M-Instruct", "{v}");
    for key in [None, Some("sk-wrong")] {
        let r = status(&http, &models, key).await?;
        assert_eq!(r.status().as_u16(), 401, "{key:?}");
        assert_eq!(r.headers().get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer"));
    }
    for probe in ["/health", "/healthz", "/readyz"] {
        assert_eq!(status(&http, &format!("{}{probe}", ep.http), None).await?.status().as_u16(), 200, "{probe}");
    }
    assert_eq!(status(&http, &format!("{}/metrics", ep.http), None).await?.status().as_u16(), 401);
    let body = serde_json::json!({"model": "SmolLM2-135M-Instruct", "prompt": "The sky is", "max_tokens": 4});
    let r = http.post(format!("{}/v1/completions", ep.http)).bearer_auth(KEY).json(&body).send().await?;
    assert_eq!(r.status().as_u16(), 200);
    let r = http.post(format!("{}/v1/completions", ep.http)).json(&body).send().await?;
    assert_eq!(r.status().as_u16(), 401);

    // The file's key: 2 requests/s, the third at once waits.
    let codes = [
        status(&http, &models, Some(FILE_KEY)).await?.status().as_u16(),
        status(&http, &models, Some(FILE_KEY)).await?.status().as_u16(),
    ];
    assert_eq!(codes, [200, 200]);
    let third = status(&http, &models, Some(FILE_KEY)).await?;
    assert_eq!(third.status().as_u16(), 429);
    let wait: u32 = third.headers().get("retry-after").context("Retry-After")?.to_str()?.parse()?;
    assert!(wait >= 1);
    assert_eq!(status(&http, &models, Some(KEY)).await?.status().as_u16(), 200, "the flag key has no limit");

    let mut g = InferenceServiceClient::connect(ep.grpc.clone()).await?;
    let e = g.list_models(ListModelsRequest {}).await.expect_err("gRPC without a key");
    assert_eq!(e.code(), tonic::Code::Unauthenticated);
    let mut req = tonic::Request::new(ListModelsRequest {});
    req.metadata_mut().insert("authorization", format!("Bearer {KEY}").parse()?);
    assert_eq!(g.list_models(req).await?.into_inner().models.len(), 1);

    // `prism generate --api-key` (the CLI's gRPC client) gets an answer; without the key the
    // model lookup is refused.
    let grpc = ep.grpc.clone();
    let (with, without) = tokio::task::spawn_blocking(move || {
        let base = ["--router", grpc.as_str(), "generate", "The sky is", "--raw", "--max-tokens", "3"];
        let with = prism_cli(&[&base[..], &["--api-key", KEY]].concat());
        (with, prism_cli(&base))
    })
    .await?;
    assert!(!with?.trim().is_empty(), "prism generate --api-key printed nothing");
    let err = without.err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("not authenticated"), "prism generate without a key: {err}");

    // PRISM_API_KEY holding a comma-separated list, as `prism up` reads it: the client
    // commands send its first key (gRPC for generate and bench, HTTP for bench's openai backend).
    let (grpc, base_url) = (ep.grpc.clone(), ep.http.clone());
    let outputs = tokio::task::spawn_blocking(move || -> Result<Vec<std::process::Output>> {
        let bench = [
            "bench",
            "serve",
            "--num-prompts",
            "2",
            "--random-input-len",
            "8",
            "--random-output-len",
            "2",
            "--no-progress",
        ];
        let runs: [Vec<&str>; 3] = [
            vec!["generate", "The sky is", "--raw", "--max-tokens", "3"],
            bench.to_vec(),
            [&bench[..], &["--backend", "openai", "--base-url", &base_url]].concat(),
        ];
        let mut outs = Vec::new();
        for args in runs {
            let out = std::process::Command::new(prism_tests::bin_path("prism")?)
                .args(["--router", grpc.as_str()])
                .args(&args)
                .env("PRISM_API_KEY", format!("{KEY},sk-other"))
                .output()?;
            outs.push(out);
        }
        Ok(outs)
    })
    .await??;
    for out in outputs {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "a client with PRISM_API_KEY=KEY,sk-other failed: {stderr}");
    }

    let m = status(&http, &format!("{}/metrics", ep.http), Some(KEY)).await?.text().await?;
    assert!(m.contains(r#"prism_router_rate_limited_total{key="limited",limit="requests"} 1"#), "{m}");
    assert!(!m.contains(KEY) && !m.contains(FILE_KEY));

    // The banner tells that keys are needed without printing one; `--prompt` ran with the key.
    let line = up.proc.wait_for_line(Duration::from_secs(60), |l| l.contains("API keys required")).await?;
    let done = up.proc.wait_for_line(Duration::from_secs(120), |l| l.contains("Still serving")).await?;
    assert!(!line.contains(KEY) && !done.contains(KEY));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prism_up_api_keys_guard_the_api_and_never_reach_the_logs() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("keys");
    std::fs::write(&file, format!("# one limited key\n\n{FILE_KEY} name=limited rps=2\n"))?;
    let f = file.to_string_lossy().into_owned();
    let args = ["--api-key", KEY, "--api-key-file", &f, "--prompt", "Say hi.", "--prompt-max-tokens", "4"];
    let mut up = PrismUp::start(&model, &args).await?;
    if let Err(e) = checks(&mut up).await {
        bail!("{e:#}\nprism up stderr:\n{}", up.proc.stderr());
    }
    up.interrupt(Duration::from_secs(10)).await?;
    let log = up.proc.stderr();
    assert!(log.contains("API keys required"), "the router logs that keys are on:\n{log}");
    assert!(!log.contains(KEY) && !log.contains(FILE_KEY), "a key reached the log:\n{log}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prism_up_refuses_a_missing_key_file_naming_it() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let missing = "/nonexistent/prism-keys";
    let out = std::process::Command::new(prism_tests::bin_path("prism")?)
        .args(["up", "--model", &model.to_string_lossy(), "--api-key-file", missing, "--port", "0"])
        .output()?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(missing) && err.contains("--api-key-file"), "{err}");
    Ok(())
}
