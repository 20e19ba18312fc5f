//! The head's HTTP endpoints: `/healthz` (process up), `/readyz` (200 only on the leader,
//! so a Kubernetes Service reaches the leader), `/metrics` (Prometheus text) and
//! `/v1/events` (the recent control-plane events as JSON: `{"events": [...]}`, oldest
//! first; see `events.rs`).

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

async fn events(AxState(c): AxState<Arc<Cluster>>) -> impl IntoResponse {
    axum::Json(serde_json::json!({ "events": c.events().recent() }))
}

/// Serves `/healthz`, `/readyz`, `/metrics` and `/v1/events` until `shutdown`.
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
        .route("/v1/events", get(events))
        .with_state(cluster);
    axum::serve(listener, app).with_graceful_shutdown(async move { shutdown.cancelled().await }).await
}
