//! prism-head: the control plane. Keeps cluster state in the state store, places
//! replicas on workers, publishes routes to routers, and elects one leader among heads
//! (only the leader reconciles, accepts worker sessions and writes; followers answer
//! `UNAVAILABLE` naming the leader and report not-ready).

pub mod admin;
pub mod audit;
pub mod auth;
pub mod cluster;
pub mod config;
pub mod drain;
pub mod election;
pub mod error;
pub mod events;
pub mod gate;
pub mod http;
pub mod metrics;
pub mod placement;
pub mod routes;
pub mod service;
pub mod store;

use std::sync::Arc;
use std::time::Duration;

use prism_common::proto::v1::head_service_server::HeadServiceServer;
use prism_common::state_store::{StateStore, keys};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use cluster::Cluster;
pub use config::{Args, HeadConfig, StoreSpec};
pub use election::Leadership;

/// Runs a head: serves HTTP and gRPC at once, opens the store named by `cfg.store`, then
/// runs as [`run_with_store`]. A store that cannot be reached yet (etcd down or still
/// starting when the head starts or restarts) is retried with backoff until it answers or
/// `shutdown`: the workers and routers serve on without a head meanwhile, and the head takes
/// over once the store is back, with no outside supervisor needed to restart it. Until then
/// `/healthz` answers 200 (the process is alive, so a startup or liveness probe does not
/// restart it), `/readyz` 503 saying the store is unreachable, `/metrics` the head's metrics,
/// and every `HeadService` call `UNAVAILABLE` ([`gate::STORE_UNAVAILABLE`]).
///
/// # Errors
/// The store is misconfigured (not merely unreachable), or a listener fails.
pub async fn run(
    cfg: HeadConfig,
    grpc_listener: TcpListener,
    http_listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let spec = cfg.store.clone();
    serve(cfg, StoreSource::Spec(spec), grpc_listener, http_listener, shutdown).await
}

/// Opens the store named by `spec`, retrying while it is unreachable. `Ok(None)`: `shutdown`
/// came first.
async fn open_store(
    spec: &StoreSpec,
    shutdown: &CancellationToken,
) -> Result<Option<Arc<dyn StateStore>>, store::StoreError> {
    let mut backoff = STORE_RETRY_MIN;
    loop {
        let attempt = tokio::select! {
            () = shutdown.cancelled() => return Ok(None),
            r = store::open(spec) => r,
        };
        match attempt {
            Ok(store) => return Ok(Some(store)),
            Err(store::StoreError::Unavailable(reason)) => {
                tracing::warn!(%reason, retry_in = ?backoff, "state store unavailable; retrying");
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(None),
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(STORE_RETRY_MAX);
            }
            Err(e) => return Err(e),
        }
    }
}

/// First and largest pause between two attempts to reach the state store at start.
const STORE_RETRY_MIN: Duration = Duration::from_millis(250);
const STORE_RETRY_MAX: Duration = Duration::from_secs(5);

/// Runs a head on an already-opened store: the election, the reconciler, gRPC
/// (`HeadService` + `grpc.health.v1`) on `grpc_listener` and HTTP (`/healthz`, `/readyz`,
/// `/metrics`) on `http_listener`, until `shutdown`. On shutdown the head resigns leadership
/// so another takes over at once.
///
/// # Errors
/// A listener fails.
pub async fn run_with_store(
    cfg: HeadConfig,
    store: Arc<dyn StateStore>,
    grpc_listener: TcpListener,
    http_listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    serve(cfg, StoreSource::Opened(store), grpc_listener, http_listener, shutdown).await
}

/// Where [`serve`] gets its state store.
enum StoreSource {
    /// Open it (retrying while unreachable) after the listeners serve.
    Spec(StoreSpec),
    /// Already open.
    Opened(Arc<dyn StateStore>),
}

/// Serves both listeners first, then opens the store and runs the control plane on it: the
/// HTTP endpoints and the gRPC [`gate::Gate`] answer for the head until the store is open.
async fn serve(
    cfg: HeadConfig,
    source: StoreSource,
    grpc_listener: TcpListener,
    http_listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    tracing::info!(
        head_id = %cfg.head_id,
        advertise = %cfg.advertise_address,
        grpc = %grpc_listener.local_addr()?,
        http = %http_listener.local_addr()?,
        "prism-head starting"
    );
    // An open head on loopback (`prism up`, a single machine) is the documented default; only
    // one other hosts can reach is worth a warning.
    if !cfg.auth.enabled() && !grpc_listener.local_addr()?.ip().is_loopback() {
        tracing::warn!(
            "no --auth-token-file: the head is open, anyone who reaches its gRPC port may deploy, scale, drain \
             and cordon (keep it on loopback or a private network, or give it a token file)"
        );
    }
    let metrics = metrics::Metrics::new();
    let (cluster_tx, cluster_rx) = watch::channel(None);
    let (service_tx, service_rx) = watch::channel(None);
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter.set_not_serving::<HeadServiceServer<service::HeadGrpc>>().await;
    let http =
        tokio::spawn(http::serve(http::Shared::new(cluster_rx, metrics.clone()), http_listener, shutdown.clone()));
    let grpc = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(health)
            .add_service(gate::Gate::new(service_rx))
            .serve_with_incoming_shutdown(
                prism_common::tls::server::incoming(grpc_listener),
                shutdown.clone().cancelled_owned(),
            ),
    );

    let opened = match source {
        StoreSource::Opened(store) => Ok(Some(store)),
        StoreSource::Spec(spec) => open_store(&spec, &shutdown).await,
    };
    let (control, failure) = match opened {
        Ok(Some(store)) => {
            let control = Control::start(cfg, store, metrics, reporter, &shutdown);
            service_tx.send_replace(Some(HeadServiceServer::new(service::HeadGrpc::new(
                control.cluster.clone(),
                shutdown.clone(),
            ))));
            cluster_tx.send_replace(Some(control.cluster.clone()));
            (Some(control), None)
        }
        Ok(None) => (None, None),
        Err(e) => {
            shutdown.cancel();
            (None, Some(e))
        }
    };
    let grpc = grpc.await;
    shutdown.cancel();
    if let Some(control) = control {
        control.stop().await;
    }
    let http = http.await;
    if let Some(e) = failure {
        return Err(e.into());
    }
    grpc??;
    http??;
    tracing::info!("prism-head stopped");
    Ok(())
}
/// The control plane on an open store: the election, its bridge into the [`Cluster`] and the
/// reconciler.
struct Control {
    cluster: Arc<Cluster>,
    election: tokio::task::JoinHandle<()>,
    bridge: tokio::task::JoinHandle<()>,
    reconciler: tokio::task::JoinHandle<()>,
}

impl Control {
    fn start(
        cfg: HeadConfig,
        store: Arc<dyn StateStore>,
        metrics: metrics::Metrics,
        reporter: tonic_health::server::HealthReporter,
        shutdown: &CancellationToken,
    ) -> Self {
        let election = election::spawn(
            store.clone(),
            election::ElectionConfig {
                name: keys::HEAD_ELECTION.to_owned(),
                candidate: cfg.advertise_address.clone(),
                lease_ttl: cfg.lease_ttl,
            },
            shutdown.clone(),
        );
        let (lead_tx, lead_rx) = watch::channel(Leadership::default());
        let cluster = Cluster::new(cfg, store, lead_rx, metrics);
        let bridge = tokio::spawn(follow_election(
            election.state,
            election.leader_key,
            lead_tx,
            cluster.clone(),
            reporter,
            shutdown.clone(),
        ));
        let reconciler = tokio::spawn(placement::reconciler::run(cluster.clone(), shutdown.clone()));
        Self { cluster, election: election.task, bridge, reconciler }
    }

    /// Waits for the tasks after shutdown; the election gets 5 s to resign.
    async fn stop(self) {
        let _ = self.bridge.await;
        let _ = self.reconciler.await;
        let _ = tokio::time::timeout(Duration::from_secs(5), self.election).await;
    }
}

/// Mirrors the election into the cluster's [`Leadership`]: loads state when elected, closes
/// worker sessions when deposed, and flips the gRPC health status of `HeadService`.
async fn follow_election(
    mut election: watch::Receiver<Leadership>,
    leader_key: watch::Receiver<Option<election::LeaderKey>>,
    tx: watch::Sender<Leadership>,
    cluster: Arc<Cluster>,
    reporter: tonic_health::server::HealthReporter,
    shutdown: CancellationToken,
) {
    loop {
        let now = election.borrow_and_update().clone();
        match now {
            Leadership::Leader if !tx.borrow().is_leader() => {
                tx.send_replace(Leadership::Leader);
                // The election publishes its key before the leadership, so the term is known.
                let term = leader_key.borrow().as_ref().map_or(0, |k| u64::try_from(k.revision).unwrap_or(0));
                loop {
                    match cluster.on_elected(term).await {
                        Ok(()) => break,
                        Err(e) => tracing::warn!(error = %e, "loading cluster state failed; retrying"),
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = tokio::time::sleep(Duration::from_millis(200)) => {}
                    }
                    if !election.borrow().is_leader() {
                        break;
                    }
                }
                reporter.set_serving::<HeadServiceServer<service::HeadGrpc>>().await;
                tracing::info!("this head is the leader");
            }
            Leadership::Leader => {}
            Leadership::Follower { leader } => {
                let was = tx.borrow().is_leader();
                tx.send_replace(Leadership::Follower { leader });
                if was {
                    tracing::warn!("leadership lost");
                    cluster.on_deposed().await;
                    reporter.set_not_serving::<HeadServiceServer<service::HeadGrpc>>().await;
                }
            }
        }
        tokio::select! {
            () = shutdown.cancelled() => break,
            r = election.changed() => if r.is_err() { break },
        }
    }
    tx.send_replace(Leadership::default());
    cluster.on_deposed().await;
}
