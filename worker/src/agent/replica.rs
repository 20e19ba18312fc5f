//! One replica hosted by this worker: its engine (behind the small [`ReplicaEngine`] trait so
//! the agent can be tested with a double), its state as reported to the head, and the
//! in-flight accounting that drain and stop wait on (RAII [`ReplicaLoadGuard`]).
//!
//! [`ReplicaTable`] holds the hosted replicas and is the one place a replica's state changes:
//! [`ReplicaTable::transition`] validates the change against the replica lifecycle
//! ([`transition_allowed`]), logs it and bumps the change feed the head session watches.

use futures::stream::BoxStream;
use prism_common::ReplicaId;
use prism_common::proto::v1::{self as pb, ReplicaState};
use prism_engine::codec::CodecExport;
use prism_engine::kv_cache::CacheEvents;
use prism_engine::{EngineError, EngineOutput, EngineRequest, Fault, ModelInfo};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

/// Stream of engine outputs for one request on a hosted replica; dropping it aborts the
/// request.
pub type ReplicaOutputStream = BoxStream<'static, EngineOutput>;

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
    /// The scheduler's batch limit (`max_num_seqs`; 0 = unknown).
    pub max_num_seqs: u32,
    /// KV-cache blocks free now.
    pub free_kv_blocks: u32,
    /// KV-cache blocks in the pool (0 = unknown).
    pub total_kv_blocks: u32,
    /// Tokens per KV-cache block (0 = unknown).
    pub block_size: u32,
    /// Prefix cache: prompt tokens looked up since start (vLLM's `prefix_cache_queries`).
    pub prefix_cache_queries_total: u64,
    /// Of those, tokens found cached (vLLM's `prefix_cache_hits`).
    pub prefix_cache_hits_total: u64,
    /// Prompt tokens run through the model in prefill since start (cache hits excluded,
    /// recomputation after preemption included).
    pub prompt_tokens_computed_total: u64,
}

/// What the agent needs from an engine replica. Implemented for the real
/// `prism_engine::EngineHandle` (see `agent/launcher.rs`) and by test doubles.
pub trait ReplicaEngine: Send + Sync + 'static {
    /// Validates and enqueues a request.
    ///
    /// # Errors
    /// The engine's classification ([`EngineError`]).
    fn submit(&self, req: EngineRequest) -> Result<ReplicaOutputStream, EngineError>;
    /// Current load.
    fn load(&self) -> EngineLoad;
    /// Whether the engine thread is running and healthy.
    fn is_alive(&self) -> bool;
    /// Why the engine thread died after a failed step (its error), once it has.
    fn failure(&self) -> Option<String> {
        None
    }
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
    /// The served model's facts (block size, prefix caching, cache namespace, ...); `None`
    /// when unknown (doubles).
    fn model_info(&self) -> Option<ModelInfo> {
        None
    }
    /// The encoding half of the model's codec, for routers (`GetPromptCodec`); `None` when it
    /// cannot be exported.
    fn codec_export(&self) -> Option<CodecExport> {
        None
    }
    /// Changes to the prefix cache's block hashes after sequence number `after` (0 = a
    /// snapshot), as `EngineHandle::prefix_cache_events`. Default: nothing cached (doubles).
    fn prefix_cache_events(&self, after: u64) -> CacheEvents {
        let _ = after;
        CacheEvents::default()
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
    /// The engine's error, e.g. `InvalidRequest` (`engine.model`) naming a model path that does not exist.
    fn launch(&self, spec: &LaunchSpec) -> Result<Arc<dyn ReplicaEngine>, EngineError>;
}

/// Where a replica's engine runs on this node (the head's placement chose the node and the
/// GPU indices; this is the backend and device ordinals the engine is started with).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DevicePlacement {
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
    pub placement: DevicePlacement,
    /// KV-cache budget for the CPU backend, bytes (the config's, or the worker default).
    pub kv_cache_bytes: u64,
    /// Threads of the replica's compute pool (`--engine-threads`); `None` = the backend's
    /// default (every core on CPU). A parallel CPU replica's engine splits them among this
    /// node's ranks.
    pub engine_threads: Option<usize>,
    /// The rank group (one rank, in-process, by default).
    pub parallel: ParallelLaunch,
}

/// The rank group of a replica whose driver runs here.
#[derive(Clone, Debug)]
pub struct ParallelLaunch {
    /// Tensor- and pipeline-parallel sizes.
    pub sizes: prism_engine::parallel::ParallelSizes,
    /// Global ranks on this node, rank 0 first (their devices: the placement's, in order).
    pub local_ranks: Vec<usize>,
    /// The rendezvous bound for ranks of other nodes (`None`: every rank is here).
    pub rendezvous: Option<Arc<prism_engine::parallel::rank::Rendezvous>>,
    /// Bound of every collective (`--collective-timeout`).
    pub collective_timeout: Duration,
    /// Time the ranks have to join and load (`--join-timeout`).
    pub join_timeout: Duration,
    /// The program of the local ranks other than 0 (`None`: this executable).
    pub rank_program: Option<prism_engine::parallel::spawn::RankProgram>,
}

impl Default for ParallelLaunch {
    fn default() -> Self {
        let d = prism_engine::parallel::ParallelConfig::default();
        Self {
            sizes: d.sizes,
            local_ranks: d.local_ranks,
            rendezvous: None,
            collective_timeout: d.collective_timeout,
            join_timeout: d.join_timeout,
            rank_program: None,
        }
    }
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
    /// Built once from the loaded engine (`None` inside: the codec cannot be exported).
    prompt_codec: OnceLock<Option<Arc<pb::PromptCodec>>>,
    in_flight: AtomicU32,
    tokens_in_flight: AtomicU64,
    idle: Notify,
    /// Cancelled when the remaining requests must be aborted (stop / drain deadline).
    pub abort: CancellationToken,
    /// When the replica was created on this worker.
    pub created: Instant,
    /// This entry holds ranks of a group whose driver runs on another node (no engine here).
    member: bool,
    /// The driver's rendezvous (`host:port`) once bound, for the head to pass on.
    rendezvous: OnceLock<String>,
    /// A member entry's rank processes.
    ranks: super::group::MemberRanks,
    /// Set once [`Replica::finish`] shuts the engine down on purpose (a stop, the end of a
    /// drain): a dead engine then is no failure.
    finishing: AtomicBool,
}

/// Why a replica has no prompt codec to give.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CodecRefusal {
    /// The engine is not loaded yet.
    NotLoaded,
    /// The engine cannot export its tokenizer / chat template (or does not say its block size).
    NotExportable,
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
            prompt_codec: OnceLock::new(),
            in_flight: AtomicU32::new(0),
            tokens_in_flight: AtomicU64::new(0),
            idle: Notify::new(),
            abort: CancellationToken::new(),
            created: Instant::now(),
            member: false,
            rendezvous: OnceLock::new(),
            ranks: super::group::MemberRanks::default(),
            finishing: AtomicBool::new(false),
        }
    }

    /// A member entry in state Starting: ranks of a group whose driver runs on another node.
    pub fn new_member(id: ReplicaId, deployment: String, model_name: String, gpu_indices: Vec<u32>) -> Self {
        Self { member: true, ..Self::new(id, deployment, model_name, gpu_indices) }
    }

    /// Whether this entry only hosts member ranks (no engine, no requests).
    pub fn is_group_member(&self) -> bool {
        self.member
    }

    /// Records the driver's rendezvous address (reported in the status from now on).
    pub fn set_rendezvous(&self, address: String) {
        let _ = self.rendezvous.set(address);
    }

    /// A member entry's rank processes.
    pub fn member_ranks(&self) -> &super::group::MemberRanks {
        &self.ranks
    }

    /// Current state and reason.
    pub fn state(&self) -> (ReplicaState, String) {
        self.state.lock().map(|s| s.clone()).unwrap_or((ReplicaState::Failed, "state lock poisoned".into()))
    }

    /// Installs the loaded engine (once).
    pub fn set_engine(&self, engine: Arc<dyn ReplicaEngine>) {
        let _ = self.engine.set(engine);
    }

    /// The engine, once loaded.
    pub fn engine(&self) -> Option<&Arc<dyn ReplicaEngine>> {
        self.engine.get()
    }

    /// The replica's prompt codec for routers (`GetPromptCodec`), built on first use from the
    /// loaded engine and kept: the JSON of [`CodecExport`], its fingerprint, and the engine's
    /// block size, cache namespace and whether prefix caching is on. The first call
    /// serializes the tokenizer (milliseconds, blocking): call it from `spawn_blocking`
    /// unless [`Replica::cached_prompt_codec`] already has it.
    ///
    /// # Errors
    /// [`CodecRefusal`]: not loaded yet, or nothing to export.
    pub fn prompt_codec(&self) -> Result<Arc<pb::PromptCodec>, CodecRefusal> {
        let engine = self.engine.get().ok_or(CodecRefusal::NotLoaded)?;
        let built = self.prompt_codec.get_or_init(|| {
            let info = engine.model_info()?;
            let export = engine.codec_export()?;
            let json = match export.to_json() {
                Ok(j) => j,
                Err(e) => {
                    tracing::warn!(replica = %self.id, error = %e, "prompt codec does not serialize");
                    return None;
                }
            };
            Some(Arc::new(pb::PromptCodec {
                replica_id: self.id.0.clone(),
                fingerprint: export.fingerprint(),
                codec_json: json,
                block_size: u32::try_from(info.block_size).unwrap_or(0),
                cache_namespace: info.cache_namespace,
                prefix_caching: info.prefix_caching,
            }))
        });
        built.clone().ok_or(CodecRefusal::NotExportable)
    }

    /// The prompt codec if [`Replica::prompt_codec`] already built it (`Some(None)`: it
    /// cannot be exported; `None`: not built yet).
    pub fn cached_prompt_codec(&self) -> Option<Option<Arc<pb::PromptCodec>>> {
        self.prompt_codec.get().cloned()
    }

    /// Admits one request: only a Ready replica with an engine takes new work.
    ///
    /// # Errors
    /// [`Refusal`] saying why not.
    pub fn admit(self: &Arc<Self>) -> Result<(ReplicaLoadGuard, Arc<dyn ReplicaEngine>), Refusal> {
        let (state, _) = self.state();
        match state {
            ReplicaState::Ready => {}
            ReplicaState::Draining | ReplicaState::Stopping => return Err(Refusal::Draining),
            other => return Err(Refusal::NotReady(other)),
        }
        let engine = self.engine.get().cloned().ok_or(Refusal::NotReady(ReplicaState::Starting))?;
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        Ok((ReplicaLoadGuard { replica: Arc::clone(self), tokens: 0 }, engine))
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

    /// Waits until idle or `deadline`, then hands the rest back (aborts them: their streams end
    /// UNAVAILABLE, so routers migrate them) and shuts the engine down. Used by `StopReplica`
    /// and at the end of a node drain.
    pub async fn finish(&self, deadline: Instant) {
        let idle = tokio::time::timeout_at(deadline.into(), self.wait_idle()).await.is_ok();
        if !idle {
            tracing::info!(replica = %self.id, in_flight = self.in_flight(), "deadline passed: aborting remaining requests");
            self.abort.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(5), self.wait_idle()).await;
        }
        self.finishing.store(true, Ordering::Release);
        if let Some(engine) = self.engine().cloned() {
            let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
        }
        let killed = self.ranks.kill_all();
        if killed > 0 {
            tracing::info!(replica = %self.id, ranks = killed, "member ranks killed");
        }
    }

    /// Whether [`Replica::finish`] has begun shutting the engine down on purpose.
    pub fn is_finishing(&self) -> bool {
        self.finishing.load(Ordering::Acquire)
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
            max_num_seqs: load.max_num_seqs,
            free_kv_blocks: load.free_kv_blocks,
            total_kv_blocks: load.total_kv_blocks,
            block_size: load.block_size,
            prefix_cache_queries: load.prefix_cache_queries_total,
            prefix_cache_hits: load.prefix_cache_hits_total,
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
            rendezvous: self.rendezvous.get().cloned().unwrap_or_default(),
            group_member: self.member,
        }
    }
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica").field("id", &self.id).field("state", &self.state()).finish()
    }
}

/// Counts one request (and its tokens) in flight on a replica until dropped: the load that
/// load reports, drain and stop see.
pub struct ReplicaLoadGuard {
    replica: Arc<Replica>,
    tokens: u64,
}

impl ReplicaLoadGuard {
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

impl Drop for ReplicaLoadGuard {
    fn drop(&mut self) {
        self.replica.tokens_in_flight.fetch_sub(self.tokens, Ordering::SeqCst);
        if self.replica.in_flight.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.replica.idle.notify_waiters();
        }
    }
}

/// Whether a replica may go from `from` to `to` (the same state: a new reason only).
///
/// The lifecycle: Starting → Ready (engine loaded) or Failed (load error, node draining, no
/// such device); Starting / Ready → Draining (node drain: no new work); Starting / Ready /
/// Draining → Failed (engine dead or stalled); any state but Stopped → Stopping (`StopReplica`,
/// failed replicas included, so the head can clean them up) and → Stopped (stop finished, or
/// the end of a drain). Stopped is final: the replica is forgotten once the head heard it.
pub fn transition_allowed(from: ReplicaState, to: ReplicaState) -> bool {
    use ReplicaState as S;
    match (from, to) {
        (S::Stopped, _) => false,
        (S::Starting, S::Ready) => true,
        (S::Starting | S::Ready, S::Draining) => true,
        (S::Starting | S::Ready | S::Draining, S::Failed) => true,
        (S::Starting | S::Ready | S::Draining | S::Failed, S::Stopping) => true,
        (_, S::Stopped) => true,
        (from, to) => from == to,
    }
}

/// The replicas hosted here (a cheap `Clone` handle, shared with the metrics collector and the
/// drain), with the feed of replica changes the head session turns into status messages.
#[derive(Clone, Debug)]
pub struct ReplicaTable {
    replicas: Arc<RwLock<HashMap<ReplicaId, Arc<Replica>>>>,
    /// Bumped on every replica change (the registration stream sends a status).
    changes: Arc<watch::Sender<u64>>,
}

impl Default for ReplicaTable {
    fn default() -> Self {
        Self { replicas: Arc::default(), changes: Arc::new(watch::channel(0).0) }
    }
}

impl ReplicaTable {
    /// Every replica (snapshot).
    pub fn all(&self) -> Vec<Arc<Replica>> {
        self.replicas.read().map(|m| m.values().cloned().collect()).unwrap_or_default()
    }

    /// One replica.
    pub fn get(&self, id: &str) -> Option<Arc<Replica>> {
        self.replicas.read().ok()?.get(&ReplicaId::from(id)).cloned()
    }

    /// Inserts unless present (the head hears of the new replica); returns false when the id
    /// already exists.
    pub fn insert_new(&self, r: Arc<Replica>) -> bool {
        let Ok(mut m) = self.replicas.write() else { return false };
        if m.contains_key(&r.id) {
            return false;
        }
        m.insert(r.id.clone(), r);
        drop(m);
        self.notify();
        true
    }

    /// Forgets the replicas in state Stopped (after the head was told).
    pub fn remove_stopped(&self) {
        if let Ok(mut m) = self.replicas.write() {
            m.retain(|_, r| r.state().0 != ReplicaState::Stopped);
        }
    }

    /// Requests in flight on every replica.
    pub fn in_flight(&self) -> u32 {
        self.all().iter().map(|r| r.in_flight()).sum()
    }

    /// Member entries whose ranks still run (not failed, stopping or stopped).
    pub fn live_members(&self) -> usize {
        self.all()
            .iter()
            .filter(|r| r.is_group_member() && matches!(r.state().0, ReplicaState::Starting | ReplicaState::Ready))
            .count()
    }

    /// Subscribes to replica changes (a counter; each bump means "send a status").
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Tells the head session to send a status although no state changed (a new replica, or
    /// a start for a replica already hosted, which a new head needs to hear about).
    pub fn notify(&self) {
        self.changes.send_modify(|v| *v += 1);
    }

    /// Moves `r` to state `to` with `reason`: the one place a replica's state changes. A change
    /// the lifecycle does not allow ([`transition_allowed`]) is refused and logged at debug
    /// (they are races the caller loses, e.g. a stop finishing after a drain stopped the
    /// replica); an accepted change is logged and the head session hears about it. Returns
    /// whether the state or reason changed.
    pub fn transition(&self, r: &Replica, to: ReplicaState, reason: impl Into<String>) -> bool {
        let reason = reason.into();
        let Ok(mut state) = r.state.lock() else { return false };
        let from = state.0;
        if from == to && state.1 == reason {
            return false;
        }
        if !transition_allowed(from, to) {
            tracing::debug!(
                replica = %r.id, from = from.as_str_name(), to = to.as_str_name(), %reason, "replica state change refused"
            );
            return false;
        }
        tracing::info!(replica = %r.id, from = from.as_str_name(), to = to.as_str_name(), %reason, "replica state");
        *state = (to, reason);
        drop(state);
        self.notify();
        true
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An engine double that accepts nothing; `Idle(Some(n))` enforces an `n`-token context.
    pub(crate) struct Idle(pub(crate) Option<usize>);
    impl ReplicaEngine for Idle {
        fn submit(&self, _req: EngineRequest) -> Result<ReplicaOutputStream, EngineError> {
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

    /// An engine that is dead once shut down, as a real one is.
    struct DiesOnShutdown(std::sync::atomic::AtomicBool);
    impl ReplicaEngine for DiesOnShutdown {
        fn submit(&self, _req: EngineRequest) -> Result<ReplicaOutputStream, EngineError> {
            Err(EngineError::Unavailable("test double".into()))
        }
        fn load(&self) -> EngineLoad {
            EngineLoad::default()
        }
        fn is_alive(&self) -> bool {
            !self.0.load(Ordering::Acquire)
        }
        fn shutdown(&self) {
            self.0.store(true, Ordering::Release);
        }
        fn max_model_len(&self) -> Option<usize> {
            None
        }
    }

    #[tokio::test]
    async fn a_finished_replica_says_its_engine_was_stopped_on_purpose() {
        let table = ReplicaTable::default();
        let r = Arc::new(Replica::new("r1".into(), "d".into(), "m".into(), vec![0]));
        r.set_engine(Arc::new(DiesOnShutdown(std::sync::atomic::AtomicBool::new(false))));
        assert!(table.transition(&r, ReplicaState::Ready, ""));
        assert!(table.transition(&r, ReplicaState::Draining, "drain"));
        assert!(!r.is_finishing());
        r.finish(Instant::now()).await;
        // Still Draining until the drain reports it Stopped; the health check must not read
        // the engine it stopped as a dead one.
        assert_eq!(r.state().0, ReplicaState::Draining);
        assert!(r.is_finishing() && !r.engine().is_some_and(|e| e.is_alive()));
    }

    #[tokio::test]
    async fn admits_only_when_ready_and_counts_in_flight() {
        let table = ReplicaTable::default();
        let r = Arc::new(Replica::new("r1".into(), "d".into(), "m".into(), vec![0]));
        assert_eq!(r.admit().err(), Some(Refusal::NotReady(ReplicaState::Starting)));
        r.set_engine(Arc::new(Idle(None)));
        table.transition(&r, ReplicaState::Ready, "");
        let (mut g, _) = r.admit().map_err(anyhow_like).expect("ready replica admits");
        g.add_tokens(7);
        assert_eq!((r.in_flight(), r.tokens_in_flight()), (1, 7));
        table.transition(&r, ReplicaState::Draining, "drain");
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
        let table = ReplicaTable::default();
        let r = Replica::new("r1".into(), "d".into(), "m".into(), vec![0]);
        assert_eq!(r.status().max_model_len, 0);
        r.set_engine(Arc::new(Idle(Some(1456))));
        table.transition(&r, ReplicaState::Ready, "");
        let s = r.status();
        assert_eq!((s.state(), s.max_model_len), (ReplicaState::Ready, 1456));
        let unknown = Replica::new("r2".into(), "d".into(), "m".into(), vec![0]);
        unknown.set_engine(Arc::new(Idle(None)));
        assert_eq!(unknown.status().max_model_len, 0);
    }

    /// No codec before the engine is loaded, none from an engine that cannot export one.
    #[test]
    fn prompt_codec_needs_a_loaded_exporting_engine() {
        let r = Replica::new("r1".into(), "d".into(), "m".into(), vec![0]);
        assert_eq!(r.prompt_codec().err(), Some(CodecRefusal::NotLoaded));
        assert!(r.cached_prompt_codec().is_none());
        r.set_engine(Arc::new(Idle(None)));
        assert_eq!(r.prompt_codec().err(), Some(CodecRefusal::NotExportable));
        assert_eq!(r.cached_prompt_codec(), Some(None), "the refusal is kept, not recomputed");
    }

    /// Every state change goes through the table: allowed ones are applied and reach the head
    /// session's feed, refused ones (out of Stopped, back to Ready) leave state and feed alone.
    #[test]
    fn transitions_follow_the_lifecycle_and_notify_the_head_session() {
        let table = ReplicaTable::default();
        let mut feed = table.subscribe();
        let r = Arc::new(Replica::new("r1".into(), "d".into(), "m".into(), vec![0]));
        assert!(table.insert_new(Arc::clone(&r)), "new id is inserted");
        assert!(feed.has_changed().unwrap_or(false), "a new replica is a change");
        feed.borrow_and_update();
        assert!(!table.insert_new(Arc::new(Replica::new("r1".into(), "d".into(), "m".into(), vec![0]))));

        assert!(table.transition(&r, ReplicaState::Ready, ""));
        assert!(feed.has_changed().unwrap_or(false));
        feed.borrow_and_update();
        assert!(!table.transition(&r, ReplicaState::Ready, ""), "same state and reason: no change");
        assert!(!feed.has_changed().unwrap_or(true));
        assert!(table.transition(&r, ReplicaState::Draining, "drain"));
        assert!(!table.transition(&r, ReplicaState::Ready, "back"), "a draining replica never takes work again");
        assert_eq!(r.state(), (ReplicaState::Draining, "drain".to_owned()));
        assert!(table.transition(&r, ReplicaState::Stopping, "stop requested"));
        assert!(table.transition(&r, ReplicaState::Stopped, "stopped"));
        feed.borrow_and_update();
        assert!(!table.transition(&r, ReplicaState::Stopped, "drained"), "Stopped is final");
        assert!(!table.transition(&r, ReplicaState::Failed, "late"), "Stopped is final");
        assert_eq!(r.state(), (ReplicaState::Stopped, "stopped".to_owned()));
        assert!(!feed.has_changed().unwrap_or(true), "refused changes are not reported");
        table.remove_stopped();
        assert!(table.get("r1").is_none(), "stopped replicas are forgotten");
    }

    #[test]
    fn lifecycle_table() {
        use ReplicaState as S;
        for (from, to) in [
            (S::Starting, S::Ready),
            (S::Starting, S::Failed),
            (S::Starting, S::Draining),
            (S::Ready, S::Draining),
            (S::Ready, S::Failed),
            (S::Draining, S::Failed),
            (S::Failed, S::Stopping),
            (S::Ready, S::Stopping),
            (S::Stopping, S::Stopped),
            (S::Draining, S::Stopped),
            (S::Failed, S::Failed),
        ] {
            assert!(transition_allowed(from, to), "{from:?} -> {to:?} must be allowed");
        }
        for (from, to) in [
            (S::Ready, S::Starting),
            (S::Draining, S::Ready),
            (S::Failed, S::Ready),
            (S::Stopping, S::Ready),
            (S::Stopping, S::Failed),
            (S::Stopping, S::Draining),
            (S::Stopped, S::Stopped),
            (S::Stopped, S::Stopping),
        ] {
            assert!(!transition_allowed(from, to), "{from:?} -> {to:?} must be refused");
        }
    }

    fn anyhow_like(e: Refusal) -> String {
        format!("{e:?}")
    }
}
