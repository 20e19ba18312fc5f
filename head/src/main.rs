//! `prism-head` binary: parse flags, bind listeners, run until SIGINT/SIGTERM.

use clap::Parser;
use prism_common::listen::bind;
use prism_common::shutdown::{CancellationToken, wait_for_signal};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    prism_common::telemetry::init_logging();
    let args = prism_head::Args::parse();
    let grpc = bind(args.listen, "--listen").await?;
    let http = bind(args.http_listen, "--http-listen").await?;
    args.tls.install()?;
    let cfg = prism_head::HeadConfig::try_from(args)?;
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        if let Ok(sig) = wait_for_signal().await {
            tracing::info!(?sig, "shutting down");
        }
        s.cancel();
    });
    prism_head::run(cfg, grpc, http, shutdown).await
}
