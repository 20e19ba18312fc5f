//! Paged decode attention on tensor cores (`kernels/attn_decode.cu`): one query token per row
//! attends over its sequence's block table up to its own position. Follows FlashDecoding (Dao,
//! Haziza, Massa, Sizov 2023: the context split across thread blocks, partials merged by their
//! log-sum-exp) with FlashAttention-2's in-register online softmax (Dao 2023) and FlashInfer's
//! treatment of GQA (Ye et al. 2024: the query heads of one KV head form the rows of a
//! tensor-core tile, so K/V are read once per group).
//!
//! Decode attention is bound by reading the KV cache. The kernel streams 64-position K/V tiles
//! into shared memory with 16-byte `cp.async` copies, double-buffered, and computes
//! `S = Q·Kᵀ` and `O += P·V` with `mma.m16n8k16` (bf16 in, f32 accumulate): rows are the
//! `G = q_heads / kv_heads` query heads (at most 8 of 16 rows used), so the arithmetic is
//! negligible and the loads stay in flight. Softmax and accumulation are f32; the output is bf16.
//!
//! With an FP8 (e4m3) cache ([`DecodeAttention::with_kv`]) the raw bytes stream the same way,
//! four tiles deep (three in flight while one is computed, half the bytes of a bf16 tile each),
//! and each warp builds its `mma` operands from them with the hardware e4m3 → f16 conversion
//! (exact); Q and P are rounded to f16 and the products run as f16 `mma`. The layouts that let
//! a warp read whole 16-byte rows of bytes instead of `ldmatrix` are in the kernel file's header.
//!
//! # Splits
//! A token with context `L = pos + 1` has `tiles = ceil(L / 64)` tiles, cut into
//! `splits = ceil(tiles / ceil(tiles / cap))` contiguous splits of equal tile count (the last
//! may be shorter), where `cap` (1..=[`MAX_SPLITS`]) is [`DecodeArgs::split_cap`]. Each split is
//! one thread block per (token, KV head); with more than one split, each writes f32 partials
//! `(max, sum, acc[head_dim])` and the block that finishes last (an atomic counter per token and
//! KV head, reset to zero by that block) merges them in split order and writes the output — no
//! second kernel. Because the split of a token depends only on its own `L` and `cap`, a constant
//! cap ([`INVARIANT_SPLIT_CAP`]) makes the result independent of the rest of the step (batch
//! invariance); [`DecodeAttention::occupancy_split_cap`] instead picks fewer splits for large
//! batches (fewer partials) and more for small ones (more blocks in flight).
//!
//! # CUDA graphs
//! The launch configuration depends only on `(n_tokens, max_ctx, split_cap)`: the grid is
//! `(grid_splits(max_ctx, cap), kv_heads, n_tokens)` blocks of 128 threads with 4·64·head_dim·2
//! bytes of dynamic shared memory (8·64·head_dim with an e4m3 cache). Per-step data (positions,
//! block tables) is read on the device, so a captured launch replays correctly with new metadata
//! at the same addresses. Tokens with fewer splits than the grid let the extra blocks exit at
//! once; a token with more splits than the grid (context above `max_ctx`) is still computed
//! correctly, by blocks that loop over several splits, only more slowly. Padding tokens
//! (position 0, a valid block table) are computed like any other.

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute_enum};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::device::{DevBuf, Gpu, nvrtc_include_paths};
use super::error::{CudaError, CudaResultExt};

/// The kernel's CUDA C source.
pub const ATTN_DECODE_SRC: &str = include_str!("kernels/attn_decode.cu");

/// Positions per tile (`DA_TILE` in the kernel file); splits are whole tiles.
pub const TILE: usize = 64;
/// Most splits of one token's context (`DA_MAX_SPLITS`); the partial buffers hold this many.
pub const MAX_SPLITS: usize = 16;
/// A split cap that does not depend on the step: with it the result of a token depends only on
/// its own context (batch invariance).
pub const INVARIANT_SPLIT_CAP: usize = MAX_SPLITS;
/// u64 words per block record of the `DA_TRACE` build (`DA_TRACE_WORDS`).
pub const TRACE_WORDS: usize = 9;
/// Threads per block (`DA_THREADS`).
const THREADS: u32 = 128;
/// Blocks per SM the kernel is built for (`DA_MIN_BLOCKS`, both cache types).
const BLOCKS_PER_SM: usize = 3;
/// K/V tiles in the shared-memory pipeline (`DA_STAGES`): bf16 and e4m3 caches.
const STAGES_BF16: usize = 2;
const STAGES_FP8: usize = 4;
/// Waves of blocks [`DecodeAttention::occupancy_split_cap`] aims for.
const TARGET_WAVES: usize = 4;

/// Attention head layout of the (local) model shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    /// Query heads.
    pub q_heads: usize,
    /// KV heads; `q_heads / kv_heads` must be 1, 2, 4 or 8.
    pub kv_heads: usize,
    /// Head dimension: 64, 128 or 256 (256: at most 4 query heads per KV head, 128 KiB of
    /// shared memory per block).
    pub head_dim: usize,
}

impl AttnShape {
    fn group(&self) -> usize {
        self.q_heads / self.kv_heads
    }
}

/// Device pointers and sizes of one launch (all pointers are raw device addresses).
#[derive(Clone, Copy, Debug)]
pub struct DecodeArgs {
    /// Tokens (rows) in this launch, at most the `max_tokens` given to [`DecodeAttention::new`].
    pub n_tokens: usize,
    /// Upper bound of every token's context `pos + 1` (the caller's context bucket); sizes the
    /// grid. A token above it is still correct, only slower.
    pub max_ctx: usize,
    /// Most splits per token, 1..=[`MAX_SPLITS`] (see the module docs).
    pub split_cap: usize,
    /// bf16 `[n_tokens, q_heads · head_dim]` output.
    pub out: u64,
    /// bf16 `[n_tokens, (q_heads + 2·kv_heads) · head_dim]` fused QKV rows (q already RoPE'd).
    pub qkv: u64,
    /// bf16 `[num_blocks, block_size, kv_heads, head_dim]` K cache of this layer.
    pub k_cache: u64,
    /// bf16 `[num_blocks, block_size, kv_heads, head_dim]` V cache of this layer.
    pub v_cache: u64,
    /// u32 `[n_tokens]` positions (context of token t is `pos[t] + 1` positions).
    pub pos: u64,
    /// u32 `[n_tokens]` offset into `bts` of each token's block table.
    pub tok_bt: u64,
    /// u32 concatenated block tables; each must cover positions `0..=pos[t]` with valid blocks.
    pub bts: u64,
    /// Positions per KV block.
    pub block_size: usize,
    /// Softmax scale, usually `1 / sqrt(head_dim)`.
    pub scale: f32,
}

/// Splits of a token with context `ctx` (positions) under `cap` (the kernel's `da_split`).
pub fn splits_for(ctx: usize, cap: usize) -> usize {
    let tiles = ctx.max(1).div_ceil(TILE);
    let per_split = tiles.div_ceil(cap.clamp(1, MAX_SPLITS));
    tiles.div_ceil(per_split)
}

/// Grid splits for contexts of at most `max_ctx`: the largest [`splits_for`] over `1..=max_ctx`.
pub fn grid_splits(max_ctx: usize, cap: usize) -> usize {
    max_ctx.max(1).div_ceil(TILE).min(cap.clamp(1, MAX_SPLITS))
}

/// The compiled decode-attention kernel for one head layout plus its scratch: f32 partials for
/// `max_tokens × q_heads × MAX_SPLITS` (head_dim + 2 values each) and one u32 counter per
/// (token, KV head).
pub struct DecodeAttention {
    f: CudaFunction,
    /// The module (its `da_trace` globals in the `DA_TRACE` build).
    module: std::sync::Arc<cudarc::driver::CudaModule>,
    shape: AttnShape,
    /// Dynamic shared memory per block, bytes.
    smem: usize,
    max_tokens: usize,
    num_sms: usize,
    /// Compute capability as `major · 10 + minor`.
    sm: u32,
    /// f32 `[max_tokens · kv_heads, MAX_SPLITS, G, head_dim]`.
    part_o: DevBuf,
    /// f32 `[max_tokens · kv_heads, MAX_SPLITS, G, 2]` (max in log2 units, sum).
    part_ml: DevBuf,
    /// u32 `[max_tokens · kv_heads]`, zero between launches.
    cnt: DevBuf,
}

impl DecodeAttention {
    /// Compiles `kernels/attn_decode.cu` for `shape` (only that instantiation) on `gpu` and
    /// allocates the scratch for launches of up to `max_tokens` tokens.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] when the device is older than sm_80 (no bf16 `mma`) or the
    /// shape is unsupported (head_dim 64/128 with 1/2/4/8 query heads per KV head, 256 with
    /// 1/2/4); [`CudaError`]
    /// when compilation or loading fails (also when the device cannot give a block the 128 KiB
    /// of shared memory head_dim 256 takes), or memory runs out.
    pub fn new(gpu: &Gpu, shape: AttnShape, max_tokens: usize) -> Result<Self, CudaError> {
        Self::with_kv(gpu, shape, max_tokens, false)
    }

    /// As [`DecodeAttention::new`]; `kv_fp8`: the caches hold e4m3 values (`KV_FP8` in the
    /// kernel file).
    ///
    /// # Errors
    /// As [`DecodeAttention::new`].
    pub fn with_kv(gpu: &Gpu, shape: AttnShape, max_tokens: usize, kv_fp8: bool) -> Result<Self, CudaError> {
        let sm: u32 = gpu.arch.trim_start_matches("sm_").parse().unwrap_or(0);
        if sm < 80 {
            return Err(CudaError::Unsupported(format!(
                "decode attention needs sm_80 or newer (device is {})",
                gpu.arch
            )));
        }
        let ok = shape.kv_heads > 0
            && shape.q_heads.is_multiple_of(shape.kv_heads)
            && match shape.head_dim {
                64 | 128 => matches!(shape.group(), 1 | 2 | 4 | 8),
                256 => matches!(shape.group(), 1 | 2 | 4),
                _ => false,
            };
        if !ok {
            return Err(CudaError::Unsupported(format!("decode attention does not support {shape:?}")));
        }
        let (hd, g) = (shape.head_dim, shape.group());
        // The decode trace (benchmarks), with the GEMVs' (`gemv.rs`).
        let trace = std::env::var("PRISM_GEMV_TRACE").is_ok_and(|v| v == "1");
        let opts = CompileOptions {
            arch: Some(gpu.arch),
            include_paths: nvrtc_include_paths(),
            options: [format!("-DDA_HD={hd}"), format!("-DDA_G={g}")]
                .into_iter()
                .chain(kv_fp8.then(|| "-DKV_FP8".to_owned()))
                .chain(trace.then(|| "-DDA_TRACE".to_owned()))
                .chain(
                    std::env::var("PRISM_ATTN_EARLY_DEPENDENTS")
                        .is_ok_and(|v| v == "1")
                        .then(|| "-DDA_EARLY_DEPENDENTS".to_owned()),
                )
                .collect(),
            ..Default::default()
        };
        let ptx = compile_ptx_with_opts(ATTN_DECODE_SRC, opts).op("NVRTC compile of attn_decode.cu")?;
        let module = gpu.ctx.load_module(ptx).op("load_module attn_decode")?;
        let f = module.load_function(&format!("attn_decode_hd{hd}_g{g}")).op("load attn_decode")?;
        let smem = Self::smem(hd, kv_fp8);
        f.set_attribute(CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem as i32)
            .op("attn_decode shared memory")?;
        let num_sms = gpu.ctx.attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).op("SM count")?;
        let max_tokens = max_tokens.max(1);
        let rows = max_tokens * shape.q_heads * MAX_SPLITS;
        Ok(Self {
            f,
            module,
            shape,
            smem,
            max_tokens,
            sm,
            num_sms: usize::try_from(num_sms).unwrap_or(1).max(1),
            part_o: DevBuf::zeroed(gpu, rows * hd * 4)?,
            part_ml: DevBuf::zeroed(gpu, rows * 2 * 4)?,
            cnt: DevBuf::zeroed(gpu, max_tokens * shape.kv_heads * 4)?,
        })
    }

    /// Dynamic shared memory per block: the pipeline's stages of a K and a V tile (2 bytes per
    /// value, 1 for e4m3).
    fn smem(head_dim: usize, kv_fp8: bool) -> usize {
        if kv_fp8 { STAGES_FP8 * 2 * TILE * head_dim } else { STAGES_BF16 * 2 * TILE * head_dim * 2 }
    }

    /// The head layout this instance was compiled for.
    pub fn shape(&self) -> AttnShape {
        self.shape
    }

    /// The `DA_TRACE` build's block records since the last call (the kernel file's `DA_TRACE`
    /// gives the [`TRACE_WORDS`] u64 of each), and resets them; empty without the trace build
    /// (`PRISM_GEMV_TRACE=1` at construction).
    ///
    /// # Errors
    /// [`CudaError`] when a copy fails.
    pub fn trace_take(&self, gpu: &Gpu) -> Result<Vec<u64>, CudaError> {
        let Ok(mut count) = self.module.get_global("da_trace_n", &gpu.stream) else { return Ok(Vec::new()) };
        let mut n = [0u8; 4];
        gpu.stream.memcpy_dtoh(&count, &mut n).op("attention trace count")?;
        let buf = self.module.get_global("da_trace", &gpu.stream).op("attention trace")?;
        let n = (u32::from_le_bytes(n) as usize).min(buf.len() / 8 / TRACE_WORDS);
        let mut words = vec![0u8; n * TRACE_WORDS * 8];
        if n > 0 {
            gpu.stream.memcpy_dtoh(&buf.slice(..words.len()), &mut words).op("attention trace records")?;
        }
        gpu.stream.memcpy_htod(&[0u8; 4], &mut count).op("attention trace reset")?;
        gpu.stream.synchronize().op("attention trace sync")?;
        Ok(words.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
    }

    /// Bytes of device scratch (partials and counters).
    pub fn scratch_bytes(&self) -> usize {
        self.part_o.bytes + self.part_ml.bytes + self.cnt.bytes
    }

    /// A split cap for `n_tokens` tokens that aims at about `TARGET_WAVES` waves of blocks on
    /// this device: many splits for small batches (latency), one for large ones (no partials).
    /// Depends on the step, so results then vary with the batch (use [`INVARIANT_SPLIT_CAP`]
    /// for batch invariance).
    /// `PRISM_ATTN_SPLIT_CAP` (1..=[`MAX_SPLITS`]) replaces it for every step (benchmarks).
    pub fn occupancy_split_cap(&self, n_tokens: usize) -> usize {
        static FIXED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        let fixed = FIXED.get_or_init(|| {
            std::env::var("PRISM_ATTN_SPLIT_CAP")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|c| (1..=MAX_SPLITS).contains(c))
        });
        if let Some(c) = *fixed {
            return c;
        }
        let want = TARGET_WAVES * BLOCKS_PER_SM * self.num_sms;
        want.div_ceil((n_tokens * self.shape.kv_heads).max(1)).clamp(1, MAX_SPLITS)
    }

    /// Enqueues the attention of `a.n_tokens` tokens on `gpu.stream`: no allocation, no host
    /// synchronisation, capturable in a CUDA graph. `n_tokens == 0` enqueues nothing.
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] when `n_tokens` exceeds `max_tokens` (or 65,535), the split
    /// cap is outside 1..=[`MAX_SPLITS`] or `block_size` is 0; [`CudaError`] on launch failure.
    pub fn launch(&self, gpu: &Gpu, a: &DecodeArgs) -> Result<(), CudaError> {
        self.launch_with(gpu, a, false)
    }

    /// As [`DecodeAttention::launch`]; `early`: launch with programmatic dependent launch
    /// (Hopper; ignored before sm_90), for a launch right behind a kernel that lets its
    /// dependents start early (the decode GEMVs do). Each block then reads the step metadata and
    /// block table and prefetches its first K/V tiles into L2 before it waits for that kernel
    /// (`griddepcontrol.wait`). Only what the host copied before the step (positions, block
    /// tables) is read so, and L2 (coherent for the whole device) is the only cache filled; the
    /// Q rows and K/V are read after the wait. Results are identical either way.
    /// `PRISM_ATTN_EARLY` (benchmarks): `0` plain launches, `1` the early launch without the
    /// prefetch, `2` (default) both.
    ///
    /// # Errors
    /// As [`DecodeAttention::launch`].
    pub fn launch_with(&self, gpu: &Gpu, a: &DecodeArgs, early: bool) -> Result<(), CudaError> {
        if a.n_tokens == 0 {
            return Ok(());
        }
        if a.n_tokens > self.max_tokens || a.n_tokens > 65_535 {
            return Err(CudaError::InvalidLaunch(format!(
                "decode attention: {} tokens > {} (scratch size)",
                a.n_tokens, self.max_tokens
            )));
        }
        if !(1..=MAX_SPLITS).contains(&a.split_cap) || a.block_size == 0 {
            return Err(CudaError::InvalidLaunch(format!(
                "decode attention: split_cap {} (1..={MAX_SPLITS}), block_size {}",
                a.split_cap, a.block_size
            )));
        }
        let s = self.shape;
        let cfg = LaunchConfig {
            grid_dim: (grid_splits(a.max_ctx, a.split_cap) as u32, s.kv_heads as u32, a.n_tokens as u32),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: self.smem as u32,
        };
        let (qh, kvh, bs, cap) = (s.q_heads as i32, s.kv_heads as i32, a.block_size as i32, a.split_cap as i32);
        // The kernel's `early`: 0 plain launch, 1 the wait only, 2 prefetch and wait.
        static MODE: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
        let mode = *MODE.get_or_init(|| {
            std::env::var("PRISM_ATTN_EARLY")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|m| (0..=2).contains(m))
                .unwrap_or(2)
        });
        let early_i: i32 = if early && self.sm >= 90 { mode } else { 0 };
        let early = early_i != 0;
        if early {
            use std::ffi::c_void;
            let p = |v: &u64| v as *const u64 as *mut c_void;
            let pi = |v: &i32| v as *const i32 as *mut c_void;
            let mut params: Vec<*mut c_void> = vec![
                p(&a.out),
                p(&self.part_o.ptr),
                p(&self.part_ml.ptr),
                p(&self.cnt.ptr),
                p(&a.qkv),
                p(&a.k_cache),
                p(&a.v_cache),
                p(&a.pos),
                p(&a.tok_bt),
                p(&a.bts),
                pi(&qh),
                pi(&kvh),
                pi(&bs),
                &a.scale as *const f32 as *mut c_void,
                pi(&cap),
                pi(&early_i),
            ];
            // SAFETY: `params` points at values that outlive the call, in the kernel's
            // parameter order and types; buffers as for the plain launch below.
            return unsafe { gpu.launch_programmatic(&self.f, cfg, &mut params) }.op("attn_decode");
        }
        let mut b = gpu.stream.launch_builder(&self.f);
        b.arg(&a.out).arg(&self.part_o.ptr).arg(&self.part_ml.ptr).arg(&self.cnt.ptr);
        b.arg(&a.qkv).arg(&a.k_cache).arg(&a.v_cache).arg(&a.pos).arg(&a.tok_bt).arg(&a.bts);
        b.arg(&qh).arg(&kvh).arg(&bs).arg(&a.scale).arg(&cap).arg(&early_i);
        // SAFETY: argument types match the kernel; the caller passes buffers of the documented
        // shapes whose block tables cover every token's context; the scratch holds n_tokens
        // (checked above) rows; shared memory matches the attribute set in `new`.
        unsafe { b.launch(cfg) }.map(|_| ()).op("attn_decode")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_follow_the_rule_and_the_grid_covers_them() {
        assert_eq!(splits_for(1, 16), 1);
        assert_eq!(splits_for(64, 16), 1);
        assert_eq!(splits_for(65, 16), 2);
        assert_eq!(splits_for(1024, 16), 16);
        assert_eq!(splits_for(1025, 16), 9);
        assert_eq!(splits_for(4096, 16), 16);
        assert_eq!(splits_for(4096, 1), 1);
        assert_eq!(splits_for(1024, 4), 4);
        for cap in 1..=MAX_SPLITS {
            let mut most = 0;
            for ctx in 1..=5000 {
                let s = splits_for(ctx, cap);
                assert!(s >= 1 && s <= cap);
                most = most.max(s);
                assert_eq!(most, grid_splits(ctx, cap), "ctx {ctx} cap {cap}");
            }
        }
    }
}
