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

/// Largest `WorkerService` message either end encodes or decodes, in bytes (router → worker
/// `Generate` and its answers). A request carries the prompt's text and, tokenized by the
/// router, its token ids (up to 5 bytes each, at most one per byte of text): 64 MiB covers the
/// router's default 4 MiB body limit several times over, so an oversized prompt reaches the
/// engine and gets its context-length 400 instead of tonic's 4 MiB default refusing it.
pub const WORKER_MAX_MESSAGE_BYTES: usize = 64 << 20;
