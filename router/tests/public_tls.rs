//! The router's public listeners with `--public-tls-cert/--public-tls-key`: the real router
//! (`prism_router::run`) in front of a mock engine, a certificate made here (rcgen). An HTTPS
//! completion succeeds over HTTP/1.1 (ALPN), the gRPC port negotiates h2 over TLS, and a
//! plaintext request to the TLS port gets no HTTP answer.

use std::sync::Arc;
use std::time::Duration;

use prism_common::tls::{Tls, TlsFiles};
use prism_router::config::{RouterConfig, StaticRoute};
use prism_router::mock_engine::{MockBehavior, MockEngineWorker};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

async fn handshake(
    addr: std::net::SocketAddr,
    roots: &rustls::RootCertStore,
    alpn: &[u8],
) -> anyhow::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots.clone())
        .with_no_client_auth();
    cfg.alpn_protocols = vec![alpn.to_vec()];
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    Ok(tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(ServerName::try_from("localhost")?, tcp).await?)
}

#[tokio::test]
async fn https_completion_and_grpc_over_tls_on_the_public_listeners() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate()?;
    let ca = ca.self_signed(&ca_key)?;
    let key = KeyPair::generate()?;
    let leaf = CertificateParams::new(vec!["localhost".to_owned()])?.signed_by(&key, &ca, &ca_key)?;
    std::fs::write(dir.path().join("tls.crt"), leaf.pem())?;
    std::fs::write(dir.path().join("tls.key"), key.serialize_pem())?;
    let files = TlsFiles { cert: dir.path().join("tls.crt"), key: dir.path().join("tls.key"), ca: None };
    let public = Tls::load_with_alpn(files, Duration::from_secs(5), true)?;
    assert!(public.client_config().is_none(), "a server-only identity");

    let shutdown = CancellationToken::new();
    let mock = MockEngineWorker::new(MockBehavior::default());
    let engine = mock.clone().spawn(shutdown.clone()).await?;
    let cfg = RouterConfig {
        static_routes: vec![StaticRoute { model: "mock".into(), endpoint: format!("http://{engine}") }],
        public_tls: Some(public),
        ..Default::default()
    };
    let h = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let g = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let (http, grpc) = (h.local_addr()?, g.local_addr()?);
    tokio::spawn(prism_router::run(cfg, h, g, shutdown.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.der().clone())?;
    let mut s = handshake(http, &roots, b"http/1.1").await?;
    assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let body = r#"{"model":"mock","prompt":"hi","max_tokens":1}"#;
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).await?;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("\"choices\""), "{answer}");

    let g = handshake(grpc, &roots, b"h2").await?;
    assert_eq!(g.get_ref().1.alpn_protocol(), Some(&b"h2"[..]), "gRPC listener speaks h2 over TLS");

    // Plaintext HTTP to the TLS port: no HTTP answer (the handshake fails).
    let plain = reqwest::Client::new().get(format!("http://{http}/health")).send().await;
    assert!(plain.is_err(), "plaintext request must not be answered: {plain:?}");
    shutdown.cancel();
    Ok(())
}
