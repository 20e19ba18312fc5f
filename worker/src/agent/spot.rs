//! Spot-termination notice poller: polls an HTTP endpoint (as cloud metadata services
//! expose, e.g. AWS `spot/instance-action`, which answers 404 until a notice exists) or a
//! file once a second until a notice appears. The drain deadline is taken from the
//! termination time in the notice (minus the drain margin) or is the SIGTERM deadline;
//! `agent/drain.rs` reacts to the notice.

use crate::config::WorkerConfig;
use std::path::PathBuf;
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

/// A spot-termination notice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpotNotice {
    /// The termination time the notice names (unix ms), when it names one.
    pub termination_unix_ms: Option<u64>,
}

/// Where spot notices are looked for, and the drain deadline they leave.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NoticeWatch {
    /// HTTP endpoint polled (`--spot-notice-url`): a notice exists once it answers 2xx.
    pub url: Option<String>,
    /// File polled (`--spot-notice-file`): a notice exists once it can be read.
    pub file: Option<PathBuf>,
    /// Kept between the end of the drain and the termination time (`--drain-margin`).
    pub drain_margin: Duration,
    /// Drain deadline when the notice names no time (the SIGTERM drain deadline).
    pub fallback_deadline: Duration,
}

impl NoticeWatch {
    /// The sources and deadlines configured for this worker.
    pub fn from_config(cfg: &WorkerConfig) -> Self {
        Self {
            url: cfg.spot_notice_url.clone(),
            file: cfg.spot_notice_file.clone(),
            drain_margin: cfg.drain_margin,
            fallback_deadline: cfg.sigterm_drain,
        }
    }

    /// Whether no notice source is configured (nothing to poll).
    pub fn is_disabled(&self) -> bool {
        self.url.is_none() && self.file.is_none()
    }

    /// The drain deadline for `notice` at `now_ms` (see [`deadline_for`]).
    pub fn drain_deadline(&self, notice: SpotNotice, now_ms: u64) -> Duration {
        deadline_for(notice.termination_unix_ms, now_ms, self.drain_margin, self.fallback_deadline)
    }

    async fn poll_once(&self, client: &reqwest::Client) -> Option<SpotNotice> {
        if let Some(url) = &self.url
            && let Ok(resp) = client.get(url).send().await
            && resp.status().is_success()
        {
            let body = resp.text().await.unwrap_or_default();
            return Some(SpotNotice { termination_unix_ms: parse_termination_time(&body) });
        }
        if let Some(path) = &self.file
            && let Ok(body) = tokio::fs::read_to_string(path).await
        {
            return Some(SpotNotice { termination_unix_ms: parse_termination_time(&body) });
        }
        None
    }

    /// Polls the configured sources once a second until a notice appears (returned) or
    /// `stop` is cancelled (`None`). Returns `None` at once when no source is configured.
    pub async fn wait(&self, stop: &CancellationToken) -> Option<SpotNotice> {
        if self.is_disabled() {
            return None;
        }
        let client = match reqwest::Client::builder().timeout(Duration::from_millis(800)).build() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "spot-notice watcher disabled: HTTP client failed");
                return None;
            }
        };
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = tick.tick() => {}
            }
            if let Some(notice) = self.poll_once(&client).await {
                return Some(notice);
            }
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

    #[tokio::test]
    async fn file_notice_is_seen_and_sets_the_deadline() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("notice");
        let watch = NoticeWatch {
            url: None,
            file: Some(file.clone()),
            drain_margin: Duration::from_secs(2),
            fallback_deadline: Duration::from_secs(25),
        };
        std::fs::write(&file, r#"{"action": "terminate", "time": "1970-01-01T00:00:10Z"}"#).expect("write notice");
        let stop = CancellationToken::new();
        let notice = tokio::time::timeout(Duration::from_secs(5), watch.wait(&stop)).await.expect("seen within 5 s");
        assert_eq!(notice, Some(SpotNotice { termination_unix_ms: Some(10_000) }));
        assert_eq!(watch.drain_deadline(SpotNotice { termination_unix_ms: Some(10_000) }, 0), Duration::from_secs(8));
        assert_eq!(watch.drain_deadline(SpotNotice { termination_unix_ms: None }, 0), Duration::from_secs(25));
    }

    #[tokio::test]
    async fn no_source_or_stop_means_no_notice() {
        let stop = CancellationToken::new();
        assert_eq!(NoticeWatch::default().wait(&stop).await, None, "nothing configured: returns at once");
        let dir = tempfile::tempdir().expect("temp dir");
        let watch = NoticeWatch { file: Some(dir.path().join("absent")), ..NoticeWatch::default() };
        stop.cancel();
        let r = tokio::time::timeout(Duration::from_secs(5), watch.wait(&stop)).await.expect("stops at once");
        assert_eq!(r, None);
    }
}
