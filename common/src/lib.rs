//! Prism's shared crate: the `prism.v1` protocol, newtype ids, shutdown and telemetry
//! helpers, and the `StateStore` trait with its embedded implementation. It depends on no
//! backend (no etcd-client, cudarc or axum), as TiKV's trait crates do.

pub mod ids;
pub mod proto;
pub mod shutdown;
pub mod state_store;
pub mod telemetry;

pub use ids::{DeploymentName, NodeId, ReplicaId, RequestId};
