//! The `prism` command-line tool, run as a child process against a cluster.

use crate::paths::{bin_path, workspace_root};
use anyhow::{Result, bail};
use std::process::Command;

/// Runs `prism ARGS` in the workspace root and returns its stdout. It blocks: call it from
/// `tokio::task::block_in_place` (or a blocking thread) inside async tests.
///
/// # Errors
/// When it cannot be started or exits non-zero (stderr in the message).
pub fn prism_cli(args: &[&str]) -> Result<String> {
    let out = Command::new(bin_path("prism")?).args(args).current_dir(workspace_root()).output()?;
    if !out.status.success() {
        bail!("prism {} failed ({}): {}", args.join(" "), out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
