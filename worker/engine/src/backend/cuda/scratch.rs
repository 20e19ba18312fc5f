//! Per-step device memory of one shard: the activations of a step of up to `max_tokens` tokens
//! and `max_rows` logit rows, the attention partials of the split-KV kernel, and the step's
//! metadata (token ids, positions, slots, block tables) uploaded in one copy before the step
//! runs. Every address is fixed between steps, so a captured CUDA graph replays with new
//! metadata written to the same place.

use super::device::{DevBuf, Gpu};
use super::error::CudaError;
use super::options::Dims;
use crate::backend::StepBatch;

/// Most blocks the greedy argmax splits one logit row over (`argmax_rows`).
pub(crate) const ARGMAX_MAX_SPLITS: usize = 64;
/// Bytes of the attention partial buffer; larger steps are split into several launches.
const PART_BYTES: usize = 64 << 20;
/// u32 entries of the metadata buffer beyond the per-token ones, for block tables (it grows
/// when a step needs more).
const META_SPARE: usize = 65_536;

/// Per-step activations (sized for `max_tokens` rows) and the step's metadata buffer.
pub(crate) struct Scratch {
    pub max_tokens: usize,
    pub max_rows: usize,
    /// f32 `[T, hidden]` residual stream.
    pub x: DevBuf,
    /// bf16 `[T, hidden]` normed activations (also the last rows' normed states).
    pub hn: DevBuf,
    /// bf16 `[T, qkv_dim]`.
    pub qkv: DevBuf,
    /// bf16 `[T, q_dim]`.
    pub attn: DevBuf,
    /// bf16 `[T, hidden]` o_proj / down_proj output (added to `x` by the next norm).
    pub proj: DevBuf,
    /// bf16 `[T, 2·inter]`.
    pub gu: DevBuf,
    /// bf16 `[T, inter]`.
    pub act: DevBuf,
    /// f32 `[R, vocab]`.
    pub logits: DevBuf,
    /// u32 `[R]` greedy tokens.
    pub argmax: DevBuf,
    /// The split argmax's per-block partials: f32 values `[R, ARGMAX_MAX_SPLITS]`, then i32
    /// indices `[R, ARGMAX_MAX_SPLITS]`, then u32 `[R]` finished-block counts (zero between
    /// launches).
    pub argmax_part: DevBuf,
    /// u32 step metadata: ids, positions, slots, block-table offsets, logit rows, block tables.
    meta: DevBuf,
    /// f32 chunked-context attention partials (`[n, q_heads, chunks, head_dim + 2]`).
    pub part: DevBuf,
    /// Capacity of `part` in f32 values.
    pub part_cap: usize,
    /// f32 `[head_dim / 2]` RoPE inverse frequencies.
    pub inv_freq: DevBuf,
    host_meta: Vec<u32>,
}

/// Device addresses of one step's metadata (u32 arrays inside the metadata buffer).
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepPtrs {
    /// `[n]` token ids.
    pub ids: u64,
    /// `[n]` positions.
    pub pos: u64,
    /// `[n]` KV-cache slots (`u32::MAX`: padding, no write).
    pub slots: u64,
    /// `[n]` offset of each token's block table in `bts`.
    pub tok_bt: u64,
    /// `[rows]` the token whose logits each logit row takes.
    pub rows: u64,
    /// The sequences' block tables, concatenated.
    pub bts: u64,
}

/// What [`Scratch::upload_meta`] uploaded.
pub(crate) struct Uploaded {
    /// Where the metadata is.
    pub ptrs: StepPtrs,
    /// Logit rows of the step (sequences with `want_logits`).
    pub rows: usize,
    /// The metadata buffer moved (it grew): graphs captured before hold the old addresses.
    pub moved: bool,
}

impl Scratch {
    /// Allocates the buffers for steps of `max_tokens` tokens and `max_rows` logit rows and
    /// uploads the RoPE inverse frequencies.
    ///
    /// # Errors
    /// [`CudaError`] when an allocation or the copy fails.
    pub fn new(gpu: &Gpu, d: &Dims, max_tokens: usize, max_rows: usize, inv_freq: &[f32]) -> Result<Self, CudaError> {
        let (t, r) = (max_tokens, max_rows);
        let alloc = |bytes: usize| DevBuf::zeroed(gpu, bytes);
        let bf = 2usize;
        let s = Self {
            max_tokens: t,
            max_rows: r,
            x: alloc(t * d.hidden * 4)?,
            hn: alloc(t * d.hidden * bf)?,
            qkv: alloc(t * d.qkv_dim() * bf)?,
            attn: alloc(t * d.q_dim() * bf)?,
            proj: alloc(t * d.hidden * bf)?,
            gu: alloc(t * 2 * d.inter * bf)?,
            act: alloc(t * d.inter * bf)?,
            logits: alloc(r * d.vocab * 4)?,
            argmax: alloc(r * 4)?,
            argmax_part: alloc(r * (ARGMAX_MAX_SPLITS * 8 + 4))?,
            meta: alloc((4 * t + r + META_SPARE) * 4)?,
            part: alloc(PART_BYTES)?,
            part_cap: PART_BYTES / 4,
            inv_freq: alloc(inv_freq.len() * 4)?,
            host_meta: Vec::new(),
        };
        gpu.upload(&s.inv_freq, 0, inv_freq)?;
        Ok(s)
    }

    /// The split argmax's partial values, partial indices and per-row finished-block counts
    /// (device addresses inside `argmax_part`).
    pub fn argmax_partials(&self) -> (u64, u64, u64) {
        let per = (self.max_rows * ARGMAX_MAX_SPLITS * 4) as u64;
        let v = self.argmax_part.ptr;
        (v, v + per, v + 2 * per)
    }

    /// Uploads the step metadata, padded to `pad_to` tokens (padding: token 0 at position 0,
    /// no KV slot, the first sequence's block table, its own logit row).
    ///
    /// # Errors
    /// [`CudaError`] when growing the buffer or the copy fails.
    pub fn upload_meta(&mut self, gpu: &Gpu, b: &StepBatch, pad_to: usize) -> Result<Uploaded, CudaError> {
        let n = b.token_ids.len();
        let pad = pad_to.saturating_sub(n);
        let np = n + pad;
        let m = &mut self.host_meta;
        m.clear();
        m.extend_from_slice(&b.token_ids);
        m.extend(std::iter::repeat_n(0, pad));
        m.extend_from_slice(&b.positions);
        m.extend(std::iter::repeat_n(0, pad));
        m.extend_from_slice(&b.slot_mapping);
        m.extend(std::iter::repeat_n(u32::MAX, pad));
        let mut bt_off = 0u32;
        for s in &b.seqs {
            m.extend(std::iter::repeat_n(bt_off, s.query_len));
            bt_off += s.block_table.len() as u32;
        }
        m.extend(std::iter::repeat_n(0, pad));
        let rows_at = m.len();
        m.extend(b.seqs.iter().filter(|s| s.want_logits).map(|s| (s.query_start + s.query_len - 1) as u32));
        let rows = m.len() - rows_at;
        m.extend((n..np).map(|i| i as u32));
        let bts_at = m.len();
        for s in &b.seqs {
            m.extend_from_slice(&s.block_table);
        }
        let need = m.len() * 4;
        let moved = need > self.meta.bytes;
        if moved {
            gpu.sync()?;
            self.meta = DevBuf::zeroed(gpu, need * 2)?;
        }
        gpu.upload(&self.meta, 0, &self.host_meta)?;
        let base = self.meta.ptr;
        let at = |i: usize| base + (i * 4) as u64;
        let ptrs = StepPtrs {
            ids: at(0),
            pos: at(np),
            slots: at(2 * np),
            tok_bt: at(3 * np),
            rows: at(rows_at),
            bts: at(bts_at),
        };
        Ok(Uploaded { ptrs, rows, moved })
    }
}
