//! Where things are: the workspace root, the built binaries (`target/<profile>/prism-head` …)
//! and the bundled model.

use anyhow::{Context, Result, bail};
use std::path::PathBuf;

/// The bundled model, relative to the workspace root (`scripts/fetch-model.sh` fetches it).
pub const MODEL_FILE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The workspace root (the directory holding the root `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// Path of a workspace binary such as `prism-head`, found next to the running test
/// executable (`target/<profile>/deps/<test>` → `target/<profile>/<name>`), or in
/// `$PRISM_BIN_DIR` when set. `env!("CARGO_BIN_EXE_…")` only works for binaries of the test's
/// own crate; build the others first (`cargo build -p prism-head -p prism-worker -p prism-router -p prism-cli`).
///
/// # Errors
/// When the binary does not exist (the message says how to build it).
pub fn bin_path(name: &str) -> Result<PathBuf> {
    let dir = match std::env::var_os("PRISM_BIN_DIR") {
        Some(d) => PathBuf::from(d),
        None => {
            let exe = std::env::current_exe().context("locating the test executable")?;
            let deps = exe.parent().context("test executable has no parent directory")?;
            // Tests run from target/<profile>/deps; binaries live in target/<profile>.
            if deps.file_name().is_some_and(|n| n == "deps") {
                deps.parent().unwrap_or(deps).to_path_buf()
            } else {
                deps.to_path_buf()
            }
        }
    };
    let path = dir.join(name);
    if !path.is_file() {
        bail!("{} not found; build it first: cargo build --bin {name}", path.display());
    }
    Ok(path)
}

/// The bundled model, or `None` (the caller skips its test) when it is absent and
/// `PRISM_REQUIRE_MODEL` is not set.
///
/// # Panics
/// With `PRISM_REQUIRE_MODEL=1` a missing model fails the test.
pub fn model() -> Option<PathBuf> {
    let path = workspace_root().join(MODEL_FILE);
    if path.exists() {
        return Some(path);
    }
    let required = std::env::var("PRISM_REQUIRE_MODEL").is_ok_and(|v| v == "1");
    assert!(!required, "{} is missing and PRISM_REQUIRE_MODEL=1: run scripts/fetch-model.sh", path.display());
    eprintln!("skipped: {} is missing (run scripts/fetch-model.sh)", path.display());
    None
}
