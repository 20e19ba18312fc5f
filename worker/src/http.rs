//! Worker HTTP endpoints: `/healthz` (alive), `/readyz` (registered, not draining, every
//! replica Ready with a live, unstalled engine; 503 with the reasons otherwise), `/metrics`
//! (Prometheus/OpenMetrics text, vLLM names), and, only with `--enable-fault-injection`,
//! `POST /debug/replicas/{id}/kill-engine` and `POST /debug/replicas/{id}/stall-engine?seconds=N`
//! (the CPU backend's analogue of SIGKILL / SIGSTOP of a shard: the agent must fail the
//! replica, hand its requests back and keep serving).

use crate::agent::Agent;
use crate::metrics::WorkerMetrics;
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::{get, post};
use prism_engine::Fault;
use std::sync::Arc;
use std::time::Duration;

#[derive(Clone)]
struct HttpState {
    agent: Arc<Agent>,
    metrics: Arc<WorkerMetrics>,
}

/// The HTTP router; the `/debug/…` fault-injection routes exist only when the agent's config
/// enables them (404 otherwise).
pub fn router(agent: Arc<Agent>, metrics: Arc<WorkerMetrics>) -> axum::Router {
    let mut r = axum::Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics_text));
    if agent.cfg.enable_fault_injection {
        tracing::warn!("fault injection enabled: POST /debug/replicas/{{id}}/kill-engine and /stall-engine");
        r = r
            .route("/debug/replicas/{id}/kill-engine", post(kill_engine))
            .route("/debug/replicas/{id}/stall-engine", post(stall_engine));
    }
    r.with_state(HttpState { agent, metrics })
}

/// Query of `stall-engine`.
#[derive(Debug, serde::Deserialize)]
struct StallQuery {
    /// How long the step thread sleeps (seconds, at most one hour).
    seconds: f64,
}

async fn kill_engine(State(s): State<HttpState>, Path(id): Path<String>) -> (StatusCode, String) {
    inject(&s, &id, Fault::KillStepThread)
}

async fn stall_engine(
    State(s): State<HttpState>,
    Path(id): Path<String>,
    Query(q): Query<StallQuery>,
) -> (StatusCode, String) {
    if !(q.seconds.is_finite() && q.seconds > 0.0 && q.seconds <= 3600.0) {
        return (StatusCode::BAD_REQUEST, "seconds must be in (0, 3600]\n".to_owned());
    }
    inject(&s, &id, Fault::Stall(Duration::from_secs_f64(q.seconds)))
}

fn inject(s: &HttpState, id: &str, fault: Fault) -> (StatusCode, String) {
    let Some(r) = s.agent.replicas().get(id) else {
        return (StatusCode::NOT_FOUND, format!("replica {id} is not hosted here\n"));
    };
    let Some(engine) = r.engine() else {
        return (StatusCode::CONFLICT, format!("replica {id} has no engine loaded\n"));
    };
    match engine.inject_fault(fault) {
        Ok(()) => {
            tracing::warn!(replica = id, ?fault, "fault injected");
            (StatusCode::OK, format!("injected {fault:?} into replica {id}\n"))
        }
        Err(e) => (StatusCode::CONFLICT, format!("{e}\n")),
    }
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
