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

#[test]
fn fp8_scales_follow_the_layers_and_family_tensors_stay_bf16_after_each_layer() {
    let d = dims(2);
    let f = WeightFormat { fp8: true, fp8_lm_head: false };
    let all = LayerExtras { qkv_bias: true, qk_norm: true, sandwich_norms: true };
    let l = layout_as(&d, true, true, true, f, all);
    // e4m3 matrices take half the 2-byte units; norms, biases and gains their bf16 size.
    let (emb, norm) = (up(100 * 64), up(64));
    let layer = up(64) + up(d.qkv_dim() * 64 / 2) + up(64 * d.q_dim() / 2) + up(64) + up(96 * 64) + up(64 * 96 / 2);
    let extra = up(d.qkv_dim()) + 2 * up(16) + 2 * up(64);
    assert_eq!(l.layers[0][0], emb + norm);
    assert_eq!(l.extras[0].qkv_bias, Some(emb + norm + layer));
    assert_eq!(l.layers[1][0], emb + norm + layer + extra);
    // The per-row f32 scales (two units a row) of layer 0 come after the last layer's extras.
    let end = emb + norm + 2 * (layer + extra);
    let (o1, o2) = (end + up(2 * d.qkv_dim()), end + up(2 * d.qkv_dim()) + up(2 * 64));
    assert_eq!(l.scales[0], [end, o1, o2, o2 + up(4 * 96)]);
    assert_eq!(l.scales.len(), 2);
    assert_eq!(l.lm_head_scale, None);
    let sc = up(2 * d.qkv_dim()) + up(2 * 64) + up(4 * 96) + up(2 * 64);
    assert_eq!(l.total, end + 2 * sc);
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
