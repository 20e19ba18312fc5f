//! [`Worker`]: one `prism-worker` process of a cluster (a node), where it serves, and its
//! metrics and readiness.

use crate::paths::bin_path;
use crate::process::Process;
use crate::wait::{eventually, free_port};
use anyhow::Result;
use std::time::Duration;

/// A `prism-worker` on free loopback ports.
#[derive(Debug)]
pub struct Worker {
    /// Node id (`w1`, `w2`, … unless named).
    pub node: String,
    /// gRPC endpoint `http://127.0.0.1:PORT` (`WorkerService`, `grpc.health.v1`).
    pub grpc: String,
    /// HTTP base `http://127.0.0.1:PORT` (`/metrics`, `/readyz`, `/debug/…`).
    pub http: String,
    /// The process (signals, restart with the same node id and ports, logs).
    pub process: Process,
}

impl Worker {
    /// Starts `prism-worker --head HEADS --node-id NODE` on two free ports, with `args`
    /// added; `heads` is a comma-separated list of head URLs.
    ///
    /// # Errors
    /// When the binary is missing or cannot be started.
    pub fn spawn(node: &str, heads: &str, args: &[String], envs: &[(String, String)]) -> Result<Self> {
        let (gp, hp) = (free_port()?, free_port()?);
        let mut all = vec![
            "--head".to_owned(),
            heads.to_owned(),
            "--node-id".to_owned(),
            node.to_owned(),
            "--listen".to_owned(),
            format!("127.0.0.1:{gp}"),
            "--http-listen".to_owned(),
            format!("127.0.0.1:{hp}"),
        ];
        all.extend_from_slice(args);
        let process = Process::spawn(node, &bin_path("prism-worker")?, &all, envs)?;
        Ok(Self {
            node: node.to_owned(),
            grpc: format!("http://127.0.0.1:{gp}"),
            http: format!("http://127.0.0.1:{hp}"),
            process,
        })
    }

    /// The worker's `/metrics` text (vLLM metric names).
    ///
    /// # Errors
    /// On transport errors.
    pub async fn metrics(&self) -> Result<String> {
        Ok(reqwest::get(format!("{}/metrics", self.http)).await?.text().await?)
    }

    /// Waits until `/readyz` answers 200 (registered, not draining, every hosted replica
    /// Ready).
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<()> {
        let url = format!("{}/readyz", self.http);
        eventually(timeout, "worker /readyz", || {
            let url = url.clone();
            async move { Ok(reqwest::get(url).await?.status().is_success().then_some(())) }
        })
        .await
    }
}
