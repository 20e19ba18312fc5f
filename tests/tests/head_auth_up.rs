//! `prism up --head-auth` as a real child process serving the bundled model: the embedded
//! worker and router present their generated tokens (the model is served), the printed
//! admin token file opens `prism status` and `prism scale`, and without it `prism status`
//! fails naming the missing token; the token never appears in what the process prints.
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_tests::{PrismUp, model, prism_cli};
use std::time::Duration;

async fn checks(up: &mut PrismUp) -> Result<()> {
    let ep = up.endpoints.clone();
    let file = ep.head_token_file.clone().context("prism up --head-auth printed no token file")?;
    let token = std::fs::read_to_string(&file)?.trim().to_owned();
    assert_eq!(token.len(), 32, "a 128-bit hex token");
    let body = serde_json::json!({"model": "SmolLM2-135M-Instruct", "prompt": "The sky is", "max_tokens": 4});
    let r = reqwest::Client::new().post(format!("{}/v1/completions", ep.http)).json(&body).send().await?;
    assert_eq!(r.status().as_u16(), 200, "the embedded router watches routes with its own token");

    let e = prism_cli(&["--head", &ep.head, "status"]).expect_err("no token");
    assert!(format!("{e:#}").contains("not authenticated: ClusterStatus needs a token"), "{e:#}");
    let out = prism_cli(&["--head", &ep.head, "--token-file", &file, "status"])?;
    assert!(out.contains("smollm2-135m-instruct"), "{out}");
    let out = prism_cli(&["--head", &ep.head, "--token-file", &file, "scale", "smollm2-135m-instruct", "1"])?;
    assert!(!out.is_empty());

    up.interrupt(Duration::from_secs(15)).await?;
    let printed = up.proc.stderr() + &up.proc.drain_stdout().join("\n");
    assert!(!printed.contains(&token), "the admin token was printed");
    // The audit lines name the admin token by its label (the log is coloured: no `who=`).
    assert!(printed.lines().any(|l| l.contains("prism-up-admin") && l.contains("ScaleDeployment")), "no audit line");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prism_up_head_auth_generates_tokens_per_component() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut up = PrismUp::start(&model, &["--head-auth"]).await?;
    if let Err(e) = checks(&mut up).await {
        bail!("{e:#}\n{}", up.proc.stderr_tail(6000));
    }
    Ok(())
}
