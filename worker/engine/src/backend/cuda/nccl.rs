//! NCCL communicators of a tensor-parallel replica (one per rank, from `ncclCommInitAll` over
//! the replica's devices): the bf16 sum all-reduce a shard enqueues after o_proj and down_proj,
//! and the abort that releases every rank blocked in a collective when one rank fails.
//! Aborted communicators are never destroyed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::nccl::{result as nccl, sys as nccl_sys};

use super::device::Gpu;
use super::error::{CudaError, CudaResultExt};

/// One rank's NCCL communicator.
pub(crate) struct TpComm {
    comm: nccl_sys::ncclComm_t,
    /// This shard's rank.
    pub rank: usize,
    /// Set once the communicators were aborted (then they must not be destroyed).
    aborted: Arc<AtomicBool>,
}

// SAFETY: the communicator is used by one thread at a time (the rank's step thread); NCCL
// allows a communicator to move between threads.
unsafe impl Send for TpComm {}

impl Drop for TpComm {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::SeqCst) {
            return;
        }
        // SAFETY: created by ncclCommInitAll, destroyed once; no collective is pending (every
        // step ends with every rank's stream synchronised).
        let _ = unsafe { nccl::comm_destroy(self.comm) };
    }
}

impl TpComm {
    /// In-place sum of `count` bf16 values at `ptr` over every rank, on the shard's stream.
    ///
    /// # Errors
    /// [`CudaError::Nccl`] when NCCL fails to enqueue it.
    pub(crate) fn all_reduce_bf16(&self, gpu: &Gpu, ptr: u64, count: usize) -> Result<(), CudaError> {
        // SAFETY: `ptr` holds `count` bf16 values on this rank's device; in-place all-reduce
        // on the stream every other launch of the shard uses.
        unsafe {
            nccl::all_reduce(
                ptr as *const _,
                ptr as *mut _,
                count,
                nccl_sys::ncclDataType_t::ncclBfloat16,
                nccl_sys::ncclRedOp_t::ncclSum,
                self.comm,
                gpu.stream.cu_stream() as nccl_sys::cudaStream_t,
            )
        }
        .map(|_| ())
        .op("ncclAllReduce")
    }
}

/// A raw communicator handle shared with the rank threads (only for `ncclCommAbort`).
#[derive(Clone, Copy)]
struct RawComm(nccl_sys::ncclComm_t);
// SAFETY: ncclCommAbort may be called from any thread, also while a collective is blocked.
unsafe impl Send for RawComm {}
// SAFETY: as above; the handle is only passed to ncclCommAbort.
unsafe impl Sync for RawComm {}

/// Every rank's communicator, for aborting them together.
pub(crate) struct CommGroup {
    raw: Vec<RawComm>,
    aborted: Arc<AtomicBool>,
}

impl CommGroup {
    /// Creates one communicator per device (ranks in the order of `devices`).
    ///
    /// # Errors
    /// [`CudaError::Unavailable`] when libnccl is missing; [`CudaError::Nccl`] when
    /// `ncclCommInitAll` fails.
    pub(crate) fn init(devices: &[u32]) -> Result<(Self, Vec<TpComm>), CudaError> {
        // SAFETY: only opens the library (cudarc panics on a missing library otherwise).
        if !unsafe { nccl_sys::is_culib_present() } {
            return Err(CudaError::Unavailable("tensor_parallel_size > 1 needs NCCL (libnccl.so.2 not found)"));
        }
        let world = devices.len();
        let ordinals: Vec<i32> = devices.iter().map(|&d| d as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); world];
        // SAFETY: `comms` has one slot per device in `ordinals`.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), world as i32, ordinals.as_ptr()) }
            .map_err(|e| CudaError::op(format!("ncclCommInitAll over devices {devices:?}"), e))?;
        let aborted = Arc::new(AtomicBool::new(false));
        let raw = comms.iter().map(|&c| RawComm(c)).collect();
        let ranks =
            comms.into_iter().enumerate().map(|(rank, comm)| TpComm { comm, rank, aborted: aborted.clone() }).collect();
        Ok((Self { raw, aborted }, ranks))
    }

    /// Whether the communicators were aborted.
    pub(crate) fn aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// Aborts every communicator once (releases ranks blocked in a collective).
    pub(crate) fn abort(&self) {
        if self.aborted.swap(true, Ordering::SeqCst) {
            return;
        }
        tracing::error!("tensor-parallel rank failed: aborting the NCCL communicators");
        for c in &self.raw {
            // SAFETY: valid communicators, aborted once (guarded by `aborted`), never destroyed
            // afterwards (TpComm::drop checks the same flag).
            let _ = unsafe { nccl::comm_abort(c.0) };
        }
    }
}
