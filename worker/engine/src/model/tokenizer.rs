//! [`Tokenizer`]: the model's tokenizer behind the API the engine needs (encode, raw token
//! bytes for incremental detokenization, special tokens). Built on the `tokenizers` crate,
//! either from a Hugging Face `tokenizer.json` or programmatically from GGUF metadata
//! (`tokenizer.ggml.model == "gpt2"`: byte-level BPE with the pre-tokenizer llama.cpp picks
//! for `tokenizer.ggml.pre`; `"llama"`: SentencePiece BPE with byte fallback, see [`spm`];
//! control/user-defined tokens as added tokens), so that ids match llama.cpp's and
//! transformers' tokenizers.

use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::sync::OnceLock;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, OffsetReferential, OffsetType, SplitDelimiterBehavior};

use super::error::{ModelError, ResultExt};
use super::gguf::{GgufFile, GgufValue};
use crate::request::EngineError;

mod spm;

/// GGUF `token_type` values (llama.cpp `llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Control tokens that end a turn, which llama.cpp adds to its end-of-generation set by their
/// text when the file names no EOT id (`llama_vocab::impl::load`); `<|endoftext|>`, which
/// also separates documents, is left out.
const END_OF_TURN_TOKENS: [&str; 5] = ["<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<EOT>"];

/// llama.cpp's Llama 3 pre-tokenizer regex (`LLAMA_VOCAB_PRE_TYPE_LLAMA3`).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// llama.cpp's Qwen2 pre-tokenizer regex (`LLAMA_VOCAB_PRE_TYPE_QWEN2`).
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer with the per-token tables the engine's detokenizer and sampler need.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Prepend BOS ourselves (GGUF `add_bos_token`); HF tokenizers do it in their post-processor.
    add_bos: bool,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    /// Raw bytes of every token id (`0..vocab_size`).
    bytes: Vec<Vec<u8>>,
    special: Vec<bool>,
    /// The plain-text twin for chat message text, built on first use.
    plain: LazyPlainText,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.bytes.len())
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("add_bos", &self.add_bos)
            .finish()
    }
}

/// GPT-2's byte ↔ unicode table (`bytes_to_unicode` in openai/gpt-2 `encoder.py`): printable
/// bytes map to themselves, the other 68 to U+0100 upwards. Returns char → byte.
fn unicode_to_byte() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        let c = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap_or('\u{FFFD}')
        };
        map.insert(c, b);
    }
    map
}

fn byte_level_bytes(token: &str, table: &HashMap<char, u8>) -> Vec<u8> {
    let mut out = Vec::with_capacity(token.len());
    for c in token.chars() {
        match table.get(&c) {
            Some(&b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

/// A vocabulary's token text → the bytes it stands for (byte-level BPE or SentencePiece).
type TokenBytes<'a> = Box<dyn Fn(&str) -> Vec<u8> + 'a>;

/// SentencePiece-style token text → bytes (`▁` is a space, `<0xNN>` a raw byte).
fn metaspace_bytes(token: &str) -> Vec<u8> {
    if token.len() == 6
        && token.starts_with("<0x")
        && token.ends_with('>')
        && let Ok(b) = u8::from_str_radix(&token[3..5], 16)
    {
        return vec![b];
    }
    token.replace('\u{2581}', " ").into_bytes()
}

fn pre_tokenizer_for(pre: &str) -> Result<PreTokenizerWrapper, ModelError> {
    let byte_level = |use_regex| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |re: &str| -> Result<PreTokenizerWrapper, ModelError> {
        let s = Split::new(SplitPattern::Regex(re.to_owned()), SplitDelimiterBehavior::Isolated, false)?;
        Ok(PreTokenizerWrapper::Split(s))
    };
    Ok(match pre {
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ]))
        }
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "pixtral" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![split(LLAMA3_REGEX)?, byte_level(false)]))
        }
        "qwen2" | "deepseek-r1-qwen" => {
            PreTokenizerWrapper::Sequence(Sequence::new(vec![split(QWEN2_REGEX)?, byte_level(false)]))
        }
        "default" | "gpt-2" | "gpt2" | "phi-2" | "" => byte_level(true),
        other => {
            tracing::warn!(pre = other, "unknown GGUF pre-tokenizer; using GPT-2's");
            byte_level(true)
        }
    })
}

/// A tokenizer's encoding half, serializable: `tokenizer.json` and the BOS handling.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TokenizerExport {
    /// The `tokenizers` pipeline as `tokenizer.json`.
    pub json: String,
    /// Prepend `bos_id` when special tokens are added (GGUF `add_bos_token`).
    pub add_bos: bool,
    /// The BOS id.
    pub bos_id: Option<u32>,
}

/// Encodes `text` as [`Tokenizer::encode`] does (shared with [`crate::codec::PromptCodec`]).
pub(crate) fn encode_with(
    inner: &tokenizers::Tokenizer,
    add_bos: bool,
    bos_id: Option<u32>,
    text: &str,
    add_special_tokens: bool,
) -> Result<Vec<u32>, EngineError> {
    let enc = inner
        .encode(text, add_special_tokens && !add_bos)
        .map_err(|e| EngineError::Internal(format!("tokenizer: {e}")))?;
    let mut ids = Vec::with_capacity(enc.len() + 1);
    if add_special_tokens
        && add_bos
        && let Some(bos) = bos_id
    {
        ids.push(bos);
    }
    ids.extend_from_slice(enc.get_ids());
    Ok(ids)
}

/// Put before a piece of text that follows a special token, so that the tokenizer sees the
/// piece where it sits in the whole prompt rather than at the start of its input (a
/// Metaspace pre-tokenizer with `prepend_scheme: first` adds `▁` only at the start); its id
/// is dropped. Private-use characters: no model's vocabulary has this text.
const PIECE_MARKER: &str = "\u{E000}\u{F8FF}prism-piece\u{F8FF}\u{E000}";

/// Where `inner` finds special tokens in `text`, as its own encoder does (added-token
/// matching with `lstrip`/`rstrip`/`single_word` and matches on normalized text): each
/// match's byte range in `text` and its id, in order. Non-special added tokens are not
/// listed.
pub(crate) fn special_token_spans(inner: &tokenizers::Tokenizer, text: &str) -> Vec<(Range<usize>, u32)> {
    let vocab = inner.get_added_vocabulary();
    let pieces = vocab.extract_and_normalize(inner.get_normalizer(), text);
    pieces
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .filter_map(|(_, (start, end), tokens)| {
            let [token] = tokens.as_deref()? else { return None };
            let special = vocab.get_added_tokens_decoder().get(&token.id).is_some_and(|t| t.special);
            special.then_some((start..end, token.id))
        })
        .collect()
}

/// The tokenizer with special-token parsing off (the `tokenizers` crate's
/// `encode_special_tokens`, transformers' `split_special_tokens`): text such as `<|im_end|>`
/// becomes the ids of its characters. Non-special added tokens are still matched.
pub(crate) struct PlainText {
    inner: tokenizers::Tokenizer,
    marker: Option<u32>,
}

impl PlainText {
    fn new(tokenizer: &tokenizers::Tokenizer) -> Result<Self, ModelError> {
        let mut inner = tokenizer.clone();
        inner.set_encode_special_tokens(true);
        inner.add_tokens([AddedToken::from(PIECE_MARKER, false).normalized(false)])?;
        let marker = inner.token_to_id(PIECE_MARKER);
        Ok(Self { inner, marker })
    }

    /// Ids of `text` with special-token text read as plain text and nothing added (no BOS).
    /// `follows_token`: the text comes after a special token in the prompt (not at its start),
    /// which some pre-tokenizers treat differently.
    ///
    /// # Errors
    /// [`EngineError::Internal`] when the tokenizer fails.
    pub(crate) fn encode(&self, text: &str, follows_token: bool) -> Result<Vec<u32>, EngineError> {
        let fail = |e: tokenizers::Error| EngineError::Internal(format!("tokenizer: {e}"));
        match self.marker {
            // Text that holds the marker itself is encoded alone (only a Metaspace `first`
            // pre-tokenizer tells the two apart).
            Some(marker) if follows_token && !text.contains(PIECE_MARKER) => {
                let enc = self.inner.encode(format!("{PIECE_MARKER}{text}"), false).map_err(fail)?;
                match enc.get_ids().split_first() {
                    Some((&first, rest)) if first == marker => Ok(rest.to_vec()),
                    _ => Err(EngineError::Internal("tokenizer: the piece marker was not kept".into())),
                }
            }
            _ => Ok(self.inner.encode(text, false).map_err(fail)?.get_ids().to_vec()),
        }
    }
}

/// A [`PlainText`] built on first use: a copy of the tokenizer only models that see
/// special-token text in chat messages pay for.
#[derive(Default)]
pub(crate) struct LazyPlainText(OnceLock<Result<PlainText, String>>);

impl LazyPlainText {
    /// The plain-text twin of `tokenizer` (always the same tokenizer for one `LazyPlainText`).
    ///
    /// # Errors
    /// [`EngineError::Internal`] when the copy cannot take the piece marker.
    pub(crate) fn get(&self, tokenizer: &tokenizers::Tokenizer) -> Result<&PlainText, EngineError> {
        self.0
            .get_or_init(|| PlainText::new(tokenizer).map_err(|e| e.to_string()))
            .as_ref()
            .map_err(|e| EngineError::Internal(format!("tokenizer: {e}")))
    }
}

impl Tokenizer {
    /// Builds a tokenizer from GGUF `tokenizer.ggml.*` metadata: byte-level BPE
    /// (`tokenizer.ggml.model == "gpt2"`) or SentencePiece BPE (`"llama"`, see [`spm`]).
    /// Control and user-defined tokens become added tokens (control ones special); the
    /// end-of-sequence ids are EOS, EOT, EOM and the end-of-turn tokens llama.cpp recognises by
    /// their text (Gemma's `<end_of_turn>` has no id key of its own).
    ///
    /// # Errors
    /// [`ModelError::TokenizerModel`] for other tokenizer models, [`ModelError::Metadata`] for
    /// missing or malformed token lists, [`ModelError::Tokenizer`] when the tokenizers crate
    /// rejects them.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let model = file.get("tokenizer.ggml.model").and_then(GgufValue::as_str).unwrap_or("");
        if model != "gpt2" && model != "llama" {
            return Err(ModelError::TokenizerModel(model.to_owned()));
        }
        let strs = |key: &str| -> Result<Vec<String>, ModelError> {
            let bad = || ModelError::Metadata { key: key.to_owned() };
            let arr = file.get(key).and_then(GgufValue::as_array).ok_or_else(bad)?;
            arr.iter().map(|v| v.as_str().map(str::to_owned).ok_or_else(bad)).collect()
        };
        let tokens = strs("tokenizer.ggml.tokens")?;
        let types: Vec<i64> = match file.get("tokenizer.ggml.token_type").and_then(GgufValue::as_array) {
            Some(a) => a.iter().map(|v| v.as_u64().map_or(1, |x| x as i64)).collect(),
            None => vec![1; tokens.len()],
        };
        let table = unicode_to_byte();
        let (mut inner, token_bytes): (tokenizers::Tokenizer, TokenBytes<'_>) = if model == "gpt2" {
            let merges: Vec<(String, String)> = strs("tokenizer.ggml.merges")?
                .into_iter()
                .filter_map(|m| m.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())))
                .collect();
            let vocab: tokenizers::models::bpe::Vocab =
                tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
            let bpe = BPE::builder().vocab_and_merges(vocab, merges).build()?;
            let mut inner = tokenizers::Tokenizer::new(bpe);
            let pre = file.get("tokenizer.ggml.pre").and_then(GgufValue::as_str).unwrap_or("default");
            inner.with_pre_tokenizer(Some(pre_tokenizer_for(pre)?));
            inner.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
            (inner, Box::new(|t: &str| byte_level_bytes(t, &table)))
        } else {
            (spm::tokenizer(file, &tokens)?, Box::new(metaspace_bytes))
        };
        let mut added = Vec::new();
        let mut bytes = Vec::with_capacity(tokens.len());
        let mut special = Vec::with_capacity(tokens.len());
        for (i, tok) in tokens.iter().enumerate() {
            let ty = types.get(i).copied().unwrap_or(1);
            let is_added = ty == TOKEN_TYPE_CONTROL || ty == TOKEN_TYPE_USER_DEFINED;
            if is_added {
                added.push(AddedToken::from(tok.clone(), ty == TOKEN_TYPE_CONTROL).normalized(false));
                bytes.push(tok.as_bytes().to_vec());
            } else {
                bytes.push(token_bytes(tok));
            }
            special.push(ty == TOKEN_TYPE_CONTROL);
        }
        inner.add_tokens(added)?;
        let id = |key: &str| file.get(key).and_then(GgufValue::as_u64).and_then(|v| u32::try_from(v).ok());
        let mut eos_ids = Vec::new();
        let by_key = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"];
        let by_text = END_OF_TURN_TOKENS.iter().filter_map(|t| {
            let i = tokens.iter().position(|x| x == t)?;
            (types.get(i) == Some(&TOKEN_TYPE_CONTROL)).then_some(i as u32)
        });
        for e in by_key.into_iter().filter_map(id).chain(by_text) {
            if !eos_ids.contains(&e) {
                eos_ids.push(e);
            }
        }
        let bos_id = id("tokenizer.ggml.bos_token_id");
        let add_bos_default = model == "llama";
        let add_bos = file.get("tokenizer.ggml.add_bos_token").and_then(GgufValue::as_bool).unwrap_or(add_bos_default)
            && bos_id.is_some();
        Ok(Self { inner, add_bos, bos_id, eos_ids, bytes, special, plain: LazyPlainText::default() })
    }

    /// Loads `tokenizer.json` (and special tokens from `tokenizer_config.json`) from a
    /// Hugging Face model directory. `bos_id`/`eos_ids` come from the model config and
    /// are completed with the tokenizer config's `bos_token`/`eos_token`.
    ///
    /// # Errors
    /// [`ModelError::File`] (for `tokenizer.json`) when `tokenizer.json` is missing or invalid.
    pub fn from_hf_dir(dir: &Path, bos_id: Option<u32>, eos_ids: &[u32]) -> Result<Self, ModelError> {
        let path = dir.join("tokenizer.json");
        let raw = std::fs::read_to_string(&path).in_file(&path)?;
        let inner = tokenizers::Tokenizer::from_bytes(raw.as_bytes()).in_file(&path)?;
        let json: serde_json::Value = serde_json::from_str(&raw).in_file(&path)?;
        let byte_level = json.get("decoder").is_some_and(|d| d.to_string().contains("\"ByteLevel\""));
        let vocab_size = inner.get_vocab_size(true);
        let added = inner.get_added_tokens_decoder();
        let table = unicode_to_byte();
        let mut bytes = Vec::with_capacity(vocab_size);
        let mut special = Vec::with_capacity(vocab_size);
        for id in 0..vocab_size as u32 {
            if let Some(tok) = added.get(&id) {
                bytes.push(tok.content.as_bytes().to_vec());
                special.push(tok.special);
            } else {
                let text = inner.id_to_token(id).unwrap_or_default();
                bytes.push(if byte_level { byte_level_bytes(&text, &table) } else { metaspace_bytes(&text) });
                special.push(false);
            }
        }
        let cfg: Option<serde_json::Value> =
            std::fs::read_to_string(dir.join("tokenizer_config.json")).ok().and_then(|s| serde_json::from_str(&s).ok());
        let named = |key: &str| -> Option<u32> {
            let v = cfg.as_ref()?.get(key)?;
            let text = v.as_str().or_else(|| v.get("content").and_then(|c| c.as_str()))?;
            inner.token_to_id(text)
        };
        let bos_id = bos_id.or_else(|| named("bos_token"));
        let mut eos = eos_ids.to_vec();
        if let Some(e) = named("eos_token")
            && !eos.contains(&e)
        {
            eos.push(e);
        }
        Ok(Self { inner, add_bos: false, bos_id, eos_ids: eos, bytes, special, plain: LazyPlainText::default() })
    }

    /// Token ids of `text`. With `add_special_tokens`, BOS is prepended when the model asks
    /// for it (GGUF `add_bos_token`, or the HF post-processor). Special-token text such as
    /// `<|im_start|>` is always recognised (completion prompts, rendered chat templates;
    /// chat message text goes through [`crate::codec`]'s chat encoding instead).
    ///
    /// # Errors
    /// [`EngineError::Internal`] if the tokenizer fails (no user text in the message).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EngineError> {
        encode_with(&self.inner, self.add_bos, self.bos_id, text, add_special_tokens)
    }

    /// What another process needs to encode exactly as this tokenizer does (routers).
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] when the tokenizer cannot be serialized.
    pub fn export(&self) -> Result<TokenizerExport, ModelError> {
        Ok(TokenizerExport { json: self.inner.to_string(false)?, add_bos: self.add_bos, bos_id: self.bos_id })
    }

    /// Raw bytes of a token (special tokens: their text); empty for an unknown id.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// The token's text (lossy when it is part of a multi-byte character).
    pub fn token_str(&self, id: u32) -> String {
        String::from_utf8_lossy(self.token_bytes(id)).into_owned()
    }

    /// Whether the id is a special (control) token: BOS, EOS, `<|im_start|>`, ...
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Number of token ids the tokenizer knows.
    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    /// BOS id, if any.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// End-of-sequence ids (EOS, EOT, ...).
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// Decodes ids to text (lossy UTF-8), optionally dropping special tokens.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        let mut buf = Vec::new();
        for &id in ids {
            if !(skip_special_tokens && self.is_special(id)) {
                buf.extend_from_slice(self.token_bytes(id));
            }
        }
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// BOS token text (for chat templates' `bos_token`), empty when none.
    pub fn bos_text(&self) -> String {
        self.bos_id.map(|id| self.token_str(id)).unwrap_or_default()
    }

    /// First EOS token text (for chat templates' `eos_token`), empty when none.
    pub fn eos_text(&self) -> String {
        self.eos_ids.first().map(|&id| self.token_str(id)).unwrap_or_default()
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// The tokenizer with special-token parsing off (built on first use).
    pub(crate) fn plain(&self) -> &LazyPlainText {
        &self.plain
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_byte_table_inverts() {
        let t = unicode_to_byte();
        assert_eq!(t.len(), 256);
        assert_eq!(t.get(&'\u{120}'), Some(&b' ')); // 'Ġ'
        assert_eq!(t.get(&'\u{10A}'), Some(&b'\n')); // 'Ċ'
        assert_eq!(byte_level_bytes("\u{120}hello", &t), b" hello");
    }

    #[test]
    fn metaspace() {
        assert_eq!(metaspace_bytes("<0x0A>"), b"\n");
        assert_eq!(metaspace_bytes("\u{2581}the"), b" the");
    }
}
