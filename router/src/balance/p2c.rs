//! Power-of-two-choices (Mitzenmacher 2001): sample two distinct candidates at random and
//! take the less loaded one; equal loads fall to the random order of the sample.

use std::sync::Arc;

use rand::Rng;

use super::policy::{BalancePolicy, RequestHint, load_of};
use crate::routes::ReplicaRoute;

/// The default policy: P2C on [`load_of`] (tokens in flight from dispatch).
#[derive(Debug, Clone, Copy, Default)]
pub struct PowerOfTwoChoices;

impl BalancePolicy for PowerOfTwoChoices {
    fn pick(&self, candidates: &[&Arc<ReplicaRoute>], _hint: &RequestHint) -> usize {
        let n = candidates.len();
        if n <= 1 {
            return 0;
        }
        let mut rng = rand::rng();
        let a = rng.random_range(0..n);
        let mut b = rng.random_range(0..n - 1);
        if b >= a {
            b += 1;
        }
        if load_of(candidates[b]) < load_of(candidates[a]) { b } else { a }
    }
}
