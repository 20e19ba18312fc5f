//! `--metrics-url`: the workers' Prometheus counters (vLLM's names) scraped before and after a
//! run, so the report can say what each worker did during it: requests finished
//! (`vllm:request_success_total`, summed over its labels), prompt and generated tokens, and the
//! prefix cache's queried and hit tokens (`vllm:prefix_cache_queries_total` /
//! `vllm:prefix_cache_hits_total`). With one replica per worker these are per replica, which gives
//! the load balance (most requests on one replica over the mean) and the cluster's hit rate
//! (hits over queries summed over the workers). Every other `_total` counter a worker exposes is
//! kept too, as a delta, under `counters`. A counter a worker does not expose is `null`.

use anyhow::{Context, Result};
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

/// Finished requests.
pub const REQUEST_SUCCESS: &str = "vllm:request_success_total";
/// Prompt tokens of finished requests.
pub const PROMPT_TOKENS: &str = "vllm:prompt_tokens_total";
/// Generated tokens of finished requests.
pub const GENERATION_TOKENS: &str = "vllm:generation_tokens_total";
/// Prompt tokens looked up in the prefix cache.
pub const PREFIX_CACHE_QUERIES: &str = "vllm:prefix_cache_queries_total";
/// Prompt tokens found in the prefix cache.
pub const PREFIX_CACHE_HITS: &str = "vllm:prefix_cache_hits_total";

/// Each sample's value summed by metric name (labels dropped) from a Prometheus / OpenMetrics
/// text exposition; comment lines and lines that do not parse are skipped.
pub fn parse(text: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        // `name{labels} value [timestamp]`: label values are quoted and may hold spaces.
        let (name, rest) = match line.find('{') {
            Some(open) => match line[open..].rfind('}') {
                Some(close) => (&line[..open], &line[open + close + 1..]),
                None => continue,
            },
            None => match line.split_once(char::is_whitespace) {
                Some((name, rest)) => (name, rest),
                None => continue,
            },
        };
        let Some(value) = rest.split_whitespace().next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        *out.entry(name.to_owned()).or_insert(0.0) += value;
    }
    out
}

/// Fetches and parses one worker's `/metrics`.
///
/// # Errors
/// The worker does not answer, or answers with a non-2xx status.
pub async fn scrape(client: &reqwest::Client, url: &str) -> Result<BTreeMap<String, f64>> {
    let resp = client.get(url).send().await.with_context(|| format!("--metrics-url {url}: cannot reach it"))?;
    let status = resp.status();
    if !status.is_success() {
        anyhow::bail!("--metrics-url {url}: HTTP {status}");
    }
    Ok(parse(&resp.text().await.with_context(|| format!("--metrics-url {url}: reading the body"))?))
}

/// Every URL's counters, in order.
///
/// # Errors
/// The first URL that cannot be scraped.
pub async fn scrape_all(client: &reqwest::Client, urls: &[String]) -> Result<Vec<BTreeMap<String, f64>>> {
    let mut out = Vec::with_capacity(urls.len());
    for url in urls {
        out.push(scrape(client, url).await?);
    }
    Ok(out)
}

/// What one worker counted during the run (after − before).
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerDelta {
    /// The scraped URL.
    pub url: String,
    /// Every `_total` counter's increase, by name.
    pub counters: BTreeMap<String, f64>,
}

impl WorkerDelta {
    /// The increase of `name`, `None` when the worker does not expose it.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.counters.get(name).copied()
    }
}

/// The deltas of the `_total` counters between two scrapes of one worker (a counter only in
/// `after` started at 0).
pub fn delta(url: &str, before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> WorkerDelta {
    let counters = after
        .iter()
        .filter(|(name, _)| name.ends_with("_total"))
        .map(|(name, &v)| (name.clone(), v - before.get(name).copied().unwrap_or(0.0)))
        .collect();
    WorkerDelta { url: url.to_owned(), counters }
}

/// The run as the workers saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerLoad {
    /// One per `--metrics-url`, in order.
    pub workers: Vec<WorkerDelta>,
}

fn sum(workers: &[WorkerDelta], name: &str) -> Option<f64> {
    let values: Vec<f64> = workers.iter().filter_map(|w| w.get(name)).collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

impl WorkerLoad {
    /// Requests finished per worker (0 for a worker that exposes no request counter).
    pub fn requests(&self) -> Vec<f64> {
        self.workers.iter().map(|w| w.get(REQUEST_SUCCESS).unwrap_or(0.0)).collect()
    }

    /// The busiest worker's requests over the mean; `None` when no worker finished a request.
    pub fn max_over_mean(&self) -> Option<f64> {
        let r = self.requests();
        let mean = r.iter().sum::<f64>() / r.len().max(1) as f64;
        (mean > 0.0).then(|| r.iter().copied().fold(0.0, f64::max) / mean)
    }

    /// Prefix-cache hit tokens over queried tokens, summed over the workers; `None` when no
    /// worker exposes the counters or none was queried.
    pub fn prefix_cache_hit_rate(&self) -> Option<f64> {
        let queries = sum(&self.workers, PREFIX_CACHE_QUERIES)?;
        let hits = sum(&self.workers, PREFIX_CACHE_HITS).unwrap_or(0.0);
        (queries > 0.0).then(|| hits / queries)
    }

    /// The `workers` object of the JSON result.
    pub fn json(&self) -> Value {
        let per_worker: Vec<Value> = self
            .workers
            .iter()
            .map(|w| {
                json!({
                    "url": w.url,
                    "requests": w.get(REQUEST_SUCCESS),
                    "prompt_tokens": w.get(PROMPT_TOKENS),
                    "generation_tokens": w.get(GENERATION_TOKENS),
                    "prefix_cache_queries": w.get(PREFIX_CACHE_QUERIES),
                    "prefix_cache_hits": w.get(PREFIX_CACHE_HITS),
                    "counters": Value::Object(w.counters.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<Map<_, _>>()),
                })
            })
            .collect();
        let r = self.requests();
        json!({
            "per_worker": per_worker,
            "requests": r,
            "max_requests": r.iter().copied().fold(0.0, f64::max),
            "mean_requests": r.iter().sum::<f64>() / r.len().max(1) as f64,
            "max_over_mean_requests": self.max_over_mean(),
            "prefix_cache_queries": sum(&self.workers, PREFIX_CACHE_QUERIES),
            "prefix_cache_hits": sum(&self.workers, PREFIX_CACHE_HITS),
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate(),
        })
    }

    /// Lines for the human table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let line = |s: &mut String, k: &str, v: String| {
            let _ = writeln!(s, "{k:<40} {v}");
        };
        let _ = writeln!(s, "{:-^50}", "Workers (--metrics-url)");
        let requests: Vec<String> = self.requests().iter().map(|r| format!("{r:.0}")).collect();
        line(&mut s, "Requests per worker:", requests.join(" "));
        let ratio = self.max_over_mean().map_or_else(|| "n/a".to_owned(), |r| format!("{r:.2}"));
        line(&mut s, "Max / mean requests per worker:", ratio);
        let rate = self.prefix_cache_hit_rate().map_or_else(|| "n/a".to_owned(), |r| format!("{:.2}", 100.0 * r));
        line(&mut s, "Prefix cache hit rate, workers (%):", rate);
        s
    }
}

/// Scrapes `urls` after a run until their finished requests reach `completed` (a worker counts
/// a request just after its last message, so a scrape right at the end can miss the last few),
/// at most `wait`; then the deltas against `before`.
///
/// # Errors
/// A URL that no longer answers.
pub async fn after_run(
    client: &reqwest::Client,
    urls: &[String],
    before: &[BTreeMap<String, f64>],
    completed: usize,
    wait: Duration,
) -> Result<WorkerLoad> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let after = scrape_all(client, urls).await?;
        let load = WorkerLoad {
            workers: urls.iter().zip(before.iter().zip(&after)).map(|(u, (b, a))| delta(u, b, a)).collect(),
        };
        if load.requests().iter().sum::<f64>() >= completed as f64 || tokio::time::Instant::now() >= deadline {
            return Ok(load);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BEFORE: &str = r#"# HELP vllm:request_success Count of successfully processed requests.
# TYPE vllm:request_success counter
vllm:request_success_total{model_name="m",finished_reason="length"} 3
vllm:request_success_total{model_name="m",finished_reason="stop"} 1
vllm:prompt_tokens_total{model_name="m"} 400
vllm:num_requests_running{model_name="m"} 2
vllm:e2e_request_latency_seconds_count{model_name="m"} 4
# EOF
"#;

    #[test]
    fn parse_sums_labels_and_skips_comments() {
        let m = parse(BEFORE);
        assert_eq!(m[REQUEST_SUCCESS], 4.0);
        assert_eq!(m[PROMPT_TOKENS], 400.0);
        assert_eq!(m["vllm:num_requests_running"], 2.0);
        assert!(!m.contains_key("# EOF"));
        let odd = parse("a{l=\"x y}\"} 5 1700000000\nb 2.5\nbroken{ 1\nnovalue\nc{} nan_or_not\n");
        assert_eq!(odd.get("a"), Some(&5.0), "a label value may hold spaces and braces");
        assert_eq!(odd.get("b"), Some(&2.5));
        assert_eq!(odd.len(), 2);
    }

    #[test]
    fn deltas_balance_and_hit_rate() {
        let after = |req: u32, hits: u32, queries: u32| {
            parse(&format!(
                "vllm:request_success_total{{finished_reason=\"length\"}} {req}\n\
                 vllm:prefix_cache_queries_total {queries}\nvllm:prefix_cache_hits_total {hits}\n\
                 vllm:num_requests_running 0\n"
            ))
        };
        let before = parse("vllm:request_success_total 4\nvllm:prefix_cache_queries_total 10\n");
        let w = |url: &str, a| delta(url, &before, &a);
        let load =
            WorkerLoad { workers: vec![w("a", after(10, 45, 100)), w("b", after(8, 30, 50)), w("c", after(6, 0, 10))] };
        assert_eq!(load.requests(), vec![6.0, 4.0, 2.0]);
        assert_eq!(load.max_over_mean(), Some(1.5));
        // Queried 90 + 40 + 0 tokens, hit 45 + 30 + 0 (no hit counter before: it started at 0).
        let rate = load.prefix_cache_hit_rate().unwrap();
        assert!((rate - 75.0 / 130.0).abs() < 1e-12, "{rate}");
        assert!(load.workers[0].get("vllm:num_requests_running").is_none(), "gauges are not deltas");
        let v = load.json();
        assert_eq!(v["max_over_mean_requests"], json!(1.5));
        assert_eq!(v["per_worker"][1]["requests"], json!(4.0));
        assert_eq!(v["per_worker"][0]["prompt_tokens"], Value::Null, "not exposed");
        assert!(load.table().lines().any(|l| l.starts_with("Max / mean requests per worker:") && l.ends_with(" 1.50")));
    }

    #[test]
    fn without_prefix_cache_counters_the_rate_is_unknown() {
        let before = parse(BEFORE);
        let after = parse(&BEFORE.replace("} 3", "} 9"));
        let load = WorkerLoad { workers: vec![delta("w", &before, &after)] };
        assert_eq!(load.requests(), vec![6.0]);
        assert_eq!(load.prefix_cache_hit_rate(), None);
        assert_eq!(load.json()["prefix_cache_hit_rate"], Value::Null);
        assert_eq!(WorkerLoad { workers: vec![] }.max_over_mean(), None);
    }
}
