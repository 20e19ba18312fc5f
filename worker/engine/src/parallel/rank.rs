//! The rank process: started by a worker agent (or by the driver for ranks on its own node)
//! with a [`RankSpec`] in the `PRISM_RANK_SPEC` environment variable, it connects to the
//! driver's [`Rendezvous`], presents the group token, receives the [`super::stage::InitSpec`],
//! forms the host mesh, loads its shard and then runs every step the driver broadcasts until
//! the driver says stop or its connection closes (then it exits: a rank never outlives its
//! driver).

use std::process::ExitCode;

/// The environment variable that turns any Prism binary into a rank process.
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

/// Runs the rank process when [`RANK_SPEC_ENV`] is set; every Prism binary calls this first
/// thing in `main` and returns its exit code when it is `Some`.
pub fn main_from_env() -> Option<ExitCode> {
    let spec = std::env::var(RANK_SPEC_ENV).ok()?;
    let _ = spec;
    Some(ExitCode::FAILURE)
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
