//! [`Head`]: one `prism-head` process of a cluster and its gRPC admin client.

use crate::paths::bin_path;
use crate::process::Process;
use crate::wait::{free_port, poll_until};
use anyhow::Result;
use prism_common::head_auth::{HeadBearer, HeadClient, head_client};
use prism_common::proto::v1::head_service_client::HeadServiceClient;
use prism_common::proto::v1::{ClusterStatusRequest, ClusterStatusResponse, ListNodesRequest};
use std::time::Duration;
use tonic::transport::Channel;

/// A `prism-head` on free loopback ports.
#[derive(Debug)]
pub struct Head {
    /// gRPC URL `http://127.0.0.1:PORT`: what workers, routers and `prism --head` take, and
    /// the address it advertises as leader.
    pub url: String,
    /// HTTP base `http://127.0.0.1:PORT` (`/readyz`, `/metrics`).
    pub http: String,
    /// The process (kill, restart on the same ports, logs).
    pub process: Process,
    /// The admin token [`Head::status`] and [`Head::wait_leader`] present (set by a cluster
    /// started with [`crate::cluster::ClusterBuilder::head_auth`]).
    pub token: Option<String>,
}

impl Head {
    /// Starts `prism-head --store STORE` on two free ports, with `args` added.
    ///
    /// # Errors
    /// When the binary is missing or cannot be started.
    pub fn spawn(name: &str, store: &str, args: &[String], envs: &[(String, String)]) -> Result<Self> {
        let (port, http) = (free_port()?, free_port()?);
        let mut all = vec![
            "--store".to_owned(),
            store.to_owned(),
            "--listen".to_owned(),
            format!("127.0.0.1:{port}"),
            "--http-listen".to_owned(),
            format!("127.0.0.1:{http}"),
        ];
        all.extend_from_slice(args);
        let process = Process::spawn(name, &bin_path("prism-head")?, &all, envs)?;
        Ok(Self {
            url: format!("http://127.0.0.1:{port}"),
            http: format!("http://127.0.0.1:{http}"),
            process,
            token: None,
        })
    }

    /// A connected client that presents no token.
    ///
    /// # Errors
    /// When the head does not accept the connection.
    pub async fn client(&self) -> Result<HeadServiceClient<Channel>> {
        // Mutual TLS when the test installed an identity (`prism_common::tls::install_internal`).
        Ok(HeadServiceClient::new(prism_common::tls::client::channel(Channel::from_shared(self.url.clone())?).await?))
    }

    /// A connected client presenting `token` (none: no `authorization` metadata).
    ///
    /// # Errors
    /// When the token is unusable or the head does not accept the connection.
    pub async fn client_with(&self, token: Option<&str>) -> Result<HeadClient> {
        let bearer = match token {
            Some(t) => HeadBearer::new(t, "test token")?,
            None => HeadBearer::default(),
        };
        Ok(head_client(prism_common::tls::client::channel(Channel::from_shared(self.url.clone())?).await?, bearer))
    }

    /// `ClusterStatus` as this head answers it (asked with [`Head::token`]).
    ///
    /// # Errors
    /// When the head does not answer.
    pub async fn status(&self) -> Result<ClusterStatusResponse> {
        Ok(self.client_with(self.token.as_deref()).await?.cluster_status(ClusterStatusRequest {}).await?.into_inner())
    }

    /// Waits until this head leads and has loaded the state (a leader-only RPC succeeds,
    /// asked with [`Head::token`]), and returns a client to it (that presents no token).
    ///
    /// # Errors
    /// When `timeout` passes first.
    pub async fn wait_leader(&self, timeout: Duration) -> Result<HeadServiceClient<Channel>> {
        poll_until(timeout, "head to lead", || async {
            let mut c = self.client_with(self.token.as_deref()).await.ok()?;
            let s = c.cluster_status(ClusterStatusRequest {}).await.ok()?.into_inner();
            c.list_nodes(ListNodesRequest {}).await.ok()?;
            if !s.is_leader {
                return None;
            }
            self.client().await.ok()
        })
        .await
    }
}
