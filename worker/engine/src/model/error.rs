//! [`ModelError`]: why a model could not be loaded. The errors of the libraries that read a
//! model (I/O, JSON, safetensors, tokenizers, minijinja) convert with `#[from]`; the loaders'
//! own checks carry what they checked (file, tensor name, metadata key, expected and actual
//! shape). [`ResultExt::in_file`] adds the path of the file being read. The engine reports
//! every load failure as [`EngineError::Internal`] (`"model load: …"`).

use std::path::{Path, PathBuf};

use crate::request::EngineError;

/// A model load failure.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// Reading, opening or mapping a file failed.
    #[error(transparent)]
    Io(#[from] std::io::Error),
    /// A JSON file (`config.json`, `tokenizer.json`, an index) does not parse.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// A `.safetensors` header is invalid.
    #[error(transparent)]
    Safetensors(#[from] safetensors::SafeTensorError),
    /// The tokenizer could not be built.
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] tokenizers::Error),
    /// The chat template does not compile.
    #[error("chat template: {0}")]
    ChatTemplate(#[from] minijinja::Error),
    /// `source` happened while reading `path`.
    #[error("{}: {source}", path.display())]
    File {
        /// The file being read.
        path: PathBuf,
        /// What went wrong.
        #[source]
        source: Box<ModelError>,
    },
    /// The file does not start with the GGUF magic.
    #[error("{} is not a GGUF file", path.display())]
    NotGguf {
        /// The file.
        path: PathBuf,
    },
    /// A GGUF version other than 2 or 3.
    #[error("unsupported GGUF version {0}")]
    GgufVersion(u32),
    /// A GGUF file whose structure is broken (truncated, impossible lengths or offsets).
    #[error("gguf: {0}")]
    MalformedGguf(&'static str),
    /// A GGUF metadata value of an unknown type.
    #[error("gguf: unknown metadata type {0}")]
    GgufValueType(u32),
    /// A metadata key the loader needs is absent or has the wrong type.
    #[error("gguf: missing or invalid {key}")]
    Metadata {
        /// The key, e.g. `llama.block_count`.
        key: String,
    },
    /// A tensor the architecture needs is absent.
    #[error("missing tensor {name}")]
    MissingTensor {
        /// Tensor name as in the file.
        name: String,
    },
    /// A tensor's shape disagrees with the config.
    #[error("tensor {name}: shape {actual:?}, expected {expected:?}")]
    Shape {
        /// Tensor name.
        name: String,
        /// Shape the config implies (row-major).
        expected: Vec<usize>,
        /// Shape in the file (row-major).
        actual: Vec<usize>,
    },
    /// A tensor's element type is not one the loader reads.
    #[error("tensor {name} has unsupported type {ty}")]
    TensorType {
        /// Tensor name.
        name: String,
        /// The type as the file names it (GGUF type id or safetensors dtype).
        ty: String,
    },
    /// A tensor's data lies (partly) outside its file, or does not fill whole blocks.
    #[error("tensor {name} lies outside the file")]
    TensorBounds {
        /// Tensor name.
        name: String,
    },
    /// A block-format tensor whose rows are not whole blocks (ggml stores each row as
    /// whole blocks: 32 weights, 256 for a K-quant).
    #[error("tensor {name}: rows of {row} weights are not whole {ty} blocks of {block}")]
    TensorBlocks {
        /// Tensor name.
        name: String,
        /// The block format.
        ty: String,
        /// Weights per row (`ne[0]`).
        row: u64,
        /// Weights per block.
        block: usize,
    },
    /// The tensor has more dimensions than a model tensor can have.
    #[error("tensor {name} has {dims} dims")]
    TensorRank {
        /// Tensor name.
        name: String,
        /// Its dimension count.
        dims: u32,
    },
    /// A tensor's stored byte count disagrees with its dtype and shape.
    #[error("tensor {name}: {dtype} {shape:?} needs {expected} bytes, the file holds {actual}")]
    TensorBytes {
        /// Tensor name.
        name: String,
        /// The dtype as the header names it.
        dtype: String,
        /// The shape in the header.
        shape: Vec<usize>,
        /// Bytes the dtype and shape imply.
        expected: usize,
        /// Bytes between its data offsets.
        actual: usize,
    },
    /// `quantization_config` names a method, format or scheme the loader does not read.
    #[error("{field} {value} is not supported (supported: {supported})")]
    Quantization {
        /// The field, e.g. `quantization_config.quant_method`.
        field: String,
        /// Its value as JSON, or `(missing)`.
        value: String,
        /// What is accepted there.
        supported: &'static str,
    },
    /// An FP8 weight's scale tensor has a shape that fits no scale layout of the weight.
    #[error("tensor {name}: shape {actual:?} is not a scale of weight {weight:?} (expected {expected})")]
    ScaleShape {
        /// The scale tensor, e.g. `model.layers.0.mlp.up_proj.weight_scale`.
        name: String,
        /// Its shape.
        actual: Vec<usize>,
        /// The weight's `[out_features, in_features]`.
        weight: Vec<usize>,
        /// The shapes that would fit.
        expected: String,
    },
    /// A scale tensor holds a value that is not finite.
    #[error("tensor {name}: scale {value} is not finite")]
    ScaleValue {
        /// The scale tensor.
        name: String,
        /// The offending value.
        value: f32,
    },
    /// An architecture other than the Llama family.
    #[error("unsupported architecture {name:?} (supported: {supported})")]
    Architecture {
        /// The architecture the model declares.
        name: String,
        /// The ones this loader reads.
        supported: &'static str,
    },
    /// A GGUF tokenizer model other than byte-level BPE ("gpt2").
    #[error("tokenizer model {0:?} is not supported (supported: gpt2)")]
    TokenizerModel(String),
    /// A sharded checkpoint's index is unusable (no `weight_map`, or a file outside the model
    /// directory).
    #[error("safetensors index: {0}")]
    Index(String),
    /// The hyper-parameters break an invariant the backends rely on.
    #[error("invalid model config: {0}")]
    Config(String),
    /// The weights cannot be split into the requested tensor-parallel shards.
    #[error("cannot shard the model: {0}")]
    Shard(String),
}

impl ModelError {
    /// `source` while reading `path`.
    pub fn in_file(path: &Path, source: impl Into<ModelError>) -> Self {
        Self::File { path: path.to_path_buf(), source: Box::new(source.into()) }
    }
}

/// Adds the file being read to an error.
pub trait ResultExt<T> {
    /// Wraps the error as [`ModelError::File`] for `path`.
    ///
    /// # Errors
    /// The wrapped error.
    fn in_file(self, path: &Path) -> Result<T, ModelError>;
}

impl<T, E: Into<ModelError>> ResultExt<T> for Result<T, E> {
    fn in_file(self, path: &Path) -> Result<T, ModelError> {
        self.map_err(|e| ModelError::in_file(path, e))
    }
}

impl From<ModelError> for EngineError {
    fn from(e: ModelError) -> Self {
        EngineError::Internal(format!("model load: {e}"))
    }
}

/// Runs a third-party parser that may panic on hostile input (the `tokenizers` crate
/// `expect`s inside its `tokenizer.json` decoder deserializer) and turns a panic into
/// [`ModelError::Tokenizer`], so a malformed file fails the load instead of the thread.
pub(crate) fn tokenizer_no_panic<T>(f: impl FnOnce() -> Result<T, ModelError>) -> Result<T, ModelError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let msg = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".to_owned());
        Err(ModelError::Tokenizer(format!("the tokenizer parser failed on this file: {msg}").into()))
    })
}
