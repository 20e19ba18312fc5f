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

use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};

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
    /// Each connection opens with a handshake (magic, the connecting rank, the world size)
    /// that the accepting rank answers with one byte; a connection naming an unknown or
    /// already connected rank, or another world size, is closed and the rank keeps waiting
    /// for the right one. Lower ranks first, then higher: rank `r` accepts only after its own
    /// connections are answered, which rank 0 (accepting at once) starts, so setup cannot
    /// deadlock.
    ///
    /// # Errors
    /// [`CommError::Setup`] when a peer cannot be reached or does not connect in time;
    /// [`CommError::Invalid`] when `rank` is not below `addresses.len()`.
    pub fn connect(self, rank: usize, addresses: &[String], timeout: Duration) -> Result<HostComm, CommError> {
        let world = addresses.len();
        if rank >= world {
            return Err(CommError::Invalid(format!("rank {rank} is outside a mesh of {world} addresses")));
        }
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for (peer, address) in addresses.iter().enumerate().take(rank) {
            streams[peer] = Some(connect_to(peer, address, rank, world, deadline)?);
        }
        self.listener.set_nonblocking(true).map_err(|e| CommError::Setup(format!("listener: {e}")))?;
        while streams.iter().enumerate().any(|(peer, s)| peer > rank && s.is_none()) {
            match self.listener.accept() {
                Ok((stream, _)) => {
                    if let Some(peer) = accept_handshake(&stream, rank, world, &streams, deadline) {
                        streams[peer] = Some(stream);
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing = (rank + 1..world).filter(|&p| streams[p].is_none()).collect::<Vec<_>>();
                        return Err(CommError::Setup(format!(
                            "rank {rank}: ranks {missing:?} did not connect within {timeout:?}"
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(CommError::Setup(format!("rank {rank}: accept: {e}"))),
            }
        }
        let mut peers = Vec::with_capacity(world);
        for stream in streams {
            peers.push(match stream {
                Some(stream) => {
                    let setup = |e: std::io::Error| CommError::Setup(format!("socket options: {e}"));
                    stream.set_nodelay(true).map_err(setup)?;
                    stream.set_nonblocking(true).map_err(setup)?;
                    Some(Peer { stream, inbox: Inbox::default(), gone: None })
                }
                None => None,
            });
        }
        Ok(HostComm {
            rank,
            world,
            abort: AbortHandle::default(),
            timeout,
            peers,
            failed: None,
            algorithm: AllReduceAlgorithm::default(),
        })
    }
}

const MAGIC: u32 = 0x5052_4d43; // "PRMC"
const HANDSHAKE_LEN: usize = 12;
const HEADER_LEN: usize = 16;
/// Longest a poll waits before the abort flag and the deadline are checked again.
const POLL_SLICE_MS: u16 = 20;

fn setup_err(rank: usize, peer: usize, what: &str, e: impl std::fmt::Display) -> CommError {
    CommError::Setup(format!("rank {rank} -> rank {peer}: {what}: {e}"))
}

/// Connects to `peer` (retrying refusals until `deadline`), sends the handshake and waits for
/// the accept byte.
fn connect_to(
    peer: usize,
    address: &str,
    rank: usize,
    world: usize,
    deadline: Instant,
) -> Result<TcpStream, CommError> {
    let target = address
        .to_socket_addrs()
        .map_err(|e| setup_err(rank, peer, &format!("address {address:?}"), e))?
        .next()
        .ok_or_else(|| setup_err(rank, peer, &format!("address {address:?}"), "resolves to nothing"))?;
    let mut stream = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(setup_err(rank, peer, &format!("connect to {address}"), "timed out"));
        }
        match TcpStream::connect_timeout(&target, left) {
            Ok(stream) => break stream,
            Err(e) if matches!(e.kind(), ErrorKind::ConnectionRefused | ErrorKind::Interrupted) => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => return Err(setup_err(rank, peer, &format!("connect to {address}"), e)),
        }
    };
    let io = |e: std::io::Error| setup_err(rank, peer, "handshake", e);
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_write_timeout(Some(left)).map_err(io)?;
    stream.set_read_timeout(Some(left)).map_err(io)?;
    let mut hello = [0u8; HANDSHAKE_LEN];
    hello[0..4].copy_from_slice(&MAGIC.to_le_bytes());
    hello[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
    hello[8..12].copy_from_slice(&(world as u32).to_le_bytes());
    stream.write_all(&hello).map_err(io)?;
    let mut ack = [0u8; 1];
    stream.read_exact(&mut ack).map_err(|e| setup_err(rank, peer, "handshake refused", e))?;
    Ok(stream)
}

/// Reads a connecting rank's handshake; `Some(peer)` (after answering it) when it names a
/// higher rank of this world not yet connected.
fn accept_handshake(
    stream: &TcpStream,
    rank: usize,
    world: usize,
    streams: &[Option<TcpStream>],
    deadline: Instant,
) -> Option<usize> {
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    stream.set_nonblocking(false).ok()?;
    stream.set_read_timeout(Some(left)).ok()?;
    stream.set_write_timeout(Some(left)).ok()?;
    let mut hello = [0u8; HANDSHAKE_LEN];
    (&*stream).read_exact(&mut hello).ok()?;
    let field = |i: usize| u32::from_le_bytes([hello[i], hello[i + 1], hello[i + 2], hello[i + 3]]);
    let peer = field(4) as usize;
    let valid = field(0) == MAGIC && field(8) as usize == world && peer > rank && peer < world;
    if !valid || streams[peer].is_some() {
        tracing::warn!(rank, peer, "host communicator: refused a connection with a bad or duplicate handshake");
        return None;
    }
    (&*stream).write_all(&[1]).ok()?;
    Some(peer)
}

/// How [`HostComm`] computes an all-reduce; both sum in ascending group order, so the result
/// is bitwise the same either way.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AllReduceAlgorithm {
    /// Every member sends its buffer to every other member and sums all of them itself: one
    /// network hop, `n-1` sends per member (the default: on loopback and for the hidden
    /// states of a step, latency is what counts; see docs/benchmarks.md).
    #[default]
    GatherAll,
    /// `group[0]` receives every contribution, sums them and sends the result back: two hops,
    /// but `2(n-1)` transfers in all instead of `n(n-1)`.
    ReduceBroadcast,
}

/// Frame kinds: a frame received must be the kind the operation expects, so members calling
/// different operations fail with [`CommError::Invalid`] instead of mixing up buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
enum Tag {
    AllReduce = 1,
    Reduced = 2,
    AllGather = 3,
    Send = 4,
    Barrier = 5,
}

/// Bytes received from a peer and not consumed yet: whole frames and the start of the next.
#[derive(Debug, Default)]
struct Inbox {
    data: Vec<u8>,
    start: usize,
    end: usize,
}

impl Inbox {
    /// The header of the first frame, when it is here: (tag, length in f32 values).
    fn header(&self) -> Option<(u32, usize)> {
        let h = self.data.get(self.start..self.start + HEADER_LEN).filter(|_| self.end - self.start >= HEADER_LEN)?;
        let tag = u32::from_le_bytes([h[0], h[1], h[2], h[3]]);
        let mut len = [0u8; 8];
        len.copy_from_slice(&h[8..16]);
        Some((tag, usize::try_from(u64::from_le_bytes(len)).unwrap_or(usize::MAX)))
    }

    /// The first frame's payload, once all of it is here.
    fn payload(&self) -> Option<&[u8]> {
        let (_, len) = self.header()?;
        let bytes = len.checked_mul(4)?;
        let from = self.start + HEADER_LEN;
        (self.end - from >= bytes).then(|| &self.data[from..from + bytes])
    }

    fn pop(&mut self) {
        if let Some((_, len)) = self.header() {
            self.start += HEADER_LEN + len * 4;
            if self.start == self.end {
                self.start = 0;
                self.end = 0;
            }
        }
    }

    /// Makes room to read into: the rest of a partly received frame, else 64 KiB.
    fn spare(&mut self) -> &mut [u8] {
        let held = self.end - self.start;
        let want = match self.header() {
            Some((_, len)) => (HEADER_LEN + len.saturating_mul(4)).saturating_sub(held).max(HEADER_LEN),
            None => 64 << 10,
        }
        .min(64 << 20);
        if self.data.len() - self.end < want {
            self.data.copy_within(self.start..self.end, 0);
            self.start = 0;
            self.end = held;
            if self.data.len() < held + want {
                self.data.resize(held + want, 0);
            }
        }
        &mut self.data[self.end..]
    }
}

#[derive(Debug)]
struct Peer {
    stream: TcpStream,
    inbox: Inbox,
    /// Why the connection ended (EOF or an I/O error); frames already in the inbox stay usable.
    gone: Option<String>,
}

impl Peer {
    /// Reads whatever the socket holds without blocking.
    fn drain(&mut self) {
        while self.gone.is_none() {
            let spare = self.inbox.spare();
            match (&self.stream).read(spare) {
                Ok(0) => self.gone = Some("connection closed".into()),
                Ok(n) => self.inbox.end += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => self.gone = Some(e.to_string()),
            }
        }
    }
}

/// One frame to write: header, then payload.
struct Outgoing<'a> {
    peer: usize,
    header: [u8; HEADER_LEN],
    payload: &'a [u8],
    written: usize,
}

impl<'a> Outgoing<'a> {
    fn new(peer: usize, tag: Tag, values: &'a [f32]) -> Self {
        let mut header = [0u8; HEADER_LEN];
        header[0..4].copy_from_slice(&(tag as u32).to_le_bytes());
        header[8..16].copy_from_slice(&(values.len() as u64).to_le_bytes());
        Self { peer, header, payload: bytemuck::cast_slice(values), written: 0 }
    }

    fn done(&self) -> bool {
        self.written == HEADER_LEN + self.payload.len()
    }
}

/// [`Communicator`] over TCP between processes: one non-blocking connection per peer, driven
/// from the calling thread. An operation writes its frames and reads every peer's socket into
/// that peer's inbox in one `poll` loop, so two ranks sending each other large buffers at
/// once never both block on full kernel buffers, and a small message costs one write and one
/// read (no thread hand-off). The loop wakes at least every 20 ms to check the abort flag and
/// the deadline. The first error fails the communicator for good: every later operation
/// returns it again, so a half-synchronised group never carries on.
#[derive(Debug)]
pub struct HostComm {
    rank: usize,
    world: usize,
    abort: AbortHandle,
    timeout: Duration,
    /// Indexed by rank; `None` at this rank.
    peers: Vec<Option<Peer>>,
    failed: Option<CommError>,
    algorithm: AllReduceAlgorithm,
}

impl HostComm {
    /// Picks the all-reduce algorithm (every member of a group must use the same one).
    pub fn set_all_reduce_algorithm(&mut self, algorithm: AllReduceAlgorithm) {
        self.algorithm = algorithm;
    }

    /// Runs `op` unless the communicator already failed, and remembers its error.
    fn guarded<T>(&mut self, op: impl FnOnce(&mut Self) -> Result<T, CommError>) -> Result<T, CommError> {
        if self.abort.is_aborted() {
            return Err(CommError::Aborted);
        }
        if let Some(e) = &self.failed {
            return Err(copy_error(e));
        }
        op(self).inspect_err(|e| self.failed = Some(copy_error(e)))
    }

    fn check_group(&self, group: &[usize]) -> Result<(), CommError> {
        if group.windows(2).any(|w| w[0] >= w[1]) {
            return Err(CommError::Invalid(format!("group {group:?} is not in ascending rank order")));
        }
        if group.last().is_some_and(|&last| last >= self.world) {
            return Err(CommError::Invalid(format!("group {group:?} has a rank outside a world of {}", self.world)));
        }
        if !group.contains(&self.rank) {
            return Err(CommError::Invalid(format!("group {group:?} does not contain rank {}", self.rank)));
        }
        Ok(())
    }

    fn check_peer(&self, peer: usize) -> Result<(), CommError> {
        if peer >= self.world || peer == self.rank {
            return Err(CommError::Invalid(format!(
                "peer {peer} is not another rank of a world of {} (this is rank {})",
                self.world, self.rank
            )));
        }
        Ok(())
    }

    fn peer(&mut self, peer: usize) -> &mut Peer {
        // Callers check `peer` against the world and this rank first.
        self.peers[peer].as_mut().expect("a peer other than this rank has a connection")
    }

    /// Writes `outgoing` and waits until each of `expect` has a whole frame of kind `tag` in
    /// its inbox, reading from every peer meanwhile; `expect_len` checks the frames' length
    /// as soon as their header is here.
    fn exchange(
        &mut self,
        outgoing: &mut [Outgoing<'_>],
        expect: &[usize],
        tag: Tag,
        expect_len: Option<usize>,
    ) -> Result<(), CommError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            for out in outgoing.iter_mut().filter(|o| !o.done()) {
                write_some(self.peers[out.peer].as_mut().expect("outgoing peer is connected"), out)?;
            }
            for peer in self.peers.iter_mut().flatten() {
                peer.drain();
            }
            let mut waiting = None;
            for &p in expect {
                let inbox = &self.peer(p).inbox;
                if let Some((got, len)) = inbox.header() {
                    if got != tag as u32 {
                        return Err(CommError::Invalid(format!(
                            "rank {p} sent a frame of kind {got} where kind {} was expected (members called different operations)",
                            tag as u32
                        )));
                    }
                    if let Some(want) = expect_len.filter(|&want| want != len) {
                        return Err(CommError::Invalid(format!("rank {p} sent {len} values, {want} expected")));
                    }
                }
                if inbox.payload().is_none() {
                    if let Some(why) = &self.peer(p).gone {
                        return Err(CommError::PeerGone { peer: p, message: why.clone() });
                    }
                    waiting.get_or_insert(p);
                }
            }
            let waiting = waiting.or_else(|| outgoing.iter().find(|o| !o.done()).map(|o| o.peer));
            let Some(waiting) = waiting else { return Ok(()) };
            if self.abort.is_aborted() {
                return Err(CommError::Aborted);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(CommError::Timeout { peer: waiting, timeout: self.timeout });
            }
            self.wait(outgoing, left)?;
        }
    }

    /// Polls until a socket can make progress, at most `left` or one slice.
    fn wait(&self, outgoing: &[Outgoing<'_>], left: Duration) -> Result<(), CommError> {
        let mut fds = Vec::with_capacity(self.world);
        for (rank, peer) in self.peers.iter().enumerate() {
            let Some(peer) = peer.as_ref().filter(|p| p.gone.is_none()) else { continue };
            let mut events = PollFlags::POLLIN;
            if outgoing.iter().any(|o| o.peer == rank && !o.done()) {
                events |= PollFlags::POLLOUT;
            }
            fds.push(PollFd::new(peer.stream.as_fd(), events));
        }
        let slice = u16::try_from(left.as_millis()).unwrap_or(u16::MAX).clamp(1, POLL_SLICE_MS);
        match poll(&mut fds, PollTimeout::from(slice)) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
            Err(e) => Err(CommError::Invalid(format!("poll failed: {e}"))),
        }
    }

    fn all_reduce_gather_all(&mut self, group: &[usize], buf: &mut [f32]) -> Result<(), CommError> {
        let others: Vec<usize> = group.iter().copied().filter(|&p| p != self.rank).collect();
        {
            let mut out: Vec<Outgoing<'_>> = others.iter().map(|&p| Outgoing::new(p, Tag::AllReduce, buf)).collect();
            self.exchange(&mut out, &others, Tag::AllReduce, Some(buf.len()))?;
        }
        let own = self.rank;
        let mut acc: Option<Vec<f32>> = None;
        for &member in group {
            let add = |acc: &mut Vec<f32>, values: Contribution<'_>| match values {
                Contribution::Own(own) => acc.iter_mut().zip(own).for_each(|(a, v)| *a += v),
                Contribution::Bytes(bytes) => {
                    acc.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(a, b)| *a += le_f32(b))
                }
            };
            let values = if member == own {
                Contribution::Own(buf)
            } else {
                Contribution::Bytes(self.peers[member].as_ref().and_then(|p| p.inbox.payload()).unwrap_or_default())
            };
            match &mut acc {
                None => acc = Some(values.to_vec()),
                Some(acc) => add(acc, values),
            }
        }
        if let Some(acc) = acc {
            buf.copy_from_slice(&acc);
        }
        for &p in &others {
            self.peer(p).inbox.pop();
        }
        Ok(())
    }

    fn all_reduce_reduce_broadcast(&mut self, group: &[usize], buf: &mut [f32]) -> Result<(), CommError> {
        let root = group[0];
        if self.rank != root {
            let mut out = [Outgoing::new(root, Tag::AllReduce, buf)];
            self.exchange(&mut out, &[], Tag::AllReduce, None)?;
            self.exchange(&mut [], &[root], Tag::Reduced, Some(buf.len()))?;
            let inbox = &mut self.peer(root).inbox;
            copy_payload(inbox.payload().unwrap_or_default(), buf);
            inbox.pop();
            return Ok(());
        }
        let others = &group[1..];
        self.exchange(&mut [], others, Tag::AllReduce, Some(buf.len()))?;
        // The root is group[0]: its own buffer is the first term of the ascending-order sum.
        for &p in others {
            let inbox = &mut self.peer(p).inbox;
            let bytes = inbox.payload().unwrap_or_default();
            buf.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(a, b)| *a += le_f32(b));
            inbox.pop();
        }
        let mut out: Vec<Outgoing<'_>> = others.iter().map(|&p| Outgoing::new(p, Tag::Reduced, buf)).collect();
        self.exchange(&mut out, &[], Tag::Reduced, None)
    }
}

/// One member's part of an all-reduce: this rank's buffer or a peer's frame payload.
enum Contribution<'a> {
    Own(&'a [f32]),
    Bytes(&'a [u8]),
}

impl Contribution<'_> {
    fn to_vec(&self) -> Vec<f32> {
        match self {
            Contribution::Own(values) => values.to_vec(),
            Contribution::Bytes(bytes) => bytes.chunks_exact(4).map(le_f32).collect(),
        }
    }
}

fn le_f32(b: &[u8]) -> f32 {
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

fn copy_payload(bytes: &[u8], out: &mut [f32]) {
    out.iter_mut().zip(bytes.chunks_exact(4)).for_each(|(o, b)| *o = le_f32(b));
}

/// Writes as much of `out` as the socket takes without blocking.
fn write_some(peer: &mut Peer, out: &mut Outgoing<'_>) -> Result<(), CommError> {
    while !out.done() {
        let result = if out.written < HEADER_LEN {
            let slices = [IoSlice::new(&out.header[out.written..]), IoSlice::new(out.payload)];
            (&peer.stream).write_vectored(&slices)
        } else {
            (&peer.stream).write(&out.payload[out.written - HEADER_LEN..])
        };
        match result {
            Ok(0) => return Err(CommError::PeerGone { peer: out.peer, message: "connection closed".into() }),
            Ok(n) => out.written += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(CommError::PeerGone { peer: out.peer, message: e.to_string() }),
        }
    }
    Ok(())
}

/// The same error again, for a communicator that failed earlier.
fn copy_error(e: &CommError) -> CommError {
    match e {
        CommError::Timeout { peer, timeout } => CommError::Timeout { peer: *peer, timeout: *timeout },
        CommError::PeerGone { peer, message } => CommError::PeerGone { peer: *peer, message: message.clone() },
        CommError::Aborted => CommError::Aborted,
        CommError::Invalid(m) => CommError::Invalid(m.clone()),
        CommError::Setup(m) => CommError::Setup(m.clone()),
    }
}

impl Communicator for HostComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_reduce_sum(&mut self, group: &[usize], buf: &mut [f32]) -> Result<(), CommError> {
        self.guarded(|c| {
            c.check_group(group)?;
            match (group.len(), c.algorithm) {
                (1, _) => Ok(()),
                (_, AllReduceAlgorithm::GatherAll) => c.all_reduce_gather_all(group, buf),
                (_, AllReduceAlgorithm::ReduceBroadcast) => c.all_reduce_reduce_broadcast(group, buf),
            }
        })
    }

    fn all_gather(&mut self, group: &[usize], local: &[f32], out: &mut [f32]) -> Result<(), CommError> {
        self.guarded(|c| {
            c.check_group(group)?;
            if out.len() != group.len() * local.len() {
                return Err(CommError::Invalid(format!(
                    "all-gather output holds {} values, {} members x {} expected",
                    out.len(),
                    group.len(),
                    local.len()
                )));
            }
            let others: Vec<usize> = group.iter().copied().filter(|&p| p != c.rank).collect();
            let mut outgoing: Vec<Outgoing<'_>> =
                others.iter().map(|&p| Outgoing::new(p, Tag::AllGather, local)).collect();
            c.exchange(&mut outgoing, &others, Tag::AllGather, Some(local.len()))?;
            for (slot, &member) in out.chunks_exact_mut(local.len().max(1)).zip(group) {
                if member == c.rank {
                    slot.copy_from_slice(local);
                } else {
                    let inbox = &mut c.peer(member).inbox;
                    copy_payload(inbox.payload().unwrap_or_default(), slot);
                    inbox.pop();
                }
            }
            if local.is_empty() {
                others.iter().for_each(|&p| c.peer(p).inbox.pop());
            }
            Ok(())
        })
    }

    fn send(&mut self, peer: usize, buf: &[f32]) -> Result<(), CommError> {
        self.guarded(|c| {
            c.check_peer(peer)?;
            c.exchange(&mut [Outgoing::new(peer, Tag::Send, buf)], &[], Tag::Send, None)
        })
    }

    fn recv(&mut self, peer: usize, buf: &mut [f32]) -> Result<(), CommError> {
        self.guarded(|c| {
            c.check_peer(peer)?;
            c.exchange(&mut [], &[peer], Tag::Send, Some(buf.len()))?;
            let inbox = &mut c.peer(peer).inbox;
            copy_payload(inbox.payload().unwrap_or_default(), buf);
            inbox.pop();
            Ok(())
        })
    }

    fn barrier(&mut self, group: &[usize]) -> Result<(), CommError> {
        self.guarded(|c| {
            c.check_group(group)?;
            let others: Vec<usize> = group.iter().copied().filter(|&p| p != c.rank).collect();
            let mut outgoing: Vec<Outgoing<'_>> = others.iter().map(|&p| Outgoing::new(p, Tag::Barrier, &[])).collect();
            c.exchange(&mut outgoing, &others, Tag::Barrier, Some(0))?;
            others.iter().for_each(|&p| c.peer(p).inbox.pop());
            Ok(())
        })
    }

    fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }
}
