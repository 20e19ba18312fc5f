//! The `HeadService.WorkerSession` stream: connect to a head (trying the configured
//! addresses in turn, with exponential backoff, following `UNAVAILABLE` leader hints), send
//! `register` then the full replica `status`, then a status on every change, `load` once a
//! second and `drain` progress; execute the head's commands. On reconnect (head restart,
//! new leader) the worker registers again and reports its running replicas, which the head
//! adopts: they are never restarted.
//!
//! A head refuses (`ALREADY_EXISTS`) a registration whose node id has a live session from
//! another worker process. At start-up that is either a second worker given a node id in
//! use, or this worker restarted before the head noticed that its previous process is gone
//! (its session ends after the head's `--worker-timeout` of silence, which the refusal says).
//! So a worker that has not registered yet retries until that session would have ended, and
//! then gives up: [`run`] returns [`Refused`] and the process exits non-zero. A worker that
//! was registered before and is then refused has been superseded: while it was frozen or cut
//! off, the head ended its session and another process registered with its node id (its
//! replicas were placed again there). It gives up at once ([`Refused::superseded`]): the
//! caller stops its replicas, freeing their memory, and the process exits non-zero (a
//! supervisor such as Kubernetes starts it again if it should run).

use super::Agent;
use super::drain::DrainSource;
use prism_common::proto::v1::{self as pb, head_message, worker_message};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::Endpoint;

/// Metadata keys a follower head may use to name the leader.
pub const LEADER_METADATA_KEYS: &[&str] = &["prism-leader", "x-prism-leader", "leader"];

/// The leader address a follower names in an `UNAVAILABLE` status: metadata
/// `prism-leader` (or `x-prism-leader` / `leader`), else `leader=ADDR` / `leader: ADDR` in
/// the message. Returned normalised to `http://…`.
pub fn leader_hint(status: &tonic::Status) -> Option<String> {
    if status.code() != tonic::Code::Unavailable {
        return None;
    }
    for key in LEADER_METADATA_KEYS {
        if let Some(v) = status.metadata().get(*key).and_then(|v| v.to_str().ok())
            && !v.trim().is_empty()
        {
            return Some(crate::config::normalize_endpoint(v));
        }
    }
    let msg = status.message();
    let lower = msg.to_ascii_lowercase();
    for pat in ["leader=", "leader: ", "leader is "] {
        if let Some(i) = lower.find(pat) {
            let rest = &msg[i + pat.len()..];
            let addr: String = rest
                .trim_start()
                .chars()
                .take_while(|c| !c.is_whitespace() && !matches!(c, ',' | ';' | ')' | '"' | '\''))
                .collect();
            if !addr.is_empty() && addr != "unknown" {
                return Some(crate::config::normalize_endpoint(&addr));
            }
        }
    }
    None
}

/// A head's gRPC status as one log-friendly line: its code, its message and, for transport
/// failures, the chain of causes (`Unavailable: not the leader; leader is unknown`), instead
/// of `tonic::Status`'s own `Display` (the code's description, the quoted message and the
/// cause's `Debug` dump).
pub fn status_line(status: &tonic::Status) -> String {
    let mut line = format!("{:?}: {}", status.code(), status.message());
    let mut cause = std::error::Error::source(status);
    while let Some(c) = cause {
        let text = c.to_string();
        if !text.is_empty() && !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        cause = c.source();
    }
    line
}

/// How long a refused worker keeps trying past the moment the head said the live session
/// would end (the head notices the silence on its next check; retries are up to a second apart).
const REFUSAL_MARGIN: Duration = Duration::from_secs(3);
/// How long it keeps trying when the refusal does not say when the live session would end.
const REFUSAL_DEFAULT_WAIT: Duration = Duration::from_secs(10);
/// Longest pause between registrations while refused (the live session may end any moment).
const REFUSAL_RETRY: Duration = Duration::from_secs(1);

/// How a session ended.
enum SessionEnd {
    /// Shutdown requested.
    Shutdown,
    /// Error (connect or stream); with a leader hint when a follower answered.
    Failed { error: String, leader: Option<String> },
    /// The head refused the registration: the node id has a live session from another
    /// worker process, which ends within `expires_in` (when the head said) if that worker is gone.
    NodeIdInUse { message: String, expires_in: Option<Duration> },
}

/// The head refused to register this worker: before it ever registered, for as long as the
/// node's live session could have belonged to an earlier process of this worker; after it had
/// registered, at once (another process now holds its node id: this one was superseded).
#[derive(Debug, thiserror::Error)]
#[error("{}", refusal_message(head, message, *superseded))]
pub struct Refused {
    /// The head that refused.
    pub head: String,
    /// Its reason (names the node id and where the live worker is).
    pub message: String,
    /// Whether this worker had registered before (it may host replicas the head has
    /// placed again on the process that now holds the node id).
    pub superseded: bool,
}

fn refusal_message(head: &str, message: &str, superseded: bool) -> String {
    if superseded {
        format!(
            "this worker was superseded: its head session ended (it was frozen or cut off) and the head at \
             {head} now refuses it because another worker process registered with its node id; its \
             replicas are stopped and it exits (restart it with a unique --node-id if it should run \
             beside that one). The head said: {message}"
        )
    } else {
        format!("the head at {head} refused to register this worker: {message}")
    }
}

/// Runs the registration loop until `shutdown` is cancelled.
///
/// # Errors
/// [`Refused`]: the node id stayed in use by another live worker process (see the module doc).
pub async fn run(agent: Arc<Agent>, shutdown: CancellationToken) -> Result<(), Refused> {
    let heads = agent.cfg.heads.clone();
    let mut idx = 0usize;
    let mut hinted: Option<String> = None;
    let mut backoff = Duration::from_millis(100);
    let mut registered_once = false;
    // While refused before ever registering: until when this worker keeps trying.
    let mut refused_until: Option<Instant> = None;
    loop {
        let target = hinted.take().unwrap_or_else(|| heads[idx % heads.len()].clone());
        let started = tokio::time::Instant::now();
        let end = session(&agent, &target, &shutdown).await;
        if agent.is_registered() {
            registered_once = true;
            refused_until = None;
        }
        match end {
            SessionEnd::Shutdown => return Ok(()),
            SessionEnd::NodeIdInUse { message, expires_in } => {
                agent.set_registered(false);
                if registered_once {
                    return Err(Refused { head: target, message, superseded: true });
                } else {
                    let now = Instant::now();
                    let until = *refused_until
                        .get_or_insert_with(|| now + expires_in.unwrap_or(REFUSAL_DEFAULT_WAIT) + REFUSAL_MARGIN);
                    if now >= until {
                        return Err(Refused { head: target, message, superseded: false });
                    }
                    tracing::warn!(
                        head = %target, error = %message, gives_up_in_s = (until - now).as_secs_f64(),
                        "head refused the registration; retrying until that session would have ended"
                    );
                }
                backoff = backoff.min(REFUSAL_RETRY);
            }
            SessionEnd::Failed { error, leader } => {
                agent.set_registered(false);
                if let Some(l) = leader.filter(|l| *l != target) {
                    tracing::info!(head = %target, leader = %l, "head is a follower: following the leader hint");
                    hinted = Some(l);
                    continue;
                }
                tracing::warn!(head = %target, %error, "head session ended; reconnecting");
                idx += 1;
                // A session that lasted a while resets the backoff.
                if started.elapsed() > Duration::from_secs(10) {
                    backoff = Duration::from_millis(100);
                }
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(agent.cfg.max_backoff);
    }
}

fn msg(m: worker_message::Msg) -> pb::WorkerMessage {
    pb::WorkerMessage { msg: Some(m) }
}

async fn session(agent: &Arc<Agent>, target: &str, shutdown: &CancellationToken) -> SessionEnd {
    let failed = |error: String| SessionEnd::Failed { error, leader: None };
    let endpoint = match Endpoint::from_shared(target.to_owned()) {
        Ok(e) => e.connect_timeout(Duration::from_secs(2)).tcp_nodelay(true),
        Err(e) => return failed(format!("bad head address {target}: {e}")),
    };
    let channel = tokio::select! {
        _ = shutdown.cancelled() => return SessionEnd::Shutdown,
        c = prism_common::tls::client::channel(endpoint) => match c {
            Ok(c) => c,
            Err(e) => return failed(format!("connect: {e}")),
        },
    };
    let bearer = match agent.cfg.head_token.bearer() {
        Ok(b) => b,
        Err(e) => return failed(format!("head token: {e}")),
    };
    let mut client = prism_common::head_auth::head_client(channel, bearer);
    let (tx, rx) = mpsc::channel::<pb::WorkerMessage>(64);
    // Queue register + status before opening the stream so they are the first messages.
    let mut changes = agent.subscribe_changes();
    let mut drains = agent.subscribe_drain();
    changes.borrow_and_update();
    drains.borrow_and_update();
    let first = [
        msg(worker_message::Msg::Register(agent.inventory())),
        msg(worker_message::Msg::Status(agent.status_snapshot())),
    ];
    for m in first {
        if tx.send(m).await.is_err() {
            return failed("outbound stream closed".into());
        }
    }
    if let Some(d) = agent.drain_state() {
        let _ = tx.send(msg(worker_message::Msg::Drain(d.to_proto()))).await;
    }
    let response = tokio::select! {
        _ = shutdown.cancelled() => return SessionEnd::Shutdown,
        r = client.worker_session(ReceiverStream::new(rx)) => r,
    };
    let mut inbound = match response {
        Ok(r) => r.into_inner(),
        Err(s) if s.code() == tonic::Code::AlreadyExists => {
            let expires_in = s
                .metadata()
                .get(prism_common::proto::SESSION_EXPIRES_METADATA)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse().ok())
                .map(Duration::from_millis);
            return SessionEnd::NodeIdInUse { message: s.message().to_owned(), expires_in };
        }
        Err(s) => return SessionEnd::Failed { error: status_line(&s), leader: leader_hint(&s) },
    };
    tracing::info!(head = %target, node = %agent.node_id(), "registered with head");
    agent.set_registered(true);
    let mut load_tick = tokio::time::interval(agent.cfg.load_interval);
    load_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let out = tokio::select! {
            _ = shutdown.cancelled() => {
                goodbye(agent, tx, &mut inbound).await;
                return SessionEnd::Shutdown;
            }
            m = inbound.message() => match m {
                Ok(Some(m)) => { handle(agent, m); None }
                Ok(None) => return failed("head closed the stream".into()),
                Err(s) => return SessionEnd::Failed { error: status_line(&s), leader: leader_hint(&s) },
            },
            c = changes.changed() => match c {
                // Loads first: a replica's Ready status then reaches the head after its load
                // report, so the route table that first lists it Ready carries its capacity
                // (`max_num_seqs`). Routers admit up to their default limit to a replica that
                // reported none, and would hand it everything queued for the model.
                Ok(()) => {
                    if tx.send(msg(worker_message::Msg::Load(agent.load_reports()))).await.is_err() {
                        return failed("outbound stream closed".into());
                    }
                    Some(msg(worker_message::Msg::Status(agent.status_snapshot())))
                }
                Err(_) => return SessionEnd::Shutdown,
            },
            d = drains.changed() => match d {
                Ok(()) => drains.borrow_and_update().as_ref().map(|d| msg(worker_message::Msg::Drain(d.to_proto()))),
                Err(_) => return SessionEnd::Shutdown,
            },
            _ = load_tick.tick() => Some(msg(worker_message::Msg::Load(agent.load_reports()))),
        };
        if let Some(m) = out
            && tx.send(m).await.is_err()
        {
            return failed("outbound stream closed".into());
        }
    }
}

/// Sends the last status and drain progress, half-closes the stream and waits (briefly)
/// for the head to close its side, so the messages are delivered before the process exits.
async fn goodbye(agent: &Agent, tx: mpsc::Sender<pb::WorkerMessage>, inbound: &mut tonic::Streaming<pb::HeadMessage>) {
    let _ = tx.send(msg(worker_message::Msg::Status(agent.status_snapshot()))).await;
    if let Some(d) = agent.drain_state() {
        let _ = tx.send(msg(worker_message::Msg::Drain(d.to_proto()))).await;
    }
    drop(tx);
    let _ = tokio::time::timeout(Duration::from_secs(2), async { while let Ok(Some(_)) = inbound.message().await {} })
        .await;
}

/// Executes one command from the head.
fn handle(agent: &Arc<Agent>, m: pb::HeadMessage) {
    match m.msg {
        Some(head_message::Msg::Ack(a)) => {
            tracing::debug!(node = %a.node_id, leader = %a.leader, "registration acknowledged");
        }
        Some(head_message::Msg::Start(s)) => {
            tracing::info!(replica = %s.replica_id, deployment = %s.deployment, "StartReplica");
            agent.start_replica(s);
        }
        Some(head_message::Msg::Stop(s)) => {
            tracing::info!(replica = %s.replica_id, deadline_ms = s.deadline_ms, "StopReplica");
            agent.stop_replica(&s.replica_id, Duration::from_millis(s.deadline_ms));
        }
        Some(head_message::Msg::Drain(d)) => {
            let deadline =
                if d.deadline_ms == 0 { agent.cfg.sigterm_drain } else { Duration::from_millis(d.deadline_ms) };
            let reason = if d.reason.is_empty() { "drain command" } else { d.reason.as_str() };
            agent.drain(deadline, reason, DrainSource::Head);
        }
        None => tracing::debug!("empty head message"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_logs_as_its_code_and_message_only() {
        let mut s = tonic::Status::with_details(tonic::Code::Unavailable, "not the leader", vec![1, 2, 3].into());
        s.metadata_mut().insert("prism-leader", tonic::metadata::MetadataValue::from_static("10.0.0.2:50050"));
        assert_eq!(status_line(&s), "Unavailable: not the leader");
        let cause = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset by peer");
        let s = tonic::Status::from_error(Box::new(cause));
        let line = status_line(&s);
        assert!(line.starts_with("Unknown: ") && line.contains("connection reset by peer"), "{line}");
        assert!(!line.contains("metadata") && !line.contains("details"), "{line}");
    }

    #[test]
    fn leader_hint_from_metadata_and_message() {
        let mut s = tonic::Status::unavailable("not the leader");
        s.metadata_mut().insert("prism-leader", tonic::metadata::MetadataValue::from_static("10.0.0.2:50050"));
        assert_eq!(leader_hint(&s).as_deref(), Some("http://10.0.0.2:50050"));
        let s = tonic::Status::unavailable("not the leader; leader=http://h1:50050");
        assert_eq!(leader_hint(&s).as_deref(), Some("http://h1:50050"));
        let s = tonic::Status::unavailable("follower, leader: h2:50050");
        assert_eq!(leader_hint(&s).as_deref(), Some("http://h2:50050"));
        assert_eq!(leader_hint(&tonic::Status::unavailable("no leader yet")), None);
        assert_eq!(leader_hint(&tonic::Status::internal("leader=h3:1")), None);
    }
}
