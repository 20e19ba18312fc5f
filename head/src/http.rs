//! The head's HTTP endpoints: `/healthz` (process up, from the moment the head starts, store
//! open or not), `/readyz` (200 only on the leader once it has loaded the cluster state, so a
//! Kubernetes Service reaches the leader; 503 saying why while the state store is not open
//! yet, or the leader is loading or cannot load the state), `/metrics` (Prometheus
//! text) and
//! `/v1/events` (the recent control-plane events as JSON: `{"events": [...]}`, oldest
//! first; see `events.rs`). With `--auth-token-file` the event log needs a `read` or
//! `admin` bearer token (it names deployments, replicas and failure reasons); the probes
//! and `/metrics` stay open: kubelets and Prometheus scrape them without credentials, and
//! they carry counts and states, never a token or a model path.

use std::sync::Arc;

use axum::extract::State as AxState;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::auth::Rpc;
use crate::cluster::{Cluster, StateLoad};
use crate::election::Leadership;
use crate::metrics::Metrics;

/// What the endpoints read: the cluster once the state store is open, and the metrics
/// (served before that too, the cluster's gauges at zero).
#[derive(Clone)]
pub struct Shared {
    cluster: watch::Receiver<Option<Arc<Cluster>>>,
    metrics: Metrics,
}

impl Shared {
    /// `cluster` holds `None` until the state store is open; `metrics` are the ones the
    /// cluster updates.
    pub fn new(cluster: watch::Receiver<Option<Arc<Cluster>>>, metrics: Metrics) -> Self {
        Self { cluster, metrics }
    }

    fn cluster(&self) -> Option<Arc<Cluster>> {
        self.cluster.borrow().clone()
    }
}

/// `/readyz`'s body while the store is not open.
const STORE_UNREACHABLE: &str = "not ready: state store unreachable; retrying";

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(AxState(s): AxState<Shared>) -> impl IntoResponse {
    let Some(c) = s.cluster() else {
        return (StatusCode::SERVICE_UNAVAILABLE, STORE_UNREACHABLE.to_owned());
    };
    match c.leadership() {
        Leadership::Leader => match c.state_load() {
            StateLoad::Loaded => (StatusCode::OK, "leader".to_owned()),
            StateLoad::NotLoaded => {
                (StatusCode::SERVICE_UNAVAILABLE, "not ready: leader, loading the cluster state".to_owned())
            }
            StateLoad::Failed(e) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready: leader, cannot load the cluster state ({e}); retrying"),
            ),
        },
        Leadership::Follower { leader } => (StatusCode::SERVICE_UNAVAILABLE, follower_body(&c, leader.as_deref())),
    }
}

/// `/readyz`'s body on a follower that sees `leader` in the election key. A head restarted
/// on the same address finds its previous run's key there until that run's lease expires:
/// the store names this head's own address then, yet nobody leads, and "leader is" that
/// address would have it claim a leadership it has not won.
fn follower_body(c: &Cluster, leader: Option<&str>) -> String {
    match leader {
        Some(l) if l == c.cfg().advertise_address => format!(
            "follower; no leader yet: the election key still names this head's address {l}, left by its \
             previous run until that run's lease expires (within --lease-ttl {:?})",
            c.cfg().lease_ttl
        ),
        Some(l) => format!("follower; leader is {l}"),
        None => "follower; no leader yet".to_owned(),
    }
}

async fn metrics(AxState(s): AxState<Shared>) -> impl IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
        s.metrics.render(),
    )
}

async fn events(AxState(s): AxState<Shared>, headers: axum::http::HeaderMap) -> axum::response::Response {
    let Some(c) = s.cluster() else {
        // Nothing is recorded before the store opens: there is no event a token would guard.
        let body = axum::Json(serde_json::json!({ "error": STORE_UNREACHABLE }));
        return (StatusCode::SERVICE_UNAVAILABLE, body).into_response();
    };
    let value = headers.get(axum::http::header::AUTHORIZATION).map(axum::http::HeaderValue::as_bytes);
    if let Err(refused) = c.cfg().auth.authorize(value, Rpc::Events) {
        let status = match refused.status.code() {
            tonic::Code::PermissionDenied => StatusCode::FORBIDDEN,
            _ => StatusCode::UNAUTHORIZED,
        };
        let body = axum::Json(serde_json::json!({ "error": refused.status.message() }));
        return if status == StatusCode::UNAUTHORIZED {
            (status, [(axum::http::header::WWW_AUTHENTICATE, "Bearer")], body).into_response()
        } else {
            (status, body).into_response()
        };
    }
    axum::Json(serde_json::json!({ "events": c.events().recent() })).into_response()
}

/// Serves `/healthz`, `/readyz`, `/metrics` and `/v1/events` until `shutdown`.
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve(
    shared: Shared,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/events", get(events))
        .with_state(shared);
    axum::serve(listener, app).with_graceful_shutdown(async move { shutdown.cancelled().await }).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{HeadConfig, StoreSpec};
    use prism_common::state_store::{EmbeddedStore, StateStore, keys};

    async fn ready(cluster: &Arc<Cluster>) -> (StatusCode, String) {
        let (_tx, rx) = watch::channel(Some(cluster.clone()));
        let resp = readyz(AxState(Shared::new(rx, Metrics::new()))).await.into_response();
        let status = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16).await.expect("body");
        (status, String::from_utf8_lossy(&body).into_owned())
    }

    /// A leader is ready only once it has loaded the state: before, and while every load
    /// fails (here an undecodable record; in the field a state too large to read), `/readyz`
    /// is 503 with the reason, so a Service sends nothing to a head that cannot serve.
    #[tokio::test]
    async fn a_leader_that_cannot_load_the_state_is_not_ready() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let bad = format!("{}bad", keys::NODES);
        store.put(&bad, b"\x0a\xff".to_vec(), None).await.expect("put");
        let (_lead_tx, lead_rx) = watch::channel(Leadership::Leader);
        let cfg = HeadConfig::new(StoreSpec::Embedded("unused".into()), "http://127.0.0.1:50050");
        let cluster = Cluster::new(cfg, store.clone(), lead_rx, Metrics::new());
        assert_eq!(ready(&cluster).await.0, StatusCode::SERVICE_UNAVAILABLE, "leader before loading");
        assert!(cluster.on_elected(1).await.is_err());
        let (status, body) = ready(&cluster).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "leader that cannot load: {body}");
        assert!(body.contains("cannot load the cluster state"), "{body}");
        store.delete(&bad).await.expect("delete");
        cluster.on_elected(1).await.expect("loads");
        assert_eq!(ready(&cluster).await, (StatusCode::OK, "leader".to_owned()));
    }

    /// A follower names the leader the election key holds, but never itself: a restarted
    /// head sees its previous run's key (its own address) until that lease expires, and no
    /// one leads then.
    #[tokio::test]
    async fn a_follower_never_names_itself_as_leader() {
        let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory().expect("store"));
        let me = "http://127.0.0.1:50050";
        let cfg = HeadConfig::new(StoreSpec::Embedded("unused".into()), me);
        for (leader, want) in [
            (Some("http://10.0.0.2:50050"), "follower; leader is http://10.0.0.2:50050"),
            (Some(me), "follower; no leader yet"),
            (None, "follower; no leader yet"),
        ] {
            let (_tx, rx) = watch::channel(Leadership::Follower { leader: leader.map(str::to_owned) });
            let cluster = Cluster::new(cfg.clone(), store.clone(), rx, Metrics::new());
            let (status, body) = ready(&cluster).await;
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
            assert!(body.starts_with(want), "leader {leader:?}: {body}");
            assert!(!body.contains(&format!("leader is {me}")), "{body}");
        }
    }
}
