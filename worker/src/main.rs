//! `prism-worker`: parse flags, bind listeners, run until SIGTERM/SIGINT (then drain and exit 0).
//! Started with `PRISM_RANK_SPEC` (by a parallel replica's driver or a member node's agent)
//! it is one rank process of a replica instead.

use clap::Parser;
use prism_common::listen::bind;
use prism_common::shutdown::{CancellationToken, wait_for_signal};
use prism_worker::{Args, WorkerConfig};
use std::process::ExitCode;

fn main() -> anyhow::Result<ExitCode> {
    // A rank process never starts the agent (nor its async runtime).
    if let Some(code) = prism_engine::parallel::rank::main_from_env() {
        return Ok(code);
    }
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(agent_main())?;
    Ok(ExitCode::SUCCESS)
}

async fn agent_main() -> anyhow::Result<()> {
    prism_common::telemetry::init_logging();
    let args = Args::parse();
    let (listen, http_listen) = (args.listen, args.http_listen);
    args.tls.install()?;
    let cfg = WorkerConfig::try_from(args)?;
    let grpc = bind(listen, "--listen").await?;
    let http = bind(http_listen, "--http-listen").await?;
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
