//! `EtcdStore`: the production [`StateStore`] on etcd v3 (etcd-client 0.21).
//!
//! Unary calls (get/put/txn/lease) go through etcd-client's balanced channel, which
//! reconnects by itself. Watches and lease keep-alives are streams that etcd-client does not
//! re-establish, so this module owns that: a watch runs in a task that re-creates the etcd
//! watch from the last delivered revision + 1 after any stream error (with backoff), and
//! answers a compacted start revision with a [`WatchEvent::Resync`] built from a fresh list.
//! `keep_alive` opens a short keep-alive exchange per refresh; lease loss is reported as
//! [`StoreError::LeaseNotFound`] — re-granting is the caller's job.

use async_trait::async_trait;
use etcd_client::{
    Client, Compare as EtcdCompare, CompareOp, ConnectOptions, EventType, GetOptions, KeyValue, KvClient, PutOptions,
    Txn as EtcdTxn, TxnOp as EtcdTxnOp, WatchClient, WatchOptions,
};
use prism_common::state_store::{
    Compare, LeaseId, Revision, StateStore, StoreError, StoreResult, Txn, TxnOp, TxnResult, Versioned, WatchEvent,
    WatchStream,
};
use std::time::Duration;
use tokio::sync::mpsc;

/// Deadline of one unary request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Deadline for establishing a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// First and largest pause between watch re-establishment attempts.
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Buffered watch events per watcher.
const WATCH_BUFFER: usize = 1024;
/// Keys per range response of [`StateStore::list`]: a prefix is read in pages at one
/// revision, so no single response grows with the cluster (100,000 replica records are
/// about 16 MB in one response, over any sane gRPC message limit).
pub const LIST_PAGE_KEYS: i64 = 1_000;
/// Largest response the etcd client decodes (tonic's default is 4 MiB). A page of
/// [`LIST_PAGE_KEYS`] records is far below it; the headroom is for pages of large values
/// and for watch responses, which etcd batches up to its own limit.
pub const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// A [`StateStore`] backed by an etcd cluster. Cheap to clone.
#[derive(Clone)]
pub struct EtcdStore {
    client: Client,
    /// KV calls, decoding responses up to [`MAX_RESPONSE_BYTES`].
    kv: KvClient,
    /// Watch streams, decoding responses up to [`MAX_RESPONSE_BYTES`].
    watch: WatchClient,
}

impl EtcdStore {
    /// Connects to an etcd cluster (`host:port` or `http://host:port` endpoints) and checks
    /// that it answers.
    ///
    /// # Errors
    /// [`StoreError::Unavailable`] when no endpoint answers within the connect timeout.
    pub async fn connect<S: AsRef<str>>(endpoints: &[S]) -> StoreResult<Self> {
        if endpoints.is_empty() {
            return Err(StoreError::InvalidArgument("no etcd endpoints".into()));
        }
        let eps: Vec<&str> = endpoints.iter().map(AsRef::as_ref).collect();
        let opts = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_timeout(REQUEST_TIMEOUT)
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            .with_keep_alive_while_idle(true);
        let client = Client::connect(eps, Some(opts)).await.map_err(classify)?;
        let kv = client.kv_client().max_decoding_message_size(MAX_RESPONSE_BYTES);
        let watch = client.watch_client().max_decoding_message_size(MAX_RESPONSE_BYTES);
        let store = Self { client, kv, watch };
        // Fail fast on a wrong address rather than on the first real request.
        store.current_revision("/").await?;
        Ok(store)
    }

    /// The etcd client, for operations this trait does not cover (compaction, status).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    async fn current_revision(&self, key: &str) -> StoreResult<Revision> {
        let resp = self.kv.clone().get(key, Some(GetOptions::new().with_count_only())).await.map_err(classify)?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }
}

/// Classifies an etcd-client error once.
fn classify(e: etcd_client::Error) -> StoreError {
    use etcd_client::Error as E;
    match e {
        E::GRpcStatus(s) => match s.code() {
            tonic::Code::Unavailable
            | tonic::Code::DeadlineExceeded
            | tonic::Code::Cancelled
            | tonic::Code::Aborted
            | tonic::Code::Unknown => StoreError::Unavailable(s.message().to_owned()),
            tonic::Code::InvalidArgument | tonic::Code::OutOfRange => {
                StoreError::InvalidArgument(s.message().to_owned())
            }
            tonic::Code::NotFound => StoreError::NotFound(s.message().to_owned()),
            _ => StoreError::Internal(format!("{:?}: {}", s.code(), s.message())),
        },
        E::TransportError(t) => StoreError::Unavailable(t.to_string()),
        E::IoError(io) => StoreError::Unavailable(io.to_string()),
        E::WatchError(m) | E::LeaseKeepAliveError(m) => StoreError::Unavailable(m),
        E::InvalidArgs(m) => StoreError::InvalidArgument(m),
        other => StoreError::Internal(other.to_string()),
    }
}

/// Maps a "lease not found" answer (gRPC NOT_FOUND) on an operation naming `lease`.
fn classify_lease(lease: LeaseId) -> impl Fn(etcd_client::Error) -> StoreError {
    move |e| match classify(e) {
        StoreError::NotFound(_) => StoreError::LeaseNotFound(lease),
        other => other,
    }
}

fn versioned(kv: &KeyValue) -> Versioned {
    Versioned {
        value: kv.value().to_vec(),
        mod_revision: kv.mod_revision(),
        create_revision: kv.create_revision(),
        lease: (kv.lease() != 0).then_some(kv.lease()),
    }
}

fn key_string(kv: &KeyValue) -> Option<String> {
    match kv.key_str() {
        Ok(k) => Some(k.to_owned()),
        Err(_) => {
            tracing::warn!(key = ?kv.key(), "etcd key is not UTF-8; skipped");
            None
        }
    }
}

/// The end of the key range holding every key that starts with `prefix` (etcd's
/// `range_end`): the prefix with its last byte below 0xff incremented; `[0]` (every key from
/// the start on) when there is none, as for the empty prefix.
fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    match prefix.iter().rposition(|&b| b < 0xff) {
        Some(i) => {
            let mut end = prefix[..=i].to_vec();
            end[i] += 1;
            end
        }
        None => vec![0],
    }
}

fn to_etcd_op(op: TxnOp) -> EtcdTxnOp {
    match op {
        TxnOp::Put { key, value, lease } => EtcdTxnOp::put(key, value, lease.map(|l| PutOptions::new().with_lease(l))),
        TxnOp::Delete { key } => EtcdTxnOp::delete(key, None),
    }
}

/// The lease named by the first put of a branch, for error classification.
fn first_lease(ops: &[TxnOp]) -> Option<LeaseId> {
    ops.iter().find_map(|op| match op {
        TxnOp::Put { lease, .. } => *lease,
        TxnOp::Delete { .. } => None,
    })
}

#[async_trait]
impl StateStore for EtcdStore {
    async fn get(&self, key: &str) -> StoreResult<Option<Versioned>> {
        let resp = self.kv.clone().get(key, None).await.map_err(classify)?;
        Ok(resp.kvs().first().map(versioned))
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> StoreResult<Revision> {
        let opts = lease.map(|l| PutOptions::new().with_lease(l));
        let resp = self.kv.clone().put(key, value, opts).await.map_err(classify_lease(lease.unwrap_or(0)))?;
        Ok(resp.header().map_or(0, |h| h.revision()))
    }

    async fn delete(&self, key: &str) -> StoreResult<bool> {
        let resp = self.kv.clone().delete(key, None).await.map_err(classify)?;
        Ok(resp.deleted() > 0)
    }

    async fn list(&self, prefix: &str) -> StoreResult<(Vec<(String, Versioned)>, Revision)> {
        // Pages of `LIST_PAGE_KEYS` keys, each continuing after the last key of the one before,
        // all at the revision of the first page so the result is one consistent snapshot.
        let end = prefix_end(prefix.as_bytes());
        let mut from = if prefix.is_empty() { vec![0] } else { prefix.as_bytes().to_vec() };
        let mut revision = 0;
        let mut items = Vec::new();
        loop {
            let mut opts = GetOptions::new().with_range(end.clone()).with_limit(LIST_PAGE_KEYS);
            if revision > 0 {
                opts = opts.with_revision(revision);
            }
            let resp = self.kv.clone().get(from.clone(), Some(opts)).await.map_err(classify)?;
            if revision == 0 {
                revision = resp.header().map_or(0, |h| h.revision());
            }
            items.extend(resp.kvs().iter().filter_map(|kv| Some((key_string(kv)?, versioned(kv)))));
            match resp.kvs().last() {
                Some(last) if resp.more() => {
                    // The smallest key after `last`.
                    from = last.key().to_vec();
                    from.push(0);
                }
                _ => return Ok((items, revision)),
            }
        }
    }

    async fn txn(&self, txn: Txn) -> StoreResult<TxnResult> {
        let lease = first_lease(&txn.success).or_else(|| first_lease(&txn.failure)).unwrap_or(0);
        let compares: Vec<EtcdCompare> = txn
            .compares
            .into_iter()
            .map(|c| match c {
                Compare::ModRevision { key, revision } => EtcdCompare::mod_revision(key, CompareOp::Equal, revision),
            })
            .collect();
        let etcd_txn = EtcdTxn::new()
            .when(compares)
            .and_then(txn.success.into_iter().map(to_etcd_op).collect::<Vec<_>>())
            .or_else(txn.failure.into_iter().map(to_etcd_op).collect::<Vec<_>>());
        let resp = self.kv.clone().txn(etcd_txn).await.map_err(classify_lease(lease))?;
        Ok(TxnResult { succeeded: resp.succeeded(), revision: resp.header().map_or(0, |h| h.revision()) })
    }

    async fn grant_lease(&self, ttl_secs: i64) -> StoreResult<LeaseId> {
        if ttl_secs <= 0 {
            return Err(StoreError::InvalidArgument(format!("lease TTL {ttl_secs}s must be positive")));
        }
        let resp = self.client.lease_client().grant(ttl_secs, None).await.map_err(classify)?;
        Ok(resp.id())
    }

    async fn keep_alive(&self, lease: LeaseId) -> StoreResult<()> {
        // etcd-client's `keep_alive` sends one refresh and reads its answer: it fails with
        // `LeaseKeepAliveError("lease not found")` when etcd answers TTL 0 (the lease is gone).
        // That string is the only signal the crate gives for this case.
        let exchange = async {
            match self.client.lease_client().keep_alive(lease).await {
                Ok(_) => Ok(()),
                Err(etcd_client::Error::LeaseKeepAliveError(m)) if m.contains("not found") => {
                    Err(StoreError::LeaseNotFound(lease))
                }
                Err(e) => Err(classify_lease(lease)(e)),
            }
        };
        tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .map_err(|_| StoreError::Unavailable("lease keep-alive timed out".into()))?
    }

    async fn revoke_lease(&self, lease: LeaseId) -> StoreResult<()> {
        match self.client.lease_client().revoke(lease).await.map_err(classify_lease(lease)) {
            Ok(_) | Err(StoreError::LeaseNotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn watch(&self, prefix: &str, start_revision: Option<Revision>) -> StoreResult<WatchStream> {
        let next = match start_revision {
            Some(r) if r > 0 => r,
            _ => self.current_revision(prefix).await? + 1,
        };
        let (tx, rx) = mpsc::channel(WATCH_BUFFER);
        let task = WatchTask { store: self.clone(), prefix: prefix.to_owned(), next, tx };
        tokio::spawn(task.run());
        Ok(Box::pin(futures::stream::unfold(rx, |mut rx| async move {
            let event = rx.recv().await?;
            Some((event, rx))
        })))
    }
}

/// Why one etcd watch stream ended.
enum Ended {
    /// The consumer dropped the stream: stop.
    ConsumerGone,
    /// The stream failed or was cancelled: re-create it from `next`.
    Retry,
    /// `next` was compacted: list, send a resync, continue after it.
    Compacted,
}

/// Owns one prefix watch across etcd reconnections.
struct WatchTask {
    store: EtcdStore,
    prefix: String,
    /// Lowest revision not yet delivered.
    next: Revision,
    tx: mpsc::Sender<WatchEvent>,
}

impl WatchTask {
    async fn run(mut self) {
        let mut backoff = BACKOFF_MIN;
        let consumer = self.tx.clone();
        loop {
            let ended = tokio::select! {
                () = consumer.closed() => Ended::ConsumerGone,
                ended = self.stream_once(&mut backoff) => ended,
            };
            match ended {
                Ended::ConsumerGone => return,
                Ended::Compacted => {
                    if self.resync().await.is_err() {
                        return;
                    }
                    backoff = BACKOFF_MIN;
                }
                Ended::Retry => {
                    tokio::select! {
                        () = self.tx.closed() => return,
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    /// Runs one etcd watch stream from `self.next` until it ends.
    async fn stream_once(&mut self, backoff: &mut Duration) -> Ended {
        let opts = WatchOptions::new().with_prefix().with_start_revision(self.next);
        let mut stream = match self.store.watch.clone().watch(self.prefix.as_str(), Some(opts)).await {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!(prefix = %self.prefix, error = %e, "etcd watch: cannot start, retrying");
                return Ended::Retry;
            }
        };
        loop {
            let resp = match stream.message().await {
                Ok(Some(r)) => r,
                Ok(None) => return Ended::Retry,
                Err(e) => {
                    tracing::debug!(prefix = %self.prefix, error = %e, "etcd watch broke; resuming");
                    return Ended::Retry;
                }
            };
            if resp.compact_revision() > 0 {
                tracing::info!(prefix = %self.prefix, from = self.next, compacted = resp.compact_revision(), "etcd watch start revision compacted; resyncing");
                return Ended::Compacted;
            }
            if resp.canceled() {
                tracing::debug!(prefix = %self.prefix, reason = resp.cancel_reason(), "etcd watch cancelled; resuming");
                return Ended::Retry;
            }
            *backoff = BACKOFF_MIN;
            let mut last = None;
            for ev in resp.events() {
                let Some(kv) = ev.kv() else { continue };
                let Some(key) = key_string(kv) else { continue };
                let rev = kv.mod_revision();
                let event = match ev.event_type() {
                    EventType::Put => WatchEvent::Put { key, value: kv.value().to_vec(), mod_revision: rev },
                    EventType::Delete => WatchEvent::Delete { key, mod_revision: rev },
                };
                if self.tx.send(event).await.is_err() {
                    return Ended::ConsumerGone;
                }
                last = Some(rev);
            }
            // etcd never splits one revision across responses (no fragmenting requested).
            if let Some(rev) = last {
                self.next = rev + 1;
            }
        }
    }

    /// Lists the prefix (retrying while etcd is away) and sends a `Resync`.
    async fn resync(&mut self) -> Result<(), ()> {
        let mut backoff = BACKOFF_MIN;
        loop {
            match self.store.list(&self.prefix).await {
                Ok((entries, revision)) => {
                    self.next = revision + 1;
                    return self.tx.send(WatchEvent::Resync { entries, revision }).await.map_err(|_| ());
                }
                Err(e) => {
                    tracing::debug!(prefix = %self.prefix, error = %e, "etcd resync list failed; retrying");
                    tokio::select! {
                        () = self.tx.closed() => return Err(()),
                        () = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::prefix_end;

    #[test]
    fn prefix_end_is_the_first_key_after_the_prefix() {
        assert_eq!(prefix_end(b"/prism/v1/replicas/"), b"/prism/v1/replicas0");
        assert_eq!(prefix_end(b"a\xff\xff"), b"b");
        assert_eq!(prefix_end(b"\xff"), [0]);
        assert_eq!(prefix_end(b""), [0]);
    }
}
