//! The three components of `prism up`, each started through its library's `run` with the
//! listeners bound by the caller and its own cancellation token, stopped in order:
//! router (stop accepting), worker (drain in-flight requests), head. The head starts first:
//! the deployment it already stores decides what `prism up` applies ([`super::restart`])
//! and so how many CPU slots the worker offers.

use anyhow::{Context, Result, anyhow};
use prism_common::engine_flags::DEFAULT_CPU_KV_CACHE_BYTES;
use prism_common::proto::v1::{ClusterStatusRequest, ClusterStatusResponse, DeploymentSpec};
use prism_common::shutdown::CancellationToken;
use prism_head::{HeadConfig, StoreSpec};
use prism_router::RouterConfig;
use std::time::Duration;
use tokio::task::JoinHandle;

use super::args::{Listeners, UpArgs};
use super::head_auth::UpHeadAuth;
use prism_common::head_auth::HeadCredential;

/// Per-component stop limits (router, worker, head): 9 s in all, inside the 10 s promise.
const ROUTER_STOP: Duration = Duration::from_secs(2);
const WORKER_STOP: Duration = Duration::from_secs(5);
const HEAD_STOP: Duration = Duration::from_secs(2);

/// One running component: its task, the token that stops it and how long it may take.
struct Component {
    name: &'static str,
    token: CancellationToken,
    /// `None` once awaited.
    task: Option<JoinHandle<Result<()>>>,
    stop_limit: Duration,
}

impl Component {
    fn new(name: &'static str, token: CancellationToken, task: JoinHandle<Result<()>>, stop_limit: Duration) -> Self {
        Self { name, token, task: Some(task), stop_limit }
    }
}

/// The running components.
pub struct Cluster {
    /// In stop order.
    tasks: Vec<Component>,
    /// Holds the embedded store's file for the process lifetime (removed on drop).
    _state_dir: Option<tempfile::TempDir>,
}

/// Starts head, worker and router on `listeners`; the router accepts `api_keys` (none = no
/// authentication); with `head_auth` the head asks for tokens and the worker and router
/// present theirs. `store` is `embedded`, `embedded:PATH` or `etcd://…`. Returns the
/// cluster, the deployment to apply: `fresh` (what the flags say) merged with the one of
/// the same name the store already holds ([`super::restart::deployment_to_apply`]), and the
/// other deployments the store holds with replicas (an earlier run that served another model
/// or name): the worker's default CPU slots count theirs too, so this run's replicas fit.
///
/// # Errors
/// Fails on an invalid store or configuration.
pub async fn start(
    store: &str,
    args: &UpArgs,
    fresh: DeploymentSpec,
    api_keys: Vec<prism_router::auth::ApiKeyEntry>,
    head_auth: Option<&UpHeadAuth>,
    listeners: Listeners,
    root: &CancellationToken,
) -> Result<(Cluster, DeploymentSpec, Vec<DeploymentSpec>)> {
    let (store, state_dir) = if store == "embedded" {
        let dir = tempfile::Builder::new().prefix("prism-up-").tempdir()?;
        (StoreSpec::Embedded(dir.path().join("state.json")), Some(dir))
    } else {
        (StoreSpec::parse(store).with_context(|| format!("--store {store:?}"))?, None)
    };
    let head_url = format!("http://{}", listeners.head_grpc.local_addr()?);
    let mut head_config = HeadConfig::new(store, head_url.clone());
    let admin = match head_auth {
        Some(a) => {
            head_config.auth = a.head_auth()?;
            a.admin()
        }
        None => HeadCredential::None,
    };

    let mut worker_config = prism_worker::WorkerConfig::for_test(head_url.clone(), &prism_worker::config::hostname());
    // The budget of CPU replicas that set none (`--kv-cache-bytes` travels in the spec).
    worker_config.kv_cache_bytes = DEFAULT_CPU_KV_CACHE_BYTES;
    // Ctrl-C drains in-flight requests for at most this long.
    worker_config.sigterm_drain = Duration::from_secs(3);
    worker_config.head_token = head_auth.map(UpHeadAuth::worker).unwrap_or_default();

    let router_config = RouterConfig {
        heads: vec![head_url.clone()],
        max_queued_requests: args.max_queued_requests,
        max_queue_wait: Duration::from_secs_f64(args.max_queue_wait),
        api_keys,
        metrics_without_auth: args.keys.metrics_without_auth,
        head_token: head_auth.map(UpHeadAuth::router).unwrap_or_default(),
        ..RouterConfig::default()
    };

    let head_token = root.child_token();
    let worker_token = root.child_token();
    let router_token = root.child_token();
    let mut head =
        tokio::spawn(prism_head::run(head_config, listeners.head_grpc, listeners.head_http, head_token.clone()));
    // Worker and router start once the head leads, so neither logs a "not the leader" retry.
    let status = tokio::select! {
        r = wait_for_leader(&head_url, &admin) => r?,
        r = &mut head => return Err(match r {
            Ok(Ok(())) => anyhow!("the head stopped during startup"),
            Ok(Err(e)) => e.context("the head failed to start"),
            Err(e) => anyhow!("the head panicked: {e}"),
        }),
    };
    let specs = || status.deployments.iter().filter_map(|d| d.spec.as_ref());
    let stored = specs().find(|s| s.name == fresh.name);
    let spec = super::restart::deployment_to_apply(fresh, stored, &args.given);
    let others: Vec<DeploymentSpec> = specs().filter(|s| s.name != spec.name && s.replicas > 0).cloned().collect();
    worker_config.cpu_slots = cpu_slots(args.cpu_slots, std::iter::once(&spec).chain(&others));
    let worker = tokio::spawn(prism_worker::run(
        worker_config,
        listeners.worker_grpc,
        listeners.worker_http,
        worker_token.clone(),
    ));
    let router = tokio::spawn(prism_router::run(
        router_config,
        listeners.router_http,
        listeners.router_grpc,
        router_token.clone(),
    ));
    let cluster = Cluster {
        tasks: vec![
            Component::new("router", router_token, router, ROUTER_STOP),
            Component::new("worker", worker_token, worker, WORKER_STOP),
            Component::new("head", head_token, head, HEAD_STOP),
        ],
        _state_dir: state_dir,
    };
    Ok((cluster, spec, others))
}

/// The worker's CPU slots: `--cpu-slots`, and at least one per rank of every replica of
/// `specs` (replicas x tensor_parallel_size x pipeline_parallel_size each), and at least one.
fn cpu_slots<'a>(flag: Option<u32>, specs: impl IntoIterator<Item = &'a DeploymentSpec>) -> u32 {
    let ranks = |spec: &DeploymentSpec| {
        let (tp, pp) = spec
            .engine
            .as_ref()
            .map_or((1, 1), |e| (e.tensor_parallel_size.max(1), e.pipeline_parallel_size.unwrap_or(1).max(1)));
        spec.replicas.saturating_mul(tp).saturating_mul(pp)
    };
    let own = specs.into_iter().map(ranks).fold(0u32, u32::saturating_add);
    flag.unwrap_or(own).max(own).max(1)
}

/// Polls the head until it reports itself leader (at most 30 s); returns its status then.
async fn wait_for_leader(head_url: &str, admin: &HeadCredential) -> Result<ClusterStatusResponse> {
    let target = crate::client::HeadTarget::new(head_url, admin.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(mut head) = crate::client::head(&target).await
            && let Ok(status) = head.cluster_status(ClusterStatusRequest {}).await
            && status.get_ref().is_leader
        {
            return Ok(status.into_inner());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(anyhow!("the embedded head did not become leader within 30 s"));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Cluster {
    /// Resolves when any component stops on its own (an error, or an unexpected exit).
    pub async fn failed(&mut self) -> anyhow::Error {
        let futures = self.tasks.iter_mut().filter_map(|c| {
            c.task.as_mut().map(|t| {
                let name = c.name;
                Box::pin(async move {
                    match t.await {
                        Ok(Ok(())) => anyhow!("the {name} stopped unexpectedly"),
                        Ok(Err(e)) => e.context(format!("the {name} failed")),
                        Err(e) => anyhow!("the {name} panicked: {e}"),
                    }
                })
            })
        });
        let futures: Vec<_> = futures.collect();
        if futures.is_empty() {
            return std::future::pending().await;
        }
        futures::future::select_all(futures).await.0
    }

    /// Stops the components in order (router, worker, head), each within its time limit.
    pub async fn shutdown(&mut self) {
        for Component { name, token, task, stop_limit: limit } in &mut self.tasks {
            token.cancel();
            if let Some(t) = task.take() {
                match tokio::time::timeout(*limit, t).await {
                    Ok(Ok(Ok(()))) => {}
                    Ok(Ok(Err(e))) => eprintln!("{name}: {e:#}"),
                    Ok(Err(e)) => eprintln!("{name} panicked: {e}"),
                    Err(_) => eprintln!("{name} did not stop within {limit:?}; exiting anyway"),
                }
            }
        }
    }
}
