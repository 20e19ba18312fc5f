//! The data of one model's admission queue: its FIFO of waiters with their token total, and
//! the service times (`service.rs`) that `Retry-After` is derived from. Generic over what a
//! waiter is sent, so it is tested without replicas.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::time::{Duration, Instant};

use super::service::ServiceTimes;
use crate::prefix::PrefixKeys;

/// Smallest `Retry-After` the router sends, seconds.
pub const MIN_RETRY_AFTER_S: u32 = 1;
/// Largest `Retry-After` the router sends, seconds (a client told to wait longer would rather
/// give up; the queue's state a minute from now is unknown anyway).
pub const MAX_RETRY_AFTER_S: u32 = 60;

/// One request waiting for a replica slot.
pub struct Waiter<T> {
    /// Unique within the router (the key a leaving request removes itself by).
    pub id: u64,
    /// Its estimated prompt + decode tokens (counted against `--max-queued-tokens`).
    pub tokens: u64,
    /// Its block hashes, for the cache-aware policy when it is served.
    pub prefix: Option<Arc<PrefixKeys>>,
    /// When it entered the queue.
    pub since: Instant,
    /// Where its slot (or its error) is sent.
    pub tx: oneshot::Sender<T>,
}

/// How long the requests queued now may still wait at most (each leaves by its
/// `--max-queue-wait`: served, or refused), for [`retry_after_s`].
#[derive(Debug, Clone, Copy)]
pub struct QueueBounds {
    /// Until the first in line has left (a place in the queue frees by then at the latest).
    pub first_gone: Duration,
    /// Until every request queued now has left, when that frees what the refused request
    /// lacks: a place in the queue (a count or token bound). `None` for a request whose wait
    /// ended: the queue emptying by timeouts gives it no slot when it comes back.
    pub all_gone: Option<Duration>,
}

/// `Retry-After` seconds for a refused request: `slots_free_in`, the time until as many
/// slots have freed as requests would be ahead of it and it (`Service::slots_free_in`; a
/// retry then is likely admitted: the queue has room, and a slot is near), but no later than
/// `bounds.all_gone` when that is given. With no estimate (nothing runs: the queue waits for
/// a replica), `bounds.first_gone`: the queue has room by then whatever the replicas do.
/// Clamped to [`MIN_RETRY_AFTER_S`]..=[`MAX_RETRY_AFTER_S`].
pub fn retry_after_s(slots_free_in: Option<f64>, bounds: QueueBounds) -> u32 {
    let secs = match slots_free_in {
        Some(s) => bounds.all_gone.map_or(s, |all| s.min(all.as_secs_f64())),
        None => bounds.first_gone.as_secs_f64(),
    };
    // Clamped to 1..=60 first, so the cast is exact.
    secs.ceil().clamp(f64::from(MIN_RETRY_AFTER_S), f64::from(MAX_RETRY_AFTER_S)) as u32
}

/// One model's queue: waiters in arrival order and their token total.
pub struct ModelQueue<T> {
    waiters: VecDeque<Waiter<T>>,
    tokens: u64,
    /// Service times of this model's requests admitted here (from the queue or straight
    /// through).
    pub service: Arc<ServiceTimes>,
}

impl<T> Default for ModelQueue<T> {
    fn default() -> Self {
        Self { waiters: VecDeque::new(), tokens: 0, service: Arc::default() }
    }
}

impl<T> ModelQueue<T> {
    /// Requests waiting.
    pub fn len(&self) -> usize {
        self.waiters.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Estimated tokens of the waiting requests.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// The first in line.
    pub fn front(&self) -> Option<&Waiter<T>> {
        self.waiters.front()
    }

    /// How long the first in line has waited at `now`.
    pub fn oldest_wait(&self, now: Instant) -> Duration {
        self.waiters.front().map_or(Duration::ZERO, |w| now.saturating_duration_since(w.since))
    }

    /// How long the last in line has waited at `now`.
    pub fn newest_wait(&self, now: Instant) -> Duration {
        self.waiters.back().map_or(Duration::ZERO, |w| now.saturating_duration_since(w.since))
    }

    /// When the requests queued now have left at the latest, each waiting at most
    /// `max_wait` (a request back after a failed attempt has less left: these are bounds).
    pub fn bounds(&self, now: Instant, max_wait: Duration) -> QueueBounds {
        QueueBounds {
            first_gone: max_wait.saturating_sub(self.oldest_wait(now)),
            all_gone: Some(max_wait.saturating_sub(self.newest_wait(now))),
        }
    }

    /// Appends `w` at the back (no overtaking).
    pub fn push(&mut self, w: Waiter<T>) {
        self.tokens = self.tokens.saturating_add(w.tokens);
        self.waiters.push_back(w);
    }

    /// Puts `w` first in line: a request back after a failed attempt arrived before every
    /// request waiting now.
    pub fn push_front(&mut self, w: Waiter<T>) {
        self.tokens = self.tokens.saturating_add(w.tokens);
        self.waiters.push_front(w);
    }

    /// Takes the first in line.
    pub fn pop_front(&mut self) -> Option<Waiter<T>> {
        let w = self.waiters.pop_front()?;
        self.tokens = self.tokens.saturating_sub(w.tokens);
        Some(w)
    }

    /// Takes the waiter `id` out wherever it is (it left or timed out); `None` when it is no
    /// longer queued.
    pub fn remove(&mut self, id: u64) -> Option<Waiter<T>> {
        let i = self.waiters.iter().position(|w| w.id == id)?;
        let w = self.waiters.remove(i)?;
        self.tokens = self.tokens.saturating_sub(w.tokens);
        Some(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admission::service::Service;

    fn waiter(id: u64, tokens: u64) -> (Waiter<u32>, oneshot::Receiver<u32>) {
        let (tx, rx) = oneshot::channel();
        (Waiter { id, tokens, prefix: None, since: Instant::now(), tx }, rx)
    }

    #[test]
    fn fifo_order_and_token_total_follow_push_pop_and_remove() {
        let mut q = ModelQueue::<u32>::default();
        let mut rxs = Vec::new();
        for (id, tokens) in [(1, 10), (2, 20), (3, 30)] {
            let (w, rx) = waiter(id, tokens);
            q.push(w);
            rxs.push(rx);
        }
        assert_eq!((q.len(), q.tokens()), (3, 60));
        assert!(q.remove(2).is_some(), "a request that leaves is taken out of the middle");
        assert!(q.remove(2).is_none());
        assert_eq!((q.len(), q.tokens()), (2, 40));
        let (back, rx) = waiter(4, 5);
        q.push_front(back);
        rxs.push(rx);
        assert_eq!((q.len(), q.tokens()), (3, 45));
        assert_eq!(q.pop_front().map(|w| w.id), Some(4), "a request back after a failed attempt goes first");
        assert_eq!(q.pop_front().map(|w| w.id), Some(1));
        assert_eq!(q.pop_front().map(|w| w.id), Some(3));
        assert!(q.pop_front().is_none());
        assert_eq!((q.len(), q.tokens(), q.is_empty()), (0, 0, true));
    }

    fn bounds(first: u64, all: u64) -> QueueBounds {
        QueueBounds { first_gone: Duration::from_secs(first), all_gone: Some(Duration::from_secs(all)) }
    }

    #[test]
    fn retry_after_is_the_time_until_enough_slots_free_clamped() {
        let wait = bounds(30, 30);
        assert_eq!(retry_after_s(Some(0.2), wait), MIN_RETRY_AFTER_S);
        assert_eq!(retry_after_s(Some(4.5), wait), 5, "whole seconds, rounded up");
        assert_eq!(retry_after_s(Some(5000.0), bounds(60, 600)), MAX_RETRY_AFTER_S);
        assert_eq!(retry_after_s(None, wait), 30, "nothing runs, the first just queued");
        assert_eq!(retry_after_s(None, bounds(600, 600)), MAX_RETRY_AFTER_S);
        assert_eq!(retry_after_s(None, bounds(0, 0)), MIN_RETRY_AFTER_S);
    }

    /// The tester's burst: 8 slots busy with requests of 2.8 s dispatched 0.05 s ago, 8
    /// queued. The admission rate of that instant (8 in a second) said 2 s, before any slot
    /// frees; the service times say when the queue has room and the refused one a slot.
    #[test]
    fn a_burst_into_free_slots_does_not_shorten_the_hint() {
        let s = Service { running: 8, oldest: Duration::from_millis(50), mean: Some(Duration::from_millis(2800)) };
        assert_eq!(retry_after_s(s.slots_free_in(9), bounds(30, 30)), 6);
    }

    /// Every slot busy for 7 s with requests dispatched 3 s ago and none finished, while 22
    /// waiters reach their 3 s `--max-queue-wait` at once: the queue empties by timeouts,
    /// which gives them no slot; the hint is when the running requests are expected to end.
    #[test]
    fn a_waiter_whose_wait_ended_is_told_when_slots_free_not_when_the_queue_empties() {
        let ended = QueueBounds { first_gone: Duration::ZERO, all_gone: None };
        let s = Service { running: 8, oldest: Duration::from_secs(3), mean: None };
        assert_eq!(retry_after_s(s.slots_free_in(1), ended), 3, "the last to go: first in line");
        assert_eq!(retry_after_s(s.slots_free_in(22), ended), 19);
        let known = Service { mean: Some(Duration::from_secs(7)), ..s };
        assert_eq!(retry_after_s(known.slots_free_in(1), ended), 4, "7 s requests 3 s in");
    }

    #[test]
    fn retry_after_never_outlasts_the_waits_of_those_queued() {
        // Nothing runs (the queue waits for a replica), the first in line has 3 s left of its
        // 30 s: the queue has room by then (it is served or refused), not 30 s from now.
        assert_eq!(retry_after_s(None, bounds(3, 25)), 3);
        // 50 s until enough slots free, but every one queued has left within 25 s.
        assert_eq!(retry_after_s(Some(50.0), bounds(3, 25)), 25);
    }

    #[test]
    fn queue_bounds_follow_the_first_and_last_waiters() {
        let now = Instant::now();
        let mut q = ModelQueue::<u32>::default();
        let (mut first, _rx1) = waiter(1, 1);
        first.since = now.checked_sub(Duration::from_secs(27)).unwrap_or(now);
        let (mut last, _rx2) = waiter(2, 1);
        last.since = now.checked_sub(Duration::from_secs(5)).unwrap_or(now);
        q.push(first);
        q.push(last);
        let b = q.bounds(now, Duration::from_secs(30));
        assert!(b.first_gone <= Duration::from_secs(3), "{b:?}");
        assert!(b.all_gone.is_some_and(|a| a <= Duration::from_secs(25) && a > Duration::from_secs(24)), "{b:?}");
        let empty = ModelQueue::<u32>::default().bounds(now, Duration::from_secs(30));
        assert_eq!((empty.first_gone, empty.all_gone), (Duration::from_secs(30), Some(Duration::from_secs(30))));
    }
}
