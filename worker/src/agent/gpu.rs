//! Device discovery: real GPUs through cudarc (feature `cuda`; the driver library is checked
//! for first because cudarc panics when it is missing), simulated GPUs for placement tests
//! (`--simulate-gpus N`), otherwise CPU slots; and where on them a replica's engine runs
//! ([`Devices::placement_for`]).

use super::replica::DevicePlacement;
use prism_common::NodeId;
use prism_common::proto::v1::{EngineConfig, GpuInfo};

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

/// Why a `StartReplica` cannot run on this node's devices (reported as the replica's
/// Failed reason).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    /// The head sent a GPU group of the wrong size for this node's share of the ranks.
    #[error(
        "got {got} GPU indices for this node's {want} of the {} ranks of tensor_parallel_size {tensor_parallel_size} x pipeline_parallel_size {pipeline_parallel_size}",
        tensor_parallel_size * pipeline_parallel_size
    )]
    GroupSize {
        /// GPU indices in the command.
        got: usize,
        /// Ranks of the group on this node.
        want: usize,
        /// The deployment's tensor-parallel size.
        tensor_parallel_size: usize,
        /// The deployment's pipeline-parallel size.
        pipeline_parallel_size: usize,
    },
    /// A GPU index this node does not have.
    #[error("GPU index {index} does not exist on node {node}")]
    NoSuchGpu {
        /// The index asked for.
        index: u32,
        /// This node.
        node: NodeId,
    },
    /// Backend `cuda` on a node without (real) GPUs.
    #[error("backend cuda requested but node {node} has no GPU")]
    NoGpu {
        /// This node.
        node: NodeId,
    },
}

impl Devices {
    /// Where the engine (or the member ranks) of a replica with `engine`'s configuration runs
    /// on this node (`node` names it in errors), given this node's share of the GPU group:
    /// `gpus`, one per local rank, of which there are `local_ranks` (the whole group,
    /// `tensor_parallel_size × pipeline_parallel_size`, when every rank is here). CUDA on
    /// those GPUs when the node has real ones and the backend is `auto`/`cuda`/unset, else
    /// the CPU backend.
    ///
    /// # Errors
    /// [`PlacementError`] when the share does not fit this node's GPUs.
    pub fn placement_for(
        &self,
        node: &NodeId,
        engine: &EngineConfig,
        gpus: &[u32],
        local_ranks: usize,
    ) -> Result<DevicePlacement, PlacementError> {
        // A CPU node's slots count too once a group has several ranks here (one slot each).
        if (!self.gpus.is_empty() || local_ranks > 1) && gpus.len() != local_ranks {
            return Err(PlacementError::GroupSize {
                got: gpus.len(),
                want: local_ranks,
                tensor_parallel_size: engine.tensor_parallel_size.max(1) as usize,
                pipeline_parallel_size: engine.pipeline_parallel_size.unwrap_or(1).max(1) as usize,
            });
        }
        if !self.gpus.is_empty()
            && let Some(bad) = gpus.iter().find(|i| !self.gpus.iter().any(|g| g.index == **i))
        {
            return Err(PlacementError::NoSuchGpu { index: *bad, node: node.clone() });
        }
        let want_cuda = matches!(engine.backend.as_str(), "" | "auto" | "cuda");
        if self.simulated || self.gpus.is_empty() || !want_cuda {
            if engine.backend == "cuda" && !self.simulated {
                return Err(PlacementError::NoGpu { node: node.clone() });
            }
            Ok(DevicePlacement::Cpu)
        } else {
            Ok(DevicePlacement::Cuda(gpus.to_vec()))
        }
    }
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

    fn engine(tp: u32, backend: &str) -> EngineConfig {
        EngineConfig { tensor_parallel_size: tp, backend: backend.into(), ..Default::default() }
    }

    #[test]
    fn placement_uses_real_gpus_for_cuda_and_the_cpu_otherwise() {
        let node = NodeId::from("n1".to_owned());
        let gpu = |index| GpuInfo { index, name: "H100".into(), memory_bytes: 80 << 30 };
        let real = Devices { gpus: vec![gpu(0), gpu(1)], cpu_slots: 0, simulated: false };
        assert_eq!(real.placement_for(&node, &engine(2, ""), &[1, 0], 2), Ok(DevicePlacement::Cuda(vec![1, 0])));
        assert_eq!(real.placement_for(&node, &engine(1, "cuda"), &[1], 1), Ok(DevicePlacement::Cuda(vec![1])));
        assert_eq!(real.placement_for(&node, &engine(1, "cpu"), &[0], 1), Ok(DevicePlacement::Cpu));
        assert_eq!(
            real.placement_for(&node, &engine(2, "auto"), &[0], 2),
            Err(PlacementError::GroupSize { got: 1, want: 2, tensor_parallel_size: 2, pipeline_parallel_size: 1 })
        );
        // Two stages over two nodes: this node holds one stage's 2 ranks of the 4.
        let mut pp = engine(2, "");
        pp.pipeline_parallel_size = Some(2);
        assert_eq!(real.placement_for(&node, &pp, &[0, 1], 2), Ok(DevicePlacement::Cuda(vec![0, 1])));
        let err = real.placement_for(&node, &pp, &[0], 2).err().map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some(
                "got 1 GPU indices for this node's 2 of the 4 ranks of tensor_parallel_size 2 x pipeline_parallel_size 2"
            )
        );
        let err = real.placement_for(&node, &engine(1, ""), &[7], 1);
        assert_eq!(err, Err(PlacementError::NoSuchGpu { index: 7, node: node.clone() }));
        assert_eq!(err.err().map(|e| e.to_string()).as_deref(), Some("GPU index 7 does not exist on node n1"));

        let simulated = discover(2, 0);
        assert_eq!(simulated.placement_for(&node, &engine(2, "cuda"), &[0, 1], 2), Ok(DevicePlacement::Cpu));
        let cpu = Devices { gpus: vec![], cpu_slots: 2, simulated: false };
        assert_eq!(cpu.placement_for(&node, &engine(1, ""), &[0], 1), Ok(DevicePlacement::Cpu));
        assert_eq!(cpu.placement_for(&node, &engine(3, ""), &[0, 1, 2], 3), Ok(DevicePlacement::Cpu));
        assert!(matches!(
            cpu.placement_for(&node, &engine(3, ""), &[0], 3),
            Err(PlacementError::GroupSize { got: 1, want: 3, .. })
        ));
        assert_eq!(cpu.placement_for(&node, &engine(1, "cuda"), &[0], 1), Err(PlacementError::NoGpu { node }));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cpu_only_without_cuda_feature() {
        assert_eq!(discover(0, 3), Devices { gpus: vec![], cpu_slots: 3, simulated: false });
    }
}
