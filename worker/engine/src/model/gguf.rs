//! GGUF v2/v3 reader (the llama.cpp file format, `ggml/docs/gguf.md`): header, typed
//! metadata, tensor infos and the aligned data section, read from an mmap (memmap2).
//! [`GgufFile::model_config`] reads the config from `llama.*` keys; [`loader::load`] turns a
//! llama-architecture file into a loaded model.

pub mod dequant;
pub mod dequant_k;
pub mod loader;

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

pub use dequant::GgmlType;

use super::config::{ArchConfig, Architecture, ModelConfig, SUPPORTED_GGUF_ARCHITECTURES};
use super::error::{ModelError, ResultExt};
use super::gemma3;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Most metadata values (array elements included) one file may hold. Real files hold about
/// a million (a 256k vocabulary's tokens, scores, types and merges); each parsed value
/// costs 32 bytes however small it is in the file, so without this bound a file of one-byte
/// array elements would cost 32 times its size.
const MAX_METADATA_VALUES: usize = 1 << 23;
/// Entries reserved up front for a map or array whose count the file claims: larger ones
/// grow as their entries actually parse, so a lying count cannot reserve memory.
const MAX_RESERVE: usize = 1 << 12;

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    /// Any unsigned integer type.
    U64(u64),
    /// Any signed integer type.
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string (lossy if the file holds invalid UTF-8).
    Str(String),
    /// Array of values.
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// As an unsigned integer (non-negative signed values too).
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Self::U64(v) => Some(*v),
            Self::I64(v) => u64::try_from(*v).ok(),
            _ => None,
        }
    }
    /// As a float (integers converted).
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            Self::F64(v) => Some(*v),
            Self::U64(v) => Some(*v as f64),
            Self::I64(v) => Some(*v as f64),
            _ => None,
        }
    }
    /// As a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Str(s) => Some(s),
            _ => None,
        }
    }
    /// As an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            Self::Array(a) => Some(a),
            _ => None,
        }
    }
    /// As a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Self::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

/// Where one tensor lives in the data section.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    /// GGUF dims, innermost first (`ne[0]` is the row length).
    pub dims: Vec<u64>,
    /// Element type.
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// Element count.
    pub fn numel(&self) -> u64 {
        // Saturates: a product that overflows is no size a file can hold (`GgufFile::open`
        // refuses such tensors).
        self.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d)).unwrap_or(u64::MAX)
    }
    /// Shape in row-major (PyTorch) order: dims reversed, `[rows, cols]` for a matrix.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An opened GGUF file.
pub struct GgufFile {
    mmap: Mmap,
    /// Format version (2 or 3).
    pub version: u32,
    /// Metadata key → value.
    pub metadata: HashMap<String, GgufValue>,
    /// Tensor name → info.
    pub tensors: HashMap<String, TensorInfo>,
    data_start: usize,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Metadata values parsed so far (bounded by [`MAX_METADATA_VALUES`]).
    values: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], ModelError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or(ModelError::MalformedGguf("truncated file"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], ModelError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }
    fn u32(&mut self) -> Result<u32, ModelError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, ModelError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    /// A count of items each at least `min_size` bytes long in the file: more than the rest
    /// of the file can hold is a corrupt (or hostile) header, refused before anything is
    /// allocated for it.
    fn count(&mut self, min_size: usize, what: &'static str) -> Result<usize, ModelError> {
        let n = self.u64()?;
        let rest = self.buf.len() - self.pos;
        usize::try_from(n).ok().filter(|&n| n <= rest / min_size.max(1)).ok_or(ModelError::MalformedGguf(what))
    }
    fn string(&mut self) -> Result<String, ModelError> {
        let n = self.count(1, "string length past the end of the file")?;
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn value(&mut self, ty: u32, depth: u32) -> Result<GgufValue, ModelError> {
        self.values += 1;
        if self.values > MAX_METADATA_VALUES {
            return Err(ModelError::MalformedGguf("more metadata values than any model has"));
        }
        Ok(match ty {
            0 => GgufValue::U64(u64::from(self.arr::<1>()?[0])),
            1 => GgufValue::I64(i64::from(self.arr::<1>()?[0] as i8)),
            2 => GgufValue::U64(u64::from(u16::from_le_bytes(self.arr()?))),
            3 => GgufValue::I64(i64::from(i16::from_le_bytes(self.arr()?))),
            4 => GgufValue::U64(u64::from(self.u32()?)),
            5 => GgufValue::I64(i64::from(i32::from_le_bytes(self.arr()?))),
            6 => GgufValue::F64(f64::from(f32::from_le_bytes(self.arr()?))),
            7 => GgufValue::Bool(self.arr::<1>()?[0] != 0),
            8 => GgufValue::Str(self.string()?),
            9 => {
                if depth > 4 {
                    return Err(ModelError::MalformedGguf("arrays nested too deep"));
                }
                let ety = self.u32()?;
                let n = self.count(value_min_size(ety), "array length past the end of the file")?;
                let mut v = Vec::with_capacity(n.min(MAX_RESERVE));
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.arr()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.arr()?)),
            other => return Err(ModelError::GgufValueType(other)),
        })
    }
}

/// Fewest bytes a metadata value of type `ty` takes in the file (unknown types: 1, and
/// parsing them fails).
fn value_min_size(ty: u32) -> usize {
    match ty {
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        // Element type and count.
        9 => 12,
        _ => 1,
    }
}

impl GgufFile {
    /// Opens and parses the header, metadata and tensor infos (tensor data stays mapped).
    ///
    /// # Errors
    /// [`ModelError`] on I/O errors, a bad magic/version, truncation or unsupported tensor
    /// types (wrapped in [`ModelError::File`] with `path`).
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        Self::parse(path).in_file(path)
    }

    fn parse(path: &Path) -> Result<Self, ModelError> {
        let file = File::open(path)?;
        // SAFETY: the file is opened read-only and not modified while mapped (model files
        // are immutable by convention; a concurrent writer is an operator error).
        let mmap = unsafe { Mmap::map(&file) }?;
        let mut r = Reader { buf: &mmap, pos: 0, values: 0 };
        if r.take(4)? != MAGIC {
            return Err(ModelError::NotGguf { path: path.to_path_buf() });
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(ModelError::GgufVersion(version));
        }
        // A tensor info is at least 24 bytes (name length, rank, type, offset), a metadata
        // pair at least 13 (key length, type, a one-byte value).
        let n_tensors = r.count(24, "tensor count larger than the file")?;
        let n_kv = r.count(13, "metadata count larger than the file")?;
        let mut metadata = HashMap::with_capacity(n_kv.min(MAX_RESERVE));
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let mut tensors = HashMap::with_capacity(n_tensors.min(MAX_RESERVE));
        for _ in 0..n_tensors {
            let name = r.string()?;
            let nd = r.u32()?;
            if nd > 4 {
                return Err(ModelError::TensorRank { name, dims: nd });
            }
            let dims = (0..nd).map(|_| r.u64()).collect::<Result<Vec<_>, _>>()?;
            let ty_id = r.u32()?;
            let ty = GgmlType::from_id(ty_id)
                .ok_or_else(|| ModelError::TensorType { name: name.clone(), ty: format!("GGML type {ty_id}") })?;
            let offset = r.u64()?;
            tensors.insert(name, TensorInfo { dims, ty, offset });
        }
        let align = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => v
                .as_u64()
                .filter(|a| a.is_power_of_two() && *a <= 1 << 20)
                .ok_or(ModelError::MalformedGguf("general.alignment is not a power of two"))?,
        };
        let data_start = (r.pos as u64)
            .div_ceil(align)
            .checked_mul(align)
            .and_then(|d| usize::try_from(d).ok())
            .ok_or(ModelError::MalformedGguf("bad data offset"))?;
        let file = Self { mmap, version, metadata, tensors, data_start };
        // Every tensor's data lies inside the file, so later reads (and the buffers sized
        // from a tensor's element count) are bounded by the file's size.
        for name in file.tensors.keys() {
            file.tensor_bytes(name)?;
        }
        Ok(file)
    }

    /// Metadata lookup.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    fn req_u(&self, key: &str) -> Result<usize, ModelError> {
        self.get(key)
            .and_then(GgufValue::as_u64)
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| ModelError::Metadata { key: key.to_owned() })
    }

    /// Raw bytes of a tensor.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] when the tensor is absent, [`ModelError::TensorBlocks`]
    /// when its rows are not whole blocks, [`ModelError::TensorBounds`] when its data does
    /// not lie inside the file.
    pub fn tensor_bytes(&self, name: &str) -> Result<(&TensorInfo, &[u8]), ModelError> {
        let info = self.tensors.get(name).ok_or_else(|| ModelError::MissingTensor { name: name.to_owned() })?;
        let out_of_bounds = || ModelError::TensorBounds { name: name.to_owned() };
        let (per, _) = info.ty.block_layout();
        let row = info.dims.first().copied().unwrap_or(1);
        if !row.is_multiple_of(per as u64) {
            return Err(ModelError::TensorBlocks {
                name: name.to_owned(),
                ty: info.ty.name().to_owned(),
                row,
                block: per,
            });
        }
        let numel = usize::try_from(info.numel()).map_err(|_| out_of_bounds())?;
        let len = info.ty.bytes_for(numel).ok_or_else(out_of_bounds)?;
        let start =
            usize::try_from(info.offset).ok().and_then(|o| o.checked_add(self.data_start)).ok_or_else(out_of_bounds)?;
        let bytes = start.checked_add(len).and_then(|end| self.mmap.get(start..end)).ok_or_else(out_of_bounds)?;
        Ok((info, bytes))
    }

    /// A tensor dequantized to f32, with its row-major shape.
    ///
    /// # Errors
    /// As [`GgufFile::tensor_bytes`].
    pub fn tensor_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let (info, bytes) = self.tensor_bytes(name)?;
        let numel = info.numel() as usize;
        let mut out = vec![0f32; numel];
        dequant::dequantize(info.ty, bytes, &mut out);
        Ok((info.shape(), out))
    }

    /// `general.architecture` (empty when absent).
    pub fn architecture(&self) -> &str {
        self.get("general.architecture").and_then(GgufValue::as_str).unwrap_or("")
    }

    /// Builds the [`ModelConfig`] from `{arch}.*` keys (`general.architecture` llama, qwen2,
    /// qwen3 or gemma3; Mistral files say llama).
    ///
    /// # Errors
    /// [`ModelError::Architecture`] naming `general.architecture` for other architectures,
    /// [`ModelError::Metadata`] for missing keys, [`ModelError::Config`] for inconsistent ones.
    pub fn model_config(&self) -> Result<ModelConfig, ModelError> {
        let arch = self.architecture();
        if !matches!(arch, "llama" | "qwen2" | "qwen3" | "gemma3") {
            return Err(ModelError::Architecture {
                name: format!("general.architecture = {arch:?}"),
                supported: SUPPORTED_GGUF_ARCHITECTURES,
            });
        }
        let k = |s: &str| format!("{arch}.{s}");
        let hidden = self.req_u(&k("embedding_length"))?;
        let heads = self.req_u(&k("attention.head_count"))?;
        let kv_heads = self.req_u(&k("attention.head_count_kv")).unwrap_or(heads);
        let head_dim = match self.req_u(&k("attention.key_length")) {
            Ok(d) => d,
            Err(_) => hidden / heads.max(1),
        };
        let vocab = match self.req_u(&k("vocab_size")) {
            Ok(v) => v,
            Err(_) => self.get("tokenizer.ggml.tokens").and_then(GgufValue::as_array).map_or(0, <[_]>::len),
        };
        let f = |key: &str, default: f64| self.get(&k(key)).and_then(GgufValue::as_f64).unwrap_or(default) as f32;
        let tok_u32 = |key: &str| self.get(key).and_then(GgufValue::as_u64).and_then(|v| u32::try_from(v).ok());
        let mut eos = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
            if let Some(id) = tok_u32(key)
                && !eos.contains(&id)
            {
                eos.push(id);
            }
        }
        let rope_freq_factors = if self.tensors.contains_key("rope_freqs.weight") {
            Some(self.tensor_f32("rope_freqs.weight")?.1)
        } else {
            None
        };
        let n_layers = self.req_u(&k("block_count"))?;
        let rope_theta = f("rope.freq_base", 10_000.0);
        let mut cfg = ModelConfig {
            hidden_size: hidden,
            intermediate_size: self.req_u(&k("feed_forward_length"))?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            head_dim,
            num_hidden_layers: n_layers,
            rms_norm_eps: f("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta,
            rope_scaling: None,
            rope_freq_factors,
            vocab_size: vocab,
            max_position_embeddings: self.req_u(&k("context_length")).unwrap_or(2048),
            tie_word_embeddings: !self.tensors.contains_key("output.weight"),
            bos_token_id: tok_u32("tokenizer.ggml.bos_token_id"),
            eos_token_ids: eos,
            quantization: None,
            arch: ArchConfig::llama(n_layers, rope_theta),
        };
        let window = self.req_u(&k("attention.sliding_window")).ok().filter(|&w| w > 0);
        match arch {
            "qwen2" => {
                cfg.arch.architecture = Architecture::Qwen2;
                cfg.arch.attention_bias = true;
            }
            "qwen3" => {
                cfg.arch.architecture = Architecture::Qwen3;
                cfg.arch.qk_norm = true;
            }
            "gemma3" => {
                // `attention.sliding_window_pattern`: a period (every n-th layer global) or
                // one bool per layer (true: local); llama.cpp's default for gemma3 is 6.
                let key = k("attention.sliding_window_pattern");
                let local: Vec<bool> = match self.get(&key) {
                    Some(GgufValue::Array(a)) => {
                        let flags: Option<Vec<bool>> = a.iter().map(GgufValue::as_bool).collect();
                        flags.filter(|f| f.len() == n_layers).ok_or(ModelError::Metadata { key })?
                    }
                    Some(v) => {
                        let p = v.as_u64().and_then(|p| usize::try_from(p).ok()).ok_or(ModelError::Metadata { key })?;
                        (0..n_layers).map(|i| gemma3::is_local(i, p)).collect()
                    }
                    None => (0..n_layers).map(|i| gemma3::is_local(i, gemma3::SLIDING_WINDOW_PATTERN)).collect(),
                };
                for (l, local) in cfg.arch.layers.iter_mut().zip(local) {
                    l.sliding_window = window.filter(|_| local);
                }
                let local_theta = self
                    .get(&k("rope.freq_base_swa"))
                    .and_then(GgufValue::as_f64)
                    .map_or(gemma3::LOCAL_ROPE_THETA, |t| t as f32);
                // llama.cpp scales by 1/sqrt(key_length) (query_pre_attn_scalar = head_dim
                // for every Gemma 3 but the 27B); the local layers' base is 10 000 unless
                // `rope.freq_base_swa` says otherwise.
                gemma3::apply(&mut cfg, 0.0, head_dim as f32, local_theta);
                cfg.arch.final_logit_softcapping =
                    self.get(&k("final_logit_softcapping")).and_then(GgufValue::as_f64).map(|c| c as f32);
            }
            // Llama; a Mistral file with a window says so here.
            _ => {
                for l in &mut cfg.arch.layers {
                    l.sliding_window = window;
                }
            }
        }
        if let Some(kind) = self.get(&k("rope.scaling.type")).and_then(GgufValue::as_str)
            && kind != "none"
        {
            return Err(ModelError::Config(format!("{arch}.rope.scaling.type {kind:?} is not supported")));
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

/// Hugging Face tensor name → GGUF tensor name (llama.cpp's `convert_hf_to_gguf.py` map) for
/// a file of `general.architecture` `arch` (Gemma 3's norms are named differently).
pub fn gguf_name_for(arch: &str, hf: &str) -> Option<String> {
    if arch == "gemma3"
        && let Some((layer, tail)) = hf.strip_prefix("model.layers.").and_then(|r| r.split_once('.'))
    {
        let suffix = match tail {
            "post_attention_layernorm.weight" => Some("post_attention_norm.weight"),
            "pre_feedforward_layernorm.weight" => Some("ffn_norm.weight"),
            "post_feedforward_layernorm.weight" => Some("post_ffw_norm.weight"),
            _ => None,
        };
        if let Some(suffix) = suffix {
            return Some(format!("blk.{layer}.{suffix}"));
        }
    }
    gguf_name(hf)
}

/// Hugging Face tensor name → GGUF tensor name (llama.cpp's `convert_hf_to_gguf.py` map).
pub fn gguf_name(hf: &str) -> Option<String> {
    let fixed = match hf {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.to_owned());
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    let suffix = match tail {
        "input_layernorm.weight" => "attn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{suffix}"))
}

#[cfg(test)]
mod tests {
    use anyhow::Context;

    use super::*;

    #[test]
    fn maps_names() {
        assert_eq!(gguf_name("model.layers.12.mlp.down_proj.weight").as_deref(), Some("blk.12.ffn_down.weight"));
        assert_eq!(gguf_name("model.embed_tokens.weight").as_deref(), Some("token_embd.weight"));
        assert_eq!(gguf_name("model.layers.x"), None);
    }

    #[test]
    fn truncated_headers_and_unknown_versions_are_typed() -> anyhow::Result<()> {
        let path = std::env::temp_dir().join(format!("prism-gguf-trunc-{}", std::process::id()));
        // Magic, version 3, then the tensor count cut short.
        std::fs::write(&path, b"GGUF\x03\x00\x00\x00\x01\x00")?;
        let truncated = GgufFile::open(&path).err().context("a truncated file must not open")?;
        std::fs::write(&path, b"GGUF\x09\x00\x00\x00")?;
        let version = GgufFile::open(&path).err().context("version 9 must not open")?;
        std::fs::remove_file(&path)?;
        assert!(
            matches!(&truncated, ModelError::File { source, .. } if matches!(**source, ModelError::MalformedGguf(_))),
            "{truncated}"
        );
        assert!(
            matches!(&version, ModelError::File { source, .. } if matches!(**source, ModelError::GgufVersion(9))),
            "{version}"
        );
        Ok(())
    }

    /// A GGUF v3 file with no metadata and one tensor `name` (`dims`, type id `ty`) whose
    /// data section holds `data_len` bytes.
    fn one_tensor_file(name: &str, dims: &[u64], ty: u32, data_len: usize) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(1u64.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend((name.len() as u64).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.resize(b.len().next_multiple_of(32), 0);
        b.extend((0..data_len).map(|i| (i % 251) as u8 & 0x3b));
        b
    }

    fn open_bytes(bytes: &[u8]) -> anyhow::Result<Result<GgufFile, ModelError>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("k.gguf");
        std::fs::write(&path, bytes)?;
        Ok(GgufFile::open(&path))
    }

    #[test]
    fn k_quant_tensors_read_and_malformed_ones_are_typed_errors_naming_the_tensor() -> anyhow::Result<()> {
        let name = "blk.0.ffn_down.weight";
        // Two rows of 512 Q6_K weights: 2 × 2 super-blocks of 210 bytes.
        let file = open_bytes(&one_tensor_file(name, &[512, 2], 14, 4 * 210))??;
        let (shape, values) = file.tensor_f32(name)?;
        assert_eq!((shape, values.len()), (vec![2, 512], 1024));
        assert_eq!(file.tensor_bytes(name)?.0.ty, GgmlType::Q6K);
        // One byte short of the last super-block.
        let short = open_bytes(&one_tensor_file(name, &[512, 2], 14, 4 * 210 - 1))?.err().context("short data")?;
        assert!(
            matches!(&short, ModelError::File { source, .. } if matches!(&**source, ModelError::TensorBounds { name: n } if n == name)),
            "{short}"
        );
        // Rows of 640 cannot be Q4_K super-blocks of 256, even when the total (1280) is.
        let rows = open_bytes(&one_tensor_file(name, &[640, 2], 12, 5 * 144))?.err().context("bad rows")?;
        assert!(
            matches!(&rows, ModelError::File { source, .. }
                if matches!(&**source, ModelError::TensorBlocks { name: n, row: 640, block: 256, .. } if n == name)),
            "{rows}"
        );
        assert!(rows.to_string().contains(name) && rows.to_string().contains("Q4_K"), "{rows}");
        // Q2_K (id 10) is not read; an id past the enum neither.
        for id in [10, 99] {
            let e = open_bytes(&one_tensor_file(name, &[256], id, 84))?.err().context("unknown type")?;
            assert!(
                matches!(&e, ModelError::File { source, .. } if matches!(&**source, ModelError::TensorType { name: n, .. } if n == name)),
                "{e}"
            );
            assert!(e.to_string().contains(&format!("GGML type {id}")), "{e}");
        }
        Ok(())
    }

    #[test]
    fn rejects_non_gguf() -> anyhow::Result<()> {
        let dir = std::env::temp_dir().join(format!("prism-gguf-test-{}", std::process::id()));
        std::fs::write(&dir, b"NOPE\x03\x00\x00\x00")?;
        let r = GgufFile::open(&dir);
        std::fs::remove_file(&dir)?;
        let e = r.err().context("a non-GGUF file must not open")?;
        assert!(matches!(&e, ModelError::File { source, .. } if matches!(**source, ModelError::NotGguf { .. })), "{e}");
        // The engine reports it as an internal error, as for every load failure.
        assert!(matches!(crate::request::EngineError::from(e), crate::request::EngineError::Internal(_)));
        Ok(())
    }
}
