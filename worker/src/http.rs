//! Worker HTTP endpoints: `/healthz` (alive), `/readyz` (registered, not draining, every
//! replica Ready with a live engine; 503 with the reasons otherwise), `/metrics`
//! (Prometheus/OpenMetrics text, vLLM names).

use crate::agent::Agent;
use crate::metrics::WorkerMetrics;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use std::sync::Arc;

#[derive(Clone)]
struct HttpState {
    agent: Arc<Agent>,
    metrics: Arc<WorkerMetrics>,
}

/// The HTTP router.
pub fn router(agent: Arc<Agent>, metrics: Arc<WorkerMetrics>) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text))
        .with_state(HttpState { agent, metrics })
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<HttpState>) -> impl IntoResponse {
    match s.agent.readiness() {
        Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {}\n", why.join("; "))),
    }
}

async fn metrics_text(State(s): State<HttpState>) -> impl IntoResponse {
    match s.metrics.encode() {
        Ok(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
            body,
        )
            .into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}
