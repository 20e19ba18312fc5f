//! `POST /tokenize` and `POST /detokenize`, vLLM's routes and shapes, answered in the router
//! with the model's prompt codec ([`crate::tokenize`]):
//!
//! - tokenize `{model, prompt, add_special_tokens?, return_token_strs?}` or
//!   `{model, messages, add_generation_prompt?, add_special_tokens?, return_token_strs?}` →
//!   `{count, max_model_len, tokens}` (+ `token_strs` with `return_token_strs`);
//! - detokenize `{model, tokens}` → `{prompt}`.
//!
//! Unknown model → 404 (`model`), a model no replica is coming to → 503 naming why (as its
//! chat requests), no Ready replica otherwise → 503, bad input → 400 naming the field
//! (`tokens` for an id outside the vocabulary).

use axum::http::StatusCode;
use prism_engine::ChatMessage;
use serde::Deserialize;
use serde_json::{Value, json};

use super::errors::ApiError;
use super::types::ChatMessageIn;
use crate::tokenize::{ModelCodecs, TokenizeError, TokenizeInput, TokenizeOptions, detokenize, tokenize};

/// `POST /tokenize` body.
#[derive(Debug, Deserialize)]
pub struct TokenizeBody {
    /// Served model name.
    pub model: String,
    /// A completion prompt (exactly one of `prompt` and `messages`).
    pub prompt: Option<String>,
    /// Chat messages, rendered through the model's template.
    pub messages: Option<Vec<ChatMessageIn>>,
    /// Text: add BOS when the model does (default true); chat: default false.
    pub add_special_tokens: Option<bool>,
    /// Chat: append the assistant turn header (default true; only true is supported).
    pub add_generation_prompt: Option<bool>,
    /// Also return each token's vocabulary string (`token_strs`).
    pub return_token_strs: Option<bool>,
    /// vLLM: a request chat template (refused, as on chat completions).
    pub chat_template: Option<Value>,
    /// vLLM: extra chat template variables (a JSON object; with `messages` only).
    pub chat_template_kwargs: Option<Value>,
}

/// `POST /detokenize` body.
#[derive(Debug, Deserialize)]
pub struct DetokenizeBody {
    /// Served model name.
    pub model: String,
    /// Token ids.
    pub tokens: Vec<u32>,
}

impl From<TokenizeError> for ApiError {
    fn from(e: TokenizeError) -> Self {
        match e {
            TokenizeError::Invalid(i) => i.into(),
            TokenizeError::Internal(m) => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, m),
        }
    }
}

/// The input to tokenize and its `chat_template_kwargs` JSON text (`None` when not given).
fn input_of(b: &TokenizeBody) -> Result<(TokenizeInput, Option<String>), ApiError> {
    let kwargs = super::types::template_fields(b.chat_template.as_ref(), b.chat_template_kwargs.as_ref())?;
    let input = match (&b.prompt, &b.messages) {
        (Some(p), None) => Ok(TokenizeInput::Text(p.clone())),
        (None, Some(ms)) => {
            let mut out = Vec::with_capacity(ms.len());
            for (i, m) in ms.iter().enumerate() {
                out.push(ChatMessage { role: m.role.clone(), content: m.text(i)?, ..Default::default() });
            }
            Ok(TokenizeInput::Chat(out))
        }
        (Some(_), Some(_)) => Err(ApiError::invalid("prompt", "give either prompt or messages, not both")),
        (None, None) => Err(ApiError::invalid("prompt", "prompt or messages is required")),
    }?;
    Ok((input, Some(kwargs).filter(|k| !k.is_empty())))
}

/// Runs `f` on the blocking pool (a long prompt takes milliseconds to tokenize).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, TokenizeError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("tokenizer task failed: {e}")))?
        .map_err(ApiError::from)
}

/// `POST /tokenize` of a parsed body: the JSON answer.
///
/// # Errors
/// 404 `model`, 503 without a Ready replica or codec, 400 naming the field.
pub async fn tokenize_answer(codecs: &ModelCodecs, b: TokenizeBody) -> Result<Value, ApiError> {
    let (input, kwargs) = input_of(&b)?;
    let mc = codecs.get(&b.model).await?;
    let opts = TokenizeOptions {
        template_kwargs: kwargs,
        add_special_tokens: b.add_special_tokens,
        add_generation_prompt: b.add_generation_prompt,
        return_token_strs: b.return_token_strs == Some(true),
    };
    let codec = mc.codec;
    let t = blocking(move || tokenize(&codec, &input, &opts)).await?;
    let mut v = json!({"count": t.tokens.len(), "max_model_len": mc.max_model_len, "tokens": t.tokens});
    if let Some(s) = t.token_strs {
        v["token_strs"] = json!(s);
    }
    Ok(v)
}

/// `POST /detokenize` of a parsed body: the JSON answer.
///
/// # Errors
/// 404 `model`, 503 without a Ready replica or codec, 400 `tokens` for an id outside the vocabulary.
pub async fn detokenize_answer(codecs: &ModelCodecs, b: DetokenizeBody) -> Result<Value, ApiError> {
    let codec = codecs.get(&b.model).await?.codec;
    let tokens = b.tokens;
    let prompt = blocking(move || detokenize(&codec, &tokens)).await?;
    Ok(json!({"prompt": prompt}))
}
