//! The three components of `prism up`, each started through its library's `run` with the
//! listeners bound by the caller and its own cancellation token, stopped in order:
//! router (stop accepting), worker (drain in-flight requests), head.

use anyhow::{Result, anyhow};
use prism_common::shutdown::CancellationToken;
use std::time::Duration;
use tokio::task::JoinHandle;

use super::Listeners;

/// The running components.
pub struct Cluster {
    tasks: Vec<(&'static str, CancellationToken, Option<JoinHandle<Result<()>>>, Duration)>,
}

/// Starts head, worker and router on `listeners`. `store` is `embedded`, `embedded:PATH`
/// or `etcd://…`.
///
/// # Errors
/// Fails on an invalid store or configuration.
pub async fn start(store: &str, listeners: Listeners, root: &CancellationToken) -> Result<Cluster> {
    let _ = (store, listeners, root);
    Err(anyhow!("prism up needs the head, worker and router libraries (not built yet)"))
}

impl Cluster {
    /// Resolves when any component stops on its own (an error, or an unexpected exit).
    pub async fn failed(&mut self) -> anyhow::Error {
        let futures = self.tasks.iter_mut().filter_map(|(name, _, task, _)| {
            task.as_mut().map(|t| {
                let name = *name;
                Box::pin(async move {
                    match t.await {
                        Ok(Ok(())) => anyhow!("the {name} stopped unexpectedly"),
                        Ok(Err(e)) => e.context(format!("the {name} failed")),
                        Err(e) => anyhow!("the {name} panicked: {e}"),
                    }
                })
            })
        });
        let futures: Vec<_> = futures.collect();
        if futures.is_empty() {
            return std::future::pending().await;
        }
        futures::future::select_all(futures).await.0
    }

    /// Stops the components in order (router, worker, head), each within its time limit.
    pub async fn shutdown(&mut self) {
        for (name, token, task, limit) in &mut self.tasks {
            token.cancel();
            if let Some(t) = task.take() {
                match tokio::time::timeout(*limit, t).await {
                    Ok(Ok(Ok(()))) => {}
                    Ok(Ok(Err(e))) => eprintln!("{name}: {e:#}"),
                    Ok(Err(e)) => eprintln!("{name} panicked: {e}"),
                    Err(_) => eprintln!("{name} did not stop within {limit:?}; exiting anyway"),
                }
            }
        }
    }
}
