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
