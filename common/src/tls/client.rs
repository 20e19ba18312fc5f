//! Client side: a tonic connector that opens TCP and runs the TLS handshake with the
//! identity's current client configuration, so every new connection (first connect and
//! every reconnect) uses the latest rotated material; or, toward a server-only public
//! listener, with a fixed configuration that trusts the system roots and an optional CA.
//!
//! With TLS on, the connection is TLS whatever the URI's scheme: `http://` addresses
//! published by an older peer, or typed by hand, do not downgrade the connection. The server
//! name checked against the certificate is the URI's host (a DNS name or an IP address), or
//! `--tls-server-name` when set (Kubernetes: addresses are pod IPs, certificates carry a
//! shared internal name).

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use hyper_util::rt::TokioIo;
use rustls::ClientConfig;
use rustls::pki_types::ServerName;
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint};

use super::Tls;

/// Connects with TLS: mutual, with a [`Tls`] identity's client configuration (reloaded), or
/// server-only, with a fixed configuration ([`TlsConnector::verifying`]).
#[derive(Clone, Debug)]
pub struct TlsConnector {
    source: Source,
}

#[derive(Clone, Debug)]
enum Source {
    /// The identity's current client configuration and server name.
    Identity(Arc<Tls>),
    /// A configuration without a client certificate; the server name is the dialled host.
    Fixed(Arc<ClientConfig>),
}

impl TlsConnector {
    /// A connector for `tls` (which must have a CA: a client verifies its server).
    pub fn new(tls: Arc<Tls>) -> Self {
        Self { source: Source::Identity(tls) }
    }

    /// A connector that verifies servers with `config` and presents no certificate (a
    /// public listener, e.g. the router's with `--public-tls-cert`; see
    /// [`super::server_only_client_config`]).
    pub fn verifying(config: Arc<ClientConfig>) -> Self {
        Self { source: Source::Fixed(config) }
    }
}

type Connecting = Pin<Box<dyn Future<Output = io::Result<TokioIo<tokio_rustls::client::TlsStream<TcpStream>>>> + Send>>;

impl tower_service::Service<http::Uri> for TlsConnector {
    type Response = TokioIo<tokio_rustls::client::TlsStream<TcpStream>>;
    type Error = io::Error;
    type Future = Connecting;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), io::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: http::Uri) -> Connecting {
        let (config, server_name) = match &self.source {
            Source::Identity(tls) => (tls.client_config(), tls.server_name().map(str::to_owned)),
            Source::Fixed(config) => (Some(Arc::clone(config)), None),
        };
        Box::pin(async move {
            let config = config.ok_or_else(|| io::Error::other("TLS identity has no CA: cannot verify a server"))?;
            let host = uri
                .host()
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("no host in {uri}")))?
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned();
            let port = uri.port_u16().unwrap_or(if uri.scheme_str() == Some("https") { 443 } else { 80 });
            let checked = server_name.unwrap_or_else(|| host.clone());
            let name = ServerName::try_from(checked.clone())
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("server name {checked:?}: {e}")))?;
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let tls = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await?;
            Ok(TokioIo::new(tls))
        })
    }
}

/// Connects `endpoint` now: with the process's internal identity when one is installed
/// ([`super::install_internal`]), else plaintext as `Endpoint::connect`.
///
/// # Errors
/// The connection or the handshake fails.
pub async fn channel(endpoint: Endpoint) -> Result<Channel, tonic::transport::Error> {
    match super::internal() {
        Some(tls) => endpoint.connect_with_connector(TlsConnector::new(tls)).await,
        None => endpoint.connect().await,
    }
}

/// As [`channel`], connecting on first use (`Endpoint::connect_lazy`).
pub fn channel_lazy(endpoint: Endpoint) -> Channel {
    match super::internal() {
        Some(tls) => endpoint.connect_with_connector_lazy(TlsConnector::new(tls)),
        None => endpoint.connect_lazy(),
    }
}

/// The scheme of internal addresses this process publishes: `https` with TLS on.
pub fn scheme() -> &'static str {
    if super::internal().is_some() { "https" } else { "http" }
}
