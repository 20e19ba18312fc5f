//! Agent tests: the worker runs in-process against `RecordingHead`, a protocol test double
//! of `HeadService.WorkerSession` written here (it records every worker message and sends
//! the commands the test gives it). The first test uses the real model; the drain tests
//! use `TickingEngine`, an engine test double that emits one token every few milliseconds.

use anyhow::{Context, Result, bail};
use futures::StreamExt;
use prism_common::proto::v1::head_service_server::{HeadService, HeadServiceServer};
use prism_common::proto::v1::worker_service_client::WorkerServiceClient;
use prism_common::proto::v1::{self as pb, head_message, worker_message};
use prism_engine::{EngineError, EngineHandle, EngineOutput, EngineRequest, Fault, FinishReason, Usage};
use prism_worker::agent::launcher::engine_config;
use prism_worker::agent::replica::{EngineLauncher, EngineLoad, LaunchSpec, ReplicaEngine, ReplicaOutputStream};
use prism_worker::{WorkerConfig, run, run_with_launcher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{Notify, mpsc};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

// ------------------------------------------------------------------ RecordingHead

/// The current session's number and the sender of the head's commands into it.
type CommandSender = (u32, mpsc::Sender<Result<pb::HeadMessage, Status>>);

/// Protocol test double of the head: records worker messages, forwards test commands.
#[derive(Clone, Default)]
struct RecordingHead {
    log: Arc<Mutex<Vec<pb::WorkerMessage>>>,
    seen: Arc<Notify>,
    commands: Arc<Mutex<Option<CommandSender>>>,
    sessions: Arc<AtomicU32>,
    /// Answer every session with UNAVAILABLE naming this leader.
    follower_of: Option<String>,
}

impl RecordingHead {
    fn messages(&self) -> Vec<pb::WorkerMessage> {
        self.log.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Waits (up to `timeout`) until `pred` holds for some recorded message; returns it.
    async fn wait_for<T>(&self, timeout: Duration, mut pred: impl FnMut(&pb::WorkerMessage) -> Option<T>) -> Result<T> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.seen.notified();
            if let Some(t) = self.messages().iter().find_map(&mut pred) {
                return Ok(t);
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                bail!("timed out after {timeout:?}; recorded: {:?}", self.messages());
            }
        }
    }

    async fn send(&self, m: head_message::Msg) -> Result<()> {
        let tx =
            self.commands.lock().ok().and_then(|c| c.as_ref().map(|c| c.1.clone())).context("no worker session")?;
        tx.send(Ok(pb::HeadMessage { msg: Some(m) })).await.context("session closed")?;
        Ok(())
    }

    /// Ends the current session from the head's side (as a dying head would).
    fn close_session(&self) {
        if let Ok(mut c) = self.commands.lock() {
            c.take();
        }
    }
}

fn replica_state(m: &pb::WorkerMessage, id: &str) -> Option<(pb::ReplicaState, String)> {
    match &m.msg {
        Some(worker_message::Msg::Status(s)) => s
            .replicas
            .iter()
            .find(|r| r.replica_id == id)
            .map(|r| (pb::ReplicaState::try_from(r.state).unwrap_or_default(), r.reason.clone())),
        _ => None,
    }
}

type HeadStream = ReceiverStream<Result<pb::HeadMessage, Status>>;

#[tonic::async_trait]
impl HeadService for RecordingHead {
    type WorkerSessionStream = HeadStream;
    type WatchRoutesStream = ReceiverStream<Result<pb::RouteTable, Status>>;

    async fn worker_session(
        &self,
        request: Request<Streaming<pb::WorkerMessage>>,
    ) -> Result<Response<HeadStream>, Status> {
        if let Some(leader) = &self.follower_of {
            let mut s = Status::unavailable(format!("not the leader; leader={leader}"));
            if let Ok(v) = leader.parse() {
                s.metadata_mut().insert("prism-leader", v);
            }
            return Err(s);
        }
        let session = self.sessions.fetch_add(1, Ordering::SeqCst);
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(16);
        if let Ok(mut c) = self.commands.lock() {
            *c = Some((session, tx.clone()));
        }
        let _ = tx.send(Ok(pb::HeadMessage { msg: Some(head_message::Msg::Ack(pb::RegisterAck::default())) })).await;
        let log = Arc::clone(&self.log);
        let seen = Arc::clone(&self.seen);
        let commands = Arc::clone(&self.commands);
        tokio::spawn(async move {
            while let Ok(Some(m)) = inbound.message().await {
                if let Ok(mut l) = log.lock() {
                    l.push(m);
                }
                seen.notify_waiters();
            }
            // The worker closed its side: close ours, as a real head does.
            if let Ok(mut c) = commands.lock()
                && c.as_ref().is_some_and(|c| c.0 == session)
            {
                c.take();
            }
        });
        drop(tx);
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn watch_routes(
        &self,
        _r: Request<pb::WatchRoutesRequest>,
    ) -> Result<Response<Self::WatchRoutesStream>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn report_demand(
        &self,
        _r: Request<pb::RouterDemandReport>,
    ) -> Result<Response<pb::RouterDemandAck>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn apply_deployment(
        &self,
        _r: Request<pb::ApplyDeploymentRequest>,
    ) -> Result<Response<pb::ApplyDeploymentResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn delete_deployment(
        &self,
        _r: Request<pb::DeleteDeploymentRequest>,
    ) -> Result<Response<pb::DeleteDeploymentResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn scale_deployment(
        &self,
        _r: Request<pb::ScaleDeploymentRequest>,
    ) -> Result<Response<pb::ScaleDeploymentResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn list_deployments(
        &self,
        _r: Request<pb::ListDeploymentsRequest>,
    ) -> Result<Response<pb::ListDeploymentsResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn list_nodes(&self, _r: Request<pb::ListNodesRequest>) -> Result<Response<pb::ListNodesResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn list_replicas(
        &self,
        _r: Request<pb::ListReplicasRequest>,
    ) -> Result<Response<pb::ListReplicasResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn cluster_status(
        &self,
        _r: Request<pb::ClusterStatusRequest>,
    ) -> Result<Response<pb::ClusterStatusResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn cordon_node(&self, _r: Request<pb::NodeRequest>) -> Result<Response<pb::NodeResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn uncordon_node(&self, _r: Request<pb::NodeRequest>) -> Result<Response<pb::NodeResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
    async fn drain_node(&self, _r: Request<pb::DrainNodeRequest>) -> Result<Response<pb::NodeResponse>, Status> {
        Err(Status::unimplemented("test double"))
    }
}

/// Serves `head` on a fresh loopback port until `stop`; returns `http://127.0.0.1:PORT`.
async fn serve_head(head: RecordingHead, stop: CancellationToken) -> Result<String> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = format!("http://{}", l.local_addr()?);
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(HeadServiceServer::new(head))
            .serve_with_incoming_shutdown(TcpListenerStream::new(l), stop.cancelled_owned()),
    );
    Ok(addr)
}

// ------------------------------------------------------------------ worker fixture

struct Worker {
    grpc: String,
    http: String,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<Result<()>>,
}

async fn start_worker(cfg: WorkerConfig, launcher: Option<Arc<dyn EngineLauncher>>) -> Result<Worker> {
    let g = TcpListener::bind("127.0.0.1:0").await?;
    let h = TcpListener::bind("127.0.0.1:0").await?;
    let grpc = format!("http://{}", g.local_addr()?);
    let http = format!("http://{}", h.local_addr()?);
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let task = tokio::spawn(async move {
        match launcher {
            Some(l) => run_with_launcher(cfg, g, h, token, l).await,
            None => run(cfg, g, h, token).await,
        }
    });
    Ok(Worker { grpc, http, shutdown, task })
}

impl Worker {
    async fn stop(self, within: Duration) -> Result<()> {
        self.shutdown.cancel();
        tokio::time::timeout(within, self.task).await.context("worker did not stop in time")???;
        Ok(())
    }
}

fn start_cmd(id: &str, model: &str) -> head_message::Msg {
    head_message::Msg::Start(pb::StartReplica {
        replica_id: id.into(),
        deployment: "smol".into(),
        engine: Some(pb::EngineConfig {
            model: model.into(),
            served_model_name: "smol".into(),
            tensor_parallel_size: 1,
            kv_cache_bytes: Some(32 * 1024 * 1024),
            ..Default::default()
        }),
        gpu_indices: vec![0],
        ..Default::default()
    })
}

fn generate_req(replica: &str, prompt: &str, max_tokens: i64) -> pb::WorkerGenerateRequest {
    pb::WorkerGenerateRequest {
        replica_id: replica.into(),
        request: Some(pb::GenerateRequest {
            model: "smol".into(),
            prompt: Some(pb::generate_request::Prompt::Text(prompt.into())),
            sampling: Some(pb::SamplingParams {
                temperature: Some(0.0),
                max_tokens: Some(max_tokens),
                ignore_eos: true,
                skip_special_tokens: Some(true),
                ..Default::default()
            }),
            request_id: String::new(),
            timeout_ms: None,
            cache_salt: None,
            ..Default::default()
        }),
        ..Default::default()
    }
}

async fn http_get(url: &str) -> Result<(u16, String)> {
    let r = reqwest::get(url).await?;
    Ok((r.status().as_u16(), r.text().await?))
}

fn model_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

// ------------------------------------------------------------------ real model

/// The real engine, keeping a handle so the test can watch its threads.
#[derive(Clone, Default)]
struct WatchedLauncher(Arc<Mutex<Option<EngineHandle>>>);

impl EngineLauncher for WatchedLauncher {
    fn launch(&self, spec: &LaunchSpec) -> Result<Arc<dyn ReplicaEngine>, EngineError> {
        let h = EngineHandle::start(engine_config(spec), None)?;
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(h.clone());
        }
        Ok(Arc::new(h))
    }
}

/// QA's cascade: a stalled engine's replica is failed after `--engine-stall-timeout`, and its
/// engine stops with it (no thread keeps computing for the dead replica), the stream ends
/// UNAVAILABLE so the router migrates it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_stalled_engine_is_failed_and_its_threads_end() -> Result<()> {
    let model = model_path();
    if !model.exists() {
        eprintln!("skipping: {} not present", model.display());
        return Ok(());
    }
    let head = RecordingHead::default();
    let head_stop = CancellationToken::new();
    let addr = serve_head(head.clone(), head_stop.clone()).await?;
    let mut cfg = WorkerConfig::for_test(addr, "node-stall");
    cfg.engine_stall_timeout = Duration::from_secs(1);
    cfg.engine_threads = Some(2);
    let launcher = WatchedLauncher::default();
    let w = start_worker(cfg, Some(Arc::new(launcher.clone()))).await?;
    head.wait_for(Duration::from_secs(10), |m| matches!(m.msg, Some(worker_message::Msg::Register(_))).then_some(()))
        .await?;
    head.send(start_cmd("stall-1", &model.to_string_lossy())).await?;
    head.wait_for(Duration::from_secs(180), |m| replica_state(m, "stall-1").filter(|s| s.0 == pb::ReplicaState::Ready))
        .await?;
    let engine = launcher.0.lock().ok().and_then(|g| g.clone()).context("engine launched")?;
    assert_eq!(compute_threads_started(&engine), 2);
    engine.inject_fault(Fault::Stall(Duration::from_secs(600)))?;
    let mut client = WorkerServiceClient::connect(w.grpc.clone()).await?;
    let s = client.generate(generate_req("stall-1", "Hello there", 8)).await?.into_inner();
    let stream = tokio::spawn(collect(s));
    let (_, reason) = head
        .wait_for(Duration::from_secs(10), |m| replica_state(m, "stall-1").filter(|s| s.0 == pb::ReplicaState::Failed))
        .await?;
    assert!(reason.contains("has not completed a step"), "{reason}");
    let failed_at = std::time::Instant::now();
    while !(engine.step_thread_finished() && engine.stats().compute_threads_alive == 0) {
        assert!(failed_at.elapsed() < Duration::from_secs(5), "engine threads still running: {:?}", engine.stats());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (toks, err) = tokio::time::timeout(Duration::from_secs(10), stream).await??;
    assert!(toks.is_empty(), "the stalled engine produced nothing");
    assert_eq!(err.map(|e| e.code()), Some(tonic::Code::Unavailable));
    w.stop(Duration::from_secs(10)).await?;
    head_stop.cancel();
    Ok(())
}

/// Compute threads the engine started (all of its pool, once up).
fn compute_threads_started(engine: &EngineHandle) -> usize {
    let t0 = std::time::Instant::now();
    while engine.stats().compute_threads_alive < 2 && t0.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(2));
    }
    engine.stats().compute_threads_alive
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_registers_starts_real_model_generates_and_stops() -> Result<()> {
    let model = model_path();
    if !model.exists() {
        eprintln!("skipping: {} not present", model.display());
        return Ok(());
    }
    let head = RecordingHead::default();
    let head_stop = CancellationToken::new();
    let head_addr = serve_head(head.clone(), head_stop.clone()).await?;
    let mut cfg = WorkerConfig::for_test(head_addr, "node-a");
    cfg.labels.insert("capacity-type".into(), "spot".into());
    let w = start_worker(cfg, None).await?;

    // register first, with the inventory.
    let inv = head
        .wait_for(Duration::from_secs(10), |m| match &m.msg {
            Some(worker_message::Msg::Register(i)) => Some(i.clone()),
            _ => None,
        })
        .await?;
    assert!(matches!(head.messages()[0].msg, Some(worker_message::Msg::Register(_))), "register comes first");
    assert_eq!(inv.node_id, "node-a");
    assert_eq!(inv.address, w.grpc);
    assert_eq!((inv.gpus.len(), inv.cpu_slots, inv.simulated_gpus), (0, 1, false));
    assert_eq!(inv.labels.get("capacity-type").map(String::as_str), Some("spot"));

    // Unknown model path: Failed, with the path in the reason.
    head.send(start_cmd("bad-1", "/nonexistent/model.gguf")).await?;
    let (_, reason) = head
        .wait_for(Duration::from_secs(10), |m| replica_state(m, "bad-1").filter(|s| s.0 == pb::ReplicaState::Failed))
        .await?;
    assert!(reason.contains("/nonexistent/model.gguf"), "reason names the path: {reason}");
    head.send(head_message::Msg::Stop(pb::StopReplica { replica_id: "bad-1".into(), deadline_ms: 0 })).await?;
    head.wait_for(Duration::from_secs(10), |m| replica_state(m, "bad-1").filter(|s| s.0 == pb::ReplicaState::Stopped))
        .await?;

    // Start the real model: Starting → Ready.
    let model_str = model.to_string_lossy().into_owned();
    head.send(start_cmd("smol-1", &model_str)).await?;
    head.wait_for(Duration::from_secs(10), |m| {
        replica_state(m, "smol-1").filter(|s| s.0 == pb::ReplicaState::Starting)
    })
    .await?;
    head.wait_for(Duration::from_secs(180), |m| replica_state(m, "smol-1").filter(|s| s.0 == pb::ReplicaState::Ready))
        .await?;
    let (code, body) = http_get(&format!("{}/readyz", w.http)).await?;
    assert_eq!(code, 200, "ready once registered and the replica is Ready: {body}");

    // Generate streams tokens.
    let mut client = WorkerServiceClient::connect(w.grpc.clone()).await?;
    let mut stream = client.generate(generate_req("smol-1", "The capital of France is", 8)).await?.into_inner();
    let mut tokens = Vec::new();
    let mut text = String::new();
    let mut last = None;
    while let Some(m) = stream.message().await? {
        tokens.extend(m.token_ids.iter().copied());
        text.push_str(&m.text);
        last = Some(m);
    }
    let last = last.context("no response")?;
    assert_eq!(tokens.len(), 8);
    assert_eq!(last.finish_reason, pb::FinishReason::Length as i32);
    let usage = last.usage.context("usage on the last message")?;
    assert_eq!(usage.completion_tokens, 8);
    assert!(usage.prompt_tokens > 0);
    assert!(!text.is_empty());

    // Unknown replica: NOT_FOUND. Invalid max_tokens: INVALID_ARGUMENT.
    let e = client.generate(generate_req("nope", "x", 4)).await.err().context("unknown replica must fail")?;
    assert_eq!(e.code(), tonic::Code::NotFound);
    let e = client.generate(generate_req("smol-1", "x", 0)).await.err().context("max_tokens 0 must fail")?;
    assert_eq!(e.code(), tonic::Code::InvalidArgument);

    // Load reports name the replica; metrics carry vLLM's names.
    head.wait_for(Duration::from_secs(5), |m| match &m.msg {
        Some(worker_message::Msg::Load(l)) => l.reports.iter().find(|r| r.replica_id == "smol-1").map(|_| ()),
        _ => None,
    })
    .await?;
    let (code, metrics) = http_get(&format!("{}/metrics", w.http)).await?;
    assert_eq!(code, 200);
    for line in [
        "vllm:generation_tokens_total{model_name=\"smol\"} 8",
        "vllm:request_success_total{model_name=\"smol\",finished_reason=\"length\"} 1",
        "vllm:num_requests_running{model_name=\"smol\"} 0",
        "vllm:e2e_request_latency_seconds_count{model_name=\"smol\"} 1",
        "vllm:time_to_first_token_seconds_count{model_name=\"smol\"} 1",
        "vllm:inter_token_latency_seconds_count{model_name=\"smol\"} 7",
    ] {
        assert!(metrics.lines().any(|l| l == line), "missing {line:?} in\n{metrics}");
    }
    assert!(metrics.contains("vllm:kv_cache_usage_perc{model_name=\"smol\"}"));
    assert!(metrics.contains("vllm:gpu_cache_usage_perc{model_name=\"smol\"}"));
    assert!(metrics.contains("vllm:num_preemptions_total{model_name=\"smol\"}"));
    assert!(!metrics.contains("_total_total"));

    // gRPC health and WorkerService.Health.
    let h = client.health(pb::WorkerHealthRequest {}).await?.into_inner();
    assert_eq!(h.node_id, "node-a");
    assert!(h.replicas.iter().any(|r| r.replica_id == "smol-1" && r.ready));

    // StopReplica: Stopping → Stopped; then the replica is gone.
    head.send(head_message::Msg::Stop(pb::StopReplica { replica_id: "smol-1".into(), deadline_ms: 1000 })).await?;
    head.wait_for(Duration::from_secs(10), |m| replica_state(m, "smol-1").filter(|s| s.0 == pb::ReplicaState::Stopped))
        .await?;
    let e = client.generate(generate_req("smol-1", "x", 4)).await.err().context("stopped replica must refuse")?;
    assert!(matches!(e.code(), tonic::Code::NotFound | tonic::Code::Unavailable), "{e:?}");

    w.stop(Duration::from_secs(10)).await?;
    head_stop.cancel();
    Ok(())
}

// ------------------------------------------------------------------ TickingEngine

/// Engine test double: emits token `i` every `tick` until `max_tokens`; counts running streams.
struct TickingEngine {
    tick: Duration,
    running: Arc<AtomicU32>,
    alive: AtomicBool,
}

struct RunningGuard(Arc<AtomicU32>);
impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl ReplicaEngine for TickingEngine {
    fn submit(&self, req: EngineRequest) -> Result<ReplicaOutputStream, EngineError> {
        let max = req.params.max_tokens.unwrap_or(16);
        if max < 1 {
            return Err(EngineError::InvalidRequest { field: "max_tokens", message: "max_tokens must be >= 1".into() });
        }
        self.running.fetch_add(1, Ordering::SeqCst);
        let guard = RunningGuard(Arc::clone(&self.running));
        let tick = self.tick;
        let s = futures::stream::unfold((0i64, guard), move |(i, g)| async move {
            if i >= max {
                return None;
            }
            tokio::time::sleep(tick).await;
            let last = i + 1 == max;
            let o = EngineOutput {
                token_ids: vec![i as u32],
                text: format!("t{i} "),
                finish_reason: last.then_some(FinishReason::Length),
                usage: last.then_some(Usage { prompt_tokens: 3, completion_tokens: max as u32, cached_tokens: 0 }),
                prompt_tokens: 3,
                ..Default::default()
            };
            Some((o, (i + 1, g)))
        });
        Ok(s.boxed())
    }
    fn load(&self) -> EngineLoad {
        EngineLoad { running: self.running.load(Ordering::SeqCst), ..Default::default() }
    }
    fn is_alive(&self) -> bool {
        self.alive.load(Ordering::SeqCst)
    }
    fn shutdown(&self) {
        self.alive.store(false, Ordering::SeqCst);
    }
}

struct TickingLauncher;
impl EngineLauncher for TickingLauncher {
    fn launch(&self, _spec: &LaunchSpec) -> Result<Arc<dyn ReplicaEngine>, EngineError> {
        Ok(Arc::new(TickingEngine {
            tick: Duration::from_millis(20),
            running: Arc::new(AtomicU32::new(0)),
            alive: AtomicBool::new(true),
        }))
    }
}

async fn ready_worker(head: &RecordingHead, cfg: WorkerConfig) -> Result<Worker> {
    let w = start_worker(cfg, Some(Arc::new(TickingLauncher))).await?;
    head.wait_for(Duration::from_secs(10), |m| matches!(m.msg, Some(worker_message::Msg::Register(_))).then_some(()))
        .await?;
    head.send(start_cmd("tick-1", "/unused")).await?;
    head.wait_for(Duration::from_secs(10), |m| replica_state(m, "tick-1").filter(|s| s.0 == pb::ReplicaState::Ready))
        .await?;
    Ok(w)
}

async fn collect(mut s: tonic::Streaming<pb::GenerateResponse>) -> (Vec<u32>, Option<Status>) {
    let mut toks = Vec::new();
    loop {
        match s.message().await {
            Ok(Some(m)) => toks.extend(m.token_ids),
            Ok(None) => return (toks, None),
            Err(e) => return (toks, Some(e)),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_drain_finishes_in_flight_and_refuses_new_work() -> Result<()> {
    let head = RecordingHead::default();
    let stop = CancellationToken::new();
    let addr = serve_head(head.clone(), stop.clone()).await?;
    let w = ready_worker(&head, WorkerConfig::for_test(addr, "node-d")).await?;
    let mut client = WorkerServiceClient::connect(w.grpc.clone()).await?;
    // 40 tokens at 20 ms: ~0.8 s, well inside a 10 s drain deadline.
    let s = client.generate(generate_req("tick-1", "p", 40)).await?.into_inner();
    let in_flight = tokio::spawn(collect(s));
    let d = client.drain(pb::WorkerDrainRequest { deadline_ms: 10_000, reason: "test".into() }).await?.into_inner();
    assert_eq!(d.in_flight, 1);
    let e = client.generate(generate_req("tick-1", "p", 4)).await.err().context("draining must refuse")?;
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let (code, _) = http_get(&format!("{}/readyz", w.http)).await?;
    assert_eq!(code, 503, "draining worker is not ready");
    let (toks, err) = in_flight.await?;
    assert!(err.is_none(), "in-flight stream completes: {err:?}");
    assert_eq!(toks, (0..40).collect::<Vec<u32>>());
    head.wait_for(Duration::from_secs(10), |m| match &m.msg {
        Some(worker_message::Msg::Drain(d)) if d.done && d.in_flight == 0 => Some(()),
        _ => None,
    })
    .await?;
    head.wait_for(Duration::from_secs(5), |m| replica_state(m, "tick-1").filter(|s| s.0 == pb::ReplicaState::Draining))
        .await?;
    w.stop(Duration::from_secs(10)).await?;
    stop.cancel();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_drain_deadline_hands_back_unfinished_streams() -> Result<()> {
    let head = RecordingHead::default();
    let stop = CancellationToken::new();
    let addr = serve_head(head.clone(), stop.clone()).await?;
    let w = ready_worker(&head, WorkerConfig::for_test(addr, "node-e")).await?;
    let mut client = WorkerServiceClient::connect(w.grpc.clone()).await?;
    // 1000 tokens at 20 ms = 20 s; the drain deadline is 300 ms.
    let s = client.generate(generate_req("tick-1", "p", 1000)).await?.into_inner();
    let in_flight = tokio::spawn(collect(s));
    let t0 = tokio::time::Instant::now();
    head.send(head_message::Msg::Drain(pb::DrainCommand { deadline_ms: 300, reason: "spot".into() })).await?;
    let (toks, err) = tokio::time::timeout(Duration::from_secs(5), in_flight).await??;
    let err = err.context("the unfinished stream ends with a status")?;
    assert_eq!(err.code(), tonic::Code::Unavailable, "handed back for migration");
    assert!(!toks.is_empty() && toks.len() < 1000);
    assert!(t0.elapsed() < Duration::from_secs(3));
    head.wait_for(Duration::from_secs(5), |m| replica_state(m, "tick-1").filter(|s| s.0 == pb::ReplicaState::Stopped))
        .await?;
    let (_, metrics) = http_get(&format!("{}/metrics", w.http)).await?;
    assert!(!metrics.contains("vllm:num_requests_running{model_name=\"smol\"} 1"));
    w.stop(Duration::from_secs(10)).await?;
    stop.cancel();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_reconnects_to_next_head_and_follows_leader_hint_without_restarting_replicas() -> Result<()> {
    // Head A (leader) and head B; B is first in the list but is a follower of A at first.
    let a = RecordingHead::default();
    let a_stop = CancellationToken::new();
    let a_addr = serve_head(a.clone(), a_stop.clone()).await?;
    let follower = RecordingHead { follower_of: Some(a_addr.clone()), ..Default::default() };
    let f_stop = CancellationToken::new();
    let f_addr = serve_head(follower.clone(), f_stop.clone()).await?;
    let b = RecordingHead::default();
    let b_stop = CancellationToken::new();
    let b_addr = serve_head(b.clone(), b_stop.clone()).await?;
    let mut cfg = WorkerConfig::for_test(f_addr, "node-r");
    cfg.heads.push(b_addr);
    cfg.max_backoff = Duration::from_millis(200);
    let w = ready_worker(&a, cfg).await?;
    assert_eq!(follower.sessions.load(Ordering::SeqCst), 0);

    // A dies: the worker moves on (follower → hint to dead A → B) and re-registers,
    // reporting the running replica as Ready (adopted, not restarted).
    a.close_session();
    a_stop.cancel();
    f_stop.cancel();
    b.wait_for(Duration::from_secs(15), |m| matches!(m.msg, Some(worker_message::Msg::Register(_))).then_some(()))
        .await?;
    b.wait_for(Duration::from_secs(5), |m| replica_state(m, "tick-1").filter(|s| s.0 == pb::ReplicaState::Ready))
        .await?;
    assert!(
        !b.messages().iter().any(|m| replica_state(m, "tick-1").is_some_and(|s| s.0 == pb::ReplicaState::Starting)),
        "the replica was not restarted"
    );
    // A StartReplica for the same id from the new head changes nothing.
    b.send(start_cmd("tick-1", "/unused")).await?;
    let mut client = WorkerServiceClient::connect(w.grpc.clone()).await?;
    let (toks, err) = collect(client.generate(generate_req("tick-1", "p", 5)).await?.into_inner()).await;
    assert!(err.is_none());
    assert_eq!(toks.len(), 5);
    w.stop(Duration::from_secs(10)).await?;
    b_stop.cancel();
    Ok(())
}

// ------------------------------------------------------------------ the binary, SIGTERM

/// Kills the child on drop (a failed assertion must not leave a process behind).
struct ChildGuard(std::process::Child);
impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_process_sigterm_finishes_stream_then_exits_zero() -> Result<()> {
    let model = model_path();
    if !model.exists() {
        eprintln!("skipping: {} not present", model.display());
        return Ok(());
    }
    let head = RecordingHead::default();
    let stop = CancellationToken::new();
    let addr = serve_head(head.clone(), stop.clone()).await?;
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_prism-worker"))
        .args(["--head", &addr, "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0", "--node-id", "proc-1"])
        .args(["--drain-grace", "30", "--drain-margin", "5"])
        .env("RUST_LOG", "warn")
        .spawn()?;
    let mut child = ChildGuard(child);
    let inv = head
        .wait_for(Duration::from_secs(20), |m| match &m.msg {
            Some(worker_message::Msg::Register(i)) => Some(i.clone()),
            _ => None,
        })
        .await?;
    head.send(start_cmd("smol-p", &model.to_string_lossy())).await?;
    head.wait_for(Duration::from_secs(180), |m| replica_state(m, "smol-p").filter(|s| s.0 == pb::ReplicaState::Ready))
        .await?;
    let mut client = WorkerServiceClient::connect(inv.address.clone()).await?;
    let mut s = client.generate(generate_req("smol-p", "Once upon a time", 48)).await?.into_inner();
    // Wait for the first token, then SIGTERM mid-stream: the stream must still complete.
    let first = s.message().await?.context("first message")?;
    let mut n = first.token_ids.len();
    let status = std::process::Command::new("kill").args(["-TERM", &child.0.id().to_string()]).status()?;
    assert!(status.success());
    head.wait_for(Duration::from_secs(10), |m| match &m.msg {
        Some(worker_message::Msg::Drain(d)) if !d.done => Some(()),
        _ => None,
    })
    .await?;
    let e = client.generate(generate_req("smol-p", "x", 4)).await.err().context("terminating worker must refuse")?;
    assert_eq!(e.code(), tonic::Code::Unavailable);
    let mut finish = first.finish_reason;
    while let Some(m) = s.message().await? {
        n += m.token_ids.len();
        finish = m.finish_reason;
    }
    assert_eq!(n, 48, "the in-flight stream completes");
    assert_eq!(finish, pb::FinishReason::Length as i32);
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let code = loop {
        if let Some(st) = child.0.try_wait()? {
            break st.code();
        }
        if std::time::Instant::now() > deadline {
            bail!("worker did not exit after SIGTERM");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(code, Some(0));
    head.wait_for(Duration::from_secs(5), |m| match &m.msg {
        Some(worker_message::Msg::Drain(d)) if d.done => Some(()),
        _ => None,
    })
    .await?;
    stop.cancel();
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn agent_spot_notice_file_starts_drain_before_termination_time() -> Result<()> {
    let head = RecordingHead::default();
    let stop = CancellationToken::new();
    let addr = serve_head(head.clone(), stop.clone()).await?;
    let dir = tempfile::tempdir()?;
    let notice = dir.path().join("spot-notice");
    let mut cfg = WorkerConfig::for_test(addr, "node-s");
    cfg.spot_notice_file = Some(notice.clone());
    let w = ready_worker(&head, cfg).await?;
    let now_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
    // Termination 10 s ahead; the drain deadline keeps the 2 s margin.
    std::fs::write(&notice, (now_s + 10).to_string())?;
    let d = head
        .wait_for(Duration::from_secs(5), |m| match &m.msg {
            Some(worker_message::Msg::Drain(d)) => Some(d.clone()),
            _ => None,
        })
        .await?;
    assert!(d.deadline_unix_ms <= (now_s + 8) * 1000 + 1000, "deadline before termination minus margin: {d:?}");
    assert!(d.reason.contains("spot"));
    // Idle node: the drain finishes long before the termination time.
    head.wait_for(Duration::from_secs(5), |m| match &m.msg {
        Some(worker_message::Msg::Drain(d)) if d.done => Some(()),
        _ => None,
    })
    .await?;
    w.stop(Duration::from_secs(10)).await?;
    stop.cancel();
    Ok(())
}
