//! One replica hosted by this worker: its engine (behind the small [`ReplicaEngine`] trait so
//! the agent can be tested with a double), its state as reported to the head, and the
//! in-flight accounting that drain and stop wait on (RAII [`InFlightGuard`]).

use futures::stream::BoxStream;
use prism_common::ReplicaId;
use prism_common::proto::v1::{self as pb, ReplicaState};
use prism_engine::{EngineError, EngineOutput, EngineRequest, Fault};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Stream of engine outputs for one request; dropping it aborts the request.
pub type OutputStream = BoxStream<'static, EngineOutput>;

/// Engine load and cumulative counters, read at scrape / report time.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EngineLoad {
    /// Sequences running (scheduled each step).
    pub running: u32,
    /// Sequences waiting for admission.
    pub waiting: u32,
    /// KV-cache blocks in use / total, in [0, 1].
    pub kv_cache_usage: f32,
    /// Preemptions since start.
    pub num_preemptions_total: u64,
}

/// What the agent needs from an engine replica. Implemented for the real
/// `prism_engine::EngineHandle` (see `agent/launcher.rs`) and by test doubles.
pub trait ReplicaEngine: Send + Sync + 'static {
    /// Validates and enqueues a request.
    ///
    /// # Errors
    /// The engine's classification ([`EngineError`]).
    fn submit(&self, req: EngineRequest) -> Result<OutputStream, EngineError>;
    /// Current load.
    fn load(&self) -> EngineLoad;
    /// Whether the engine thread is running and healthy.
    fn is_alive(&self) -> bool;
    /// Aborts everything and stops the engine thread (may block briefly).
    fn shutdown(&self);
    /// Stops a failed engine without blocking (callable from async code): its running step
    /// is interrupted, its streams end without a finish reason and its threads exit, so it
    /// no longer takes CPU from the replica that replaces it. Default: nothing (doubles).
    fn stop(&self) {}
    /// How long the engine has had work without completing a step (`None`: idle, or the
    /// engine cannot tell). Readiness fails past `--engine-stall-timeout`.
    fn stalled_for(&self) -> Option<Duration> {
        None
    }
    /// Effective context length in tokens (prompt + completion), as the engine enforces it
    /// (`ModelInfo::max_model_len`); `None` when unknown (doubles).
    fn max_model_len(&self) -> Option<usize> {
        None
    }
    /// Injects a fault (opt-in, `--enable-fault-injection`).
    ///
    /// # Errors
    /// `Unavailable` when the engine does not support it or has stopped.
    fn inject_fault(&self, fault: Fault) -> Result<(), EngineError> {
        let _ = fault;
        Err(EngineError::Unavailable("this engine does not support fault injection".into()))
    }
}

/// Starts engines (blocking: called from `spawn_blocking`).
pub trait EngineLauncher: Send + Sync + 'static {
    /// Loads the model and starts the engine described by `spec`.
    ///
    /// # Errors
    /// The engine's error, e.g. `Internal` naming a model path that does not exist.
    fn launch(&self, spec: &LaunchSpec) -> Result<Arc<dyn ReplicaEngine>, EngineError>;
}

/// Where a replica's engine runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// CPU backend (CPU-only node or simulated GPUs).
    Cpu,
    /// CUDA backend on these GPU ordinals (rank 0 first).
    Cuda(Vec<u32>),
}

/// Everything needed to start one replica's engine.
#[derive(Clone, Debug)]
pub struct LaunchSpec {
    /// Replica id.
    pub replica_id: ReplicaId,
    /// Engine configuration from the deployment.
    pub engine: pb::EngineConfig,
    /// Backend and devices.
    pub placement: Placement,
    /// KV-cache budget for the CPU backend, bytes (the config's, or the worker default).
    pub kv_cache_bytes: u64,
    /// Threads of the replica's compute pool (`--engine-threads`); `None` = the backend's
    /// default (every core on CPU).
    pub engine_threads: Option<usize>,
}

/// One hosted replica.
pub struct Replica {
    /// Replica id.
    pub id: ReplicaId,
    /// Deployment name.
    pub deployment: String,
    /// Served model name (metric label `model_name`).
    pub model_name: String,
    /// GPU indices (or CPU slots) of the group.
    pub gpu_indices: Vec<u32>,
    state: Mutex<(ReplicaState, String)>,
    engine: OnceLock<Arc<dyn ReplicaEngine>>,
    in_flight: AtomicU32,
    tokens_in_flight: AtomicU64,
    idle: Notify,
    /// Cancelled when the remaining requests must be aborted (stop / drain deadline).
    pub abort: CancellationToken,
    /// When the replica was created on this worker.
    pub created: Instant,
}

/// Why a replica refuses a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// Not loaded yet, failed, or stopped.
    NotReady(ReplicaState),
    /// Draining or stopping: no new work.
    Draining,
}

impl Replica {
    /// A replica in state Starting.
    pub fn new(id: ReplicaId, deployment: String, model_name: String, gpu_indices: Vec<u32>) -> Self {
        Self {
            id,
            deployment,
            model_name,
            gpu_indices,
            state: Mutex::new((ReplicaState::Starting, String::new())),
            engine: OnceLock::new(),
            in_flight: AtomicU32::new(0),
            tokens_in_flight: AtomicU64::new(0),
            idle: Notify::new(),
            abort: CancellationToken::new(),
            created: Instant::now(),
        }
    }

    /// Current state and reason.
    pub fn state(&self) -> (ReplicaState, String) {
        self.state.lock().map(|s| s.clone()).unwrap_or((ReplicaState::Failed, "state lock poisoned".into()))
    }

    /// Sets the state; returns whether it changed.
    pub fn set_state(&self, state: ReplicaState, reason: impl Into<String>) -> bool {
        let reason = reason.into();
        match self.state.lock() {
            Ok(mut s) => {
                let changed = s.0 != state || s.1 != reason;
                *s = (state, reason);
                changed
            }
            Err(_) => false,
        }
    }

    /// Installs the loaded engine (once).
    pub fn set_engine(&self, engine: Arc<dyn ReplicaEngine>) {
        let _ = self.engine.set(engine);
    }

    /// The engine, once loaded.
    pub fn engine(&self) -> Option<&Arc<dyn ReplicaEngine>> {
        self.engine.get()
    }

    /// Admits one request: only a Ready replica with an engine takes new work.
    ///
    /// # Errors
    /// [`Refusal`] saying why not.
    pub fn admit(self: &Arc<Self>) -> Result<(InFlightGuard, Arc<dyn ReplicaEngine>), Refusal> {
        let (state, _) = self.state();
        match state {
            ReplicaState::Ready => {}
            ReplicaState::Draining | ReplicaState::Stopping => return Err(Refusal::Draining),
            other => return Err(Refusal::NotReady(other)),
        }
        let engine = self.engine.get().cloned().ok_or(Refusal::NotReady(ReplicaState::Starting))?;
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Ok((InFlightGuard { replica: Arc::clone(self), tokens: 0 }, engine))
    }

    /// Requests in flight.
    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Prompt + generated tokens of the requests in flight.
    pub fn tokens_in_flight(&self) -> u64 {
        self.tokens_in_flight.load(Ordering::SeqCst)
    }

    /// Waits until no request is in flight.
    pub async fn wait_idle(&self) {
        loop {
            let notified = self.idle.notified();
            if self.in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Load report for the head (None until the engine is loaded).
    pub fn load_report(&self) -> Option<pb::LoadReport> {
        let load = self.engine.get()?.load();
        Some(pb::LoadReport {
            replica_id: self.id.0.clone(),
            running: load.running,
            waiting: load.waiting,
            kv_cache_usage: load.kv_cache_usage,
            tokens_in_flight: self.tokens_in_flight(),
        })
    }

    /// Status entry for the head, with the engine's effective `max_model_len` once loaded.
    pub fn status(&self) -> pb::ReplicaStatus {
        let (state, reason) = self.state();
        let max_model_len =
            self.engine.get().and_then(|e| e.max_model_len()).map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX));
        pb::ReplicaStatus {
            replica_id: self.id.0.clone(),
            deployment: self.deployment.clone(),
            state: state as i32,
            reason,
            gpu_indices: self.gpu_indices.clone(),
            max_model_len,
        }
    }
}

/// Counts one request in flight on a replica until dropped.
pub struct InFlightGuard {
    replica: Arc<Replica>,
    tokens: u64,
}

impl InFlightGuard {
    /// Adds tokens (prompt or generated) to the replica's tokens-in-flight.
    pub fn add_tokens(&mut self, n: u64) {
        self.tokens += n;
        self.replica.tokens_in_flight.fetch_add(n, Ordering::SeqCst);
    }

    /// The replica this request runs on.
    pub fn replica(&self) -> &Arc<Replica> {
        &self.replica
    }
}

impl Drop for InFlightGuard {
    fn drop(&mut self) {
        self.replica.tokens_in_flight.fetch_sub(self.tokens, Ordering::SeqCst);
        if self.replica.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.replica.idle.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine double that accepts nothing; `Idle(Some(n))` enforces an `n`-token context.
    struct Idle(Option<usize>);
    impl ReplicaEngine for Idle {
        fn submit(&self, _req: EngineRequest) -> Result<OutputStream, EngineError> {
            Err(EngineError::Unavailable("test double".into()))
        }
        fn load(&self) -> EngineLoad {
            EngineLoad::default()
        }
        fn is_alive(&self) -> bool {
            true
        }
        fn shutdown(&self) {}
        fn max_model_len(&self) -> Option<usize> {
            self.0
        }
    }

    #[tokio::test]
    async fn admits_only_when_ready_and_counts_in_flight() {
        let r = Arc::new(Replica::new("r1".into(), "d".into(), "m".into(), vec![0]));
        assert_eq!(r.admit().err(), Some(Refusal::NotReady(ReplicaState::Starting)));
        r.set_engine(Arc::new(Idle(None)));
        r.set_state(ReplicaState::Ready, "");
        let (mut g, _) = r.admit().map_err(|e| anyhow_like(e)).expect("ready replica admits");
        g.add_tokens(7);
        assert_eq!((r.in_flight(), r.tokens_in_flight()), (1, 7));
        r.set_state(ReplicaState::Draining, "drain");
        assert_eq!(r.admit().err(), Some(Refusal::Draining));
        let waiter = {
            let r = Arc::clone(&r);
            tokio::spawn(async move { r.wait_idle().await })
        };
        drop(g);
        tokio::time::timeout(std::time::Duration::from_secs(2), waiter).await.expect("idle within 2 s").expect("join");
        assert_eq!((r.in_flight(), r.tokens_in_flight()), (0, 0));
    }

    /// The status sent to the head carries the engine's effective context length once it is
    /// loaded (0 before, and for engines that cannot tell).
    #[test]
    fn status_reports_the_engines_max_model_len_once_loaded() {
        let r = Replica::new("r1".into(), "d".into(), "m".into(), vec![0]);
        assert_eq!(r.status().max_model_len, 0);
        r.set_engine(Arc::new(Idle(Some(1456))));
        r.set_state(ReplicaState::Ready, "");
        let s = r.status();
        assert_eq!((s.state(), s.max_model_len), (ReplicaState::Ready, 1456));
        let unknown = Replica::new("r2".into(), "d".into(), "m".into(), vec![0]);
        unknown.set_engine(Arc::new(Idle(None)));
        assert_eq!(unknown.status().max_model_len, 0);
    }

    fn anyhow_like(e: Refusal) -> String {
        format!("{e:?}")
    }
}
