//! Whether this head was watching. Judgements of workers by time (a session silent for
//! `worker_timeout`, a node disconnected for that long) count only time the head itself was
//! running: a head process that was stopped (SIGSTOP, a frozen VM or container, a long GC-like
//! stall) or whose runtime was starved of CPU sees all its timers expire at once when it
//! resumes, before it has read what the workers sent meanwhile. Without this, one pause of the
//! head longer than `worker_timeout` declared every healthy worker Dead and re-placed its
//! replicas.
//!
//! A ticker stamps the time every [`TICK`]; a gap between two stamps longer than [`STALL`] is
//! a stall of the head, and a judgement starts its window no earlier than the stall's end.
//! Every judgement stamps too, so one that runs before the ticker after a resume still sees
//! the gap.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

/// How often the ticker stamps the time.
pub const TICK: Duration = Duration::from_millis(100);
/// A gap between stamps longer than this is a stall of the head (ten ticks: a busy runtime
/// delays a tick by milliseconds, a stopped process by seconds).
pub const STALL: Duration = Duration::from_secs(1);

/// The head's own liveness clock (see the module docs).
#[derive(Debug)]
pub struct StallWatch {
    origin: Instant,
    /// Milliseconds since `origin` of the latest stamp.
    stamped: AtomicU64,
    /// Milliseconds since `origin` at which the latest stall ended (0: none seen; the head's
    /// start is not a stall).
    resumed: AtomicU64,
}

impl Default for StallWatch {
    fn default() -> Self {
        Self { origin: Instant::now(), stamped: AtomicU64::new(0), resumed: AtomicU64::new(0) }
    }
}

impl StallWatch {
    /// A watch whose ticker runs on the current tokio runtime (when there is one) until the
    /// returned handle is the watch's only owner left.
    pub fn started() -> Arc<Self> {
        let watch = Arc::new(Self::default());
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let w = Arc::clone(&watch);
            rt.spawn(async move {
                while Arc::strong_count(&w) > 1 {
                    tokio::time::sleep(TICK).await;
                    w.stamp();
                }
            });
        }
        watch
    }

    fn ms(&self, t: Instant) -> u64 {
        u64::try_from(t.saturating_duration_since(self.origin).as_millis()).unwrap_or(u64::MAX)
    }

    /// Stamps the time; a gap since the previous stamp longer than [`STALL`] records a stall
    /// that ended now.
    pub fn stamp(&self) {
        let now = self.ms(Instant::now());
        let prev = self.stamped.fetch_max(now, Ordering::AcqRel);
        let gap = now.saturating_sub(prev);
        if gap > STALL.as_millis() as u64 {
            self.resumed.fetch_max(now, Ordering::AcqRel);
            tracing::warn!(
                stalled_ms = gap,
                "this head was not running (stopped or starved of CPU): time-based judgements of workers restart from now"
            );
        }
    }

    /// The start of the time this head has watched without a stall since `since`: `since`
    /// itself, or the end of a stall after it.
    pub fn watched_from(&self, since: Instant) -> Instant {
        self.stamp();
        match self.resumed.load(Ordering::Acquire) {
            0 => since,
            ms => since.max(self.origin + Duration::from_millis(ms)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stall_of_the_head_restarts_the_watched_time_and_ticks_do_not() {
        let watch = StallWatch::started();
        let since = Instant::now();
        // Running normally: the ticker stamps every 100 ms, nothing is a stall.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        assert_eq!(watch.watched_from(since), since, "no stall while the head runs");

        // A stall: a watch whose ticker never runs, left unstamped for longer than STALL, is
        // what a stopped head's watch looks like when the process resumes.
        let lone = StallWatch::default();
        lone.stamp();
        let before = Instant::now();
        std::thread::sleep(STALL + Duration::from_millis(300));
        let resumed = lone.watched_from(before);
        assert!(resumed > before + STALL, "the window restarts at the stall's end: {:?}", resumed - before);
        // Only once: the next judgement sees no new stall, and a later window is its own.
        let later = Instant::now();
        assert_eq!(lone.watched_from(later), later);
        assert_eq!(lone.watched_from(before), resumed);
        drop(watch);
    }
}
