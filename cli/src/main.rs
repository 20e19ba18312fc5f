//! `prism`: run a one-machine cluster (`prism up`), talk to a model (`generate`, `chat`),
//! and operate a cluster through the head (`status`, `deploy`, `scale`, `cordon`,
//! `uncordon`, `drain`), plus benchmarks (`bench`).

mod bench;
mod chat;
mod client;
mod cordon;
mod deploy;
mod drain;
mod generate;
mod model_check;
mod output;
mod scale;
mod status;
mod table;
mod up;

use anyhow::Result;
use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

/// Prism: LLM serving on a Rust actor runtime (a replacement for Ray Serve + KubeRay + vLLM).
#[derive(Parser, Debug)]
#[command(name = "prism", version, about, propagate_version = true)]
struct Cli {
    #[command(flatten)]
    endpoints: client::Endpoints,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Run head (embedded store) + worker + router in this process and serve a model.
    Up(Box<up::UpArgs>),
    /// Stream one answer to PROMPT from the router (gRPC).
    Generate(generate::GenerateArgs),
    /// Interactive chat with the router's model; the history is kept.
    Chat(chat::ChatArgs),
    /// Nodes, GPUs, deployments, replicas, states and load.
    Status(status::StatusArgs),
    /// Create or update a deployment from a YAML file.
    Deploy(deploy::DeployArgs),
    /// Set a deployment's replica count.
    Scale(scale::ScaleArgs),
    /// Remove a deployment: its replicas drain and stop, and its model is no longer served.
    Delete {
        /// Deployment name (see `prism status`).
        name: String,
    },
    /// Stop placing new replicas on NODE.
    Cordon {
        /// Node id (see `prism status`).
        node: String,
    },
    /// Allow placing replicas on NODE again.
    Uncordon {
        /// Node id (see `prism status`).
        node: String,
    },
    /// Move NODE's replicas away and stop them by the deadline.
    Drain(drain::DrainArgs),
    /// Run a benchmark.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

fn main() -> Result<()> {
    prism_engine::parallel::rank::exit_if_rank();
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.format(&mut Cli::command()).exit());
    if let (Command::Up(args), Some(up)) = (&mut cli.command, matches.subcommand_matches("up")) {
        // On a restart over a kept store, only the flags given override the stored deployment.
        args.given = up::Given::of(up);
    }
    if matches!(cli.command, Command::Up(_)) && std::env::var_os("RUST_LOG").is_none() {
        // `prism up` draws a progress bar: only warnings and errors go to the terminal.
        // SAFETY: no other thread exists yet (the runtime is built below).
        unsafe { std::env::set_var("RUST_LOG", "warn") };
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let endpoints = cli.endpoints;
    // The internal identity is for the head's admin RPCs; the router's public port is
    // server-only TLS (`--tls-ca` alone is the CA to trust there), and `prism up` stays
    // plaintext on loopback.
    let without_internal_tls =
        matches!(cli.command, Command::Up(_) | Command::Generate(_) | Command::Chat(_) | Command::Bench(_));
    if !without_internal_tls {
        endpoints.tls.install()?;
    }
    let head = endpoints.head_target();
    let router = endpoints.router_target();
    let result = runtime.block_on(async move {
        match cli.command {
            Command::Up(args) => up::run(*args).await,
            Command::Generate(args) => generate::run(&router, args).await,
            Command::Chat(args) => chat::run(&router, args).await,
            Command::Status(args) => status::run(&head, args).await,
            Command::Deploy(args) => deploy::run(&head, args).await,
            Command::Scale(args) => scale::run(&head, args).await,
            Command::Delete { name } => scale::delete(&head, name).await,
            Command::Cordon { node } => cordon::run(&head, node, true).await,
            Command::Uncordon { node } => cordon::run(&head, node, false).await,
            Command::Drain(args) => drain::run(&head, args).await,
            Command::Bench(command) => bench::run(&router, command).await,
        }
    });
    // Blocking reads (chat's stdin) and engine threads must not keep the process alive.
    runtime.shutdown_timeout(std::time::Duration::from_secs(1));
    if result.as_ref().is_err_and(output::broken_pipe) {
        // The reader of our output has gone (`prism status | head -1`): stop quietly with the
        // status a shell reports for a process ended by SIGPIPE, as other unix tools do.
        std::process::exit(141);
    }
    result
}
