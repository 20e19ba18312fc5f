//! prism-worker: the node agent. It discovers its devices, registers with the head over the
//! `WorkerSession` stream, starts and supervises engine replicas, serves
//! `WorkerService.Generate` for them, drains on SIGTERM / drain commands / spot notices,
//! and exposes health and vLLM-named metrics.
//!
//! Entry point: [`run`] (listeners passed in so tests bind `127.0.0.1:0`).

pub mod agent;
pub mod config;
pub mod http;
pub mod metrics;
pub mod service;

pub use config::{Args, WorkerConfig};

use agent::Agent;
use agent::drain::DrainSource;
use agent::replica::EngineLauncher;
use agent::spot::NoticeWatch;
use prism_common::proto::v1::worker_service_server::WorkerServiceServer;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic_health::ServingStatus;

/// gRPC service name reported through `grpc.health.v1`.
pub const WORKER_SERVICE_NAME: &str = "prism.v1.WorkerService";

/// The endpoint routers dial when `--advertise-address` is not set: the bound address, with
/// an unspecified IP (`0.0.0.0`, `::`) replaced by this host's name.
pub fn advertise_from(local: SocketAddr) -> String {
    if local.ip().is_unspecified() {
        format!("{}://{}:{}", prism_common::tls::client::scheme(), config::hostname(), local.port())
    } else {
        format!("{}://{local}", prism_common::tls::client::scheme())
    }
}

/// Runs the worker with the real engine until `shutdown` is cancelled; then drains (refuse
/// new work, finish in-flight requests until `sigterm_drain`, abort the rest, tell the head;
/// see `agent/drain.rs`) and returns.
///
/// # Errors
/// See [`run_with_launcher`].
pub async fn run(
    cfg: WorkerConfig,
    grpc_listener: TcpListener,
    http_listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let launcher = Arc::new(agent::launcher::LocalLauncher::new(cfg.model_root.clone()));
    run_with_launcher(cfg, grpc_listener, http_listener, shutdown, launcher).await
}

/// [`run`] with a chosen engine launcher (tests use doubles).
///
/// # Errors
/// No GPUs and no CPU slots to offer; a listener or server failure; the head refused the
/// registration ([`agent::registration::Refused`]).
pub async fn run_with_launcher(
    cfg: WorkerConfig,
    grpc_listener: TcpListener,
    http_listener: TcpListener,
    shutdown: CancellationToken,
    launcher: Arc<dyn EngineLauncher>,
) -> anyhow::Result<()> {
    let local = grpc_listener.local_addr()?;
    let mut cfg = cfg;
    // Rendezvous and rank listeners bind where the gRPC service does, unless told otherwise.
    cfg.rendezvous_bind = cfg.rendezvous_bind.or(Some(local.ip()));
    let address = cfg.advertise_address.clone().unwrap_or_else(|| advertise_from(local));
    let devices = agent::gpu::discover(cfg.simulate_gpus, cfg.cpu_slots);
    if devices.gpus.is_empty() && devices.cpu_slots == 0 {
        // The head refuses an empty inventory; without this the worker would retry forever.
        anyhow::bail!(
            "this node has no GPUs and --cpu-slots is 0, so the worker has nothing to run replicas on: \
             give --cpu-slots 1 or more (PRISM_CPU_SLOTS)"
        );
    }
    tracing::info!(
        node = %cfg.node_id, %address, gpus = devices.gpus.len(), simulated = devices.simulated,
        cpu_slots = devices.cpu_slots, grpc = %local, http = %http_listener.local_addr()?, "worker starting"
    );
    let sigterm_drain = cfg.sigterm_drain;
    let agent = Arc::new(Agent::new(cfg, devices, address, launcher));
    let metrics = Arc::new(metrics::WorkerMetrics::new(agent.replicas().clone()));
    let stop = CancellationToken::new();

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    let health_task = {
        let agent = Arc::clone(&agent);
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! { _ = stop.cancelled() => break, _ = tick.tick() => {} }
                agent.check_engines();
                let st = if agent.readiness().is_ok() { ServingStatus::Serving } else { ServingStatus::NotServing };
                health_reporter.set_service_status("", st).await;
                health_reporter.set_service_status(WORKER_SERVICE_NAME, st).await;
            }
            health_reporter.set_service_status("", ServingStatus::NotServing).await;
        })
    };

    let svc = service::WorkerGrpc::new(Arc::clone(&agent), Arc::clone(&metrics)).with_stop(stop.clone());
    let grpc = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health_service)
            .add_service(
                WorkerServiceServer::new(svc)
                    .max_decoding_message_size(prism_common::proto::WORKER_MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(prism_common::proto::WORKER_MAX_MESSAGE_BYTES),
            )
            .serve_with_incoming_shutdown(
                prism_common::tls::server::incoming(grpc_listener),
                stop.clone().cancelled_owned(),
            ),
    );
    let http = tokio::spawn(
        axum::serve(http_listener, http::router(Arc::clone(&agent), metrics))
            .with_graceful_shutdown(stop.clone().cancelled_owned())
            .into_future(),
    );
    let mut registration = tokio::spawn(agent::registration::run(Arc::clone(&agent), stop.child_token()));
    let spot = tokio::spawn(
        Arc::clone(agent.node_drain()).drain_on_spot_notice(NoticeWatch::from_config(&agent.cfg), stop.child_token()),
    );

    // Phase 1: serve until asked to stop. Phase 2: drain (refuse new work, finish or hand back
    // in-flight requests, tell the head). The registration loop ends early only when the head
    // refused this worker (its node id is another live worker's): before it ever registered
    // nothing was started; a superseded worker's replicas were placed again on the process
    // that holds its node id, so they are stopped at once, freeing their memory.
    let drained = agent.node_drain().drain_on_terminate(&shutdown, sigterm_drain);
    tokio::pin!(drained);
    let refused = tokio::select! {
        () = &mut drained => None,
        r = &mut registration => match r {
            Ok(Err(refused)) => {
                if refused.superseded {
                    tracing::error!(error = %refused, "superseded: stopping the replicas and exiting");
                    let why = "superseded by another worker with this node id";
                    agent.drain(Duration::ZERO, why, DrainSource::Superseded);
                    agent.node_drain().wait_done().await;
                }
                Some(refused)
            }
            Ok(Ok(())) | Err(_) => {
                drained.await;
                None
            }
        },
    };
    // Phase 3: stop everything (the session sends its last status first).
    stop.cancel();
    if !registration.is_finished() {
        let _ = tokio::time::timeout(Duration::from_secs(3), registration).await;
    }
    spot.abort();
    health_task.abort();
    let grpc_res = tokio::time::timeout(Duration::from_secs(5), grpc).await;
    let http_res = tokio::time::timeout(Duration::from_secs(5), http).await;
    if let Ok(Ok(Err(e))) = grpc_res {
        return Err(e.into());
    }
    if let Ok(Ok(Err(e))) = http_res {
        return Err(e.into());
    }
    if let Some(refused) = refused {
        return Err(refused.into());
    }
    tracing::info!("worker stopped");
    Ok(())
}
