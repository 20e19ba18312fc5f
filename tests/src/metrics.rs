//! Reading Prometheus text (`/metrics` of the workers, router and head) and latency quantiles.

use std::time::Duration;

/// The sum of every sample of `metric` (all label sets) in Prometheus text `body`, `None`
/// when there is none. The name must match exactly (`foo` does not match `foo_total`).
pub fn metric_sum(body: &str, metric: &str) -> Option<f64> {
    let mut found = None;
    for line in body.lines().filter(|l| !l.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        if &line[..name_end] != metric {
            continue;
        }
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok())?;
        found = Some(found.unwrap_or(0.0) + value);
    }
    found
}

/// The sum of the samples whose line starts with `prefix` (0 when none), so that every
/// `prism_x_total{…}` line adds up, or one labelled series is picked by its full text.
pub fn metric_value(body: &str, prefix: &str) -> f64 {
    body.lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// The `q`-quantile (0..=1, nearest rank) of `xs`; zero for an empty slice.
pub fn quantile(xs: &[Duration], q: f64) -> Duration {
    let mut v = xs.to_vec();
    v.sort_unstable();
    if v.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[idx]
}
