//! How the `prism` client reaches what it talks to, with the real binaries:
//! - `a_stopped_head_is_given_up_on_with_the_timeout_named`: a head that accepts connections
//!   but answers nothing (SIGSTOP: a frozen VM, a wedged process) makes `prism status` and
//!   `prism drain` fail after `--timeout` / `PRISM_TIMEOUT`, naming the head and the
//!   timeout, instead of hanging.
//! - `generate_reaches_a_router_serving_public_tls`: a router with `--public-tls-cert` on
//!   its gRPC port is reached over TLS by `prism --router https://…` trusting `--tls-ca`
//!   (or the system roots, here through `SSL_CERT_FILE`), and refused without a CA that
//!   signed its certificate. No head, worker or model: the router's answer to the model
//!   lookup shows the TLS connection worked.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use prism_tests::{Cluster, Router, Store, bin_path, eventually};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

/// Command-line arguments and environment variables of one `prism` run.
type Invocation<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>);

/// Runs `prism ARGS` with `envs`, killing it after `limit` (then an error: it hung).
fn prism_within(limit: Duration, args: &[&str], envs: &[(&str, &str)]) -> Result<(Output, Duration)> {
    let started = Instant::now();
    let mut child = Command::new(bin_path("prism")?)
        .args(args)
        .envs(envs.iter().copied())
        .env("RUST_BACKTRACE", "0")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    while child.try_wait()?.is_none() {
        if started.elapsed() > limit {
            child.kill()?;
            let out = child.wait_with_output()?;
            bail!("prism {} still running after {limit:?}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok((child.wait_with_output()?, started.elapsed()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_head_is_given_up_on_with_the_timeout_named() -> Result<()> {
    let cluster = Cluster::builder().store(Store::Embedded).start().await?;
    let result = async {
        let head = cluster.head_url().to_owned();
        cluster.head().process.freeze()?;
        let cases: [(Invocation, &str); 2] = [
            ((vec!["--head", &head, "--timeout", "2s", "status"], vec![]), "2 s"),
            ((vec!["--head", &head, "drain", "n1"], vec![("PRISM_TIMEOUT", "1500ms")]), "1.5 s"),
        ];
        for ((args, envs), within) in cases {
            let (out, took) = tokio::task::block_in_place(|| prism_within(Duration::from_secs(20), &args, &envs))?;
            let err = String::from_utf8_lossy(&out.stderr);
            ensure!(!out.status.success(), "prism {args:?} succeeded against a stopped head");
            ensure!(
                err.contains(&format!("the head at {head} did not answer within {within}")),
                "prism {args:?} names the head and the timeout: {err}"
            );
            // A change sent to a head that is only slow may still be applied.
            ensure!(err.contains("may still take effect"), "prism {args:?} says the outcome is unknown: {err}");
            ensure!(took < Duration::from_secs(10), "prism {args:?} gave up after {took:?}");
        }
        cluster.head().process.thaw()?;
        Ok(())
    }
    .await;
    if let Err(e) = result {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

/// A CA and a loopback server certificate it signed, written as `ca.crt`, `pub.crt`,
/// `pub.key` under `dir`.
fn write_certificates(dir: &std::path::Path) -> Result<()> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(rcgen::DnType::CommonName, "prism-test-public-ca");
    let ca_key = KeyPair::generate()?;
    let ca = ca.self_signed(&ca_key)?;
    let leaf = CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
    let key = KeyPair::generate()?;
    let cert = leaf.signed_by(&key, &ca, &ca_key)?;
    std::fs::write(dir.join("ca.crt"), ca.pem())?;
    std::fs::write(dir.join("pub.crt"), cert.pem())?;
    std::fs::write(dir.join("pub.key"), key.serialize_pem())?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_reaches_a_router_serving_public_tls() -> Result<()> {
    let dir = tempfile::tempdir()?;
    write_certificates(dir.path())?;
    let path = |name: &str| dir.path().join(name).to_string_lossy().into_owned();
    let args = ["--public-tls-cert".to_owned(), path("pub.crt"), "--public-tls-key".to_owned(), path("pub.key")];
    // A head that is not there: the router serves on without one (fail static).
    let router = Router::spawn("prism-router", "http://127.0.0.1:9", &args, &[])?;
    let result = async {
        let port = router.grpc.rsplit(':').next().context("router port")?.to_owned();
        let https = format!("https://127.0.0.1:{port}");
        eventually(Duration::from_secs(30), "router gRPC port open", || async {
            Ok(tokio::net::TcpStream::connect(format!("127.0.0.1:{port}")).await.ok().map(|_| ()))
        })
        .await?;
        let ca = path("ca.crt");
        let trusted: [Invocation; 2] = [
            (vec!["--router", &https, "--tls-ca", &ca, "generate", "hi"], vec![]),
            (vec!["--router", &https, "generate", "hi"], vec![("SSL_CERT_FILE", ca.as_str())]),
        ];
        for (args, envs) in &trusted {
            let (out, _) = tokio::task::block_in_place(|| prism_within(Duration::from_secs(20), args, envs))?;
            let err = String::from_utf8_lossy(&out.stderr);
            // The router answered the model lookup: it has no route table from a head.
            ensure!(err.contains("no route table"), "prism {args:?} {envs:?} reached the router over TLS: {err}");
        }
        let (out, _) = tokio::task::block_in_place(|| {
            prism_within(Duration::from_secs(20), &["--router", &https, "generate", "hi"], &[])
        })?;
        let err = String::from_utf8_lossy(&out.stderr);
        ensure!(
            !out.status.success() && !err.contains("no route table"),
            "a certificate no trusted CA signed is refused: {err}"
        );
        Ok(())
    }
    .await;
    if let Err(e) = result {
        bail!("{e:#}\n{}", router.process.stderr());
    }
    Ok(())
}
