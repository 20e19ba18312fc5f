//! Closed-loop streaming load: clients that send greedy requests one after the other until
//! stopped, every stream compared with an undisturbed reference run (tokens, usage and
//! finish reason), and the report of what the clients saw.

use super::generate::{PROMPTS, StreamResult, greedy_request, stream};
use anyhow::{Result, bail};
use prism_common::proto::v1::FinishReason;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Outcome of a load run.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// Streams that completed with the reference tokens.
    pub ok: usize,
    /// Client-visible errors.
    pub errors: Vec<String>,
    /// Streams that differ from the reference: tokens, usage or finish reason (prompt
    /// index, description).
    pub mismatches: Vec<(usize, String)>,
    /// Every result (prompt index, stream).
    pub results: Vec<(usize, StreamResult)>,
}

impl LoadReport {
    /// Largest inter-token gap of the streams that were running at `t`.
    pub fn max_gap_around(&self, t: Instant) -> Duration {
        self.results
            .iter()
            .filter(|(_, r)| r.started.is_some_and(|s| s <= t) && r.ended.is_some_and(|e| e >= t))
            .map(|(_, r)| r.max_gap)
            .max()
            .unwrap_or_default()
    }

    /// Largest inter-token gap over every stream.
    pub fn max_gap(&self) -> Duration {
        self.results.iter().map(|(_, r)| r.max_gap).max().unwrap_or_default()
    }

    /// Fails when a stream erred or differed from the reference.
    ///
    /// # Errors
    /// Describes the first failures.
    pub fn check(&self) -> Result<()> {
        if !self.errors.is_empty() || !self.mismatches.is_empty() {
            bail!(
                "{} ok, {} errors {:?}, {} mismatches {:?}",
                self.ok,
                self.errors.len(),
                self.errors.iter().take(5).collect::<Vec<_>>(),
                self.mismatches.len(),
                self.mismatches.iter().take(2).collect::<Vec<_>>()
            );
        }
        Ok(())
    }
}

/// Closed-loop streaming clients, each sending greedy requests for [`PROMPTS`] in turn (EOS
/// ignored) until stopped; every stream is compared with the reference.
pub struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    report: Arc<Mutex<LoadReport>>,
}

impl Load {
    /// Starts `clients` clients against the router at `grpc`; `reference[i]` is the
    /// expected output of `PROMPTS[i]` at `max_tokens` (from [`crate::reference`]).
    pub fn start(grpc: &str, clients: usize, max_tokens: u32, reference: Arc<Vec<Vec<u32>>>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let report = Arc::new(Mutex::new(LoadReport::default()));
        let tasks = (0..clients)
            .map(|c| {
                let (grpc, stop, report, reference) =
                    (grpc.to_owned(), stop.clone(), report.clone(), reference.clone());
                tokio::spawn(async move {
                    let mut i = c;
                    while !stop.load(Ordering::SeqCst) {
                        let p = i % PROMPTS.len();
                        i += 1;
                        let res = stream(&grpc, greedy_request(PROMPTS[p], max_tokens, true)).await;
                        let Ok(mut rep) = report.lock() else { return };
                        match res {
                            // Usage and finish_reason describe the whole request, also after a migration.
                            Ok(r)
                                if r.tokens == reference[p]
                                    && r.completion_tokens == max_tokens
                                    && r.prompt_tokens as usize == PROMPTS[p].len()
                                    && r.finish == FinishReason::Length as i32 =>
                            {
                                rep.ok += 1;
                                rep.results.push((p, r));
                            }
                            Ok(r) => {
                                let what = format!(
                                    "tokens {:?} (expected {:?}), usage {}+{}, finish {}",
                                    r.tokens, reference[p], r.prompt_tokens, r.completion_tokens, r.finish
                                );
                                rep.mismatches.push((p, what));
                                rep.results.push((p, r));
                            }
                            Err(e) => rep.errors.push(format!("{e:#}")),
                        }
                    }
                })
            })
            .collect();
        Self { stop, tasks, report }
    }

    /// Streams finished so far (ok + failed).
    pub fn finished(&self) -> usize {
        self.report.lock().map(|r| r.ok + r.errors.len() + r.mismatches.len()).unwrap_or(0)
    }

    /// Waits until at least `n` more streams than now have finished.
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_more(&self, n: usize, timeout: Duration) -> Result<()> {
        let target = self.finished() + n;
        crate::wait::wait_until(timeout, "load progress", || std::future::ready(self.finished() >= target)).await
    }

    /// Stops the clients after their current stream and returns the report.
    ///
    /// # Errors
    /// When a client task panicked.
    pub async fn stop(self) -> Result<LoadReport> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.tasks {
            t.await?;
        }
        let mut r = self.report.lock().map_err(|_| anyhow::anyhow!("poisoned"))?;
        Ok(std::mem::take(&mut *r))
    }
}
