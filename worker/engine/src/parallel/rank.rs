//! The rank process: started by a worker agent (or by the driver for ranks on its own node)
//! with a [`RankSpec`] in the `PRISM_RANK_SPEC` environment variable, it binds its
//! host-communicator listener, connects to the driver's [`Rendezvous`] (retrying for
//! [`RANK_CONNECT_TIMEOUT`]), says hello with the group token, its rank and its listener's
//! address, receives the [`super::stage::InitSpec`], forms the host mesh, loads its shard
//! (`Loaded` / `LoadFailed`) and then runs every step the driver broadcasts
//! ([`super::stage::run_micro_batches`], answering `StepDone` / `StepFailed`) until the
//! driver says stop or its connection closes — then it exits: a rank never outlives its
//! driver, and a failed rank never serves again (it exits after `StepFailed`).
//!
//! Exit codes: 0 when the driver stopped it or went away, 1 when it failed (join, load,
//! step), 2 when the spec does not parse.

use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use super::comm::HostCommListener;
use super::stage::{StageBackend, StageContext, build_stage_backend, read_model_config, run_micro_batches};
use super::wire::{Msg, WireError, read_msg, write_msg};

/// The environment variable that turns a rank program (`prism-worker`, `prism`, `prism-rank`) into a rank process.
pub const RANK_SPEC_ENV: &str = "PRISM_RANK_SPEC";

/// What a rank process is started with (JSON in [`RANK_SPEC_ENV`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RankSpec {
    /// The driver's rendezvous, `host:port`.
    pub rendezvous: String,
    /// The group's secret.
    pub token: String,
    /// Global rank.
    pub rank: usize,
    /// CUDA device ordinal (`None` on CPU).
    pub device: Option<u32>,
    /// IP the rank's host-communicator listener binds (`None` = all interfaces).
    pub bind_ip: Option<std::net::IpAddr>,
    /// Host other ranks reach this rank's listener at.
    pub advertise_host: String,
    /// Threads of the rank's compute pool (`None` = the init spec's).
    pub engine_threads: Option<usize>,
}

/// How long a rank keeps trying to reach its driver's rendezvous (the driver may still be
/// binding it, or its node still starting).
pub const RANK_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs the rank process when [`RANK_SPEC_ENV`] is set; every Prism binary calls this first
/// thing in `main` and returns its exit code when it is `Some`. A spec that does not parse
/// is reported on stderr with exit code 2; a rank that fails (join, load, step) exits 1; a
/// rank whose driver says stop or goes away exits 0.
pub fn main_from_env() -> Option<ExitCode> {
    rank_from_env().map(ExitCode::from)
}

/// As [`main_from_env`] for a `main` that cannot return an [`ExitCode`] (an async main):
/// when [`RANK_SPEC_ENV`] is set, runs the rank and exits the process with its code;
/// otherwise returns.
pub fn exit_if_rank() {
    if let Some(code) = rank_from_env() {
        std::process::exit(i32::from(code));
    }
}

fn rank_from_env() -> Option<u8> {
    let raw = std::env::var(RANK_SPEC_ENV).ok()?;
    let spec: RankSpec = match serde_json::from_str(&raw) {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "prism rank: {RANK_SPEC_ENV} is not a rank spec (JSON with rendezvous, token, rank, device, bind_ip, advertise_host, engine_threads): {e}"
            );
            return Some(2);
        }
    };
    match run_rank(&spec) {
        Ok(()) => Some(0),
        Err(e) => {
            eprintln!("prism rank {}: {e}", spec.rank);
            Some(1)
        }
    }
}

fn connect_rendezvous(address: &str, timeout: Duration) -> Result<TcpStream, String> {
    let deadline = Instant::now() + timeout;
    loop {
        match TcpStream::connect(address) {
            Ok(s) => return Ok(s),
            Err(e) if Instant::now() >= deadline => {
                return Err(format!("rendezvous {address} not reachable within {timeout:?}: {e}"));
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}

/// One rank's life (see the module docs): join, load, serve steps until told to stop or
/// the driver's connection closes. A failed step is reported (`StepFailed`) and ends the
/// rank: a rank never serves again after a failure.
///
/// # Errors
/// Why the rank stopped, when it was not the driver's doing.
pub fn run_rank(spec: &RankSpec) -> Result<(), String> {
    let bind_ip = spec.bind_ip.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
    let listener = HostCommListener::bind(bind_ip, &spec.advertise_host)
        .map_err(|e| format!("bind the host communicator on {bind_ip}: {e}"))?;
    let mut conn = connect_rendezvous(&spec.rendezvous, RANK_CONNECT_TIMEOUT)?;
    let _ = conn.set_nodelay(true);
    let hello = Msg::Hello { token: spec.token.clone(), rank: spec.rank, mesh_address: listener.address().to_owned() };
    write_msg(&mut conn, &hello).map_err(|e| e.to_string())?;
    let init = match read_msg(&mut conn) {
        Ok(Msg::Init(init)) => *init,
        Ok(other) => return Err(format!("expected the init spec, got {other:?}")),
        Err(e) => return Err(format!("the driver refused this rank or went away: {e}")),
    };
    let threads = spec.engine_threads.or(init.engine_threads).filter(|n| *n > 0);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.unwrap_or(0))
        .thread_name(|i| format!("prism-rank-{i}"))
        .build()
        .map_err(|e| format!("compute pool: {e}"))?;
    let load = || -> Result<Box<dyn StageBackend>, String> {
        if spec.rank >= init.sizes.world_size() || init.mesh.len() != init.sizes.world_size() {
            return Err(format!("rank {} is not in a mesh of {} addresses", spec.rank, init.mesh.len()));
        }
        let timeout = Duration::from_millis(init.collective_timeout_ms);
        let comm = listener.connect(spec.rank, &init.mesh, timeout).map_err(|e| e.to_string())?;
        let config = read_model_config(&init.model).map_err(|e| e.to_string())?;
        let coords = init.sizes.coords(spec.rank);
        let layers = init.sizes.stage_layers(coords.pp_rank, config.num_hidden_layers);
        let ctx = StageContext { layers, coords, device: spec.device, comm: Box::new(comm), init: init.clone() };
        pool.install(|| build_stage_backend(ctx)).map_err(|e| e.to_string())
    };
    let mut stage = match load() {
        Ok(s) => s,
        Err(message) => {
            let _ = write_msg(&mut conn, &Msg::LoadFailed { message: message.clone() });
            return Err(message);
        }
    };
    let loaded = Msg::Loaded { num_kv_blocks: stage.num_kv_blocks(), kv_bytes_per_token: stage.kv_bytes_per_token() };
    write_msg(&mut conn, &loaded).map_err(|e| e.to_string())?;
    // The whole serve loop runs inside the compute pool: a CPU stage's matmuls find their
    // pool without a hand-off to a worker thread and back on every step.
    pool.install(|| serve(&mut conn, stage.as_mut()))
}

/// How long a rank polls its connection for the next step after answering one before it
/// blocks in the read: back-to-back steps arrive without a thread wake-up, an idle rank
/// sleeps after this.
pub const NEXT_STEP_SPIN: Duration = Duration::from_millis(2);

/// Waits until `conn` has bytes to read (or is closed, or failed), polling for at most
/// `spin`; then the caller's blocking read returns without sleeping when the step came in
/// time.
fn spin_for_input(conn: &TcpStream, spin: Duration) {
    if conn.set_nonblocking(true).is_err() {
        return;
    }
    let until = Instant::now() + spin;
    let mut byte = [0u8; 1];
    loop {
        match conn.peek(&mut byte) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < until => {
                std::thread::yield_now();
            }
            _ => break,
        }
    }
    let _ = conn.set_nonblocking(false);
}

/// Runs every step the driver sends until it says stop or its connection closes.
fn serve(conn: &mut TcpStream, stage: &mut dyn StageBackend) -> Result<(), String> {
    loop {
        match read_msg(conn) {
            Ok(Msg::Step { seq, greedy, micro_batches, batch }) => {
                let started = Instant::now();
                match run_micro_batches(stage, &batch, greedy, micro_batches) {
                    Ok(outputs) => {
                        let compute_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                        write_msg(conn, &Msg::StepDone { seq, outputs, compute_ns }).map_err(|e| e.to_string())?;
                        spin_for_input(conn, NEXT_STEP_SPIN);
                    }
                    Err(e) => {
                        let message = format!("step {seq}: {e}");
                        let _ = write_msg(conn, &Msg::StepFailed { message: message.clone() });
                        return Err(message);
                    }
                }
            }
            Ok(Msg::Shutdown) => return Ok(()),
            Ok(other) => return Err(format!("unexpected control message {other:?}")),
            Err(WireError::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// The driver's listener for joining ranks, bound before the model loads so its address can
/// be reported (to the head, for ranks on other nodes) while the group forms.
#[derive(Debug)]
pub struct Rendezvous {
    listener: std::net::TcpListener,
    address: String,
    token: String,
}

impl Rendezvous {
    /// Binds `bind:0`; [`Rendezvous::address`] is `advertise_host:port`. Ranks must present
    /// `token`.
    ///
    /// # Errors
    /// The bind's I/O error.
    pub fn bind(bind_ip: std::net::IpAddr, advertise_host: &str, token: &str) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind((bind_ip, 0))?;
        let address = format!("{advertise_host}:{}", listener.local_addr()?.port());
        Ok(Self { listener, address, token: token.to_owned() })
    }

    /// `host:port` ranks connect to.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// The group's secret.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// The listener (the driver accepts on it).
    pub fn listener(&self) -> &std::net::TcpListener {
        &self.listener
    }
}
