//! The node agent: owns the hosted replicas, executes the head's commands (start / stop
//! replica, drain) and tracks what the head must hear about (status changes, drain
//! progress). Reached through a cheap `Arc<Agent>` by the registration stream, the gRPC
//! service and the HTTP endpoints.
//!
//! Submodules: [`registration`] (the `WorkerSession` stream to the head), [`gpu`] (device
//! discovery), [`replica`] (one replica and its engine), [`launcher`] (the real engine
//! behind [`replica::EngineLauncher`]), [`spot`] (spot-termination notice watcher).

pub mod gpu;
pub mod launcher;
pub mod registration;
pub mod replica;
pub mod spot;

use crate::config::WorkerConfig;
use prism_common::proto::v1::{self as pb, ReplicaState};
use prism_common::{NodeId, ReplicaId};
use replica::{EngineLauncher, LaunchSpec, Placement, Replica};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::watch;

/// The replicas hosted here, shared with the metrics collector.
#[derive(Clone, Debug, Default)]
pub struct ReplicaMap(Arc<RwLock<HashMap<ReplicaId, Arc<Replica>>>>);

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica").field("id", &self.id).field("state", &self.state()).finish()
    }
}

impl ReplicaMap {
    /// Every replica (snapshot).
    pub fn all(&self) -> Vec<Arc<Replica>> {
        self.0.read().map(|m| m.values().cloned().collect()).unwrap_or_default()
    }

    /// One replica.
    pub fn get(&self, id: &str) -> Option<Arc<Replica>> {
        self.0.read().ok()?.get(&ReplicaId::from(id)).cloned()
    }

    /// Inserts unless present; returns false when the id already exists.
    fn insert_new(&self, r: Arc<Replica>) -> bool {
        let Ok(mut m) = self.0.write() else { return false };
        if m.contains_key(&r.id) {
            return false;
        }
        m.insert(r.id.clone(), r);
        true
    }

    fn remove_stopped(&self) {
        if let Ok(mut m) = self.0.write() {
            m.retain(|_, r| r.state().0 != ReplicaState::Stopped);
        }
    }
}

/// Who asked for a drain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DrainSource {
    /// The head's DrainCommand (replicas are stopped at the end, the process keeps running).
    Head,
    /// SIGTERM / shutdown token (the process exits at the end).
    Terminate,
    /// Spot-termination notice (the process keeps serving nothing until SIGTERM).
    SpotNotice,
    /// `WorkerService.Drain`.
    Rpc,
}

/// Node drain progress, as sent to the head.
#[derive(Clone, Debug, PartialEq)]
pub struct DrainState {
    /// Requests in flight on this node.
    pub in_flight: u32,
    /// Deadline (unix ms).
    pub deadline_unix_ms: u64,
    /// Finished (idle or deadline passed, remaining requests handed back).
    pub done: bool,
    /// Why.
    pub reason: String,
}

impl DrainState {
    /// Proto form.
    pub fn to_proto(&self) -> pb::DrainProgress {
        pb::DrainProgress {
            in_flight: self.in_flight,
            deadline_unix_ms: self.deadline_unix_ms,
            done: self.done,
            reason: self.reason.clone(),
        }
    }
}

/// Milliseconds since the unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

/// The node agent.
pub struct Agent {
    /// Validated configuration.
    pub cfg: WorkerConfig,
    /// Devices offered.
    pub devices: gpu::Devices,
    /// Endpoint routers dial.
    pub address: String,
    replicas: ReplicaMap,
    launcher: Arc<dyn EngineLauncher>,
    registered: AtomicBool,
    /// Bumped on every replica state change (the registration stream sends a status).
    changes: watch::Sender<u64>,
    /// Current drain (None = not draining).
    drain: watch::Sender<Option<DrainState>>,
    drain_lock: Mutex<()>,
}

impl Agent {
    /// A new agent with no replicas.
    pub fn new(cfg: WorkerConfig, devices: gpu::Devices, address: String, launcher: Arc<dyn EngineLauncher>) -> Self {
        Self {
            cfg,
            devices,
            address,
            replicas: ReplicaMap::default(),
            launcher,
            registered: AtomicBool::new(false),
            changes: watch::channel(0).0,
            drain: watch::channel(None).0,
            drain_lock: Mutex::new(()),
        }
    }

    /// The node id.
    pub fn node_id(&self) -> &NodeId {
        &self.cfg.node_id
    }

    /// The hosted replicas.
    pub fn replicas(&self) -> &ReplicaMap {
        &self.replicas
    }

    /// The inventory sent in `register`.
    pub fn inventory(&self) -> pb::NodeInventory {
        pb::NodeInventory {
            node_id: self.cfg.node_id.0.clone(),
            address: self.address.clone(),
            gpus: self.devices.gpus.clone(),
            cpu_slots: self.devices.cpu_slots,
            labels: self.cfg.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            simulated_gpus: self.devices.simulated,
        }
    }

    /// Marks whether the head session is up (readiness).
    pub fn set_registered(&self, up: bool) {
        self.registered.store(up, Ordering::SeqCst);
    }

    /// Whether the head session is up.
    pub fn is_registered(&self) -> bool {
        self.registered.load(Ordering::SeqCst)
    }

    /// Subscribes to replica state changes.
    pub fn subscribe_changes(&self) -> watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Subscribes to drain progress.
    pub fn subscribe_drain(&self) -> watch::Receiver<Option<DrainState>> {
        self.drain.subscribe()
    }

    /// Current drain, if any.
    pub fn drain_state(&self) -> Option<DrainState> {
        self.drain.borrow().clone()
    }

    /// Whether a drain is in progress or finished.
    pub fn is_draining(&self) -> bool {
        self.drain.borrow().is_some()
    }

    fn changed(&self) {
        self.changes.send_modify(|v| *v += 1);
    }

    /// Status of every replica for the head; replicas reported as Stopped are then forgotten.
    pub fn status_snapshot(&self) -> pb::WorkerStatus {
        let replicas = self.replicas.all().iter().map(|r| r.status()).collect();
        self.replicas.remove_stopped();
        pb::WorkerStatus { replicas }
    }

    /// Why `r`'s engine is unhealthy, if it is: its step thread is dead, or it has held work
    /// without completing a step for longer than `--engine-stall-timeout`.
    pub fn engine_problem(&self, r: &Replica) -> Option<String> {
        let engine = r.engine()?;
        if !engine.is_alive() {
            return Some("engine thread is not running".to_owned());
        }
        match engine.stalled_for() {
            Some(d) if d > self.cfg.engine_stall_timeout => {
                Some(format!("engine has not completed a step for {:.1}s while it had work", d.as_secs_f64()))
            }
            _ => None,
        }
    }

    /// Turns Ready / Draining replicas whose engine died or stalled into Failed: their
    /// remaining requests are aborted (streams end UNAVAILABLE, so routers migrate them),
    /// the engine is stopped (its running step interrupted, its threads ended, so it stops
    /// competing for the CPU with the replica that replaces it) and the head hears it with
    /// the next status, which takes them out of the routes. Called by the health loop
    /// (every 500 ms) and before each load report.
    pub fn check_engines(&self) {
        for r in self.replicas.all() {
            let (state, _) = r.state();
            if !matches!(state, ReplicaState::Ready | ReplicaState::Draining) {
                continue;
            }
            if let Some(why) = self.engine_problem(&r)
                && r.set_state(ReplicaState::Failed, why.clone())
            {
                tracing::warn!(replica = %r.id, reason = %why, "engine unhealthy: replica failed");
                r.abort.cancel();
                if let Some(engine) = r.engine() {
                    engine.stop();
                }
                self.changed();
            }
        }
    }

    /// Load reports of the loaded replicas (after [`Agent::check_engines`]).
    pub fn load_reports(&self) -> pb::LoadReports {
        self.check_engines();
        let reports = self.replicas.all().iter().filter_map(|r| r.load_report()).collect();
        pb::LoadReports { reports }
    }

    /// Readiness: registered, not draining, and every replica Ready with a live engine that
    /// is not stalled (see [`Agent::engine_problem`]). Returns the reasons when not ready.
    pub fn readiness(&self) -> Result<(), Vec<String>> {
        let mut why = Vec::new();
        if !self.is_registered() {
            why.push("not registered with the head".to_owned());
        }
        if self.is_draining() {
            why.push("draining".to_owned());
        }
        for r in self.replicas.all() {
            let (state, reason) = r.state();
            let problem =
                if r.engine().is_none() { Some("engine not loaded".to_owned()) } else { self.engine_problem(&r) };
            if state != ReplicaState::Ready || problem.is_some() {
                let reason = problem.unwrap_or(reason);
                why.push(format!("replica {} is {} {}", r.id, state.as_str_name(), reason).trim_end().to_owned());
            }
        }
        if why.is_empty() { Ok(()) } else { Err(why) }
    }

    /// Executes `StartReplica`: idempotent (an id already hosted is left alone, so a new
    /// head adopts running replicas instead of restarting them). Loads the engine on a
    /// blocking thread; Starting → Ready, or Failed with the reason.
    pub fn start_replica(self: &Arc<Self>, cmd: pb::StartReplica) {
        let engine = cmd.engine.unwrap_or_default();
        let model_name =
            if engine.served_model_name.is_empty() { engine.model.clone() } else { engine.served_model_name.clone() };
        let replica = Arc::new(Replica::new(
            ReplicaId(cmd.replica_id.clone()),
            cmd.deployment.clone(),
            model_name,
            cmd.gpu_indices.clone(),
        ));
        if !self.replicas.insert_new(Arc::clone(&replica)) {
            tracing::info!(replica = %cmd.replica_id, "start for a replica already hosted: kept as is");
            self.changed();
            return;
        }
        if self.drain_state().is_some_and(|d| d.done) {
            // A finished drain: the head uncordoned the node and places replicas again.
            self.drain.send_replace(None);
        }
        if self.is_draining() {
            replica.set_state(ReplicaState::Failed, "node is draining");
            self.changed();
            return;
        }
        self.changed();
        let placement = match self.placement_for(&engine, &cmd.gpu_indices) {
            Ok(p) => p,
            Err(reason) => {
                replica.set_state(ReplicaState::Failed, reason);
                self.changed();
                return;
            }
        };
        let kv_cache_bytes = engine.kv_cache_bytes.unwrap_or(self.cfg.kv_cache_bytes);
        let spec = LaunchSpec {
            replica_id: replica.id.clone(),
            engine,
            placement,
            kv_cache_bytes,
            engine_threads: self.cfg.engine_threads,
        };
        let agent = Arc::clone(self);
        tokio::spawn(async move {
            tracing::info!(replica = %spec.replica_id, model = %spec.engine.model, "loading replica");
            let launcher = Arc::clone(&agent.launcher);
            let spec2 = spec.clone();
            let res = tokio::task::spawn_blocking(move || launcher.launch(&spec2)).await;
            match res {
                Ok(Ok(engine)) => {
                    let (state, _) = replica.state();
                    if state != ReplicaState::Starting {
                        // Stopped (or drained) while loading.
                        tokio::task::spawn_blocking(move || engine.shutdown());
                        return;
                    }
                    replica.set_engine(engine);
                    replica.set_state(ReplicaState::Ready, "");
                    tracing::info!(replica = %spec.replica_id, "replica ready");
                }
                Ok(Err(e)) => {
                    tracing::warn!(replica = %spec.replica_id, error = %e, "replica failed to start");
                    replica.set_state(ReplicaState::Failed, e.to_string());
                }
                Err(e) => {
                    replica.set_state(ReplicaState::Failed, format!("engine load panicked: {e}"));
                }
            }
            agent.changed();
        });
    }

    fn placement_for(&self, engine: &pb::EngineConfig, gpus: &[u32]) -> Result<Placement, String> {
        let tp = engine.tensor_parallel_size.max(1) as usize;
        if !self.devices.gpus.is_empty() && gpus.len() != tp {
            return Err(format!("got {} GPU indices for tensor_parallel_size {tp}", gpus.len()));
        }
        if let Some(bad) = gpus.iter().find(|i| !self.devices.gpus.iter().any(|g| g.index == **i)) {
            if !self.devices.gpus.is_empty() {
                return Err(format!("GPU index {bad} does not exist on node {}", self.cfg.node_id));
            }
        }
        let want_cuda = matches!(engine.backend.as_str(), "" | "auto" | "cuda");
        if self.devices.simulated || self.devices.gpus.is_empty() || !want_cuda {
            if engine.backend == "cuda" && !self.devices.simulated {
                return Err(format!("backend cuda requested but node {} has no GPU", self.cfg.node_id));
            }
            Ok(Placement::Cpu)
        } else {
            Ok(Placement::Cuda(gpus.to_vec()))
        }
    }

    /// Executes `StopReplica`: no new requests; waits until idle or `deadline`, aborts the
    /// rest (their streams end UNAVAILABLE so the router migrates them), shuts the engine
    /// and reports Stopped.
    pub fn stop_replica(self: &Arc<Self>, id: &str, deadline: Duration) {
        let Some(r) = self.replicas.get(id) else {
            tracing::info!(replica = id, "stop for an unknown replica");
            return;
        };
        if matches!(r.state().0, ReplicaState::Stopping | ReplicaState::Stopped) {
            return;
        }
        r.set_state(ReplicaState::Stopping, "stop requested");
        self.changed();
        let agent = Arc::clone(self);
        tokio::spawn(async move {
            agent.finish_replica(&r, Instant::now() + deadline).await;
            r.set_state(ReplicaState::Stopped, "stopped");
            agent.changed();
        });
    }

    /// Waits for `r` to be idle until `deadline`, then aborts the rest and shuts the engine.
    async fn finish_replica(&self, r: &Arc<Replica>, deadline: Instant) {
        let idle = tokio::time::timeout_at(deadline.into(), r.wait_idle()).await.is_ok();
        if !idle {
            tracing::info!(replica = %r.id, in_flight = r.in_flight(), "deadline passed: aborting remaining requests");
            r.abort.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(5), r.wait_idle()).await;
        }
        if let Some(engine) = r.engine().cloned() {
            let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
        }
    }

    /// Requests in flight on every replica.
    pub fn in_flight(&self) -> u32 {
        self.replicas.all().iter().map(|r| r.in_flight()).sum()
    }

    /// Starts a drain (idempotent: a second request can only bring the deadline forward).
    /// New work is refused at once; in-flight requests finish until `deadline`, the rest
    /// are aborted (handed back). For `DrainSource::Head` the replicas are stopped at the
    /// end and the node accepts replicas again afterwards. Returns the in-flight count.
    pub fn drain(self: &Arc<Self>, deadline: Duration, reason: &str, source: DrainSource) -> u32 {
        let _g = self.drain_lock.lock();
        let deadline_unix_ms = unix_ms() + deadline.as_millis() as u64;
        let in_flight = self.in_flight();
        if let Some(cur) = self.drain_state() {
            if !cur.done && deadline_unix_ms < cur.deadline_unix_ms {
                self.drain.send_modify(|d| {
                    if let Some(d) = d {
                        d.deadline_unix_ms = deadline_unix_ms;
                    }
                });
            }
            return in_flight;
        }
        tracing::info!(?source, reason, deadline_ms = deadline.as_millis() as u64, in_flight, "drain started");
        for r in self.replicas.all() {
            if matches!(r.state().0, ReplicaState::Ready | ReplicaState::Starting) {
                r.set_state(ReplicaState::Draining, reason);
            }
        }
        self.changed();
        self.drain.send_replace(Some(DrainState {
            in_flight,
            deadline_unix_ms,
            done: false,
            reason: reason.to_owned(),
        }));
        let agent = Arc::clone(self);
        tokio::spawn(async move { agent.drain_loop(source).await });
        in_flight
    }

    async fn drain_loop(self: Arc<Self>, source: DrainSource) {
        loop {
            let Some(d) = self.drain_state() else { return };
            let in_flight = self.in_flight();
            let past = unix_ms() >= d.deadline_unix_ms;
            if in_flight != d.in_flight {
                self.drain.send_modify(|s| {
                    if let Some(s) = s {
                        s.in_flight = in_flight;
                    }
                });
            }
            if in_flight == 0 || past {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // Deadline reached or idle: abort what is left and stop the engines.
        let replicas = self.replicas.all();
        for r in &replicas {
            self.finish_replica(r, Instant::now()).await;
            if !matches!(r.state().0, ReplicaState::Failed | ReplicaState::Stopped) {
                r.set_state(ReplicaState::Stopped, "drained");
            }
        }
        self.changed();
        self.drain.send_modify(|s| {
            if let Some(s) = s {
                s.in_flight = 0;
                s.done = true;
            }
        });
        tracing::info!(?source, "drain finished");
    }

    /// Waits until the current drain (if any) has finished.
    pub async fn wait_drained(&self) {
        let mut rx = self.drain.subscribe();
        let _ = rx.wait_for(|d| d.as_ref().is_none_or(|d| d.done)).await;
    }
}
