use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};

use super::*;

struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

fn ca() -> Ca {
    let mut p = CertificateParams::new(Vec::<String>::new()).expect("params");
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let key = KeyPair::generate().expect("key");
    Ca { cert: p.self_signed(&key).expect("ca"), key }
}

fn leaf(ca: &Ca) -> (String, String) {
    let key = KeyPair::generate().expect("key");
    let p = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
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
    let ca = ca();
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
    let ca = ca();
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
    }
    .load()
    .expect_err("missing file")
    .to_string();
    assert!(e.contains("--tls-cert /nonexistent/c"), "{e}");
    assert_eq!(args::parse_interval("500ms"), Ok(Duration::from_millis(500)));
    assert_eq!(args::parse_interval("2"), Ok(Duration::from_secs(2)));
    assert!(args::parse_interval("0s").is_err());
}
