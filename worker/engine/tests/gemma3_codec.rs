//! Gemma 3 270M's tokenizer and chat template (`models/gemma-3-270m-q4_k_m.gguf`, fetched by
//! `scripts/fetch-gemma.sh`) against `tests/fixtures/gemma3_reference.json`, written by
//! `tests/reference/gemma_reference.py`:
//! - token ids equal llama.cpp's (llama-cpp-python) for varied strings, with special-token
//!   parsing on and off, with and without BOS, through the engine's tokenizer and through the
//!   router's copy of it (`PromptCodec` from the exported codec);
//! - the chat template (the file has none; the `gemma3` one Prism falls back to) renders as
//!   jinja2 renders it, rejects what jinja2 rejects, and chat prompts encode to llama.cpp's ids.
//!
//! Only the GGUF metadata is read (no weights). Skipped (with a notice) when the file is
//! missing, unless `PRISM_REQUIRE_MODEL` is set.

use std::path::PathBuf;

use anyhow::{Context, Result, bail, ensure};
use prism_engine::codec::{ModelCodec, PromptCodec, TextCodec};
use prism_engine::model::chat_template::builtin_source;
use prism_engine::model::gguf::{GgufFile, GgufValue};
use prism_engine::model::{ChatTemplate, Tokenizer};
use prism_engine::{ChatMessage, EngineError, Prompt};
use serde_json::Value;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn gemma() -> Result<Option<GgufFile>> {
    let path = repo_root().join("models/gemma-3-270m-q4_k_m.gguf");
    if !path.exists() {
        if std::env::var_os("PRISM_REQUIRE_MODEL").is_some() {
            bail!("{} is missing and PRISM_REQUIRE_MODEL is set (run scripts/fetch-gemma.sh)", path.display());
        }
        eprintln!("SKIPPED: {} not found (run scripts/fetch-gemma.sh)", path.display());
        return Ok(None);
    }
    Ok(Some(GgufFile::open(&path)?))
}

fn fixture() -> Result<Value> {
    let p = repo_root().join("tests/fixtures/gemma3_reference.json");
    Ok(serde_json::from_str(&std::fs::read_to_string(&p).with_context(|| p.display().to_string())?)?)
}

fn ids(v: &Value) -> Result<Vec<u32>> {
    v.as_array().context("not an array")?.iter().map(|x| x.as_u64().map(|x| x as u32).context("not an id")).collect()
}

fn messages(v: &Value) -> Result<Vec<ChatMessage>> {
    let arr = v.as_array().context("messages")?;
    arr.iter()
        .map(|m| {
            let field = |k: &str| m[k].as_str().map(str::to_owned).with_context(|| format!("message {k}"));
            Ok(ChatMessage { role: field("role")?, content: field("content")?, ..Default::default() })
        })
        .collect()
}

/// The codec the GGUF loader builds: the file's tokenizer and its template or the builtin.
fn codec(file: &GgufFile) -> Result<ModelCodec> {
    let tokenizer = Tokenizer::from_gguf(file)?;
    let arch = file.get("general.architecture").and_then(GgufValue::as_str).context("architecture")?;
    ensure!(arch == "gemma3", "architecture {arch}");
    ensure!(file.get("tokenizer.chat_template").is_none(), "the file now has a template: test it instead");
    let src = builtin_source(arch).context("no builtin gemma3 template")?;
    let chat_template = Some(ChatTemplate::new(src, tokenizer.bos_text(), tokenizer.eos_text())?);
    Ok(ModelCodec { tokenizer, chat_template })
}

#[test]
fn tokenizer_ids_equal_llama_cpp() -> Result<()> {
    let Some(file) = gemma()? else { return Ok(()) };
    let fx = fixture()?;
    let codec = codec(&file)?;
    let tok = &codec.tokenizer;
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos_id(), Some(fx["bos_id"].as_u64().context("bos_id")? as u32));
    assert_eq!(tok.bos_text(), "<bos>");
    // <eos> from its id key, <end_of_turn> by its text (llama.cpp's end-of-generation set).
    assert_eq!(tok.eos_ids(), &[1, 106]);
    assert!(tok.is_special(106) && tok.token_str(106) == "<end_of_turn>");
    let mut plain = tok.inner().clone();
    plain.set_encode_special_tokens(true);
    let router = PromptCodec::from_export(&codec.export().context("export")?)?;
    let cases = fx["tokenizer"].as_array().context("tokenizer cases")?;
    ensure!(cases.len() >= 20, "fixture has {} tokenizer cases", cases.len());
    for case in cases {
        let text = case["text"].as_str().context("text")?;
        let want = ids(&case["ids"])?;
        assert_eq!(tok.encode(text, false)?, want, "ids of {text:?}");
        assert_eq!(tok.encode(text, true)?, ids(&case["ids_bos"])?, "ids with BOS of {text:?}");
        let got_plain = plain.encode(text, false).map_err(|e| anyhow::anyhow!("{e}"))?;
        assert_eq!(got_plain.get_ids(), ids(&case["ids_plain"])?, "ids of {text:?}, special tokens as text");
        assert_eq!(router.prompt_ids(&Prompt::Text(text.to_owned()))?, ids(&case["ids_bos"])?, "router: {text:?}");
        // Token bytes put the text back together (byte fallback loses nothing); a `▁` typed
        // in the text comes back as the space it stands for.
        assert_eq!(tok.decode(&want, false), text.replace('\u{2581}', " "), "decode of {text:?}");
    }
    Ok(())
}

#[test]
fn chat_template_renders_as_jinja2() -> Result<()> {
    let Some(file) = gemma()? else { return Ok(()) };
    let fx = fixture()?;
    let codec = codec(&file)?;
    let template = codec.chat_template.as_ref().context("template")?;
    let (_, bos, eos) = template.parts();
    assert_eq!((bos, eos), (fx["chat_template"]["bos_token"].as_str().unwrap_or(""), "<eos>"));
    let cases = fx["chat_template"]["cases"].as_array().context("template cases")?;
    let mut rejected = 0;
    for case in cases {
        let msgs = messages(&case["messages"])?;
        let agp = case["add_generation_prompt"].as_bool().context("add_generation_prompt")?;
        let got = template.render(&msgs, agp);
        match case["text"].as_str() {
            Some(want) => assert_eq!(got?, want, "{case}"),
            None => {
                let message = case["error"].as_str().context("neither text nor error")?;
                match got {
                    Err(EngineError::InvalidRequest { field: "messages", message: m }) => {
                        assert!(m.contains(message), "{m:?} does not carry jinja2's {message:?}");
                    }
                    other => panic!("{case}: expected the template to reject it, got {other:?}"),
                }
                rejected += 1;
            }
        }
    }
    assert_eq!(rejected, 2, "the fixture's two rejected conversations");
    let chats = fx["prompts"].as_array().context("prompts")?.iter().filter(|p| p["kind"] == "chat");
    let mut n = 0;
    for p in chats {
        let msgs = messages(&p["messages"])?;
        assert_eq!(codec.render_chat(&msgs)?, p["text"].as_str().context("text")?);
        assert_eq!(codec.encode_chat(&msgs, false)?, ids(&p["prompt_ids"])?, "chat ids of {}", p["text"]);
        n += 1;
    }
    assert_eq!(n, 2);
    Ok(())
}
