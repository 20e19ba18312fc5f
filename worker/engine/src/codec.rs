//! What the engine needs from a model's tokenizer and chat template, as one object-safe
//! trait so the step loop does not depend on a model format (and tests can use a
//! byte-level double). [`ModelCodec`] implements it for a loaded model.
//!
//! [`CodecExport`] / [`PromptCodec`]: the encoding half of a model's codec, shipped to
//! routers (cache-aware routing hashes a request's blocks before choosing a replica), built
//! so that [`PromptCodec::prompt_ids`] gives exactly the ids [`crate::EngineHandle::submit`]
//! computes: both go through [`prompt_ids_with`].

use super::kv_cache::prefix_hash;
use super::model::tokenizer::encode_with;
use super::model::{ChatTemplate, ModelError, Tokenizer, TokenizerExport};
use super::request::{ChatMessage, EngineError, Prompt};

/// Tokenization, token bytes and chat rendering. Called from `submit` (caller's thread)
/// and from the step thread.
pub trait TextCodec: Send + Sync {
    /// Token ids of `text`; `add_special_tokens` adds BOS when the model asks for it.
    ///
    /// # Errors
    /// [`EngineError::Internal`] when the tokenizer fails.
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EngineError>;
    /// Raw bytes of a token (may be part of a UTF-8 character); empty for unknown ids.
    fn token_bytes(&self, id: u32) -> &[u8];
    /// Whether the token is a special/control token (BOS, EOS, `<|im_end|>`, ...).
    fn is_special(&self, id: u32) -> bool;
    /// Vocabulary size (valid ids are `0..vocab_size`).
    fn vocab_size(&self) -> usize;
    /// Renders chat messages with the generation prompt appended.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (field `messages`) when the model has no chat
    /// template or the template rejects the messages.
    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError>;
    /// The encoding half, for routers; `None` when the codec cannot be exported (doubles).
    fn export(&self) -> Option<CodecExport> {
        None
    }
}

/// The prompt's token ids: text is encoded with BOS (when the model asks for it), chat is
/// rendered with the generation prompt and encoded without adding BOS again, ids are used
/// as given.
///
/// # Errors
/// What `encode` and `render` return.
pub fn prompt_ids_with(
    prompt: &Prompt,
    encode: impl Fn(&str, bool) -> Result<Vec<u32>, EngineError>,
    render: impl Fn(&[ChatMessage]) -> Result<String, EngineError>,
) -> Result<Vec<u32>, EngineError> {
    match prompt {
        Prompt::Text(t) => encode(t, true),
        Prompt::TokenIds(ids) => Ok(ids.clone()),
        Prompt::Chat(msgs) => encode(&render(msgs)?, false),
    }
}

/// A model's chat template as shipped: source and the `bos_token`/`eos_token` variables.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatTemplateExport {
    /// Jinja source.
    pub source: String,
    /// `bos_token` as the template sees it.
    pub bos_token: String,
    /// `eos_token` as the template sees it.
    pub eos_token: String,
}

/// Everything needed to tokenize prompts as a replica does (JSON on the wire).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CodecExport {
    /// Tokenizer pipeline and BOS handling.
    pub tokenizer: TokenizerExport,
    /// Chat template, when the model has one.
    pub chat_template: Option<ChatTemplateExport>,
}

impl CodecExport {
    /// The JSON a worker sends.
    ///
    /// # Errors
    /// Never in practice (plain strings and numbers).
    pub fn to_json(&self) -> Result<Vec<u8>, serde_json::Error> {
        serde_json::to_vec(self)
    }

    /// Parses what [`CodecExport::to_json`] wrote.
    ///
    /// # Errors
    /// Malformed JSON.
    pub fn from_json(bytes: &[u8]) -> Result<Self, serde_json::Error> {
        serde_json::from_slice(bytes)
    }

    /// Identifies the content (a hash of the JSON): equal fingerprints, equal tokenization.
    pub fn fingerprint(&self) -> u64 {
        self.to_json().map_or(0, |j| prefix_hash::fingerprint(&j))
    }
}

/// Prompt tokenization rebuilt from a [`CodecExport`] (routers).
pub struct PromptCodec {
    tokenizer: tokenizers::Tokenizer,
    add_bos: bool,
    bos_id: Option<u32>,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for PromptCodec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PromptCodec").field("add_bos", &self.add_bos).finish_non_exhaustive()
    }
}

impl PromptCodec {
    /// Builds the tokenizer and compiles the chat template.
    ///
    /// # Errors
    /// [`ModelError::Tokenizer`] / [`ModelError::ChatTemplate`] when they do not load.
    pub fn from_export(e: &CodecExport) -> Result<Self, ModelError> {
        let tokenizer = tokenizers::Tokenizer::from_bytes(e.tokenizer.json.as_bytes())?;
        let chat_template = match &e.chat_template {
            Some(t) => Some(ChatTemplate::new(&t.source, t.bos_token.clone(), t.eos_token.clone())?),
            None => None,
        };
        Ok(Self { tokenizer, add_bos: e.tokenizer.add_bos, bos_id: e.tokenizer.bos_id, chat_template })
    }

    /// The prompt's token ids, as the replica's engine computes them.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (field `messages`) for chat without a template or
    /// rejected by it; [`EngineError::Internal`] when the tokenizer fails.
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        prompt_ids_with(
            prompt,
            |t, special| encode_with(&self.tokenizer, self.add_bos, self.bos_id, t, special),
            |m| render_with(self.chat_template.as_ref(), m),
        )
    }
}

fn render_with(template: Option<&ChatTemplate>, messages: &[ChatMessage]) -> Result<String, EngineError> {
    match template {
        Some(t) => t.render(messages, true),
        None => Err(EngineError::InvalidRequest {
            field: "messages",
            message: "this model has no chat template; send a completion prompt".to_owned(),
        }),
    }
}

/// [`TextCodec`] of a loaded model.
#[derive(Debug)]
pub struct ModelCodec {
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// Its chat template, if it ships one.
    pub chat_template: Option<ChatTemplate>,
}

impl TextCodec for ModelCodec {
    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EngineError> {
        self.tokenizer.encode(text, add_special_tokens)
    }

    fn token_bytes(&self, id: u32) -> &[u8] {
        if (id as usize) < self.tokenizer.vocab_size() { self.tokenizer.token_bytes(id) } else { &[] }
    }

    fn is_special(&self, id: u32) -> bool {
        (id as usize) < self.tokenizer.vocab_size() && self.tokenizer.is_special(id)
    }

    fn vocab_size(&self) -> usize {
        self.tokenizer.vocab_size()
    }

    fn render_chat(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        render_with(self.chat_template.as_ref(), messages)
    }

    fn export(&self) -> Option<CodecExport> {
        let tokenizer = match self.tokenizer.export() {
            Ok(t) => t,
            Err(e) => {
                tracing::warn!(error = %e, "tokenizer cannot be exported; routers will route by load alone");
                return None;
            }
        };
        let chat_template = self.chat_template.as_ref().map(|t| {
            let (source, bos, eos) = t.parts();
            ChatTemplateExport { source: source.to_owned(), bos_token: bos.to_owned(), eos_token: eos.to_owned() }
        });
        Some(CodecExport { tokenizer, chat_template })
    }
}
