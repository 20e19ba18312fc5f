//! The TLS flags shared by `prism-head`, `prism-worker`, `prism-router` and the `prism`
//! client commands (clap, each also settable through a `PRISM_…` environment variable).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::{Tls, TlsError, TlsFiles};

/// Mutual TLS on the internal gRPC plane: all three files, or none (plaintext).
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsArgs {
    /// PEM certificate chain this component presents to its peers (leaf first). With
    /// --tls-key and --tls-ca every internal gRPC connection uses mutual TLS.
    #[arg(long, global = true, env = "PRISM_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// PEM private key of --tls-cert.
    #[arg(long, global = true, env = "PRISM_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// PEM CA bundle: peers must present a certificate signed by it.
    #[arg(long, global = true, env = "PRISM_TLS_CA")]
    pub tls_ca: Option<PathBuf>,

    /// How often the three files are re-read; changed files are used by new connections
    /// (`500ms`, `5s`, `1m`).
    #[arg(long, global = true, env = "PRISM_TLS_RELOAD_INTERVAL", default_value = "5s", value_parser = parse_interval)]
    pub tls_reload_interval: Duration,

    /// Check every server's certificate against this DNS name instead of the host of the
    /// address dialled (internal addresses are pod IPs; the Kubernetes certificates all carry
    /// `prism-internal`).
    #[arg(long, global = true, env = "PRISM_TLS_SERVER_NAME")]
    pub tls_server_name: Option<String>,
}

impl TlsArgs {
    /// The files, when all three flags are set.
    ///
    /// # Errors
    /// [`TlsError::Incomplete`] naming the missing flag when only some are set.
    pub fn files(&self) -> Result<Option<TlsFiles>, TlsError> {
        let flags = [("--tls-cert", &self.tls_cert), ("--tls-key", &self.tls_key), ("--tls-ca", &self.tls_ca)];
        let given = flags.iter().find(|(_, v)| v.is_some());
        let missing = flags.iter().find(|(_, v)| v.is_none());
        match (given, missing) {
            (None, _) => Ok(None),
            (Some((given, _)), Some((missing, _))) => Err(TlsError::Incomplete { given, missing }),
            (Some(_), None) => Ok(Some(TlsFiles {
                cert: self.tls_cert.clone().unwrap_or_default(),
                key: self.tls_key.clone().unwrap_or_default(),
                ca: self.tls_ca.clone(),
            })),
        }
    }

    /// Loads the identity (`None` when no flag is set).
    ///
    /// # Errors
    /// Incomplete flags, or a file that cannot be read or used.
    pub fn load(&self) -> Result<Option<Arc<Tls>>, TlsError> {
        self.files()?
            .map(|f| Tls::load_full(f, self.tls_reload_interval, false, self.tls_server_name.clone()))
            .transpose()
    }

    /// Loads the identity and installs it as the process's internal one
    /// ([`super::install_internal`]); returns whether TLS is on.
    ///
    /// # Errors
    /// As [`TlsArgs::load`].
    pub fn install(&self) -> Result<bool, TlsError> {
        let tls = self.load()?;
        let on = tls.is_some();
        super::install_internal(tls);
        Ok(on)
    }
}

/// Server-only TLS on a public listener (no client certificates asked for).
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq)]
pub struct PublicTlsArgs {
    /// PEM certificate chain served on the public HTTP and gRPC listeners (with
    /// --public-tls-key; clients are not asked for a certificate).
    #[arg(long, env = "PRISM_PUBLIC_TLS_CERT")]
    pub public_tls_cert: Option<PathBuf>,

    /// PEM private key of --public-tls-cert.
    #[arg(long, env = "PRISM_PUBLIC_TLS_KEY")]
    pub public_tls_key: Option<PathBuf>,
}

impl PublicTlsArgs {
    /// Loads the public identity (`None` when neither flag is set), re-read every
    /// `reload_interval`; `http11` offers HTTP/1.1 next to h2 in ALPN.
    ///
    /// # Errors
    /// One flag without the other, or a file that cannot be read or used.
    pub fn load(&self, reload_interval: Duration, http11: bool) -> Result<Option<Arc<Tls>>, TlsError> {
        match (&self.public_tls_cert, &self.public_tls_key) {
            (None, None) => Ok(None),
            (Some(_), None) => Err(TlsError::Incomplete { given: "--public-tls-cert", missing: "--public-tls-key" }),
            (None, Some(_)) => Err(TlsError::Incomplete { given: "--public-tls-key", missing: "--public-tls-cert" }),
            (Some(cert), Some(key)) => Tls::load_with_alpn(
                TlsFiles { cert: cert.clone(), key: key.clone(), ca: None },
                reload_interval,
                http11,
            )
            .map(Some),
        }
    }
}

/// Parses `500ms`, `5s`, `1m` or a bare number of seconds (more than zero).
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_interval(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let bad = || format!("invalid interval {s:?}: use e.g. 500ms, 5s, 1m");
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    if !v.is_finite() || v <= 0.0 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(v * scale))
}
