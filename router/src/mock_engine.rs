//! The mock engine, `MockEngineWorker`: a fake `WorkerService` that returns tokens
//! instantly, for the router's runtime tests and the router benchmark ONLY (cargo feature
//! `mock-engine`, off in the default build). It runs no model: token `i` of a sequence is id
//! `i` (counting tokens resubmitted in `prior_output_ids`) with text `"t{i} "`, so a migrated
//! stream can be checked for repeated or missing tokens. Like the real worker it reports
//! usage of its own attempt (its prompt count; completion tokens including the resubmitted
//! ones); the router rewrites a migrated stream's counts. Behaviours (delay per token,
//! frozen streams, a frozen process, failing before or after some tokens) are switchable at
//! run time for fault tests. With a prompt codec set ([`MockEngineWorker::with_codec`]) it
//! serves `GetPromptCodec` and a `WatchPrefixCache` stream of the block hashes a test says
//! it holds ([`MockEngineWorker::set_cached`]: one reset per change); without one both are
//! UNIMPLEMENTED, as on an older worker.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker, ready};
use std::time::Duration;

use futures::Stream;
use prism_common::proto::v1 as pb;
use prism_common::proto::v1::worker_service_server::{WorkerService, WorkerServiceServer};
use prism_common::proto::v1::{
    FinishReason, GenerateResponse, TokenLogprob, TopLogprob, Usage, WorkerDrainRequest, WorkerDrainResponse,
    WorkerGenerateRequest, WorkerHealthRequest, WorkerHealthResponse, generate_request,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;
use tonic::{Request, Response, Status};

/// How the mock answers.
#[derive(Debug, Clone, Default)]
pub struct MockBehavior {
    /// Tokens per choice when the request sets no `max_tokens` (then finish_reason `stop`); 0 = 8.
    pub tokens: u32,
    /// Pause before each token.
    pub token_delay: Duration,
    /// Accept streams (response headers sent) but never send a message.
    pub freeze: bool,
    /// The whole process is frozen, as under SIGSTOP: connections are still accepted (the
    /// kernel does that) but no byte is read or written, so no response headers and no
    /// HTTP/2 PING answers. Clearing it thaws every connection.
    pub freeze_process: bool,
    /// Fail every request with UNAVAILABLE before the first token.
    pub fail_before_first: bool,
    /// Fail with UNAVAILABLE after this many tokens of a stream.
    pub fail_after_tokens: Option<u32>,
    /// After this many tokens of a stream, end it with a message of no token whose finish
    /// reason is `abort`, as the engine ends the requests it drops (deadline, shutdown).
    pub abort_after_tokens: Option<u32>,
    /// Refuse, as the engine does, a request whose prompt (words) + `max_tokens` is over this
    /// context length: INVALID_ARGUMENT naming `prompt`.
    pub max_model_len: Option<u32>,
}

/// Counters a test can read.
#[derive(Debug, Default)]
pub struct MockStats {
    /// Generate calls received.
    pub requests: AtomicU64,
    /// Streams open now.
    pub active: AtomicI64,
    /// Streams whose client went away before the end.
    pub cancelled: AtomicU64,
    /// The last request received.
    pub last_request: Mutex<Option<WorkerGenerateRequest>>,
}

/// The mock engine worker (cheap `Clone`; clones share behaviour and stats).
#[derive(Debug, Clone, Default)]
pub struct MockEngineWorker {
    behavior: Arc<Mutex<MockBehavior>>,
    gate: Arc<FreezeGate>,
    /// Shared counters.
    pub stats: Arc<MockStats>,
    /// The prompt codec served by `GetPromptCodec` (`None`: UNIMPLEMENTED).
    codec: Option<pb::PromptCodec>,
    /// The block hashes the mock's "prefix cache" holds (a reset is streamed per change).
    cached: Arc<tokio::sync::watch::Sender<Vec<u64>>>,
}

/// Process-freeze switch shared by every connection of a mock.
#[derive(Debug, Default)]
struct FreezeGate {
    frozen: AtomicBool,
    wakers: Mutex<Vec<Waker>>,
}

impl FreezeGate {
    fn set(&self, frozen: bool) {
        self.frozen.store(frozen, Ordering::SeqCst);
        if !frozen {
            let wakers = self.wakers.lock().map(|mut w| std::mem::take(&mut *w)).unwrap_or_default();
            wakers.into_iter().for_each(Waker::wake);
        }
    }

    /// `Pending` (and a wake-up at thaw) while frozen.
    fn poll_open(&self, cx: &mut Context<'_>) -> Poll<()> {
        if !self.frozen.load(Ordering::SeqCst) {
            return Poll::Ready(());
        }
        if let Ok(mut w) = self.wakers.lock() {
            w.push(cx.waker().clone());
        }
        // Re-check: a thaw between the load and the push must not be missed.
        if self.frozen.load(Ordering::SeqCst) { Poll::Pending } else { Poll::Ready(()) }
    }
}

/// A connection whose IO stalls while the mock's process is "frozen".
struct FreezableIo {
    inner: tokio::net::TcpStream,
    gate: Arc<FreezeGate>,
}

impl Connected for FreezableIo {
    type ConnectInfo = ();
    fn connect_info(&self) -> Self::ConnectInfo {}
}

impl AsyncRead for FreezableIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.gate.poll_open(cx));
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for FreezableIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        ready!(self.gate.poll_open(cx));
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        ready!(self.gate.poll_open(cx));
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

struct ActiveGuard(Arc<MockStats>);
impl Drop for ActiveGuard {
    fn drop(&mut self) {
        self.0.active.fetch_sub(1, Ordering::Relaxed);
    }
}

impl MockEngineWorker {
    /// A mock with the given behaviour.
    pub fn new(behavior: MockBehavior) -> Self {
        let gate = Arc::new(FreezeGate::default());
        gate.set(behavior.freeze_process);
        Self {
            behavior: Arc::new(Mutex::new(behavior)),
            gate,
            stats: Arc::default(),
            codec: None,
            cached: Arc::new(tokio::sync::watch::Sender::new(Vec::new())),
        }
    }

    /// The same mock serving `codec` from `GetPromptCodec` and a prefix-cache stream.
    #[must_use]
    pub fn with_codec(mut self, codec: pb::PromptCodec) -> Self {
        self.codec = Some(codec);
        self
    }

    /// Sets the block hashes the mock reports holding (sent as a reset to every watcher).
    pub fn set_cached(&self, hashes: Vec<u64>) {
        self.cached.send_replace(hashes);
    }

    /// Replaces the behaviour for requests that arrive from now on (`freeze_process` takes
    /// effect at once on every connection).
    pub fn set_behavior(&self, b: MockBehavior) {
        self.gate.set(b.freeze_process);
        if let Ok(mut g) = self.behavior.lock() {
            *g = b;
        }
    }

    /// The service with the message limits of a real worker.
    fn server(self) -> WorkerServiceServer<Self> {
        WorkerServiceServer::new(self)
            .max_decoding_message_size(prism_common::proto::WORKER_MAX_MESSAGE_BYTES)
            .max_encoding_message_size(prism_common::proto::WORKER_MAX_MESSAGE_BYTES)
    }

    fn behavior(&self) -> MockBehavior {
        self.behavior.lock().map(|g| g.clone()).unwrap_or_default()
    }

    /// Serves `WorkerService` on `listener` until `shutdown` (mutual TLS when the process has
    /// an internal identity installed; then `freeze` does not apply).
    ///
    /// # Errors
    /// Transport errors of the gRPC server.
    pub async fn serve(self, listener: tokio::net::TcpListener, shutdown: CancellationToken) -> anyhow::Result<()> {
        if let Some(tls) = prism_common::tls::internal() {
            tonic::transport::Server::builder()
                .add_service(self.server())
                .serve_with_incoming_shutdown(
                    prism_common::tls::server::incoming_with(listener, Some(tls), "mock grpc"),
                    shutdown.cancelled_owned(),
                )
                .await?;
            return Ok(());
        }
        let gate = self.gate.clone();
        let incoming = futures::stream::unfold((listener, gate), |(l, gate)| async move {
            let r = l.accept().await.map(|(tcp, _)| {
                let _ = tcp.set_nodelay(true);
                FreezableIo { inner: tcp, gate: gate.clone() }
            });
            Some((r, (l, gate)))
        });
        tonic::transport::Server::builder()
            .add_service(self.server())
            .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
            .await?;
        Ok(())
    }

    /// Binds 127.0.0.1:0, serves in a background task and returns the address.
    ///
    /// # Errors
    /// When the port cannot be bound.
    pub async fn spawn(self, shutdown: CancellationToken) -> anyhow::Result<SocketAddr> {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        tokio::spawn(self.serve(l, shutdown));
        Ok(addr)
    }
}

fn prompt_len(r: &WorkerGenerateRequest) -> Result<u32, Status> {
    let req = r.request.as_ref().ok_or_else(|| Status::invalid_argument("request is missing"))?;
    let n = match &req.prompt {
        Some(generate_request::Prompt::Text(t)) => t.split_whitespace().count(),
        Some(generate_request::Prompt::TokenIds(t)) => t.ids.len(),
        Some(generate_request::Prompt::Chat(c)) => {
            c.messages.iter().map(|m| m.content.split_whitespace().count() + 3).sum()
        }
        None => 0,
    };
    if n == 0 {
        let mut s = Status::invalid_argument("prompt is empty");
        s.metadata_mut()
            .insert(crate::openai::errors::PARAM_METADATA, tonic::metadata::MetadataValue::from_static("prompt"));
        return Err(s);
    }
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

type GenStream = Pin<Box<dyn Stream<Item = Result<GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl WorkerService for MockEngineWorker {
    type GenerateStream = GenStream;
    type WatchPrefixCacheStream = Pin<Box<dyn Stream<Item = Result<pb::PrefixCacheEvents, Status>> + Send>>;

    /// Without a codec the mock has no tokenizer: routers route it by load alone.
    async fn get_prompt_codec(
        &self,
        _: Request<pb::GetPromptCodecRequest>,
    ) -> Result<Response<pb::PromptCodec>, Status> {
        self.codec.clone().map(Response::new).ok_or_else(|| Status::unimplemented("mock engine: no prompt codec"))
    }

    async fn watch_prefix_cache(
        &self,
        _: Request<pb::WatchPrefixCacheRequest>,
    ) -> Result<Response<Self::WatchPrefixCacheStream>, Status> {
        if self.codec.is_none() {
            return Err(Status::unimplemented("mock engine: no prefix cache"));
        }
        let rx = self.cached.subscribe();
        let stream = futures::stream::unfold((rx, true), |(mut rx, first)| async move {
            if !first && rx.changed().await.is_err() {
                return None;
            }
            let stored = rx.borrow_and_update().clone();
            Some((Ok(pb::PrefixCacheEvents { reset: true, stored, removed: vec![], seq: 0 }), (rx, false)))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn generate(&self, request: Request<WorkerGenerateRequest>) -> Result<Response<GenStream>, Status> {
        let r = request.into_inner();
        self.stats.requests.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut g) = self.stats.last_request.lock() {
            *g = Some(r.clone());
        }
        let b = self.behavior();
        if b.fail_before_first {
            return Err(Status::unavailable("mock engine: failing on purpose"));
        }
        let prompt_tokens = prompt_len(&r)?;
        let req = r.request.clone().unwrap_or_default();
        let sampling = req.sampling.clone().unwrap_or_default();
        if sampling.max_tokens.is_some_and(|m| m < 1) {
            return Err(Status::invalid_argument("max_tokens must be at least 1"));
        }
        let wanted = u64::from(prompt_tokens) + sampling.max_tokens.and_then(|m| u64::try_from(m).ok()).unwrap_or(0);
        if let Some(max) = b.max_model_len
            && wanted > u64::from(max)
        {
            let mut s = Status::invalid_argument(format!(
                "this model's maximum context length is {max} tokens, but {wanted} were requested"
            ));
            s.metadata_mut()
                .insert(crate::openai::errors::PARAM_METADATA, tonic::metadata::MetadataValue::from_static("prompt"));
            return Err(s);
        }
        let prior = u32::try_from(r.prior_output_ids.len()).unwrap_or(u32::MAX);
        let (limit, reason) = match sampling.max_tokens {
            Some(m) => (u32::try_from(m).unwrap_or(u32::MAX), FinishReason::Length),
            None => (if b.tokens == 0 { 8 } else { b.tokens }, FinishReason::Stop),
        };
        let n = sampling.n.unwrap_or(1).max(1);
        let (tx, rx) = mpsc::channel(64);
        self.stats.active.fetch_add(1, Ordering::Relaxed);
        let guard = ActiveGuard(self.stats.clone());
        let stats = self.stats.clone();
        tokio::spawn(async move {
            let _guard = guard;
            if b.freeze {
                tx.closed().await;
                stats.cancelled.fetch_add(1, Ordering::Relaxed);
                return;
            }
            let mut total = 0u32;
            for choice in 0..n {
                let mut emitted = 0u32;
                let mut i = prior;
                while i < limit {
                    if !b.token_delay.is_zero() {
                        tokio::select! {
                            _ = tx.closed() => { stats.cancelled.fetch_add(1, Ordering::Relaxed); return; }
                            _ = tokio::time::sleep(b.token_delay) => {}
                        }
                    }
                    if b.fail_after_tokens.is_some_and(|k| emitted >= k) {
                        let _ = tx.send(Err(Status::unavailable("mock engine: failing mid-stream"))).await;
                        return;
                    }
                    if b.abort_after_tokens.is_some_and(|k| emitted >= k) {
                        let aborted = GenerateResponse {
                            request_id: req.request_id.clone(),
                            index: choice,
                            finish_reason: FinishReason::Abort as i32,
                            ..Default::default()
                        };
                        let _ = tx.send(Ok(aborted)).await;
                        return;
                    }
                    let last_of_choice = i + 1 >= limit;
                    total += 1;
                    let logprobs = sampling.logprobs.map(|k| {
                        vec![TokenLogprob {
                            token_id: i,
                            token: format!("t{i} "),
                            logprob: -0.5,
                            bytes: format!("t{i} ").into_bytes(),
                            top_logprobs: (0..k)
                                .map(|j| TopLogprob {
                                    token_id: i + j,
                                    token: format!("t{} ", i + j),
                                    logprob: -0.5 - j as f32,
                                    bytes: format!("t{} ", i + j).into_bytes(),
                                })
                                .collect(),
                        }]
                    });
                    let msg = GenerateResponse {
                        request_id: req.request_id.clone(),
                        index: choice,
                        token_ids: vec![i],
                        text: format!("t{i} "),
                        logprobs: logprobs.unwrap_or_default(),
                        finish_reason: if last_of_choice { reason as i32 } else { 0 },
                        usage: (last_of_choice && choice + 1 == n).then_some(Usage {
                            prompt_tokens,
                            completion_tokens: total + prior,
                            cached_tokens: 0,
                        }),
                        prompt_tokens: if emitted == 0 { prompt_tokens } else { 0 },
                        ..Default::default()
                    };
                    if tx.send(Ok(msg)).await.is_err() {
                        stats.cancelled.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                    emitted += 1;
                    i += 1;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn drain(&self, _r: Request<WorkerDrainRequest>) -> Result<Response<WorkerDrainResponse>, Status> {
        Ok(Response::new(WorkerDrainResponse { in_flight: 0 }))
    }

    async fn health(&self, _r: Request<WorkerHealthRequest>) -> Result<Response<WorkerHealthResponse>, Status> {
        Ok(Response::new(WorkerHealthResponse { node_id: "mock-engine".into(), draining: false, replicas: vec![] }))
    }
}
