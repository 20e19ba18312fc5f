//! TLS for Prism's connections: certificate chain, private key and CA bundle read from PEM
//! files, turned into rustls configurations (ring provider), and re-read every few seconds so
//! a rotated certificate (cert-manager swaps the mounted files in place) is used by the next
//! connection without a restart.
//!
//! With a CA bundle the material is mutual: a server built from it requires a client
//! certificate signed by the CA, and a client verifies the server against the CA and
//! presents its own certificate. Without a CA (the router's public listeners) it is a
//! server-only identity. A rotated file that does not parse, or a key that does not match
//! its certificate, keeps the previous material and logs an error.
//!
//! The internal identity is one per process ([`install_internal`]): every internal gRPC
//! channel ([`client::channel`], [`client::channel_lazy`]) and internal gRPC server
//! ([`server::incoming`]) of the process uses it; none installed means plaintext.

pub mod args;
pub mod client;
pub mod server;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{ClientConfig, RootCertStore, ServerConfig};

pub use args::{PublicTlsArgs, TlsArgs};

/// HTTP/2 is the only protocol of the gRPC plane; the router's public HTTP adds HTTP/1.1.
const ALPN_H2: &[u8] = b"h2";
const ALPN_HTTP11: &[u8] = b"http/1.1";

/// Where the PEM files of one identity live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// Certificate chain (leaf first).
    pub cert: PathBuf,
    /// Private key of the leaf (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// CA bundle peers must be signed by; `None` for a server-only identity (no client
    /// certificates asked for, no client configuration).
    pub ca: Option<PathBuf>,
}

/// A TLS file that cannot be used. Each variant names the flag and the path.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A flag of a set was given without the others.
    #[error("{given} is set but {missing} is not (TLS needs certificate, key and CA together)")]
    Incomplete {
        /// The flag that was set.
        given: &'static str,
        /// The flag that is missing.
        missing: &'static str,
    },
    /// A file cannot be read.
    #[error("{flag} {path}: {source}")]
    Read {
        /// Flag naming the file.
        flag: &'static str,
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A file has no usable PEM content.
    #[error("{flag} {path}: {reason}")]
    Parse {
        /// Flag naming the file.
        flag: &'static str,
        /// The path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the material (e.g. the key does not match the certificate).
    #[error("TLS material from {cert}: {source}")]
    Config {
        /// The certificate path (the key and CA sit beside it).
        cert: PathBuf,
        /// rustls's reason.
        source: rustls::Error,
    },
}

/// The file contents a configuration was built from (compared on every poll).
type Contents = [Vec<u8>; 3];

struct Material {
    contents: Contents,
    server: Arc<ServerConfig>,
    client: Option<Arc<ClientConfig>>,
}

/// One TLS identity, reloaded from its files. Cheap to share (`Arc`).
pub struct Tls {
    files: TlsFiles,
    /// HTTP/1.1 offered next to h2 in ALPN (the router's public HTTP listener).
    http11: bool,
    /// The name servers' certificates are checked against instead of the address's host.
    server_name: Option<String>,
    current: RwLock<Arc<Material>>,
    /// Contents that failed to build, so one bad rotation logs once, not every poll.
    failed: Mutex<Option<Contents>>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.files).field("http11", &self.http11).finish_non_exhaustive()
    }
}

impl Tls {
    /// Loads the identity and starts a thread that re-reads the files every
    /// `reload_interval` (the thread ends when the last `Arc` is dropped).
    ///
    /// # Errors
    /// [`TlsError`] naming the file that cannot be read or used.
    pub fn load(files: TlsFiles, reload_interval: Duration) -> Result<Arc<Self>, TlsError> {
        Self::load_with_alpn(files, reload_interval, false)
    }

    /// As [`Tls::load`], offering HTTP/1.1 as well as h2 (a public HTTP listener).
    ///
    /// # Errors
    /// [`TlsError`] naming the file that cannot be read or used.
    pub fn load_with_alpn(files: TlsFiles, reload_interval: Duration, http11: bool) -> Result<Arc<Self>, TlsError> {
        Self::load_full(files, reload_interval, http11, None)
    }

    /// As [`Tls::load`]; as a client, checks every server's certificate against
    /// `server_name` (when given) instead of the host of the address dialled: internal
    /// addresses are pod IPs that no certificate can name in advance.
    ///
    /// # Errors
    /// [`TlsError`] naming the file that cannot be read or used.
    pub fn load_full(
        files: TlsFiles,
        reload_interval: Duration,
        http11: bool,
        server_name: Option<String>,
    ) -> Result<Arc<Self>, TlsError> {
        let contents = read_all(&files)?;
        let material = build(&files, contents, http11)?;
        let tls = Arc::new(Self {
            files,
            http11,
            server_name,
            current: RwLock::new(Arc::new(material)),
            failed: Mutex::new(None),
        });
        spawn_watcher(Arc::downgrade(&tls), reload_interval);
        Ok(tls)
    }

    /// The name servers are verified as, when it overrides the dialled host.
    pub fn server_name(&self) -> Option<&str> {
        self.server_name.as_deref()
    }

    /// The files this identity is read from.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The server configuration of the current material (client certificates required
    /// when a CA is configured).
    pub fn server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.material().server)
    }

    /// The client configuration of the current material; `None` for a server-only identity.
    pub fn client_config(&self) -> Option<Arc<ClientConfig>> {
        self.material().client.clone()
    }

    fn material(&self) -> Arc<Material> {
        Arc::clone(&self.current.read().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Re-reads the files now: `Ok(true)` when the material changed and was swapped in,
    /// `Ok(false)` when the files are unchanged (or are the contents that already failed).
    ///
    /// # Errors
    /// The new files cannot be read or used; the previous material stays in use.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let contents = read_all(&self.files)?;
        if self.material().contents == contents {
            return Ok(false);
        }
        let mut failed = self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if failed.as_ref() == Some(&contents) {
            return Ok(false);
        }
        match build(&self.files, contents.clone(), self.http11) {
            Ok(m) => {
                *self.current.write().unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::new(m);
                *failed = None;
                Ok(true)
            }
            Err(e) => {
                *failed = Some(contents);
                Err(e)
            }
        }
    }
}

fn spawn_watcher(tls: Weak<Tls>, interval: Duration) {
    let interval = interval.max(Duration::from_millis(50));
    let spawned = std::thread::Builder::new().name("prism-tls-reload".into()).spawn(move || {
        loop {
            std::thread::sleep(interval);
            let Some(tls) = tls.upgrade() else { return };
            match tls.reload() {
                Ok(true) => tracing::info!(cert = %tls.files.cert.display(), "TLS material reloaded"),
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(error = %e, "TLS files changed but cannot be used; keeping the previous material")
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::error!(error = %e, "cannot start the TLS reload thread; certificates will not be reloaded");
    }
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { flag, path: path.to_owned(), source })
}

fn read_all(files: &TlsFiles) -> Result<Contents, TlsError> {
    Ok([
        read("--tls-cert", &files.cert)?,
        read("--tls-key", &files.key)?,
        match &files.ca {
            Some(ca) => read("--tls-ca", ca)?,
            None => Vec::new(),
        },
    ])
}

fn certs(flag: &'static str, path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let parse = |reason: String| TlsError::Parse { flag, path: path.to_owned(), reason };
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| parse(format!("bad PEM certificate: {e}")))?;
    if certs.is_empty() {
        return Err(parse("no PEM certificate (-----BEGIN CERTIFICATE-----) in the file".into()));
    }
    Ok(certs)
}

/// The ring provider: pure Rust + assembly, no cmake/C toolchain as aws-lc-rs needs.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn build(files: &TlsFiles, contents: Contents, http11: bool) -> Result<Material, TlsError> {
    let chain = certs("--tls-cert", &files.cert, &contents[0])?;
    let key = PrivateKeyDer::from_pem_slice(&contents[1]).map_err(|e| TlsError::Parse {
        flag: "--tls-key",
        path: files.key.clone(),
        reason: format!("no usable PEM private key: {e}"),
    })?;
    let config = |source| TlsError::Config { cert: files.cert.clone(), source };
    let provider = provider();
    let mut alpn = vec![ALPN_H2.to_vec()];
    if http11 {
        alpn.push(ALPN_HTTP11.to_vec());
    }
    let server_builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_protocol_versions(rustls::DEFAULT_VERSIONS)
        .map_err(config)?;
    let (server, client) = match &files.ca {
        Some(ca_path) => {
            let mut roots = RootCertStore::empty();
            for c in certs("--tls-ca", ca_path, &contents[2])? {
                roots.add(c).map_err(|e| TlsError::Parse {
                    flag: "--tls-ca",
                    path: ca_path.clone(),
                    reason: format!("not a usable CA certificate: {e}"),
                })?;
            }
            let roots = Arc::new(roots);
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
                    .build()
                    .map_err(|e| TlsError::Parse {
                        flag: "--tls-ca",
                        path: ca_path.clone(),
                        reason: format!("cannot verify clients with it: {e}"),
                    })?;
            let mut server = server_builder
                .with_client_cert_verifier(verifier)
                .with_single_cert(chain.clone(), key.clone_key())
                .map_err(config)?;
            server.alpn_protocols = alpn.clone();
            let mut client = ClientConfig::builder_with_provider(Arc::clone(&provider))
                .with_protocol_versions(rustls::DEFAULT_VERSIONS)
                .map_err(config)?
                .with_root_certificates(roots)
                .with_client_auth_cert(chain, key)
                .map_err(config)?;
            client.alpn_protocols = vec![ALPN_H2.to_vec()];
            (server, Some(Arc::new(client)))
        }
        None => {
            let mut server = server_builder.with_no_client_auth().with_single_cert(chain, key).map_err(config)?;
            server.alpn_protocols = alpn;
            (server, None)
        }
    };
    Ok(Material { contents, server: Arc::new(server), client })
}

/// A client configuration for servers with a server-only identity (the router's public
/// listeners): no client certificate; servers verified against the system's root
/// certificates (the platform's bundle, or `SSL_CERT_FILE` / `SSL_CERT_DIR` when set) plus the
/// certificates in `ca` (a PEM bundle: a private CA, or a self-signed server certificate);
/// h2 in ALPN.
///
/// # Errors
/// `ca` cannot be read or holds no usable certificate, or no root at all is available
/// (no system bundle and no `ca`).
pub fn server_only_client_config(ca: Option<&Path>) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    let system = rustls_native_certs::load_native_certs();
    for e in &system.errors {
        tracing::debug!(error = %e, "a system root certificate source cannot be read");
    }
    // Unparsable entries of the system bundle are skipped, as every TLS client does.
    let (_added, _skipped) = roots.add_parsable_certificates(system.certs);
    if let Some(path) = ca {
        let pem = read("--tls-ca", path)?;
        for c in certs("--tls-ca", path, &pem)? {
            roots.add(c).map_err(|e| TlsError::Parse {
                flag: "--tls-ca",
                path: path.to_owned(),
                reason: format!("not a usable CA certificate: {e}"),
            })?;
        }
    }
    if roots.is_empty() {
        return Err(TlsError::Parse {
            flag: "--tls-ca",
            path: PathBuf::new(),
            reason: "no system root certificates found: give the server's CA with --tls-ca".into(),
        });
    }
    let mut client = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(rustls::DEFAULT_VERSIONS)
        .map_err(|source| TlsError::Config { cert: ca.map(Path::to_owned).unwrap_or_default(), source })?
        .with_root_certificates(roots)
        .with_no_client_auth();
    client.alpn_protocols = vec![ALPN_H2.to_vec()];
    Ok(Arc::new(client))
}

static INTERNAL: RwLock<Option<Arc<Tls>>> = RwLock::new(None);

/// Installs the process's internal identity: from now on every internal gRPC channel and
/// server of this process uses mutual TLS with it. `None` goes back to plaintext.
pub fn install_internal(tls: Option<Arc<Tls>>) {
    *INTERNAL.write().unwrap_or_else(std::sync::PoisonError::into_inner) = tls;
}

/// The process's internal identity, if one is installed.
pub fn internal() -> Option<Arc<Tls>> {
    INTERNAL.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
}

#[cfg(test)]
mod tests;
