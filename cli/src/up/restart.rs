//! What `prism up` applies when its deployment is already in the state store (a restart on
//! `--store embedded:PATH` or etcd): the stored deployment, with the settings given on this
//! command line (or in the environment) on top. A setting changed since the deployment was
//! first applied (`prism scale`, `prism deploy -f`) is kept unless its flag is given again,
//! as re-applying an unchanged manifest with `kubectl apply` keeps a scaled Deployment's
//! replicas. The model and its served name are always this run's: they are what `prism up`
//! serves and name the deployment.

use clap::ArgMatches;
use clap::parser::ValueSource;
use prism_common::proto::v1::{DeploymentSpec, EngineConfig};
use std::collections::BTreeSet;

/// The `prism up` flags whose value came from the command line or an environment variable
/// rather than a default, by clap id (the `UpArgs` / `EngineFlags` field name: `replicas`,
/// `max_model_len`, …). Empty when the arguments were not parsed from a command line.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Given(BTreeSet<String>);

impl Given {
    /// The flags `matches` (of the `up` subcommand) got from the command line or the environment.
    pub fn of(matches: &ArgMatches) -> Self {
        let given =
            |id: &str| matches!(matches.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable));
        Self(matches.ids().map(|id| id.as_str()).filter(|id| given(id)).map(str::to_owned).collect())
    }

    /// Whether the flag with clap id `id` was given.
    pub fn contains(&self, id: &str) -> bool {
        self.0.contains(id)
    }
}

/// Calls `$m!` with the `EngineConfig` knobs that one `prism up` flag each sets (the clap id
/// of the flag is the field's name); `enable_prefix_caching`, which two flags set, is not in it.
macro_rules! engine_knobs {
    ($m:ident) => {
        $m!(
            max_model_len,
            tensor_parallel_size,
            pipeline_parallel_size,
            gpu_memory_utilization,
            batch_invariant,
            max_num_seqs,
            max_num_batched_tokens,
            block_size,
            kv_cache_bytes,
            backend,
            max_in_flight,
            chat_content_special_tokens,
            quantization,
            kv_cache_dtype,
        )
    };
}

/// The deployment `prism up` applies: `fresh` (built from its flags) when nothing is
/// `stored` under its name; else the stored deployment with the replica count and each
/// engine knob taken from `fresh` only when its flag was `given`, the model and served name
/// always from `fresh`, and the settings `prism up` has no flag for (bounds, placement,
/// `node_selector`, `autoscaling_config`, …) as stored.
pub fn deployment_to_apply(fresh: DeploymentSpec, stored: Option<&DeploymentSpec>, given: &Given) -> DeploymentSpec {
    let Some(stored) = stored else { return fresh };
    let mut spec = stored.clone();
    if given.contains("replicas") {
        spec.replicas = fresh.replicas;
    }
    spec.engine = match (fresh.engine, stored.engine.as_ref()) {
        (Some(fresh), Some(stored)) => Some(engine_to_apply(fresh, stored, given)),
        (fresh, _) => fresh,
    };
    spec
}

/// `fresh` with every knob whose flag was not `given` taken from `stored`.
fn engine_to_apply(fresh: EngineConfig, stored: &EngineConfig, given: &Given) -> EngineConfig {
    let mut engine = fresh;
    // The clap id of each engine flag is its `EngineConfig` field's name.
    macro_rules! keep_stored_unless_given {
        ($($knob:ident),* $(,)?) => {$(
            if !given.contains(stringify!($knob)) {
                engine.$knob.clone_from(&stored.$knob);
            }
        )*};
    }
    engine_knobs!(keep_stored_unless_given);
    // Two flags set this knob: `--enable-prefix-caching[=BOOL]` and `--no-enable-prefix-caching`.
    if !given.contains("enable_prefix_caching") && !given.contains("no_enable_prefix_caching") {
        engine.enable_prefix_caching = stored.enable_prefix_caching;
    }
    engine
}

/// What `applied` keeps from the store against `fresh` (what this run's flags alone say), as
/// `setting value` items for the restart notice: the replica count and each engine knob that
/// differs. Bounds, placement and autoscaling are not listed (no `prism up` flag sets them).
pub fn kept_settings(fresh: &DeploymentSpec, applied: &DeploymentSpec) -> Vec<String> {
    let mut kept = Vec::new();
    if applied.replicas != fresh.replicas {
        kept.push(format!("replicas {}", applied.replicas));
    }
    let (Some(f), Some(a)) = (fresh.engine.as_ref(), applied.engine.as_ref()) else { return kept };
    // `Some(512)` reads `512`, `"fp8"` reads `fp8`.
    let show = |v: String| {
        let v = v.strip_prefix("Some(").and_then(|x| x.strip_suffix(')')).map_or(v.clone(), str::to_owned);
        v.trim_matches('"').to_owned()
    };
    macro_rules! differing {
        ($($knob:ident),* $(,)?) => {$(
            if a.$knob != f.$knob {
                kept.push(format!("{} {}", stringify!($knob), show(format!("{:?}", a.$knob))));
            }
        )*};
    }
    engine_knobs!(differing);
    differing!(enable_prefix_caching);
    kept
}

#[cfg(test)]
mod tests {
    use super::super::args::parse_up as parse;
    use super::*;
    use clap::{CommandFactory, Parser};
    use prism_common::engine_flags::EngineFlags;
    use prism_common::proto::v1::{AutoscalingConfig, PlacementStrategy};

    fn given(ids: &[&str]) -> Given {
        Given(ids.iter().map(|id| (*id).to_owned()).collect())
    }

    fn fresh(replicas: u32) -> DeploymentSpec {
        DeploymentSpec {
            name: "smol".into(),
            engine: Some(EngineFlags::default().to_proto("/models/new.gguf", "Smol")),
            replicas,
            placement: PlacementStrategy::Spread as i32,
            ..DeploymentSpec::default()
        }
    }

    /// A deployment as `prism scale` and `prism deploy -f` may have left it: every setting
    /// differs from what `prism up` with no flags deploys.
    fn stored() -> anyhow::Result<DeploymentSpec> {
        let engine: EngineFlags = serde_yaml::from_str(
            "max_model_len: 2048\ntensor_parallel_size: 2\npipeline_parallel_size: 2\n\
             gpu_memory_utilization: 0.5\nbatch_invariant: true\nmax_num_seqs: 8\nmax_num_batched_tokens: 256\n\
             block_size: 32\nkv_cache_bytes: 1048576\nbackend: cpu\nmax_in_flight: 4\nenable_prefix_caching: false\n\
             chat_content_special_tokens: true\nquantization: fp8\nkv_cache_dtype: fp8\n",
        )?;
        Ok(DeploymentSpec {
            name: "smol".into(),
            engine: Some(engine.to_proto("/models/old.gguf", "Old")),
            replicas: 3,
            min_replicas: 1,
            max_replicas: 5,
            placement: PlacementStrategy::Pack as i32,
            node_selector: [("zone".to_owned(), "a".to_owned())].into(),
            min_on_demand: 1,
            autoscaling: None,
        })
    }

    #[test]
    fn a_new_deployment_is_what_the_flags_say() {
        assert_eq!(deployment_to_apply(fresh(2), None, &given(&["replicas"])), fresh(2));
        assert_eq!(deployment_to_apply(fresh(1), None, &Given::default()), fresh(1));
    }

    #[test]
    fn a_stored_deployment_keeps_its_replicas_and_settings_unless_a_flag_is_given() -> anyhow::Result<()> {
        let stored = stored()?;
        let kept = deployment_to_apply(fresh(1), Some(&stored), &Given::default());
        assert_eq!(kept.replicas, 3, "the scaled count survives a restart without --replicas");
        assert_eq!((kept.min_replicas, kept.max_replicas, kept.min_on_demand), (1, 5, 1));
        assert_eq!(kept.placement, PlacementStrategy::Pack as i32);
        assert_eq!(kept.node_selector.get("zone").map(String::as_str), Some("a"));
        let engine = kept.engine.clone().unwrap_or_default();
        assert_eq!((engine.model.as_str(), engine.served_model_name.as_str()), ("/models/new.gguf", "Smol"));
        let old = stored.engine.clone().unwrap_or_default();
        assert_eq!(
            engine,
            EngineConfig { model: engine.model.clone(), served_model_name: engine.served_model_name.clone(), ..old }
        );

        let explicit = deployment_to_apply(fresh(1), Some(&stored), &given(&["replicas", "max_num_seqs"]));
        assert_eq!(explicit.replicas, 1, "an explicit --replicas wins");
        let engine = explicit.engine.unwrap_or_default();
        assert_eq!(engine.max_num_seqs, None, "an explicit --max-num-seqs wins (0 = the default)");
        assert_eq!(engine.max_model_len, Some(2048), "knobs not given stay as stored");
        Ok(())
    }

    /// The restart notice names every kept setting with its value, and nothing when the store
    /// holds what the flags say.
    #[test]
    fn the_kept_settings_are_listed_with_their_values() -> anyhow::Result<()> {
        let stored = stored()?;
        let applied = deployment_to_apply(fresh(1), Some(&stored), &given(&["max_num_seqs"]));
        let kept = kept_settings(&fresh(1), &applied);
        for item in ["replicas 3", "max_model_len 2048", "kv_cache_dtype fp8", "quantization fp8", "backend cpu"] {
            assert!(kept.contains(&item.to_owned()), "{item} missing from {kept:?}");
        }
        assert!(!kept.iter().any(|k| k.starts_with("max_num_seqs")), "a flag given is not kept: {kept:?}");
        assert_eq!(kept.len(), 15, "replicas and every stored knob but max_num_seqs: {kept:?}");
        let same = deployment_to_apply(fresh(2), Some(&fresh(2)), &Given::default());
        assert_eq!(kept_settings(&fresh(2), &same), Vec::<String>::new());
        Ok(())
    }

    #[test]
    fn the_stored_autoscaling_config_is_kept() -> anyhow::Result<()> {
        let auto = AutoscalingConfig { min_replicas: 0, max_replicas: 2, ..AutoscalingConfig::default() };
        let stored = DeploymentSpec { replicas: 0, autoscaling: Some(auto), ..stored()? };
        let kept = deployment_to_apply(fresh(1), Some(&stored), &Given::default());
        assert_eq!((kept.replicas, kept.autoscaling), (0, Some(auto)));
        Ok(())
    }

    /// Every engine flag is wired: given alone, it makes its knob take this run's value.
    #[test]
    fn each_engine_flag_given_overrides_its_stored_knob() -> anyhow::Result<()> {
        #[derive(Parser)]
        struct Engine {
            #[command(flatten)]
            engine: EngineFlags,
        }
        let stored = stored()?;
        let kept = deployment_to_apply(fresh(1), Some(&stored), &Given::default()).engine.unwrap_or_default();
        let ids: Vec<String> = Engine::command()
            .get_arguments()
            .map(|a| a.get_id().as_str().to_owned())
            .filter(|id| id != "help" && id != "version")
            .collect();
        // A new knob: give it a non-default value in `stored` and wire it in `engine_to_apply`.
        assert_eq!(ids.len(), 16, "the engine flags: {ids:?}");
        for id in &ids {
            let one = deployment_to_apply(fresh(1), Some(&stored), &given(&[id])).engine.unwrap_or_default();
            assert_ne!(one, kept, "--{id} given leaves the stored knob in place");
        }
        Ok(())
    }

    #[test]
    fn flags_on_the_command_line_count_as_given() -> anyhow::Result<()> {
        let up = parse(&["--replicas", "2", "--max-model-len=4096"])?;
        assert!(up.given.contains("replicas") && up.given.contains("max_model_len"));
        assert!(!up.given.contains("tensor_parallel_size"), "a default is not given: {:?}", up.given);
        assert!(!up.given.contains("port"));
        let defaults = parse(&[])?;
        assert!(!defaults.given.contains("replicas"), "{:?}", defaults.given);
        assert_eq!(defaults.replicas, 1);
        let no_cache = parse(&["--no-enable-prefix-caching"])?;
        assert!(no_cache.given.contains("no_enable_prefix_caching"));
        Ok(())
    }
}
