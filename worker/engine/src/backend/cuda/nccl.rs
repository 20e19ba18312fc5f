//! The collectives of one rank of a parallel CUDA replica ([`RankComm`]): the tensor-parallel
//! all-reduce a shard enqueues after o_proj and down_proj, and the pipeline's stage-to-stage
//! hidden states, either through NCCL (one communicator per process from
//! `ncclCommInitRank(world, unique id, rank)`, the stage's tensor-parallel group split off
//! it with `ncclCommSplit(color = pp_rank, key = tp_rank)`) or through the host communicator
//! (`host_collectives`: the stream is synchronised, the values go through host memory as f32
//! — slow, but several ranks may then share one GPU, which NCCL refuses).
//!
//! Bounds: NCCL operations are asynchronous on the stream, so a peer that died or froze shows
//! as a stream that never drains. [`RankComm::wait`] therefore never blocks in
//! `cuStreamSynchronize`: it polls the stream, checks `ncclCommGetAsyncError` and, past the
//! deadline, aborts the communicators (`ncclCommAbort` releases the kernels blocked in a
//! collective) and fails the step; an aborted communicator fails every later step and is
//! never destroyed. Not bounded here: `ncclCommInitRank` (blocks until every rank joined) and
//! NCCL's connection set-up on a communicator's first collective or send/receive (host-side,
//! inside the enqueue), and a pageable host-to-device copy that waits behind a receive whose
//! sender died. A rank process stuck there is killed by the driver once its step answer is
//! overdue (collective timeout) or its load is (join timeout). Rank 0, in the driver's
//! process, never receives from another stage and its metadata copies follow a finished wait,
//! so it can block only in `ncclCommInitRank` and in the first step's connection set-up when a
//! peer freezes exactly then (a peer that exits makes NCCL fail instead).

use std::time::{Duration, Instant};

use cudarc::nccl::{result as nccl, sys as nccl_sys};
use half::bf16;

use super::device::Gpu;
use super::error::{CudaError, CudaResultExt};
use crate::parallel::comm::Communicator;

/// Element type of a collective's device buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Elem {
    F32,
    Bf16,
}

impl Elem {
    fn nccl(self) -> nccl_sys::ncclDataType_t {
        match self {
            Self::F32 => nccl_sys::ncclDataType_t::ncclFloat32,
            Self::Bf16 => nccl_sys::ncclDataType_t::ncclBfloat16,
        }
    }
}

/// NCCL communicators of one process: the world's and its stage's tensor-parallel group's
/// (`tp` is `None` when the group is the world, or has one rank).
struct NcclComms {
    world: nccl_sys::ncclComm_t,
    tp: Option<nccl_sys::ncclComm_t>,
    aborted: bool,
}

impl NcclComms {
    /// The communicator of the tensor-parallel group.
    fn tp(&self) -> nccl_sys::ncclComm_t {
        self.tp.unwrap_or(self.world)
    }

    fn all(&self) -> impl Iterator<Item = nccl_sys::ncclComm_t> + '_ {
        std::iter::once(self.world).chain(self.tp)
    }

    /// Aborts every communicator once.
    fn abort(&mut self) {
        if std::mem::replace(&mut self.aborted, true) {
            return;
        }
        for c in self.all() {
            // SAFETY: valid communicators, aborted once (guarded by `aborted`) and never
            // destroyed afterwards (Drop checks the same flag).
            let _ = unsafe { nccl::comm_abort(c) };
        }
    }
}

impl Drop for NcclComms {
    fn drop(&mut self) {
        if self.aborted {
            return;
        }
        // The split communicator first, then the one it was split from.
        for c in self.tp.into_iter().chain([self.world]) {
            // SAFETY: created by ncclCommInitRank / ncclCommSplit, destroyed once; no operation
            // is pending (`RankComm` aborts instead when its last work was not seen finished).
            let _ = unsafe { nccl::comm_destroy(c) };
        }
    }
}

/// The host path's communicator and staging buffers.
struct HostColl {
    comm: Box<dyn Communicator>,
    tp_group: Vec<usize>,
    f32s: Vec<f32>,
    bf16s: Vec<bf16>,
}

enum Kind {
    Nccl(NcclComms),
    Host(HostColl),
}

/// One rank's collectives (see the module doc).
pub(crate) struct RankComm {
    /// Rank within the stage's tensor-parallel group.
    pub tp_rank: usize,
    /// Ranks in the group.
    pub tp_size: usize,
    /// Bound of [`RankComm::wait`].
    timeout: Duration,
    /// NCCL work was enqueued and not yet seen finished by [`RankComm::wait`] (then the
    /// communicators are aborted, not destroyed, on drop: destroying one with an operation
    /// that never completes would block).
    pending: bool,
    kind: Kind,
}

impl Drop for RankComm {
    fn drop(&mut self) {
        if let (true, Kind::Nccl(c)) = (self.pending, &mut self.kind) {
            c.abort();
        }
    }
}

// SAFETY: the communicators are used by one thread at a time (the rank's step thread); NCCL
// allows a communicator to move between threads; the host communicator is `Send`.
unsafe impl Send for RankComm {}

/// What [`RankComm`] is built from: this rank and its group.
pub(crate) struct RankCommSpec {
    pub rank: usize,
    pub world_size: usize,
    pub tp_rank: usize,
    pub tp_size: usize,
    pub pp_rank: usize,
    pub timeout: Duration,
}

/// `ncclGetUniqueId` as its 128 bytes.
///
/// # Errors
/// [`CudaError::Unavailable`] without libnccl; [`CudaError::Nccl`] when NCCL fails.
pub(crate) fn unique_id() -> Result<Vec<u8>, CudaError> {
    nccl_present()?;
    let id = nccl::get_uniqueid().op("ncclGetUniqueId")?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

fn nccl_present() -> Result<(), CudaError> {
    // SAFETY: only opens the library (cudarc panics on a missing library otherwise).
    if unsafe { nccl_sys::is_culib_present() } {
        Ok(())
    } else {
        Err(CudaError::Unavailable("parallel CUDA replicas need NCCL (libnccl.so.2 not found)"))
    }
}

impl RankComm {
    /// Joins the world's NCCL communicator from the driver's `unique_id` on `gpu`'s device
    /// (blocks until every rank joined) and splits off this stage's tensor-parallel group
    /// when the world has more than one stage and the stage more than one rank.
    ///
    /// # Errors
    /// [`CudaError::InvalidOption`] for an id that is not 128 bytes; [`CudaError::Nccl`] when
    /// NCCL fails (two ranks on one GPU: NCCL refuses; use host collectives).
    pub fn nccl(gpu: &Gpu, spec: &RankCommSpec, unique_id: &[u8]) -> Result<Self, CudaError> {
        nccl_present()?;
        let mut id = nccl_sys::ncclUniqueId { internal: [0; 128] };
        if unique_id.len() != id.internal.len() {
            return Err(CudaError::InvalidOption {
                field: "nccl_unique_id",
                message: format!("the NCCL unique id has {} bytes, not 128", unique_id.len()),
            });
        }
        for (d, &s) in id.internal.iter_mut().zip(unique_id) {
            *d = s as std::ffi::c_char;
        }
        gpu.bind()?;
        let mut world = std::ptr::null_mut();
        // SAFETY: `world` receives the communicator; the device is current on this thread.
        unsafe { nccl::comm_init_rank(&mut world, spec.world_size as i32, id, spec.rank as i32) }
            .map_err(|e| CudaError::op(format!("ncclCommInitRank(rank {} of {})", spec.rank, spec.world_size), e))?;
        let mut comms = NcclComms { world, tp: None, aborted: false };
        if spec.tp_size > 1 && spec.tp_size < spec.world_size {
            let mut tp = std::ptr::null_mut();
            // SAFETY: every rank of the world calls the split once, in the same order; a null
            // config inherits the parent's.
            let r = unsafe {
                nccl_sys::ncclCommSplit(world, spec.pp_rank as i32, spec.tp_rank as i32, &mut tp, std::ptr::null_mut())
            };
            if r != nccl_sys::ncclResult_t::ncclSuccess {
                // The other ranks may be inside the split: abort rather than destroy.
                comms.abort();
                return Err(CudaError::op("ncclCommSplit(color pp_rank, key tp_rank)", CudaError::Nccl(r)));
            }
            comms.tp = Some(tp);
        }
        let kind = Kind::Nccl(comms);
        Ok(Self { tp_rank: spec.tp_rank, tp_size: spec.tp_size, timeout: spec.timeout, pending: false, kind })
    }

    /// Collectives through the host communicator (`comm`), `tp_group` being the stage's
    /// tensor-parallel group in global ranks.
    pub fn host(spec: &RankCommSpec, comm: Box<dyn Communicator>, tp_group: Vec<usize>) -> Self {
        let kind = Kind::Host(HostColl { comm, tp_group, f32s: Vec::new(), bf16s: Vec::new() });
        Self { tp_rank: spec.tp_rank, tp_size: spec.tp_size, timeout: spec.timeout, pending: false, kind }
    }

    fn check_alive(&self) -> Result<(), CudaError> {
        match &self.kind {
            Kind::Nccl(c) if c.aborted => Err(CudaError::TensorParallel("the NCCL communicators were aborted earlier")),
            _ => Ok(()),
        }
    }

    /// In-place sum of `count` values at `ptr` over the tensor-parallel group, enqueued on
    /// `gpu`'s stream (NCCL) or done through the host now (host collectives).
    ///
    /// # Errors
    /// [`CudaError::Nccl`] when NCCL fails to enqueue it; [`CudaError::HostComm`] when the host
    /// collective fails; [`CudaError`] on a copy failure.
    pub fn all_reduce(&mut self, gpu: &Gpu, ptr: u64, count: usize, elem: Elem) -> Result<(), CudaError> {
        self.check_alive()?;
        match &mut self.kind {
            Kind::Nccl(c) => {
                self.pending = true;
                // SAFETY: `ptr` holds `count` values of `elem` on this rank's device; in-place
                // all-reduce on the stream every other launch of the shard uses.
                unsafe {
                    nccl::all_reduce(
                        ptr as *const _,
                        ptr as *mut _,
                        count,
                        elem.nccl(),
                        nccl_sys::ncclRedOp_t::ncclSum,
                        c.tp(),
                        gpu.stream.cu_stream() as nccl_sys::cudaStream_t,
                    )
                }
                .map(|_| ())
                .op("ncclAllReduce")
            }
            Kind::Host(h) => {
                h.download(gpu, ptr, count, elem)?;
                h.comm.all_reduce_sum(&h.tp_group, &mut h.f32s)?;
                h.upload(gpu, ptr, elem)
            }
        }
    }

    /// Sends `count` f32 at `ptr` to global rank `peer` (the next stage).
    ///
    /// # Errors
    /// As [`RankComm::all_reduce`].
    pub fn send_f32(&mut self, gpu: &Gpu, ptr: u64, count: usize, peer: usize) -> Result<(), CudaError> {
        self.check_alive()?;
        match &mut self.kind {
            Kind::Nccl(c) => {
                self.pending = true;
                // SAFETY: `ptr` holds `count` f32 on this device; stream-ordered after the
                // layers that wrote them.
                unsafe {
                    nccl::send(
                        ptr as *const _,
                        count,
                        Elem::F32.nccl(),
                        peer as i32,
                        c.world,
                        gpu.stream.cu_stream() as nccl_sys::cudaStream_t,
                    )
                }
                .map(|_| ())
                .op("ncclSend")
            }
            Kind::Host(h) => {
                h.download(gpu, ptr, count, Elem::F32)?;
                Ok(h.comm.send(peer, &h.f32s)?)
            }
        }
    }

    /// Receives `count` f32 from global rank `peer` (the previous stage) into `ptr`.
    ///
    /// # Errors
    /// As [`RankComm::all_reduce`].
    pub fn recv_f32(&mut self, gpu: &Gpu, ptr: u64, count: usize, peer: usize) -> Result<(), CudaError> {
        self.check_alive()?;
        match &mut self.kind {
            Kind::Nccl(c) => {
                self.pending = true;
                // SAFETY: `ptr` has room for `count` f32 on this device; the layers that read
                // them are enqueued after it on the same stream.
                unsafe {
                    nccl::recv(
                        ptr as *mut _,
                        count,
                        Elem::F32.nccl(),
                        peer as i32,
                        c.world,
                        gpu.stream.cu_stream() as nccl_sys::cudaStream_t,
                    )
                }
                .map(|_| ())
                .op("ncclRecv")
            }
            Kind::Host(h) => {
                h.f32s.clear();
                h.f32s.resize(count, 0.0);
                h.comm.recv(peer, &mut h.f32s)?;
                h.upload(gpu, ptr, Elem::F32)
            }
        }
    }

    /// Waits for everything enqueued on `gpu`'s stream, at most the collective timeout (see
    /// the module doc); aborts the NCCL communicators on a timeout or an NCCL error.
    ///
    /// # Errors
    /// [`CudaError::CollectiveTimeout`] past the deadline; [`CudaError::Nccl`] for an
    /// asynchronous NCCL error; [`CudaError`] for a kernel fault.
    pub fn wait(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        let Kind::Nccl(c) = &mut self.kind else {
            return gpu.sync();
        };
        if c.aborted {
            return Err(CudaError::TensorParallel("the NCCL communicators were aborted earlier"));
        }
        let deadline = Instant::now() + self.timeout;
        let mut spins = 0u32;
        loop {
            // SAFETY: queries the rank's own stream.
            match unsafe { cudarc::driver::sys::cuStreamQuery(gpu.stream.cu_stream()) } {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => {
                    self.pending = false;
                    return Ok(());
                }
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => {
                    c.abort();
                    return Err(CudaError::op("stream query", cudarc::driver::DriverError(e)));
                }
            }
            let bad = |s| !matches!(s, nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress);
            let failed = c.all().find_map(|comm| {
                let mut state = nccl_sys::ncclResult_t::ncclSuccess;
                // SAFETY: a valid communicator; `state` receives its asynchronous error.
                let r = unsafe { nccl_sys::ncclCommGetAsyncError(comm, &mut state) };
                if bad(r) { Some(r) } else { bad(state).then_some(state) }
            });
            if let Some(code) = failed {
                c.abort();
                return Err(CudaError::op("ncclCommGetAsyncError", CudaError::Nccl(code)));
            }
            if Instant::now() >= deadline {
                tracing::error!(timeout = ?self.timeout, "NCCL step did not finish in time: aborting the communicators");
                c.abort();
                return Err(CudaError::CollectiveTimeout(self.timeout));
            }
            // Spin briefly (a decode step finishes in milliseconds), then back off.
            spins += 1;
            if spins < 20_000 {
                std::hint::spin_loop();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
}

impl HostColl {
    /// Copies `count` values of `elem` at `ptr` into `f32s` (waits for the stream).
    fn download(&mut self, gpu: &Gpu, ptr: u64, count: usize, elem: Elem) -> Result<(), CudaError> {
        self.f32s.clear();
        match elem {
            Elem::F32 => {
                self.f32s.resize(count, 0.0);
                gpu.download(&mut self.f32s, ptr)
            }
            Elem::Bf16 => {
                self.bf16s.clear();
                self.bf16s.resize(count, bf16::ZERO);
                gpu.download(&mut self.bf16s, ptr)?;
                self.f32s.extend(self.bf16s.iter().map(|v| v.to_f32()));
                Ok(())
            }
        }
    }

    /// Copies `f32s` to `ptr` as `elem` and waits (the staging buffers are reused).
    fn upload(&mut self, gpu: &Gpu, ptr: u64, elem: Elem) -> Result<(), CudaError> {
        match elem {
            // SAFETY: the caller's buffer at `ptr` holds `f32s.len()` f32.
            Elem::F32 => unsafe { cudarc::driver::result::memcpy_htod_async(ptr, &self.f32s, gpu.stream.cu_stream()) }
                .op("memcpy HtoD")?,
            Elem::Bf16 => {
                self.bf16s.clear();
                self.bf16s.extend(self.f32s.iter().map(|&v| bf16::from_f32(v)));
                // SAFETY: the caller's buffer at `ptr` holds `f32s.len()` bf16.
                unsafe { cudarc::driver::result::memcpy_htod_async(ptr, &self.bf16s, gpu.stream.cu_stream()) }
                    .op("memcpy HtoD")?;
            }
        }
        gpu.sync()
    }
}
