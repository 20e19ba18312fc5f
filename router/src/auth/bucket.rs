//! A token bucket: the per-key limits' state (requests per second, tokens per minute).

use std::time::Instant;

use crate::admission::queue::{MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S};

/// `capacity` units that refill at `rate` per second; a take may drive the level below zero
/// (a request larger than the whole bucket passes when the bucket is full, then pays it off).
#[derive(Debug)]
pub struct Bucket {
    level: f64,
    capacity: f64,
    rate: f64,
    at: Instant,
}

impl Bucket {
    /// A full bucket of `capacity` refilling at `rate` per second (both > 0).
    pub fn new(capacity: f64, rate: f64, now: Instant) -> Self {
        Self { level: capacity, capacity, rate, at: now }
    }

    /// Takes `cost` units, or returns the whole seconds until it could (`Retry-After`,
    /// clamped to the admission queue's 1..=60).
    pub fn take(&mut self, cost: f64, now: Instant) -> Result<(), u32> {
        self.refill(now);
        let need = cost.min(self.capacity);
        if self.level >= need {
            self.level -= cost;
            return Ok(());
        }
        let secs = (need - self.level) / self.rate;
        // Clamped first, so the cast is exact.
        Err(secs.ceil().clamp(f64::from(MIN_RETRY_AFTER_S), f64::from(MAX_RETRY_AFTER_S)) as u32)
    }

    /// Gives back `cost` units taken earlier (a request refused after its take), up to the
    /// capacity.
    pub fn refund(&mut self, cost: f64, now: Instant) {
        self.refill(now);
        self.level = (self.level + cost).min(self.capacity);
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + elapsed * self.rate).min(self.capacity);
        self.at = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn refills_at_its_rate_and_names_the_wait() {
        let t0 = Instant::now();
        let mut b = Bucket::new(2.0, 2.0, t0);
        assert_eq!((b.take(1.0, t0), b.take(1.0, t0)), (Ok(()), Ok(())));
        assert_eq!(b.take(1.0, t0), Err(1), "0.5 s to the next request rounds up to 1 s");
        assert_eq!(b.take(1.0, t0 + Duration::from_millis(500)), Ok(()));
        // 600 tokens/min = 10/s: 300 missing tokens are 30 s away.
        let mut t = Bucket::new(600.0, 10.0, t0);
        assert_eq!(t.take(500.0, t0), Ok(()));
        assert_eq!(t.take(400.0, t0), Err(30));
        // Larger than the bucket: passes once when full, then the debt is paid off.
        let mut big = Bucket::new(100.0, 10.0, t0);
        assert_eq!(big.take(150.0, t0), Ok(()));
        assert_eq!(big.take(1.0, t0), Err(6));
        assert_eq!(big.take(1.0, t0 + Duration::from_secs(6)), Ok(()));
        // A refund restores what was taken, never past the capacity.
        let mut r = Bucket::new(100.0, 10.0, t0);
        assert_eq!(r.take(150.0, t0), Ok(()));
        r.refund(150.0, t0);
        assert_eq!(r.take(100.0, t0), Ok(()));
        r.refund(500.0, t0);
        assert_eq!((r.take(100.0, t0), r.take(1.0, t0)), (Ok(()), Err(1)));
    }
}
