//! Process-wide shutdown: a root `CancellationToken` cancelled by SIGINT/SIGTERM, with
//! child tokens per task (three-phase shutdown: stop accepting, drain, cancel).

pub use tokio_util::sync::CancellationToken;

/// Which signal asked the process to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopSignal {
    /// SIGINT (Ctrl-C).
    Interrupt,
    /// SIGTERM (pod deletion, spot reclaim).
    Terminate,
}

/// Waits for SIGINT or SIGTERM and says which arrived.
///
/// # Errors
/// Fails when the signal handlers cannot be installed.
pub async fn wait_for_signal() -> std::io::Result<StopSignal> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut int = signal(SignalKind::interrupt())?;
    let mut term = signal(SignalKind::terminate())?;
    tokio::select! {
        _ = int.recv() => Ok(StopSignal::Interrupt),
        _ = term.recv() => Ok(StopSignal::Terminate),
    }
}
