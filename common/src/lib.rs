//! Prism's shared crate: the `prism.v1` protocol, the engine flags of a deployment and the
//! validation of its spec, newtype ids, shutdown and telemetry helpers, and the `StateStore`
//! trait with its embedded implementation. It depends on no backend (no etcd-client, cudarc
//! or axum), as TiKV's trait crates do.

pub mod bearer;
pub mod deployment;
pub mod engine_flags;
pub mod head_auth;
pub mod listen;
pub mod model_root;
pub mod proto;
pub mod shutdown;
pub mod state_store;
pub mod telemetry;
pub mod text;
pub mod time;
pub mod tls;

/// The newtype ids live in `prism-ids` (shared with the engine, which has no protocol
/// dependency); re-exported here so `prism_common::ids::NodeId` keeps working.
pub use prism_ids as ids;
pub use prism_ids::{DeploymentName, NodeId, ReplicaId, RequestId};
