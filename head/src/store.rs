//! State store backends for the head: [`EtcdStore`] (production, etcd v3) and the
//! [`EmbeddedStore`] from `prism-common` (one machine), both behind `Arc<dyn StateStore>`.

pub mod etcd;

pub use etcd::EtcdStore;
pub use prism_common::state_store::{EmbeddedStore, StateStore, StoreError};

use crate::config::StoreSpec;
use std::sync::Arc;

/// Opens the store named by `spec`: connects to etcd, or opens (creating if needed) the
/// embedded store's file. Must run inside a tokio runtime.
///
/// # Errors
/// [`StoreError::Unavailable`] when etcd cannot be reached; [`StoreError::Internal`] when
/// the embedded file cannot be read or parsed.
pub async fn open(spec: &StoreSpec) -> Result<Arc<dyn StateStore>, StoreError> {
    match spec {
        StoreSpec::Etcd(endpoints) => Ok(Arc::new(EtcdStore::connect(endpoints).await?)),
        StoreSpec::Embedded(path) => Ok(Arc::new(EmbeddedStore::open(path)?)),
    }
}
