//! Free loopback ports and polling with a deadline (never a fixed sleep for readiness):
//! [`wait_until`] / [`poll_until`] for conditions that are simply true or not yet,
//! [`eventually`] for checks that may fail on the way (a server not up yet).

use anyhow::{Result, anyhow, bail};
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;

/// Pause between two polls.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// A TCP port on 127.0.0.1 that was free a moment ago and that no other test process will
/// hand out while this one runs. Prefer passing a bound listener where the API allows it;
/// this is for child processes that must be told their port.
///
/// The port comes from outside the kernel's ephemeral range (`ip_local_port_range`): a port
/// the OS handed out for `bind(0)` is just as likely to be handed out next as the local port
/// of some outgoing connection (a worker dialling etcd, a client dialling the head) in the
/// moment between this call and the child's own `bind`, which then fails with "address
/// already in use". Ports below the range are only ever taken by an explicit `bind`. Calls in
/// one process walk the range from a pid-dependent start, so concurrent tests of one test
/// binary never get the same port, and each port is checked by binding it.
///
/// Test binaries run side by side too, and their walks meet: the bind check alone let two
/// of them hand out one port between the check and the child's `bind` (or while a fixture
/// restarts a child on its ports). So each port is also reserved across processes before it
/// is handed out: a lock on a file named after it under [`PORT_LOCK_DIR`] in the temporary
/// directory, held until this process exits (the kernel drops it then, even on a crash).
/// A port another process holds is skipped.
///
/// # Errors
/// When no port of the range can be bound.
pub fn free_port() -> Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(u32::MAX);
    let (lo, hi) = non_ephemeral_range();
    let span = u32::from(hi - lo) + 1;
    let seed = std::process::id().wrapping_mul(7919) % span;
    let _ = NEXT.compare_exchange(u32::MAX, seed, Ordering::Relaxed, Ordering::Relaxed);
    let candidates = (0..span).filter_map(|_| {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed) % span;
        u16::try_from(offset).ok().map(|o| lo + o)
    });
    pick_port(candidates).ok_or_else(|| anyhow!("no free loopback port in {lo}..={hi}"))
}

/// Directory (under the temporary directory) of the per-port lock files of [`free_port`].
pub const PORT_LOCK_DIR: &str = "prism-test-ports";

/// The first of `candidates` that this process can reserve ([`reserve_port`]) and bind.
fn pick_port(candidates: impl Iterator<Item = u16>) -> Option<u16> {
    for port in candidates {
        let Some(reservation) = reserve_port(port) else { continue };
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            if let Some(lock) = reservation {
                RESERVED.lock().unwrap_or_else(std::sync::PoisonError::into_inner).push(lock);
            }
            return Some(port);
        }
    }
    None
}

/// The lock files of the ports this process reserved, kept open (locked) until it exits.
static RESERVED: std::sync::Mutex<Vec<std::fs::File>> = std::sync::Mutex::new(Vec::new());

/// Reserves `port` across processes: `None` when another process holds it; `Some(Some(lock))`
/// when the lock is taken (keep the file open to keep it); `Some(None)` where no lock can be
/// taken at all (no writable temporary directory, a file system without locks): the bind
/// check alone decides then, as before reservations.
fn reserve_port(port: u16) -> Option<Option<std::fs::File>> {
    let dir = std::env::temp_dir().join(PORT_LOCK_DIR);
    if std::fs::create_dir_all(&dir).is_err() {
        return Some(None);
    }
    let Ok(file) =
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join(port.to_string()))
    else {
        return Some(None);
    };
    match file.try_lock() {
        Ok(()) => Some(Some(file)),
        Err(std::fs::TryLockError::WouldBlock) => None,
        Err(std::fs::TryLockError::Error(_)) => Some(None),
    }
}

/// The widest run of ports in 10000..=65535 outside the kernel's ephemeral range (Linux
/// default 32768..=60999, so 10000..=32767); 10000..=32767 where the range cannot be read.
fn non_ephemeral_range() -> (u16, u16) {
    const LO: u16 = 10_000;
    let fallback = (LO, 32_767);
    let Ok(text) = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range") else {
        return fallback;
    };
    let mut it = text.split_whitespace().filter_map(|v| v.parse::<u16>().ok());
    let (Some(e_lo), Some(e_hi)) = (it.next(), it.next()) else {
        return fallback;
    };
    let below = (LO, e_lo.saturating_sub(1));
    let above = if e_hi == u16::MAX { (1, 0) } else { ((e_hi + 1).max(LO), u16::MAX) };
    let width = |(a, b): (u16, u16)| if b >= a { u32::from(b - a) + 1 } else { 0 };
    match (width(below), width(above)) {
        (0, 0) => fallback,
        (b, a) if b >= a => below,
        _ => above,
    }
}

/// Polls `check` every 20 ms until it returns `true`.
///
/// # Errors
/// When `timeout` passes first; the message names `what`.
pub async fn wait_until<F, Fut>(timeout: Duration, what: &str, mut check: F) -> Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    poll_until(timeout, what, || {
        let fut = check();
        async move { fut.await.then_some(()) }
    })
    .await
}

/// Polls `check` every 20 ms until it returns `Some(value)`, and returns that value.
///
/// # Errors
/// When `timeout` passes first; the message names `what`.
pub async fn poll_until<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// Pause between two attempts of [`eventually`].
const RETRY_INTERVAL: Duration = Duration::from_millis(100);

/// Runs `check` every 100 ms until it returns `Ok(Some(value))`, and returns that value.
/// `Ok(None)` means "not yet"; an error (a connection refused, say) is remembered and the
/// check retried.
///
/// # Errors
/// When `timeout` passes first: the last error, with `what` as context.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = anyhow!("timed out");
    loop {
        match check().await {
            Ok(Some(v)) => return Ok(v),
            Ok(None) => {}
            Err(e) => last = e,
        }
        if Instant::now() > deadline {
            return Err(last.context(format!("{what}: not reached within {timeout:?}")));
        }
        tokio::time::sleep(RETRY_INTERVAL).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context;

    /// A port reserved by another test process (its lock file held through another open
    /// file, as a second process holds it) is never handed out here, even though nothing
    /// listens on it yet: that process's child is about to bind it.
    #[test]
    fn a_port_another_process_reserved_is_skipped() -> Result<()> {
        let taken = free_port()?;
        // `taken` stays reserved by this process; a new open file of its lock is refused
        // exactly as one in another process is.
        assert!(reserve_port(taken).is_none(), "a held reservation was granted again");
        let picked = pick_port(taken..taken.saturating_add(50)).context("no port")?;
        assert_ne!(picked, taken, "a port reserved elsewhere was handed out");
        Ok(())
    }
}
