//! What both transports share: the per-request options and the [`Timeline`] that turns the
//! arrival times of a stream's token-bearing messages into a [`Record`].

use crate::bench::stats::Record;
use std::time::{Duration, Instant};

/// Request fields common to every request of a run.
#[derive(Debug, Clone)]
pub struct RequestOptions {
    /// Served model name.
    pub model: String,
    /// Sampling temperature (0 = greedy).
    pub temperature: f32,
    /// Keep generating past EOS, so every request generates its `max_tokens`.
    pub ignore_eos: bool,
    /// Sent as `authorization: Bearer KEY` (HTTP header, gRPC metadata).
    pub api_key: Option<String>,
}

/// Arrival times of one request's stream.
#[derive(Debug)]
pub struct Timeline {
    start: Instant,
    first: Option<Instant>,
    last: Option<Instant>,
    itl: Vec<Duration>,
    chunks: usize,
}

impl Timeline {
    /// Starts the clock (call just before sending).
    pub fn start() -> Self {
        Self { start: Instant::now(), first: None, last: None, itl: Vec::new(), chunks: 0 }
    }

    /// A message carrying new tokens arrived now.
    pub fn token_chunk(&mut self) {
        let now = Instant::now();
        match self.last {
            Some(last) => self.itl.push(now - last),
            None => self.first = Some(now),
        }
        self.last = Some(now);
        self.chunks += 1;
    }

    /// The stream ended now. `output_tokens` is the server's count when it sent one (else the
    /// number of token-bearing messages); a stream without any token has TTFT = E2E latency.
    pub fn finish(self, prompt_tokens: usize, output_tokens: Option<usize>) -> Record {
        let e2el = self.start.elapsed();
        Record {
            prompt_tokens,
            output_tokens: output_tokens.unwrap_or(self.chunks),
            cached_tokens: None,
            ttft: self.first.map_or(e2el, |f| f - self.start),
            itl: self.itl,
            e2el,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_gaps_and_counts() {
        let mut t = Timeline::start();
        std::thread::sleep(Duration::from_millis(5));
        t.token_chunk();
        std::thread::sleep(Duration::from_millis(5));
        t.token_chunk();
        t.token_chunk();
        let r = t.finish(7, None);
        assert_eq!((r.prompt_tokens, r.output_tokens), (7, 3));
        assert!(r.ttft >= Duration::from_millis(5) && r.ttft <= r.e2el);
        assert_eq!(r.itl.len(), 2);
        assert!(r.itl[0] >= Duration::from_millis(5));
        let empty = Timeline::start().finish(1, Some(0));
        assert_eq!(empty.ttft, empty.e2el);
    }
}
