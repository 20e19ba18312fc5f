//! Router configuration: the clap `Args` (every flag also read from a `PRISM_…` variable)
//! and the validated [`RouterConfig`] that [`crate::run`] takes.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;

use crate::auth::{ApiKeyArgs, ApiKeyEntry};

/// Errors found while validating the router's flags.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A `--static-route` value is not `MODEL=ENDPOINT`.
    #[error("--static-route expects MODEL=ENDPOINT, got {0:?}")]
    StaticRoute(String),
    /// Neither a head nor a static route was given.
    #[error("give --head (head gRPC address) or at least one --static-route")]
    NoRouteSource,
    /// A numeric flag is out of range.
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    /// `--worker-header-timeout` below one second.
    #[error("--worker-header-timeout must be at least 1 second")]
    HeaderTimeout,
    /// `--prefix-cache-weight` negative or not a number.
    #[error("--prefix-cache-weight must be a finite number >= 0")]
    PrefixWeight,
    /// The API keys (`--api-key`, `--api-key-file`, the limits).
    #[error(transparent)]
    Keys(#[from] crate::auth::KeyConfigError),
    /// The TLS flags or files (`--tls-*`, `--public-tls-*`).
    #[error(transparent)]
    Tls(#[from] prism_common::tls::TlsError),
}

/// Default `--prefix-cache-weight`: an uncached prompt token costs prefill compute now and
/// KV memory after, a token in flight mostly the latter (`balance/prefix.rs` explains the cost).
pub const DEFAULT_PREFIX_CACHE_WEIGHT: f64 = 2.0;

/// Default `--max-prompts-per-request`: the default admission queue's length
/// (`--max-queued-requests`), so that a batch alone fits the queue of a busy model.
pub const DEFAULT_MAX_PROMPTS: usize = 1024;

/// How the router chooses among a model's replicas (`--routing-policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RoutingPolicy {
    /// Power of two choices on load (tokens in flight).
    P2c,
    /// Cache-aware: the replica whose prefix cache holds most of the prompt, against load,
    /// with a load guard (`balance/prefix.rs`); P2C for replicas without a prompt codec.
    PrefixAware,
}

/// Command-line flags of `prism-router`.
#[derive(Debug, Clone, Parser)]
#[command(name = "prism-router", version, about = "Prism router: OpenAI HTTP + gRPC inference front end")]
pub struct Args {
    /// Head gRPC address(es) to watch routes from, e.g. http://head:50050 (repeatable or comma separated).
    #[arg(long = "head", env = "PRISM_HEAD", value_delimiter = ',')]
    pub head: Vec<String>,
    /// The token this router presents to the head (role `router`).
    #[command(flatten)]
    pub head_token: prism_common::head_auth::HeadTokenArgs,
    /// HTTP listen address (OpenAI API, /health, /healthz, /readyz, /metrics).
    #[arg(long = "http-listen", env = "PRISM_ROUTER_HTTP_LISTEN", default_value = "0.0.0.0:8000")]
    pub http_listen: SocketAddr,
    /// HTTP port; overrides the port of --http-listen when set (vLLM's `--port`).
    #[arg(long = "port", env = "PRISM_ROUTER_PORT")]
    pub port: Option<u16>,
    /// gRPC listen address (`prism.v1.InferenceService`, health, reflection).
    #[arg(long = "grpc-listen", env = "PRISM_ROUTER_GRPC_LISTEN", default_value = "0.0.0.0:50051")]
    pub grpc_listen: SocketAddr,
    /// API keys and their limits; when none is given, requests need no key.
    #[command(flatten)]
    pub keys: ApiKeyArgs,
    /// Largest accepted request body in bytes; larger bodies get 413 before parsing.
    #[arg(long = "max-body-bytes", env = "PRISM_MAX_BODY_BYTES", default_value_t = 4 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// Default per-request deadline in seconds (a request's own `timeout_ms` may shorten it).
    #[arg(long = "request-timeout", env = "PRISM_REQUEST_TIMEOUT", default_value_t = 600.0)]
    pub request_timeout_s: f64,
    /// Requests in flight per replica before it counts as full, for replicas that report no
    /// capacity (`max_num_seqs`) and whose deployment sets no `max_in_flight`.
    #[arg(long = "max-in-flight-per-replica", env = "PRISM_MAX_IN_FLIGHT_PER_REPLICA", default_value_t = 256)]
    pub max_in_flight_per_replica: u32,
    /// Requests per model that may wait in the admission queue while every Ready replica is
    /// at its limit (or none is Ready yet); past it: 429 with Retry-After. 0 = no queue.
    #[arg(long = "max-queued-requests", env = "PRISM_MAX_QUEUED_REQUESTS", default_value_t = 1024)]
    pub max_queued_requests: u32,
    /// Estimated tokens (prompt + max_tokens × n) per model that may wait in the admission
    /// queue; past it: 429 with Retry-After.
    #[arg(long = "max-queued-tokens", env = "PRISM_MAX_QUEUED_TOKENS", default_value_t = 4 << 20)]
    pub max_queued_tokens: u64,
    /// Longest wait in the admission queue, in seconds (a request's own deadline may end it
    /// sooner); past it: 429, or 503 when the model still has no Ready replica.
    #[arg(long = "max-queue-wait", env = "PRISM_MAX_QUEUE_WAIT", default_value_t = 30.0)]
    pub max_queue_wait_s: f64,
    /// Most prompts in one `/v1/completions` request (`"prompt": [...]`, a batch answered with
    /// choices indexed `prompt_index * n + j`); past it: 400 `prompt`. Each prompt is admitted
    /// as its own request, so a batch larger than the admission queue can hold while replicas
    /// are busy gets 429.
    #[arg(long = "max-prompts-per-request", env = "PRISM_MAX_PROMPTS_PER_REQUEST", default_value_t = DEFAULT_MAX_PROMPTS)]
    pub max_prompts_per_request: usize,
    /// Fixed route `MODEL=ENDPOINT` (repeatable), bypassing the head; e.g. `smol=http://127.0.0.1:50061`.
    #[arg(long = "static-route", env = "PRISM_STATIC_ROUTE", value_delimiter = ',')]
    pub static_route: Vec<String>,
    /// Seconds a replica stays out of rotation after its first UNAVAILABLE/timeout (doubles per failure, max 30 s).
    #[arg(long = "ejection-base", env = "PRISM_EJECTION_BASE", default_value_t = 2.0)]
    pub ejection_base_s: f64,
    /// Seconds a worker may take to send response headers for a request before its replica
    /// counts as unresponsive (ejected, request retried elsewhere); at least 1. A request's own
    /// deadline never ejects a replica.
    #[arg(long = "worker-header-timeout", env = "PRISM_ROUTER_WORKER_HEADER_TIMEOUT", default_value_t = 2.0)]
    pub worker_header_timeout_s: f64,
    /// Seconds an HTTP client has to send a request head; a connection still sending it
    /// after that is closed (half-sent requests cannot hold connections).
    #[arg(long = "http-header-read-timeout", env = "PRISM_ROUTER_HTTP_HEADER_READ_TIMEOUT", default_value_t = 10.0)]
    pub http_header_read_timeout_s: f64,
    /// Replica choice: `prefix-aware` (the longest prompt prefix already in a replica's prefix
    /// cache, weighed against load; load alone where replicas have no prompt codec) or `p2c`
    /// (power of two choices on load).
    #[arg(long = "routing-policy", env = "PRISM_ROUTING_POLICY", value_enum, default_value = "prefix-aware")]
    pub routing_policy: RoutingPolicy,
    /// Prefix-aware routing: cost of one prompt token to prefill against one token in flight
    /// (higher keeps requests with their cached prefix under more load imbalance; 0 = load alone).
    #[arg(long = "prefix-cache-weight", env = "PRISM_PREFIX_CACHE_WEIGHT", default_value_t = DEFAULT_PREFIX_CACHE_WEIGHT)]
    pub prefix_cache_weight: f64,
    /// The format tool calls are parsed from (vLLM's `--tool-call-parser`): `auto` (by the
    /// model's chat template: `<tool_call>` → hermes, the Llama 3 format → llama3_json,
    /// otherwise hermes), `hermes`, or `llama3_json`.
    #[arg(long = "tool-call-parser", env = "PRISM_TOOL_CALL_PARSER", value_enum, default_value = "auto")]
    pub tool_call_parser: crate::tools::ParserChoice,
    /// Mutual TLS toward the head and the workers (the router's identity).
    #[command(flatten)]
    pub tls: prism_common::tls::TlsArgs,
    /// Server-only TLS on the public HTTP and gRPC listeners.
    #[command(flatten)]
    pub public_tls: prism_common::tls::PublicTlsArgs,
}

/// One `--static-route` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticRoute {
    /// Served model name.
    pub model: String,
    /// Worker gRPC endpoint, e.g. `http://127.0.0.1:50061`.
    pub endpoint: String,
}

impl std::str::FromStr for StaticRoute {
    type Err = ConfigError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (model, endpoint) = s.split_once('=').ok_or_else(|| ConfigError::StaticRoute(s.to_owned()))?;
        if model.is_empty() || endpoint.is_empty() {
            return Err(ConfigError::StaticRoute(s.to_owned()));
        }
        let endpoint = if endpoint.contains("://") { endpoint.to_owned() } else { format!("http://{endpoint}") };
        Ok(Self { model: model.to_owned(), endpoint })
    }
}

/// Validated router configuration.
#[derive(Debug, Clone)]
pub struct RouterConfig {
    /// Head gRPC endpoints (with scheme); empty = static routes only.
    pub heads: Vec<String>,
    /// The token presented to the head for route watches and demand reports (none: an open head).
    pub head_token: prism_common::head_auth::HeadCredential,
    /// Accepted API keys with their limits; empty = no authentication (`Debug` hides them).
    pub api_keys: Vec<ApiKeyEntry>,
    /// Whether `/metrics` needs no key when keys are set.
    pub metrics_without_auth: bool,
    /// Body size limit in bytes (413 above it).
    pub max_body_bytes: usize,
    /// Default per-request deadline.
    pub request_timeout: Duration,
    /// Per-replica in-flight request limit of replicas that report no capacity.
    pub max_in_flight_per_replica: u32,
    /// Most requests waiting per model in the admission queue (0 = no queue).
    pub max_queued_requests: u32,
    /// Most estimated tokens waiting per model in the admission queue.
    pub max_queued_tokens: u64,
    /// Longest wait of a request in the admission queue.
    pub max_queue_wait: Duration,
    /// Most prompts in one completion request.
    pub max_prompts_per_request: usize,
    /// Fixed routes (replica ids `static-{model}-{i}`).
    pub static_routes: Vec<StaticRoute>,
    /// First ejection period of a failing replica.
    pub ejection_base: Duration,
    /// Longest wait for a worker's response headers before its replica counts as unresponsive.
    pub worker_header_timeout: Duration,
    /// Time an HTTP client has to send a request head.
    pub http_header_read_timeout: Duration,
    /// How replicas are chosen.
    pub routing_policy: RoutingPolicy,
    /// Prefix-aware routing's weight of an uncached prompt token.
    pub prefix_cache_weight: f64,
    /// The tool-call parser (`--tool-call-parser`).
    pub tool_call_parser: crate::tools::ParserChoice,
    /// TLS identity of the public HTTP and gRPC listeners (`None`: plaintext).
    pub public_tls: Option<std::sync::Arc<prism_common::tls::Tls>>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            heads: Vec::new(),
            head_token: prism_common::head_auth::HeadCredential::None,
            api_keys: Vec::new(),
            metrics_without_auth: false,
            max_body_bytes: 4 * 1024 * 1024,
            request_timeout: Duration::from_secs(600),
            max_in_flight_per_replica: 256,
            max_queued_requests: 1024,
            max_queued_tokens: 4 << 20,
            max_queue_wait: Duration::from_secs(30),
            max_prompts_per_request: DEFAULT_MAX_PROMPTS,
            static_routes: Vec::new(),
            ejection_base: Duration::from_secs(2),
            worker_header_timeout: Duration::from_secs(2),
            http_header_read_timeout: Duration::from_secs(10),
            routing_policy: RoutingPolicy::PrefixAware,
            prefix_cache_weight: DEFAULT_PREFIX_CACHE_WEIGHT,
            tool_call_parser: crate::tools::ParserChoice::Auto,
            public_tls: None,
        }
    }
}

impl Args {
    /// The HTTP listen address after applying `--port`.
    pub fn http_addr(&self) -> SocketAddr {
        let mut a = self.http_listen;
        if let Some(p) = self.port {
            a.set_port(p);
        }
        a
    }

    /// Validates the flags into a [`RouterConfig`].
    ///
    /// # Errors
    /// [`ConfigError`] for a malformed static route, no route source, zero limits, or bad
    /// API keys (an unreadable or malformed key file).
    pub fn into_config(self) -> Result<RouterConfig, ConfigError> {
        let static_routes = self.static_route.iter().map(|s| s.parse()).collect::<Result<Vec<StaticRoute>, _>>()?;
        if self.head.is_empty() && static_routes.is_empty() {
            return Err(ConfigError::NoRouteSource);
        }
        if self.max_body_bytes == 0 {
            return Err(ConfigError::Zero("--max-body-bytes"));
        }
        if self.max_in_flight_per_replica == 0 {
            return Err(ConfigError::Zero("--max-in-flight-per-replica"));
        }
        if self.max_prompts_per_request == 0 {
            return Err(ConfigError::Zero("--max-prompts-per-request"));
        }
        if self.max_queued_tokens == 0 {
            return Err(ConfigError::Zero("--max-queued-tokens"));
        }
        if !(self.max_queue_wait_s > 0.0 && self.max_queue_wait_s.is_finite()) {
            return Err(ConfigError::Zero("--max-queue-wait"));
        }
        if self.request_timeout_s.is_nan() || self.request_timeout_s <= 0.0 {
            return Err(ConfigError::Zero("--request-timeout"));
        }
        if !(self.http_header_read_timeout_s > 0.0 && self.http_header_read_timeout_s.is_finite()) {
            return Err(ConfigError::Zero("--http-header-read-timeout"));
        }
        if !(self.worker_header_timeout_s >= 1.0 && self.worker_header_timeout_s.is_finite()) {
            return Err(ConfigError::HeaderTimeout);
        }
        if !(self.prefix_cache_weight >= 0.0 && self.prefix_cache_weight.is_finite()) {
            return Err(ConfigError::PrefixWeight);
        }
        let heads = self.head.into_iter().map(|h| if h.contains("://") { h } else { format!("http://{h}") }).collect();
        Ok(RouterConfig {
            heads,
            head_token: self.head_token.credential(),
            api_keys: self.keys.entries()?,
            metrics_without_auth: self.keys.metrics_without_auth,
            max_body_bytes: self.max_body_bytes,
            request_timeout: Duration::from_secs_f64(self.request_timeout_s),
            max_in_flight_per_replica: self.max_in_flight_per_replica,
            max_queued_requests: self.max_queued_requests,
            max_queued_tokens: self.max_queued_tokens,
            max_queue_wait: Duration::from_secs_f64(self.max_queue_wait_s),
            max_prompts_per_request: self.max_prompts_per_request,
            static_routes,
            ejection_base: Duration::from_secs_f64(self.ejection_base_s.max(0.01)),
            worker_header_timeout: Duration::from_secs_f64(self.worker_header_timeout_s),
            http_header_read_timeout: Duration::from_secs_f64(self.http_header_read_timeout_s),
            routing_policy: self.routing_policy,
            prefix_cache_weight: self.prefix_cache_weight,
            tool_call_parser: self.tool_call_parser,
            public_tls: self.public_tls.load(self.tls.tls_reload_interval, true)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn static_route_parses_and_adds_scheme() {
        let r: StaticRoute = "smol=127.0.0.1:50061".parse().expect("valid");
        assert_eq!(r, StaticRoute { model: "smol".into(), endpoint: "http://127.0.0.1:50061".into() });
        assert!("nomodel".parse::<StaticRoute>().is_err());
        assert!("=x".parse::<StaticRoute>().is_err());
    }

    #[test]
    fn args_need_a_route_source() {
        let a = Args::parse_from(["prism-router"]);
        assert!(matches!(a.into_config(), Err(ConfigError::NoRouteSource)));
        let a = Args::parse_from(["prism-router", "--head", "head:50050", "--port", "9000"]);
        assert_eq!(a.http_addr().port(), 9000);
        let c = a.into_config().expect("valid");
        assert_eq!(c.heads, vec!["http://head:50050".to_owned()]);
        assert_eq!(c.max_body_bytes, 4 * 1024 * 1024);
        let d = RouterConfig::default();
        assert_eq!((c.max_queued_requests, c.max_queued_tokens), (d.max_queued_requests, d.max_queued_tokens));
        assert_eq!(c.max_queue_wait, Duration::from_secs(30));
    }

    #[test]
    fn routing_policy_flag() {
        let base = ["prism-router", "--head", "h:1"];
        let c = Args::parse_from(base).into_config().expect("valid");
        assert_eq!(c.routing_policy, RoutingPolicy::PrefixAware, "cache-aware by default");
        let a = Args::parse_from(base.iter().copied().chain(["--routing-policy", "p2c"]));
        assert_eq!(a.into_config().expect("valid").routing_policy, RoutingPolicy::P2c);
        assert!(Args::try_parse_from(base.iter().copied().chain(["--routing-policy", "nearest"])).is_err());
        let a = Args::parse_from(base.iter().copied().chain(["--prefix-cache-weight=-1"]));
        assert!(matches!(a.into_config(), Err(ConfigError::PrefixWeight)));
    }

    #[test]
    fn api_key_flags_reach_the_config_and_a_bad_key_file_is_an_error() {
        let base = ["prism-router", "--head", "h:1"];
        let a = Args::parse_from(base.iter().copied().chain(["--api-key", "sk-1,sk-2", "--metrics-without-auth"]));
        let c = a.into_config().expect("valid");
        assert_eq!(c.api_keys.iter().map(|k| k.key.as_str()).collect::<Vec<_>>(), ["sk-1", "sk-2"]);
        assert!(c.metrics_without_auth);
        assert!(!format!("{c:?}").contains("sk-1"), "Debug of the config shows a key");
        let a = Args::parse_from(base.iter().copied().chain(["--api-key-file", "/nonexistent/keys"]));
        let err = a.into_config().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("--api-key-file /nonexistent/keys"), "{err}");
    }

    #[test]
    fn queue_flags_parse_and_are_checked() {
        let base = ["prism-router", "--head", "h:1"];
        let a = Args::parse_from(base.iter().copied().chain(["--max-queued-requests", "0", "--max-queue-wait", "2.5"]));
        let c = a.into_config().expect("0 queued requests = no queue");
        assert_eq!((c.max_queued_requests, c.max_queue_wait), (0, Duration::from_millis(2500)));
        let a = Args::parse_from(base.iter().copied().chain(["--max-queue-wait", "0"]));
        assert!(matches!(a.into_config(), Err(ConfigError::Zero("--max-queue-wait"))));
        let a = Args::parse_from(base.iter().copied().chain(["--max-queued-tokens", "0"]));
        assert!(matches!(a.into_config(), Err(ConfigError::Zero("--max-queued-tokens"))));
    }
}
