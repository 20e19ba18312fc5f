//! Collectives between the ranks of one replica. [`Communicator`] is what a backend calls;
//! [`HostComm`] implements it over TCP between processes (any host): a full mesh of
//! connections, set up from every rank's listen address (exchanged through the driver's
//! rendezvous). The CUDA backend has its own device communicator (NCCL) beside it.
//!
//! Every operation is bounded by the communicator's timeout, so a dead or frozen peer fails
//! the step (`CommError::Timeout` / `PeerGone`) instead of hanging it, and [`AbortHandle::abort`]
//! makes every pending and later operation fail at once (a replica declared failed or
//! stopping must not wait for its timeout).
//!
//! Determinism: an all-reduce sums contributions in ascending rank order on every member, so
//! every member ends with bitwise the same result (tensor-parallel ranks must hold the same
//! residual stream).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Why a collective failed.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// A peer did not take part within the timeout (frozen, or far slower).
    #[error("rank {peer} did not answer within {timeout:?}")]
    Timeout {
        /// The peer waited for.
        peer: usize,
        /// The communicator's timeout.
        timeout: Duration,
    },
    /// A peer's connection closed or failed (the process died).
    #[error("rank {peer} is gone: {message}")]
    PeerGone {
        /// The peer.
        peer: usize,
        /// The I/O error.
        message: String,
    },
    /// [`AbortHandle::abort`] was called.
    #[error("the communicator was aborted")]
    Aborted,
    /// Inconsistent call (a group without this rank, buffers of the wrong size).
    #[error("invalid collective: {0}")]
    Invalid(String),
    /// Setting up the mesh failed.
    #[error("communicator setup failed: {0}")]
    Setup(String),
}

/// Makes a communicator's operations fail with [`CommError::Aborted`], from any thread.
#[derive(Clone, Debug, Default)]
pub struct AbortHandle(Arc<AtomicBool>);

impl AbortHandle {
    /// Aborts: pending operations return within a short poll interval, later ones at once.
    pub fn abort(&self) {
        self.0.store(true, Ordering::SeqCst);
    }

    /// Whether [`AbortHandle::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Collectives over f32 host buffers between the ranks of one replica. `group`s are global
/// ranks in ascending order that include this rank; every member calls the same operation
/// with the same group and length, in the same order.
pub trait Communicator: Send {
    /// This rank (global).
    fn rank(&self) -> usize;

    /// Ranks in the whole mesh.
    fn world_size(&self) -> usize;

    /// Replaces `buf` with the element-wise sum over `group`, summed in ascending rank order
    /// (bitwise equal on every member).
    ///
    /// # Errors
    /// [`CommError`] when a member is gone, too slow, or the communicator was aborted.
    fn all_reduce_sum(&mut self, group: &[usize], buf: &mut [f32]) -> Result<(), CommError>;

    /// Concatenates every member's `local` (equal lengths) into `out` in group order
    /// (`out.len() == group.len() * local.len()`).
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_sum`].
    fn all_gather(&mut self, group: &[usize], local: &[f32], out: &mut [f32]) -> Result<(), CommError>;

    /// Sends `buf` to `peer` (returns once it is handed to the transport).
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_sum`].
    fn send(&mut self, peer: usize, buf: &[f32]) -> Result<(), CommError>;

    /// Receives exactly `buf.len()` values from `peer`'s matching [`Communicator::send`].
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_sum`]; [`CommError::Invalid`] when the peer sent
    /// another length.
    fn recv(&mut self, peer: usize, buf: &mut [f32]) -> Result<(), CommError>;

    /// Returns once every member of `group` has called it.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce_sum`].
    fn barrier(&mut self, group: &[usize]) -> Result<(), CommError>;

    /// The handle that aborts this communicator.
    fn abort_handle(&self) -> AbortHandle;
}

/// A rank's listener, bound before the mesh's addresses are exchanged.
#[derive(Debug)]
pub struct HostCommListener {
    listener: std::net::TcpListener,
    address: String,
}

impl HostCommListener {
    /// Binds `bind_ip:0`; [`HostCommListener::address`] is `advertise_host:port`.
    ///
    /// # Errors
    /// The bind's I/O error.
    pub fn bind(bind_ip: std::net::IpAddr, advertise_host: &str) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind((bind_ip, 0))?;
        let address = format!("{advertise_host}:{}", listener.local_addr()?.port());
        Ok(Self { listener, address })
    }

    /// Where the other ranks connect (`host:port`).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Forms the mesh: connects to every lower rank's address in `addresses` (indexed by
    /// rank) and accepts every higher rank, all within `timeout`; operations then use
    /// `timeout` as their bound.
    ///
    /// # Errors
    /// [`CommError::Setup`] when a peer cannot be reached or does not connect in time.
    pub fn connect(self, rank: usize, addresses: &[String], timeout: Duration) -> Result<HostComm, CommError> {
        let _ = (&self.listener, rank, addresses, timeout);
        Err(CommError::Setup("not built yet".into()))
    }
}

/// [`Communicator`] over TCP between processes.
#[derive(Debug)]
pub struct HostComm {
    rank: usize,
    world: usize,
    abort: AbortHandle,
}

impl Communicator for HostComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world
    }
    fn all_reduce_sum(&mut self, _group: &[usize], _buf: &mut [f32]) -> Result<(), CommError> {
        Err(CommError::Invalid("not built yet".into()))
    }
    fn all_gather(&mut self, _group: &[usize], _local: &[f32], _out: &mut [f32]) -> Result<(), CommError> {
        Err(CommError::Invalid("not built yet".into()))
    }
    fn send(&mut self, _peer: usize, _buf: &[f32]) -> Result<(), CommError> {
        Err(CommError::Invalid("not built yet".into()))
    }
    fn recv(&mut self, _peer: usize, _buf: &mut [f32]) -> Result<(), CommError> {
        Err(CommError::Invalid("not built yet".into()))
    }
    fn barrier(&mut self, _group: &[usize]) -> Result<(), CommError> {
        Err(CommError::Invalid("not built yet".into()))
    }
    fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }
}
