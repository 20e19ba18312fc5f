//! The embedded store on disk: a snapshot plus an append-only change log, as etcd's
//! snapshot + WAL and Raft-style compaction.
//!
//! - `<path>` is a snapshot: every key not bound to a lease with its revisions, and the store
//!   revision, as one JSON document. It is only ever replaced whole: written to `<path>.tmp`,
//!   fsynced and renamed over `<path>` (then the directory is fsynced).
//! - `<path>.log` holds one JSON line per committed mutation after that snapshot: the store
//!   revision it brought and the final value (or deletion) of each key it touched. Each line
//!   is appended and fsynced before the mutation returns, so a write costs its own size, not
//!   the store's. A key bound to a lease is logged as deleted (leased keys are never
//!   persisted: their holders live in this process).
//! - When the log outgrows [`COMPACT_FACTOR`] x the snapshot (and at least
//!   [`COMPACT_MIN_BYTES`]), the snapshot is rewritten and the log emptied: the rewrite's cost
//!   is spread over at least that many logged bytes.
//!
//! Recovery reads the snapshot, then replays the log lines with a revision above the
//! snapshot's (a crash between writing a new snapshot and emptying the log leaves lines the
//! snapshot already holds). A write that was torn by a crash can only be the log's last line
//! (every earlier line was fsynced before the next was written), and its mutation never
//! returned: a last line that is incomplete or unreadable is dropped. An unreadable line
//! followed by others is corruption and fails the open.

use super::super::api::{Revision, StoreError, StoreResult, Versioned};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The log is compacted once it holds this many times the snapshot's bytes …
pub(super) const COMPACT_FACTOR: u64 = 2;
/// … and at least this many bytes (small stores are not rewritten on every few writes).
pub(super) const COMPACT_MIN_BYTES: u64 = 1 << 20;

#[derive(Serialize, Deserialize)]
struct Snapshot {
    revision: Revision,
    entries: Vec<SnapshotEntry>,
}

#[derive(Serialize, Deserialize)]
struct SnapshotEntry {
    key: String,
    value: Vec<u8>,
    create_revision: Revision,
    mod_revision: Revision,
}

/// One committed mutation: the revision it brought the store to, and where each key it
/// touched ended up.
#[derive(Serialize, Deserialize)]
struct LogRecord {
    revision: Revision,
    ops: Vec<LogOp>,
}

#[derive(Serialize, Deserialize)]
enum LogOp {
    Put(SnapshotEntry),
    Delete(String),
}

/// What the files held: the keys (none bound to a lease) and the store revision.
pub(super) struct Recovered {
    pub data: BTreeMap<String, Versioned>,
    pub revision: Revision,
}

/// The open files of a persisted store.
pub(super) struct Disk {
    path: PathBuf,
    log_path: PathBuf,
    log: File,
    /// Bytes in the log (where the next record goes).
    log_bytes: u64,
    /// Bytes of the last snapshot written.
    snapshot_bytes: u64,
    /// An append failed part-way: the log may end in a partial line, so the next write
    /// rewrites the snapshot and starts a new log instead of appending after it.
    broken: bool,
}

fn internal(what: &str, path: &Path, e: impl std::fmt::Display) -> StoreError {
    StoreError::Internal(format!("{what} {}: {e}", path.display()))
}

fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// The change log of the store persisted at `path`.
pub(super) fn log_path(path: &Path) -> PathBuf {
    with_suffix(path, ".log")
}

/// Reads the snapshot at `path` and replays its log. A missing snapshot is an empty store at
/// revision 1; a missing log is an empty one.
///
/// # Errors
/// [`StoreError::Internal`] when a file cannot be read, the snapshot cannot be parsed, or a
/// log line other than the last cannot be parsed.
pub(super) fn recover(path: &Path) -> StoreResult<Recovered> {
    let mut rec = match std::fs::read(path) {
        Ok(bytes) => {
            let snap: Snapshot = serde_json::from_slice(&bytes).map_err(|e| internal("parse", path, e))?;
            let data = snap.entries.into_iter().map(|e| (e.key.clone(), versioned(e))).collect();
            Recovered { data, revision: snap.revision }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Recovered { data: BTreeMap::new(), revision: 1 },
        Err(e) => return Err(internal("read", path, e)),
    };
    let log_path = log_path(path);
    let log = match std::fs::read(&log_path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(rec),
        Err(e) => return Err(internal("read", &log_path, e)),
    };
    let mut lines = log.split_inclusive(|b| *b == b'\n').enumerate().peekable();
    while let Some((i, line)) = lines.next() {
        let last = lines.peek().is_none();
        let parsed = line
            .strip_suffix(b"\n")
            .ok_or_else(|| "incomplete line".to_owned())
            .and_then(|l| serde_json::from_slice::<LogRecord>(l).map_err(|e| e.to_string()));
        let record = match parsed {
            Ok(r) => r,
            Err(e) if last => {
                tracing::warn!(log = %log_path.display(), line = i + 1, error = %e, "embedded store: dropping a torn last log record");
                break;
            }
            Err(e) => return Err(internal("parse", &log_path, format!("line {}: {e}", i + 1))),
        };
        if record.revision <= rec.revision {
            // Already in the snapshot (a crash came between its rewrite and the log's reset).
            continue;
        }
        for op in record.ops {
            match op {
                LogOp::Put(e) => {
                    rec.data.insert(e.key.clone(), versioned(e));
                }
                LogOp::Delete(k) => {
                    rec.data.remove(&k);
                }
            }
        }
        rec.revision = record.revision;
    }
    Ok(rec)
}

fn versioned(e: SnapshotEntry) -> Versioned {
    Versioned { value: e.value, mod_revision: e.mod_revision, create_revision: e.create_revision, lease: None }
}

fn entry(key: &str, v: &Versioned) -> SnapshotEntry {
    SnapshotEntry {
        key: key.to_owned(),
        value: v.value.clone(),
        create_revision: v.create_revision,
        mod_revision: v.mod_revision,
    }
}

/// fsyncs the directory holding `path`, so a file created or renamed in it survives a crash.
fn sync_dir(path: &Path) -> StoreResult<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    File::open(dir).and_then(|d| d.sync_all()).map_err(|e| internal("sync directory", dir, e))
}

impl Disk {
    /// Writes a snapshot of `data` at `revision` and starts an empty log after it.
    ///
    /// # Errors
    /// [`StoreError::Internal`] on I/O errors.
    pub(super) fn create(path: &Path, data: &BTreeMap<String, Versioned>, revision: Revision) -> StoreResult<Self> {
        let snapshot_bytes = write_snapshot(path, data, revision)?;
        let log_path = log_path(path);
        let log = new_log(&log_path)?;
        Ok(Self { path: path.to_path_buf(), log_path, log, log_bytes: 0, snapshot_bytes, broken: false })
    }

    /// Persists one committed mutation: the store is at `revision` and `keys` are the keys
    /// it touched, each now as in `data` (absent or bound to a lease: logged as deleted).
    /// Compacts when the log has grown past its bound.
    ///
    /// # Errors
    /// [`StoreError::Internal`] on I/O errors (the next call rewrites the snapshot).
    pub(super) fn append<'a>(
        &mut self,
        data: &BTreeMap<String, Versioned>,
        revision: Revision,
        keys: impl IntoIterator<Item = &'a str>,
    ) -> StoreResult<()> {
        if self.broken {
            return self.compact(data, revision);
        }
        let ops = keys
            .into_iter()
            .map(|k| match data.get(k) {
                Some(v) if v.lease.is_none() => LogOp::Put(entry(k, v)),
                _ => LogOp::Delete(k.to_owned()),
            })
            .collect();
        let mut line = serde_json::to_vec(&LogRecord { revision, ops })
            .map_err(|e| internal("encode a record for", &self.log_path, e))?;
        line.push(b'\n');
        if let Err(e) = self.log.write_all(&line).and_then(|()| self.log.sync_data()) {
            // Cut a partial line off; if even that fails, the next write starts a new log.
            self.broken = self.log.set_len(self.log_bytes).and_then(|()| self.log.sync_data()).is_err();
            return Err(internal("append to", &self.log_path, e));
        }
        self.log_bytes += line.len() as u64;
        if self.log_bytes >= COMPACT_MIN_BYTES.max(self.snapshot_bytes.saturating_mul(COMPACT_FACTOR)) {
            self.compact(data, revision)?;
        }
        Ok(())
    }

    /// Rewrites the snapshot from `data` and empties the log.
    fn compact(&mut self, data: &BTreeMap<String, Versioned>, revision: Revision) -> StoreResult<()> {
        self.broken = true;
        self.snapshot_bytes = write_snapshot(&self.path, data, revision)?;
        self.log = new_log(&self.log_path)?;
        self.log_bytes = 0;
        self.broken = false;
        Ok(())
    }
}

/// Writes the keys of `data` not bound to a lease at `revision` to `path` atomically
/// (temporary file, fsync, rename, directory fsync); returns the bytes written.
fn write_snapshot(path: &Path, data: &BTreeMap<String, Versioned>, revision: Revision) -> StoreResult<u64> {
    let snap = Snapshot {
        revision,
        entries: data.iter().filter(|(_, v)| v.lease.is_none()).map(|(k, v)| entry(k, v)).collect(),
    };
    let bytes = serde_json::to_vec(&snap).map_err(|e| internal("encode", path, e))?;
    let tmp = with_suffix(path, ".tmp");
    let io = |e: std::io::Error| internal("persist", path, e);
    {
        let mut f = File::create(&tmp).map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
    }
    std::fs::rename(&tmp, path).map_err(io)?;
    sync_dir(path)?;
    Ok(bytes.len() as u64)
}

/// Creates (or empties) the log at `path` for appending.
fn new_log(path: &Path) -> StoreResult<File> {
    let io = |e: std::io::Error| internal("create", path, e);
    let f = OpenOptions::new().create(true).write(true).truncate(true).open(path).map_err(io)?;
    f.sync_all().map_err(io)?;
    sync_dir(path)?;
    // Appends go to the end whatever the file position (a truncation above or after a failed
    // append leaves it past the end).
    OpenOptions::new().append(true).open(path).map_err(io)
}

#[cfg(test)]
mod tests {
    use super::super::EmbeddedStore;
    use super::*;
    use crate::state_store::{StateStore, Txn, TxnOp};

    fn tmp() -> StoreResult<tempfile::TempDir> {
        tempfile::tempdir().map_err(|e| StoreError::Internal(e.to_string()))
    }

    fn len(path: &Path) -> u64 {
        std::fs::metadata(path).map_or(0, |m| m.len())
    }

    /// Puts, a delete, a transaction and a leased key after the snapshot live only in the log;
    /// a reopen replays them: the same keys, values and revisions, and the revision goes on.
    #[tokio::test]
    async fn a_reopen_replays_the_log_over_the_snapshot() -> StoreResult<()> {
        let dir = tmp()?;
        let path = dir.path().join("state.json");
        let s = EmbeddedStore::open(&path)?;
        s.put("/a", b"1".to_vec(), None).await?;
        s.put("/a", b"2".to_vec(), None).await?;
        s.put("/b", b"gone".to_vec(), None).await?;
        assert!(s.delete("/b").await?);
        let txn =
            Txn { success: vec![TxnOp::put("/c", b"3".to_vec()), TxnOp::put("/d", b"4".to_vec())], ..Txn::default() };
        s.txn(txn).await?;
        // An unleased key put again under a lease leaves the persisted view.
        s.put("/e", b"5".to_vec(), None).await?;
        let lease = s.grant_lease(60).await?;
        s.put("/e", b"leased".to_vec(), Some(lease)).await?;
        let (before, rev) = s.list("/").await?;
        let snapshot = std::fs::read(&path).map_err(|e| StoreError::Internal(e.to_string()))?;
        assert!(len(&log_path(&path)) > 0, "the writes went to the log");
        drop(s);
        assert_eq!(std::fs::read(&path).ok(), Some(snapshot), "no write rewrote the snapshot");

        let s = EmbeddedStore::open(&path)?;
        let (after, rev2) = s.list("/").await?;
        let unleased: Vec<_> = before.into_iter().filter(|(_, v)| v.lease.is_none()).collect();
        assert_eq!(after, unleased);
        assert_eq!(after.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>(), ["/a", "/c", "/d"]);
        assert_eq!(rev2, rev);
        assert_eq!(len(&log_path(&path)), 0, "the open folded the log into a new snapshot");
        assert_eq!(s.put("/f", vec![], None).await?, rev + 1);
        Ok(())
    }

    /// A crash in the middle of appending leaves a partial last line: the open drops it and
    /// keeps every whole record, and later writes persist normally. A bad line with records
    /// after it is corruption: the open fails, naming the line.
    #[tokio::test]
    async fn a_torn_last_record_is_dropped_and_a_corrupt_middle_one_fails_the_open() -> StoreResult<()> {
        let dir = tmp()?;
        let path = dir.path().join("state.json");
        let s = EmbeddedStore::open(&path)?;
        s.put("/a", b"1".to_vec(), None).await?;
        let rev = s.put("/b", b"2".to_vec(), None).await?;
        drop(s);
        let log = log_path(&path);
        let whole = std::fs::read(&log).map_err(|e| StoreError::Internal(e.to_string()))?;
        let torn = br#"{"revision":99,"ops":[{"Put":{"key":"/c","val"#;
        let append = |bytes: &[u8]| -> StoreResult<()> {
            let mut f = OpenOptions::new().append(true).open(&log).map_err(|e| StoreError::Internal(e.to_string()))?;
            f.write_all(bytes).map_err(|e| StoreError::Internal(e.to_string()))
        };
        append(torn)?;

        let s = EmbeddedStore::open(&path)?;
        assert_eq!(s.get("/b").await?.map(|v| (v.value, v.mod_revision)), Some((b"2".to_vec(), rev)));
        assert!(s.get("/c").await?.is_none());
        assert_eq!(s.revision(), rev);
        let next = s.put("/c", b"3".to_vec(), None).await?;
        assert_eq!(next, rev + 1);
        drop(s);
        let s = EmbeddedStore::open(&path)?;
        assert_eq!(s.get("/c").await?.map(|v| v.mod_revision), Some(next));
        drop(s);

        // A whole but unreadable line, then a good one: not a torn tail.
        std::fs::write(&log, b"").map_err(|e| StoreError::Internal(e.to_string()))?;
        append(b"{\"revision\":\n")?;
        append(&whole)?;
        match EmbeddedStore::open(&path) {
            Err(StoreError::Internal(m)) => assert!(m.contains("line 1"), "{m}"),
            other => panic!("expected a corrupt log to fail the open, got {:?}", other.err()),
        }
        Ok(())
    }

    /// The log is compacted once it outgrows its bound: the snapshot is rewritten, the log
    /// restarts empty, and a reopen sees the latest values.
    #[tokio::test]
    async fn a_long_log_is_compacted_into_the_snapshot() -> StoreResult<()> {
        let dir = tmp()?;
        let path = dir.path().join("state.json");
        let s = EmbeddedStore::open(&path)?;
        let value = vec![7u8; 64 << 10];
        let mut compacted = false;
        let mut last = 0;
        for i in 0..40u8 {
            let before = len(&log_path(&path));
            let mut v = value.clone();
            v[0] = i;
            last = s.put("/big", v, None).await?;
            compacted |= len(&log_path(&path)) < before;
        }
        assert!(compacted, "40 x 64 KiB records never compacted the log");
        assert!(len(&log_path(&path)) < COMPACT_MIN_BYTES);
        drop(s);
        let s = EmbeddedStore::open(&path)?;
        let got = s.get("/big").await?.map(|v| (v.value[0], v.mod_revision));
        assert_eq!(got, Some((39, last)));
        Ok(())
    }
}
