//! Structured outputs: [`StructuredOutput`] grammars compiled by llguidance (the
//! structured-output backend vLLM and SGLang use: an Earley parser over lazily built lexer
//! automata, masks for a 128k vocabulary in well under a millisecond) into a per-sequence
//! [`Matcher`] that yields each step's allowed tokens (`constraint.rs` applies them).
//!
//! [`GrammarCompiler`] is built once per loaded model from the engine's own tokenizer: the
//! raw bytes of every token id, special tokens marked with llguidance's `0xFF` prefix so no
//! grammar text can produce them. Grammars are compiled on the submitting thread (never the
//! step thread), so an invalid schema, regex or grammar is an
//! [`EngineError::InvalidRequest`] naming its field before the request is queued.
//!
//! JSON schemas and `json_object` are compiled without free whitespace between tokens
//! (`{"a":1}`), since a small model given free whitespace can emit newlines until
//! `max_tokens`; a schema's own `x-guidance` options (llguidance's JSON options, e.g.
//! `{"whitespace_flexible": true}`) take precedence. Objects that list their properties
//! and say nothing of others are closed (`additionalProperties: false`, as OpenAI's strict
//! mode and vLLM's xgrammar do; `structured/closed_objects.rs`), so a model cannot invent
//! keys with unbounded values.
//!
//! Limits: grammar text at most [`MAX_GRAMMAR_BYTES`], at most [`MAX_CHOICES`] choices;
//! llguidance's fuel limits bound the work of compiling one grammar and of one mask, and its
//! `max_items_in_row` (2000, its default) the branching of one parser state, so a
//! pathological grammar fails instead of stalling the step thread. [`GrammarCompiler::compile`]
//! runs the grammar's first steps (the initial mask, the bytes it forces, the mask after
//! them) so that a grammar over those limits at its start, such as a JSON object with
//! hundreds of optional properties, is an `InvalidRequest` before the request is queued; one
//! that reaches them only later fails its request during generation (`step_loop`).

mod closed_objects;

pub use closed_objects::close_objects;

use super::codec::TextCodec;
use super::request::{EngineError, StructuredOutput};
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;

/// Longest accepted JSON schema, regex or grammar text (bytes; choices in total).
pub const MAX_GRAMMAR_BYTES: usize = 128 * 1024;
/// Most entries of a `choice` list.
pub const MAX_CHOICES: usize = 1024;

/// Field names of [`StructuredOutput`]'s variants in errors (`structured_output.<variant>`).
pub(crate) fn field_of(spec: &StructuredOutput) -> &'static str {
    match spec {
        StructuredOutput::JsonSchema(_) => "structured_output.json_schema",
        StructuredOutput::JsonObject => "structured_output.json_object",
        StructuredOutput::Regex(_) => "structured_output.regex",
        StructuredOutput::Choice(_) => "structured_output.choice",
        StructuredOutput::Grammar(_) => "structured_output.grammar",
    }
}

/// llguidance's view of the engine's tokenizer.
struct CodecEnv {
    trie: TokTrie,
    codec: Arc<dyn TextCodec>,
}

impl TokenizerEnv for CodecEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => self.codec.encode(text, false).unwrap_or_else(|_| self.trie.greedy_tokenize(s)),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }

    /// Invalid UTF-8 falls back to a greedy split, which is not the tokenizer's own.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// The token trie of `codec`'s vocabulary: each id's raw bytes; special tokens (and ids
/// without bytes) as `0xFF` + their text, which llguidance never matches against grammar
/// text.
fn token_trie(codec: &dyn TextCodec, eos: u32) -> TokTrie {
    let vocab = codec.vocab_size();
    let words: Vec<Vec<u8>> = (0..vocab as u32)
        .map(|id| {
            let bytes = codec.token_bytes(id);
            if codec.is_special(id) || bytes.is_empty() {
                let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                if bytes.is_empty() {
                    w.extend_from_slice(format!("<[{id}]>").as_bytes());
                } else {
                    w.extend_from_slice(bytes);
                }
                w
            } else {
                bytes.to_vec()
            }
        })
        .collect();
    TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words)
}

/// Compiles grammars for one model (llguidance's `ParserFactory` over the model's
/// tokenizer); shared by every request of the replica.
pub struct GrammarCompiler {
    factory: ParserFactory,
    eos: u32,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").field("eos", &self.eos).finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// Builds the token trie and llguidance's lexer slices for `codec`'s vocabulary
    /// (tens of milliseconds for a 50k vocabulary). `eos` stands for "the grammar may end
    /// here" in masks.
    ///
    /// # Errors
    /// llguidance's message when the factory cannot be built.
    pub fn new(codec: Arc<dyn TextCodec>, eos: u32) -> Result<Self, String> {
        let trie = token_trie(&*codec, eos);
        let env: TokEnv = Arc::new(CodecEnv { trie, codec });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        *factory.limits_mut() = ParserLimits {
            // A few milliseconds of lexer and parser work per mask at most (llguidance's
            // speed figures: 14k fuel/ms, 20k items/ms).
            step_lexer_fuel: 100_000,
            step_max_items: 50_000,
            initial_lexer_fuel: 1_000_000,
            max_grammar_size: 500_000,
            // Messages go to clients: no parser state or grammar dump.
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Self { factory, eos })
    }

    /// The token that marks "the grammar may end here" in masks.
    pub fn eos(&self) -> u32 {
        self.eos
    }

    /// The vocabulary size masks cover.
    pub fn vocab_size(&self) -> usize {
        self.factory.tok_env().tok_trie().vocab_size()
    }

    /// A matcher at the start of `spec`'s grammar, advanced over `prior` (tokens generated
    /// before a stream migration).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] naming the field (`structured_output.<variant>`) with
    /// llguidance's message, or `prior_output_ids` when those tokens leave the grammar.
    pub fn compile(&self, spec: &StructuredOutput, prior: &[u32]) -> Result<Matcher, EngineError> {
        let field = field_of(spec);
        let invalid = |message: String| EngineError::InvalidRequest { field, message };
        let grammar = grammar_of(spec).map_err(invalid)?;
        let parser = self.factory.create_parser(grammar).map_err(|e| invalid(format!("{e:#}")))?;
        let mut matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(llg_message(&e)));
        }
        if !prior.is_empty() {
            matcher.consume_tokens(prior).map_err(|e| EngineError::InvalidRequest {
                field: "prior_output_ids",
                message: format!("prior_output_ids do not follow the request's grammar: {}", llg_message(&e)),
            })?;
        }
        self.first_steps(&matcher).map_err(|e| invalid(format!("the grammar failed at its first tokens: {e}")))?;
        Ok(matcher)
    }

    /// Runs `matcher`'s first steps on a deep copy: the mask now, the bytes the grammar
    /// forces from here (`{` of a JSON object, `{"name":` with a required first property),
    /// and the mask after them. llguidance checks its per-step limits only while stepping,
    /// so without this a grammar that compiles can still fail at its first token on the
    /// step thread (an object with ~500 optional properties puts 4 Earley items per
    /// property in the row after `{`, over `max_items_in_row`). Costs about two masks.
    ///
    /// # Errors
    /// llguidance's message.
    fn first_steps(&self, matcher: &Matcher) -> Result<(), String> {
        let mut m = matcher.deep_clone();
        if m.is_stopped() {
            return Ok(());
        }
        m.compute_mask().map_err(|e| llg_message(&e))?;
        let forced = m.compute_ff_bytes();
        if let Some(e) = m.get_error() {
            return Err(llg_message(&e));
        }
        if forced.is_empty() {
            return Ok(());
        }
        // The tokenizer is not canonical for llguidance, so it forces bytes, not tokens; any
        // split of them is accepted, and one it does not accept stops the walk (no error).
        let tokens = self.factory.tok_env().tok_trie().greedy_tokenize(&forced);
        m.try_consume_tokens(&tokens).map_err(|e| llg_message(&e))?;
        if !m.is_stopped() {
            m.compute_mask().map_err(|e| llg_message(&e))?;
        }
        Ok(())
    }
}

/// llguidance's error message for clients: its `<non-verbose/>` marker (parser state and
/// grammar left out) removed.
pub(crate) fn llg_message(e: &dyn std::fmt::Display) -> String {
    let full = format!("{e:#}");
    full.trim_end().trim_end_matches("<non-verbose/>").trim_end().to_owned()
}

fn check_size(len: usize, what: &str) -> Result<(), String> {
    if len > MAX_GRAMMAR_BYTES {
        return Err(format!("{what} is {len} bytes; at most {MAX_GRAMMAR_BYTES} are accepted"));
    }
    Ok(())
}

/// llguidance's grammar for `spec` (checked for size and, for JSON, syntax).
fn grammar_of(spec: &StructuredOutput) -> Result<TopLevelGrammar, String> {
    Ok(match spec {
        StructuredOutput::JsonSchema(text) => {
            check_size(text.len(), "the JSON schema")?;
            let mut schema: serde_json::Value =
                serde_json::from_str(text).map_err(|e| format!("the JSON schema is not valid JSON: {e}"))?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err("the JSON schema must be an object or a boolean".to_owned());
            }
            close_objects(&mut schema);
            TopLevelGrammar::from_json_schema(compact_json(schema))
        }
        StructuredOutput::JsonObject => {
            TopLevelGrammar::from_json_schema(compact_json(serde_json::json!({"type": "object"})))
        }
        StructuredOutput::Regex(rx) => {
            check_size(rx.len(), "the regex")?;
            TopLevelGrammar::from_regex(rx)
        }
        StructuredOutput::Choice(choices) => {
            if choices.is_empty() {
                return Err("choice must list at least one string".to_owned());
            }
            if choices.len() > MAX_CHOICES {
                return Err(format!("choice lists {} strings; at most {MAX_CHOICES} are accepted", choices.len()));
            }
            check_size(choices.iter().map(String::len).sum(), "the choice list")?;
            let alternatives: Vec<String> = choices.iter().map(|c| regex_escape(c)).collect();
            TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
        }
        StructuredOutput::Grammar(lark) => {
            check_size(lark.len(), "the grammar")?;
            TopLevelGrammar::from_lark(lark.clone())
        }
    })
}

/// `schema` with compact JSON (no whitespace between tokens) unless it sets its own
/// `x-guidance` options.
fn compact_json(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut()
        && !obj.contains_key("x-guidance")
    {
        obj.insert("x-guidance".to_owned(), serde_json::json!({"whitespace_flexible": false}));
        return schema;
    }
    if schema.is_boolean() {
        // `true` accepts any value, `false` none: the object forms say the same.
        let any = schema.as_bool() == Some(true);
        let mut obj = if any { serde_json::json!({}) } else { serde_json::json!({"not": {}}) };
        obj["x-guidance"] = serde_json::json!({"whitespace_flexible": false});
        return obj;
    }
    schema
}

/// `s` as a regex matching exactly itself.
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 2);
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~\"/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choice_regex_escapes_metacharacters() {
        assert_eq!(regex_escape("a.b*(c)"), r"a\.b\*\(c\)");
        assert_eq!(regex_escape("plain text"), "plain text");
    }

    #[test]
    fn json_schemas_get_compact_whitespace_unless_they_choose() {
        let s = compact_json(serde_json::json!({"type": "string"}));
        assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
        let own = serde_json::json!({"type": "string", "x-guidance": {"whitespace_flexible": true}});
        assert_eq!(compact_json(own.clone()), own);
        assert_eq!(compact_json(serde_json::json!(true))["x-guidance"]["whitespace_flexible"], false);
    }

    #[test]
    fn bad_specs_are_rejected_before_compiling() {
        assert!(grammar_of(&StructuredOutput::JsonSchema("{not json".into())).is_err());
        assert!(grammar_of(&StructuredOutput::JsonSchema("[1]".into())).is_err());
        assert!(grammar_of(&StructuredOutput::Choice(Vec::new())).is_err());
        let huge = "a".repeat(MAX_GRAMMAR_BYTES + 1);
        assert!(grammar_of(&StructuredOutput::Regex(huge.clone())).unwrap_err().contains("at most"));
        assert!(grammar_of(&StructuredOutput::Grammar(huge)).is_err());
    }
}
