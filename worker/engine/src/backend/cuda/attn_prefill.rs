//! Tensor-core causal GQA attention for prefill chunks over the paged KV cache: the
//! FlashAttention-2 forward pass (Dao 2023, "FlashAttention-2: Faster Attention with Better
//! Parallelism and Work Partitioning", Algorithm 1) on `mma.sync.m16n8k16` bf16 tensor-core
//! instructions, compiled by NVRTC from `kernels/attn_prefill.cu` as its own module.
//!
//! Work partition: the query tokens of each sequence are cut into tiles of
//! `64 / G` tokens (`G` = query heads per KV head); the 64 rows of a tile's Q block are the
//! (token, query head) pairs of one KV head, so the `G` heads that share a KV head share every
//! K/V tile read from the cache. One thread block (4 warps, 16 rows each) per (tile, KV head)
//! streams 64-position K/V tiles from position 0 up to the tile's last token through shared
//! memory (`cp.async`, double-buffered, gathered through the block table), computes
//! `S = Q·Kᵀ`, applies the causal mask, keeps an online softmax in f32 registers and
//! accumulates `O += P·V`; the output is `O / l` in bf16. Tiles are launched longest first
//! (the causal work of a tile grows with its position), so the short ones fill the last wave.
//!
//! Each token's reduction order depends only on its own position (K/V tiles aligned to
//! position 0, fully masked tiles are exact no-ops), so the result does not depend on how a
//! prompt is chunked or what else is in the step — the same property as the split-KV kernel of
//! `llama.cu`, though the two kernels round differently (their outputs agree to bf16 accuracy,
//! not bitwise).
//!
//! With an e4m3 cache ([`PrefillAttention::new_fp8_kv`]) the raw bytes of the next K/V tile are
//! copied with `cp.async` while the current one is widened to f16 in shared memory (exact) and
//! computed with f16 `mma`; Q and P are rounded to f16.
//!
//! The work list is built on the host per launch and copied to a device buffer sized for
//! `max_num_batched_tokens` (prefill steps are not captured in CUDA graphs); repeated launches
//! with the same sequences (one per layer) skip the copy.

use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::device::{DevBuf, Gpu, nvrtc_include_paths};
use super::error::{CudaError, CudaResultExt};

/// The kernels' CUDA C source.
pub const PREFILL_SRC: &str = include_str!("kernels/attn_prefill.cu");

/// Rows ((token, head) pairs) of a Q tile (`PF_BM`).
const TILE_ROWS: usize = 64;
/// K/V positions per tile (`PF_BN`).
const KV_TILE: usize = 64;
/// Threads per block (`PF_THREADS`).
const THREADS: u32 = 128;
/// u32 words per work-list entry (`PF_TILE_WORDS`).
const TILE_WORDS: usize = 8;
/// Head dimensions the kernels are instantiated for (`PF_KERNEL`).
const HEAD_DIMS: [usize; 3] = [64, 128, 256];

/// Dynamic shared memory of one block (`PF_SMEM_BYTES`): the Q tile and two stages of K and V.
fn smem_bytes(head_dim: usize) -> usize {
    (TILE_ROWS + 4 * KV_TILE) * head_dim * 2
}

/// One sequence's query tokens in the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillSeq {
    /// First row of the sequence's query tokens in the step (`qkv` / `out` row).
    pub query_start: usize,
    /// Query tokens in this step (their positions are `context_len − query_len ..
    /// context_len`); a sequence with 0 is skipped.
    pub query_len: usize,
    /// Tokens of the sequence in the cache after this step (≥ `query_len`).
    pub context_len: usize,
    /// Offset (in u32 entries) of the sequence's block table inside `bts`.
    pub bt_offset: usize,
}

/// Model and cache dimensions of one launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefillDims {
    /// Query heads.
    pub q_heads: usize,
    /// KV heads (`q_heads / kv_heads` ∈ {1, 2, 4, 8}; {1, 2, 4} at head_dim 256).
    pub kv_heads: usize,
    /// Head dimension, 64, 128 or 256.
    pub head_dim: usize,
    /// Tokens per KV-cache block.
    pub block_size: usize,
}

/// Device addresses of one launch.
#[derive(Clone, Copy, Debug)]
pub struct PrefillPtrs {
    /// bf16 `[T, q_heads · head_dim]` output; only the rows of the sequences' query tokens
    /// are written.
    pub out: u64,
    /// bf16 `[T, (q_heads + 2·kv_heads) · head_dim]` fused QKV rows, q already RoPE'd (only the
    /// q part is read).
    pub qkv: u64,
    /// bf16 `[num_blocks, block_size, kv_heads, head_dim]` K cache of the layer, holding every
    /// position `< context_len` of each sequence.
    pub k_cache: u64,
    /// bf16 V cache, as `k_cache`.
    pub v_cache: u64,
    /// u32 concatenated block tables (each covers `context_len.div_ceil(block_size)` blocks).
    pub bts: u64,
}

/// How the kernel builds its tensor-core operand fragments from shared memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FragmentLoads {
    /// `ldmatrix` (the fast path).
    #[default]
    Ldmatrix,
    /// Plain shared-memory loads written from the PTX fragment tables (slower; a cross-check of
    /// the `ldmatrix` addressing).
    Scalar,
}

/// The compiled prefill-attention kernels and the device work list.
pub struct PrefillAttention {
    /// By head_dim (64, 128, 256) and group (1, 2, 4, 8): index `hd_index * 4 + log2(group)`;
    /// `None` for head_dim 256 with 8 heads per KV head (not instantiated) and where the device
    /// cannot give a block the kernel's shared memory (head_dim 256 takes 160 KiB).
    kernels: Vec<Option<CudaFunction>>,
    /// u32 `[max_tiles, TILE_WORDS]` work list.
    work: DevBuf,
    max_tiles: usize,
    /// Work list of the current launch (host) and the one in `work` (skips repeated copies).
    host_work: Vec<u32>,
    uploaded: Vec<u32>,
    /// Which fragment loads the kernels were compiled with.
    pub fragments: FragmentLoads,
}

impl std::fmt::Debug for PrefillAttention {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillAttention")
            .field("max_tiles", &self.max_tiles)
            .field("fragments", &self.fragments)
            .finish_non_exhaustive()
    }
}

fn invalid(msg: impl Into<String>) -> CudaError {
    CudaError::InvalidLaunch(msg.into())
}

/// Whether `attn_prefill_hd{head_dim}_g{group}` exists (head_dim 256 stops at 4 heads per KV
/// head, as the split-KV kernel of `llama.cu`).
fn instantiated(head_dim: usize, group: usize) -> bool {
    matches!(group, 1 | 2 | 4 | 8) && (head_dim < 256 || group <= 4)
}

/// Checks the shapes the kernels support; returns the group size `q_heads / kv_heads`.
fn check_dims(d: &PrefillDims) -> Result<usize, CudaError> {
    if !matches!(d.head_dim, 64 | 128 | 256) {
        return Err(invalid(format!("prefill attention: head_dim {} (64, 128 or 256)", d.head_dim)));
    }
    if d.kv_heads == 0 || !d.q_heads.is_multiple_of(d.kv_heads) || !instantiated(d.head_dim, d.q_heads / d.kv_heads) {
        return Err(invalid(format!(
            "prefill attention: {} query heads / {} KV heads at head_dim {} (1, 2, 4 or 8 per KV head; 1, 2 or 4 \
             at 256)",
            d.q_heads, d.kv_heads, d.head_dim
        )));
    }
    if d.block_size == 0 {
        return Err(invalid("prefill attention: block_size 0"));
    }
    Ok(d.q_heads / d.kv_heads)
}

/// Appends the work list of `seqs` for group size `group` to `out` (cleared first):
/// `TILE_WORDS` u32 per tile `{query_start, query_len, context_len, bt_offset, tok0, ntok, 0, 0}`,
/// tiles of `TILE_ROWS / group` tokens, ordered by descending number of K/V tiles (stable).
///
/// # Errors
/// [`CudaError::InvalidLaunch`] when `query_len > context_len` or a value overflows u32.
pub fn build_work_list(seqs: &[PrefillSeq], group: usize, out: &mut Vec<u32>) -> Result<(), CudaError> {
    out.clear();
    let per_tile = (TILE_ROWS / group.max(1)).max(1);
    let u =
        |v: usize, what: &str| u32::try_from(v).map_err(|_| invalid(format!("prefill attention: {what} {v} > u32")));
    let mut tiles: Vec<(usize, [u32; TILE_WORDS])> = Vec::new();
    for s in seqs {
        if s.query_len == 0 {
            continue;
        }
        if s.query_len > s.context_len {
            return Err(invalid(format!(
                "prefill attention: query_len {} > context_len {}",
                s.query_len, s.context_len
            )));
        }
        let (qs, ql, cl, bo) = (
            u(s.query_start, "query_start")?,
            u(s.query_len, "query_len")?,
            u(s.context_len, "context_len")?,
            u(s.bt_offset, "bt_offset")?,
        );
        u(s.query_start + s.query_len, "query end")?;
        let first_pos = s.context_len - s.query_len;
        let mut tok0 = 0;
        while tok0 < s.query_len {
            let ntok = per_tile.min(s.query_len - tok0);
            let kv_tiles = (first_pos + tok0 + ntok).div_ceil(KV_TILE);
            tiles.push((kv_tiles, [qs, ql, cl, bo, tok0 as u32, ntok as u32, 0, 0]));
            tok0 += ntok;
        }
    }
    tiles.sort_by_key(|t| std::cmp::Reverse(t.0));
    out.extend(tiles.iter().flat_map(|t| t.1));
    Ok(())
}

impl PrefillAttention {
    /// Compiles the kernels for `gpu`'s architecture (ldmatrix fragments) and allocates a work
    /// list for steps of up to `max_num_batched_tokens` query tokens.
    ///
    /// # Errors
    /// [`CudaError`] when compilation, loading or allocation fails.
    pub fn new(gpu: &Gpu, max_num_batched_tokens: usize) -> Result<Self, CudaError> {
        Self::build(gpu, max_num_batched_tokens, FragmentLoads::Ldmatrix, false)
    }

    /// As [`PrefillAttention::new`] for an e4m3 KV cache (`KV_FP8` in the kernel file).
    ///
    /// # Errors
    /// As [`PrefillAttention::new`].
    pub fn new_fp8_kv(gpu: &Gpu, max_num_batched_tokens: usize) -> Result<Self, CudaError> {
        Self::build(gpu, max_num_batched_tokens, FragmentLoads::Ldmatrix, true)
    }

    /// As [`PrefillAttention::new`], choosing how operand fragments are loaded.
    ///
    /// # Errors
    /// As [`PrefillAttention::new`].
    pub fn with_fragments(
        gpu: &Gpu,
        max_num_batched_tokens: usize,
        fragments: FragmentLoads,
    ) -> Result<Self, CudaError> {
        Self::build(gpu, max_num_batched_tokens, fragments, false)
    }

    fn build(
        gpu: &Gpu,
        max_num_batched_tokens: usize,
        fragments: FragmentLoads,
        kv_fp8: bool,
    ) -> Result<Self, CudaError> {
        let mut src = match fragments {
            FragmentLoads::Ldmatrix => PREFILL_SRC.to_owned(),
            FragmentLoads::Scalar => format!("#define PF_SCALAR_FRAGS 1\n{PREFILL_SRC}"),
        };
        if kv_fp8 {
            src = format!("#define KV_FP8 1\n{src}");
        }
        let opts = CompileOptions { arch: Some(gpu.arch), include_paths: nvrtc_include_paths(), ..Default::default() };
        let ptx = compile_ptx_with_opts(src, opts).op("NVRTC compile of attn_prefill.cu")?;
        let module = gpu.ctx.load_module(ptx).op("load_module attn_prefill")?;
        let optin = gpu
            .ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .op("shared memory per block")?;
        let mut kernels = Vec::with_capacity(HEAD_DIMS.len() * 4);
        for hd in HEAD_DIMS {
            for g in [1, 2, 4, 8] {
                if !instantiated(hd, g) {
                    kernels.push(None);
                    continue;
                }
                let name = format!("attn_prefill_hd{hd}_g{g}");
                let f = module.load_function(&name).map_err(|e| CudaError::op(name.clone(), e))?;
                let smem = i32::try_from(smem_bytes(hd))
                    .map_err(|_| CudaError::Unsupported(format!("{name}: {} B shared memory", smem_bytes(hd))))?;
                if smem > optin {
                    // Left out on this device (head_dim 256 before sm_80's 163 KiB); `launch`
                    // refuses that head_dim.
                    kernels.push(None);
                    continue;
                }
                f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
                    .map_err(|e| CudaError::op(format!("{name}: {smem} B dynamic shared memory"), e))?;
                // Prefer the largest shared-memory carveout (two 80 KiB blocks per SM at hd 128).
                f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT, 100)
                    .map_err(|e| CudaError::op(format!("{name}: carveout"), e))?;
                kernels.push(Some(f));
            }
        }
        // Every tile holds at least one query token.
        let max_tiles = max_num_batched_tokens.max(1);
        let work = DevBuf::zeroed(gpu, max_tiles * TILE_WORDS * 4)?;
        Ok(Self { kernels, work, max_tiles, host_work: Vec::new(), uploaded: Vec::new(), fragments })
    }

    /// Most tiles one launch takes (= `max_num_batched_tokens`).
    pub fn max_tiles(&self) -> usize {
        self.max_tiles
    }

    /// Builds the work list of `seqs` and copies it to the device unless it equals the one
    /// already there; returns the number of tiles. [`PrefillAttention::launch`] calls it; calling
    /// it once per step before the first layer's kernels are enqueued keeps the (pageable,
    /// possibly host-blocking) copy out of the layer loop.
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] for unsupported dimensions, `query_len > context_len`
    /// or more tiles than `max_tiles`; [`CudaError`] when the copy fails.
    pub fn prepare(&mut self, gpu: &Gpu, seqs: &[PrefillSeq], dims: PrefillDims) -> Result<usize, CudaError> {
        let group = check_dims(&dims)?;
        build_work_list(seqs, group, &mut self.host_work)?;
        let tiles = self.host_work.len() / TILE_WORDS;
        if tiles > self.max_tiles {
            return Err(invalid(format!(
                "prefill attention: {tiles} tiles > {} (max_num_batched_tokens)",
                self.max_tiles
            )));
        }
        if tiles > 0 && self.host_work != self.uploaded {
            // Stream-ordered after earlier launches that read the old list.
            gpu.upload(&self.work, 0, &self.host_work)?;
            self.uploaded.clone_from(&self.host_work);
        }
        Ok(tiles)
    }

    /// Enqueues causal attention for the query tokens of `seqs` on `gpu.stream` (no host
    /// synchronisation): for each sequence, row `query_start + i` of `out` gets, for every
    /// query head, `softmax(scale · q·Kᵀ) · V` over positions `0 ..= context_len − query_len + i`
    /// of its block table. Copies the work list first unless it equals the previous one
    /// ([`PrefillAttention::prepare`]).
    ///
    /// # Errors
    /// As [`PrefillAttention::prepare`]; [`CudaError`] when the launch fails.
    pub fn launch(
        &mut self,
        gpu: &Gpu,
        seqs: &[PrefillSeq],
        ptrs: &PrefillPtrs,
        dims: PrefillDims,
        scale: f32,
    ) -> Result<(), CudaError> {
        let tiles = self.prepare(gpu, seqs, dims)?;
        if tiles == 0 {
            return Ok(());
        }
        let group = dims.q_heads / dims.kv_heads;
        let blocks = u32::try_from(tiles * dims.kv_heads).map_err(|_| invalid("prefill attention: grid too large"))?;
        let hd_index = HEAD_DIMS.iter().position(|&h| h == dims.head_dim).unwrap_or(0);
        let f = self.kernels[hd_index * 4 + group.trailing_zeros() as usize].as_ref().ok_or_else(|| {
            CudaError::Unsupported(format!(
                "prefill attention: head_dim {} needs {} B of shared memory per block, more than the device gives",
                dims.head_dim,
                smem_bytes(dims.head_dim)
            ))
        })?;
        let i = |v: usize| i32::try_from(v).map_err(|_| invalid(format!("prefill attention: {v} > i32")));
        let (qh, kvh, bs) = (i(dims.q_heads)?, i(dims.kv_heads)?, i(dims.block_size)?);
        let scale_log2 = scale * std::f32::consts::LOG2_E;
        let work = self.work.ptr;
        let mut b = gpu.stream.launch_builder(f);
        b.arg(&ptrs.out).arg(&ptrs.qkv).arg(&ptrs.k_cache).arg(&ptrs.v_cache).arg(&ptrs.bts).arg(&work);
        b.arg(&qh).arg(&kvh).arg(&bs).arg(&scale_log2);
        let cfg = LaunchConfig {
            grid_dim: (blocks, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: smem_bytes(dims.head_dim) as u32,
        };
        // SAFETY: argument types match the kernel; the work list is on the device (copied above,
        // stream-ordered); the caller passes buffers of the documented shapes whose block tables
        // cover every position < context_len with valid block ids.
        unsafe { b.launch(cfg) }.map(|_| ()).op("attn_prefill")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq(query_start: usize, query_len: usize, context_len: usize) -> PrefillSeq {
        PrefillSeq { query_start, query_len, context_len, bt_offset: 7 }
    }

    #[test]
    fn work_list_covers_every_token_once_longest_first() {
        let seqs = [seq(0, 100, 100), seq(100, 300, 1300), seq(400, 0, 5), seq(400, 1, 50)];
        let mut w = Vec::new();
        build_work_list(&seqs, 4, &mut w).unwrap();
        let tiles: Vec<&[u32]> = w.chunks(TILE_WORDS).collect();
        // 16 tokens per tile at G = 4: 7 + 19 + 1 tiles.
        assert_eq!(tiles.len(), 7 + 19 + 1);
        let kv = |t: &[u32]| ((t[2] - t[1] + t[4] + t[5]) as usize).div_ceil(KV_TILE);
        assert!(tiles.windows(2).all(|p| kv(p[0]) >= kv(p[1])));
        for s in seqs.iter().filter(|s| s.query_len > 0) {
            let mut covered: Vec<u32> = tiles
                .iter()
                .filter(|t| t[0] as usize == s.query_start && t[1] as usize == s.query_len)
                .flat_map(|t| t[4]..t[4] + t[5])
                .collect();
            covered.sort_unstable();
            assert_eq!(covered, (0..s.query_len as u32).collect::<Vec<_>>());
        }
        assert!(tiles.iter().all(|t| t[3] == 7 && t[5] as usize <= 16));
    }

    #[test]
    fn work_list_rejects_query_longer_than_context() {
        let mut w = Vec::new();
        assert!(build_work_list(&[seq(0, 5, 4)], 1, &mut w).is_err());
    }

    #[test]
    fn dims_checked() {
        let d = PrefillDims { q_heads: 32, kv_heads: 8, head_dim: 128, block_size: 16 };
        assert_eq!(check_dims(&d).unwrap(), 4);
        assert!(check_dims(&PrefillDims { head_dim: 96, ..d }).is_err());
        assert_eq!(check_dims(&PrefillDims { head_dim: 256, q_heads: 4, kv_heads: 1, ..d }).unwrap(), 4);
        assert!(check_dims(&PrefillDims { head_dim: 512, ..d }).is_err());
        assert!(check_dims(&PrefillDims { head_dim: 256, q_heads: 16, kv_heads: 2, ..d }).is_err());
        assert!(check_dims(&PrefillDims { q_heads: 48, ..d }).is_err());
        assert!(check_dims(&PrefillDims { block_size: 0, ..d }).is_err());
    }
}
