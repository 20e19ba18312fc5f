//! `prism up`'s flags and listening sockets (`up.rs` and `up/components.rs` use it; it uses
//! only `up/restart.rs`'s `Given`).

use super::restart::Given;
use anyhow::Result;
use clap::Args;
use prism_common::engine_flags::EngineFlags;
use prism_common::listen::BindError;
use std::net::SocketAddr;
use std::path::PathBuf;
use tokio::net::TcpListener;

/// The bundled model (`scripts/fetch-model.sh` puts it here).
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
/// The script that fetches [`DEFAULT_MODEL`].
pub const FETCH_SCRIPT: &str = "scripts/fetch-model.sh";
/// The prompt `--demo` answers.
pub const DEMO_PROMPT: &str = "What is the capital of France?";

/// `prism up` flags (vLLM's names where vLLM has the knob; the engine's come from [`EngineFlags`]).
#[derive(Args, Debug, Clone)]
pub struct UpArgs {
    /// Model to serve: a GGUF file or a Hugging Face directory.
    #[arg(long, env = "PRISM_MODEL_PATH", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// Model name clients use (default: the file or directory name without extension).
    #[arg(long, env = "PRISM_SERVED_MODEL_NAME")]
    pub served_model_name: Option<String>,
    /// Engine knobs (the keys of a deployment file's `engine:` block).
    #[command(flatten)]
    pub engine: EngineFlags,
    /// Number of replicas of the model. On a restart over a kept store, without this flag
    /// the stored count is kept (e.g. one set with `prism scale`).
    #[arg(long, env = "PRISM_REPLICAS", default_value_t = 1)]
    pub replicas: u32,
    /// Address the router listens on (use 0.0.0.0 to serve other machines).
    #[arg(long, env = "PRISM_HOST", default_value = "127.0.0.1")]
    pub host: std::net::IpAddr,
    /// Router HTTP port (OpenAI API, /health, /metrics); 0 = any free port.
    #[arg(long, env = "PRISM_PORT", default_value_t = 8000)]
    pub port: u16,
    /// Router gRPC port (`prism.v1.InferenceService`); 0 = any free port.
    #[arg(long, env = "PRISM_GRPC_PORT", default_value_t = 50051)]
    pub grpc_port: u16,
    /// Head gRPC port on 127.0.0.1 (`prism status` talks to it); 0 = any free port.
    #[arg(long, env = "PRISM_HEAD_PORT", default_value_t = 50050)]
    pub head_port: u16,
    /// Head HTTP port on 127.0.0.1 (/healthz, /readyz, /metrics); 0 = any free port.
    #[arg(long, env = "PRISM_HEAD_HTTP_PORT", default_value_t = 8081)]
    pub head_http_port: u16,
    /// Worker gRPC port on 127.0.0.1; 0 = any free port.
    #[arg(long, env = "PRISM_WORKER_PORT", default_value_t = 50061)]
    pub worker_port: u16,
    /// Worker HTTP port on 127.0.0.1 (/healthz, /readyz, vLLM /metrics); 0 = any free port.
    #[arg(long, env = "PRISM_WORKER_HTTP_PORT", default_value_t = 8082)]
    pub worker_http_port: u16,
    /// State store: `embedded` (in process, state in a temporary file), `embedded:PATH`
    /// (persisted to PATH) or `etcd://HOST:PORT[,HOST:PORT]`. When it already holds this
    /// model's deployment (a restart), the stored settings are kept (the replica count from
    /// `prism scale`, engine knobs, placement, autoscaling from `prism deploy`) and only the
    /// flags given (or set in the environment) override them; the model and served name are
    /// always this command line's.
    #[arg(long, env = "PRISM_STORE", default_value = "embedded")]
    pub store: String,
    /// After startup, stream the answer to this prompt (chat template, greedy), then keep serving.
    #[arg(long, env = "PRISM_PROMPT")]
    pub prompt: Option<String>,
    /// Same as `--prompt "What is the capital of France?"`.
    #[arg(long, env = "PRISM_DEMO", conflicts_with = "prompt")]
    pub demo: bool,
    /// Most new tokens for the `--prompt` answer.
    #[arg(long, env = "PRISM_PROMPT_MAX_TOKENS", default_value_t = 128)]
    pub prompt_max_tokens: i64,
    /// Give up when the model is not Ready after this many seconds.
    #[arg(long, env = "PRISM_LOAD_TIMEOUT", default_value_t = 900)]
    pub load_timeout: u64,
    /// CPU slots of the embedded worker: replicas it can hold on the CPU backend (default
    /// and minimum: the deployment's replicas × tensor-parallel × pipeline-parallel size,
    /// one per rank; on a restart, of the stored deployment). Raise it to deploy more models
    /// or let an autoscaled deployment grow (`prism deploy`).
    #[arg(long, env = "PRISM_UP_CPU_SLOTS")]
    pub cpu_slots: Option<u32>,
    /// Requests that may wait in the router's admission queue while the replicas are full
    /// (Ray Serve's `max_queued_requests`); past it: 429 with Retry-After. 0 = no queue.
    #[arg(long, env = "PRISM_MAX_QUEUED_REQUESTS", default_value_t = 1024)]
    pub max_queued_requests: u32,
    /// Longest wait in the router's admission queue in seconds (> 0); past it: 429, or 503
    /// when no replica is Ready. Raise it for large bursts such as `--request-rate inf`.
    #[arg(long, env = "PRISM_MAX_QUEUE_WAIT", default_value_t = 30.0, value_parser = positive_seconds)]
    pub max_queue_wait: f64,
    /// API keys of the router (`--api-key`, `--api-key-file`, per-key limits,
    /// `--metrics-without-auth`), as `prism-router` takes them.
    #[command(flatten)]
    pub keys: prism_router::auth::ApiKeyArgs,

    /// Make the embedded head ask for tokens: random admin, worker and router tokens are
    /// generated for this run, and the admin token's file (mode 0600) is printed for
    /// `prism status --token-file`. Off: the head is open, on loopback only.
    #[arg(long, env = "PRISM_UP_HEAD_AUTH")]
    pub head_auth: bool,

    /// Which of these flags were given (command line or environment) rather than left at
    /// their default: on a restart over a kept store only those override the stored
    /// deployment. Filled by `main` from the parsed command line.
    #[arg(skip)]
    pub given: Given,
}

/// A number of seconds above zero (finite).
fn positive_seconds(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?} is not a number of seconds: {e}"))?;
    if v > 0.0 && v.is_finite() && v < 1e9 { Ok(v) } else { Err(format!("must be above 0 seconds, got {s}")) }
}

/// The sockets `prism up` listens on (bound before anything starts, then handed to each `run`).
pub struct Listeners {
    /// Head gRPC.
    pub head_grpc: TcpListener,
    /// Head HTTP.
    pub head_http: TcpListener,
    /// Worker gRPC.
    pub worker_grpc: TcpListener,
    /// Worker HTTP.
    pub worker_http: TcpListener,
    /// Router HTTP (OpenAI API).
    pub router_http: TcpListener,
    /// Router gRPC.
    pub router_grpc: TcpListener,
}

async fn bind(ip: std::net::IpAddr, port: u16, flag: &'static str) -> Result<TcpListener, BindError> {
    prism_common::listen::bind(SocketAddr::new(ip, port), flag).await
}

impl Listeners {
    /// Binds every socket `args` names (loopback for the head and worker, `--host` for the router).
    ///
    /// # Errors
    /// A port is taken or cannot be bound: [`BindError`] names the flag that gave it.
    pub async fn bind(args: &UpArgs) -> Result<Self, BindError> {
        let lo = std::net::IpAddr::from([127, 0, 0, 1]);
        Ok(Self {
            head_grpc: bind(lo, args.head_port, "--head-port").await?,
            head_http: bind(lo, args.head_http_port, "--head-http-port").await?,
            worker_grpc: bind(lo, args.worker_port, "--worker-port").await?,
            worker_http: bind(lo, args.worker_http_port, "--worker-http-port").await?,
            router_http: bind(args.host, args.port, "--port").await?,
            router_grpc: bind(args.host, args.grpc_port, "--grpc-port").await?,
        })
    }
}

/// `prism up`'s arguments parsed from `flags` as `main` parses the `up` subcommand, the flags
/// given recorded (tests).
#[cfg(test)]
pub(crate) fn parse_up(flags: &[&str]) -> Result<UpArgs> {
    use clap::{CommandFactory, FromArgMatches};
    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        up: UpArgs,
    }
    let matches = Cli::command().try_get_matches_from(std::iter::once("prism-up").chain(flags.iter().copied()))?;
    let mut up = Cli::from_arg_matches(&matches)?.up;
    up.given = Given::of(&matches);
    Ok(up)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A taken port is reported with the flag that chose it, so the user knows what to change.
    #[tokio::test]
    async fn a_taken_port_names_its_flag() -> Result<()> {
        let taken = TcpListener::bind("127.0.0.1:0").await?;
        let port = taken.local_addr()?.port().to_string();
        let any = "0";
        let mut flags = vec!["--head-port", any, "--head-http-port", any, "--worker-port", any];
        flags.extend(["--worker-http-port", any, "--port", any, "--grpc-port", any]);
        for flag in ["--head-http-port", "--port", "--grpc-port"] {
            let mut given = flags.clone();
            let i = given.iter().position(|f| *f == flag).ok_or_else(|| anyhow::anyhow!("{flag}"))?;
            given[i + 1] = &port;
            let err = Listeners::bind(&parse_up(&given)?).await.err().ok_or_else(|| anyhow::anyhow!("bound {flag}"))?;
            assert!(matches!(err, BindError::InUse { .. }), "{err:?}");
            assert_eq!((err.flag(), err.addr()), (flag, taken.local_addr()?), "{err}");
        }
        Ok(())
    }
}
