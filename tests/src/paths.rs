//! Where things are: the workspace root, the built binaries (`target/<profile>/prism-head` …)
//! and the models (the bundled SmolLM2 and the fetched Gemma 3 270M).

use anyhow::{Context, Result, bail};
use std::path::PathBuf;

/// The bundled model, relative to the workspace root (`scripts/fetch-model.sh` fetches it).
pub const MODEL_FILE: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// The second model, Gemma 3 270M (Q4_K_M), relative to the workspace root
/// (`scripts/fetch-gemma.sh` fetches it; Gemma Terms of Use, not committed).
pub const GEMMA_FILE: &str = "models/gemma-3-270m-q4_k_m.gguf";

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
    model_file(MODEL_FILE, "scripts/fetch-model.sh")
}

/// Gemma 3 270M ([`GEMMA_FILE`]), or `None` as [`model`] does.
///
/// # Panics
/// With `PRISM_REQUIRE_MODEL=1` a missing file fails the test.
pub fn gemma_model() -> Option<PathBuf> {
    model_file(GEMMA_FILE, "scripts/fetch-gemma.sh")
}

fn model_file(file: &str, fetch: &str) -> Option<PathBuf> {
    let path = workspace_root().join(file);
    if path.exists() {
        return Some(path);
    }
    let required = std::env::var("PRISM_REQUIRE_MODEL").is_ok_and(|v| v == "1");
    assert!(!required, "{} is missing and PRISM_REQUIRE_MODEL=1: run {fetch}", path.display());
    eprintln!("skipped: {} is missing (run {fetch})", path.display());
    None
}
