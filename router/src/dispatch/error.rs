//! Why a request could not be served: [`DispatchError`], mapped to HTTP in
//! `openai::errors` and to gRPC in `grpc::to_status`.

use tonic::{Code, Status};

use crate::admission::{AdmitError, Bound};

/// Why a request could not be served.
#[derive(Debug, thiserror::Error)]
pub enum DispatchError {
    /// No route knows this model (404).
    #[error("the model `{0}` does not exist")]
    UnknownModel(String),
    /// The model exists but no replica can take work (503).
    #[error("no ready replica for model `{0}`")]
    NoReplica(String),
    /// The model was listed without a Ready replica and none came while the request waited
    /// in the admission queue (503 with `Retry-After`).
    #[error("no ready replica for model `{model}` came in time; retry after {retry_after_s} s")]
    NoReplicaInTime {
        /// Served model name.
        model: String,
        /// Suggested `Retry-After`, seconds.
        retry_after_s: u32,
    },
    /// Every replica is at its limit and the admission queue is past a bound (429 with
    /// `Retry-After`).
    #[error("the model is overloaded ({reason}); retry after {retry_after_s} s")]
    Overloaded {
        /// Which bound: `admission queue full`, `admission queue token bound`, `queue wait bound`.
        reason: &'static str,
        /// Suggested `Retry-After`, seconds.
        retry_after_s: u32,
    },
    /// The request's deadline passed (504).
    #[error("the request deadline was exceeded")]
    DeadlineExceeded,
    /// The worker answered with this status.
    #[error("worker error: {}", .0.message())]
    Worker(Status),
}

impl DispatchError {
    /// The `Retry-After` seconds this error suggests (429 / 503 kinds).
    pub fn retry_after_s(&self) -> Option<u32> {
        match self {
            Self::NoReplica(_) => Some(1),
            Self::NoReplicaInTime { retry_after_s, .. } | Self::Overloaded { retry_after_s, .. } => {
                Some(*retry_after_s)
            }
            _ => None,
        }
    }

    /// The error of an admission refusal for `model`.
    pub(super) fn from_admit(e: AdmitError, model: &str) -> Self {
        match e {
            AdmitError::UnknownModel => Self::UnknownModel(model.to_owned()),
            AdmitError::NoneUsable => Self::NoReplica(model.to_owned()),
            AdmitError::NoReplicaInTime { retry_after_s } => {
                Self::NoReplicaInTime { model: model.to_owned(), retry_after_s }
            }
            AdmitError::Rejected { bound, retry_after_s } => {
                let reason = match bound {
                    Bound::Full => "admission queue full",
                    Bound::Tokens => "admission queue token bound",
                    Bound::Timeout | Bound::Deadline => "queue wait bound",
                };
                Self::Overloaded { reason, retry_after_s }
            }
            AdmitError::DeadlineExceeded => Self::DeadlineExceeded,
        }
    }

    /// The error of a worker status: DEADLINE_EXCEEDED is the request's own deadline,
    /// anything else the worker's answer.
    pub(super) fn from_status(s: Status) -> Self {
        if s.code() == Code::DeadlineExceeded { Self::DeadlineExceeded } else { Self::Worker(s) }
    }
}
