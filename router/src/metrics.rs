//! Router metrics (prometheus-client), all named `prism_…`: requests by outcome, request
//! duration, time to first token, retries, migrations, in-flight requests, the admission
//! queue (depth, tokens, wait, rejections per model), the route table version, and
//! cache-aware routing (decisions by reason, prompt tokens expected cached where routed,
//! tokenization time, each replica's prefix index size).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Outcome label values of `prism_router_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Finished normally.
    Ok,
    /// Rejected as invalid (4xx other than the ones below).
    BadRequest,
    /// Missing or wrong API key.
    Unauthenticated,
    /// Unknown model.
    NotFound,
    /// Every replica full (429).
    Overloaded,
    /// No ready replica or the worker was unavailable (503).
    Unavailable,
    /// Deadline exceeded.
    Timeout,
    /// The client went away.
    Cancelled,
    /// Any other failure.
    Error,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::BadRequest => "bad_request",
            Self::Unauthenticated => "unauthenticated",
            Self::NotFound => "not_found",
            Self::Overloaded => "overloaded",
            Self::Unavailable => "unavailable",
            Self::Timeout => "timeout",
            Self::Cancelled => "cancelled",
            Self::Error => "error",
        }
    }
}

/// Why the cache-aware policy chose a replica (the `reason` label of
/// `prism_router_routing_decisions_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouteReason {
    /// The replica holding the longest cached prefix of the prompt.
    PrefixHit,
    /// Nothing of the prompt is cached on any candidate: the least loaded.
    Cold,
    /// A replica with a longer cached prefix was passed over for load (the cost).
    Load,
    /// The replica with the longest cached prefix is loaded past the guard.
    LoadGuard,
    /// No candidate has a prompt codec (or the request no hashes): power of two choices.
    NoCodec,
}

impl RouteReason {
    fn as_str(self) -> &'static str {
        match self {
            Self::PrefixHit => "prefix_hit",
            Self::Cold => "cold",
            Self::Load => "load",
            Self::LoadGuard => "load_guard",
            Self::NoCodec => "no_codec",
        }
    }
}

/// All router metrics; cheap to clone (shared handles).
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    requests: Family<Vec<(String, String)>, Counter>,
    duration: Histogram,
    /// `prism_router_retries_total`: requests resubmitted to another replica before the first token.
    pub retries: Counter,
    /// `prism_router_migrations_total`: streams moved to another replica after the first token.
    pub migrations: Counter,
    /// `prism_router_in_flight`: requests being served now.
    pub in_flight: Gauge,
    /// `prism_route_table_version`: version of the route table in use.
    pub route_version: Gauge<u64, AtomicU64>,
    /// `prism_route_table_term`: leadership term of the head that published the table in use.
    pub route_term: Gauge<u64, AtomicU64>,
    /// `prism_route_table_replicas`: replicas (Ready or Draining) in the table in use.
    pub route_replicas: Gauge<u64, AtomicU64>,
    /// `prism_router_stale_route_tables_total`: tables ignored because an older term published them.
    pub stale_route_tables: Counter,
    /// `prism_router_replica_dispatches_total{replica_id}`: requests (and migrations) sent to each replica.
    dispatches: Family<Vec<(String, String)>, Counter>,
    /// `prism_router_time_to_first_token_seconds`: arrival at the router to the first worker
    /// message, admission queue time included.
    ttft: Histogram,
    /// `prism_router_queue_depth{model}`: requests waiting in the admission queue.
    queue_depth: Family<Vec<(String, String)>, Gauge>,
    /// `prism_router_queue_tokens{model}`: estimated tokens of those requests.
    queue_tokens: Family<Vec<(String, String)>, Gauge>,
    /// `prism_router_queue_wait_seconds`: time requests that queued spent in the queue.
    queue_wait: Histogram,
    /// `prism_router_queue_rejected_total{model,reason}`: requests refused by a queue bound.
    queue_rejected: Family<Vec<(String, String)>, Counter>,
    /// `prism_router_routing_decisions_total{policy,reason}`: cache-aware picks by reason.
    decisions: Family<Vec<(String, String)>, Counter>,
    /// `prism_router_prefix_cached_tokens_total`: prompt tokens expected cached on the
    /// replicas requests were routed to.
    prefix_cached: Counter,
    /// `prism_router_prefix_prompt_tokens_total`: prompt tokens of the requests routed with
    /// block hashes (the ratio of the two is the expected hit rate).
    prefix_prompt: Counter,
    /// `prism_router_prefix_tokenize_seconds`: tokenizing and hashing one prompt for routing.
    tokenize: Histogram,
    /// `prism_router_prefix_index_blocks{replica_id}`: block hashes a replica's prefix cache
    /// reported holding.
    index_blocks: Family<Vec<(String, String)>, Gauge>,
    /// `prism_router_prefix_expected_blocks{replica_id}`: hashes recorded at dispatch and not
    /// yet confirmed by the replica.
    expected_blocks: Family<Vec<(String, String)>, Gauge>,
    /// `prism_router_auth_rejected_total{reason}`: requests refused for their API key.
    auth_rejected: Family<Vec<(String, String)>, Counter>,
    /// `prism_router_rate_limited_total{key,limit}`: requests over a per-key limit (`key` is
    /// the key's label, never the key).
    rate_limited: Family<Vec<(String, String)>, Counter>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<Vec<(String, String)>, Counter>::default();
        let duration = Histogram::new(exponential_buckets(0.0005, 2.0, 22));
        let retries = Counter::default();
        let migrations = Counter::default();
        let in_flight = Gauge::default();
        let route_version = Gauge::<u64, AtomicU64>::default();
        let route_term = Gauge::<u64, AtomicU64>::default();
        let route_replicas = Gauge::<u64, AtomicU64>::default();
        let stale_route_tables = Counter::default();
        let dispatches = Family::<Vec<(String, String)>, Counter>::default();
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 18));
        let queue_depth = Family::<Vec<(String, String)>, Gauge>::default();
        let queue_tokens = Family::<Vec<(String, String)>, Gauge>::default();
        let queue_wait = Histogram::new(exponential_buckets(0.001, 2.0, 18));
        let queue_rejected = Family::<Vec<(String, String)>, Counter>::default();
        let decisions = Family::<Vec<(String, String)>, Counter>::default();
        let prefix_cached = Counter::default();
        let prefix_prompt = Counter::default();
        let tokenize = Histogram::new(exponential_buckets(0.00001, 2.0, 18));
        let index_blocks = Family::<Vec<(String, String)>, Gauge>::default();
        let expected_blocks = Family::<Vec<(String, String)>, Gauge>::default();
        let auth_rejected = Family::<Vec<(String, String)>, Counter>::default();
        let rate_limited = Family::<Vec<(String, String)>, Counter>::default();
        registry.register(
            "prism_router_auth_rejected",
            "Requests refused for a missing, malformed or unknown API key, by reason",
            auth_rejected.clone(),
        );
        registry.register(
            "prism_router_rate_limited",
            "Requests refused by a per-key limit (key: the key's label; limit: requests or tokens)",
            rate_limited.clone(),
        );
        registry.register("prism_router_requests", "Requests by outcome", requests.clone());
        registry.register(
            "prism_router_request_duration_seconds",
            "Request duration from arrival to last byte",
            duration.clone(),
        );
        registry.register("prism_router_retries", "Retries on another replica before the first token", retries.clone());
        registry.register(
            "prism_router_migrations",
            "Streams migrated to another replica mid-stream",
            migrations.clone(),
        );
        registry.register("prism_router_in_flight", "Requests being served", in_flight.clone());
        registry.register("prism_route_table_version", "Version of the route table in use", route_version.clone());
        registry.register("prism_route_table_term", "Leadership term of the table in use", route_term.clone());
        registry.register("prism_route_table_replicas", "Replicas in the route table in use", route_replicas.clone());
        registry.register(
            "prism_router_stale_route_tables",
            "Route tables ignored because a head of an older term published them",
            stale_route_tables.clone(),
        );
        registry.register(
            "prism_router_replica_dispatches",
            "Requests and migrations sent to each replica",
            dispatches.clone(),
        );
        registry.register(
            "prism_router_time_to_first_token_seconds",
            "Arrival at the router to the first worker message, admission queue time included",
            ttft.clone(),
        );
        registry.register("prism_router_queue_depth", "Requests waiting in the admission queue", queue_depth.clone());
        registry.register(
            "prism_router_queue_tokens",
            "Estimated prompt + decode tokens of the requests in the admission queue",
            queue_tokens.clone(),
        );
        registry.register(
            "prism_router_queue_wait_seconds",
            "Time requests that queued spent in the admission queue",
            queue_wait.clone(),
        );
        registry.register(
            "prism_router_queue_rejected",
            "Requests refused by an admission queue bound, by reason (full, tokens, timeout, deadline)",
            queue_rejected.clone(),
        );
        registry.register(
            "prism_router_routing_decisions",
            "Cache-aware routing decisions by reason (prefix_hit, cold, load, load_guard, no_codec)",
            decisions.clone(),
        );
        registry.register(
            "prism_router_prefix_cached_tokens",
            "Prompt tokens expected in the prefix cache of the replica each request was routed to",
            prefix_cached.clone(),
        );
        registry.register(
            "prism_router_prefix_prompt_tokens",
            "Prompt tokens of the requests routed by their block hashes",
            prefix_prompt.clone(),
        );
        registry.register(
            "prism_router_prefix_tokenize_seconds",
            "Time to tokenize and hash one prompt for cache-aware routing",
            tokenize.clone(),
        );
        registry.register(
            "prism_router_prefix_index_blocks",
            "Block hashes each replica's prefix cache reported holding",
            index_blocks.clone(),
        );
        registry.register(
            "prism_router_prefix_expected_blocks",
            "Block hashes recorded at dispatch and not yet confirmed by the replica",
            expected_blocks.clone(),
        );
        Self {
            registry: Arc::new(registry),
            requests,
            duration,
            retries,
            migrations,
            in_flight,
            route_version,
            route_term,
            route_replicas,
            stale_route_tables,
            dispatches,
            ttft,
            queue_depth,
            queue_tokens,
            queue_wait,
            queue_rejected,
            decisions,
            prefix_cached,
            prefix_prompt,
            tokenize,
            index_blocks,
            expected_blocks,
            auth_rejected,
            rate_limited,
        }
    }

    /// Counts one cache-aware decision: its reason, and the prompt tokens expected cached on
    /// the chosen replica out of `prompt`.
    pub fn routed(&self, reason: RouteReason, cached: u64, prompt: u64) {
        let l =
            vec![("policy".to_owned(), "prefix-aware".to_owned()), ("reason".to_owned(), reason.as_str().to_owned())];
        self.decisions.get_or_create(&l).inc();
        self.prefix_cached.inc_by(cached);
        self.prefix_prompt.inc_by(prompt);
    }

    /// Records the time one prompt took to tokenize and hash.
    pub fn tokenized(&self, seconds: f64) {
        self.tokenize.observe(seconds);
    }

    /// Sets the prefix index gauges of `replica_id`.
    pub fn set_prefix_index(&self, replica_id: &str, confirmed: usize, expected: usize) {
        let l = vec![("replica_id".to_owned(), replica_id.to_owned())];
        self.index_blocks.get_or_create(&l).set(i64::try_from(confirmed).unwrap_or(i64::MAX));
        self.expected_blocks.get_or_create(&l).set(i64::try_from(expected).unwrap_or(i64::MAX));
    }

    /// Drops the prefix index gauges of a replica that left the table.
    pub fn forget_prefix_index(&self, replica_id: &str) {
        let l = vec![("replica_id".to_owned(), replica_id.to_owned())];
        self.index_blocks.remove(&l);
        self.expected_blocks.remove(&l);
    }

    /// Sets the admission queue gauges of `model`: `depth` requests, `tokens` estimated tokens.
    pub fn set_queue(&self, model: &str, depth: usize, tokens: u64) {
        let l = vec![("model".to_owned(), model.to_owned())];
        self.queue_depth.get_or_create(&l).set(i64::try_from(depth).unwrap_or(i64::MAX));
        self.queue_tokens.get_or_create(&l).set(i64::try_from(tokens).unwrap_or(i64::MAX));
    }

    /// Records the time one request spent in the admission queue.
    pub fn queue_waited(&self, seconds: f64) {
        self.queue_wait.observe(seconds);
    }

    /// Counts one request of `model` refused by a queue bound (`reason`: full, tokens,
    /// timeout, deadline).
    pub fn queue_rejected(&self, model: &str, reason: &str) {
        self.queue_rejected
            .get_or_create(&vec![("model".to_owned(), model.to_owned()), ("reason".to_owned(), reason.to_owned())])
            .inc();
    }

    /// Records one finished request.
    pub fn observe(&self, outcome: Outcome, seconds: f64) {
        self.requests.get_or_create(&vec![("outcome".to_owned(), outcome.as_str().to_owned())]).inc();
        self.duration.observe(seconds);
    }

    /// Counts one dispatch (new request, retry or migration) to `replica_id`.
    pub fn dispatched(&self, replica_id: &str) {
        self.dispatches.get_or_create(&vec![("replica_id".to_owned(), replica_id.to_owned())]).inc();
    }

    /// Drops the dispatch counter of a replica that left the route table (with nothing in
    /// flight), so that replica churn does not grow the exposition without bound.
    pub fn forget_replica(&self, replica_id: &str) {
        self.dispatches.remove(&vec![("replica_id".to_owned(), replica_id.to_owned())]);
    }

    /// Counts a request refused for its API key.
    pub fn auth_rejected(&self, reason: &str) {
        self.auth_rejected.get_or_create(&vec![("reason".to_owned(), reason.to_owned())]).inc();
    }

    /// Counts a request refused by a per-key limit (`key`: the key's label).
    pub fn rate_limited(&self, key: &str, limit: &str) {
        self.rate_limited
            .get_or_create(&vec![("key".to_owned(), key.to_owned()), ("limit".to_owned(), limit.to_owned())])
            .inc();
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut s, &self.registry);
        s
    }
}

/// Counts one request in `prism_router_in_flight` while alive; on drop records its outcome
/// (`cancelled` when [`RequestTracker::set`] was never called, i.e. the client went away)
/// and duration.
pub struct RequestTracker {
    metrics: Metrics,
    start: std::time::Instant,
    outcome: Option<Outcome>,
}

impl RequestTracker {
    /// Starts tracking a request that arrived now.
    pub fn new(metrics: &Metrics) -> Self {
        metrics.in_flight.inc();
        Self { metrics: metrics.clone(), start: std::time::Instant::now(), outcome: None }
    }

    /// Sets the outcome recorded when the tracker drops.
    pub fn set(&mut self, outcome: Outcome) {
        self.outcome = Some(outcome);
    }

    /// Records the time to first token: from the request's arrival (so the admission queue
    /// counts) to now, when its first worker message came back.
    pub fn first_token(&self) {
        self.metrics.ttft.observe(self.start.elapsed().as_secs_f64());
    }
}

impl Drop for RequestTracker {
    fn drop(&mut self) {
        self.metrics.in_flight.dec();
        self.metrics.observe(self.outcome.unwrap_or(Outcome::Cancelled), self.start.elapsed().as_secs_f64());
    }
}
