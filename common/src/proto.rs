//! Generated `prism.v1` protocol (tonic + prost), compiled once by `build.rs`.

#![allow(clippy::all, missing_docs)]

/// All messages and services of package `prism.v1`.
pub mod v1 {
    tonic::include_proto!("prism.v1");
}

/// Encoded `FileDescriptorSet` of the protocol, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("prism_descriptor");

pub use v1::*;

/// Metadata key on the head's `ALREADY_EXISTS` refusal of a worker registration (its node
/// id has a live session from another worker process): milliseconds until that session ends
/// if its worker has stopped sending (the head's `--worker-timeout` after its last message).
pub const SESSION_EXPIRES_METADATA: &str = "prism-session-expires-ms";
