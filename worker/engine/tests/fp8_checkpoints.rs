//! FP8 (E4M3) checkpoints through `load_model`, the CPU backend and the engine. The tiny
//! seeded Llama fixture (`tests/fixtures/hf-tiny`) is rewritten here as FP8 in each Hugging
//! Face layout — compressed-tensors per channel / per tensor, transformers/vLLM "fp8" per
//! tensor and block-wise — by a writer that shares nothing with the loader: E4M3 values from
//! the format's definition (OCP OFP8: 1-4-3, bias 7, no infinities, NaN `S.1111.111`), codes
//! by nearest-value search (ties to even), its own safetensors header. Next to each FP8
//! directory it writes the reference: the same model in f32 with every quantized weight
//! replaced by `value(code) · scale`. The FP8 load must give exactly those weights and
//! logits. `scripts/quantize_fp8.py`'s output is checked the same way (python with numpy: see
//! `numpy_python`).
//! Broken checkpoints (unsupported `quant_method`, missing or misshapen scales, an F8 tensor
//! whose bytes disagree with its shape) are typed errors naming the field or tensor.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail, ensure};
use half::bf16;
use prism_engine::backend::cpu::CpuBackend;
use prism_engine::backend::{Backend, SeqStep, StepBatch};
use prism_engine::model::{LoadedModel, ModelError, ModelSource, load_model};
use prism_engine::{
    EngineConfig, EngineError, EngineHandle, EngineRequest, KvCacheDtype, Prompt, Quantization, SamplingParams,
};
use serde_json::{Value, json};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf-tiny")
}

/// One tensor as the writer stores it.
#[derive(Clone)]
struct Stored {
    name: String,
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl Stored {
    fn f32(name: &str, shape: Vec<usize>, values: &[f32]) -> Self {
        Self {
            name: name.to_owned(),
            dtype: "F32",
            shape,
            bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        }
    }
}

/// A tensor in f32: name, shape, values.
type F32Tensor = (String, Vec<usize>, Vec<f32>);

/// The fixture's tensors in f32 (read with the safetensors crate, converted here).
fn fixture_tensors() -> Result<Vec<F32Tensor>> {
    let raw = std::fs::read(fixture_dir().join("model.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&raw)?;
    let mut out = Vec::new();
    for (name, view) in st.tensors() {
        let b = view.data();
        let values: Vec<f32> = match view.dtype() {
            safetensors::Dtype::F32 => {
                b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
            }
            safetensors::Dtype::F16 => {
                b.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect()
            }
            safetensors::Dtype::BF16 => b.chunks_exact(2).map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => anyhow::bail!("fixture tensor {name} is {other:?}"),
        };
        out.push((name, view.shape().to_vec(), values));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

fn write_safetensors(path: &Path, tensors: &[Stored]) -> Result<()> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for t in tensors {
        let start = data.len();
        data.extend_from_slice(&t.bytes);
        header.insert(t.name.clone(), json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [start, data.len()]}));
    }
    let mut h = serde_json::to_vec(&Value::Object(header))?;
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    std::fs::write(path, out)?;
    Ok(())
}

/// A model directory: the fixture's tokenizer and generation files, its config.json with
/// `quantization_config` set (or not), and `tensors`.
fn write_dir(dir: &Path, quantization_config: Option<&Value>, tensors: &[Stored]) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(fixture_dir().join(f), dir.join(f))?;
    }
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("config.json"))?)?;
    if let Some(q) = quantization_config {
        config["quantization_config"] = q.clone();
    }
    std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&config)?)?;
    write_safetensors(&dir.join("model.safetensors"), tensors)
}

/// E4M3 code → value, from the format's definition.
fn e4m3_value(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (exp, man) = (i32::from((code >> 3) & 0xf), f64::from(code & 7));
    let mag = if exp == 0 { man / 8.0 * 2f64.powi(-6) } else { (1.0 + man / 8.0) * 2f64.powi(exp - 7) };
    (sign * mag) as f32
}

/// The finite code nearest to `x` (|x| ≤ 448 here), ties to the even code.
fn e4m3_code(x: f32) -> u8 {
    let base = if x.is_sign_negative() { 0x80 } else { 0 };
    let mut best = base;
    for code in base..=base + 0x7e {
        let (d, bd) = ((e4m3_value(code) - x).abs(), (e4m3_value(best) - x).abs());
        if d < bd || (d == bd && code & 1 == 0) {
            best = code;
        }
    }
    best
}

#[derive(Clone, Copy)]
enum Scales {
    Channel,
    Tensor,
    Block([usize; 2]),
}

/// How one FP8 directory is written.
struct Layout {
    quantization_config: Value,
    scales: Scales,
    /// `weight_scale` or `weight_scale_inv`.
    scale_suffix: &'static str,
    /// The scale tensor's shape for a per-tensor scale (`[]` or `[1]`).
    tensor_scale_shape: Vec<usize>,
    scale_bf16: bool,
    input_scale: bool,
}

fn is_linear(name: &str) -> bool {
    name.starts_with("model.layers.")
        && ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
            .iter()
            .any(|p| name.ends_with(&format!("{p}.weight")))
}

/// Writes `fp8` (the layout) and `reference` (f32, the FP8 weights dequantized here).
fn write_fp8_pair(layout: &Layout, fp8: &Path, reference: &Path) -> Result<()> {
    let mut fp8_tensors = Vec::new();
    let mut ref_tensors = Vec::new();
    for (name, shape, w) in fixture_tensors()? {
        if !is_linear(&name) {
            fp8_tensors.push(Stored::f32(&name, shape.clone(), &w));
            ref_tensors.push(Stored::f32(&name, shape, &w));
            continue;
        }
        let (out, inp) = (shape[0], shape[1]);
        // Which scale each weight uses, and each scale's amax.
        let (grid, scale_shape): ((usize, usize), Vec<usize>) = match layout.scales {
            Scales::Channel => ((out, 1), vec![out, 1]),
            Scales::Tensor => ((1, 1), layout.tensor_scale_shape.clone()),
            Scales::Block([br, bc]) => ((out.div_ceil(br), inp.div_ceil(bc)), vec![out.div_ceil(br), inp.div_ceil(bc)]),
        };
        let cell = |r: usize, c: usize| match layout.scales {
            Scales::Channel => r,
            Scales::Tensor => 0,
            Scales::Block([br, bc]) => (r / br) * grid.1 + c / bc,
        };
        let mut amax = vec![0f32; grid.0 * grid.1];
        for r in 0..out {
            for c in 0..inp {
                let a = &mut amax[cell(r, c)];
                *a = a.max(w[r * inp + c].abs());
            }
        }
        let mut scales: Vec<f32> = amax.iter().map(|&a| if a > 0.0 { a / 448.0 } else { 1.0 }).collect();
        if layout.scale_bf16 {
            scales.iter_mut().for_each(|s| *s = bf16::from_f32(*s).to_f32());
        }
        let mut codes = vec![0u8; out * inp];
        let mut deq = vec![0f32; out * inp];
        for r in 0..out {
            for c in 0..inp {
                let s = scales[cell(r, c)];
                // `w · (1 / s)` in f32: the at-load quantization's rounding, which
                // `scripts/quantize_fp8.py` follows.
                let code = e4m3_code((w[r * inp + c] * (1.0 / s)).clamp(-448.0, 448.0));
                codes[r * inp + c] = code;
                deq[r * inp + c] = e4m3_value(code) * s;
            }
        }
        let prefix = name.strip_suffix(".weight").context("linear name")?;
        fp8_tensors.push(Stored { name: name.clone(), dtype: "F8_E4M3", shape: shape.clone(), bytes: codes });
        let scale_name = format!("{prefix}.{}", layout.scale_suffix);
        fp8_tensors.push(if layout.scale_bf16 {
            Stored {
                name: scale_name,
                dtype: "BF16",
                shape: scale_shape,
                bytes: scales.iter().flat_map(|&s| bf16::from_f32(s).to_le_bytes()).collect(),
            }
        } else {
            Stored::f32(&scale_name, scale_shape, &scales)
        });
        if layout.input_scale {
            fp8_tensors.push(Stored::f32(&format!("{prefix}.input_scale"), vec![], &[0.0125]));
        }
        ref_tensors.push(Stored::f32(&name, shape, &deq));
    }
    write_dir(fp8, Some(&layout.quantization_config), &fp8_tensors)?;
    write_dir(reference, None, &ref_tensors)
}

fn load(dir: &Path) -> Result<LoadedModel> {
    Ok(load_model(&ModelSource::detect(dir)?, None)?)
}

fn load_err(dir: &Path) -> ModelError {
    match load_model(&ModelSource::HfDir(dir.to_path_buf()), None) {
        Ok(_) => panic!("{} must not load", dir.display()),
        Err(ModelError::File { source, .. }) => *source,
        Err(e) => e,
    }
}

/// Last-position logits of a prefill of `prompt`.
fn logits(model: LoadedModel, prompt: &[u32]) -> Result<Vec<f32>> {
    let cfg = model.config.clone();
    let mut backend = CpuBackend::new(model.weights, &cfg, 1 << 20, 4)?;
    let bs = backend.block_size();
    let mut batch = StepBatch::default();
    for (p, &t) in prompt.iter().enumerate() {
        batch.token_ids.push(t);
        batch.positions.push(p as u32);
        batch.slot_mapping.push(p as u32);
    }
    batch.seqs.push(SeqStep {
        query_start: 0,
        query_len: prompt.len(),
        context_len: prompt.len(),
        block_table: (0..prompt.len().div_ceil(bs) as u32).collect(),
        want_logits: true,
    });
    Ok(backend.forward(&batch)?.row(0).to_vec())
}

const PROMPT: [u32; 9] = [256, 72, 101, 108, 108, 111, 264, 263, 100];

fn compressed_tensors(strategy: &str, input_activations: Value) -> Value {
    json!({
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": true, "dynamic": false},
            "input_activations": input_activations}},
        "ignore": ["lm_head"]
    })
}

fn layouts() -> Vec<(&'static str, Layout)> {
    let dynamic = json!({"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true});
    let static_tensor = json!({"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": false});
    vec![
        (
            "ct-channel",
            Layout {
                quantization_config: compressed_tensors("channel", dynamic),
                scales: Scales::Channel,
                scale_suffix: "weight_scale",
                tensor_scale_shape: vec![],
                scale_bf16: false,
                input_scale: false,
            },
        ),
        (
            "ct-tensor-bf16-static",
            Layout {
                quantization_config: compressed_tensors("tensor", static_tensor),
                scales: Scales::Tensor,
                scale_suffix: "weight_scale",
                tensor_scale_shape: vec![1],
                scale_bf16: true,
                input_scale: true,
            },
        ),
        (
            "fp8-tensor",
            Layout {
                quantization_config: json!({"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}),
                scales: Scales::Tensor,
                scale_suffix: "weight_scale",
                tensor_scale_shape: vec![],
                scale_bf16: false,
                input_scale: true,
            },
        ),
        (
            "fp8-block",
            Layout {
                // 32 x 48 blocks: the 64- and 128-wide matrices end in partial blocks.
                quantization_config: json!({"quant_method": "fp8", "activation_scheme": "dynamic",
                    "weight_block_size": [32, 48], "modules_to_not_convert": ["lm_head"]}),
                scales: Scales::Block([32, 48]),
                scale_suffix: "weight_scale_inv",
                tensor_scale_shape: vec![],
                scale_bf16: false,
                input_scale: false,
            },
        ),
    ]
}

#[test]
fn fp8_layouts_load_to_the_dequantized_reference_exactly() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let original = logits(load(&fixture_dir())?, &PROMPT)?;
    let scale = original.iter().fold(0f32, |m, v| m.max(v.abs()));
    for (label, layout) in layouts() {
        let (fp8, reference) = (tmp.path().join(label), tmp.path().join(format!("{label}-ref")));
        write_fp8_pair(&layout, &fp8, &reference)?;
        let (m, r) = (load(&fp8)?, load(&reference)?);
        let q = m.config.quantization.as_ref().context("quantization parsed")?;
        ensure!(q.ignore == ["lm_head"], "{label}: ignore {:?}", q.ignore);
        ensure!(m.weights == r.weights, "{label}: FP8 weights differ from the dequantized reference");
        // lm_head stayed f32: it is the fixture's own.
        let lm_head = m.weights.lm_head.as_ref().context("untied lm_head")?;
        let fixture = load(&fixture_dir())?;
        ensure!(Some(lm_head) == fixture.weights.lm_head.as_ref(), "{label}: lm_head changed");
        let (lf, lr) = (logits(m, &PROMPT)?, logits(r, &PROMPT)?);
        ensure!(lf == lr, "{label}: logits differ from the reference's");
        // And FP8 stays close to the unquantized model (E4M3 keeps 3 mantissa bits).
        let d = lf.iter().zip(&original).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        eprintln!("{label}: max |logit - f32 logit| = {d:.4} (max |logit| {scale:.3})");
        ensure!(d < 0.1 * scale, "{label}: FP8 logits are {d} away from f32 (scale {scale})");
    }
    Ok(())
}

#[test]
fn fp8_weights_read_as_stored_with_their_scales() -> Result<()> {
    use prism_engine::model::fp8::{Fp8Format, Fp8Scales};
    use prism_engine::model::quantization::{ActivationScheme, QuantMethod, WeightStrategy};
    use prism_engine::model::safetensors::open_dir_model;
    let tmp = tempfile::tempdir()?;
    for (label, layout) in layouts() {
        let (fp8, reference) = (tmp.path().join(label), tmp.path().join(format!("{label}-ref")));
        write_fp8_pair(&layout, &fp8, &reference)?;
        let m = open_dir_model(&fp8)?;
        let q = m.config.quantization.as_ref().context("quantization")?;
        let name = "model.layers.1.mlp.down_proj.weight";
        let w = m.files.fp8_weight(name)?.context("FP8 weight")?;
        ensure!(w.format == Fp8Format::E4M3 && w.shape == [64, 128] && w.bytes.len() == 64 * 128, "{label}");
        let r = load(&reference)?;
        ensure!(w.dequantize() == r.weights.layers[1].down_proj.data, "{label}: dequantize() != reference");
        match (label, &w.scales) {
            ("ct-channel", Fp8Scales::PerChannel(s)) => ensure!(s.len() == 64),
            ("ct-tensor-bf16-static" | "fp8-tensor", Fp8Scales::PerTensor(_)) => {}
            ("fp8-block", Fp8Scales::Block { block, scales }) => {
                ensure!(*block == [32, 48] && scales.len() == 2 * 3, "{label}: {block:?} {}", scales.len())
            }
            (l, s) => anyhow::bail!("{l}: unexpected scales {s:?}"),
        }
        ensure!(w.input_scale == layout.input_scale.then_some(0.0125), "{label}: input_scale {:?}", w.input_scale);
        match label {
            "ct-channel" => ensure!(
                q.method == QuantMethod::CompressedTensors
                    && q.weights == WeightStrategy::Channel
                    && q.activations == ActivationScheme::Dynamic
            ),
            "fp8-block" => ensure!(q.method == QuantMethod::Fp8 && q.weights == WeightStrategy::Block([32, 48])),
            _ => {}
        }
        // Non-FP8 tensors are not FP8 weights; the bf16 path dequantizes FP8 ones.
        ensure!(m.files.fp8_weight("lm_head.weight")?.is_none() && !m.files.is_fp8("model.norm.weight"));
        let mut out = Vec::new();
        m.files.append_bf16(name, &[64, 128], &mut out)?;
        let want: Vec<bf16> = r.weights.layers[1].down_proj.data.iter().map(|&v| bf16::from_f32(v)).collect();
        ensure!(out == want, "{label}: append_bf16 of an FP8 weight");
        let mut block = Vec::new();
        m.files.append_bf16_block(name, [64, 128], 0..64, 64..128, &mut block)?;
        let want_block: Vec<bf16> = (0..64).flat_map(|row| want[row * 128 + 64..row * 128 + 128].to_vec()).collect();
        ensure!(block == want_block, "{label}: append_bf16_block of an FP8 weight");
    }
    Ok(())
}

#[test]
fn broken_fp8_checkpoints_are_errors_naming_the_field_or_tensor() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let (_, layout) = layouts().into_iter().next().context("layout")?;
    let (good, reference) = (tmp.path().join("good"), tmp.path().join("ref"));
    write_fp8_pair(&layout, &good, &reference)?;
    let raw = std::fs::read(good.join("model.safetensors"))?;
    let st = safetensors::SafeTensors::deserialize(&raw)?;
    let mut tensors: Vec<Stored> = Vec::new();
    for (name, view) in st.tensors() {
        let dtype = match view.dtype() {
            safetensors::Dtype::F8_E4M3 => "F8_E4M3",
            _ => "F32",
        };
        tensors.push(Stored { name, dtype, shape: view.shape().to_vec(), bytes: view.data().to_vec() });
    }
    let variant = |label: &str, qc: &Value, edit: &dyn Fn(&mut Vec<Stored>)| -> Result<ModelError> {
        let dir = tmp.path().join(label);
        let mut t = tensors.clone();
        edit(&mut t);
        write_dir(&dir, Some(qc), &t)?;
        Ok(load_err(&dir))
    };
    let qc = &layout.quantization_config;
    let unchanged = |_: &mut Vec<Stored>| {};

    let awq = json!({"quant_method": "awq", "bits": 4, "group_size": 128});
    let e = variant("awq", &awq, &unchanged)?;
    ensure!(
        matches!(&e, ModelError::Quantization { field, value, .. }
            if field == "quantization_config.quant_method" && value == "\"awq\""),
        "{e}"
    );
    let int8 = compressed_tensors("channel", Value::Null);
    let mut int8 = int8.clone();
    int8["config_groups"]["group_0"]["weights"]["type"] = json!("int");
    let e = variant("int8", &int8, &unchanged)?;
    ensure!(
        matches!(&e, ModelError::Quantization { field, .. } if field == "quantization_config.config_groups.group_0.weights.type"),
        "{e}"
    );

    let scale = "model.layers.1.mlp.down_proj.weight_scale";
    let e = variant("no-scale", qc, &|t| t.retain(|s| s.name != scale))?;
    ensure!(matches!(&e, ModelError::MissingTensor { name } if name == scale), "{e}");

    let e = variant("scale-shape", qc, &|t| {
        let s = t.iter_mut().find(|s| s.name == scale).expect("scale");
        s.shape = vec![32, 1];
        s.bytes.truncate(32 * 4);
    })?;
    ensure!(
        matches!(&e, ModelError::ScaleShape { name, actual, weight, .. }
            if name == scale && actual == &[32, 1] && weight == &[64, 128]),
        "{e}"
    );

    let e = variant("scale-nan", qc, &|t| {
        let s = t.iter_mut().find(|s| s.name == scale).expect("scale");
        s.bytes[..4].copy_from_slice(&f32::NAN.to_le_bytes());
    })?;
    ensure!(matches!(&e, ModelError::ScaleValue { name, .. } if name == scale), "{e}");

    let weight = "model.layers.0.self_attn.q_proj.weight";
    let e = variant("bytes", qc, &|t| {
        t.iter_mut().find(|s| s.name == weight).expect("weight").bytes.push(0);
    })?;
    ensure!(matches!(&e, ModelError::TensorBytes { name, expected: 4096, actual: 4097, .. } if name == weight), "{e}");
    ensure!(e.to_string().contains(weight), "{e}");

    // A 2-D scale is a block scale only with weight_block_size.
    let e = variant("block-no-size", &json!({"quant_method": "fp8"}), &|t| {
        let s = t.iter_mut().find(|s| s.name == scale).expect("scale");
        s.shape = vec![2, 32];
    })?;
    ensure!(matches!(&e, ModelError::ScaleShape { expected, .. } if expected.contains("weight_block_size")), "{e}");
    Ok(())
}

/// The first layout's FP8 checkpoint and its dequantized reference, written under `root`.
fn first_fp8_pair(root: &Path) -> Result<(PathBuf, PathBuf)> {
    let (_, layout) = layouts().into_iter().next().context("layout")?;
    let (fp8, reference) = (root.join("fp8"), root.join("ref"));
    write_fp8_pair(&layout, &fp8, &reference)?;
    Ok((fp8, reference))
}

/// A CPU engine on `dir` with two threads and a 4 MiB KV cache.
fn small_cpu_engine(dir: &Path) -> EngineConfig {
    let mut cfg = EngineConfig::new(dir.to_path_buf());
    cfg.engine_threads = Some(2);
    cfg.kv_cache_bytes = Some(4 << 20);
    cfg
}

#[test]
fn the_cpu_engine_generates_from_an_fp8_checkpoint_as_from_its_reference() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let (fp8, reference) = first_fp8_pair(tmp.path())?;
    let mut generated = Vec::new();
    for dir in [&fp8, &reference] {
        let cfg = small_cpu_engine(dir);
        let engine = EngineHandle::start(cfg, None)?;
        let params =
            SamplingParams { temperature: 0.0, max_tokens: Some(24), ignore_eos: true, ..SamplingParams::default() };
        let mut stream = engine.submit(EngineRequest {
            id: "fp8".into(),
            prompt: Prompt::Text("hi the in".into()),
            params,
            prior_output_ids: Vec::new(),
            deadline: None,
            cache_salt: None,
            tools: None,
            chat_template_kwargs: None,
        })?;
        let mut tokens = Vec::new();
        while let Some(o) = stream.blocking_recv() {
            tokens.extend(o.token_ids);
        }
        engine.shutdown();
        ensure!(tokens.len() == 24, "{}: {} tokens", dir.display(), tokens.len());
        generated.push(tokens);
    }
    ensure!(generated[0] == generated[1], "FP8 {:?} vs reference {:?}", generated[0], generated[1]);
    Ok(())
}

/// `--quantization fp8` and `--kv-cache-dtype fp8` are one-GPU CUDA options: a CPU replica
/// refuses them with an error naming the field rather than serving bf16, while the FP8
/// checkpoint itself still loads (the test above).
#[test]
fn the_cpu_engine_refuses_fp8_quantization_and_fp8_kv_cache_by_name() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let (_, reference) = first_fp8_pair(tmp.path())?;
    for field in ["quantization", "kv_cache_dtype"] {
        let mut cfg = small_cpu_engine(&reference);
        if field == "quantization" {
            cfg.quantization = Quantization::Fp8;
        } else {
            cfg.kv_cache_dtype = KvCacheDtype::Fp8;
        }
        match EngineHandle::start(cfg, None) {
            Err(EngineError::InvalidRequest { field: f, message }) => {
                ensure!(f == field, "{field}: error names {f}: {message}");
                ensure!(message.contains("one-GPU CUDA replica") && message.contains("CPU"), "{message}");
            }
            Err(e) => bail!("{field}: {e}"),
            Ok(engine) => {
                engine.shutdown();
                bail!("{field} fp8 on the CPU backend started an engine");
            }
        }
    }
    Ok(())
}

fn has_numpy(python: &Path) -> bool {
    std::process::Command::new(python).args(["-c", "import numpy"]).output().is_ok_and(|o| o.status.success())
}

/// A python with numpy: `PRISM_PYTHON`, `python3` when it has numpy, or a virtual environment
/// made once under the workspace's `target/fp8-venv` with numpy from PyPI.
fn numpy_python() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PRISM_PYTHON") {
        return Ok(PathBuf::from(p));
    }
    if has_numpy(Path::new("python3")) {
        return Ok(PathBuf::from("python3"));
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/fp8-venv");
    let python = venv.join("bin/python");
    // Two tests may get here at once on a fresh checkout: one of them makes the environment.
    static MAKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _making = MAKING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if !has_numpy(&python) {
        let made = std::process::Command::new("python3").arg("-m").arg("venv").arg(&venv).status()?;
        ensure!(made.success(), "python3 -m venv {} failed", venv.display());
        let pip = std::process::Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check", "numpy"])
            .status()?;
        ensure!(pip.success(), "pip install numpy failed (offline? set PRISM_PYTHON to a python with numpy)");
    }
    Ok(python)
}

/// `scripts/quantize_fp8.py` (numpy) writes the compressed-tensors per-channel layout this
/// file's writer does: loading its output gives the same weights; its "fp8" layout loads with
/// per-tensor scales.
#[test]
fn the_quantize_script_writes_what_the_loader_reads() -> Result<()> {
    let python = numpy_python()?;
    let tmp = tempfile::tempdir()?;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/quantize_fp8.py");
    let (_, layout) = layouts().into_iter().next().context("layout")?;
    let (ours, reference) = (tmp.path().join("ours"), tmp.path().join("ref"));
    write_fp8_pair(&layout, &ours, &reference)?;
    for (label, extra) in [("script-channel", vec![]), ("script-fp8", vec!["--layout", "fp8", "--strategy", "tensor"])]
    {
        let out = tmp.path().join(label);
        let status =
            std::process::Command::new(&python).arg(&script).arg(fixture_dir()).arg(&out).args(&extra).status()?;
        ensure!(status.success(), "{label}: quantize_fp8.py failed");
        let m = load(&out)?;
        ensure!(m.config.quantization.is_some(), "{label}");
        if label == "script-channel" {
            ensure!(m.weights == load(&reference)?.weights, "script output differs from the test writer's");
        } else {
            let w = prism_engine::model::safetensors::open_dir_model(&out)?;
            let q = w.files.fp8_weight("model.layers.0.mlp.up_proj.weight")?.context("FP8 weight")?;
            ensure!(matches!(q.scales, prism_engine::model::fp8::Fp8Scales::PerTensor(_)), "{label}: {:?}", q.scales);
        }
    }
    Ok(())
}

/// `scripts/quantize_fp8.py` rounds as the at-load quantization does (`quantize_rows`, which
/// the device kernel equals bit for bit): the same codes and scales for a matrix whose rows hold
/// values where `w / scale` and `w · (1 / scale)` round to different codes.
#[test]
fn the_quantize_script_rounds_as_the_at_load_quantization() -> Result<()> {
    use prism_engine::model::fp8::{f32_to_e4m3, quantize_rows};
    let python = numpy_python()?;
    let (rows, cols) = (64usize, 512usize);
    let mut w = Vec::with_capacity(rows * cols);
    let mut boundary = 0usize;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for _ in 0..rows {
        // The row's largest magnitude sets its scale; the other values are bf16 values below it,
        // the ones on which the two roundings disagree first.
        let amax = bf16::from_f32(0.01 + (next() % 1000) as f32 / 1000.0).to_f32();
        let s = amax / 448.0;
        let mut row = vec![amax];
        let start = (next() % 30_000) as u16;
        for b in (start..u16::MAX).chain(0..start) {
            let v = bf16::from_bits(b).to_f32();
            if row.len() < cols / 2
                && v.is_finite()
                && v.abs() < amax
                && f32_to_e4m3(v / s) != f32_to_e4m3(v * (1.0 / s))
            {
                row.push(v);
                boundary += 1;
            }
        }
        while row.len() < cols {
            row.push(bf16::from_bits((next() % 65_536) as u16).to_f32().clamp(-amax, amax));
        }
        w.extend(row.into_iter().map(|v| if v.is_nan() { 0.0 } else { v }));
    }
    ensure!(boundary >= 20, "only {boundary} values where the two roundings differ");
    let tmp = tempfile::tempdir()?;
    let (inp, codes_out, scales_out) =
        (tmp.path().join("w.f32"), tmp.path().join("codes.u8"), tmp.path().join("s.f32"));
    std::fs::write(&inp, w.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/quantize_fp8.py");
    let code = format!(
        "import importlib.util, numpy as np\n\
         spec = importlib.util.spec_from_file_location('q', {script:?})\n\
         q = importlib.util.module_from_spec(spec); spec.loader.exec_module(q)\n\
         w = np.fromfile({inp:?}, dtype='<f4').reshape({rows}, {cols})\n\
         codes, scale = q.quantize(w, 'channel')\n\
         codes.tofile({codes_out:?}); scale.astype('<f4').tofile({scales_out:?})\n"
    );
    let status = std::process::Command::new(&python).arg("-c").arg(code).status()?;
    ensure!(status.success(), "quantize_fp8.py's quantize failed");
    let codes = std::fs::read(&codes_out)?;
    let scales: Vec<f32> =
        std::fs::read(&scales_out)?.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    let (want_codes, want_scales) = quantize_rows(&w, cols);
    ensure!(scales == want_scales, "scales differ");
    let differ = codes.iter().zip(&want_codes).filter(|(a, b)| a != b).count();
    ensure!(differ == 0, "{differ} of {} codes differ from the at-load rule ({boundary} boundary values)", codes.len());
    Ok(())
}
