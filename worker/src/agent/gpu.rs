//! Device discovery: real GPUs through cudarc (feature `cuda`; the driver library is checked
//! for first because cudarc panics when it is missing), simulated GPUs for placement tests
//! (`--simulate-gpus N`), otherwise CPU slots.

use prism_common::proto::v1::GpuInfo;

/// What this node offers for replicas.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Devices {
    /// GPUs (real or simulated), by index.
    pub gpus: Vec<GpuInfo>,
    /// Replica slots on a node without GPUs.
    pub cpu_slots: u32,
    /// The GPUs are simulated: engines run on the CPU backend.
    pub simulated: bool,
}

/// Memory advertised per simulated GPU (80 GiB, an H100/A100-80G).
pub const SIMULATED_GPU_MEMORY: u64 = 80 * 1024 * 1024 * 1024;

/// Discovers devices: `simulate > 0` advertises that many fake GPUs named "simulated";
/// otherwise real GPUs when the `cuda` feature is on and a driver is present; otherwise
/// `cpu_slots` CPU slots.
pub fn discover(simulate: u32, cpu_slots: u32) -> Devices {
    if simulate > 0 {
        return Devices {
            gpus: (0..simulate)
                .map(|index| GpuInfo { index, name: "simulated".into(), memory_bytes: SIMULATED_GPU_MEMORY })
                .collect(),
            cpu_slots: 0,
            simulated: true,
        };
    }
    let gpus = cuda_gpus();
    if gpus.is_empty() {
        Devices { gpus, cpu_slots, simulated: false }
    } else {
        Devices { gpus, cpu_slots: 0, simulated: false }
    }
}

/// Real GPUs via the CUDA driver API; empty when the driver is absent or fails.
#[cfg(feature = "cuda")]
pub fn cuda_gpus() -> Vec<GpuInfo> {
    use cudarc::driver::{result, sys};
    // SAFETY: only probes whether the driver library can be opened (no CUDA call is made).
    if !unsafe { sys::is_culib_present() } {
        tracing::info!("CUDA driver library not found: offering CPU slots");
        return Vec::new();
    }
    if let Err(e) = result::init() {
        tracing::warn!(error = ?e, "cuInit failed: offering CPU slots");
        return Vec::new();
    }
    let count = match result::device::get_count() {
        Ok(n) => n,
        Err(e) => {
            tracing::warn!(error = ?e, "cuDeviceGetCount failed");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for ordinal in 0..count {
        let Ok(dev) = result::device::get(ordinal) else { continue };
        let name = result::device::get_name(dev).unwrap_or_else(|_| "unknown".into());
        // SAFETY: `dev` is a valid device handle returned by cuDeviceGet after cuInit.
        let memory_bytes = unsafe { result::device::total_mem(dev) }.map(|m| m as u64).unwrap_or(0);
        let Ok(index) = u32::try_from(ordinal) else { continue };
        out.push(GpuInfo { index, name, memory_bytes });
    }
    out
}

/// Without the `cuda` feature there are no GPUs to discover.
#[cfg(not(feature = "cuda"))]
pub fn cuda_gpus() -> Vec<GpuInfo> {
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_gpus_are_named_and_indexed() {
        let d = discover(4, 1);
        assert!(d.simulated);
        assert_eq!(d.cpu_slots, 0);
        assert_eq!(d.gpus.iter().map(|g| g.index).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert!(d.gpus.iter().all(|g| g.name == "simulated" && g.memory_bytes == SIMULATED_GPU_MEMORY));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cpu_only_without_cuda_feature() {
        assert_eq!(discover(0, 3), Devices { gpus: vec![], cpu_slots: 3, simulated: false });
    }
}
