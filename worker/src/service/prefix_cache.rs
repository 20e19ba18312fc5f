//! `WatchPrefixCache`: a replica's prefix-cache block hashes as a stream of batches, for
//! cache-aware routers. The engine is polled every [`WATCH_INTERVAL`] (its event feed is
//! pull-only); a batch is sent only when something changed. The first message is a reset
//! (`reset = true`, `stored` = every hash held now); later ones are deltas whose `stored` and
//! `removed` are disjoint (within a batch the last event of a hash wins), so a reader may
//! apply them in either order.
//!
//! Memory stays bounded for a slow reader: at most [`WATCH_BUFFER`] batches wait in the
//! stream's channel; a batch that finds it full is dropped, the worker stops reading events
//! for that reader and, once the reader has room again, sends a fresh reset snapshot (the
//! reader's view is whole again, nothing is buffered meanwhile).
//!
//! The stream ends (OK) when the replica stops (Stopping, Stopped, Failed, or its engine
//! died), when the worker shuts down, or when the client goes away.

use crate::agent::replica::{Replica, ReplicaEngine};
use prism_common::proto::v1::{self as pb, ReplicaState};
use prism_engine::kv_cache::{CacheEvent, CacheEvents};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// How often a watcher reads the engine's prefix-cache events (the batching interval).
pub const WATCH_INTERVAL: Duration = Duration::from_millis(50);
/// Batches waiting for one reader before it is treated as too slow (and later reset).
pub const WATCH_BUFFER: usize = 8;

/// The sender side of one watcher's stream.
pub type WatchSender = mpsc::Sender<Result<pb::PrefixCacheEvents, Status>>;

/// Splits events into the hashes added and removed by the batch as a whole: the last event
/// of each hash wins, so the two lists are disjoint. Each list keeps first-seen order.
pub fn coalesce(events: &[CacheEvent]) -> (Vec<u64>, Vec<u64>) {
    let mut last: HashMap<u64, bool> = HashMap::with_capacity(events.len());
    let mut order = Vec::with_capacity(events.len());
    for e in events {
        let (h, stored) = match *e {
            CacheEvent::Stored(h) => (h, true),
            CacheEvent::Removed(h) => (h, false),
        };
        if last.insert(h, stored).is_none() {
            order.push(h);
        }
    }
    let (mut stored, mut removed) = (Vec::new(), Vec::new());
    for h in order {
        if last[&h] { stored.push(h) } else { removed.push(h) }
    }
    (stored, removed)
}

/// The reset message for a read from sequence 0: the engine's snapshot, or (an engine that
/// answers with events from the start instead) the hashes those events leave stored.
pub fn reset_message(ev: CacheEvents) -> pb::PrefixCacheEvents {
    let stored = match ev.snapshot {
        Some(all) => all,
        None => coalesce(&ev.events).0,
    };
    pb::PrefixCacheEvents { reset: true, stored, removed: Vec::new(), seq: ev.next }
}

/// The message for a read after `seq > 0`: a reset when the engine sent a snapshot (the
/// reader fell behind its event log), a delta when something changed, `None` otherwise.
pub fn delta_message(ev: CacheEvents) -> Option<pb::PrefixCacheEvents> {
    if ev.snapshot.is_some() {
        return Some(reset_message(ev));
    }
    if ev.events.is_empty() {
        return None;
    }
    let (stored, removed) = coalesce(&ev.events);
    Some(pb::PrefixCacheEvents { reset: false, stored, removed, seq: ev.next })
}

fn replica_ended(replica: &Replica, engine: &dyn ReplicaEngine) -> bool {
    let (state, _) = replica.state();
    matches!(state, ReplicaState::Stopping | ReplicaState::Stopped | ReplicaState::Failed) || !engine.is_alive()
}

/// Feeds one watcher until the replica stops, `stop` is cancelled or the client leaves.
pub async fn watch(replica: Arc<Replica>, engine: Arc<dyn ReplicaEngine>, tx: WatchSender, stop: CancellationToken) {
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + WATCH_INTERVAL, WATCH_INTERVAL);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut cursor = 0u64;
    let mut need_reset = true;
    loop {
        if replica_ended(&replica, engine.as_ref()) {
            tracing::debug!(replica = %replica.id, "prefix-cache watch ends: replica stopped");
            return;
        }
        let msg = if need_reset {
            if tx.capacity() == 0 {
                None // still behind: read nothing until the reader has room
            } else {
                let ev = engine.prefix_cache_events(0);
                cursor = ev.next;
                Some(reset_message(ev))
            }
        } else {
            let ev = engine.prefix_cache_events(cursor);
            cursor = ev.next;
            delta_message(ev)
        };
        if let Some(msg) = msg {
            match tx.try_send(Ok(msg)) {
                Ok(()) => need_reset = false,
                Err(TrySendError::Full(_)) => {
                    tracing::debug!(replica = %replica.id, "prefix-cache watcher too slow: a reset follows");
                    need_reset = true;
                }
                Err(TrySendError::Closed(_)) => return,
            }
        }
        tokio::select! {
            _ = tick.tick() => {}
            _ = tx.closed() => return,
            _ = stop.cancelled() => return,
            _ = replica.abort.cancelled() => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use CacheEvent::{Removed, Stored};

    #[test]
    fn coalesce_keeps_each_hashs_last_event() {
        let (s, r) = coalesce(&[Stored(1), Stored(2), Removed(1), Removed(3), Stored(3), Stored(4)]);
        assert_eq!((s, r), (vec![2, 3, 4], vec![1]));
        assert_eq!(coalesce(&[]), (vec![], vec![]));
    }

    #[test]
    fn snapshots_become_resets_and_empty_reads_send_nothing() {
        let snap = CacheEvents { snapshot: Some(vec![7, 8]), events: vec![], next: 12 };
        let m = reset_message(snap.clone());
        assert_eq!((m.reset, m.stored, m.removed, m.seq), (true, vec![7, 8], vec![], 12));
        assert_eq!(delta_message(snap).map(|m| (m.reset, m.seq)), Some((true, 12)));
        // An engine that answers "from 0" with its events: the reset holds what they leave.
        let from_start = CacheEvents { snapshot: None, events: vec![Stored(1), Stored(2), Removed(1)], next: 3 };
        assert_eq!(reset_message(from_start).stored, vec![2]);
        assert_eq!(delta_message(CacheEvents { snapshot: None, events: vec![], next: 3 }), None);
        let d = delta_message(CacheEvents { snapshot: None, events: vec![Removed(2), Stored(5)], next: 5 })
            .expect("a change is sent");
        assert_eq!((d.reset, d.stored, d.removed, d.seq), (false, vec![5], vec![2], 5));
    }

    /// An engine double whose event log grows on demand; reading from 0 gives a snapshot.
    #[derive(Default)]
    struct Events(std::sync::Mutex<Vec<CacheEvent>>);
    impl Events {
        fn push(&self, e: CacheEvent) {
            self.0.lock().expect("log").push(e);
        }
    }
    impl ReplicaEngine for Events {
        fn submit(
            &self,
            _: prism_engine::EngineRequest,
        ) -> Result<crate::agent::replica::ReplicaOutputStream, prism_engine::EngineError> {
            Err(prism_engine::EngineError::Unavailable("test double".into()))
        }
        fn load(&self) -> crate::agent::replica::EngineLoad {
            crate::agent::replica::EngineLoad::default()
        }
        fn is_alive(&self) -> bool {
            true
        }
        fn shutdown(&self) {}
        fn prefix_cache_events(&self, after: u64) -> CacheEvents {
            let log = self.0.lock().expect("log");
            let next = log.len() as u64;
            if after == 0 {
                return CacheEvents { snapshot: Some(coalesce(&log).0), events: vec![], next };
            }
            CacheEvents { snapshot: None, events: log[after as usize..].to_vec(), next }
        }
    }

    async fn recv(rx: &mut mpsc::Receiver<Result<pb::PrefixCacheEvents, Status>>) -> pb::PrefixCacheEvents {
        tokio::time::timeout(Duration::from_secs(2), rx.recv())
            .await
            .expect("a batch within 2 s")
            .expect("stream open")
            .expect("ok message")
    }

    /// First a reset, then deltas; a reader that let the buffer fill gets a reset holding
    /// everything (and nothing stale) instead of the batches it missed.
    #[tokio::test]
    async fn first_a_reset_then_deltas_and_a_slow_reader_is_reset() {
        let engine = Arc::new(Events::default());
        engine.push(Stored(1));
        let replica = Arc::new(Replica::new("r1".into(), "d".into(), "m".into(), vec![0]));
        replica.set_engine(engine.clone());
        let (tx, mut rx) = mpsc::channel(1);
        let stop = CancellationToken::new();
        let task = tokio::spawn(watch(Arc::clone(&replica), engine.clone(), tx, stop.clone()));
        let first = recv(&mut rx).await;
        assert_eq!((first.reset, first.stored.clone()), (true, vec![1]));
        engine.push(Stored(2));
        let d = recv(&mut rx).await;
        assert_eq!((d.reset, d.stored, d.removed), (false, vec![2], vec![]));
        // Nothing changes: nothing is sent.
        assert!(tokio::time::timeout(WATCH_INTERVAL * 4, rx.recv()).await.is_err(), "no batch without a change");
        // The reader stops reading: one batch fills the buffer, the next is dropped.
        engine.push(Stored(3));
        tokio::time::sleep(WATCH_INTERVAL * 3).await;
        engine.push(Removed(1));
        engine.push(Stored(4));
        tokio::time::sleep(WATCH_INTERVAL * 3).await;
        let buffered = recv(&mut rx).await;
        assert_eq!((buffered.reset, buffered.stored), (false, vec![3]));
        let reset = recv(&mut rx).await;
        assert!(reset.reset, "the missed batch is replaced by a reset: {reset:?}");
        let mut held = reset.stored.clone();
        held.sort_unstable();
        assert_eq!(held, vec![2, 3, 4]);
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(2), task).await.expect("ends on stop").expect("join");
    }

    /// The stream ends when the replica stops, and the task when the client leaves.
    #[tokio::test]
    async fn ends_when_the_replica_stops_or_the_client_leaves() {
        let table = crate::agent::replica::ReplicaTable::default();
        let engine = Arc::new(Events::default());
        let replica = Arc::new(Replica::new("r1".into(), "d".into(), "m".into(), vec![0]));
        replica.set_engine(engine.clone());
        table.transition(&replica, ReplicaState::Ready, "");
        let (tx, mut rx) = mpsc::channel(WATCH_BUFFER);
        let task = tokio::spawn(watch(Arc::clone(&replica), engine.clone(), tx, CancellationToken::new()));
        assert!(recv(&mut rx).await.reset);
        table.transition(&replica, ReplicaState::Stopping, "stop requested");
        let end = tokio::time::timeout(Duration::from_secs(2), rx.recv()).await.expect("the stream ends");
        assert!(end.is_none(), "ends without an error: {end:?}");
        tokio::time::timeout(Duration::from_secs(2), task).await.expect("task ends").expect("join");

        let other = Arc::new(Replica::new("r2".into(), "d".into(), "m".into(), vec![0]));
        other.set_engine(engine.clone());
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        let task = tokio::spawn(watch(other, engine, tx, CancellationToken::new()));
        drop(rx);
        tokio::time::timeout(Duration::from_secs(2), task).await.expect("ends when the client leaves").expect("join");
    }
}
