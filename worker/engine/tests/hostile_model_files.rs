//! Property harnesses over hostile model files and tokenizer input, seeded and bounded so
//! they run in CI on stable Rust: a tiny valid GGUF file and a tiny Hugging Face directory
//! are built here, then mutated and truncated at random; every load must end in `Ok` or a
//! `ModelError`, never a panic, an abort or an allocation the file does not justify. Random
//! Unicode and byte strings go through the bundled model's tokenizer (encode → decode gives
//! the text back). `PRISM_FUZZ_CASES=N` runs N cases per harness (default 300) and
//! `PRISM_FUZZ_SEED=S` changes the seed, for longer runs locally.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

use prism_engine::model::gguf::GgufFile;
use prism_engine::model::{ModelError, ModelSource, Tokenizer, load_model};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn cases() -> usize {
    std::env::var("PRISM_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300)
}

fn rng(harness: u64) -> (StdRng, u64) {
    let seed = std::env::var("PRISM_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0x5eed_0000) ^ harness;
    (StdRng::seed_from_u64(seed), seed)
}

fn bundled_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
}

// ---- a tiny GGUF writer ---------------------------------------------------------------------

enum Val {
    U32(u32),
    F32(f32),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_val(out: &mut Vec<u8>, v: &Val) {
    match v {
        Val::U32(x) => {
            out.extend_from_slice(&4u32.to_le_bytes());
            out.extend_from_slice(&x.to_le_bytes());
        }
        Val::F32(x) => {
            out.extend_from_slice(&6u32.to_le_bytes());
            out.extend_from_slice(&x.to_le_bytes());
        }
        Val::Str(s) => {
            out.extend_from_slice(&8u32.to_le_bytes());
            put_str(out, s);
        }
        Val::Strs(list) => {
            out.extend_from_slice(&9u32.to_le_bytes());
            out.extend_from_slice(&8u32.to_le_bytes());
            out.extend_from_slice(&(list.len() as u64).to_le_bytes());
            for s in list {
                put_str(out, s);
            }
        }
        Val::I32s(list) => {
            out.extend_from_slice(&9u32.to_le_bytes());
            out.extend_from_slice(&5u32.to_le_bytes());
            out.extend_from_slice(&(list.len() as u64).to_le_bytes());
            for x in list {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
    }
}

/// GPT-2's byte → printable character table (the tokens of a byte-level BPE vocabulary).
fn byte_chars() -> Vec<String> {
    let direct: Vec<u32> = (33..=126).chain(161..=172).chain(174..=255).collect();
    let mut out = vec![String::new(); 256];
    let mut extra = 0;
    for b in 0..256u32 {
        let c = if direct.contains(&b) {
            b
        } else {
            extra += 1;
            255 + extra
        };
        out[b as usize] = char::from_u32(c).map(String::from).unwrap_or_default();
    }
    out
}

const HIDDEN: usize = 32;
const HEADS: usize = 2;
const KV_HEADS: usize = 1;
const HEAD_DIM: usize = HIDDEN / HEADS;
const FFN: usize = 32;
const VOCAB: usize = 259;

/// A valid one-layer llama GGUF (f32 tensors, byte-level tokenizer); returns the bytes and
/// where the header (metadata and tensor infos) ends.
fn tiny_gguf() -> (Vec<u8>, usize) {
    let mut tokens = byte_chars();
    tokens.extend(["Ġt".into(), "he".into(), "<|endoftext|>".into()]);
    let mut types = vec![1i32; 258];
    types.push(3);
    let kv: Vec<(&str, Val)> = vec![
        ("general.architecture", Val::Str("llama".into())),
        ("llama.embedding_length", Val::U32(HIDDEN as u32)),
        ("llama.feed_forward_length", Val::U32(FFN as u32)),
        ("llama.attention.head_count", Val::U32(HEADS as u32)),
        ("llama.attention.head_count_kv", Val::U32(KV_HEADS as u32)),
        ("llama.block_count", Val::U32(1)),
        ("llama.context_length", Val::U32(128)),
        ("llama.attention.layer_norm_rms_epsilon", Val::F32(1e-5)),
        ("tokenizer.ggml.model", Val::Str("gpt2".into())),
        ("tokenizer.ggml.tokens", Val::Strs(tokens)),
        ("tokenizer.ggml.token_type", Val::I32s(types)),
        ("tokenizer.ggml.merges", Val::Strs(vec!["Ġ t".into(), "h e".into()])),
        ("tokenizer.ggml.eos_token_id", Val::U32(258)),
        ("tokenizer.chat_template", Val::Str("{% for m in messages %}{{ m.content }}{% endfor %}".into())),
    ];
    let kvd = KV_HEADS * HEAD_DIM;
    let tensors: Vec<(&str, Vec<u64>)> = vec![
        ("token_embd.weight", vec![HIDDEN as u64, VOCAB as u64]),
        ("output_norm.weight", vec![HIDDEN as u64]),
        ("blk.0.attn_norm.weight", vec![HIDDEN as u64]),
        ("blk.0.attn_q.weight", vec![HIDDEN as u64, HIDDEN as u64]),
        ("blk.0.attn_k.weight", vec![HIDDEN as u64, kvd as u64]),
        ("blk.0.attn_v.weight", vec![HIDDEN as u64, kvd as u64]),
        ("blk.0.attn_output.weight", vec![HIDDEN as u64, HIDDEN as u64]),
        ("blk.0.ffn_norm.weight", vec![HIDDEN as u64]),
        ("blk.0.ffn_gate.weight", vec![HIDDEN as u64, FFN as u64]),
        ("blk.0.ffn_up.weight", vec![HIDDEN as u64, FFN as u64]),
        ("blk.0.ffn_down.weight", vec![FFN as u64, HIDDEN as u64]),
    ];
    let mut out = b"GGUF".to_vec();
    out.extend_from_slice(&3u32.to_le_bytes());
    out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    out.extend_from_slice(&(kv.len() as u64).to_le_bytes());
    for (k, v) in &kv {
        put_str(&mut out, k);
        put_val(&mut out, v);
    }
    let mut offset = 0u64;
    for (name, dims) in &tensors {
        put_str(&mut out, name);
        out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            out.extend_from_slice(&d.to_le_bytes());
        }
        out.extend_from_slice(&0u32.to_le_bytes()); // F32
        out.extend_from_slice(&offset.to_le_bytes());
        offset += dims.iter().product::<u64>() * 4;
        offset = offset.div_ceil(32) * 32;
    }
    let header_end = out.len();
    while !out.len().is_multiple_of(32) {
        out.push(0);
    }
    let data_start = out.len();
    out.resize(data_start + offset as usize, 0);
    for (i, b) in out[data_start..].chunks_exact_mut(4).enumerate() {
        b.copy_from_slice(&(((i % 17) as f32 - 8.0) / 64.0).to_le_bytes());
    }
    (out, header_end)
}

/// One random mutation of `bytes`, mostly inside `[0, hot)`: flipped bytes, a u64 field
/// overwritten with a huge count or length, a cut, a spliced range.
fn mutate(rng: &mut StdRng, bytes: &mut Vec<u8>, hot: usize) {
    const HUGE: [u64; 6] = [1 << 40, 1 << 60, u64::MAX, u32::MAX as u64, 1 << 31, 0];
    for _ in 0..rng.random_range(1..4) {
        if bytes.is_empty() {
            return;
        }
        let hot = hot.clamp(1, bytes.len());
        let at = if rng.random_bool(0.85) { rng.random_range(0..hot) } else { rng.random_range(0..bytes.len()) };
        match rng.random_range(0..5) {
            0 => bytes[at] = rng.random(),
            1 => bytes[at] ^= 1 << rng.random_range(0..8),
            2 if at + 8 <= bytes.len() => {
                bytes[at..at + 8].copy_from_slice(&HUGE[rng.random_range(0..HUGE.len())].to_le_bytes())
            }
            3 => bytes.truncate(at),
            _ => {
                let len = rng.random_range(0..16).min(bytes.len() - at);
                let copy = bytes[at..at + len].to_vec();
                let to = rng.random_range(0..bytes.len());
                let end = (to + len).min(bytes.len());
                bytes[to..end].copy_from_slice(&copy[..end - to]);
            }
        }
    }
}

/// Loads `source`, turning a panic into a test failure that names the case.
fn load_no_panic(source: &ModelSource, what: &str) -> Result<(), ModelError> {
    match catch_unwind(AssertUnwindSafe(|| load_model(source, None))) {
        Ok(r) => r.map(drop),
        Err(_) => panic!("{what}: the loader panicked"),
    }
}

#[test]
fn tiny_gguf_loads_and_every_mutation_or_truncation_is_ok_or_a_model_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("m.gguf");
    let (good, header_end) = tiny_gguf();
    std::fs::write(&path, &good).expect("write");
    let m = load_model(&ModelSource::Gguf(path.clone()), None).expect("the unmutated file loads");
    assert_eq!((m.config.hidden_size, m.config.num_hidden_layers, m.config.vocab_size), (HIDDEN, 1, VOCAB));
    let (mut rng, seed) = rng(1);
    let (mut ok, mut err) = (0, 0);
    for case in 0..cases() {
        let mut bytes = good.clone();
        mutate(&mut rng, &mut bytes, header_end);
        std::fs::write(&path, &bytes).expect("write");
        match load_no_panic(&ModelSource::Gguf(path.clone()), &format!("seed {seed} case {case}")) {
            Ok(()) => ok += 1,
            Err(_) => err += 1,
        }
    }
    // The harness must reach past the header checks, and most mutations must be caught.
    assert!(err > 0, "no mutation was refused ({ok} loaded)");
    eprintln!("gguf: {ok} loaded, {err} refused");
}

#[test]
fn hostile_gguf_headers_are_refused_before_allocating() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("m.gguf");
    let head = |n_tensors: u64, n_kv: u64| {
        let mut b = b"GGUF".to_vec();
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&n_tensors.to_le_bytes());
        b.extend_from_slice(&n_kv.to_le_bytes());
        b
    };
    let mut cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("2^40 tensors", head(1 << 40, 0), "tensor count"),
        ("2^40 metadata pairs", head(0, 1 << 40), "metadata count"),
    ];
    let mut long_key = head(0, 1);
    long_key.extend_from_slice(&(1u64 << 60).to_le_bytes());
    cases.push(("a key of length 2^60", long_key, "string length"));
    let mut long_array = head(0, 1);
    put_str(&mut long_array, "tokenizer.ggml.tokens");
    long_array.extend_from_slice(&9u32.to_le_bytes());
    long_array.extend_from_slice(&8u32.to_le_bytes());
    long_array.extend_from_slice(&(1u64 << 40).to_le_bytes());
    cases.push(("an array of 2^40 strings", long_array, "array length"));
    // A tensor of 2^20 x 2^20 x 2^20 x 2^20 elements (the product overflows u64) and one
    // whose data lies past the end of the file.
    for (label, dims) in [("overflowing dims", vec![1u64 << 20; 4]), ("data past the end", vec![1 << 20, 1 << 10])] {
        let mut t = head(1, 0);
        put_str(&mut t, "token_embd.weight");
        t.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in &dims {
            t.extend_from_slice(&d.to_le_bytes());
        }
        t.extend_from_slice(&0u32.to_le_bytes());
        t.extend_from_slice(&0u64.to_le_bytes());
        t.resize(t.len() + 64, 0);
        cases.push((label, t, "token_embd.weight"));
    }
    // Room for what each header claims to follow, so the claim itself is what is refused.
    for (_, bytes, _) in &mut cases {
        bytes.resize(bytes.len() + 256, 0);
    }
    let (mut good, _) = tiny_gguf();
    let mut bad_align = good.clone();
    // general.alignment = 3 (not a power of two) appended as one more pair.
    let n_kv = u64::from_le_bytes(bad_align[16..24].try_into().expect("8 bytes")) + 1;
    bad_align[16..24].copy_from_slice(&n_kv.to_le_bytes());
    let mut pair = Vec::new();
    put_str(&mut pair, "general.alignment");
    put_val(&mut pair, &Val::U32(3));
    bad_align.splice(24..24, pair);
    cases.push(("alignment 3", bad_align, "alignment"));
    good.truncate(good.len() - 100);
    cases.push(("the last tensor cut short", good, "blk.0.ffn_down.weight"));
    for (label, bytes, needle) in cases {
        std::fs::write(&path, &bytes).expect("write");
        let e = load_no_panic(&ModelSource::Gguf(path.clone()), label).expect_err(label).to_string();
        assert!(e.contains(needle) && e.contains("m.gguf"), "{label}: {e}");
    }
}

// ---- Hugging Face directories ---------------------------------------------------------------

fn tokenizer_json() -> String {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("m.gguf");
    std::fs::write(&path, tiny_gguf().0).expect("write");
    let file = GgufFile::open(&path).expect("tiny gguf");
    Tokenizer::from_gguf(&file).expect("tokenizer").export().expect("export").json
}

fn config_json() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN, "intermediate_size": FFN,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1,
        "vocab_size": VOCAB, "max_position_embeddings": 128, "tie_word_embeddings": true, "eos_token_id": 258
    })
}

/// `model.safetensors` of the tiny model (f32), and where its JSON header ends.
fn tiny_safetensors() -> (Vec<u8>, usize) {
    let kvd = KV_HEADS * HEAD_DIM;
    let mut tensors = vec![
        ("model.embed_tokens.weight".to_owned(), vec![VOCAB, HIDDEN]),
        ("model.norm.weight".to_owned(), vec![HIDDEN]),
    ];
    for (n, shape) in [
        ("input_layernorm", vec![HIDDEN]),
        ("post_attention_layernorm", vec![HIDDEN]),
        ("self_attn.q_proj", vec![HIDDEN, HIDDEN]),
        ("self_attn.k_proj", vec![kvd, HIDDEN]),
        ("self_attn.v_proj", vec![kvd, HIDDEN]),
        ("self_attn.o_proj", vec![HIDDEN, HIDDEN]),
        ("mlp.gate_proj", vec![FFN, HIDDEN]),
        ("mlp.up_proj", vec![FFN, HIDDEN]),
        ("mlp.down_proj", vec![HIDDEN, FFN]),
    ] {
        tensors.push((format!("model.layers.0.{n}.weight"), shape));
    }
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, shape) in &tensors {
        let start = data.len();
        let n: usize = shape.iter().product();
        data.extend((0..n).flat_map(|i| (((i % 13) as f32 - 6.0) / 32.0).to_le_bytes()));
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [start, data.len()]}),
        );
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).expect("json");
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    let header_end = out.len();
    out.extend_from_slice(&data);
    (out, header_end)
}

fn write_hf_dir(dir: &Path, config: &[u8], tokenizer: &[u8], weights: &[u8]) {
    std::fs::write(dir.join("config.json"), config).expect("write");
    std::fs::write(dir.join("tokenizer.json"), tokenizer).expect("write");
    std::fs::write(dir.join("model.safetensors"), weights).expect("write");
}

#[test]
fn tiny_hf_dir_loads_and_mutated_safetensors_config_and_tokenizer_files_are_errors() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (weights, header_end) = tiny_safetensors();
    let tok = tokenizer_json();
    let cfg = serde_json::to_vec(&config_json()).expect("json");
    write_hf_dir(dir.path(), &cfg, tok.as_bytes(), &weights);
    let src = ModelSource::HfDir(dir.path().to_path_buf());
    let m = load_model(&src, None).expect("the unmutated directory loads");
    assert_eq!((m.config.hidden_size, m.config.vocab_size), (HIDDEN, VOCAB));
    let (mut rng, seed) = rng(2);
    let n = cases();
    for case in 0..n {
        let (mut c, mut t, mut w) = (cfg.clone(), tok.clone().into_bytes(), weights.clone());
        // Mostly the safetensors header; a third of the cases hit config.json or tokenizer.json.
        match case % 6 {
            0 => mutate(&mut rng, &mut c, usize::MAX),
            1 => mutate(&mut rng, &mut t, usize::MAX),
            _ => mutate(&mut rng, &mut w, header_end),
        }
        write_hf_dir(dir.path(), &c, &t, &w);
        // Either outcome is fine; a panic or an abort is not.
        let _ = load_no_panic(&src, &format!("seed {seed} case {case}"));
    }
}

#[test]
fn absurd_config_sizes_and_bad_headers_are_errors_naming_the_problem() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (weights, _) = tiny_safetensors();
    let tok = tokenizer_json();
    let src = ModelSource::HfDir(dir.path().to_path_buf());
    for (field, value) in [
        ("hidden_size", serde_json::json!(1u64 << 40)),
        ("num_hidden_layers", serde_json::json!(1_000_000_000u64)),
        ("intermediate_size", serde_json::json!(1u64 << 40)),
        ("vocab_size", serde_json::json!(1u64 << 40)),
        ("max_position_embeddings", serde_json::json!(u64::MAX)),
        ("head_dim", serde_json::json!(1u64 << 40)),
    ] {
        let mut cfg = config_json();
        cfg[field] = value;
        write_hf_dir(dir.path(), &serde_json::to_vec(&cfg).expect("json"), tok.as_bytes(), &weights);
        let e = load_no_panic(&src, field).expect_err(field).to_string();
        assert!(e.contains(field) && e.contains("config.json"), "{field}: {e}");
    }
    let cfg = serde_json::to_vec(&config_json()).expect("json");
    let mut long_header = weights.clone();
    long_header[..8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let mut short_header = weights.clone();
    short_header[..8].copy_from_slice(&(weights.len() as u64).to_le_bytes());
    let mut cut = weights.clone();
    cut.truncate(weights.len() - 4);
    for (label, w) in [("header length 2^60", long_header), ("header past the end", short_header), ("cut", cut)] {
        write_hf_dir(dir.path(), &cfg, tok.as_bytes(), &w);
        let e = load_no_panic(&src, label).expect_err(label).to_string();
        assert!(e.contains("model.safetensors"), "{label}: {e}");
    }
    // Broken JSON inside the decoder object made the tokenizers crate panic (an `expect` in
    // its decoder deserializer): found by the harness above, now a clean error.
    assert!(tok.contains("\"decoder\":{"), "the exported tokenizer has a decoder object");
    let decoder_panic = tok.replacen("\"decoder\":{", "\"decoder\":{\"type\":nul,", 1);
    for (label, t) in [
        ("not JSON", "{\"model\": "),
        ("wrong shape", "{\"model\": 3}"),
        ("empty", ""),
        ("broken decoder", decoder_panic.as_str()),
    ] {
        write_hf_dir(dir.path(), &cfg, t.as_bytes(), &weights);
        let e = load_no_panic(&src, label).expect_err(label).to_string();
        assert!(e.contains("tokenizer.json"), "{label}: {e}");
        assert_eq!(e.contains("tokenizer parser failed"), label == "broken decoder", "{label}: {e}");
    }
}

// ---- tokenizer input ------------------------------------------------------------------------

/// Random text; `wild` adds any `char` and lossy random bytes (some of whose bytes the
/// model's vocabulary has no token for: those are dropped, so only tame text round-trips).
fn random_text(rng: &mut StdRng, wild: bool) -> String {
    const PIECES: [&str; 8] = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\u{FFFD}", "\r\n", " ", "é", "日本語"];
    let len = rng.random_range(0..48);
    let mut s = String::new();
    for _ in 0..len {
        match rng.random_range(0..if wild { 6 } else { 2 }) {
            0 => s.push_str(PIECES[rng.random_range(0..PIECES.len())]),
            1 => s.push(char::from(rng.random_range(b' '..b'~'))),
            2 => s.push(rng.random::<char>()),
            3 => s.push(char::from_u32(rng.random_range(0x300..0x3000)).unwrap_or(' ')),
            4 => {
                let bytes: Vec<u8> = (0..rng.random_range(1..6)).map(|_| rng.random()).collect();
                s.push_str(&String::from_utf8_lossy(&bytes));
            }
            _ => s.push_str("the"),
        }
    }
    s
}

#[test]
fn random_unicode_round_trips_through_the_bundled_tokenizer() {
    let file = GgufFile::open(&bundled_model()).expect("bundled model");
    let tok = Tokenizer::from_gguf(&file).expect("tokenizer");
    let (mut rng, seed) = rng(3);
    for case in 0..cases() * 3 {
        let wild = case % 2 == 0;
        let text = random_text(&mut rng, wild);
        let ids = tok.encode(&text, false).unwrap_or_else(|e| panic!("seed {seed} case {case} {text:?}: {e}"));
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()), "seed {seed} case {case}: {ids:?}");
        let back = tok.decode(&ids, false);
        if !wild {
            assert_eq!(back, text, "seed {seed} case {case}: ids {ids:?}");
        }
        // Random ids, some past the vocabulary, decode to something without panicking.
        let ids: Vec<u32> = (0..rng.random_range(0..16)).map(|_| rng.random_range(0..60_000)).collect();
        let _ = tok.decode(&ids, rng.random());
    }
}
