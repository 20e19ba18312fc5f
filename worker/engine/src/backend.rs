//! The backend contract: one forward step of the model over a flattened batch, with the
//! KV cache held by the backend in paged blocks (vLLM's model-runner / attention-backend
//! split). The scheduler owns block *bookkeeping* (`BlockPool`, `BlockTable`); the backend
//! owns block *memory*: per layer, K and V of shape `[num_blocks, block_size, num_kv_heads,
//! head_dim]`. A token at position `p` of a sequence lives in slot
//! `block_table[p / block_size] * block_size + p % block_size`.
//!
//! Implementations: `cpu` (f32 reference, all cores) and `cuda` (bf16, feature `cuda`).
//!
//! [`StepControl`] lets the engine stop a forward pass that is already running (a replica
//! declared failed or shut down must release its cores at once, not after a step of
//! minutes) and lets backends report progress inside a long step, so that a slow but
//! advancing step is not mistaken for a frozen one.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Why a replica's engine was told to stop (see [`StepControl::request_stop`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopKind {
    /// Orderly shutdown: requests end with finish_reason `abort`.
    Shutdown,
    /// The replica failed (stalled, declared dead by its agent): streams end without a
    /// finish reason so callers retry or migrate them.
    Fail,
}

#[derive(Debug)]
struct ControlInner {
    /// 0 = run, 1 = [`StopKind::Shutdown`], 2 = [`StopKind::Fail`].
    stop: AtomicU8,
    epoch: Instant,
    /// Nanoseconds after `epoch` of the last progress mark.
    last_progress_ns: AtomicU64,
}

/// Cooperative cancellation and progress of one replica's steps: a cheap `Clone` shared by
/// the handle, the step loop and the backend. Backends call [`StepControl::checkpoint`]
/// between layers (a few atomic operations): it records progress and fails with
/// [`BackendError::Cancelled`] once a stop was requested, so an interrupted forward pass
/// returns within one layer's time.
#[derive(Clone, Debug)]
pub struct StepControl(Arc<ControlInner>);

impl Default for StepControl {
    fn default() -> Self {
        Self(Arc::new(ControlInner {
            stop: AtomicU8::new(0),
            epoch: Instant::now(),
            last_progress_ns: AtomicU64::new(0),
        }))
    }
}

impl StepControl {
    /// Asks the running step (if any) and the step loop to stop. The first request wins:
    /// a later one does not change its kind.
    pub fn request_stop(&self, kind: StopKind) {
        let v = match kind {
            StopKind::Shutdown => 1,
            StopKind::Fail => 2,
        };
        let _ = self.0.stop.compare_exchange(0, v, Ordering::SeqCst, Ordering::SeqCst);
    }

    /// The stop requested, if any.
    pub fn stop_requested(&self) -> Option<StopKind> {
        match self.0.stop.load(Ordering::SeqCst) {
            0 => None,
            1 => Some(StopKind::Shutdown),
            _ => Some(StopKind::Fail),
        }
    }

    /// Records progress now (a layer, a step, or an idle tick).
    pub fn mark_progress(&self) {
        let ns = u64::try_from(self.0.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.0.last_progress_ns.fetch_max(ns, Ordering::Relaxed);
    }

    /// When progress was last recorded (the control's creation before the first mark).
    pub fn last_progress(&self) -> Instant {
        self.0.epoch + Duration::from_nanos(self.0.last_progress_ns.load(Ordering::Relaxed))
    }

    /// Called by backends between layers: records progress.
    ///
    /// # Errors
    /// [`BackendError::Cancelled`] once a stop was requested.
    pub fn checkpoint(&self) -> Result<(), BackendError> {
        if self.stop_requested().is_some() {
            return Err(BackendError::Cancelled);
        }
        self.mark_progress();
        Ok(())
    }
}

/// Per-sequence part of a step (vLLM's varlen layout).
#[derive(Clone, Debug)]
pub struct SeqStep {
    /// Offset of this sequence's first query token in [`StepBatch::token_ids`].
    pub query_start: usize,
    /// Query tokens this step (prompt chunk length for prefill, 1 for decode).
    pub query_len: usize,
    /// Tokens in the cache for this sequence after this step's tokens are written
    /// (= position of the last query token + 1). Attention covers `0..context_len`, causal.
    pub context_len: usize,
    /// Physical block ids covering positions `0..context_len`.
    pub block_table: Vec<u32>,
    /// Whether logits are needed for this sequence's last query token (false for
    /// non-final prefill chunks).
    pub want_logits: bool,
}

/// One forward step over a batch of sequences, flattened to `num_tokens` tokens.
#[derive(Clone, Debug, Default)]
pub struct StepBatch {
    /// `[num_tokens]` input token ids.
    pub token_ids: Vec<u32>,
    /// `[num_tokens]` absolute positions (RoPE).
    pub positions: Vec<u32>,
    /// `[num_tokens]` KV-cache slot of each token (`block * block_size + offset`).
    pub slot_mapping: Vec<u32>,
    /// Sequences in the batch, in order of `query_start`.
    pub seqs: Vec<SeqStep>,
}

/// Logits of the sequences that asked for them, in batch order: row-major
/// `[rows, vocab_size]` f32.
#[derive(Clone, Debug, Default)]
pub struct Logits {
    /// Number of rows (sequences with `want_logits`).
    pub rows: usize,
    /// Vocabulary size (row length).
    pub vocab_size: usize,
    /// `rows * vocab_size` values.
    pub data: Vec<f32>,
}

impl StepBatch {
    /// Checks the batch against a backend's cache geometry (shared by every backend):
    /// equal-length token/position/slot arrays, token ids `< vocab`, slots and block ids in
    /// range, sequences tiling the tokens in order with `query_len` in `1..=context_len`,
    /// block tables covering `context_len`, positions `context_len - query_len + i`.
    /// Returns the number of logit rows (sequences with `want_logits`).
    ///
    /// # Errors
    /// [`BackendError::InvalidBatch`] naming the first violation.
    pub fn validate(&self, vocab: usize, num_blocks: usize, block_size: usize) -> Result<usize, BackendError> {
        let invalid = |m: &str| BackendError::InvalidBatch(m.to_owned());
        let n = self.token_ids.len();
        if self.positions.len() != n || self.slot_mapping.len() != n {
            return Err(invalid("token_ids, positions and slot_mapping differ in length"));
        }
        if let Some(&id) = self.token_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(BackendError::InvalidBatch(format!("token id {id} >= vocab {vocab}")));
        }
        if self.slot_mapping.iter().any(|&s| s as usize >= num_blocks * block_size) {
            return Err(invalid("slot out of range"));
        }
        let (mut next, mut rows) = (0, 0);
        for s in &self.seqs {
            if s.query_start != next || s.query_len == 0 || s.query_len > s.context_len {
                return Err(invalid("sequences must tile the batch in order with query_len in 1..=context_len"));
            }
            next += s.query_len;
            if next > n || s.block_table.len() * block_size < s.context_len {
                return Err(invalid("block table does not cover context_len"));
            }
            if s.block_table.iter().any(|&blk| blk as usize >= num_blocks) {
                return Err(invalid("block id out of range"));
            }
            for i in 0..s.query_len {
                if self.positions[s.query_start + i] as usize != s.context_len - s.query_len + i {
                    return Err(invalid("positions must be context_len - query_len + i"));
                }
            }
            rows += usize::from(s.want_logits);
        }
        if next != n {
            return Err(invalid("sequences do not cover every token"));
        }
        Ok(rows)
    }
}

impl Logits {
    /// Row `i` (`vocab_size` values). Panics if `i >= rows` (caller bug, not input-derived).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab_size..(i + 1) * self.vocab_size]
    }
}

/// One additive change to a logit: `logits[row][token] += value` (`-inf` bans the token).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitEdit {
    /// Logit row (batch order of the rows with `want_logits`).
    pub row: u32,
    /// Token id.
    pub token: u32,
    /// Added value (`logit_bias`, or -inf for a banned token).
    pub value: f32,
}

/// Per-row changes to a step's logits before a token is chosen (grammar masks,
/// `logit_bias`, `min_tokens`), the same rule on the host and on a device: edits are added
/// first, then every token outside a row's mask becomes -inf.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LogitConstraints {
    /// u32 words per mask: `ceil(vocab / 32)`; bit `t % 32` of word `t / 32` set = allowed.
    pub mask_words: usize,
    /// The masks, `mask_words` words each.
    pub masks: Vec<u32>,
    /// Per logit row: index of its mask in `masks`, -1 = unmasked; empty = no row masked.
    pub mask_of_row: Vec<i32>,
    /// Additive edits (several may name one logit: they add up).
    pub edits: Vec<LogitEdit>,
}

impl LogitConstraints {
    /// Whether nothing changes.
    pub fn is_empty(&self) -> bool {
        self.masks.is_empty() && self.edits.is_empty()
    }

    /// Row `row`'s mask, if it has one.
    pub fn mask(&self, row: usize) -> Option<&[u32]> {
        let m = usize::try_from(*self.mask_of_row.get(row)?).ok()?;
        self.masks.get(m * self.mask_words..(m + 1) * self.mask_words)
    }

    /// Applies the edits and masks to host logits (ids outside `0..vocab_size` ignored).
    pub fn apply(&self, logits: &mut Logits) {
        let vocab = logits.vocab_size;
        for e in &self.edits {
            if (e.row as usize) < logits.rows && (e.token as usize) < vocab {
                logits.data[e.row as usize * vocab + e.token as usize] += e.value;
            }
        }
        for row in 0..logits.rows {
            if let Some(mask) = self.mask(row) {
                apply_mask(&mut logits.data[row * vocab..(row + 1) * vocab], mask);
            }
        }
    }
}

/// Sets every logit whose bit in `mask` is clear (or beyond it) to -inf.
fn apply_mask(row: &mut [f32], mask: &[u32]) {
    for (w, chunk) in row.chunks_mut(32).enumerate() {
        match mask.get(w).copied().unwrap_or(0) {
            u32::MAX => {}
            0 => chunk.fill(f32::NEG_INFINITY),
            bits => {
                for (b, l) in chunk.iter_mut().enumerate() {
                    if bits & (1 << b) == 0 {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
        }
    }
}

/// Backend failures (a failed step fails the whole replica's in-flight requests).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Device or kernel failure.
    #[error("device error: {0}")]
    Device(String),
    /// A CUDA device, kernel or library failure.
    #[cfg(feature = "cuda")]
    #[error("device error: {0}")]
    Cuda(#[from] cuda::error::CudaError),
    /// The batch is inconsistent with the cache (scheduler bug).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    /// The step was interrupted because the engine is stopping ([`StepControl`]); the KV
    /// of the interrupted step is garbage and the engine does not run another one.
    #[error("cancelled: the engine is stopping")]
    Cancelled,
}

/// A model loaded on a device with its paged KV cache, ready to run steps.
/// Runs on the engine thread only (`Send`, not `Sync`).
pub trait Backend: Send {
    /// Runs one forward step: writes the K/V of every token into its slot, attends over
    /// each sequence's cached context (causal) and returns logits for the sequences
    /// with `want_logits`.
    ///
    /// # Errors
    /// `BackendError::Device` on device failure; `InvalidBatch` on inconsistent input.
    fn forward(&mut self, batch: &StepBatch) -> Result<Logits, BackendError>;

    /// Whether [`Backend::forward_greedy`] is cheaper than [`Backend::forward`] (the argmax
    /// runs on the device and the logits never reach the host). The step loop uses it only
    /// then, and only for steps whose every logit row belongs to a plain-greedy sequence
    /// (`Sampler::is_plain_greedy`). Default: `false`.
    fn has_device_greedy(&self) -> bool {
        false
    }

    /// Runs one step exactly as [`Backend::forward`] (same K/V writes, same logits) and
    /// returns, per logit row in batch order, the index of the largest logit: NaN skipped,
    /// ties to the lowest id, 0 when every value is NaN or -inf (`sampler::argmax`'s
    /// rule). The default runs `forward` and takes the argmax on the
    /// host; backends with [`Backend::has_device_greedy`] copy back only `rows × 4` bytes.
    ///
    /// # Errors
    /// As [`Backend::forward`].
    fn forward_greedy(&mut self, batch: &StepBatch) -> Result<Vec<u32>, BackendError> {
        let logits = self.forward(batch)?;
        Ok((0..logits.rows).map(|r| crate::sampler::argmax(logits.row(r))).collect())
    }

    /// [`Backend::forward_greedy`] with per-row logit changes: `constraints` is called once
    /// the forward is under way (a device backend calls it after enqueueing the forward, so
    /// the grammar masks computed meanwhile on the host overlap it) and its result applied as
    /// [`LogitConstraints::apply`] does before the argmax. The default runs `forward`,
    /// applies them on the host and takes the argmax there.
    ///
    /// # Errors
    /// As [`Backend::forward`].
    fn forward_greedy_constrained(
        &mut self,
        batch: &StepBatch,
        constraints: &mut dyn FnMut() -> LogitConstraints,
    ) -> Result<Vec<u32>, BackendError> {
        let mut logits = self.forward(batch)?;
        constraints().apply(&mut logits);
        Ok((0..logits.rows).map(|r| crate::sampler::argmax(logits.row(r))).collect())
    }

    /// Number of KV-cache blocks allocated.
    fn num_kv_blocks(&self) -> usize;

    /// Tokens per block.
    fn block_size(&self) -> usize;

    /// Bytes of KV cache one token uses across all layers (K and V).
    fn kv_bytes_per_token(&self) -> usize;

    /// The sliding window every layer of the model has, when it has one: the scheduler then
    /// frees KV blocks that fall wholly out of it ([`crate::scheduler::Scheduler::with_sliding_window`]).
    /// Default `None` (keep every block).
    fn kv_sliding_window(&self) -> Option<usize> {
        None
    }

    /// Short backend name for logs and metrics ("cpu", "cuda").
    fn name(&self) -> &'static str;
}
