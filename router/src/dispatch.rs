//! Dispatch: sends a request to a replica's worker and streams its answer back.
//!
//! - The replica comes from [`crate::balance::select`]; its load counts from this moment
//!   (a [`ReplicaLoadGuard`] held until the stream ends or the client leaves).
//! - Before the first token a failed replica (UNAVAILABLE, transport error, stale route) is
//!   retried once on another replica; UNAVAILABLE takes the replica out of rotation with
//!   exponential backoff (ejection).
//! - A replica that leaves the route table while a request waits for its first token (the
//!   head evicted it: its worker stopped heartbeating for `worker_timeout`, e.g. SIGSTOP or a
//!   partition, or it was stopped) fails that attempt at once with UNAVAILABLE, so it is
//!   retried elsewhere like any failure before the first token (nothing was streamed, so the
//!   retry is safe); dropping the worker stream cancels the request there. A Draining replica
//!   is still listed and keeps what it accepted (its worker finishes or hands it back).
//! - The deadline goes to the worker twice: `timeout_ms` in the request and the gRPC timeout.
//!   A request's own deadline (DEADLINE_EXCEEDED) never counts against a replica: a client
//!   asking for 1 ms must not eject replicas for everyone. A frozen replica (SIGSTOP, hung
//!   host: TCP still open) is found two other ways: (a) a worker answers a Generate call with
//!   response headers at once (the engine queues the request), so no headers within
//!   `header_timeout` (≥ 1 s) is UNAVAILABLE for that replica, retried elsewhere; (b) HTTP/2
//!   keep-alive pings on every worker channel, idle or not, fail a connection whose peer
//!   stops answering within [`KEEPALIVE_INTERVAL`] + [`KEEPALIVE_TIMEOUT`], which ends its
//!   streams with UNAVAILABLE (ejection, migration).
//! - After the first token the stream is pumped by a task; when the client drops the
//!   receiver the task drops the worker stream, which cancels the request on the worker.
//! - Mid-stream failure of a single-choice request is migrated (issue 7): the prompt plus the
//!   token ids generated so far are resubmitted to another replica (`prior_output_ids`) and
//!   the client's stream continues; usage then describes the whole request.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use prism_common::proto::v1::worker_service_client::WorkerServiceClient;
use prism_common::proto::v1::{
    FinishReason, GenerateRequest, GenerateResponse, Usage, WorkerGenerateRequest, generate_request,
};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status, Streaming};

use crate::balance::{BalancePolicy, ReplicaLoadGuard, RequestHint, SelectError, select};
use crate::metrics::Metrics;
use crate::routes::{ReplicaRoute, Routes};

/// Decode tokens assumed for the load estimate when a request sets no `max_tokens`.
const DEFAULT_EXPECTED_DECODE: u64 = 256;
/// At most this many migrations per request.
const MAX_MIGRATIONS: u32 = 3;
/// Longest wait of a stream to be migrated for a replica that can take it.
const MIGRATION_WAIT: Duration = Duration::from_secs(30);
/// Route-table poll period during that wait.
const MIGRATION_POLL: Duration = Duration::from_millis(50);
/// HTTP/2 PING period on worker channels (also while idle).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// A PING unanswered this long closes the worker connection (its streams fail UNAVAILABLE).
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

/// Why a request could not be served.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// No route knows this model (404).
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    /// The model exists but no replica can take work (503).
    #[error("no ready replica for model `{0}`")]
    NoReplica(String),
    /// Every replica is at its in-flight limit (429).
    #[error("every replica of the model is at its in-flight limit; retry later")]
    Overloaded,
    /// The request's deadline passed (504).
    #[error("the request deadline was exceeded")]
    DeadlineExceeded,
    /// The worker answered with this status.
    #[error("worker error: {}", .0.message())]
    Worker(Status),
}

/// A started request: the first worker message and a receiver for the rest.
pub struct Dispatched {
    /// The request id used on the worker.
    pub request_id: String,
    /// First message (already received, so errors before the first token are known).
    pub first: GenerateResponse,
    /// The remaining messages; dropping it cancels the request on the worker.
    pub rest: mpsc::Receiver<Result<GenerateResponse, DispatchError>>,
}

/// Timing knobs of the dispatcher.
#[derive(Debug, Clone)]
pub struct DispatchConfig {
    /// Deadline of a request that sets none (and the upper bound of those that do).
    pub default_timeout: Duration,
    /// First ejection period after a failure.
    pub ejection_base: Duration,
    /// Longest wait for a worker's response headers to a Generate call; past it (and before
    /// the request's own deadline) the replica counts as unresponsive: UNAVAILABLE, ejected,
    /// retried elsewhere.
    pub header_timeout: Duration,
}

/// Sends requests to workers (cheap `Clone`).
#[derive(Clone)]
pub struct Dispatcher {
    inner: Arc<Inner>,
}

struct Inner {
    routes: Routes,
    policy: Box<dyn BalancePolicy>,
    clients: DashMap<String, WorkerServiceClient<Channel>>,
    metrics: Metrics,
    cfg: DispatchConfig,
}

/// Whether a status before the first token is worth another replica.
fn retryable(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::Unknown | Code::NotFound | Code::ResourceExhausted | Code::Aborted)
}

/// Whether a status says the replica should leave rotation for a while. DEADLINE_EXCEEDED
/// is the request's own deadline and never counts (an unresponsive replica shows up as
/// UNAVAILABLE: header timeout or keep-alive failure).
fn ejects(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::Unknown | Code::NotFound)
}

fn hint_for(req: &GenerateRequest) -> RequestHint {
    let prompt = match &req.prompt {
        Some(generate_request::Prompt::Text(t)) => t.len() as u64 / 4 + 1,
        Some(generate_request::Prompt::TokenIds(t)) => t.ids.len() as u64,
        Some(generate_request::Prompt::Chat(c)) => c.messages.iter().map(|m| m.content.len() as u64 / 4 + 8).sum(),
        None => 0,
    };
    let sampling = req.sampling.as_ref();
    let decode =
        sampling.and_then(|s| s.max_tokens).and_then(|m| u64::try_from(m).ok()).unwrap_or(DEFAULT_EXPECTED_DECODE);
    let n = u64::from(sampling.and_then(|s| s.n).unwrap_or(1).max(1));
    RequestHint { expected_tokens: prompt + decode * n }
}

impl Dispatcher {
    /// A dispatcher over `routes` choosing replicas with `policy`.
    pub fn new(routes: Routes, policy: Box<dyn BalancePolicy>, metrics: Metrics, cfg: DispatchConfig) -> Self {
        Self { inner: Arc::new(Inner { routes, policy, clients: DashMap::new(), metrics, cfg }) }
    }

    /// The route table this dispatcher reads.
    pub fn routes(&self) -> &Routes {
        &self.inner.routes
    }

    /// The deadline of a request: its own `timeout_ms` capped by the default.
    pub fn deadline_for(&self, req: &GenerateRequest) -> Instant {
        let d = self.inner.cfg.default_timeout;
        let t = req.timeout_ms.filter(|&ms| ms > 0).map(Duration::from_millis).map_or(d, |t| t.min(d));
        Instant::now() + t
    }

    fn client(&self, endpoint: &str) -> Result<WorkerServiceClient<Channel>, Status> {
        if let Some(c) = self.inner.clients.get(endpoint) {
            return Ok(c.clone());
        }
        let ch = Endpoint::from_shared(endpoint.to_owned())
            .map_err(|_| Status::unavailable("invalid worker endpoint"))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true)
            .connect_lazy();
        let c = WorkerServiceClient::new(ch).max_decoding_message_size(64 * 1024 * 1024);
        self.inner.clients.insert(endpoint.to_owned(), c.clone());
        Ok(c)
    }

    fn pick(
        &self,
        model: &str,
        tried: &[String],
        hint: &RequestHint,
    ) -> Result<(Arc<ReplicaRoute>, ReplicaLoadGuard), DispatchError> {
        let snap = self.inner.routes.snapshot();
        let picked = select(&snap, model, tried, self.inner.routes.now_ms(), self.inner.policy.as_ref(), hint)
            .map_err(|e| match e {
                SelectError::UnknownModel => DispatchError::UnknownModel(model.to_owned()),
                SelectError::NoneReady => DispatchError::NoReplica(model.to_owned()),
                SelectError::AllFull => DispatchError::Overloaded,
            })?;
        self.inner.metrics.dispatched(&picked.0.replica_id);
        Ok(picked)
    }

    /// Opens the worker stream and waits for its first message.
    async fn start(
        &self,
        replica: &ReplicaRoute,
        req: &GenerateRequest,
        prior: &[u32],
        original_prompt_tokens: u32,
        deadline: Instant,
    ) -> Result<(Streaming<GenerateResponse>, GenerateResponse), Status> {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(Status::deadline_exceeded("deadline exceeded"));
        }
        let mut inner = req.clone();
        inner.timeout_ms = Some(u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX).max(1));
        let mut wreq = tonic::Request::new(WorkerGenerateRequest {
            replica_id: replica.replica_id.clone(),
            request: Some(inner),
            prior_output_ids: prior.to_vec(),
            original_prompt_tokens,
        });
        wreq.set_timeout(remaining);
        let mut client = self.client(&replica.endpoint)?;
        // Until the first token, an eviction of the replica by the head ends the attempt.
        let gone = self.left_routes(replica);
        tokio::pin!(gone);
        // Response headers: the request's deadline, or the header bound if that comes first.
        let header_by = Instant::now() + self.inner.cfg.header_timeout;
        let headers = tokio::select! {
            r = tokio::time::timeout_at(deadline.min(header_by), client.generate(wreq)) => r,
            () = &mut gone => return Err(left_routes_status()),
        };
        let mut s = match headers {
            Ok(r) => r.map_err(|e| past_deadline(e, deadline))?.into_inner(),
            Err(_) if header_by < deadline => {
                return Err(Status::unavailable("the replica sent no response headers in time (frozen?)"));
            }
            Err(_) => return Err(Status::deadline_exceeded("no answer from the replica before the deadline")),
        };
        let first = tokio::select! {
            r = tokio::time::timeout_at(deadline, s.message()) => r,
            // Returning drops `s`: the worker (if it ever runs again) cancels the request.
            () = &mut gone => return Err(left_routes_status()),
        };
        match first {
            Ok(Ok(Some(first))) => Ok((s, first)),
            Ok(Ok(None)) => Err(Status::unavailable("worker closed the stream before answering")),
            Ok(Err(e)) => Err(past_deadline(e, deadline)),
            Err(_) => Err(Status::deadline_exceeded("no answer from the replica before the deadline")),
        }
    }

    /// Resolves once the route table no longer lists `replica` (checked now and after every
    /// table update); pending forever while it stays listed, Draining included.
    async fn left_routes(&self, replica: &ReplicaRoute) {
        let routes = &self.inner.routes;
        // Subscribe before the first check so an update in between is not missed.
        let mut updates = routes.subscribe();
        loop {
            if !routes.lists(&replica.model, &replica.replica_id) {
                tracing::info!(replica = %replica.replica_id, "replica left the route table before the first token; attempt abandoned");
                return;
            }
            if updates.changed().await.is_err() {
                return std::future::pending().await; // the table is gone with the router
            }
        }
    }

    fn note_failure(&self, replica: &ReplicaRoute, s: &Status) {
        if ejects(s) {
            tracing::warn!(replica = %replica.replica_id, code = ?s.code(), "replica failed; out of rotation for a while");
            replica.stats.record_failure(self.inner.routes.now_ms(), self.inner.cfg.ejection_base);
        }
    }

    /// Starts `req` on a replica of its model (retrying once elsewhere before the first
    /// token) and returns its stream.
    ///
    /// # Errors
    /// [`DispatchError`]: unknown model, no ready replica, all full, deadline, or the
    /// worker's own status (e.g. INVALID_ARGUMENT for a prompt over the context length).
    pub async fn dispatch(&self, mut req: GenerateRequest) -> Result<Dispatched, DispatchError> {
        if req.request_id.is_empty() {
            req.request_id = uuid::Uuid::new_v4().to_string();
        }
        let deadline = self.deadline_for(&req);
        let hint = hint_for(&req);
        let mut tried: Vec<String> = Vec::new();
        let mut last: Option<Status> = None;
        loop {
            let (replica, guard) = match self.pick(&req.model, &tried, &hint) {
                Ok(p) => p,
                Err(e) => return Err(last.map_or(e, status_error)),
            };
            match self.start(&replica, &req, &[], 0, deadline).await {
                Ok((stream, first)) => {
                    replica.stats.record_success();
                    let (tx, rx) = mpsc::channel(32);
                    let mut pump = Pump {
                        dispatcher: self.clone(),
                        req: req.clone(),
                        deadline,
                        hint,
                        tried,
                        generated: first.token_ids.clone(),
                        prompt_tokens: first.prompt_tokens,
                        finished: 0,
                        migrations: 0,
                    };
                    pump.note(&first);
                    tokio::spawn(pump.run(stream, replica, guard, tx));
                    return Ok(Dispatched { request_id: req.request_id, first, rest: rx });
                }
                Err(s) => {
                    drop(guard);
                    self.note_failure(&replica, &s);
                    tried.push(replica.replica_id.clone());
                    if retryable(&s) && tried.len() < 2 && Instant::now() < deadline {
                        tracing::debug!(replica = %replica.replica_id, code = ?s.code(), "retrying on another replica");
                        self.inner.metrics.retries.inc();
                        last = Some(s);
                        continue;
                    }
                    return Err(status_error(s));
                }
            }
        }
    }
}

/// A worker's CANCELLED ("Timeout expired": its server enforcing the grpc-timeout we sent) at
/// or after the request's deadline is that deadline, not a replica failure.
fn past_deadline(s: Status, deadline: Instant) -> Status {
    if s.code() == Code::Cancelled && Instant::now() + Duration::from_millis(5) >= deadline {
        Status::deadline_exceeded("the request deadline was exceeded")
    } else {
        s
    }
}

/// The failure of an attempt whose replica was evicted before its first token: UNAVAILABLE
/// (retried elsewhere; the replica is gone from the table anyway).
fn left_routes_status() -> Status {
    Status::unavailable("the replica left the route table before its first token")
}

fn status_error(s: Status) -> DispatchError {
    if s.code() == Code::DeadlineExceeded { DispatchError::DeadlineExceeded } else { DispatchError::Worker(s) }
}

/// State of a running stream, enough to migrate it.
struct Pump {
    dispatcher: Dispatcher,
    req: GenerateRequest,
    deadline: Instant,
    hint: RequestHint,
    tried: Vec<String>,
    generated: Vec<u32>,
    prompt_tokens: u32,
    finished: u32,
    migrations: u32,
}

impl Pump {
    fn choices(&self) -> u32 {
        self.req.sampling.as_ref().and_then(|s| s.n).unwrap_or(1).max(1)
    }

    fn note(&mut self, m: &GenerateResponse) {
        if m.finish_reason != FinishReason::Unspecified as i32 {
            self.finished += 1;
        }
    }

    async fn run(
        mut self,
        mut stream: Streaming<GenerateResponse>,
        mut replica: Arc<ReplicaRoute>,
        mut guard: ReplicaLoadGuard,
        tx: mpsc::Sender<Result<GenerateResponse, DispatchError>>,
    ) {
        let mut migrated = false;
        loop {
            let next = tokio::select! {
                biased;
                _ = tx.closed() => return, // client gone: dropping `stream` cancels the worker request
                r = tokio::time::timeout_at(self.deadline, stream.message()) => r,
            };
            let failure = match next {
                Err(_) => {
                    let _ = tx.send(Err(DispatchError::DeadlineExceeded)).await;
                    return;
                }
                Ok(Ok(Some(mut m))) => {
                    self.note(&m);
                    if self.choices() == 1 {
                        self.generated.extend_from_slice(&m.token_ids);
                    }
                    if migrated {
                        m.prompt_tokens = 0;
                        if m.usage.is_some() {
                            m.usage = Some(Usage {
                                prompt_tokens: self.prompt_tokens,
                                completion_tokens: u32::try_from(self.generated.len()).unwrap_or(u32::MAX),
                            });
                        }
                    }
                    if tx.send(Ok(m)).await.is_err() {
                        return;
                    }
                    continue;
                }
                Ok(Ok(None)) if self.finished >= self.choices() => return,
                Ok(Ok(None)) => Status::unavailable("worker stream ended before the request finished"),
                Ok(Err(s)) => past_deadline(s, self.deadline),
            };
            self.dispatcher.note_failure(&replica, &failure);
            self.tried.push(replica.replica_id.clone());
            match self.migrate(&failure).await {
                Some((s, r, g, first)) => {
                    stream = s;
                    replica = r;
                    drop(std::mem::replace(&mut guard, g)); // the old replica's load is released
                    migrated = true;
                    self.dispatcher.inner.metrics.migrations.inc();
                    tracing::info!(replica = %replica.replica_id, "stream migrated");
                    let mut first = first;
                    self.note(&first);
                    self.generated.extend_from_slice(&first.token_ids);
                    first.prompt_tokens = 0;
                    if first.usage.is_some() {
                        first.usage = Some(Usage {
                            prompt_tokens: self.prompt_tokens,
                            completion_tokens: u32::try_from(self.generated.len()).unwrap_or(u32::MAX),
                        });
                    }
                    if tx.send(Ok(first)).await.is_err() {
                        return;
                    }
                }
                None => {
                    let _ = tx.send(Err(status_error(failure))).await;
                    return;
                }
            }
        }
    }

    /// A replica to continue on; waits (up to [`MIGRATION_WAIT`], within the deadline) while
    /// none can take the stream, e.g. while a replacement starts after every other replica
    /// went away. `None` when none came.
    async fn pick_for_migration(&mut self) -> Option<(Arc<ReplicaRoute>, ReplicaLoadGuard)> {
        let until = (Instant::now() + MIGRATION_WAIT).min(self.deadline);
        loop {
            if let Ok(p) = self.dispatcher.pick(&self.req.model, &self.tried, &self.hint) {
                return Some(p);
            }
            // Every other replica was tried: allow the earlier ones again (they may be back;
            // a failed one stays ejected for a while).
            self.tried.clear();
            if let Ok(p) = self.dispatcher.pick(&self.req.model, &self.tried, &self.hint) {
                return Some(p);
            }
            if Instant::now() >= until {
                return None;
            }
            tokio::time::sleep(MIGRATION_POLL).await;
        }
    }

    /// Resubmits prompt + generated tokens to another replica; `None` when not possible.
    async fn migrate(
        &mut self,
        failure: &Status,
    ) -> Option<(Streaming<GenerateResponse>, Arc<ReplicaRoute>, ReplicaLoadGuard, GenerateResponse)> {
        if self.choices() != 1
            || !matches!(
                failure.code(),
                Code::Unavailable | Code::Unknown | Code::Aborted | Code::Internal | Code::Cancelled | Code::NotFound
            )
        {
            return None;
        }
        while self.migrations < MAX_MIGRATIONS && Instant::now() < self.deadline {
            self.migrations += 1;
            let (replica, guard) = self.pick_for_migration().await?;
            self.tried.push(replica.replica_id.clone());
            match self.dispatcher.start(&replica, &self.req, &self.generated, self.prompt_tokens, self.deadline).await {
                Ok((s, first)) => return Some((s, replica, guard, first)),
                Err(s) => self.dispatcher.note_failure(&replica, &s),
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_common::proto::v1::SamplingParams;

    #[test]
    fn hint_counts_prompt_and_decode() {
        let req = GenerateRequest {
            prompt: Some(generate_request::Prompt::TokenIds(prism_common::proto::v1::TokenIds { ids: vec![1; 100] })),
            sampling: Some(SamplingParams { max_tokens: Some(10), n: Some(2), ..Default::default() }),
            ..Default::default()
        };
        assert_eq!(hint_for(&req).expected_tokens, 120);
        assert!(retryable(&Status::unavailable("x")));
        assert!(!retryable(&Status::invalid_argument("x")));
    }

    #[test]
    fn own_deadline_never_ejects() {
        assert!(!ejects(&Status::deadline_exceeded("x")));
        assert!(!ejects(&Status::cancelled("x")));
        assert!(ejects(&Status::unavailable("x")));
        let past = Instant::now();
        assert_eq!(past_deadline(Status::cancelled("Timeout expired"), past).code(), Code::DeadlineExceeded);
        let later = Instant::now() + Duration::from_secs(60);
        assert_eq!(past_deadline(Status::cancelled("x"), later).code(), Code::Cancelled);
    }
}
