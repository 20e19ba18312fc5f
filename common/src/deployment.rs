//! Validation of a deployment spec, as pure functions of the spec: the head runs
//! [`validate_spec`] on every `ApplyDeployment` and `prism deploy` (with `--dry-run` too)
//! runs the same function before it sends or prints anything, so a file the head would refuse
//! is refused with the head's own message. What needs the cluster (the model root, the
//! served-name owner, the nodes' capacity) stays with the head.

pub mod autoscaling;

use crate::proto::v1::DeploymentSpec;
use autoscaling::Params;

/// Largest accepted `tensor_parallel_size` (no node has more GPUs than this).
pub const MAX_TENSOR_PARALLEL: u32 = 1024;

/// A deployment spec the head refuses (`INVALID_ARGUMENT`); the message names the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidSpec(pub String);

/// The model name a deployment is served under (`served_model_name`, else its name: specs
/// stored before [`validate_spec`] filled it in may leave it empty).
pub fn served_name(spec: &DeploymentSpec) -> &str {
    spec.engine.as_ref().map(|e| e.served_model_name.as_str()).filter(|s| !s.is_empty()).unwrap_or(&spec.name)
}

/// True for a DNS-1123 label: 1–63 of `[a-z0-9-]`, starting and ending alphanumeric.
pub fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// Validates a deployment spec and fills defaults (`served_model_name` = name; a knob set to
/// 0 is unset; an autoscaled spec's `replicas` = its `initial_replicas`, else `min_replicas`).
///
/// # Errors
/// [`InvalidSpec`] naming the field.
pub fn validate_spec(mut spec: DeploymentSpec) -> Result<DeploymentSpec, InvalidSpec> {
    let bad = |m: String| Err(InvalidSpec(m));
    if !is_dns1123_label(&spec.name) {
        return bad(format!(
            "deployment name {:?} is not a DNS-1123 label (1-63 of a-z, 0-9, '-', alphanumeric at both ends)",
            spec.name
        ));
    }
    let Some(engine) = spec.engine.as_mut() else {
        return bad("engine is required".into());
    };
    if engine.model.trim().is_empty() {
        return bad("engine.model must not be empty".into());
    }
    if engine.tensor_parallel_size == 0 || engine.tensor_parallel_size > MAX_TENSOR_PARALLEL {
        return bad(format!(
            "engine.tensor_parallel_size must be between 1 and {MAX_TENSOR_PARALLEL}, got {}",
            engine.tensor_parallel_size
        ));
    }
    if let Some(pp) = engine.pipeline_parallel_size
        && (pp == 0 || pp > MAX_TENSOR_PARALLEL)
    {
        return bad(format!("engine.pipeline_parallel_size must be between 1 and {MAX_TENSOR_PARALLEL}, got {pp}"));
    }
    if let Some(u) = engine.gpu_memory_utilization
        && !(0.0..=1.0).contains(&u)
    {
        return bad(format!("engine.gpu_memory_utilization must be in [0, 1], got {u}"));
    }
    if !matches!(engine.quantization.as_str(), "" | "fp8") {
        return bad(format!("engine.quantization must be fp8 or unset, got {:?}", engine.quantization));
    }
    if !matches!(engine.kv_cache_dtype.as_str(), "" | "auto" | "bf16" | "fp8") {
        return bad(format!("engine.kv_cache_dtype must be auto, bf16 or fp8, got {:?}", engine.kv_cache_dtype));
    }
    if !matches!(engine.backend.as_str(), "" | "auto" | "cpu" | "cuda") {
        return bad(format!("engine.backend must be auto, cpu or cuda, got {:?}", engine.backend));
    }
    if engine.served_model_name.is_empty() {
        engine.served_model_name.clone_from(&spec.name);
    }
    crate::engine_flags::unset_zeros(engine);
    if let Some(a) = &spec.autoscaling {
        let p = Params::from_config(a).map_err(InvalidSpec)?;
        if spec.min_replicas != 0 || spec.max_replicas != 0 {
            return bad(format!(
                "min_replicas ({}) / max_replicas ({}) bound `prism scale` and cannot be combined with autoscaling_config; \
                 use autoscaling_config.min_replicas / max_replicas",
                spec.min_replicas, spec.max_replicas
            ));
        }
        // The autoscaler's target starts at initial_replicas (an update keeps the current
        // count: the head's `apply_deployment`).
        spec.replicas = p.initial_replicas;
        return Ok(spec);
    }
    check_replica_bounds(&spec, spec.replicas)?;
    Ok(spec)
}

/// Refuses a replica count outside the spec's `[min_replicas, max_replicas]` (a
/// `max_replicas` of 0 = no upper bound), or bounds that cross.
///
/// # Errors
/// [`InvalidSpec`] naming the bounds.
pub fn check_replica_bounds(spec: &DeploymentSpec, replicas: u32) -> Result<(), InvalidSpec> {
    let min = spec.min_replicas;
    let max = if spec.max_replicas == 0 { u32::MAX } else { spec.max_replicas };
    if min > max {
        return Err(InvalidSpec(format!("min_replicas {min} is greater than max_replicas {max}")));
    }
    if replicas > autoscaling::MAX_REPLICAS {
        return Err(InvalidSpec(format!("replicas must be at most {}, got {replicas}", autoscaling::MAX_REPLICAS)));
    }
    if replicas < min || replicas > max {
        return Err(InvalidSpec(format!(
            "replicas {replicas} is outside [min_replicas {min}, max_replicas {}]",
            spec.max_replicas
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::v1::{AutoscalingConfig, EngineConfig};

    fn spec() -> DeploymentSpec {
        DeploymentSpec {
            name: "smollm".into(),
            engine: Some(EngineConfig { model: "/m.gguf".into(), tensor_parallel_size: 1, ..Default::default() }),
            replicas: 1,
            ..Default::default()
        }
    }

    #[test]
    fn the_served_name_is_the_deployment_name_unless_set() {
        let mut s = spec();
        assert_eq!(served_name(&s), "smollm");
        if let Some(e) = s.engine.as_mut() {
            e.served_model_name = "llama".into();
        }
        assert_eq!(served_name(&s), "llama");
        s.engine = None;
        assert_eq!(served_name(&s), "smollm");
    }

    #[test]
    fn names() {
        assert!(is_dns1123_label("llama-3-8b"));
        for bad in ["", "-a", "a-", "Llama", "a_b", "a.b", &"a".repeat(64)] {
            assert!(!is_dns1123_label(bad), "{bad}");
        }
    }

    #[test]
    fn spec_validation() {
        let s = validate_spec(spec()).expect("valid");
        assert_eq!(s.engine.map(|e| e.served_model_name), Some("smollm".to_owned()));
        let mut s = spec();
        s.engine = s.engine.map(|e| EngineConfig { tensor_parallel_size: 0, ..e });
        assert!(validate_spec(s).is_err());
        let mut s = spec();
        s.engine = s.engine.map(|e| EngineConfig { model: " ".into(), ..e });
        assert!(validate_spec(s).is_err());
        let mut s = spec();
        s.name = "Bad_Name".into();
        assert!(validate_spec(s).is_err());
        let mut s = spec();
        s.engine = None;
        assert!(validate_spec(s).is_err());
        let mut s = spec();
        s.replicas = 5;
        s.max_replicas = 3;
        assert_eq!(
            validate_spec(s).err().map(|e| e.0),
            Some("replicas 5 is outside [min_replicas 0, max_replicas 3]".into())
        );
        // A count no cluster holds (a typo for 10) is refused, with or without bounds: its
        // Pending replicas would swamp the store and every status answer.
        let s = spec();
        assert_eq!(
            check_replica_bounds(&s, 10_001).err().map(|e| e.0),
            Some("replicas must be at most 10000, got 10001".into())
        );
        assert!(check_replica_bounds(&s, 100_000).is_err());
        assert!(check_replica_bounds(&s, 10_000).is_ok());
        let mut s = spec();
        s.min_replicas = 2;
        assert!(validate_spec(s).is_err());
    }

    /// Zeros are unset (the engine's defaults), as before the protocol tracked presence.
    #[test]
    fn zero_knobs_are_accepted_as_unset() {
        let mut s = spec();
        s.engine = s.engine.map(|e| EngineConfig { block_size: Some(0), max_num_seqs: Some(0), ..e });
        let e = validate_spec(s).expect("valid").engine.expect("engine");
        assert_eq!((e.block_size, e.max_num_seqs), (None, None));
    }

    #[test]
    fn autoscaling_specs() {
        let auto = |min, max, initial| AutoscalingConfig {
            min_replicas: min,
            max_replicas: max,
            initial_replicas: initial,
            ..Default::default()
        };
        // initial_replicas (else min) is the starting count, whatever `replicas` says.
        let s = validate_spec(DeploymentSpec { autoscaling: Some(auto(1, 3, None)), replicas: 0, ..spec() });
        assert_eq!(s.expect("valid").replicas, 1);
        let s = validate_spec(DeploymentSpec { autoscaling: Some(auto(1, 3, Some(2))), replicas: 7, ..spec() });
        assert_eq!(s.expect("valid").replicas, 2);
        let s = validate_spec(DeploymentSpec { autoscaling: Some(auto(0, 3, None)), replicas: 0, ..spec() });
        assert_eq!(s.expect("valid").replicas, 0);
        let Err(InvalidSpec(m)) = validate_spec(DeploymentSpec { autoscaling: Some(auto(3, 1, None)), ..spec() })
        else {
            panic!("min > max accepted");
        };
        assert_eq!(m, "autoscaling_config.min_replicas (3) is greater than max_replicas (1)");
        let both = DeploymentSpec { autoscaling: Some(auto(1, 3, None)), max_replicas: 3, ..spec() };
        assert!(matches!(validate_spec(both), Err(InvalidSpec(m)) if m.contains("autoscaling_config")));
    }

    #[test]
    fn parallel_sizes_name_their_field() {
        let with = |tp: u32, pp: Option<u32>| DeploymentSpec {
            engine: spec().engine.map(|e| EngineConfig { tensor_parallel_size: tp, pipeline_parallel_size: pp, ..e }),
            ..spec()
        };
        let Err(InvalidSpec(m)) = validate_spec(with(0, None)) else { panic!("tp 0 accepted") };
        assert_eq!(m, "engine.tensor_parallel_size must be between 1 and 1024, got 0");
        let Err(InvalidSpec(m)) = validate_spec(with(2, Some(0))) else { panic!("pp 0 accepted") };
        assert_eq!(m, "engine.pipeline_parallel_size must be between 1 and 1024, got 0");
        let s = validate_spec(with(2, Some(3))).expect("valid");
        assert_eq!(s.engine.and_then(|e| e.pipeline_parallel_size), Some(3));
    }
}
