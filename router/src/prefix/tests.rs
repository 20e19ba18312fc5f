use super::*;
use prism_common::proto::v1::{ChatMessage as PbChat, ChatMessages, TokenIds};
use prism_engine::codec::CodecExport;
use prism_engine::model::TokenizerExport;

/// A word-level tokenizer over a few words (ids in the order below).
pub(crate) fn tiny_codec() -> Arc<PromptCodec> {
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "c": 2, "[UNK]": 3}, "unk_token": "[UNK]"}
    });
    let export = CodecExport {
        tokenizer: TokenizerExport { json: json.to_string(), add_bos: false, bos_id: None },
        chat_template: None,
        chat_content_special_tokens: false,
    };
    Arc::new(PromptCodec::from_export(&export).expect("tiny tokenizer builds"))
}

fn codec(fingerprint: u64, block_size: u32) -> Arc<ReplicaCodec> {
    Arc::new(ReplicaCodec { key: HashKey { fingerprint, block_size, namespace: 7 }, codec: tiny_codec() })
}

fn text(t: &str) -> GenerateRequest {
    GenerateRequest { prompt: Some(generate_request::Prompt::Text(t.into())), ..Default::default() }
}

#[tokio::test]
async fn text_is_tokenized_once_per_fingerprint_and_hashed_per_key() {
    let (a4, a2, b4) = (codec(1, 4), codec(1, 2), codec(2, 4));
    let req = text("a b c a b c a b c");
    let keys = prompt_keys(&req, vec![a4.clone(), a2.clone(), b4.clone(), a4.clone()]).await.expect("keys");
    let k4 = keys.get(&a4.key).expect("codec a, blocks of 4");
    assert_eq!(k4.ids, vec![0, 1, 2, 0, 1, 2, 0, 1, 2]);
    assert_eq!(k4.hashes, block_hashes(7, None, &k4.ids, 4), "the engine's hash function");
    assert_eq!(k4.hashes.len(), 2, "the partial last block has no hash");
    assert_eq!(keys.get(&a2.key).map(|k| k.hashes.len()), Some(4));
    assert!(keys.get(&b4.key).is_some());
    assert_eq!(keys.ids_for(1), Some(&k4.ids[..]), "tokenized text: ids are forwarded");
    assert_eq!(keys.ids_for(9), None, "no codec of that fingerprint");
    assert_eq!(keys.prompt_tokens(), Some(9));
    // The salt starts another chain.
    let salted = GenerateRequest { cache_salt: Some("tenant".into()), ..req };
    let ks = prompt_keys(&salted, vec![a4.clone()]).await.expect("keys");
    assert_eq!(ks.get(&a4.key).map(|k| k.hashes.clone()), Some(block_hashes(7, Some("tenant"), &k4.ids, 4)));
    assert_ne!(ks.get(&a4.key).map(|k| k.hashes[0]), Some(k4.hashes[0]));
}

#[tokio::test]
async fn ids_are_hashed_not_forwarded_and_failures_route_by_load() {
    let a4 = codec(1, 4);
    let ids = GenerateRequest {
        prompt: Some(generate_request::Prompt::TokenIds(TokenIds { ids: (0..8).collect() })),
        ..Default::default()
    };
    let keys = prompt_keys(&ids, vec![a4.clone()]).await.expect("keys");
    assert_eq!(keys.get(&a4.key).map(|k| k.hashes.len()), Some(2));
    assert_eq!(keys.ids_for(1), None, "the worker has the ids already");
    // No chat template: the codec gives nothing and the replica reports the error itself.
    let chat = GenerateRequest {
        prompt: Some(generate_request::Prompt::Chat(ChatMessages {
            messages: vec![PbChat { role: "user".into(), content: "a".into(), ..Default::default() }],
        })),
        ..Default::default()
    };
    let keys = prompt_keys(&chat, vec![a4.clone()]).await.expect("keys");
    assert!(keys.get(&a4.key).is_none());
    assert!(prompt_keys(&GenerateRequest::default(), vec![a4]).await.is_none(), "no prompt");
    assert!(prompt_keys(&text("a"), vec![]).await.is_none(), "no codec");
}

#[test]
fn replica_cache_matches_through_its_codec() {
    let cache = ReplicaCache::default();
    let a4 = codec(1, 4);
    let ids: Vec<u32> = (0..12).collect();
    let hashes = block_hashes(7, None, &ids, 4);
    let keys = PrefixKeys::new(vec![CodecKeys { key: a4.key, ids, hashes: hashes.clone() }], true);
    let now = Instant::now();
    assert!(cache.matched_blocks(&keys, now).is_none(), "no codec yet: load alone");
    cache.set_codec(Some(a4));
    assert_eq!(cache.matched_blocks(&keys, now).map(|(n, _)| n), Some(0));
    cache.index().reset(&hashes[..2]);
    assert_eq!(cache.matched_blocks(&keys, now).map(|(n, _)| n), Some(2));
    cache.set_codec(Some(codec(2, 4)));
    assert!(cache.matched_blocks(&keys, now).is_none(), "another codec: the request has no hashes for it");
}

/// The router tokenizes as the engine does, for the bundled model's real tokenizer, and a
/// 1,000-token prompt takes well under the time of a prefill (printed: the cost per request).
#[test]
fn real_tokenizer_matches_the_engine_and_is_fast() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        return;
    }
    let file = prism_engine::model::gguf::GgufFile::open(&path).expect("gguf");
    let tok = prism_engine::model::tokenizer::Tokenizer::from_gguf(&file).expect("tokenizer");
    let export = CodecExport {
        tokenizer: tok.export().expect("export"),
        chat_template: None,
        chat_content_special_tokens: false,
    };
    let json = export.to_json().expect("json");
    let started = std::time::Instant::now();
    let codec = PromptCodec::from_export(&CodecExport::from_json(&json).expect("parse")).expect("build");
    let build = started.elapsed();
    let sentence = "The quick brown fox jumps over the lazy dog while the router counts blocks. ";
    let prompt = Prompt::Text(sentence.repeat(70));
    let ids = codec.prompt_ids(&prompt).expect("ids");
    let Prompt::Text(t) = &prompt else { unreachable!() };
    assert_eq!(ids, tok.encode(t, true).expect("engine ids"), "the replica's own ids");
    assert!(ids.len() >= 1000, "{} tokens", ids.len());
    let rounds = 20u32;
    let started = std::time::Instant::now();
    for _ in 0..rounds {
        let k = keys_blocking(
            &prompt,
            ChatVars::default(),
            None,
            &[Arc::new(ReplicaCodec {
                key: HashKey { fingerprint: 1, block_size: 16, namespace: 0 },
                codec: Arc::new(PromptCodec::from_export(&export).expect("build")),
            })],
        );
        assert_eq!(k.prompt_tokens(), Some(ids.len() as u64));
    }
    let per_build_and_tokenize = started.elapsed() / rounds;
    let started = std::time::Instant::now();
    for _ in 0..rounds {
        let _ = codec.prompt_ids(&prompt).expect("ids");
    }
    let per = started.elapsed() / rounds;
    println!(
        "codec build (json {} KB) {build:?}; {} tokens: tokenize {per:?} per prompt (build + tokenize + hash {per_build_and_tokenize:?})",
        json.len() / 1024,
        ids.len()
    );
    assert!(per < std::time::Duration::from_millis(200), "tokenizing 1,000 tokens took {per:?}");
}
