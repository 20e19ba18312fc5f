//! Why a request could not be served: [`DispatchError`], mapped to HTTP in
//! `openai::errors` and to gRPC in `grpc::to_status`.

use tonic::{Code, Status};

/// Why a request could not be served.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// No route knows this model (404).
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    /// The model exists but no replica can take work (503).
    #[error("no ready replica for model `{0}`")]
    NoReplica(String),
    /// Every replica is at its in-flight limit (429).
    #[error("every replica of the model is at its in-flight limit; retry later")]
    Overloaded,
    /// The request's deadline passed (504).
    #[error("the request deadline was exceeded")]
    DeadlineExceeded,
    /// The worker answered with this status.
    #[error("worker error: {}", .0.message())]
    Worker(Status),
}

impl DispatchError {
    /// The error of a worker status: DEADLINE_EXCEEDED is the request's own deadline,
    /// anything else the worker's answer.
    pub(super) fn from_status(s: Status) -> Self {
        if s.code() == Code::DeadlineExceeded { Self::DeadlineExceeded } else { Self::Worker(s) }
    }
}
