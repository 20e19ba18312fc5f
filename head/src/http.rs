//! The head's HTTP endpoints: `/healthz` (process up), `/readyz` (200 only on the leader,
//! so a Kubernetes Service reaches the leader) and `/metrics` (Prometheus text).

use std::sync::Arc;

use axum::extract::State as AxState;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::get;
use tokio_util::sync::CancellationToken;

use crate::cluster::Cluster;
use crate::election::Leadership;

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(AxState(c): AxState<Arc<Cluster>>) -> impl IntoResponse {
    match c.leadership() {
        Leadership::Leader => (StatusCode::OK, "leader".to_owned()),
        Leadership::Follower { leader } => {
            (StatusCode::SERVICE_UNAVAILABLE, format!("follower; leader is {}", leader.as_deref().unwrap_or("unknown")))
        }
    }
}

async fn metrics(AxState(c): AxState<Arc<Cluster>>) -> impl IntoResponse {
    (
        [(axum::http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
        c.metrics().render(),
    )
}

/// Serves `/healthz`, `/readyz` and `/metrics` until `shutdown`.
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve(
    cluster: Arc<Cluster>,
    listener: tokio::net::TcpListener,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let app = axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .with_state(cluster);
    axum::serve(listener, app).with_graceful_shutdown(async move { shutdown.cancelled().await }).await
}
