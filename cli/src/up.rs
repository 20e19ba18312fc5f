//! `prism up`: a whole cluster in one process — the head (embedded state store by default,
//! or etcd), one worker (every local GPU, else the CPU backend) and the router, talking
//! real gRPC on loopback exactly as separate processes do — then deploys one model, shows
//! its loading progress, prints the endpoints, and serves until Ctrl-C, which drains and
//! exits 0. Restarted on a kept store, it keeps what was changed in the stored deployment
//! since (`prism scale`, `prism deploy`) unless the flag for it is given ([`restart`]).

mod args;
mod components;
mod head_auth;
mod restart;

pub use args::{DEFAULT_MODEL, DEMO_PROMPT, FETCH_SCRIPT, Listeners, UpArgs};
pub use restart::Given;

use crate::client::{self, status_error};
use crate::generate::{self, SamplingArgs};
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use prism_common::deployment::is_dns1123_label;
use prism_common::proto::v1::{
    ApplyDeploymentRequest, ChatMessage, ChatMessages, ClusterStatusRequest, DeploymentSpec, GenerateRequest,
    ListModelsRequest, NodeState, PlacementStrategy, ReplicaState, generate_request::Prompt,
};
use prism_common::shutdown::{CancellationToken, StopSignal, wait_for_signal};
use std::io::IsTerminal;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The name clients use for `model`: its file name up to the first `.` (GGUF) or the directory name.
pub fn default_served_name(model: &Path) -> String {
    let name = model.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let stem = if model.is_dir() { name.as_str() } else { name.split('.').next().unwrap_or_default() };
    if stem.is_empty() { "model".to_owned() } else { stem.to_owned() }
}

/// A DNS-1123 deployment name derived from a served model name (`SmolLM2-135M-Instruct` → `smollm2-135m-instruct`).
pub fn deployment_name(served: &str) -> String {
    let mut name: String =
        served.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    name.truncate(63);
    let name = name.trim_matches('-').to_owned();
    if is_dns1123_label(&name) { name } else { "model".to_owned() }
}

/// Finds the model, fetching the bundled one through [`FETCH_SCRIPT`] when it is missing.
fn resolve_model(model: &Path) -> Result<PathBuf> {
    if !model.exists() {
        if model != Path::new(DEFAULT_MODEL) {
            bail!("model {} does not exist (give a GGUF file or a Hugging Face directory)", model.display());
        }
        if !Path::new(FETCH_SCRIPT).exists() {
            bail!(
                "the bundled model {DEFAULT_MODEL} is missing; run `./{FETCH_SCRIPT}` from the repository root, \
                 or pass --model PATH"
            );
        }
        eprintln!("{DEFAULT_MODEL} is missing: fetching it with ./{FETCH_SCRIPT}");
        let status = std::process::Command::new("bash").arg(FETCH_SCRIPT).status()?;
        if !status.success() || !model.exists() {
            bail!("./{FETCH_SCRIPT} failed ({status}); run it by hand to see why");
        }
    }
    std::fs::canonicalize(model).with_context(|| format!("cannot resolve {}", model.display()))
}

fn spec(args: &UpArgs, model: &Path, served: &str) -> DeploymentSpec {
    DeploymentSpec {
        name: deployment_name(served),
        engine: Some(args.engine.to_proto(model.to_string_lossy(), served)),
        replicas: args.replicas,
        placement: PlacementStrategy::Spread as i32,
        ..DeploymentSpec::default()
    }
}

/// Runs `prism up` until SIGINT/SIGTERM; returns Ok after a clean drain.
///
/// # Errors
/// Fails when a port is taken, the model is missing, a component fails, or the replica
/// fails to load (its reason is in the error).
pub async fn run(args: UpArgs) -> Result<()> {
    prism_common::telemetry::init_logging();
    if args.engine.tensor_parallel_size == 0 || args.replicas == 0 {
        bail!("--tensor-parallel-size and --replicas must be at least 1");
    }
    args.engine.validate().map_err(|e| anyhow::anyhow!("--{}", e.to_string().replace('_', "-")))?;
    if args.served_model_name.as_deref().is_some_and(|n| n.trim().is_empty()) {
        // Clients could never ask for it (the router would list the deployment's name instead).
        bail!(
            "--served-model-name (PRISM_SERVED_MODEL_NAME) is empty: give a name, or leave it out to serve the \
             model as its file name without extension"
        );
    }
    let model = resolve_model(&args.model)?;
    let engine = args.engine.to_proto(model.to_string_lossy(), "");
    crate::model_check::check_parallel(&engine).with_context(|| format!("model {}", model.display()))?;
    let served = args.served_model_name.clone().unwrap_or_else(|| default_served_name(&model));
    // Checked before anything listens: a missing or malformed key file stops startup.
    let api_keys = args.keys.entries()?;
    // `prism up`'s own calls to the router (readiness, `--prompt`) use the first key.
    let auth = api_keys.first().map(|k| k.key.clone());
    let head_auth = if args.head_auth { Some(head_auth::UpHeadAuth::generate()?) } else { None };
    let listeners = Listeners::bind(&args).await?;
    let mut endpoints = Endpoints::of(&listeners)?;
    endpoints.head_token = head_auth.as_ref().map(|a| a.admin()).unwrap_or_default();
    endpoints.head_token_file = head_auth.as_ref().map(|a| a.admin_file().to_owned());
    let root = CancellationToken::new();
    let fresh = spec(&args, &model, &served);
    let (mut cluster, deployment, others) =
        components::start(&args.store, &args, fresh.clone(), api_keys, head_auth.as_ref(), listeners, &root).await?;
    let kept = restart::kept_settings(&fresh, &deployment);
    if !kept.is_empty() {
        eprintln!(
            "{} is in the store ({}): keeping its {} (pass their flags to change them)",
            deployment.name,
            args.store,
            kept.join(", ")
        );
    }
    for o in &others {
        eprintln!(
            "the store also holds deployment {} ({}) from an earlier run: it keeps serving beside {}; \
             `prism delete {}` removes it",
            o.name,
            prism_common::text::count(u64::from(o.replicas), "replica", "replicas"),
            deployment.name,
            o.name
        );
    }

    let signal = wait_for_signal();
    tokio::pin!(signal);
    let outcome = tokio::select! {
        r = bring_up(&args, &deployment, &kept, &model, &endpoints, auth.as_deref()) => r,
        s = &mut signal => { eprintln!("\n{}: stopping during startup", signal_name(&s)); Ok(false) }
        r = cluster.failed() => Err(r),
    };
    match outcome {
        Ok(true) => {
            tokio::select! {
                s = &mut signal => eprintln!("\n{}: draining and shutting down…", signal_name(&s)),
                r = cluster.failed() => {
                    eprintln!("error: {r:#}; shutting down");
                    cluster.shutdown().await;
                    return Err(r);
                }
            }
        }
        Ok(false) => {}
        Err(e) => {
            cluster.shutdown().await;
            return Err(e);
        }
    }
    // A second Ctrl-C during the drain exits at once.
    tokio::spawn(async {
        if wait_for_signal().await.is_ok() {
            eprintln!("second signal: exiting now");
            std::process::exit(130);
        }
    });
    cluster.shutdown().await;
    eprintln!("stopped");
    Ok(())
}

fn signal_name(s: &std::io::Result<StopSignal>) -> &'static str {
    match s {
        Ok(StopSignal::Interrupt) => "SIGINT",
        Ok(StopSignal::Terminate) => "SIGTERM",
        Err(_) => "signal handler failed",
    }
}

/// The addresses `prism up` serves on, as printed.
struct Endpoints {
    http: String,
    grpc: String,
    head: String,
    head_http: String,
    worker_http: String,
    /// What `prism up`'s own head calls present (none: an open head).
    head_token: prism_common::head_auth::HeadCredential,
    /// The admin token's file, with `--head-auth`.
    head_token_file: Option<PathBuf>,
}

impl Endpoints {
    fn of(l: &Listeners) -> Result<Self> {
        let show = |a: SocketAddr| {
            if a.ip().is_unspecified() { format!("127.0.0.1:{}", a.port()) } else { a.to_string() }
        };
        Ok(Self {
            http: format!("http://{}", show(l.router_http.local_addr()?)),
            grpc: show(l.router_grpc.local_addr()?),
            head: format!("http://{}", show(l.head_grpc.local_addr()?)),
            head_http: format!("http://{}", show(l.head_http.local_addr()?)),
            worker_http: format!("http://{}", show(l.worker_http.local_addr()?)),
            head_token: prism_common::head_auth::HeadCredential::None,
            head_token_file: None,
        })
    }
}

/// How long after a worker has registered `prism up` keeps a Pending replica's reason to
/// itself: the reconciler places the replica on its next pass (about a second).
const PENDING_GRACE: Duration = Duration::from_secs(3);

/// Whether a Pending replica's reason is worth saying: only once a worker has been
/// registered (`worker_since`, the first poll that saw a Ready node) for [`PENDING_GRACE`].
/// Before that "no schedulable node" only means that `prism up`'s own worker has not
/// registered yet, or registered an instant ago: not news, and a reader of a log takes a
/// "pending:" line for an error.
fn pending_worth_saying(worker_since: Option<Instant>, now: Instant) -> bool {
    worker_since.is_some_and(|since| now.saturating_duration_since(since) >= PENDING_GRACE)
}

/// `prism up`'s startup progress: a bar on a terminal; elsewhere (a log file, a pipe, where the
/// bar does not draw) each new message as a line.
struct Progress<'a> {
    bar: &'a ProgressBar,
    plain: bool,
    last: String,
}

impl Progress<'_> {
    fn say(&mut self, msg: String) {
        if msg == self.last {
            return;
        }
        if self.plain {
            eprintln!("prism up: {msg}");
        }
        self.bar.set_message(msg.clone());
        self.last = msg;
    }
}

/// Applies `spec`, shows progress until its replicas are Ready and the router serves the
/// model, prints the endpoints and runs the `--prompt` (the router calls carry `api_key`
/// when API keys are set). `kept`: the settings kept from the store, named when a replica
/// fails. Returns `Ok(true)` when serving.
async fn bring_up(
    args: &UpArgs,
    spec: &DeploymentSpec,
    kept: &[String],
    model: &Path,
    ep: &Endpoints,
    api_key: Option<&str>,
) -> Result<bool> {
    let served = spec.engine.as_ref().map(|e| e.served_model_name.as_str()).unwrap_or_default();
    let bar = ProgressBar::new(4);
    let mut progress = Progress { bar: &bar, plain: !std::io::stderr().is_terminal(), last: String::new() };
    bar.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] [{bar:24}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(120));
    let deadline = Instant::now() + Duration::from_secs(args.load_timeout);
    let poll = Duration::from_millis(200);

    progress.say("starting the head".to_owned());
    let mut head = loop {
        match client::head(&client::HeadTarget::new(ep.head.clone(), ep.head_token.clone())).await {
            Ok(h) => break h,
            Err(e) if Instant::now() > deadline => return Err(e),
            Err(_) => tokio::time::sleep(poll).await,
        }
    };
    let deployment = spec.name.clone();
    // At zero (a stored autoscaled deployment scaled to zero) nothing starts until a request comes.
    let want = spec.replicas as usize;
    loop {
        match head.apply_deployment(ApplyDeploymentRequest { spec: Some(spec.clone()) }).await {
            Ok(_) => break,
            Err(s) if s.code() == tonic::Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(poll).await;
            }
            Err(s) => return Err(status_error(s)).context("deploying the model"),
        }
    }
    bar.inc(1);
    progress.say(format!("waiting for the worker; deploying {served}"));
    let mut stage = 1;
    let mut worker_since: Option<Instant> = None;
    loop {
        if Instant::now() > deadline {
            bail!(
                "the model was not Ready within {} s; last: {} (see `prism status` and the logs)",
                args.load_timeout,
                progress.last
            );
        }
        let status = head.cluster_status(ClusterStatusRequest {}).await.map_err(status_error)?.into_inner();
        let replicas: Vec<_> = status.replicas.iter().filter(|r| r.deployment == deployment).collect();
        if worker_since.is_none() && status.nodes.iter().any(|n| n.state == NodeState::Ready as i32) {
            worker_since = Some(Instant::now());
        }
        if let Some(failed) = replicas.iter().find(|r| r.state == ReplicaState::Failed as i32) {
            bar.abandon_with_message("failed");
            let from_store = if kept.is_empty() {
                String::new()
            } else {
                format!(" (kept from the store: {}; pass their flags to change them)", kept.join(", "))
            };
            bail!("replica {} failed to start: {}{from_store}", failed.replica_id, failed.reason);
        }
        let ready = replicas.iter().filter(|r| r.state == ReplicaState::Ready as i32).count();
        let starting = replicas.iter().any(|r| r.state == ReplicaState::Starting as i32);
        let new_stage = if ready >= want {
            4
        } else if starting || ready > 0 {
            3
        } else if !status.nodes.is_empty() {
            2
        } else {
            1
        };
        if new_stage != stage {
            stage = new_stage;
            bar.set_position(stage);
            let msg = match stage {
                2 => "worker registered; placing the replica".to_owned(),
                3 => format!("loading {} ({ready}/{want} ready)", model.display()),
                _ => "model loaded; waiting for the router".to_owned(),
            };
            progress.say(msg);
        }
        if let Some(pending) = replicas.iter().find(|r| r.state == ReplicaState::Pending as i32 && !r.reason.is_empty())
            && pending_worth_saying(worker_since, Instant::now())
        {
            progress.say(format!("pending: {}", pending.reason));
        }
        if stage == 4 {
            break;
        }
        tokio::time::sleep(poll).await;
    }
    let mut router = client::router(&client::RouterTarget::new(ep.grpc.clone())).await?;
    loop {
        let models = router
            .list_models(client::authorized(ListModelsRequest {}, api_key)?)
            .await
            .map_err(status_error)?
            .into_inner()
            .models;
        if models.iter().any(|m| m.id == served && (m.ready_replicas > 0 || want == 0)) {
            break;
        }
        if Instant::now() > deadline {
            bail!("the router did not list {served} within {} s", args.load_timeout);
        }
        tokio::time::sleep(poll).await;
    }
    bar.finish_and_clear();
    print_banner(served, model, ep, api_key.is_some());

    let prompt = if args.demo { Some(DEMO_PROMPT.to_owned()) } else { args.prompt.clone() };
    if let Some(prompt) = prompt {
        println!(">>> {prompt}");
        let sampling =
            SamplingArgs { temperature: Some(0.0), max_tokens: Some(args.prompt_max_tokens), ..Default::default() };
        let request = GenerateRequest {
            model: served.to_owned(),
            prompt: Some(Prompt::Chat(ChatMessages {
                messages: vec![ChatMessage { role: "user".into(), content: prompt, ..Default::default() }],
            })),
            sampling: Some(sampling.to_proto()),
            ..GenerateRequest::default()
        };
        let mut stdout = std::io::stdout();
        generate::stream(&mut router, client::authorized(request, api_key)?, &mut stdout).await?;
        println!("\n");
        println!("Still serving; press Ctrl-C to stop.");
    }
    Ok(true)
}

fn print_banner(served: &str, model: &Path, ep: &Endpoints, keys: bool) {
    println!("Prism is up: serving {served} ({})", model.display());
    println!("  OpenAI API:   {}/v1", ep.http);
    println!("  gRPC:         {}  (prism.v1.InferenceService; `prism generate`, `prism chat`)", ep.grpc);
    match &ep.head_token_file {
        Some(f) => println!("  Head:         {}  (`prism status --token-file {}`)", ep.head, f.display()),
        None => println!("  Head:         {}  (`prism status`)", ep.head),
    }
    println!("  Metrics:      {}/metrics  {}/metrics  {}/metrics", ep.http, ep.worker_http, ep.head_http);
    println!();
    if keys {
        // The key itself is never printed: the example reads it from the environment.
        println!("API keys required: send Authorization: Bearer KEY (the probes /health, /healthz, /readyz are open)");
        println!("The example below reads the key from $PRISM_API_KEY: export PRISM_API_KEY=KEY first");
        println!();
    }
    let auth = if keys { " -H \"Authorization: Bearer $PRISM_API_KEY\"" } else { "" };
    println!("Try:");
    println!(
        "  curl {}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\\n    -d '{{\"model\": \"{served}\", \"messages\": [{{\"role\": \"user\", \"content\": \"{DEMO_PROMPT}\"}}], \"temperature\": 0}}'",
        ep.http
    );
    println!("Press Ctrl-C to stop.");
    println!();
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deploy::DeploymentFile;
    use args::parse_up;
    use prism_common::proto::v1::EngineConfig;

    /// The engine config `prism up FLAGS` deploys, and the one of a deployment file with `engine_block`.
    fn both(flags: &[&str], engine_block: &str) -> anyhow::Result<(EngineConfig, EngineConfig)> {
        let args = parse_up(flags)?;
        let up = spec(&args, Path::new("/models/m.gguf"), "smol").engine.context("engine")?;
        let yaml = format!("name: smol\nmodel: /models/m.gguf\n{engine_block}");
        let deployed = DeploymentFile::parse(&yaml)?.to_spec().engine.context("engine")?;
        Ok((up, deployed))
    }

    #[test]
    fn up_flags_and_a_deployment_files_engine_block_give_the_same_engine_config() -> anyhow::Result<()> {
        let (up, deployed) = both(
            &[
                "--tensor-parallel-size=2",
                "--max-model-len=2048",
                "--block-size=32",
                "--max-num-seqs=64",
                "--max-num-batched-tokens=1024",
                "--gpu-memory-utilization=0.85",
                "--kv-cache-bytes=67108864",
                "--backend=cpu",
                "--max-in-flight=16",
                "--batch-invariant",
            ],
            "engine:\n  tensor_parallel_size: 2\n  max_model_len: 2048\n  block_size: 32\n  max_num_seqs: 64\n  \
             max_num_batched_tokens: 1024\n  gpu_memory_utilization: 0.85\n  kv_cache_bytes: 67108864\n  \
             backend: cpu\n  max_in_flight: 16\n  batch_invariant: true\n",
        )?;
        assert_eq!(up, deployed);
        assert_eq!((up.max_num_seqs, up.backend.as_str(), up.served_model_name.as_str()), (Some(64), "cpu", "smol"));
        // No engine flags and no engine block: every knob unset, one GPU per replica.
        let (up, deployed) = both(&[], "")?;
        assert_eq!(up, deployed);
        let unset = EngineConfig {
            model: "/models/m.gguf".into(),
            served_model_name: "smol".into(),
            tensor_parallel_size: 1,
            ..EngineConfig::default()
        };
        assert_eq!(up, unset);
        Ok(())
    }

    /// vLLM's `--no-enable-prefix-caching` turns the prefix cache off in the deployment, as a
    /// file's `enable_prefix_caching: false` does; no flag leaves it unset (on).
    #[test]
    fn prefix_caching_flags_reach_the_deployment_like_the_yaml_key() -> anyhow::Result<()> {
        for (flags, block, want) in [
            (&["--no-enable-prefix-caching"][..], "engine:\n  enable_prefix_caching: false\n", Some(false)),
            (&["--enable-prefix-caching=false"][..], "engine: {enable_prefix_caching: false}\n", Some(false)),
            (&["--enable-prefix-caching"][..], "engine:\n  enable_prefix_caching: true\n", Some(true)),
            (&[][..], "engine: {}\n", None),
        ] {
            let (up, deployed) = both(flags, block)?;
            assert_eq!((up.enable_prefix_caching, deployed.enable_prefix_caching), (want, want), "{flags:?}");
        }
        let parse = parse_up;
        assert!(parse(&["--enable-prefix-caching", "--no-enable-prefix-caching"]).is_err(), "contradicting flags");
        // The flag has no YAML spelling: the key is `enable_prefix_caching`.
        assert!(DeploymentFile::parse("name: a\nmodel: m\nengine:\n  no_enable_prefix_caching: true\n").is_err());
        Ok(())
    }

    #[test]
    fn queue_flags_default_to_the_routers_and_refuse_a_wait_of_zero() -> anyhow::Result<()> {
        let parse = parse_up;
        let d = parse(&[])?;
        let router = prism_router::RouterConfig::default();
        assert_eq!(d.max_queued_requests, router.max_queued_requests);
        assert_eq!(Duration::from_secs_f64(d.max_queue_wait), router.max_queue_wait);
        let set = parse(&["--max-queued-requests=0", "--max-queue-wait=120"])?;
        assert_eq!((set.max_queued_requests, set.max_queue_wait), (0, 120.0));
        for bad in ["0", "-1", "nan", "inf", "soon"] {
            let flag = format!("--max-queue-wait={bad}");
            let err = parse(&[flag.as_str()]).err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains("--max-queue-wait"), "{bad}: {err}");
        }
        Ok(())
    }

    /// `prism up` takes the router's key flags; a key file that cannot be read is a startup
    /// error naming it.
    #[test]
    fn api_key_flags_reach_the_router_config() -> anyhow::Result<()> {
        let parse = parse_up;
        let up = parse(&["--api-key", "sk-1", "--api-key=sk-2", "--api-key-rate-limit=5", "--metrics-without-auth"])?;
        let keys = up.keys.entries()?;
        assert_eq!(
            keys.iter().map(|k| (k.key.as_str(), k.rps)).collect::<Vec<_>>(),
            [("sk-1", Some(5.0)), ("sk-2", Some(5.0))]
        );
        assert!(up.keys.metrics_without_auth);
        assert!(!format!("{up:?}").contains("sk-1"), "Debug of the flags shows a key");
        assert!(parse(&[])?.keys.entries()?.is_empty());
        let err = parse(&["--api-key-file", "/nonexistent/keys"])?.keys.entries().err().map(|e| e.to_string());
        assert!(err.unwrap_or_default().contains("/nonexistent/keys"));
        Ok(())
    }

    #[test]
    fn names_from_model_paths() {
        let served = default_served_name(Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
        assert_eq!(served, "SmolLM2-135M-Instruct");
        assert_eq!(deployment_name(&served), "smollm2-135m-instruct");
        assert_eq!(deployment_name("My_Model.v2"), "my-model-v2");
        assert_eq!(deployment_name("___"), "model");
    }

    /// No "pending: no schedulable node" while `prism up`'s own worker has not registered,
    /// nor in the instant after it did (before the reconciler's next pass places the replica);
    /// a replica still Pending a few seconds after that is news.
    #[test]
    fn a_pending_reason_is_said_only_a_grace_after_the_worker_registered() {
        let t0 = Instant::now();
        assert!(!pending_worth_saying(None, t0), "no worker yet");
        assert!(!pending_worth_saying(None, t0 + Duration::from_secs(600)), "still no worker");
        assert!(!pending_worth_saying(Some(t0), t0), "the worker has just registered");
        assert!(!pending_worth_saying(Some(t0), t0 + PENDING_GRACE - Duration::from_millis(1)));
        assert!(pending_worth_saying(Some(t0), t0 + PENDING_GRACE));
        assert!(pending_worth_saying(Some(t0), t0 + Duration::from_secs(60)));
    }
}
