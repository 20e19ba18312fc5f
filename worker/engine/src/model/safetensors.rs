//! Hugging Face model directories: `config.json`, `model.safetensors` or a sharded
//! `model.safetensors.index.json`, `tokenizer.json`, `tokenizer_config.json` (chat template,
//! special tokens) and `generation_config.json` (EOS ids). Tensors are mmapped (memmap2),
//! read through the `safetensors` crate's header parser and converted from
//! f32/f16/bf16 to f32. FP8 weights (F8_E4M3 / F8_E5M2 with their scale tensors, [`fp8`])
//! are dequantized to the same f32 (or bf16) values, or read as stored for an FP8 backend.

pub mod fp8;

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use half::{bf16, f16};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata};

use super::chat_template::ChatTemplate;
use super::config::{HfLlamaConfig, ModelConfig, TokenIds};
use super::error::{ModelError, ResultExt, tokenizer_no_panic};
use super::llama::{HostTensor, LlamaWeights, WeightSource};
use super::loaded::{LoadedModel, ProgressFn};
use super::quantization::CheckpointQuant;
use super::tokenizer::Tokenizer;

/// A tensor converted to f32: row-major shape, values, and the bytes it took in the file.
pub type ReadTensor = (Vec<usize>, Vec<f32>, usize);

/// One mmapped `.safetensors` file with its parsed header.
struct Shard {
    mmap: Mmap,
    data_start: usize,
    meta: Metadata,
}

/// A set of safetensors files addressed by tensor name.
pub struct SafetensorsFiles {
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
    /// The checkpoint's `quantization_config` (block sizes of block-wise FP8 scales).
    quantization: Option<CheckpointQuant>,
}

impl SafetensorsFiles {
    /// Opens `model.safetensors`, or every file named by `model.safetensors.index.json`.
    ///
    /// # Errors
    /// [`ModelError::File`] when neither exists or a header is invalid, [`ModelError::Index`]
    /// for an index without `weight_map` or naming a file outside `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self, ModelError> {
        let index_path = dir.join("model.safetensors.index.json");
        let files: Vec<String> = if index_path.exists() {
            let raw = std::fs::read_to_string(&index_path).in_file(&index_path)?;
            let v: serde_json::Value = serde_json::from_str(&raw).in_file(&index_path)?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| ModelError::Index("no weight_map".into()))?;
            let mut files: Vec<String> = map.values().filter_map(|f| f.as_str().map(str::to_owned)).collect();
            files.sort();
            files.dedup();
            files
        } else {
            vec!["model.safetensors".to_owned()]
        };
        let mut shards = Vec::with_capacity(files.len());
        let mut index = HashMap::new();
        for (i, name) in files.iter().enumerate() {
            if name.contains('/') || name.contains("..") {
                return Err(ModelError::Index(format!("names a file outside the directory: {name}")));
            }
            let path = dir.join(name);
            let file = File::open(&path).in_file(&path)?;
            // SAFETY: read-only mapping of a model file that is not modified while loaded.
            let mmap = unsafe { Mmap::map(&file) }.in_file(&path)?;
            let (n, meta) = match safetensors::SafeTensors::read_metadata(&mmap) {
                Ok(parsed) => parsed,
                // The parser does not say which tensor; find it so the error can.
                Err(e @ safetensors::SafeTensorError::TensorInvalidInfo) => {
                    return Err(ModelError::in_file(&path, byte_count_error(&mmap).unwrap_or(e.into())));
                }
                Err(e) => return Err(ModelError::in_file(&path, e)),
            };
            for t in meta.tensors().keys() {
                index.insert(t.clone(), i);
            }
            shards.push(Shard { mmap, data_start: 8 + n, meta });
        }
        Ok(Self { shards, index, quantization: None })
    }

    /// Sets the checkpoint's quantization (from `config.json`), which says the block size of
    /// block-wise FP8 scales; [`open_dir_model`] does this.
    pub fn set_quantization(&mut self, quantization: Option<CheckpointQuant>) {
        self.quantization = quantization;
    }

    /// Whether a tensor of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Total bytes of tensor data.
    pub fn total_bytes(&self) -> u64 {
        self.shards.iter().map(|s| (s.mmap.len() - s.data_start) as u64).sum()
    }

    /// A tensor converted to f32 with its shape; `None` when absent. Returns the bytes read too.
    /// An FP8 weight is dequantized with its scales ([`SafetensorsFiles::fp8_weight`]).
    ///
    /// # Errors
    /// [`ModelError::TensorType`] for dtypes other than f32/f16/bf16/F8_E4M3/F8_E5M2; for FP8
    /// weights, as [`SafetensorsFiles::fp8_weight`].
    pub fn tensor_f32(&self, name: &str) -> Result<Option<ReadTensor>, ModelError> {
        let Some((info, bytes)) = self.raw(name)? else { return Ok(None) };
        if is_fp8(info.dtype) {
            let (w, read) = self.fp8_weight_read(name)?;
            return Ok(Some((w.shape.to_vec(), w.dequantize(), read)));
        }
        Ok(Some((info.shape.clone(), float_values(name, info.dtype, bytes)?, bytes.len())))
    }

    /// The stored bytes of `name` with its header entry; `None` when absent.
    fn raw(&self, name: &str) -> Result<Option<(&safetensors::tensor::TensorInfo, &[u8])>, ModelError> {
        let Some(&i) = self.index.get(name) else { return Ok(None) };
        let shard = &self.shards[i];
        let info = shard.meta.info(name).ok_or_else(|| ModelError::MissingTensor { name: name.to_owned() })?;
        let (a, b) = info.data_offsets;
        let bytes = shard
            .mmap
            .get(shard.data_start + a..shard.data_start + b)
            .ok_or_else(|| ModelError::TensorBounds { name: name.to_owned() })?;
        Ok(Some((info, bytes)))
    }

    /// Appends tensor `name` to `out` as bf16 — copied as stored when the file holds bf16,
    /// rounded to nearest-even from f32/f16 and from FP8 weights dequantized in f32 — after
    /// checking its shape; returns the bytes read.
    /// A GPU backend loads a bf16 checkpoint this way without an f32 copy of the model.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`], [`ModelError::Shape`] or [`ModelError::TensorType`] when
    /// the tensor is missing, has another shape, or a dtype other than f32/f16/bf16/FP8; for
    /// FP8 weights, as [`SafetensorsFiles::fp8_weight`].
    pub fn append_bf16(&self, name: &str, shape: &[usize], out: &mut Vec<bf16>) -> Result<usize, ModelError> {
        let (info, bytes) = self.raw(name)?.ok_or_else(|| ModelError::MissingTensor { name: name.to_owned() })?;
        if info.shape != shape {
            return Err(ModelError::Shape {
                name: name.to_owned(),
                expected: shape.to_vec(),
                actual: info.shape.clone(),
            });
        }
        if is_fp8(info.dtype) {
            let (w, read) = self.fp8_weight_read(name)?;
            let mut f = Vec::new();
            w.dequantize_block(0..w.shape[0], 0..w.shape[1], &mut f);
            out.extend(f.into_iter().map(bf16::from_f32));
            return Ok(read);
        }
        match info.dtype {
            Dtype::BF16 => out.extend(bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]))),
            Dtype::F16 => {
                out.extend(bytes.chunks_exact(2).map(|c| bf16::from_f32(f16::from_le_bytes([c[0], c[1]]).to_f32())))
            }
            Dtype::F32 => {
                out.extend(bytes.chunks_exact(4).map(|c| bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))))
            }
            other => return Err(ModelError::TensorType { name: name.to_owned(), ty: format!("{other:?}") }),
        }
        Ok(bytes.len())
    }

    /// Appends the block `rows × cols` of the 2-D tensor `name` (stored `[shape[0], shape[1]]`,
    /// row-major) to `out` as bf16, row by row, converting as [`SafetensorsFiles::append_bf16`];
    /// returns the bytes read. A tensor-parallel shard takes whole rows (q/k/v, gate/up) or a
    /// column range of every row (o_proj, down_proj) this way, straight from the mmap.
    ///
    /// # Errors
    /// As [`SafetensorsFiles::append_bf16`] (FP8 weights dequantized as there); [`ModelError::Shard`]
    /// when the block is outside the tensor.
    pub fn append_bf16_block(
        &self,
        name: &str,
        shape: [usize; 2],
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        out: &mut Vec<bf16>,
    ) -> Result<usize, ModelError> {
        let (info, bytes) = self.raw(name)?.ok_or_else(|| ModelError::MissingTensor { name: name.to_owned() })?;
        if info.shape != shape {
            return Err(ModelError::Shape {
                name: name.to_owned(),
                expected: shape.to_vec(),
                actual: info.shape.clone(),
            });
        }
        if rows.start > rows.end || rows.end > shape[0] || cols.start > cols.end || cols.end > shape[1] {
            return Err(ModelError::Shard(format!(
                "{name}: block rows {rows:?} x cols {cols:?} is outside its shape {shape:?}"
            )));
        }
        if is_fp8(info.dtype) {
            let (w, _) = self.fp8_weight_read(name)?;
            let mut f = Vec::new();
            w.dequantize_block(rows.clone(), cols.clone(), &mut f);
            out.extend(f.into_iter().map(bf16::from_f32));
            return Ok(rows.len() * cols.len());
        }
        let es = match info.dtype {
            Dtype::BF16 | Dtype::F16 => 2,
            Dtype::F32 => 4,
            other => return Err(ModelError::TensorType { name: name.to_owned(), ty: format!("{other:?}") }),
        };
        let mut read = 0;
        for r in rows {
            let a = (r * shape[1] + cols.start) * es;
            let b = (r * shape[1] + cols.end) * es;
            let row = bytes.get(a..b).ok_or_else(|| ModelError::TensorBounds { name: name.to_owned() })?;
            match info.dtype {
                Dtype::BF16 => out.extend(row.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]))),
                Dtype::F16 => {
                    out.extend(row.chunks_exact(2).map(|c| bf16::from_f32(f16::from_le_bytes([c[0], c[1]]).to_f32())))
                }
                _ => out
                    .extend(row.chunks_exact(4).map(|c| bf16::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]])))),
            }
            read += row.len();
        }
        Ok(read)
    }
}

/// Whether `dtype` is an FP8 format the loader reads ([`SafetensorsFiles::fp8_weight`]).
fn is_fp8(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F8_E4M3 | Dtype::F8_E5M2)
}

/// The first tensor of a safetensors file whose data offsets do not span the bytes its dtype
/// and shape need, as [`ModelError::TensorBytes`] (the header parser reports only that one
/// does not). `None` when the header cannot be read here either.
fn byte_count_error(file: &[u8]) -> Option<ModelError> {
    let n = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header: serde_json::Value = serde_json::from_slice(file.get(8..8usize.checked_add(n)?)?).ok()?;
    header.as_object()?.iter().filter(|(k, _)| *k != "__metadata__").find_map(|(name, t)| {
        let dtype: Dtype = serde_json::from_value(t.get("dtype")?.clone()).ok()?;
        let shape: Vec<usize> = serde_json::from_value(t.get("shape")?.clone()).ok()?;
        let offsets: [usize; 2] = serde_json::from_value(t.get("data_offsets")?.clone()).ok()?;
        let bits = shape.iter().try_fold(dtype.bitsize(), |a, &d| a.checked_mul(d))?;
        let actual = offsets[1].checked_sub(offsets[0])?;
        (bits / 8 != actual).then(|| ModelError::TensorBytes {
            name: name.clone(),
            dtype: format!("{dtype:?}"),
            shape,
            expected: bits / 8,
            actual,
        })
    })
}

/// f32/f16/bf16 little-endian `bytes` as f32.
fn float_values(name: &str, dtype: Dtype, bytes: &[u8]) -> Result<Vec<f32>, ModelError> {
    Ok(match dtype {
        Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        Dtype::F16 => bytes.chunks_exact(2).map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        Dtype::BF16 => bytes.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
        other => return Err(ModelError::TensorType { name: name.to_owned(), ty: format!("{other:?}") }),
    })
}

/// A Hugging Face model directory opened without reading its weights: configuration,
/// tokenizer, chat template and the mmapped `.safetensors` files (a GPU backend uploads the
/// tensors from the files itself).
pub struct HfDirModel {
    /// Architecture hyper-parameters and special token ids.
    pub config: ModelConfig,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template, when the model ships one.
    pub chat_template: Option<ChatTemplate>,
    /// The weights, mmapped.
    pub files: SafetensorsFiles,
}

struct Source<'a> {
    files: &'a SafetensorsFiles,
    done: u64,
    total: u64,
    progress: ProgressFn<'a>,
}

impl WeightSource for Source<'_> {
    fn tensor(&mut self, hf_name: &str) -> Result<Option<HostTensor>, ModelError> {
        Ok(self.files.tensor_f32(hf_name)?.map(|(shape, data, n)| {
            self.done += n as u64;
            (self.progress)(self.done, self.total);
            (shape, data)
        }))
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>, ModelError> {
    match std::fs::read_to_string(path) {
        Ok(s) => serde_json::from_str(&s).map(Some).in_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ModelError::in_file(path, e)),
    }
}

/// `chat_template` in `tokenizer_config.json`: a string, or a list of `{name, template}`
/// (the one named "default" is used).
fn chat_template_source(tok_cfg: &serde_json::Value) -> Option<String> {
    match tok_cfg.get("chat_template")? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(list) => list
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    }
}

/// Loads a Hugging Face Llama-family model directory.
///
/// # Errors
/// [`ModelError`] on missing/invalid files or unsupported architectures.
pub fn load_dir(dir: &Path, progress: ProgressFn<'_>) -> Result<LoadedModel, ModelError> {
    let HfDirModel { config, tokenizer, chat_template, files } = open_dir_model(dir)?;
    let total = files.total_bytes();
    let mut src = Source { files: &files, done: 0, total, progress };
    let weights = LlamaWeights::load(&config, &mut src)?;
    Ok(LoadedModel { config, tokenizer, chat_template, weights })
}

/// Opens a Hugging Face Llama-family model directory without reading its tensors.
///
/// # Errors
/// As [`load_dir`].
pub fn open_dir_model(dir: &Path) -> Result<HfDirModel, ModelError> {
    let cfg_path = dir.join("config.json");
    let raw = std::fs::read_to_string(&cfg_path).in_file(&cfg_path)?;
    let hf: HfLlamaConfig = serde_json::from_str(&raw).in_file(&cfg_path)?;
    let mut config = ModelConfig::from_hf(&hf).in_file(&cfg_path)?;
    if let Some(gen_cfg) = read_json(&dir.join("generation_config.json"))?
        && let Some(eos) = gen_cfg.get("eos_token_id").and_then(|v| serde_json::from_value::<TokenIds>(v.clone()).ok())
    {
        for id in eos.to_vec() {
            if !config.eos_token_ids.contains(&id) {
                config.eos_token_ids.push(id);
            }
        }
    }
    // `from_hf_dir` names tokenizer.json in its own errors; a parser panic is named here.
    let tokenizer = match tokenizer_no_panic(|| Tokenizer::from_hf_dir(dir, config.bos_token_id, &config.eos_token_ids))
    {
        Err(e @ ModelError::Tokenizer(_)) => return Err(ModelError::in_file(&dir.join("tokenizer.json"), e)),
        r => r?,
    };
    config.bos_token_id = tokenizer.bos_id();
    config.eos_token_ids = tokenizer.eos_ids().to_vec();
    let chat_template = match read_json(&dir.join("tokenizer_config.json"))?.as_ref().and_then(chat_template_source) {
        Some(src) => Some(ChatTemplate::new(&src, tokenizer.bos_text(), tokenizer.eos_text())?),
        None => None,
    };
    let mut files = SafetensorsFiles::open_dir(dir)?;
    files.set_quantization(config.quantization.clone());
    if !files.contains("lm_head.weight") {
        config.tie_word_embeddings = true;
    }
    Ok(HfDirModel { config, tokenizer, chat_template, files })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes `model.safetensors` by hand (8-byte header length, JSON header, data).
    fn write_file(dir: &Path, tensors: &[(&str, &str, Vec<usize>, Vec<u8>)]) {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, dtype, shape, bytes) in tensors {
            let start = data.len();
            data.extend_from_slice(bytes);
            header.insert(
                (*name).to_owned(),
                serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, data.len()]}),
            );
        }
        let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).expect("test file");
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend_from_slice(&data);
        std::fs::write(dir.join("model.safetensors"), out).expect("test file");
    }

    #[test]
    fn missing_files_name_the_file_and_keep_the_io_error() {
        let dir = std::env::temp_dir().join(format!("prism-st-missing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("test dir");
        let e = open_dir_model(&dir).err().expect("a directory without config.json must not open");
        assert!(
            matches!(&e, ModelError::File { path, source } if path.ends_with("config.json")
                && matches!(&**source, ModelError::Io(io) if io.kind() == std::io::ErrorKind::NotFound)),
            "{e}"
        );
        std::fs::write(dir.join("config.json"), "{").expect("test file");
        let e = open_dir_model(&dir).err().expect("invalid JSON must not open");
        assert!(matches!(&e, ModelError::File { source, .. } if matches!(**source, ModelError::Json(_))), "{e}");
        let engine = crate::request::EngineError::from(e);
        assert!(
            matches!(&engine, crate::request::EngineError::Internal(m) if m.starts_with("model load: ")),
            "{engine}"
        );
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn append_bf16_copies_bf16_and_rounds_f32_f16_like_the_f32_path() {
        let dir = std::env::temp_dir().join(format!("prism-st-bf16-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("test file");
        let vals = [1.0f32, -2.5, 3.140_625, 1.0e-3, 65_504.0, -0.333_333_34];
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect();
        let bf16b: Vec<u8> = vals.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
        write_file(
            &dir,
            &[("a", "F32", vec![2, 3], f32b), ("b", "F16", vec![2, 3], f16b), ("c", "BF16", vec![2, 3], bf16b.clone())],
        );
        let files = SafetensorsFiles::open_dir(&dir).expect("test file");
        for name in ["a", "b", "c"] {
            let mut out = Vec::new();
            let n = files.append_bf16(name, &[2, 3], &mut out).expect("test file");
            assert!(n == 24 || n == 12, "{name}: {n} bytes");
            // The f32 path rounded to bf16 gives the same values (bf16 is exact in f32).
            let (_, f, _) = files.tensor_f32(name).expect("test file").expect("test file");
            let want: Vec<bf16> = f.iter().map(|&v| bf16::from_f32(v)).collect();
            assert_eq!(out, want, "{name}");
        }
        // bf16 is copied bit for bit.
        let mut out = Vec::new();
        files.append_bf16("c", &[2, 3], &mut out).expect("test file");
        let bits: Vec<u8> = out.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(bits, bf16b);
        // Appends after what is there (fused q/k/v).
        files.append_bf16("a", &[2, 3], &mut out).expect("test file");
        assert_eq!(out.len(), 12);
        // Wrong shape and missing tensors are errors naming the tensor.
        let e = files.append_bf16("a", &[3, 2], &mut Vec::new()).expect_err("must fail").to_string();
        assert!(e.contains("tensor a: shape [2, 3], expected [3, 2]"), "{e}");
        let e = files.append_bf16("zz", &[1], &mut Vec::new()).expect_err("must fail").to_string();
        assert!(e.contains("missing tensor zz"), "{e}");
        let e = files.append_bf16("a", &[3, 2], &mut Vec::new()).expect_err("must fail");
        assert!(
            matches!(&e, ModelError::Shape { name, expected, actual } if name == "a" && expected == &[3, 2] && actual == &[2, 3]),
            "{e}"
        );
        let e = files.append_bf16("zz", &[1], &mut Vec::new()).expect_err("must fail");
        assert!(matches!(&e, ModelError::MissingTensor { name } if name == "zz"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn bf16_blocks_are_the_rows_and_columns_of_the_whole_tensor() {
        let dir = std::env::temp_dir().join(format!("prism-st-block-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("test dir");
        // A 4 x 6 tensor with distinct values, in each dtype.
        let vals: Vec<f32> = (0..24).map(|i| i as f32 * 0.5 - 3.0).collect();
        let f32b: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        let f16b: Vec<u8> = vals.iter().flat_map(|&v| f16::from_f32(v).to_le_bytes()).collect();
        let bf16b: Vec<u8> = vals.iter().flat_map(|&v| bf16::from_f32(v).to_le_bytes()).collect();
        write_file(
            &dir,
            &[("a", "F32", vec![4, 6], f32b), ("b", "F16", vec![4, 6], f16b), ("c", "BF16", vec![4, 6], bf16b)],
        );
        let files = SafetensorsFiles::open_dir(&dir).expect("test file");
        for name in ["a", "b", "c"] {
            let mut whole = Vec::new();
            files.append_bf16(name, &[4, 6], &mut whole).expect("test file");
            // Rows 1..3 (a q/k/v shard), appended after what is there.
            let mut out = vec![bf16::ONE];
            files.append_bf16_block(name, [4, 6], 1..3, 0..6, &mut out).expect("test file");
            assert_eq!(out[0], bf16::ONE);
            assert_eq!(&out[1..], &whole[6..18], "{name} rows");
            // Columns 2..5 of every row (an o_proj shard).
            let mut out = Vec::new();
            let n = files.append_bf16_block(name, [4, 6], 0..4, 2..5, &mut out).expect("test file");
            let want: Vec<bf16> = (0..4).flat_map(|r| whole[r * 6 + 2..r * 6 + 5].to_vec()).collect();
            assert_eq!(out, want, "{name} cols");
            assert_eq!(n, 12 * if name == "a" { 4 } else { 2 });
        }
        let e = files.append_bf16_block("a", [4, 6], 0..5, 0..6, &mut Vec::new()).expect_err("outside");
        assert!(matches!(&e, ModelError::Shard(m) if m.contains("rows 0..5")), "{e}");
        let e = files.append_bf16_block("a", [6, 4], 0..1, 0..1, &mut Vec::new()).expect_err("wrong shape");
        assert!(matches!(&e, ModelError::Shape { name, .. } if name == "a"), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
