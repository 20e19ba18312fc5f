//! `EtcdFixture`: a real single-member `etcd` (Debian `etcd-server`) on free loopback ports
//! with its data in a temporary directory, polled for health before use and killed on drop.
//! `kill` / `restart` (same ports, same data) let tests exercise reconnection.

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

/// A running etcd for one test. Dropping it kills etcd and removes its data.
pub struct EtcdFixture {
    process: Option<ProcessGuard>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
}

impl EtcdFixture {
    /// Starts etcd on free loopback ports and waits until `/health` answers `true`.
    ///
    /// # Errors
    /// When `etcd` is not installed or does not become healthy (the error includes its log).
    pub async fn start() -> Result<Self> {
        let mut last_err = None;
        for _ in 0..START_ATTEMPTS {
            let dir = tempfile::Builder::new().prefix("prism-etcd-").tempdir()?;
            let mut fixture = Self { process: None, dir, client_port: free_port()?, peer_port: free_port()? };
            match fixture.launch().await {
                Ok(()) => return Ok(fixture),
                Err(e) => last_err = Some(e),
            }
        }
        Err(last_err.unwrap_or_else(|| anyhow::anyhow!("etcd did not start")))
    }

    /// Client endpoint `127.0.0.1:PORT` (what `EtcdStore::connect` and `--store etcd://` take).
    pub fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    /// Client URL `http://127.0.0.1:PORT` (what `etcdctl --endpoints` takes).
    pub fn client_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The endpoints as a list.
    pub fn endpoints(&self) -> Vec<String> {
        vec![self.endpoint()]
    }

    /// The data directory.
    pub fn data_dir(&self) -> &Path {
        self.dir.path()
    }

    /// The etcd process id while it runs (to freeze it with SIGSTOP, say).
    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(ProcessGuard::pid)
    }

    /// Kills etcd with SIGKILL (data stays for [`EtcdFixture::restart`]).
    pub fn kill(&mut self) {
        if let Some(mut p) = self.process.take() {
            p.kill();
        }
    }

    /// Starts etcd again on the same ports and data directory, and waits until healthy.
    ///
    /// # Errors
    /// When it does not become healthy.
    pub async fn restart(&mut self) -> Result<()> {
        self.kill();
        self.launch().await
    }

    /// etcd's log so far (stdout + stderr), for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("etcd.log")
    }

    async fn launch(&mut self) -> Result<()> {
        let client = self.client_url();
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let data = self.dir.path().join("data");
        // A restart appends to the same log.
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log_path())?;
        let child = Command::new("etcd")
            .arg("--name=prism-test")
            .arg(format!("--data-dir={}", data.display()))
            .arg(format!("--listen-client-urls={client}"))
            .arg(format!("--advertise-client-urls={client}"))
            .arg(format!("--listen-peer-urls={peer}"))
            .arg(format!("--initial-advertise-peer-urls={peer}"))
            .arg(format!("--initial-cluster=prism-test={peer}"))
            .arg("--initial-cluster-state=new")
            .arg("--logger=zap")
            .arg("--log-level=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("spawning etcd (Debian package etcd-server)")?;
        self.process = Some(ProcessGuard::new("etcd", child));
        let port = self.client_port;
        let mut exited = None;
        let ready = wait_until(READY_TIMEOUT, "etcd /health", || {
            if let Some(p) = self.process.as_mut()
                && let Ok(Some(status)) = p.try_wait()
            {
                exited = Some(status);
                return std::future::ready(true);
            }
            std::future::ready(healthy(port))
        })
        .await;
        if let Some(status) = exited {
            self.process = None;
            bail!("etcd exited with {status} during start; log:\n{}", self.log());
        }
        if let Err(e) = ready {
            self.kill();
            bail!("{e}; etcd log:\n{}", self.log());
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
