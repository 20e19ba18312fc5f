//! The engine knobs of a deployment, with vLLM's names, in one struct: [`EngineFlags`] is
//! both a set of clap flags (`#[command(flatten)]`, each with a `PRISM_…` env var; `prism
//! up` takes them) and the `engine:` block of a deployment YAML file (serde, unknown keys
//! rejected; `prism deploy` reads it). [`EngineFlags::to_proto`] is the one conversion to
//! the protocol's [`pb::EngineConfig`]; the worker's launcher is the one conversion from it
//! to the engine's own configuration.
//!
//! Adding a knob touches: a field here (flag, env var, YAML key, doc) with its value in
//! `Default`, its line in [`EngineFlags::to_proto`] (and in [`unset_zeros`] when it is
//! optional), the field of `EngineConfig` in `proto/prism/v1/head.proto`, its line in
//! the worker's launcher (plus the engine's own `EngineConfig` when the engine lacks it), and
//! its line in what `prism up` applies over a stored deployment (`cli/src/up/restart.rs`).

use crate::proto::v1 as pb;
use serde::{Deserialize, Serialize};

/// The worker's KV-cache budget for a CPU replica whose deployment sets none: 256 MiB
/// (`prism-worker --kv-cache-bytes` default; `prism up` uses it too).
pub const DEFAULT_CPU_KV_CACHE_BYTES: u64 = 256 << 20;

/// Which engine backend a replica runs on (`EngineConfig.backend` in the protocol).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// CUDA when the replica was placed on GPUs, else CPU.
    Auto,
    /// The f32 CPU reference backend, even on a GPU node.
    Cpu,
    /// CUDA; the replica fails on a node without GPUs.
    Cuda,
}

impl BackendChoice {
    /// The protocol's spelling (`auto`, `cpu`, `cuda`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }
}

/// Weight quantization of a deployment (`EngineConfig.quantization`; vLLM's `--quantization`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum QuantizationChoice {
    /// FP8 e4m3 weights with per-output-channel scales, quantized at load (CUDA).
    Fp8,
}

/// KV-cache element type of a deployment (`EngineConfig.kv_cache_dtype`; vLLM's
/// `--kv-cache-dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum KvCacheDtypeChoice {
    /// The model's compute type (bf16).
    Auto,
    /// bf16.
    Bf16,
    /// FP8 e4m3 with a per-tensor scale of 1.0 (CUDA): twice the tokens in the same memory.
    Fp8,
}

impl KvCacheDtypeChoice {
    /// The protocol's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Bf16 => "bf16",
            Self::Fp8 => "fp8",
        }
    }
}

/// Engine knobs of a deployment (vLLM's names). `None` = the engine's default, given in
/// each field's doc; a zero is taken as unset too (see [`unset_zeros`]).
///
/// As clap flags: `--max-model-len`, `--tensor-parallel-size`, … with env vars
/// `PRISM_MAX_MODEL_LEN`, `PRISM_TENSOR_PARALLEL_SIZE`, …. As YAML: the same names in
/// snake case (`max_model_len: 2048`); any other key is an error. Serialized (`prism deploy
/// --dry-run`) with the same keys, unset knobs left out.
#[derive(Clone, Debug, PartialEq, clap::Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct EngineFlags {
    /// Context length in tokens (default: the model's own, capped to what the KV cache
    /// holds). A value given is served as given: one over the model's context length or the
    /// KV cache's capacity fails the replica, with a reason saying what fits.
    #[arg(long, env = "PRISM_MAX_MODEL_LEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<u32>,
    /// Tensor-parallel ranks per pipeline stage, at least 1 (each rank holds 1/N of every
    /// layer's attention heads, KV heads and MLP columns: N must divide them).
    #[arg(long, env = "PRISM_TENSOR_PARALLEL_SIZE", default_value_t = 1)]
    #[serde(default = "one")]
    pub tensor_parallel_size: u32,
    /// Pipeline stages per replica (default 1); each stage holds a contiguous range of layers.
    /// A replica uses tensor_parallel_size x pipeline_parallel_size GPUs (CPU slots on CPU nodes).
    #[arg(long, env = "PRISM_PIPELINE_PARALLEL_SIZE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline_parallel_size: Option<u32>,
    /// Fraction of GPU memory for weights + KV cache on the CUDA backend, in (0, 1]
    /// (default 0.9).
    #[arg(long, env = "PRISM_GPU_MEMORY_UTILIZATION")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu_memory_utilization: Option<f32>,
    /// CUDA: batch-invariant (deterministic) kernels: a request's output never depends on what
    /// else is batched with it (slower; vLLM's VLLM_BATCH_INVARIANT; default off).
    #[arg(long, env = "PRISM_BATCH_INVARIANT")]
    #[serde(default)]
    pub batch_invariant: bool,
    /// Most sequences per batch (default 256).
    #[arg(long, env = "PRISM_MAX_NUM_SEQS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<u32>,
    /// Most tokens per engine step, prefill chunks + decodes: the chunked-prefill budget
    /// (default 512 on the CPU backend, 2048 on CUDA).
    #[arg(long, env = "PRISM_MAX_NUM_BATCHED_TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_num_batched_tokens: Option<u32>,
    /// KV cache block size in tokens (default 16).
    #[arg(long, env = "PRISM_BLOCK_SIZE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// KV cache budget in bytes (default: the worker's, 256 MiB, on the CPU backend; sized
    /// from --gpu-memory-utilization on CUDA).
    #[arg(long, env = "PRISM_KV_CACHE_BYTES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_bytes: Option<u64>,
    /// Engine backend: auto (CUDA when the replica got GPUs, else CPU; the default), cpu or cuda.
    #[arg(long, env = "PRISM_BACKEND", value_enum, hide_possible_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<BackendChoice>,
    /// Requests the router keeps in flight on one replica (default: the router's
    /// --max-in-flight-per-replica, 256).
    #[arg(long, env = "PRISM_MAX_IN_FLIGHT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u32>,
    /// Automatic prefix caching: reuse the KV blocks of prompt prefixes seen before (default
    /// on, as in vLLM). YAML: `enable_prefix_caching: false`; flags: `--no-enable-prefix-caching`.
    #[arg(long, env = "PRISM_ENABLE_PREFIX_CACHING", num_args = 0..=1, default_missing_value = "true")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_prefix_caching: Option<bool>,
    /// Turns automatic prefix caching off (vLLM's `--no-enable-prefix-caching`).
    #[arg(long, conflicts_with = "enable_prefix_caching")]
    #[serde(skip)]
    pub no_enable_prefix_caching: bool,
    /// Parse special-token text typed inside chat messages (`<|im_end|>`, ...) as special
    /// tokens, as before this option existed. Off by default: only the chat template makes
    /// special tokens, so a user cannot close their turn or forge a system turn. Completion
    /// prompts always parse special-token text. YAML: `chat_content_special_tokens: true`.
    #[arg(long, env = "PRISM_CHAT_CONTENT_SPECIAL_TOKENS")]
    #[serde(default)]
    pub chat_content_special_tokens: bool,
    /// Weight quantization: fp8 quantizes a bf16 checkpoint's linear layers to FP8 e4m3 at load
    /// (per-output-channel scales; CUDA). Default: the checkpoint's own format.
    #[arg(long, env = "PRISM_QUANTIZATION", value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub quantization: Option<QuantizationChoice>,
    /// KV cache element type: auto (bf16; the default), bf16 or fp8 (e4m3, scale 1.0; CUDA).
    #[arg(long, env = "PRISM_KV_CACHE_DTYPE", value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_cache_dtype: Option<KvCacheDtypeChoice>,
}

fn one() -> u32 {
    1
}

impl Default for EngineFlags {
    /// Every knob at the engine's default (what no flag and an empty `engine:` block give).
    fn default() -> Self {
        Self {
            max_model_len: None,
            tensor_parallel_size: one(),
            pipeline_parallel_size: None,
            gpu_memory_utilization: None,
            batch_invariant: false,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            block_size: None,
            kv_cache_bytes: None,
            backend: None,
            max_in_flight: None,
            enable_prefix_caching: None,
            no_enable_prefix_caching: false,
            chat_content_special_tokens: false,
            quantization: None,
            kv_cache_dtype: None,
        }
    }
}

/// An engine knob out of its range.
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
pub enum EngineFlagsError {
    /// `tensor_parallel_size` is 0.
    #[error("tensor_parallel_size must be at least 1")]
    TensorParallelSize,
    /// `pipeline_parallel_size` is 0.
    #[error("pipeline_parallel_size must be at least 1")]
    PipelineParallelSize,
    /// `gpu_memory_utilization` is not in (0, 1].
    #[error("gpu_memory_utilization must be in (0, 1], got {0}")]
    GpuMemoryUtilization(f32),
}

impl EngineFlags {
    /// Checks the ranges the engine needs.
    ///
    /// # Errors
    /// [`EngineFlagsError`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), EngineFlagsError> {
        if self.tensor_parallel_size == 0 {
            return Err(EngineFlagsError::TensorParallelSize);
        }
        if self.pipeline_parallel_size == Some(0) {
            return Err(EngineFlagsError::PipelineParallelSize);
        }
        if let Some(u) = self.gpu_memory_utilization
            && !(u > 0.0 && u <= 1.0)
        {
            return Err(EngineFlagsError::GpuMemoryUtilization(u));
        }
        Ok(())
    }

    /// The protocol's engine configuration for `model` (a path as the worker sees it) served
    /// as `served_model_name`; zeros become unset ([`unset_zeros`]).
    pub fn to_proto(&self, model: impl Into<String>, served_model_name: impl Into<String>) -> pb::EngineConfig {
        let mut engine = pb::EngineConfig {
            model: model.into(),
            served_model_name: served_model_name.into(),
            tensor_parallel_size: self.tensor_parallel_size,
            pipeline_parallel_size: self.pipeline_parallel_size,
            max_model_len: self.max_model_len,
            block_size: self.block_size,
            max_num_seqs: self.max_num_seqs,
            max_num_batched_tokens: self.max_num_batched_tokens,
            gpu_memory_utilization: self.gpu_memory_utilization,
            kv_cache_bytes: self.kv_cache_bytes,
            backend: self.backend.map(BackendChoice::as_str).unwrap_or_default().to_owned(),
            max_in_flight: self.max_in_flight,
            batch_invariant: self.batch_invariant,
            enable_prefix_caching: if self.no_enable_prefix_caching { Some(false) } else { self.enable_prefix_caching },
            chat_content_special_tokens: self.chat_content_special_tokens,
            quantization: self.quantization.map(|_| "fp8".to_owned()).unwrap_or_default(),
            kv_cache_dtype: self.kv_cache_dtype.map(KvCacheDtypeChoice::as_str).unwrap_or_default().to_owned(),
        };
        unset_zeros(&mut engine);
        engine
    }
}

/// Clears the optional knobs set to zero. No knob has a usable zero (a block of 0 tokens, a
/// batch of 0 sequences, no KV cache, no GPU memory), and before the protocol tracked presence
/// 0 was how a knob was left unset: a zero keeps meaning "the default". Applied where a spec
/// enters the cluster ([`EngineFlags::to_proto`], the head's validation), so readers take
/// `Some` as a real value.
pub fn unset_zeros(engine: &mut pb::EngineConfig) {
    fn clear<T: Default + PartialEq>(v: &mut Option<T>) {
        if v.as_ref().is_some_and(|x| *x == T::default()) {
            *v = None;
        }
    }
    clear(&mut engine.max_model_len);
    clear(&mut engine.block_size);
    clear(&mut engine.max_num_seqs);
    clear(&mut engine.max_num_batched_tokens);
    clear(&mut engine.gpu_memory_utilization);
    clear(&mut engine.kv_cache_bytes);
    clear(&mut engine.max_in_flight);
    clear(&mut engine.pipeline_parallel_size);
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        engine: EngineFlags,
    }

    fn flags(args: &[&str]) -> EngineFlags {
        Cli::parse_from(std::iter::once("test").chain(args.iter().copied())).engine
    }

    fn yaml(text: &str) -> EngineFlags {
        serde_yaml::from_str(text).expect("valid engine block")
    }

    #[test]
    fn no_flags_and_an_empty_block_are_the_defaults() {
        assert_eq!(flags(&[]), EngineFlags::default());
        assert_eq!(yaml("{}"), EngineFlags::default());
    }

    #[test]
    fn flags_and_yaml_keys_set_the_same_fields() {
        let from_flags = flags(&[
            "--max-model-len=2048",
            "--tensor-parallel-size=2",
            "--gpu-memory-utilization=0.8",
            "--batch-invariant",
            "--max-num-seqs=64",
            "--max-num-batched-tokens=1024",
            "--block-size=32",
            "--kv-cache-bytes=1048576",
            "--backend=cuda",
            "--max-in-flight=8",
        ]);
        let from_yaml = yaml(
            "max_model_len: 2048\ntensor_parallel_size: 2\ngpu_memory_utilization: 0.8\nbatch_invariant: true\n\
             max_num_seqs: 64\nmax_num_batched_tokens: 1024\nblock_size: 32\nkv_cache_bytes: 1048576\n\
             backend: cuda\nmax_in_flight: 8\n",
        );
        assert_eq!(from_flags, from_yaml);
        let e = from_flags.to_proto("/m.gguf", "m");
        assert_eq!((e.max_model_len, e.block_size, e.max_num_seqs), (Some(2048), Some(32), Some(64)));
        assert_eq!((e.max_num_batched_tokens, e.kv_cache_bytes, e.max_in_flight), (Some(1024), Some(1 << 20), Some(8)));
        assert_eq!((e.tensor_parallel_size, e.backend.as_str(), e.batch_invariant), (2, "cuda", true));
        assert_eq!(e.gpu_memory_utilization, Some(0.8));
    }

    #[test]
    fn chat_content_special_tokens_is_off_unless_asked_for() {
        assert!(!EngineFlags::default().to_proto("/m.gguf", "m").chat_content_special_tokens);
        let on = flags(&["--chat-content-special-tokens"]);
        assert_eq!(on, yaml("chat_content_special_tokens: true\n"));
        assert!(on.to_proto("/m.gguf", "m").chat_content_special_tokens);
    }

    #[test]
    fn quantization_and_kv_cache_dtype_take_vllms_names() {
        let e = EngineFlags::default().to_proto("/m", "m");
        assert_eq!((e.quantization.as_str(), e.kv_cache_dtype.as_str()), ("", ""));
        let f = flags(&["--quantization=fp8", "--kv-cache-dtype=fp8"]);
        assert_eq!(f, yaml("quantization: fp8\nkv_cache_dtype: fp8\n"));
        let e = f.to_proto("/m", "m");
        assert_eq!((e.quantization.as_str(), e.kv_cache_dtype.as_str()), ("fp8", "fp8"));
        assert_eq!(flags(&["--kv-cache-dtype=auto"]).to_proto("/m", "m").kv_cache_dtype, "auto");
        assert!(serde_yaml::from_str::<EngineFlags>("quantization: awq\n").is_err());
        assert!(serde_yaml::from_str::<EngineFlags>("kv_cache_dtype: fp16\n").is_err());
    }

    #[test]
    fn serialized_knobs_read_back_the_same() {
        let set =
            flags(&["--max-model-len=2048", "--backend=cpu", "--kv-cache-dtype=bf16", "--gpu-memory-utilization=0.85"]);
        let text = serde_yaml::to_string(&set).expect("serializes");
        assert!(text.contains("max_model_len: 2048\n"), "{text}");
        assert!(text.contains("backend: cpu\n") && text.contains("kv_cache_dtype: bf16\n"), "{text}");
        assert!(!text.contains("block_size") && !text.contains("null"), "unset knobs are left out: {text}");
        assert_eq!(yaml(&text), set);
        assert_eq!(yaml(&serde_yaml::to_string(&EngineFlags::default()).expect("serializes")), EngineFlags::default());
    }

    #[test]
    fn unknown_keys_and_values_are_rejected() {
        assert!(serde_yaml::from_str::<EngineFlags>("tensor_parallel: 2\n").is_err());
        assert!(serde_yaml::from_str::<EngineFlags>("backend: tpu\n").is_err());
    }

    #[test]
    fn unset_knobs_are_absent_and_zeros_mean_unset() {
        let e = EngineFlags::default().to_proto("/m.gguf", "m");
        assert_eq!(
            e,
            pb::EngineConfig {
                model: "/m.gguf".into(),
                served_model_name: "m".into(),
                tensor_parallel_size: 1,
                ..Default::default()
            }
        );
        let zeros = flags(&["--max-num-seqs=0", "--block-size=0", "--gpu-memory-utilization=0", "--kv-cache-bytes=0"]);
        assert_eq!(zeros.to_proto("/m.gguf", "m"), e);
    }

    /// Records written before the knobs were `optional` decode as before: a value that was set
    /// is `Some`, an unset one (0, which proto3 never encodes) is `None`; and an unset knob
    /// encodes to nothing, which older readers take as 0 = unset.
    #[test]
    fn the_wire_format_is_the_one_before_presence() {
        use prost::Message;
        // Field 6 (max_num_seqs) = 64 and field 9 (kv_cache_bytes) = 1 MiB, as varints.
        let old = [0x30, 64, 0x48, 0x80, 0x80, 0x40];
        let e = pb::EngineConfig::decode(old.as_slice()).expect("decodes");
        assert_eq!((e.max_num_seqs, e.kv_cache_bytes), (Some(64), Some(1 << 20)));
        assert_eq!((e.max_model_len, e.block_size, e.gpu_memory_utilization), (None, None, None));
        let set = pb::EngineConfig { max_num_seqs: Some(64), kv_cache_bytes: Some(1 << 20), ..Default::default() };
        assert_eq!(set.encode_to_vec(), old);
        assert!(pb::EngineConfig::default().encode_to_vec().is_empty());
    }

    #[test]
    fn validation_names_the_field() {
        assert_eq!(EngineFlags::default().validate(), Ok(()));
        let tp0 = EngineFlags { tensor_parallel_size: 0, ..EngineFlags::default() };
        assert_eq!(tp0.validate(), Err(EngineFlagsError::TensorParallelSize));
        let pp0 = EngineFlags { pipeline_parallel_size: Some(0), ..EngineFlags::default() };
        assert_eq!(pp0.validate().map_err(|e| e.to_string()), Err("pipeline_parallel_size must be at least 1".into()));
        for u in [0.0, 1.5, f32::NAN] {
            let bad = EngineFlags { gpu_memory_utilization: Some(u), ..EngineFlags::default() };
            assert!(matches!(bad.validate(), Err(EngineFlagsError::GpuMemoryUtilization(_))), "{u}");
        }
    }
}
