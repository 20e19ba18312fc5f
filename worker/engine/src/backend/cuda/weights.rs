//! Llama weights on the device in bf16: one allocation for everything (fixed addresses),
//! q/k/v stacked into one `[q + 2·kv, hidden]` matrix and gate/up into `[2·inter, hidden]`
//! (one GEMM each, as vLLM's `QKVParallelLinear` / `MergedColumnParallelLinear`). Filled from
//! f32 host weights (rounded to nearest-even bf16), straight from a Hugging Face checkpoint's
//! mmapped `.safetensors` one tensor at a time (bf16 copied as stored: no f32 copy of the model
//! on the host), or with seeded random values generated on the device ([`SyntheticShape`],
//! benchmarks at real sizes).

use half::bf16;

use super::device::{DevBuf, Gpu};
use super::error::CudaError;
use super::options::{Dims, SyntheticShape};
use crate::model::config::{ArchConfig, Architecture, ModelConfig};
use crate::model::error::ModelError;
use crate::model::llama::LlamaWeights;
use crate::model::safetensors::SafetensorsFiles;

/// The CUDA kernels implement Llama's decoder recipe only: a model whose
/// [`ArchConfig`] asks for more (biases, q/k norms, Gemma's norms and GeGLU, sliding windows,
/// per-layer RoPE bases) is refused rather than computed wrongly.
fn check_llama_recipe(cfg: &ModelConfig) -> Result<(), CudaError> {
    let mut arch = cfg.arch.clone();
    arch.architecture = Architecture::Llama;
    if arch != ArchConfig::llama(cfg.num_hidden_layers, cfg.rope_theta) {
        return Err(CudaError::Unsupported(format!(
            "{} on the CUDA backend (its layers differ from Llama's); use the CPU backend",
            cfg.arch.architecture.hf_name()
        )));
    }
    Ok(())
}

/// Device addresses of one decoder layer's weights.
pub(crate) struct LayerPtrs {
    pub input_norm: u64,
    pub qkv: u64,
    pub o_proj: u64,
    pub post_norm: u64,
    pub gate_up: u64,
    pub down: u64,
}

/// All weights in one device buffer.
pub(crate) struct DeviceWeights {
    _buf: DevBuf,
    pub embed: u64,
    pub lm_head: u64,
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

/// Element offsets (bf16 units) of every tensor in the single buffer.
struct Layout {
    total: usize,
    /// The embedding (also the lm_head when tied); `None` on a middle or untied last stage.
    embed: Option<usize>,
    /// An untied lm_head on the last stage.
    lm_head: Option<usize>,
    norm: usize,
    layers: Vec<[usize; 6]>,
}

/// `d` is the local shard's dimensions (its heads, MLP rows and layer count). The whole
/// model's layout is the same as it always was: embedding, lm_head (untied), norm, layers.
fn layout(d: &Dims, tied: bool, first_stage: bool, last_stage: bool) -> Layout {
    let mut at = 0usize;
    let mut take = |n: usize| {
        let o = at;
        // 256-byte alignment for every tensor.
        at += n.div_ceil(128) * 128;
        o
    };
    let embed = (first_stage || (last_stage && tied)).then(|| take(d.vocab * d.hidden));
    let lm_head = (last_stage && !tied).then(|| take(d.vocab * d.hidden));
    let norm = take(d.hidden);
    let layers = (0..d.layers)
        .map(|_| {
            [
                take(d.hidden),
                take(d.qkv_dim() * d.hidden),
                take(d.hidden * d.q_dim()),
                take(d.hidden),
                take(2 * d.inter * d.hidden),
                take(d.hidden * d.inter),
            ]
        })
        .collect();
    Layout { total: at, embed, lm_head, norm, layers }
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
}

impl DeviceWeights {
    fn from_layout(buf: DevBuf, l: &Layout) -> Self {
        let p = |o: usize| buf.ptr + (o * 2) as u64;
        let layers = l
            .layers
            .iter()
            .map(|o| LayerPtrs {
                input_norm: p(o[0]),
                qkv: p(o[1]),
                o_proj: p(o[2]),
                post_norm: p(o[3]),
                gate_up: p(o[4]),
                down: p(o[5]),
            })
            .collect();
        let embed = l.embed.map_or(0, p);
        Self { embed, lm_head: l.lm_head.map_or(embed, p), norm: p(l.norm), layers, bytes: buf.bytes, _buf: buf }
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
        progress: &dyn Fn(u64, u64),
    ) -> Result<(Self, Dims), CudaError> {
        check_llama_recipe(cfg)?;
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
        let l = layout(&d, tied, spec.first_stage, spec.last_stage);
        let buf = DevBuf::zeroed(gpu, l.total * 2)?;
        let total = files.total_bytes();
        let mut done = 0u64;
        let mut staging: Vec<bf16> = Vec::new();
        let mut put = |off: usize, parts: &[Part<'_>]| -> Result<(), CudaError> {
            staging.clear();
            for part in parts {
                done += match &part.block {
                    None => files.append_bf16(part.name, part.shape, &mut staging)?,
                    Some((rows, cols)) => files.append_bf16_block(
                        part.name,
                        [part.shape[0], part.shape[1]],
                        rows.clone(),
                        cols.clone(),
                        &mut staging,
                    )?,
                } as u64;
            }
            gpu.upload(&buf, off * 2, &staging)?;
            // The staging vector is reused: wait for the (pageable, staged) copy.
            gpu.sync()?;
            progress(done, total);
            Ok(())
        };
        let (h, v, r) = (d.hidden, d.vocab, spec.tp_rank);
        // Whole-model widths (stored shapes) and this shard's slices of them.
        let (q, kv, i) =
            (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.intermediate_size);
        let (qs, kvs, is) =
            (r * d.q_dim()..(r + 1) * d.q_dim(), r * d.kv_dim()..(r + 1) * d.kv_dim(), r * d.inter..(r + 1) * d.inter);
        if let Some(o) = l.embed {
            put(o, &[Part::whole("model.embed_tokens.weight", &[v, h])])?;
        }
        if let Some(o) = l.lm_head {
            put(o, &[Part::whole("lm_head.weight", &[v, h])])?;
        }
        if spec.last_stage {
            put(l.norm, &[Part::whole("model.norm.weight", &[h])])?;
        }
        for (li, o) in spec.layers.clone().zip(&l.layers) {
            let n = |t: &str| format!("model.layers.{li}.{t}.weight");
            let (ln1, qn, kn, vn) =
                (n("input_layernorm"), n("self_attn.q_proj"), n("self_attn.k_proj"), n("self_attn.v_proj"));
            let (on, ln2, gn, un, dn) = (
                n("self_attn.o_proj"),
                n("post_attention_layernorm"),
                n("mlp.gate_proj"),
                n("mlp.up_proj"),
                n("mlp.down_proj"),
            );
            put(o[0], &[Part::whole(&ln1, &[h])])?;
            put(
                o[1],
                &[
                    Part::rows(&qn, &[q, h], qs.clone()),
                    Part::rows(&kn, &[kv, h], kvs.clone()),
                    Part::rows(&vn, &[kv, h], kvs.clone()),
                ],
            )?;
            put(o[2], &[Part::cols(&on, &[h, q], qs.clone())])?;
            put(o[3], &[Part::whole(&ln2, &[h])])?;
            put(o[4], &[Part::rows(&gn, &[i, h], is.clone()), Part::rows(&un, &[i, h], is.clone())])?;
            put(o[5], &[Part::cols(&dn, &[h, i], is.clone())])?;
        }
        Ok((Self::from_layout(buf, &l), d))
    }

    /// Uploads host weights as bf16 (f32 ones, or any GGUF block format dequantized first).
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a model without layers; [`CudaError`] on allocation or
    /// copy failure.
    pub fn upload(gpu: &Gpu, w: &LlamaWeights, cfg: &ModelConfig) -> Result<(Self, Dims), CudaError> {
        check_llama_recipe(cfg)?;
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
        let l = layout(&d, w.lm_head.is_none(), true, true);
        let buf = DevBuf::zeroed(gpu, l.total * 2)?;
        let mut staging: Vec<bf16> = Vec::new();
        let mut put = |off: usize, parts: &[&[f32]]| -> Result<(), CudaError> {
            staging.clear();
            for part in parts {
                staging.extend(part.iter().map(|&v| bf16::from_f32(v)));
            }
            gpu.upload(&buf, off * 2, &staging)?;
            // The staging vector is reused: wait for the (pageable, staged) copy.
            gpu.sync()
        };
        // `to_f32` borrows f32 weights and dequantizes any matrix still in GGUF blocks
        // (every block format, K-quants included), so either kind of load uploads.
        if let Some(o) = l.embed {
            put(o, &[&w.embed_tokens.to_f32()])?;
        }
        if let (Some(o), Some(lm)) = (l.lm_head, &w.lm_head) {
            put(o, &[&lm.to_f32()])?;
        }
        put(l.norm, &[&w.norm])?;
        for (o, lw) in l.layers.iter().zip(&w.layers) {
            put(o[0], &[&lw.input_layernorm])?;
            put(o[1], &[&lw.q_proj.to_f32(), &lw.k_proj.to_f32(), &lw.v_proj.to_f32()])?;
            put(o[2], &[&lw.o_proj.to_f32()])?;
            put(o[3], &[&lw.post_attention_layernorm])?;
            put(o[4], &[&lw.gate_proj.to_f32(), &lw.up_proj.to_f32()])?;
            put(o[5], &[&lw.down_proj.to_f32()])?;
        }
        Ok((Self::from_layout(buf, &l), d))
    }

    /// Seeded random weights on the device: matrices uniform in ±sqrt(3)·0.02 (std 0.02),
    /// norm gains 1.
    ///
    /// # Errors
    /// [`CudaError`] on allocation or launch failure.
    pub fn synthetic(gpu: &Gpu, s: &SyntheticShape) -> Result<(Self, Dims), CudaError> {
        let d = s.dims();
        let l = layout(&d, false, true, true);
        let buf = DevBuf::zeroed(gpu, l.total * 2)?;
        let scale = 0.02 * 3f32.sqrt();
        let mut seed = s.seed;
        let mut fill = |off: usize, n: usize| {
            seed = seed.wrapping_add(1);
            gpu.fill_uniform(buf.ptr + (off * 2) as u64, n, seed, scale)
        };
        if let Some(o) = l.embed {
            fill(o, d.vocab * d.hidden)?;
        }
        if let Some(o) = l.lm_head {
            fill(o, d.vocab * d.hidden)?;
        }
        for o in &l.layers {
            fill(o[1], d.qkv_dim() * d.hidden)?;
            fill(o[2], d.hidden * d.q_dim())?;
            fill(o[4], 2 * d.inter * d.hidden)?;
            fill(o[5], d.hidden * d.inter)?;
        }
        gpu.fill_const(buf.ptr + (l.norm * 2) as u64, d.hidden, 1.0)?;
        for o in &l.layers {
            gpu.fill_const(buf.ptr + (o[0] * 2) as u64, d.hidden, 1.0)?;
            gpu.fill_const(buf.ptr + (o[3] * 2) as u64, d.hidden, 1.0)?;
        }
        gpu.sync()?;
        Ok((Self::from_layout(buf, &l), d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(layers: usize) -> Dims {
        Dims { hidden: 64, q_heads: 4, kv_heads: 2, head_dim: 16, inter: 96, vocab: 100, layers, eps: 1e-5 }
    }

    /// Offsets rounded to 128 elements (256 bytes), as `layout` places them.
    fn up(n: usize) -> usize {
        n.div_ceil(128) * 128
    }

    #[test]
    fn the_whole_model_keeps_its_layout_and_stages_hold_only_their_tensors() {
        let d = dims(2);
        let (emb, norm) = (up(100 * 64), up(64));
        let layer = up(64) + up(d.qkv_dim() * 64) + up(64 * d.q_dim()) + up(64) + up(2 * 96 * 64) + up(64 * 96);
        // Whole model, untied: embedding, lm_head, norm, then the layers in order.
        let l = layout(&d, false, true, true);
        assert_eq!((l.embed, l.lm_head, l.norm), (Some(0), Some(emb), 2 * emb));
        assert_eq!(l.layers[0][0], 2 * emb + norm);
        assert_eq!(l.layers[1][0], 2 * emb + norm + layer);
        assert_eq!(l.total, 2 * emb + norm + 2 * layer);
        // Tied: no lm_head slot (the embedding serves).
        let l = layout(&d, true, true, true);
        assert_eq!((l.embed, l.lm_head, l.norm), (Some(0), None, emb));
        // A middle stage: neither the embedding nor an lm_head.
        let l = layout(&d, false, false, false);
        assert_eq!((l.embed, l.lm_head, l.total), (None, None, norm + 2 * layer));
        // The last stage of a tied model holds the embedding as its lm_head; untied, the lm_head.
        assert_eq!(layout(&d, true, false, true).embed, Some(0));
        let l = layout(&d, false, false, true);
        assert_eq!((l.embed, l.lm_head), (None, Some(0)));
        // The first stage of an untied model: the embedding, no lm_head.
        let l = layout(&d, false, true, false);
        assert_eq!((l.embed, l.lm_head), (Some(0), None));
    }

    #[test]
    fn the_full_spec_is_every_layer_on_one_rank() {
        let s = ShardSpec::full(30);
        assert_eq!(s, ShardSpec { tp_rank: 0, tp_size: 1, layers: 0..30, first_stage: true, last_stage: true });
        // A whole-tensor part reads the tensor as stored; a partial one reads a block.
        assert!(Part::rows("w", &[8, 4], 0..8).block.is_none());
        assert_eq!(Part::rows("w", &[8, 4], 2..4).block, Some((2..4, 0..4)));
        assert!(Part::cols("w", &[8, 4], 0..4).block.is_none());
        assert_eq!(Part::cols("w", &[8, 4], 1..3).block, Some((0..8, 1..3)));
        assert!(Part::whole("n", &[8]).block.is_none());
    }
}
