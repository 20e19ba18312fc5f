//! Node drain, in one place. Every trigger takes the same path:
//! - SIGTERM / pod deletion / spot preemption by the platform: [`NodeDrain::drain_on_terminate`]
//!   (the process exits 0 once the drain is finished);
//! - the head's `DrainCommand` and `WorkerService.Drain`: [`NodeDrain::start`] (the process
//!   keeps running; the node takes replicas again once the head places some);
//! - a spot-termination notice: [`NodeDrain::drain_on_spot_notice`], with `agent/spot.rs` as
//!   the notice poller.
//!
//! A drain refuses new work at once (replicas → Draining, readiness fails), reports its
//! progress to the head ([`DrainState`] through [`NodeDrain::subscribe`]), lets in-flight
//! requests finish (and member ranks of parallel replicas driven from other nodes serve on
//! until the head stops their group) until the deadline, then hands the rest back (aborts them: their streams end
//! UNAVAILABLE and routers migrate them), shuts the engines down (replicas → Stopped) and marks
//! the drain done.

use super::replica::ReplicaTable;
use super::spot::NoticeWatch;
use prism_common::proto::v1::{self as pb, ReplicaState};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How often the drain re-counts the requests in flight (and reports a change to the head).
const PROGRESS_INTERVAL: Duration = Duration::from_millis(100);

/// Who asked for a drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainSource {
    /// The head's DrainCommand (replicas are stopped at the end, the process keeps running).
    Head,
    /// SIGTERM / shutdown token (the process exits at the end).
    Terminate,
    /// Spot-termination notice (the process keeps serving nothing until SIGTERM).
    SpotNotice,
    /// `WorkerService.Drain`.
    Rpc,
    /// The head refused this worker after it had registered: another process holds its node
    /// id (the process exits at the end, without waiting for requests in flight).
    Superseded,
}

/// Node drain progress, as sent to the head.
#[derive(Clone, Debug, PartialEq)]
pub struct DrainState {
    /// Requests in flight on this node.
    pub in_flight: u32,
    /// Deadline (unix ms).
    pub deadline_unix_ms: u64,
    /// Finished (idle or deadline passed, remaining requests handed back).
    pub done: bool,
    /// Why.
    pub reason: String,
}

impl DrainState {
    /// Proto form.
    pub fn to_proto(&self) -> pb::DrainProgress {
        pb::DrainProgress {
            in_flight: self.in_flight,
            deadline_unix_ms: self.deadline_unix_ms,
            done: self.done,
            reason: self.reason.clone(),
        }
    }
}

/// Milliseconds since the unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The node's drain: at most one at a time, over the replicas of one [`ReplicaTable`].
#[derive(Debug)]
pub struct NodeDrain {
    replicas: ReplicaTable,
    /// Current drain (None = not draining).
    state: watch::Sender<Option<DrainState>>,
    /// Serialises [`NodeDrain::start`] calls.
    lock: Mutex<()>,
}

impl NodeDrain {
    /// No drain yet, over `replicas`.
    pub fn new(replicas: ReplicaTable) -> Self {
        Self { replicas, state: watch::channel(None).0, lock: Mutex::new(()) }
    }

    /// Subscribes to drain progress.
    pub fn subscribe(&self) -> watch::Receiver<Option<DrainState>> {
        self.state.subscribe()
    }

    /// Current drain, if any.
    pub fn state(&self) -> Option<DrainState> {
        self.state.borrow().clone()
    }

    /// Whether a drain is in progress or finished.
    pub fn is_draining(&self) -> bool {
        self.state.borrow().is_some()
    }

    /// Forgets a finished drain: the head uncordoned the node and places replicas on it again.
    /// A drain in progress is kept.
    pub fn reopen_if_finished(&self) {
        if self.state().is_some_and(|d| d.done) {
            self.state.send_replace(None);
        }
    }

    /// Starts a drain (idempotent: a second request can only bring the deadline forward).
    /// New work is refused at once; in-flight requests finish until `deadline`, the rest are
    /// handed back. Returns the requests in flight.
    pub fn start(self: &Arc<Self>, deadline: Duration, reason: &str, source: DrainSource) -> u32 {
        let _serialised = self.lock.lock();
        let deadline_unix_ms = unix_ms() + deadline.as_millis() as u64;
        let in_flight = self.replicas.in_flight();
        if let Some(cur) = self.state() {
            if !cur.done && deadline_unix_ms < cur.deadline_unix_ms {
                self.state.send_modify(|d| {
                    if let Some(d) = d {
                        d.deadline_unix_ms = deadline_unix_ms;
                    }
                });
            }
            return in_flight;
        }
        tracing::info!(?source, reason, deadline_ms = deadline.as_millis() as u64, in_flight, "drain started");
        // Member ranks keep serving their group (whose driver is on another node) until the
        // head stops the group or the deadline passes.
        for r in self.replicas.all() {
            if !r.is_group_member() && matches!(r.state().0, ReplicaState::Ready | ReplicaState::Starting) {
                self.replicas.transition(&r, ReplicaState::Draining, reason);
            }
        }
        self.state.send_replace(Some(DrainState {
            in_flight,
            deadline_unix_ms,
            done: false,
            reason: reason.to_owned(),
        }));
        let drain = Arc::clone(self);
        tokio::spawn(async move { drain.run(source).await });
        in_flight
    }

    /// Reports the in-flight count until the node is idle or the deadline passed, then hands
    /// back what is left, stops the engines and marks the drain done.
    async fn run(self: Arc<Self>, source: DrainSource) {
        loop {
            let Some(d) = self.state() else { return };
            let in_flight = self.replicas.in_flight();
            let past = unix_ms() >= d.deadline_unix_ms;
            if in_flight != d.in_flight {
                self.state.send_modify(|s| {
                    if let Some(s) = s {
                        s.in_flight = in_flight;
                    }
                });
            }
            if (in_flight == 0 && self.replicas.live_members() == 0) || past {
                break;
            }
            tokio::time::sleep(PROGRESS_INTERVAL).await;
        }
        self.hand_back().await;
        self.state.send_modify(|s| {
            if let Some(s) = s {
                s.in_flight = 0;
                s.done = true;
            }
        });
        tracing::info!(?source, "drain finished");
    }

    /// The deadline hand-back: aborts the requests still in flight (routers migrate them),
    /// shuts every engine down and reports the replicas Stopped (failed ones stay Failed).
    async fn hand_back(&self) {
        for r in self.replicas.all() {
            r.finish(Instant::now()).await;
            if !matches!(r.state().0, ReplicaState::Failed | ReplicaState::Stopped) {
                self.replicas.transition(&r, ReplicaState::Stopped, "drained");
            }
        }
    }

    /// Waits until the current drain (if any) has finished.
    pub async fn wait_done(&self) {
        let mut rx = self.state.subscribe();
        let _ = rx.wait_for(|d| d.as_ref().is_none_or(|d| d.done)).await;
    }

    /// SIGTERM (pod deletion, the platform's preemption): waits for `shutdown`, then drains
    /// with `deadline` and returns once the drain is finished, so the caller can stop the
    /// servers and exit 0. A drain already finished (e.g. after a spot notice) returns at once.
    pub async fn drain_on_terminate(self: &Arc<Self>, shutdown: &CancellationToken, deadline: Duration) {
        shutdown.cancelled().await;
        tracing::info!(deadline_s = deadline.as_secs_f64(), "shutdown requested: draining");
        self.start(deadline, "worker shutting down", DrainSource::Terminate);
        self.wait_done().await;
    }

    /// Spot-termination notice: waits for `notices` to see one (or `stop`), then drains with
    /// the deadline the notice leaves (its termination time minus the drain margin, else the
    /// SIGTERM deadline). The process keeps running until SIGTERM.
    pub async fn drain_on_spot_notice(self: Arc<Self>, notices: NoticeWatch, stop: CancellationToken) {
        let Some(notice) = notices.wait(&stop).await else { return };
        let deadline = notices.drain_deadline(notice, unix_ms());
        tracing::warn!(deadline_ms = deadline.as_millis() as u64, "spot termination notice: draining");
        self.start(deadline, "spot termination notice", DrainSource::SpotNotice);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::replica::Replica;
    use crate::agent::replica::tests::Idle;

    fn ready_replica(table: &ReplicaTable, id: &str) -> Arc<Replica> {
        let r = Arc::new(Replica::new(id.into(), "d".into(), "m".into(), vec![0]));
        r.set_engine(Arc::new(Idle(None)));
        assert!(table.insert_new(Arc::clone(&r)));
        assert!(table.transition(&r, ReplicaState::Ready, ""));
        r
    }

    async fn done_within(drain: &NodeDrain, secs: u64) {
        tokio::time::timeout(Duration::from_secs(secs), drain.wait_done()).await.expect("drain finishes in time");
    }

    #[tokio::test]
    async fn idle_node_drains_at_once_and_stops_its_replicas() {
        let table = ReplicaTable::default();
        let r = ready_replica(&table, "r1");
        let drain = Arc::new(NodeDrain::new(table.clone()));
        assert!(!drain.is_draining());
        assert_eq!(drain.start(Duration::from_secs(30), "test", DrainSource::Rpc), 0);
        assert!(drain.is_draining());
        assert!(r.admit().is_err(), "a draining node refuses new work");
        done_within(&drain, 5).await;
        let d = drain.state().expect("drain state kept once done");
        assert!(d.done && d.in_flight == 0 && d.reason == "test", "{d:?}");
        assert_eq!(r.state(), (ReplicaState::Stopped, "drained".to_owned()));
        assert!(!r.abort.is_cancelled(), "nothing was in flight to hand back");
        drain.reopen_if_finished();
        assert!(!drain.is_draining(), "a finished drain is forgotten when replicas are placed again");
    }

    #[tokio::test]
    async fn second_request_only_brings_the_deadline_forward_and_in_flight_work_finishes() {
        let table = ReplicaTable::default();
        let r = ready_replica(&table, "r1");
        let (guard, _) = r.admit().map_err(|e| format!("{e:?}")).expect("ready replica admits");
        let drain = Arc::new(NodeDrain::new(table.clone()));
        assert_eq!(drain.start(Duration::from_secs(60), "first", DrainSource::Head), 1);
        let first = drain.state().expect("draining").deadline_unix_ms;
        drain.start(Duration::from_secs(120), "later", DrainSource::Rpc);
        assert_eq!(drain.state().expect("draining").deadline_unix_ms, first, "a later deadline is ignored");
        drain.start(Duration::from_secs(30), "sooner", DrainSource::SpotNotice);
        let d = drain.state().expect("draining");
        assert!(d.deadline_unix_ms < first && d.reason == "first" && !d.done, "{d:?}");
        drain.reopen_if_finished();
        assert!(drain.is_draining(), "a drain in progress is kept");
        drop(guard);
        done_within(&drain, 5).await;
        assert!(!r.abort.is_cancelled(), "finished within the deadline: nothing handed back");
        assert_eq!(r.state().0, ReplicaState::Stopped);
    }

    #[tokio::test]
    async fn deadline_hands_back_unfinished_requests() {
        let table = ReplicaTable::default();
        let r = ready_replica(&table, "r1");
        let (guard, _) = r.admit().map_err(|e| format!("{e:?}")).expect("ready replica admits");
        // A request that only ends when it is handed back (as the gRPC stream forwarder does).
        let request = {
            let r = Arc::clone(&r);
            tokio::spawn(async move {
                r.abort.cancelled().await;
                drop(guard);
            })
        };
        let drain = Arc::new(NodeDrain::new(table.clone()));
        let started = Instant::now();
        drain.start(Duration::from_millis(200), "spot", DrainSource::Head);
        done_within(&drain, 10).await;
        assert!(started.elapsed() >= Duration::from_millis(150), "waited for the deadline");
        assert!(r.abort.is_cancelled(), "the unfinished request was handed back");
        request.await.expect("request task ends");
        assert_eq!((r.in_flight(), r.state().0), (0, ReplicaState::Stopped));
    }

    #[tokio::test]
    async fn terminate_waits_for_the_shutdown_token_then_drains() {
        let table = ReplicaTable::default();
        let failed = ready_replica(&table, "failed");
        assert!(table.transition(&failed, ReplicaState::Failed, "engine died"));
        let drain = Arc::new(NodeDrain::new(table.clone()));
        let shutdown = CancellationToken::new();
        let task = {
            let (drain, shutdown) = (Arc::clone(&drain), shutdown.clone());
            tokio::spawn(async move { drain.drain_on_terminate(&shutdown, Duration::from_secs(5)).await })
        };
        tokio::task::yield_now().await;
        assert!(!drain.is_draining(), "no drain before the signal");
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), task).await.expect("returns once drained").expect("join");
        assert!(drain.state().is_some_and(|d| d.done && d.reason == "worker shutting down"));
        assert_eq!(failed.state(), (ReplicaState::Failed, "engine died".to_owned()), "failed replicas stay Failed");
    }
}
