//! How long a model's requests hold their replica slots, for `Retry-After`: the mean time
//! from dispatch to release of its recent requests and the dispatch instants of those still
//! running. A slot frees when a request leaves its replica, not when another is admitted, so
//! this (rather than the admission rate, which a burst into free slots inflates) says when a
//! waiting request gets one.
//!
//! Each request admitted through the queue carries an [`InService`] in its `DispatchGuard`:
//! it counts the request as running from admission and records its service time when the
//! guard drops (stream end, error, client gone).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::time::{Duration, Instant};

/// Weight of the newest completion in the mean service time (an exponentially weighted
/// mean: recent requests count most, a few odd ones do not swing it).
const MEAN_WEIGHT: f64 = 0.2;

/// What the router knows of how soon a model's busy slots free, at one instant.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Service {
    /// Requests of the model on its replicas now: the slots that free as they finish.
    pub running: u32,
    /// How long the oldest of them has been running.
    pub oldest: Duration,
    /// Mean time from dispatch to release of its recent requests; `None` before the first.
    pub mean: Option<Duration>,
}

impl Service {
    /// Seconds until `position` slots have freed (when the `position`-th in line would get
    /// one): the oldest running request finishes first, then one slot frees every
    /// `service / running`, where `service` is the mean service time unless the oldest has
    /// already run longer, or nothing finished yet: then it is expected to run about as long
    /// again as it has (all that is known of a duration is that it exceeds its age). `None`
    /// when nothing runs (the queue waits for a replica, not for a slot).
    pub fn slots_free_in(&self, position: usize) -> Option<f64> {
        if self.running == 0 {
            return None;
        }
        let age = self.oldest.as_secs_f64();
        let service = match self.mean {
            Some(m) if m.as_secs_f64() > age => m.as_secs_f64(),
            _ => 2.0 * age,
        };
        let after_first = position.saturating_sub(1) as f64 * service / f64::from(self.running);
        Some(service - age + after_first)
    }
}

#[derive(Debug, Default)]
struct Times {
    /// Mean service time, seconds.
    mean: Option<f64>,
    /// Dispatch instants of the requests running, by admission order.
    running: BTreeMap<u64, Instant>,
    next: u64,
}

/// One model's service times (shared with the [`InService`] of its running requests).
#[derive(Debug, Default)]
pub struct ServiceTimes {
    times: Mutex<Times>,
}

impl ServiceTimes {
    fn lock(&self) -> MutexGuard<'_, Times> {
        self.times.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Counts a request dispatched at `now` as running until the returned value drops.
    pub fn start(self: &Arc<Self>, now: Instant) -> InService {
        let mut t = self.lock();
        let seq = t.next;
        t.next += 1;
        t.running.insert(seq, now);
        InService { times: Arc::clone(self), seq }
    }

    fn finish(&self, seq: u64, now: Instant) {
        let mut t = self.lock();
        if let Some(since) = t.running.remove(&seq) {
            let took = now.saturating_duration_since(since).as_secs_f64();
            t.mean = Some(t.mean.map_or(took, |m| m + MEAN_WEIGHT * (took - m)));
        }
    }

    /// What is known at `now`, with `running` the requests of the model on its replicas
    /// (the router's own count: requests dispatched other than through the queue included).
    pub fn at(&self, now: Instant, running: u32) -> Service {
        let t = self.lock();
        let oldest = t.running.values().next().map_or(Duration::ZERO, |s| now.saturating_duration_since(*s));
        Service { running, oldest, mean: t.mean.map(Duration::from_secs_f64) }
    }
}

/// A request of a model running on a replica; dropped with its `DispatchGuard`, it records
/// how long the request held its slot.
#[derive(Debug)]
pub struct InService {
    times: Arc<ServiceTimes>,
    seq: u64,
}

impl Drop for InService {
    fn drop(&mut self) {
        self.times.finish(self.seq, Instant::now());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(running: u32, oldest_s: f64, mean_s: Option<f64>) -> Service {
        Service { running, oldest: Duration::from_secs_f64(oldest_s), mean: mean_s.map(Duration::from_secs_f64) }
    }

    #[test]
    fn slots_free_after_the_running_requests_finish() {
        // 8 slots busy with requests of 2.8 s each, dispatched 0.05 s ago (a burst into free
        // slots): the 9th in line gets a slot when the first wave is done and one more
        // request has run, not within a second.
        let s = service(8, 0.05, Some(2.8));
        let w = s.slots_free_in(9).unwrap_or_default();
        assert!((w - (2.75 + 2.8)).abs() < 1e-9, "{w}");
        // The next in line: when the oldest finishes.
        assert!((s.slots_free_in(1).unwrap_or_default() - 2.75).abs() < 1e-9);
        // One slot, requests of 1 s, the oldest half done: 0.5 s, then 1 s per position.
        assert_eq!(service(1, 0.5, Some(1.0)).slots_free_in(3), Some(2.5));
        // Nothing runs: no estimate (the queue waits for a replica).
        assert_eq!(service(0, 0.0, Some(1.0)).slots_free_in(3), None);
    }

    #[test]
    fn a_request_that_outlasts_the_mean_or_has_none_is_expected_to_run_as_long_again() {
        // 8 requests running for 3 s, none finished yet: each expected to take 6 s.
        assert_eq!(service(8, 3.0, None).slots_free_in(1), Some(3.0));
        assert_eq!(service(8, 3.0, None).slots_free_in(9), Some(3.0 + 6.0));
        // A mean of 2 s from earlier, shorter requests says nothing of one running for 5 s.
        assert_eq!(service(2, 5.0, Some(2.0)).slots_free_in(1), Some(5.0));
    }

    #[test]
    fn service_times_follow_dispatch_and_release() {
        let t0 = Instant::now();
        let times = Arc::new(ServiceTimes::default());
        assert_eq!(times.at(t0, 0), Service::default());
        let a = times.start(t0);
        let b = times.start(t0 + Duration::from_secs(1));
        let s = times.at(t0 + Duration::from_secs(3), 2);
        assert_eq!((s.running, s.oldest, s.mean), (2, Duration::from_secs(3), None));
        times.finish(a.seq, t0 + Duration::from_secs(2));
        // Its drop finds it recorded already.
        drop(a);
        let s = times.at(t0 + Duration::from_secs(3), 1);
        assert_eq!((s.oldest, s.mean), (Duration::from_secs(2), Some(Duration::from_secs(2))));
        times.finish(b.seq, t0 + Duration::from_secs(8));
        drop(b);
        let s = times.at(t0 + Duration::from_secs(9), 0);
        // 2 s, then 7 s weighted 0.2: 3 s.
        assert_eq!((s.oldest, s.mean.map(|m| (m.as_secs_f64() * 1e6).round() / 1e6)), (Duration::ZERO, Some(3.0)));
        // Dropping records the release.
        let c = times.start(Instant::now());
        drop(c);
        assert!(times.lock().running.is_empty());
    }
}
