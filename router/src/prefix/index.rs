//! One replica's prefix index: the block hashes its engine's prefix cache holds, as its
//! `WatchPrefixCache` stream reports them (a reset replaces the set, deltas change it), plus
//! the hashes of requests this router just sent there ("expected"): a burst of requests with
//! one prefix sticks to the replica that got the first of them before the engine's events
//! arrive. An expected hash the engine never confirms expires after [`EXPECTED_TTL`].
//!
//! Lookups walk the request's chained hashes from the first block and stop at the first one
//! missing (a block hash names its whole prefix, so a later match without the earlier blocks
//! is no use to the engine either).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

/// How long a hash recorded at dispatch counts without the engine confirming it: longer than
/// a prefill of a long prompt under load takes, short enough that a request that failed (or
/// whose blocks were never cached) stops attracting traffic soon.
pub const EXPECTED_TTL: Duration = Duration::from_secs(5);

/// Expected entries beyond which expired ones are swept on insertion (keeps the map small
/// without a timer task).
const SWEEP_AT: usize = 4096;

/// Block hashes held by one replica's prefix cache (confirmed) or expected there soon.
#[derive(Debug, Default)]
pub struct PrefixIndex {
    /// Hashes the replica reported holding (set semantics, as the worker's stream has: the
    /// last event per hash wins).
    confirmed: HashSet<u64>,
    /// Hash → when the expectation lapses.
    expected: HashMap<u64, Instant>,
}

impl PrefixIndex {
    /// Replaces the confirmed set with `hashes` (a reset message: the whole set now).
    pub fn reset(&mut self, hashes: &[u64]) {
        self.confirmed.clear();
        self.confirmed.extend(hashes);
        for h in hashes {
            self.expected.remove(h);
        }
    }

    /// Applies a delta: `stored` blocks became reusable, `removed` blocks were evicted.
    pub fn apply(&mut self, stored: &[u64], removed: &[u64]) {
        for &h in stored {
            self.confirmed.insert(h);
            self.expected.remove(&h);
        }
        for h in removed {
            self.confirmed.remove(h);
            self.expected.remove(h);
        }
    }

    /// Records `hashes` as expected on this replica until `now + EXPECTED_TTL` (a request
    /// with these blocks was just sent there). Already confirmed hashes are skipped.
    pub fn expect(&mut self, hashes: &[u64], now: Instant) {
        if self.expected.len() >= SWEEP_AT {
            self.expected.retain(|_, until| *until > now);
        }
        let until = now + EXPECTED_TTL;
        for &h in hashes {
            if !self.confirmed.contains(&h) {
                self.expected.insert(h, until);
            }
        }
    }

    /// Leading blocks of `hashes` present (confirmed, or expected and not lapsed at `now`).
    pub fn matched(&self, hashes: &[u64], now: Instant) -> usize {
        hashes
            .iter()
            .take_while(|h| self.confirmed.contains(*h) || self.expected.get(h).is_some_and(|until| *until > now))
            .count()
    }

    /// Distinct confirmed hashes (the `prism_router_prefix_index_blocks` gauge).
    pub fn confirmed_len(&self) -> usize {
        self.confirmed.len()
    }

    /// Expected hashes not lapsed at `now`.
    pub fn expected_len(&self, now: Instant) -> usize {
        self.expected.values().filter(|until| **until > now).count()
    }

    /// Forgets everything (the stream to the replica broke: its cache may have changed
    /// unseen; until the next reset only expectations count).
    pub fn clear_confirmed(&mut self) {
        self.confirmed.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_replaces_and_deltas_apply() {
        let now = Instant::now();
        let mut ix = PrefixIndex::default();
        ix.reset(&[1, 2, 3]);
        assert_eq!(ix.matched(&[1, 2, 3, 4], now), 3);
        ix.apply(&[4], &[2]);
        assert_eq!(ix.matched(&[1, 2, 3, 4], now), 1, "a chain stops at the first missing block");
        assert_eq!(ix.matched(&[3, 4], now), 2);
        ix.reset(&[9]);
        assert_eq!(ix.matched(&[1], now), 0, "a reset drops what is not in it");
        assert_eq!((ix.confirmed_len(), ix.matched(&[9], now)), (1, 1));
        // Set semantics: a hash stored again is one entry, and one removal drops it.
        ix.apply(&[5], &[]);
        ix.apply(&[5], &[]);
        assert_eq!((ix.matched(&[5], now), ix.confirmed_len()), (1, 2));
        ix.apply(&[], &[5, 77]);
        assert_eq!(ix.matched(&[5], now), 0, "removing an unknown hash is harmless");
    }

    #[test]
    fn expected_hashes_count_until_they_lapse_or_are_confirmed() {
        let t0 = Instant::now();
        let mut ix = PrefixIndex::default();
        ix.expect(&[10, 11, 12], t0);
        assert_eq!(ix.matched(&[10, 11, 12, 13], t0), 3);
        assert_eq!(ix.expected_len(t0), 3);
        let later = t0 + EXPECTED_TTL + Duration::from_millis(1);
        assert_eq!(ix.matched(&[10, 11, 12], later), 0, "never confirmed: lapsed");
        // Confirmation turns an expectation into a cached block that does not lapse.
        ix.expect(&[10, 11], t0);
        ix.apply(&[10], &[]);
        assert_eq!(ix.matched(&[10, 11], later), 1);
        assert_eq!(ix.expected_len(t0), 2, "11 and 12 (from before) remain expected");
        // An eviction also ends the expectation; a reset confirms what it lists.
        ix.expect(&[20, 21], t0);
        ix.apply(&[], &[21]);
        assert_eq!(ix.matched(&[20, 21], t0), 1);
        ix.reset(&[20]);
        assert_eq!(ix.matched(&[20], later), 1);
        ix.clear_confirmed();
        assert_eq!(ix.matched(&[20], t0), 0);
    }

    #[test]
    fn lapsed_expectations_are_swept() {
        let t0 = Instant::now();
        let mut ix = PrefixIndex::default();
        let many: Vec<u64> = (0..SWEEP_AT as u64).collect();
        ix.expect(&many, t0);
        ix.expect(&[u64::MAX], t0 + EXPECTED_TTL * 2);
        assert_eq!(ix.expected.len(), 1, "the lapsed ones went when the map was full");
    }
}
