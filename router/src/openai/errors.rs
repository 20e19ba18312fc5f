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
    /// Parameter at fault, when known.
    pub param: Option<&'static str>,
    /// Seconds for `Retry-After` (429/503).
    pub retry_after: Option<u32>,
}

impl ApiError {
    /// An error with this status and message.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self { status, message: message.into(), param: None, retry_after: None }
    }

    /// 400 naming a parameter.
    pub fn invalid(param: &'static str, message: impl Into<String>) -> Self {
        Self { param: Some(param), ..Self::new(StatusCode::BAD_REQUEST, message) }
    }

    /// OpenAI's `type` for this status.
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE | StatusCode::GATEWAY_TIMEOUT => "service_unavailable",
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
            "code": self.status.as_u16(),
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

impl From<DispatchError> for ApiError {
    fn from(e: DispatchError) -> Self {
        let message = e.to_string();
        match e {
            DispatchError::UnknownModel(_) => Self { param: Some("model"), ..Self::new(StatusCode::NOT_FOUND, message) },
            DispatchError::NoReplica(_) => {
                Self { retry_after: Some(1), ..Self::new(StatusCode::SERVICE_UNAVAILABLE, message) }
            }
            DispatchError::Overloaded => Self { retry_after: Some(1), ..Self::new(StatusCode::TOO_MANY_REQUESTS, message) },
            DispatchError::DeadlineExceeded => Self::new(StatusCode::GATEWAY_TIMEOUT, message),
            DispatchError::Worker(s) => {
                let status = http_status(s.code());
                let retry_after = matches!(status, StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE).then_some(1);
                Self { retry_after, ..Self::new(status, s.message().to_owned()) }
            }
        }
    }
}
