//! `EtcdFixture`: a real `etcd` (Debian `etcd-server`) on free loopback ports with its data in
//! a temporary directory, polled for health before use and killed on drop: one member
//! ([`EtcdFixture::start`]) or a cluster of several ([`EtcdFixture::start_cluster`], as in
//! production: three). `kill` / `restart` (same ports, same data) act on every member;
//! `kill_member` / `restart_member` on one, to take a member or the quorum away.

use crate::process::ProcessGuard;
use crate::wait::{free_port, wait_until};
use anyhow::{Context, Result, bail};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

/// How long a fresh etcd may take to report healthy.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// Attempts with new ports when a port taken meanwhile makes etcd exit.
const START_ATTEMPTS: usize = 3;

/// One etcd member: its process (while running) and ports.
struct Member {
    name: String,
    process: Option<ProcessGuard>,
    client_port: u16,
    peer_port: u16,
}

/// A running etcd (one member or a cluster) for one test. Dropping it kills etcd and removes
/// its data.
pub struct EtcdFixture {
    members: Vec<Member>,
    dir: tempfile::TempDir,
}

impl EtcdFixture {
    /// Starts a single-member etcd on free loopback ports and waits until `/health` answers
    /// `true`.
    ///
    /// # Errors
    /// When `etcd` is not installed or does not become healthy (the error includes its log).
    pub async fn start() -> Result<Self> {
        Self::start_cluster(1).await
    }

    /// Starts an etcd cluster of `members` members on free loopback ports and waits until
    /// every member reports healthy.
    ///
    /// # Errors
    /// When `etcd` is not installed or the cluster does not become healthy.
    pub async fn start_cluster(members: usize) -> Result<Self> {
        let mut last_err = None;
        for _ in 0..START_ATTEMPTS {
            let dir = tempfile::Builder::new().prefix("prism-etcd-").tempdir()?;
            let mut list = Vec::new();
            for i in 0..members.max(1) {
                let name = if members <= 1 { "prism-test".to_owned() } else { format!("prism-test-{i}") };
                list.push(Member { name, process: None, client_port: free_port()?, peer_port: free_port()? });
            }
            let mut fixture = Self { members: list, dir };
            let all: Vec<usize> = (0..fixture.members.len()).collect();
            match fixture.launch(&all).await {
                Ok(()) => return Ok(fixture),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("etcd did not start")))
    }

    /// The first member's client endpoint `127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.members[0].client_port)
    }

    /// The first member's client URL `http://127.0.0.1:PORT` (what `etcdctl --endpoints` takes).
    pub fn client_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.members[0].client_port)
    }

    /// Every member's client endpoint (what `EtcdStore::connect` and `--store etcd://A,B,C` take).
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| format!("127.0.0.1:{}", m.client_port)).collect()
    }

    /// Number of members.
    pub fn member_count(&self) -> usize {
        self.members.len()
    }

    /// The data directory (each member's data is in `data-<name>` under it).
    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The first member's process id while it runs (to freeze it with SIGSTOP, say).
    pub fn pid(&self) -> Option<u32> {
        self.members[0].process.as_ref().and_then(ProcessGuard::pid)
    }

    /// Kills every member with SIGKILL (data stays for [`EtcdFixture::restart`]).
    pub fn kill(&mut self) {
        for i in 0..self.members.len() {
            self.kill_member(i);
        }
    }

    /// Kills member `i` with SIGKILL (data stays for [`EtcdFixture::restart_member`]).
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut p) = self.members.get_mut(i).and_then(|m| m.process.take()) {
            p.kill();
        }
    }

    /// Starts every member again on the same ports and data, and waits until healthy.
    ///
    /// # Errors
    /// When it does not become healthy.
    pub async fn restart(&mut self) -> Result<()> {
        self.kill();
        let all: Vec<usize> = (0..self.members.len()).collect();
        self.launch(&all).await
    }

    /// Starts member `i` again on its ports and data, and waits until it is healthy (it rejoins
    /// the cluster).
    ///
    /// # Errors
    /// When it does not become healthy.
    pub async fn restart_member(&mut self, i: usize) -> Result<()> {
        self.kill_member(i);
        self.launch(&[i]).await
    }

    /// etcd's log so far (every member's stdout + stderr), for failure messages.
    pub fn log(&self) -> String {
        self.members
            .iter()
            .map(|m| {
                let log = std::fs::read_to_string(self.log_path(m)).unwrap_or_default();
                if self.members.len() == 1 { log } else { format!("--- {} ---\n{log}", m.name) }
            })
            .collect()
    }

    fn log_path(&self, m: &Member) -> PathBuf {
        if self.members.len() == 1 {
            self.dir.path().join("etcd.log")
        } else {
            self.dir.path().join(format!("{}.log", m.name))
        }
    }

    fn initial_cluster(&self) -> String {
        self.members
            .iter()
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Spawns members `which` (all at once: a cluster member waits for its peers), then waits
    /// until each is healthy.
    async fn launch(&mut self, which: &[usize]) -> Result<()> {
        let initial = self.initial_cluster();
        for &i in which {
            let m = &self.members[i];
            let client = format!("http://127.0.0.1:{}", m.client_port);
            let peer = format!("http://127.0.0.1:{}", m.peer_port);
            let data = if self.members.len() == 1 {
                self.dir.path().join("data")
            } else {
                self.dir.path().join(format!("data-{}", m.name))
            };
            // A restart appends to the same log.
            let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path(m))?;
            let child = Command::new("etcd")
                .arg(format!("--name={}", m.name))
                .arg(format!("--data-dir={}", data.display()))
                .arg(format!("--listen-client-urls={client}"))
                .arg(format!("--advertise-client-urls={client}"))
                .arg(format!("--listen-peer-urls={peer}"))
                .arg(format!("--initial-advertise-peer-urls={peer}"))
                .arg(format!("--initial-cluster={initial}"))
                .arg("--initial-cluster-state=new")
                .arg("--initial-cluster-token=prism-test")
                .arg("--logger=zap")
                .arg("--log-level=warn")
                .stdin(Stdio::null())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()
                .context("spawning etcd (Debian package etcd-server)")?;
            self.members[i].process = Some(ProcessGuard::new(self.members[i].name.clone(), child));
        }
        for &i in which {
            let port = self.members[i].client_port;
            let mut exited = None;
            let ready = wait_until(READY_TIMEOUT, "etcd /health", || {
                if let Some(p) = self.members[i].process.as_mut()
                    && let Ok(Some(status)) = p.try_wait()
                {
                    exited = Some(status);
                    return std::future::ready(true);
                }
                std::future::ready(healthy(port))
            })
            .await;
            if let Some(status) = exited {
                self.members[i].process = None;
                bail!("etcd {} exited with {status} during start; log:\n{}", self.members[i].name, self.log());
            }
            if let Err(e) = ready {
                for &j in which {
                    self.kill_member(j);
                }
                bail!("{e}; etcd log:\n{}", self.log());
            }
        }
        Ok(())
    }
}

/// One plain HTTP/1.0 `GET /health` (etcd 3.4 answers `{"health":"true"}`).
fn healthy(port: u16) -> bool {
    let probe = || -> std::io::Result<String> {
        let mut s = TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_millis(500)))?;
        s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")?;
        let mut body = String::new();
        s.read_to_string(&mut body)?;
        Ok(body)
    };
    probe().is_ok_and(|b| b.contains("\"health\":\"true\""))
}
