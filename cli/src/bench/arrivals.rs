//! When each request of `prism bench serve` is sent, as vLLM's `vllm bench serve` schedules
//! them: the first request at 0, then gaps drawn from a gamma distribution with shape
//! `--burstiness` and mean `1 / rate` (shape 1 is an exponential gap, i.e. Poisson
//! arrivals; below 1 burstier, above 1 steadier). `--request-rate inf` sends everything at 0.
//!
//! A ramp (`--ramp-up-strategy`) replaces the fixed rate by one that moves from
//! `--ramp-up-start-rps` to `--ramp-up-end-rps` over the run's requests (progress =
//! request index / (n − 1)): `linear`, `exponential` (geometric), or `step` (a Prism
//! extension: `--ramp-up-steps` equal levels from start to end). The gap after request `i`
//! uses the rate at `i`.
//!
//! Gamma draws follow Marsaglia & Tsang, "A simple method for generating gamma variables"
//! (ACM TOMS 26(3), 2000), boosted by `U^(1/k)` for shapes below 1.

use rand::Rng;
use rand::rngs::StdRng;

/// How the rate moves from start to end over the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RampUpStrategy {
    /// `start + (end − start) · progress`.
    Linear,
    /// `start · (end / start)^progress`.
    Exponential,
    /// `steps` constant levels, linearly spaced from start to end.
    Step,
}

impl RampUpStrategy {
    /// The flag value, as written to the result file.
    pub fn name(self) -> &'static str {
        match self {
            RampUpStrategy::Linear => "linear",
            RampUpStrategy::Exponential => "exponential",
            RampUpStrategy::Step => "step",
        }
    }
}

/// A rate ramp.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ramp {
    /// The curve.
    pub strategy: RampUpStrategy,
    /// Rate of the first request (requests/s, > 0).
    pub start_rps: f64,
    /// Rate of the last request (requests/s, > 0).
    pub end_rps: f64,
    /// Levels of the `step` strategy (≥ 1).
    pub steps: usize,
}

/// The arrival process of a run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    /// Requests/s; `f64::INFINITY` sends every request at once. Ignored with a ramp.
    pub rate: f64,
    /// Gamma shape of the gaps (> 0; 1 = Poisson).
    pub burstiness: f64,
    /// A rate that changes over the run, instead of `rate`.
    pub ramp: Option<Ramp>,
}

impl Schedule {
    /// Checks rates, shape and steps.
    ///
    /// # Errors
    /// A message naming the flag.
    pub fn validate(&self) -> anyhow::Result<()> {
        if self.rate.is_nan() || self.rate <= 0.0 {
            anyhow::bail!("--request-rate must be > 0 or inf, got {}", self.rate);
        }
        if !(self.burstiness > 0.0 && self.burstiness.is_finite()) {
            anyhow::bail!("--burstiness must be a positive number, got {}", self.burstiness);
        }
        if let Some(r) = self.ramp {
            for (flag, v) in [("--ramp-up-start-rps", r.start_rps), ("--ramp-up-end-rps", r.end_rps)] {
                if !(v > 0.0 && v.is_finite()) {
                    anyhow::bail!("{flag} must be a positive number of requests/s, got {v}");
                }
            }
            if r.steps == 0 {
                anyhow::bail!("--ramp-up-steps must be at least 1");
            }
        }
        Ok(())
    }

    /// The rate (requests/s) in force for request `i` of `n`.
    pub fn rate_at(&self, i: usize, n: usize) -> f64 {
        let Some(r) = self.ramp else { return self.rate };
        let progress = if n > 1 { i as f64 / (n - 1) as f64 } else { 0.0 };
        match r.strategy {
            RampUpStrategy::Linear => r.start_rps + (r.end_rps - r.start_rps) * progress,
            RampUpStrategy::Exponential => r.start_rps * (r.end_rps / r.start_rps).powf(progress),
            RampUpStrategy::Step => {
                let level = ((progress * r.steps as f64).floor() as usize).min(r.steps - 1);
                let frac = if r.steps > 1 { level as f64 / (r.steps - 1) as f64 } else { 0.0 };
                r.start_rps + (r.end_rps - r.start_rps) * frac
            }
        }
    }

    /// Send times of `n` requests in seconds from the start (non-decreasing, the first 0).
    pub fn offsets(&self, n: usize, rng: &mut StdRng) -> Vec<f64> {
        let mut out = Vec::with_capacity(n);
        let mut t = 0.0;
        for i in 0..n {
            out.push(t);
            let rate = self.rate_at(i, n);
            if rate.is_finite() {
                t += gamma(rng, self.burstiness, 1.0 / (rate * self.burstiness));
            }
        }
        out
    }
}

/// A uniform draw in (0, 1].
fn open_unit(rng: &mut StdRng) -> f64 {
    1.0 - rng.random::<f64>()
}

/// A standard normal draw (Box–Muller).
fn normal(rng: &mut StdRng) -> f64 {
    let (u1, u2) = (open_unit(rng), rng.random::<f64>());
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// A gamma draw with `shape` k > 0 and `scale` θ: mean kθ, variance kθ².
pub fn gamma(rng: &mut StdRng, shape: f64, scale: f64) -> f64 {
    if shape < 1.0 {
        return gamma(rng, shape + 1.0, scale) * open_unit(rng).powf(1.0 / shape);
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = normal(rng);
        let v = (1.0 + c * x).powi(3);
        if v <= 0.0 {
            continue;
        }
        let u = open_unit(rng);
        if u.ln() < 0.5 * x * x + d - d * v + d * v.ln() {
            return d * v * scale;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn gaps(s: &Schedule, n: usize, seed: u64) -> Vec<f64> {
        let t = s.offsets(n, &mut StdRng::seed_from_u64(seed));
        t.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn mean_var(x: &[f64]) -> (f64, f64) {
        let m = x.iter().sum::<f64>() / x.len() as f64;
        (m, x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / x.len() as f64)
    }

    #[test]
    fn infinite_rate_sends_everything_at_once() {
        let s = Schedule { rate: f64::INFINITY, burstiness: 1.0, ramp: None };
        assert_eq!(s.offsets(5, &mut StdRng::seed_from_u64(0)), vec![0.0; 5]);
    }

    #[test]
    fn poisson_gaps_have_mean_one_over_rate() {
        let s = Schedule { rate: 10.0, burstiness: 1.0, ramp: None };
        let g = gaps(&s, 20_001, 42);
        let (mean, var) = mean_var(&g);
        assert!((mean - 0.1).abs() < 0.1 * 0.03, "mean {mean}");
        // Exponential: variance = mean².
        assert!((var - 0.01).abs() < 0.01 * 0.08, "variance {var}");
        assert!(g.iter().all(|&x| x > 0.0));
    }

    #[test]
    fn burstiness_sets_the_gap_variance() {
        // Gamma with shape k and mean 1/r: variance 1 / (r² k).
        for k in [0.25, 0.5, 4.0, 50.0] {
            let s = Schedule { rate: 4.0, burstiness: k, ramp: None };
            let (mean, var) = mean_var(&gaps(&s, 40_001, 9));
            let want = 1.0 / (16.0 * k);
            assert!((mean - 0.25).abs() < 0.25 * 0.04, "k {k}: mean {mean}");
            assert!((var - want).abs() < want * 0.1, "k {k}: variance {var}, want {want}");
        }
    }

    #[test]
    fn same_seed_same_schedule() {
        let s = Schedule { rate: 3.0, burstiness: 0.7, ramp: None };
        assert_eq!(gaps(&s, 100, 5), gaps(&s, 100, 5));
        assert_ne!(gaps(&s, 100, 5), gaps(&s, 100, 6));
    }

    #[test]
    fn ramp_rates() {
        let ramp = |strategy, steps| Schedule {
            rate: f64::INFINITY,
            burstiness: 1.0,
            ramp: Some(Ramp { strategy, start_rps: 1.0, end_rps: 16.0, steps }),
        };
        let lin = ramp(RampUpStrategy::Linear, 1);
        assert_eq!([lin.rate_at(0, 5), lin.rate_at(2, 5), lin.rate_at(4, 5)], [1.0, 8.5, 16.0]);
        let exp = ramp(RampUpStrategy::Exponential, 1);
        let r: Vec<f64> = (0..5).map(|i| exp.rate_at(i, 5)).collect();
        for (got, want) in r.iter().zip([1.0, 2.0, 4.0, 8.0, 16.0]) {
            assert!((got - want).abs() < 1e-9, "{r:?}");
        }
        let step = ramp(RampUpStrategy::Step, 4);
        let r: Vec<f64> = (0..9).map(|i| step.rate_at(i, 9)).collect();
        assert_eq!(r, vec![1.0, 1.0, 6.0, 6.0, 11.0, 11.0, 16.0, 16.0, 16.0]);
        assert_eq!(ramp(RampUpStrategy::Step, 1).rate_at(8, 9), 1.0);
        assert_eq!(lin.rate_at(0, 1), 1.0);
    }

    #[test]
    fn ramp_gaps_shrink_as_the_rate_grows() {
        let s = Schedule {
            rate: f64::INFINITY,
            burstiness: 1.0,
            ramp: Some(Ramp { strategy: RampUpStrategy::Linear, start_rps: 2.0, end_rps: 20.0, steps: 1 }),
        };
        let g = gaps(&s, 4001, 11);
        let (first, _) = mean_var(&g[..1000]);
        let (last, _) = mean_var(&g[3000..]);
        // Mean gap of the first quarter ≈ 1/(2 + 18·0.125) ≈ 0.24 s, of the last ≈ 1/(2 + 18·0.875) ≈ 0.057 s.
        assert!(first > 0.18 && last < 0.07, "first {first}, last {last}");
    }

    #[test]
    fn validation_names_the_flag() {
        let ok = Schedule { rate: f64::INFINITY, burstiness: 1.0, ramp: None };
        assert!(ok.validate().is_ok());
        assert!(Schedule { rate: 0.0, ..ok }.validate().is_err());
        assert!(Schedule { burstiness: 0.0, ..ok }.validate().is_err());
        let bad_ramp = Ramp { strategy: RampUpStrategy::Linear, start_rps: 0.0, end_rps: 1.0, steps: 1 };
        assert!(Schedule { ramp: Some(bad_ramp), ..ok }.validate().is_err());
    }
}
