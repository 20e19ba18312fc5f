//! `mock-engine`: the mock engine as a process, a MOCK `WorkerService` that returns tokens
//! instantly (no model), for the router benchmark and runtime tests only. Not the real
//! worker; built only with the `mock-engine` feature
//! (`cargo build -p prism-router --features mock-engine --bins`).

use clap::Parser;
use prism_common::shutdown::{CancellationToken, wait_for_signal};
use prism_router::mock_engine::{MockBehavior, MockEngineWorker};

/// Flags of the mock engine.
#[derive(Parser)]
#[command(name = "mock-engine", about = "Mock engine worker for router tests/benchmarks (no model)")]
struct Args {
    /// gRPC listen address.
    #[arg(long, env = "PRISM_MOCK_LISTEN", default_value = "127.0.0.1:50061")]
    listen: std::net::SocketAddr,
    /// Tokens per choice when a request sets no max_tokens.
    #[arg(long, env = "PRISM_MOCK_TOKENS", default_value_t = 8)]
    tokens: u32,
    /// Microseconds to wait before each token.
    #[arg(long, env = "PRISM_MOCK_TOKEN_DELAY_US", default_value_t = 0)]
    token_delay_us: u64,
    /// Mutual TLS on the listener (the router benchmark's mTLS runs).
    #[command(flatten)]
    tls: prism_common::tls::TlsArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    prism_common::telemetry::init_logging();
    let a = Args::parse();
    a.tls.install()?;
    let l = tokio::net::TcpListener::bind(a.listen).await?;
    tracing::info!(addr = %l.local_addr()?, "mock-engine listening");
    let shutdown = CancellationToken::new();
    let s = shutdown.clone();
    tokio::spawn(async move {
        let _ = wait_for_signal().await;
        s.cancel();
    });
    let mock = MockEngineWorker::new(MockBehavior {
        tokens: a.tokens,
        token_delay: std::time::Duration::from_micros(a.token_delay_us),
        ..Default::default()
    });
    mock.serve(l, shutdown).await
}
