//! A deployment's `autoscaling_config` (Ray Serve's names, units and defaults), validated
//! once into [`Params`]: the head never acts on a half-valid config, and `prism deploy`
//! refuses a file with the same wording before it reaches the head.

use std::time::Duration;

use crate::proto::v1::AutoscalingConfig;

/// Ray Serve's default `target_ongoing_requests`: running + waiting + queued per replica.
pub const DEFAULT_TARGET_ONGOING_REQUESTS: f64 = 2.0;
/// Ray Serve's default `upscale_delay_s`, seconds.
pub const DEFAULT_UPSCALE_DELAY_S: f64 = 30.0;
/// Ray Serve's default `downscale_delay_s`, seconds.
pub const DEFAULT_DOWNSCALE_DELAY_S: f64 = 600.0;
/// Ray Serve's default `look_back_period_s`, seconds.
pub const DEFAULT_LOOK_BACK_PERIOD_S: f64 = 30.0;
/// Largest accepted delay or look-back period, seconds (30 days): beyond any real use, and
/// keeps every duration representable.
pub const MAX_SECONDS: f64 = 30.0 * 86_400.0;
/// Largest accepted replica count: `replicas`, `max_replicas` and so every autoscaling
/// target. Far beyond any real cluster (each replica holds at least one GPU or CPU slot),
/// and low enough that a typo cannot make the head write, place and report a count of
/// Pending replicas that swamps the store and every status answer (each replica is a
/// stored record and a row the reconciler visits every pass). Ray Serve and Kubernetes set
/// no hard cap; Kubernetes creates pods at a bounded rate instead.
pub const MAX_REPLICAS: u32 = 10_000;

/// A validated autoscaling config with its defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    /// Lower bound (0 = scale to zero when idle).
    pub min_replicas: u32,
    /// Upper bound (≥ max(1, min_replicas)).
    pub max_replicas: u32,
    /// Replica count at creation (in [min, max]; default min).
    pub initial_replicas: u32,
    /// Ongoing requests (running + waiting + queued) each replica should carry.
    pub target_ongoing_requests: f64,
    /// Mean KV-cache usage in (0, 1] above which one more replica is added (None = off).
    pub target_kv_cache_usage: Option<f64>,
    /// How long a higher target must hold before it is applied.
    pub upscale_delay: Duration,
    /// How long a lower target must hold before it is applied.
    pub downscale_delay: Duration,
    /// Window the load is averaged over.
    pub look_back_period: Duration,
    /// Multiplies each upscale step (> 0).
    pub upscaling_factor: f64,
    /// Multiplies each downscale step (> 0).
    pub downscaling_factor: f64,
}

fn seconds(field: &str, v: Option<f64>, default: f64) -> Result<Duration, String> {
    let s = v.unwrap_or(default);
    if !s.is_finite() {
        return Err(format!("autoscaling_config.{field} must be a finite number of seconds, got {s}"));
    }
    if s < 0.0 {
        return Err(format!("autoscaling_config.{field} must not be negative, got {s}"));
    }
    if s > MAX_SECONDS {
        return Err(format!("autoscaling_config.{field} must be at most {MAX_SECONDS} seconds, got {s}"));
    }
    Ok(Duration::from_secs_f64(s))
}

fn factor(field: &str, v: Option<f64>) -> Result<f64, String> {
    let f = v.unwrap_or(1.0);
    if !f.is_finite() || f <= 0.0 {
        return Err(format!("autoscaling_config.{field} must be a finite number greater than 0, got {f}"));
    }
    Ok(f)
}

impl Params {
    /// Validates `c` and fills Ray Serve's defaults.
    ///
    /// # Errors
    /// A message naming the offending field, e.g.
    /// "autoscaling_config.min_replicas (3) is greater than max_replicas (1)".
    pub fn from_config(c: &AutoscalingConfig) -> Result<Self, String> {
        let (min, max) = (c.min_replicas, c.max_replicas);
        if max == 0 {
            return Err("autoscaling_config.max_replicas must be at least 1, got 0".into());
        }
        if max > MAX_REPLICAS {
            return Err(format!("autoscaling_config.max_replicas must be at most {MAX_REPLICAS}, got {max}"));
        }
        if min > max {
            return Err(format!("autoscaling_config.min_replicas ({min}) is greater than max_replicas ({max})"));
        }
        let initial = c.initial_replicas.unwrap_or(min);
        if initial < min || initial > max {
            return Err(format!(
                "autoscaling_config.initial_replicas ({initial}) is outside [min_replicas ({min}), max_replicas ({max})]"
            ));
        }
        let target = c.target_ongoing_requests.unwrap_or(DEFAULT_TARGET_ONGOING_REQUESTS);
        if !target.is_finite() || target <= 0.0 {
            return Err(format!(
                "autoscaling_config.target_ongoing_requests must be a finite number greater than 0, got {target}"
            ));
        }
        if let Some(kv) = c.target_kv_cache_usage
            && !(kv.is_finite() && kv > 0.0 && kv <= 1.0)
        {
            return Err(format!("autoscaling_config.target_kv_cache_usage must be in (0, 1], got {kv}"));
        }
        Ok(Self {
            min_replicas: min,
            max_replicas: max,
            initial_replicas: initial,
            target_ongoing_requests: target,
            target_kv_cache_usage: c.target_kv_cache_usage,
            upscale_delay: seconds("upscale_delay_s", c.upscale_delay_s, DEFAULT_UPSCALE_DELAY_S)?,
            downscale_delay: seconds("downscale_delay_s", c.downscale_delay_s, DEFAULT_DOWNSCALE_DELAY_S)?,
            look_back_period: seconds("look_back_period_s", c.look_back_period_s, DEFAULT_LOOK_BACK_PERIOD_S)?,
            upscaling_factor: factor("upscaling_factor", c.upscaling_factor)?,
            downscaling_factor: factor("downscaling_factor", c.downscaling_factor)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(min: u32, max: u32) -> AutoscalingConfig {
        AutoscalingConfig { min_replicas: min, max_replicas: max, ..Default::default() }
    }

    fn err(c: AutoscalingConfig) -> String {
        Params::from_config(&c).expect_err("invalid")
    }

    #[test]
    fn defaults_are_ray_serves() {
        let p = Params::from_config(&cfg(1, 3)).expect("valid");
        assert_eq!((p.min_replicas, p.max_replicas, p.initial_replicas), (1, 3, 1));
        assert!((p.target_ongoing_requests - 2.0).abs() < f64::EPSILON);
        assert_eq!(p.target_kv_cache_usage, None);
        assert_eq!(p.upscale_delay, Duration::from_secs(30));
        assert_eq!(p.downscale_delay, Duration::from_secs(600));
        assert_eq!(p.look_back_period, Duration::from_secs(30));
        assert!((p.upscaling_factor - 1.0).abs() < f64::EPSILON);
        assert!((p.downscaling_factor - 1.0).abs() < f64::EPSILON);
        let zero = Params::from_config(&cfg(0, 2)).expect("scale to zero is valid");
        assert_eq!(zero.initial_replicas, 0);
    }

    #[test]
    fn every_invalid_field_is_named() {
        assert_eq!(err(cfg(3, 1)), "autoscaling_config.min_replicas (3) is greater than max_replicas (1)");
        assert!(err(cfg(0, 0)).starts_with("autoscaling_config.max_replicas "));
        assert_eq!(err(cfg(1, 10_001)), "autoscaling_config.max_replicas must be at most 10000, got 10001");
        assert!(err(cfg(1, 100_000)).starts_with("autoscaling_config.max_replicas "));
        assert!(Params::from_config(&cfg(1, 10_000)).is_ok());
        assert!(
            err(AutoscalingConfig { initial_replicas: Some(5), ..cfg(1, 3) })
                .starts_with("autoscaling_config.initial_replicas (5) is outside")
        );
        assert!(err(AutoscalingConfig { initial_replicas: Some(0), ..cfg(1, 3) }).contains("initial_replicas"));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let c = AutoscalingConfig { target_ongoing_requests: Some(bad), ..cfg(1, 3) };
            assert!(err(c).starts_with("autoscaling_config.target_ongoing_requests "), "{bad}");
        }
        for bad in [0.0, 1.01, -0.5, f64::NAN] {
            let c = AutoscalingConfig { target_kv_cache_usage: Some(bad), ..cfg(1, 3) };
            assert!(err(c).starts_with("autoscaling_config.target_kv_cache_usage "), "{bad}");
        }
        assert!(Params::from_config(&AutoscalingConfig { target_kv_cache_usage: Some(1.0), ..cfg(1, 3) }).is_ok());
        for bad in [-1.0, f64::NAN, f64::NEG_INFINITY, 1e12] {
            let c = AutoscalingConfig { upscale_delay_s: Some(bad), ..cfg(1, 3) };
            assert!(err(c).starts_with("autoscaling_config.upscale_delay_s "), "{bad}");
            let c = AutoscalingConfig { downscale_delay_s: Some(bad), ..cfg(1, 3) };
            assert!(err(c).starts_with("autoscaling_config.downscale_delay_s "), "{bad}");
            let c = AutoscalingConfig { look_back_period_s: Some(bad), ..cfg(1, 3) };
            assert!(err(c).starts_with("autoscaling_config.look_back_period_s "), "{bad}");
        }
        for bad in [0.0, -2.0, f64::NAN, f64::INFINITY] {
            let c = AutoscalingConfig { upscaling_factor: Some(bad), ..cfg(1, 3) };
            assert!(err(c).starts_with("autoscaling_config.upscaling_factor "), "{bad}");
            let c = AutoscalingConfig { downscaling_factor: Some(bad), ..cfg(1, 3) };
            assert!(err(c).starts_with("autoscaling_config.downscaling_factor "), "{bad}");
        }
        let zero_delays = AutoscalingConfig { upscale_delay_s: Some(0.0), downscale_delay_s: Some(0.0), ..cfg(0, 1) };
        assert!(Params::from_config(&zero_delays).is_ok());
    }
}
