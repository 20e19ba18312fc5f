//! The device side of the CUDA backend: one context + stream per shard (cudarc 0.19, dynamic
//! loading), a cuBLAS handle on that stream, the NVRTC-compiled kernels of `kernels/llama.cu`,
//! raw device buffers ([`DevBuf`]: fixed addresses, so launches and a later CUDA-graph capture
//! take plain pointers) and the two launch shapes the model uses (GEMM, 1-D kernels).
//!
//! cudarc panics when a CUDA library is missing, so [`Gpu::new`] checks
//! `is_culib_present()` for the driver, cuBLAS and NVRTC first and returns an error instead.
//! Every call returns [`CudaError`] naming the operation that failed.

use std::sync::Arc;

use cudarc::cublas::{CudaBlas, result as blas_result, sys as blas_sys};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg, result, sys};
use cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};

use super::error::{CudaError, CudaResultExt};

/// The kernels' CUDA C source (bf16 storage, f32 math).
pub const KERNELS_SRC: &str = include_str!("kernels/llama.cu");

/// Include directories for NVRTC (the kernels include `cuda_bf16.h`, which ships with the CUDA
/// toolkit's headers, not with the driver or libnvrtc): the first of `$PRISM_CUDA_INCLUDE`,
/// `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include` that holds
/// `cuda_bf16.h` (else `/usr/local/cuda/include`, and NVRTC's error names the missing header).
pub fn nvrtc_include_paths() -> Vec<String> {
    let candidates = [
        std::env::var("PRISM_CUDA_INCLUDE").ok(),
        std::env::var("CUDA_HOME").ok().map(|h| format!("{h}/include")),
        std::env::var("CUDA_PATH").ok().map(|h| format!("{h}/include")),
    ];
    let dir = candidates
        .into_iter()
        .flatten()
        .find(|d| std::path::Path::new(d).join("cuda_bf16.h").is_file())
        .unwrap_or_else(|| "/usr/local/cuda/include".to_owned());
    vec![dir]
}

/// A device allocation with a fixed address (`cuMemAlloc`), freed on drop.
pub struct DevBuf {
    ctx: Arc<CudaContext>,
    /// Device address.
    pub ptr: u64,
    /// Size in bytes.
    pub bytes: usize,
}

impl DevBuf {
    /// Allocates `bytes` (at least 1) of device memory, zero-filled.
    ///
    /// # Errors
    /// [`CudaError`] when the device is out of memory.
    pub fn zeroed(gpu: &Gpu, bytes: usize) -> Result<Self, CudaError> {
        let bytes = bytes.max(1);
        gpu.ctx.bind_to_thread().op("bind context")?;
        // SAFETY: plain allocation in the bound context; freed exactly once in Drop.
        let ptr =
            unsafe { result::malloc_sync(bytes) }.map_err(|e| CudaError::op(format!("cuMemAlloc({bytes} B)"), e))?;
        let buf = Self { ctx: gpu.ctx.clone(), ptr, bytes };
        // SAFETY: `ptr` holds `bytes` bytes; the stream is the buffer's context's.
        unsafe { result::memset_d8_async(ptr, 0, bytes, gpu.stream.cu_stream()) }.op("memset")?;
        Ok(buf)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by cuMemAlloc in this context and not freed before. The
            // caller synchronises the stream before dropping buffers that kernels use.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// `(head_dim, query heads per KV head)` of the split-KV paged attention kernels of
/// `kernels/llama.cu`: head_dim 64 and 128 with 1, 2, 4 or 8 heads per KV head, 256 with 1, 2
/// or 4 (the kernel keeps `group · head_dim ≤ 1024` accumulators per warp in shared memory).
pub const SPLIT_KV_SHAPES: [(usize, usize); 11] =
    [(64, 1), (64, 2), (64, 4), (64, 8), (128, 1), (128, 2), (128, 4), (128, 8), (256, 1), (256, 2), (256, 4)];

/// Loaded kernels (names as in `kernels/llama.cu`).
pub struct Kernels {
    pub embed_gather: CudaFunction,
    pub add_rmsnorm: CudaFunction,
    pub rope_kv_write: CudaFunction,
    /// As `rope_kv_write` into e4m3 caches.
    pub rope_kv_write_fp8: CudaFunction,
    /// Paged attention `paged_attention_hd{hd}_g{group}`, in the order of
    /// [`SPLIT_KV_SHAPES`]; look one up with [`Kernels::attention_for`].
    pub attention: Vec<CudaFunction>,
    pub attn_combine: CudaFunction,
    pub silu_mul: CudaFunction,
    pub argmax_rows: CudaFunction,
    pub logit_edits: CudaFunction,
    pub fill_uniform: CudaFunction,
    pub fill_const: CudaFunction,
    pub count_neq_u16: CudaFunction,
    /// Model-family variants (see `kernels/llama.cu`): embedding scale, q/k/v bias and per-head
    /// q/k norm before RoPE, normed residual deltas, GeGLU, logit soft-capping.
    pub scale_f32: CudaFunction,
    pub qkv_prep_rope_kv_write: CudaFunction,
    pub add_normed_rmsnorm: CudaFunction,
    pub gelu_tanh_mul: CudaFunction,
    pub softcap_f32: CudaFunction,
}

impl Kernels {
    /// The split-KV paged attention kernel for `head_dim` and `group` query heads per KV head,
    /// or `None` when [`SPLIT_KV_SHAPES`] has no such kernel.
    pub fn attention_for(&self, head_dim: usize, group: usize) -> Option<&CudaFunction> {
        SPLIT_KV_SHAPES.iter().position(|&s| s == (head_dim, group)).map(|i| &self.attention[i])
    }
}

/// One GPU: context, stream, cuBLAS handle and kernels.
pub struct Gpu {
    /// The device's primary context.
    pub ctx: Arc<CudaContext>,
    /// The stream every launch of this shard goes to.
    pub stream: Arc<CudaStream>,
    /// cuBLAS on `stream`.
    pub blas: CudaBlas,
    /// NVRTC-compiled kernels.
    pub k: Kernels,
    /// Device name (e.g. "NVIDIA H200").
    pub name: String,
    /// `sm_XY` the kernels were compiled for.
    pub arch: &'static str,
}

fn arch_for(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (7, 0) => "sm_70",
        (7, 5) => "sm_75",
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        (m, _) if m >= 9 => "sm_90",
        _ => "sm_80",
    }
}

/// Whether the CUDA driver, cuBLAS and NVRTC libraries can be opened and a device exists.
pub fn cuda_available() -> bool {
    // SAFETY: these only try to open the shared libraries (no CUDA call is made).
    let present =
        unsafe { sys::is_culib_present() && blas_sys::is_culib_present() && cudarc::nvrtc::sys::is_culib_present() };
    present && result::init().is_ok() && result::device::get_count().map(|n| n > 0).unwrap_or(false)
}

impl Gpu {
    /// Launches `f` on this stream with programmatic dependent launch (Hopper and later): the
    /// grid may start while the previous kernel finishes; the kernel must execute
    /// `griddepcontrol.wait` before it reads anything the previous kernel writes.
    ///
    /// # Safety
    /// `params` points at the kernel's arguments in order, each of its parameter's type, alive
    /// for the call (the driver copies them); the buffers are as the kernel requires.
    pub unsafe fn launch_programmatic(
        &self,
        f: &CudaFunction,
        cfg: LaunchConfig,
        params: &mut [*mut std::ffi::c_void],
    ) -> Result<(), result::DriverError> {
        // SAFETY: a zeroed attribute is valid; we set its id and the matching union field.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let lc = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        // SAFETY: as the caller guarantees for `params`; `lc` and `attr` outlive the call.
        unsafe { sys::cuLaunchKernelEx(&lc, f.cu_function(), params.as_mut_ptr(), std::ptr::null_mut()) }.result()
    }

    /// Opens device `ordinal`, creates a stream and a cuBLAS handle, compiles and loads the kernels.
    ///
    /// # Errors
    /// [`CudaError::Unavailable`] when a library or the device is missing; [`CudaError`] when
    /// the context, stream or cuBLAS handle cannot be created or compilation fails.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        if !cuda_available() {
            return Err(CudaError::Unavailable("CUDA driver, cuBLAS or NVRTC not found, or no device"));
        }
        let ctx = CudaContext::new(ordinal).op("CudaContext::new")?;
        // SAFETY: one stream per shard and raw pointers everywhere: cudarc's per-buffer
        // event tracking is not used (it is disabled before any cudarc allocation).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().op("new_stream")?;
        let blas = CudaBlas::new(stream.clone()).op("cublas")?;
        let (major, minor) = ctx.compute_capability().op("compute_capability")?;
        let arch = arch_for(major, minor);
        let opts = CompileOptions { arch: Some(arch), include_paths: nvrtc_include_paths(), ..Default::default() };
        let ptx = compile_ptx_with_opts(KERNELS_SRC, opts).op("NVRTC compile of llama.cu")?;
        let module = ctx.load_module(ptx).op("load_module")?;
        let f = |name: &str| module.load_function(name).map_err(|e| CudaError::op(name.to_owned(), e));
        let k = Kernels {
            embed_gather: f("embed_gather")?,
            add_rmsnorm: f("add_rmsnorm")?,
            rope_kv_write: f("rope_kv_write")?,
            rope_kv_write_fp8: f("rope_kv_write_fp8")?,
            attention: SPLIT_KV_SHAPES
                .iter()
                .map(|(hd, g)| f(&format!("paged_attention_hd{hd}_g{g}")))
                .collect::<Result<_, _>>()?,
            attn_combine: f("attn_combine")?,
            silu_mul: f("silu_mul")?,
            argmax_rows: f("argmax_rows")?,
            logit_edits: f("logit_edits")?,
            fill_uniform: f("fill_uniform")?,
            fill_const: f("fill_const")?,
            count_neq_u16: f("count_neq_u16")?,
            scale_f32: f("scale_f32")?,
            qkv_prep_rope_kv_write: f("qkv_prep_rope_kv_write")?,
            add_normed_rmsnorm: f("add_normed_rmsnorm")?,
            gelu_tanh_mul: f("gelu_tanh_mul")?,
            softcap_f32: f("softcap_f32")?,
        };
        let name = ctx.name().unwrap_or_else(|_| "cuda".into());
        Ok(Self { ctx, stream, blas, k, name, arch })
    }

    /// Binds the context to the calling thread (the engine thread differs from the loader's).
    ///
    /// # Errors
    /// [`CudaError`] on driver failure.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().op("bind context")
    }

    /// `(free, total)` device memory in bytes.
    ///
    /// # Errors
    /// [`CudaError`] on driver failure.
    pub fn mem_info(&self) -> Result<(usize, usize), CudaError> {
        self.bind()?;
        result::mem_get_info().op("cuMemGetInfo")
    }

    /// Copies `src` to device address `dst` (stream-ordered).
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] when the copy overflows `dst`; [`CudaError`] on driver
    /// failure.
    pub fn upload<T>(&self, dst: &DevBuf, offset_bytes: usize, src: &[T]) -> Result<(), CudaError> {
        let len = std::mem::size_of_val(src);
        if offset_bytes + len > dst.bytes {
            return Err(CudaError::InvalidLaunch(format!(
                "upload of {len} B at {offset_bytes} overflows {} B",
                dst.bytes
            )));
        }
        // SAFETY: bounds checked above; `src` outlives the call (pageable memory: the copy
        // is staged before the call returns).
        unsafe { result::memcpy_htod_async(dst.ptr + offset_bytes as u64, src, self.stream.cu_stream()) }
            .op("memcpy HtoD")
    }

    /// Copies `dst.len()` values from device address `src` and waits for them.
    ///
    /// # Errors
    /// [`CudaError`] on driver failure (including earlier asynchronous kernel faults).
    pub fn download<T>(&self, dst: &mut [T], src: u64) -> Result<(), CudaError> {
        // SAFETY: the caller passes an address holding at least `dst.len()` values.
        unsafe { result::memcpy_dtoh_async(dst, src, self.stream.cu_stream()) }.op("memcpy DtoH")?;
        self.sync()
    }

    /// Waits for the stream.
    ///
    /// # Errors
    /// [`CudaError`] on an asynchronous kernel fault.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream.synchronize().op("stream sync")
    }

    /// Row-major `y[n, out] = x[n, inp] · w[out, inp]ᵀ` (bf16 inputs, f32 accumulation, output
    /// bf16 or f32 when `f32_out`), through `cublasGemmEx` in column-major terms:
    /// `yᵀ = w · xᵀ` with `transa = T`.
    ///
    /// # Errors
    /// [`CudaError::InvalidLaunch`] for a dimension above `i32::MAX`; [`CudaError`] on cuBLAS
    /// failure.
    pub fn gemm(&self, g: &GemmArgs) -> Result<(), CudaError> {
        let GemmArgs { y, x, w, shape: GemmShape { n, out, inp }, f32_out } = *g;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let c_type = if f32_out { blas_sys::cudaDataType_t::CUDA_R_32F } else { blas_sys::cudaDataType_t::CUDA_R_16BF };
        let i = |v: usize| i32::try_from(v).map_err(|_| CudaError::InvalidLaunch(format!("GEMM dimension {v}")));
        // SAFETY: the caller passes buffers of at least n·inp, out·inp and n·out elements.
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                i(out)?,
                i(n)?,
                i(inp)?,
                (&alpha) as *const f32 as *const _,
                w as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                i(inp)?,
                x as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                i(inp)?,
                (&beta) as *const f32 as *const _,
                y as *mut _,
                c_type,
                i(out)?,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .op("cublasGemmEx")
    }

    /// Fills `n` bf16 values at `ptr` with seeded uniform values in `[-scale, scale)`.
    ///
    /// # Errors
    /// [`CudaError`] on launch failure.
    pub fn fill_uniform(&self, ptr: u64, n: usize, seed: u32, scale: f32) -> Result<(), CudaError> {
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&self.k.fill_uniform);
        b.arg(&ptr).arg(&n64).arg(&seed).arg(&scale);
        // SAFETY: `ptr` holds n bf16 values (caller); argument types match the kernel.
        unsafe { b.launch(grid_stride(n)) }.map(|_| ()).op("fill_uniform")
    }

    /// Fills `n` bf16 values at `ptr` with `v`.
    ///
    /// # Errors
    /// [`CudaError`] on launch failure.
    pub fn fill_const(&self, ptr: u64, n: usize, v: f32) -> Result<(), CudaError> {
        let n64 = n as u64;
        let mut b = self.stream.launch_builder(&self.k.fill_const);
        b.arg(&ptr).arg(&n64).arg(&v);
        // SAFETY: as for fill_uniform.
        unsafe { b.launch(grid_stride(n)) }.map(|_| ()).op("fill_const")
    }
}

/// GEMM problem size: `n` rows of activations, `out × inp` weight.
#[derive(Clone, Copy, Debug)]
pub struct GemmShape {
    /// Activation rows (tokens).
    pub n: usize,
    /// Output features.
    pub out: usize,
    /// Input features.
    pub inp: usize,
}

/// One product `y[n, out] = x[n, inp] · w[out, inp]ᵀ` on raw device addresses: bf16 `x` and
/// `w`, `y` in bf16 or, with `f32_out`, f32.
#[derive(Clone, Copy, Debug)]
pub struct GemmArgs {
    /// Output, `[n, out]`.
    pub y: u64,
    /// Activations, `[n, inp]`.
    pub x: u64,
    /// Weight, `[out, inp]` row-major.
    pub w: u64,
    /// Problem size.
    pub shape: GemmShape,
    /// f32 output (the lm_head's logits) instead of bf16.
    pub f32_out: bool,
}

/// A grid-stride launch over `n` elements (256 threads, at most 132·16 blocks).
pub fn grid_stride(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 132 * 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

/// One block per row (`rows` blocks of `threads`).
pub fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}
