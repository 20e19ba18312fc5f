//! The chat encoding's general path (escape, render, split at the template's special tokens,
//! encode the pieces as plain text) against the one-call encoding of the rendered template,
//! on the bundled GGUF (byte-level BPE), the hf-tiny checkpoint and a Metaspace tokenizer.

use std::path::PathBuf;

use super::chat::{MessageSpans, encode_split};
use super::{ModelCodec, TextCodec};
use crate::model::gguf::{GgufFile, GgufValue};
use crate::model::tokenizer::{LazyPlainText, encode_with};
use crate::model::{ChatTemplate, Tokenizer};
use crate::request::ChatMessage;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn smollm() -> anyhow::Result<Option<ModelCodec>> {
    let path = repo_root().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        anyhow::ensure!(std::env::var_os("PRISM_REQUIRE_MODEL").is_none(), "{} is missing", path.display());
        eprintln!("SKIPPED: {} not found (run scripts/fetch-model.sh)", path.display());
        return Ok(None);
    }
    let file = GgufFile::open(&path)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let src = file.get("tokenizer.chat_template").and_then(GgufValue::as_str).unwrap_or_default();
    let chat_template = Some(ChatTemplate::new(src, tokenizer.bos_text(), tokenizer.eos_text())?);
    Ok(Some(ModelCodec { tokenizer, chat_template }))
}

fn hf_tiny() -> anyhow::Result<ModelCodec> {
    let dir = repo_root().join("tests/fixtures/hf-tiny");
    let tokenizer = Tokenizer::from_hf_dir(&dir, None, &[])?;
    let cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json"))?)?;
    let src = cfg["chat_template"].as_str().unwrap_or_default();
    let chat_template = Some(ChatTemplate::new(src, tokenizer.bos_text(), tokenizer.eos_text())?);
    Ok(ModelCodec { tokenizer, chat_template })
}

fn msg(role: &str, content: &str) -> ChatMessage {
    ChatMessage { role: role.into(), content: content.into(), ..Default::default() }
}

/// Chats with nothing special in their text, with the spots where splitting could change
/// ids: text right after and before the template's tokens, leading newlines and spaces
/// (pre-tokenizer runs), empty content, non-ASCII, digits, several turns.
fn ordinary_chats() -> Vec<Vec<ChatMessage>> {
    vec![
        vec![msg("user", "What is the tallest mountain?")],
        vec![msg("system", "You are terse."), msg("user", "Name three primes. 😀 ünïcödé")],
        vec![msg("user", "\n\n  leading newlines and spaces  \n\n")],
        vec![msg("user", " x"), msg("assistant", ""), msg("user", "12345678 and 3.14159")],
        vec![msg("user", "<|im_end"), msg("assistant", "im_start|> | <| |> <b>tags</b>"), msg("user", "ok")],
        vec![msg("system", "\t"), msg("user", "tabs\tand\r\nCRLF"), msg("assistant", "Sure."), msg("user", "again")],
    ]
}

fn no_spans(messages: &[ChatMessage]) -> Vec<MessageSpans> {
    messages.iter().map(|_| MessageSpans { role: Vec::new(), content: Vec::new() }).collect()
}

/// For each chat: the one-call ids (today's rule), the ids of `encode_chat`, and the general
/// path's ids all agree.
fn assert_split_path_is_exact(codec: &ModelCodec) -> anyhow::Result<()> {
    let template = codec.chat_template.as_ref().expect("template");
    let inner = codec.tokenizer.inner();
    let plain = LazyPlainText::default();
    for chat in ordinary_chats() {
        let one_call = encode_with(inner, false, None, &template.render(&chat, true)?, false)?;
        assert_eq!(codec.encode_chat(&chat, false)?, one_call, "{chat:?}");
        let split = encode_split(inner, plain.get(inner)?, template, &chat, Default::default(), &no_spans(&chat))?;
        assert_eq!(split, one_call, "{chat:?}");
    }
    Ok(())
}

#[test]
fn the_split_path_equals_the_one_call_encoding_on_smollm() -> anyhow::Result<()> {
    let Some(codec) = smollm()? else { return Ok(()) };
    assert_split_path_is_exact(&codec)
}

#[test]
fn the_split_path_equals_the_one_call_encoding_on_hf_tiny() -> anyhow::Result<()> {
    let codec = hf_tiny()?;
    assert_split_path_is_exact(&codec)?;
    // And special-token text in a message is plain text there too.
    let chat = [msg("user", "a<|im_end|>b")];
    let ids = codec.encode_chat(&chat, false)?;
    let end = codec.tokenizer.inner().token_to_id("<|im_end|>").expect("im_end");
    assert_eq!(ids.iter().filter(|&&i| i == end).count(), 1, "only the template's <|im_end|>: {ids:?}");
    assert_eq!(codec.encode_chat(&chat, true)?.iter().filter(|&&i| i == end).count(), 2);
    Ok(())
}

/// A Metaspace pre-tokenizer with `prepend_scheme: first` adds `▁` only at the start of the
/// input: a piece after a special token must be encoded as where it sits, not as a new input.
#[test]
fn pieces_after_a_special_token_are_not_encoded_as_the_start_of_the_input() -> anyhow::Result<()> {
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [{"id": 4, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false,
                          "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": true},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "\u{2581}hi": 1, "hi": 2, "\u{2581}there": 3, "<s>": 4,
                  "<": 5, "s": 6, ">": 7}, "unk_token": "[UNK]"}
    });
    let inner = tokenizers::Tokenizer::from_bytes(json.to_string().as_bytes()).map_err(anyhow::Error::msg)?;
    assert_eq!(inner.encode("hi there", false).map_err(anyhow::Error::msg)?.get_ids(), [1, 3]);
    assert_eq!(inner.encode("<s>hi there", false).map_err(anyhow::Error::msg)?.get_ids(), [4, 2, 3]);
    let lazy = LazyPlainText::default();
    let plain = lazy.get(&inner)?;
    assert_eq!(plain.encode("hi there", false)?, [1, 3]);
    assert_eq!(plain.encode("hi there", true)?, [2, 3]);
    let template = ChatTemplate::new("{% for m in messages %}<s>{{ m.content }}{% endfor %}", "<s>".into(), "".into())?;
    let chat = [msg("user", "hi there"), msg("user", "hi")];
    let one_call = encode_with(&inner, false, None, &template.render(&chat, true)?, false)?;
    assert_eq!(one_call, [4, 2, 3, 4, 2]);
    assert_eq!(encode_split(&inner, plain, &template, &chat, Default::default(), &no_spans(&chat))?, one_call);
    Ok(())
}
