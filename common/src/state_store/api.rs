//! The state store's interface: the [`StateStore`] trait and its value, transaction, watch
//! and error types (a leaf module: the implementations import it, it imports none of them).

use async_trait::async_trait;
use futures::stream::BoxStream;

/// A lease id, as etcd issues them (positive, store-assigned).
pub type LeaseId = i64;

/// A store-wide revision: increments once per mutating operation or transaction.
pub type Revision = i64;

/// A value with its versioning metadata, as etcd's `mvccpb.KeyValue`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versioned {
    /// The value bytes (usually a protobuf-encoded record from `proto/`).
    pub value: Vec<u8>,
    /// Revision of the last write to this key.
    pub mod_revision: Revision,
    /// Revision at which this key was created (since its last deletion).
    pub create_revision: Revision,
    /// Lease the key is bound to, if any (the key is deleted when the lease expires).
    pub lease: Option<LeaseId>,
}

/// A condition of a transaction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Compare {
    /// The key's `mod_revision` equals `revision`; `revision == 0` means "the key is absent".
    ModRevision {
        /// Full key.
        key: String,
        /// Expected mod revision (0 = absent).
        revision: Revision,
    },
}

impl Compare {
    /// The key is absent (create-if-absent).
    pub fn absent(key: impl Into<String>) -> Self {
        Self::ModRevision { key: key.into(), revision: 0 }
    }

    /// The key was last written at `revision` (compare-and-swap).
    pub fn mod_revision(key: impl Into<String>, revision: Revision) -> Self {
        Self::ModRevision { key: key.into(), revision }
    }
}

/// One operation of a transaction branch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TxnOp {
    /// Write `value` at `key`, optionally bound to a lease.
    Put {
        /// Full key.
        key: String,
        /// Value bytes.
        value: Vec<u8>,
        /// Lease to bind the key to.
        lease: Option<LeaseId>,
    },
    /// Delete `key` (no-op when absent).
    Delete {
        /// Full key.
        key: String,
    },
}

impl TxnOp {
    /// A put without a lease.
    pub fn put(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Self::Put { key: key.into(), value: value.into(), lease: None }
    }

    /// A delete.
    pub fn delete(key: impl Into<String>) -> Self {
        Self::Delete { key: key.into() }
    }
}

/// A transaction: if every compare holds, apply `success`, else apply `failure`; atomically.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Txn {
    /// Conditions, all of which must hold.
    pub compares: Vec<Compare>,
    /// Operations applied when every compare holds.
    pub success: Vec<TxnOp>,
    /// Operations applied otherwise.
    pub failure: Vec<TxnOp>,
}

/// The outcome of a transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TxnResult {
    /// Whether every compare held (and `success` was applied).
    pub succeeded: bool,
    /// Store revision after the transaction (the revision of its writes when it wrote).
    pub revision: Revision,
}

/// A change seen by a watch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WatchEvent {
    /// A key was created or updated.
    Put {
        /// Full key.
        key: String,
        /// New value bytes.
        value: Vec<u8>,
        /// Revision of this write.
        mod_revision: Revision,
    },
    /// A key was deleted (explicitly, or because its lease expired).
    Delete {
        /// Full key.
        key: String,
        /// Revision of the deletion.
        mod_revision: Revision,
    },
    /// The watch could not continue from where it was (the requested revision was compacted,
    /// the store restarted, or the watcher fell too far behind). `entries` is the complete
    /// current content of the watched prefix at `revision`: callers replace their view with it;
    /// later events have revisions greater than `revision`.
    Resync {
        /// Every key under the prefix with its value, sorted by key.
        entries: Vec<(String, Versioned)>,
        /// Revision of that snapshot.
        revision: Revision,
    },
}

impl WatchEvent {
    /// The revision this event brings the watcher to.
    pub fn revision(&self) -> Revision {
        match self {
            Self::Put { mod_revision, .. } | Self::Delete { mod_revision, .. } => *mod_revision,
            Self::Resync { revision, .. } => *revision,
        }
    }
}

/// A watch: events in revision order. It never ends on its own while the store lives
/// (implementations reconnect internally); drop it to stop watching.
pub type WatchStream = BoxStream<'static, WatchEvent>;

/// Errors of state store operations, classified once where the cause is known.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store cannot be reached (etcd down, connection lost); retrying later may succeed.
    #[error("state store unavailable: {0}")]
    Unavailable(String),
    /// A precondition did not hold (used by helpers built on transactions).
    #[error("conflict on {0}")]
    Conflict(String),
    /// A key that had to exist does not.
    #[error("not found: {0}")]
    NotFound(String),
    /// The lease does not exist (expired or revoked): keys bound to it are gone and the
    /// holder must grant a new lease and rewrite them.
    #[error("lease {0} not found (expired or revoked)")]
    LeaseNotFound(LeaseId),
    /// Invalid argument (empty key, non-positive TTL …).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The embedded store's file is already open in another store: another Prism process
    /// (or another store in this one) holds the exclusive lock on `lock`, the lock file next to
    /// `path`. Two stores on one file would overwrite each other's state.
    #[error("state store file {} is in use by another Prism process (it holds the lock {}); stop that process or use another file", path.display(), lock.display())]
    Locked {
        /// The snapshot file.
        path: std::path::PathBuf,
        /// Its lock file (`<path>.lock`).
        lock: std::path::PathBuf,
    },
    /// Anything else (I/O on the persistence file, unexpected responses).
    #[error("state store internal error: {0}")]
    Internal(String),
}

/// Most compares, and most operations per branch, one transaction may carry (etcd's default
/// `--max-txn-ops`); both stores reject larger transactions with
/// [`StoreError::InvalidArgument`]. Split bigger batches into several transactions.
pub const MAX_TXN_OPS: usize = 128;

/// Result alias for state store operations.
pub type StoreResult<T> = Result<T, StoreError>;

/// The state store API (etcd v3 semantics). All keys are full keys (see [`keys`]).
#[async_trait]
pub trait StateStore: Send + Sync + 'static {
    /// Reads one key.
    async fn get(&self, key: &str) -> StoreResult<Option<Versioned>>;

    /// Writes one key (optionally bound to a lease) and returns the new revision.
    ///
    /// # Errors
    /// [`StoreError::LeaseNotFound`] when `lease` does not exist.
    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> StoreResult<Revision>;

    /// Deletes one key; `true` when it existed.
    async fn delete(&self, key: &str) -> StoreResult<bool>;

    /// Every key starting with `prefix`, sorted by key, and the store revision of that read
    /// (watch from `revision + 1` to see every later change).
    async fn list(&self, prefix: &str) -> StoreResult<(Vec<(String, Versioned)>, Revision)>;

    /// Applies a transaction atomically.
    ///
    /// # Errors
    /// [`StoreError::LeaseNotFound`] when a put names a missing lease;
    /// [`StoreError::InvalidArgument`] when a list holds more than [`MAX_TXN_OPS`] entries.
    async fn txn(&self, txn: Txn) -> StoreResult<TxnResult>;

    /// Grants a lease with a time-to-live in seconds (etcd may round a small TTL up).
    async fn grant_lease(&self, ttl_secs: i64) -> StoreResult<LeaseId>;

    /// Refreshes a lease once (resets its TTL).
    ///
    /// # Errors
    /// [`StoreError::LeaseNotFound`] when it has already expired or was revoked.
    async fn keep_alive(&self, lease: LeaseId) -> StoreResult<()>;

    /// Revokes a lease, deleting every key bound to it. Revoking a missing lease is not an error.
    async fn revoke_lease(&self, lease: LeaseId) -> StoreResult<()>;

    /// Watches every key under `prefix`. With `start_revision = Some(r)` the stream first
    /// replays every change with revision ≥ r (or starts with a [`WatchEvent::Resync`] when
    /// that history is no longer available); with `None` it reports changes after now.
    async fn watch(&self, prefix: &str, start_revision: Option<Revision>) -> StoreResult<WatchStream>;
}
