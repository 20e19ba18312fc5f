//! Starting rank processes and keeping them tied to their parent: a rank is killed when its
//! [`RankProcess`] is dropped, and (Linux) when the process that started it dies
//! (`PR_SET_PDEATHSIG`), so no rank outlives its agent holding device memory.

use std::path::PathBuf;

use super::rank::RankSpec;

/// The program a rank process runs: any Prism binary (each calls
/// [`super::rank::main_from_env`] first), by default the running one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankProgram {
    /// Executable.
    pub program: PathBuf,
    /// Arguments (none are needed: the spec travels in the environment).
    pub args: Vec<String>,
}

impl RankProgram {
    /// The running executable.
    ///
    /// # Errors
    /// When the executable's path cannot be read.
    pub fn current_exe() -> std::io::Result<Self> {
        Ok(Self { program: std::env::current_exe()?, args: Vec::new() })
    }
}

/// A running rank process; dropping it kills and reaps it.
#[derive(Debug)]
pub struct RankProcess {
    /// Global rank.
    pub rank: usize,
    child: std::process::Child,
}

impl RankProcess {
    /// Process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The exit status once it has exited.
    ///
    /// # Errors
    /// The wait's I/O error.
    pub fn try_wait(&mut self) -> std::io::Result<Option<std::process::ExitStatus>> {
        self.child.try_wait()
    }

    /// Kills (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for RankProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts a rank process of `program` with `spec`.
///
/// # Errors
/// The spawn's I/O error.
pub fn spawn_rank(program: &RankProgram, spec: &RankSpec) -> std::io::Result<RankProcess> {
    let json = serde_json::to_string(spec).map_err(std::io::Error::other)?;
    let child = std::process::Command::new(&program.program)
        .args(&program.args)
        .env(super::rank::RANK_SPEC_ENV, json)
        .spawn()?;
    Ok(RankProcess { rank: spec.rank, child })
}
