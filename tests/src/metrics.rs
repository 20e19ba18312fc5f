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

/// The value of one labelled series, named by its full text (`name{label="v"}`), `None` when
/// the body has no such series.
pub fn series_value(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' ')))
        .and_then(|v| v.trim().parse::<f64>().ok())
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

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# TYPE vllm:num_requests_running gauge\n\
        vllm:num_requests_running{model_name=\"m\"} 3\n\
        vllm:num_requests_running_total{model_name=\"m\"} 100\n\
        prism_router_replica_dispatches_total{replica_id=\"a\"} 2\n\
        prism_router_replica_dispatches_total{replica_id=\"b\"} 5\n";

    #[test]
    fn metric_sum_matches_the_exact_name() {
        assert_eq!(metric_sum(TEXT, "vllm:num_requests_running"), Some(3.0));
        assert_eq!(metric_sum(TEXT, "prism_router_replica_dispatches_total"), Some(7.0));
        assert_eq!(metric_sum(TEXT, "vllm:num_requests_waiting"), None);
    }

    #[test]
    fn metric_value_adds_lines_by_prefix() {
        assert_eq!(metric_value(TEXT, "prism_router_replica_dispatches_total"), 7.0);
        assert_eq!(metric_value(TEXT, "prism_router_replica_dispatches_total{replica_id=\"b\"}"), 5.0);
        assert_eq!(metric_value(TEXT, "vllm:num_requests_running"), 103.0);
        assert_eq!(metric_value(TEXT, "absent"), 0.0);
    }

    #[test]
    fn quantile_is_nearest_rank() {
        let xs: Vec<Duration> = [5, 1, 4, 2, 3].iter().map(|&ms| Duration::from_millis(ms)).collect();
        assert_eq!(quantile(&xs, 0.5), Duration::from_millis(3));
        assert_eq!(quantile(&xs, 1.0), Duration::from_millis(5));
        assert_eq!(quantile(&xs, 0.0), Duration::from_millis(1));
        assert_eq!(quantile(&[], 0.5), Duration::ZERO);
    }
}
