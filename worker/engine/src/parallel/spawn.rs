//! Starting rank processes and keeping them tied to their parent: a rank is killed when its
//! [`RankProcess`] is dropped, and (Linux) when the process that started it dies
//! (`PR_SET_PDEATHSIG`), so no rank outlives its agent holding device memory.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that forked the child exits, not the process.
//! The driver starts ranks from short-lived threads (tokio's blocking pool), so every spawn
//! goes through one process-wide spawner thread, started on first use and never ended: its
//! exit is the process's exit. Each rank also gets a process group of its own, so a SIGINT
//! or SIGTERM sent to the terminal's foreground group (Ctrl-C on the agent) reaches the agent
//! alone; the agent decides when its ranks stop, and they die with it in any case.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

use super::rank::RankSpec;

/// The program a rank process runs: a rank program (`prism-worker`, `prism` or `prism-rank`; each calls
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
    child: Child,
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

/// Starts a rank process of `program` with `spec`, from the process-wide spawner thread (see
/// the module's header), in a process group of its own, killed when this process dies.
///
/// # Errors
/// The spawn's I/O error.
pub fn spawn_rank(program: &RankProgram, spec: &RankSpec) -> std::io::Result<RankProcess> {
    let json = serde_json::to_string(spec).map_err(std::io::Error::other)?;
    let mut command = Command::new(&program.program);
    command.args(&program.args).env(super::rank::RANK_SPEC_ENV, json);
    let child = spawn_tied(command)?;
    Ok(RankProcess { rank: spec.rank, child })
}

type SpawnRequest = (Command, mpsc::SyncSender<std::io::Result<Child>>);

/// Spawns `command` on the spawner thread (started on first use).
fn spawn_tied(command: Command) -> std::io::Result<Child> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<SpawnRequest>>> = OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<SpawnRequest>();
        // The thread holds the receiver and the static the sender, so it runs as long as the
        // process: the rank processes' parent-death signal fires only when the process exits.
        std::thread::Builder::new()
            .name("prism-rank-spawner".into())
            .spawn(move || {
                for (command, reply) in rx {
                    let _ = reply.send(spawn_here(command));
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| tracing::error!(error = %e, "cannot start the rank spawner thread"));
        Mutex::new(tx)
    });
    let (reply_tx, reply_rx) = mpsc::sync_channel(1);
    let gone = || std::io::Error::other("the rank spawner thread is not running");
    spawner.lock().map_err(|_| gone())?.send((command, reply_tx)).map_err(|_| gone())?;
    reply_rx.recv().map_err(|_| gone())?
}

/// Spawns on the calling thread (the spawner thread): own process group; on Linux SIGKILL
/// when this thread (the process, as the spawner never exits) dies.
fn spawn_here(mut command: Command) -> std::io::Result<Child> {
    use std::os::unix::process::CommandExt;
    command.process_group(0);
    #[cfg(target_os = "linux")]
    {
        let parent = std::process::id();
        // SAFETY: the closure runs in the forked child before exec and only makes two system
        // calls (prctl, getppid); it allocates nothing and takes no lock.
        unsafe {
            command.pre_exec(move || {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL).map_err(std::io::Error::from)?;
                // The parent may have died between fork and prctl: then no signal will come.
                if nix::unistd::getppid().as_raw().cast_unsigned() != parent {
                    return Err(std::io::Error::other("the parent exited while the rank started"));
                }
                Ok(())
            });
        }
    }
    command.spawn()
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    fn sleeper() -> RankProgram {
        RankProgram { program: "sleep".into(), args: vec!["30".into()] }
    }

    fn spec(rank: usize) -> RankSpec {
        RankSpec {
            rendezvous: "127.0.0.1:1".into(),
            token: "t".into(),
            rank,
            device: None,
            bind_ip: None,
            advertise_host: "127.0.0.1".into(),
            engine_threads: None,
        }
    }

    /// Whether `pid` is a live process (a zombie counts as dead).
    fn alive(pid: u32) -> bool {
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            // The state follows the parenthesised command name.
            Ok(stat) => stat.rsplit_once(')').is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
            Err(_) => false,
        }
    }

    fn wait_dead(pid: u32, within: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < within {
            if !alive(pid) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn a_rank_started_from_a_thread_that_exits_lives_until_dropped() {
        let mut rank = std::thread::spawn(|| spawn_rank(&sleeper(), &spec(1)))
            .join()
            .expect("spawning thread")
            .expect("spawn sleep");
        let pid = rank.pid();
        std::thread::sleep(Duration::from_millis(300));
        assert!(rank.try_wait().expect("try_wait").is_none(), "the rank died with the thread that asked for it");
        assert!(alive(pid));
        let group = nix::unistd::getpgid(Some(nix::unistd::Pid::from_raw(pid.cast_signed()))).expect("getpgid");
        assert_eq!(group.as_raw().cast_unsigned(), pid, "the rank leads a process group of its own");
        drop(rank);
        assert!(!alive(pid), "dropping the rank kills and reaps it");
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists(), "reaped, not a zombie");
    }

    const PID_FILE_ENV: &str = "PRISM_TEST_RANK_PID_FILE";

    /// Runs this test binary again as the parent of a rank; that parent exits without dropping
    /// the rank, and the rank must die with it.
    #[test]
    fn a_rank_dies_with_its_parent_process() {
        if let Some(path) = std::env::var_os(PID_FILE_ENV) {
            // The intermediate parent: spawn from a short-lived thread, then exit at once
            // (`exit` runs no destructors, so only the parent-death signal can kill the rank).
            let rank = std::thread::spawn(|| spawn_rank(&sleeper(), &spec(1))).join().expect("thread").expect("spawn");
            std::fs::write(path, rank.pid().to_string()).expect("write pid");
            std::process::exit(0);
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let pid_file = dir.path().join("pid");
        let status = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args(["--exact", "parallel::spawn::tests::a_rank_dies_with_its_parent_process", "--test-threads=1"])
            .env(PID_FILE_ENV, &pid_file)
            .stdout(std::process::Stdio::null())
            .status()
            .expect("run the intermediate parent");
        assert!(status.success(), "intermediate parent: {status}");
        let pid: u32 = std::fs::read_to_string(&pid_file).expect("pid file").trim().parse().expect("pid");
        assert!(wait_dead(pid, Duration::from_secs(3)), "rank {pid} outlived its parent");
    }
}
