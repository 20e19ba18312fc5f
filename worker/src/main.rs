//! `prism-worker`: parse flags, bind listeners, run until SIGTERM/SIGINT (then drain and exit 0).

use clap::Parser;
use prism_common::shutdown::{CancellationToken, wait_for_signal};
use prism_worker::{Args, WorkerConfig};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    prism_common::telemetry::init_logging();
    let cfg = WorkerConfig::try_from(Args::parse())?;
    let args_listen = Args::parse();
    let grpc = tokio::net::TcpListener::bind(args_listen.listen).await?;
    let http = tokio::net::TcpListener::bind(args_listen.http_listen).await?;
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    tokio::spawn(async move {
        match wait_for_signal().await {
            Ok(sig) => tracing::info!(?sig, "signal received: draining (a second signal exits at once)"),
            Err(e) => tracing::error!(error = %e, "cannot install signal handlers"),
        }
        token.cancel();
        if wait_for_signal().await.is_ok() {
            tracing::warn!("second signal: exiting without finishing the drain");
            std::process::exit(1);
        }
    });
    prism_worker::run(cfg, grpc, http, shutdown).await
}
