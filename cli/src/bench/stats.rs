//! What `prism bench serve` measures and how it sums it up, with vLLM's definitions
//! (`vllm bench serve`): TTFT (send → first token), TPOT ((E2E − TTFT) / (output tokens − 1),
//! requests with more than one output token), ITL (each gap between streamed token chunks),
//! E2E latency (send → end of stream); throughputs over the benchmark's duration; goodput:
//! completed requests that meet every SLO of `--goodput` (`ttft:MS`, `tpot:MS`, `e2el:MS`),
//! per second. Percentiles are nearest-rank; the median is p50. The prefix-cache hit rate is
//! cached prompt tokens (`usage.prompt_tokens_details.cached_tokens`) over prompt tokens, over
//! the requests whose server reported a cached count.

use std::collections::BTreeMap;
use std::time::Duration;

/// What one successful request measured.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Record {
    /// Prompt tokens: the server's `usage.prompt_tokens`, else the dataset's length.
    pub prompt_tokens: usize,
    /// Generated tokens: the server's `usage.completion_tokens`, else the tokens/chunks seen.
    pub output_tokens: usize,
    /// Prompt tokens served from the prefix cache (`usage.prompt_tokens_details.cached_tokens`);
    /// `None` when the server did not report it.
    pub cached_tokens: Option<usize>,
    /// Send → first token.
    pub ttft: Duration,
    /// Gaps between consecutive token-bearing messages.
    pub itl: Vec<Duration>,
    /// Send → end of stream.
    pub e2el: Duration,
}

impl Record {
    /// Time per output token after the first; `None` with fewer than 2 output tokens.
    pub fn tpot(&self) -> Option<Duration> {
        (self.output_tokens > 1).then(|| self.e2el.saturating_sub(self.ttft) / (self.output_tokens as u32 - 1))
    }
}

/// A request that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Its class, the key of the failure counts: `http 429`, `grpc ResourceExhausted`,
    /// `transport`, `stream` (broken or malformed mid-stream).
    pub status: String,
    /// What went wrong (the server's error message when it sent one).
    pub message: String,
}

/// A latency metric of the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Metric {
    /// Time to first token.
    Ttft,
    /// Time per output token (excluding the first).
    Tpot,
    /// Inter-token latency.
    Itl,
    /// End-to-end latency.
    E2el,
}

impl Metric {
    /// The name in flags and JSON keys (`ttft` → `mean_ttft_ms`).
    pub fn key(self) -> &'static str {
        match self {
            Metric::Ttft => "ttft",
            Metric::Tpot => "tpot",
            Metric::Itl => "itl",
            Metric::E2el => "e2el",
        }
    }

    /// Parses one name of `--percentile-metrics` / `--goodput`.
    ///
    /// # Errors
    /// An unknown name.
    pub fn parse(s: &str) -> anyhow::Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "ttft" => Ok(Metric::Ttft),
            "tpot" => Ok(Metric::Tpot),
            "itl" => Ok(Metric::Itl),
            "e2el" => Ok(Metric::E2el),
            other => anyhow::bail!("unknown metric {other:?} (expected ttft, tpot, itl or e2el)"),
        }
    }

    /// `--percentile-metrics ttft,tpot,…` (deduplicated, in the report's order).
    ///
    /// # Errors
    /// An unknown or no name.
    pub fn parse_list(s: &str) -> anyhow::Result<Vec<Self>> {
        let mut v: Vec<Metric> =
            s.split(',').filter(|p| !p.trim().is_empty()).map(Metric::parse).collect::<Result<_, _>>()?;
        v.sort();
        v.dedup();
        if v.is_empty() {
            anyhow::bail!("--percentile-metrics names no metric");
        }
        Ok(v)
    }
}

/// `--metric-percentiles 50,90,99`: each in (0, 100].
///
/// # Errors
/// A value that is not a number in (0, 100].
pub fn parse_percentiles(s: &str) -> anyhow::Result<Vec<f64>> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let p: f64 = part.parse().map_err(|_| anyhow::anyhow!("--metric-percentiles: {part:?} is not a number"))?;
        if !(p > 0.0 && p <= 100.0) {
            anyhow::bail!("--metric-percentiles: {p} is not in (0, 100]");
        }
        out.push(p);
    }
    if out.is_empty() {
        anyhow::bail!("--metric-percentiles names no percentile");
    }
    Ok(out)
}

/// Service-level objectives of `--goodput` in milliseconds (vLLM's `KEY:VALUE` pairs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Slo {
    /// Objectives by metric (ttft, tpot, e2el), ms.
    pub limits_ms: BTreeMap<Metric, f64>,
}

impl Slo {
    /// Parses `ttft:200 tpot:30` (one pair per value).
    ///
    /// # Errors
    /// A pair that is not `ttft|tpot|e2el:MS` with a positive number.
    pub fn parse(pairs: &[String]) -> anyhow::Result<Self> {
        let mut limits_ms = BTreeMap::new();
        for pair in pairs.iter().flat_map(|p| p.split_whitespace()) {
            let Some((k, v)) = pair.split_once(':') else {
                anyhow::bail!("--goodput expects KEY:MS pairs such as ttft:200, got {pair:?}");
            };
            let metric = Metric::parse(k)?;
            if metric == Metric::Itl {
                anyhow::bail!("--goodput: itl has no per-request objective (use ttft, tpot or e2el)");
            }
            let ms: f64 = v.parse().map_err(|_| anyhow::anyhow!("--goodput: {v:?} is not a number of ms"))?;
            if !(ms > 0.0 && ms.is_finite()) {
                anyhow::bail!("--goodput: {k} must be a positive number of ms, got {ms}");
            }
            limits_ms.insert(metric, ms);
        }
        Ok(Slo { limits_ms })
    }

    /// Whether `r` meets every objective (a request without a TPOT meets the TPOT one).
    pub fn met(&self, r: &Record) -> bool {
        self.limits_ms.iter().all(|(m, &limit)| {
            let value = match m {
                Metric::Ttft => Some(r.ttft),
                Metric::Tpot => r.tpot(),
                Metric::E2el => Some(r.e2el),
                Metric::Itl => None,
            };
            value.is_none_or(|v| ms(v) <= limit)
        })
    }
}

/// Nearest-rank percentile of sorted samples (`p` in [0, 100]).
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A duration in milliseconds.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Mean, median, standard deviation and percentiles of one metric, in ms.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Summary {
    /// Arithmetic mean.
    pub mean: f64,
    /// p50.
    pub median: f64,
    /// Population standard deviation.
    pub std: f64,
    /// `(percentile, value)` in the order asked.
    pub percentiles: Vec<(f64, f64)>,
}

/// Sums up samples (zeros when there is none).
pub fn summarize(samples: &mut [Duration], percentiles: &[f64]) -> Summary {
    if samples.is_empty() {
        return Summary { percentiles: percentiles.iter().map(|&p| (p, 0.0)).collect(), ..Summary::default() };
    }
    samples.sort();
    let n = samples.len() as f64;
    let mean = samples.iter().map(|&d| ms(d)).sum::<f64>() / n;
    let var = samples.iter().map(|&d| (ms(d) - mean).powi(2)).sum::<f64>() / n;
    Summary {
        mean,
        median: ms(percentile(samples, 50.0)),
        std: var.sqrt(),
        percentiles: percentiles.iter().map(|&p| (p, ms(percentile(samples, p)))).collect(),
    }
}

/// The whole run's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Aggregate {
    /// Successful requests.
    pub completed: usize,
    /// Failed requests.
    pub failed: usize,
    /// Failures by [`Failure::status`].
    pub failures: BTreeMap<String, usize>,
    /// Sum of prompt tokens of the completed requests.
    pub total_input: usize,
    /// Sum of generated tokens of the completed requests.
    pub total_output: usize,
    /// Sum of cached prompt tokens over the requests that reported one; `None` when none did.
    pub total_cached: Option<usize>,
    /// `total_cached` over the prompt tokens of those same requests; `None` when none reported.
    pub cache_hit_rate: Option<f64>,
    /// First send → last response, seconds.
    pub duration_s: f64,
    /// Completed requests/s.
    pub request_throughput: f64,
    /// Requests/s that met every SLO; `None` without `--goodput`.
    pub request_goodput: Option<f64>,
    /// Generated tokens/s.
    pub output_throughput: f64,
    /// (Prompt + generated) tokens/s.
    pub total_token_throughput: f64,
    /// Per metric.
    pub metrics: BTreeMap<Metric, Summary>,
}

/// Sums up a run.
pub fn aggregate(
    records: &[Record],
    failures: &[Failure],
    duration: Duration,
    slo: Option<&Slo>,
    percentiles: &[f64],
) -> Aggregate {
    let secs = duration.as_secs_f64().max(f64::MIN_POSITIVE);
    let total_input: usize = records.iter().map(|r| r.prompt_tokens).sum();
    let total_output: usize = records.iter().map(|r| r.output_tokens).sum();
    let reported: Vec<(usize, usize)> =
        records.iter().filter_map(|r| r.cached_tokens.map(|c| (c, r.prompt_tokens))).collect();
    let total_cached = (!reported.is_empty()).then(|| reported.iter().map(|r| r.0).sum::<usize>());
    let reported_prompt: usize = reported.iter().map(|r| r.1).sum();
    let cache_hit_rate =
        total_cached.map(|c| if reported_prompt == 0 { 0.0 } else { c as f64 / reported_prompt as f64 });
    let mut by_status = BTreeMap::new();
    for f in failures {
        *by_status.entry(f.status.clone()).or_insert(0) += 1;
    }
    let mut ttft: Vec<Duration> = records.iter().map(|r| r.ttft).collect();
    let mut tpot: Vec<Duration> = records.iter().filter_map(Record::tpot).collect();
    let mut itl: Vec<Duration> = records.iter().flat_map(|r| r.itl.iter().copied()).collect();
    let mut e2el: Vec<Duration> = records.iter().map(|r| r.e2el).collect();
    let metrics = BTreeMap::from([
        (Metric::Ttft, summarize(&mut ttft, percentiles)),
        (Metric::Tpot, summarize(&mut tpot, percentiles)),
        (Metric::Itl, summarize(&mut itl, percentiles)),
        (Metric::E2el, summarize(&mut e2el, percentiles)),
    ]);
    Aggregate {
        completed: records.len(),
        failed: failures.len(),
        failures: by_status,
        total_input,
        total_output,
        total_cached,
        cache_hit_rate,
        duration_s: duration.as_secs_f64(),
        request_throughput: records.len() as f64 / secs,
        request_goodput: slo.map(|s| records.iter().filter(|r| s.met(r)).count() as f64 / secs),
        output_throughput: total_output as f64 / secs,
        total_token_throughput: (total_input + total_output) as f64 / secs,
        metrics,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(ms: u64) -> Duration {
        Duration::from_millis(ms)
    }

    fn record(ttft: u64, e2el: u64, output_tokens: usize) -> Record {
        Record { prompt_tokens: 10, output_tokens, ttft: d(ttft), e2el: d(e2el), ..Record::default() }
    }

    #[test]
    fn nearest_rank_percentiles() {
        let samples: Vec<Duration> = (1..=100).map(Duration::from_millis).collect();
        assert_eq!(percentile(&samples, 50.0), Duration::from_millis(50));
        assert_eq!(percentile(&samples, 99.0), Duration::from_millis(99));
        assert_eq!(percentile(&samples, 100.0), Duration::from_millis(100));
        assert_eq!(percentile(&samples[..1], 99.0), Duration::from_millis(1));
        assert_eq!(percentile(&[], 50.0), Duration::ZERO);
    }

    #[test]
    fn summary_mean_median_std_percentiles() {
        let mut s: Vec<Duration> = [40, 10, 30, 20].map(d).to_vec();
        let sum = summarize(&mut s, &[50.0, 90.0, 99.0]);
        assert_eq!(sum.mean, 25.0);
        assert_eq!(sum.median, 20.0);
        assert!((sum.std - 125f64.sqrt()).abs() < 1e-9);
        assert_eq!(sum.percentiles, vec![(50.0, 20.0), (90.0, 40.0), (99.0, 40.0)]);
        assert_eq!(summarize(&mut [], &[99.0]).percentiles, vec![(99.0, 0.0)]);
    }

    #[test]
    fn tpot_excludes_the_first_token() {
        assert_eq!(record(100, 800, 8).tpot(), Some(d(100)));
        assert_eq!(record(100, 800, 1).tpot(), None);
    }

    #[test]
    fn goodput_counts_requests_meeting_every_slo() {
        let slo = Slo::parse(&["ttft:200".into(), "tpot:30".into()]).unwrap();
        let records = [
            record(150, 150 + 7 * 25, 8), // meets both
            record(250, 250 + 7 * 25, 8), // TTFT too slow
            record(150, 150 + 7 * 40, 8), // TPOT too slow
            record(200, 200, 1),          // TTFT at the limit, no TPOT: meets
        ];
        let good: Vec<bool> = records.iter().map(|r| slo.met(r)).collect();
        assert_eq!(good, [true, false, false, true]);
        let agg = aggregate(&records, &[], d(2000), Some(&slo), &[99.0]);
        assert_eq!(agg.request_goodput, Some(1.0));
        assert_eq!(aggregate(&records, &[], d(2000), None, &[99.0]).request_goodput, None);
        let e2el = Slo::parse(&["e2el:300".into()]).unwrap();
        assert_eq!(records.iter().filter(|r| e2el.met(r)).count(), 1);
    }

    #[test]
    fn goodput_flag_errors() {
        for bad in ["ttft", "ttft:x", "ttft:-1", "foo:10", "itl:5"] {
            assert!(Slo::parse(&[bad.into()]).is_err(), "{bad}");
        }
        assert_eq!(Slo::parse(&["ttft:200 e2el:1000".into()]).unwrap().limits_ms.len(), 2);
    }

    #[test]
    fn aggregate_totals_throughputs_and_failures() {
        let records = [
            Record {
                prompt_tokens: 32,
                output_tokens: 8,
                cached_tokens: None,
                ttft: d(100),
                itl: vec![d(10), d(30)],
                e2el: d(200),
            },
            Record {
                prompt_tokens: 16,
                output_tokens: 4,
                cached_tokens: None,
                ttft: d(50),
                itl: vec![d(20)],
                e2el: d(110),
            },
        ];
        let failures = [
            Failure { status: "http 429".into(), message: "queue full".into() },
            Failure { status: "http 429".into(), message: "queue full".into() },
            Failure { status: "transport".into(), message: "refused".into() },
        ];
        let agg = aggregate(&records, &failures, d(4000), None, &[50.0]);
        assert_eq!((agg.completed, agg.failed), (2, 3));
        assert_eq!(agg.failures, BTreeMap::from([("http 429".into(), 2), ("transport".into(), 1)]));
        assert_eq!((agg.total_input, agg.total_output), (48, 12));
        assert_eq!(agg.request_throughput, 0.5);
        assert_eq!(agg.output_throughput, 3.0);
        assert_eq!(agg.total_token_throughput, 15.0);
        assert_eq!(agg.metrics[&Metric::Itl].mean, 20.0);
        assert!((agg.metrics[&Metric::Tpot].mean - (100.0 / 7.0 + 20.0) / 2.0).abs() < 1e-3);
        assert_eq!(agg.metrics[&Metric::E2el].median, 110.0);
        assert_eq!((agg.total_cached, agg.cache_hit_rate), (None, None), "no server reported cached tokens");
    }

    #[test]
    fn cache_hit_rate_over_the_requests_that_report() {
        let r = |prompt_tokens, cached_tokens| Record { prompt_tokens, cached_tokens, ..Record::default() };
        let agg = aggregate(&[r(100, Some(60)), r(50, Some(0)), r(1000, None)], &[], d(1000), None, &[50.0]);
        assert_eq!(agg.total_input, 1150);
        assert_eq!(agg.total_cached, Some(60));
        assert_eq!(agg.cache_hit_rate, Some(0.4), "60 of the 150 prompt tokens of the reporting requests");
        let cold = aggregate(&[r(100, Some(0))], &[], d(1000), None, &[50.0]);
        assert_eq!((cold.total_cached, cold.cache_hit_rate), (Some(0), Some(0.0)));
    }

    #[test]
    fn metric_and_percentile_lists() {
        assert_eq!(Metric::parse_list("itl, ttft,itl").unwrap(), vec![Metric::Ttft, Metric::Itl]);
        assert!(Metric::parse_list("ttft,nope").is_err());
        assert_eq!(parse_percentiles("50, 99.9").unwrap(), vec![50.0, 99.9]);
        assert!(parse_percentiles("0").is_err());
        assert!(parse_percentiles("101").is_err());
        assert!(parse_percentiles("").is_err());
    }
}
