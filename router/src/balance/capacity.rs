//! How many requests one replica may have in flight from this router: its admission limit,
//! from what the replica reports rather than a fixed number.
//!
//! The rule ([`replica_limit`]), in order:
//! 1. The route's `max_in_flight` when the deployment set one (`engine.max_in_flight`): the
//!    operator's explicit override wins.
//! 2. A replica whose last load report shows its KV cache nearly full (under
//!    [`KV_FREE_FLOOR`] of its blocks free) while requests already wait on the engine is held
//!    back to what it runs now: more work there would only wait (or preempt running
//!    sequences), so it waits in the router's queue instead, where it can still go to another
//!    replica.
//! 3. Otherwise the engine's batch limit `max_num_seqs` plus a headroom of a sixteenth of it
//!    (rounded down): with exactly `max_num_seqs` in flight every completion leaves a batch
//!    slot empty for a router round trip and a prefill chunk, so a large engine keeps a few
//!    requests of its own waiting to fill slots at once. Whatever waits on an engine waits
//!    outside the router's bounded queue and cannot move to a replica that comes up later, for
//!    about (its position / `max_num_seqs`) of a request's duration; a sixteenth keeps that a
//!    small fraction, and a small engine (under 16 sequences, where one waiting request would
//!    wait a large part of a request's duration) gets none: its requests wait in the router.
//! 4. A replica that has not reported its capacity (`max_num_seqs` 0: an older worker, static
//!    routes, or no report yet) gets the router's `--max-in-flight-per-replica`.

use prism_common::proto::v1::LoadReport;

/// Headroom beyond `max_num_seqs`, as a fraction of it (rounded down).
pub const HEADROOM_FRACTION: f64 = 1.0 / 16.0;
/// Below this fraction of free KV-cache blocks the cache counts as nearly full.
pub const KV_FREE_FLOOR: f64 = 0.05;

/// Requests beyond `max_num_seqs` a replica may hold waiting on its engine.
pub fn headroom(max_num_seqs: u32) -> u32 {
    let h = (f64::from(max_num_seqs) * HEADROOM_FRACTION).floor();
    // `h` is at most a sixteenth of a u32 here.
    h as u32
}

/// Whether `load` shows the KV cache nearly full (by blocks when reported, else by usage).
fn kv_nearly_full(load: &LoadReport) -> bool {
    if load.total_kv_blocks > 0 {
        f64::from(load.free_kv_blocks) < f64::from(load.total_kv_blocks) * KV_FREE_FLOOR
    } else {
        f64::from(load.kv_cache_usage) >= 1.0 - KV_FREE_FLOOR
    }
}

/// The admission limit of a replica (requests in flight from this router); see the module
/// documentation for the rule. `route_max_in_flight` is the route's value (0 = not set),
/// `load` its last load report, `default` the router's `--max-in-flight-per-replica`.
/// Never 0.
pub fn replica_limit(route_max_in_flight: u32, load: Option<&LoadReport>, default: u32) -> u32 {
    if route_max_in_flight > 0 {
        return route_max_in_flight;
    }
    let Some(load) = load.filter(|l| l.max_num_seqs > 0) else {
        return default.max(1);
    };
    if load.waiting > 0 && kv_nearly_full(load) {
        return load.running.clamp(1, load.max_num_seqs);
    }
    load.max_num_seqs.saturating_add(headroom(load.max_num_seqs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(max_num_seqs: u32, running: u32, waiting: u32, free: u32, total: u32) -> LoadReport {
        LoadReport {
            max_num_seqs,
            running,
            waiting,
            free_kv_blocks: free,
            total_kv_blocks: total,
            block_size: 16,
            ..Default::default()
        }
    }

    #[test]
    fn override_then_reported_capacity_then_default() {
        let l = report(8, 0, 0, 100, 100);
        assert_eq!(replica_limit(3, Some(&l), 256), 3, "the deployment's max_in_flight wins");
        assert_eq!(replica_limit(0, Some(&l), 256), 8, "a small engine: no headroom");
        assert_eq!(replica_limit(0, Some(&report(256, 0, 0, 9, 10)), 256), 272, "256 + 256/16");
        assert_eq!(replica_limit(0, Some(&report(16, 0, 0, 9, 10)), 256), 17, "16 + 1");
        assert_eq!(replica_limit(0, Some(&report(31, 0, 0, 9, 10)), 256), 32, "31 + 1 (rounded down)");
        assert_eq!(replica_limit(0, Some(&report(0, 0, 0, 9, 10)), 256), 256, "no capacity reported");
        assert_eq!(replica_limit(0, None, 256), 256);
        assert_eq!(replica_limit(0, None, 0), 1, "never 0");
    }

    #[test]
    fn a_nearly_full_kv_cache_with_waiting_requests_holds_the_replica_back() {
        // 2 of 100 blocks free and 3 requests waiting: only what runs now.
        assert_eq!(replica_limit(0, Some(&report(8, 5, 3, 2, 100)), 256), 5);
        // Nearly full but nothing waiting: the engine still admits; the normal limit.
        assert_eq!(replica_limit(0, Some(&report(8, 5, 0, 2, 100)), 256), 8);
        // Waiting but plenty of blocks (waiting for a batch slot): the normal limit.
        assert_eq!(replica_limit(0, Some(&report(8, 8, 3, 50, 100)), 256), 8);
        // Held back never goes to 0 (it would never get work again) nor above max_num_seqs.
        assert_eq!(replica_limit(0, Some(&report(8, 0, 3, 0, 100)), 256), 1);
        // Without block counts the usage fraction decides.
        let by_usage =
            LoadReport { max_num_seqs: 8, running: 4, waiting: 1, kv_cache_usage: 0.99, ..Default::default() };
        assert_eq!(replica_limit(0, Some(&by_usage), 256), 4);
    }
}
