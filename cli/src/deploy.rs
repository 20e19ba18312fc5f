//! `prism deploy -f FILE`: applies a deployment described in YAML. Engine arguments use
//! vLLM's names; unknown fields are rejected so a typo never silently takes a default.
//!
//! ```yaml
//! name: smollm2
//! model: models/SmolLM2-135M-Instruct.Q4_1.gguf   # GGUF file or Hugging Face directory, as the worker sees it
//! served_model_name: smollm2                      # optional, default = name
//! engine:                                         # optional; 0/absent = the engine's default
//!   tensor_parallel_size: 1                       # the keys are `prism up`'s engine flags
//!   pipeline_parallel_size: 1                     # stages; a replica holds tp x pp GPUs (CPU slots)
//!   max_model_len: 2048                           # (prism_common::engine_flags::EngineFlags)
//!   block_size: 16
//!   max_num_seqs: 64
//!   max_num_batched_tokens: 2048
//!   gpu_memory_utilization: 0.9
//!   enable_prefix_caching: true                   # automatic prefix caching (default on)
//! replicas: 2                                     # fixed count (default 1) ...
//! placement: spread                               # spread | pack
//! node_selector: { capacity-type: on-demand }
//! ```
//!
//! ... or, instead of `replicas` (and of the `prism scale` bounds `min_replicas` /
//! `max_replicas`), Ray Serve's `autoscaling_config` with its names, units and defaults:
//!
//! ```yaml
//! autoscaling_config:
//!   min_replicas: 1               # 0 = scale to zero when idle
//!   max_replicas: 4
//!   initial_replicas: 1           # default min_replicas
//!   target_ongoing_requests: 2    # running + waiting + queued per replica (default 2)
//!   target_kv_cache_usage: 0.9    # optional: also scale up above this mean KV usage
//!   upscale_delay_s: 30           # default 30
//!   downscale_delay_s: 600        # default 600
//!   look_back_period_s: 30        # default 30
//!   upscaling_factor: 1.0         # default 1
//!   downscaling_factor: 1.0       # default 1
//! ```

use crate::client;
use anyhow::{Context, Result, anyhow, bail};
use clap::Args;
use prism_common::engine_flags::EngineFlags;
use prism_common::proto::v1::{
    ApplyDeploymentRequest, ApplyDeploymentResponse, AutoscalingConfig, DeploymentSpec, PlacementStrategy,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// `prism deploy` flags.
#[derive(Args, Debug)]
pub struct DeployArgs {
    /// YAML deployment file (`-` = stdin).
    #[arg(short = 'f', long = "file", env = "PRISM_DEPLOY_FILE")]
    pub file: PathBuf,
    /// Validate and print the deployment as it would be applied, without applying it: YAML
    /// with the file's keys and the deployment's defaults filled in (`prism deploy -f` reads
    /// it back). Engine knobs left out (`block_size`, `max_num_seqs`, ...) stay out: each
    /// replica's engine picks them for its backend, as vLLM does.
    #[arg(long, env = "PRISM_DRY_RUN")]
    pub dry_run: bool,
}

/// A deployment file (serialized with the same keys, absent ones left out).
#[derive(Debug, Deserialize, Serialize, Clone, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DeploymentFile {
    /// Deployment name (DNS-1123 label).
    pub name: String,
    /// GGUF file or Hugging Face directory, as the worker sees it.
    pub model: String,
    /// Model name clients use (default: `name`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_model_name: Option<String>,
    /// Engine knobs (vLLM names, the same as `prism up`'s engine flags).
    #[serde(default)]
    pub engine: EngineFlags,
    /// Number of replicas (default 1; not with `autoscaling_config`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u32>,
    /// Lower bound for `prism scale` (not with `autoscaling_config`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_replicas: Option<u32>,
    /// Upper bound for `prism scale` (not with `autoscaling_config`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_replicas: Option<u32>,
    /// Ray Serve's autoscaling config: the head's autoscaler owns the replica count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub autoscaling_config: Option<AutoscalingFile>,
    /// `spread` (default) or `pack`.
    #[serde(default)]
    pub placement: PlacementArg,
    /// Only nodes with all these labels are used.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,
    /// The first N replicas prefer `capacity-type=on-demand` nodes.
    #[serde(default)]
    pub min_on_demand: u32,
}

/// The `autoscaling_config:` block: Ray Serve's names, units (seconds) and defaults (see
/// the module docs); absent keys take the default.
#[derive(Debug, Deserialize, Serialize, Clone, Default, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AutoscalingFile {
    /// Lower bound (0 = scale to zero when idle).
    #[serde(default)]
    pub min_replicas: u32,
    /// Upper bound (≥ max(1, min_replicas)).
    pub max_replicas: u32,
    /// Replicas at creation (default `min_replicas`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initial_replicas: Option<u32>,
    /// Running + waiting + queued requests per replica (default 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_ongoing_requests: Option<f64>,
    /// Mean KV-cache usage in (0, 1] above which one more replica is added (default off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_kv_cache_usage: Option<f64>,
    /// Seconds a higher target must hold (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upscale_delay_s: Option<f64>,
    /// Seconds a lower target must hold (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downscale_delay_s: Option<f64>,
    /// Seconds the load is averaged over (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub look_back_period_s: Option<f64>,
    /// Multiplies each upscale step (> 0, default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upscaling_factor: Option<f64>,
    /// Multiplies each downscale step (> 0, default 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub downscaling_factor: Option<f64>,
}

impl AutoscalingFile {
    /// The protocol's `AutoscalingConfig`.
    pub fn to_proto(&self) -> AutoscalingConfig {
        AutoscalingConfig {
            min_replicas: self.min_replicas,
            max_replicas: self.max_replicas,
            initial_replicas: self.initial_replicas,
            target_ongoing_requests: self.target_ongoing_requests,
            target_kv_cache_usage: self.target_kv_cache_usage,
            upscale_delay_s: self.upscale_delay_s,
            downscale_delay_s: self.downscale_delay_s,
            look_back_period_s: self.look_back_period_s,
            upscaling_factor: self.upscaling_factor,
            downscaling_factor: self.downscaling_factor,
        }
    }
}

/// Placement strategy of a deployment's replicas.
#[derive(Debug, Deserialize, Serialize, Clone, Copy, Default, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum PlacementArg {
    /// Over as many nodes as possible.
    #[default]
    Spread,
    /// Fill nodes first.
    Pack,
}

impl DeploymentFile {
    /// Parses and validates a YAML document.
    ///
    /// # Errors
    /// Fails on YAML errors, unknown fields, or invalid values (named in the message).
    pub fn parse(yaml: &str) -> Result<Self> {
        let file: Self = serde_yaml::from_str(yaml).context("invalid deployment file")?;
        file.validate()?;
        Ok(file)
    }

    fn validate(&self) -> Result<()> {
        // The one key combination the spec cannot show (`to_spec` drops `replicas` then).
        if self.autoscaling_config.is_some() && self.replicas.is_some() {
            bail!(
                "replicas cannot be combined with autoscaling_config (the autoscaler owns the count); \
                 use autoscaling_config.initial_replicas"
            );
        }
        // The head's own validation of the spec (the same function, so the same message):
        // whatever the head would refuse on apply is refused here, `--dry-run` included.
        prism_common::deployment::validate_spec(self.to_spec())?;
        // Stricter than the head where a zero would silently mean the default.
        self.engine.validate().map_err(|e| anyhow!("engine.{e}"))?;
        Ok(())
    }

    /// The same deployment with the defaults [`DeploymentFile::to_spec`] applies written out
    /// (the served name; the replica count of a fixed-size deployment): what `--dry-run`
    /// shows. Its spec is the same.
    pub fn with_defaults(&self) -> Self {
        let mut file = self.clone();
        file.served_model_name.get_or_insert_with(|| self.name.clone());
        if file.autoscaling_config.is_none() {
            file.replicas.get_or_insert(1);
        }
        file
    }

    /// What `prism deploy --dry-run` prints: [`DeploymentFile::with_defaults`] as YAML, with
    /// the keys of a deployment file, so it reads as one and `prism deploy -f` takes it back.
    ///
    /// # Errors
    /// Only if serialization fails (it does not for a parsed file).
    pub fn dry_run_yaml(&self) -> Result<String> {
        serde_yaml::to_string(&self.with_defaults()).context("cannot write the deployment as YAML")
    }

    /// The protocol's `DeploymentSpec` (absent counts and bounds are 0 = default).
    pub fn to_spec(&self) -> DeploymentSpec {
        let served = self.served_model_name.as_deref().unwrap_or(&self.name);
        DeploymentSpec {
            name: self.name.clone(),
            engine: Some(self.engine.to_proto(self.model.as_str(), served)),
            replicas: match &self.autoscaling_config {
                Some(a) => a.initial_replicas.unwrap_or(a.min_replicas),
                None => self.replicas.unwrap_or(1),
            },
            min_replicas: self.min_replicas.unwrap_or(0),
            max_replicas: self.max_replicas.unwrap_or(0),
            placement: match self.placement {
                PlacementArg::Spread => PlacementStrategy::Spread,
                PlacementArg::Pack => PlacementStrategy::Pack,
            } as i32,
            node_selector: self.node_selector.clone().into_iter().collect(),
            min_on_demand: self.min_on_demand,
            autoscaling: self.autoscaling_config.as_ref().map(AutoscalingFile::to_proto),
        }
    }
}

/// Runs `prism deploy`.
///
/// # Errors
/// Fails when the file is unreadable or invalid, or the head rejects the deployment.
pub async fn run(head_addr: &client::HeadTarget, args: DeployArgs) -> Result<()> {
    let yaml = if args.file.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())?
    } else {
        std::fs::read_to_string(&args.file).with_context(|| format!("cannot read {}", args.file.display()))?
    };
    let file = DeploymentFile::parse(&yaml)?;
    let spec = file.to_spec();
    // The engine's model checks when the model is here too (else the engine checks at load).
    if let Some(engine) = &spec.engine {
        crate::model_check::check_parallel(engine).with_context(|| format!("model {}", engine.model))?;
    }
    if args.dry_run {
        return crate::output::write_stdout(&file.dry_run_yaml()?);
    }
    let mut head = client::Head::connect(head_addr).await?;
    let request = ApplyDeploymentRequest { spec: Some(spec) };
    let response = head
        .call(|mut h| {
            let request = request.clone();
            async move { h.apply_deployment(request).await }
        })
        .await?;
    println!("{}; watch it with `prism status`", applied_message(&file.name, &response));
    Ok(())
}

/// What `prism deploy` says of an applied deployment. The generation counts replica
/// templates (it grows only on an engine or `node_selector` change, which replaces the
/// replicas), so an update of anything else, `autoscaling_config` included, keeps it: the
/// message says so, and whether the deployment is autoscaled now.
fn applied_message(name: &str, response: &ApplyDeploymentResponse) -> String {
    let generation = response.deployment.as_ref().map_or(0, |d| d.generation);
    if response.created {
        return format!("deployment {name} created (generation {generation})");
    }
    let autoscaled =
        response.deployment.as_ref().and_then(|d| d.spec.as_ref()).is_some_and(|s| s.autoscaling.is_some());
    format!(
        "deployment {name} updated (generation {generation}, autoscaling {}; only an engine or node_selector \
         change starts a new generation, which replaces the replicas)",
        if autoscaled { "on" } else { "off" }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const FULL: &str = r#"
name: smollm2
model: models/SmolLM2-135M-Instruct.Q4_1.gguf
served_model_name: smol
engine:
  tensor_parallel_size: 2
  max_model_len: 2048
  block_size: 16
  max_num_seqs: 64
  max_num_batched_tokens: 1024
  gpu_memory_utilization: 0.85
replicas: 3
placement: pack
node_selector:
  capacity-type: on-demand
"#;

    #[test]
    fn an_update_says_whether_it_is_autoscaled_and_what_the_generation_means() {
        use prism_common::proto::v1::DeploymentRecord;
        let response = |created: bool, autoscaling: Option<AutoscalingConfig>| ApplyDeploymentResponse {
            created,
            deployment: Some(DeploymentRecord {
                spec: Some(DeploymentSpec { autoscaling, ..DeploymentSpec::default() }),
                generation: 1,
                ..DeploymentRecord::default()
            }),
        };
        assert_eq!(applied_message("gemma", &response(true, None)), "deployment gemma created (generation 1)");
        let on = applied_message("gemma", &response(false, Some(AutoscalingConfig::default())));
        assert!(on.starts_with("deployment gemma updated (generation 1, autoscaling on; only an engine"), "{on}");
        let off = applied_message("gemma", &response(false, None));
        assert!(off.contains("autoscaling off") && off.contains("replaces the replicas"), "{off}");
    }

    #[test]
    fn full_file_maps_to_spec() -> Result<()> {
        let spec = DeploymentFile::parse(FULL)?.to_spec();
        assert_eq!(spec.name, "smollm2");
        assert_eq!(spec.replicas, 3);
        assert_eq!(spec.placement, PlacementStrategy::Pack as i32);
        assert_eq!(spec.node_selector.get("capacity-type").map(String::as_str), Some("on-demand"));
        let engine = spec.engine.context("engine")?;
        assert_eq!(engine.served_model_name, "smol");
        assert_eq!(engine.tensor_parallel_size, 2);
        assert_eq!(engine.max_model_len, Some(2048));
        assert_eq!(engine.block_size, Some(16));
        assert_eq!(engine.max_num_seqs, Some(64));
        assert_eq!(engine.max_num_batched_tokens, Some(1024));
        assert!((engine.gpu_memory_utilization.context("gpu_memory_utilization")? - 0.85).abs() < 1e-6);
        Ok(())
    }

    #[test]
    fn dry_run_prints_a_deployment_file_that_reads_back_as_the_same_deployment() -> Result<()> {
        let files = [
            FULL,
            "name: a\nmodel: /m.gguf\n",
            "name: a\nmodel: m\nengine: {enable_prefix_caching: false, backend: cpu}\nmin_replicas: 1\nmax_replicas: 4\n",
            include_str!("../../docs/examples/smollm2-autoscaled.yaml"),
        ];
        for yaml in files {
            let file = DeploymentFile::parse(yaml)?;
            let printed = file.dry_run_yaml()?;
            let back = DeploymentFile::parse(&printed).with_context(|| format!("re-reading:\n{printed}"))?;
            assert_eq!(back.to_spec(), file.to_spec(), "{printed}");
            assert_eq!(back, file.with_defaults(), "{printed}");
        }

        // The keys a user writes, with the defaults that apply filled in.
        let full: serde_yaml::Value = serde_yaml::from_str(&DeploymentFile::parse(FULL)?.dry_run_yaml()?)?;
        assert_eq!(full["name"].as_str(), Some("smollm2"));
        assert_eq!(full["model"].as_str(), Some("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
        assert_eq!(full["served_model_name"].as_str(), Some("smol"));
        assert_eq!(full["replicas"].as_u64(), Some(3));
        assert_eq!(full["placement"].as_str(), Some("pack"));
        assert_eq!(full["node_selector"]["capacity-type"].as_str(), Some("on-demand"));
        assert_eq!(full["engine"]["tensor_parallel_size"].as_u64(), Some(2));
        assert_eq!(full["engine"]["max_model_len"].as_u64(), Some(2048));
        assert_eq!(full["engine"]["max_num_batched_tokens"].as_u64(), Some(1024));
        assert_eq!(full["engine"]["gpu_memory_utilization"].as_f64().map(|u| (u * 100.0).round()), Some(85.0));
        let minimal: serde_yaml::Value =
            serde_yaml::from_str(&DeploymentFile::parse("name: a\nmodel: /m.gguf\n")?.dry_run_yaml()?)?;
        assert_eq!(minimal["served_model_name"].as_str(), Some("a"), "defaults to name");
        assert_eq!(minimal["replicas"].as_u64(), Some(1));
        assert_eq!(minimal["placement"].as_str(), Some("spread"));
        assert!(minimal["engine"]["max_model_len"].is_null(), "an unset knob is left out: {minimal:?}");
        assert!(minimal["autoscaling_config"].is_null() && minimal["node_selector"].is_null());
        let auto: serde_yaml::Value = serde_yaml::from_str(
            &DeploymentFile::parse(include_str!("../../docs/examples/smollm2-autoscaled.yaml"))?.dry_run_yaml()?,
        )?;
        assert!(auto["replicas"].is_null(), "the autoscaler owns the count: {auto:?}");
        assert_eq!(auto["autoscaling_config"]["max_replicas"].as_u64(), Some(2));
        Ok(())
    }

    #[test]
    fn minimal_file_takes_defaults() -> Result<()> {
        let spec = DeploymentFile::parse("name: a\nmodel: /m.gguf\n")?.to_spec();
        assert_eq!(spec.replicas, 1);
        assert_eq!(spec.placement, PlacementStrategy::Spread as i32);
        let engine = spec.engine.context("engine")?;
        assert_eq!(engine.served_model_name, "a");
        assert_eq!(engine.tensor_parallel_size, 1);
        assert_eq!(engine.max_model_len, None);
        Ok(())
    }

    #[test]
    fn the_repositorys_deployment_files_parse() -> Result<()> {
        let example = DeploymentFile::parse(include_str!("../../docs/examples/smollm2.yaml"))?.to_spec();
        let engine = example.engine.context("engine")?;
        assert_eq!((engine.max_model_len, engine.block_size, engine.max_num_seqs), (Some(2048), Some(16), Some(64)));
        let auto = DeploymentFile::parse(include_str!("../../docs/examples/smollm2-autoscaled.yaml"))?.to_spec();
        let a = auto.autoscaling.context("autoscaling")?;
        assert_eq!((a.min_replicas, a.max_replicas, auto.replicas), (0, 2, 1), "starts at initial_replicas");
        let overlay = DeploymentFile::parse(include_str!("../../k8s/overlays/cpu/smollm2.yaml"))?.to_spec();
        assert_eq!(overlay.engine.context("engine")?.backend, "cpu");
        Ok(())
    }

    #[test]
    fn prefix_caching_can_be_turned_off_in_the_engine_block() -> Result<()> {
        let off = DeploymentFile::parse("name: a\nmodel: /m.gguf\nengine: {enable_prefix_caching: false}\n")?;
        assert_eq!(off.to_spec().engine.context("engine")?.enable_prefix_caching, Some(false));
        let default = DeploymentFile::parse("name: a\nmodel: /m.gguf\n")?;
        assert_eq!(default.to_spec().engine.context("engine")?.enable_prefix_caching, None, "absent = on");
        assert!(DeploymentFile::parse("name: a\nmodel: m\nengine: {enable_prefix_caching: nope}\n").is_err());
        Ok(())
    }

    #[test]
    fn pipeline_parallel_size_is_a_deployment_key() -> Result<()> {
        let file = DeploymentFile::parse(
            "name: big\nmodel: m\nengine:\n  tensor_parallel_size: 2\n  pipeline_parallel_size: 3\n",
        )?;
        let engine = file.to_spec().engine.context("engine")?;
        assert_eq!((engine.tensor_parallel_size, engine.pipeline_parallel_size), (2, Some(3)));
        let e =
            DeploymentFile::parse("name: a\nmodel: m\nengine:\n  pipeline_parallel_size: 0\n").err().context("pp 0")?;
        assert_eq!(e.to_string(), "engine.pipeline_parallel_size must be at least 1");
        Ok(())
    }

    #[test]
    fn unknown_fields_are_rejected() {
        assert!(DeploymentFile::parse("name: a\nmodel: m\nreplica: 2\n").is_err());
        assert!(DeploymentFile::parse("name: a\nmodel: m\nengine:\n  tensor_parallel: 2\n").is_err());
    }

    #[test]
    fn invalid_values_are_rejected() {
        assert!(DeploymentFile::parse("name: Bad_Name\nmodel: m\n").is_err());
        assert!(DeploymentFile::parse("name: a\nmodel: m\nengine:\n  tensor_parallel_size: 0\n").is_err());
        assert!(DeploymentFile::parse("name: a\nmodel: m\nengine:\n  gpu_memory_utilization: 1.5\n").is_err());
        assert!(DeploymentFile::parse("name: a\nmodel: m\nmin_replicas: 3\nmax_replicas: 1\n").is_err());
        assert!(DeploymentFile::parse("name: a\nmodel: m\nplacement: random\n").is_err());
    }

    #[test]
    fn autoscaling_config_maps_to_spec_autoscaling() -> Result<()> {
        let yaml = "name: a\nmodel: m\nautoscaling_config:\n  min_replicas: 1\n  max_replicas: 3\n  \
                    initial_replicas: 2\n  target_ongoing_requests: 4\n  target_kv_cache_usage: 0.9\n  \
                    upscale_delay_s: 2\n  downscale_delay_s: 8\n  look_back_period_s: 3\n  \
                    upscaling_factor: 1.5\n  downscaling_factor: 0.5\n";
        let spec = DeploymentFile::parse(yaml)?.to_spec();
        assert_eq!(spec.replicas, 2, "initial_replicas");
        assert_eq!((spec.min_replicas, spec.max_replicas), (0, 0));
        let a = spec.autoscaling.context("autoscaling")?;
        assert_eq!((a.min_replicas, a.max_replicas, a.initial_replicas), (1, 3, Some(2)));
        assert_eq!(a.target_ongoing_requests, Some(4.0));
        assert_eq!(a.target_kv_cache_usage, Some(0.9));
        assert_eq!((a.upscale_delay_s, a.downscale_delay_s, a.look_back_period_s), (Some(2.0), Some(8.0), Some(3.0)));
        assert_eq!((a.upscaling_factor, a.downscaling_factor), (Some(1.5), Some(0.5)));
        // Absent keys stay absent (the head fills Ray Serve's defaults); initial = min.
        let spec =
            DeploymentFile::parse("name: a\nmodel: m\nautoscaling_config: { min_replicas: 0, max_replicas: 2 }\n")?
                .to_spec();
        assert_eq!(spec.replicas, 0);
        assert_eq!(spec.autoscaling.context("autoscaling")?.target_ongoing_requests, None);
        Ok(())
    }

    #[test]
    fn invalid_autoscaling_configs_are_refused_naming_the_field() {
        let err = |block: &str| {
            DeploymentFile::parse(&format!("name: a\nmodel: m\nautoscaling_config: {{ {block} }}\n"))
                .expect_err(block)
                .to_string()
        };
        assert_eq!(
            err("min_replicas: 3, max_replicas: 1"),
            "autoscaling_config.min_replicas (3) is greater than max_replicas (1)"
        );
        assert!(err("max_replicas: 0").contains("autoscaling_config.max_replicas"));
        assert!(err("max_replicas: 2, initial_replicas: 3").contains("autoscaling_config.initial_replicas"));
        assert!(
            err("max_replicas: 2, target_ongoing_requests: 0").contains("autoscaling_config.target_ongoing_requests")
        );
        assert!(
            err("max_replicas: 2, target_kv_cache_usage: 1.5").contains("autoscaling_config.target_kv_cache_usage")
        );
        assert!(err("max_replicas: 2, upscale_delay_s: -1").contains("autoscaling_config.upscale_delay_s"));
        assert!(err("max_replicas: 2, look_back_period_s: .nan").contains("autoscaling_config.look_back_period_s"));
        assert!(err("max_replicas: 2, downscaling_factor: 0").contains("autoscaling_config.downscaling_factor"));
        // Unknown keys (a typo) are refused, not defaulted.
        assert!(
            format!(
                "{:#}",
                DeploymentFile::parse("name: a\nmodel: m\nautoscaling_config: { max_replica: 2 }\n").expect_err("typo")
            )
            .contains("max_replica")
        );
        // The fixed-count fields do not mix with it.
        for extra in ["replicas: 2", "min_replicas: 1", "max_replicas: 3"] {
            let yaml = format!("name: a\nmodel: m\n{extra}\nautoscaling_config: {{ max_replicas: 2 }}\n");
            assert!(DeploymentFile::parse(&yaml).expect_err(extra).to_string().contains("autoscaling_config"));
        }
    }
}
