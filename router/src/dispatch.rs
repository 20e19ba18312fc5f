//! Dispatch: sends a request to a replica's worker and streams its answer back.
//!
//! - [`Dispatcher::dispatch`] takes a slot through the admission queue (`crate::admission`:
//!   waits in the model's FIFO while every replica is at its limit or none is Ready yet) and
//!   opens its worker stream (`upstream`: the worker call up to its first message, ejection).
//! - Before the first token nothing was streamed, so another attempt is safe. A replica that
//!   failed (UNAVAILABLE, transport error, stale route, no response headers in time) leaves
//!   rotation with exponential backoff (ejection) and the request goes back to the admission
//!   queue, first in line (`Admission::readmit`): another replica takes it at once, or it
//!   waits, within its queue bounds, until the replica is back or the head replaces it. A
//!   short outage of the only replicas is then a wait, not a 503, and a request that never
//!   started is never told that its replica was lost. A replica that is full or stopping
//!   (RESOURCE_EXHAUSTED, ABORTED) is retried once on another replica with a free slot. A
//!   Draining replica is still listed and keeps what it accepted (its worker finishes or
//!   hands it back).
//! - A request's own deadline (DEADLINE_EXCEEDED) never counts against a replica: a client
//!   asking for 1 ms must not eject replicas for everyone.
//! - After the first token the stream is pumped by a task (`migrate`), which migrates a
//!   single-choice stream that fails mid-way to another replica and is the one place that
//!   adjusts usage of a migrated stream.

mod error;
mod migrate;
mod upstream;

use std::sync::Arc;
use std::time::Duration;

use prism_common::proto::v1::{GenerateRequest, GenerateResponse, generate_request};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::{Code, Status};

use crate::admission::{Admission, AdmissionConfig};
use crate::balance::{BalancePolicy, RequestHint};
use crate::metrics::Metrics;
use crate::prefix::{ReplicaCodec, prompt_keys};
use crate::routes::Routes;
pub use error::DispatchError;
use migrate::{Continuation, StreamPump};
use upstream::Upstream;
pub use upstream::{DispatchConfig, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT};

/// Most attempts of one request before its first token: a request whose every attempt fails
/// (one that makes its replica fail, say) must not eject each replica that comes back.
const MAX_ATTEMPTS: usize = 8;

/// Decode tokens assumed for the load estimate when a request sets no `max_tokens`.
const DEFAULT_EXPECTED_DECODE: u64 = 256;

/// A started request: the first worker message and a receiver for the rest.
pub struct Dispatched {
    /// The request id used on the worker.
    pub request_id: String,
    /// First message (already received, so errors before the first token are known).
    pub first: GenerateResponse,
    /// The remaining messages; dropping it cancels the request on the worker.
    pub rest: mpsc::Receiver<Result<GenerateResponse, DispatchError>>,
}

/// Sends requests to workers (cheap `Clone`).
#[derive(Clone)]
pub struct Dispatcher {
    upstream: Arc<Upstream>,
    admission: Admission,
}

/// Whether a status before the first token is worth another replica.
fn retryable(s: &Status) -> bool {
    matches!(s.code(), Code::Unavailable | Code::Unknown | Code::NotFound | Code::ResourceExhausted | Code::Aborted)
}

/// Expected decode tokens of all choices: `max_tokens` (or [`DEFAULT_EXPECTED_DECODE`]) × `n`.
fn decode_tokens(req: &GenerateRequest) -> u64 {
    let sampling = req.sampling.as_ref();
    let decode =
        sampling.and_then(|s| s.max_tokens).and_then(|m| u64::try_from(m).ok()).unwrap_or(DEFAULT_EXPECTED_DECODE);
    let n = u64::from(sampling.and_then(|s| s.n).unwrap_or(1).max(1));
    decode * n
}

/// Estimated tokens of a request: prompt (a quarter of its bytes for text) + max_tokens × n;
/// what the admission queue and the per-key token limit count.
pub fn estimated_tokens(req: &GenerateRequest) -> u64 {
    let prompt = match &req.prompt {
        Some(generate_request::Prompt::Text(t)) => t.len() as u64 / 4 + 1,
        Some(generate_request::Prompt::TokenIds(t)) => t.ids.len() as u64,
        Some(generate_request::Prompt::Chat(c)) => c.messages.iter().map(|m| m.content.len() as u64 / 4 + 8).sum(),
        None => 0,
    };
    prompt + decode_tokens(req)
}

fn hint_for(req: &GenerateRequest) -> RequestHint {
    RequestHint::tokens(estimated_tokens(req))
}

impl Dispatcher {
    /// A dispatcher over `routes` choosing replicas with `policy`; first attempts wait in
    /// admission queues bounded by `queue` (run [`Admission::run`] on [`Dispatcher::admission`]).
    pub fn new(
        routes: Routes,
        policy: Box<dyn BalancePolicy>,
        metrics: Metrics,
        cfg: DispatchConfig,
        queue: AdmissionConfig,
    ) -> Self {
        let policy: Arc<dyn BalancePolicy> = Arc::from(policy);
        let admission = Admission::new(routes.clone(), Arc::clone(&policy), metrics.clone(), queue);
        Self { upstream: Arc::new(Upstream::new(routes, policy, metrics, cfg)), admission }
    }

    /// The admission queues of first attempts.
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// The route table this dispatcher reads.
    pub fn routes(&self) -> &Routes {
        self.upstream.routes()
    }

    /// The tool-call parser for requests to `model`: `choice`, resolved (`auto`) by the chat
    /// template of the model's replicas as the router knows it from their prompt codecs
    /// (none known: `hermes`).
    pub fn tool_parser(&self, model: &str, choice: crate::tools::ParserChoice) -> crate::tools::ParserKind {
        if choice != crate::tools::ParserChoice::Auto {
            return choice.resolve(None);
        }
        let snap = self.routes().snapshot();
        let codec = snap.models.get(model).into_iter().flatten().find_map(|r| r.cache.codec());
        choice.resolve(codec.as_ref().and_then(|c| c.codec.chat_template_source()))
    }

    /// Whether `model` is one the route table knows, checked before the key's token limit
    /// so that repeating a request for an unknown model gets its 404 again rather than 429.
    /// Without a table yet nothing is refused here ([`Dispatcher::dispatch`] answers then).
    ///
    /// # Errors
    /// [`DispatchError::UnknownModel`], as [`Dispatcher::dispatch`] would answer.
    pub fn check_model(&self, model: &str) -> Result<(), DispatchError> {
        let snap = self.routes().snapshot();
        if snap.loaded && !snap.models.contains_key(model) {
            return Err(DispatchError::UnknownModel(model.to_owned()));
        }
        Ok(())
    }

    /// The deadline of a request: its own `timeout_ms` capped by the default.
    pub fn deadline_for(&self, req: &GenerateRequest) -> Instant {
        let d = self.upstream.cfg().default_timeout;
        let t = req.timeout_ms.filter(|&ms| ms > 0).map(Duration::from_millis).map_or(d, |t| t.min(d));
        Instant::now() + t
    }

    /// Adds the request's token ids and block hashes under the codecs of its model's
    /// replicas (none known: the hint stays as it is, routed by load); the token estimate
    /// becomes the exact prompt length.
    async fn add_prefix(&self, req: &GenerateRequest, hint: &mut RequestHint) {
        let snap = self.routes().snapshot();
        let mut codecs: Vec<Arc<ReplicaCodec>> = Vec::new();
        for c in snap.models.get(&req.model).into_iter().flatten().filter_map(|r| r.cache.codec()) {
            if !codecs.iter().any(|k| k.key == c.key) {
                codecs.push(c);
            }
        }
        if codecs.is_empty() {
            return;
        }
        let started = std::time::Instant::now();
        let Some(keys) = prompt_keys(req, codecs).await else { return };
        self.upstream.metrics().tokenized(started.elapsed().as_secs_f64());
        if let Some(prompt) = keys.prompt_tokens() {
            hint.expected_tokens = prompt + decode_tokens(req);
        }
        hint.prefix = Some(keys);
    }

    /// Starts `req` on a replica of its model and returns its stream.
    ///
    /// The first attempt waits in the model's admission queue for a slot. After a replica
    /// failure before the first token (the replica ejected) the request queues again, first
    /// in line, with what is left of its queue wait; after a full or stopping replica it
    /// takes a free slot on another replica or fails with that status.
    ///
    /// # Errors
    /// [`DispatchError`]: unknown model, no ready replica, a queue bound, deadline, or the
    /// worker's own status (e.g. INVALID_ARGUMENT for a prompt over the context length).
    pub async fn dispatch(&self, mut req: GenerateRequest) -> Result<Dispatched, DispatchError> {
        if req.request_id.is_empty() {
            req.request_id = uuid::Uuid::new_v4().to_string();
        }
        let deadline = self.deadline_for(&req);
        let mut hint = hint_for(&req);
        if self.upstream.policy().wants_prefix() {
            self.add_prefix(&req, &mut hint).await;
        }
        let mut tried: Vec<String> = Vec::new();
        let mut last: Option<Status> = None;
        // Time spent in the admission queue, all visits together (bounded by --max-queue-wait).
        let mut queued = Duration::ZERO;
        let entered = Instant::now();
        let admitted = self
            .admission
            .admit(&req.model, hint.clone(), deadline)
            .await
            .map_err(|e| DispatchError::from_admit(e, &req.model))?;
        queued += entered.elapsed();
        self.upstream.metrics().dispatched(&admitted.0.replica_id);
        let mut admitted = Some(admitted);
        loop {
            let (replica, guard) = match admitted.take() {
                Some(p) => p,
                None => match self.upstream.pick(&req.model, &tried, &hint) {
                    Ok(p) => p,
                    Err(e) => {
                        let last_replica = tried.last().map_or("", String::as_str);
                        return Err(last.map_or(e, |s| DispatchError::from_last_failure(s, last_replica)));
                    }
                },
            };
            match self.upstream.open(&replica, &req, &hint, &[], deadline).await {
                Ok((stream, first)) => {
                    replica.stats.record_success();
                    let (tx, rx) = mpsc::channel(32);
                    let request_id = req.request_id.clone();
                    let c = Continuation { req, deadline, hint, tried };
                    let pump = StreamPump::new(Arc::clone(&self.upstream), c, &first);
                    tokio::spawn(pump.run(stream, replica, guard, tx));
                    return Ok(Dispatched { request_id, first, rest: rx });
                }
                Err(s) => {
                    drop(guard);
                    self.upstream.note_failure(&replica, &s);
                    tried.push(replica.replica_id.clone());
                    if !retryable(&s) {
                        return Err(DispatchError::from_status(s));
                    }
                    if Instant::now() >= deadline {
                        return Err(DispatchError::DeadlineExceeded);
                    }
                    if upstream::ejects(&s) {
                        if tried.len() >= MAX_ATTEMPTS {
                            tracing::warn!(replica = %replica.replica_id, code = ?s.code(), attempts = tried.len(), "every attempt failed before the first token");
                            return Err(DispatchError::NoReplica(req.model.clone()));
                        }
                        // The replica is out of rotation: wait, first in line, for another one
                        // or for it to come back, as a new arrival would.
                        tracing::debug!(replica = %replica.replica_id, code = ?s.code(), "replica failed before the first token; back to the queue");
                        self.upstream.metrics().retries.inc();
                        let entered = Instant::now();
                        let again = self.admission.readmit(&req.model, hint.clone(), deadline, queued).await;
                        queued += entered.elapsed();
                        let again = again.map_err(|e| DispatchError::from_admit(e, &req.model))?;
                        self.upstream.metrics().dispatched(&again.0.replica_id);
                        admitted = Some(again);
                        continue;
                    }
                    if tried.len() < 2 {
                        tracing::debug!(replica = %replica.replica_id, code = ?s.code(), "retrying on another replica");
                        self.upstream.metrics().retries.inc();
                        last = Some(s);
                        continue;
                    }
                    return Err(DispatchError::from_last_failure(s, &replica.replica_id));
                }
            }
        }
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
}
