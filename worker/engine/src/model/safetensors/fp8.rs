//! FP8 weights in safetensors files: a linear's `weight` stored as F8_E4M3 (or F8_E5M2) next
//! to its scale tensor (`weight_scale`, or `weight_scale_inv` in the block-wise layout) and,
//! with static activation quantization, `input_scale` — the tensor names vLLM's FP8 and
//! compressed-tensors loaders read. The scale's shape says its layout: `[]` or `[1]` per
//! tensor, `[out]` or `[out, 1]` per output channel, `[ceil(out / bn), ceil(in / bk)]` per
//! block of the configured `weight_block_size`.

use safetensors::tensor::Dtype;

use super::{ReadTensor, SafetensorsFiles, float_values, is_fp8};
use crate::model::error::ModelError;
use crate::model::fp8::{Fp8Format, Fp8Scales, Fp8Weight};
use crate::model::quantization::WeightStrategy;

impl SafetensorsFiles {
    /// The FP8 weight `name` (`….weight`) as stored — codes borrowed from the mmap, its scales
    /// and optional `input_scale` read — without dequantizing; `None` when the tensor is
    /// absent or not FP8. The scale is `<prefix>.weight_scale` or `<prefix>.weight_scale_inv`
    /// (both multiply the codes), `<prefix>` being `name` without `.weight`.
    ///
    /// # Errors
    /// [`ModelError::TensorRank`] for an FP8 tensor that is not 2-D,
    /// [`ModelError::MissingTensor`] naming `<prefix>.weight_scale` when no scale is stored,
    /// [`ModelError::ScaleShape`] for a scale (or `input_scale`) whose shape fits no layout,
    /// [`ModelError::ScaleValue`] for a non-finite scale, [`ModelError::TensorType`] for a
    /// scale that is not f32/f16/bf16.
    pub fn fp8_weight(&self, name: &str) -> Result<Option<Fp8Weight<'_>>, ModelError> {
        match self.raw(name)? {
            Some((info, _)) if is_fp8(info.dtype) => Ok(Some(self.fp8_weight_read(name)?.0)),
            _ => Ok(None),
        }
    }

    /// Whether `name` is stored in an FP8 format.
    pub fn is_fp8(&self, name: &str) -> bool {
        matches!(self.raw(name), Ok(Some((info, _))) if is_fp8(info.dtype))
    }

    /// As [`SafetensorsFiles::fp8_weight`] for a tensor known to be FP8, with the bytes read
    /// (codes and scales).
    pub(super) fn fp8_weight_read(&self, name: &str) -> Result<(Fp8Weight<'_>, usize), ModelError> {
        let (info, bytes) = self.raw(name)?.ok_or_else(|| ModelError::MissingTensor { name: name.to_owned() })?;
        let format = if info.dtype == Dtype::F8_E5M2 { Fp8Format::E5M2 } else { Fp8Format::E4M3 };
        let &[out, inp] = info.shape.as_slice() else {
            return Err(ModelError::TensorRank { name: name.to_owned(), dims: info.shape.len() as u32 });
        };
        if bytes.len() != out * inp {
            return Err(ModelError::TensorBytes {
                name: name.to_owned(),
                dtype: format!("{:?}", info.dtype),
                shape: info.shape.clone(),
                expected: out * inp,
                actual: bytes.len(),
            });
        }
        let prefix = name.strip_suffix(".weight").unwrap_or(name);
        let block = match self.quantization.as_ref().map(|q| q.weights) {
            Some(WeightStrategy::Block(b)) => Some(b),
            _ => None,
        };
        let mut read = bytes.len();
        let candidates = [format!("{prefix}.weight_scale"), format!("{prefix}.weight_scale_inv")];
        let mut found = None;
        for c in &candidates {
            if let Some(v) = self.scale_values(c)? {
                found = Some((c, v));
                break;
            }
        }
        let Some((scale_name, (shape, values, n))) = found else {
            // The block-wise layout's name when the config says blocks, the usual one otherwise.
            let missing = &candidates[usize::from(block.is_some())];
            return Err(ModelError::MissingTensor { name: missing.clone() });
        };
        read += n;
        let scales = scale_layout(scale_name, &shape, values, [out, inp], block)?;
        let input_name = format!("{prefix}.input_scale");
        let input_scale = match self.scale_values(&input_name)? {
            None => None,
            Some((shape, values, n)) => {
                read += n;
                if values.len() != 1 {
                    return Err(ModelError::ScaleShape {
                        name: input_name,
                        actual: shape,
                        weight: vec![out, inp],
                        expected: "[] or [1] (one static activation scale)".into(),
                    });
                }
                Some(values[0])
            }
        };
        Ok((Fp8Weight { format, bytes, shape: [out, inp], scales, input_scale }, read))
    }

    /// A scale tensor's shape, finite f32 values and bytes; `None` when absent.
    fn scale_values(&self, name: &str) -> Result<Option<ReadTensor>, ModelError> {
        let Some((info, bytes)) = self.raw(name)? else { return Ok(None) };
        let values = float_values(name, info.dtype, bytes)?;
        if let Some(&value) = values.iter().find(|v| !v.is_finite()) {
            return Err(ModelError::ScaleValue { name: name.to_owned(), value });
        }
        Ok(Some((info.shape.clone(), values, bytes.len())))
    }
}

/// Which layout a scale of `shape` is for a weight `[out, inp]`.
fn scale_layout(
    name: &str,
    shape: &[usize],
    values: Vec<f32>,
    [out, inp]: [usize; 2],
    block: Option<[usize; 2]>,
) -> Result<Fp8Scales, ModelError> {
    if values.len() == 1 && shape.iter().all(|&d| d == 1) {
        return Ok(Fp8Scales::PerTensor(values[0]));
    }
    if shape == [out] || shape == [out, 1] {
        return Ok(Fp8Scales::PerChannel(values));
    }
    if let Some(b) = block
        && shape == [out.div_ceil(b[0]), inp.div_ceil(b[1])]
    {
        return Ok(Fp8Scales::Block { block: b, scales: values });
    }
    let mut expected = format!("[] or [1] per tensor, [{out}] or [{out}, 1] per channel");
    match block {
        Some(b) => {
            expected += &format!(", [{}, {}] per {}x{} block", out.div_ceil(b[0]), inp.div_ceil(b[1]), b[0], b[1])
        }
        None if shape.len() == 2 => expected += "; block scales need quantization_config.weight_block_size",
        None => {}
    }
    Err(ModelError::ScaleShape { name: name.to_owned(), actual: shape.to_vec(), weight: vec![out, inp], expected })
}
