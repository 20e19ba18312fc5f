//! The decision on a fake clock: observations every `STEP`, decisions applied at once.

use std::time::{Duration, Instant};

use prism_common::proto::v1::AutoscalingConfig;

use super::*;

const STEP: Duration = Duration::from_millis(500);

/// The integration test's config: min 1, max 3, target 2, upscale 2 s, downscale 8 s, look-back 3 s.
fn params() -> Params {
    Params::from_config(&AutoscalingConfig {
        min_replicas: 1,
        max_replicas: 3,
        target_ongoing_requests: Some(2.0),
        upscale_delay_s: Some(2.0),
        downscale_delay_s: Some(8.0),
        look_back_period_s: Some(3.0),
        ..Default::default()
    })
    .expect("valid")
}

fn load(ongoing: f64) -> Inputs {
    Inputs { ongoing, queued: 0, kv_cache_usage: None, starting: 0 }
}

/// Feeds `inputs(t)` from `from_s` to `to_s` seconds, applying every decision; returns
/// them with their time (seconds) and the final replica count.
struct Sim {
    w: Window,
    p: Params,
    t0: Instant,
    current: u32,
    decisions: Vec<(f64, Decision)>,
}

impl Sim {
    fn new(p: Params, current: u32) -> Self {
        Self { w: Window::default(), p, t0: Instant::now(), current, decisions: Vec::new() }
    }

    fn run(&mut self, from_s: f64, to_s: f64, inputs: impl Fn(f64) -> Inputs) -> &mut Self {
        let mut t = from_s;
        while t <= to_s + 1e-9 {
            let now = self.t0 + Duration::from_secs_f64(t);
            if let Some(d) = self.w.observe(&self.p, now, self.current, inputs(t)) {
                assert_eq!(d.from, self.current);
                self.current = d.to;
                self.decisions.push((t, d));
            }
            t += STEP.as_secs_f64();
        }
        self
    }
}

#[test]
fn step_load_scales_up_after_the_upscale_delay_and_down_after_the_downscale_delay() {
    let mut s = Sim::new(params(), 1);
    s.run(0.0, 10.0, |_| load(1.0));
    assert!(s.decisions.is_empty(), "1 ongoing at 1 replica is on target: {:?}", s.decisions);
    // 8 ongoing: ⌈8 / 2⌉ = 4, clamped to max 3.
    s.run(10.5, 60.0, |_| load(8.0));
    assert_eq!(s.decisions.len(), 1, "{:?}", s.decisions);
    let (t, d) = &s.decisions[0];
    assert_eq!((d.from, d.to), (1, 3));
    // The window mean crosses 2 at once (8 of the last samples), then 2 s of delay.
    assert!((12.0..=13.5).contains(t), "upscaled at {t}");
    assert!(
        d.reason.starts_with("ongoing ") && d.reason.contains("over 1 replica > target 2.0 for 2."),
        "{}",
        d.reason
    );
    // Back to 1 ongoing: ⌈1 / 1.8⌉ = 1 once the window has forgotten the load, then 8 s.
    s.run(60.5, 120.0, |_| load(1.0));
    assert_eq!(s.decisions.len(), 2, "{:?}", s.decisions);
    let (t, d) = &s.decisions[1];
    assert_eq!((d.from, d.to), (3, 1));
    assert!((68.0..=72.0).contains(t), "downscaled at {t}");
    assert!(d.reason.contains("< target 2.0 for 8."), "{}", d.reason);
}

#[test]
fn a_constant_load_settles_and_never_flaps() {
    // Noisy load around every ⌈⌉ boundary of target 2 (2, 4, 6): at most one change, then none.
    for centre in [2.0, 4.0, 6.0] {
        for start in 1..=3 {
            let mut s = Sim::new(params(), start);
            s.run(0.0, 600.0, |t| load(centre + if ((t * 2.0) as u64).is_multiple_of(2) { 0.3 } else { -0.3 }));
            assert!(s.decisions.len() <= 1, "centre {centre}, start {start}: {:?}", s.decisions);
        }
    }
    // Exactly on the boundary: 4 ongoing over 2 replicas stays, over 3 stays (4 > 0.9 × 2 × 2).
    let mut s = Sim::new(params(), 2);
    s.run(0.0, 120.0, |_| load(4.0));
    assert!(s.decisions.is_empty());
    let mut s = Sim::new(params(), 3);
    s.run(0.0, 120.0, |_| load(4.0));
    assert!(s.decisions.is_empty(), "{:?}", s.decisions);
    // Well below: 3.0 over 3 replicas goes to 2 (3.0 ≤ 3.6) and stays there (3.0 ≤ 4).
    let mut s = Sim::new(params(), 3);
    s.run(0.0, 120.0, |_| load(3.0));
    assert_eq!(s.decisions.iter().map(|(_, d)| d.to).collect::<Vec<_>>(), vec![2]);
}

#[test]
fn a_change_of_direction_or_a_settled_pass_restarts_the_delay() {
    let instant = Params { look_back_period: Duration::ZERO, ..params() };
    let mut s = Sim::new(instant.clone(), 2);
    // High for 1.5 s (below the 2 s delay), then on target: nothing.
    s.run(0.0, 1.5, |_| load(20.0)).run(2.0, 30.0, |_| load(3.0));
    assert!(s.decisions.is_empty(), "{:?}", s.decisions);
    // Alternating high/low bursts shorter than the delays never scale.
    let mut s = Sim::new(instant, 2);
    s.run(0.0, 300.0, |t| load(if ((t / 1.5) as u64).is_multiple_of(2) { 20.0 } else { 0.5 }));
    assert!(s.decisions.is_empty(), "{:?}", s.decisions);
}

#[test]
fn scale_from_zero_is_immediate_and_scale_to_zero_waits_for_an_idle_window() {
    let p = Params { min_replicas: 0, ..params() };
    let mut s = Sim::new(p.clone(), 0);
    s.run(0.0, 20.0, |_| load(0.0));
    assert!(s.decisions.is_empty());
    // One queued request at 0 replicas: 1 replica at the first observation.
    s.run(20.5, 20.5, |_| Inputs { ongoing: 1.0, queued: 1, kv_cache_usage: None, starting: 0 });
    assert_eq!(s.decisions.len(), 1);
    assert_eq!((s.decisions[0].1.from, s.decisions[0].1.to), (0, 1));
    assert!(s.decisions[0].1.reason.starts_with("scale from zero: 1 request queued"));
    // Light load keeps it at 1; a blip inside the look-back keeps it from zero.
    s.run(21.0, 60.0, |t| load(if ((t * 2.0) as u64).is_multiple_of(5) { 1.0 } else { 0.0 }));
    assert_eq!(s.current, 1, "{:?}", s.decisions);
    // Idle: the window empties after 3 s, then 8 s of downscale delay.
    s.run(60.5, 100.0, |_| load(0.0));
    let (t, d) = s.decisions.last().expect("scaled to zero");
    assert_eq!((d.from, d.to), (1, 0));
    assert!((71.0..=73.0).contains(t), "to zero at {t}");
    assert!(d.reason.starts_with("no ongoing or queued requests for 8."), "{}", d.reason);
    // min 1 never goes to zero.
    let mut s = Sim::new(params(), 1);
    s.run(0.0, 100.0, |_| load(0.0));
    assert!(s.decisions.is_empty());
}

#[test]
fn factors_smooth_each_step_rounding_away_from_current() {
    let p = Params { max_replicas: 10, upscaling_factor: 0.5, downscaling_factor: 0.5, ..params() };
    // 10 ongoing over 1: raw 5, 1 + 0.5 × 4 = 3.
    let mut s = Sim::new(p.clone(), 1);
    s.run(0.0, 2.5, |_| load(10.0));
    assert_eq!(s.decisions.first().map(|(_, d)| d.to), Some(3));
    // 1 ongoing over 4: raw 1, 4 − 0.5 × 3 = 2.5 → 2.
    let mut s = Sim::new(p.clone(), 4);
    s.run(0.0, 8.5, |_| load(1.0));
    assert_eq!(s.decisions.first().map(|(_, d)| d.to), Some(2));
    // A tiny factor still moves one replica.
    let p = Params { upscaling_factor: 0.01, ..p };
    let mut s = Sim::new(p, 1);
    s.run(0.0, 2.5, |_| load(10.0));
    assert_eq!(s.decisions.first().map(|(_, d)| d.to), Some(2));
    // A large one is clamped to max.
    let p = Params { upscaling_factor: 100.0, ..params() };
    let mut s = Sim::new(p, 1);
    s.run(0.0, 2.5, |_| load(10.0));
    assert_eq!(s.decisions.first().map(|(_, d)| d.to), Some(3));
}

#[test]
fn kv_cache_usage_above_target_adds_one_replica_and_blocks_downscale() {
    let p = Params { target_kv_cache_usage: Some(0.8), ..params() };
    let kv =
        |usage: f64, ongoing: f64| move |_| Inputs { ongoing, queued: 0, kv_cache_usage: Some(usage), starting: 0 };
    let mut s = Sim::new(p.clone(), 1);
    s.run(0.0, 30.0, kv(0.95, 1.0));
    assert_eq!(s.decisions.iter().map(|(_, d)| d.to).collect::<Vec<_>>(), vec![2, 3]);
    assert!(s.decisions[0].1.reason.starts_with("mean KV cache usage 95% > target 80%"), "{}", s.decisions[0].1.reason);
    // Few requests but a full cache: no downscale.
    let mut s = Sim::new(p.clone(), 3);
    s.run(0.0, 60.0, kv(0.9, 0.5));
    assert!(s.decisions.is_empty(), "{:?}", s.decisions);
    // Below the KV target, the request rule alone.
    let mut s = Sim::new(p, 3);
    s.run(0.0, 60.0, kv(0.3, 0.5));
    assert_eq!(s.decisions.iter().map(|(_, d)| d.to).collect::<Vec<_>>(), vec![1]);
}

#[test]
fn a_fresh_window_makes_no_instant_decision() {
    // A new leader sees an idle deployment at 3 replicas: nothing before the full delay.
    let mut a = Autoscaler::default();
    let p = params();
    let t0 = Instant::now();
    let dep = DeploymentName::from("d");
    assert_eq!(a.observe(&dep, &p, t0, 3, load(0.5)), None);
    assert_eq!(a.observe(&dep, &p, t0 + Duration::from_secs(7), 3, load(0.5)), None);
    let d = a.observe(&dep, &p, t0 + Duration::from_secs(8), 3, load(0.5)).expect("after 8 s");
    assert_eq!(d.to, 1);
    // Forgotten windows start over.
    a.forget(&dep);
    assert_eq!(a.observe(&dep, &p, t0 + Duration::from_secs(9), 3, load(0.5)), None);
}

#[test]
fn a_cold_start_is_not_cut_short_when_its_clients_give_up() {
    let p = Params { min_replicas: 0, ..params() };
    let mut s = Sim::new(p, 0);
    s.run(0.0, 0.0, |_| Inputs { ongoing: 5.0, queued: 5, kv_cache_usage: None, starting: 0 });
    assert_eq!(s.current, 1);
    // The 5 clients left at once; the replica loads for 30 s (longer than look-back + delay).
    let loading = |_| Inputs { ongoing: 0.0, queued: 0, kv_cache_usage: None, starting: 1 };
    s.run(0.5, 30.0, loading);
    assert_eq!(s.current, 1, "scaled down during the cold start: {:?}", s.decisions);
    // Ready at 30 s and idle: the downscale delay (8 s) counts from there.
    s.run(30.5, 60.0, |_| load(0.0));
    let (t, d) = s.decisions.last().expect("scaled to zero after the cold start");
    assert_eq!((d.from, d.to), (1, 0));
    assert!((38.0..=39.5).contains(t), "to zero at {t}");
}
