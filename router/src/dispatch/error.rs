//! Why a request could not be served: [`DispatchError`], mapped to HTTP in
//! `openai::errors` and to gRPC in `grpc::to_status`.

use prism_common::proto::v1::UnavailableCause;
use tonic::{Code, Status};

use crate::admission::{AdmitError, Bound};
use crate::routes::ModelUnavailable;

/// `Retry-After` of [`DispatchError::Unavailable`] for a deployment that failed or is scaled
/// to 0, seconds: nothing changes until someone changes the deployment, so a client should
/// not come back at once (the head replaces a replica that failed after serving about this
/// long after it failed).
pub const UNAVAILABLE_RETRY_AFTER_S: u32 = 10;

/// `Retry-After` of [`DispatchError::Unavailable`] when no node can run a replica, seconds:
/// workers that come back are used at once.
pub const NO_NODE_RETRY_AFTER_S: u32 = 5;

/// `Retry-After` of [`DispatchError::NoRouteTable`], seconds (the router retries the head
/// with a backoff of at most 5 s).
pub const NO_ROUTE_TABLE_RETRY_AFTER_S: u32 = 2;

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
    /// The replica serving the request failed (its worker died, froze, dropped the connection
    /// or stopped the replica) and no other replica could take the request over in time (503
    /// with `Retry-After`). The worker's own status (often a transport error) is logged, not
    /// sent.
    #[error("the replica serving the request {what}, and no other replica could continue it; retry after 1 s")]
    ReplicaLost {
        /// What happened to it, in words.
        what: &'static str,
    },
    /// No replica of the model is coming (503 with `Retry-After`, at once: waiting would be
    /// for nothing): its replicas failed to start, it is scaled to 0, or no node can run one.
    /// `reason` is a failed replica's as its worker reported it, or a Pending one's as the
    /// placer found it (may be empty).
    #[error("{}", unavailable_message(model, deployment, *cause, reason))]
    Unavailable {
        /// Served model name.
        model: String,
        /// The deployment serving it.
        deployment: String,
        /// Why no replica is coming.
        cause: UnavailableCause,
        /// In the worker's or the placer's words.
        reason: String,
    },
    /// No route table came from the head yet, so whether the model exists is not known (503
    /// with `Retry-After`, never 404: a client must not give up on a model that exists).
    #[error("no route table from the head yet; retry after {NO_ROUTE_TABLE_RETRY_AFTER_S} s")]
    NoRouteTable,
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
            Self::NoReplica(_) | Self::ReplicaLost { .. } => Some(1),
            Self::NoReplicaInTime { retry_after_s, .. } | Self::Overloaded { retry_after_s, .. } => {
                Some(*retry_after_s)
            }
            Self::Unavailable { cause: UnavailableCause::NoNode, .. } => Some(NO_NODE_RETRY_AFTER_S),
            Self::Unavailable { .. } => Some(UNAVAILABLE_RETRY_AFTER_S),
            Self::NoRouteTable => Some(NO_ROUTE_TABLE_RETRY_AFTER_S),
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
            AdmitError::Unavailable(u) => Self::unavailable(model, &u),
            AdmitError::NoRouteTable => Self::NoRouteTable,
        }
    }

    /// The error for `model`, which the head lists as unavailable (no replica is coming).
    pub fn unavailable(model: &str, why: &ModelUnavailable) -> Self {
        Self::Unavailable {
            model: model.to_owned(),
            deployment: why.deployment.clone(),
            cause: why.cause,
            reason: why.reason.clone(),
        }
    }

    /// The error of a worker status: DEADLINE_EXCEEDED is the request's own deadline,
    /// anything else the worker's answer.
    pub(super) fn from_status(s: Status) -> Self {
        if s.code() == Code::DeadlineExceeded { Self::DeadlineExceeded } else { Self::Worker(s) }
    }

    /// The error of the last failure of a request that could go to no other replica: a
    /// failure of the replica itself becomes [`Self::ReplicaLost`] (a clean 503 the client may
    /// retry), anything else (the request's own error, a full replica) stays the worker's.
    pub(super) fn from_last_failure(s: Status, replica: &str) -> Self {
        let what = match s.code() {
            Code::Unavailable | Code::Unknown | Code::Cancelled => "lost its worker",
            Code::Aborted | Code::NotFound => "was stopped",
            Code::Internal => "failed",
            _ => return Self::from_status(s),
        };
        tracing::warn!(%replica, code = ?s.code(), message = s.message(), "replica failed and no other could take the request");
        Self::ReplicaLost { what }
    }
}

/// `: REASON` when there is one.
fn because(reason: &str) -> String {
    if reason.is_empty() { String::new() } else { format!(": {reason}") }
}

/// The message of [`DispatchError::Unavailable`]: what is wrong and what to do.
fn unavailable_message(model: &str, deployment: &str, cause: UnavailableCause, reason: &str) -> String {
    let reason = because(reason);
    match cause {
        UnavailableCause::ScaledToZero => format!(
            "deployment `{deployment}` (model `{model}`) is scaled to 0 replicas; scale it up \
             (`prism scale {deployment} N`) and retry"
        ),
        UnavailableCause::NoNode => format!(
            "no node can run a replica of deployment `{deployment}` (model `{model}`){reason}; retry after \
             {NO_NODE_RETRY_AFTER_S} s (`prism status` shows the nodes)"
        ),
        UnavailableCause::Failed | UnavailableCause::Unspecified => format!(
            "the replicas of deployment `{deployment}` (model `{model}`) failed to start{reason}; fix the \
             deployment (`prism status` shows its replicas) and retry"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::errors::ApiError;
    use axum::http::StatusCode;

    #[test]
    fn a_replica_failure_with_nowhere_else_to_go_is_a_clean_retryable_503() {
        let lost =
            || DispatchError::from_last_failure(Status::unknown("h2 protocol error: error reading a body"), "r1");
        assert!(matches!(lost(), DispatchError::ReplicaLost { what: "lost its worker" }));
        let api = ApiError::from(lost());
        assert_eq!((api.status, api.retry_after), (StatusCode::SERVICE_UNAVAILABLE, Some(1)));
        assert!(!api.message.contains("h2"), "no transport internals in the reply: {}", api.message);
        let grpc = crate::grpc::to_status(lost());
        assert_eq!(grpc.code(), Code::Unavailable);
        assert_eq!(grpc.metadata().get(crate::admission::RETRY_AFTER_METADATA).map(|v| v.to_str().unwrap()), Some("1"));
        let stopped = DispatchError::from_last_failure(Status::aborted("replica stopping"), "r1");
        assert!(matches!(stopped, DispatchError::ReplicaLost { what: "was stopped" }));

        // The request's own errors and a full replica keep the worker's answer.
        let own = DispatchError::from_last_failure(Status::invalid_argument("prompt too long"), "r1");
        assert!(matches!(&own, DispatchError::Worker(s) if s.code() == Code::InvalidArgument));
        let full = DispatchError::from_last_failure(Status::resource_exhausted("full"), "r1");
        assert_eq!(ApiError::from(full).status, StatusCode::TOO_MANY_REQUESTS);
        let late = DispatchError::from_last_failure(Status::deadline_exceeded("late"), "r1");
        assert!(matches!(late, DispatchError::DeadlineExceeded));
    }

    /// A model no replica is coming to, and a router with no route table yet: 503 /
    /// UNAVAILABLE with `Retry-After` (never 404, which clients do not retry), by cause.
    #[test]
    fn unavailable_models_and_a_missing_route_table_are_retryable_503s() {
        let error = |cause: Option<UnavailableCause>| match cause {
            Some(cause) => DispatchError::Unavailable {
                model: "m".into(),
                deployment: "d".into(),
                cause,
                reason: "needs 1 slots on one node; no schedulable node".into(),
            },
            None => DispatchError::from_admit(AdmitError::NoRouteTable, "m"),
        };
        for (cause, retry) in [
            (Some(UnavailableCause::Failed), UNAVAILABLE_RETRY_AFTER_S),
            (Some(UnavailableCause::ScaledToZero), UNAVAILABLE_RETRY_AFTER_S),
            (Some(UnavailableCause::NoNode), NO_NODE_RETRY_AFTER_S),
            (None, NO_ROUTE_TABLE_RETRY_AFTER_S),
        ] {
            let grpc = crate::grpc::to_status(error(cause));
            assert_eq!(grpc.code(), Code::Unavailable, "{cause:?}");
            let secs = grpc.metadata().get(crate::admission::RETRY_AFTER_METADATA).and_then(|v| v.to_str().ok());
            assert_eq!(secs, Some(retry.to_string().as_str()), "{cause:?}");
            let api = ApiError::from(error(cause));
            assert_eq!((api.status, api.retry_after), (StatusCode::SERVICE_UNAVAILABLE, Some(retry)), "{cause:?}");
        }
    }
}
