//! Public engine API types: what a caller submits and what it receives.
//!
//! Validation rules (all raise [`EngineError::InvalidRequest`] naming the field) follow
//! vLLM's `SamplingParams._verify_args`.

use prism_common::RequestId;
use std::time::Instant;

/// One chat message, rendered through the model's chat template.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// "system", "user", "assistant", ...
    pub role: String,
    /// Message text.
    pub content: String,
}

/// What to complete.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Raw text, tokenized with the model's tokenizer (BOS added when the model asks for it).
    Text(String),
    /// Token ids, used as given (each must be < vocab size).
    TokenIds(Vec<u32>),
    /// Chat messages: rendered with the chat template, generation prompt added.
    Chat(Vec<ChatMessage>),
}

/// Sampling parameters as the client sent them (raw, validated by the engine).
/// Defaults: temperature 1.0, top_p 1.0, top_k -1, min_p 0, penalties neutral, n 1.
#[derive(Clone, Debug)]
pub struct SamplingParams {
    /// 0 = greedy; must be >= 0.
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// -1 (or 0) = disabled, else >= 1.
    pub top_k: i32,
    /// Minimum probability relative to the most likely token, [0, 1].
    pub min_p: f32,
    /// Per-request RNG seed; `None` = random.
    pub seed: Option<u64>,
    /// > 0; 1 = off (CTRL-style, divides positive logits of seen tokens).
    pub repetition_penalty: f32,
    /// [-2, 2], OpenAI semantics (times the count of each generated token).
    pub frequency_penalty: f32,
    /// [-2, 2], OpenAI semantics (once per generated token present).
    pub presence_penalty: f32,
    /// Stop strings: generation ends before them; no part of one is ever emitted.
    pub stop: Vec<String>,
    /// Stop token ids (the token itself is not part of the text).
    pub stop_token_ids: Vec<u32>,
    /// New tokens to generate; `None` = until EOS or the context limit. Must be >= 1.
    pub max_tokens: Option<i64>,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Number of independent choices (>= 1).
    pub n: u32,
    /// `Some(k)`: return each sampled token's logprob and the top `k` (0..=20) alternatives.
    pub logprobs: Option<u32>,
    /// Drop special tokens (BOS/EOS/control) from the text.
    pub skip_special_tokens: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            max_tokens: None,
            ignore_eos: false,
            n: 1,
            logprobs: None,
            skip_special_tokens: true,
        }
    }
}

/// A request submitted to the engine.
#[derive(Clone, Debug)]
pub struct EngineRequest {
    /// Caller-chosen id (for logs and metrics; never contains prompt text).
    pub id: RequestId,
    /// The prompt.
    pub prompt: Prompt,
    /// Sampling parameters.
    pub params: SamplingParams,
    /// Tokens generated before (stream migration): appended after the prompt, counted
    /// against `max_tokens` and seen by the penalties and stop checks; not re-emitted.
    pub prior_output_ids: Vec<u32>,
    /// The request is aborted (finish_reason `Abort`) when this passes.
    pub deadline: Option<Instant>,
}

/// Why a choice ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` reached or the context window full.
    Length,
    /// Aborted (deadline, engine shutdown).
    Abort,
}

impl FinishReason {
    /// OpenAI / vLLM spelling: "stop", "length", "abort".
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::Abort => "abort",
        }
    }
}

/// One alternative in a top-logprobs list.
#[derive(Clone, Debug, PartialEq)]
pub struct TopLogprob {
    /// Token id.
    pub token_id: u32,
    /// The token's text (lossy where the token is part of a multi-byte character).
    pub token: String,
    /// Natural-log probability under the sampling distribution's logits (before temperature).
    pub logprob: f32,
    /// The token's raw bytes.
    pub bytes: Vec<u8>,
}

/// Logprob information for one sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The sampled token.
    pub token_id: u32,
    /// Its text (lossy for partial UTF-8).
    pub token: String,
    /// Its logprob.
    pub logprob: f32,
    /// Its raw bytes.
    pub bytes: Vec<u8>,
    /// The top-k alternatives (k as requested), most likely first.
    pub top_logprobs: Vec<TopLogprob>,
}

/// Token counts for a whole request (all choices).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt tokens after templating (the original prompt; `prior_output_ids` are not counted here).
    pub prompt_tokens: u32,
    /// Tokens generated across all choices, `prior_output_ids` included.
    pub completion_tokens: u32,
}

/// One streamed output: the new tokens of one choice since the previous output.
/// The last output of a choice has `finish_reason`; the very last output of the
/// request has `usage`.
#[derive(Clone, Debug, Default)]
pub struct EngineOutput {
    /// Choice index (0..n).
    pub index: u32,
    /// New token ids.
    pub token_ids: Vec<u32>,
    /// New text: valid UTF-8, never any part of a stop string.
    pub text: String,
    /// One entry per new token when logprobs were requested.
    pub logprobs: Vec<TokenLogprob>,
    /// Set on the choice's last output.
    pub finish_reason: Option<FinishReason>,
    /// Set on the request's last output.
    pub usage: Option<Usage>,
    /// Prompt length in tokens (every output carries it).
    pub prompt_tokens: u32,
}

/// Engine errors, classified where the cause is known; mapped to gRPC/HTTP in one place
/// per service (`InvalidRequest` → INVALID_ARGUMENT/400, `Overloaded` → RESOURCE_EXHAUSTED/429,
/// `Unavailable` → UNAVAILABLE/503, `Internal` → INTERNAL/500).
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The request is invalid; `field` names the offending parameter (OpenAI's `param`).
    #[error("{message}")]
    InvalidRequest {
        /// Offending field, e.g. "max_tokens", "prompt".
        field: &'static str,
        /// Human-readable message (never contains prompt text).
        message: String,
    },
    /// Too many waiting requests.
    #[error("engine overloaded: {0}")]
    Overloaded(String),
    /// The engine thread is gone or shutting down.
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    /// Model loading or a forward pass failed.
    #[error("engine internal error: {0}")]
    Internal(String),
}
