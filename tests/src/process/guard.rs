//! [`ProcessGuard`]: a child process started by the caller (with its own pipes or log
//! file), killed (SIGKILL) and reaped on drop.

use anyhow::{Result, bail};
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
