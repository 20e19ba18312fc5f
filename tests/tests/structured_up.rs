//! Structured outputs and tool calling through the official `openai` Python client against a
//! `prism up` serving the bundled model (`models/SmolLM2-135M-Instruct.Q4_1.gguf`, CPU
//! engine): `tests/openai_client/test_structured.py` (in the venv `tests/openai_client/setup.sh`
//! creates) runs every check against one cluster — `beta.chat.completions.parse` with a
//! Pydantic model, 50 json_schema outputs validated streamed and not, json_object /
//! guided_choice / guided_regex, `tool_choice` required and named with two tools, a streamed
//! tool call accumulated from `delta.tool_calls`, a tool-result conversation, and 400s naming
//! the field (invalid schema, unknown tool, a schema the engine rejects, two constraints).
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_tests::{PrismUp, model, workspace_root};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn structured_outputs_and_tools_through_the_openai_client() -> Result<()> {
    run_script(true).await
}

async fn run_script(sweep: bool) -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let python = tokio::task::spawn_blocking(setup_venv).await??;
    let up = PrismUp::start(&model, &["--served-model-name", "smollm2"]).await?;
    let script = workspace_root().join("tests/openai_client/test_structured.py");
    let base = format!("{}/v1", up.endpoints.http);
    let out = tokio::process::Command::new(&python)
        .arg(&script)
        .args(["--base-url", &base, "--model", "smollm2"])
        .env("PRISM_STRUCTURED_50", if sweep { "1" } else { "0" })
        .output()
        .await
        .with_context(|| format!("running {}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}");
    if !out.status.success() {
        bail!(
            "structured-output script failed ({}):\n{stdout}\n{}\n--- prism up stderr ---\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            up.proc.stderr()
        );
    }
    assert!(stdout.contains(" passed, 0 failed"), "no summary line from the script:\n{stdout}");
    Ok(())
}

/// Runs `tests/openai_client/setup.sh` (creates the venv once, under a lock) and returns the
/// venv's python.
fn setup_venv() -> Result<std::path::PathBuf> {
    let script = workspace_root().join("tests/openai_client/setup.sh");
    let out = std::process::Command::new("bash").arg(&script).output().context("running setup.sh")?;
    if !out.status.success() {
        bail!("{} failed ({}): {}", script.display(), out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned().into())
}
