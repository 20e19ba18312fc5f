//! What the engine needs from a model's tokenizer and chat template, as one object-safe
//! trait so the step loop does not depend on a model format (and tests can use a
//! byte-level double). [`ModelCodec`] implements it for a loaded model.
//!
//! [`CodecExport`] / [`PromptCodec`]: the encoding half of a model's codec, shipped to
//! routers (cache-aware routing hashes a request's blocks before choosing a replica), built
//! so that [`PromptCodec::prompt_ids`] gives exactly the ids [`crate::EngineHandle::submit`]
//! computes: both go through [`prompt_ids_with`] and the chat encoding of [`chat`].
//!
//! Special tokens: a completion prompt's text is encoded with special-token text parsed
//! (`<|im_start|>` typed into `/v1/completions` is that token, as in vLLM: the caller writes
//! the whole prompt). In a chat prompt only the template makes special tokens; text inside
//! the messages is encoded with special-token parsing off ([`chat`]), unless the engine's
//! `chat_content_special_tokens` opt-out is on.

mod chat;
#[cfg(test)]
mod chat_tests;
mod tokens;

pub use chat::ChatVars;

use super::kv_cache::prefix_hash;
use super::model::tokenizer::{LazyPlainText, encode_with};
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
    /// Token ids of a chat prompt (generation prompt appended, no BOS added): special tokens
    /// only where the template puts them, message text with special-token parsing off;
    /// `content_special_tokens` parses special-token text in the messages too (the opt-out).
    /// The default renders and encodes the whole text (codecs without special tokens).
    ///
    /// # Errors
    /// What `render_chat` and `encode` return.
    fn encode_chat(&self, messages: &[ChatMessage], content_special_tokens: bool) -> Result<Vec<u32>, EngineError> {
        let _ = content_special_tokens;
        self.encode(&self.render_chat(messages)?, false)
    }
    /// [`TextCodec::encode_chat`] with the request's tool definitions (`tools`: a JSON array
    /// of OpenAI tool objects; `None` = no tools) in the template's `tools` variable, or
    /// folded into the messages for a template that does not read it. The default (codecs
    /// without templates) accepts no tools.
    ///
    /// # Errors
    /// What `encode_chat` returns; [`EngineError::InvalidRequest`] (field `tools`) for tools
    /// this codec cannot render.
    fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&str>,
        content_special_tokens: bool,
    ) -> Result<Vec<u32>, EngineError> {
        match tools {
            None => self.encode_chat(messages, content_special_tokens),
            Some(_) => Err(EngineError::InvalidRequest {
                field: "tools",
                message: "this model's codec does not render tools".to_owned(),
            }),
        }
    }
    /// [`TextCodec::encode_chat_with_tools`] with the request's `chat_template_kwargs` too
    /// ([`ChatVars`]). The default (codecs without templates) accepts no kwargs.
    ///
    /// # Errors
    /// What `encode_chat_with_tools` returns; [`EngineError::InvalidRequest`] (field
    /// `chat_template_kwargs`) for kwargs this codec cannot render or that are refused
    /// ([`crate::model::chat_template::parse_template_kwargs`]).
    fn encode_chat_with_vars(
        &self,
        messages: &[ChatMessage],
        vars: ChatVars<'_>,
        content_special_tokens: bool,
    ) -> Result<Vec<u32>, EngineError> {
        match vars.template_kwargs {
            None => self.encode_chat_with_tools(messages, vars.tools, content_special_tokens),
            Some(_) => Err(EngineError::InvalidRequest {
                field: "chat_template_kwargs",
                message: "this model's codec does not render chat template variables".to_owned(),
            }),
        }
    }
    /// The encoding half, for routers; `None` when the codec cannot be exported (doubles).
    fn export(&self) -> Option<CodecExport> {
        None
    }
}

/// The prompt's token ids: text is encoded with BOS (when the model asks for it) and its
/// special-token text parsed, chat goes to `encode_chat` ([`TextCodec::encode_chat`]: the
/// template's special tokens only), ids are used as given.
///
/// # Errors
/// What `encode` and `encode_chat` return.
pub fn prompt_ids_with(
    prompt: &Prompt,
    encode: impl Fn(&str, bool) -> Result<Vec<u32>, EngineError>,
    encode_chat: impl Fn(&[ChatMessage]) -> Result<Vec<u32>, EngineError>,
) -> Result<Vec<u32>, EngineError> {
    match prompt {
        Prompt::Text(t) => encode(t, true),
        Prompt::TokenIds(ids) => Ok(ids.clone()),
        Prompt::Chat(msgs) => encode_chat(msgs),
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
///
/// The template travels under the JSON key `chat` (it was `chat_template` while message text
/// was encoded with special tokens parsed): a router built before reads no template from
/// this export, so it never computes chat ids by the old rule for a replica of this one
/// (its chat requests are tokenized by the replica), while completion ids, whose rule did
/// not change, still match.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CodecExport {
    /// Tokenizer pipeline and BOS handling.
    pub tokenizer: TokenizerExport,
    /// Chat template, when the model has one.
    #[serde(rename = "chat")]
    pub chat_template: Option<ChatTemplateExport>,
    /// The replica parses special-token text inside chat messages too (its
    /// `chat_content_special_tokens` opt-out).
    #[serde(default)]
    pub chat_content_special_tokens: bool,
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
    plain: LazyPlainText,
    add_bos: bool,
    bos_id: Option<u32>,
    chat_template: Option<ChatTemplate>,
    chat_content_special_tokens: bool,
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
        Ok(Self {
            tokenizer,
            plain: LazyPlainText::default(),
            add_bos: e.tokenizer.add_bos,
            bos_id: e.tokenizer.bos_id,
            chat_template,
            chat_content_special_tokens: e.chat_content_special_tokens,
        })
    }

    /// The prompt's token ids, as the replica's engine computes them.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (field `messages`) for chat without a template or
    /// rejected by it; [`EngineError::Internal`] when the tokenizer fails.
    pub fn prompt_ids(&self, prompt: &Prompt) -> Result<Vec<u32>, EngineError> {
        self.prompt_ids_with_tools(prompt, None)
    }

    /// [`PromptCodec::prompt_ids`] of a chat request with tool definitions (`tools`: JSON
    /// array text, as `EngineRequest::tools`), as the replica's engine computes them.
    ///
    /// # Errors
    /// As [`PromptCodec::prompt_ids`]; (field `tools`) for tools that are not a JSON array.
    pub fn prompt_ids_with_tools(&self, prompt: &Prompt, tools: Option<&str>) -> Result<Vec<u32>, EngineError> {
        self.prompt_ids_with_vars(prompt, ChatVars { tools, template_kwargs: None })
    }

    /// [`PromptCodec::prompt_ids`] of a chat request with its tools and
    /// `chat_template_kwargs` ([`ChatVars`]), as the replica's engine computes them.
    ///
    /// # Errors
    /// As [`PromptCodec::prompt_ids_with_tools`]; (field `chat_template_kwargs`) for kwargs
    /// that are refused.
    pub fn prompt_ids_with_vars(&self, prompt: &Prompt, vars: ChatVars<'_>) -> Result<Vec<u32>, EngineError> {
        prompt_ids_with(
            prompt,
            |t, special| encode_with(&self.tokenizer, self.add_bos, self.bos_id, t, special),
            |m| {
                let template = self.chat_template.as_ref();
                chat::encode_chat(&self.tokenizer, &self.plain, template, m, vars, self.chat_content_special_tokens)
            },
        )
    }

    /// The chat template's Jinja source, when the model has one (routers pick a tool-call
    /// parser by it).
    pub fn chat_template_source(&self) -> Option<&str> {
        self.chat_template.as_ref().map(|t| t.parts().0)
    }
}

fn render_with(template: Option<&ChatTemplate>, messages: &[ChatMessage]) -> Result<String, EngineError> {
    let template = template.ok_or_else(chat::no_template)?;
    let (messages, _) = chat::with_tools(template, messages, None)?;
    template.render(&messages, true)
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

    fn encode_chat(&self, messages: &[ChatMessage], content_special_tokens: bool) -> Result<Vec<u32>, EngineError> {
        self.encode_chat_with_tools(messages, None, content_special_tokens)
    }

    fn encode_chat_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&str>,
        content_special_tokens: bool,
    ) -> Result<Vec<u32>, EngineError> {
        self.encode_chat_with_vars(messages, ChatVars { tools, template_kwargs: None }, content_special_tokens)
    }

    fn encode_chat_with_vars(
        &self,
        messages: &[ChatMessage],
        vars: ChatVars<'_>,
        content_special_tokens: bool,
    ) -> Result<Vec<u32>, EngineError> {
        let (inner, plain) = (self.tokenizer.inner(), self.tokenizer.plain());
        chat::encode_chat(inner, plain, self.chat_template.as_ref(), messages, vars, content_special_tokens)
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
        // The opt-out is the engine's (`RuntimeConfig`): `EngineHandle::codec_export` sets it.
        Some(CodecExport { tokenizer, chat_template, chat_content_special_tokens: false })
    }
}
