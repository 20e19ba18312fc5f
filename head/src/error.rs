//! The head's error type and its one mapping to `tonic::Status`.

use prism_common::state_store::StoreError;
use tonic::metadata::MetadataValue;

/// Metadata key naming the current leader on `UNAVAILABLE` answers from followers.
pub const LEADER_METADATA: &str = "prism-leader";

/// Errors of head operations, classified where the cause is known.
#[derive(Debug, thiserror::Error)]
pub enum HeadError {
    /// The request is malformed (bad name, tensor_parallel_size 0, bad inventory …).
    #[error("{0}")]
    InvalidArgument(String),
    /// The operation does not apply in the object's current state (scaling an autoscaled
    /// deployment by hand).
    #[error("{0}")]
    FailedPrecondition(String),
    /// A worker registered with a node id whose live session belongs to another worker
    /// process; `expires_in` is how long that session lasts if its worker has stopped sending.
    #[error("{message}")]
    NodeIdInUse {
        /// What is refused and why, naming the node id and where the live worker is.
        message: String,
        /// Until the live session ends should its worker be gone.
        expires_in: std::time::Duration,
    },
    /// The named deployment or node does not exist.
    #[error("{0} not found")]
    NotFound(String),
    /// This head is not the leader; `leader` is the leader's address when known.
    #[error("not the leader; leader is {}", leader.as_deref().unwrap_or("unknown"))]
    NotLeader {
        /// The leader's advertised gRPC address.
        leader: Option<String>,
    },
    /// A concurrent write changed what this operation read; retry.
    #[error("conflicting update of {0}; retry")]
    Conflict(String),
    /// A stored record could not be decoded.
    #[error("corrupt record at {key}: {reason}")]
    Corrupt {
        /// Store key.
        key: String,
        /// Decode error.
        reason: String,
    },
    /// The state store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Result alias for head operations.
pub type HeadResult<T> = Result<T, HeadError>;

impl From<prism_common::deployment::InvalidSpec> for HeadError {
    fn from(e: prism_common::deployment::InvalidSpec) -> Self {
        HeadError::InvalidArgument(e.0)
    }
}

impl From<HeadError> for tonic::Status {
    fn from(e: HeadError) -> Self {
        let msg = e.to_string();
        match e {
            HeadError::InvalidArgument(_) => tonic::Status::invalid_argument(msg),
            HeadError::NotFound(_) => tonic::Status::not_found(msg),
            HeadError::FailedPrecondition(_) => tonic::Status::failed_precondition(msg),
            HeadError::NotLeader { leader } => {
                let mut s = tonic::Status::unavailable(msg);
                if let Some(l) = leader.and_then(|l| MetadataValue::try_from(l.as_str()).ok()) {
                    s.metadata_mut().insert(LEADER_METADATA, l);
                }
                s
            }
            HeadError::NodeIdInUse { expires_in, .. } => {
                let mut s = tonic::Status::already_exists(msg);
                if let Ok(v) = MetadataValue::try_from(expires_in.as_millis().to_string()) {
                    s.metadata_mut().insert(prism_common::proto::SESSION_EXPIRES_METADATA, v);
                }
                s
            }
            HeadError::Conflict(_) => tonic::Status::aborted(msg),
            HeadError::Corrupt { .. } => tonic::Status::internal(msg),
            HeadError::Store(StoreError::Unavailable(_)) => tonic::Status::unavailable(msg),
            HeadError::Store(StoreError::InvalidArgument(_)) => tonic::Status::invalid_argument(msg),
            HeadError::Store(StoreError::NotFound(_)) => tonic::Status::not_found(msg),
            HeadError::Store(StoreError::Conflict(_)) => tonic::Status::aborted(msg),
            HeadError::Store(_) => tonic::Status::internal(msg),
        }
    }
}
