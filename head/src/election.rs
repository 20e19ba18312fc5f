//! Leader election among heads, built only on the [`StateStore`] trait (transaction + lease +
//! watch), so it works on etcd and on the embedded store alike. It follows etcd's
//! `concurrency.Election` idea with a single key: the leader is whoever created
//! `/prism/v1/election/{name}` bound to its lease (create-if-absent: compare
//! `mod_revision == 0`). Followers watch the key and campaign again when it is deleted —
//! by `resign`, or by the store when the leader's lease expires (its process died).
//!
//! [`spawn`] runs the whole loop for a head (grant lease, keep it alive, campaign, step
//! down on lease loss) and publishes a [`Leadership`] through a `watch` channel.

use futures::StreamExt;
use prism_common::state_store::{
    Compare, LeaseId, Revision, StateStore, StoreError, StoreResult, Txn, TxnOp, WatchEvent, keys, spawn_keep_alive,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Proof of leadership: the election key as this candidate wrote it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaderKey {
    /// The election key (`/prism/v1/election/{name}`).
    pub key: String,
    /// Revision at which it was written (resign compares on it).
    pub revision: Revision,
    /// The lease the key is bound to.
    pub lease: LeaseId,
}

/// Campaigns for `name` with `value` (e.g. this head's advertised gRPC address) bound to
/// `lease`; returns once this candidate is leader. While another candidate leads,
/// `observe(Some(value))` is called with its value (and `observe(None)` when it goes away).
/// Campaigning again with the lease that already holds the key returns at once.
///
/// # Errors
/// Store errors ([`StoreError::LeaseNotFound`] when `lease` expired meanwhile).
pub async fn campaign(
    store: &dyn StateStore,
    name: &str,
    value: &[u8],
    lease: LeaseId,
    observe: &mut (dyn FnMut(Option<&[u8]>) + Send),
) -> StoreResult<LeaderKey> {
    let key = keys::election(name);
    loop {
        let txn = Txn {
            compares: vec![Compare::absent(&key)],
            success: vec![TxnOp::Put { key: key.clone(), value: value.to_vec(), lease: Some(lease) }],
            failure: vec![],
        };
        let result = store.txn(txn).await?;
        if result.succeeded {
            return Ok(LeaderKey { key, revision: result.revision, lease });
        }
        let Some(current) = store.get(&key).await? else { continue };
        if current.lease == Some(lease) {
            return Ok(LeaderKey { key, revision: current.mod_revision, lease });
        }
        observe(Some(&current.value));
        wait_for_deletion(store, &key, current.mod_revision + 1, observe).await?;
        observe(None);
    }
}

/// Waits until `key` is deleted (watching from `from`), reporting value changes.
async fn wait_for_deletion(
    store: &dyn StateStore,
    key: &str,
    from: Revision,
    observe: &mut (dyn FnMut(Option<&[u8]>) + Send),
) -> StoreResult<()> {
    let mut events = store.watch(key, Some(from)).await?;
    while let Some(event) = events.next().await {
        match event {
            WatchEvent::Delete { key: k, .. } if k == key => return Ok(()),
            WatchEvent::Put { key: k, value, .. } if k == key => observe(Some(&value)),
            WatchEvent::Resync { entries, .. } => match entries.iter().find(|(k, _)| k == key) {
                Some((_, v)) => observe(Some(&v.value)),
                None => return Ok(()),
            },
            _ => {}
        }
    }
    Err(StoreError::Unavailable("election watch ended".into()))
}

/// The current leader's value for `name`, if any.
///
/// # Errors
/// Store errors.
pub async fn leader(store: &dyn StateStore, name: &str) -> StoreResult<Option<Vec<u8>>> {
    Ok(store.get(&keys::election(name)).await?.map(|v| v.value))
}

/// Gives up leadership: deletes the key if it is still the one `leader` wrote. Returns
/// whether it was still held.
///
/// # Errors
/// Store errors.
pub async fn resign(store: &dyn StateStore, leader: &LeaderKey) -> StoreResult<bool> {
    let txn = Txn {
        compares: vec![Compare::mod_revision(&leader.key, leader.revision)],
        success: vec![TxnOp::delete(&leader.key)],
        failure: vec![],
    };
    Ok(store.txn(txn).await?.succeeded)
}

/// What this head currently is: published by the election loop ([`Election::state`]) and
/// mirrored by the cluster handle (`Cluster::leadership`) once the head has acted on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Leadership {
    /// Not leading; `leader` is the leader's value (its address) when one is known.
    Follower {
        /// The current leader's value, UTF-8 (lossy).
        leader: Option<String>,
    },
    /// This head leads.
    Leader,
}

impl Default for Leadership {
    /// A follower that knows no leader.
    fn default() -> Self {
        Self::Follower { leader: None }
    }
}

impl Leadership {
    /// Whether this head leads.
    pub fn is_leader(&self) -> bool {
        matches!(self, Self::Leader)
    }
}

/// Settings of [`spawn`].
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    /// Election name (`keys::HEAD_ELECTION` for heads).
    pub name: String,
    /// This candidate's value, published while it leads (its advertised gRPC address).
    pub candidate: String,
    /// Lease TTL: a dead leader is replaced within about this long (whole seconds, ≥ 1).
    pub lease_ttl: Duration,
}

/// A running election loop.
pub struct Election {
    /// Current leadership; `changed()` wakes on every transition.
    pub state: watch::Receiver<Leadership>,
    /// The election key while this candidate leads (`None` otherwise). Its `key` and
    /// `revision` are a fencing token: a leader-only write can add
    /// `Compare::mod_revision(&k.key, k.revision)` so it fails once leadership is lost.
    pub leader_key: watch::Receiver<Option<LeaderKey>>,
    /// The loop task; it ends after shutdown (having resigned and revoked its lease).
    pub task: JoinHandle<()>,
}

/// Runs the election loop for one candidate until `shutdown`: grants a lease, keeps it
/// alive, campaigns, leads until the lease is lost (then campaigns again with a new lease),
/// and on shutdown resigns and revokes the lease so a follower takes over at once.
pub fn spawn(store: Arc<dyn StateStore>, config: ElectionConfig, shutdown: CancellationToken) -> Election {
    let (tx, rx) = watch::channel(Leadership::default());
    let (key_tx, key_rx) = watch::channel(None);
    let task = tokio::spawn(run(store, config, Publish { state: tx, key: key_tx }, shutdown));
    Election { state: rx, leader_key: key_rx, task }
}

/// Where the loop publishes what it is.
struct Publish {
    state: watch::Sender<Leadership>,
    key: watch::Sender<Option<LeaderKey>>,
}

async fn run(store: Arc<dyn StateStore>, config: ElectionConfig, tx: Publish, shutdown: CancellationToken) {
    let ttl_secs = i64::try_from(config.lease_ttl.as_secs().max(1)).unwrap_or(i64::MAX);
    let mut backoff = Duration::from_millis(100);
    while !shutdown.is_cancelled() {
        let outcome = term(&store, &config, ttl_secs, &tx, &shutdown).await;
        match outcome {
            Ok(()) => backoff = Duration::from_millis(100),
            Err(e) => {
                tracing::warn!(error = %e, election = %config.name, "election: retrying");
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}

/// One lease's life: campaign with it, lead while it lasts. Returns `Ok` when the lease was
/// lost or shutdown was requested (the lease is revoked on the way out).
async fn term(
    store: &Arc<dyn StateStore>,
    config: &ElectionConfig,
    ttl_secs: i64,
    tx: &Publish,
    shutdown: &CancellationToken,
) -> StoreResult<()> {
    let lease = store.grant_lease(ttl_secs).await?;
    let keep_alive_stop = shutdown.child_token();
    let mut keep_alive = spawn_keep_alive(store.clone(), lease, ttl_secs, keep_alive_stop.clone());
    let result = async {
        let mut observe = |v: Option<&[u8]>| {
            // A key holding this candidate's own address while it campaigns is a previous run's
            // (a restarted process), waiting out its lease: nobody leads, and naming ourselves
            // would send workers and clients that ask for the leader straight back here.
            let leader =
                v.filter(|b| *b != config.candidate.as_bytes()).map(|b| String::from_utf8_lossy(b).into_owned());
            tx.state.send_replace(Leadership::Follower { leader });
        };
        let won = tokio::select! {
            () = shutdown.cancelled() => return Ok(()),
            lost = &mut keep_alive => {
                tracing::info!(lease, ?lost, "election: lease lost while campaigning");
                return Ok(());
            }
            won = campaign(store.as_ref(), &config.name, config.candidate.as_bytes(), lease, &mut observe) => won?,
        };
        tracing::info!(candidate = %config.candidate, election = %config.name, "election: became leader");
        tx.key.send_replace(Some(won.clone()));
        tx.state.send_replace(Leadership::Leader);
        let mut ignore = |_: Option<&[u8]>| {};
        let deposed = wait_for_deletion(store.as_ref(), &won.key, won.revision + 1, &mut ignore);
        tokio::select! {
            () = shutdown.cancelled() => {
                if let Err(e) = resign(store.as_ref(), &won).await {
                    tracing::warn!(error = %e, "election: resign failed");
                }
            }
            lost = &mut keep_alive => tracing::warn!(lease, ?lost, "election: lease lost; stepping down"),
            r = deposed => tracing::warn!(result = ?r, "election: key removed; stepping down"),
        }
        Ok(())
    }
    .await;
    tx.key.send_replace(None);
    tx.state.send_replace(Leadership::Follower { leader: None });
    keep_alive_stop.cancel();
    keep_alive.abort();
    if let Err(e) = store.revoke_lease(lease).await {
        tracing::debug!(error = %e, lease, "election: revoke failed (it expires on its own)");
    }
    result
}
