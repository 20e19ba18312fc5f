//! The replicas behind the router and the gRPC channels to their workers: one attempt of a
//! request on one replica, from picking the replica to the worker's first message.
//!
//! - [`Upstream::pick`] chooses a replica through [`crate::balance::select`]; its load counts
//!   from that moment (a [`DispatchGuard`] held until the stream ends or the client leaves).
//! - [`Upstream::open`] sends `WorkerService.Generate` with the request's remaining deadline
//!   (twice: `timeout_ms` in the request and the gRPC timeout) and waits for the first
//!   message. A worker answers with response headers at once (its engine queues the request),
//!   so no headers within `header_timeout` is UNAVAILABLE: the replica is frozen (SIGSTOP, hung
//!   host with TCP still open). A replica that leaves the route table before the first message
//!   (the head evicted it, or it was stopped) ends the attempt at once with UNAVAILABLE;
//!   dropping the worker stream cancels the request there.
//! - HTTP/2 keep-alive pings on every worker channel, idle or not, fail a connection whose
//!   peer stops answering within [`KEEPALIVE_INTERVAL`] + [`KEEPALIVE_TIMEOUT`], which ends its
//!   streams with UNAVAILABLE.
//! - [`Upstream::note_failure`] takes a replica out of rotation (exponential backoff) after
//!   UNAVAILABLE-like failures; a request's own deadline never counts against a replica.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use prism_common::proto::v1::worker_service_client::WorkerServiceClient;
use prism_common::proto::v1::{FinishReason, GenerateRequest, GenerateResponse, WorkerGenerateRequest};
use tokio::time::Instant;
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status, Streaming};

use super::error::DispatchError;
use crate::balance::{BalancePolicy, DispatchGuard, RequestHint, SelectError, select};
use crate::metrics::Metrics;
use crate::routes::{ReplicaRoute, Routes};

/// HTTP/2 PING period on worker channels (also while idle).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(5);
/// A PING unanswered this long closes the worker connection (its streams fail UNAVAILABLE).
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(5);

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

/// What the dispatcher shares between requests: routes, the balancing policy, one gRPC
/// client per worker endpoint, metrics and timing.
pub(super) struct Upstream {
    routes: Routes,
    policy: Arc<dyn BalancePolicy>,
    clients: DashMap<String, WorkerServiceClient<Channel>>,
    metrics: Metrics,
    cfg: DispatchConfig,
}

/// Whether a status says the replica should leave rotation for a while. DEADLINE_EXCEEDED
/// is the request's own deadline and never counts (an unresponsive replica shows up as
/// UNAVAILABLE: header timeout or keep-alive failure).
pub(super) fn ejects(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::Unknown | Code::NotFound)
}

/// A worker's CANCELLED ("Timeout expired": its server enforcing the grpc-timeout we sent) at
/// or after the request's deadline is that deadline, not a replica failure.
pub(super) fn past_deadline(s: Status, deadline: Instant) -> Status {
    if s.code() == Code::Cancelled && Instant::now() + Duration::from_millis(5) >= deadline {
        Status::deadline_exceeded("the request deadline was exceeded")
    } else {
        s
    }
}

/// Whether the engine ended a choice of this message with finish reason `abort`: not an
/// OpenAI finish reason, so the message is never passed on ([`abort_failure`] instead).
pub(super) fn is_aborted(m: &GenerateResponse) -> bool {
    m.finish_reason == FinishReason::Abort as i32
}

/// The failure an aborted choice stands for: the request's own deadline when it is at or past
/// it (the engine expires a request at its `timeout_ms`, which the router set to this
/// deadline: DEADLINE_EXCEEDED, a 504 or an error event), else the replica dropping its work
/// (stopping: UNAVAILABLE, so the stream moves, or ends with an error event when it cannot).
pub(super) fn abort_failure(deadline: Instant) -> Status {
    // The worker's deadline is this one less the milliseconds `timeout_ms` truncates.
    if Instant::now() + Duration::from_millis(5) >= deadline {
        Status::deadline_exceeded("the request deadline was exceeded")
    } else {
        Status::unavailable("the replica aborted the request")
    }
}

/// The failure of an attempt whose replica was evicted before its first token: UNAVAILABLE
/// (retried elsewhere; the replica is gone from the table anyway).
fn left_routes_status() -> Status {
    Status::unavailable("the replica left the route table before its first token")
}

/// The prompt ids to send `replica` with their codec fingerprint; empty and 0 when the
/// router has none tokenized by a codec of that replica's fingerprint (it tokenizes itself).
fn forwarded_ids(replica: &ReplicaRoute, hint: &RequestHint) -> (Vec<u32>, u64) {
    let Some(codec) = replica.cache.codec() else { return (Vec::new(), 0) };
    let fp = codec.key.fingerprint;
    hint.prefix.as_ref().and_then(|k| k.ids_for(fp)).map_or((Vec::new(), 0), |ids| (ids.to_vec(), fp))
}

impl Upstream {
    pub(super) fn new(routes: Routes, policy: Arc<dyn BalancePolicy>, metrics: Metrics, cfg: DispatchConfig) -> Self {
        Self { routes, policy, clients: DashMap::new(), metrics, cfg }
    }

    pub(super) fn routes(&self) -> &Routes {
        &self.routes
    }

    pub(super) fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub(super) fn cfg(&self) -> &DispatchConfig {
        &self.cfg
    }

    pub(super) fn policy(&self) -> &dyn BalancePolicy {
        self.policy.as_ref()
    }

    fn client(&self, endpoint: &str) -> Result<WorkerServiceClient<Channel>, Status> {
        if let Some(c) = self.clients.get(endpoint) {
            return Ok(c.clone());
        }
        let ep = Endpoint::from_shared(endpoint.to_owned())
            .map_err(|_| Status::unavailable("invalid worker endpoint"))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .http2_keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT)
            .keep_alive_while_idle(true);
        let ch = prism_common::tls::client::channel_lazy(ep);
        let c = WorkerServiceClient::new(ch).max_decoding_message_size(64 * 1024 * 1024);
        self.clients.insert(endpoint.to_owned(), c.clone());
        Ok(c)
    }

    /// Chooses and admits a replica of `model` other than those in `tried`.
    pub(super) fn pick(
        &self,
        model: &str,
        tried: &[String],
        hint: &RequestHint,
    ) -> Result<(Arc<ReplicaRoute>, DispatchGuard), DispatchError> {
        let snap = self.routes.snapshot();
        let picked =
            select(&snap, model, tried, self.routes.now_ms(), self.policy.as_ref(), hint).map_err(|e| match e {
                SelectError::UnknownModel => DispatchError::UnknownModel(model.to_owned()),
                SelectError::NoneReady => DispatchError::NoReplica(model.to_owned()),
                SelectError::AllFull => DispatchError::Overloaded { reason: "every replica full", retry_after_s: 1 },
            })?;
        self.metrics.dispatched(&picked.0.replica_id);
        Ok(picked)
    }

    /// Opens the worker stream of `req` on `replica` and waits for its first message;
    /// `prior` are the token ids a migrated stream already sent its client. The prompt's
    /// token ids go along when the router tokenized it with a codec of the replica's
    /// fingerprint (`hint.prefix`): the worker then does not tokenize again.
    pub(super) async fn open(
        &self,
        replica: &ReplicaRoute,
        req: &GenerateRequest,
        hint: &RequestHint,
        prior: &[u32],
        deadline: Instant,
    ) -> Result<(Streaming<GenerateResponse>, GenerateResponse), Status> {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(Status::deadline_exceeded("deadline exceeded"));
        }
        let (prompt_token_ids, codec_fingerprint) = forwarded_ids(replica, hint);
        let mut inner = req.clone();
        inner.timeout_ms = Some(u64::try_from(remaining.as_millis()).unwrap_or(u64::MAX).max(1));
        // The worker reports what its engine did; the router rewrites a migrated stream's
        // counts itself (`dispatch::migrate`).
        let mut wreq = tonic::Request::new(WorkerGenerateRequest {
            replica_id: replica.replica_id.clone(),
            request: Some(inner),
            prior_output_ids: prior.to_vec(),
            prompt_token_ids,
            codec_fingerprint,
        });
        wreq.set_timeout(remaining);
        let mut client = self.client(&replica.endpoint)?;
        // Until the first token, an eviction of the replica by the head ends the attempt.
        let gone = self.left_routes(replica);
        tokio::pin!(gone);
        // Response headers: the request's deadline, or the header bound if that comes first.
        let header_by = Instant::now() + self.cfg.header_timeout;
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
            Ok(Ok(Some(first))) if is_aborted(&first) => Err(abort_failure(deadline)),
            Ok(Ok(Some(first))) => Ok((s, first)),
            Ok(Ok(None)) => Err(Status::unavailable("worker closed the stream before answering")),
            Ok(Err(e)) => Err(past_deadline(e, deadline)),
            Err(_) => Err(Status::deadline_exceeded("no answer from the replica before the deadline")),
        }
    }

    /// Resolves once the route table no longer lists `replica` (checked now and after every
    /// table update); pending forever while it stays listed, Draining included.
    pub(super) async fn left_routes(&self, replica: &ReplicaRoute) {
        let routes = &self.routes;
        // Subscribe before the first check so an update in between is not missed.
        let mut updates = routes.subscribe();
        loop {
            if !routes.lists(&replica.model, &replica.replica_id) {
                tracing::info!(replica = %replica.replica_id, "replica left the route table; its attempt is abandoned");
                return;
            }
            if updates.changed().await.is_err() {
                return std::future::pending().await; // the table is gone with the router
            }
        }
    }

    /// Records a failed attempt on `replica`: ejects it for a while when `s` says so.
    pub(super) fn note_failure(&self, replica: &ReplicaRoute, s: &Status) {
        if ejects(s) {
            tracing::warn!(replica = %replica.replica_id, code = ?s.code(), "replica failed; out of rotation for a while");
            replica.stats.record_failure(self.routes.now_ms(), self.cfg.ejection_base);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefix::{CodecKeys, HashKey, PrefixKeys, ReplicaCodec};
    use prism_common::proto::v1::{ReplicaState, RouteEntry, RouteTable};

    #[test]
    fn ids_go_only_to_a_replica_of_the_same_fingerprint() {
        let routes = Routes::new(4, Metrics::new());
        let entry = |id: &str| RouteEntry {
            replica_id: id.into(),
            model: "m".into(),
            endpoint: format!("http://{id}"),
            state: ReplicaState::Ready as i32,
            ..Default::default()
        };
        routes.apply(RouteTable {
            served: vec![],
            unavailable: vec![],
            term: 0,
            version: 1,
            routes: vec![entry("a"), entry("b"), entry("c")],
            models: vec![],
        });
        let snap = routes.snapshot();
        let reps = &snap.models["m"];
        let codec = |fingerprint| {
            let key = HashKey { fingerprint, block_size: 16, namespace: 0 };
            Some(Arc::new(ReplicaCodec { key, codec: crate::prefix::tests::tiny_codec() }))
        };
        reps[0].cache.set_codec(codec(1));
        reps[1].cache.set_codec(codec(2));
        let key = HashKey { fingerprint: 1, block_size: 16, namespace: 0 };
        let keys = |tokenized| {
            let k = CodecKeys { key, ids: vec![5, 6, 7], hashes: vec![] };
            Some(Arc::new(PrefixKeys::new(vec![k], tokenized)))
        };
        let hint = RequestHint { expected_tokens: 3, prefix: keys(true) };
        assert_eq!(forwarded_ids(&reps[0], &hint), (vec![5, 6, 7], 1));
        assert_eq!(forwarded_ids(&reps[1], &hint), (vec![], 0), "another tokenizer: the worker tokenizes");
        assert_eq!(forwarded_ids(&reps[2], &hint), (vec![], 0), "no codec known");
        let ids_prompt = RequestHint { expected_tokens: 3, prefix: keys(false) };
        assert_eq!(forwarded_ids(&reps[0], &ids_prompt), (vec![], 0), "the prompt was ids already");
        assert_eq!(forwarded_ids(&reps[0], &RequestHint::tokens(3)), (vec![], 0));
    }

    #[test]
    fn an_abort_is_the_deadline_at_it_and_a_replica_failure_before() {
        let abort = GenerateResponse { finish_reason: FinishReason::Abort as i32, ..Default::default() };
        assert!(is_aborted(&abort));
        assert!(!is_aborted(&GenerateResponse { finish_reason: FinishReason::Stop as i32, ..Default::default() }));
        assert!(!is_aborted(&GenerateResponse::default()));
        assert_eq!(abort_failure(Instant::now()).code(), Code::DeadlineExceeded);
        assert_eq!(abort_failure(Instant::now() + Duration::from_secs(5)).code(), Code::Unavailable);
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
