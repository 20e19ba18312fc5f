//! The data of one model's admission queue: its FIFO of waiters with their token total, and
//! the drain rate that `Retry-After` is derived from. Generic over what a waiter is sent, so
//! it is tested without replicas.

use std::collections::VecDeque;
use std::sync::Arc;

use tokio::sync::oneshot;
use tokio::time::{Duration, Instant};

use crate::prefix::PrefixKeys;

/// Smallest `Retry-After` the router sends, seconds.
pub const MIN_RETRY_AFTER_S: u32 = 1;
/// Largest `Retry-After` the router sends, seconds (a client told to wait longer would rather
/// give up; the queue's state a minute from now is unknown anyway).
pub const MAX_RETRY_AFTER_S: u32 = 60;
/// Seconds of history the drain rate is measured over.
const DRAIN_WINDOW_S: usize = 10;

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
    /// Back after an attempt that failed before its first token: it queued or was served
    /// once already, so its admission is not counted again in the drain rate.
    pub again: bool,
    /// Where its slot (or its error) is sent.
    pub tx: oneshot::Sender<T>,
}

/// Requests admitted per second over the last [`DRAIN_WINDOW_S`] seconds, in one-second
/// buckets keyed by whole seconds since the admission epoch.
#[derive(Debug, Default)]
pub struct DrainRate {
    buckets: [u32; DRAIN_WINDOW_S],
    /// The second `buckets` are current up to.
    head: u64,
}

impl DrainRate {
    /// Clears the buckets of the seconds between the last update and `sec`.
    fn advance(&mut self, sec: u64) {
        if sec <= self.head {
            return;
        }
        let n = (sec - self.head).min(DRAIN_WINDOW_S as u64);
        for i in 1..=n {
            self.buckets[((self.head + i) % DRAIN_WINDOW_S as u64) as usize] = 0;
        }
        self.head = sec;
    }

    /// Counts one request admitted during second `sec`.
    pub fn record(&mut self, sec: u64) {
        self.advance(sec);
        let i = (sec % DRAIN_WINDOW_S as u64) as usize;
        self.buckets[i] = self.buckets[i].saturating_add(1);
    }

    /// Requests admitted per second at second `sec`: the window's count over the seconds
    /// since its earliest admission (at least one), so a queue that started draining a moment
    /// ago (a replica just Ready, long requests just done) is not diluted by the idle seconds
    /// before; `None` when nothing was admitted in the window.
    pub fn per_second(&mut self, sec: u64) -> Option<f64> {
        self.advance(sec);
        // A caller that read the clock before another recorded a later second.
        let sec = sec.max(self.head);
        // Seconds back from `sec` to the earliest one with an admission, oldest first.
        let window = DRAIN_WINDOW_S as u64;
        let earliest =
            (0..window.min(sec + 1)).rev().find(|back| self.buckets[((sec - back) % window) as usize] > 0)?;
        let sum: u32 = self.buckets.iter().sum();
        Some(f64::from(sum) / (earliest + 1) as f64)
    }
}

/// How long the requests queued now may still wait at most (each leaves by its
/// `--max-queue-wait`: served, or refused), for [`retry_after_s`].
#[derive(Debug, Clone, Copy)]
pub struct QueueBounds {
    /// Until the first in line has left (a place in the queue frees by then at the latest).
    pub first_gone: Duration,
    /// Until every request queued now has left.
    pub all_gone: Duration,
}

/// `Retry-After` seconds for a request refused when it would be `position`-th in line: the
/// time the queue takes to drain that far at `rate` requests per second (a retry then is
/// likely admitted, and behind fewer requests than wait now), but no later than
/// `bounds.all_gone`. When nothing drained lately, `bounds.first_gone`: the queue has room by
/// then whatever the replicas do. Clamped to [`MIN_RETRY_AFTER_S`]..=[`MAX_RETRY_AFTER_S`].
pub fn retry_after_s(position: usize, rate: Option<f64>, bounds: QueueBounds) -> u32 {
    let secs = match rate {
        Some(r) if r > 0.0 => (position as f64 / r).min(bounds.all_gone.as_secs_f64()),
        _ => bounds.first_gone.as_secs_f64(),
    };
    // Clamped to 1..=60 first, so the cast is exact.
    secs.ceil().clamp(f64::from(MIN_RETRY_AFTER_S), f64::from(MAX_RETRY_AFTER_S)) as u32
}

/// One model's queue: waiters in arrival order and their token total.
pub struct ModelQueue<T> {
    waiters: VecDeque<Waiter<T>>,
    tokens: u64,
    /// Admissions of this model (from the queue or straight through).
    pub drain: DrainRate,
}

impl<T> Default for ModelQueue<T> {
    fn default() -> Self {
        Self { waiters: VecDeque::new(), tokens: 0, drain: DrainRate::default() }
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
            all_gone: max_wait.saturating_sub(self.newest_wait(now)),
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

    fn waiter(id: u64, tokens: u64) -> (Waiter<u32>, oneshot::Receiver<u32>) {
        let (tx, rx) = oneshot::channel();
        (Waiter { id, tokens, prefix: None, since: Instant::now(), again: false, tx }, rx)
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

    #[test]
    fn drain_rate_counts_the_last_ten_seconds() {
        let mut d = DrainRate::default();
        assert_eq!(d.per_second(0), None, "nothing drained yet");
        for _ in 0..4 {
            d.record(100);
        }
        assert_eq!(d.per_second(100), Some(4.0), "a burst in the first second counts over one second");
        assert_eq!(d.per_second(101), Some(2.0));
        for s in 101..110 {
            d.record(s);
        }
        assert_eq!(d.per_second(109), Some(1.3), "13 over the 10 s window");
        assert_eq!(d.per_second(110), Some(0.9), "second 100 left the window");
        assert_eq!(d.per_second(130), None, "nothing in the last 10 s");
    }

    #[test]
    fn drain_rate_counts_from_the_first_admission_in_the_window() {
        let mut d = DrainRate::default();
        d.record(100);
        assert_eq!(d.per_second(105), Some(1.0 / 6.0), "one in the six seconds since");
        // A lull, then the queue drains 30 within a second (its replica just came Ready).
        for _ in 0..30 {
            d.record(150);
        }
        assert_eq!(d.per_second(150), Some(30.0), "the idle seconds before do not dilute it");
        assert_eq!(d.per_second(152), Some(10.0));
        assert_eq!(DrainRate::default().per_second(3), None);
    }

    fn bounds(first: u64, all: u64) -> QueueBounds {
        QueueBounds { first_gone: Duration::from_secs(first), all_gone: Duration::from_secs(all) }
    }

    #[test]
    fn retry_after_is_the_drain_time_clamped() {
        let wait = bounds(30, 30);
        assert_eq!(retry_after_s(1, Some(2.0), wait), 1, "next in line at 2/s: within a second");
        assert_eq!(retry_after_s(9, Some(2.0), wait), 5, "ceil(9 / 2)");
        assert_eq!(retry_after_s(10_000, Some(1.0), bounds(60, 600)), MAX_RETRY_AFTER_S);
        assert_eq!(retry_after_s(1, Some(1000.0), wait), MIN_RETRY_AFTER_S);
        assert_eq!(retry_after_s(5, None, wait), 30, "nothing drained, the first just queued");
        assert_eq!(retry_after_s(5, None, bounds(600, 600)), MAX_RETRY_AFTER_S);
        assert_eq!(retry_after_s(5, None, bounds(0, 0)), MIN_RETRY_AFTER_S);
    }

    #[test]
    fn retry_after_never_outlasts_the_waits_of_those_queued() {
        // Nothing drained in the window, the first in line has 3 s left of its 30 s: the
        // queue has room by then (it is served or refused), not 30 s from now.
        assert_eq!(retry_after_s(10, None, bounds(3, 25)), 3);
        // 100 ahead at 2/s would be 50 s, but every one of them has left within 25 s.
        assert_eq!(retry_after_s(100, Some(2.0), bounds(3, 25)), 25);
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
        assert!(b.all_gone <= Duration::from_secs(25) && b.all_gone > Duration::from_secs(24), "{b:?}");
        let empty = ModelQueue::<u32>::default().bounds(now, Duration::from_secs(30));
        assert_eq!((empty.first_gone, empty.all_gone), (Duration::from_secs(30), Duration::from_secs(30)));
    }
}
