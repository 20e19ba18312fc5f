//! Demand reports to the head (`HeadService.ReportDemand`): what this router queues and has
//! in flight per served model, for the head's autoscaler (queue depth counts toward a
//! deployment's ongoing requests, and a request queued for a model with no Ready replica is
//! the signal to scale from zero).
//!
//! Sent about once a second ([`REPORT_PERIOD`]), and at once when a request queues for a
//! model with no Ready replica. It goes to the head whose route stream is live (the leader),
//! else to the configured heads in turn, following a follower's `prism-leader` hint. Every
//! failure (a head that does not implement the RPC yet, a follower, a head away) is logged
//! at debug level and the next report simply tries again: serving never waits on it. With
//! static routes (no head) nothing is sent.

use std::collections::HashMap;
use std::time::Duration;

use prism_common::head_auth::{HeadClient, HeadCredential, head_client};
use prism_common::proto::v1::RouterDemandReport;
use tokio_util::sync::CancellationToken;
use tonic::transport::Endpoint;

use crate::admission::Admission;
use crate::routes::Routes;

/// Period of the regular report.
pub const REPORT_PERIOD: Duration = Duration::from_secs(1);
/// Longest wait for one report's answer.
const REPORT_TIMEOUT: Duration = Duration::from_secs(1);
/// Metadata key in which a follower head names the leader.
const LEADER_METADATA: &str = "prism-leader";

/// Reports demand to `heads` until `shutdown` (returns at once when `heads` is empty).
pub async fn report(
    admission: Admission,
    routes: Routes,
    heads: Vec<String>,
    router_id: String,
    credential: HeadCredential,
    shutdown: CancellationToken,
) {
    if heads.is_empty() {
        return;
    }
    let mut clients: HashMap<String, HeadClient> = HashMap::new();
    let mut next = 0usize;
    let mut hint: Option<String> = None;
    let mut tick = tokio::time::interval(REPORT_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shutdown.cancelled() => return,
            _ = tick.tick() => {}
            () = admission.scale_from_zero_wanted() => {}
        }
        let head = match hint.take().or_else(|| routes.watched_head()) {
            Some(h) => h,
            None => {
                next = next.wrapping_add(1);
                heads[next % heads.len()].clone()
            }
        };
        let Some(client) = client_for(&mut clients, &head, &credential) else { continue };
        let req = RouterDemandReport { router_id: router_id.clone(), models: admission.demand() };
        match tokio::time::timeout(REPORT_TIMEOUT, client.report_demand(req)).await {
            Ok(Ok(_)) => {}
            Ok(Err(s)) => {
                hint = s
                    .metadata()
                    .get(LEADER_METADATA)
                    .and_then(|v| v.to_str().ok())
                    .filter(|l| !l.is_empty() && *l != head)
                    .map(str::to_owned);
                tracing::debug!(head = %head, code = ?s.code(), "demand report not taken");
            }
            Err(_) => tracing::debug!(head = %head, "demand report timed out"),
        }
    }
}

/// The client of `head` (connected lazily, kept for the next reports).
fn client_for<'a>(
    clients: &'a mut HashMap<String, HeadClient>,
    head: &str,
    credential: &HeadCredential,
) -> Option<&'a mut HeadClient> {
    if !clients.contains_key(head) {
        let ep = match Endpoint::from_shared(head.to_owned()) {
            Ok(ep) => ep.connect_timeout(Duration::from_secs(1)),
            Err(e) => {
                tracing::debug!(head, error = %e, "bad head endpoint for demand reports");
                return None;
            }
        };
        let bearer = match credential.bearer() {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "no head token for demand reports");
                return None;
            }
        };
        clients.insert(head.to_owned(), head_client(prism_common::tls::client::channel_lazy(ep), bearer));
    }
    clients.get_mut(head)
}
