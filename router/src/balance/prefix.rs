//! Cache-aware replica choice (`--routing-policy prefix-aware`): send a request where the
//! longest prefix of its prompt is already in the replica's prefix cache, unless that
//! replica is much busier than the others.
//!
//! Cost of replica `i` (Dynamo's KV router: prefill work to do plus the load already
//! there), in tokens:
//!
//! `cost_i = weight × (prompt_tokens − cached_tokens_i) + load_i`
//!
//! - `cached_tokens_i`: full blocks of the request's chained block hashes found, from the
//!   first block on, in the replica's prefix index (`crate::prefix`), times the block size.
//! - `load_i`: the tokens in flight there ([`load_of`]: prompt + expected decode of each
//!   request from dispatch, raised to the worker's report) less the prompt tokens of this
//!   router's requests there that were expected cached at dispatch: K/V of a shared prefix is
//!   held once and not computed again (Dynamo counts active blocks the same way), so a replica
//!   serving one prefix to many requests is not taken for busier than it is. A cold request
//!   (nothing cached anywhere) goes to the least loaded replica. `weight`
//!   (`--prefix-cache-weight`, default `config::DEFAULT_PREFIX_CACHE_WEIGHT` = 2: an uncached
//!   prompt token costs prefill compute now and KV memory after, a token in flight mostly the
//!   latter) sets how much imbalance a cached prefix outweighs.
//! - Load guards (SGLang's balance thresholds, llm-d's and Dynamo's hot-prefix problem): a
//!   replica counts nothing cached, so a shared system prompt cannot pin the traffic to the
//!   replicas that computed it first, when
//!   - its load exceeds [`GUARD_RATIO`] × the candidates' mean plus the request's own tokens
//!     (slack, so 1 request against 0 is not "hot"): a burst piling up on it now; or
//!   - its recent dispatches (this router's, decayed with a 20 s half-life:
//!     `ReplicaStats::recent_dispatches`) exceed [`SHARE_GUARD_RATIO`] × the candidates' mean
//!     plus one request: a steady share above its due, which at low concurrency never shows
//!     as load (one request at a time everywhere) yet leaves a replica idle. The cold replica
//!     then takes a request, computes the prefix once, and competes on equal terms after.
//! - Ties (equal cost) fall to the candidate with the fewest recent dispatches, then to a
//!   random one: cold requests at an idle moment even out the replicas' shares, so the share
//!   guard below rarely has to break a prefix's affinity.
//!
//! Candidates are those `balance::select` admits (Ready, not ejected, below their limit):
//! capacity and the admission queue stay as they are. Replicas without a codec count no
//! cached tokens; when no candidate has one, or the request has no hashes, the pick is P2C.
//! After admission the request's hashes are recorded as expected on the chosen replica.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use rand::Rng;

use super::p2c::PowerOfTwoChoices;
use super::policy::{BalancePolicy, RequestHint, load_of};
use crate::metrics::{Metrics, RouteReason};
use crate::prefix::PrefixKeys;
use crate::routes::ReplicaRoute;

/// A replica loaded beyond this multiple of the mean (plus slack) gets no cache preference.
pub const GUARD_RATIO: f64 = 1.5;
/// A replica whose recent dispatches exceed this multiple of the mean (plus one) gets no cache
/// preference. Below 1.5, so that two of three replicas sharing all traffic (each at 1.5× the
/// mean) are both over it and the third gets its turn.
pub const SHARE_GUARD_RATIO: f64 = 1.25;

/// The cache-aware policy.
#[derive(Clone)]
pub struct PrefixAware {
    weight: f64,
    metrics: Metrics,
}

/// One candidate as the cost sees it.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Scored {
    cached: u64,
    hot: bool,
    cost: f64,
    recent: f64,
}

impl PrefixAware {
    /// The policy with prefill weight `weight` (≥ 0), counting its decisions in `metrics`.
    pub fn new(weight: f64, metrics: Metrics) -> Self {
        Self { weight: weight.max(0.0), metrics }
    }

    /// Scores every candidate; `None` when none has hashes for this request.
    fn score(&self, candidates: &[&Arc<ReplicaRoute>], hint: &RequestHint, now: Instant) -> Option<(Vec<Scored>, u64)> {
        let keys = hint.prefix.as_deref()?;
        let matched: Vec<Option<(u64, u64)>> = candidates.iter().map(|r| cached_on(r, keys, now)).collect();
        // Replicas without a codec: the longest prompt seen, nothing cached.
        let prompt = matched.iter().flatten().map(|(p, _)| *p).max()?;
        let loads: Vec<u64> = candidates.iter().map(|r| load(r)).collect();
        let mean = loads.iter().sum::<u64>() as f64 / loads.len() as f64;
        let guard = GUARD_RATIO * mean + hint.expected_tokens as f64;
        let recent: Vec<f64> = candidates.iter().map(|r| r.stats.recent_dispatches(now)).collect();
        let share_guard = SHARE_GUARD_RATIO * recent.iter().sum::<f64>() / recent.len() as f64 + 1.0;
        let scored = matched
            .iter()
            .zip(&loads)
            .zip(&recent)
            .map(|((m, &load), &recent)| {
                let (p, cached) = m.unwrap_or((prompt, 0));
                let hot = load as f64 > guard || recent > share_guard;
                let counted = if hot { 0 } else { cached };
                Scored { cached, hot, cost: self.weight * (p - counted) as f64 + load as f64, recent }
            })
            .collect();
        Some((scored, prompt))
    }
}

/// A replica's load for the cost: tokens in flight less those expected cached at dispatch.
fn load(r: &ReplicaRoute) -> u64 {
    load_of(r).saturating_sub(r.stats.cached_tokens.load(Ordering::Relaxed))
}

/// Prompt tokens of the request cached on `r` (full matched blocks, at most the prompt).
fn cached_on(r: &ReplicaRoute, keys: &PrefixKeys, now: Instant) -> Option<(u64, u64)> {
    r.cache.matched_blocks(keys, now).map(|(blocks, k)| {
        let prompt = k.ids.len() as u64;
        (prompt, (blocks as u64 * u64::from(k.key.block_size)).min(prompt))
    })
}

/// Index of the lowest cost; among equals the fewest recent dispatches (within half a
/// request), then a random one.
fn cheapest(scored: &[Scored]) -> usize {
    let best = scored.iter().map(|s| s.cost).fold(f64::INFINITY, f64::min);
    let tied = |i: &usize| scored[*i].cost <= best;
    let fewest = (0..scored.len()).filter(tied).map(|i| scored[i].recent).fold(f64::INFINITY, f64::min);
    let ties: Vec<usize> = (0..scored.len()).filter(|i| tied(i) && scored[*i].recent <= fewest + 0.5).collect();
    if ties.len() <= 1 {
        return ties.first().copied().unwrap_or(0);
    }
    ties[rand::rng().random_range(0..ties.len())]
}

/// Why the pick went where it did.
fn reason(scored: &[Scored], i: usize) -> RouteReason {
    let best_cached = scored.iter().map(|s| s.cached).max().unwrap_or(0);
    if best_cached == 0 {
        RouteReason::Cold
    } else if scored[i].cached == best_cached {
        RouteReason::PrefixHit
    } else if scored.iter().any(|s| s.hot && s.cached == best_cached) {
        RouteReason::LoadGuard
    } else {
        RouteReason::Load
    }
}

impl BalancePolicy for PrefixAware {
    fn pick(&self, candidates: &[&Arc<ReplicaRoute>], hint: &RequestHint) -> usize {
        let Some((scored, prompt)) = self.score(candidates, hint, Instant::now()) else {
            self.metrics.routed(RouteReason::NoCodec, 0, 0);
            return PowerOfTwoChoices.pick(candidates, hint);
        };
        let i = cheapest(&scored);
        self.metrics.routed(reason(&scored, i), scored[i].cached, prompt);
        i
    }

    fn wants_prefix(&self) -> bool {
        true
    }

    fn expected_cached(&self, replica: &ReplicaRoute, hint: &RequestHint) -> u64 {
        let Some(keys) = hint.prefix.as_deref() else { return 0 };
        cached_on(replica, keys, Instant::now()).map_or(0, |(_, cached)| cached)
    }

    fn admitted(&self, replica: &ReplicaRoute, hint: &RequestHint) {
        let Some(keys) = hint.prefix.as_deref() else { return };
        let Some(codec) = replica.cache.codec() else { return };
        if let Some(k) = keys.get(&codec.key) {
            replica.cache.index().expect(&k.hashes, Instant::now());
        }
    }
}

#[cfg(test)]
#[path = "prefix/tests.rs"]
mod tests;
