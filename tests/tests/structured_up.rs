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

use anyhow::Result;
use prism_tests::{PrismUp, model, openai_venv, run_openai_script};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn structured_outputs_and_tools_through_the_openai_client() -> Result<()> {
    run_script(true).await
}

async fn run_script(sweep: bool) -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let python = openai_venv().await?;
    let up = PrismUp::start(&model, &["--served-model-name", "smollm2"]).await?;
    let sweep = if sweep { "1" } else { "0" };
    run_openai_script(
        &python,
        &up,
        "tests/openai_client/test_structured.py",
        "smollm2",
        &[("PRISM_STRUCTURED_50", sweep)],
    )
    .await?;
    Ok(())
}
