//! The autoscaler's decision, as Ray Serve's default policy makes it, kept pure (the time
//! is an argument) so it is tested on a fake clock; the reconciler feeds it each pass.
//!
//! Per deployment, each observation is the total of ongoing requests (running + waiting
//! on its Ready replicas, plus the requests the routers hold queued for its served model)
//! and the mean KV-cache usage of its Ready replicas. Then:
//! - the ongoing total is averaged over `look_back_period_s` (time-weighted);
//! - raw target = ⌈average / target_ongoing_requests⌉; with `target_kv_cache_usage` set, a
//!   mean usage above it asks for at least current + 1 (and blocks a downscale);
//! - a downscale to m needs average ≤ 0.9 × target × m ([`DOWNSCALE_HYSTERESIS`]), so a
//!   constant load near a ⌈⌉ boundary settles instead of flapping;
//! - the step is smoothed by `upscaling_factor` / `downscaling_factor` (current + factor ×
//!   (raw − current), rounded away from current so a step is never 0) and clamped to
//!   [min_replicas, max_replicas];
//! - it is applied once the same direction has held for `upscale_delay_s` /
//!   `downscale_delay_s`; a change of direction (or a pass asking for no change) restarts
//!   the clock;
//! - scale from zero: demand for a deployment at 0 replicas gives 1 at once;
//! - scale to zero (min 0): no ongoing and no queued request over the look-back period, for
//!   `downscale_delay_s`;
//! - no downscale while a replica is Starting: the delay counts from when none is loading,
//!   so clients that give up during a cold start do not cancel it for the next ones.
//!
//! A window starts empty (a new leader, a new deployment), so no decision is made from
//! history this head did not see.

/// The validation of `autoscaling_config` lives with the deployment spec's (`prism deploy
/// --dry-run` runs it too); re-exported under its old path.
pub use prism_common::deployment::autoscaling as params;

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use prism_common::DeploymentName;

pub use params::Params;

/// A downscale to m replicas needs the average ongoing requests at or below
/// (1 − this) × target × m: the dead band between the up and down thresholds.
pub const DOWNSCALE_HYSTERESIS: f64 = 0.1;

/// One observation of a deployment's load.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Inputs {
    /// Running + waiting requests on its Ready replicas plus requests queued for it at the routers.
    pub ongoing: f64,
    /// Requests queued for it at the routers (part of `ongoing`).
    pub queued: u32,
    /// Mean KV-cache usage of its Ready replicas, in [0, 1] (None when none reports).
    pub kv_cache_usage: Option<f64>,
    /// Its replicas still loading (Starting). While one is, no downscale is due: a cold start
    /// is never cut short because the clients that asked for it gave up.
    pub starting: u32,
}

/// A change of a deployment's replica count.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Replica count before.
    pub from: u32,
    /// Replica count after.
    pub to: u32,
    /// Why, for people: "ongoing 17.2 over 2 replicas > target 2.0 for 2.0 s".
    pub reason: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    Up,
    Down,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at: Instant,
    ongoing: f64,
    kv: Option<f64>,
}

/// A proposed change and since when it has held.
#[derive(Debug, Clone, Copy)]
struct Proposal {
    direction: Direction,
    since: Instant,
}

/// One deployment's load history and pending proposal.
#[derive(Debug, Default)]
pub struct Window {
    samples: VecDeque<Sample>,
    proposal: Option<Proposal>,
}

impl Window {
    /// Time-weighted mean of the ongoing total over the window (each sample stands for
    /// the interval since the one before it); the plain value with one sample.
    fn mean_ongoing(&self) -> f64 {
        let (Some(first), Some(last)) = (self.samples.front(), self.samples.back()) else { return 0.0 };
        let span = last.at.duration_since(first.at).as_secs_f64();
        if span <= 0.0 {
            return self.samples.iter().map(|s| s.ongoing).sum::<f64>() / self.samples.len() as f64;
        }
        let mut sum = 0.0;
        for (prev, s) in self.samples.iter().zip(self.samples.iter().skip(1)) {
            sum += s.ongoing * s.at.duration_since(prev.at).as_secs_f64();
        }
        sum / span
    }

    /// True when some sample in the window saw a request.
    fn any_ongoing(&self) -> bool {
        self.samples.iter().any(|s| s.ongoing > 0.0)
    }

    fn mean_kv(&self) -> Option<f64> {
        let kv: Vec<f64> = self.samples.iter().filter_map(|s| s.kv).collect();
        (!kv.is_empty()).then(|| kv.iter().sum::<f64>() / kv.len() as f64)
    }

    /// Records an observation at `now` for a deployment currently at `current` replicas
    /// and returns the change to make, if one is due.
    pub fn observe(&mut self, p: &Params, now: Instant, current: u32, inputs: Inputs) -> Option<Decision> {
        self.samples.push_back(Sample { at: now, ongoing: inputs.ongoing.max(0.0), kv: inputs.kv_cache_usage });
        while self.samples.front().is_some_and(|s| now.duration_since(s.at) > p.look_back_period) {
            self.samples.pop_front();
        }
        // Scale from zero: no delay, whatever the window says.
        if current == 0 && (inputs.queued > 0 || inputs.ongoing > 0.0) {
            let to = 1.clamp(p.min_replicas, p.max_replicas);
            self.proposal = None;
            let queued = prism_common::text::count(u64::from(inputs.queued), "request", "requests");
            let reason = format!("scale from zero: {queued} queued with 0 replicas");
            return Some(Decision { from: 0, to, reason });
        }
        let (to, why) = self.target(p, current);
        let direction = match to.cmp(&current) {
            std::cmp::Ordering::Greater => Direction::Up,
            std::cmp::Ordering::Less => Direction::Down,
            std::cmp::Ordering::Equal => {
                self.proposal = None;
                return None;
            }
        };
        if direction == Direction::Down && inputs.starting > 0 {
            // The downscale clock starts once nothing is loading.
            self.proposal = None;
            return None;
        }
        let since = match self.proposal {
            Some(pr) if pr.direction == direction => pr.since,
            _ => now,
        };
        self.proposal = Some(Proposal { direction, since });
        let held = now.duration_since(since);
        let delay = if direction == Direction::Up { p.upscale_delay } else { p.downscale_delay };
        if held < delay {
            return None;
        }
        self.proposal = None;
        Some(Decision { from: current, to, reason: format!("{why} for {:.1} s", held.as_secs_f64()) })
    }

    /// The replica count the window asks for (before the delay), and why.
    fn target(&self, p: &Params, current: u32) -> (u32, String) {
        let avg = self.mean_ongoing();
        let target = p.target_ongoing_requests;
        let up_raw = ceil_u32(avg / target);
        let mut down_raw = ceil_u32(avg / (target * (1.0 - DOWNSCALE_HYSTERESIS)));
        if self.any_ongoing() {
            // Only a window with no request at all scales to zero.
            down_raw = down_raw.max(1);
        }
        let kv_high = match (p.target_kv_cache_usage, self.mean_kv()) {
            (Some(t), Some(kv)) if kv > t => Some((kv, t)),
            _ => None,
        };
        let per = |n: u32| if n == 1 { "replica" } else { "replicas" };
        let (raw, why) = if let Some((kv, t)) = kv_high.filter(|_| up_raw <= current) {
            (current.saturating_add(1), format!("mean KV cache usage {:.0}% > target {:.0}%", kv * 100.0, t * 100.0))
        } else if up_raw > current {
            (up_raw, format!("ongoing {avg:.1} over {current} {} > target {target:.1}", per(current)))
        } else if down_raw < current && kv_high.is_none() {
            let why = if down_raw == 0 {
                "no ongoing or queued requests".to_owned()
            } else {
                format!("ongoing {avg:.1} over {current} {} < target {target:.1}", per(current))
            };
            (down_raw, why)
        } else {
            (current, String::new())
        };
        let smoothed = match raw.cmp(&current) {
            std::cmp::Ordering::Greater => {
                let x = f64::from(current) + p.upscaling_factor * f64::from(raw - current);
                ceil_u32(x).max(current + 1)
            }
            std::cmp::Ordering::Less => {
                let x = f64::from(current) - p.downscaling_factor * f64::from(current - raw);
                // Rounded away from current; never to zero while there is load.
                let down = if x <= 0.0 { 0 } else { x.floor() as u32 };
                down.min(current - 1).max(raw.min(1))
            }
            std::cmp::Ordering::Equal => current,
        };
        (smoothed.clamp(p.min_replicas, p.max_replicas), why)
    }
}

/// ⌈x⌉ as a replica count (saturating; 0 for x ≤ 0 or NaN).
fn ceil_u32(x: f64) -> u32 {
    if x.is_nan() || x <= 0.0 { 0 } else { x.ceil().min(f64::from(u32::MAX)) as u32 }
}

/// Every deployment's window. One per leadership term: a new leader starts empty.
#[derive(Debug, Default)]
pub struct Autoscaler {
    windows: HashMap<DeploymentName, Window>,
}

impl Autoscaler {
    /// Records an observation of `deployment` (see [`Window::observe`]).
    pub fn observe(
        &mut self,
        deployment: &DeploymentName,
        p: &Params,
        now: Instant,
        current: u32,
        inputs: Inputs,
    ) -> Option<Decision> {
        self.windows.entry(deployment.clone()).or_default().observe(p, now, current, inputs)
    }

    /// Drops the window of a deployment that is gone or no longer autoscaled.
    pub fn forget(&mut self, deployment: &DeploymentName) {
        self.windows.remove(deployment);
    }

    /// Keeps only the windows of `keep`.
    pub fn retain(&mut self, keep: impl Fn(&DeploymentName) -> bool) {
        self.windows.retain(|d, _| keep(d));
    }

    /// Forgets the pending proposal of `deployment` (its count was set from elsewhere).
    pub fn reset_proposal(&mut self, deployment: &DeploymentName) {
        if let Some(w) = self.windows.get_mut(deployment) {
            w.proposal = None;
        }
    }
}

#[cfg(test)]
mod tests;
