//! Free loopback ports and polling with a deadline (never a fixed sleep for readiness):
//! [`wait_until`] / [`poll_until`] for conditions that are simply true or not yet,
//! [`eventually`] for checks that may fail on the way (a server not up yet).

use anyhow::{Result, anyhow, bail};
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;

/// Pause between two polls.
const POLL_INTERVAL: Duration = Duration::from_millis(20);

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, then released).
/// Prefer passing a bound listener where the API allows it; this is for child processes
/// that must be told their port.
///
/// # Errors
/// When no socket can be bound.
pub fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
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
