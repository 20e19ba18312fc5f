//! What a balancing policy sees and implements: the request's [`RequestHint`], the
//! [`BalancePolicy`] trait, and a replica's load in tokens ([`load_of`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::prefix::PrefixKeys;
use crate::routes::ReplicaRoute;

/// What the policy may know about the request.
#[derive(Debug, Clone, Default)]
pub struct RequestHint {
    /// Prompt tokens (estimated for text) plus the expected decode tokens.
    pub expected_tokens: u64,
    /// The prompt's token ids and block hashes under its replicas' codecs (cache-aware
    /// routing); `None` when no replica of the model has a codec or the policy needs none.
    pub prefix: Option<Arc<PrefixKeys>>,
}

impl RequestHint {
    /// A hint with a token estimate alone.
    pub fn tokens(expected_tokens: u64) -> Self {
        Self { expected_tokens, prefix: None }
    }
}

/// A replica-choice policy. Candidates are all admissible; return the index of the pick.
pub trait BalancePolicy: Send + Sync + 'static {
    /// Picks one of `candidates` (never empty) for a request described by `hint`.
    fn pick(&self, candidates: &[&Arc<ReplicaRoute>], hint: &RequestHint) -> usize;

    /// Whether the policy uses [`RequestHint::prefix`] (the dispatcher tokenizes only then).
    fn wants_prefix(&self) -> bool {
        false
    }

    /// Prompt tokens of the request expected in `replica`'s prefix cache, counted with its
    /// load while it is in flight (`ReplicaStats::cached_tokens`); 0 without prefix caching.
    fn expected_cached(&self, _replica: &ReplicaRoute, _hint: &RequestHint) -> u64 {
        0
    }

    /// Called once the request holds a slot on `replica` (its pick, or the next candidate
    /// when the pick was full in the meantime).
    fn admitted(&self, _replica: &ReplicaRoute, _hint: &RequestHint) {}
}

/// Load of a replica in tokens: dispatched-and-unfinished tokens counted here, corrected
/// upwards by the worker's last load report (which also sees other routers' requests).
pub fn load_of(r: &ReplicaRoute) -> u64 {
    r.stats.tokens.load(Ordering::Relaxed).max(r.reported_tokens)
}
