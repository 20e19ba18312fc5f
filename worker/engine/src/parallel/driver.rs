//! The driver side of a parallel replica: [`ParallelBackend`] is the `Backend` the step loop
//! drives. Rank 0 (first stage, tensor-parallel rank 0) runs in the driver's process; every
//! other rank is a process ([`super::spawn`]) that joined through the [`Rendezvous`].
//!
//! Start: bind a loopback rendezvous (or take the configured one), spawn this node's ranks
//! (the cores split among them), accept every expected rank's hello within `join_timeout`
//! (an error names the missing ranks, or the child that exited), send each the
//! [`InitSpec`] with the full mesh (and an NCCL id on CUDA), then connect rank 0's mesh and
//! build its stage while the others do, and wait for every `Loaded` (the replica has the
//! fewest KV blocks of any rank). With `rank0_in_process == false` rank 0 is a child too and
//! the driver only schedules.
//!
//! Each step the driver validates the batch against the group's geometry, sends it to every
//! rank ([`super::wire`]), runs rank 0's micro-batches and waits for every rank's answer
//! (each bounded by `collective_timeout` after rank 0's part, polling the replica's
//! [`StepControl`]); the last stage's tensor-parallel rank 0 returns the logit rows, or the
//! argmax ids for a greedy step when it is not in this process. A rank that exits, fails its
//! step or stalls past the collective timeout fails the step; the backend then aborts rank
//! 0's communicator, closes every control connection, kills the ranks it started and
//! refuses every later step, so the engine reports the replica dead (and the agent replaces
//! it). Dropping the backend sends `Shutdown`, waits up to 500 ms, then kills what is left.

use std::net::{IpAddr, Ipv4Addr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::comm::{AbortHandle, CommError, Communicator, HostCommListener};
use super::group::{POLL, RankLink, accept_joins, check_children};
use super::layout::ParallelSizes;
use super::rank::{RankSpec, Rendezvous};
use super::spawn::{RankProcess, RankProgram, spawn_rank};
use super::stage::{InitSpec, StageBackend, StageBackendKind, StageContext, StageOutput, run_micro_batches};
use super::wire::{Msg, encode_step};
use crate::backend::{Backend, BackendError, Logits, StepBatch, StepControl};
use crate::model::{LlamaWeights, ModelConfig};

/// How a replica's ranks are laid out and started (part of `EngineConfig`).
#[derive(Clone, Debug)]
pub struct ParallelConfig {
    /// `tensor_parallel_size × pipeline_parallel_size`; 1 × 1 = today's single-process path.
    pub sizes: ParallelSizes,
    /// Global ranks on this node, rank 0 first (ranks `local_ranks[i]` use
    /// `BackendKind::Cuda.devices[i]` on CUDA). Rank 0 runs in this process; the driver
    /// starts the others as processes. Ranks not listed join from other nodes.
    pub local_ranks: Vec<usize>,
    /// Where ranks connect; `None` = bound on loopback by the driver (every rank local).
    pub rendezvous: Option<Arc<Rendezvous>>,
    /// The executable the driver starts its local ranks with.
    pub rank_program: Option<RankProgram>,
    /// Every rank joined and loaded its shard within this, or the replica fails to start.
    pub join_timeout: Duration,
    /// Bound of every collective and of each step's answer from a rank.
    pub collective_timeout: Duration,
    /// Micro-batches per step with pipeline parallelism (`None` = the number of stages).
    pub micro_batches: Option<usize>,
    /// Rank 0 runs in the driver's process (the default). `false`: rank 0 is a child process
    /// too and the driver only schedules (vLLM's multiprocessing executor); this is how the
    /// rank-process overhead of a one-rank replica is measured.
    pub rank0_in_process: bool,
    /// CUDA ranks sum and pass activations through the host communicator (staged through
    /// host memory) instead of NCCL: several ranks on one device (NCCL refuses that), tests.
    pub host_collectives: bool,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            sizes: ParallelSizes::default(),
            local_ranks: vec![0],
            rendezvous: None,
            rank_program: None,
            join_timeout: Duration::from_secs(600),
            collective_timeout: Duration::from_secs(30),
            micro_batches: None,
            rank0_in_process: true,
            host_collectives: false,
        }
    }
}

/// What the driver knows of the model besides the [`InitSpec`]: its architecture, the
/// whole model's weights when they are already loaded (rank 0 of a CPU replica shares the
/// driver's load instead of reading the file again), and the CUDA ordinals of the local
/// ranks (`local_ranks[i]` uses `devices[i]`; empty = ordinal `i`).
pub struct DriverModel {
    /// The model's architecture.
    pub config: ModelConfig,
    /// The whole model (CPU: GGUF blocks kept), for rank 0 in this process.
    pub weights: Option<LlamaWeights>,
    /// CUDA ordinals of `ParallelConfig::local_ranks`.
    pub devices: Vec<u32>,
}

/// A CPU rank's KV budget so that the group holds exactly as many blocks as the unsharded
/// replica would with `total_bytes`: each rank holds its stage's layers and `1/tp` of the
/// KV heads, and the stage with the most layers gets just the bytes of those blocks (the
/// others get a few more blocks, unused: the group has the minimum over its ranks).
pub fn rank_kv_budget(total_bytes: u64, config: &ModelConfig, sizes: ParallelSizes, block_size: usize) -> u64 {
    let per_token_layer = 2 * config.kv_dim() as u64 * 4;
    let blocks = total_bytes / (per_token_layer * config.num_hidden_layers as u64 * block_size as u64).max(1);
    let most_layers = (0..sizes.pipeline_parallel_size)
        .map(|p| sizes.stage_layers(p, config.num_hidden_layers).len())
        .max()
        .unwrap_or(1) as u64;
    let tp = sizes.tensor_parallel_size.max(1) as u64;
    blocks * block_size as u64 * most_layers * per_token_layer / tp
}

/// A replica whose ranks are processes (see the module docs).
pub struct ParallelBackend {
    sizes: ParallelSizes,
    control: StepControl,
    block_size: usize,
    num_kv_blocks: usize,
    kv_bytes_per_token: usize,
    vocab: usize,
    micro_batches: usize,
    /// Greedy steps take the argmax where the logits are (a CUDA device, or a rank process
    /// that would otherwise send every logit row over its control connection).
    device_greedy: bool,
    collective_timeout: Duration,
    /// Rank 0's stage when it runs in this process.
    local: Option<Box<dyn StageBackend>>,
    /// The rank that returns the logits: the last stage's tensor-parallel rank 0.
    output_rank: usize,
    links: Vec<RankLink>,
    children: Vec<RankProcess>,
    /// Aborts rank 0's communicator (set once its mesh is formed).
    abort: Arc<OnceLock<AbortHandle>>,
    watcher_done: Arc<AtomicBool>,
    failed: Option<String>,
    step_seq: u64,
    rendezvous: Arc<Rendezvous>,
    /// The last step's timing (its round trip sizes the next step's spin window).
    timing: Option<StepTiming>,
}

/// Where a step's time went, as the driver saw it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepTiming {
    /// From sending the step to having every rank's answer.
    pub round_trip: Duration,
    /// The output rank's own time running the step (what it reported in `StepDone`; zero
    /// when rank 0 in this process returns the outputs).
    pub rank_compute: Duration,
}

/// The most the driver polls for a step's answer without sleeping (around when the last
/// step's answer came; outside that window it sleeps until the answer wakes it).
const ANSWER_SPIN: Duration = Duration::from_millis(2);

impl std::fmt::Debug for ParallelBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParallelBackend").field("sizes", &self.sizes).finish_non_exhaustive()
    }
}

/// The host part of `host:port`.
fn host_of(address: &str) -> &str {
    address.rsplit_once(':').map_or(address, |(h, _)| h)
}

fn random_token() -> String {
    use rand::Rng;
    let mut rng = rand::rng();
    (0..16).map(|_| format!("{:02x}", rng.random::<u8>())).collect()
}

impl ParallelBackend {
    /// Starts the group: binds (or takes) the rendezvous, starts the local ranks, waits for
    /// every rank to join and load, builds rank 0's stage. `init` is the spec every rank gets
    /// (its `mesh` is filled in here). Reads the model's architecture from `init.model`;
    /// [`ParallelBackend::start_with_model`] takes it (and the loaded weights) instead.
    ///
    /// # Errors
    /// [`BackendError::Device`] naming the rank that did not join, failed to load or exited.
    pub fn start(
        cfg: &ParallelConfig,
        init: super::stage::InitSpec,
        control: StepControl,
    ) -> Result<Self, BackendError> {
        let config = super::stage::read_model_config(&init.model).map_err(|e| BackendError::Device(e.to_string()))?;
        Self::start_with_model(cfg, init, control, DriverModel { config, weights: None, devices: Vec::new() })
    }

    /// As [`ParallelBackend::start`], with what the caller already knows of the model.
    ///
    /// # Errors
    /// As [`ParallelBackend::start`].
    pub fn start_with_model(
        cfg: &ParallelConfig,
        mut init: InitSpec,
        control: StepControl,
        model: DriverModel,
    ) -> Result<Self, BackendError> {
        let dev = |m: String| BackendError::Device(m);
        let sizes = cfg.sizes;
        let world = sizes.world_size();
        sizes.validate(&model.config).map_err(|e| dev(e.to_string()))?;
        init.sizes = sizes;
        let started = Instant::now();
        let deadline = started + cfg.join_timeout;
        let rendezvous = match &cfg.rendezvous {
            Some(r) => r.clone(),
            None => Arc::new(
                Rendezvous::bind(IpAddr::V4(Ipv4Addr::LOCALHOST), "127.0.0.1", &random_token())
                    .map_err(|e| dev(format!("bind the rendezvous: {e}")))?,
            ),
        };
        let host = host_of(rendezvous.address()).to_owned();
        let loopback = host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback()) || host == "localhost";
        let bind_ip = loopback.then_some(IpAddr::V4(Ipv4Addr::LOCALHOST));
        let in_process = cfg.rank0_in_process;
        let program = match &cfg.rank_program {
            Some(p) => p.clone(),
            None => RankProgram::current_exe().map_err(|e| dev(format!("the rank program: {e}")))?,
        };
        // The cores are split among this node's ranks.
        let cores = init
            .engine_threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get));
        let share = (cores / cfg.local_ranks.len().max(1)).max(1);
        let cuda = init.backend == StageBackendKind::Cuda;
        let mut children = Vec::new();
        for (i, &rank) in cfg.local_ranks.iter().enumerate() {
            if (rank == 0 && in_process) || rank >= world {
                continue;
            }
            let spec = RankSpec {
                rendezvous: rendezvous.address().to_owned(),
                token: rendezvous.token().to_owned(),
                rank,
                device: cuda.then(|| model.devices.get(i).copied().unwrap_or(i as u32)),
                bind_ip,
                advertise_host: host.clone(),
                engine_threads: Some(share),
            };
            children.push(spawn_rank(&program, &spec).map_err(|e| dev(format!("start rank {rank}: {e}")))?);
        }
        let expected: Vec<usize> = (usize::from(in_process)..world).collect();
        let mut joined = accept_joins(&rendezvous, world, &expected, deadline, &mut children, &control)?;
        let listener = if in_process {
            let ip = bind_ip.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
            Some(HostCommListener::bind(ip, &host).map_err(|e| dev(format!("bind rank 0's communicator: {e}")))?)
        } else {
            None
        };
        let mut mesh = vec![String::new(); world];
        for (&rank, j) in &joined {
            mesh[rank].clone_from(&j.mesh_address);
        }
        if let Some(l) = &listener {
            mesh[0] = l.address().to_owned();
        }
        init.mesh = mesh;
        #[cfg(feature = "cuda")]
        if cuda && !init.host_collectives && world > 1 {
            init.nccl_unique_id = Some(crate::backend::cuda::stage::nccl_unique_id()?);
        }
        let abort = Arc::new(OnceLock::new());
        let mut links = Vec::with_capacity(joined.len());
        for (rank, j) in std::mem::take(&mut joined) {
            let mut link = RankLink::new(rank, j.stream, abort.clone())?;
            link.send(&Msg::Init(Box::new(init.clone())))?;
            links.push(link);
        }
        let collective_timeout = Duration::from_millis(init.collective_timeout_ms);
        // Rank 0 connects its mesh and loads while the other ranks do.
        let (local, loaded) = std::thread::scope(|s| {
            let rank0 = listener.map(|l| {
                let (init, control, abort) = (init.clone(), control.clone(), abort.clone());
                let layers = sizes.stage_layers(0, model.config.num_hidden_layers);
                let weights = model.weights;
                let config = model.config.clone();
                let device = cuda.then(|| model.devices.first().copied().unwrap_or(0));
                s.spawn(move || -> Result<Box<dyn StageBackend>, BackendError> {
                    let comm = l.connect(0, &init.mesh, collective_timeout).map_err(|e| dev(format!("rank 0: {e}")))?;
                    let _ = abort.set(comm.abort_handle());
                    let coords = sizes.coords(0);
                    let ctx = StageContext { init, coords, layers, device, comm: Box::new(comm) };
                    match ctx.init.backend {
                        StageBackendKind::Cpu => Ok(Box::new(crate::backend::cpu::stage::build_cpu_stage(
                            ctx,
                            weights.map(|w| (w, config)),
                            Some(control),
                        )?)),
                        #[cfg(feature = "cuda")]
                        StageBackendKind::Cuda => crate::backend::cuda::stage::build_cuda_stage(ctx),
                        #[cfg(not(feature = "cuda"))]
                        StageBackendKind::Cuda => Err(dev("the CUDA backend is not built into this binary".into())),
                    }
                })
            });
            let mut loaded = Ok(Vec::new());
            for link in &mut links {
                let answer = link.recv(deadline, &control, "loaded").and_then(|m| match m {
                    Msg::Loaded { num_kv_blocks, kv_bytes_per_token } => Ok((num_kv_blocks, kv_bytes_per_token)),
                    _ => Err(dev(format!("rank {}: expected loaded", link.rank))),
                });
                match answer {
                    Ok(a) => loaded.as_mut().map(|v| v.push(a)).unwrap_or(()),
                    Err(e) => {
                        if let Some(a) = abort.get() {
                            a.abort();
                        }
                        loaded = Err(e);
                        break;
                    }
                }
            }
            let local = rank0.map(|h| h.join().unwrap_or_else(|_| Err(dev("rank 0's load panicked".into()))));
            (local.transpose(), loaded)
        });
        // A rank whose connection closed: name its exit status when it is a child here.
        let mut loaded = loaded.map_err(|e| {
            let until = Instant::now() + Duration::from_millis(200);
            loop {
                match check_children(&mut children) {
                    Err(exited) => return exited,
                    Ok(()) if Instant::now() >= until => return e,
                    Ok(()) => std::thread::sleep(POLL),
                }
            }
        })?;
        let local = local?;
        check_children(&mut children)?;
        if let Some(l) = &local {
            loaded.push((l.num_kv_blocks(), l.kv_bytes_per_token()));
        }
        let num_kv_blocks = loaded.iter().map(|l| l.0).min().unwrap_or(0);
        let kv_bytes_per_token = loaded.iter().map(|l| l.1).sum();
        let watcher_done = Arc::new(AtomicBool::new(false));
        spawn_watcher(control.clone(), abort.clone(), watcher_done.clone());
        tracing::info!(
            tensor_parallel_size = sizes.tensor_parallel_size,
            pipeline_parallel_size = sizes.pipeline_parallel_size,
            rendezvous = rendezvous.address(),
            num_kv_blocks,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "parallel group loaded"
        );
        let pp = sizes.pipeline_parallel_size;
        Ok(Self {
            sizes,
            control,
            block_size: init.block_size,
            num_kv_blocks,
            kv_bytes_per_token,
            vocab: model.config.vocab_size,
            micro_batches: if pp > 1 { cfg.micro_batches.unwrap_or(pp).max(1) } else { 1 },
            // The argmax on the last rank: only ids cross the control connection.
            device_greedy: cuda || sizes.rank_of(0, pp - 1) != 0 || !in_process,
            collective_timeout,
            local,
            output_rank: sizes.rank_of(0, pp - 1),
            links,
            children,
            abort,
            watcher_done,
            failed: None,
            step_seq: 0,
            rendezvous,
            timing: None,
        })
    }

    /// Process ids of the rank processes this driver started, by rank.
    pub fn rank_pids(&self) -> Vec<(usize, u32)> {
        self.children.iter().map(|c| (c.rank, c.pid())).collect()
    }

    /// Where the last step's time went (`None` before the first step).
    pub fn last_step_timing(&self) -> Option<StepTiming> {
        self.timing
    }

    /// The rendezvous the group formed on.
    pub fn rendezvous_address(&self) -> &str {
        self.rendezvous.address()
    }

    /// Tears the group down after a failure: aborts rank 0's communicator, closes every
    /// control connection (remote ranks exit on it) and kills the local rank processes.
    fn fail(&mut self, why: &BackendError) {
        tracing::error!(error = %why, "parallel step failed; tearing the rank group down");
        if let Some(a) = self.abort.get() {
            a.abort();
        }
        for l in &self.links {
            l.close();
        }
        self.children.clear();
        self.local = None;
        self.failed = Some(why.to_string());
    }

    fn step(&mut self, batch: &StepBatch, greedy: bool) -> Result<Vec<StageOutput>, BackendError> {
        if let Some(why) = &self.failed {
            return Err(BackendError::Device(format!("the rank group failed earlier: {why}")));
        }
        batch.validate(self.vocab, self.num_kv_blocks, self.block_size)?;
        self.run_step(batch, greedy).inspect_err(|e| self.fail(e))
    }

    fn run_step(&mut self, batch: &StepBatch, greedy: bool) -> Result<Vec<StageOutput>, BackendError> {
        self.step_seq += 1;
        let seq = self.step_seq;
        let frame = encode_step(seq, greedy, self.micro_batches, batch);
        for l in &mut self.links {
            l.send_frame(&frame)?;
        }
        let sent = Instant::now();
        // Poll for the answers around when the last step's came (at most ANSWER_SPIN).
        let spin = self.timing.map(|t| {
            let margin = (t.round_trip / 8).clamp(Duration::from_micros(100), ANSWER_SPIN / 2);
            (sent + t.round_trip.saturating_sub(margin), sent + t.round_trip + margin)
        });
        let mut out = match &mut self.local {
            Some(stage) => match run_micro_batches(stage.as_mut(), batch, greedy, self.micro_batches) {
                Ok(o) => Some(o),
                // Rank 0's collective was aborted (a rank's connection failed or it sent
                // StepFailed): that rank's own report says which rank went. A timeout of
                // rank 0's own collective already names the peer it waited on.
                Err(BackendError::Device(m)) if m.contains(&CommError::Aborted.to_string()) => {
                    return Err(self.root_cause(BackendError::Device(m), 0));
                }
                Err(e) => return Err(e),
            },
            None => None,
        };
        let deadline = Instant::now() + self.collective_timeout;
        let mut rank_compute = Duration::ZERO;
        for i in 0..self.links.len() {
            let l = &mut self.links[i];
            let answer = match spin {
                Some(window) => l.recv_spinning(deadline, &self.control, "the step", window),
                None => l.recv(deadline, &self.control, "the step"),
            };
            let answer = match answer {
                Ok(a) => a,
                // This rank did not answer in time: it may be waiting on a frozen peer, whose
                // name the peers' `StepFailed` carries.
                Err(e) if Instant::now() >= deadline => return Err(self.root_cause(e, i)),
                Err(e) => return Err(e),
            };
            let l = &self.links[i];
            match answer {
                Msg::StepDone { seq: s, outputs, compute_ns } if s == seq => {
                    if l.rank == self.output_rank {
                        out = Some(outputs);
                        rank_compute = Duration::from_nanos(compute_ns);
                    }
                }
                _ => return Err(BackendError::Device(format!("rank {}: an unexpected answer to step {seq}", l.rank))),
            }
        }
        self.timing = Some(StepTiming { round_trip: sent.elapsed(), rank_compute });
        out.ok_or_else(|| BackendError::Device(format!("rank {} returned no outputs", self.output_rank)))
    }
}

impl ParallelBackend {
    /// The failure that explains `e` (a step rank 0 could not finish; links before
    /// `answered` already answered it). Over a short grace (`collective_timeout / 4`, 50 ms
    /// to 2 s) it gathers what the ranks report: a rank whose connection is gone (it
    /// exited) is the cause at once; otherwise the ranks that stayed silent (neither
    /// answered nor failed) are the frozen ones, named before the first rank's failure
    /// (`rank 4 did not answer the step (frozen?); rank 3 failed: rank 4 did not answer
    /// within 30s`). With no report, `e` itself.
    fn root_cause(&mut self, e: BackendError, answered: usize) -> BackendError {
        if matches!(e, BackendError::Cancelled) {
            return e;
        }
        let grace = (self.collective_timeout / 4).clamp(Duration::from_millis(50), Duration::from_secs(2));
        let until = Instant::now() + grace;
        let mut heard: Vec<Option<String>> = vec![None; self.links.len()];
        let mut failures: Vec<String> = Vec::new();
        loop {
            for (k, l) in self.links.iter_mut().enumerate().skip(answered) {
                if heard[k].is_some() {
                    continue;
                }
                if let Some(f) = l.pending_failure() {
                    let f = f.to_string();
                    if f.contains("is gone") || f.contains("connection") {
                        tracing::warn!(error = %e, cause = %f, "parallel step failed");
                        return BackendError::Device(f.trim_start_matches("device error: ").to_owned());
                    }
                    failures.push(f.trim_start_matches("device error: ").to_owned());
                    heard[k] = Some(String::new());
                }
            }
            let silent: Vec<usize> = self
                .links
                .iter()
                .enumerate()
                .skip(answered)
                .filter(|(k, _)| heard[*k].is_none())
                .map(|(_, l)| l.rank)
                .collect();
            let done = silent.is_empty() || Instant::now() >= until || self.control.stop_requested().is_some();
            if done {
                if failures.is_empty() {
                    return e;
                }
                let first = failures.swap_remove(0);
                let why = if silent.is_empty() {
                    first
                } else {
                    let who = silent.iter().map(usize::to_string).collect::<Vec<_>>().join(", ");
                    let s = if silent.len() == 1 { "" } else { "s" };
                    format!("rank{s} {who} did not answer the step (frozen?); {first}")
                };
                tracing::warn!(error = %e, cause = %why, "parallel step failed");
                return BackendError::Device(why);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Aborts rank 0's communicator as soon as the replica is asked to stop (a collective
/// waiting on a peer returns at once instead of after its timeout).
fn spawn_watcher(control: StepControl, abort: Arc<OnceLock<AbortHandle>>, done: Arc<AtomicBool>) {
    let _ = std::thread::Builder::new().name("prism-group-watch".into()).spawn(move || {
        while !done.load(Ordering::Relaxed) {
            if control.stop_requested().is_some() {
                if let Some(a) = abort.get() {
                    a.abort();
                }
                return;
            }
            std::thread::sleep(POLL);
        }
    });
}

fn no_output(rank: usize) -> BackendError {
    BackendError::Device(format!("rank {rank} returned a micro-batch without its outputs"))
}

impl Backend for ParallelBackend {
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits, BackendError> {
        let outputs = self.step(batch, false)?;
        let mut logits = Logits { rows: 0, vocab_size: self.vocab, data: Vec::new() };
        for o in outputs {
            let StageOutput::Logits(l) = o else { return Err(no_output(self.output_rank)) };
            logits.rows += l.rows;
            logits.data.extend_from_slice(&l.data);
        }
        Ok(logits)
    }

    fn has_device_greedy(&self) -> bool {
        self.device_greedy
    }

    fn forward_greedy(&mut self, batch: &StepBatch) -> Result<Vec<u32>, BackendError> {
        if !self.device_greedy {
            let logits = self.forward(batch)?;
            return Ok((0..logits.rows).map(|r| crate::sampler::argmax(logits.row(r))).collect());
        }
        let mut ids = Vec::new();
        for o in self.step(batch, true)? {
            let StageOutput::Greedy(g) = o else { return Err(no_output(self.output_rank)) };
            ids.extend(g);
        }
        Ok(ids)
    }

    fn num_kv_blocks(&self) -> usize {
        self.num_kv_blocks
    }

    fn block_size(&self) -> usize {
        self.block_size
    }

    fn kv_bytes_per_token(&self) -> usize {
        self.kv_bytes_per_token
    }

    fn name(&self) -> &'static str {
        "parallel"
    }
}

impl Drop for ParallelBackend {
    /// Asks every rank to exit, then kills the local rank processes that have not.
    fn drop(&mut self) {
        self.watcher_done.store(true, Ordering::Relaxed);
        for l in &mut self.links {
            let _ = l.send(&Msg::Shutdown);
        }
        self.local = None;
        let deadline = Instant::now() + Duration::from_millis(500);
        while Instant::now() < deadline && self.children.iter_mut().any(|c| matches!(c.try_wait(), Ok(None))) {
            std::thread::sleep(POLL);
        }
        for l in &self.links {
            l.close();
        }
        self.children.clear();
    }
}
