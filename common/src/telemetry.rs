//! Logging set-up shared by every binary: `tracing` to stderr, filtered by `RUST_LOG`
//! (default `info`). Never log prompts or generated text at info level.

/// Installs the global subscriber once; later calls are ignored.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ =
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_target(false).try_init();
}
