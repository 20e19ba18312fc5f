//! The real [`EngineLauncher`]: checks the model path, then starts an engine replica with the
//! engine crate's `EngineHandle` and adapts it to [`ReplicaEngine`].

use super::replica::{DevicePlacement, EngineLauncher, EngineLoad, LaunchSpec, ReplicaEngine, ReplicaOutputStream};
use futures::StreamExt;
use prism_engine::{BackendKind, EngineConfig, EngineError, EngineHandle, EngineRequest, Fault};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

impl ReplicaEngine for EngineHandle {
    fn submit(&self, req: EngineRequest) -> Result<ReplicaOutputStream, EngineError> {
        EngineHandle::submit(self, req).map(|s| s.boxed())
    }

    fn load(&self) -> EngineLoad {
        let s = self.stats();
        EngineLoad {
            running: u32::try_from(s.running).unwrap_or(u32::MAX),
            waiting: u32::try_from(s.waiting).unwrap_or(u32::MAX),
            kv_cache_usage: s.kv_cache_usage as f32,
            num_preemptions_total: s.num_preemptions_total,
        }
    }

    fn is_alive(&self) -> bool {
        EngineHandle::is_alive(self)
    }

    fn shutdown(&self) {
        EngineHandle::shutdown(self);
    }

    fn stop(&self) {
        EngineHandle::stop(self);
    }

    /// Time since the engine last made progress (a step, an idle tick, or a layer of a
    /// running step), while it holds work.
    fn stalled_for(&self) -> Option<Duration> {
        let s = self.stats();
        if s.requests_in_flight == 0 {
            return None;
        }
        s.last_progress_at.map(|t| t.elapsed())
    }

    fn max_model_len(&self) -> Option<usize> {
        Some(self.model_info().max_model_len)
    }

    fn inject_fault(&self, fault: Fault) -> Result<(), EngineError> {
        EngineHandle::inject_fault(self, fault)
    }
}

/// Engine configuration for a launch spec (proto zeros mean "engine default").
pub fn engine_config(spec: &LaunchSpec) -> EngineConfig {
    let e = &spec.engine;
    let mut cfg = EngineConfig::new(&e.model);
    cfg.served_model_name = if e.served_model_name.is_empty() { e.model.clone() } else { e.served_model_name.clone() };
    if e.max_model_len > 0 {
        cfg.max_model_len = Some(e.max_model_len as usize);
    }
    if e.block_size > 0 {
        cfg.block_size = e.block_size as usize;
    }
    if e.max_num_seqs > 0 {
        cfg.max_num_seqs = e.max_num_seqs as usize;
    }
    cfg.engine_threads = spec.engine_threads;
    cfg.batch_invariant = e.batch_invariant;
    if e.gpu_memory_utilization > 0.0 {
        cfg.gpu_memory_utilization = e.gpu_memory_utilization;
    }
    // The worker's default budget is for CPU replicas; a CUDA replica sizes its KV cache from
    // gpu_memory_utilization unless the deployment set a budget itself.
    cfg.kv_cache_bytes = match &spec.placement {
        DevicePlacement::Cpu => Some(spec.kv_cache_bytes),
        DevicePlacement::Cuda(_) => (e.kv_cache_bytes > 0).then_some(e.kv_cache_bytes),
    };
    cfg.backend = match &spec.placement {
        DevicePlacement::Cpu => BackendKind::Cpu,
        DevicePlacement::Cuda(devices) => BackendKind::Cuda { devices: devices.clone() },
    };
    // The deployment's explicit value, else the backend's default (512 on CPU, 2048 on CUDA).
    cfg.max_num_batched_tokens = if e.max_num_batched_tokens > 0 {
        e.max_num_batched_tokens as usize
    } else {
        cfg.backend.default_max_num_batched_tokens()
    };
    cfg
}

/// Launches replicas on this worker's engine.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalLauncher;

impl EngineLauncher for LocalLauncher {
    fn launch(&self, spec: &LaunchSpec) -> Result<Arc<dyn ReplicaEngine>, EngineError> {
        let model = Path::new(&spec.engine.model);
        if spec.engine.model.is_empty() {
            return Err(EngineError::InvalidRequest { field: "model", message: "model path is empty".into() });
        }
        if !model.exists() {
            return Err(EngineError::Internal(format!("model path {} does not exist", model.display())));
        }
        let handle = EngineHandle::start(engine_config(spec), None)?;
        Ok(Arc::new(handle))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_common::proto::v1 as pb;

    fn spec(placement: DevicePlacement, kv: u64, util: f32) -> LaunchSpec {
        LaunchSpec {
            replica_id: prism_common::ReplicaId::from("r1".to_owned()),
            engine: pb::EngineConfig {
                model: "/m".into(),
                kv_cache_bytes: kv,
                gpu_memory_utilization: util,
                ..Default::default()
            },
            placement,
            kv_cache_bytes: 64 << 20,
            engine_threads: None,
        }
    }

    #[test]
    fn step_token_budget_defaults_per_backend_and_keeps_an_explicit_value() {
        assert_eq!(engine_config(&spec(DevicePlacement::Cpu, 0, 0.0)).max_num_batched_tokens, 512);
        assert_eq!(engine_config(&spec(DevicePlacement::Cuda(vec![0]), 0, 0.0)).max_num_batched_tokens, 2048);
        let mut s = spec(DevicePlacement::Cpu, 0, 0.0);
        s.engine.max_num_batched_tokens = 4096;
        s.engine_threads = Some(3);
        let cfg = engine_config(&s);
        assert_eq!(cfg.max_num_batched_tokens, 4096);
        assert_eq!(cfg.engine_threads, Some(3));
    }

    #[test]
    fn cuda_replicas_size_kv_from_gpu_memory_unless_the_deployment_set_a_budget() {
        let cpu = engine_config(&spec(DevicePlacement::Cpu, 0, 0.0));
        assert_eq!(cpu.kv_cache_bytes, Some(64 << 20));
        let gpu = engine_config(&spec(DevicePlacement::Cuda(vec![0]), 0, 0.0));
        assert_eq!(gpu.kv_cache_bytes, None);
        assert!((gpu.gpu_memory_utilization - 0.9).abs() < 1e-6);
        let gpu = engine_config(&spec(DevicePlacement::Cuda(vec![1]), 1 << 30, 0.5));
        assert_eq!(gpu.kv_cache_bytes, Some(1 << 30));
        assert!((gpu.gpu_memory_utilization - 0.5).abs() < 1e-6);
        assert_eq!(gpu.backend, BackendKind::Cuda { devices: vec![1] });
    }
}
