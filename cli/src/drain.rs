//! `prism drain NODE --deadline 60s`: cordons the node, moves its replicas elsewhere (each
//! keeps serving until its replacement is Ready, or until the deadline when none can be
//! placed) and stops them once idle or at the deadline (the head does the work; this asks
//! for it).

use crate::client;
use anyhow::{Result, bail};
use clap::Args;
use prism_common::proto::v1::DrainNodeRequest;
use std::time::Duration;

/// `prism drain` arguments.
#[derive(Args, Debug)]
pub struct DrainArgs {
    /// Node id (see `prism status`).
    pub node: String,
    /// How long in-flight requests may run before they are migrated: `90s`, `2m`, `500ms`.
    /// Zero is refused: it would stop the node's replicas at once (kubectl drain's
    /// `--timeout=0` waits forever instead).
    #[arg(long, env = "PRISM_DRAIN_DEADLINE", default_value = "60s", value_parser = parse_deadline)]
    pub deadline: Duration,
    /// Why (recorded on the node, shown by `prism status`).
    #[arg(long, env = "PRISM_DRAIN_REASON", default_value = "prism drain")]
    pub reason: String,
}

/// Parses `500ms`, `60s`, `2m`, `1h` or a bare number of seconds.
///
/// # Errors
/// Fails on anything else.
pub fn parse_duration(text: &str) -> Result<Duration> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let Ok(value) = number.parse::<f64>() else { bail!("invalid duration {text:?} (try 60s, 2m, 500ms)") };
    let seconds = match unit.trim() {
        "" | "s" => value,
        "ms" => value / 1e3,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => bail!("invalid duration unit in {text:?} (use ms, s, m or h)"),
    };
    if !seconds.is_finite() || seconds < 0.0 {
        bail!("invalid duration {text:?}");
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// A drain deadline: as [`parse_duration`], but not zero. A zero deadline would stop the
/// node's replicas at once, cutting their requests, and a user who knows `kubectl drain`
/// (where `--timeout=0` means wait forever) may give one meaning the opposite.
///
/// # Errors
/// Not a duration, or zero.
fn parse_deadline(text: &str) -> Result<Duration> {
    let deadline = parse_duration(text)?;
    if deadline.is_zero() {
        bail!(
            "a zero deadline would stop the node's replicas at once, cutting their requests (it does not mean \
             \"wait forever\" as kubectl drain's --timeout=0 does); give the time in-flight requests may take, \
             e.g. --deadline 60s (a short one such as 1s stops them almost at once)"
        );
    }
    Ok(deadline)
}

/// Runs `prism drain`.
///
/// # Errors
/// Fails when the head is unreachable or does not know the node.
pub async fn run(head_addr: &client::HeadTarget, args: DrainArgs) -> Result<()> {
    let mut head = client::Head::connect(head_addr).await?;
    let deadline_ms = u64::try_from(args.deadline.as_millis()).unwrap_or(u64::MAX).max(1);
    let request = DrainNodeRequest { node_id: args.node.clone(), deadline_ms, reason: args.reason };
    head.call(|mut h| {
        let request = request.clone();
        async move { h.drain_node(request).await }
    })
    .await?;
    println!(
        "node {} draining (deadline {:?}); follow it with `prism status`, resume it with `prism uncordon {}`",
        args.node, args.deadline, args.node
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() -> Result<()> {
        assert_eq!(parse_duration("60s")?, Duration::from_secs(60));
        assert_eq!(parse_duration("2m")?, Duration::from_secs(120));
        assert_eq!(parse_duration("500ms")?, Duration::from_millis(500));
        assert_eq!(parse_duration("1.5s")?, Duration::from_millis(1500));
        assert_eq!(parse_duration("10")?, Duration::from_secs(10));
        assert!(parse_duration("10 parsecs").is_err());
        assert!(parse_duration("s").is_err());
        Ok(())
    }

    #[test]
    fn a_zero_drain_deadline_is_refused() -> Result<()> {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: DrainArgs,
        }
        for zero in ["0s", "0", "0ms", "0.0m"] {
            let Err(e) = Cli::try_parse_from(["drain", "w1", "--deadline", zero]) else { panic!("{zero} accepted") };
            assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{zero}: {e}");
        }
        let e = Cli::try_parse_from(["drain", "w1", "--deadline", "0s"]).err().map(|e| e.to_string());
        assert!(e.as_deref().is_some_and(|e| e.contains("--deadline 60s")), "{e:?}");
        let ok = Cli::try_parse_from(["drain", "w1", "--deadline", "1s"])?;
        assert_eq!(ok.args.deadline, Duration::from_secs(1));
        Ok(())
    }
}
