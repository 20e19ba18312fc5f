use super::*;
use crate::balance::select;
use crate::config::DEFAULT_PREFIX_CACHE_WEIGHT as DEFAULT_WEIGHT;
use crate::prefix::{CodecKeys, HashKey, PrefixKeys, ReplicaCodec};
use crate::routes::Routes;
use prism_common::proto::v1::{ReplicaState, RouteEntry, RouteTable};
use prism_engine::kv_cache::prefix_hash::block_hashes;
use std::sync::atomic::Ordering;

const KEY: HashKey = HashKey { fingerprint: 1, block_size: 16, namespace: 7 };
/// A 320-token prompt (20 blocks), 16 decode tokens.
const PROMPT: u32 = 320;

fn table(n: usize) -> Routes {
    let r = Routes::new(1000, Metrics::new());
    r.apply(RouteTable {
        served: vec![],
        unavailable: vec![],
        term: 0,
        models: vec![],
        version: 1,
        routes: (0..n)
            .map(|i| RouteEntry {
                replica_id: format!("r{i}"),
                model: "m".into(),
                endpoint: format!("http://r{i}"),
                state: ReplicaState::Ready as i32,
                ..Default::default()
            })
            .collect(),
    });
    let codec = Arc::new(ReplicaCodec { key: KEY, codec: crate::prefix::tests::tiny_codec() });
    for rep in &r.snapshot().models["m"] {
        rep.cache.set_codec(Some(Arc::clone(&codec)));
    }
    r
}

/// A request whose prompt starts with prefix `p` (token ids `p * 1000 ..`).
fn hint(p: u32) -> RequestHint {
    let ids: Vec<u32> = (0..PROMPT).map(|i| p * 1000 + i).collect();
    let hashes = block_hashes(KEY.namespace, None, &ids, KEY.block_size as usize);
    let keys = PrefixKeys::new(vec![CodecKeys { key: KEY, ids, hashes }], true);
    RequestHint { expected_tokens: u64::from(PROMPT) + 16, prefix: Some(Arc::new(keys)) }
}

fn cache_on(routes: &Routes, i: usize, h: &RequestHint) {
    let snap = routes.snapshot();
    let k = h.prefix.as_ref().and_then(|k| k.get(&KEY)).expect("keys");
    snap.models["m"][i].cache.index().apply(&k.hashes, &[]);
}

fn load(routes: &Routes, loads: &[u64]) {
    for (r, l) in routes.snapshot().models["m"].iter().zip(loads) {
        r.stats.tokens.store(*l, Ordering::Relaxed);
    }
}

/// Picks of `n` requests (nothing admitted: loads stay as set).
fn picks(routes: &Routes, policy: &PrefixAware, h: &RequestHint, n: usize) -> Vec<usize> {
    let snap = routes.snapshot();
    let c: Vec<&Arc<ReplicaRoute>> = snap.models["m"].iter().collect();
    (0..n).map(|_| policy.pick(&c, h)).collect()
}

fn decisions(m: &Metrics, reason: &str) -> f64 {
    let text = m.encode();
    let key = format!("prism_router_routing_decisions_total{{policy=\"prefix-aware\",reason=\"{reason}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&key)).and_then(|v| v.parse().ok()).unwrap_or(0.0)
}

#[test]
fn a_cached_prefix_wins_under_moderate_imbalance() {
    let routes = table(3);
    let m = Metrics::new();
    let p = PrefixAware::new(DEFAULT_WEIGHT, m.clone());
    let h = hint(1);
    cache_on(&routes, 0, &h);
    // r0 holds the prefix and runs about one request more than the others.
    load(&routes, &[672, 336, 336]);
    assert!(picks(&routes, &p, &h, 20).iter().all(|&i| i == 0));
    assert_eq!(decisions(&m, "prefix_hit"), 20.0);
    // Weight 0: load alone.
    let by_load = PrefixAware::new(0.0, m.clone());
    assert!(picks(&routes, &by_load, &h, 20).iter().all(|&i| i != 0));
}

#[test]
fn a_hot_prefix_on_a_replica_far_above_the_mean_goes_elsewhere() {
    let routes = table(3);
    let m = Metrics::new();
    let p = PrefixAware::new(DEFAULT_WEIGHT, m.clone());
    let h = hint(1);
    cache_on(&routes, 0, &h);
    // Even a large weight (the prefix alone would keep it there) yields to the guard.
    let sticky = PrefixAware::new(100.0, m.clone());
    load(&routes, &[5000, 1000, 1000]);
    let got = picks(&routes, &sticky, &h, 200);
    assert!(got.iter().all(|&i| i != 0), "the hot replica got work: {got:?}");
    assert!(got.contains(&1) && got.contains(&2), "equal loads split at random: {got:?}");
    assert_eq!(decisions(&m, "load_guard"), 200.0);
    // Small numbers: one request against none is not "hot" (the slack), the prefix wins.
    load(&routes, &[336, 0, 0]);
    assert!(picks(&routes, &sticky, &h, 20).iter().all(|&i| i == 0));
    assert!(picks(&routes, &p, &h, 20).iter().all(|&i| i == 0));
}

#[test]
fn a_cold_request_goes_to_the_least_loaded_and_equal_prefixes_split_by_load() {
    let routes = table(3);
    let p = PrefixAware::new(DEFAULT_WEIGHT, Metrics::new());
    load(&routes, &[500, 100, 300]);
    assert!(picks(&routes, &p, &hint(2), 20).iter().all(|&i| i == 1), "cold: least loaded");
    // r0 and r2 both hold the prefix: the less loaded of them, not the idle r1 without it.
    let h = hint(3);
    cache_on(&routes, 0, &h);
    cache_on(&routes, 2, &h);
    load(&routes, &[400, 0, 200]);
    assert!(picks(&routes, &p, &h, 20).iter().all(|&i| i == 2));
    load(&routes, &[200, 0, 200]);
    let got = picks(&routes, &p, &h, 200);
    assert!(got.iter().all(|&i| i != 1) && got.contains(&0) && got.contains(&2), "{got:?}");
}

#[test]
fn without_codecs_or_hashes_the_pick_is_p2c() {
    let routes = table(2);
    let m = Metrics::new();
    let p = PrefixAware::new(DEFAULT_WEIGHT, m.clone());
    load(&routes, &[1000, 0]);
    assert!(picks(&routes, &p, &RequestHint::tokens(10), 20).iter().all(|&i| i == 1));
    for r in &routes.snapshot().models["m"] {
        r.cache.set_codec(None);
    }
    assert!(picks(&routes, &p, &hint(1), 20).iter().all(|&i| i == 1));
    assert_eq!(decisions(&m, "no_codec"), 40.0);
}

/// A burst of one prefix sticks to the replica that got its first request before the
/// engine reports anything (hashes expected from dispatch); the shared prefix counts once in
/// that replica's load, so the burst stays until its decode work alone outweighs a prefill
/// elsewhere.
#[test]
fn a_burst_sticks_before_the_engine_confirms() {
    let routes = table(3);
    let p = PrefixAware::new(DEFAULT_WEIGHT, Metrics::new());
    let snap = routes.snapshot();
    let h = hint(4);
    let (first, g) = select(&snap, "m", &[], 0, &p, &h).expect("admitted");
    assert!(first.cache.index().expected_len(Instant::now()) > 0, "hashes recorded at dispatch");
    assert_eq!(first.stats.cached_tokens.load(Ordering::Relaxed), 0, "the first one computes the prefix");
    let mut guards = vec![g];
    // The second follows the first before the engine confirms anything; the third finds the
    // first replica over its share of recent dispatches (two of three against none elsewhere).
    let (r, g) = select(&snap, "m", &[], 0, &p, &h).expect("admitted");
    assert_eq!(r.replica_id, first.replica_id, "request 2 of the burst");
    guards.push(g);
    assert_eq!(first.stats.cached_tokens.load(Ordering::Relaxed), u64::from(PROMPT));
    // Each request there still adds its decode tokens: the burst spills over at last.
    let spilled = (0..40).any(|_| {
        let (r, g) = select(&snap, "m", &[], 0, &p, &h).expect("admitted");
        guards.push(g);
        r.replica_id != first.replica_id
    });
    assert!(spilled, "one replica took the whole burst");
    drop(guards);
    assert_eq!(first.stats.cached_tokens.load(Ordering::Relaxed), 0, "released with the requests");
}

#[test]
fn a_shared_prefix_spreads_over_every_replica() {
    // One system prompt for everything, one request at a time (no load ever shows): without the
    // share guard the replicas that computed it first would take every request.
    let routes = table(3);
    let m = Metrics::new();
    let p = PrefixAware::new(DEFAULT_WEIGHT, m.clone());
    let snap = routes.snapshot();
    let h = hint(5);
    let mut per = [0usize; 3];
    for _ in 0..60 {
        let (r, g) = select(&snap, "m", &[], 0, &p, &h).expect("admitted");
        let i = snap.models["m"].iter().position(|x| x.replica_id == r.replica_id).expect("listed");
        per[i] += 1;
        cache_on(&routes, i, &h); // the engine confirms the prefix
        drop(g);
    }
    let max = *per.iter().max().expect("three") as f64;
    assert!(max <= 1.5 * 20.0, "requests per replica {per:?}");
    assert!(per.iter().all(|&n| n > 0), "requests per replica {per:?}");
    assert!(decisions(&m, "prefix_hit") >= 50.0, "hits: {}", decisions(&m, "prefix_hit"));
}

#[test]
fn families_of_repeats_keep_their_replica() {
    // 50 prompt families, each sent 4 times in a row, one request at a time, on 2 replicas: the
    // first of a family computes its prefix, the 3 repeats should find it. Cold picks going to the
    // replica with fewer recent dispatches keep the shares even, so the share guard rarely fires.
    let routes = table(2);
    let p = PrefixAware::new(DEFAULT_WEIGHT, Metrics::new());
    let snap = routes.snapshot();
    let mut misses = 0;
    for f in 0..50 {
        let h = hint(100 + f);
        let mut home = None;
        for _ in 0..4 {
            let (r, g) = select(&snap, "m", &[], 0, &p, &h).expect("admitted");
            let i = snap.models["m"].iter().position(|x| x.replica_id == r.replica_id).expect("listed");
            match home {
                None => home = Some(i),
                Some(h) if h != i => misses += 1,
                Some(_) => {}
            }
            cache_on(&routes, i, &h);
            drop(g);
        }
    }
    let per: Vec<u64> = snap.models["m"].iter().map(|r| r.stats.dispatched.load(Ordering::Relaxed)).collect();
    assert!(misses <= 3, "{misses} of 150 repeats left their family's replica; dispatches {per:?}");
    assert!(per.iter().all(|&n| n >= 80), "dispatches {per:?}");
}
