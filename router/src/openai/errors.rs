//! OpenAI error objects (`{"error": {"message", "type", "param", "code"}}`) and the one
//! place where dispatch and worker failures become HTTP statuses.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use tonic::Code;

use crate::dispatch::DispatchError;
use crate::metrics::Outcome;

/// An HTTP error in OpenAI's shape.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable message (never contains prompt text).
    pub message: String,
    /// Parameter at fault, when known (a top-level field or a path such as `messages[0].role`).
    pub param: Option<String>,
    /// Seconds for `Retry-After` (429/503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// An error with this status and message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), param: None, retry_after: None }
    }

    /// 400 naming a parameter.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self { param: Some(param.into()), ..Self::new(StatusCode::BAD_REQUEST, message) }
    }

    /// OpenAI's string `code` for this error, or `None` (JSON null).
    fn code(&self) -> Option<&'static str> {
        match self.status {
            StatusCode::UNAUTHORIZED => Some("invalid_api_key"),
            StatusCode::NOT_FOUND if self.param.as_deref() == Some("model") => Some("model_not_found"),
            StatusCode::TOO_MANY_REQUESTS => Some("rate_limit_exceeded"),
            StatusCode::METHOD_NOT_ALLOWED => Some("method_not_allowed"),
            StatusCode::PAYLOAD_TOO_LARGE => Some("request_too_large"),
            _ => None,
        }
    }

    /// OpenAI's `type` for this status.
    fn kind(&self) -> &'static str {
        match self.status {
            // OpenAI's own 401: `invalid_request_error` with code `invalid_api_key`.
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            // The request's own deadline (`timeout_ms`, `--request-timeout`): not an outage.
            StatusCode::GATEWAY_TIMEOUT => "timeout_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The metrics outcome of this error.
    pub fn outcome(&self) -> Outcome {
        match self.status {
            StatusCode::UNAUTHORIZED => Outcome::Unauthenticated,
            StatusCode::NOT_FOUND => Outcome::NotFound,
            StatusCode::TOO_MANY_REQUESTS => Outcome::Overloaded,
            StatusCode::SERVICE_UNAVAILABLE => Outcome::Unavailable,
            StatusCode::GATEWAY_TIMEOUT => Outcome::Timeout,
            s if s.is_client_error() => Outcome::BadRequest,
            _ => Outcome::Error,
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.code(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        r
    }
}

/// Worker gRPC status code → HTTP status (the only such mapping in the router).
pub fn http_status(code: Code) -> StatusCode {
    match code {
        Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => StatusCode::BAD_REQUEST,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable | Code::Cancelled | Code::Aborted => StatusCode::SERVICE_UNAVAILABLE,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unknown => StatusCode::BAD_GATEWAY,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The message of a worker OUT_OF_RANGE: tonic's own refusal of a message over a size limit
/// on the router ↔ worker hop (the engine never answers OUT_OF_RANGE). Not the client's fault
/// (500, never 400) and tonic's text is no business of the client's: it is logged instead.
pub const INTERNAL_HOP_MESSAGE: &str = "internal error: the request could not be passed to its replica";

/// gRPC metadata key in which a worker names the request field an INVALID_ARGUMENT is about
/// (e.g. `prompt` for an empty prompt or one over the context length).
pub const PARAM_METADATA: &str = "prism-param";

impl From<crate::validate::Invalid> for ApiError {
    fn from(e: crate::validate::Invalid) -> Self {
        Self::invalid(e.param, e.message)
    }
}

impl From<DispatchError> for ApiError {
    fn from(e: DispatchError) -> Self {
        let message = e.to_string();
        let retry_after = e.retry_after_s();
        match e {
            DispatchError::UnknownModel(_) => {
                Self { param: Some("model".into()), ..Self::new(StatusCode::NOT_FOUND, message) }
            }
            DispatchError::NoReplica(_)
            | DispatchError::NoReplicaInTime { .. }
            | DispatchError::ReplicaLost { .. }
            | DispatchError::Unavailable { .. }
            | DispatchError::NoRouteTable => {
                Self { retry_after, ..Self::new(StatusCode::SERVICE_UNAVAILABLE, message) }
            }
            DispatchError::Overloaded { .. } => {
                Self { retry_after, ..Self::new(StatusCode::TOO_MANY_REQUESTS, message) }
            }
            DispatchError::DeadlineExceeded => Self::new(StatusCode::GATEWAY_TIMEOUT, message),
            DispatchError::Worker(s) if s.code() == Code::OutOfRange => {
                tracing::warn!(message = s.message(), "internal gRPC hop refused a message");
                Self::new(StatusCode::INTERNAL_SERVER_ERROR, INTERNAL_HOP_MESSAGE)
            }
            DispatchError::Worker(s) => {
                let status = http_status(s.code());
                let retry_after =
                    matches!(status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE).then_some(1);
                // The worker names the field of an INVALID_ARGUMENT in `prism-param` metadata.
                let param = (status == StatusCode::BAD_REQUEST)
                    .then(|| s.metadata().get(PARAM_METADATA).and_then(|v| v.to_str().ok()).map(str::to_owned))
                    .flatten();
                Self { retry_after, param, ..Self::new(status, s.message().to_owned()) }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_types_follow_the_status() {
        let kind = |e: ApiError| e.body()["error"]["type"].clone();
        assert_eq!(kind(DispatchError::DeadlineExceeded.into()), "timeout_error");
        assert_eq!(kind(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "x")), "service_unavailable");
        assert_eq!(kind(ApiError::new(StatusCode::TOO_MANY_REQUESTS, "x")), "rate_limit_error");
        assert_eq!(kind(ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "x")), "server_error");
        assert_eq!(kind(ApiError::invalid("n", "x")), "invalid_request_error");
    }
}
