//! Shared fixture of the drain / preemption tests (issue 7): a real local cluster of etcd,
//! one `prism-head`, N `prism-worker` processes on the bundled SmolLM2 GGUF (CPU backend)
//! and one `prism-router`, each its own process on loopback ports; a greedy streaming client
//! that records token ids and inter-token gaps; a closed-loop load generator that checks
//! every stream against an undisturbed reference run; and helpers to read the router's
//! route view (`ListModels`) and metrics.
//!
//! Budget: the CI machine has 2 cores, so prompts are short, `max_tokens` 32–64 and only a
//! few clients run at once.

#![allow(dead_code)]

use crate::e2e_support::{Proc, bin, eventually, prism_cli};
use anyhow::{Context, Result, bail};
use prism_common::proto::v1::head_service_client::HeadServiceClient;
use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
use prism_common::proto::v1::{
    ClusterStatusRequest, FinishReason, GenerateRequest, ListModelsRequest, NodeState, ReplicaRecord, ReplicaState,
    SamplingParams, TokenIds, generate_request,
};
use prism_tests::{EtcdFixture, free_port};
use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Served model name of the test deployment.
pub const SERVED: &str = "smollm2";

/// Short prompts (token ids of the reference fixture's tokenizer cases).
pub const PROMPTS: &[&[u32]] = &[
    &[19556, 28, 905, 17],
    &[504, 2365, 6354, 16438, 27003, 690, 260, 23790, 2767, 30],
    &[2899, 1898],
    &[256, 1296, 2899, 5600, 284, 35079, 333],
];

/// One worker process and where it serves.
pub struct Worker {
    /// Node id (`w1`, `w2`, …).
    pub node: String,
    /// gRPC endpoint (`http://127.0.0.1:PORT`).
    pub grpc: String,
    /// HTTP base (`http://127.0.0.1:PORT`).
    pub http: String,
    /// Flags it was started with (for restarts).
    args: Vec<String>,
    /// The process (None after it was reaped by a test).
    pub proc: Option<Proc>,
}

/// How to start a cluster.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// Number of workers.
    pub workers: usize,
    /// Replicas of the deployment (spread).
    pub replicas: u32,
    /// Extra flags for every worker.
    pub worker_args: Vec<String>,
    /// Extra flags for one worker (by index).
    pub worker_extra: HashMap<usize, Vec<String>>,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self { workers: 3, replicas: 3, worker_args: Vec::new(), worker_extra: HashMap::new() }
    }
}

/// A running cluster; dropping it kills every process (etcd last).
pub struct Cluster {
    /// Head gRPC URL.
    pub head: String,
    head_port: u16,
    head_args: Vec<String>,
    /// Router HTTP base.
    pub http: String,
    /// Router gRPC URL.
    pub grpc: String,
    /// The head process (None while killed).
    pub head_proc: Option<Proc>,
    /// The router process.
    pub router: Proc,
    /// The workers, in node order.
    pub workers: Vec<Worker>,
    /// The model file.
    pub model: std::path::PathBuf,
    etcd: EtcdFixture,
}

fn s(x: &str) -> String {
    x.to_owned()
}

impl Cluster {
    /// Starts etcd, the head, `opts.workers` workers (`w1`…) and the router, then deploys
    /// `opts.replicas` replicas of the model (spread) and waits until the router lists them
    /// all Ready.
    ///
    /// # Errors
    /// When a process fails to start or the deployment does not become Ready.
    pub async fn start(model: &Path, opts: ClusterOptions) -> Result<Self> {
        let etcd = EtcdFixture::start().await?;
        let head_port = free_port()?;
        let head = format!("http://127.0.0.1:{head_port}");
        let head_args = vec![
            s("--store"),
            format!("etcd://{}", etcd.endpoint()),
            s("--listen"),
            format!("127.0.0.1:{head_port}"),
            s("--http-listen"),
            format!("127.0.0.1:{}", free_port()?),
            s("--worker-timeout"),
            s("2s"),
            s("--drain-timeout"),
            s("30s"),
        ];
        let head_proc = Proc::spawn("prism-head", &bin("prism-head")?, &head_args, &[])?;
        let mut workers = Vec::new();
        for i in 0..opts.workers {
            let node = format!("w{}", i + 1);
            let (gp, hp) = (free_port()?, free_port()?);
            let mut args = vec![
                s("--head"),
                head.clone(),
                s("--node-id"),
                node.clone(),
                s("--listen"),
                format!("127.0.0.1:{gp}"),
                s("--http-listen"),
                format!("127.0.0.1:{hp}"),
                s("--kv-cache-bytes"),
                s("67108864"),
            ];
            args.extend(opts.worker_args.iter().cloned());
            if let Some(extra) = opts.worker_extra.get(&i) {
                args.extend(extra.iter().cloned());
            }
            let proc = Proc::spawn(&node, &bin("prism-worker")?, &args, &[])?;
            workers.push(Worker {
                node,
                grpc: format!("http://127.0.0.1:{gp}"),
                http: format!("http://127.0.0.1:{hp}"),
                args,
                proc: Some(proc),
            });
        }
        let (http_port, grpc_port) = (free_port()?, free_port()?);
        let router = Proc::spawn(
            "prism-router",
            &bin("prism-router")?,
            &[
                s("--head"),
                head.clone(),
                s("--http-listen"),
                format!("127.0.0.1:{http_port}"),
                s("--grpc-listen"),
                format!("127.0.0.1:{grpc_port}"),
                s("--ejection-base"),
                s("0.5"),
            ],
            &[],
        )?;
        let mut cluster = Self {
            head,
            head_port,
            head_args,
            http: format!("http://127.0.0.1:{http_port}"),
            grpc: format!("http://127.0.0.1:{grpc_port}"),
            head_proc: Some(head_proc),
            router,
            workers,
            model: model.to_path_buf(),
            etcd,
        };
        if let Err(e) = cluster.deploy(opts.workers, opts.replicas).await {
            bail!("{e:#}\n{}", cluster.logs());
        }
        Ok(cluster)
    }

    async fn deploy(&mut self, nodes: usize, replicas: u32) -> Result<()> {
        let head = self.head.clone();
        eventually(Duration::from_secs(60), "workers registered", || {
            let head = head.clone();
            async move {
                let st =
                    HeadServiceClient::connect(head).await?.cluster_status(ClusterStatusRequest {}).await?.into_inner();
                Ok((st.is_leader && st.nodes.len() == nodes).then_some(()))
            }
        })
        .await?;
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("smollm2.yaml");
        std::fs::write(
            &file,
            format!(
                "name: smollm2\nmodel: {}\nserved_model_name: {SERVED}\nreplicas: {replicas}\nplacement: spread\n",
                self.model.display()
            ),
        )?;
        let f = file.to_string_lossy().into_owned();
        let head = self.head.clone();
        tokio::task::block_in_place(|| prism_cli(&["--head", &head, "deploy", "-f", &f]))?;
        self.wait_ready(replicas as usize, Duration::from_secs(240)).await
    }

    /// Waits until the head has `n` Ready replicas and the router lists `n` ready replicas.
    ///
    /// # Errors
    /// On timeout or a Failed replica.
    pub async fn wait_ready(&self, n: usize, timeout: Duration) -> Result<()> {
        let head = self.head.clone();
        eventually(timeout, "replicas Ready at the head", || {
            let head = head.clone();
            async move {
                let st =
                    HeadServiceClient::connect(head).await?.cluster_status(ClusterStatusRequest {}).await?.into_inner();
                if let Some(f) = st.replicas.iter().find(|r| r.state == ReplicaState::Failed as i32) {
                    bail!("replica {} failed: {}", f.replica_id, f.reason);
                }
                let ready = st.replicas.iter().filter(|r| r.state == ReplicaState::Ready as i32).count();
                Ok((ready == n).then_some(()))
            }
        })
        .await?;
        let grpc = self.grpc.clone();
        eventually(Duration::from_secs(30), "router lists the replicas", || {
            let grpc = grpc.clone();
            async move { Ok((router_ready_replicas(&grpc).await? == n as u32).then_some(())) }
        })
        .await
    }

    /// The head's replica records.
    ///
    /// # Errors
    /// When the head does not answer.
    pub async fn replicas(&self) -> Result<Vec<ReplicaRecord>> {
        let st = HeadServiceClient::connect(self.head.clone()).await?.cluster_status(ClusterStatusRequest {}).await?;
        Ok(st.into_inner().replicas)
    }

    /// The node state of `node` at the head, and whether it is cordoned.
    ///
    /// # Errors
    /// When the head does not answer or does not know the node.
    pub async fn node_state(&self, node: &str) -> Result<(NodeState, bool)> {
        let st = HeadServiceClient::connect(self.head.clone()).await?.cluster_status(ClusterStatusRequest {}).await?;
        let rec = st
            .into_inner()
            .nodes
            .into_iter()
            .find(|n| n.inventory.as_ref().is_some_and(|i| i.node_id == node))
            .context("node unknown")?;
        Ok((rec.state(), rec.cordoned))
    }

    /// Replica id hosted on `node` (Ready or Draining), if any.
    ///
    /// # Errors
    /// When the head does not answer.
    pub async fn replica_on(&self, node: &str) -> Result<Option<String>> {
        Ok(self
            .replicas()
            .await?
            .into_iter()
            .find(|r| r.node_id == node && matches!(r.state(), ReplicaState::Ready | ReplicaState::Draining))
            .map(|r| r.replica_id))
    }

    /// Worker by node id.
    ///
    /// # Errors
    /// When there is no such worker.
    pub fn worker(&mut self, node: &str) -> Result<&mut Worker> {
        self.workers.iter_mut().find(|w| w.node == node).context("no such worker")
    }

    /// Starts a worker again with its original flags (same node id and ports).
    ///
    /// # Errors
    /// When it cannot be started.
    pub fn restart_worker(&mut self, node: &str) -> Result<()> {
        let w = self.worker(node)?;
        if let Some(p) = w.proc.as_mut()
            && !p.exited()
        {
            bail!("{node} is still running");
        }
        w.proc = None;
        w.proc = Some(Proc::spawn(&w.node, &bin("prism-worker")?, &w.args, &[])?);
        Ok(())
    }

    /// Waits until `node`'s worker answers `/readyz` with 200 (registered, not draining,
    /// every hosted replica Ready).
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_worker_ready(&mut self, node: &str, timeout: Duration) -> Result<()> {
        let url = format!("{}/readyz", self.worker(node)?.http);
        eventually(timeout, "worker /readyz", || {
            let url = url.clone();
            async move { Ok(reqwest::get(url).await?.status().is_success().then_some(())) }
        })
        .await
    }

    /// Kills the head with SIGKILL.
    pub fn kill_head(&mut self) {
        self.head_proc = None;
    }

    /// Starts the head again (same flags and ports).
    ///
    /// # Errors
    /// When it cannot be started.
    pub fn restart_head(&mut self) -> Result<()> {
        self.head_proc = Some(Proc::spawn("prism-head", &bin("prism-head")?, &self.head_args, &[])?);
        Ok(())
    }

    /// Runs the `prism` CLI against this cluster's head.
    ///
    /// # Errors
    /// When the command fails.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let mut all = vec!["--head", self.head.as_str()];
        all.extend_from_slice(args);
        tokio::task::block_in_place(|| prism_cli(&all))
    }

    /// The router's `/metrics` value of a sample line starting with `name` (0 when absent).
    ///
    /// # Errors
    /// On transport errors.
    pub async fn router_metric(&self, name: &str) -> Result<f64> {
        let text = reqwest::get(format!("{}/metrics", self.http)).await?.text().await?;
        Ok(metric_value(&text, name))
    }

    /// Every process's stderr tail, for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        let tail = |s: String| {
            let cut = s.len().saturating_sub(6000);
            let cut = (cut..s.len()).find(|i| s.is_char_boundary(*i)).unwrap_or(0);
            s[cut..].to_owned()
        };
        if let Some(h) = &self.head_proc {
            out.push_str(&format!("--- head ---\n{}\n", tail(h.stderr())));
        }
        for w in &self.workers {
            if let Some(p) = &w.proc {
                out.push_str(&format!("--- {} ---\n{}\n", w.node, tail(p.stderr())));
            }
        }
        out.push_str(&format!("--- router ---\n{}\n", tail(self.router.stderr())));
        out
    }
}

/// Sum of the samples whose line starts with `name` (so `prism_x_total{…}` lines add up).
pub fn metric_value(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(name))
        .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// Ready replicas of [`SERVED`] according to the router (`ListModels`).
///
/// # Errors
/// When the router does not answer.
pub async fn router_ready_replicas(grpc: &str) -> Result<u32> {
    let mut c = InferenceServiceClient::connect(grpc.to_owned()).await?;
    let models = c.list_models(ListModelsRequest {}).await?.into_inner().models;
    Ok(models.iter().find(|m| m.id == SERVED).map_or(0, |m| m.ready_replicas))
}

/// Polls the router every 2 ms until its ready replica count differs from `from`;
/// returns when that was seen.
///
/// # Errors
/// On timeout.
pub async fn wait_route_change(grpc: &str, from: u32, timeout: Duration) -> Result<Instant> {
    let mut c = InferenceServiceClient::connect(grpc.to_owned()).await?;
    let deadline = Instant::now() + timeout;
    loop {
        let models = c.list_models(ListModelsRequest {}).await?.into_inner().models;
        let n = models.iter().find(|m| m.id == SERVED).map_or(0, |m| m.ready_replicas);
        if n != from {
            return Ok(Instant::now());
        }
        if Instant::now() > deadline {
            bail!("router still lists {from} ready replicas after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// What one streaming request returned.
#[derive(Clone, Debug, Default)]
pub struct StreamResult {
    /// Every token id, in order.
    pub tokens: Vec<u32>,
    /// Largest gap between two messages carrying tokens.
    pub max_gap: Duration,
    /// When the largest gap ended.
    pub max_gap_at: Option<Instant>,
    /// When the request started and ended.
    pub started: Option<Instant>,
    /// When the last message arrived.
    pub ended: Option<Instant>,
    /// Final finish reason.
    pub finish: i32,
    /// Completion tokens from `usage`.
    pub completion_tokens: u32,
    /// Prompt tokens from `usage`.
    pub prompt_tokens: u32,
}

/// A greedy request for `prompt` (ids), `max_tokens`, not stopping at EOS.
pub fn greedy_request(prompt: &[u32], max_tokens: u32, ignore_eos: bool) -> GenerateRequest {
    GenerateRequest {
        model: SERVED.into(),
        prompt: Some(generate_request::Prompt::TokenIds(TokenIds { ids: prompt.to_vec() })),
        sampling: Some(SamplingParams {
            temperature: Some(0.0),
            max_tokens: Some(i64::from(max_tokens)),
            ignore_eos,
            skip_special_tokens: Some(true),
            ..SamplingParams::default()
        }),
        ..GenerateRequest::default()
    }
}

/// Streams `req` through the router's gRPC API and records the tokens and gaps.
///
/// # Errors
/// Any gRPC error (a client-visible failure).
pub async fn stream(grpc: &str, req: GenerateRequest) -> Result<StreamResult> {
    let mut c = InferenceServiceClient::connect(grpc.to_owned()).await?;
    let started = Instant::now();
    let mut out = StreamResult { started: Some(started), ..StreamResult::default() };
    let mut s = c.generate(req).await?.into_inner();
    let mut last = started;
    let mut first = true;
    while let Some(m) = s.message().await? {
        let now = Instant::now();
        if !m.token_ids.is_empty() {
            if !first && now - last > out.max_gap {
                out.max_gap = now - last;
                out.max_gap_at = Some(now);
            }
            first = false;
            last = now;
            out.tokens.extend_from_slice(&m.token_ids);
        }
        if m.finish_reason != FinishReason::Unspecified as i32 {
            out.finish = m.finish_reason;
        }
        if let Some(u) = m.usage {
            out.completion_tokens = u.completion_tokens;
            out.prompt_tokens = u.prompt_tokens;
        }
        out.ended = Some(now);
    }
    Ok(out)
}

/// Undisturbed greedy outputs of every prompt in [`PROMPTS`] (`max_tokens`, EOS ignored),
/// one concurrent request per prompt.
///
/// # Errors
/// Any request failure.
pub async fn reference(grpc: &str, max_tokens: u32) -> Result<Vec<Vec<u32>>> {
    let runs = PROMPTS.iter().map(|p| stream(grpc, greedy_request(p, max_tokens, true)));
    let mut out = Vec::new();
    for r in futures::future::join_all(runs).await {
        let r = r?;
        if r.tokens.len() != max_tokens as usize {
            bail!("reference run gave {} tokens, expected {max_tokens}", r.tokens.len());
        }
        out.push(r.tokens);
    }
    Ok(out)
}

/// Outcome of a load run.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// Streams that completed with the reference tokens.
    pub ok: usize,
    /// Client-visible errors.
    pub errors: Vec<String>,
    /// Streams that differ from the reference: tokens, usage or finish reason (prompt
    /// index, description).
    pub mismatches: Vec<(usize, String)>,
    /// Every result (prompt index, stream).
    pub results: Vec<(usize, StreamResult)>,
}

impl LoadReport {
    /// Largest inter-token gap of the streams that were running at `t`.
    pub fn max_gap_around(&self, t: Instant) -> Duration {
        self.results
            .iter()
            .filter(|(_, r)| r.started.is_some_and(|s| s <= t) && r.ended.is_some_and(|e| e >= t))
            .map(|(_, r)| r.max_gap)
            .max()
            .unwrap_or_default()
    }

    /// Largest inter-token gap over every stream.
    pub fn max_gap(&self) -> Duration {
        self.results.iter().map(|(_, r)| r.max_gap).max().unwrap_or_default()
    }

    /// Fails when a stream erred or differed from the reference.
    ///
    /// # Errors
    /// Describes the first failures.
    pub fn check(&self) -> Result<()> {
        if !self.errors.is_empty() || !self.mismatches.is_empty() {
            bail!(
                "{} ok, {} errors {:?}, {} mismatches {:?}",
                self.ok,
                self.errors.len(),
                self.errors.iter().take(5).collect::<Vec<_>>(),
                self.mismatches.len(),
                self.mismatches.iter().take(2).collect::<Vec<_>>()
            );
        }
        Ok(())
    }
}

/// Closed-loop streaming clients, each sending greedy requests one after the other until
/// stopped; every stream is compared with the reference.
pub struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    report: Arc<Mutex<LoadReport>>,
}

impl Load {
    /// Starts `clients` clients against the router at `grpc`.
    pub fn start(grpc: &str, clients: usize, max_tokens: u32, reference: Arc<Vec<Vec<u32>>>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let report = Arc::new(Mutex::new(LoadReport::default()));
        let tasks = (0..clients)
            .map(|c| {
                let (grpc, stop, report, reference) =
                    (grpc.to_owned(), stop.clone(), report.clone(), reference.clone());
                tokio::spawn(async move {
                    let mut i = c;
                    while !stop.load(Ordering::SeqCst) {
                        let p = i % PROMPTS.len();
                        i += 1;
                        let res = stream(&grpc, greedy_request(PROMPTS[p], max_tokens, true)).await;
                        let Ok(mut rep) = report.lock() else { return };
                        match res {
                            // Usage and finish_reason describe the whole request, also after a migration.
                            Ok(r)
                                if r.tokens == reference[p]
                                    && r.completion_tokens == max_tokens
                                    && r.prompt_tokens as usize == PROMPTS[p].len()
                                    && r.finish == FinishReason::Length as i32 =>
                            {
                                rep.ok += 1;
                                rep.results.push((p, r));
                            }
                            Ok(r) => {
                                let what = format!(
                                    "tokens {:?} (expected {:?}), usage {}+{}, finish {}",
                                    r.tokens, reference[p], r.prompt_tokens, r.completion_tokens, r.finish
                                );
                                rep.mismatches.push((p, what));
                                rep.results.push((p, r));
                            }
                            Err(e) => rep.errors.push(format!("{e:#}")),
                        }
                    }
                })
            })
            .collect();
        Self { stop, tasks, report }
    }

    /// Streams finished so far (ok + failed).
    pub fn finished(&self) -> usize {
        self.report.lock().map(|r| r.ok + r.errors.len() + r.mismatches.len()).unwrap_or(0)
    }

    /// Waits until at least `n` more streams than now have finished.
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_more(&self, n: usize, timeout: Duration) -> Result<()> {
        let target = self.finished() + n;
        prism_tests::wait_until(timeout, "load progress", || std::future::ready(self.finished() >= target)).await
    }

    /// Stops the clients after their current stream and returns the report.
    ///
    /// # Errors
    /// When a client task panicked.
    pub async fn stop(self) -> Result<LoadReport> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            t.await?;
        }
        let mut r = self.report.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        Ok(std::mem::take(&mut *r))
    }
}

/// p-quantile (0..=1) of `xs` (sorted copy; nearest rank).
pub fn quantile(xs: &[Duration], q: f64) -> Duration {
    let mut v = xs.to_vec();
    v.sort_unstable();
    if v.is_empty() {
        return Duration::ZERO;
    }
    let idx = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
    v[idx]
}
