//! `prism scale NAME N`: sets a deployment's replica count, then says how many of them the
//! current nodes cannot place (they stay Pending until capacity joins, as in Ray Serve).
//! `prism delete NAME`: removes a deployment (its replicas drain and stop; the router stops
//! listing its model).

use crate::client;
use anyhow::Result;
use clap::Args;
use prism_common::proto::v1::{
    ClusterStatusRequest, DeleteDeploymentRequest, ReplicaRecord, ReplicaState, ScaleDeploymentRequest,
};
use prism_common::text::count;
use std::time::{Duration, Instant};

/// How long `prism scale` waits for the head to create or place the new replicas before it
/// reports what is still Pending (the reconciler acts on a scale at once).
const PLACEMENT_WAIT: Duration = Duration::from_secs(2);
/// Pause between two status reads while waiting.
const PLACEMENT_POLL: Duration = Duration::from_millis(100);

/// `prism scale` arguments.
#[derive(Args, Debug)]
pub struct ScaleArgs {
    /// Deployment name.
    pub name: String,
    /// Desired number of replicas. More than the nodes can place is accepted: the rest stay
    /// Pending until nodes join (a notice on stderr says how many, and why).
    #[arg(allow_negative_numbers = true, value_parser = parse_replicas)]
    pub replicas: u32,
}

/// A replica count: a whole number ≥ 0. Negative numbers reach this parser (rather than
/// being taken for a flag, `unexpected argument '-1'`) so the refusal can say what is valid.
///
/// # Errors
/// Not a whole number, negative, or beyond `u32`.
fn parse_replicas(text: &str) -> Result<u32, String> {
    let n: i64 = text.trim().parse().map_err(|_| format!("{text:?} is not a replica count (a whole number ≥ 0)"))?;
    if n < 0 {
        return Err(format!("the replica count must be ≥ 0, not {n} (0 stops every replica)"));
    }
    u32::try_from(n).map_err(|_| format!("{n} replicas is far beyond any cluster (at most 10,000)"))
}

/// Runs `prism scale`.
///
/// # Errors
/// Fails when the head is unreachable or rejects the request (unknown deployment, …).
pub async fn run(head_addr: &client::HeadTarget, args: ScaleArgs) -> Result<()> {
    let mut head = client::Head::connect(head_addr).await?;
    let request = ScaleDeploymentRequest { name: args.name.clone(), replicas: args.replicas };
    head.call(|mut h| {
        let request = request.clone();
        async move { h.scale_deployment(request).await }
    })
    .await?;
    println!("deployment {} scaled to {}", args.name, count(u64::from(args.replicas), "replica", "replicas"));
    if let Some(notice) = unplaced_notice(&mut head, &args.name, args.replicas).await {
        eprintln!("{notice}");
    }
    Ok(())
}

/// The notice for replicas of `name` the current nodes cannot place, once the head has
/// created its `replicas` (or after [`PLACEMENT_WAIT`]); `None` when all are placed or
/// the status cannot be read (the scale itself succeeded).
async fn unplaced_notice(head: &mut client::Head, name: &str, replicas: u32) -> Option<String> {
    let deadline = Instant::now() + PLACEMENT_WAIT;
    loop {
        let status = head.call(|mut h| async move { h.cluster_status(ClusterStatusRequest {}).await }).await.ok()?;
        let mine: Vec<&ReplicaRecord> = status
            .replicas
            .iter()
            .filter(|r| r.deployment == name)
            .filter(|r| matches!(r.state(), ReplicaState::Pending | ReplicaState::Starting | ReplicaState::Ready))
            .collect();
        let settled = mine.len() == replicas as usize;
        if settled || Instant::now() >= deadline {
            return pending_notice(&mine, replicas);
        }
        tokio::time::sleep(PLACEMENT_POLL).await;
    }
}

/// "notice: P of N replicas cannot be placed …" for the desired replicas the nodes cannot
/// place. Right after a scale-down the head may not have removed the surplus Pending
/// replicas yet: those are not among the `desired` count, so P is the desired replicas
/// not placed (Starting or Ready), at most the Pending ones seen, never more than `desired`.
fn pending_notice(replicas: &[&ReplicaRecord], desired: u32) -> Option<String> {
    let pending: Vec<&&ReplicaRecord> = replicas.iter().filter(|r| r.state() == ReplicaState::Pending).collect();
    let placed = replicas.iter().filter(|r| matches!(r.state(), ReplicaState::Starting | ReplicaState::Ready)).count();
    let unplaced = (desired as usize).saturating_sub(placed).min(pending.len());
    if unplaced == 0 {
        return None;
    }
    let first = pending.first()?;
    let reason = if first.reason.is_empty() { "no room on any node" } else { first.reason.as_str() };
    let of = count(u64::from(desired), "replica", "replicas");
    let verb = if unplaced == 1 { "it stays" } else { "they stay" };
    Some(format!(
        "notice: {unplaced} of {of} cannot be placed on the current nodes: {reason}; {verb} Pending until capacity joins"
    ))
}

/// Runs `prism delete NAME`.
///
/// # Errors
/// Fails when the head is unreachable or rejects the request (unknown deployment, …).
pub async fn delete(head_addr: &client::HeadTarget, name: String) -> Result<()> {
    let mut head = client::Head::connect(head_addr).await?;
    let request = DeleteDeploymentRequest { name: name.clone() };
    head.call(|mut h| {
        let request = request.clone();
        async move { h.delete_deployment(request).await }
    })
    .await?;
    println!("deployment {name} deleted; its replicas drain and stop");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replica(state: ReplicaState, reason: &str) -> ReplicaRecord {
        ReplicaRecord { state: state as i32, reason: reason.into(), ..Default::default() }
    }

    #[test]
    fn the_notice_counts_pending_replicas_and_gives_the_planner_reason() {
        let ready = replica(ReplicaState::Ready, "");
        let pending = replica(ReplicaState::Pending, "needs 1 CPU slot on one node; largest free group is 0");
        assert_eq!(pending_notice(&[&ready, &ready], 2), None);
        assert_eq!(
            pending_notice(&[&ready, &pending, &pending], 3).as_deref(),
            Some(
                "notice: 2 of 3 replicas cannot be placed on the current nodes: needs 1 CPU slot on one node; \
                 largest free group is 0; they stay Pending until capacity joins"
            )
        );
        assert!(
            pending_notice(&[&pending], 1)
                .is_some_and(|n| n.contains("1 of 1 replica cannot") && n.contains("it stays"))
        );
    }

    #[test]
    fn replica_counts_are_whole_numbers_from_zero() {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: ScaleArgs,
        }
        let parse = |n: &str| Cli::try_parse_from(["scale", "smol", n]).map(|c| c.args.replicas);
        assert_eq!(parse("0").ok(), Some(0));
        assert_eq!(parse("5000").ok(), Some(5000));
        for bad in ["-1", "-5", "2.5", "x", "99999999999"] {
            let Err(e) = parse(bad) else { panic!("{bad} accepted") };
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{bad}: {e}");
        }
        let Err(e) = parse("-5") else { panic!("-5 accepted") };
        assert!(e.to_string().contains("must be ≥ 0, not -5"), "{e}");
    }

    /// Right after a scale-down the head has not removed the surplus Pending replicas yet:
    /// they are not among the desired count, so only the desired ones not placed count.
    #[test]
    fn the_notice_after_a_scale_down_counts_only_the_desired_replicas() {
        let ready = replica(ReplicaState::Ready, "");
        let starting = replica(ReplicaState::Starting, "");
        let pending = replica(ReplicaState::Pending, "no room");
        let mut surplus = vec![&ready, &starting, &ready];
        surplus.extend(std::iter::repeat_n(&pending, 4997));
        assert_eq!(pending_notice(&surplus, 2), None, "3 placed cover the 2 desired");
        assert_eq!(pending_notice(&surplus, 3), None);
        let mut short = vec![&ready];
        short.extend(std::iter::repeat_n(&pending, 4997));
        assert!(
            pending_notice(&short, 2).is_some_and(|n| n.starts_with("notice: 1 of 2 replicas cannot be placed")),
            "{:?}",
            pending_notice(&short, 2)
        );
    }
}
