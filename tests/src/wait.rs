//! Free loopback ports and polling with a deadline (never a fixed sleep for readiness):
//! [`wait_until`] / [`poll_until`] for conditions that are simply true or not yet,
//! [`eventually`] for checks that may fail on the way (a server not up yet).

use anyhow::{Result, anyhow, bail};
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;

/// Pause between two polls.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// A TCP port on 127.0.0.1 that was free a moment ago. Prefer passing a bound listener where
/// the API allows it; this is for child processes that must be told their port.
///
/// The port comes from outside the kernel's ephemeral range (`ip_local_port_range`): a port
/// the OS handed out for `bind(0)` is just as likely to be handed out next as the local port
/// of some outgoing connection (a worker dialling etcd, a client dialling the head) in the
/// moment between this call and the child's own `bind`, which then fails with "address
/// already in use". Ports below the range are only ever taken by an explicit `bind`. Calls in
/// one process walk the range from a pid-dependent start, so concurrent tests of one test
/// binary never get the same port, and each port is checked by binding it.
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
    for _ in 0..span {
        let offset = NEXT.fetch_add(1, Ordering::Relaxed) % span;
        let port = lo + u16::try_from(offset).expect("offset below a u16 span");
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free loopback port in {lo}..={hi}")
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
