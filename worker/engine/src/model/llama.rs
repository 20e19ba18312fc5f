//! Llama-family weights on the host, Hugging Face layout and names (candle's
//! `llama.rs`, transformers' `LlamaForCausalLM`): f32, or — when loaded with
//! `keep_quantized` — a matrix may keep its GGUF blocks as stored ([`QuantizedData`]), which
//! [`Linear::to_f32`] dequantizes on demand to the same values a load-time dequantization
//! gives. Also their split into tensor-parallel
//! shards (Megatron-LM, Shoeybi et al. 2019): q/k/v and gate/up are column-parallel
//! (output rows split, whole heads per rank), o_proj and down_proj row-parallel (input
//! columns split; each rank's product is a partial sum that an all-reduce completes),
//! embeddings, norms and lm_head replicated.

use std::borrow::Cow;

use super::config::ModelConfig;
use super::error::ModelError;
use super::gguf::dequant::{self, GgmlType, QK};

/// A matrix kept in its GGUF block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, or the K-quants
/// Q4_K, Q5_K, Q6_K, Q8_K): each row is `in_features / block` whole blocks (32 weights, 256
/// for a K-quant), rows stored one after another (Q/K rows already
/// un-permuted to the Hugging Face layout).
#[derive(Clone, Debug, PartialEq)]
pub struct QuantizedData {
    /// Block format.
    pub ty: GgmlType,
    /// `out_features * row_bytes` bytes.
    pub bytes: Vec<u8>,
}

impl QuantizedData {
    /// Whether the CPU kernels read `ty` blocks directly.
    pub fn supports(ty: GgmlType) -> bool {
        !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16)
    }

    /// Bytes of one row of `in_features` weights.
    pub fn row_bytes(&self, in_features: usize) -> usize {
        let (per, bytes) = self.ty.block_layout();
        in_features / per * bytes
    }
}

/// A linear layer's weight, `[out_features, in_features]` row-major (`y = x · Wᵀ`).
#[derive(Clone, Debug, PartialEq)]
pub struct Linear {
    /// Output features (rows).
    pub out_features: usize,
    /// Input features (columns).
    pub in_features: usize,
    /// `out_features * in_features` values; empty when `quant` holds the weight.
    pub data: Vec<f32>,
    /// The weight in its GGUF block format (then `data` is empty), when loaded with
    /// `keep_quantized`.
    pub quant: Option<QuantizedData>,
}

impl Linear {
    /// An f32 weight.
    pub fn new(out_features: usize, in_features: usize, data: Vec<f32>) -> Self {
        Self { out_features, in_features, data, quant: None }
    }

    /// The f32 values (`data`, or the blocks dequantized exactly as at load time).
    pub fn to_f32(&self) -> Cow<'_, [f32]> {
        match &self.quant {
            None => Cow::Borrowed(&self.data),
            Some(q) => {
                let mut out = vec![0f32; self.out_features * self.in_features];
                dequant::dequantize(q.ty, &q.bytes, &mut out);
                Cow::Owned(out)
            }
        }
    }

    /// This weight with f32 `data` (a no-op when it already is f32).
    pub fn dequantized(self) -> Linear {
        match self.quant {
            None => self,
            Some(_) => Linear::new(self.out_features, self.in_features, self.to_f32().into_owned()),
        }
    }

    /// Row `r` in f32 (an embedding lookup).
    pub fn row_f32(&self, r: usize, out: &mut [f32]) {
        let inp = self.in_features;
        match &self.quant {
            None => out.copy_from_slice(&self.data[r * inp..(r + 1) * inp]),
            Some(q) => {
                let rb = q.row_bytes(inp);
                dequant::dequantize(q.ty, &q.bytes[r * rb..(r + 1) * rb], out);
            }
        }
    }

    /// Rows `start..end` (a column-parallel slice).
    pub fn rows(&self, start: usize, end: usize) -> Linear {
        if let Some(q) = &self.quant {
            let rb = q.row_bytes(self.in_features);
            return Linear {
                out_features: end - start,
                in_features: self.in_features,
                data: Vec::new(),
                quant: Some(QuantizedData { ty: q.ty, bytes: q.bytes[start * rb..end * rb].to_vec() }),
            };
        }
        Linear::new(end - start, self.in_features, self.data[start * self.in_features..end * self.in_features].to_vec())
    }

    /// Columns `start..end` of every row (a row-parallel slice). A quantized weight stays
    /// quantized when the cut falls on block boundaries, and is dequantized otherwise.
    pub fn cols(&self, start: usize, end: usize) -> Linear {
        if let Some(q) = &self.quant {
            let (per, bb) = q.ty.block_layout();
            if start.is_multiple_of(per) && end.is_multiple_of(per) {
                let rb = q.row_bytes(self.in_features);
                let mut bytes = Vec::with_capacity(self.out_features * (end - start) / per * bb);
                for r in q.bytes.chunks_exact(rb) {
                    bytes.extend_from_slice(&r[start / per * bb..end / per * bb]);
                }
                return Linear {
                    out_features: self.out_features,
                    in_features: end - start,
                    data: Vec::new(),
                    quant: Some(QuantizedData { ty: q.ty, bytes }),
                };
            }
            return self.clone().dequantized().cols(start, end);
        }
        let mut data = Vec::with_capacity(self.out_features * (end - start));
        for r in self.data.chunks_exact(self.in_features) {
            data.extend_from_slice(&r[start..end]);
        }
        Linear::new(self.out_features, end - start, data)
    }
}

/// One decoder layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerWeights {
    /// `input_layernorm` RMSNorm gain, `[hidden]`.
    pub input_layernorm: Vec<f32>,
    /// `[q_dim, hidden]` (HF rotate-half RoPE layout).
    pub q_proj: Linear,
    /// `[kv_dim, hidden]`.
    pub k_proj: Linear,
    /// `[kv_dim, hidden]`.
    pub v_proj: Linear,
    /// `[hidden, q_dim]`.
    pub o_proj: Linear,
    /// Gain of the RMSNorm before the MLP, `[hidden]` (Llama's `post_attention_layernorm`).
    pub post_attention_layernorm: Vec<f32>,
    /// `[intermediate, hidden]`.
    pub gate_proj: Linear,
    /// `[intermediate, hidden]`.
    pub up_proj: Linear,
    /// `[hidden, intermediate]`.
    pub down_proj: Linear,
    /// q/k/v projection biases (`[q_dim]`, `[kv_dim]`, `[kv_dim]`) when
    /// [`super::config::ArchConfig::attention_bias`].
    pub qkv_bias: Option<[Vec<f32>; 3]>,
    /// Per-head q and k RMSNorm gains (`[head_dim]` each) when
    /// [`super::config::ArchConfig::qk_norm`].
    pub qk_norm: Option<[Vec<f32>; 2]>,
    /// RMSNorm gains of the attention output and of the MLP output (`[hidden]` each) when
    /// [`super::config::ArchConfig::sandwich_norms`] (Gemma 3's `post_attention_layernorm`
    /// and `post_feedforward_layernorm`; its `pre_feedforward_layernorm` is
    /// [`LayerWeights::post_attention_layernorm`], the norm before the MLP).
    pub sandwich_norms: Option<[Vec<f32>; 2]>,
}

/// Which tensor-parallel shard a set of weights is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardInfo {
    /// This shard's rank, `0..world_size`.
    pub rank: usize,
    /// Number of shards.
    pub world_size: usize,
}

/// All weights of a Llama-family model (or of one tensor-parallel shard of it).
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaWeights {
    /// `[vocab, hidden]`.
    pub embed_tokens: Linear,
    /// Decoder layers.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm gain, `[hidden]`.
    pub norm: Vec<f32>,
    /// `[vocab, hidden]`; `None` when tied to `embed_tokens`.
    pub lm_head: Option<Linear>,
    /// Shard identity (rank 0 of 1 for a whole model).
    pub shard: ShardInfo,
}

/// A tensor read from a checkpoint: row-major shape and f32 values.
pub type HostTensor = (Vec<usize>, Vec<f32>);

/// A matrix read from a checkpoint in its block format: row-major shape and blocks.
pub type QuantizedTensor = (Vec<usize>, QuantizedData);

/// Where [`LlamaWeights::load`] reads tensors from: given a Hugging Face tensor name,
/// the tensor's row-major shape and f32 data in the HF layout, or `None` when absent.
pub trait WeightSource {
    /// Reads one tensor.
    ///
    /// # Errors
    /// [`ModelError`] on read/format failures.
    fn tensor(&mut self, hf_name: &str) -> Result<Option<HostTensor>, ModelError>;

    /// Reads a matrix in its block format, `None` when the source does not store it in
    /// one that [`QuantizedData::supports`] (then [`WeightSource::tensor`] is used).
    ///
    /// # Errors
    /// [`ModelError`] on read/format failures.
    fn quantized(&mut self, _hf_name: &str) -> Result<Option<QuantizedTensor>, ModelError> {
        Ok(None)
    }
}

fn fetch(src: &mut dyn WeightSource, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
    let (got, data) = src.tensor(name)?.ok_or_else(|| ModelError::MissingTensor { name: name.to_owned() })?;
    if got != shape {
        return Err(ModelError::Shape { name: name.to_owned(), expected: shape.to_vec(), actual: got });
    }
    Ok(data)
}

/// A `[len]` RMSNorm gain, plus `offset` (Gemma's checkpoints store `g - 1`).
fn norm(src: &mut dyn WeightSource, name: &str, len: usize, offset: f32) -> Result<Vec<f32>, ModelError> {
    let mut g = fetch(src, name, &[len])?;
    if offset != 0.0 {
        for v in &mut g {
            *v += offset;
        }
    }
    Ok(g)
}

fn linear(src: &mut dyn WeightSource, name: &str, out: usize, inp: usize, quant: bool) -> Result<Linear, ModelError> {
    if quant
        && inp.is_multiple_of(QK)
        && let Some((shape, q)) = src.quantized(name)?
    {
        if shape != [out, inp] || !inp.is_multiple_of(q.ty.block_layout().0) || q.bytes.len() != out * q.row_bytes(inp)
        {
            return Err(ModelError::Shape { name: name.to_owned(), expected: vec![out, inp], actual: shape });
        }
        return Ok(Linear { out_features: out, in_features: inp, data: Vec::new(), quant: Some(q) });
    }
    Ok(Linear::new(out, inp, fetch(src, name, &[out, inp])?))
}

impl LlamaWeights {
    /// Reads every tensor by its Hugging Face name, checking shapes against `cfg`.
    /// `lm_head.weight` absent (or `tie_word_embeddings`) means tied embeddings.
    ///
    /// # Errors
    /// [`ModelError::MissingTensor`] or [`ModelError::Shape`] on a missing tensor or a shape
    /// mismatch; the source's own errors.
    pub fn load(cfg: &ModelConfig, src: &mut dyn WeightSource) -> Result<Self, ModelError> {
        Self::load_with(cfg, src, false)
    }

    /// As [`LlamaWeights::load`]; with `keep_quantized`, matrices that the source stores
    /// in a supported block format keep it ([`Linear::quant`]) instead of being
    /// dequantized to f32.
    ///
    /// # Errors
    /// As [`LlamaWeights::load`].
    pub fn load_with(cfg: &ModelConfig, src: &mut dyn WeightSource, keep_quantized: bool) -> Result<Self, ModelError> {
        let (h, i, q, kv, v) = (cfg.hidden_size, cfg.intermediate_size, cfg.q_dim(), cfg.kv_dim(), cfg.vocab_size);
        let kq = keep_quantized;
        let embed_tokens = linear(src, "model.embed_tokens.weight", v, h, kq)?;
        let a = &cfg.arch;
        let off = a.norm_weight_offset;
        let hd = cfg.head_dim;
        // Gemma 3 names its norm before the MLP `pre_feedforward_layernorm` and uses
        // `post_attention_layernorm` for the norm of the attention output.
        let ffn_norm = if a.sandwich_norms { "pre_feedforward_layernorm" } else { "post_attention_layernorm" };
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let qkv_bias = if a.attention_bias {
                Some([
                    fetch(src, &format!("{p}.self_attn.q_proj.bias"), &[q])?,
                    fetch(src, &format!("{p}.self_attn.k_proj.bias"), &[kv])?,
                    fetch(src, &format!("{p}.self_attn.v_proj.bias"), &[kv])?,
                ])
            } else {
                None
            };
            let qk_norm = if a.qk_norm {
                Some([
                    norm(src, &format!("{p}.self_attn.q_norm.weight"), hd, off)?,
                    norm(src, &format!("{p}.self_attn.k_norm.weight"), hd, off)?,
                ])
            } else {
                None
            };
            let sandwich_norms = if a.sandwich_norms {
                Some([
                    norm(src, &format!("{p}.post_attention_layernorm.weight"), h, off)?,
                    norm(src, &format!("{p}.post_feedforward_layernorm.weight"), h, off)?,
                ])
            } else {
                None
            };
            layers.push(LayerWeights {
                input_layernorm: norm(src, &format!("{p}.input_layernorm.weight"), h, off)?,
                q_proj: linear(src, &format!("{p}.self_attn.q_proj.weight"), q, h, kq)?,
                k_proj: linear(src, &format!("{p}.self_attn.k_proj.weight"), kv, h, kq)?,
                v_proj: linear(src, &format!("{p}.self_attn.v_proj.weight"), kv, h, kq)?,
                o_proj: linear(src, &format!("{p}.self_attn.o_proj.weight"), h, q, kq)?,
                post_attention_layernorm: norm(src, &format!("{p}.{ffn_norm}.weight"), h, off)?,
                gate_proj: linear(src, &format!("{p}.mlp.gate_proj.weight"), i, h, kq)?,
                up_proj: linear(src, &format!("{p}.mlp.up_proj.weight"), i, h, kq)?,
                down_proj: linear(src, &format!("{p}.mlp.down_proj.weight"), h, i, kq)?,
                qkv_bias,
                qk_norm,
                sandwich_norms,
            });
        }
        let final_norm = norm(src, "model.norm.weight", h, off)?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else if kq && h.is_multiple_of(QK) && src.quantized("lm_head.weight")?.is_some() {
            Some(linear(src, "lm_head.weight", v, h, true)?)
        } else {
            match src.tensor("lm_head.weight")? {
                Some((shape, data)) if shape == [v, h] => Some(Linear::new(v, h, data)),
                Some((shape, _)) => {
                    return Err(ModelError::Shape {
                        name: "lm_head.weight".into(),
                        expected: vec![v, h],
                        actual: shape,
                    });
                }
                None => None,
            }
        };
        Ok(Self { embed_tokens, layers, norm: final_norm, lm_head, shard: ShardInfo { rank: 0, world_size: 1 } })
    }

    /// Every matrix with f32 `data` (a model loaded with `keep_quantized`, dequantized).
    pub fn dequantized(self) -> Self {
        let layers = self
            .layers
            .into_iter()
            .map(|l| LayerWeights {
                q_proj: l.q_proj.dequantized(),
                k_proj: l.k_proj.dequantized(),
                v_proj: l.v_proj.dequantized(),
                o_proj: l.o_proj.dequantized(),
                gate_proj: l.gate_proj.dequantized(),
                up_proj: l.up_proj.dequantized(),
                down_proj: l.down_proj.dequantized(),
                ..l
            })
            .collect();
        Self {
            embed_tokens: self.embed_tokens.dequantized(),
            layers,
            norm: self.norm,
            lm_head: self.lm_head.map(Linear::dequantized),
            shard: self.shard,
        }
    }

    /// The output projection (`lm_head`, or the embedding when tied).
    pub fn lm_head(&self) -> &Linear {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Tensor-parallel shard `rank` of `world_size` of a whole model: attention heads and
    /// KV heads divided among ranks (whole heads), MLP columns divided evenly; o_proj and
    /// down_proj keep the matching input columns, so each rank's output is a partial sum
    /// and summing them over ranks (the all-reduce) gives the unsharded result.
    ///
    /// # Errors
    /// [`ModelError::Shard`] when `world_size` does not divide the KV heads and the
    /// intermediate size, or `self` is already a shard.
    pub fn shard(&self, cfg: &ModelConfig, rank: usize, world_size: usize) -> Result<Self, ModelError> {
        if self.shard.world_size != 1 || world_size == 0 || rank >= world_size {
            return Err(ModelError::Shard(format!(
                "rank {rank} of world size {world_size} (the weights are shard {} of {})",
                self.shard.rank, self.shard.world_size
            )));
        }
        if !cfg.num_key_value_heads.is_multiple_of(world_size) || !cfg.intermediate_size.is_multiple_of(world_size) {
            return Err(ModelError::Shard(format!(
                "tensor_parallel_size {world_size} must divide num_key_value_heads {} and intermediate_size {}",
                cfg.num_key_value_heads, cfg.intermediate_size
            )));
        }
        let hd = cfg.head_dim;
        let qh = cfg.num_attention_heads / world_size;
        let kvh = cfg.num_key_value_heads / world_size;
        let ff = cfg.intermediate_size / world_size;
        let (q0, q1) = (rank * qh * hd, (rank + 1) * qh * hd);
        let (k0, k1) = (rank * kvh * hd, (rank + 1) * kvh * hd);
        let (f0, f1) = (rank * ff, (rank + 1) * ff);
        let layers = self
            .layers
            .iter()
            .map(|l| LayerWeights {
                input_layernorm: l.input_layernorm.clone(),
                q_proj: l.q_proj.rows(q0, q1),
                k_proj: l.k_proj.rows(k0, k1),
                v_proj: l.v_proj.rows(k0, k1),
                o_proj: l.o_proj.cols(q0, q1),
                post_attention_layernorm: l.post_attention_layernorm.clone(),
                gate_proj: l.gate_proj.rows(f0, f1),
                up_proj: l.up_proj.rows(f0, f1),
                down_proj: l.down_proj.cols(f0, f1),
                qkv_bias: l
                    .qkv_bias
                    .as_ref()
                    .map(|[bq, bk, bv]| [bq[q0..q1].to_vec(), bk[k0..k1].to_vec(), bv[k0..k1].to_vec()]),
                qk_norm: l.qk_norm.clone(),
                sandwich_norms: l.sandwich_norms.clone(),
            })
            .collect();
        Ok(Self {
            embed_tokens: self.embed_tokens.clone(),
            layers,
            norm: self.norm.clone(),
            lm_head: self.lm_head.clone(),
            shard: ShardInfo { rank, world_size },
        })
    }
}

/// llama.cpp's conversion permutes Q/K rows per head from the Hugging Face rotate-half
/// layout (`[h][half][j]`) to interleaved pairs (`[h][j][half]`); this reverses it in place.
/// `data` is `[n_heads * head_dim, cols]` row-major.
pub fn unpermute_qk(data: &mut [f32], n_heads: usize, cols: usize) {
    permute_rows(data, n_heads, cols, false);
}

/// [`unpermute_qk`] on rows of `row_bytes` bytes (a matrix in a block format).
pub fn unpermute_qk_bytes(data: &mut [u8], n_heads: usize, row_bytes: usize) {
    permute_rows(data, n_heads, row_bytes, false);
}

/// The forward permutation (HF → GGUF), as `convert_hf_to_gguf.py`'s `permute`.
pub fn permute_qk(data: &mut [f32], n_heads: usize, cols: usize) {
    permute_rows(data, n_heads, cols, true);
}

fn permute_rows<T: Copy>(data: &mut [T], n_heads: usize, cols: usize, to_gguf: bool) {
    if n_heads == 0 || cols == 0 {
        return;
    }
    let rows = data.len() / cols;
    let hd = rows / n_heads;
    let half = hd / 2;
    let src = data.to_vec();
    for h in 0..n_heads {
        for i in 0..2 {
            for j in 0..half {
                let hf_row = h * hd + i * half + j;
                let gg_row = h * hd + j * 2 + i;
                let (dst, from) = if to_gguf { (gg_row, hf_row) } else { (hf_row, gg_row) };
                data[dst * cols..(dst + 1) * cols].copy_from_slice(&src[from * cols..(from + 1) * cols]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permute_then_unpermute_is_identity() {
        let (heads, hd, cols) = (3, 8, 5);
        let orig: Vec<f32> = (0..heads * hd * cols).map(|x| x as f32).collect();
        let mut w = orig.clone();
        permute_qk(&mut w, heads, cols);
        assert_ne!(w, orig);
        // Row 1 of GGUF head 0 is HF row `half + 0` (second half, pair 0).
        assert_eq!(w[cols], orig[(hd / 2) * cols]);
        unpermute_qk(&mut w, heads, cols);
        assert_eq!(w, orig);
    }

    #[test]
    fn linear_slices() {
        let l = Linear::new(2, 3, vec![1., 2., 3., 4., 5., 6.]);
        assert_eq!(l.rows(1, 2).data, vec![4., 5., 6.]);
        assert_eq!(l.cols(1, 3).data, vec![2., 3., 5., 6.]);
    }

    #[test]
    fn quantized_slices_match_f32_slices() {
        // 2 rows x 64 columns of Q4_1 (2 blocks per row, 20 bytes each).
        let bytes: Vec<u8> = (0..80u32).map(|i| (i * 37 % 251) as u8 & 0x3b).collect();
        let q = Linear {
            out_features: 2,
            in_features: 64,
            data: Vec::new(),
            quant: Some(QuantizedData { ty: GgmlType::Q4_1, bytes }),
        };
        let f = q.clone().dequantized();
        assert_eq!(f.data.len(), 128);
        assert_eq!(q.rows(1, 2).to_f32().as_ref(), f.rows(1, 2).data.as_slice());
        assert!(q.cols(32, 64).quant.is_some());
        assert_eq!(q.cols(32, 64).to_f32().as_ref(), f.cols(32, 64).data.as_slice());
        assert_eq!(q.cols(8, 40).data, f.cols(8, 40).data);
        let mut row = vec![0f32; 64];
        q.row_f32(1, &mut row);
        assert_eq!(row.as_slice(), &f.data[64..]);
    }
}
