//! Per-sequence token sampling, following vLLM's sampler order: penalties (repetition over
//! prompt and output, frequency and presence over output), then temperature, top-k, top-p
//! (nucleus, Holtzman et al. 2020), min-p, and a draw from the per-sequence RNG. A
//! temperature below [`GREEDY_TEMPERATURE`] is greedy (argmax; ties go to the lowest id).
//!
//! Numerics: probabilities are computed in f64 after subtracting the maximum scaled logit,
//! so tiny temperatures and tiny top-p values can never produce NaN; NaN logits from a
//! backend are treated as -inf. Logprobs are those of the raw model distribution
//! (log-softmax of the unprocessed logits), as vLLM v1 returns by default.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Temperatures below this are treated as greedy decoding.
pub const GREEDY_TEMPERATURE: f32 = 1e-5;

/// Validated sampling settings of one sequence (see `request::SamplingParams`).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingConfig {
    /// Temperature (< [`GREEDY_TEMPERATURE`] = greedy).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 = all.
    pub top_k: usize,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// Minimum probability relative to the most likely token, in [0, 1].
    pub min_p: f32,
    /// CTRL repetition penalty (> 0, 1 = off).
    pub repetition_penalty: f32,
    /// OpenAI frequency penalty.
    pub frequency_penalty: f32,
    /// OpenAI presence penalty.
    pub presence_penalty: f32,
    /// Return the sampled token's logprob and this many top alternatives.
    pub logprobs: Option<usize>,
}

impl Default for SamplingConfig {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            logprobs: None,
        }
    }
}

/// A sampled token with its logprobs when requested.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The token id.
    pub token: u32,
    /// Its raw logprob (when logprobs were requested).
    pub logprob: Option<f32>,
    /// The top alternatives `(token, logprob)`, most likely first (when requested).
    pub top: Vec<(u32, f32)>,
}

/// Sampling state of one sequence: its RNG and the tokens it has seen.
#[derive(Debug)]
pub struct Sampler {
    cfg: SamplingConfig,
    rng: StdRng,
    /// Generated-token counts (frequency/presence penalties; repetition penalty).
    output_counts: HashMap<u32, u32>,
    /// Prompt tokens (repetition penalty only).
    prompt_tokens: Vec<u32>,
}

impl Sampler {
    /// A sampler seeded with `seed` (reproducible) or from the OS (when `None`).
    /// `prompt` and `prior_output` feed the penalties.
    pub fn new(cfg: SamplingConfig, seed: Option<u64>, prompt: &[u32], prior_output: &[u32]) -> Self {
        let rng = match seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_rng(&mut rand::rng()),
        };
        let prompt_tokens = if cfg.repetition_penalty != 1.0 { prompt.to_vec() } else { Vec::new() };
        let mut s = Self { cfg, rng, output_counts: HashMap::new(), prompt_tokens };
        for &t in prior_output {
            s.observe(t);
        }
        s
    }

    /// Records a generated token (penalties see it from the next draw on).
    pub fn observe(&mut self, token: u32) {
        *self.output_counts.entry(token).or_insert(0) += 1;
    }

    /// The settings.
    pub fn config(&self) -> &SamplingConfig {
        &self.cfg
    }

    /// Whether [`Sampler::sample`] of this sequence is a plain argmax of the raw logits, so a
    /// backend may pick the token on the device without returning the logits: greedy
    /// (temperature below [`GREEDY_TEMPERATURE`]; top-k/top-p/min-p do not matter then), no
    /// repetition/frequency/presence penalty and no logprobs. NaN logits are skipped and ties
    /// go to the lowest id, as in [`argmax`]; a device argmax must follow the same rule.
    pub fn is_plain_greedy(&self) -> bool {
        self.cfg.temperature < GREEDY_TEMPERATURE && !self.has_penalties() && self.cfg.logprobs.is_none()
    }

    /// Records a token chosen by a device argmax for a [`Sampler::is_plain_greedy`] sequence,
    /// returning what [`Sampler::sample`] would have returned for logits whose argmax is
    /// `token`. Greedy sampling draws no random number, so the RNG state stays as `sample`
    /// leaves it; the caller still calls [`Sampler::observe`] as for any sampled token.
    /// Debug builds assert the sequence is plain greedy (a caller bug otherwise).
    pub fn accept_greedy(&mut self, token: u32) -> Sampled {
        debug_assert!(self.is_plain_greedy(), "accept_greedy on a sequence that needs the logits");
        Sampled { token, logprob: None, top: Vec::new() }
    }

    fn has_penalties(&self) -> bool {
        self.cfg.repetition_penalty != 1.0 || self.cfg.frequency_penalty != 0.0 || self.cfg.presence_penalty != 0.0
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let rp = self.cfg.repetition_penalty;
        if rp != 1.0 {
            let mut seen: Vec<u32> = self.prompt_tokens.clone();
            seen.extend(self.output_counts.keys().copied());
            seen.sort_unstable();
            seen.dedup();
            for t in seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 { *l / rp } else { *l * rp };
                }
            }
        }
        for (&t, &c) in &self.output_counts {
            if let Some(l) = logits.get_mut(t as usize) {
                *l -= self.cfg.frequency_penalty * c as f32 + self.cfg.presence_penalty;
            }
        }
    }

    /// Draws the next token from one row of logits (`[vocab_size]`).
    pub fn sample(&mut self, logits: &[f32]) -> Sampled {
        let (logprob_k, lse) = match self.cfg.logprobs {
            Some(k) => (Some(k), log_sum_exp(logits)),
            None => (None, 0.0),
        };
        let token = if self.has_penalties() {
            let mut l = logits.to_vec();
            self.apply_penalties(&mut l);
            self.draw(&l)
        } else {
            self.draw(logits)
        };
        let (logprob, top) = match logprob_k {
            Some(k) => {
                let lp = |t: u32| (clean(logits[t as usize]) as f64 - lse) as f32;
                let top = top_indices(logits, k).into_iter().map(|t| (t, lp(t))).collect();
                (Some(lp(token)), top)
            }
            None => (None, Vec::new()),
        };
        Sampled { token, logprob, top }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        if self.cfg.temperature < GREEDY_TEMPERATURE {
            return argmax(logits);
        }
        let inv_t = 1.0 / self.cfg.temperature as f64;
        let mut cand: Vec<(u32, f64)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, clean(l) as f64)).collect();
        let k = self.cfg.top_k;
        if k > 0 && k < cand.len() {
            cand.select_nth_unstable_by(k - 1, |a, b| b.1.total_cmp(&a.1));
            cand.truncate(k);
        }
        let max = cand.iter().map(|c| c.1).fold(f64::NEG_INFINITY, f64::max);
        if !max.is_finite() {
            return argmax(logits);
        }
        for c in &mut cand {
            c.1 = ((c.1 - max) * inv_t).exp();
        }
        if self.cfg.top_p < 1.0 {
            cand.sort_unstable_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let total: f64 = cand.iter().map(|c| c.1).sum();
            let limit = self.cfg.top_p as f64 * total;
            let mut cum = 0.0;
            let mut keep = 0;
            for c in &cand {
                cum += c.1;
                keep += 1;
                if cum >= limit {
                    break;
                }
            }
            cand.truncate(keep.max(1));
        }
        if self.cfg.min_p > 0.0 {
            // After the max subtraction the most likely token has weight 1.
            let floor = self.cfg.min_p as f64;
            cand.retain(|c| c.1 >= floor);
        }
        let total: f64 = cand.iter().map(|c| c.1).sum();
        let mut u = self.rng.random::<f64>() * total;
        for c in &cand {
            if u < c.1 {
                return c.0;
            }
            u -= c.1;
        }
        cand.last().map_or_else(|| argmax(logits), |c| c.0)
    }
}

fn clean(l: f32) -> f32 {
    if l.is_nan() { f32::NEG_INFINITY } else { l }
}

/// Index of the largest logit (lowest index on ties, NaN ignored).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().map(clean).fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return 0.0;
    }
    let sum: f64 = logits.iter().map(|&l| (clean(l) as f64 - max).exp()).sum();
    max + sum.ln()
}

/// The `k` largest logits' indices, most likely first (lowest id on ties).
fn top_indices(logits: &[f32], k: usize) -> Vec<u32> {
    if k == 0 {
        return Vec::new();
    }
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let cmp = |a: &u32, b: &u32| clean(logits[*b as usize]).total_cmp(&clean(logits[*a as usize])).then(a.cmp(b));
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_unstable_by(cmp);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(t: f32) -> SamplingConfig {
        SamplingConfig { temperature: t, ..SamplingConfig::default() }
    }

    #[test]
    fn greedy_takes_argmax_and_ignores_nan() {
        let mut s = Sampler::new(cfg(0.0), None, &[], &[]);
        assert_eq!(s.sample(&[0.1, f32::NAN, 3.0, 3.0, -1.0]).token, 2);
        let mut s = Sampler::new(cfg(1e-7), None, &[], &[]);
        assert_eq!(s.sample(&[0.1, 5.0, 3.0]).token, 1);
    }

    #[test]
    fn tiny_temperature_and_top_p_never_nan() {
        let c = SamplingConfig { temperature: 1e-4, top_p: 1e-9, ..SamplingConfig::default() };
        let mut s = Sampler::new(c, Some(1), &[], &[]);
        for _ in 0..50 {
            assert_eq!(s.sample(&[1000.0, -1000.0, 999.9, 0.0]).token, 0);
        }
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_respects_top_k() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let c = SamplingConfig { temperature: 1.0, top_k: 5, ..SamplingConfig::default() };
        let draw = |seed| {
            let mut s = Sampler::new(c.clone(), Some(seed), &[], &[]);
            (0..64).map(|_| s.sample(&logits).token).collect::<Vec<_>>()
        };
        let a = draw(42);
        assert_eq!(a, draw(42));
        assert_ne!(a, draw(43));
        let top5 = top_indices(&logits, 5);
        assert!(a.iter().all(|t| top5.contains(t)), "{a:?} outside {top5:?}");
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(distinct.len() > 1, "temperature 1 should vary");
    }

    #[test]
    fn min_p_and_top_p_filter() {
        // probs ~ [0.5, 0.25, 0.125, 0.125]
        let l = [0.0f32, -std::f32::consts::LN_2, -2.0 * std::f32::consts::LN_2, -2.0 * std::f32::consts::LN_2];
        let c = SamplingConfig { temperature: 1.0, min_p: 0.6, ..SamplingConfig::default() };
        let mut s = Sampler::new(c, Some(3), &[], &[]);
        assert!((0..50).all(|_| s.sample(&l).token == 0));
        let c = SamplingConfig { temperature: 1.0, top_p: 0.7, ..SamplingConfig::default() };
        let mut s = Sampler::new(c, Some(3), &[], &[]);
        let got: std::collections::HashSet<u32> = (0..200).map(|_| s.sample(&l).token).collect();
        assert_eq!(got, [0, 1].into_iter().collect());
    }

    #[test]
    fn penalties_change_the_greedy_choice() {
        let l = [2.0f32, 1.9, 0.0];
        let c = SamplingConfig { presence_penalty: 0.5, ..SamplingConfig::default() };
        let mut s = Sampler::new(c, None, &[], &[0]);
        assert_eq!(s.sample(&l).token, 1);
        let c = SamplingConfig { repetition_penalty: 1.2, ..SamplingConfig::default() };
        let mut s = Sampler::new(c, None, &[0], &[]);
        assert_eq!(s.sample(&l).token, 1, "2.0/1.2 < 1.9");
        let c = SamplingConfig { frequency_penalty: 0.04, ..SamplingConfig::default() };
        let mut s = Sampler::new(c, None, &[], &[0, 0]);
        assert_eq!(s.sample(&l).token, 0, "2.0 - 0.08 > 1.9");
        s.observe(0);
        assert_eq!(s.sample(&l).token, 1, "2.0 - 0.12 < 1.9");
    }

    #[test]
    fn plain_greedy_is_exactly_argmax_and_accept_matches_sample() {
        let plain = |c: SamplingConfig| Sampler::new(c, Some(5), &[], &[]).is_plain_greedy();
        assert!(plain(cfg(0.0)));
        assert!(plain(SamplingConfig { temperature: 1e-7, top_k: 3, top_p: 0.5, min_p: 0.2, ..cfg(0.0) }));
        assert!(!plain(cfg(0.7)), "temperature");
        assert!(!plain(SamplingConfig { logprobs: Some(0), ..cfg(0.0) }), "logprobs");
        assert!(!plain(SamplingConfig { repetition_penalty: 1.1, ..cfg(0.0) }));
        assert!(!plain(SamplingConfig { frequency_penalty: 0.1, ..cfg(0.0) }));
        assert!(!plain(SamplingConfig { presence_penalty: -0.1, ..cfg(0.0) }));
        // The same rows through `sample` and through a host argmax + `accept_greedy`.
        let rows: [&[f32]; 4] =
            [&[0.1, f32::NAN, 3.0, 3.0], &[f32::NAN, f32::NAN], &[-1.0, -0.5], &[f32::NEG_INFINITY; 3]];
        let mut a = Sampler::new(cfg(0.0), Some(9), &[1, 2], &[3]);
        let mut b = Sampler::new(cfg(0.0), Some(9), &[1, 2], &[3]);
        for r in rows {
            let (x, y) = (a.sample(r), b.accept_greedy(argmax(r)));
            assert_eq!(x, y);
            a.observe(x.token);
            b.observe(y.token);
        }
    }

    #[test]
    fn logprobs_are_raw_log_softmax_with_top_n() {
        let l = [1.0f32, 3.0, 2.0];
        let c = SamplingConfig { logprobs: Some(2), ..SamplingConfig::default() };
        let mut s = Sampler::new(c, None, &[], &[]);
        let out = s.sample(&l);
        let lse = (1f64.exp() + 3f64.exp() + 2f64.exp()).ln();
        assert_eq!(out.token, 1);
        assert!((out.logprob.expect("requested") as f64 - (3.0 - lse)).abs() < 1e-6);
        assert_eq!(out.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((out.top[1].1 as f64 - (2.0 - lse)).abs() < 1e-6);
    }
}
