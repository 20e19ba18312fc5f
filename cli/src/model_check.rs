//! Deploy-time model checks (`prism up`, `prism deploy -f`): the engine's own
//! [`ParallelSizes::validate`] run on the model's config before anything is deployed, so a
//! `tensor_parallel_size` that does not divide the model's heads, KV heads or MLP width, or
//! more pipeline stages than layers, is refused with the engine's message instead of a
//! replica that fails to load. The config comes from the GGUF metadata or the Hugging Face
//! directory's `config.json`, through the engine's loaders.

use std::path::Path;

use anyhow::{Context, Result, bail};
use prism_common::proto::v1::EngineConfig;
use prism_engine::model::ModelConfig;
use prism_engine::model::config::HfLlamaConfig;
use prism_engine::model::gguf::GgufFile;
use prism_engine::parallel::layout::ParallelSizes;

/// The model's config when `model` is a local GGUF file or Hugging Face directory; None
/// when nothing is at that path here (a path as the workers see it).
///
/// # Errors
/// The file exists but its config cannot be read.
pub fn model_config(model: &Path) -> Result<Option<ModelConfig>> {
    if model.is_file() {
        let gguf = GgufFile::open(model)?;
        return Ok(Some(gguf.model_config().with_context(|| format!("{}: model config", model.display()))?));
    }
    let json = model.join("config.json");
    if model.is_dir() && json.is_file() {
        let raw = std::fs::read_to_string(&json).with_context(|| format!("cannot read {}", json.display()))?;
        let hf: HfLlamaConfig =
            serde_json::from_str(&raw).with_context(|| format!("{}: not a model config", json.display()))?;
        return Ok(Some(ModelConfig::from_hf(&hf).with_context(|| json.display().to_string())?));
    }
    Ok(None)
}

/// The engine's parallel sizes of a deployment's engine config (absent pipeline size = 1).
pub fn sizes(engine: &EngineConfig) -> ParallelSizes {
    ParallelSizes::new(engine.tensor_parallel_size as usize, engine.pipeline_parallel_size.unwrap_or(1) as usize)
}

/// Checks the deployment's parallel sizes against the model's shape; Ok without a check
/// when the model is not here (`prism deploy` of a path only the workers have).
///
/// # Errors
/// The engine's message naming the size and the model's number, or an unreadable model.
pub fn check_parallel(engine: &EngineConfig) -> Result<()> {
    let Some(cfg) = model_config(Path::new(&engine.model))? else { return Ok(()) };
    check_sizes(&sizes(engine), &cfg)
}

/// [`ParallelSizes::validate`] with the engine's message.
///
/// # Errors
/// The sizes do not fit the model.
pub fn check_sizes(sizes: &ParallelSizes, cfg: &ModelConfig) -> Result<()> {
    if let Err(e) = sizes.validate(cfg) {
        bail!("{e}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smol() -> Option<std::path::PathBuf> {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
        p.exists().then_some(p)
    }

    fn engine(model: &str, tp: u32, pp: Option<u32>) -> EngineConfig {
        EngineConfig { model: model.into(), tensor_parallel_size: tp, pipeline_parallel_size: pp, ..Default::default() }
    }

    #[test]
    fn the_models_shape_bounds_the_parallel_sizes() -> Result<()> {
        let Some(model) = smol() else { return Ok(()) };
        let model = model.to_string_lossy().into_owned();
        // SmolLM2-135M: 9 heads, 3 KV heads, intermediate 1536, 30 layers.
        check_parallel(&engine(&model, 3, Some(2)))?;
        check_parallel(&engine(&model, 1, Some(30)))?;
        let e = check_parallel(&engine(&model, 2, None)).err().context("tp 2 accepted")?;
        assert_eq!(e.to_string(), "tensor_parallel_size 2 does not divide the model's num_attention_heads 9");
        let e = check_parallel(&engine(&model, 1, Some(31))).err().context("pp 31 accepted")?;
        assert_eq!(e.to_string(), "pipeline_parallel_size 31 is more than the model's num_hidden_layers 30");
        Ok(())
    }

    #[test]
    fn a_model_only_the_workers_have_is_not_checked() -> Result<()> {
        check_parallel(&engine("/models/not-here/llama.gguf", 7, Some(500)))?;
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("config.json"), "{\"hidden_size\": 1}")?;
        let e = check_parallel(&engine(&dir.path().to_string_lossy(), 1, None)).err().context("bad config accepted")?;
        assert!(e.to_string().contains("not a model config"), "{e:#}");
        Ok(())
    }
}
