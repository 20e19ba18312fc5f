//! The HTTP API-key guard: the outermost layer of the HTTP app, in front of routing, so every
//! route, method and path spelling — and every unknown path — answers 401 without a valid
//! key (the route table cannot be probed) except the probes of [`crate::auth::is_http_probe`],
//! matched on the raw path. An authenticated request is counted against its key's
//! requests-per-second limit (429 + `Retry-After`) and carries its [`Caller`] in the request
//! extensions for the token limit of the generation endpoints.

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use super::errors::ApiError;
use crate::auth::{ApiKeys, Caller, Limited};

/// What the guard needs.
#[derive(Clone)]
pub struct Guard {
    /// Accepted keys and their limits.
    pub keys: ApiKeys,
    /// Whether `/metrics` is a probe (`--metrics-without-auth`).
    pub metrics_open: bool,
}

/// 401 in OpenAI's shape with `WWW-Authenticate: Bearer`.
pub fn unauthorized() -> Response {
    let mut r = ApiError::new(StatusCode::UNAUTHORIZED, "missing or invalid API key (send Authorization: Bearer KEY)")
        .into_response();
    r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

/// 429 for a per-key limit, with `Retry-After`.
pub fn limited(l: Limited) -> ApiError {
    ApiError { retry_after: Some(l.retry_after_s), ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, l.message()) }
}

/// The middleware (`axum::middleware::from_fn_with_state`).
pub async fn require_key(State(g): State<Guard>, mut req: Request, next: Next) -> Response {
    if !g.keys.enabled() || crate::auth::is_http_probe(req.method(), req.uri().path(), g.metrics_open) {
        return next.run(req).await;
    }
    let values = req.headers().get_all(header::AUTHORIZATION).iter().map(HeaderValue::as_bytes);
    let caller: Option<Caller> = match g.keys.authenticate(values) {
        Ok(c) => c,
        Err(_) => return unauthorized(),
    };
    if let Err(l) = g.keys.admit_request(caller) {
        return limited(l).into_response();
    }
    if let Some(c) = caller {
        req.extensions_mut().insert(c);
    }
    next.run(req).await
}
