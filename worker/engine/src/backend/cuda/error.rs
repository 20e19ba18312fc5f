//! [`CudaError`]: the CUDA backend's failures. cudarc's driver, cuBLAS, cuBLASLt and NVRTC
//! errors convert with `#[from]` (as candle's CUDA backend does); NCCL's `NcclError`
//! implements no `std::error::Error` and is mapped by the one `From` impl below.
//! [`CudaResultExt::op`] names the operation that failed (a kernel, a copy, a library call).
//! Steps report a `CudaError` as [`crate::backend::BackendError::Cuda`]; constructors report it
//! to the engine as [`EngineError`] (an invalid option as `InvalidRequest`, a checkpoint error as
//! the model-load error it is, everything else as `Internal`).

use std::borrow::Cow;

use cudarc::driver::DriverError;
use cudarc::nccl::result::NcclError;
use cudarc::nccl::sys::ncclResult_t;
use cudarc::nvrtc::CompileError;

use crate::model::error::ModelError;
use crate::request::EngineError;

/// A CUDA backend failure.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A CUDA driver call failed (asynchronous kernel faults surface here at the next sync).
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),
    /// A cuBLASLt call failed.
    #[error("cuBLASLt: {0}")]
    CublasLt(#[from] cudarc::cublaslt::result::CublasError),
    /// NVRTC could not compile a kernel file (the log is in the error).
    #[error("NVRTC: {0}")]
    Compile(#[from] CompileError),
    /// An NCCL call failed.
    #[error("NCCL: {0:?}")]
    Nccl(ncclResult_t),
    /// `op` failed with `source`.
    #[error("{op}: {source}")]
    Op {
        /// The operation, e.g. a kernel name or `cuMemAlloc(… B)`.
        op: Cow<'static, str>,
        /// What it failed with.
        #[source]
        source: Box<CudaError>,
    },
    /// A CUDA library (driver, cuBLAS, cuBLASLt, NVRTC, NCCL) or the device is missing.
    #[error("{0}")]
    Unavailable(&'static str),
    /// The model or device is outside what the kernels support (head sizes, GQA groups,
    /// shared memory, architecture).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// A kernel or GEMM was called outside its contract (an inconsistent step or a caller bug).
    #[error("invalid launch: {0}")]
    InvalidLaunch(String),
    /// cuBLASLt offers no algorithm for a GEMM shape.
    #[error("cuBLASLt has no algorithm for {out}x{inp} ({detail})")]
    NoAlgorithm {
        /// Output features.
        out: usize,
        /// Input features.
        inp: usize,
        /// Which rows or plan it was asked for.
        detail: String,
    },
    /// A CUDA graph capture recorded nothing.
    #[error("empty CUDA graph capture")]
    EmptyGraph,
    /// A backend option is out of range (the engine reports it as `InvalidRequest`).
    #[error("{message}")]
    InvalidOption {
        /// The option, e.g. `gpu_memory_utilization`.
        field: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// A tensor-parallel replica cannot run: a rank failed and the communicators were
    /// aborted, or the group is malformed.
    #[error("tensor parallelism: {0}")]
    TensorParallel(&'static str),
    /// Reading the checkpoint failed.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A collective through the host communicator failed (`host_collectives`).
    #[error("host collective: {0}")]
    HostComm(#[from] crate::parallel::comm::CommError),
    /// An NCCL step did not finish within the collective timeout (a peer died or froze);
    /// the communicators were aborted.
    #[error("NCCL step did not finish within {0:?} (communicators aborted)")]
    CollectiveTimeout(std::time::Duration),
}

impl CudaError {
    /// `source` while running `op`.
    pub fn op(op: impl Into<Cow<'static, str>>, source: impl Into<CudaError>) -> Self {
        Self::Op { op: op.into(), source: Box::new(source.into()) }
    }
}

/// NCCL's error type holds only the status code: keep that.
impl From<NcclError> for CudaError {
    fn from(e: NcclError) -> Self {
        Self::Nccl(e.0)
    }
}

/// Names the operation a CUDA result came from.
pub trait CudaResultExt<T> {
    /// Wraps the error as [`CudaError::Op`].
    ///
    /// # Errors
    /// The wrapped error.
    fn op(self, op: &'static str) -> Result<T, CudaError>;
}

impl<T, E: Into<CudaError>> CudaResultExt<T> for Result<T, E> {
    fn op(self, op: &'static str) -> Result<T, CudaError> {
        self.map_err(|e| CudaError::op(op, e))
    }
}

impl From<CudaError> for EngineError {
    fn from(e: CudaError) -> Self {
        match e {
            CudaError::InvalidOption { field, message } => EngineError::InvalidRequest { field, message },
            CudaError::Model(e) => e.into(),
            e => EngineError::Internal(format!("cuda backend: {e}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_errors_keep_their_kind() {
        let e = EngineError::from(CudaError::InvalidOption { field: "block_size", message: "0".into() });
        assert!(matches!(e, EngineError::InvalidRequest { field: "block_size", .. }));
        let e = EngineError::from(CudaError::Model(ModelError::MissingTensor { name: "lm_head.weight".into() }));
        assert!(matches!(&e, EngineError::Internal(m) if m.starts_with("model load: ")), "{e}");
        let e = EngineError::from(CudaError::op("end_capture", CudaError::EmptyGraph));
        assert!(matches!(&e, EngineError::Internal(m) if m.starts_with("cuda backend: ")), "{e}");
    }

    #[test]
    fn nccl_status_converts_and_ops_are_named() {
        let e = CudaError::from(NcclError(ncclResult_t::ncclUnhandledCudaError));
        assert!(matches!(e, CudaError::Nccl(ncclResult_t::ncclUnhandledCudaError)));
        let named: Result<(), CudaError> = Err(NcclError(ncclResult_t::ncclSystemError)).op("ncclAllReduce");
        assert!(
            matches!(&named, Err(CudaError::Op { op, source }) if op == "ncclAllReduce" && matches!(**source, CudaError::Nccl(_)))
        );
    }
}
