//! Mutual TLS between the components, on real processes with certificates generated here
//! (rcgen): `prism-head` + `prism-worker` + `prism-router` with `PRISM_TLS_CERT/KEY/CA`
//! (one identity signed by the cluster CA, re-read every 300 ms), the real model.
//!
//! - The mTLS cluster registers, deploys and serves a completion; `prism status` works with
//!   the TLS flags and fails without them.
//! - A worker with a certificate from another CA (trusting the cluster's CA) never registers:
//!   the head refuses the handshake and logs `UnknownIssuer`; a router with such a
//!   certificate cannot watch routes (it never becomes ready).
//! - Rotation: the identity files are replaced in place (rename, as cert-manager's symlink
//!   swap) with a new pair from the same CA; without a restart the head serves the new
//!   certificate (its serial changed) to the next connection, and `prism status` and a
//!   completion still succeed.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use prism_common::tls::{Tls, TlsFiles};
use prism_tests::{Cluster, PROMPTS, greedy_request, model, stream};
use prism_tests::{Router, Worker};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, SerialNumber};

const RELOAD: &str = "300ms";

struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Result<Self> {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(rcgen::DnType::CommonName, name);
        let key = KeyPair::generate()?;
        Ok(Self { cert: p.self_signed(&key)?, key })
    }

    /// A leaf for loopback (`localhost`, `127.0.0.1`) with `serial`: (PEM cert, PEM key, DER cert).
    fn leaf(&self, serial: u64) -> Result<(String, String, Vec<u8>)> {
        let mut p = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
        p.serial_number = Some(SerialNumber::from(serial));
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.cert, &self.key)?;
        Ok((cert.pem(), key.serialize_pem(), cert.der().to_vec()))
    }

    /// Writes `NAME.crt`, `NAME.key` and `NAME-ca.crt` under `dir`, each by rename so a
    /// reader never sees half a file.
    fn write(&self, dir: &Path, name: &str, serial: u64) -> Result<(TlsFiles, Vec<u8>)> {
        let (cert, key, der) = self.leaf(serial)?;
        let files = TlsFiles {
            cert: dir.join(format!("{name}.crt")),
            key: dir.join(format!("{name}.key")),
            ca: Some(dir.join(format!("{name}-ca.crt"))),
        };
        let swap = |path: &PathBuf, body: &str| -> Result<()> {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, body)?;
            std::fs::rename(&tmp, path)?;
            Ok(())
        };
        swap(files.ca.as_ref().context("ca")?, &self.cert.pem())?;
        // Key before certificate: a poll between the two sees a mismatch, refuses it and
        // keeps the old pair; the next poll takes the consistent new one.
        swap(&files.key, &key)?;
        swap(&files.cert, &cert)?;
        Ok((files, der))
    }
}

fn flags(f: &TlsFiles) -> Vec<String> {
    let p = |p: &Path| p.to_string_lossy().into_owned();
    vec![
        "--tls-cert".into(),
        p(&f.cert),
        "--tls-key".into(),
        p(&f.key),
        "--tls-ca".into(),
        f.ca.as_deref().map(p).unwrap_or_default(),
    ]
}

fn envs(f: &TlsFiles) -> Vec<(String, String)> {
    let p = |p: &Path| p.to_string_lossy().into_owned();
    vec![
        ("PRISM_TLS_CERT".into(), p(&f.cert)),
        ("PRISM_TLS_KEY".into(), p(&f.key)),
        ("PRISM_TLS_CA".into(), f.ca.as_deref().map(p).unwrap_or_default()),
        ("PRISM_TLS_RELOAD_INTERVAL".into(), RELOAD.into()),
    ]
}

/// The DER certificate the server at `addr` presents to a client with `client`'s identity.
async fn served_certificate(addr: &str, client: &Tls) -> Result<Vec<u8>> {
    let config = client.client_config().context("client config")?;
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1")?;
    let s = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await?;
    let chain = s.get_ref().1.peer_certificates().context("no peer certificate")?;
    Ok(chain.first().context("empty chain")?.as_ref().to_vec())
}

async fn completes(cluster: &Cluster) -> Result<()> {
    let r = stream(cluster.grpc(), greedy_request(PROMPTS[0], 8, true)).await?;
    ensure!(r.tokens.len() == 8, "expected 8 tokens, got {:?}", r.tokens);
    Ok(())
}

async fn eventually_in_log(what: &str, log: impl Fn() -> String, needle: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while tokio::time::Instant::now() < deadline {
        if log().contains(needle) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    anyhow::bail!("{what}: {needle:?} never logged:\n{}", log())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mtls_cluster_serves_refuses_a_foreign_ca_and_reloads_rotated_certificates() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let ca = Ca::new("prism-test-ca")?;
    let foreign_ca = Ca::new("someone-else")?;
    let (cluster_files, first_der) = ca.write(dir.path(), "cluster", 1001)?;
    let (client_files, _) = ca.write(dir.path(), "client", 2001)?;
    let (foreign_files, _) = foreign_ca.write(dir.path(), "foreign", 3001)?;
    // The foreign components trust the cluster's CA (it is no secret), so they accept the
    // head; only their own certificate is foreign.
    std::fs::write(foreign_files.ca.as_ref().context("ca")?, ca.cert.pem())?;
    // This test process is a client of the head (status, waits) with its own identity.
    let client = Tls::load(client_files.clone(), Duration::from_secs(3600))?;
    prism_common::tls::install_internal(Some(client.clone()));

    let client_flags = flags(&client_files);
    let client_flags: Vec<&str> = client_flags.iter().map(String::as_str).collect();
    let mut builder = Cluster::serving(&model, 1, 1).cli_args(&client_flags);
    for (k, v) in envs(&cluster_files) {
        builder = builder.env(&k, &v);
    }
    let cluster = builder.start().await?;
    cluster.with_logs(completes(&cluster).await)?;

    // The CLI reaches the head with the TLS flags (the fixture passes them; the deploy above
    // went through them too), and not without them.
    let status = cluster.with_logs(cluster.cli(&["status"]))?;
    ensure!(status.contains("w1"), "status lists the worker: {status}");
    let plain = prism_tests::prism_cli(&["--head", cluster.head_url(), "status"]);
    ensure!(plain.is_err(), "a plaintext client is refused by the mTLS head: {plain:?}");

    // A worker and a router with certificates from another CA are refused.
    let cluster_env = envs(&cluster_files);
    let foreign = Worker::spawn("foreign", &cluster.head_urls(), &flags(&foreign_files), &cluster_env)?;
    let router = Router::spawn("router-foreign", &cluster.head_urls(), &flags(&foreign_files), &cluster_env)?;
    // rustls names the reason: the client certificate is not signed by the CA.
    eventually_in_log("head", || cluster.head().process.stderr(), "UnknownIssuer").await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let nodes: Vec<String> =
        cluster.status().await?.nodes.into_iter().filter_map(|n| n.inventory.map(|i| i.node_id)).collect();
    ensure!(nodes == ["w1"], "only w1 registered, got {nodes:?}\n{}", foreign.process.stderr());
    let ready = reqwest::get(format!("{}/readyz", router.http)).await?.status();
    ensure!(!ready.is_success(), "foreign router must not get routes: /readyz {ready}\n{}", router.process.stderr());
    let good = reqwest::get(format!("{}/readyz", cluster.router().http)).await?.status();
    ensure!(good.is_success(), "the cluster's router is ready: {good}");
    drop(router);
    drop(foreign);

    // Rotation in place: a new pair from the same CA, served to the next connection.
    let head_addr = cluster.head_url().trim_start_matches("http://").to_owned();
    ensure!(served_certificate(&head_addr, &client).await? == first_der, "head serves the first certificate");
    let (_, second_der) = ca.write(dir.path(), "cluster", 1002)?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let served = served_certificate(&head_addr, &client).await?;
        if served == second_der {
            break;
        }
        ensure!(served == first_der, "served certificate is neither the old nor the new one");
        ensure!(tokio::time::Instant::now() < deadline, "head still serves serial 1001 after rotation");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    ensure!(second_der != first_der);
    eventually_in_log("head", || cluster.head().process.stderr(), "TLS material reloaded").await?;
    let status = cluster.with_logs(cluster.cli(&["status"]))?;
    ensure!(status.contains("w1"), "status after rotation: {status}");
    cluster.with_logs(completes(&cluster).await)?;
    Ok(())
}
