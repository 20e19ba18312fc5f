//! The paged KV cache's memory on one device: per layer a K and a V buffer of bf16 (or e4m3,
//! `--kv-cache-dtype fp8`: twice the blocks in the same budget)
//! `[num_blocks, block_size, kv_heads, head_dim]`. Sized after the weights and the step scratch
//! are allocated, from an explicit byte budget or from `gpu_memory_utilization` (vLLM's rule:
//! `total · utilization − in use`, less a reserve for cuBLAS workspaces and the driver).

use super::device::{DevBuf, Gpu};
use super::error::CudaError;
use super::options::{CudaOptions, Dims, KvCacheDtype};

/// Bytes left for cuBLAS workspaces and the driver when the budget comes from
/// `gpu_memory_utilization`.
const RESERVE_BYTES: u64 = 256 << 20;

/// The K and V caches of every layer.
pub(crate) struct KvCache {
    /// Per layer: K, bf16 `[num_blocks, block_size, kv_heads, head_dim]`.
    pub k: Vec<DevBuf>,
    /// Per layer: V, same shape.
    pub v: Vec<DevBuf>,
    /// Blocks per layer.
    pub num_blocks: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Element type.
    pub dtype: KvCacheDtype,
}

impl KvCache {
    /// Bytes one token takes across all layers (K and V, `dtype` values).
    pub fn bytes_per_token(d: &Dims, dtype: KvCacheDtype) -> usize {
        d.layers * 2 * d.kv_dim() * dtype.bytes()
    }

    /// Allocates as many blocks of `opts.block_size` tokens as the budget holds.
    ///
    /// # Errors
    /// [`CudaError::InvalidOption`] (`block_size`) for a block size of 0 or
    /// (`gpu_memory_utilization`) when the budget holds no block; [`CudaError`] when the memory
    /// query or an allocation fails.
    pub fn allocate(gpu: &Gpu, d: &Dims, opts: &CudaOptions) -> Result<Self, CudaError> {
        if opts.block_size == 0 {
            return Err(CudaError::InvalidOption { field: "block_size", message: "block_size must be >= 1".into() });
        }
        let per_token = Self::bytes_per_token(d, opts.kv_cache_dtype);
        let per_block = per_token * opts.block_size;
        let (free, total) = gpu.mem_info()?;
        let budget = match opts.kv_cache_bytes {
            Some(b) => b,
            None => {
                let used = total - free;
                let allowed = (total as f64 * f64::from(opts.gpu_memory_utilization)) as u64;
                allowed.saturating_sub(used as u64).saturating_sub(RESERVE_BYTES)
            }
        };
        let num_blocks = usize::try_from(budget / per_block as u64).unwrap_or(usize::MAX);
        if num_blocks == 0 {
            return Err(CudaError::InvalidOption {
                field: "gpu_memory_utilization",
                message: format!(
                    "KV budget {budget} B holds no block of {} tokens ({per_token} B/token)",
                    opts.block_size
                ),
            });
        }
        let layer_bytes = num_blocks * opts.block_size * d.kv_dim() * opts.kv_cache_dtype.bytes();
        let mut k = Vec::with_capacity(d.layers);
        let mut v = Vec::with_capacity(d.layers);
        for _ in 0..d.layers {
            k.push(DevBuf::zeroed(gpu, layer_bytes)?);
            v.push(DevBuf::zeroed(gpu, layer_bytes)?);
        }
        Ok(Self { k, v, num_blocks, block_size: opts.block_size, dtype: opts.kv_cache_dtype })
    }

    /// Bytes of cache allocated.
    pub fn bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|b| b.bytes).sum()
    }
}
