//! Admission: requests beyond what the Ready replicas of their model can take wait in a
//! bounded per-model FIFO instead of being refused (vLLM queues a burst in its scheduler, Ray
//! Serve at the deployment handle with `max_queued_requests`; the router is where every
//! replica's capacity is visible, so the queue is here).
//!
//! - [`Admission::admit`] takes a slot at once when nothing of that model waits and a replica
//!   is below its limit (`balance::capacity` derives limits from the replicas' reports).
//!   Otherwise the request joins the back of its model's queue: no new arrival overtakes a
//!   waiting one. A model listed in the route table with no Ready replica (scaled to zero,
//!   replicas starting) queues too, and wakes the demand reporter at once (`crate::demand`).
//! - A model that no replica is coming to serve (the head's `RouteTable.unavailable`: its
//!   replicas cannot start, it is scaled to 0, no node can run one) is refused at once, and so
//!   are its waiters when the news comes (503 / UNAVAILABLE saying why): nobody would serve
//!   them. Before the first route table came every request is refused (503 / UNAVAILABLE, not
//!   404: the model may well exist).
//! - Bounds, per model: `--max-queued-requests` (count), `--max-queued-tokens` (the
//!   request's token estimate, prompt + decode), `--max-queue-wait` and the request's own
//!   deadline (time). Past a count or token bound the request is refused at once with a
//!   `Retry-After` for when as many slots have freed as it would have requests ahead, from
//!   the service times of the model's running and recent requests (`service.rs`), bounded by
//!   the waits left to those queued (`queue::retry_after_s`; 429 / RESOURCE_EXHAUSTED); past
//!   the wait bound 429 with the same estimate (not bounded: the queue emptying by timeouts
//!   frees no slot), or 503 / UNAVAILABLE when the model still has no Ready replica; past its
//!   own deadline 504 / DEADLINE_EXCEEDED.
//! - Waiters are served in order by [`Admission::run`], woken when a dispatched request
//!   releases its slot (`DispatchGuard` drop), when the route table changes (membership,
//!   state, or a replica's new load report) and by [`PUMP_TICK`]: an ejection that ends sends
//!   no notification, so the tick is what readmits an ejected replica (within 200 ms).
//! - Ready replicas that are all out of rotation after failures (ejected: their worker died,
//!   froze or dropped the connection) make a request wait too, as Ray Serve keeps requests at
//!   the handle until a replica is available: until an ejection ends (the replica then takes
//!   one request to find out whether it is back) or the head replaces the replica. Its wait
//!   bound answers 503 / UNAVAILABLE, not 429, while the model has no usable replica.
//! - A request whose attempt failed on its replica before the first token (connection
//!   refused, no response headers, the replica evicted) comes back through
//!   [`Admission::readmit`]: first in line, with what is left of its `--max-queue-wait`.
//! - A waiter whose client goes away (its future dropped) leaves the queue at once; a slot
//!   handed to it in that instant is released with the dropped message.

pub mod queue;
pub mod service;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use prism_common::proto::v1::ModelDemand;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::balance::{BalancePolicy, DispatchGuard, RequestHint, SelectError, select};
use crate::metrics::Metrics;
use crate::routes::{ModelUnavailable, ReplicaRoute, RouteSnapshot, Routes};
/// gRPC metadata key carrying the suggested retry delay in whole seconds (HTTP's
/// `Retry-After`) on RESOURCE_EXHAUSTED and UNAVAILABLE answers of the router.
pub const RETRY_AFTER_METADATA: &str = "retry-after";

pub use queue::{MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, QueueBounds, retry_after_s};
use queue::{ModelQueue, Waiter};

/// Period of the safety-net pump (replicas whose ejection ended send no notification).
const PUMP_TICK: Duration = Duration::from_millis(200);

/// The queue's bounds (each per model).
#[derive(Debug, Clone)]
pub struct AdmissionConfig {
    /// Most requests waiting; 0 = no queue (refused at once when every replica is full).
    pub max_queued_requests: u32,
    /// Most estimated tokens (prompt + decode) of the requests waiting.
    pub max_queued_tokens: u64,
    /// Longest wait of one request.
    pub max_queue_wait: Duration,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self { max_queued_requests: 1024, max_queued_tokens: 4 << 20, max_queue_wait: Duration::from_secs(30) }
    }
}

/// A slot on a replica: the replica and the guard counting the request there.
pub type Admitted = (Arc<ReplicaRoute>, DispatchGuard);

/// Which bound refused a request (the `reason` label of `prism_router_queue_rejected_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// `--max-queued-requests`.
    Full,
    /// `--max-queued-tokens`.
    Tokens,
    /// `--max-queue-wait`.
    Timeout,
    /// The request's own deadline.
    Deadline,
}

impl Bound {
    /// The metric label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Full => "full",
            Self::Tokens => "tokens",
            Self::Timeout => "timeout",
            Self::Deadline => "deadline",
        }
    }
}

/// Why a request got no slot.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// No route mentions the model (404).
    #[error("model not found")]
    UnknownModel,
    /// Static routes whose every endpoint is out of rotation after failures, or the router is
    /// shutting down (503).
    #[error("no usable replica")]
    NoneUsable,
    /// A queue bound refused it (429); retry after `retry_after_s` seconds.
    #[error("admission queue bound `{}` reached", bound.as_str())]
    Rejected {
        /// The bound (never `Deadline`).
        bound: Bound,
        /// Suggested `Retry-After`, seconds.
        retry_after_s: u32,
    },
    /// It waited for a usable replica (Ready, not ejected) until its wait bound and none came
    /// (503).
    #[error("no ready replica came in time")]
    NoReplicaInTime {
        /// Suggested `Retry-After`, seconds.
        retry_after_s: u32,
    },
    /// Its own deadline passed while it waited (504).
    #[error("deadline exceeded in the admission queue")]
    DeadlineExceeded,
    /// No replica of the model is coming (503).
    #[error("no replica of deployment {} is coming ({})", .0.deployment, .0.cause.as_str_name())]
    Unavailable(Arc<ModelUnavailable>),
    /// No route table came from the head yet: the model is not known either way (503).
    #[error("no route table from the head yet")]
    NoRouteTable,
}

type Answer = Result<Admitted, AdmitError>;

/// What one immediate try gave.
enum Attempt {
    Go(Admitted),
    Fail(AdmitError),
    /// No slot now; `no_ready`: the model has no Ready replica at all.
    Wait {
        no_ready: bool,
    },
}

#[derive(Default)]
struct Queues {
    models: HashMap<String, ModelQueue<Answer>>,
    next_id: u64,
    closed: bool,
}

struct Inner {
    routes: Routes,
    policy: Arc<dyn BalancePolicy>,
    metrics: Metrics,
    cfg: AdmissionConfig,
    queues: Mutex<Queues>,
    /// Notified when a request queues for a model with no Ready replica.
    scale_from_zero: Notify,
}

/// The admission queues of every model (cheap `Clone`).
#[derive(Clone)]
pub struct Admission {
    inner: Arc<Inner>,
}

/// Whether `model` has a replica that may take work at `now_ms` (Ready and not ejected).
fn usable(snap: &RouteSnapshot, model: &str, now_ms: u64) -> bool {
    snap.models.get(model).is_some_and(|rs| rs.iter().any(|r| r.is_ready() && !r.stats.is_ejected(now_ms)))
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn try_now(&self, snap: &RouteSnapshot, model: &str, hint: &RequestHint) -> Attempt {
        if !snap.loaded {
            return Attempt::Fail(AdmitError::NoRouteTable);
        }
        match select(snap, model, &[], self.routes.now_ms(), self.policy.as_ref(), hint) {
            Ok(a) => Attempt::Go(a),
            Err(SelectError::UnknownModel) => Attempt::Fail(AdmitError::UnknownModel),
            Err(SelectError::AllFull) => Attempt::Wait { no_ready: false },
            // Ready replicas, all out of rotation after failures: one may come back, or the
            // head replaces them. Static routes have no head to replace a dead endpoint, so
            // waiting there would mostly be for nothing: 503 at once.
            Err(SelectError::NoneReady) if snap.has_ready(model) && snap.managed => Attempt::Wait { no_ready: false },
            Err(SelectError::NoneReady) if snap.has_ready(model) => Attempt::Fail(AdmitError::NoneUsable),
            Err(SelectError::NoneReady) => match snap.unavailable(model) {
                Some(why) => Attempt::Fail(AdmitError::Unavailable(why)),
                None => Attempt::Wait { no_ready: true },
            },
        }
    }

    /// `Retry-After` for a request of `model` refused by `bound` with `q` as it is now: when
    /// as many of the model's slots have freed as requests are queued, plus one (see
    /// [`retry_after_s`]).
    fn retry_after(
        &self,
        model: &str,
        q: &ModelQueue<Answer>,
        snap: &RouteSnapshot,
        bound: Bound,
        now: Instant,
    ) -> u32 {
        let running =
            snap.models.get(model).map_or(0, |rs| rs.iter().map(|r| r.stats.in_flight.load(Ordering::Relaxed)).sum());
        let service = q.service.at(now, running);
        let mut bounds = q.bounds(now, self.cfg.max_queue_wait);
        if matches!(bound, Bound::Timeout | Bound::Deadline) {
            bounds.all_gone = None;
        }
        retry_after_s(service.slots_free_in(q.len() + 1), bounds)
    }

    /// Counts the request of `a` as running for `q`'s model until its guard drops.
    fn in_service(q: &ModelQueue<Answer>, a: &mut Admitted, now: Instant) {
        a.1.attach(Box::new(q.service.start(now)));
    }

    fn gauges(&self, model: &str, q: &ModelQueue<Answer>) {
        self.metrics.set_queue(model, q.len(), q.tokens());
    }

    /// Hands slots to the first waiters of `model` while replicas can take them; returns
    /// whether the queue changed.
    fn pump_model(&self, model: &str, q: &mut ModelQueue<Answer>, snap: &RouteSnapshot, now: Instant) -> bool {
        let mut changed = false;
        while let Some(front) = q.front() {
            if front.tx.is_closed() {
                q.pop_front();
                changed = true;
                continue;
            }
            let hint = RequestHint { expected_tokens: front.tokens, prefix: front.prefix.clone() };
            match self.try_now(snap, model, &hint) {
                Attempt::Go(mut a) => {
                    let Some(w) = q.pop_front() else { break };
                    changed = true;
                    self.metrics.queue_waited(now.saturating_duration_since(w.since).as_secs_f64());
                    Self::in_service(q, &mut a, now);
                    // A receiver gone in this instant drops the slot with the message.
                    let _ = w.tx.send(Ok(a));
                }
                Attempt::Fail(e @ (AdmitError::UnknownModel | AdmitError::Unavailable(_))) => {
                    // The model left the table (deleted), or no replica of it is coming:
                    // nobody of it will be served.
                    while let Some(w) = q.pop_front() {
                        self.metrics.queue_waited(now.saturating_duration_since(w.since).as_secs_f64());
                        let _ = w.tx.send(Err(e.clone()));
                    }
                    changed = true;
                }
                Attempt::Fail(_) | Attempt::Wait { .. } => break,
            }
        }
        changed
    }

    /// A waiter's time bound passed: takes it out and says why, unless the pump answered it
    /// in the meantime (then that answer stands).
    fn expire(&self, model: &str, id: u64, bound: Bound, mut rx: oneshot::Receiver<Answer>) -> Answer {
        let now = Instant::now();
        let mut queues = self.lock();
        if let Some(q) = queues.models.get_mut(model)
            && let Some(w) = q.remove(id)
        {
            self.metrics.queue_waited(now.saturating_duration_since(w.since).as_secs_f64());
            self.metrics.queue_rejected(model, bound.as_str());
            self.gauges(model, q);
            let snap = self.routes.snapshot();
            let retry_after_s = self.retry_after(model, q, &snap, bound, now);
            drop(queues);
            return Err(if !usable(&snap, model, self.routes.now_ms()) {
                AdmitError::NoReplicaInTime { retry_after_s }
            } else if bound == Bound::Deadline {
                AdmitError::DeadlineExceeded
            } else {
                AdmitError::Rejected { bound, retry_after_s }
            });
        }
        drop(queues);
        // No longer queued: the pump sent its answer under the lock just taken.
        rx.try_recv().unwrap_or(Err(AdmitError::NoneUsable))
    }

    /// Takes the waiter `id` out if it is still queued (its client went away).
    fn leave(&self, model: &str, id: u64) {
        let mut queues = self.lock();
        if let Some(q) = queues.models.get_mut(model)
            && let Some(w) = q.remove(id)
        {
            self.metrics.queue_waited(Instant::now().saturating_duration_since(w.since).as_secs_f64());
            self.gauges(model, q);
        }
    }
}

/// Removes a waiter whose future is dropped before its answer (client disconnect).
struct Leave<'a> {
    inner: &'a Inner,
    model: &'a str,
    id: u64,
    armed: bool,
}

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.inner.leave(self.model, self.id);
        }
    }
}

impl Admission {
    /// Queues over `routes`, choosing replicas with `policy`.
    pub fn new(routes: Routes, policy: Arc<dyn BalancePolicy>, metrics: Metrics, cfg: AdmissionConfig) -> Self {
        let inner = Inner {
            routes,
            policy,
            metrics,
            cfg,
            queues: Mutex::new(Queues::default()),
            scale_from_zero: Notify::new(),
        };
        Self { inner: Arc::new(inner) }
    }

    /// A slot on a replica of `model` for a request of `hint.expected_tokens` tokens, waiting
    /// in the model's queue (within its bounds and until `deadline`) when none is free.
    ///
    /// # Errors
    /// [`AdmitError`]: unknown model, no replica coming, a bound reached, shutdown.
    pub async fn admit(&self, model: &str, hint: RequestHint, deadline: Instant) -> Answer {
        self.enter(model, hint, deadline, None).await
    }

    /// A slot for a request whose attempt failed on its replica before the first token (the
    /// replica is out of rotation now): like [`Admission::admit`], but first in line (it
    /// arrived before those waiting), its wait bound what is left of `--max-queue-wait` after
    /// the `waited` it spent queued already.
    ///
    /// # Errors
    /// As [`Admission::admit`].
    pub async fn readmit(&self, model: &str, hint: RequestHint, deadline: Instant, waited: Duration) -> Answer {
        self.enter(model, hint, deadline, Some(waited)).await
    }

    /// [`Admission::admit`] (`waited`: `None`) or [`Admission::readmit`].
    async fn enter(&self, model: &str, hint: RequestHint, deadline: Instant, waited: Option<Duration>) -> Answer {
        let inner = &*self.inner;
        let now = Instant::now();
        let again = waited.is_some();
        let (id, mut rx) = {
            let mut queues = inner.lock();
            if queues.closed {
                return Err(AdmitError::NoneUsable);
            }
            let snap = inner.routes.snapshot();
            // A request back after a failed attempt is first in line: it tries at once.
            let waiting = !again && queues.models.get(model).is_some_and(|q| !q.is_empty());
            let no_ready = if waiting {
                if !snap.models.contains_key(model) {
                    return Err(AdmitError::UnknownModel);
                }
                if let Some(why) = snap.unavailable(model) {
                    return Err(AdmitError::Unavailable(why));
                }
                !snap.has_ready(model)
            } else {
                match inner.try_now(&snap, model, &hint) {
                    Attempt::Go(mut a) => {
                        Inner::in_service(queues.models.entry(model.to_owned()).or_default(), &mut a, now);
                        return Ok(a);
                    }
                    Attempt::Fail(e) => return Err(e),
                    Attempt::Wait { no_ready } => no_ready,
                }
            };
            let id = queues.next_id;
            queues.next_id += 1;
            let q = queues.models.entry(model.to_owned()).or_default();
            let bound = if q.len() >= inner.cfg.max_queued_requests as usize {
                Some(Bound::Full)
            } else if q.tokens().saturating_add(hint.expected_tokens) > inner.cfg.max_queued_tokens {
                Some(Bound::Tokens)
            } else {
                None
            };
            if let Some(bound) = bound {
                inner.metrics.queue_rejected(model, bound.as_str());
                return Err(AdmitError::Rejected {
                    bound,
                    retry_after_s: inner.retry_after(model, q, &snap, bound, now),
                });
            }
            let (tx, rx) = oneshot::channel();
            let w = Waiter { id, tokens: hint.expected_tokens, prefix: hint.prefix.clone(), since: now, tx };
            if again {
                q.push_front(w);
            } else {
                q.push(w);
            }
            if waiting {
                // A slot may have freed since the pump last ran: serve the line in order now.
                inner.pump_model(model, q, &snap, now);
            }
            inner.gauges(model, q);
            if no_ready {
                inner.scale_from_zero.notify_one();
            }
            (id, rx)
        };
        let mut leave = Leave { inner, model, id, armed: true };
        let wait_bound = now + inner.cfg.max_queue_wait.saturating_sub(waited.unwrap_or_default());
        let (until, bound) =
            if deadline < wait_bound { (deadline, Bound::Deadline) } else { (wait_bound, Bound::Timeout) };
        let res = tokio::time::timeout_at(until, &mut rx).await;
        leave.armed = false;
        match res {
            Ok(Ok(answer)) => answer,
            // The queues were closed (shutdown) without an answer.
            Ok(Err(_)) => Err(AdmitError::NoneUsable),
            Err(_) => inner.expire(model, id, bound, rx),
        }
    }

    /// Serves waiters of every model while replicas can take them.
    pub fn pump(&self) {
        let inner = &*self.inner;
        let now = Instant::now();
        let snap = inner.routes.snapshot();
        let mut queues = inner.lock();
        for (model, q) in &mut queues.models {
            if !q.is_empty() && inner.pump_model(model, q, &snap, now) {
                inner.gauges(model, q);
            }
        }
    }

    /// Pumps the queues until `shutdown`, on every released slot, route-table update and
    /// [`PUMP_TICK`]; then answers every waiter (503) and refuses new ones.
    pub async fn run(self, shutdown: CancellationToken) {
        let released = self.inner.routes.released();
        let mut updates = self.inner.routes.subscribe();
        let mut tick = tokio::time::interval(PUMP_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = released.notified() => {}
                r = updates.changed() => if r.is_err() { break },
                _ = tick.tick() => {}
            }
            self.pump();
        }
        let mut queues = self.inner.lock();
        queues.closed = true;
        for (model, q) in &mut queues.models {
            while let Some(w) = q.pop_front() {
                let _ = w.tx.send(Err(AdmitError::NoneUsable));
            }
            self.inner.gauges(model, q);
        }
    }

    /// Resolves when a request has queued for a model with no Ready replica (scale from zero)
    /// since the last call.
    pub async fn scale_from_zero_wanted(&self) {
        self.inner.scale_from_zero.notified().await;
    }

    /// What this router holds per served model: every model of the route table, and any
    /// with waiters.
    pub fn demand(&self) -> Vec<ModelDemand> {
        let now = Instant::now();
        let snap = self.inner.routes.snapshot();
        let mut out: BTreeMap<&str, ModelDemand> = BTreeMap::new();
        for (model, replicas) in &snap.models {
            let in_flight = replicas.iter().map(|r| r.stats.in_flight.load(Ordering::Relaxed)).sum();
            out.insert(model, ModelDemand { model: model.clone(), in_flight, ..Default::default() });
        }
        let queues = self.inner.lock();
        for (model, q) in &queues.models {
            if q.is_empty() && !out.contains_key(model.as_str()) {
                continue;
            }
            let d = out.entry(model).or_insert_with(|| ModelDemand { model: model.clone(), ..Default::default() });
            d.queued = u32::try_from(q.len()).unwrap_or(u32::MAX);
            d.queued_tokens = q.tokens();
            d.oldest_queued_s = q.oldest_wait(now).as_secs_f64();
        }
        out.into_values().collect()
    }

    /// Requests waiting for `model` now.
    pub fn queued(&self, model: &str) -> usize {
        self.inner.lock().models.get(model).map_or(0, ModelQueue::len)
    }
}

#[cfg(test)]
#[path = "admission/tests.rs"]
mod tests;
