//! What the engine needs from a model's tokenizer and chat template, as one object-safe
//! trait so the step loop does not depend on a model format (and tests can use a
//! byte-level double). [`ModelCodec`] implements it for a loaded model.

use super::model::{ChatTemplate, Tokenizer};
use super::request::{ChatMessage, EngineError};

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
        match &self.chat_template {
            Some(t) => t.render(messages, true),
            None => Err(EngineError::InvalidRequest {
                field: "messages",
                message: "this model has no chat template; send a completion prompt".to_owned(),
            }),
        }
    }
}
