//! Worker flags (clap, every flag also read from a `PRISM_…` environment variable) and the
//! validated [`WorkerConfig`] that [`crate::run`] takes.

use prism_common::NodeId;
use prism_common::engine_flags::DEFAULT_CPU_KV_CACHE_BYTES;
use prism_common::head_auth::HeadCredential;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

/// `--collective-timeout` when neither it nor a stall timeout below twice this is given.
pub const DEFAULT_COLLECTIVE_TIMEOUT_S: f64 = 30.0;

/// Command-line flags of `prism-worker`.
#[derive(Clone, Debug, clap::Parser)]
#[command(name = "prism-worker", version, about = "Prism node agent: registers with the head and runs engine replicas")]
pub struct Args {
    /// Head gRPC address(es), comma-separated (e.g. `http://head-0:50050,http://head-1:50050`).
    /// The worker connects to one, follows `UNAVAILABLE` leader hints and reconnects with backoff.
    #[arg(long, env = "PRISM_HEAD", value_delimiter = ',', default_value = "http://127.0.0.1:50050")]
    pub head: Vec<String>,

    /// The token this worker presents to the head (role `worker`).
    #[command(flatten)]
    pub head_token: prism_common::head_auth::HeadTokenArgs,

    /// gRPC listen address (WorkerService + grpc.health.v1).
    #[arg(long, env = "PRISM_WORKER_LISTEN", default_value = "0.0.0.0:50061")]
    pub listen: SocketAddr,

    /// HTTP listen address (`/healthz`, `/readyz`, `/metrics`).
    #[arg(long, env = "PRISM_WORKER_HTTP_LISTEN", default_value = "0.0.0.0:8082")]
    pub http_listen: SocketAddr,

    /// Endpoint routers dial for this worker, e.g. `http://10.0.0.5:50061`. Default: derived
    /// from the bound gRPC listener (an unspecified IP is replaced by this host's name).
    #[arg(long, env = "PRISM_ADVERTISE_ADDRESS")]
    pub advertise_address: Option<String>,

    /// Node id (default: the host name).
    #[arg(long, env = "PRISM_NODE_ID")]
    pub node_id: Option<String>,

    /// Node labels `k=v,...`, e.g. `capacity-type=spot,zone=us-east-1a`.
    #[arg(long, env = "PRISM_LABELS", value_delimiter = ',')]
    pub labels: Vec<String>,

    /// Advertise N simulated GPUs (named "simulated") for placement tests on machines without
    /// GPUs; engines then run on the CPU backend.
    #[arg(long, env = "PRISM_SIMULATE_GPUS", default_value_t = 0)]
    pub simulate_gpus: u32,

    /// Replica slots offered by a node without GPUs (at least 1 there: a worker with no GPU
    /// and no slot has nothing to offer and refuses to start).
    #[arg(long, env = "PRISM_CPU_SLOTS", default_value_t = 1)]
    pub cpu_slots: u32,

    /// Termination grace period (seconds) the orchestrator gives this process after SIGTERM
    /// (Kubernetes `terminationGracePeriodSeconds`).
    #[arg(long, env = "PRISM_DRAIN_GRACE", default_value_t = 30.0)]
    pub drain_grace: f64,

    /// Safety margin (seconds) kept before the grace period ends: the SIGTERM drain deadline is
    /// `drain_grace - drain_margin`.
    #[arg(long, env = "PRISM_DRAIN_MARGIN", default_value_t = 5.0)]
    pub drain_margin: f64,

    /// KV-cache budget in bytes of the CPU replicas whose deployment sets no `kv_cache_bytes`.
    #[arg(long, env = "PRISM_WORKER_KV_CACHE_BYTES", default_value_t = DEFAULT_CPU_KV_CACHE_BYTES)]
    pub kv_cache_bytes: u64,

    /// Spot-termination notice URL, polled once a second; a 200 answer (a termination time,
    /// as cloud metadata services return) starts the drain early.
    #[arg(long, env = "PRISM_SPOT_NOTICE_URL")]
    pub spot_notice_url: Option<String>,

    /// Spot-termination notice file, checked once a second; when it exists (content: an
    /// RFC 3339 time, unix seconds, or empty) the drain starts.
    #[arg(long, env = "PRISM_SPOT_NOTICE_FILE")]
    pub spot_notice_file: Option<PathBuf>,

    /// Seconds an engine may hold work without making progress (completing a step, or on the
    /// CPU backend a layer of a step) before its replica counts as stalled: readiness
    /// (`/readyz`, `grpc.health.v1`) fails, the replica is reported Failed to the head, which
    /// takes it out of the routes, and its engine is stopped (running step interrupted,
    /// threads ended). A dead engine thread is detected at once, whatever this says. The
    /// default (60) suits CPU nodes, where a loaded machine can take seconds per step; on
    /// GPUs a step takes milliseconds: use about 5 there.
    #[arg(long, env = "PRISM_WORKER_ENGINE_STALL_TIMEOUT", default_value_t = 60.0)]
    pub engine_stall_timeout: f64,

    /// Threads of each replica's own compute pool (default: every core for CPU replicas, 2
    /// for CUDA ones). Replicas never share a pool, so one replica's long step cannot starve
    /// another's.
    #[arg(long, env = "PRISM_WORKER_ENGINE_THREADS")]
    pub engine_threads: Option<usize>,

    /// Serve the fault-injection endpoints on the HTTP port (`POST
    /// /debug/replicas/{id}/kill-engine` ends a replica's engine step thread, `POST
    /// /debug/replicas/{id}/stall-engine?seconds=N` freezes it) for tests and chaos drills.
    /// Off by default; never enable it on a port clients can reach.
    #[arg(long, env = "PRISM_WORKER_ENABLE_FAULT_INJECTION", default_value_t = false)]
    pub enable_fault_injection: bool,

    /// Mutual TLS on the gRPC listener and toward the head.
    #[command(flatten)]
    pub tls: prism_common::tls::TlsArgs,
    /// Seconds a parallel replica's collective (all-reduce, stage hand-off, a rank's answer to
    /// a step) may take before the group counts as broken: the engine fails the step, kills
    /// its ranks and the replica is reported Failed. Must be below `--engine-stall-timeout`,
    /// so a stalled rank is caught by the group (which names it) before the agent's stall
    /// detection. Default: 30, or half the stall timeout when that is below 60.
    #[arg(long, env = "PRISM_COLLECTIVE_TIMEOUT")]
    pub collective_timeout: Option<f64>,

    /// Seconds every rank of a parallel replica has to join the driver's rendezvous and load
    /// its shard before the replica fails to start.
    #[arg(long, env = "PRISM_JOIN_TIMEOUT", default_value_t = 600.0)]
    pub join_timeout: f64,

    /// IP the rendezvous of a parallel replica with ranks on other nodes binds, and the host
    /// communicator listeners of this node's ranks (default: the gRPC listen IP). Ranks of
    /// other nodes reach them at the host of the advertised address.
    #[arg(long, env = "PRISM_RENDEZVOUS_BIND")]
    pub rendezvous_bind: Option<IpAddr>,
    /// The directory replicas may load models from: a model path outside it, or resolving
    /// out of it through a symlink (the model file, or any file of a model directory), fails
    /// the replica with the reason. Set it to the same directory as the head's
    /// `--model-root`. Unset: any path.
    #[arg(long, env = "PRISM_MODEL_ROOT")]
    pub model_root: Option<PathBuf>,
}

/// Invalid flag values.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A `--labels` entry is not `key=value`.
    #[error("label {0:?} is not key=value")]
    BadLabel(String),
    /// No head address.
    #[error("--head needs at least one address")]
    NoHead,
    /// The drain margin does not fit in the grace period.
    #[error("--drain-grace ({grace}s) must be a positive number larger than --drain-margin ({margin}s)")]
    BadDrain {
        /// Grace seconds.
        grace: f64,
        /// Margin seconds.
        margin: f64,
    },
    /// `--engine-stall-timeout` is not a positive number of seconds.
    #[error("--engine-stall-timeout ({0}s) must be a positive number of seconds")]
    BadStallTimeout(f64),
    /// `--collective-timeout` is not a positive number of seconds below the stall timeout.
    #[error(
        "--collective-timeout ({collective}s) must be a positive number of seconds below --engine-stall-timeout ({stall}s)"
    )]
    BadCollectiveTimeout {
        /// Collective timeout, seconds.
        collective: f64,
        /// Engine stall timeout, seconds.
        stall: f64,
    },
    /// `--join-timeout` is not a positive number of seconds.
    #[error("--join-timeout ({0}s) must be a positive number of seconds")]
    BadJoinTimeout(f64),
    /// A node id that is empty or not a DNS-1123-ish name.
    #[error("node id {0:?} must be non-empty and contain only [A-Za-z0-9._-]")]
    BadNodeId(String),
}

/// Validated worker configuration.
#[derive(Clone, Debug)]
pub struct WorkerConfig {
    /// Head endpoints (`http://host:port`), tried in order.
    pub heads: Vec<String>,
    /// The token presented to the head (none: an open head).
    pub head_token: HeadCredential,
    /// Advertised endpoint; `None` = derive from the gRPC listener.
    pub advertise_address: Option<String>,
    /// This node's id.
    pub node_id: NodeId,
    /// Node labels.
    pub labels: BTreeMap<String, String>,
    /// Simulated GPUs (0 = discover real ones).
    pub simulate_gpus: u32,
    /// CPU slots when no GPU is present.
    pub cpu_slots: u32,
    /// SIGTERM drain deadline (grace − margin).
    pub sigterm_drain: Duration,
    /// Margin kept before a known termination time (spot notice).
    pub drain_margin: Duration,
    /// Default KV-cache bytes for CPU replicas.
    pub kv_cache_bytes: u64,
    /// Spot notice URL.
    pub spot_notice_url: Option<String>,
    /// Spot notice file.
    pub spot_notice_file: Option<PathBuf>,
    /// Interval of load reports to the head.
    pub load_interval: Duration,
    /// Longest pause between reconnect attempts to the head.
    pub max_backoff: Duration,
    /// Work held this long without a completed step makes a replica stalled (not ready, Failed).
    pub engine_stall_timeout: Duration,
    /// Whether the `/debug/replicas/{id}/…` fault-injection endpoints are served.
    pub enable_fault_injection: bool,
    /// Threads of each replica's compute pool; `None` = the backend's default.
    pub engine_threads: Option<usize>,
    /// Bound of a parallel replica's collectives (below `engine_stall_timeout`).
    pub collective_timeout: Duration,
    /// Time a parallel replica's ranks have to join and load.
    pub join_timeout: Duration,
    /// IP rendezvous and rank listeners bind; `None` = the gRPC listen IP ([`crate::run`]
    /// fills it in).
    pub rendezvous_bind: Option<IpAddr>,
    /// The program rank processes run; `None` = this executable (tests substitute one).
    pub rank_program: Option<prism_engine::parallel::spawn::RankProgram>,
    /// Where replicas may load models from (`None`: anywhere); see `Args::model_root`.
    pub model_root: Option<PathBuf>,
}

impl WorkerConfig {
    /// A configuration for tests: one head, CPU only, node id as given.
    pub fn for_test(head: impl Into<String>, node_id: &str) -> Self {
        Self {
            heads: vec![head.into()],
            head_token: HeadCredential::None,
            advertise_address: None,
            node_id: NodeId::from(node_id),
            labels: BTreeMap::new(),
            simulate_gpus: 0,
            cpu_slots: 1,
            sigterm_drain: Duration::from_secs(25),
            drain_margin: Duration::from_secs(2),
            kv_cache_bytes: 64 * 1024 * 1024,
            spot_notice_url: None,
            spot_notice_file: None,
            load_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(2),
            engine_stall_timeout: Duration::from_secs(60),
            enable_fault_injection: false,
            engine_threads: None,
            collective_timeout: Duration::from_secs(30),
            join_timeout: Duration::from_secs(600),
            rendezvous_bind: None,
            rank_program: None,
            model_root: None,
        }
    }
}

/// Normalises a head address to a URI tonic can dial (`host:port` → `http://host:port`).
pub fn normalize_endpoint(addr: &str) -> String {
    let a = addr.trim();
    if a.contains("://") { a.to_owned() } else { format!("http://{a}") }
}

/// This machine's host name (`/proc/sys/kernel/hostname`, else `$HOSTNAME`, else "localhost").
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "localhost".to_owned())
}

impl TryFrom<Args> for WorkerConfig {
    type Error = ConfigError;

    fn try_from(a: Args) -> Result<Self, ConfigError> {
        let heads: Vec<String> =
            a.head.iter().map(|h| h.trim()).filter(|h| !h.is_empty()).map(normalize_endpoint).collect();
        if heads.is_empty() {
            return Err(ConfigError::NoHead);
        }
        let mut labels = BTreeMap::new();
        for l in a.labels.iter().map(|l| l.trim()).filter(|l| !l.is_empty()) {
            let (k, v) = l.split_once('=').ok_or_else(|| ConfigError::BadLabel(l.to_owned()))?;
            if k.trim().is_empty() {
                return Err(ConfigError::BadLabel(l.to_owned()));
            }
            labels.insert(k.trim().to_owned(), v.trim().to_owned());
        }
        let grace = a.drain_grace;
        let margin = a.drain_margin;
        if !(grace.is_finite() && margin.is_finite() && margin >= 0.0 && grace > margin) {
            return Err(ConfigError::BadDrain { grace, margin });
        }
        let stall = a.engine_stall_timeout;
        if !(stall.is_finite() && stall > 0.0) {
            return Err(ConfigError::BadStallTimeout(stall));
        }
        let collective = a.collective_timeout.unwrap_or(DEFAULT_COLLECTIVE_TIMEOUT_S.min(stall / 2.0));
        if !(collective.is_finite() && collective > 0.0 && collective < stall) {
            return Err(ConfigError::BadCollectiveTimeout { collective, stall });
        }
        let join = a.join_timeout;
        if !(join.is_finite() && join > 0.0) {
            return Err(ConfigError::BadJoinTimeout(join));
        }
        let node_id = a.node_id.unwrap_or_else(hostname);
        let valid =
            !node_id.is_empty() && node_id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !valid {
            return Err(ConfigError::BadNodeId(node_id));
        }
        Ok(Self {
            heads,
            head_token: a.head_token.credential(),
            advertise_address: a.advertise_address.map(|s| normalize_endpoint(&s)),
            node_id: NodeId(node_id),
            labels,
            simulate_gpus: a.simulate_gpus,
            cpu_slots: a.cpu_slots,
            sigterm_drain: Duration::from_secs_f64(grace - margin),
            drain_margin: Duration::from_secs_f64(margin),
            kv_cache_bytes: a.kv_cache_bytes,
            spot_notice_url: a.spot_notice_url,
            spot_notice_file: a.spot_notice_file,
            load_interval: Duration::from_secs(1),
            max_backoff: Duration::from_secs(5),
            engine_stall_timeout: Duration::from_secs_f64(stall),
            enable_fault_injection: a.enable_fault_injection,
            engine_threads: a.engine_threads.filter(|n| *n > 0),
            collective_timeout: Duration::from_secs_f64(collective),
            join_timeout: Duration::from_secs_f64(join),
            rendezvous_bind: a.rendezvous_bind,
            rank_program: None,
            model_root: a.model_root,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<WorkerConfig, ConfigError> {
        let mut v = vec!["prism-worker"];
        v.extend_from_slice(args);
        WorkerConfig::try_from(Args::parse_from(v))
    }

    #[test]
    fn parses_heads_labels_and_drain_deadline() -> anyhow::Result<()> {
        let c = parse(&[
            "--head",
            "h0:50050,http://h1:50050",
            "--labels",
            "capacity-type=spot,zone=z1",
            "--node-id",
            "n1",
            "--drain-grace",
            "30",
            "--drain-margin",
            "5",
        ])?;
        assert_eq!(c.heads, vec!["http://h0:50050", "http://h1:50050"]);
        assert_eq!(c.labels.get("capacity-type").map(String::as_str), Some("spot"));
        assert_eq!(c.labels.get("zone").map(String::as_str), Some("z1"));
        assert_eq!(c.sigterm_drain, Duration::from_secs(25));
        assert_eq!(c.node_id.as_str(), "n1");
        Ok(())
    }

    #[test]
    fn rejects_bad_values() {
        assert!(matches!(parse(&["--labels", "novalue"]), Err(ConfigError::BadLabel(_))));
        assert!(matches!(parse(&["--drain-grace", "5", "--drain-margin", "5"]), Err(ConfigError::BadDrain { .. })));
        assert!(matches!(parse(&["--node-id", "a b"]), Err(ConfigError::BadNodeId(_))));
        assert!(matches!(parse(&["--engine-stall-timeout", "0"]), Err(ConfigError::BadStallTimeout(_))));
        assert!(matches!(parse(&["--join-timeout", "0"]), Err(ConfigError::BadJoinTimeout(_))));
    }

    /// The group's collective timeout must expire before the agent's stall detection, so a
    /// stalled rank is reported by the group (naming the rank) rather than as a stalled engine.
    #[test]
    fn collective_timeout_defaults_to_30s_and_must_be_below_the_stall_timeout() -> anyhow::Result<()> {
        let c = parse(&[])?;
        assert_eq!((c.collective_timeout, c.join_timeout), (Duration::from_secs(30), Duration::from_secs(600)));
        let c = parse(&["--collective-timeout", "3", "--engine-stall-timeout", "5", "--join-timeout", "120"])?;
        assert_eq!((c.collective_timeout, c.join_timeout), (Duration::from_secs(3), Duration::from_secs(120)));
        let err = parse(&["--collective-timeout", "5", "--engine-stall-timeout", "5"]).err().map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some("--collective-timeout (5s) must be a positive number of seconds below --engine-stall-timeout (5s)")
        );
        assert!(matches!(parse(&["--collective-timeout", "0"]), Err(ConfigError::BadCollectiveTimeout { .. })));
        // A short stall timeout (GPU pools) without an explicit collective timeout halves it.
        assert_eq!(parse(&["--engine-stall-timeout", "5"])?.collective_timeout, Duration::from_millis(2500));
        Ok(())
    }

    #[test]
    fn fault_injection_is_off_by_default() -> anyhow::Result<()> {
        assert!(!parse(&[])?.enable_fault_injection);
        let c = parse(&["--enable-fault-injection", "--engine-stall-timeout", "2.5"])?;
        assert!(c.enable_fault_injection);
        assert_eq!(c.engine_stall_timeout, Duration::from_millis(2500));
        Ok(())
    }
}
