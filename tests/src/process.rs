//! Child processes for integration tests: a guard that kills its child on drop, and the
//! location of the workspace's binaries (`target/debug/prism-head` …).

use anyhow::{Context, Result, bail};
use std::path::PathBuf;
use std::process::{Child, ExitStatus};

/// Owns a child process and kills it (SIGKILL) and reaps it on drop, so a failing test
/// never leaves processes behind.
#[derive(Debug)]
pub struct ProcessGuard {
    name: String,
    child: Option<Child>,
}

impl ProcessGuard {
    /// Guards `child`; `name` is used in messages.
    pub fn new(name: impl Into<String>, child: Child) -> Self {
        Self { name: name.into(), child: Some(child) }
    }

    /// The name given at creation.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The child's process id (`None` once killed).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The child, for its pipes or signals.
    pub fn child_mut(&mut self) -> Option<&mut Child> {
        self.child.as_mut()
    }

    /// Whether the child has exited, and how (does not block).
    ///
    /// # Errors
    /// When the status cannot be queried.
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        match self.child.as_mut() {
            Some(c) => Ok(c.try_wait()?),
            None => bail!("{} was already killed", self.name),
        }
    }

    /// Kills the child with SIGKILL (`kill -9`) and reaps it. Idempotent.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Fails only when it already exited; reaping below handles both cases.
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for ProcessGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The workspace root (the directory holding the root `Cargo.toml`).
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// Path of a workspace binary such as `prism-head`, found next to the running test
/// executable (`target/<profile>/deps/<test>` → `target/<profile>/<name>`), or in
/// `$PRISM_BIN_DIR` when set. `env!("CARGO_BIN_EXE_…")` only works for binaries of the test's
/// own crate; build the others first (`cargo build -p prism-head -p prism-worker`).
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
