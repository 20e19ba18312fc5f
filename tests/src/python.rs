//! Python from the integration tests: the virtual environments the `setup.sh` scripts make
//! (`tests/openai_client/setup.sh`, `tests/k8s/setup.sh`) and the OpenAI-client scripts of
//! `tests/openai_client/` run against a `prism up`.

use crate::paths::workspace_root;
use crate::up::PrismUp;
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Exit status of a `setup.sh` that could not install its packages (no package index reachable).
const SETUP_OFFLINE: i32 = 3;

/// The venv setup script of the OpenAI-client scripts, relative to the workspace root.
pub const OPENAI_SETUP: &str = "tests/openai_client/setup.sh";

/// Runs the venv setup script `setup` (a path relative to the workspace root, run from there;
/// it makes the venv once, under a lock, and prints the venv's python as its last line) and
/// returns that python, or `None` (with a notice) when the script exits 3: its packages could
/// not be installed because no package index is reachable. The script's stderr is echoed
/// (`cargo test` shows it when the test fails).
///
/// # Errors
/// When the script cannot start, or fails with any other status.
pub fn venv_python(setup: &str) -> Result<Option<PathBuf>> {
    let out = Command::new("bash")
        .arg(setup)
        .current_dir(workspace_root())
        .output()
        .with_context(|| format!("cannot start {setup}"))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprint!("{stderr}");
    match out.status.code() {
        Some(0) => {
            let stdout = String::from_utf8_lossy(&out.stdout);
            let python = stdout.lines().last().unwrap_or_default().trim();
            if python.is_empty() {
                bail!("{setup} printed no python path");
            }
            Ok(Some(PathBuf::from(python)))
        }
        Some(SETUP_OFFLINE) => {
            println!("NOTICE: {setup} could not install its packages (offline?)");
            Ok(None)
        }
        _ => bail!("{setup} failed ({}): {stderr}", out.status),
    }
}

/// The python of the OpenAI-client venv ([`OPENAI_SETUP`]: the `openai` package pinned in
/// `tests/openai_client/requirements.txt`), made off the async runtime's threads.
///
/// # Errors
/// When the venv cannot be made, offline included (these tests need the client).
pub async fn openai_venv() -> Result<PathBuf> {
    tokio::task::spawn_blocking(|| venv_python(OPENAI_SETUP))
        .await??
        .with_context(|| format!("the OpenAI-client tests need the `openai` package from PyPI ({OPENAI_SETUP})"))
}

/// Runs the OpenAI-client script `script` (a path relative to the workspace root) with `python`
/// against the OpenAI API of `up` as `--base-url <up>/v1 --model <served>`, with `envs` added
/// to its environment, prints its stdout and returns it. The scripts print one line per check
/// and end with `N passed, M failed`.
///
/// # Errors
/// When the script exits non-zero (the message holds its stdout and stderr and `prism up`'s
/// stderr), or its stdout has no `passed, 0 failed` summary.
pub async fn run_openai_script(
    python: &Path,
    up: &PrismUp,
    script: &str,
    served: &str,
    envs: &[(&str, &str)],
) -> Result<String> {
    let script = workspace_root().join(script);
    let base = format!("{}/v1", up.endpoints.http);
    let out = tokio::process::Command::new(python)
        .arg(&script)
        .args(["--base-url", &base, "--model", served])
        .envs(envs.iter().copied())
        .output()
        .await
        .with_context(|| format!("running {}", script.display()))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    println!("{stdout}");
    if !out.status.success() {
        bail!(
            "{} failed ({}):\n{stdout}\n{}\n--- prism up stderr ---\n{}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr),
            up.proc.stderr()
        );
    }
    if !stdout.contains(" passed, 0 failed") {
        bail!("no summary line from {}:\n{stdout}", script.display());
    }
    Ok(stdout)
}
