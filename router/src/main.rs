//! `prism-router` binary: parse flags, bind listeners, run until SIGINT/SIGTERM.

use clap::Parser;
use prism_common::listen::bind;
use prism_common::shutdown::{CancellationToken, wait_for_signal};
use prism_router::Args;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    prism_common::telemetry::init_logging();
    let args = Args::parse();
    let http_addr = args.http_addr();
    // `--port` replaces the port of `--http-listen`: name the flag that chose it.
    let http_flag = if args.port.is_some() { "--port" } else { "--http-listen" };
    let grpc_addr = args.grpc_listen;
    args.tls.install()?;
    let config = args.into_config()?;
    let http = bind(http_addr, http_flag).await?;
    let grpc = bind(grpc_addr, "--grpc-listen").await?;
    tracing::info!(http = %http.local_addr()?, grpc = %grpc.local_addr()?, "prism-router listening");
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        let _ = wait_for_signal().await;
        s.cancel();
    });
    prism_router::run(config, http, grpc, shutdown).await
}
