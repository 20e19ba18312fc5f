//! Per-sequence token constraints of the step loop: a grammar [`Matcher`] (structured
//! outputs), `logit_bias` and `min_tokens`, turned each step into one
//! [`LogitConstraints`] for the step's logit rows, applied before penalties, temperature,
//! top-k/top-p and the draw (on the host, or in a backend's device argmax).
//!
//! Grammar masks are computed on the replica's compute pool while the forward pass runs:
//! [`StepMasks::start`] moves each constrained row's matcher into a pool job before the
//! forward, [`StepMasks::join`] takes the masks (and the matchers back) once the logits are
//! ready. The token sampled in a step is consumed by the matcher at the start of the next
//! step's job ([`SeqConstraint::defer`]), so no grammar work runs serially on the step
//! thread between two forwards; a grammar that this token completes is reported by that job
//! ([`RowMask::done`]) and its sequence then ends with `stop` without using the step's row.
//! EOS and stop token ids are allowed exactly when the grammar may end (EOS not under
//! `ignore_eos`), and never before `min_tokens` tokens were generated.

use super::backend::{LogitConstraints, LogitEdit};
use super::request::EngineError;
use llguidance::Matcher;
use rayon::iter::{IntoParallelIterator, ParallelIterator};
use std::sync::Arc;
use std::sync::mpsc;

/// What constrains one sequence's tokens (absent for free sequences: they pay nothing).
pub(crate) struct SeqConstraint {
    /// The grammar's state; `None` without a grammar, and while a step's mask job holds it.
    pub matcher: Option<Box<Matcher>>,
    /// A sampled token the matcher has not consumed yet (the next mask job consumes it).
    pub pending: Option<u32>,
    /// Whether the sequence has a grammar (its matcher may be out in a mask job).
    pub grammar: bool,
    /// `(token, bias)` added to the logits every step (validated, unique tokens).
    pub logit_bias: Arc<[(u32, f32)]>,
    /// EOS and stop token ids are banned while fewer tokens were generated.
    pub min_tokens: usize,
    /// Ids that end the sequence: EOS (unless `ignore_eos`) and the stop token ids.
    pub enders: Arc<[u32]>,
    /// EOS ids and stop token ids (all of them, cleared in grammar masks first).
    pub end_ids: Arc<[u32]>,
    /// The token llguidance's masks use for "the grammar may end here".
    pub mask_eos: u32,
    /// The request field the grammar came from (`structured_output.<variant>`).
    pub field: &'static str,
}

impl std::fmt::Debug for SeqConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SeqConstraint")
            .field("grammar", &self.grammar)
            .field("logit_bias", &self.logit_bias.len())
            .field("min_tokens", &self.min_tokens)
            .finish_non_exhaustive()
    }
}

impl SeqConstraint {
    /// Whether this step's logits of a sequence that generated `generated` tokens need
    /// changes beyond its grammar mask.
    fn edits(&self, generated: usize) -> bool {
        !self.logit_bias.is_empty() || generated < self.min_tokens
    }

    /// Appends this row's additive edits: the biases, then -inf for the enders while
    /// `min_tokens` is not reached.
    pub fn push_edits(&self, row: u32, generated: usize, out: &mut Vec<LogitEdit>) {
        if !self.edits(generated) {
            return;
        }
        out.extend(self.logit_bias.iter().map(|&(token, value)| LogitEdit { row, token, value }));
        if generated < self.min_tokens {
            out.extend(self.end_ids.iter().map(|&token| LogitEdit { row, token, value: f32::NEG_INFINITY }));
        }
    }

    /// Advances the grammar over a sampled token that does not end the sequence, now (after
    /// any deferred token). Returns whether the grammar is complete (the sequence then
    /// finishes with reason `stop`).
    ///
    /// # Errors
    /// llguidance's message when the token leaves the grammar (a masking bug) or the
    /// matcher failed.
    pub fn advance(&mut self, token: u32) -> Result<bool, String> {
        let Some(m) = self.matcher.as_mut() else { return Ok(false) };
        for t in self.pending.take().into_iter().chain([token]) {
            m.consume_token(t).map_err(|e| format!("{e:#}"))?;
        }
        Ok(m.is_stopped())
    }

    /// The error that ends the sequence when its grammar failed mid-generation with
    /// llguidance's `message`: an `InvalidRequest` naming the grammar's field, as when it
    /// fails at compile time, since llguidance fails on the grammar's own limits (an Earley
    /// row over `max_items_in_row`, a mask over its fuel) reached on this sequence's path.
    pub fn failure(&self, message: &str) -> EngineError {
        let message = super::structured::llg_message(&message);
        EngineError::InvalidRequest {
            field: self.field,
            message: format!("the grammar failed during generation: {message}"),
        }
    }

    /// Leaves a sampled token that does not end the sequence to the next step's mask job
    /// (which consumes it before computing the mask). Returns whether the grammar is
    /// already complete: only when an earlier deferred token was still unconsumed, which is
    /// then consumed here.
    ///
    /// # Errors
    /// As [`SeqConstraint::advance`], for that earlier token.
    pub fn defer(&mut self, token: u32) -> Result<bool, String> {
        let Some(m) = self.matcher.as_mut() else { return Ok(false) };
        if let Some(prev) = self.pending.replace(token) {
            m.consume_token(prev).map_err(|e| format!("{e:#}"))?;
            if m.is_stopped() {
                self.pending = None;
                return Ok(true);
            }
        }
        Ok(false)
    }
}

/// One row's grammar mask job result.
pub(crate) struct RowMask {
    /// Logit row.
    pub row: usize,
    /// The matcher, returned to its sequence.
    pub matcher: Box<Matcher>,
    /// `mask_words` words (bit set = allowed), or why the mask failed.
    pub mask: Result<Vec<u32>, String>,
    /// The deferred token completed the grammar: the sequence ends with `stop` and its row of
    /// this step is not used (`mask` is then empty).
    pub done: bool,
}

/// The grammar masks of one step, computing on the compute pool.
pub(crate) struct StepMasks {
    rx: mpsc::Receiver<RowMask>,
    jobs: usize,
    mask_words: usize,
}

/// What a mask job needs besides the matcher.
pub(crate) struct MaskJob {
    /// Logit row.
    pub row: usize,
    /// The sequence's matcher (moved into the job and back).
    pub matcher: Box<Matcher>,
    /// The last step's token, consumed before the mask is computed.
    pub pending: Option<u32>,
    /// Ids that end the sequence (allowed when the grammar may end).
    pub enders: Arc<[u32]>,
    /// EOS and stop ids (cleared first).
    pub end_ids: Arc<[u32]>,
    /// The token llguidance's masks use for "may end here".
    pub mask_eos: u32,
}

impl StepMasks {
    /// Starts one job per constrained row on `pool`; masks cover `vocab` tokens (the
    /// tokenizer's vocabulary: logits beyond it are masked out). The calling thread hands
    /// the pool one task that fans the rows out (a spawn per row would wake the pool's
    /// threads one by one from the step thread, delaying the forward behind it).
    pub fn start(pool: &rayon::ThreadPool, jobs: Vec<MaskJob>, vocab: usize) -> Self {
        let (tx, rx) = mpsc::channel();
        let mask_words = vocab.div_ceil(32);
        let n = jobs.len();
        pool.spawn(move || {
            jobs.into_par_iter().for_each_with(tx, |tx, job| {
                let MaskJob { row, mut matcher, pending, enders, end_ids, mask_eos } = job;
                let (mask, done) = match pending.map(|t| matcher.consume_token(t)) {
                    Some(Err(e)) => (Err(format!("the grammar rejected a sampled token: {e:#}")), false),
                    Some(Ok(())) if matcher.is_stopped() && matcher.get_error().is_none() => (Ok(Vec::new()), true),
                    _ => (grammar_mask(&mut matcher, &enders, &end_ids, vocab, mask_words, mask_eos), false),
                };
                // The receiver is gone only when the step failed; the mask is not needed then.
                let _ = tx.send(RowMask { row, matcher, mask, done });
            });
        });
        Self { rx, jobs: n, mask_words }
    }

    /// u32 words per mask row.
    pub fn mask_words(&self) -> usize {
        self.mask_words
    }

    /// Waits for every job. A job that panicked is missing from the result (its sequence
    /// then has no matcher and is ended by the caller).
    pub fn join(self) -> Vec<RowMask> {
        let mut out = Vec::with_capacity(self.jobs);
        for _ in 0..self.jobs {
            match self.rx.recv() {
                Ok(m) => out.push(m),
                Err(_) => break,
            }
        }
        out
    }
}

/// The allowed tokens of `matcher`'s current state as `mask_words` words over `vocab`:
/// llguidance's mask with the enders allowed exactly when the grammar may end; tokens
/// beyond the tokenizer's vocabulary never allowed.
fn grammar_mask(
    matcher: &mut Matcher,
    enders: &[u32],
    end_ids: &[u32],
    vocab: usize,
    mask_words: usize,
    eos: u32,
) -> Result<Vec<u32>, String> {
    let mut words = vec![0u32; mask_words];
    let accepting = if matcher.is_stopped() {
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        true
    } else {
        let vob = matcher.compute_mask().map_err(|e| format!("{e:#}"))?;
        let trie_vocab = vob.len().min(vocab);
        let src = vob.as_slice();
        let full = trie_vocab / 32;
        words[..full].copy_from_slice(&src[..full]);
        if trie_vocab % 32 != 0 {
            words[full] = src[full] & ((1u32 << (trie_vocab % 32)) - 1);
        }
        let accepting = vob.is_allowed(eos);
        for &t in end_ids {
            set_bit(&mut words, t, false);
        }
        accepting
    };
    if accepting {
        for &t in enders {
            set_bit(&mut words, t, true);
        }
    }
    Ok(words)
}

fn set_bit(words: &mut [u32], token: u32, on: bool) {
    if let Some(w) = words.get_mut(token as usize / 32) {
        let bit = 1u32 << (token % 32);
        if on {
            *w |= bit;
        } else {
            *w &= !bit;
        }
    }
}

/// Builds the step's [`LogitConstraints`] from joined masks and the rows' edits.
pub(crate) fn assemble(rows: usize, mask_words: usize, masks: &[RowMask], edits: Vec<LogitEdit>) -> LogitConstraints {
    let mut c = LogitConstraints { mask_words, masks: Vec::new(), mask_of_row: vec![-1; rows], edits };
    for m in masks {
        if let Ok(words) = &m.mask
            && m.row < rows
            && !m.done
        {
            c.mask_of_row[m.row] = (c.masks.len() / mask_words.max(1)) as i32;
            c.masks.extend_from_slice(words);
        }
    }
    if c.masks.is_empty() {
        c.mask_of_row.clear();
    }
    c
}
