//! `prism bench serve`'s outputs: the table on stdout (laid out as `vllm bench serve` prints
//! its result) and the JSON result file (vLLM's keys: `completed`, `failed`,
//! `total_input_tokens`, `total_output_tokens`, `request_throughput`, `request_goodput`,
//! `output_throughput`, `total_token_throughput`, `mean_/median_/std_/pNN_{ttft,tpot,itl,e2el}_ms`,
//! and with `--save-detailed` the per-request `input_lens`, `output_lens`, `ttfts`, `itls`,
//! `e2els` (seconds) and `errors`), plus Prism's `failures` (counts by status),
//! `total_cached_tokens` and `prefix_cache_hit_rate` (`null` when the server reported no cached
//! count) and, with `--metrics-url`, `workers` (see `worker_metrics.rs`).

use super::stats::{Aggregate, Failure, Metric, Record, Summary};
use serde_json::{Map, Value, json};
use std::fmt::Write as _;

/// The run's settings, as written to the result.
#[derive(Debug, Clone)]
pub struct RunInfo {
    /// `openai`, `openai-chat` or `grpc`.
    pub backend: &'static str,
    /// Served model.
    pub model: String,
    /// `random`, `multi-turn` or `custom`.
    pub dataset: &'static str,
    /// Requests sent.
    pub num_prompts: usize,
    /// Requests/s (infinite = all at once).
    pub request_rate: f64,
    /// Gamma shape of the gaps.
    pub burstiness: f64,
    /// In-flight cap.
    pub max_concurrency: Option<usize>,
    /// `(strategy, start rps, end rps)` of a ramp.
    pub ramp: Option<(&'static str, f64, f64)>,
    /// Seed.
    pub seed: u64,
    /// `--goodput` objectives by metric key, ms.
    pub goodput: Vec<(&'static str, f64)>,
    /// `--label`.
    pub label: Option<String>,
    /// Unix time of the start, seconds.
    pub started_unix_s: u64,
}

/// `p99`, `p99.9`: vLLM's percentile key.
fn pkey(p: f64) -> String {
    if p.fract() == 0.0 { format!("p{}", p as u64) } else { format!("p{p}") }
}

fn title(m: Metric) -> (&'static str, &'static str) {
    match m {
        Metric::Ttft => ("Time to First Token", "TTFT"),
        Metric::Tpot => ("Time per Output Token (excl. 1st token)", "TPOT"),
        Metric::Itl => ("Inter-token Latency", "ITL"),
        Metric::E2el => ("End-to-end Latency", "E2EL"),
    }
}

fn rate_text(rate: f64) -> String {
    if rate.is_finite() { format!("{rate}") } else { "inf".to_owned() }
}

/// The human table.
pub fn table(info: &RunInfo, agg: &Aggregate, metrics: &[Metric]) -> String {
    let mut s = String::new();
    let line = |s: &mut String, k: &str, v: String| {
        let _ = writeln!(s, "{k:<40} {v}");
    };
    let _ = writeln!(s, "{:=^50}", " Serving Benchmark Result ");
    line(&mut s, "Backend:", info.backend.to_owned());
    line(&mut s, "Successful requests:", agg.completed.to_string());
    line(&mut s, "Failed requests:", agg.failed.to_string());
    for (status, n) in &agg.failures {
        line(&mut s, &format!("  failed ({status}):"), n.to_string());
    }
    if let Some(c) = info.max_concurrency {
        line(&mut s, "Maximum request concurrency:", c.to_string());
    }
    match info.ramp {
        Some((strategy, start, end)) => {
            line(&mut s, "Request rate ramp (RPS):", format!("{strategy} {start} -> {end}"))
        }
        None => line(&mut s, "Request rate configured (RPS):", rate_text(info.request_rate)),
    }
    line(&mut s, "Benchmark duration (s):", format!("{:.2}", agg.duration_s));
    line(&mut s, "Total input tokens:", agg.total_input.to_string());
    line(&mut s, "Total generated tokens:", agg.total_output.to_string());
    let na = || "n/a".to_owned();
    line(&mut s, "Total cached prompt tokens:", agg.total_cached.map_or_else(na, |c| c.to_string()));
    line(&mut s, "Prefix cache hit rate (%):", agg.cache_hit_rate.map_or_else(na, |r| format!("{:.2}", 100.0 * r)));
    line(&mut s, "Request throughput (req/s):", format!("{:.2}", agg.request_throughput));
    if let Some(g) = agg.request_goodput {
        line(&mut s, "Request goodput (req/s):", format!("{g:.2}"));
    }
    line(&mut s, "Output token throughput (tok/s):", format!("{:.2}", agg.output_throughput));
    line(&mut s, "Total token throughput (tok/s):", format!("{:.2}", agg.total_token_throughput));
    for &m in metrics {
        let (long, short) = title(m);
        let sum = &agg.metrics[&m];
        let _ = writeln!(s, "{:-^50}", long);
        line(&mut s, &format!("Mean {short} (ms):"), format!("{:.2}", sum.mean));
        line(&mut s, &format!("Median {short} (ms):"), format!("{:.2}", sum.median));
        // p50 is the median line above.
        for &(p, v) in sum.percentiles.iter().filter(|(p, _)| *p != 50.0) {
            line(&mut s, &format!("P{} {short} (ms):", &pkey(p)[1..]), format!("{v:.2}"));
        }
    }
    let _ = writeln!(s, "{}", "=".repeat(50));
    s
}

fn put_summary(out: &mut Map<String, Value>, key: &str, sum: &Summary) {
    out.insert(format!("mean_{key}_ms"), json!(sum.mean));
    out.insert(format!("median_{key}_ms"), json!(sum.median));
    out.insert(format!("std_{key}_ms"), json!(sum.std));
    for &(p, v) in &sum.percentiles {
        out.insert(format!("{}_{key}_ms", pkey(p)), json!(v));
    }
}

/// `YYYYMMDD-HHMMSS` (UTC) of a Unix time, as vLLM dates its results.
pub fn date(unix_s: u64) -> String {
    // Days to civil date: Howard Hinnant's `civil_from_days`.
    let (days, secs) = ((unix_s / 86_400) as i64, unix_s % 86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}{month:02}{day:02}-{:02}{:02}{:02}", secs / 3600, secs / 60 % 60, secs % 60)
}

/// The JSON result; `detailed` adds the per-request arrays.
pub fn json(info: &RunInfo, agg: &Aggregate, records: &[Record], failures: &[Failure], detailed: bool) -> Value {
    let mut out = Map::new();
    let rate = if info.request_rate.is_finite() { json!(info.request_rate) } else { json!("inf") };
    let mut put = |k: &str, v: Value| {
        out.insert(k.to_owned(), v);
    };
    put("date", json!(date(info.started_unix_s)));
    put("backend", json!(info.backend));
    put("label", json!(info.label));
    put("model_id", json!(info.model));
    put("dataset_name", json!(info.dataset));
    put("num_prompts", json!(info.num_prompts));
    put("request_rate", rate);
    put("burstiness", json!(info.burstiness));
    put("max_concurrency", json!(info.max_concurrency));
    put("ramp_up_strategy", json!(info.ramp.map(|r| r.0)));
    put("ramp_up_start_rps", json!(info.ramp.map(|r| r.1)));
    put("ramp_up_end_rps", json!(info.ramp.map(|r| r.2)));
    put("seed", json!(info.seed));
    put("goodput_slo_ms", Value::Object(info.goodput.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect()));
    put("duration", json!(agg.duration_s));
    put("completed", json!(agg.completed));
    put("failed", json!(agg.failed));
    put("failures", json!(agg.failures));
    put("total_input_tokens", json!(agg.total_input));
    put("total_output_tokens", json!(agg.total_output));
    put("total_cached_tokens", json!(agg.total_cached));
    put("prefix_cache_hit_rate", json!(agg.cache_hit_rate));
    put("request_throughput", json!(agg.request_throughput));
    put("request_goodput", json!(agg.request_goodput));
    put("output_throughput", json!(agg.output_throughput));
    put("total_token_throughput", json!(agg.total_token_throughput));
    for (m, sum) in &agg.metrics {
        put_summary(&mut out, m.key(), sum);
    }
    if detailed {
        let secs = |d: &std::time::Duration| json!(d.as_secs_f64());
        out.insert("input_lens".into(), json!(records.iter().map(|r| r.prompt_tokens).collect::<Vec<_>>()));
        out.insert("output_lens".into(), json!(records.iter().map(|r| r.output_tokens).collect::<Vec<_>>()));
        out.insert("cached_lens".into(), json!(records.iter().map(|r| r.cached_tokens).collect::<Vec<_>>()));
        out.insert("ttfts".into(), Value::Array(records.iter().map(|r| secs(&r.ttft)).collect()));
        out.insert("e2els".into(), Value::Array(records.iter().map(|r| secs(&r.e2el)).collect()));
        out.insert(
            "itls".into(),
            Value::Array(records.iter().map(|r| Value::Array(r.itl.iter().map(secs).collect())).collect()),
        );
        out.insert(
            "errors".into(),
            Value::Array(failures.iter().map(|f| json!({"status": f.status, "message": f.message})).collect()),
        );
    }
    Value::Object(out)
}

/// vLLM-style default file name: `prism-BACKEND-RATEqps-concurrencyN-DATE.json` (RATE is
/// `STRATEGYSTART-END` with a ramp).
pub fn default_filename(info: &RunInfo) -> String {
    let concurrency = info.max_concurrency.map_or_else(|| "none".to_owned(), |c| c.to_string());
    let rate = match info.ramp {
        Some((strategy, start, end)) => format!("{strategy}{start}-{end}"),
        None => rate_text(info.request_rate),
    };
    format!("prism-{}-{rate}qps-concurrency{concurrency}-{}.json", info.backend, date(info.started_unix_s))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::stats::aggregate;
    use std::time::Duration;

    fn info() -> RunInfo {
        RunInfo {
            backend: "grpc",
            model: "m".into(),
            dataset: "random",
            num_prompts: 2,
            request_rate: f64::INFINITY,
            burstiness: 1.0,
            max_concurrency: Some(4),
            ramp: None,
            seed: 0,
            goodput: vec![("ttft", 200.0)],
            label: None,
            started_unix_s: 1_764_592_496,
        }
    }

    #[test]
    fn dates_are_utc_civil() {
        assert_eq!(date(0), "19700101-000000");
        assert_eq!(date(951_782_400), "20000229-000000");
        assert_eq!(date(1_764_592_496), "20251201-123456");
    }

    #[test]
    fn json_keys_match_vllm() {
        let d = Duration::from_millis;
        let records = [Record {
            prompt_tokens: 4,
            output_tokens: 3,
            cached_tokens: Some(1),
            ttft: d(10),
            itl: vec![d(5), d(7)],
            e2el: d(22),
        }];
        let failures = [Failure { status: "http 429".into(), message: "full".into() }];
        let agg = aggregate(&records, &failures, d(1000), None, &[50.0, 99.9]);
        let v = json(&info(), &agg, &records, &failures, true);
        assert_eq!(v["completed"], json!(1));
        assert_eq!(v["failed"], json!(1));
        assert_eq!(v["failures"]["http 429"], json!(1));
        assert_eq!(v["total_output_tokens"], json!(3));
        assert_eq!(v["total_cached_tokens"], json!(1));
        assert_eq!(v["prefix_cache_hit_rate"], json!(0.25));
        assert_eq!(v["cached_lens"], json!([1]));
        assert_eq!(v["request_rate"], json!("inf"));
        assert_eq!(v["median_ttft_ms"], json!(10.0));
        assert_eq!(v["p99.9_e2el_ms"], json!(22.0));
        assert_eq!(v["p50_tpot_ms"], json!(6.0));
        assert_eq!(v["itls"][0].as_array().unwrap().len(), 2);
        assert_eq!(v["errors"][0]["status"], json!("http 429"));
        let brief = json(&info(), &agg, &records, &failures, false);
        assert!(brief.get("ttfts").is_none());
        let t = table(&info(), &agg, &[Metric::Ttft, Metric::E2el]);
        assert!(t.contains("Successful requests:") && t.contains("P99.9 E2EL (ms):") && !t.contains("TPOT"));
        assert!(t.lines().any(|l| l.starts_with("Prefix cache hit rate (%):") && l.ends_with(" 25.00")));
        let cold = aggregate(&[Record { cached_tokens: None, ..records[0].clone() }], &[], d(1000), None, &[50.0]);
        assert_eq!(json(&info(), &cold, &[], &[], false)["prefix_cache_hit_rate"], Value::Null);
        assert!(
            table(&info(), &cold, &[])
                .lines()
                .any(|l| l.starts_with("Total cached prompt tokens:") && l.ends_with(" n/a"))
        );
        assert_eq!(default_filename(&info()), "prism-grpc-infqps-concurrency4-20251201-123456.json");
        let ramp = RunInfo { ramp: Some(("linear", 1.0, 8.0)), max_concurrency: None, ..info() };
        assert_eq!(default_filename(&ramp), "prism-grpc-linear1-8qps-concurrencynone-20251201-123456.json");
    }
}
