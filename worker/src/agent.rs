//! The node agent: owns the hosted replicas, executes the head's commands (start / stop
//! replica, drain) and tracks what the head must hear about (status changes, drain
//! progress). Reached through a cheap `Arc<Agent>` by the registration stream, the gRPC
//! service and the HTTP endpoints.
//!
//! Submodules: [`registration`] (the `WorkerSession` stream to the head), [`gpu`] (device
//! discovery and device placement), [`replica`] (one replica and its engine, the replica table
//! through which every state change goes), [`drain`] (the node drain: SIGTERM, drain commands,
//! spot notices, the deadline hand-back), [`launcher`] (the real engine behind
//! [`replica::EngineLauncher`]), [`spot`] (spot-termination notice poller), [`group`] (this
//! node's ranks of a parallel replica, and the member role's rank processes).
//!
//! A parallel replica (`tensor_parallel_size × pipeline_parallel_size` > 1) takes one of two
//! roles on a node. The driver's node (a `StartReplica` without `rendezvous`) holds rank 0:
//! its engine runs rank 0 in this process and starts the node's other ranks as processes;
//! when the group has ranks on other nodes it first binds a rendezvous and reports its
//! address in the replica's status at once, so the head can start them while the model
//! loads. A member node (a `StartReplica` with the driver's `rendezvous`) starts one rank
//! process per local rank and reports the entry with `group_member`: Ready once they are
//! started (the driver's replica says whether the group formed), Failed as soon as one of
//! them exits (the others are killed with it); a stop kills them at once, a node drain
//! leaves them serving until the head stops the group or the drain's deadline passes.

pub mod drain;
pub mod gpu;
pub mod group;
pub mod launcher;
pub mod registration;
pub mod replica;
pub mod spot;

pub use drain::{DrainSource, DrainState};

use crate::config::WorkerConfig;
use drain::NodeDrain;
use group::{LocalShare, MemberLaunch};
use prism_common::proto::v1::{self as pb, ReplicaState};
use prism_common::{NodeId, ReplicaId};
use prism_engine::parallel::ParallelSizes;
use prism_engine::parallel::rank::Rendezvous;
use prism_engine::parallel::spawn::RankProgram;
use replica::{DevicePlacement, EngineLauncher, LaunchSpec, ParallelLaunch, Replica, ReplicaTable};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::watch;

/// The node agent.
pub struct Agent {
    /// Validated configuration.
    pub cfg: WorkerConfig,
    /// Devices offered.
    pub devices: gpu::Devices,
    /// Endpoint routers dial.
    pub address: String,
    /// Made at start-up (uuid v4), sent in `register`: the head tells this process
    /// reconnecting from another process registering with the same node id.
    instance_id: String,
    replicas: ReplicaTable,
    launcher: Arc<dyn EngineLauncher>,
    registered: AtomicBool,
    drain: Arc<NodeDrain>,
}

impl Agent {
    /// A new agent with no replicas.
    pub fn new(cfg: WorkerConfig, devices: gpu::Devices, address: String, launcher: Arc<dyn EngineLauncher>) -> Self {
        let replicas = ReplicaTable::default();
        Self {
            cfg,
            devices,
            address,
            instance_id: uuid::Uuid::new_v4().to_string(),
            drain: Arc::new(NodeDrain::new(replicas.clone())),
            replicas,
            launcher,
            registered: AtomicBool::new(false),
        }
    }

    /// The node id.
    pub fn node_id(&self) -> &NodeId {
        &self.cfg.node_id
    }

    /// The hosted replicas.
    pub fn replicas(&self) -> &ReplicaTable {
        &self.replicas
    }

    /// The node's drain (SIGTERM and spot-notice reactions, progress for the head).
    pub fn node_drain(&self) -> &Arc<NodeDrain> {
        &self.drain
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
            instance_id: self.instance_id.clone(),
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
        self.replicas.subscribe()
    }

    /// Subscribes to drain progress.
    pub fn subscribe_drain(&self) -> watch::Receiver<Option<DrainState>> {
        self.drain.subscribe()
    }

    /// Current drain, if any.
    pub fn drain_state(&self) -> Option<DrainState> {
        self.drain.state()
    }

    /// Whether a drain is in progress or finished.
    pub fn is_draining(&self) -> bool {
        self.drain.is_draining()
    }

    /// Starts a node drain ([`NodeDrain::start`]): for the head's `DrainCommand` and
    /// `WorkerService.Drain`. Returns the requests in flight.
    pub fn drain(&self, deadline: Duration, reason: &str, source: DrainSource) -> u32 {
        self.drain.start(deadline, reason, source)
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
            // The failed step's error when there is one (which rank of a group exited or
            // did not answer), so the replica's reason names the cause.
            return Some(engine.failure().unwrap_or_else(|| "engine thread is not running".to_owned()));
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
            if r.is_group_member() {
                self.check_member(&r, state);
                continue;
            }
            // A replica being stopped (the end of a drain, `StopReplica`) has its engine shut
            // down before it is reported Stopped: that engine is not dead, it is done.
            if !matches!(state, ReplicaState::Ready | ReplicaState::Draining) || r.is_finishing() {
                continue;
            }
            if let Some(why) = self.engine_problem(&r)
                && self.replicas.transition(&r, ReplicaState::Failed, why.clone())
            {
                tracing::warn!(replica = %r.id, reason = %why, "engine unhealthy: replica failed");
                r.abort.cancel();
                if let Some(engine) = r.engine() {
                    engine.stop();
                }
            }
        }
    }

    /// A member entry whose rank exited turns Failed (naming the rank and its exit) and its
    /// other ranks are killed: the group is broken, the driver's replica fails with it.
    fn check_member(&self, r: &Replica, state: ReplicaState) {
        if !matches!(state, ReplicaState::Starting | ReplicaState::Ready | ReplicaState::Draining) {
            return;
        }
        if let Some(why) = r.member_ranks().exited()
            && self.replicas.transition(r, ReplicaState::Failed, why.clone())
        {
            tracing::warn!(replica = %r.id, reason = %why, "member rank exited: group failed");
            r.member_ranks().kill_all();
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
            let problem = if r.is_group_member() {
                r.member_ranks().exited()
            } else if r.engine().is_none() {
                Some("engine not loaded".to_owned())
            } else {
                self.engine_problem(&r)
            };
            if state != ReplicaState::Ready || problem.is_some() {
                let reason = problem.unwrap_or(reason);
                why.push(format!("replica {} is {} {}", r.id, state.as_str_name(), reason).trim_end().to_owned());
            }
        }
        if why.is_empty() { Ok(()) } else { Err(why) }
    }

    /// Executes `StartReplica`: idempotent (an id already hosted is left alone, so a new
    /// head adopts running replicas instead of restarting them). With the driver's
    /// `rendezvous` it starts this node's member ranks ([`Agent::start_member`]); else it
    /// loads the engine on a blocking thread (binding the group's rendezvous first when it
    /// has ranks on other nodes): Starting → Ready, or Failed with the reason.
    pub fn start_replica(self: &Arc<Self>, cmd: pb::StartReplica) {
        let engine = cmd.engine.clone().unwrap_or_default();
        let model_name =
            if engine.served_model_name.is_empty() { engine.model.clone() } else { engine.served_model_name.clone() };
        let member = !cmd.rendezvous.is_empty();
        let (id, deployment, gpus) =
            (ReplicaId(cmd.replica_id.clone()), cmd.deployment.clone(), cmd.gpu_indices.clone());
        let replica = Arc::new(if member {
            Replica::new_member(id, deployment, model_name, gpus)
        } else {
            Replica::new(id, deployment, model_name, gpus)
        });
        if !self.replicas.insert_new(Arc::clone(&replica)) {
            tracing::info!(replica = %cmd.replica_id, "start for a replica already hosted: kept as is");
            self.replicas.notify();
            return;
        }
        self.drain.reopen_if_finished();
        if self.is_draining() {
            self.replicas.transition(&replica, ReplicaState::Failed, "node is draining");
            return;
        }
        let sizes = ParallelSizes::new(
            engine.tensor_parallel_size.max(1) as usize,
            engine.pipeline_parallel_size.unwrap_or(1).max(1) as usize,
        );
        let share = match LocalShare::of(&self.cfg.node_id, sizes, &cmd.rank_groups, &cmd.gpu_indices) {
            Ok(s) if !member && !s.holds_rank_zero() => Err(group::GroupError::NoRankZero(self.cfg.node_id.clone())),
            Ok(s) if member && s.holds_rank_zero() => {
                Err(group::GroupError::MemberWithRankZero(self.cfg.node_id.clone()))
            }
            other => other,
        };
        let placement = share.map_err(|e| e.to_string()).and_then(|share| {
            let placement = self
                .devices
                .placement_for(&self.cfg.node_id, &engine, &share.devices, share.ranks.len())
                .map_err(|e| e.to_string())?;
            Ok((share, placement))
        });
        let (share, placement) = match placement {
            Ok(p) => p,
            Err(e) => {
                self.replicas.transition(&replica, ReplicaState::Failed, e);
                return;
            }
        };
        if member {
            // CPU member ranks share this node's cores (the driver's engine splits its own).
            let threads = matches!(placement, DevicePlacement::Cpu)
                .then(|| group::threads_per_rank(self.cfg.engine_threads, share.ranks.len()));
            self.start_member(&replica, &cmd, &share, &placement, threads.or(self.cfg.engine_threads));
            return;
        }
        let rendezvous = if share.spans_nodes {
            match self.bind_rendezvous(&cmd.group_token) {
                Ok(r) => {
                    replica.set_rendezvous(r.address().to_owned());
                    tracing::info!(replica = %replica.id, rendezvous = r.address(), "rendezvous bound for the group's other nodes");
                    self.replicas.notify();
                    Some(Arc::new(r))
                }
                Err(e) => {
                    self.replicas.transition(&replica, ReplicaState::Failed, e);
                    return;
                }
            }
        } else {
            None
        };
        // Simulated GPUs exist for placement tests: a group that sits whole on one simulated
        // node runs as one unsharded CPU engine (no rank processes), as replicas on simulated
        // GPUs always have. A group spread over nodes still runs its ranks.
        let (sizes, local_ranks) = if self.devices.simulated && !share.spans_nodes {
            (ParallelSizes::default(), vec![0])
        } else {
            (sizes, share.ranks)
        };
        let kv_cache_bytes = engine.kv_cache_bytes.unwrap_or(self.cfg.kv_cache_bytes);
        let spec = LaunchSpec {
            replica_id: replica.id.clone(),
            engine,
            placement,
            kv_cache_bytes,
            engine_threads: self.cfg.engine_threads,
            parallel: ParallelLaunch {
                sizes,
                local_ranks,
                rendezvous,
                collective_timeout: self.cfg.collective_timeout,
                join_timeout: self.cfg.join_timeout,
                rank_program: self.cfg.rank_program.clone(),
            },
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
                    replica.set_engine(Arc::clone(&engine));
                    if !agent.replicas.transition(&replica, ReplicaState::Ready, "") {
                        // A stop or drain came in between: the engine never took work.
                        tokio::task::spawn_blocking(move || engine.shutdown());
                    }
                }
                Ok(Err(e)) => {
                    tracing::warn!(replica = %spec.replica_id, error = %e, "replica failed to start");
                    agent.replicas.transition(&replica, ReplicaState::Failed, launcher::load_failure(&e));
                }
                Err(e) => {
                    agent.replicas.transition(&replica, ReplicaState::Failed, format!("engine load panicked: {e}"));
                }
            }
        });
    }

    /// Binds the rendezvous of a group with ranks on other nodes: on `--rendezvous-bind`
    /// (default: the gRPC listen IP), reachable at the host of the advertised address.
    fn bind_rendezvous(&self, token: &str) -> Result<Rendezvous, String> {
        if token.is_empty() {
            return Err("group_token is empty for a rank group over several nodes".to_owned());
        }
        let ip = self.cfg.rendezvous_bind.unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED));
        Rendezvous::bind(ip, &group::advertise_host(&self.address), token)
            .map_err(|e| format!("cannot bind the group's rendezvous on {ip}: {e}"))
    }

    /// The member role: starts one rank process per local rank (this executable, joining the
    /// driver's rendezvous with the group token); Ready once they are started, Failed when
    /// one cannot be started (the others are killed).
    fn start_member(
        &self,
        replica: &Replica,
        cmd: &pb::StartReplica,
        share: &LocalShare,
        placement: &DevicePlacement,
        engine_threads: Option<usize>,
    ) {
        let program = match self.cfg.rank_program.clone().map_or_else(RankProgram::current_exe, Ok) {
            Ok(p) => p,
            Err(e) => {
                self.replicas.transition(replica, ReplicaState::Failed, format!("cannot find this executable: {e}"));
                return;
            }
        };
        let launch = MemberLaunch {
            program,
            rendezvous: cmd.rendezvous.clone(),
            token: cmd.group_token.clone(),
            bind_ip: self.cfg.rendezvous_bind,
            advertise_host: group::advertise_host(&self.address),
            engine_threads,
            cuda: matches!(placement, DevicePlacement::Cuda(_)),
        };
        match group::spawn_members(&launch, share) {
            Ok(ranks) => {
                let pids: Vec<u32> = ranks.iter().map(|p| p.pid()).collect();
                tracing::info!(replica = %replica.id, ranks = ?share.ranks, ?pids, rendezvous = %cmd.rendezvous, "member ranks started");
                replica.member_ranks().set(ranks);
                if !self.replicas.transition(replica, ReplicaState::Ready, "") {
                    // Stopped or drained meanwhile: its ranks go with it.
                    replica.member_ranks().kill_all();
                }
            }
            Err(e) => {
                self.replicas.transition(replica, ReplicaState::Failed, e);
            }
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
        self.replicas.transition(&r, ReplicaState::Stopping, "stop requested");
        let agent = Arc::clone(self);
        tokio::spawn(async move {
            r.finish(Instant::now() + deadline).await;
            agent.replicas.transition(&r, ReplicaState::Stopped, "stopped");
        });
    }

    /// Requests in flight on every replica.
    pub fn in_flight(&self) -> u32 {
        self.replicas.in_flight()
    }
}
