//! The real [`EngineLauncher`]: checks the model path, then starts an engine replica with the
//! engine crate's `EngineHandle` and adapts it to [`ReplicaEngine`].

use super::replica::{DevicePlacement, EngineLauncher, EngineLoad, LaunchSpec, ReplicaEngine, ReplicaOutputStream};
use futures::StreamExt;
use prism_engine::codec::CodecExport;
use prism_engine::kv_cache::CacheEvents;
use prism_engine::parallel::ParallelConfig;
use prism_engine::parallel::spawn::RankProgram;
use prism_engine::{
    BackendKind, EngineConfig, EngineError, EngineHandle, EngineRequest, Fault, KvCacheDtype, ModelInfo, Quantization,
};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

impl ReplicaEngine for EngineHandle {
    fn submit(&self, req: EngineRequest) -> Result<ReplicaOutputStream, EngineError> {
        EngineHandle::submit(self, req).map(|s| s.boxed())
    }

    fn load(&self) -> EngineLoad {
        let s = self.stats();
        let n = |v: usize| u32::try_from(v).unwrap_or(u32::MAX);
        EngineLoad {
            running: n(s.running),
            waiting: n(s.waiting),
            kv_cache_usage: s.kv_cache_usage as f32,
            num_preemptions_total: s.num_preemptions_total,
            max_num_seqs: n(self.max_num_seqs()),
            free_kv_blocks: n(s.free_blocks),
            total_kv_blocks: n(s.total_blocks),
            block_size: n(self.model_info().block_size),
            prefix_cache_queries_total: s.prefix_cache_queries_total,
            prefix_cache_hits_total: s.prefix_cache_hits_total,
            prompt_tokens_computed_total: s.prompt_tokens_computed_total,
        }
    }

    fn is_alive(&self) -> bool {
        EngineHandle::is_alive(self)
    }

    fn failure(&self) -> Option<String> {
        EngineHandle::failure(self)
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

    fn model_info(&self) -> Option<ModelInfo> {
        Some(EngineHandle::model_info(self))
    }

    fn codec_export(&self) -> Option<CodecExport> {
        EngineHandle::codec_export(self)
    }

    fn prefix_cache_events(&self, after: u64) -> CacheEvents {
        EngineHandle::prefix_cache_events(self, after)
    }

    fn inject_fault(&self, fault: Fault) -> Result<(), EngineError> {
        EngineHandle::inject_fault(self, fault)
    }
}

/// The engine configuration of a launch spec: the one mapping from the protocol's
/// `EngineConfig` to the engine's. An absent knob takes the engine's default
/// ([`EngineConfig::new`], the backend's step token budget); the KV-cache budget of a CPU
/// replica that sets none is the worker's (`LaunchSpec::kv_cache_bytes`). A parallel replica
/// (tensor × pipeline size above 1) gets its rank group: the sizes, this node's ranks (rank
/// 0 first; on CUDA `devices[i]` is rank `local_ranks[i]`'s GPU), the rendezvous bound for
/// ranks of other nodes, the running executable as the program of the local ranks, and the
/// worker's collective and join timeouts.
pub fn engine_config(spec: &LaunchSpec) -> EngineConfig {
    let e = &spec.engine;
    let backend = match &spec.placement {
        DevicePlacement::Cpu => BackendKind::Cpu,
        DevicePlacement::Cuda(devices) => BackendKind::Cuda { devices: devices.clone() },
    };
    let base = EngineConfig::new(&e.model);
    let size = |v: Option<u32>, default: usize| v.map_or(default, |n| n as usize);
    EngineConfig {
        served_model_name: if e.served_model_name.is_empty() { e.model.clone() } else { e.served_model_name.clone() },
        max_model_len: e.max_model_len.map(|n| n as usize),
        block_size: size(e.block_size, base.block_size),
        max_num_seqs: size(e.max_num_seqs, base.max_num_seqs),
        max_num_batched_tokens: size(e.max_num_batched_tokens, backend.default_max_num_batched_tokens()),
        engine_threads: spec.engine_threads,
        // A CUDA replica sizes its KV cache from gpu_memory_utilization unless the deployment
        // set a budget itself.
        kv_cache_bytes: match &spec.placement {
            DevicePlacement::Cpu => Some(spec.kv_cache_bytes),
            DevicePlacement::Cuda(_) => e.kv_cache_bytes,
        },
        gpu_memory_utilization: e.gpu_memory_utilization.unwrap_or(base.gpu_memory_utilization),
        backend,
        batch_invariant: e.batch_invariant,
        // Absent = on, vLLM's default.
        enable_prefix_caching: e.enable_prefix_caching.unwrap_or(base.enable_prefix_caching),
        parallel: parallel_config(spec),
        chat_content_special_tokens: e.chat_content_special_tokens,
        // The head accepts only these spellings (its validation of `engine`).
        quantization: if e.quantization == "fp8" { Quantization::Fp8 } else { base.quantization },
        kv_cache_dtype: if e.kv_cache_dtype == "fp8" { KvCacheDtype::Fp8 } else { base.kv_cache_dtype },
        ..base
    }
}

/// The engine's [`ParallelConfig`] of a launch spec (the default, one in-process rank, for
/// an unsharded replica).
fn parallel_config(spec: &LaunchSpec) -> ParallelConfig {
    let p = &spec.parallel;
    if p.sizes.is_single() {
        return ParallelConfig::default();
    }
    ParallelConfig {
        sizes: p.sizes,
        local_ranks: p.local_ranks.clone(),
        rendezvous: p.rendezvous.clone(),
        rank_program: p.rank_program.clone().or_else(|| RankProgram::current_exe().ok()),
        join_timeout: p.join_timeout,
        collective_timeout: p.collective_timeout,
        ..ParallelConfig::default()
    }
}

/// The reason a replica whose engine did not start is Failed with (`prism status`, and the
/// 503 of a request for its model): "model failed to load: …" with the engine's own message,
/// never "engine internal error", since a load failure is most often the deployment's (a
/// model path that does not exist, a file that is not a model).
pub fn load_failure(e: &EngineError) -> String {
    let detail = match e {
        EngineError::InvalidRequest { message, .. } => message.as_str(),
        EngineError::Overloaded(m) | EngineError::Unavailable(m) | EngineError::Internal(m) => m.as_str(),
    };
    format!("model failed to load: {detail}")
}

/// Launches replicas on this worker's engine, loading models only from under the model root
/// when one is set.
#[derive(Clone, Debug, Default)]
pub struct LocalLauncher {
    model_root: Option<PathBuf>,
}

impl LocalLauncher {
    /// A launcher; with `model_root`, a model path outside it (lexically, or through a
    /// symlink) fails the replica ([`prism_common::model_root::check_on_disk`]).
    pub fn new(model_root: Option<PathBuf>) -> Self {
        Self { model_root }
    }
}

impl EngineLauncher for LocalLauncher {
    fn launch(&self, spec: &LaunchSpec) -> Result<Arc<dyn ReplicaEngine>, EngineError> {
        if spec.engine.model.is_empty() {
            return Err(EngineError::InvalidRequest { field: "model", message: "model path is empty".into() });
        }
        let mut config = engine_config(spec);
        if let Some(root) = &self.model_root {
            let path = prism_common::model_root::check_on_disk(root, &spec.engine.model)
                .map_err(|e| EngineError::InvalidRequest { field: "engine.model", message: e.to_string() })?;
            config.model = path;
        }
        let model = config.model.as_path();
        if !model.exists() {
            return Err(EngineError::InvalidRequest {
                field: "engine.model",
                message: format!("model path {} does not exist", model.display()),
            });
        }
        let handle = EngineHandle::start(config, None)?;
        Ok(Arc::new(handle))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_common::proto::v1 as pb;

    fn spec(placement: DevicePlacement, kv: Option<u64>, util: Option<f32>) -> LaunchSpec {
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
            parallel: super::super::replica::ParallelLaunch::default(),
        }
    }

    /// A sharded replica's engine gets its rank group; an unsharded one the one-rank default.
    #[test]
    fn a_parallel_replica_gets_its_rank_group_and_the_workers_timeouts() {
        let single = engine_config(&spec(DevicePlacement::Cpu, None, None)).parallel;
        assert!(single.sizes.is_single());
        assert_eq!((single.local_ranks, single.rank_program), (vec![0], None));
        let mut s = spec(DevicePlacement::Cuda(vec![2, 3]), None, None);
        s.parallel = super::super::replica::ParallelLaunch {
            sizes: prism_engine::parallel::ParallelSizes::new(2, 2),
            local_ranks: vec![0, 1],
            rendezvous: None,
            collective_timeout: Duration::from_secs(3),
            join_timeout: Duration::from_secs(90),
            rank_program: None,
        };
        let cfg = engine_config(&s);
        let p = &cfg.parallel;
        assert_eq!((p.sizes.world_size(), p.local_ranks.clone()), (4, vec![0, 1]));
        assert_eq!((p.collective_timeout, p.join_timeout), (Duration::from_secs(3), Duration::from_secs(90)));
        assert_eq!(p.rank_program, RankProgram::current_exe().ok(), "local ranks run this executable");
        assert!(p.rank0_in_process);
        assert_eq!(cfg.backend, BackendKind::Cuda { devices: vec![2, 3] }, "one GPU per local rank, in rank order");
    }

    #[test]
    fn step_token_budget_defaults_per_backend_and_keeps_an_explicit_value() {
        assert_eq!(engine_config(&spec(DevicePlacement::Cpu, None, None)).max_num_batched_tokens, 512);
        assert_eq!(engine_config(&spec(DevicePlacement::Cuda(vec![0]), None, None)).max_num_batched_tokens, 2048);
        let mut s = spec(DevicePlacement::Cpu, None, None);
        s.engine.max_num_batched_tokens = Some(4096);
        s.engine_threads = Some(3);
        let cfg = engine_config(&s);
        assert_eq!(cfg.max_num_batched_tokens, 4096);
        assert_eq!(cfg.engine_threads, Some(3));
    }

    #[test]
    fn cuda_replicas_size_kv_from_gpu_memory_unless_the_deployment_set_a_budget() {
        let cpu = engine_config(&spec(DevicePlacement::Cpu, None, None));
        assert_eq!(cpu.kv_cache_bytes, Some(64 << 20));
        let gpu = engine_config(&spec(DevicePlacement::Cuda(vec![0]), None, None));
        assert_eq!(gpu.kv_cache_bytes, None);
        assert!((gpu.gpu_memory_utilization - 0.9).abs() < 1e-6);
        let gpu = engine_config(&spec(DevicePlacement::Cuda(vec![1]), Some(1 << 30), Some(0.5)));
        assert_eq!(gpu.kv_cache_bytes, Some(1 << 30));
        assert!((gpu.gpu_memory_utilization - 0.5).abs() < 1e-6);
        assert_eq!(gpu.backend, BackendKind::Cuda { devices: vec![1] });
    }

    #[test]
    fn absent_knobs_take_the_engines_defaults_and_set_ones_pass_through() {
        let defaults = engine_config(&spec(DevicePlacement::Cpu, None, None));
        let engine = EngineConfig::new("/m");
        assert_eq!((defaults.max_model_len, defaults.block_size), (None, engine.block_size));
        assert_eq!((defaults.max_num_seqs, defaults.batch_invariant), (engine.max_num_seqs, false));
        assert_eq!(defaults.served_model_name, "/m");
        let mut s = spec(DevicePlacement::Cpu, Some(1 << 20), None);
        s.engine.served_model_name = "smol".into();
        s.engine.max_model_len = Some(1024);
        s.engine.block_size = Some(32);
        s.engine.max_num_seqs = Some(8);
        s.engine.batch_invariant = true;
        let cfg = engine_config(&s);
        assert_eq!(cfg.served_model_name, "smol");
        assert_eq!((cfg.max_model_len, cfg.block_size, cfg.max_num_seqs), (Some(1024), 32, 8));
        assert!(cfg.batch_invariant);
        assert!(defaults.enable_prefix_caching, "prefix caching is on unless the deployment turns it off");
        s.engine.enable_prefix_caching = Some(false);
        assert!(!engine_config(&s).enable_prefix_caching);
        s.engine.enable_prefix_caching = Some(true);
        assert!(engine_config(&s).enable_prefix_caching);
        assert!(
            !defaults.chat_content_special_tokens,
            "chat message text is plain text unless the deployment opts out"
        );
        s.engine.chat_content_special_tokens = true;
        assert!(engine_config(&s).chat_content_special_tokens);
        // A CPU replica's budget is the worker's, already resolved into the launch spec.
        assert_eq!(cfg.kv_cache_bytes, Some(64 << 20));
    }

    /// With a model root, a path outside it or a link out of it fails the launch naming
    /// `engine.model` before anything is loaded.
    #[test]
    fn model_paths_outside_the_root_fail_the_launch() -> Result<(), Box<dyn std::error::Error>> {
        let tmp = tempfile::tempdir()?;
        let root = tmp.path().join("models");
        std::fs::create_dir_all(&root)?;
        std::fs::write(tmp.path().join("outside.gguf"), b"GGUF")?;
        std::os::unix::fs::symlink(tmp.path().join("outside.gguf"), root.join("link.gguf"))?;
        let launcher = LocalLauncher::new(Some(root.clone()));
        for (model, needle) in [
            (tmp.path().join("outside.gguf").display().to_string(), "is outside the model root"),
            (root.join("link.gguf").display().to_string(), "a symlink points out of it"),
            (format!("{}/../outside.gguf", root.display()), "`..`"),
            (root.join("missing.gguf").display().to_string(), "No such file"),
        ] {
            let mut s = spec(DevicePlacement::Cpu, None, None);
            s.engine.model = model.clone();
            let e = launcher.launch(&s).err().ok_or("must fail")?;
            assert!(
                matches!(&e, EngineError::InvalidRequest { field: "engine.model", message } if message.contains(needle)),
                "{model}: {e}"
            );
        }
        Ok(())
    }

    /// A model file that is not there fails the replica as a load failure naming the path,
    /// not as an engine internal error.
    #[test]
    fn a_missing_model_is_a_load_failure() {
        let mut s = spec(DevicePlacement::Cpu, None, None);
        s.engine.model = "models/does-not-exist.gguf".into();
        let e = LocalLauncher::default().launch(&s).err().expect("a missing model fails");
        let reason = load_failure(&e);
        assert!(reason.starts_with("model failed to load: "), "{reason}");
        assert!(reason.contains("models/does-not-exist.gguf") && !reason.contains("internal"), "{reason}");
    }

    /// The load a real replica reports carries its capacity: the launch spec's `max_num_seqs`,
    /// the block pool's size and the block size, every block free while idle.
    #[test]
    fn real_engine_load_reports_its_capacity() {
        let model = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        if !std::path::Path::new(model).exists() {
            eprintln!("skipping: {model} not present");
            return;
        }
        let mut s = spec(DevicePlacement::Cpu, None, None);
        s.engine.model = model.into();
        s.engine.max_num_seqs = Some(4);
        s.engine.block_size = Some(16);
        s.kv_cache_bytes = 8 << 20;
        s.engine_threads = Some(1);
        let engine = LocalLauncher::default().launch(&s).expect("the bundled model loads");
        let load = engine.load();
        // The prompt codec a router gets: the engine's export, its fingerprint, the block size
        // and namespace of its prefix cache (on by default).
        let replica = super::super::replica::Replica::new("r1".into(), "d".into(), "m".into(), vec![0]);
        replica.set_engine(Arc::clone(&engine));
        let codec = replica.prompt_codec().expect("the bundled model's codec exports");
        let export = engine.codec_export().expect("export");
        assert_eq!(codec.fingerprint, export.fingerprint());
        assert_eq!(prism_engine::codec::CodecExport::from_json(&codec.codec_json).ok(), Some(export));
        let info = engine.model_info().expect("info");
        assert_eq!((codec.block_size, codec.cache_namespace, codec.prefix_caching), (16, info.cache_namespace, true));
        engine.shutdown();
        assert_eq!((load.max_num_seqs, load.block_size), (4, 16));
        assert!(load.total_kv_blocks > 0, "{load:?}");
        assert_eq!(load.free_kv_blocks, load.total_kv_blocks, "an idle engine holds no block");
        assert_eq!((load.running, load.waiting), (0, 0));
    }
}
