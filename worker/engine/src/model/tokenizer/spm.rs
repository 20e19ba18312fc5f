//! SentencePiece BPE tokenizers from GGUF metadata (`tokenizer.ggml.model == "llama"`: Llama 1/2,
//! Mistral, Gemma), built as a `tokenizers` BPE model that encodes as llama.cpp's SPM tokenizer
//! (`llm_tokenizer_spm`) does.
//!
//! llama.cpp's SPM tokenizer has no merge list: it starts from the text's characters (spaces
//! replaced by `▁`) and repeatedly joins the adjacent pair whose concatenation is a vocabulary
//! token with the highest score (leftmost on ties); characters no token covers become their
//! `<0xNN>` byte tokens. A BPE model reproduces that when its merges are every split `(l, r)`
//! of every token `t = l + r` with both halves in the vocabulary, ranked by `t`'s score: BPE
//! then applies, among the adjacent pairs, the one whose result scores highest (the leftmost
//! one when both are the same merge), which is llama.cpp's choice. (Two different splits of one
//! token overlapping in one text, `ab|a|ba`, are ranked by their order here, not by position:
//! llama.cpp and this can differ there only.)
//!
//! Around the model: a `Replace(" ", "▁")` normalizer (`llama_escape_whitespace`), a `▁`
//! prepended to the text only with `tokenizer.ggml.add_space_prefix` (true unless the file says
//! false; Gemma says false), no pre-tokenizer (llama.cpp runs the whole text through one SPM
//! session), and a decoder that turns `▁` back into spaces and byte tokens into bytes.

use std::collections::HashMap;

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::{NormalizerWrapper, Sequence as NormalizerSequence};
use tokenizers::{DecoderWrapper, Tokenizer};

use super::super::error::ModelError;
use super::super::gguf::{GgufFile, GgufValue};

/// SentencePiece's whitespace symbol `▁` (U+2581).
const SPACE: &str = "\u{2581}";

/// Token scores (`tokenizer.ggml.scores`), one per token.
///
/// # Errors
/// [`ModelError::Metadata`] when the list is missing, holds a non-number or has the wrong length.
fn scores(file: &GgufFile, n_tokens: usize) -> Result<Vec<f64>, ModelError> {
    let key = "tokenizer.ggml.scores";
    let bad = || ModelError::Metadata { key: key.to_owned() };
    let arr = file.get(key).and_then(GgufValue::as_array).ok_or_else(bad)?;
    if arr.len() != n_tokens {
        return Err(bad());
    }
    arr.iter().map(|v| v.as_f64().ok_or_else(bad)).collect()
}

/// The BPE merges that make BPE pick llama.cpp's SPM bigrams: every split of every token into
/// two vocabulary tokens, highest-scoring result first (ties, which only a token's own splits
/// have when scores are distinct, by result id, then left id).
fn merges(tokens: &[String], scores: &[f64]) -> Vec<(String, String)> {
    let ids: HashMap<&str, u32> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i as u32)).collect();
    let mut found: Vec<(u32, u32, u32)> = Vec::new();
    for (i, t) in tokens.iter().enumerate() {
        for (k, _) in t.char_indices().skip(1) {
            if let (Some(&l), Some(&r)) = (ids.get(&t[..k]), ids.get(&t[k..])) {
                found.push((i as u32, l, r));
            }
        }
    }
    found.sort_by(|a, b| scores[b.0 as usize].total_cmp(&scores[a.0 as usize]).then(a.0.cmp(&b.0)).then(a.1.cmp(&b.1)));
    found.into_iter().map(|(_, l, r)| (tokens[l as usize].clone(), tokens[r as usize].clone())).collect()
}

/// The `tokenizers` pipeline for a GGUF SentencePiece vocabulary (added tokens not yet added).
///
/// # Errors
/// [`ModelError::Metadata`] for missing or malformed scores, [`ModelError::Tokenizer`] when the
/// tokenizers crate rejects the model.
pub(super) fn tokenizer(file: &GgufFile, tokens: &[String]) -> Result<Tokenizer, ModelError> {
    let scores = scores(file, tokens.len())?;
    let vocab: tokenizers::models::bpe::Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges(tokens, &scores)).byte_fallback(true);
    let unk = file.get("tokenizer.ggml.unknown_token_id").and_then(GgufValue::as_u64);
    if let Some(unk) = unk.and_then(|u| tokens.get(usize::try_from(u).ok()?)) {
        builder = builder.unk_token(unk.clone());
    }
    let mut inner = Tokenizer::new(builder.build()?);
    let replace = NormalizerWrapper::Replace(Replace::new(" ", SPACE)?);
    let add_space_prefix = file.get("tokenizer.ggml.add_space_prefix").and_then(GgufValue::as_bool).unwrap_or(true);
    inner.with_normalizer(Some(if add_space_prefix {
        NormalizerWrapper::Sequence(NormalizerSequence::new(vec![
            NormalizerWrapper::Prepend(Prepend::new(SPACE.to_owned())),
            replace,
        ]))
    } else {
        replace
    }))?;
    inner.with_decoder(Some(DecoderWrapper::Sequence(DecoderSequence::new(vec![
        DecoderWrapper::Replace(Replace::new(SPACE, " ")?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ]))));
    Ok(inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strings(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn merges_rank_by_the_result_score() {
        let tokens = strings(&["a", "b", "c", "ab", "bc", "abc"]);
        // "bc" outscores "ab", which outscores "abc".
        let scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0];
        let m = merges(&tokens, &scores);
        let pair = |l: &str, r: &str| (l.to_owned(), r.to_owned());
        assert_eq!(m, vec![pair("b", "c"), pair("a", "b"), pair("a", "bc"), pair("ab", "c")]);
    }

    #[test]
    fn merges_split_at_char_boundaries() {
        let tokens = strings(&["\u{2581}", "x", "\u{2581}x"]);
        let m = merges(&tokens, &[0.0, 0.0, -1.0]);
        assert_eq!(m, vec![("\u{2581}".to_owned(), "x".to_owned())]);
    }
}
