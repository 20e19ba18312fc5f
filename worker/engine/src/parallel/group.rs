//! The driver's side of the control connections: accepting joins on the rendezvous
//! ([`accept_joins`]: token, rank range and duplicates checked, bad joins refused with a
//! logged reason) and one [`RankLink`] per joined rank (a reader thread turns its frames into
//! a channel, so the driver waits for answers with a deadline while it polls the replica's
//! stop requests; a connection that fails or a `StepFailed` aborts rank 0's communicator at
//! once, so rank 0 never waits out its timeout on a dead peer).

use std::collections::BTreeMap;
use std::net::TcpStream;
use std::sync::mpsc::{Receiver, RecvTimeoutError, TryRecvError, channel};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use super::comm::AbortHandle;
use super::rank::Rendezvous;
use super::spawn::RankProcess;
use super::wire::{Msg, WireError, read_msg, write_msg};
use crate::backend::{BackendError, StepControl};

/// How long a new connection may take to say hello.
const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// How often waits poll the replica's stop request.
pub const POLL: Duration = Duration::from_millis(10);

/// A joined rank: its hello and its connection.
#[derive(Debug)]
pub struct Joined {
    /// Its host-communicator address.
    pub mesh_address: String,
    /// The control connection.
    pub stream: TcpStream,
}

/// Fails when a child rank process has exited.
pub fn check_children(children: &mut [RankProcess]) -> Result<(), BackendError> {
    for c in children.iter_mut() {
        if let Ok(Some(status)) = c.try_wait() {
            return Err(BackendError::Device(format!("rank {} (pid {}) exited: {status}", c.rank, c.pid())));
        }
    }
    Ok(())
}

/// Reads one hello and decides on it; `Err` is the refusal reason.
fn hello(
    stream: &mut TcpStream,
    rdv: &Rendezvous,
    world: usize,
    expected: &BTreeMap<usize, Option<Joined>>,
) -> Result<(usize, String), String> {
    stream.set_nonblocking(false).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(HELLO_TIMEOUT)).map_err(|e| e.to_string())?;
    let (token, rank, mesh_address) = match read_msg(stream) {
        Ok(Msg::Hello { token, rank, mesh_address }) => (token, rank, mesh_address),
        Ok(other) => return Err(format!("expected hello, got {other:?}")),
        Err(e) => return Err(e.to_string()),
    };
    if token != rdv.token() {
        return Err(format!("rank {rank} presented a wrong group token"));
    }
    match expected.get(&rank) {
        None if rank >= world => Err(format!("rank {rank} is out of range (world size {world})")),
        None => Err(format!("rank {rank} is not expected to join (it runs in the driver)")),
        Some(Some(_)) => Err(format!("rank {rank} joined twice")),
        Some(None) => Ok((rank, mesh_address)),
    }
}

/// Accepts joins until every rank of `expected` has said hello, or `deadline` (error
/// naming the missing ranks), or a child exits. Refused connections are logged and closed.
///
/// # Errors
/// [`BackendError::Device`] naming the ranks that did not join or the child that exited.
pub fn accept_joins(
    rdv: &Rendezvous,
    world: usize,
    expected: &[usize],
    deadline: Instant,
    children: &mut [RankProcess],
    control: &StepControl,
) -> Result<BTreeMap<usize, Joined>, BackendError> {
    let mut joined: BTreeMap<usize, Option<Joined>> = expected.iter().map(|&r| (r, None)).collect();
    let listener = rdv.listener();
    listener.set_nonblocking(true).map_err(|e| BackendError::Device(format!("rendezvous: {e}")))?;
    while joined.values().any(Option::is_none) {
        if control.stop_requested().is_some() {
            return Err(BackendError::Cancelled);
        }
        check_children(children)?;
        if Instant::now() >= deadline {
            let missing: Vec<usize> = joined.iter().filter(|(_, j)| j.is_none()).map(|(r, _)| *r).collect();
            return Err(BackendError::Device(format!(
                "ranks {missing:?} did not join the rendezvous {} in time",
                rdv.address()
            )));
        }
        match listener.accept() {
            Ok((mut stream, peer)) => match hello(&mut stream, rdv, world, &joined) {
                Ok((rank, mesh_address)) => {
                    let _ = stream.set_read_timeout(None);
                    let _ = stream.set_nodelay(true);
                    tracing::debug!(rank, %peer, mesh_address, "rank joined");
                    joined.insert(rank, Some(Joined { mesh_address, stream }));
                }
                Err(reason) => tracing::warn!(%peer, reason, "refused a rank's connection to the rendezvous"),
            },
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(e) => tracing::warn!(error = %e, "rendezvous accept failed"),
        }
    }
    Ok(joined.into_iter().filter_map(|(r, j)| j.map(|j| (r, j))).collect())
}

/// What a rank's reader thread saw.
pub type Incoming = Result<Msg, String>;

/// The driver's control connection to one rank.
pub struct RankLink {
    /// Global rank.
    pub rank: usize,
    stream: TcpStream,
    rx: Receiver<Incoming>,
}

impl RankLink {
    /// Starts the reader thread. A failed connection or a `StepFailed`/`LoadFailed` aborts
    /// `abort` (rank 0's communicator, once it exists).
    ///
    /// # Errors
    /// When the stream cannot be cloned or the thread not started.
    pub fn new(rank: usize, stream: TcpStream, abort: Arc<OnceLock<AbortHandle>>) -> Result<Self, BackendError> {
        let dev = |e: std::io::Error| BackendError::Device(format!("rank {rank}'s control connection: {e}"));
        let mut reader = stream.try_clone().map_err(dev)?;
        let (tx, rx) = channel();
        std::thread::Builder::new()
            .name(format!("prism-rank-link-{rank}"))
            .spawn(move || {
                loop {
                    let msg = read_msg(&mut reader);
                    let fatal = match &msg {
                        Ok(Msg::StepFailed { .. } | Msg::LoadFailed { .. }) | Err(_) => true,
                        Ok(_) => false,
                    };
                    if fatal && let Some(a) = abort.get() {
                        a.abort();
                    }
                    let item = msg.map_err(|e| match e {
                        WireError::Io(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                            "its connection closed (the process exited)".to_owned()
                        }
                        e => e.to_string(),
                    });
                    if tx.send(item).is_err() || fatal {
                        return;
                    }
                }
            })
            .map_err(dev)?;
        Ok(Self { rank, stream, rx })
    }

    /// Sends a message.
    ///
    /// # Errors
    /// [`BackendError::Device`] when the connection is gone.
    pub fn send(&mut self, msg: &Msg) -> Result<(), BackendError> {
        write_msg(&mut self.stream, msg).map_err(|e| BackendError::Device(format!("rank {}: {e}", self.rank)))
    }

    /// Sends a pre-encoded frame.
    ///
    /// # Errors
    /// [`BackendError::Device`] when the connection is gone.
    pub fn send_frame(&mut self, frame: &[u8]) -> Result<(), BackendError> {
        use std::io::Write;
        self.stream.write_all(frame).map_err(|e| BackendError::Device(format!("rank {}: {e}", self.rank)))
    }

    /// The next message, waiting until `deadline` while polling `control` (a stop request
    /// ends the wait with [`BackendError::Cancelled`]) and `children`.
    ///
    /// # Errors
    /// [`BackendError::Device`] naming the rank when its connection failed, it sent a
    /// failure, or it did not answer by `deadline`.
    pub fn recv(&mut self, deadline: Instant, control: &StepControl, what: &str) -> Result<Msg, BackendError> {
        loop {
            if control.stop_requested().is_some() {
                return Err(BackendError::Cancelled);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(BackendError::Device(format!("rank {} did not answer {what} in time", self.rank)));
            }
            match self.rx.recv_timeout(POLL.min(deadline - now)) {
                Ok(item) => return self.answer(item),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return Err(self.gone()),
            }
        }
    }

    /// As [`RankLink::recv`], but polls the channel without sleeping between `spin.0` and
    /// `spin.1` (when the answer is expected; before it, it waits as `recv` does): an answer
    /// that comes in that window is taken without a thread wake-up. The window is the
    /// caller's bound on the spinning.
    ///
    /// # Errors
    /// As [`RankLink::recv`].
    pub fn recv_spinning(
        &mut self,
        deadline: Instant,
        control: &StepControl,
        what: &str,
        spin: (Instant, Instant),
    ) -> Result<Msg, BackendError> {
        let (from, until) = spin;
        loop {
            let now = Instant::now();
            if now >= until.min(deadline) {
                return self.recv(deadline, control, what);
            }
            if control.stop_requested().is_some() {
                return Err(BackendError::Cancelled);
            }
            if now < from {
                match self.rx.recv_timeout((from - now).min(POLL)) {
                    Ok(item) => return self.answer(item),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return Err(self.gone()),
                }
            }
            match self.rx.try_recv() {
                Ok(item) => return self.answer(item),
                Err(TryRecvError::Empty) => std::thread::yield_now(),
                Err(TryRecvError::Disconnected) => return Err(self.gone()),
            }
        }
    }

    /// A failure this rank already sent or hit (its `StepFailed`, its connection gone),
    /// without waiting; None when nothing is pending or what is pending is not a failure.
    pub fn pending_failure(&mut self) -> Option<BackendError> {
        match self.rx.try_recv() {
            Ok(item) => self.answer(item).err(),
            Err(TryRecvError::Empty) => None,
            Err(TryRecvError::Disconnected) => Some(self.gone()),
        }
    }

    fn answer(&self, item: Incoming) -> Result<Msg, BackendError> {
        match item {
            Ok(Msg::StepFailed { message } | Msg::LoadFailed { message }) => {
                Err(BackendError::Device(format!("rank {} failed: {message}", self.rank)))
            }
            Ok(msg) => Ok(msg),
            Err(e) => Err(BackendError::Device(format!("rank {}: {e}", self.rank))),
        }
    }

    fn gone(&self) -> BackendError {
        BackendError::Device(format!("rank {}: its control connection is gone", self.rank))
    }

    /// Closes the connection (the rank exits when it reads the end).
    pub fn close(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

impl Drop for RankLink {
    /// The reader thread holds a clone of the stream: shut the socket down so both ends see
    /// the close.
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::net::{IpAddr, Ipv4Addr};

    use super::*;
    use crate::parallel::wire::encode;

    fn hello(address: &str, token: &str, rank: usize) -> TcpStream {
        let mut s = TcpStream::connect(address).unwrap();
        let msg = Msg::Hello { token: token.into(), rank, mesh_address: format!("127.0.0.1:{}", 9000 + rank) };
        s.write_all(&encode(&msg)).unwrap();
        s
    }

    /// The connection was closed by the driver (EOF, or reset).
    fn refused(mut s: TcpStream) -> bool {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut buf = [0u8; 1];
        matches!(s.read(&mut buf), Ok(0) | Err(_))
    }

    #[test]
    fn bad_joins_are_refused_and_good_ones_accepted() {
        let rdv = Rendezvous::bind(IpAddr::V4(Ipv4Addr::LOCALHOST), "127.0.0.1", "secret").unwrap();
        let address = rdv.address().to_owned();
        let client = std::thread::spawn(move || {
            let wrong_token = hello(&address, "guess", 1);
            let out_of_range = hello(&address, "secret", 7);
            let driver_rank = hello(&address, "secret", 0);
            let mut malformed = TcpStream::connect(&address).unwrap();
            malformed.write_all(&[0xff, 0xff, 0xff, 0x7f, 1]).unwrap();
            let mut garbage = TcpStream::connect(&address).unwrap();
            garbage.write_all(&[3, 0, 0, 0, 99, 1, 2]).unwrap();
            let good = hello(&address, "secret", 1);
            std::thread::sleep(Duration::from_millis(200));
            let duplicate = hello(&address, "secret", 1);
            let second = hello(&address, "secret", 2);
            let all_refused = [wrong_token, out_of_range, driver_rank, malformed, garbage, duplicate]
                .into_iter()
                .map(refused)
                .collect::<Vec<_>>();
            (all_refused, good, second)
        });
        let deadline = Instant::now() + Duration::from_secs(20);
        let joined = accept_joins(&rdv, 3, &[1, 2], deadline, &mut [], &StepControl::default()).unwrap();
        assert_eq!(joined.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(joined[&1].mesh_address, "127.0.0.1:9001");
        let (all_refused, _good, _second) = client.join().unwrap();
        assert_eq!(all_refused, vec![true; 6]);
    }

    #[test]
    fn missing_ranks_are_named_when_the_join_deadline_passes() {
        let rdv = Rendezvous::bind(IpAddr::V4(Ipv4Addr::LOCALHOST), "127.0.0.1", "secret").unwrap();
        let deadline = Instant::now() + Duration::from_millis(200);
        let err = accept_joins(&rdv, 4, &[1, 2, 3], deadline, &mut [], &StepControl::default()).unwrap_err();
        assert!(err.to_string().contains("ranks [1, 2, 3] did not join"), "{err}");
    }
}
