//! StateStore conformance: one test body per behaviour, run against the `EmbeddedStore`
//! (in memory) and against `EtcdStore` on a real etcd started by `EtcdFixture`. Then the
//! store-specific tests: embedded persistence across reopen, and etcd watch resumption
//! across an etcd restart and after compaction.

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use prism_common::proto::v1::ReplicaRecord;
use prism_common::state_store::{
    Compare, EmbeddedStore, MAX_TXN_OPS, StateStore, StoreError, Txn, TxnOp, WatchEvent, WatchStream, keys,
    spawn_keep_alive,
};
use prism_head::cluster::view::ClusterView;
use prism_head::election::{self, ElectionConfig, Leadership};
use prism_head::store::EtcdStore;
use prism_tests::{EtcdFixture, wait_until};
use prost::Message;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

type Store = Arc<dyn StateStore>;

/// Lease TTL used by the tests (etcd 3.4's minimum is about 2 s with default timing).
const TTL: i64 = 2;
/// Upper bound for a lease-bound key to disappear after its last refresh (TTL + etcd's
/// 500 ms expiry check + slack for a loaded 2-core machine).
const EXPIRY_BOUND: Duration = Duration::from_secs(6);
/// Bound for one watch event to arrive.
const EVENT_TIMEOUT: Duration = Duration::from_secs(5);

async fn next_event(w: &mut WatchStream) -> Result<WatchEvent> {
    tokio::time::timeout(EVENT_TIMEOUT, w.next()).await.context("watch event timed out")?.context("watch ended")
}

async fn exists(store: &Store, key: &str) -> bool {
    matches!(store.get(key).await, Ok(Some(_)))
}

// ---- conformance bodies -------------------------------------------------------------------

async fn crud(s: Store) -> Result<()> {
    let k = "/prism/v1/nodes/n1";
    ensure!(s.get(k).await?.is_none());
    let r1 = s.put(k, b"one".to_vec(), None).await?;
    let v = s.get(k).await?.context("key after put")?;
    ensure!(v.value == b"one" && v.mod_revision == r1 && v.create_revision == r1 && v.lease.is_none());
    let r2 = s.put(k, b"two".to_vec(), None).await?;
    ensure!(r2 > r1, "revision must grow: {r1} -> {r2}");
    let v = s.get(k).await?.context("key after update")?;
    ensure!(v.value == b"two" && v.mod_revision == r2 && v.create_revision == r1);
    ensure!(s.delete(k).await?, "delete of an existing key returns true");
    ensure!(s.get(k).await?.is_none());
    ensure!(!s.delete(k).await?, "delete of a missing key returns false");
    Ok(())
}

async fn list_prefix(s: Store) -> Result<()> {
    s.put("/prism/v1/nodes/b", b"B".to_vec(), None).await?;
    s.put("/prism/v1/nodes/a", b"A".to_vec(), None).await?;
    s.put("/prism/v1/nodesX", b"not a node".to_vec(), None).await?;
    let last = s.put("/prism/v1/deployments/d", b"D".to_vec(), None).await?;
    let (nodes, rev) = s.list(keys::NODES).await?;
    let names: Vec<&str> = nodes.iter().map(|(k, _)| k.as_str()).collect();
    ensure!(names == ["/prism/v1/nodes/a", "/prism/v1/nodes/b"], "got {names:?}");
    ensure!(nodes[0].1.value == b"A" && nodes[1].1.value == b"B");
    ensure!(rev >= last, "list revision {rev} < last write {last}");
    let (all, _) = s.list(keys::ROOT).await?;
    ensure!(all.len() == 4, "root holds 4 keys, got {}", all.len());
    let (none, _) = s.list("/prism/v1/replicas/").await?;
    ensure!(none.is_empty());
    Ok(())
}

async fn txn_compare_mod_revision(s: Store) -> Result<()> {
    let k = "/prism/v1/reservations/n1/0";
    let create = |v: &str| Txn {
        compares: vec![Compare::absent(k)],
        success: vec![TxnOp::put(k, v.as_bytes())],
        failure: vec![TxnOp::put("/prism/v1/lost", v.as_bytes())],
    };
    let r = s.txn(create("first")).await?;
    ensure!(r.succeeded, "create-if-absent on a missing key succeeds");
    let created = s.get(k).await?.context("created")?;
    ensure!(created.mod_revision == r.revision && created.value == b"first");
    let r2 = s.txn(create("second")).await?;
    ensure!(!r2.succeeded, "create-if-absent on an existing key fails");
    ensure!(s.get(k).await?.context("still there")?.value == b"first");
    ensure!(s.get("/prism/v1/lost").await?.context("failure branch applied")?.value == b"second");

    // CAS on the current revision succeeds; on a stale one fails; both ops land atomically.
    let cas = |rev, v: &str| Txn {
        compares: vec![Compare::mod_revision(k, rev)],
        success: vec![TxnOp::put(k, v.as_bytes()), TxnOp::delete("/prism/v1/lost")],
        failure: vec![],
    };
    let r3 = s.txn(cas(created.mod_revision, "cas")).await?;
    ensure!(r3.succeeded);
    ensure!(s.get(k).await?.context("cas")?.value == b"cas");
    ensure!(s.get("/prism/v1/lost").await?.is_none(), "both success ops applied");
    let r4 = s.txn(cas(created.mod_revision, "stale")).await?;
    ensure!(!r4.succeeded, "stale CAS fails");
    ensure!(s.get(k).await?.context("unchanged")?.value == b"cas");
    Ok(())
}

async fn txn_size_limit(s: Store) -> Result<()> {
    let puts = |n: usize| (0..n).map(|i| TxnOp::put(format!("/prism/v1/replicas/big/{i}"), b"r")).collect::<Vec<_>>();
    let r = s.txn(Txn { success: puts(MAX_TXN_OPS), ..Txn::default() }).await?;
    ensure!(r.succeeded);
    ensure!(s.list("/prism/v1/replicas/big/").await?.0.len() == MAX_TXN_OPS);
    match s.txn(Txn { success: puts(MAX_TXN_OPS + 1), ..Txn::default() }).await {
        Err(StoreError::InvalidArgument(_)) => {}
        other => anyhow::bail!("oversized txn: {other:?}"),
    }
    Ok(())
}

async fn concurrent_cas_one_winner(s: Store) -> Result<()> {
    let k = "/prism/v1/deployments/contended";
    let base = s.put(k, b"v0".to_vec(), None).await?;
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let s = s.clone();
            tokio::spawn(async move {
                let txn = Txn {
                    compares: vec![Compare::mod_revision(k, base)],
                    success: vec![TxnOp::put(k, format!("writer-{i}").into_bytes())],
                    failure: vec![],
                };
                s.txn(txn).await.map(|r| r.succeeded)
            })
        })
        .collect();
    let mut winners = 0;
    for t in tasks {
        if t.await?? {
            winners += 1;
        }
    }
    ensure!(winners == 1, "exactly one concurrent CAS wins, got {winners}");
    let v = s.get(k).await?.context("value")?;
    ensure!(v.value.starts_with(b"writer-"));
    Ok(())
}

async fn lease_expiry_deletes_keys(s: Store) -> Result<()> {
    let lease = s.grant_lease(TTL).await?;
    s.put("/prism/v1/nodes/leased", b"alive".to_vec(), Some(lease)).await?;
    let r = s
        .txn(Txn {
            success: vec![TxnOp::Put {
                key: "/prism/v1/nodes/leased2".into(),
                value: b"x".to_vec(),
                lease: Some(lease),
            }],
            ..Txn::default()
        })
        .await?;
    ensure!(r.succeeded);
    let v = s.get("/prism/v1/nodes/leased").await?.context("leased key")?;
    ensure!(v.lease == Some(lease));
    s.put("/prism/v1/nodes/plain", b"stays".to_vec(), None).await?;
    let started = std::time::Instant::now();
    wait_until(EXPIRY_BOUND, "leased keys to expire", || async {
        !exists(&s, "/prism/v1/nodes/leased").await && !exists(&s, "/prism/v1/nodes/leased2").await
    })
    .await?;
    ensure!(started.elapsed() >= Duration::from_millis(1500), "expired too early: {:?}", started.elapsed());
    ensure!(exists(&s, "/prism/v1/nodes/plain").await, "unleased key survives");
    match s.keep_alive(lease).await {
        Err(StoreError::LeaseNotFound(id)) => ensure!(id == lease),
        other => anyhow::bail!("keep_alive on an expired lease: {other:?}"),
    }
    match s.put("/prism/v1/nodes/x", b"x".to_vec(), Some(lease)).await {
        Err(StoreError::LeaseNotFound(_)) => {}
        other => anyhow::bail!("put with an expired lease: {other:?}"),
    }
    Ok(())
}

async fn keep_alive_keeps_keys(s: Store) -> Result<()> {
    let lease = s.grant_lease(TTL).await?;
    s.put("/prism/v1/nodes/kept", b"alive".to_vec(), Some(lease)).await?;
    let stop = CancellationToken::new();
    let ka = spawn_keep_alive(s.clone(), lease, TTL, stop.clone());
    // Outlive the TTL twice over: the key must still be there (this sleep is the assertion,
    // not a readiness wait).
    tokio::time::sleep(Duration::from_secs(u64::try_from(TTL)? * 2 + 1)).await;
    ensure!(exists(&s, "/prism/v1/nodes/kept").await, "keep-alive keeps the key");
    stop.cancel();
    ka.await??;
    wait_until(EXPIRY_BOUND, "key to expire after keep-alive stops", || async {
        !exists(&s, "/prism/v1/nodes/kept").await
    })
    .await?;
    // A revoked lease deletes its keys at once.
    let lease2 = s.grant_lease(30).await?;
    s.put("/prism/v1/nodes/revoked", b"x".to_vec(), Some(lease2)).await?;
    s.revoke_lease(lease2).await?;
    ensure!(!exists(&s, "/prism/v1/nodes/revoked").await, "revoke deletes bound keys");
    s.revoke_lease(lease2).await?;
    Ok(())
}

async fn watch_replays_from_revision(s: Store) -> Result<()> {
    let p = "/prism/v1/replicas/llama/";
    let r_a = s.put(&format!("{p}a"), b"A".to_vec(), None).await?;
    let r_b = s.put(&format!("{p}b"), b"B".to_vec(), None).await?;
    s.put("/prism/v1/nodes/elsewhere", b"-".to_vec(), None).await?;
    let r_del = s.txn(Txn { success: vec![TxnOp::delete(format!("{p}a"))], ..Txn::default() }).await?.revision;
    // Live-only watch opened now must not see the history.
    let mut live = s.watch(p, None).await?;
    let mut w = s.watch(p, Some(r_a)).await?;
    ensure!(
        next_event(&mut w).await? == WatchEvent::Put { key: format!("{p}a"), value: b"A".to_vec(), mod_revision: r_a }
    );
    ensure!(
        next_event(&mut w).await? == WatchEvent::Put { key: format!("{p}b"), value: b"B".to_vec(), mod_revision: r_b }
    );
    ensure!(next_event(&mut w).await? == WatchEvent::Delete { key: format!("{p}a"), mod_revision: r_del });
    // Resuming from the middle replays only the rest.
    let mut mid = s.watch(p, Some(r_b + 1)).await?;
    ensure!(next_event(&mut mid).await? == WatchEvent::Delete { key: format!("{p}a"), mod_revision: r_del });
    // A transaction's writes share one revision and arrive together.
    let t = s
        .txn(Txn {
            success: vec![TxnOp::put(format!("{p}c"), b"C"), TxnOp::put(format!("{p}d"), b"D")],
            ..Txn::default()
        })
        .await?;
    for stream in [&mut w, &mut mid, &mut live] {
        ensure!(
            next_event(stream).await?
                == WatchEvent::Put { key: format!("{p}c"), value: b"C".to_vec(), mod_revision: t.revision }
        );
        ensure!(
            next_event(stream).await?
                == WatchEvent::Put { key: format!("{p}d"), value: b"D".to_vec(), mod_revision: t.revision }
        );
    }
    Ok(())
}

async fn election_one_leader_and_takeover(s: Store) -> Result<()> {
    let lease_a = s.grant_lease(TTL).await?;
    let lease_b = s.grant_lease(30).await?;
    let mut seen_a = |_: Option<&[u8]>| {};
    let a = election::campaign(s.as_ref(), "head", b"head-a", lease_a, &mut seen_a).await?;
    ensure!(election::leader(s.as_ref(), "head").await?.as_deref() == Some(&b"head-a"[..]));
    // Campaigning again with the same lease is idempotent.
    let again = election::campaign(s.as_ref(), "head", b"head-a", lease_a, &mut seen_a).await?;
    ensure!(again == a);
    // B waits while A leads and observes A as leader.
    let s2 = s.clone();
    let (obs_tx, mut obs_rx) = tokio::sync::mpsc::unbounded_channel();
    let b = tokio::spawn(async move {
        let mut observe = |v: Option<&[u8]>| {
            let _ = obs_tx.send(v.map(<[u8]>::to_vec));
        };
        election::campaign(s2.as_ref(), "head", b"head-b", lease_b, &mut observe).await
    });
    let first = tokio::time::timeout(EVENT_TIMEOUT, obs_rx.recv()).await?.context("observer")?;
    ensure!(first.as_deref() == Some(&b"head-a"[..]), "B sees A as leader");
    ensure!(!b.is_finished(), "only one leader");
    // A stops refreshing: its lease expires and B takes over within the bound.
    let started = std::time::Instant::now();
    let b_key = tokio::time::timeout(EXPIRY_BOUND, b).await.context("B did not take over")???;
    ensure!(started.elapsed() >= Duration::from_millis(500), "B won before A's lease ran out");
    ensure!(election::leader(s.as_ref(), "head").await?.as_deref() == Some(&b"head-b"[..]));
    ensure!(!election::resign(s.as_ref(), &a).await?, "A's stale key cannot delete B's");
    ensure!(election::resign(s.as_ref(), &b_key).await?);
    ensure!(election::leader(s.as_ref(), "head").await?.is_none());
    s.revoke_lease(lease_b).await?;
    Ok(())
}

async fn election_runner_fails_over(s: Store) -> Result<()> {
    let cfg = |c: &str| ElectionConfig { name: "head".into(), candidate: c.into(), lease_ttl: Duration::from_secs(2) };
    let stop_a = CancellationToken::new();
    let stop_b = CancellationToken::new();
    let mut a = election::spawn(s.clone(), cfg("http://a:50050"), stop_a.clone());
    let mut b = election::spawn(s.clone(), cfg("http://b:50050"), stop_b.clone());
    // Exactly one leads; the other knows who.
    let (leader, follower, leader_stop, follower_addr) = loop {
        tokio::time::timeout(EVENT_TIMEOUT, async {
            tokio::select! { r = a.state.changed() => r, r = b.state.changed() => r }
        })
        .await??;
        let (sa, sb) = (a.state.borrow().clone(), b.state.borrow().clone());
        match (&sa, &sb) {
            (Leadership::Leader, Leadership::Follower { leader: Some(l) }) if l == "http://a:50050" => {
                break (a, b, stop_a.clone(), "http://b:50050");
            }
            (Leadership::Follower { leader: Some(l) }, Leadership::Leader) if l == "http://b:50050" => {
                break (b, a, stop_b.clone(), "http://a:50050");
            }
            (Leadership::Leader, Leadership::Leader) => anyhow::bail!("two leaders"),
            _ => {}
        }
    };
    // The leader shuts down (resigns): the follower leads promptly.
    leader_stop.cancel();
    tokio::time::timeout(EVENT_TIMEOUT, leader.task).await??;
    let mut follower = follower;
    tokio::time::timeout(EXPIRY_BOUND, follower.state.wait_for(Leadership::is_leader)).await??;
    ensure!(election::leader(s.as_ref(), "head").await?.as_deref() == Some(follower_addr.as_bytes()));
    // The new leader's fencing token is the key as stored.
    let token = follower.leader_key.borrow().clone().context("leader key published")?;
    let stored = s.get(&keys::election("head")).await?.context("election key")?;
    ensure!(stored.mod_revision == token.revision && stored.lease == Some(token.lease));
    stop_b.cancel();
    stop_a.cancel();
    Ok(())
}

/// A restarted head finds its previous run's election key (its own address, under a lease
/// that has not expired yet): it reports no leader rather than naming itself, then leads once
/// the old lease goes.
async fn election_restart_never_names_itself(s: Store) -> Result<()> {
    let me = "http://a:50050";
    let old_lease = s.grant_lease(TTL).await?;
    let mut seen = |_: Option<&[u8]>| {};
    election::campaign(s.as_ref(), "head", me.as_bytes(), old_lease, &mut seen).await?;
    let stop = CancellationToken::new();
    let cfg = ElectionConfig { name: "head".into(), candidate: me.into(), lease_ttl: Duration::from_secs(2) };
    let mut run = election::spawn(s.clone(), cfg, stop.clone());
    // Campaigning against the old key: every state published until it goes names no leader.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(700);
    while tokio::time::Instant::now() < deadline {
        let state = run.state.borrow().clone();
        ensure!(state == Leadership::Follower { leader: None }, "while the old key lives: {state:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.revoke_lease(old_lease).await?;
    tokio::time::timeout(EXPIRY_BOUND, run.state.wait_for(Leadership::is_leader)).await??;
    stop.cancel();
    tokio::time::timeout(EVENT_TIMEOUT, run.task).await??;
    Ok(())
}

/// A state larger than gRPC's 4 MiB default message size (about 6 MiB of replica records,
/// written in transactions of at most `MAX_TXN_OPS` puts) reads back whole, through `list` and
/// through the head's `ClusterView::load`: a head must always be able to read back what it wrote.
async fn list_beyond_message_limit(s: Store) -> Result<()> {
    const RECORDS: usize = 4_000;
    let reason = "r".repeat(1_500);
    let record = |i: usize| ReplicaRecord {
        replica_id: format!("big-{i:05}"),
        deployment: "big".into(),
        reason: reason.clone(),
        ..ReplicaRecord::default()
    };
    let mut last = 0;
    for chunk in (0..RECORDS).collect::<Vec<_>>().chunks(MAX_TXN_OPS) {
        let success = chunk
            .iter()
            .map(|&i| TxnOp::put(ClusterView::replica_key(&record(i)), record(i).encode_to_vec()))
            .collect();
        last = s.txn(Txn { success, ..Txn::default() }).await?.revision;
    }
    let (all, rev) = s.list(keys::REPLICAS).await?;
    ensure!(all.len() == RECORDS, "listed {} of {RECORDS} records", all.len());
    ensure!(all.windows(2).all(|w| w[0].0 < w[1].0), "list is sorted by key");
    ensure!(rev >= last, "list revision {rev} < last write {last}");
    let bytes: usize = all.iter().map(|(k, v)| k.len() + v.value.len()).sum();
    ensure!(bytes > 4 << 20, "the state ({bytes} bytes) must exceed 4 MiB");
    let view = ClusterView::load(s.as_ref()).await?;
    ensure!(view.replicas.len() == RECORDS, "loaded {} of {RECORDS} replicas", view.replicas.len());
    Ok(())
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod embedded {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() -> anyhow::Result<()> {
                    let store: super::Store = std::sync::Arc::new(super::EmbeddedStore::in_memory()?);
                    super::$name(store).await
                }
            )*
        }
        mod etcd {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() -> anyhow::Result<()> {
                    let etcd = super::EtcdFixture::start().await?;
                    let store: super::Store = std::sync::Arc::new(super::EtcdStore::connect(&etcd.endpoints()).await?);
                    let result = super::$name(store).await;
                    if result.is_err() {
                        eprintln!("etcd log:\n{}", etcd.log());
                    }
                    result
                }
            )*
        }
    };
}

conformance!(
    crud,
    list_prefix,
    txn_compare_mod_revision,
    txn_size_limit,
    concurrent_cas_one_winner,
    lease_expiry_deletes_keys,
    keep_alive_keeps_keys,
    watch_replays_from_revision,
    election_one_leader_and_takeover,
    election_runner_fails_over,
    election_restart_never_names_itself,
    list_beyond_message_limit,
);

// ---- store-specific behaviour -------------------------------------------------------------

/// The embedded store keeps its keys and revision across a reopen of the same file; keys
/// bound to leases (whose holders died with the process) are gone; watches from before the
/// reopen start with a `Resync`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_persists_across_reopen() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("state.json");
    let (a_rev, last_rev) = {
        let s = EmbeddedStore::open(&path)?;
        let a_rev = s.put("/prism/v1/deployments/a", b"A".to_vec(), None).await?;
        s.put("/prism/v1/deployments/b", b"B".to_vec(), None).await?;
        let lease = s.grant_lease(60).await?;
        s.put("/prism/v1/nodes/n1", b"leased".to_vec(), Some(lease)).await?;
        ensure!(s.delete("/prism/v1/deployments/b").await?);
        (a_rev, s.revision())
    };
    let s = EmbeddedStore::open(&path)?;
    ensure!(s.revision() == last_rev, "revision continues: {} vs {last_rev}", s.revision());
    let a = s.get("/prism/v1/deployments/a").await?.context("a survives")?;
    ensure!(a.value == b"A" && a.mod_revision == a_rev && a.create_revision == a_rev);
    ensure!(s.get("/prism/v1/deployments/b").await?.is_none(), "deleted key stays deleted");
    ensure!(s.get("/prism/v1/nodes/n1").await?.is_none(), "lease-bound key is not persisted");
    let d_rev = s.put("/prism/v1/deployments/d", b"D".to_vec(), None).await?;
    ensure!(d_rev > last_rev);
    let mut old = s.watch(keys::DEPLOYMENTS, Some(a_rev)).await?;
    match next_event(&mut old).await? {
        WatchEvent::Resync { entries, revision } => {
            let names: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
            ensure!(names == ["/prism/v1/deployments/a", "/prism/v1/deployments/d"], "{names:?}");
            ensure!(revision == d_rev);
        }
        other => anyhow::bail!("expected Resync, got {other:?}"),
    }
    let mut fresh = s.watch(keys::DEPLOYMENTS, Some(last_rev + 1)).await?;
    ensure!(
        next_event(&mut fresh).await?
            == WatchEvent::Put { key: "/prism/v1/deployments/d".into(), value: b"D".to_vec(), mod_revision: d_rev }
    );
    drop(s);
    // A third open sees the write made after the reopen.
    let s = EmbeddedStore::open(&path)?;
    ensure!(s.get("/prism/v1/deployments/d").await?.is_some());
    // While it is open the file is locked (one file, one store).
    ensure!(matches!(EmbeddedStore::open(&path), Err(StoreError::Locked { .. })));
    drop(s);
    // A corrupt file is an error, not an empty store.
    std::fs::write(&path, b"{not json")?;
    ensure!(matches!(EmbeddedStore::open(&path), Err(StoreError::Internal(_))));
    Ok(())
}

/// An etcd watch survives an etcd crash and restart: the store re-creates it from the last
/// delivered revision, so a write made while it was disconnected is still delivered, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_watch_resumes_after_etcd_restart() -> Result<()> {
    let mut etcd = EtcdFixture::start().await?;
    let store = EtcdStore::connect(&etcd.endpoints()).await?;
    let mut w = store.watch(keys::NODES, None).await?;
    let r1 = store.put("/prism/v1/nodes/n1", b"1".to_vec(), None).await?;
    ensure!(next_event(&mut w).await?.revision() == r1);
    etcd.kill();
    etcd.restart().await?;
    // A different client writes right away, before the watch has necessarily reconnected.
    let other = EtcdStore::connect(&etcd.endpoints()).await?;
    let r2 = other.put("/prism/v1/nodes/n2", b"2".to_vec(), None).await?;
    let ev = next_event(&mut w).await?;
    ensure!(
        ev == WatchEvent::Put { key: "/prism/v1/nodes/n2".into(), value: b"2".to_vec(), mod_revision: r2 },
        "got {ev:?}"
    );
    // The original client's unary calls reconnect too.
    let r3 = poll_put(&store, "/prism/v1/nodes/n3").await?;
    ensure!(next_event(&mut w).await?.revision() == r3);
    Ok(())
}

async fn poll_put(store: &EtcdStore, key: &str) -> Result<i64> {
    prism_tests::poll_until(Duration::from_secs(10), "put after etcd restart", || async {
        store.put(key, b"x".to_vec(), None).await.ok()
    })
    .await
}

/// Watching from a compacted revision yields a `Resync` with the prefix's current content,
/// then live events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_watch_from_compacted_revision_resyncs() -> Result<()> {
    let etcd = EtcdFixture::start().await?;
    let store = EtcdStore::connect(&etcd.endpoints()).await?;
    let r1 = store.put("/prism/v1/nodes/a", b"A".to_vec(), None).await?;
    store.put("/prism/v1/nodes/b", b"B".to_vec(), None).await?;
    let r3 = store.put("/prism/v1/nodes/a", b"A2".to_vec(), None).await?;
    store.client().compact(r3, None).await?;
    let mut w = store.watch(keys::NODES, Some(r1)).await?;
    match next_event(&mut w).await? {
        WatchEvent::Resync { entries, revision } => {
            let got: Vec<(&str, &[u8])> = entries.iter().map(|(k, v)| (k.as_str(), v.value.as_slice())).collect();
            ensure!(got == [("/prism/v1/nodes/a", &b"A2"[..]), ("/prism/v1/nodes/b", &b"B"[..])], "{got:?}");
            ensure!(revision >= r3);
        }
        other => anyhow::bail!("expected Resync, got {other:?}"),
    }
    let r4 = store.put("/prism/v1/nodes/c", b"C".to_vec(), None).await?;
    ensure!(
        next_event(&mut w).await?
            == WatchEvent::Put { key: "/prism/v1/nodes/c".into(), value: b"C".to_vec(), mod_revision: r4 }
    );
    Ok(())
}

/// Connecting to an address where no etcd listens fails promptly with `Unavailable`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_connect_to_nothing_is_unavailable() -> Result<()> {
    let port = prism_tests::free_port()?;
    let started = std::time::Instant::now();
    let r = EtcdStore::connect(&[format!("127.0.0.1:{port}")]).await;
    ensure!(matches!(r, Err(StoreError::Unavailable(_))), "got {:?}", r.err());
    ensure!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    Ok(())
}

/// A kept-alive lease outlives an etcd crash shorter than its TTL: the keep-alive loop
/// rides over the outage and the bound key is still there afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_keep_alive_rides_over_a_restart() -> Result<()> {
    let mut etcd = EtcdFixture::start().await?;
    let store: Store = Arc::new(EtcdStore::connect(&etcd.endpoints()).await?);
    let ttl = 10;
    let lease = store.grant_lease(ttl).await?;
    store.put("/prism/v1/nodes/n1", b"alive".to_vec(), Some(lease)).await?;
    let stop = CancellationToken::new();
    let ka = spawn_keep_alive(store.clone(), lease, ttl, stop.clone());
    etcd.kill();
    etcd.restart().await?;
    wait_until(Duration::from_secs(10), "store reachable again", || async {
        store.get("/prism/v1/nodes/n1").await.is_ok()
    })
    .await?;
    ensure!(exists(&store, "/prism/v1/nodes/n1").await, "leased key survives the restart");
    ensure!(!ka.is_finished(), "keep-alive loop still running");
    store.keep_alive(lease).await?;
    stop.cancel();
    ka.await??;
    Ok(())
}
