//! The backend contract: one forward step of the model over a flattened batch, with the
//! KV cache held by the backend in paged blocks (vLLM's model-runner / attention-backend
//! split). The scheduler owns block *bookkeeping* (`BlockPool`, `BlockTable`); the backend
//! owns block *memory*: per layer, K and V of shape `[num_blocks, block_size, num_kv_heads,
//! head_dim]`. A token at position `p` of a sequence lives in slot
//! `block_table[p / block_size] * block_size + p % block_size`.
//!
//! Implementations: `cpu` (f32 reference, all cores) and `cuda` (bf16, feature `cuda`).

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

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

impl Logits {
    /// Row `i` (`vocab_size` values). Panics if `i >= rows` (caller bug, not input-derived).
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab_size..(i + 1) * self.vocab_size]
    }
}

/// Backend failures (a failed step fails the whole replica's in-flight requests).
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// Device or kernel failure.
    #[error("device error: {0}")]
    Device(String),
    /// The batch is inconsistent with the cache (scheduler bug).
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
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

    /// Number of KV-cache blocks allocated.
    fn num_kv_blocks(&self) -> usize;

    /// Tokens per block.
    fn block_size(&self) -> usize;

    /// Bytes of KV cache one token uses across all layers (K and V).
    fn kv_bytes_per_token(&self) -> usize;

    /// Short backend name for logs and metrics ("cpu", "cuda").
    fn name(&self) -> &'static str;
}
