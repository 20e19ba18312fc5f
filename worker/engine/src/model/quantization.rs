//! [`CheckpointQuant`]: how a Hugging Face checkpoint's weights are quantized, parsed from
//! `config.json`'s `quantization_config`. The FP8 layouts read are those vLLM's loaders read:
//!
//! - `quant_method: "fp8"` (transformers' `FineGrainedFP8Config`, vLLM's `Fp8Config`):
//!   `weight` F8_E4M3 with `weight_scale` (per tensor) or, with `weight_block_size: [bn, bk]`
//!   (DeepSeek-V3), `weight_scale_inv` per `bn × bk` block; `activation_scheme` "dynamic" or
//!   "static" (then `input_scale`); unquantized modules in `ignored_layers` /
//!   `modules_to_not_convert`.
//! - `quant_method: "fbgemm_fp8"`: `weight` F8_E4M3 with a per-channel `weight_scale`
//!   `[out, 1]`, dynamic per-token activations, `modules_to_not_convert`.
//! - `quant_method: "compressed-tensors"` (llm-compressor), `format` "float-quantized" or
//!   "naive-quantized": `config_groups.*.weights` with `num_bits: 8`, `type: "float"` and
//!   `strategy` "tensor" (`weight_scale` `[]`/`[1]`), "channel" (`[out, 1]`) or "block"
//!   (`block_structure`); `input_activations` null (weight-only) or dynamic / static;
//!   `ignore` lists modules kept in their original dtype (usually `lm_head`).
//!
//! Anything else (AWQ, GPTQ, bitsandbytes, int8 or 4-bit compressed-tensors, group-wise
//! scales) is refused with [`ModelError::Quantization`] naming the field and its value.
//! Which tensors are FP8 is read from the file (their dtype), not from the module lists.

use serde_json::Value;

use super::error::ModelError;

/// The quantization methods whose FP8 weights load.
pub const SUPPORTED_METHODS: &str = "fp8, fbgemm_fp8, compressed-tensors";

/// Which `quant_method` wrote the checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QuantMethod {
    /// `"fp8"` (transformers / vLLM / DeepSeek).
    Fp8,
    /// `"fbgemm_fp8"`.
    FbgemmFp8,
    /// `"compressed-tensors"` (llm-compressor).
    CompressedTensors,
}

/// How the weight scales are laid out, as the config declares it (each tensor's scale
/// shape is checked against its weight when read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightStrategy {
    /// One scale per matrix.
    Tensor,
    /// One scale per output row.
    Channel,
    /// One scale per `[block_rows, block_cols]` block.
    Block([usize; 2]),
}

/// How activations are quantized for FP8 matrix products (the CPU backend keeps them f32).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationScheme {
    /// Weight-only quantization (W8A16).
    None,
    /// Scales computed on the fly (per token or per tensor).
    Dynamic,
    /// A calibrated per-tensor `input_scale` stored next to each weight.
    Static,
}

/// A checkpoint's `quantization_config`, validated.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointQuant {
    /// The method that wrote it.
    pub method: QuantMethod,
    /// The declared weight scale layout.
    pub weights: WeightStrategy,
    /// How activations are meant to be quantized.
    pub activations: ActivationScheme,
    /// Modules left unquantized (`ignore`, `ignored_layers`, `modules_to_not_convert`), as
    /// listed (names or `re:` patterns).
    pub ignore: Vec<String>,
}

fn unsupported(field: impl Into<String>, value: Option<&Value>, supported: &'static str) -> ModelError {
    ModelError::Quantization {
        field: field.into(),
        value: value.map_or_else(|| "(missing)".to_owned(), Value::to_string),
        supported,
    }
}

fn string_list(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect())
        .unwrap_or_default()
}

/// A `[rows, cols]` pair of positive block sizes.
fn block_size(v: &Value, field: &str) -> Result<[usize; 2], ModelError> {
    let pair = v.as_array().filter(|a| a.len() == 2).and_then(|a| {
        let r = a[0].as_u64().filter(|&x| x > 0 && x <= 1 << 20)?;
        let c = a[1].as_u64().filter(|&x| x > 0 && x <= 1 << 20)?;
        Some([r as usize, c as usize])
    });
    pair.ok_or_else(|| unsupported(field, Some(v), "two positive block sizes [rows, cols]"))
}

impl CheckpointQuant {
    /// Parses `quantization_config`.
    ///
    /// # Errors
    /// [`ModelError::Quantization`] naming the first unsupported field
    /// (`quantization_config.quant_method`, `.format`, `.activation_scheme`,
    /// `.weight_block_size`, `.config_groups.<group>.weights.num_bits` / `.type` / `.strategy`).
    pub fn from_hf(qc: &Value) -> Result<Self, ModelError> {
        let method = qc.get("quant_method");
        match method.and_then(Value::as_str) {
            Some("fp8") => Self::fp8(qc),
            Some("fbgemm_fp8") => Ok(Self {
                method: QuantMethod::FbgemmFp8,
                weights: WeightStrategy::Channel,
                activations: ActivationScheme::Dynamic,
                ignore: string_list(qc.get("modules_to_not_convert")),
            }),
            Some("compressed-tensors") => Self::compressed_tensors(qc),
            _ => Err(unsupported("quantization_config.quant_method", method, SUPPORTED_METHODS)),
        }
    }

    fn fp8(qc: &Value) -> Result<Self, ModelError> {
        let activations = match qc.get("activation_scheme") {
            None | Some(Value::Null) => ActivationScheme::Dynamic,
            Some(v) => match v.as_str() {
                Some("dynamic") => ActivationScheme::Dynamic,
                Some("static") => ActivationScheme::Static,
                _ => return Err(unsupported("quantization_config.activation_scheme", Some(v), "dynamic, static")),
            },
        };
        let weights = match qc.get("weight_block_size") {
            None | Some(Value::Null) => WeightStrategy::Tensor,
            Some(v) => WeightStrategy::Block(block_size(v, "quantization_config.weight_block_size")?),
        };
        let mut ignore = string_list(qc.get("ignored_layers"));
        ignore.extend(string_list(qc.get("modules_to_not_convert")));
        Ok(Self { method: QuantMethod::Fp8, weights, activations, ignore })
    }

    fn compressed_tensors(qc: &Value) -> Result<Self, ModelError> {
        let format = qc.get("format");
        if !matches!(format.and_then(Value::as_str), Some("float-quantized" | "naive-quantized")) {
            return Err(unsupported("quantization_config.format", format, "float-quantized, naive-quantized"));
        }
        let groups = qc.get("config_groups").and_then(Value::as_object);
        let Some(groups) = groups.filter(|g| !g.is_empty()) else {
            return Err(unsupported(
                "quantization_config.config_groups",
                qc.get("config_groups"),
                "an object of quantization groups",
            ));
        };
        let mut weights = None;
        let mut activations = ActivationScheme::None;
        // serde_json's map is sorted by key: the first group in name order declares the layout.
        for (name, group) in groups {
            let field = |f: &str| format!("quantization_config.config_groups.{name}.weights{f}");
            let w = group.get("weights").filter(|w| w.is_object());
            let Some(w) = w else { return Err(unsupported(field(""), group.get("weights"), "an FP8 weight scheme")) };
            if w.get("num_bits").and_then(Value::as_u64) != Some(8) {
                return Err(unsupported(field(".num_bits"), w.get("num_bits"), "8"));
            }
            if w.get("type").and_then(Value::as_str) != Some("float") {
                return Err(unsupported(field(".type"), w.get("type"), "float"));
            }
            let strategy = match w.get("strategy").and_then(Value::as_str) {
                Some("tensor") => WeightStrategy::Tensor,
                Some("channel") => WeightStrategy::Channel,
                Some("block") => match w.get("block_structure") {
                    Some(b) => WeightStrategy::Block(block_size(b, &field(".block_structure"))?),
                    None => return Err(unsupported(field(".block_structure"), None, "[rows, cols]")),
                },
                _ => return Err(unsupported(field(".strategy"), w.get("strategy"), "tensor, channel, block")),
            };
            weights.get_or_insert(strategy);
            if let Some(a) = group.get("input_activations").filter(|a| !a.is_null()) {
                let dynamic = a.get("dynamic").and_then(Value::as_bool).unwrap_or(false);
                activations = if dynamic { ActivationScheme::Dynamic } else { ActivationScheme::Static };
            }
        }
        Ok(Self {
            method: QuantMethod::CompressedTensors,
            weights: weights.unwrap_or(WeightStrategy::Tensor),
            activations,
            ignore: string_list(qc.get("ignore")),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn field_of(e: ModelError) -> (String, String) {
        match e {
            ModelError::Quantization { field, value, .. } => (field, value),
            other => panic!("expected a quantization error, got {other}"),
        }
    }

    #[test]
    fn fp8_layouts_parse() -> Result<(), ModelError> {
        let q = CheckpointQuant::from_hf(&json!({"quant_method": "fp8", "activation_scheme": "static"}))?;
        assert_eq!(q.method, QuantMethod::Fp8);
        assert_eq!(q.weights, WeightStrategy::Tensor);
        assert_eq!(q.activations, ActivationScheme::Static);
        let q = CheckpointQuant::from_hf(&json!({"quant_method": "fp8", "activation_scheme": "dynamic",
            "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]}))?;
        assert_eq!(q.weights, WeightStrategy::Block([128, 128]));
        assert_eq!(q.activations, ActivationScheme::Dynamic);
        assert_eq!(q.ignore, vec!["lm_head".to_owned()]);
        let q = CheckpointQuant::from_hf(&json!({"quant_method": "fbgemm_fp8"}))?;
        assert_eq!((q.method, q.weights), (QuantMethod::FbgemmFp8, WeightStrategy::Channel));
        Ok(())
    }

    #[test]
    fn compressed_tensors_parses_groups_and_ignore() -> Result<(), ModelError> {
        let q = CheckpointQuant::from_hf(&json!({
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true, "dynamic": false},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": true}}},
            "ignore": ["lm_head"], "quantization_status": "compressed"}))?;
        assert_eq!(q.method, QuantMethod::CompressedTensors);
        assert_eq!(q.weights, WeightStrategy::Channel);
        assert_eq!(q.activations, ActivationScheme::Dynamic);
        assert_eq!(q.ignore, vec!["lm_head".to_owned()]);
        let q = CheckpointQuant::from_hf(&json!({
            "quant_method": "compressed-tensors", "format": "naive-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                "input_activations": null}}}))?;
        assert_eq!((q.weights, q.activations), (WeightStrategy::Tensor, ActivationScheme::None));
        Ok(())
    }

    #[test]
    fn unsupported_methods_and_schemes_name_the_field_and_value() {
        let cases = [
            (json!({"quant_method": "awq", "bits": 4}), "quantization_config.quant_method", "\"awq\""),
            (json!({"quant_method": "gptq"}), "quantization_config.quant_method", "\"gptq\""),
            (json!({"bits": 4}), "quantization_config.quant_method", "(missing)"),
            (
                json!({"quant_method": "fp8", "activation_scheme": "weird"}),
                "quantization_config.activation_scheme",
                "\"weird\"",
            ),
            (
                json!({"quant_method": "fp8", "weight_block_size": [128]}),
                "quantization_config.weight_block_size",
                "[128]",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}),
                "quantization_config.format",
                "\"pack-quantized\"",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}}),
                "quantization_config.config_groups.group_0.weights.type",
                "\"int\"",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "strategy": "channel"}}}}),
                "quantization_config.config_groups.group_0.weights.num_bits",
                "4",
            ),
            (
                json!({"quant_method": "compressed-tensors", "format": "float-quantized",
                    "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "group"}}}}),
                "quantization_config.config_groups.group_0.weights.strategy",
                "\"group\"",
            ),
        ];
        for (qc, field, value) in cases {
            let e = CheckpointQuant::from_hf(&qc).expect_err("must be refused");
            assert!(e.to_string().contains(field), "{e}");
            assert_eq!(field_of(e), (field.to_owned(), value.to_owned()), "{qc}");
        }
    }
}
