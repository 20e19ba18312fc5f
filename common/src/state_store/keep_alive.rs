//! Lease keep-alive loop: refreshes a lease every third of its TTL until cancelled, and
//! reports loss (the lease expired or was revoked) so the holder can re-grant and rewrite its
//! keys — etcd-client's keep-alive stream does not do this on its own.

use super::api::{LeaseId, StateStore, StoreError};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Spawns a task that calls [`StateStore::keep_alive`] every `ttl_secs / 3` seconds (at least
/// every 200 ms). Transient errors ([`StoreError::Unavailable`]) are retried quickly for up to
/// two thirds of the TTL after the last success; then the lease counts as lost — a little
/// before the store itself would expire it, so a leader steps down before another can win.
///
/// The task returns `Ok(())` when `cancel` fires, or `Err(StoreError::LeaseNotFound(lease))`
/// when the lease is lost (other persistent errors are returned as they are).
pub fn spawn_keep_alive(
    store: Arc<dyn StateStore>,
    lease: LeaseId,
    ttl_secs: i64,
    cancel: CancellationToken,
) -> JoinHandle<Result<(), StoreError>> {
    tokio::spawn(async move {
        let ttl = Duration::from_secs(ttl_secs.max(1).unsigned_abs());
        let period = (ttl / 3).max(Duration::from_millis(200));
        let retry = Duration::from_millis(100);
        let give_up = ttl * 2 / 3;
        let mut last_ok = tokio::time::Instant::now();
        loop {
            match store.keep_alive(lease).await {
                Ok(()) => {
                    last_ok = tokio::time::Instant::now();
                    tokio::select! {
                        () = cancel.cancelled() => return Ok(()),
                        () = tokio::time::sleep(period) => {}
                    }
                }
                Err(StoreError::Unavailable(reason)) => {
                    if last_ok.elapsed() >= give_up {
                        tracing::warn!(lease, %reason, "lease keep-alive failed for two thirds of its TTL");
                        return Err(StoreError::LeaseNotFound(lease));
                    }
                    tracing::debug!(lease, %reason, "lease keep-alive retry");
                    tokio::select! {
                        () = cancel.cancelled() => return Ok(()),
                        () = tokio::time::sleep(retry) => {}
                    }
                }
                Err(e) => return Err(e),
            }
        }
    })
}
