//! Replica selection: which Ready replica of a model gets the next request.
//!
//! [`select`] filters the model's replicas down to those that may take work (Ready, not
//! ejected, not excluded by a retry, below their in-flight limit: 1 for a replica back from
//! an ejection until a request on it succeeds), asks a [`BalancePolicy`]
//! to choose, and admits the request with a [`DispatchGuard`] that counts its load from the
//! moment of dispatch until the guard drops (stream end, error or client disconnect); the
//! drop wakes the admission queue (`crate::admission`), whose waiters may take the slot.
//! `capacity.rs` decides each replica's limit from what it reports. Policies: `p2c.rs`
//! (power of two choices on load) and `prefix.rs` (cache-aware: the longest cached prompt
//! prefix against load, with a load guard).

pub mod capacity;
pub mod p2c;
mod policy;
pub mod prefix;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::Notify;

use crate::routes::{ReplicaRoute, ReplicaStats, RouteSnapshot};

pub use p2c::PowerOfTwoChoices;
pub use policy::{BalancePolicy, RequestHint, load_of};
pub use prefix::PrefixAware;

/// Why no replica was chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    /// No route mentions this model.
    #[error("model not found")]
    UnknownModel,
    /// The model exists but no replica can take work now (draining, ejected, or tried).
    #[error("no ready replica for this model")]
    NoneReady,
    /// Every ready replica is at its in-flight limit.
    #[error("every replica is at its in-flight limit")]
    AllFull,
}

/// Counts one request's load on a replica; releases it on drop and wakes whoever waits for
/// a slot (the admission queue).
#[derive(Debug)]
pub struct DispatchGuard {
    stats: Arc<ReplicaStats>,
    tokens: u64,
    cached: u64,
    released: Arc<Notify>,
    /// Dropped when the slot is released (the admission queue's service time of the request).
    attached: Option<Box<dyn std::fmt::Debug + Send + Sync>>,
}

impl DispatchGuard {
    /// Keeps `value` until the slot is released, then drops it (before waking the queue).
    pub fn attach(&mut self, value: Box<dyn std::fmt::Debug + Send + Sync>) {
        self.attached = Some(value);
    }
}

impl Drop for DispatchGuard {
    fn drop(&mut self) {
        self.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.stats.tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        self.stats.cached_tokens.fetch_sub(self.cached, Ordering::Relaxed);
        drop(self.attached.take());
        self.released.notify_one();
    }
}

/// Requests `r` may hold now: its limit, or 1 while it is on probation after an ejection
/// (`ReplicaStats::on_probation`: one request finds out whether it is back).
fn limit(r: &ReplicaRoute) -> u32 {
    if r.stats.on_probation() { r.max_in_flight.min(1) } else { r.max_in_flight }
}

/// Tries to take a slot on `r` for a request of `tokens` tokens, `cached` of them expected
/// in its prefix cache; `None` when it is full.
fn try_admit(r: &ReplicaRoute, tokens: u64, cached: u64, released: &Arc<Notify>) -> Option<DispatchGuard> {
    let prev = r.stats.in_flight.fetch_add(1, Ordering::Relaxed);
    if prev >= limit(r) {
        r.stats.in_flight.fetch_sub(1, Ordering::Relaxed);
        return None;
    }
    let cached = cached.min(tokens);
    r.stats.tokens.fetch_add(tokens, Ordering::Relaxed);
    r.stats.cached_tokens.fetch_add(cached, Ordering::Relaxed);
    r.stats.dispatched.fetch_add(1, Ordering::Relaxed);
    r.stats.record_dispatch(std::time::Instant::now());
    Some(DispatchGuard { stats: r.stats.clone(), tokens, cached, released: Arc::clone(released), attached: None })
}

/// Chooses and admits a replica of `model`, skipping replica ids in `exclude`.
///
/// # Errors
/// [`SelectError::UnknownModel`], [`SelectError::NoneReady`] or [`SelectError::AllFull`].
pub fn select(
    snap: &RouteSnapshot,
    model: &str,
    exclude: &[String],
    now_ms: u64,
    policy: &dyn BalancePolicy,
    hint: &RequestHint,
) -> Result<(Arc<ReplicaRoute>, DispatchGuard), SelectError> {
    let replicas = snap.models.get(model).ok_or(SelectError::UnknownModel)?;
    let mut candidates: Vec<&Arc<ReplicaRoute>> = replicas
        .iter()
        .filter(|r| r.is_ready() && !r.stats.is_ejected(now_ms) && !exclude.contains(&r.replica_id))
        .collect();
    if candidates.is_empty() {
        return Err(SelectError::NoneReady);
    }
    candidates.retain(|r| r.stats.in_flight.load(Ordering::Relaxed) < limit(r));
    while !candidates.is_empty() {
        let i = policy.pick(&candidates, hint).min(candidates.len() - 1);
        let cached = policy.expected_cached(candidates[i], hint);
        if let Some(g) = try_admit(candidates[i], hint.expected_tokens, cached, &snap.released) {
            policy.admitted(candidates[i], hint);
            return Ok((candidates[i].clone(), g));
        }
        candidates.swap_remove(i);
    }
    Err(SelectError::AllFull)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Metrics;
    use crate::routes::Routes;
    use prism_common::proto::v1::{ReplicaState, RouteEntry, RouteTable};

    fn table(states: &[ReplicaState], limit: u32) -> Routes {
        let r = Routes::new(limit, Metrics::new());
        r.apply(RouteTable {
            served: vec![],
            unavailable: vec![],
            term: 0,
            models: vec![],
            version: 1,
            routes: states
                .iter()
                .enumerate()
                .map(|(i, s)| RouteEntry {
                    replica_id: format!("r{i}"),
                    model: "m".into(),
                    endpoint: format!("http://r{i}"),
                    state: *s as i32,
                    ..Default::default()
                })
                .collect(),
        });
        r
    }

    #[test]
    fn draining_never_picked_and_errors_are_distinct() {
        let routes = table(&[ReplicaState::Draining, ReplicaState::Ready], 2);
        let snap = routes.snapshot();
        let p = PowerOfTwoChoices;
        let h = RequestHint::tokens(10);
        for _ in 0..20 {
            let (r, _g) = select(&snap, "m", &[], 0, &p, &h).expect("one ready");
            assert_eq!(r.replica_id, "r1");
        }
        assert_eq!(select(&snap, "x", &[], 0, &p, &h).err(), Some(SelectError::UnknownModel));
        assert_eq!(select(&snap, "m", &["r1".into()], 0, &p, &h).err(), Some(SelectError::NoneReady));
        let g1 = select(&snap, "m", &[], 0, &p, &h).expect("slot 1");
        let g2 = select(&snap, "m", &[], 0, &p, &h).expect("slot 2");
        assert_eq!(select(&snap, "m", &[], 0, &p, &h).err(), Some(SelectError::AllFull));
        assert_eq!(snap.models["m"][1].stats.tokens.load(Ordering::Relaxed), 20);
        drop((g1, g2));
        assert_eq!(snap.models["m"][1].stats.tokens.load(Ordering::Relaxed), 0);
        assert!(select(&snap, "m", &[], 0, &p, &h).is_ok());
    }

    /// A replica whose ejection ended takes one request until one succeeds: a replica still
    /// down fails one request, not every one that waited for it.
    #[test]
    fn a_replica_back_from_an_ejection_takes_one_request_until_one_succeeds() {
        let routes = table(&[ReplicaState::Ready], 4);
        let snap = routes.snapshot();
        let (p, h) = (PowerOfTwoChoices, RequestHint::tokens(1));
        let stats = &snap.models["m"][0].stats;
        stats.record_failure(0, std::time::Duration::from_millis(100));
        assert_eq!(select(&snap, "m", &[], 50, &p, &h).err(), Some(SelectError::NoneReady), "ejected");
        let probe = select(&snap, "m", &[], 100, &p, &h).expect("the probe");
        assert_eq!(select(&snap, "m", &[], 100, &p, &h).err(), Some(SelectError::AllFull));
        stats.record_success();
        let more: Vec<_> = (0..3).map(|_| select(&snap, "m", &[], 100, &p, &h).expect("its full limit")).collect();
        drop((probe, more));
    }

    #[test]
    fn load_counted_from_dispatch_spreads_evenly() {
        let routes = table(&[ReplicaState::Ready, ReplicaState::Ready, ReplicaState::Ready], 1000);
        let snap = routes.snapshot();
        let h = RequestHint::tokens(5000);
        // Held guards = long prompts still in flight: the next pick must avoid loaded replicas.
        let guards: Vec<_> =
            (0..300).map(|_| select(&snap, "m", &[], 0, &PowerOfTwoChoices, &h).expect("admit")).collect();
        for r in &snap.models["m"] {
            let n = r.stats.in_flight.load(Ordering::Relaxed);
            assert!((80..=120).contains(&n), "replica {} got {n}", r.replica_id);
        }
        drop(guards);
    }
}
