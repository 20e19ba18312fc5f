//! Spot-termination notice watcher: polls an HTTP endpoint (as cloud metadata services
//! expose, e.g. AWS `spot/instance-action`, which answers 404 until a notice exists) or a
//! file once a second; when a notice appears the node drains, with the deadline taken from
//! the termination time in the notice (minus the drain margin) or the SIGTERM deadline.

use super::{Agent, DrainSource, unix_ms};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Parses a termination time from a notice body: a JSON object with `"time"` (AWS), an
/// RFC 3339 UTC time `YYYY-MM-DDTHH:MM:SS[.fff]Z`, or unix seconds. Returns unix ms.
pub fn parse_termination_time(body: &str) -> Option<u64> {
    let body = body.trim();
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(body) {
        if let Some(t) = v.get("time").and_then(|t| t.as_str()) {
            return parse_rfc3339_utc(t);
        }
        if let Some(n) = v.as_u64() {
            return Some(n.saturating_mul(1000));
        }
    }
    parse_rfc3339_utc(body)
}

/// `YYYY-MM-DDTHH:MM:SS[.frac]Z` → unix ms (UTC only).
fn parse_rfc3339_utc(s: &str) -> Option<u64> {
    let s = s.trim().strip_suffix('Z').or_else(|| s.trim().strip_suffix("+00:00"))?;
    let (date, time) = s.split_once(['T', ' '])?;
    let mut d = date.split('-').map(|x| x.parse::<i64>().ok());
    let (y, m, day) = (d.next()??, d.next()??, d.next()??);
    let time = time.split('.').next()?;
    let mut t = time.split(':').map(|x| x.parse::<i64>().ok());
    let (hh, mm, ss) = (t.next()??, t.next()??, t.next()??);
    if !(1..=12).contains(&m) || !(1..=31).contains(&day) || hh > 23 || mm > 59 || ss > 60 {
        return None;
    }
    // Days from civil (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = if y >= 0 { y } else { y - 399 } / 400;
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hh * 3600 + mm * 60 + ss;
    u64::try_from(secs).ok().map(|s| s * 1000)
}

/// Drain deadline for a notice: until the termination time minus `margin`, else `fallback`.
pub fn deadline_for(notice_unix_ms: Option<u64>, now_ms: u64, margin: Duration, fallback: Duration) -> Duration {
    match notice_unix_ms {
        Some(t) => Duration::from_millis(t.saturating_sub(now_ms)).saturating_sub(margin),
        None => fallback,
    }
}

async fn poll_once(agent: &Agent, client: &reqwest::Client) -> Option<Option<u64>> {
    if let Some(url) = &agent.cfg.spot_notice_url {
        if let Ok(resp) = client.get(url).send().await {
            if resp.status().is_success() {
                let body = resp.text().await.unwrap_or_default();
                return Some(parse_termination_time(&body));
            }
        }
    }
    if let Some(path) = &agent.cfg.spot_notice_file {
        if let Ok(body) = tokio::fs::read_to_string(path).await {
            return Some(parse_termination_time(&body));
        }
    }
    None
}

/// Polls the configured notice sources once a second until a notice starts the drain or
/// `shutdown` is cancelled. Does nothing when no source is configured.
pub async fn watch(agent: Arc<Agent>, shutdown: CancellationToken) {
    if agent.cfg.spot_notice_url.is_none() && agent.cfg.spot_notice_file.is_none() {
        return;
    }
    let client = match reqwest::Client::builder().timeout(Duration::from_millis(800)).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "spot-notice watcher disabled: HTTP client failed");
            return;
        }
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        if let Some(notice) = poll_once(&agent, &client).await {
            let deadline = deadline_for(notice, unix_ms(), agent.cfg.drain_margin, agent.cfg.sigterm_drain);
            tracing::warn!(deadline_ms = deadline.as_millis() as u64, "spot termination notice: draining");
            agent.drain(deadline, "spot termination notice", DrainSource::SpotNotice);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_aws_and_plain_times() {
        // 2017-09-18T08:22:00Z = 1505722920 s.
        let aws = r#"{"action": "terminate", "time": "2017-09-18T08:22:00Z"}"#;
        assert_eq!(parse_termination_time(aws), Some(1_505_722_920_000));
        assert_eq!(parse_termination_time("2017-09-18T08:22:00.123Z"), Some(1_505_722_920_000));
        assert_eq!(parse_termination_time("1505722920"), Some(1_505_722_920_000));
        assert_eq!(parse_termination_time("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(parse_termination_time("TRUE"), None);
        assert_eq!(parse_termination_time(""), None);
    }

    #[test]
    fn deadline_keeps_margin_and_falls_back() {
        let m = Duration::from_secs(2);
        let f = Duration::from_secs(25);
        assert_eq!(deadline_for(Some(10_000), 0, m, f), Duration::from_secs(8));
        assert_eq!(deadline_for(Some(1_000), 5_000, m, f), Duration::ZERO);
        assert_eq!(deadline_for(None, 0, m, f), f);
    }
}
