//! [`Process`]: a program run as a child of the test (a Prism binary, usually) with its stdout
//! lines readable as they come, its stderr kept (the last 128–256 KiB) for failure messages,
//! signals (SIGTERM, SIGSTOP / SIGCONT, SIGKILL), an exit polled against a deadline, and a
//! restart with the same command line. Dropping it kills the child (SIGKILL) and reaps it.

use crate::paths::workspace_root;
use anyhow::{Context, Result, bail};
use nix::sys::signal::Signal;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tokio::time::Instant;

/// Kept stderr grows to this many bytes before the oldest part is dropped …
const LOG_LIMIT: usize = 256 * 1024;
/// … down to this many.
const LOG_KEEP: usize = 128 * 1024;
/// Pause between two polls of the child's state.
const POLL: Duration = Duration::from_millis(20);

/// What to run, kept for restarts.
#[derive(Clone, Debug)]
struct Spec {
    name: String,
    program: PathBuf,
    args: Vec<String>,
    envs: Vec<(String, String)>,
}

/// Where the reader threads put the child's output (shared by every run of one [`Process`]).
#[derive(Clone, Debug)]
struct Sinks {
    lines: UnboundedSender<String>,
    log: Arc<Mutex<String>>,
}

/// Whether the current run's stdout / stderr pipes are still open (cleared at end of file).
#[derive(Debug)]
struct Pipes {
    stdout_open: Arc<AtomicBool>,
    stderr_open: Arc<AtomicBool>,
}

/// A child process of the test; see the module documentation.
#[derive(Debug)]
pub struct Process {
    spec: Spec,
    sinks: Sinks,
    lines: UnboundedReceiver<String>,
    child: Child,
    pipes: Pipes,
    /// Set once the child has been reaped: its pid may then belong to another process.
    exit: Option<ExitStatus>,
}

impl Process {
    /// Starts `program args` in the workspace root with `envs` added to the environment,
    /// stdin closed, stdout and stderr piped. `name` is used in messages.
    ///
    /// # Errors
    /// When the process cannot be started.
    pub fn spawn(name: &str, program: &Path, args: &[String], envs: &[(String, String)]) -> Result<Self> {
        let spec =
            Spec { name: name.to_owned(), program: program.to_path_buf(), args: args.to_vec(), envs: envs.to_vec() };
        let (tx, lines) = unbounded_channel();
        let sinks = Sinks { lines: tx, log: Arc::new(Mutex::new(String::new())) };
        let (child, pipes) = launch(&spec, &sinks)?;
        Ok(Self { spec, sinks, lines, child, pipes, exit: None })
    }

    /// The name given at start.
    pub fn name(&self) -> &str {
        &self.spec.name
    }

    /// The arguments it runs with.
    pub fn args(&self) -> &[String] {
        &self.spec.args
    }

    /// The process id of the current run.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// What the process wrote to stderr so far, over every run (the last 128–256 KiB).
    pub fn stderr(&self) -> String {
        self.sinks.log.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// The last `max` bytes (or a little less, at a character boundary) of [`Process::stderr`].
    pub fn stderr_tail(&self, max: usize) -> String {
        let s = self.stderr();
        let cut = s.len().saturating_sub(max);
        let cut = (cut..s.len()).find(|i| s.is_char_boundary(*i)).unwrap_or(s.len());
        s[cut..].to_owned()
    }

    /// Reads stdout lines until `pred` matches one (returned) or `timeout` passes.
    ///
    /// # Errors
    /// On timeout, or when the process closes its stdout first; stdout and stderr are in
    /// the message.
    pub async fn wait_for_line(&mut self, timeout: Duration, pred: impl Fn(&str) -> bool) -> Result<String> {
        let deadline = Instant::now() + timeout;
        let mut seen = Vec::new();
        loop {
            match tokio::time::timeout(POLL * 5, self.lines.recv()).await {
                Ok(Some(line)) => {
                    if pred(&line) {
                        return Ok(line);
                    }
                    seen.push(line);
                    continue;
                }
                Ok(None) => bail!("{}: stdout channel closed", self.spec.name),
                Err(_) => {}
            }
            let closed = !self.pipes.stdout_open.load(Ordering::SeqCst) && self.lines.is_empty();
            if closed || Instant::now() >= deadline {
                let status = self.try_exit().ok().flatten();
                let why = if closed { "stdout closed" } else { "timed out" };
                bail!(
                    "{}: no expected line ({why} after {timeout:?}; exit {status:?}); stdout:\n{}\nstderr:\n{}",
                    self.spec.name,
                    seen.join("\n"),
                    self.stderr()
                );
            }
        }
    }

    /// Stdout lines printed since the last read (does not block).
    pub fn drain_stdout(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(line) = self.lines.try_recv() {
            out.push(line);
        }
        out
    }

    /// Whether the current run has exited, and how (does not block; reaps the child).
    ///
    /// # Errors
    /// When the status cannot be queried.
    pub fn try_exit(&mut self) -> Result<Option<ExitStatus>> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait()?;
        }
        Ok(self.exit)
    }

    /// Whether the current run has exited.
    pub fn exited(&mut self) -> bool {
        matches!(self.try_exit(), Ok(Some(_)))
    }

    /// Sends `signal` to the current run.
    ///
    /// # Errors
    /// When it has already exited (and been reaped) or the signal cannot be delivered.
    pub fn signal(&self, signal: Signal) -> Result<()> {
        if let Some(status) = self.exit {
            bail!("{} already exited ({status}): no {signal} sent", self.spec.name);
        }
        let pid = nix::unistd::Pid::from_raw(i32::try_from(self.child.id())?);
        nix::sys::signal::kill(pid, signal).with_context(|| format!("kill -{signal} {}", self.spec.name))
    }

    /// SIGTERM: the graceful stop a pod deletion or spot preemption sends.
    ///
    /// # Errors
    /// As [`Process::signal`].
    pub fn terminate(&self) -> Result<()> {
        self.signal(Signal::SIGTERM)
    }

    /// SIGSTOP: freezes the process (it keeps its sockets but answers nothing).
    ///
    /// # Errors
    /// As [`Process::signal`].
    pub fn freeze(&self) -> Result<()> {
        self.signal(Signal::SIGSTOP)
    }

    /// SIGCONT: resumes a frozen process.
    ///
    /// # Errors
    /// As [`Process::signal`].
    pub fn thaw(&self) -> Result<()> {
        self.signal(Signal::SIGCONT)
    }

    /// SIGKILL (`kill -9`, also of a frozen process) and reap. Idempotent.
    pub fn kill(&mut self) {
        if self.exit.is_none() {
            // Fails only when it already exited; the wait below reaps it either way.
            let _ = self.child.kill();
            self.exit = self.child.wait().ok();
        }
    }

    /// Waits for the current run to exit, polling, at most `limit`.
    ///
    /// # Errors
    /// When it is still running after `limit` (stderr in the message).
    pub async fn wait_exit(&mut self, limit: Duration) -> Result<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.try_exit()? {
                return Ok(status);
            }
            if Instant::now() > deadline {
                bail!("{} still running after {limit:?}; stderr:\n{}", self.spec.name, self.stderr());
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until the current run's stderr is closed (read to its end), at most `limit`:
    /// after an exit, [`Process::stderr`] then holds everything it wrote.
    ///
    /// # Errors
    /// When the pipe is still open after `limit` (a descendant may hold it).
    pub async fn wait_stderr_closed(&self, limit: Duration) -> Result<()> {
        let open = self.pipes.stderr_open.clone();
        crate::wait::wait_until(limit, "stderr closed", move || std::future::ready(!open.load(Ordering::SeqCst))).await
    }

    /// Starts the program again with the same arguments and environment (same ports, same
    /// node id …) once the current run has exited; its stderr is appended to the same log.
    ///
    /// # Errors
    /// When the current run is still going or the program cannot be started.
    pub fn restart(&mut self) -> Result<()> {
        if !self.exited() {
            bail!("{} is still running", self.spec.name);
        }
        if let Ok(mut log) = self.sinks.log.lock() {
            log.push_str(&format!("--- {} restarted ---\n", self.spec.name));
        }
        let (child, pipes) = launch(&self.spec, &self.sinks)?;
        self.child = child;
        self.pipes = pipes;
        self.exit = None;
        Ok(())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Starts one run of `spec` and the threads that read its pipes into `sinks`.
fn launch(spec: &Spec, sinks: &Sinks) -> Result<(Child, Pipes)> {
    let mut cmd = Command::new(&spec.program);
    cmd.args(&spec.args).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.current_dir(workspace_root());
    for (k, v) in &spec.envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().with_context(|| format!("cannot start {}", spec.program.display()))?;
    let pipes = Pipes { stdout_open: Arc::new(AtomicBool::new(true)), stderr_open: Arc::new(AtomicBool::new(true)) };
    let out = child.stdout.take().context("stdout")?;
    let (tx, open) = (sinks.lines.clone(), pipes.stdout_open.clone());
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
        open.store(false, Ordering::SeqCst);
    });
    let err = child.stderr.take().context("stderr")?;
    let (log, open) = (sinks.log.clone(), pipes.stderr_open.clone());
    std::thread::spawn(move || {
        append_lines(err, &log);
        open.store(false, Ordering::SeqCst);
    });
    Ok((child, pipes))
}

/// Appends every line of `pipe` to `log`, dropping the oldest part past [`LOG_LIMIT`].
fn append_lines(pipe: impl Read, log: &Mutex<String>) {
    for line in BufReader::new(pipe).lines().map_while(Result::ok) {
        if let Ok(mut s) = log.lock() {
            if s.len() > LOG_LIMIT {
                let cut = s.len() - LOG_KEEP;
                let cut = (cut..s.len()).find(|i| s.is_char_boundary(*i)).unwrap_or(0);
                s.drain(..cut);
            }
            s.push_str(&line);
            s.push('\n');
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Result<Process> {
        Process::spawn("sh", Path::new("/bin/sh"), &["-c".to_owned(), script.to_owned()], &[])
    }

    #[tokio::test]
    async fn reads_lines_and_keeps_stderr_across_a_restart() -> Result<()> {
        let mut p = sh("echo starting; echo ready; echo oops >&2; exit 3")?;
        assert_eq!(p.wait_for_line(Duration::from_secs(10), |l| l == "ready").await?, "ready");
        let status = p.wait_exit(Duration::from_secs(10)).await?;
        assert_eq!(status.code(), Some(3));
        p.wait_stderr_closed(Duration::from_secs(10)).await?;
        assert_eq!(p.stderr(), "oops\n");
        assert!(p.signal(Signal::SIGTERM).is_err(), "no signal to a reaped pid");
        p.restart()?;
        p.wait_exit(Duration::from_secs(10)).await?;
        p.wait_stderr_closed(Duration::from_secs(10)).await?;
        assert_eq!(p.stderr(), "oops\n--- sh restarted ---\noops\n");
        assert!(p.stderr_tail(5).ends_with("oops\n"));
        Ok(())
    }

    #[tokio::test]
    async fn freeze_thaw_terminate_and_kill() -> Result<()> {
        let mut p = sh("trap 'exit 0' TERM; echo up; while :; do sleep 0.05; done")?;
        p.wait_for_line(Duration::from_secs(10), |l| l == "up").await?;
        assert!(p.restart().is_err(), "a running process is not restarted");
        p.freeze()?;
        p.thaw()?;
        p.terminate()?;
        assert!(p.wait_exit(Duration::from_secs(10)).await?.success());
        p.restart()?;
        p.wait_for_line(Duration::from_secs(10), |l| l == "up").await?;
        p.freeze()?;
        p.kill();
        assert!(p.exited());
        Ok(())
    }

    #[tokio::test]
    async fn a_line_that_never_comes_fails_when_stdout_closes() -> Result<()> {
        let mut p = sh("echo something else")?;
        let err = p.wait_for_line(Duration::from_secs(30), |l| l == "never").await;
        assert!(err.is_err());
        Ok(())
    }
}
