//! After the first token: a task pumps the worker's stream to the client and, when a
//! single-choice stream fails mid-way, migrates it: the prompt plus the token ids generated
//! so far are resubmitted to another replica (`prior_output_ids`), which continues where the
//! first one stopped, and the client's stream goes on as if nothing happened.
//!
//! This module is the one place that adjusts token counts for a migrated stream
//! ([`StreamUsage`]): a replica reports what its engine did for its own attempt, and the
//! client is shown one request (one `prompt_tokens`, usage over every token it received).
//!
//! When the client drops its receiver the task drops the worker stream, which cancels the
//! request on the worker.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use prism_common::proto::v1::{FinishReason, GenerateRequest, GenerateResponse, Usage};
use tokio::sync::mpsc;
use tokio::time::Instant;
use tonic::{Code, Status, Streaming};

use super::error::DispatchError;
use super::upstream::{Upstream, abort_failure, is_aborted, past_deadline};
use crate::balance::{DispatchGuard, RequestHint};
use crate::routes::ReplicaRoute;

/// At most this many migrations per request.
const MAX_MIGRATIONS: u32 = 3;
/// Longest wait of a stream to be migrated for a replica that can take it.
const MIGRATION_WAIT: Duration = Duration::from_secs(30);
/// Route-table poll period during that wait.
const MIGRATION_POLL: Duration = Duration::from_millis(50);

/// Token accounting of a stream as its client sees it, across migrations.
///
/// Before any migration messages pass unchanged. On the replica that continues a migrated
/// stream, `prompt_tokens` is cleared (the client had it on its first message) and `usage`
/// becomes the prompt tokens of the first attempt plus every token the client received,
/// whatever that replica counted for its own attempt.
#[derive(Debug)]
pub(super) struct StreamUsage {
    /// Only single-choice streams are migrated, so only their tokens are kept.
    single_choice: bool,
    /// `prompt_tokens` of the first attempt's first message.
    prompt_tokens: u32,
    /// Token ids sent to the client so far (single-choice streams).
    generated: Vec<u32>,
    /// Whether the stream has moved to another replica.
    migrated: bool,
}

impl StreamUsage {
    /// Accounting that starts with the first message of the first attempt.
    pub(super) fn new(first: &GenerateResponse, single_choice: bool) -> Self {
        let generated = if single_choice { first.token_ids.clone() } else { Vec::new() };
        Self { single_choice, prompt_tokens: first.prompt_tokens, generated, migrated: false }
    }

    /// Token ids the client has received (what a migration resubmits as `prior_output_ids`).
    pub(super) fn generated(&self) -> &[u32] {
        &self.generated
    }

    /// Records a message of the current replica before it goes to the client, rewriting its
    /// counts when the stream was migrated.
    pub(super) fn pass(&mut self, m: &mut GenerateResponse) {
        if self.single_choice {
            self.generated.extend_from_slice(&m.token_ids);
        }
        if self.migrated {
            m.prompt_tokens = 0;
            if let Some(u) = m.usage {
                m.usage = Some(Usage {
                    prompt_tokens: self.prompt_tokens,
                    completion_tokens: u32::try_from(self.generated.len()).unwrap_or(u32::MAX),
                    // What the last replica found cached (it also saw the generated tokens).
                    cached_tokens: u.cached_tokens.min(self.prompt_tokens),
                });
            }
        }
    }

    /// The stream continues on another replica; `first` is that replica's first message.
    pub(super) fn migrated(&mut self, first: &mut GenerateResponse) {
        self.migrated = true;
        self.pass(first);
    }
}

/// What a request needs to be continued elsewhere.
pub(super) struct Continuation {
    /// The client's request as dispatched (request id set).
    pub(super) req: GenerateRequest,
    /// The request's deadline.
    pub(super) deadline: Instant,
    /// Load estimate for replica selection.
    pub(super) hint: RequestHint,
    /// Replica ids tried so far (skipped when choosing the next).
    pub(super) tried: Vec<String>,
}

/// State of a running stream, enough to migrate it.
pub(super) struct StreamPump {
    upstream: Arc<Upstream>,
    c: Continuation,
    usage: StreamUsage,
    finished: u32,
    migrations: u32,
}

impl StreamPump {
    /// A pump for a stream whose first message (already received) is `first`.
    pub(super) fn new(upstream: Arc<Upstream>, c: Continuation, first: &GenerateResponse) -> Self {
        let single_choice = choices(&c.req) == 1;
        let mut pump = Self { upstream, c, usage: StreamUsage::new(first, single_choice), finished: 0, migrations: 0 };
        pump.note(first);
        pump
    }

    fn note(&mut self, m: &GenerateResponse) {
        if m.finish_reason != FinishReason::Unspecified as i32 {
            self.finished += 1;
        }
    }

    /// Forwards the rest of `stream` to `tx`, migrating on failure; ends with the stream, a
    /// terminal error sent to `tx`, or the client gone.
    ///
    /// A migratable stream whose replica leaves the route table (the head found its worker
    /// gone: session lost, frozen, killed) moves at once rather than when the connection's
    /// keepalive gives up (up to [`KEEPALIVE_INTERVAL`](super::upstream::KEEPALIVE_INTERVAL) +
    /// [`KEEPALIVE_TIMEOUT`](super::upstream::KEEPALIVE_TIMEOUT) later): a frozen worker would
    /// otherwise stall its streams that long. The continuation is token-exact, so moving a
    /// stream whose worker was in fact alive (only cut off from the head, which replaces it
    /// and stops it when it reconnects) costs a prefill, not a wrong answer. A stream of
    /// several choices cannot move and keeps waiting on its connection.
    pub(super) async fn run(
        mut self,
        mut stream: Streaming<GenerateResponse>,
        mut replica: Arc<ReplicaRoute>,
        mut guard: DispatchGuard,
        tx: mpsc::Sender<Result<GenerateResponse, DispatchError>>,
    ) {
        let movable = choices(&self.c.req) == 1;
        let mut gone = self.left_routes(&replica, movable);
        loop {
            let next = tokio::select! {
                biased;
                _ = tx.closed() => return, // client gone: dropping `stream` cancels the worker request
                r = tokio::time::timeout_at(self.c.deadline, stream.message()) => Some(r),
                () = &mut gone => None,
            };
            let Some(next) = next else {
                let failure = Status::unavailable("the replica left the route table mid-stream (its worker is gone)");
                if !self.move_on(failure, &mut stream, &mut replica, &mut guard, &tx).await {
                    return;
                }
                gone = self.left_routes(&replica, movable);
                continue;
            };
            let failure = match next {
                Err(_) => {
                    let _ = tx.send(Err(DispatchError::DeadlineExceeded)).await;
                    return;
                }
                // A choice the engine aborted: past the deadline the request's end, else
                // the replica's failure (moved like any other).
                Ok(Ok(Some(m))) if is_aborted(&m) => {
                    let failure = abort_failure(self.c.deadline);
                    if failure.code() == Code::DeadlineExceeded {
                        let _ = tx.send(Err(DispatchError::DeadlineExceeded)).await;
                        return;
                    }
                    failure
                }
                Ok(Ok(Some(mut m))) => {
                    self.note(&m);
                    self.usage.pass(&mut m);
                    if tx.send(Ok(m)).await.is_err() {
                        return;
                    }
                    continue;
                }
                Ok(Ok(None)) if self.finished >= choices(&self.c.req) => return,
                Ok(Ok(None)) => Status::unavailable("worker stream ended before the request finished"),
                Ok(Err(s)) => past_deadline(s, self.c.deadline),
            };
            if !self.move_on(failure, &mut stream, &mut replica, &mut guard, &tx).await {
                return;
            }
            gone = self.left_routes(&replica, movable);
        }
    }

    /// Resolves when `replica` leaves the route table, for a stream that can move; never
    /// otherwise.
    fn left_routes(&self, replica: &Arc<ReplicaRoute>, movable: bool) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        if !movable {
            return Box::pin(std::future::pending());
        }
        let (upstream, replica) = (Arc::clone(&self.upstream), Arc::clone(replica));
        Box::pin(async move { upstream.left_routes(&replica).await })
    }

    /// After `failure` of the stream on `replica`: continues it on another replica (updating
    /// `stream`, `replica` and `guard`) and returns true, or sends the client its terminal
    /// error and returns false (false too when the client is gone).
    async fn move_on(
        &mut self,
        failure: Status,
        stream: &mut Streaming<GenerateResponse>,
        replica: &mut Arc<ReplicaRoute>,
        guard: &mut DispatchGuard,
        tx: &mpsc::Sender<Result<GenerateResponse, DispatchError>>,
    ) -> bool {
        self.upstream.note_failure(replica, &failure);
        self.c.tried.push(replica.replica_id.clone());
        match self.migrate(&failure).await {
            Ok((s, r, g, mut first)) => {
                *stream = s;
                *replica = r;
                drop(std::mem::replace(guard, g)); // the old replica's load is released
                self.upstream.metrics().migrations.inc();
                tracing::info!(replica = %replica.replica_id, "stream migrated");
                self.note(&first);
                self.usage.migrated(&mut first);
                tx.send(Ok(first)).await.is_ok()
            }
            Err(why) => {
                let e = match why {
                    NoMigration::Unavailable(e) => e,
                    NoMigration::Failed => DispatchError::from_last_failure(failure, &replica.replica_id),
                };
                let _ = tx.send(Err(e)).await;
                false
            }
        }
    }

    /// A replica to continue on; waits (up to [`MIGRATION_WAIT`], within the deadline) while
    /// none can take the stream, e.g. while a replacement starts after every other replica
    /// went away. Stops waiting as soon as the route table lists the model as unavailable
    /// (the head says no replica is coming), answering as a queued request is answered then.
    async fn pick_for_migration(&mut self) -> Result<(Arc<ReplicaRoute>, DispatchGuard), NoMigration> {
        let until = (Instant::now() + MIGRATION_WAIT).min(self.c.deadline);
        loop {
            if let Ok(p) = self.upstream.pick(&self.c.req.model, &self.c.tried, &self.c.hint) {
                return Ok(p);
            }
            // Every other replica was tried: allow the earlier ones again (they may be back;
            // a failed one stays ejected for a while).
            self.c.tried.clear();
            if let Ok(p) = self.upstream.pick(&self.c.req.model, &self.c.tried, &self.c.hint) {
                return Ok(p);
            }
            if let Some(why) = self.upstream.routes().snapshot().unavailable(&self.c.req.model) {
                return Err(NoMigration::Unavailable(DispatchError::unavailable(&self.c.req.model, &why)));
            }
            if Instant::now() >= until {
                return Err(NoMigration::Failed);
            }
            tokio::time::sleep(MIGRATION_POLL).await;
        }
    }

    /// Resubmits prompt + generated tokens to another replica.
    async fn migrate(&mut self, failure: &Status) -> Result<Migrated, NoMigration> {
        if choices(&self.c.req) != 1 || !migratable(failure) {
            return Err(NoMigration::Failed);
        }
        while self.migrations < MAX_MIGRATIONS && Instant::now() < self.c.deadline {
            self.migrations += 1;
            let (replica, guard) = self.pick_for_migration().await?;
            self.c.tried.push(replica.replica_id.clone());
            match self.upstream.open(&replica, &self.c.req, &self.c.hint, self.usage.generated(), self.c.deadline).await
            {
                Ok((s, first)) => return Ok((s, replica, guard, first)),
                Err(s) => self.upstream.note_failure(&replica, &s),
            }
        }
        Err(NoMigration::Failed)
    }
}

/// A stream continued on another replica: its stream, route, load guard and first message.
type Migrated = (Streaming<GenerateResponse>, Arc<ReplicaRoute>, DispatchGuard, GenerateResponse);

/// Why a failed stream was not continued elsewhere.
enum NoMigration {
    /// Not migratable, or no replica took it in time: the client gets the replica's loss.
    Failed,
    /// The head lists the model as unavailable: the client gets that answer at once.
    Unavailable(DispatchError),
}

/// Choices the request asks for (`n`, at least 1).
fn choices(req: &GenerateRequest) -> u32 {
    req.sampling.as_ref().and_then(|s| s.n).unwrap_or(1).max(1)
}

/// Whether a mid-stream failure is the replica's (worth continuing elsewhere) rather than
/// the request's own (invalid, deadline, ...).
fn migratable(failure: &Status) -> bool {
    matches!(
        failure.code(),
        Code::Unavailable | Code::Unknown | Code::Aborted | Code::Internal | Code::Cancelled | Code::NotFound
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(tokens: &[u32], prompt_tokens: u32, usage: Option<(u32, u32)>) -> GenerateResponse {
        GenerateResponse {
            token_ids: tokens.to_vec(),
            prompt_tokens,
            usage: usage.map(|(p, c)| Usage { prompt_tokens: p, completion_tokens: c, cached_tokens: 0 }),
            ..GenerateResponse::default()
        }
    }

    #[test]
    fn unmigrated_stream_passes_unchanged() {
        let mut u = StreamUsage::new(&msg(&[1], 7, None), true);
        let mut last = msg(&[2, 3], 7, Some((7, 3)));
        u.pass(&mut last);
        assert_eq!(
            (last.prompt_tokens, last.usage),
            (7, Some(Usage { prompt_tokens: 7, completion_tokens: 3, cached_tokens: 0 }))
        );
        assert_eq!(u.generated(), &[1, 2, 3]);
    }

    #[test]
    fn migrated_stream_reports_the_whole_request() {
        // The first replica streamed 2 tokens of a 7-token prompt, then failed.
        let mut u = StreamUsage::new(&msg(&[10], 7, None), true);
        u.pass(&mut msg(&[11], 0, None));
        assert_eq!(u.generated(), &[10, 11], "resubmitted as prior_output_ids");
        // The replica that continues counts its own attempt (here a different prompt count
        // and only its own tokens): the client still sees one request.
        let mut first = msg(&[12], 4, None);
        u.migrated(&mut first);
        assert_eq!((first.prompt_tokens, first.usage), (0, None), "prompt_tokens only on the client's first message");
        let mut last = msg(&[13], 4, Some((4, 2)));
        u.pass(&mut last);
        assert_eq!(last.prompt_tokens, 0);
        assert_eq!(last.usage.map(|u| u.prompt_tokens), Some(7));
        assert_eq!(last.usage, Some(Usage { prompt_tokens: 7, completion_tokens: 4, cached_tokens: 0 }));
        assert_eq!(u.generated(), &[10, 11, 12, 13]);
    }

    #[test]
    fn only_replica_failures_migrate() {
        assert!(migratable(&Status::unavailable("x")));
        assert!(migratable(&Status::cancelled("x")));
        assert!(!migratable(&Status::invalid_argument("x")));
        assert!(!migratable(&Status::deadline_exceeded("x")));
        let n2 = GenerateRequest {
            sampling: Some(prism_common::proto::v1::SamplingParams { n: Some(2), ..Default::default() }),
            ..Default::default()
        };
        assert_eq!((choices(&n2), choices(&GenerateRequest::default())), (2, 1));
    }
}
