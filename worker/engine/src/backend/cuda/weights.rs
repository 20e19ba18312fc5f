//! Llama weights on the device in bf16: one allocation for everything (fixed addresses),
//! q/k/v stacked into one `[q + 2·kv, hidden]` matrix and gate/up into `[2·inter, hidden]`
//! (one GEMM each, as vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear`). Filled from
//! f32 host weights (rounded to nearest-even bf16), straight from a Hugging Face checkpoint's
//! mmapped `.safetensors` one tensor at a time (bf16 copied as stored: no f32 copy of the model
//! on the host), or with seeded random values generated on the device ([`SyntheticShape`],
//! benchmarks at real sizes).
//!
//! With FP8 ([`WeightFormat::fp8`]) every decoder-layer matrix is stored as e4m3 codes with one
//! f32 scale per output row, quantized on the device as it is uploaded (`fp8.rs`: each matrix
//! goes through a bf16 staging buffer on the device, then into its codes and scales); the
//! embedding and norms stay bf16, the lm_head too unless [`WeightFormat::fp8_lm_head`].

use half::bf16;

use super::device::{DevBuf, Gpu};
use super::error::CudaError;
use super::fp8::Fp8Kernels;
use super::options::{Dims, SyntheticShape};
use crate::model::config::ModelConfig;
use crate::model::error::ModelError;
use crate::model::llama::LlamaWeights;
use crate::model::safetensors::SafetensorsFiles;

/// Device addresses of one decoder layer's weights.
pub(crate) struct LayerPtrs {
    pub input_norm: u64,
    pub qkv: u64,
    pub o_proj: u64,
    pub post_norm: u64,
    pub gate_up: u64,
    pub down: u64,
    /// `[qkv_dim]` q, k, v biases (0: none).
    pub qkv_bias: u64,
    /// `[head_dim]` per-head q and k RMSNorm gains (0: none).
    pub q_norm: u64,
    pub k_norm: u64,
    /// `[hidden]` RMSNorm gains of the attention output and of the MLP output before their
    /// residual adds (0: none).
    pub attn_out_norm: u64,
    pub ffn_out_norm: u64,
    /// FP8: the f32 per-row scales of qkv, o_proj, gate_up and down (0 for bf16 weights).
    pub qkv_scale: u64,
    pub o_proj_scale: u64,
    pub gate_up_scale: u64,
    pub down_scale: u64,
}

/// How the weights are stored on the device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct WeightFormat {
    /// Decoder-layer matrices in e4m3 with per-output-row f32 scales.
    pub fp8: bool,
    /// The lm_head in e4m3 too (its own copy when tied to the embedding).
    pub fp8_lm_head: bool,
}

/// Which of the model-family tensors every layer has beyond Llama's (the default: none).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LayerExtras {
    /// q/k/v biases.
    pub qkv_bias: bool,
    /// Per-head q/k RMSNorm gains.
    pub qk_norm: bool,
    /// Norms of the attention and MLP outputs.
    pub sandwich_norms: bool,
}

impl LayerExtras {
    fn of(cfg: &ModelConfig) -> Self {
        let a = &cfg.arch;
        Self { qkv_bias: a.attention_bias, qk_norm: a.qk_norm, sandwich_norms: a.sandwich_norms }
    }
}

/// Element offsets of one layer's model-family tensors ([`LayerExtras`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ExtraOffsets {
    qkv_bias: Option<usize>,
    qk_norm: Option<[usize; 2]>,
    sandwich_norms: Option<[usize; 2]>,
}

/// All weights in one device buffer.
pub(crate) struct DeviceWeights {
    _buf: DevBuf,
    pub embed: u64,
    pub lm_head: u64,
    /// The FP8 lm_head's per-row scales (0 when it is bf16).
    pub lm_head_scale: u64,
    pub norm: u64,
    pub layers: Vec<LayerPtrs>,
    /// Bytes of weights.
    pub bytes: usize,
}

/// Which part of a checkpoint one rank holds: tensor-parallel shard `tp_rank` of `tp_size`
/// (whole heads of q/k/v and rows of gate/up, the matching columns of o_proj and down_proj —
/// Megatron-LM's split) of the decoder layers `layers`, with the embedding on the first
/// pipeline stage and the final norm and lm_head on the last. [`ShardSpec::full`] is the
/// whole model (the single-GPU backend).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ShardSpec {
    pub tp_rank: usize,
    pub tp_size: usize,
    pub layers: std::ops::Range<usize>,
    /// Holds the embedding (first stage).
    pub first_stage: bool,
    /// Holds the final norm and lm_head (last stage).
    pub last_stage: bool,
}

impl ShardSpec {
    /// The whole model of `num_layers` layers.
    pub fn full(num_layers: usize) -> Self {
        Self { tp_rank: 0, tp_size: 1, layers: 0..num_layers, first_stage: true, last_stage: true }
    }
}

/// Offsets (2-byte units) of every tensor in the single buffer.
struct Layout {
    total: usize,
    /// The embedding (also the lm_head when tied); `None` on a middle or untied last stage.
    embed: Option<usize>,
    /// An untied (or FP8) lm_head on the last stage.
    lm_head: Option<usize>,
    /// The FP8 lm_head's scales.
    lm_head_scale: Option<usize>,
    norm: usize,
    layers: Vec<[usize; 6]>,
    /// Each layer's [`LayerExtras`] tensors, placed after its six Llama tensors.
    extras: Vec<ExtraOffsets>,
    /// FP8: per layer the scales of qkv, o_proj, gate_up and down (empty for bf16).
    scales: Vec<[usize; 4]>,
}

/// `d` is the local shard's dimensions (its heads, MLP rows and layer count). The whole
/// model's layout in bf16 is the same as it always was: embedding, lm_head (untied), norm,
/// layers; a Llama model (no [`LayerExtras`]) keeps exactly that layout.
#[cfg(test)]
fn layout(d: &Dims, tied: bool, first_stage: bool, last_stage: bool, ex: LayerExtras) -> Layout {
    layout_as(d, tied, first_stage, last_stage, WeightFormat::default(), ex)
}

/// [`layout`] for weights stored as `f`: an FP8 matrix of `n` values takes `n` bytes, its
/// scales 4 bytes per row, after the layers. Each layer's [`LayerExtras`] tensors (biases and
/// gains: never FP8) follow its six Llama tensors.
fn layout_as(d: &Dims, tied: bool, first_stage: bool, last_stage: bool, f: WeightFormat, ex: LayerExtras) -> Layout {
    let mut at = 0usize;
    let mut take = |n: usize| {
        let o = at;
        // 256-byte alignment for every tensor.
        at += n.div_ceil(128) * 128;
        o
    };
    // Units a matrix of `n` values takes.
    let mat = |n: usize| if f.fp8 { n.div_ceil(2) } else { n };
    let fp8_head = f.fp8 && f.fp8_lm_head && last_stage;
    let embed = (first_stage || (last_stage && tied && !fp8_head)).then(|| take(d.vocab * d.hidden));
    let lm_head = if fp8_head {
        Some(take(d.vocab * d.hidden / 2))
    } else {
        (last_stage && !tied).then(|| take(d.vocab * d.hidden))
    };
    let norm = take(d.hidden);
    let mut layers = Vec::with_capacity(d.layers);
    let mut extras = Vec::with_capacity(d.layers);
    for _ in 0..d.layers {
        layers.push([
            take(d.hidden),
            take(mat(d.qkv_dim() * d.hidden)),
            take(mat(d.hidden * d.q_dim())),
            take(d.hidden),
            take(mat(2 * d.inter * d.hidden)),
            take(mat(d.hidden * d.inter)),
        ]);
        extras.push(ExtraOffsets {
            qkv_bias: ex.qkv_bias.then(|| take(d.qkv_dim())),
            qk_norm: ex.qk_norm.then(|| [take(d.head_dim), take(d.head_dim)]),
            sandwich_norms: ex.sandwich_norms.then(|| [take(d.hidden), take(d.hidden)]),
        });
    }
    let scales = if f.fp8 {
        (0..d.layers)
            .map(|_| [take(2 * d.qkv_dim()), take(2 * d.hidden), take(4 * d.inter), take(2 * d.hidden)])
            .collect()
    } else {
        Vec::new()
    };
    let lm_head_scale = fp8_head.then(|| take(2 * d.vocab));
    Layout { total: at, embed, lm_head, lm_head_scale, norm, layers, extras, scales }
}

/// Uploads bf16 matrices into their slots: as they are, or (FP8) through a bf16 staging
/// buffer on the device into e4m3 codes and per-row scales.
struct Sink<'a> {
    gpu: &'a Gpu,
    buf: &'a DevBuf,
    /// FP8: the quantization kernels and the device staging buffer.
    q: Option<(Fp8Kernels, DevBuf)>,
}

/// The parts (all FP8 e4m3 with per-tensor or per-channel scales) as stored: their rows'
/// codes into `codes` and one scale per row into `scales`; the bytes read, or `None` when a
/// part is not such a tensor (block scales, E5M2, bf16: those load through bf16).
fn fp8_as_stored(
    files: &SafetensorsFiles,
    parts: &[Part<'_>],
    codes: &mut Vec<u8>,
    scales: &mut Vec<f32>,
) -> Result<Option<u64>, CudaError> {
    use crate::model::fp8::{Fp8Format, Fp8Scales};
    codes.clear();
    scales.clear();
    let mut read = 0u64;
    for part in parts {
        let Some(w) = files.fp8_weight(part.name)? else { return Ok(None) };
        if w.format != Fp8Format::E4M3 || matches!(w.scales, Fp8Scales::Block { .. }) || part.shape.len() != 2 {
            return Ok(None);
        }
        let [out_f, inp] = w.shape;
        let (rows, cols) = part.block.clone().unwrap_or((0..out_f, 0..inp));
        for r in rows {
            codes.extend_from_slice(&w.bytes[r * inp + cols.start..r * inp + cols.end]);
            scales.push(w.scales.at(r, 0, inp));
        }
        read += w.bytes.len() as u64;
    }
    Ok(Some(read))
}

impl Sink<'_> {
    /// e4m3 `codes` (whole rows) and their per-row `scales` into an FP8 slot as they are.
    fn put_codes(&self, off: usize, scale_off: usize, codes: &[u8], scales: &[f32]) -> Result<(), CudaError> {
        self.gpu.upload(self.buf, off * 2, codes)?;
        self.gpu.upload(self.buf, scale_off * 2, scales)?;
        // The staging vectors are reused: wait for the (pageable, staged) copies.
        self.gpu.sync()
    }

    /// `vals` (bf16, whole rows of `cols`) into the slot at `off` (2-byte units); with a scale
    /// slot and FP8, quantized per row.
    fn put(&self, off: usize, scale_off: Option<usize>, cols: usize, vals: &[bf16]) -> Result<(), CudaError> {
        match (&self.q, scale_off) {
            (Some((k, tmp)), Some(so)) => {
                self.gpu.upload(tmp, 0, vals)?;
                let rows = vals.len() / cols.max(1);
                let at = |o: usize| self.buf.ptr + (o * 2) as u64;
                k.quantize(self.gpu, at(off), at(so), tmp.ptr, rows, cols)?;
            }
            _ => self.gpu.upload(self.buf, off * 2, vals)?,
        }
        // The staging vector is reused: wait for the (pageable, staged) copy.
        self.gpu.sync()
    }

    /// Device-generated values: `gen(ptr)` writes `rows × cols` bf16 at `ptr`, the slot itself
    /// for bf16, the device staging buffer for FP8 (then quantized into the slot).
    fn generate(
        &self,
        off: usize,
        scale_off: Option<usize>,
        rows: usize,
        cols: usize,
        fill: impl FnOnce(u64) -> Result<(), CudaError>,
    ) -> Result<(), CudaError> {
        let at = |o: usize| self.buf.ptr + (o * 2) as u64;
        match (&self.q, scale_off) {
            (Some((k, tmp)), Some(so)) => {
                fill(tmp.ptr)?;
                k.quantize(self.gpu, at(off), at(so), tmp.ptr, rows, cols)
            }
            _ => fill(at(off)),
        }
    }
}

/// The sink for `l` in `buf`, with a staging buffer for the largest matrix when FP8.
fn sink<'a>(gpu: &'a Gpu, buf: &'a DevBuf, d: &Dims, f: WeightFormat) -> Result<Sink<'a>, CudaError> {
    if !f.fp8 {
        return Ok(Sink { gpu, buf, q: None });
    }
    if !(d.hidden.is_multiple_of(16) && d.inter.is_multiple_of(16) && d.q_dim().is_multiple_of(16)) {
        return Err(CudaError::Unsupported(format!(
            "FP8 weights need hidden, intermediate and q widths that are multiples of 16 ({}, {}, {})",
            d.hidden,
            d.inter,
            d.q_dim()
        )));
    }
    let most = [d.qkv_dim() * d.hidden, d.hidden * d.q_dim(), 2 * d.inter * d.hidden, d.hidden * d.inter];
    let mut most = most.into_iter().max().unwrap_or(0);
    if f.fp8_lm_head {
        most = most.max(d.vocab * d.hidden);
    }
    Ok(Sink { gpu, buf, q: Some((Fp8Kernels::new(gpu)?, DevBuf::zeroed(gpu, most * 2)?)) })
}

/// One piece of a fused device tensor: `name` (stored with `shape`), whole or the block
/// `rows × cols` of a 2-D tensor.
struct Part<'a> {
    name: &'a str,
    shape: &'a [usize],
    block: Option<(std::ops::Range<usize>, std::ops::Range<usize>)>,
}

impl<'a> Part<'a> {
    fn whole(name: &'a str, shape: &'a [usize]) -> Self {
        Self { name, shape, block: None }
    }

    /// Rows `rows` (all columns) of `name [shape[0], shape[1]]`; the whole tensor when that is
    /// every row.
    fn rows(name: &'a str, shape: &'a [usize], rows: std::ops::Range<usize>) -> Self {
        let block = (rows != (0..shape[0])).then(|| (rows, 0..shape[1]));
        Self { name, shape, block }
    }

    /// Columns `cols` of every row of `name [shape[0], shape[1]]` (strided per row).
    fn cols(name: &'a str, shape: &'a [usize], cols: std::ops::Range<usize>) -> Self {
        let block = (cols != (0..shape[1])).then(|| (0..shape[0], cols));
        Self { name, shape, block }
    }

    /// Elements `range` of the 1-D tensor `name [shape[0]]` (a tensor-parallel slice of a bias).
    fn range(name: &'a str, shape: &'a [usize], range: std::ops::Range<usize>) -> Self {
        let block = (range != (0..shape[0])).then_some((range, 0..1));
        Self { name, shape, block }
    }
}

/// Appends `part` of `files` to `out` as bf16; returns the bytes read.
fn append_part(files: &SafetensorsFiles, part: &Part<'_>, out: &mut Vec<bf16>) -> Result<usize, ModelError> {
    match (&part.block, part.shape) {
        (None, _) => files.append_bf16(part.name, part.shape, out),
        (Some((range, _)), [len]) => {
            // A 1-D slice: the whole (small) tensor is read, the slice kept.
            let start = out.len();
            let bytes = files.append_bf16(part.name, &[*len], out)?;
            if range.end > *len {
                return Err(ModelError::Shard(format!("{}: range {range:?} is outside [{len}]", part.name)));
            }
            out.truncate(start + range.end);
            out.drain(start..start + range.start);
            Ok(bytes)
        }
        (Some((rows, cols)), shape) => {
            files.append_bf16_block(part.name, [shape[0], shape[1]], rows.clone(), cols.clone(), out)
        }
    }
}

/// Adds `offset` to every value (RMSNorm gains stored as `g - 1`), rounding back to bf16.
fn add_offset(v: &mut [bf16], offset: f32) {
    if offset != 0.0 {
        for x in v {
            *x = bf16::from_f32(x.to_f32() + offset);
        }
    }
}

impl DeviceWeights {
    /// Whether any matrix is stored in FP8.
    pub fn has_fp8(&self) -> bool {
        self.lm_head_scale != 0 || self.layers.iter().any(|l| l.qkv_scale != 0)
    }

    fn from_layout(buf: DevBuf, l: &Layout) -> Self {
        let p = |o: usize| buf.ptr + (o * 2) as u64;
        let layers = l
            .layers
            .iter()
            .zip(&l.extras)
            .enumerate()
            .map(|(i, (o, x))| {
                let sc = l.scales.get(i).map_or([0; 4], |s| s.map(p));
                LayerPtrs {
                    input_norm: p(o[0]),
                    qkv: p(o[1]),
                    o_proj: p(o[2]),
                    post_norm: p(o[3]),
                    gate_up: p(o[4]),
                    down: p(o[5]),
                    qkv_bias: x.qkv_bias.map_or(0, p),
                    q_norm: x.qk_norm.map_or(0, |[q, _]| p(q)),
                    k_norm: x.qk_norm.map_or(0, |[_, k]| p(k)),
                    attn_out_norm: x.sandwich_norms.map_or(0, |[a, _]| p(a)),
                    ffn_out_norm: x.sandwich_norms.map_or(0, |[_, f]| p(f)),
                    qkv_scale: sc[0],
                    o_proj_scale: sc[1],
                    gate_up_scale: sc[2],
                    down_scale: sc[3],
                }
            })
            .collect();
        let embed = l.embed.map_or(0, p);
        Self {
            embed,
            lm_head: l.lm_head.map_or(embed, p),
            lm_head_scale: l.lm_head_scale.map_or(0, p),
            norm: p(l.norm),
            layers,
            bytes: buf.bytes,
            _buf: buf,
        }
    }

    /// Uploads a Hugging Face Llama checkpoint tensor by tensor from its mmapped files (bf16
    /// as stored, f32/f16 rounded to bf16); the host holds one tensor (or one fused q/k/v or
    /// gate/up matrix) at a time. Only `spec`'s part is read: its layers, its tensor-parallel
    /// rows and columns (strided row by row straight from the mmap), the embedding on the first
    /// stage and the final norm and lm_head on the last (a tied lm_head is the embedding).
    /// `progress(done, total)` reports bytes read.
    ///
    /// # Errors
    /// [`CudaError::Model`] for a missing tensor, a shape that disagrees with `cfg`, a split
    /// `spec.tp_size` does not divide or an unsupported dtype; [`CudaError`] on an
    /// allocation or copy failure.
    pub fn from_safetensors(
        gpu: &Gpu,
        files: &SafetensorsFiles,
        cfg: &ModelConfig,
        spec: &ShardSpec,
        format: WeightFormat,
        progress: &dyn Fn(u64, u64),
    ) -> Result<(Self, Dims), CudaError> {
        let tp = spec.tp_size.max(1);
        let divides = cfg.num_attention_heads.is_multiple_of(tp)
            && cfg.num_key_value_heads.is_multiple_of(tp)
            && cfg.intermediate_size.is_multiple_of(tp);
        if !divides || spec.tp_rank >= tp || spec.layers.end > cfg.num_hidden_layers || spec.layers.is_empty() {
            return Err(CudaError::Model(ModelError::Shard(format!(
                "shard {spec:?} of a model with {} heads, {} KV heads, intermediate size {}, {} layers",
                cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size, cfg.num_hidden_layers
            ))));
        }
        let d = Dims {
            hidden: cfg.hidden_size,
            q_heads: cfg.num_attention_heads / tp,
            kv_heads: cfg.num_key_value_heads / tp,
            head_dim: cfg.head_dim,
            inter: cfg.intermediate_size / tp,
            vocab: cfg.vocab_size,
            layers: spec.layers.len(),
            eps: cfg.rms_norm_eps,
        };
        let tied = cfg.tie_word_embeddings || !files.contains("lm_head.weight");
        let ex = LayerExtras::of(cfg);
        let l = layout_as(&d, tied, spec.first_stage, spec.last_stage, format, ex);
        let buf = DevBuf::zeroed(gpu, l.total * 2)?;
        let out = sink(gpu, &buf, &d, format)?;
        let total = files.total_bytes();
        let mut done = 0u64;
        let mut staging: Vec<bf16> = Vec::new();
        // RMSNorm gains get the checkpoint's offset (`gain_offset`), matrices and biases not;
        // `q`: the scale slot and row width of a matrix FP8 quantizes (never a bias or gain).
        let offset = cfg.arch.norm_weight_offset;
        let mut codes: Vec<u8> = Vec::new();
        let mut scales: Vec<f32> = Vec::new();
        let mut put =
            |off: usize, q: Option<(usize, usize)>, parts: &[Part<'_>], gain_offset: f32| -> Result<(), CudaError> {
                // An FP8 checkpoint's e4m3 codes with per-tensor or per-channel scales go to an FP8
                // slot as stored (no dequantization); anything else through bf16.
                if let (Some((so, _)), true) = (q, out.q.is_some())
                    && let Some(n) = fp8_as_stored(files, parts, &mut codes, &mut scales)?
                {
                    done += n;
                    out.put_codes(off, so, &codes, &scales)?;
                    progress(done, total);
                    return Ok(());
                }
                staging.clear();
                for part in parts {
                    done += append_part(files, part, &mut staging)? as u64;
                }
                add_offset(&mut staging, gain_offset);
                out.put(off, q.map(|q| q.0), q.map_or(1, |q| q.1), &staging)?;
                progress(done, total);
                Ok(())
            };
        let (h, v, r) = (d.hidden, d.vocab, spec.tp_rank);
        // Whole-model widths (stored shapes) and this shard's slices of them.
        let (qw, kv, iw) =
            (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size);
        let (qs, kvs, is) =
            (r * d.q_dim()..(r + 1) * d.q_dim(), r * d.kv_dim()..(r + 1) * d.kv_dim(), r * d.inter..(r + 1) * d.inter);
        if let Some(o) = l.embed {
            put(o, None, &[Part::whole("model.embed_tokens.weight", &[v, h])], 0.0)?;
        }
        if let Some(o) = l.lm_head {
            let name = if tied { "model.embed_tokens.weight" } else { "lm_head.weight" };
            put(o, l.lm_head_scale.map(|s| (s, h)), &[Part::whole(name, &[v, h])], 0.0)?;
        }
        if spec.last_stage {
            put(l.norm, None, &[Part::whole("model.norm.weight", &[h])], offset)?;
        }
        // Gemma 3 names its norm before the MLP `pre_feedforward_layernorm` and uses
        // `post_attention_layernorm` for the norm of the attention output.
        let ffn_norm = if ex.sandwich_norms { "pre_feedforward_layernorm" } else { "post_attention_layernorm" };
        let hd = cfg.head_dim;
        for (i, ((li, o), x)) in spec.layers.clone().zip(&l.layers).zip(&l.extras).enumerate() {
            let sc = l.scales.get(i).copied();
            let q = |k: usize, cols: usize| sc.map(|s| (s[k], cols));
            let n = |t: &str| format!("model.layers.{li}.{t}.weight");
            let (ln1, qn, kn, vn) =
                (n("input_layernorm"), n("self_attn.q_proj"), n("self_attn.k_proj"), n("self_attn.v_proj"));
            let (on, ln2, gn, un, dn) =
                (n("self_attn.o_proj"), n(ffn_norm), n("mlp.gate_proj"), n("mlp.up_proj"), n("mlp.down_proj"));
            put(o[0], None, &[Part::whole(&ln1, &[h])], offset)?;
            put(
                o[1],
                q(0, h),
                &[
                    Part::rows(&qn, &[qw, h], qs.clone()),
                    Part::rows(&kn, &[kv, h], kvs.clone()),
                    Part::rows(&vn, &[kv, h], kvs.clone()),
                ],
                0.0,
            )?;
            put(o[2], q(1, d.q_dim()), &[Part::cols(&on, &[h, qw], qs.clone())], 0.0)?;
            put(o[3], None, &[Part::whole(&ln2, &[h])], offset)?;
            let gu = [iw, h];
            put(o[4], q(2, h), &[Part::rows(&gn, &gu, is.clone()), Part::rows(&un, &gu, is.clone())], 0.0)?;
            put(o[5], q(3, d.inter), &[Part::cols(&dn, &[h, iw], is.clone())], 0.0)?;
            let b = |t: &str| format!("model.layers.{li}.self_attn.{t}_proj.bias");
            if let Some(ob) = x.qkv_bias {
                let (bq, bk, bv) = (b("q"), b("k"), b("v"));
                let (sq, skv) = ([qw], [kv]);
                let parts = [
                    Part::range(&bq, &sq, qs.clone()),
                    Part::range(&bk, &skv, kvs.clone()),
                    Part::range(&bv, &skv, kvs.clone()),
                ];
                put(ob, None, &parts, 0.0)?;
            }
            if let Some([oq, ok]) = x.qk_norm {
                // Per-head gains: the same on every tensor-parallel rank.
                put(oq, None, &[Part::whole(&n("self_attn.q_norm"), &[hd])], offset)?;
                put(ok, None, &[Part::whole(&n("self_attn.k_norm"), &[hd])], offset)?;
            }
            if let Some([oa, of]) = x.sandwich_norms {
                put(oa, None, &[Part::whole(&n("post_attention_layernorm"), &[h])], offset)?;
                put(of, None, &[Part::whole(&n("post_feedforward_layernorm"), &[h])], offset)?;
            }
        }
        gpu.sync()?;
        drop(out);
        Ok((Self::from_layout(buf, &l), d))
    }

    /// Uploads host weights as bf16 (f32 ones, or any GGUF block format dequantized first).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a model without layers; [`CudaError`] on allocation or
    /// copy failure.
    pub fn upload(
        gpu: &Gpu,
        w: &LlamaWeights,
        cfg: &ModelConfig,
        format: WeightFormat,
    ) -> Result<(Self, Dims), CudaError> {
        let first = w.layers.first().ok_or_else(|| CudaError::Unsupported("model has no layers".into()))?;
        let hd = cfg.head_dim;
        let d = Dims {
            hidden: cfg.hidden_size,
            q_heads: first.q_proj.out_features / hd,
            kv_heads: first.k_proj.out_features / hd,
            head_dim: hd,
            inter: first.gate_proj.out_features,
            vocab: w.embed_tokens.out_features,
            layers: w.layers.len(),
            eps: cfg.rms_norm_eps,
        };
        let first_extras = LayerExtras {
            qkv_bias: first.qkv_bias.is_some(),
            qk_norm: first.qk_norm.is_some(),
            sandwich_norms: first.sandwich_norms.is_some(),
        };
        if w.layers.iter().any(|lw| {
            (lw.qkv_bias.is_some(), lw.qk_norm.is_some(), lw.sandwich_norms.is_some())
                != (first_extras.qkv_bias, first_extras.qk_norm, first_extras.sandwich_norms)
        }) {
            return Err(CudaError::Unsupported("layers differ in their biases or norms".into()));
        }
        let l = layout_as(&d, w.lm_head.is_none(), true, true, format, first_extras);
        let buf = DevBuf::zeroed(gpu, l.total * 2)?;
        let out = sink(gpu, &buf, &d, format)?;
        let mut staging: Vec<bf16> = Vec::new();
        let mut put = |off: usize, q: Option<(usize, usize)>, parts: &[&[f32]]| -> Result<(), CudaError> {
            staging.clear();
            for part in parts {
                staging.extend(part.iter().map(|&v| bf16::from_f32(v)));
            }
            out.put(off, q.map(|q| q.0), q.map_or(1, |q| q.1), &staging)
        };
        // `to_f32` borrows f32 weights and dequantizes any matrix still in GGUF blocks
        // (every block format, K-quants included), so either kind of load uploads.
        let h = d.hidden;
        if let Some(o) = l.embed {
            put(o, None, &[&w.embed_tokens.to_f32()])?;
        }
        if let Some(o) = l.lm_head {
            let lm = w.lm_head.as_ref().unwrap_or(&w.embed_tokens);
            put(o, l.lm_head_scale.map(|s| (s, h)), &[&lm.to_f32()])?;
        }
        put(l.norm, None, &[&w.norm])?;
        for (i, (o, lw)) in l.layers.iter().zip(&w.layers).enumerate() {
            let sc = l.scales.get(i).copied();
            let q = |k: usize, cols: usize| sc.map(|s| (s[k], cols));
            put(o[0], None, &[&lw.input_layernorm])?;
            put(o[1], q(0, h), &[&lw.q_proj.to_f32(), &lw.k_proj.to_f32(), &lw.v_proj.to_f32()])?;
            put(o[2], q(1, d.q_dim()), &[&lw.o_proj.to_f32()])?;
            put(o[3], None, &[&lw.post_attention_layernorm])?;
            put(o[4], q(2, h), &[&lw.gate_proj.to_f32(), &lw.up_proj.to_f32()])?;
            put(o[5], q(3, d.inter), &[&lw.down_proj.to_f32()])?;
        }
        // The host weights' gains already include the checkpoint's norm offset.
        for (x, lw) in l.extras.iter().zip(&w.layers) {
            if let (Some(o), Some([bq, bk, bv])) = (x.qkv_bias, &lw.qkv_bias) {
                if bq.len() != d.q_dim() || bk.len() != d.kv_dim() || bv.len() != d.kv_dim() {
                    return Err(CudaError::Unsupported("q/k/v bias lengths do not match the weights".into()));
                }
                put(o, None, &[bq, bk, bv])?;
            }
            if let (Some([oq, ok]), Some([gq, gk])) = (x.qk_norm, &lw.qk_norm) {
                put(oq, None, &[gq])?;
                put(ok, None, &[gk])?;
            }
            if let (Some([oa, of]), Some([ga, gf])) = (x.sandwich_norms, &lw.sandwich_norms) {
                put(oa, None, &[ga])?;
                put(of, None, &[gf])?;
            }
        }
        gpu.sync()?;
        drop(out);
        Ok((Self::from_layout(buf, &l), d))
    }

    /// Seeded random weights on the device: matrices uniform in ±sqrt(3)·0.02 (std 0.02),
    /// norm gains 1.
    ///
    /// # Errors
    /// [`CudaError`] on allocation or launch failure.
    pub fn synthetic(gpu: &Gpu, s: &SyntheticShape, format: WeightFormat) -> Result<(Self, Dims), CudaError> {
        let d = s.dims();
        let l = layout_as(&d, false, true, true, format, LayerExtras::default());
        let buf = DevBuf::zeroed(gpu, l.total * 2)?;
        let out = sink(gpu, &buf, &d, format)?;
        let scale = 0.02 * 3f32.sqrt();
        let mut seed = s.seed;
        // The same seeds in the same order whatever the format: FP8 quantizes the bf16 weights.
        let mut fill = |off: usize, q: Option<usize>, rows: usize, cols: usize| {
            seed = seed.wrapping_add(1);
            let sd = seed;
            out.generate(off, q, rows, cols, |p| gpu.fill_uniform(p, rows * cols, sd, scale))
        };
        let h = d.hidden;
        if let Some(o) = l.embed {
            fill(o, None, d.vocab, h)?;
        }
        if let Some(o) = l.lm_head {
            fill(o, l.lm_head_scale, d.vocab, h)?;
        }
        for (i, o) in l.layers.iter().enumerate() {
            let sc = l.scales.get(i).copied();
            fill(o[1], sc.map(|s| s[0]), d.qkv_dim(), h)?;
            fill(o[2], sc.map(|s| s[1]), h, d.q_dim())?;
            fill(o[4], sc.map(|s| s[2]), 2 * d.inter, h)?;
            fill(o[5], sc.map(|s| s[3]), h, d.inter)?;
        }
        gpu.fill_const(buf.ptr + (l.norm * 2) as u64, d.hidden, 1.0)?;
        for o in &l.layers {
            gpu.fill_const(buf.ptr + (o[0] * 2) as u64, d.hidden, 1.0)?;
            gpu.fill_const(buf.ptr + (o[3] * 2) as u64, d.hidden, 1.0)?;
        }
        gpu.sync()?;
        drop(out);
        Ok((Self::from_layout(buf, &l), d))
    }
}

#[cfg(test)]
mod tests;
