//! The head's event log: an in-memory ring of the last [`EVENT_LOG_CAPACITY`] control-plane
//! events (autoscaler decisions; replicas placed, pending, Ready, failed, removed, stopped,
//! evicted), each also
//! logged with `tracing`, served as JSON on `GET /v1/events` by `http.rs`. Kept per
//! process (a new leader starts an empty log); the durable trace is the logs.

use std::collections::VecDeque;
use std::sync::Mutex;

use serde::Serialize;

/// Events kept; older ones are dropped first.
pub const EVENT_LOG_CAPACITY: usize = 200;

/// What an event is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// The autoscaler changed a deployment's replica count.
    Scaling,
    /// A replica was assigned a node and its slots.
    ReplicaPlaced,
    /// A replica fits nowhere yet (the message says why).
    ReplicaPending,
    /// A replica reported Ready for the first time.
    ReplicaReady,
    /// A replica failed (the message is the worker's reason).
    ReplicaFailed,
    /// A replica's worker reported it stopped (its record is gone).
    ReplicaStopped,
    /// A replica is being removed (scale-down, spec change, deleted deployment): drained, then stopped.
    ReplicaRemoved,
    /// A replica of a dead node was dropped (a replacement is created).
    ReplicaEvicted,
}

/// One event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Event {
    /// Wall-clock time, unix milliseconds.
    pub unix_ms: u64,
    /// What happened.
    pub kind: EventKind,
    /// Deployment concerned.
    pub deployment: String,
    /// Replica concerned (empty for deployment events).
    pub replica: String,
    /// Human-readable detail ("1 -> 3: ongoing 7.9 over 1 replica > target 2.0 for 2.0 s").
    pub message: String,
}

/// The ring of recent events. Shared through the cluster handle.
#[derive(Debug, Default)]
pub struct EventLog {
    events: Mutex<VecDeque<Event>>,
}

impl EventLog {
    /// Records an event now and logs it.
    pub fn push(&self, kind: EventKind, deployment: &str, replica: &str, message: String) {
        tracing::info!(?kind, deployment, replica, %message, "event");
        let e = Event {
            unix_ms: prism_common::time::unix_ms(),
            kind,
            deployment: deployment.to_owned(),
            replica: replica.to_owned(),
            message,
        };
        let mut q = self.events.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if q.len() == EVENT_LOG_CAPACITY {
            q.pop_front();
        }
        q.push_back(e);
    }

    /// The kept events, oldest first.
    pub fn recent(&self) -> Vec<Event> {
        self.events.lock().unwrap_or_else(std::sync::PoisonError::into_inner).iter().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_last_events_oldest_first() {
        let log = EventLog::default();
        for i in 0..EVENT_LOG_CAPACITY + 5 {
            log.push(EventKind::ReplicaPlaced, "d", &format!("r{i}"), String::new());
        }
        let kept = log.recent();
        assert_eq!(kept.len(), EVENT_LOG_CAPACITY);
        assert_eq!(kept[0].replica, "r5");
        assert_eq!(kept.last().map(|e| e.replica.as_str()), Some(format!("r{}", EVENT_LOG_CAPACITY + 4).as_str()));
        let json = serde_json::to_value(&kept[0]).expect("serializes");
        assert_eq!(json["kind"], "replica_placed");
    }
}
