//! The route table: which replicas serve which model, where, and in what state.
//!
//! Filled from the head's `WatchRoutes` stream (each message is the whole table) or from
//! `--static-route` flags. When the head is unreachable the last table stays in use (fail
//! static) while a background task reconnects with exponential backoff. Per-replica runtime
//! state (requests and tokens in flight counted from dispatch, ejection after failures) lives
//! in [`ReplicaStats`], kept across table updates so the load guards of requests in flight
//! (`balance::DispatchGuard`) stay attached. Every update bumps a [`tokio::sync::watch`]
//! counter ([`Routes::subscribe`]) so requests waiting on a replica learn at once when it
//! leaves the table. The head also names the models that no replica is coming to serve,
//! with why ([`RouteSnapshot::unavailable`]): requests for them are answered at once.
//! [`RouteSnapshot::readiness`] says whether the router can take requests at all. What each
//! deployment's spec says of its model ([`ModelSettings`]: configured context length, codec
//! id) is known with no replica too, and the last prompt codec of a model is kept while its
//! codec id is unchanged ([`served`]).

pub mod served;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use dashmap::DashMap;
use prism_common::head_auth::{HeadCredential, head_client};
use prism_common::proto::v1::{ReplicaState, RouteTable, UnavailableCause, WatchRoutesRequest};
use prism_engine::codec::PromptCodec;
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::balance::capacity::replica_limit;
use crate::config::StaticRoute;
use crate::prefix::ReplicaCache;
pub use served::ModelSettings;

/// How long a lower-term table must be held by the head answering as leader before it is
/// applied anyway (longer than any lease TTL a deposed head needs to notice).
const STALE_TERM_GRACE: Duration = Duration::from_secs(30);
use crate::metrics::Metrics;

/// Longest time a replica is kept out of rotation after repeated failures.
const MAX_EJECTION: Duration = Duration::from_secs(30);

/// Runtime counters of one replica, owned by the router (not the head).
#[derive(Debug, Default)]
pub struct ReplicaStats {
    /// Requests dispatched and not finished.
    pub in_flight: AtomicU32,
    /// Prompt + expected decode tokens of those requests.
    pub tokens: AtomicU64,
    /// Prompt tokens of those requests expected in the replica's prefix cache at dispatch
    /// (cache-aware routing; their K/V is shared, not computed again).
    pub cached_tokens: AtomicU64,
    /// Requests ever dispatched here (tests, debugging).
    pub dispatched: AtomicU64,
    /// Dispatches decayed with a half-life of [`RECENT_HALF_LIFE`]: the replica's recent share
    /// of this router's traffic (cache-aware routing's balance guard).
    recent: std::sync::Mutex<Option<(f64, Instant)>>,
    failures: AtomicU32,
    ejected_until_ms: AtomicU64,
}

/// Half-life of [`ReplicaStats::recent_dispatches`].
pub const RECENT_HALF_LIFE: Duration = Duration::from_secs(20);

impl ReplicaStats {
    /// Counts one dispatch in the decayed count.
    pub fn record_dispatch(&self, now: Instant) {
        let mut g = self.recent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let v = g.map_or(0.0, |(v, at)| decay(v, at, now));
        *g = Some((v + 1.0, now));
    }

    /// Dispatches here, each weighted by `0.5^(age / RECENT_HALF_LIFE)`.
    pub fn recent_dispatches(&self, now: Instant) -> f64 {
        let g = self.recent.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        g.map_or(0.0, |(v, at)| decay(v, at, now))
    }

    /// Whether the replica is out of rotation at `now_ms` (ms since the router's epoch).
    pub fn is_ejected(&self, now_ms: u64) -> bool {
        self.ejected_until_ms.load(Ordering::Relaxed) > now_ms
    }

    /// Whether the replica is back from an ejection with no success since (half-open): it
    /// takes one request at a time until one succeeds (`balance::select`), so a replica still
    /// down fails one request when its ejection ends, not every request that waited for it.
    pub fn on_probation(&self) -> bool {
        self.failures.load(Ordering::Relaxed) != 0
    }

    /// Takes the replica out of rotation for `base * 2^(failures-1)` (at most 30 s). A failure
    /// while it is out already (a request sent before the ejection, failing with the same
    /// outage) neither counts nor lengthens the period: one outage that fails many requests at
    /// once must not eject the replica for the longest period.
    pub fn record_failure(&self, now_ms: u64, base: Duration) {
        if self.is_ejected(now_ms) {
            return;
        }
        let n = self.failures.fetch_add(1, Ordering::Relaxed).min(16);
        let period = base.saturating_mul(1u32 << n).min(MAX_EJECTION);
        let until = now_ms + u64::try_from(period.as_millis()).unwrap_or(u64::MAX / 2);
        self.ejected_until_ms.fetch_max(until, Ordering::Relaxed);
    }

    /// Puts the replica back in rotation and resets its failure count.
    pub fn record_success(&self) {
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
            self.ejected_until_ms.store(0, Ordering::Relaxed);
        }
    }
}

fn decay(v: f64, at: Instant, now: Instant) -> f64 {
    v * 0.5f64.powf(now.saturating_duration_since(at).as_secs_f64() / RECENT_HALF_LIFE.as_secs_f64())
}

/// One replica in the table.
#[derive(Debug)]
pub struct ReplicaRoute {
    /// Replica id (sent to the worker in `WorkerGenerateRequest.replica_id`).
    pub replica_id: String,
    /// Served model name.
    pub model: String,
    /// Worker gRPC endpoint.
    pub endpoint: String,
    /// Ready or Draining (Draining gets no new work).
    pub state: ReplicaState,
    /// Tokens in flight according to the worker's last load report.
    pub reported_tokens: u64,
    /// Requests waiting on the worker according to its last load report.
    pub reported_waiting: u32,
    /// Admission limit (requests in flight from this router) for this replica, from the
    /// route's override or its reported capacity (`balance::capacity::replica_limit`).
    pub max_in_flight: u32,
    /// Context length, 0 = unknown.
    pub max_model_len: u32,
    /// Its deployment's codec id when it was created for the current spec, else 0
    /// (`RouteEntry.codec_id`).
    pub codec_id: u64,
    /// Router-side counters, shared across table versions.
    pub stats: Arc<ReplicaStats>,
    /// Its prompt codec and prefix index (cache-aware routing), shared across table versions.
    pub cache: Arc<ReplicaCache>,
}

impl ReplicaRoute {
    /// Whether new work may go here (Ready in the table).
    pub fn is_ready(&self) -> bool {
        self.state == ReplicaState::Ready
    }
}

/// Why no replica of a model is coming: the head's `RouteTable.unavailable` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelUnavailable {
    /// The deployment serving the model.
    pub deployment: String,
    /// Why (`Unspecified`, from a head that predates the causes, is read as `Failed`).
    pub cause: UnavailableCause,
    /// A Failed replica's reason as its worker reported it, or a Pending replica's as the
    /// placer found it (may be empty).
    pub reason: String,
}

/// Why the router cannot take requests now (`/readyz`, `/health`, `grpc.health.v1`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReady {
    /// No route table came from the head yet (and no static route was given).
    #[error("no route table from the head yet")]
    NoTable,
    /// The table names no model: nothing is deployed.
    #[error("no model is deployed")]
    NoModel,
    /// Every model is unavailable (failed, scaled to 0, no node can run it): named here.
    #[error("no model can serve or is on its way (unavailable: {})", .0.join(", "))]
    NoneCanServe(Vec<String>),
}

/// An immutable version of the table.
#[derive(Debug, Default)]
pub struct RouteSnapshot {
    /// Head's table version (0 for static routes / nothing received yet).
    pub version: u64,
    /// Leadership term of the head that published it (0 for static routes / nothing yet).
    pub term: u64,
    /// Replicas by served model name.
    pub models: BTreeMap<String, Vec<Arc<ReplicaRoute>>>,
    /// Models that no replica is coming to serve, by served model name.
    pub unavailable: BTreeMap<String, Arc<ModelUnavailable>>,
    /// What each deployment's spec says of its model, by served model name.
    pub served: BTreeMap<String, ModelSettings>,
    /// Whether a table was ever received (or static routes were given).
    pub loaded: bool,
    /// Whether a head manages the table, replacing replicas that fail; false for static
    /// routes, where nothing replaces an endpoint that stops answering.
    pub managed: bool,
    /// Notified whenever a request admitted from this table releases its slot (shared by
    /// every snapshot of one [`Routes`]).
    pub released: Arc<Notify>,
}

impl RouteSnapshot {
    /// Whether at least one replica of some model is Ready.
    pub fn any_ready(&self) -> bool {
        self.models.values().flatten().any(|r| r.is_ready())
    }

    /// `model`'s context length: the largest its listed replicas report, else its
    /// deployment's configured `max_model_len`; 0 = unknown.
    pub fn max_model_len(&self, model: &str) -> u32 {
        let reported = self.models.get(model).and_then(|rs| rs.iter().map(|r| r.max_model_len).max());
        reported.filter(|&n| n > 0).unwrap_or_else(|| self.served.get(model).map_or(0, |s| s.max_model_len))
    }

    /// Whether `model` has a Ready replica (ejected ones included).
    pub fn has_ready(&self, model: &str) -> bool {
        self.models.get(model).is_some_and(|rs| rs.iter().any(|r| r.is_ready()))
    }

    /// Why `model` cannot be served, when the head says no replica of it is coming (and this
    /// table has no Ready replica of it): waiting would be for nothing.
    pub fn unavailable(&self, model: &str) -> Option<Arc<ModelUnavailable>> {
        self.unavailable.get(model).filter(|_| !self.has_ready(model)).cloned()
    }

    /// Whether the router can take requests: a table came (Ray Serve's proxies are not ready
    /// before their route table is populated either) and it holds a model that has a Ready
    /// replica or one on its way (loading, about to be placed, an autoscaled deployment at
    /// zero that a request scales up). Not "a Ready replica exists": a Service whose routers
    /// all went unready with only scaled-to-zero models would get no request to scale them up.
    ///
    /// # Errors
    /// [`NotReady`]: no table yet, no model, or every model unavailable.
    pub fn readiness(&self) -> Result<(), NotReady> {
        if !self.loaded {
            return Err(NotReady::NoTable);
        }
        if self.models.is_empty() {
            return Err(NotReady::NoModel);
        }
        if self.models.keys().any(|m| self.unavailable(m).is_none()) {
            return Ok(());
        }
        Err(NotReady::NoneCanServe(self.models.keys().cloned().collect()))
    }
}

struct Inner {
    snapshot: RwLock<Arc<RouteSnapshot>>,
    stats: DashMap<String, Arc<ReplicaStats>>,
    caches: DashMap<String, Arc<ReplicaCache>>,
    kept: served::KeptCodecs,
    epoch: Instant,
    default_max_in_flight: u32,
    metrics: Metrics,
    /// Bumped on every stored table (load-only updates included).
    updates: watch::Sender<u64>,
    /// See [`RouteSnapshot::released`].
    released: Arc<Notify>,
    /// The head whose `WatchRoutes` stream is delivering tables now (the leader).
    watched_head: RwLock<Option<String>>,
}

/// Shared handle on the route table (cheap `Clone`).
#[derive(Clone)]
pub struct Routes {
    inner: Arc<Inner>,
}

impl Routes {
    /// An empty table; `default_max_in_flight` applies to routes that give no limit.
    pub fn new(default_max_in_flight: u32, metrics: Metrics) -> Self {
        Self {
            inner: Arc::new(Inner {
                snapshot: RwLock::new(Arc::new(RouteSnapshot::default())),
                stats: DashMap::new(),
                caches: DashMap::new(),
                kept: served::KeptCodecs::default(),
                epoch: Instant::now(),
                default_max_in_flight,
                metrics,
                updates: watch::Sender::new(0),
                released: Arc::new(Notify::new()),
                watched_head: RwLock::new(None),
            }),
        }
    }

    /// Milliseconds since this table was created (the clock of ejections).
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.inner.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The current table.
    pub fn snapshot(&self) -> Arc<RouteSnapshot> {
        match self.inner.snapshot.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    /// A receiver woken by every table update (membership, state or load); its value is
    /// an update counter, not the head's version.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.inner.updates.subscribe()
    }

    /// Notified whenever a dispatched request releases its replica slot.
    pub fn released(&self) -> Arc<Notify> {
        Arc::clone(&self.inner.released)
    }

    /// The head endpoint whose route stream is live now (`None` while no head answers).
    pub fn watched_head(&self) -> Option<String> {
        match self.inner.watched_head.read() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }

    fn set_watched_head(&self, head: Option<String>) {
        match self.inner.watched_head.write() {
            Ok(mut g) => *g = head,
            Err(p) => *p.into_inner() = head,
        }
    }

    /// Keeps `codec`, fetched from a replica of `model` whose route carried `codec_id` (see
    /// [`served`]).
    pub fn keep_codec(&self, model: &str, codec_id: u64, codec: &Arc<PromptCodec>) {
        self.inner.kept.keep(model, codec_id, codec);
    }

    /// The codec kept for `model` that matches its codec id in `snap` (what its next replica
    /// loads), if any.
    pub fn kept_codec(&self, snap: &RouteSnapshot, model: &str) -> Option<Arc<PromptCodec>> {
        self.inner.kept.get(model, snap.served.get(model)?.codec_id)
    }

    /// Whether the current table lists `replica_id` (Ready or Draining) for `model`.
    pub fn lists(&self, model: &str, replica_id: &str) -> bool {
        self.snapshot().models.get(model).is_some_and(|rs| rs.iter().any(|r| r.replica_id == replica_id))
    }

    fn stats_for(&self, replica_id: &str) -> Arc<ReplicaStats> {
        self.inner.stats.entry(replica_id.to_owned()).or_default().clone()
    }

    fn cache_for(&self, replica_id: &str) -> Arc<ReplicaCache> {
        self.inner.caches.entry(replica_id.to_owned()).or_default().clone()
    }

    fn store(&self, snap: RouteSnapshot) {
        self.inner.metrics.route_version.set(snap.version);
        self.inner.metrics.route_term.set(snap.term);
        let replicas = snap.models.values().map(Vec::len).sum::<usize>();
        self.inner.metrics.route_replicas.set(u64::try_from(replicas).unwrap_or(u64::MAX));
        let snap = Arc::new(snap);
        match self.inner.snapshot.write() {
            Ok(mut g) => *g = snap,
            Err(p) => *p.into_inner() = snap,
        }
        self.inner.updates.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Installs fixed routes (`static-{model}-{i}` replica ids, all Ready).
    pub fn set_static(&self, routes: &[StaticRoute]) {
        let mut models: BTreeMap<String, Vec<Arc<ReplicaRoute>>> = BTreeMap::new();
        for (i, r) in routes.iter().enumerate() {
            let replica_id = format!("static-{}-{i}", r.model);
            let stats = self.stats_for(&replica_id);
            let cache = self.cache_for(&replica_id);
            models.entry(r.model.clone()).or_default().push(Arc::new(ReplicaRoute {
                replica_id,
                model: r.model.clone(),
                endpoint: r.endpoint.clone(),
                state: ReplicaState::Ready,
                reported_tokens: 0,
                reported_waiting: 0,
                max_in_flight: self.inner.default_max_in_flight,
                max_model_len: 0,
                codec_id: 0,
                stats,
                cache,
            }));
        }
        let (unavailable, served) = (BTreeMap::new(), BTreeMap::new());
        let released = self.released();
        let snap =
            RouteSnapshot { version: 0, term: 0, models, unavailable, served, loaded: true, managed: false, released };
        self.store(snap);
    }

    /// Replaces the table with one received from the head, unless it is stale: published in
    /// an older leadership term than the table in use (a deposed head that has not noticed
    /// yet), or an older version of the same term. Returns whether it was applied. Entries that
    /// are neither Ready nor Draining are dropped; models listed without entries stay known (no
    /// replica: 503); stats of replicas no longer listed are forgotten.
    pub fn apply(&self, table: RouteTable) -> bool {
        let cur = self.snapshot();
        if cur.loaded && (table.term < cur.term || table.term == cur.term && table.version < cur.version) {
            self.inner.metrics.stale_route_tables.inc();
            tracing::warn!(
                term = table.term,
                version = table.version,
                current_term = cur.term,
                current_version = cur.version,
                "route table from an older term ignored"
            );
            return false;
        }
        self.replace(table);
        true
    }

    /// Applies `table` whatever its term (see [`Routes::watch`]: a lower term that the only
    /// reachable leader keeps publishing means the store's revisions were reset).
    fn replace(&self, table: RouteTable) {
        // Deployed models with no usable replica stay known (503, not 404).
        let mut models: BTreeMap<String, Vec<Arc<ReplicaRoute>>> =
            table.models.into_iter().map(|m| (m, Vec::new())).collect();
        let unavailable: BTreeMap<String, Arc<ModelUnavailable>> = table
            .unavailable
            .into_iter()
            .map(|u| {
                let cause = match u.cause() {
                    UnavailableCause::Unspecified => UnavailableCause::Failed,
                    c => c,
                };
                (u.model, Arc::new(ModelUnavailable { deployment: u.deployment, cause, reason: u.reason }))
            })
            .collect();
        let served: BTreeMap<String, ModelSettings> = table
            .served
            .into_iter()
            .map(|s| (s.model, ModelSettings { max_model_len: s.max_model_len, codec_id: s.codec_id }))
            .collect();
        for model in unavailable.keys().chain(served.keys()) {
            models.entry(model.clone()).or_default();
        }
        for e in table.routes {
            let state = ReplicaState::try_from(e.state).unwrap_or(ReplicaState::Unspecified);
            if !matches!(state, ReplicaState::Ready | ReplicaState::Draining) || e.endpoint.is_empty() {
                continue;
            }
            let stats = self.stats_for(&e.replica_id);
            let cache = self.cache_for(&e.replica_id);
            let (reported_tokens, reported_waiting) =
                e.load.as_ref().map(|l| (l.tokens_in_flight, l.waiting)).unwrap_or((0, 0));
            let max_in_flight = replica_limit(e.max_in_flight, e.load.as_ref(), self.inner.default_max_in_flight);
            models.entry(e.model.clone()).or_default().push(Arc::new(ReplicaRoute {
                replica_id: e.replica_id,
                model: e.model,
                endpoint: e.endpoint,
                state,
                reported_tokens,
                reported_waiting,
                max_in_flight,
                max_model_len: e.max_model_len,
                codec_id: e.codec_id,
                stats,
                cache,
            }));
        }
        let live: std::collections::HashSet<&str> = models.values().flatten().map(|r| r.replica_id.as_str()).collect();
        // A replica's per-replica series go with its stats: once it is unlisted and idle (one
        // with requests in flight may still be counted, e.g. by a retry that picked it).
        self.inner.stats.retain(|k, v| {
            let keep = live.contains(k.as_str()) || v.in_flight.load(Ordering::Relaxed) > 0;
            if !keep {
                self.inner.metrics.forget_replica(k);
            }
            keep
        });
        // A replica that left takes its prefix index along (a replacement starts cold); its
        // codec stays while its model's codec id is unchanged.
        let prev = self.snapshot();
        let codecs = prev.models.values().flatten().map(|r| (r.model.as_str(), r.codec_id, r.cache.codec()));
        self.inner.kept.keep_from(codecs.map(|(m, id, c)| (m, id, c.map(|c| Arc::clone(&c.codec)))));
        self.inner.kept.retain_current(&served);
        self.inner.caches.retain(|k, _| live.contains(k.as_str()));
        // Load-only updates arrive about once a second per worker: log membership/state changes only.
        let key = |m: &BTreeMap<String, Vec<Arc<ReplicaRoute>>>| -> Vec<(String, i32)> {
            let mut v: Vec<_> = m.values().flatten().map(|r| (r.replica_id.clone(), r.state as i32)).collect();
            v.sort_unstable();
            v
        };
        if key(&self.snapshot().models) == key(&models) {
            tracing::debug!(version = table.version, replicas = live.len(), "route table updated (load)");
        } else {
            let draining = models.values().flatten().filter(|r| r.state == ReplicaState::Draining).count();
            tracing::info!(version = table.version, replicas = live.len(), draining, "route table updated");
        }
        if self.snapshot().unavailable != unavailable {
            let names: Vec<_> = unavailable.iter().map(|(m, u)| format!("{m} ({})", u.cause.as_str_name())).collect();
            tracing::info!(unavailable = ?names, "models no replica is coming to serve");
        }
        let released = self.released();
        let (version, term) = (table.version, table.term);
        self.store(RouteSnapshot { version, term, models, unavailable, served, loaded: true, managed: true, released });
    }

    /// Follows `WatchRoutes` on the given heads until `shutdown`, trying them in turn and
    /// reconnecting with exponential backoff (100 ms → 5 s). The last table stays in use
    /// while no head answers.
    pub async fn watch(
        self,
        heads: Vec<String>,
        router_id: String,
        credential: HeadCredential,
        shutdown: CancellationToken,
    ) {
        if heads.is_empty() {
            return;
        }
        let mut backoff = Duration::from_millis(100);
        let mut i = 0usize;
        loop {
            let head = heads[i % heads.len()].clone();
            i = i.wrapping_add(1);
            let attempt = async {
                let ep = tonic::transport::Endpoint::from_shared(head.clone())?
                    .connect_timeout(Duration::from_secs(3))
                    .http2_keep_alive_interval(Duration::from_secs(5))
                    .keep_alive_timeout(Duration::from_secs(5));
                let ch = prism_common::tls::client::channel(ep).await?;
                let mut client = head_client(ch, credential.bearer()?);
                let mut stream =
                    client.watch_routes(WatchRoutesRequest { router_id: router_id.clone() }).await?.into_inner();
                let mut got_any = false;
                self.set_watched_head(None);
                // A table of a lower term than the one in use, still held after
                // STALE_TERM_GRACE by the head that answers as leader, is applied: a deposed
                // head learns it within its lease TTL and ends the stream, so only a store
                // whose revisions were reset (restored from a snapshot) keeps one that long.
                let mut stale: Option<(tokio::time::Instant, RouteTable)> = None;
                loop {
                    let next = match &stale {
                        Some((since, _)) => {
                            match tokio::time::timeout_at(*since + STALE_TERM_GRACE, stream.message()).await {
                                Ok(m) => m?,
                                Err(_) => {
                                    if let Some((_, table)) = stale.take() {
                                        tracing::warn!(
                                            term = table.term,
                                            "the leader's lower term persists: applying it"
                                        );
                                        self.replace(table);
                                    }
                                    continue;
                                }
                            }
                        }
                        None => stream.message().await?,
                    };
                    let Some(table) = next else { break };
                    if !got_any {
                        self.set_watched_head(Some(head.clone()));
                    }
                    got_any = true;
                    if self.apply(table.clone()) {
                        stale = None;
                    } else {
                        let since = stale.as_ref().map_or_else(tokio::time::Instant::now, |(s, _)| *s);
                        stale = Some((since, table));
                    }
                }
                anyhow::Ok(got_any)
            };
            let res = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = attempt => r,
            };
            self.set_watched_head(None);
            match res {
                Ok(true) => backoff = Duration::from_millis(100),
                Ok(false) => {}
                Err(e) => tracing::warn!(head = %head, error = %e, "route watch failed; keeping the last table"),
            }
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_common::proto::v1::{LoadReport, RouteEntry};

    fn entry(id: &str, model: &str, state: ReplicaState) -> RouteEntry {
        RouteEntry {
            replica_id: id.into(),
            model: model.into(),
            endpoint: format!("http://{id}:1"),
            state: state as i32,
            load: Some(LoadReport { tokens_in_flight: 7, ..Default::default() }),
            ..Default::default()
        }
    }

    #[test]
    fn apply_keeps_ready_and_draining_and_stats() {
        let routes = Routes::new(4, Metrics::new());
        routes.apply(RouteTable {
            served: vec![],
            unavailable: vec![],
            term: 0,
            models: vec![],
            version: 3,
            routes: vec![
                entry("a", "m", ReplicaState::Ready),
                entry("b", "m", ReplicaState::Draining),
                entry("c", "m", ReplicaState::Starting),
            ],
        });
        let s = routes.snapshot();
        assert_eq!(s.version, 3);
        let m = &s.models["m"];
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].reported_tokens, 7);
        assert_eq!(m[0].max_in_flight, 4);
        m[0].stats.in_flight.store(2, Ordering::Relaxed);
        routes.apply(RouteTable {
            served: vec![],
            unavailable: vec![],
            term: 0,
            version: 4,
            routes: vec![entry("a", "m", ReplicaState::Ready)],
            models: vec!["gone".into()],
        });
        assert!(routes.snapshot().models["gone"].is_empty());
        assert_eq!(routes.snapshot().models["m"][0].stats.in_flight.load(Ordering::Relaxed), 2);
        assert!(routes.snapshot().any_ready());
    }

    #[test]
    fn updates_wake_subscribers_and_lists_follows_the_table() {
        let routes = Routes::new(4, Metrics::new());
        let mut rx = routes.subscribe();
        routes.apply(RouteTable {
            served: vec![],
            unavailable: vec![],
            term: 0,
            version: 1,
            routes: vec![entry("a", "m", ReplicaState::Ready)],
            models: vec![],
        });
        assert!(rx.has_changed().unwrap_or(false));
        rx.mark_unchanged();
        assert!(routes.lists("m", "a"));
        assert!(!routes.lists("other", "a"));
        routes.apply(RouteTable {
            served: vec![],
            unavailable: vec![],
            term: 0,
            version: 2,
            routes: vec![entry("a", "m", ReplicaState::Draining)],
            models: vec![],
        });
        assert!(rx.has_changed().unwrap_or(false));
        assert!(routes.lists("m", "a"), "a Draining replica stays listed");
        routes.apply(RouteTable {
            served: vec![],
            unavailable: vec![],
            term: 0,
            version: 3,
            routes: vec![entry("b", "m", ReplicaState::Ready)],
            models: vec![],
        });
        assert!(!routes.lists("m", "a"));
    }

    /// `prism_router_replica_dispatches_total` has a series per replica: one that leaves the
    /// table loses it once nothing is in flight on it, so replica churn does not grow it.
    #[test]
    fn a_replica_that_leaves_takes_its_dispatch_series_along() {
        let metrics = Metrics::new();
        let routes = Routes::new(4, metrics.clone());
        let table = |version, ids: &[&str]| RouteTable {
            served: vec![],
            unavailable: vec![],
            term: 0,
            version,
            routes: ids.iter().map(|id| entry(id, "m", ReplicaState::Ready)).collect(),
            models: vec!["m".into()],
        };
        let series = |id: &str| format!("prism_router_replica_dispatches_total{{replica_id=\"{id}\"}}");
        routes.apply(table(1, &["a", "b", "c"]));
        for id in ["a", "b", "c"] {
            metrics.dispatched(id);
        }
        routes.snapshot().models["m"][2].stats.in_flight.store(1, Ordering::Relaxed);
        routes.apply(table(2, &["b"]));
        let text = metrics.encode();
        assert!(!text.contains(&series("a")), "{text}");
        assert!(text.contains(&series("b")) && text.contains(&series("c")), "c still has a request in flight: {text}");
        let c = routes.inner.stats.get("c").map(|s| Arc::clone(s.value()));
        c.iter().for_each(|s| s.in_flight.store(0, Ordering::Relaxed));
        routes.apply(table(3, &["b"]));
        let text = metrics.encode();
        assert!(!text.contains(&series("c")) && text.contains(&series("b")), "{text}");
    }

    /// A deposed head that has not noticed yet may still send a table (an empty one, say):
    /// a table of an older term, or an older version of the current term, is ignored and
    /// counted; a newer term applies, even with an empty table (a leader with no replicas).
    #[test]
    fn tables_of_an_older_term_are_ignored() {
        let metrics = Metrics::new();
        let routes = Routes::new(4, metrics.clone());
        let table = |term, version, ids: &[&str]| RouteTable {
            served: vec![],
            unavailable: vec![],
            term,
            version,
            routes: ids.iter().map(|id| entry(id, "m", ReplicaState::Ready)).collect(),
            models: vec!["m".into()],
        };
        assert!(routes.apply(table(5, 100, &["a", "b"])));
        assert!(!routes.apply(table(4, 200, &[])), "older term, newer version: ignored");
        assert!(!routes.apply(table(5, 99, &["a"])), "same term, older version: ignored");
        assert!(routes.lists("m", "a") && routes.lists("m", "b"));
        assert_eq!(metrics.stale_route_tables.get(), 2);
        let s = routes.snapshot();
        assert_eq!((s.term, s.version), (5, 100));
        assert!(routes.apply(table(6, 101, &[])), "a newer leader's empty table applies");
        assert!(!routes.lists("m", "a"));
        assert_eq!(metrics.route_replicas.get(), 0);
        assert_eq!(metrics.route_term.get(), 6);
    }

    /// Ready means "can take requests": a table came and a model has a Ready replica or one
    /// on its way (a model listed with no replica and not unavailable: scale from zero,
    /// loading). A scaled-to-zero autoscaled model keeps the router ready; models that all
    /// are unavailable, an empty table and no table at all do not.
    #[test]
    fn readiness_needs_a_table_and_a_model_that_can_serve_or_is_coming() {
        use prism_common::proto::v1::UnavailableModel;
        let routes = Routes::new(4, Metrics::new());
        assert_eq!(routes.snapshot().readiness(), Err(NotReady::NoTable));
        let table = |version, ready: &[&str], unavailable: &[&str]| RouteTable {
            served: vec![],
            term: 0,
            version,
            models: vec!["m".into(), "n".into()],
            routes: ready.iter().map(|m| entry(&format!("r-{m}"), m, ReplicaState::Ready)).collect(),
            unavailable: unavailable
                .iter()
                .map(|m| UnavailableModel {
                    model: (*m).into(),
                    deployment: format!("{m}-dep"),
                    cause: UnavailableCause::ScaledToZero as i32,
                    reason: String::new(),
                })
                .collect(),
        };
        routes.apply(RouteTable { served: vec![], models: vec![], ..table(1, &[], &[]) });
        assert_eq!(routes.snapshot().readiness(), Err(NotReady::NoModel));
        routes.apply(table(2, &[], &[]));
        assert_eq!(routes.snapshot().readiness(), Ok(()), "no Ready replica, both on their way");
        routes.apply(table(3, &[], &["m"]));
        assert_eq!(routes.snapshot().readiness(), Ok(()), "n is on its way");
        routes.apply(table(4, &[], &["m", "n"]));
        assert_eq!(routes.snapshot().readiness(), Err(NotReady::NoneCanServe(vec!["m".into(), "n".into()])));
        routes.apply(table(5, &["m"], &["m", "n"]));
        assert_eq!(routes.snapshot().readiness(), Ok(()), "m still has a Ready replica");
        assert!(routes.snapshot().unavailable("m").is_none() && routes.snapshot().unavailable("n").is_some());
    }

    #[test]
    fn ejection_backs_off_and_resets() {
        let s = ReplicaStats::default();
        s.record_failure(1000, Duration::from_secs(1));
        assert!(s.is_ejected(1999));
        assert!(!s.is_ejected(2000));
        assert!(s.on_probation(), "back in rotation, one request at a time");
        s.record_failure(1999, Duration::from_secs(1));
        assert!(!s.is_ejected(2000), "a failure while ejected is the same outage: no longer period");
        s.record_failure(2000, Duration::from_secs(1));
        assert!(s.is_ejected(3999), "the next failure after the ejection doubles it");
        assert!(!s.is_ejected(4000));
        s.record_success();
        assert!(!s.is_ejected(2001) && !s.on_probation());
    }
}
