//! `prism-head` flags (clap, every flag also settable through a `PRISM_…` environment
//! variable) and the validated [`HeadConfig`] built from them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use crate::auth::{HeadAuth, TokenFileError};

/// Command-line flags of `prism-head`.
#[derive(Parser, Debug, Clone)]
#[command(name = "prism-head", version, about = "Prism control plane: cluster state, placement, routes")]
pub struct Args {
    /// gRPC listen address (HeadService + grpc.health.v1).
    #[arg(long, env = "PRISM_HEAD_LISTEN", default_value = "0.0.0.0:50050")]
    pub listen: SocketAddr,

    /// HTTP listen address for /healthz, /readyz (ready = leader) and /metrics.
    #[arg(long, env = "PRISM_HEAD_HTTP_LISTEN", default_value = "0.0.0.0:8081")]
    pub http_listen: SocketAddr,

    /// State store: `embedded:PATH` (one machine, persisted to PATH) or
    /// `etcd://HOST:PORT[,HOST:PORT...]`.
    #[arg(long, env = "PRISM_HEAD_STORE", default_value = "embedded:prism-state.json")]
    pub store: String,

    /// Address other components use to reach this head's gRPC port (published as the
    /// leader's address), e.g. `http://head-0.prism-head:50050`. Default: derived from
    /// `--listen` (0.0.0.0 becomes 127.0.0.1).
    #[arg(long, env = "PRISM_HEAD_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,

    /// A worker whose session is gone this long is Dead and its replicas are re-placed
    /// (humantime-like: `5s`, `500ms`, `2m`).
    #[arg(long, env = "PRISM_HEAD_WORKER_TIMEOUT", default_value = "5s", value_parser = parse_duration)]
    pub worker_timeout: Duration,

    /// A Dead node (its worker gone for `--worker-timeout`) is forgotten (removed from the
    /// node list and the store) once it has been gone this long and no replica record refers
    /// to it any more (its replicas were replaced elsewhere). A worker that drained and closed
    /// its session on purpose (SIGTERM, pod deletion) is forgotten at once instead, unless an
    /// operator's drain (`prism drain`) holds it: then it is kept, Dead and cordoned, for
    /// this long. A worker that comes back with the same node id registers as a new node.
    #[arg(long, env = "PRISM_HEAD_DEAD_NODE_RETENTION", default_value = "10m", value_parser = parse_duration)]
    pub dead_node_retention: Duration,

    /// Leader lease TTL: a dead leader is replaced within about this long.
    #[arg(long, env = "PRISM_HEAD_LEASE_TTL", default_value = "5s", value_parser = parse_duration)]
    pub lease_ttl: Duration,

    /// This head's id in the leader election (default: a random id).
    #[arg(long, env = "PRISM_HEAD_ID")]
    pub head_id: Option<String>,

    /// Default drain deadline for replicas removed by scale-down or node drain.
    #[arg(long, env = "PRISM_HEAD_DRAIN_TIMEOUT", default_value = "30s", value_parser = parse_duration)]
    pub drain_timeout: Duration,

    /// Period of the reconciler's tick (it also runs on every change).
    #[arg(long, env = "PRISM_HEAD_RECONCILE_INTERVAL", default_value = "1s", value_parser = parse_duration)]
    pub reconcile_interval: Duration,

    /// A replica that was Ready and then failed (engine died or stalled) is replaced this
    /// long after it failed, as Ray Serve restarts unhealthy replicas. A one-rank replica
    /// that fails while starting (bad model path, out of memory) stays Failed with its
    /// reason, so a broken spec never becomes a restart loop; a GPU group (several ranks)
    /// that fails while starting (a rank crashed or was OOM-killed while loading) is
    /// replaced after this delay x 2^n, n = the deployment's earlier start failures since
    /// one of its replicas was Ready (at most 64 x the delay).
    #[arg(long, env = "PRISM_HEAD_REPLICA_RESTART_DELAY", default_value = "10s", value_parser = parse_duration)]
    pub replica_restart_delay: Duration,

    /// Mutual TLS on the gRPC listener (workers, routers and the CLI present certificates).
    #[command(flatten)]
    pub tls: prism_common::tls::TlsArgs,
    /// Bearer tokens and their roles, one `TOKEN role=admin|read|worker|router [name=LABEL]`
    /// per line (`#` comments). Callers send `authorization: Bearer TOKEN`. Unset: the head
    /// runs open (anyone who reaches its port may deploy, scale and drain), as `prism up`
    /// does on loopback.
    #[arg(long, env = "PRISM_HEAD_AUTH_TOKEN_FILE")]
    pub auth_token_file: Option<PathBuf>,
    /// The directory deployments may load models from: `engine.model` must name a path under
    /// it (no `..`, no absolute path elsewhere; a relative path is taken under it), or
    /// ApplyDeployment answers INVALID_ARGUMENT. Workers check the same with symlinks
    /// resolved (their own `--model-root`). Unset: any path (a single-user cluster).
    #[arg(long, env = "PRISM_MODEL_ROOT")]
    pub model_root: Option<PathBuf>,
}

/// Default of `--dead-node-retention`: long enough to see in `prism status` which node died
/// and to bring it back as the same node, short enough that pod churn leaves no trail.
pub const DEFAULT_DEAD_NODE_RETENTION: Duration = Duration::from_secs(600);

/// Where cluster state lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreSpec {
    /// In-process store persisted to a file.
    Embedded(PathBuf),
    /// etcd cluster endpoints (`host:port`).
    Etcd(Vec<String>),
}

/// Validated head configuration.
#[derive(Debug, Clone)]
pub struct HeadConfig {
    /// State store location.
    pub store: StoreSpec,
    /// Address published as the leader's (gRPC URL).
    pub advertise_address: String,
    /// Session-less time after which a worker is Dead.
    pub worker_timeout: Duration,
    /// How long a Dead node without replicas is kept before it is forgotten.
    pub dead_node_retention: Duration,
    /// Leader lease TTL.
    pub lease_ttl: Duration,
    /// Election candidate id.
    pub head_id: String,
    /// Default drain deadline.
    pub drain_timeout: Duration,
    /// Reconciler tick period.
    pub reconcile_interval: Duration,
    /// Delay before a replica that failed after being Ready is replaced.
    pub replica_restart_delay: Duration,
    /// Accepted tokens and roles ([`HeadAuth::open`] without `--auth-token-file`).
    pub auth: HeadAuth,
    /// Where deployments may load models from (`None`: anywhere); see `Args::model_root`.
    pub model_root: Option<PathBuf>,
}

/// Invalid flag values.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `--store` is neither `embedded:PATH` nor `etcd://…`.
    #[error("invalid --store {0:?}: expected embedded:PATH or etcd://HOST:PORT[,HOST:PORT]")]
    Store(String),
    /// A duration that must be positive is zero.
    #[error("{0} must be greater than zero")]
    ZeroDuration(&'static str),
    /// `--auth-token-file` cannot be read or is malformed (the message names the line).
    #[error(transparent)]
    Auth(#[from] TokenFileError),
}

impl StoreSpec {
    /// Parses `embedded:PATH` or `etcd://HOST:PORT[,HOST:PORT]`.
    ///
    /// # Errors
    /// [`ConfigError::Store`] on anything else.
    pub fn parse(s: &str) -> Result<Self, ConfigError> {
        if let Some(path) = s.strip_prefix("embedded:") {
            if path.is_empty() {
                return Err(ConfigError::Store(s.to_owned()));
            }
            return Ok(Self::Embedded(PathBuf::from(path)));
        }
        if let Some(rest) = s.strip_prefix("etcd://") {
            let eps: Vec<String> =
                rest.split(',').map(str::trim).filter(|e| !e.is_empty()).map(str::to_owned).collect();
            if eps.is_empty() || eps.iter().any(|e| !e.contains(':')) {
                return Err(ConfigError::Store(s.to_owned()));
            }
            return Ok(Self::Etcd(eps));
        }
        Err(ConfigError::Store(s.to_owned()))
    }
}

impl TryFrom<Args> for HeadConfig {
    type Error = ConfigError;

    fn try_from(a: Args) -> Result<Self, ConfigError> {
        let store = StoreSpec::parse(&a.store)?;
        for (name, d) in [
            ("--worker-timeout", a.worker_timeout),
            ("--lease-ttl", a.lease_ttl),
            ("--reconcile-interval", a.reconcile_interval),
        ] {
            if d.is_zero() {
                return Err(ConfigError::ZeroDuration(name));
            }
        }
        let advertise_address = a.advertise_address.unwrap_or_else(|| {
            let ip = if a.listen.ip().is_unspecified() { "127.0.0.1".to_owned() } else { a.listen.ip().to_string() };
            format!("{}://{ip}:{}", prism_common::tls::client::scheme(), a.listen.port())
        });
        let head_id = a.head_id.unwrap_or_else(|| {
            let u = uuid::Uuid::new_v4().simple().to_string();
            format!("head-{}", &u[..8])
        });
        let auth = match &a.auth_token_file {
            Some(p) => HeadAuth::from_file(p)?,
            None => HeadAuth::open(),
        };
        Ok(Self {
            store,
            advertise_address,
            worker_timeout: a.worker_timeout,
            dead_node_retention: a.dead_node_retention,
            lease_ttl: a.lease_ttl,
            head_id,
            drain_timeout: a.drain_timeout,
            reconcile_interval: a.reconcile_interval,
            replica_restart_delay: a.replica_restart_delay,
            auth,
            model_root: a.model_root,
        })
    }
}

impl HeadConfig {
    /// A configuration for tests and `prism up`: given store and advertise address,
    /// defaults for everything else (worker timeout and lease TTL 5 s).
    pub fn new(store: StoreSpec, advertise_address: impl Into<String>) -> Self {
        let u = uuid::Uuid::new_v4().simple().to_string();
        Self {
            store,
            advertise_address: advertise_address.into(),
            worker_timeout: Duration::from_secs(5),
            dead_node_retention: DEFAULT_DEAD_NODE_RETENTION,
            lease_ttl: Duration::from_secs(5),
            head_id: format!("head-{}", &u[..8]),
            drain_timeout: Duration::from_secs(30),
            reconcile_interval: Duration::from_secs(1),
            replica_restart_delay: Duration::from_secs(10),
            auth: HeadAuth::open(),
            model_root: None,
        }
    }
}

/// A duration flag that is not `500ms`, `5s`, `2m`, `1h` or a number of seconds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {0:?}: use e.g. 500ms, 5s, 2m")]
pub struct InvalidDuration(pub String);

/// Parses `500ms`, `5s`, `2m`, `1h` or a bare number of seconds.
///
/// # Errors
/// [`InvalidDuration`] (its message names the accepted forms).
pub fn parse_duration(s: &str) -> Result<Duration, InvalidDuration> {
    let s = s.trim();
    let bad = || InvalidDuration(s.to_owned());
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let v: f64 = num.parse().map_err(|_| bad())?;
    if !v.is_finite() || v < 0.0 {
        return Err(bad());
    }
    let secs = match unit {
        "ms" => v / 1000.0,
        "s" => v,
        "m" => v * 60.0,
        "h" => v * 3600.0,
        _ => return Err(bad()),
    };
    Ok(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_specs() {
        assert_eq!(StoreSpec::parse("embedded:/tmp/x.json").ok(), Some(StoreSpec::Embedded("/tmp/x.json".into())));
        assert_eq!(StoreSpec::parse("etcd://a:1,b:2").ok(), Some(StoreSpec::Etcd(vec!["a:1".into(), "b:2".into()])));
        assert!(StoreSpec::parse("etcd://").is_err());
        assert!(StoreSpec::parse("redis://x:1").is_err());
        assert!(StoreSpec::parse("embedded:").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        assert!(parse_duration("5x").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn defaults_and_advertise() {
        let a = Args::parse_from(["prism-head", "--listen", "0.0.0.0:7000"]);
        let c = HeadConfig::try_from(a).expect("valid");
        assert_eq!(c.advertise_address, "http://127.0.0.1:7000");
        assert_eq!(c.worker_timeout, Duration::from_secs(5));
        assert_eq!(c.dead_node_retention, DEFAULT_DEAD_NODE_RETENTION);
        assert_eq!(c.store, StoreSpec::Embedded("prism-state.json".into()));
        assert!(!c.auth.enabled());
    }

    #[test]
    fn a_malformed_token_file_is_a_startup_error_naming_the_line() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("tokens");
        std::fs::write(&file, "# ops\nsecret-secret-secret-1 role=admin\nsecret-secret-secret-2 role=boss\n")
            .expect("write");
        let a = Args::parse_from(["prism-head", "--auth-token-file", file.to_str().expect("utf-8")]);
        let e = HeadConfig::try_from(a).expect_err("role boss");
        let m = e.to_string();
        assert!(m.contains("line 3: role \"boss\""), "{m}");
        assert!(!m.contains("secret-secret"), "{m}");
        let a = Args::parse_from(["prism-head", "--auth-token-file", "/nonexistent/tokens"]);
        assert!(matches!(HeadConfig::try_from(a), Err(ConfigError::Auth(TokenFileError::Read { .. }))));
    }
}
