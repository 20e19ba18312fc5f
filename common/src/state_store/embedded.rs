//! `EmbeddedStore`: the in-process state store for one machine (`prism up`), with etcd v3's
//! semantics — a store-wide revision, create/mod revisions per key, transactions comparing mod
//! revisions, leases with expiry, and prefix watches that resume from a revision.
//!
//! State is one `BTreeMap` behind a `std::sync::Mutex` (never held across `.await`), a bounded
//! history of recent changes for watch replay, a lease table checked by a background expiry
//! task, and a broadcast channel feeding live watchers. With a path it is persisted before
//! each mutation returns, as a snapshot at `<path>` plus an append-only log of the mutations
//! after it at `<path>.log` (one fsynced line each, so a write costs its own size, not the
//! store's; the snapshot is rewritten when the log outgrows it — see [`persist`]): a
//! committed write survives a crash. Keys bound to leases are *not* persisted (their holders
//! live in this process and die with it), so a reopened store has no leases; the revision
//! continues from the snapshot and log, and watches from revisions before the reopen get a
//! `Resync`.
//!
//! One file serves one store at a time: `open` takes an exclusive advisory lock
//! (`flock(LOCK_EX | LOCK_NB)` through `std::fs::File::try_lock`) on `<path>.lock` and holds it
//! until the last clone of the store is dropped, so a second Prism process on the same file
//! fails fast with [`StoreError::Locked`] instead of overwriting the first one's state. The
//! kernel releases the lock when the holder exits, also on SIGKILL. Dropping the last clone
//! first closes the store (under its mutex, so a lease expiry being persisted finishes first;
//! nothing is written after) and then unlocks, so the file can be reopened at once.

mod persist;

use super::api::{
    Compare, LeaseId, MAX_TXN_OPS, Revision, StateStore, StoreError, StoreResult, Txn, TxnOp, TxnResult, Versioned,
    WatchEvent, WatchStream,
};
use async_trait::async_trait;
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;
use tokio::sync::broadcast;
use tokio::time::Instant;

/// Changes kept for watch replay; older revisions answer with `Resync`.
const HISTORY_LIMIT: usize = 10_000;
/// Capacity of the live-event channel per watcher before it must resynchronise.
const BROADCAST_CAPACITY: usize = 4_096;
/// How often the expiry task checks lease deadlines.
const EXPIRY_TICK: Duration = Duration::from_millis(50);

/// The in-process [`StateStore`]. Cheap to clone (all clones share one store).
#[derive(Clone)]
pub struct EmbeddedStore {
    inner: Arc<Inner>,
    /// Persisted stores: the lock on `<path>.lock`, shared by the clones (not by watches or
    /// the expiry task, which hold the state only weakly or briefly).
    _lock: Option<Arc<StoreLock>>,
}

struct Inner {
    state: Mutex<State>,
    path: Option<PathBuf>,
}

/// The exclusive lock on a persisted store's `<path>.lock`, released when the last clone of
/// the store is dropped.
struct StoreLock {
    /// The locked file: held, never read.
    _file: std::fs::File,
    inner: Weak<Inner>,
}

impl Drop for StoreLock {
    fn drop(&mut self) {
        // Close before `_file` unlocks: a write still running (a lease expiry) ends first and
        // none follows, so the next holder of the lock owns the file alone.
        if let Some(inner) = self.inner.upgrade() {
            inner.lock().closed = true;
        }
    }
}

/// One committed change.
#[derive(Clone, Debug)]
struct Change {
    key: String,
    /// `None` for a deletion.
    value: Option<Vec<u8>>,
    revision: Revision,
}

struct Lease {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

struct State {
    data: BTreeMap<String, Versioned>,
    revision: Revision,
    /// History holds every change with a revision greater than this.
    compacted: Revision,
    history: VecDeque<Change>,
    leases: HashMap<LeaseId, Lease>,
    next_lease: LeaseId,
    live: broadcast::Sender<Change>,
    /// Every handle is gone and the file lock released (or about to be): never persist again.
    closed: bool,
    /// The snapshot and change log of a persisted store.
    disk: Option<persist::Disk>,
}

impl EmbeddedStore {
    /// A store that lives only in memory. Must be called inside a tokio runtime (it spawns
    /// the lease expiry task).
    ///
    /// # Errors
    /// [`StoreError::Internal`] outside a tokio runtime.
    pub fn in_memory() -> StoreResult<Self> {
        Self::build(State::new(1), None)
    }

    /// Opens (or creates) a store persisted at `path`, reloading its keys and revision.
    /// Must be called inside a tokio runtime.
    ///
    /// # Errors
    /// [`StoreError::Locked`] when another store (in this or another process) has `path`
    /// open; [`StoreError::Internal`] when the snapshot, its log or the lock file cannot be
    /// read or parsed (a torn last log record is dropped, see [`persist`]), or outside a
    /// runtime.
    pub fn open(path: impl AsRef<Path>) -> StoreResult<Self> {
        let path = path.as_ref().to_path_buf();
        // Lock before reading: the snapshot read must be the one this store then owns.
        let lock = lock_file(&path)?;
        let recovered = persist::recover(&path)?;
        let mut state = State::new(recovered.revision);
        if recovered.revision > 1 {
            // Changes before the reopen are in no history: watches from them resync.
            state.compacted = recovered.revision;
        }
        state.data = recovered.data;
        // A new snapshot at once: a store opened on a fresh path exists on disk, the replayed
        // log (and a torn last record) is folded in, and keys that were bound to (now gone)
        // leases in an older format never linger.
        state.disk = Some(persist::Disk::create(&path, &state.data, state.revision)?);
        let store = Self::build(state, Some(path))?;
        let lock = StoreLock { _file: lock, inner: Arc::downgrade(&store.inner) };
        Ok(Self { _lock: Some(Arc::new(lock)), ..store })
    }

    fn build(state: State, path: Option<PathBuf>) -> StoreResult<Self> {
        let handle = tokio::runtime::Handle::try_current()
            .map_err(|e| StoreError::Internal(format!("EmbeddedStore needs a tokio runtime: {e}")))?;
        let inner = Arc::new(Inner { state: Mutex::new(state), path });
        let weak = Arc::downgrade(&inner);
        handle.spawn(expiry_loop(weak));
        Ok(Self { inner, _lock: None })
    }

    /// The current store revision.
    pub fn revision(&self) -> Revision {
        self.inner.lock().revision
    }

    /// The file this store persists to, if any.
    pub fn path(&self) -> Option<&Path> {
        self.inner.path.as_deref()
    }
}

/// Opens (creating if needed) `<path>.lock` and takes an exclusive, non-blocking lock on it.
/// The file is never removed: deleting it while another process waits to open it would let
/// two processes lock two different files of one name.
///
/// # Errors
/// [`StoreError::Locked`] when another open file description holds the lock;
/// [`StoreError::Internal`] when the lock file cannot be created or locked.
fn lock_file(path: &Path) -> StoreResult<std::fs::File> {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    let lock = PathBuf::from(name);
    let io = |e: std::io::Error| StoreError::Internal(format!("lock {}: {e}", lock.display()));
    let file =
        std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&lock).map_err(io)?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Locked { path: path.to_path_buf(), lock }),
        Err(std::fs::TryLockError::Error(e)) => Err(io(e)),
    }
}

async fn expiry_loop(weak: Weak<Inner>) {
    loop {
        tokio::time::sleep(EXPIRY_TICK).await;
        let Some(inner) = weak.upgrade() else { return };
        let mut state = inner.lock();
        let now = Instant::now();
        let expired: Vec<LeaseId> = state.leases.iter().filter(|(_, l)| l.deadline <= now).map(|(id, _)| *id).collect();
        for id in expired {
            tracing::debug!(lease = id, "embedded store: lease expired");
            if let Err(e) = inner.remove_lease(&mut state, id) {
                tracing::warn!(error = %e, "embedded store: persisting lease expiry failed");
            }
        }
    }
}

impl State {
    fn new(revision: Revision) -> Self {
        let (live, _) = broadcast::channel(BROADCAST_CAPACITY);
        Self {
            data: BTreeMap::new(),
            revision,
            compacted: 0,
            history: VecDeque::new(),
            leases: HashMap::new(),
            next_lease: 1,
            live,
            closed: false,
            disk: None,
        }
    }

    fn list(&self, prefix: &str) -> Vec<(String, Versioned)> {
        self.data
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn check_lease(&self, lease: Option<LeaseId>) -> StoreResult<()> {
        match lease {
            Some(id) if !self.leases.contains_key(&id) => Err(StoreError::LeaseNotFound(id)),
            _ => Ok(()),
        }
    }

    fn apply_put(&mut self, key: &str, value: Vec<u8>, lease: Option<LeaseId>, rev: Revision) -> Change {
        let create_revision = match self.data.get(key) {
            Some(old) => {
                if old.lease != lease
                    && let Some(l) = old.lease.and_then(|id| self.leases.get_mut(&id))
                {
                    l.keys.remove(key);
                }
                old.create_revision
            }
            None => rev,
        };
        if let Some(l) = lease.and_then(|id| self.leases.get_mut(&id)) {
            l.keys.insert(key.to_owned());
        }
        let v = Versioned { value: value.clone(), mod_revision: rev, create_revision, lease };
        self.data.insert(key.to_owned(), v);
        Change { key: key.to_owned(), value: Some(value), revision: rev }
    }

    fn apply_delete(&mut self, key: &str, rev: Revision) -> Option<Change> {
        let old = self.data.remove(key)?;
        if let Some(l) = old.lease.and_then(|id| self.leases.get_mut(&id)) {
            l.keys.remove(key);
        }
        Some(Change { key: key.to_owned(), value: None, revision: rev })
    }

    fn holds(&self, compare: &Compare) -> bool {
        match compare {
            Compare::ModRevision { key, revision } => self.data.get(key).map_or(0, |v| v.mod_revision) == *revision,
        }
    }

    /// Records committed changes: history (bounded) and live watchers.
    fn commit(&mut self, changes: Vec<Change>) {
        let Some(last) = changes.last() else { return };
        self.revision = last.revision;
        for c in changes {
            // A send error only means nobody is watching.
            let _ = self.live.send(c.clone());
            self.history.push_back(c);
        }
        while self.history.len() > HISTORY_LIMIT {
            if let Some(old) = self.history.pop_front() {
                self.compacted = self.compacted.max(old.revision);
            }
        }
        // Never keep half a revision: drop the rest of the trimmed revision too.
        while self.history.front().is_some_and(|c| c.revision <= self.compacted) {
            self.history.pop_front();
        }
    }

    /// Where a watch starts: events to deliver first and the lowest revision of live events
    /// still to deliver.
    fn start_watch(&self, prefix: &str, from: Option<Revision>) -> (Vec<WatchEvent>, Revision) {
        match from {
            Some(r) if r > 0 && r > self.compacted => {
                let replay = self
                    .history
                    .iter()
                    .filter(|c| c.revision >= r && c.key.starts_with(prefix))
                    .map(to_event)
                    .collect();
                (replay, r.max(self.revision + 1))
            }
            Some(r) if r > 0 => {
                let resync = WatchEvent::Resync { entries: self.list(prefix), revision: self.revision };
                (vec![resync], self.revision + 1)
            }
            _ => (Vec::new(), self.revision + 1),
        }
    }
}

fn to_event(c: &Change) -> WatchEvent {
    match &c.value {
        Some(v) => WatchEvent::Put { key: c.key.clone(), value: v.clone(), mod_revision: c.revision },
        None => WatchEvent::Delete { key: c.key.clone(), mod_revision: c.revision },
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves consistent data (every mutation completes
        // before it can panic), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Commits changes and persists (when a path is set).
    fn commit(&self, state: &mut State, changes: Vec<Change>) -> StoreResult<()> {
        if changes.is_empty() {
            return Ok(());
        }
        let keys: BTreeSet<String> = changes.iter().map(|c| c.key.clone()).collect();
        state.commit(changes);
        persist(state, &keys)
    }

    fn remove_lease(&self, state: &mut State, id: LeaseId) -> StoreResult<()> {
        let Some(lease) = state.leases.remove(&id) else { return Ok(()) };
        let rev = state.revision + 1;
        let changes = lease.keys.iter().filter_map(|k| state.apply_delete(k, rev)).collect();
        self.commit(state, changes)
    }
}

/// Logs a committed mutation that touched `keys` (persisted stores that are still open).
fn persist(state: &mut State, keys: &BTreeSet<String>) -> StoreResult<()> {
    let State { data, revision, closed, disk, .. } = state;
    match disk {
        Some(disk) if !*closed => disk.append(data, *revision, keys.iter().map(String::as_str)),
        _ => Ok(()),
    }
}

#[async_trait]
impl StateStore for EmbeddedStore {
    async fn get(&self, key: &str) -> StoreResult<Option<Versioned>> {
        Ok(self.inner.lock().data.get(key).cloned())
    }

    async fn put(&self, key: &str, value: Vec<u8>, lease: Option<LeaseId>) -> StoreResult<Revision> {
        check_key(key)?;
        let mut state = self.inner.lock();
        state.check_lease(lease)?;
        let rev = state.revision + 1;
        let change = state.apply_put(key, value, lease, rev);
        self.inner.commit(&mut state, vec![change])?;
        Ok(rev)
    }

    async fn delete(&self, key: &str) -> StoreResult<bool> {
        let mut state = self.inner.lock();
        let rev = state.revision + 1;
        match state.apply_delete(key, rev) {
            Some(change) => {
                self.inner.commit(&mut state, vec![change])?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    async fn list(&self, prefix: &str) -> StoreResult<(Vec<(String, Versioned)>, Revision)> {
        let state = self.inner.lock();
        Ok((state.list(prefix), state.revision))
    }

    async fn txn(&self, txn: Txn) -> StoreResult<TxnResult> {
        let longest = txn.compares.len().max(txn.success.len()).max(txn.failure.len());
        if longest > MAX_TXN_OPS {
            return Err(StoreError::InvalidArgument(format!(
                "transaction with {longest} operations (at most {MAX_TXN_OPS})"
            )));
        }
        let mut state = self.inner.lock();
        let succeeded = txn.compares.iter().all(|c| state.holds(c));
        let ops = if succeeded { txn.success } else { txn.failure };
        for op in &ops {
            match op {
                TxnOp::Put { key, lease, .. } => {
                    check_key(key)?;
                    state.check_lease(*lease)?;
                }
                TxnOp::Delete { key } => check_key(key)?,
            }
        }
        let rev = state.revision + 1;
        let mut changes = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                TxnOp::Put { key, value, lease } => changes.push(state.apply_put(&key, value, lease, rev)),
                TxnOp::Delete { key } => changes.extend(state.apply_delete(&key, rev)),
            }
        }
        self.inner.commit(&mut state, changes)?;
        Ok(TxnResult { succeeded, revision: state.revision })
    }

    async fn grant_lease(&self, ttl_secs: i64) -> StoreResult<LeaseId> {
        if ttl_secs <= 0 {
            return Err(StoreError::InvalidArgument(format!("lease TTL {ttl_secs}s must be positive")));
        }
        let ttl = Duration::from_secs(ttl_secs.unsigned_abs());
        let mut state = self.inner.lock();
        let id = state.next_lease;
        state.next_lease += 1;
        state.leases.insert(id, Lease { ttl, deadline: Instant::now() + ttl, keys: BTreeSet::new() });
        Ok(id)
    }

    async fn keep_alive(&self, lease: LeaseId) -> StoreResult<()> {
        let mut state = self.inner.lock();
        let now = Instant::now();
        match state.leases.get_mut(&lease) {
            Some(l) if l.deadline > now => {
                l.deadline = now + l.ttl;
                Ok(())
            }
            Some(_) => {
                self.inner.remove_lease(&mut state, lease)?;
                Err(StoreError::LeaseNotFound(lease))
            }
            None => Err(StoreError::LeaseNotFound(lease)),
        }
    }

    async fn revoke_lease(&self, lease: LeaseId) -> StoreResult<()> {
        let mut state = self.inner.lock();
        self.inner.remove_lease(&mut state, lease)
    }

    async fn watch(&self, prefix: &str, start_revision: Option<Revision>) -> StoreResult<WatchStream> {
        let (pending, rx, next) = {
            let state = self.inner.lock();
            let rx = state.live.subscribe();
            let (pending, next) = state.start_watch(prefix, start_revision);
            (pending, rx, next)
        };
        let watcher = Watcher {
            inner: Arc::downgrade(&self.inner),
            prefix: prefix.to_owned(),
            pending: pending.into(),
            rx,
            floor: next,
            resume: next,
            skip: 0,
        };
        Ok(Box::pin(futures::stream::unfold(watcher, |mut w| async move {
            let event = w.next_event().await?;
            Some((event, w))
        })))
    }
}

fn check_key(key: &str) -> StoreResult<()> {
    if key.is_empty() {
        return Err(StoreError::InvalidArgument("empty key".into()));
    }
    Ok(())
}

/// State of one watch stream: replayed events first, then live ones.
struct Watcher {
    inner: Weak<Inner>,
    prefix: String,
    pending: VecDeque<WatchEvent>,
    rx: broadcast::Receiver<Change>,
    /// Live events below this revision were already covered by the replay.
    floor: Revision,
    /// Where to replay from after falling behind: revision `resume`, skipping the first
    /// `skip` matching changes of it (already delivered; a transaction's changes share one
    /// revision).
    resume: Revision,
    skip: usize,
}

impl Watcher {
    async fn next_event(&mut self) -> Option<WatchEvent> {
        loop {
            if let Some(e) = self.pending.pop_front() {
                self.delivered(&e);
                return Some(e);
            }
            match self.rx.recv().await {
                Ok(c) if c.revision >= self.floor && c.key.starts_with(&self.prefix) => {
                    let e = to_event(&c);
                    self.delivered(&e);
                    return Some(e);
                }
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(_)) => self.catch_up()?,
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    }

    fn delivered(&mut self, e: &WatchEvent) {
        match e {
            WatchEvent::Resync { revision, .. } => {
                self.resume = revision + 1;
                self.skip = 0;
            }
            _ if e.revision() == self.resume => self.skip += 1,
            _ => {
                self.resume = e.revision();
                self.skip = 1;
            }
        }
    }

    /// Fell behind the live channel: replay from the history (or resync) where we stopped.
    fn catch_up(&mut self) -> Option<()> {
        let inner = self.inner.upgrade()?;
        let state = inner.lock();
        self.rx = state.live.subscribe();
        let (pending, floor) = state.start_watch(&self.prefix, Some(self.resume.max(1)));
        let mut pending: VecDeque<WatchEvent> = pending.into();
        if !matches!(pending.front(), Some(WatchEvent::Resync { .. })) {
            for _ in 0..self.skip {
                if pending.front().is_some_and(|e| e.revision() == self.resume) {
                    pending.pop_front();
                }
            }
        }
        self.pending = pending;
        self.floor = floor;
        Some(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;

    async fn collect(w: &mut WatchStream, n: usize) -> Vec<WatchEvent> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            match tokio::time::timeout(Duration::from_secs(5), w.next()).await {
                Ok(Some(e)) => out.push(e),
                _ => break,
            }
        }
        out
    }

    /// A watcher that falls behind the live channel catches up from the history: every
    /// change exactly once, in order, including both changes of a transaction.
    #[tokio::test]
    async fn lagging_watcher_sees_every_change_once() -> StoreResult<()> {
        let s = EmbeddedStore::in_memory()?;
        let mut w = s.watch("/w/", None).await?;
        let first = s.put("/w/0", b"x".to_vec(), None).await?;
        let total = BROADCAST_CAPACITY + 500;
        for i in 1..total {
            let txn = Txn {
                success: vec![
                    TxnOp::put(format!("/w/{i}"), b"x".to_vec()),
                    TxnOp::put(format!("/w/{i}b"), b"y".to_vec()),
                ],
                ..Txn::default()
            };
            s.txn(txn).await?;
        }
        let events = collect(&mut w, 2 * total - 1).await;
        assert_eq!(events.len(), 2 * total - 1);
        let mut expected = vec![(first, "/w/0".to_owned())];
        for i in 1..total {
            let rev = first + Revision::try_from(i).unwrap_or(0);
            expected.push((rev, format!("/w/{i}")));
            expected.push((rev, format!("/w/{i}b")));
        }
        let got: Vec<(Revision, String)> = events
            .iter()
            .map(|e| match e {
                WatchEvent::Put { key, mod_revision, .. } => (*mod_revision, key.clone()),
                other => (0, format!("{other:?}")),
            })
            .collect();
        assert_eq!(got, expected);
        Ok(())
    }

    /// Watching from a revision older than the kept history answers with a `Resync`.
    #[tokio::test]
    async fn trimmed_history_resyncs() -> StoreResult<()> {
        let s = EmbeddedStore::in_memory()?;
        for i in 0..=HISTORY_LIMIT {
            s.put(&format!("/h/{}", i % 3), vec![], None).await?;
        }
        s.put("/other", vec![], None).await?;
        let mut w = s.watch("/h/", Some(1)).await?;
        match w.next().await {
            Some(WatchEvent::Resync { entries, revision }) => {
                assert_eq!(entries.len(), 3);
                assert_eq!(revision, s.revision());
            }
            other => panic!("expected Resync, got {other:?}"),
        }
        // A recent revision still replays.
        let r = s.put("/h/new", vec![], None).await?;
        let mut w = s.watch("/h/", Some(r)).await?;
        assert_eq!(w.next().await.map(|e| e.revision()), Some(r));
        Ok(())
    }

    /// One file, one store: a second open of the same path fails with `Locked` naming the file
    /// (and writes nothing), while the first store or any clone of it lives; once the last
    /// clone is dropped the file opens again, with the first store's keys.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_second_open_of_one_file_fails_until_the_first_store_is_dropped() -> StoreResult<()> {
        let dir = tempfile::tempdir().map_err(|e| StoreError::Internal(e.to_string()))?;
        let path = dir.path().join("state.json");
        let first = EmbeddedStore::open(&path)?;
        let rev = first.put("/k", b"first".to_vec(), None).await?;
        let lease = first.grant_lease(1).await?;
        first.put("/leased", vec![], Some(lease)).await?;
        let clone = first.clone();
        let _watch = first.watch("/", None).await?;
        drop(first);
        match EmbeddedStore::open(&path) {
            Err(StoreError::Locked { path: p, lock }) => {
                assert_eq!(p, path);
                assert_eq!(lock, dir.path().join("state.json.lock"));
                let msg = StoreError::Locked { path: p, lock }.to_string();
                assert!(msg.contains(&path.display().to_string()), "{msg}");
            }
            other => panic!("expected Locked while a clone lives, got {:?}", other.err()),
        }
        assert_eq!(clone.get("/k").await?.map(|v| v.value), Some(b"first".to_vec()));
        drop(clone);
        // At once (no wait for the lease expiry task), while a watch still exists.
        let again = EmbeddedStore::open(&path)?;
        let k = again.get("/k").await?;
        assert_eq!(k.map(|v| (v.value, v.mod_revision)), Some((b"first".to_vec(), rev)));
        assert!(again.get("/leased").await?.is_none());
        Ok(())
    }
}
