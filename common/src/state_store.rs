//! The state store: where the head keeps cluster state (nodes, deployments, replicas, the
//! election key). One trait, two implementations: `EtcdStore` (in `prism-head`, etcd-client)
//! for production and [`EmbeddedStore`] (in-process, optionally persisted to a file) for one
//! machine. The shape follows ai-dynamo's storage trait and etcd's v3 API: every key carries a
//! `mod_revision` and `create_revision` from one store-wide revision counter, transactions
//! compare mod revisions (0 = absent), keys may be bound to a lease, and watches resume from a
//! revision, signalling [`WatchEvent::Resync`] when that history is gone.
//!
//! This is called a *state store*, never a "KV store": KV means the attention cache here.

pub mod api;
pub mod embedded;
pub mod keep_alive;
pub mod keys;

pub use api::*;
pub use embedded::EmbeddedStore;
pub use keep_alive::spawn_keep_alive;
