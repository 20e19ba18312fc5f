//! Keeps every listed replica's [`ReplicaCache`] current for cache-aware routing: one task
//! per replica in the route table fetches its prompt codec (`GetPromptCodec`, retried with
//! backoff while the worker fails or starts; a worker without the RPC is asked again rarely)
//! and then follows its `WatchPrefixCache` stream (a reset replaces the index, deltas change
//! it), reconnecting with backoff. The task ends when the replica leaves the table; its index
//! is dropped with the table's entry.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use prism_common::proto::v1::WatchPrefixCacheRequest;
use prism_common::proto::v1::worker_service_client::WorkerServiceClient;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};

use crate::metrics::Metrics;
use crate::prefix::ReplicaCache;
use crate::prefix::codec::{CodecCache, CodecError, MAX_CODEC_BYTES};
use crate::routes::Routes;

/// First retry delay of a failed codec fetch or watch stream.
const BACKOFF_START: Duration = Duration::from_millis(200);
/// Longest retry delay of a codec fetch or watch stream that keeps failing.
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// Delay before asking again a worker without `GetPromptCodec` / `WatchPrefixCache` (it may
/// be upgraded in place) or whose replica's codec cannot be exported.
const UNIMPLEMENTED_RETRY: Duration = Duration::from_secs(60);

/// One replica followed by a task.
struct Followed {
    endpoint: String,
    stop: CancellationToken,
}

/// Follows the route table until `shutdown`: starts a task per listed replica, stops it when
/// the replica leaves.
pub async fn run(routes: Routes, metrics: Metrics, shutdown: CancellationToken) {
    let codecs = Arc::new(CodecCache::default());
    let mut followed: HashMap<String, Followed> = HashMap::new();
    let mut updates = routes.subscribe();
    loop {
        let snap = routes.snapshot();
        let listed: HashMap<&str, &Arc<crate::routes::ReplicaRoute>> =
            snap.models.values().flatten().map(|r| (r.replica_id.as_str(), r)).collect();
        followed.retain(|id, f| {
            let keep = listed.get(id.as_str()).is_some_and(|r| r.endpoint == f.endpoint);
            if !keep {
                f.stop.cancel();
                metrics.forget_prefix_index(id);
            }
            keep
        });
        for (id, r) in &listed {
            if followed.contains_key(*id) || !r.is_ready() {
                continue;
            }
            let stop = shutdown.child_token();
            let replica = Replica {
                id: (*id).to_owned(),
                cache: Arc::clone(&r.cache),
                metrics: metrics.clone(),
                stop: stop.clone(),
            };
            tokio::spawn(replica.follow(r.endpoint.clone(), Arc::clone(&codecs)));
            followed.insert((*id).to_owned(), Followed { endpoint: r.endpoint.clone(), stop });
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            r = updates.changed() => if r.is_err() { return },
        }
    }
}

/// The task of one replica.
struct Replica {
    id: String,
    cache: Arc<ReplicaCache>,
    metrics: Metrics,
    stop: CancellationToken,
}

impl Replica {
    /// Sleeps `d`; false when the task was stopped meanwhile.
    async fn pause(&self, d: Duration) -> bool {
        tokio::select! {
            () = self.stop.cancelled() => false,
            () = tokio::time::sleep(d) => true,
        }
    }

    async fn follow(self, endpoint: String, codecs: Arc<CodecCache>) {
        let Ok(ep) = Endpoint::from_shared(endpoint) else { return };
        let ch = prism_common::tls::client::channel_lazy(
            ep.connect_timeout(Duration::from_secs(2))
                .http2_keep_alive_interval(Duration::from_secs(5))
                .keep_alive_timeout(Duration::from_secs(5)),
        );
        let mut client = WorkerServiceClient::new(ch).max_decoding_message_size(MAX_CODEC_BYTES);
        if !self.fetch_codec(&mut client, &codecs).await {
            return;
        }
        self.watch(&mut client).await;
    }

    /// Installs the replica's codec; false when the task ends without one (stopped, or an
    /// engine that caches no prefixes).
    async fn fetch_codec(&self, client: &mut WorkerServiceClient<Channel>, codecs: &CodecCache) -> bool {
        let mut backoff = BACKOFF_START;
        loop {
            let fetched = tokio::select! {
                () = self.stop.cancelled() => return false,
                r = codecs.fetch(client, &self.id) => r,
            };
            let delay = match fetched {
                Ok(Some(c)) => {
                    tracing::info!(replica = %self.id, block_size = c.key.block_size, "prompt codec loaded: cache-aware routing");
                    self.cache.set_codec(Some(c));
                    return true;
                }
                Ok(None) => {
                    tracing::info!(replica = %self.id, "replica caches no prefixes: routed by load alone");
                    return false;
                }
                Err(e @ (CodecError::Unimplemented | CodecError::NotExportable)) => {
                    tracing::info!(replica = %self.id, error = %e, "routed by load alone");
                    UNIMPLEMENTED_RETRY
                }
                Err(e) => {
                    tracing::debug!(replica = %self.id, error = %e, "prompt codec not fetched; retrying");
                    let d = backoff;
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                    d
                }
            };
            if !self.pause(delay).await {
                return false;
            }
        }
    }

    /// Follows `WatchPrefixCache` until stopped, reconnecting with backoff; the confirmed
    /// index is cleared whenever the stream breaks (its next reset refills it).
    async fn watch(&self, client: &mut WorkerServiceClient<Channel>) {
        let mut backoff = BACKOFF_START;
        loop {
            let opened = tokio::select! {
                () = self.stop.cancelled() => return,
                r = client.watch_prefix_cache(WatchPrefixCacheRequest { replica_id: self.id.clone() }) => r,
            };
            let delay = match opened {
                Ok(stream) => {
                    let mut stream = stream.into_inner();
                    loop {
                        let next = tokio::select! {
                            () = self.stop.cancelled() => return,
                            m = stream.message() => m,
                        };
                        let Ok(Some(m)) = next else { break };
                        backoff = BACKOFF_START;
                        let mut ix = self.cache.index();
                        if m.reset {
                            ix.reset(&m.stored);
                        } else {
                            ix.apply(&m.stored, &m.removed);
                        }
                        let (confirmed, expected) = (ix.confirmed_len(), ix.expected_len(Instant::now()));
                        drop(ix);
                        // Stopped: the replica left and its gauges were dropped; setting
                        // them now would bring its series back for good.
                        if self.stop.is_cancelled() {
                            return;
                        }
                        self.metrics.set_prefix_index(&self.id, confirmed, expected);
                    }
                    self.cache.index().clear_confirmed();
                    tracing::debug!(replica = %self.id, "prefix cache stream ended; reconnecting");
                    backoff
                }
                Err(s) if s.code() == Code::Unimplemented => UNIMPLEMENTED_RETRY,
                Err(s) => {
                    tracing::debug!(replica = %self.id, code = ?s.code(), "prefix cache watch failed; retrying");
                    backoff
                }
            };
            backoff = (backoff * 2).min(BACKOFF_MAX);
            if !self.pause(delay).await {
                return;
            }
        }
    }
}
