use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

use super::*;

struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn new_ca() -> Ca {
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let key = KeyPair::generate().expect("key");
    Ca { cert: p.self_signed(&key).expect("ca"), key }
}

fn leaf(ca: &Ca) -> (String, String) {
    leaf_named(ca, "localhost")
}

fn leaf_named(ca: &Ca, name: &str) -> (String, String) {
    let key = KeyPair::generate().expect("key");
    let p = CertificateParams::new(vec![name.to_owned()]).expect("params");
    (p.signed_by(&key, &ca.cert, &ca.key).expect("leaf").pem(), key.serialize_pem())
}

fn write(dir: &Path, ca: &Ca, (cert, key): &(String, String)) -> TlsFiles {
    std::fs::write(dir.join("tls.crt"), cert).expect("write");
    std::fs::write(dir.join("tls.key"), key).expect("write");
    std::fs::write(dir.join("ca.crt"), ca.cert.pem()).expect("write");
    TlsFiles { cert: dir.join("tls.crt"), key: dir.join("tls.key"), ca: Some(dir.join("ca.crt")) }
}

#[test]
fn loads_mutual_material_and_reloads_a_changed_pair() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = new_ca();
    let files = write(dir.path(), &ca, &leaf(&ca));
    let tls = Tls::load(files.clone(), Duration::from_secs(3600)).expect("load");
    assert!(tls.client_config().is_some());
    assert_eq!(tls.server_config().alpn_protocols, vec![b"h2".to_vec()]);
    assert!(!tls.reload().expect("unchanged"), "unchanged files are not a reload");
    let before = tls.server_config();
    write(dir.path(), &ca, &leaf(&ca));
    assert!(tls.reload().expect("changed"));
    assert!(!Arc::ptr_eq(&before, &tls.server_config()), "new material swapped in");
}

#[test]
fn a_bad_rotation_keeps_the_previous_material() {
    let dir = tempfile::tempdir().expect("dir");
    let ca = new_ca();
    let files = write(dir.path(), &ca, &leaf(&ca));
    let tls = Tls::load(files.clone(), Duration::from_secs(3600)).expect("load");
    let before = tls.server_config();
    std::fs::write(&files.cert, "not a certificate").expect("write");
    let e = tls.reload().expect_err("garbage refused").to_string();
    assert!(e.contains("--tls-cert") && e.contains("tls.crt"), "{e}");
    assert!(Arc::ptr_eq(&before, &tls.server_config()), "old material kept");
    // The same bad contents are not retried (and not logged) on every poll.
    assert!(!tls.reload().expect("same bad contents"));
    // A key of another certificate is refused too.
    let (cert, _) = leaf(&ca);
    let (_, other_key) = leaf(&ca);
    std::fs::write(&files.cert, cert).expect("write");
    std::fs::write(&files.key, other_key).expect("write");
    assert!(tls.reload().is_err(), "mismatched key refused");
    assert!(Arc::ptr_eq(&before, &tls.server_config()));
}

#[test]
fn flags_come_as_a_set_and_name_what_is_missing() {
    let a = TlsArgs { tls_cert: Some("c".into()), ..Default::default() };
    let e = a.files().expect_err("incomplete").to_string();
    assert!(e.contains("--tls-cert") && e.contains("--tls-key"), "{e}");
    assert_eq!(TlsArgs::default().files().expect("none"), None);
    let e = TlsArgs {
        tls_cert: Some("/nonexistent/c".into()),
        tls_key: Some("k".into()),
        tls_ca: Some("a".into()),
        tls_reload_interval: Duration::from_secs(5),
        tls_server_name: None,
    }
    .load()
    .expect_err("missing file")
    .to_string();
    assert!(e.contains("--tls-cert /nonexistent/c"), "{e}");
    assert_eq!(args::parse_interval("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(args::parse_interval("2"), Ok(Duration::from_secs(2)));
    assert!(args::parse_interval("0s").is_err());
}

/// A server whose certificate names only `prism-internal`, dialled at 127.0.0.1: refused
/// unless the client checks the certificate against `--tls-server-name prism-internal`; and
/// a client certificate of another CA is refused by the server.
#[tokio::test]
async fn server_name_override_and_client_certificates_from_another_ca() {
    use futures::StreamExt;
    use tower_service::Service;
    let dir = tempfile::tempdir().expect("dir");
    let (sdir, cdir, fdir) = (dir.path().join("s"), dir.path().join("c"), dir.path().join("f"));
    for d in [&sdir, &cdir, &fdir] {
        std::fs::create_dir(d).expect("mkdir");
    }
    let ca = new_ca();
    let server =
        Tls::load(write(&sdir, &ca, &leaf_named(&ca, "prism-internal")), Duration::from_secs(3600)).expect("server");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let uri: http::Uri = format!("https://{}", listener.local_addr().expect("addr")).parse().expect("uri");
    let mut incoming = server::incoming_with(listener, Some(server), "test");
    let accepted = tokio::spawn(async move { incoming.next().await.map(|r| r.is_ok()) });

    let client_files = write(&cdir, &ca, &leaf(&ca));
    let by_host = Tls::load(client_files.clone(), Duration::from_secs(3600)).expect("client");
    let e = client::TlsConnector::new(by_host).call(uri.clone()).await.expect_err("127.0.0.1 not in the certificate");
    assert!(e.to_string().contains("certificate"), "{e}");
    let by_name =
        Tls::load_full(client_files, Duration::from_secs(3600), false, Some("prism-internal".into())).expect("client");
    client::TlsConnector::new(by_name).call(uri.clone()).await.expect("verified as prism-internal");
    assert_eq!(accepted.await.expect("join"), Some(true), "the server accepted the verified client");

    // A client that trusts the CA but presents a certificate of another CA: the server
    // refuses it (the client learns it on its first read; TLS 1.3 sends the alert late).
    let other = new_ca();
    let foreign_files = write(&fdir, &other, &leaf(&other));
    std::fs::write(foreign_files.ca.as_ref().expect("ca"), ca.cert.pem()).expect("write");
    let foreign = Tls::load_full(foreign_files, Duration::from_secs(3600), false, Some("prism-internal".into()))
        .expect("foreign");
    if let Ok(io) = client::TlsConnector::new(foreign).call(uri).await {
        use tokio::io::AsyncReadExt;
        let mut io = io.into_inner();
        let mut b = [0u8; 1];
        assert!(io.read(&mut b).await.is_err(), "the server must refuse a foreign client certificate");
    }
}
