//! Worker metrics under vLLM's names (label `model_name`), so existing dashboards and KEDA
//! ScaledObjects work unchanged. Gauges (`running`, `waiting`, KV-cache usage) and the
//! preemption counter are read from each engine at scrape time, so they return to idle as
//! soon as work ends (aborts included); latencies, token counts and finished requests are
//! recorded by `service.rs` as requests stream.
//!
//! Prefix-cache counters (`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`,
//! in prompt tokens; hit rate = hits / queries) and `prism:prompt_tokens_computed_total`
//! (prompt tokens actually prefilled: cache hits excluded, recomputation after preemption
//! included; vLLM has no such metric, hence Prism's prefix) are read from the engines too.
//!
//! prometheus-client appends `_total` to counters itself, so counters are registered
//! without it (`vllm:prompt_tokens` is exposed as `vllm:prompt_tokens_total`).

use crate::agent::replica::ReplicaTable;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;

/// Labels `{model_name}`.
pub type ModelLabels = Vec<(&'static str, String)>;

/// vLLM's TTFT buckets (seconds).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
];
/// vLLM's inter-token latency buckets (seconds).
const ITL_BUCKETS: &[f64] =
    &[0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
/// vLLM's request latency buckets (seconds).
const E2E_BUCKETS: &[f64] =
    &[0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0];

fn model(name: &str) -> ModelLabels {
    vec![("model_name", name.to_owned())]
}

/// Request-path metrics, shared by the gRPC service.
pub struct WorkerMetrics {
    registry: Registry,
    ttft: Family<ModelLabels, Histogram>,
    itl: Family<ModelLabels, Histogram>,
    e2e: Family<ModelLabels, Histogram>,
    prompt_tokens: Family<ModelLabels, Counter>,
    generation_tokens: Family<ModelLabels, Counter>,
    request_success: Family<ModelLabels, Counter>,
}

impl std::fmt::Debug for WorkerMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerMetrics")
    }
}

impl WorkerMetrics {
    /// Registers every metric; engine gauges are read from `replicas` at scrape time.
    pub fn new(replicas: ReplicaTable) -> Self {
        let mut registry = Registry::default();
        let ttft =
            Family::<ModelLabels, Histogram>::new_with_constructor(|| Histogram::new(TTFT_BUCKETS.iter().copied()));
        let itl =
            Family::<ModelLabels, Histogram>::new_with_constructor(|| Histogram::new(ITL_BUCKETS.iter().copied()));
        let e2e =
            Family::<ModelLabels, Histogram>::new_with_constructor(|| Histogram::new(E2E_BUCKETS.iter().copied()));
        let prompt_tokens = Family::<ModelLabels, Counter>::default();
        let generation_tokens = Family::<ModelLabels, Counter>::default();
        let request_success = Family::<ModelLabels, Counter>::default();
        registry.register(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds",
            ttft.clone(),
        );
        registry.register(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds",
            itl.clone(),
        );
        registry.register(
            "vllm:e2e_request_latency_seconds",
            "Histogram of end to end request latency in seconds",
            e2e.clone(),
        );
        registry.register("vllm:prompt_tokens", "Number of prefill tokens processed", prompt_tokens.clone());
        registry.register("vllm:generation_tokens", "Number of generation tokens processed", generation_tokens.clone());
        registry.register("vllm:request_success", "Count of successfully processed requests", request_success.clone());
        registry.register_collector(Box::new(EngineCollector { replicas }));
        Self { registry, ttft, itl, e2e, prompt_tokens, generation_tokens, request_success }
    }

    /// Records the time to first token.
    pub fn observe_ttft(&self, model_name: &str, secs: f64) {
        self.ttft.get_or_create(&model(model_name)).observe(secs);
    }

    /// Records one inter-token gap.
    pub fn observe_itl(&self, model_name: &str, secs: f64) {
        self.itl.get_or_create(&model(model_name)).observe(secs);
    }

    /// Records a finished request: latency, token counts and its finish reason.
    pub fn finish(&self, model_name: &str, e2e_secs: f64, prompt_tokens: u64, generation_tokens: u64, reason: &str) {
        let l = model(model_name);
        self.e2e.get_or_create(&l).observe(e2e_secs);
        self.prompt_tokens.get_or_create(&l).inc_by(prompt_tokens);
        self.generation_tokens.get_or_create(&l).inc_by(generation_tokens);
        let mut lr = l;
        lr.push(("finished_reason", reason.to_owned()));
        self.request_success.get_or_create(&lr).inc();
    }

    /// Prometheus text exposition (OpenMetrics).
    ///
    /// # Errors
    /// Formatting failure (not expected with a `String`).
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

/// Reads each engine's load at scrape time.
#[derive(Debug)]
struct EngineCollector {
    replicas: ReplicaTable,
}

/// A gauge read from the summed load: (name, help, value).
type CountGauge = (&'static str, &'static str, fn(&ModelLoad) -> i64);

#[derive(Default)]
struct ModelLoad {
    running: i64,
    waiting: i64,
    kv_used: f64,
    engines: u32,
    preemptions: u64,
    prefix_cache_queries: u64,
    prefix_cache_hits: u64,
    prompt_tokens_computed: u64,
}

/// A counter read from the summed load: (name without `_total`, help, value).
type CountCounter = (&'static str, &'static str, fn(&ModelLoad) -> u64);

impl prometheus_client::collector::Collector for EngineCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut by_model: BTreeMap<String, ModelLoad> = BTreeMap::new();
        for r in self.replicas.all() {
            let Some(engine) = r.engine() else { continue };
            let l = engine.load();
            let m = by_model.entry(r.model_name.clone()).or_default();
            m.running += i64::from(l.running);
            m.waiting += i64::from(l.waiting);
            m.kv_used += f64::from(l.kv_cache_usage);
            m.engines += 1;
            m.preemptions += l.num_preemptions_total;
            m.prefix_cache_queries += l.prefix_cache_queries_total;
            m.prefix_cache_hits += l.prefix_cache_hits_total;
            m.prompt_tokens_computed += l.prompt_tokens_computed_total;
        }
        let counts: [CountGauge; 2] = [
            ("vllm:num_requests_running", "Number of requests in model execution batches", |m| m.running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed", |m| m.waiting),
        ];
        for (name, help, f) in counts {
            let mut me = encoder.encode_descriptor(name, help, None, ConstGauge::new(0i64).metric_type())?;
            for (model_name, m) in &by_model {
                let labels = model(model_name);
                ConstGauge::new(f(m)).encode(me.encode_family(&labels)?)?;
            }
        }
        let usage: [(&str, &str); 2] = [
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage"),
            ("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage (alias)"),
        ];
        for (name, help) in usage {
            let mut me = encoder.encode_descriptor(name, help, None, ConstGauge::new(0.0f64).metric_type())?;
            for (model_name, m) in &by_model {
                let labels = model(model_name);
                ConstGauge::new(m.kv_used / f64::from(m.engines.max(1))).encode(me.encode_family(&labels)?)?;
            }
        }
        let counters: [CountCounter; 4] = [
            ("vllm:num_preemptions", "Cumulative number of preemptions from the engine", |m| m.preemptions),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens", |m| {
                m.prefix_cache_queries
            }),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens", |m| {
                m.prefix_cache_hits
            }),
            (
                "prism:prompt_tokens_computed",
                "Prompt tokens run through the model in prefill (prefix cache hits excluded)",
                |m| m.prompt_tokens_computed,
            ),
        ];
        for (name, help, f) in counters {
            let mut me = encoder.encode_descriptor(name, help, None, ConstCounter::new(0u64).metric_type())?;
            for (model_name, m) in &by_model {
                let labels = model(model_name);
                ConstCounter::new(f(m)).encode(me.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::replica::{EngineLoad, Replica, ReplicaEngine, ReplicaOutputStream};
    use prism_engine::{EngineError, EngineRequest};
    use std::sync::Arc;

    struct Counting(EngineLoad);
    impl ReplicaEngine for Counting {
        fn submit(&self, _: EngineRequest) -> Result<ReplicaOutputStream, EngineError> {
            Err(EngineError::Unavailable("test double".into()))
        }
        fn load(&self) -> EngineLoad {
            self.0
        }
        fn is_alive(&self) -> bool {
            true
        }
        fn shutdown(&self) {}
    }

    /// The prefix-cache counters of a model's replicas are summed under vLLM's names.
    #[test]
    fn prefix_cache_counters_are_summed_per_model() {
        let table = ReplicaTable::default();
        for (id, q, h, c) in [("a", 100, 64, 36), ("b", 50, 16, 34)] {
            let r = Arc::new(Replica::new(id.into(), "d".into(), "smol".into(), vec![0]));
            r.set_engine(Arc::new(Counting(EngineLoad {
                prefix_cache_queries_total: q,
                prefix_cache_hits_total: h,
                prompt_tokens_computed_total: c,
                ..EngineLoad::default()
            })));
            table.insert_new(r);
        }
        let text = WorkerMetrics::new(table).encode().expect("encode");
        for line in [
            "vllm:prefix_cache_queries_total{model_name=\"smol\"} 150",
            "vllm:prefix_cache_hits_total{model_name=\"smol\"} 80",
            "prism:prompt_tokens_computed_total{model_name=\"smol\"} 70",
        ] {
            assert!(text.lines().any(|l| l == line), "missing {line} in\n{text}");
        }
    }
}
