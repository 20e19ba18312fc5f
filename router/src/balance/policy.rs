//! What a balancing policy sees and implements: the request's [`RequestHint`], the
//! [`BalancePolicy`] trait, and a replica's load in tokens ([`load_of`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::routes::ReplicaRoute;

/// What the policy may know about the request (room for prefix affinity).
#[derive(Debug, Clone, Copy, Default)]
pub struct RequestHint {
    /// Prompt tokens (estimated for text) plus the expected decode tokens.
    pub expected_tokens: u64,
}

/// A replica-choice policy. Candidates are all admissible; return the index of the pick.
pub trait BalancePolicy: Send + Sync + 'static {
    /// Picks one of `candidates` (never empty) for a request described by `hint`.
    fn pick(&self, candidates: &[&Arc<ReplicaRoute>], hint: &RequestHint) -> usize;
}

/// Load of a replica in tokens: dispatched-and-unfinished tokens counted here, corrected
/// upwards by the worker's last load report (which also sees other routers' requests).
pub fn load_of(r: &ReplicaRoute) -> u64 {
    r.stats.tokens.load(Ordering::Relaxed).max(r.reported_tokens)
}
