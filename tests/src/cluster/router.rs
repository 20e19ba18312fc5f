//! [`Router`]: one `prism-router` process of a cluster and where it serves.

use crate::paths::bin_path;
use crate::process::Process;
use crate::wait::free_port;
use anyhow::Result;

/// A `prism-router` on free loopback ports.
#[derive(Debug)]
pub struct Router {
    /// OpenAI HTTP base `http://127.0.0.1:PORT` (the API is under `/v1`; also `/metrics`,
    /// `/readyz`).
    pub http: String,
    /// gRPC URL `http://127.0.0.1:PORT` (`InferenceService`, `grpc.health.v1`).
    pub grpc: String,
    /// The process (signals, restart on the same ports, logs).
    pub process: Process,
}

impl Router {
    /// Starts `prism-router --head HEADS` on two free ports, with `args` added; `heads` is a
    /// comma-separated list of head URLs.
    ///
    /// # Errors
    /// When the binary is missing or cannot be started.
    pub fn spawn(name: &str, heads: &str, args: &[String], envs: &[(String, String)]) -> Result<Self> {
        let (hp, gp) = (free_port()?, free_port()?);
        let mut all = vec![
            "--head".to_owned(),
            heads.to_owned(),
            "--http-listen".to_owned(),
            format!("127.0.0.1:{hp}"),
            "--grpc-listen".to_owned(),
            format!("127.0.0.1:{gp}"),
        ];
        all.extend_from_slice(args);
        let process = Process::spawn(name, &bin_path("prism-router")?, &all, envs)?;
        Ok(Self { http: format!("http://127.0.0.1:{hp}"), grpc: format!("http://127.0.0.1:{gp}"), process })
    }

    /// The router's `/metrics` text.
    ///
    /// # Errors
    /// On transport errors.
    pub async fn metrics(&self) -> Result<String> {
        Ok(reqwest::get(format!("{}/metrics", self.http)).await?.text().await?)
    }
}
