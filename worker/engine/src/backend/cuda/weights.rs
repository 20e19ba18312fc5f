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
    /// Each layer's [`LayerExtras`] tensors, placed after its six Llama tensors.
    extras: Vec<ExtraOffsets>,
}

/// `d` is the local shard's dimensions (its heads, MLP rows and layer count). The whole
/// model's layout is the same as it always was: embedding, lm_head (untied), norm, layers.
/// A Llama model (no [`LayerExtras`]) keeps exactly that layout.
fn layout(d: &Dims, tied: bool, first_stage: bool, last_stage: bool, ex: LayerExtras) -> Layout {
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
    let mut layers = Vec::with_capacity(d.layers);
    let mut extras = Vec::with_capacity(d.layers);
    for _ in 0..d.layers {
        layers.push([
            take(d.hidden),
            take(d.qkv_dim() * d.hidden),
            take(d.hidden * d.q_dim()),
            take(d.hidden),
            take(2 * d.inter * d.hidden),
            take(d.hidden * d.inter),
        ]);
        extras.push(ExtraOffsets {
            qkv_bias: ex.qkv_bias.then(|| take(d.qkv_dim())),
            qk_norm: ex.qk_norm.then(|| [take(d.head_dim), take(d.head_dim)]),
            sandwich_norms: ex.sandwich_norms.then(|| [take(d.hidden), take(d.hidden)]),
        });
    }
    Layout { total: at, embed, lm_head, norm, layers, extras }
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
    fn from_layout(buf: DevBuf, l: &Layout) -> Self {
        let p = |o: usize| buf.ptr + (o * 2) as u64;
        let layers = l
            .layers
            .iter()
            .zip(&l.extras)
            .map(|(o, x)| LayerPtrs {
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
        let l = layout(&d, tied, spec.first_stage, spec.last_stage, ex);
        let buf = DevBuf::zeroed(gpu, l.total * 2)?;
        let total = files.total_bytes();
        let mut done = 0u64;
        let mut staging: Vec<bf16> = Vec::new();
        // RMSNorm gains get the checkpoint's offset (`put_norm`), matrices and biases not.
        let offset = cfg.arch.norm_weight_offset;
        let mut put_with = |off: usize, parts: &[Part<'_>], gain_offset: f32| -> Result<(), CudaError> {
            staging.clear();
            for part in parts {
                done += append_part(files, part, &mut staging)? as u64;
            }
            add_offset(&mut staging, gain_offset);
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
            put_with(o, &[Part::whole("model.embed_tokens.weight", &[v, h])], 0.0)?;
        }
        if let Some(o) = l.lm_head {
            put_with(o, &[Part::whole("lm_head.weight", &[v, h])], 0.0)?;
        }
        if spec.last_stage {
            put_with(l.norm, &[Part::whole("model.norm.weight", &[h])], offset)?;
        }
        // Gemma 3 names its norm before the MLP `pre_feedforward_layernorm` and uses
        // `post_attention_layernorm` for the norm of the attention output.
        let ffn_norm = if ex.sandwich_norms { "pre_feedforward_layernorm" } else { "post_attention_layernorm" };
        let hd = cfg.head_dim;
        for ((li, o), x) in spec.layers.clone().zip(&l.layers).zip(&l.extras) {
            let n = |t: &str| format!("model.layers.{li}.{t}.weight");
            let (ln1, qn, kn, vn) =
                (n("input_layernorm"), n("self_attn.q_proj"), n("self_attn.k_proj"), n("self_attn.v_proj"));
            let (on, ln2, gn, un, dn) =
                (n("self_attn.o_proj"), n(ffn_norm), n("mlp.gate_proj"), n("mlp.up_proj"), n("mlp.down_proj"));
            put_with(o[0], &[Part::whole(&ln1, &[h])], offset)?;
            put_with(
                o[1],
                &[
                    Part::rows(&qn, &[q, h], qs.clone()),
                    Part::rows(&kn, &[kv, h], kvs.clone()),
                    Part::rows(&vn, &[kv, h], kvs.clone()),
                ],
                0.0,
            )?;
            put_with(o[2], &[Part::cols(&on, &[h, q], qs.clone())], 0.0)?;
            put_with(o[3], &[Part::whole(&ln2, &[h])], offset)?;
            put_with(o[4], &[Part::rows(&gn, &[i, h], is.clone()), Part::rows(&un, &[i, h], is.clone())], 0.0)?;
            put_with(o[5], &[Part::cols(&dn, &[h, i], is.clone())], 0.0)?;
            let b = |t: &str| format!("model.layers.{li}.self_attn.{t}_proj.bias");
            if let Some(ob) = x.qkv_bias {
                let (bq, bk, bv) = (b("q"), b("k"), b("v"));
                let (sq, skv) = ([q], [kv]);
                let parts = [
                    Part::range(&bq, &sq, qs.clone()),
                    Part::range(&bk, &skv, kvs.clone()),
                    Part::range(&bv, &skv, kvs.clone()),
                ];
                put_with(ob, &parts, 0.0)?;
            }
            if let Some([oq, ok]) = x.qk_norm {
                // Per-head gains: the same on every tensor-parallel rank.
                put_with(oq, &[Part::whole(&n("self_attn.q_norm"), &[hd])], offset)?;
                put_with(ok, &[Part::whole(&n("self_attn.k_norm"), &[hd])], offset)?;
            }
            if let Some([oa, of]) = x.sandwich_norms {
                put_with(oa, &[Part::whole(&n("post_attention_layernorm"), &[h])], offset)?;
                put_with(of, &[Part::whole(&n("post_feedforward_layernorm"), &[h])], offset)?;
            }
        }
        Ok((Self::from_layout(buf, &l), d))
    }

    /// Uploads f32 host weights as bf16.
    ///
    /// # Errors
    /// [`CudaError::Unsupported`] for a model without layers; [`CudaError`] on allocation or
    /// copy failure.
    pub fn upload(gpu: &Gpu, w: &LlamaWeights, cfg: &ModelConfig) -> Result<(Self, Dims), CudaError> {
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
        let l = layout(&d, w.lm_head.is_none(), true, true, first_extras);
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
        if let Some(o) = l.embed {
            put(o, &[&w.embed_tokens.data])?;
        }
        if let (Some(o), Some(lm)) = (l.lm_head, &w.lm_head) {
            put(o, &[&lm.data])?;
        }
        put(l.norm, &[&w.norm])?;
        for (o, lw) in l.layers.iter().zip(&w.layers) {
            put(o[0], &[&lw.input_layernorm])?;
            put(o[1], &[&lw.q_proj.data, &lw.k_proj.data, &lw.v_proj.data])?;
            put(o[2], &[&lw.o_proj.data])?;
            put(o[3], &[&lw.post_attention_layernorm])?;
            put(o[4], &[&lw.gate_proj.data, &lw.up_proj.data])?;
            put(o[5], &[&lw.down_proj.data])?;
        }
        // The host weights' gains already include the checkpoint's norm offset.
        for (x, lw) in l.extras.iter().zip(&w.layers) {
            if let (Some(o), Some([bq, bk, bv])) = (x.qkv_bias, &lw.qkv_bias) {
                if bq.len() != d.q_dim() || bk.len() != d.kv_dim() || bv.len() != d.kv_dim() {
                    return Err(CudaError::Unsupported("q/k/v bias lengths do not match the weights".into()));
                }
                put(o, &[bq, bk, bv])?;
            }
            if let (Some([oq, ok]), Some([gq, gk])) = (x.qk_norm, &lw.qk_norm) {
                put(oq, &[gq])?;
                put(ok, &[gk])?;
            }
            if let (Some([oa, of]), Some([ga, gf])) = (x.sandwich_norms, &lw.sandwich_norms) {
                put(oa, &[ga])?;
                put(of, &[gf])?;
            }
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
        let l = layout(&d, false, true, true, LayerExtras::default());
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
        let l = layout(&d, false, true, true, LayerExtras::default());
        assert_eq!((l.embed, l.lm_head, l.norm), (Some(0), Some(emb), 2 * emb));
        assert_eq!(l.layers[0][0], 2 * emb + norm);
        assert_eq!(l.layers[1][0], 2 * emb + norm + layer);
        assert_eq!(l.total, 2 * emb + norm + 2 * layer);
        // Tied: no lm_head slot (the embedding serves).
        let l = layout(&d, true, true, true, LayerExtras::default());
        assert_eq!((l.embed, l.lm_head, l.norm), (Some(0), None, emb));
        // A middle stage: neither the embedding nor an lm_head.
        let l = layout(&d, false, false, false, LayerExtras::default());
        assert_eq!((l.embed, l.lm_head, l.total), (None, None, norm + 2 * layer));
        // The last stage of a tied model holds the embedding as its lm_head; untied, the lm_head.
        assert_eq!(layout(&d, true, false, true, LayerExtras::default()).embed, Some(0));
        let l = layout(&d, false, false, true, LayerExtras::default());
        assert_eq!((l.embed, l.lm_head), (None, Some(0)));
        // The first stage of an untied model: the embedding, no lm_head.
        let l = layout(&d, false, true, false, LayerExtras::default());
        assert_eq!((l.embed, l.lm_head), (Some(0), None));
    }

    #[test]
    fn family_tensors_follow_each_layer_and_llama_layers_have_none() {
        let d = dims(2);
        let llama = layout(&d, true, true, true, LayerExtras::default());
        assert!(llama.extras.iter().all(|x| *x == ExtraOffsets::default()));
        let all = LayerExtras { qkv_bias: true, qk_norm: true, sandwich_norms: true };
        let l = layout(&d, true, true, true, all);
        // Layer 0's six tensors are where Llama has them; its extras come right after.
        assert_eq!(l.layers[0], llama.layers[0]);
        let end0 = l.layers[0][5] + up(64 * 96);
        let x = l.extras[0];
        assert_eq!(x.qkv_bias, Some(end0));
        assert_eq!(x.qk_norm, Some([end0 + up(d.qkv_dim()), end0 + up(d.qkv_dim()) + up(16)]));
        assert_eq!(
            x.sandwich_norms,
            Some([end0 + up(d.qkv_dim()) + 2 * up(16), end0 + up(d.qkv_dim()) + 2 * up(16) + up(64)])
        );
        // Layer 1 starts after them.
        let extra = up(d.qkv_dim()) + 2 * up(16) + 2 * up(64);
        assert_eq!(l.layers[1][0], end0 + extra);
        assert_eq!(l.total, llama.total + 2 * extra);
        // Only q/k norms (Qwen3): no bias slot, no sandwich slots.
        let qk = layout(&d, true, true, true, LayerExtras { qk_norm: true, ..LayerExtras::default() });
        assert_eq!(qk.extras[0].qk_norm, Some([end0, end0 + up(16)]));
        assert_eq!((qk.extras[0].qkv_bias, qk.extras[0].sandwich_norms), (None, None));
    }

    /// A one-file checkpoint of f32 1-D tensors.
    fn write_checkpoint(dir: &std::path::Path, tensors: &[(&str, Vec<f32>)]) {
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for (name, v) in tensors {
            let start = data.len();
            data.extend(v.iter().flat_map(|x| x.to_le_bytes()));
            header.insert(
                (*name).to_owned(),
                serde_json::json!({"dtype": "F32", "shape": [v.len()], "data_offsets": [start, data.len()]}),
            );
        }
        let h = serde_json::to_vec(&header).unwrap();
        let mut file = (h.len() as u64).to_le_bytes().to_vec();
        file.extend(h);
        file.extend(data);
        std::fs::write(dir.join("model.safetensors"), file).unwrap();
    }

    #[test]
    fn a_tensor_parallel_rank_takes_its_slice_of_each_bias_and_gains_get_the_offset() {
        let dir = tempfile::tempdir().unwrap();
        let bias: Vec<f32> = (0..8).map(|i| i as f32 * 0.5).collect();
        write_checkpoint(dir.path(), &[("q_proj.bias", bias.clone()), ("q_norm.weight", vec![0.25, -0.5, 0.0, 1.0])]);
        let files = SafetensorsFiles::open_dir(dir.path()).unwrap();
        let bf = |v: &[bf16]| v.iter().map(|x| x.to_f32()).collect::<Vec<_>>();
        // Rank 1 of 2: elements 4..8 (the heads whose q/k/v rows it holds).
        let mut out = vec![bf16::from_f32(9.0)];
        append_part(&files, &Part::range("q_proj.bias", &[8], 4..8), &mut out).unwrap();
        assert_eq!(bf(&out), [9.0, 2.0, 2.5, 3.0, 3.5]);
        // The whole range is the whole tensor.
        assert!(Part::range("q_proj.bias", &[8], 0..8).block.is_none());
        out.clear();
        append_part(&files, &Part::range("q_proj.bias", &[8], 0..8), &mut out).unwrap();
        assert_eq!(bf(&out), bias);
        // A range past the end names the tensor.
        let err = append_part(&files, &Part::range("q_proj.bias", &[8], 6..10), &mut out).unwrap_err();
        assert!(err.to_string().contains("q_proj.bias"), "{err}");
        // Gemma's gains are stored as g - 1: the upload adds the offset.
        out.clear();
        append_part(&files, &Part::whole("q_norm.weight", &[4]), &mut out).unwrap();
        add_offset(&mut out, 1.0);
        assert_eq!(bf(&out), [1.25, 0.5, 1.0, 2.0]);
        add_offset(&mut out, 0.0);
        assert_eq!(bf(&out), [1.25, 0.5, 1.0, 2.0]);
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
