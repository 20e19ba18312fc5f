//! Public engine API types: what a caller submits and what it receives.
//!
//! Validation rules (all raise [`EngineError::InvalidRequest`] naming the field) follow
//! vLLM's `SamplingParams._verify_args` and its prompt-length checks:
//! - a prompt of 0 tokens is rejected ("prompt is empty");
//! - a prompt that leaves no room for one new token in `max_model_len` is rejected, the
//!   message naming the limit and the prompt size;
//! - **prompt + `max_tokens` over `max_model_len` is rejected** (field `max_tokens`), as vLLM
//!   and OpenAI do, never silently capped; `max_tokens: None` means "until EOS or the
//!   context window", which then ends with finish_reason `length`;
//! - `max_tokens` <= 0, temperature < 0, top_p outside (0, 1], top_k < -1, min_p outside
//!   [0, 1], repetition_penalty <= 0, frequency/presence penalty outside [-2, 2], n = 0 or
//!   n > [`MAX_N`], logprobs > [`MAX_LOGPROBS`], an empty stop string, and token ids
//!   outside the vocabulary (prompt, `prior_output_ids`, `logit_bias` or `stop_token_ids`) are rejected;
//! - a `logit_bias` value outside [-100, 100] and `min_tokens` > `max_tokens` are rejected;
//! - an invalid `structured` grammar is rejected naming `structured_output.<kind>`
//!   (checked when the grammar is compiled, in `EngineHandle::submit`).

use super::sampler::SamplingConfig;
use prism_ids::RequestId;
use std::time::Instant;

/// Most choices (`n`) per request.
pub const MAX_N: u32 = 128;
/// Most top-logprob alternatives per token (OpenAI's limit).
pub const MAX_LOGPROBS: u32 = 20;
/// Longest accepted `cache_salt`, in bytes.
pub const MAX_CACHE_SALT_BYTES: usize = 256;

/// One chat message, rendered through the model's chat template.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChatMessage {
    /// "system", "user", "assistant", "tool", ...
    pub role: String,
    /// Message text.
    pub content: String,
    /// Tools an assistant turn called (OpenAI's `message.tool_calls`), for the template.
    pub tool_calls: Vec<ToolCall>,
    /// Role "tool": the id of the call this message answers.
    pub tool_call_id: Option<String>,
    /// The participant's or tool's name.
    pub name: Option<String>,
}

/// A function call an assistant turn made.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolCall {
    /// Call id (`call_...`).
    pub id: String,
    /// Function name.
    pub name: String,
    /// JSON text of the arguments object.
    pub arguments: String,
}

/// A grammar the output must follow (token masks from llguidance, applied before sampling).
#[derive(Clone, Debug, PartialEq)]
pub enum StructuredOutput {
    /// One JSON value valid against this JSON Schema (JSON text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// The whole output matches this regular expression.
    Regex(String),
    /// The output is exactly one of these strings.
    Choice(Vec<String>),
    /// A context-free grammar in llguidance's Lark syntax.
    Grammar(String),
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
    /// Added to these tokens' logits before sampling (OpenAI's `logit_bias`, each in [-100, 100]).
    pub logit_bias: Vec<(u32, f32)>,
    /// EOS and stop token ids are masked until this many tokens were generated.
    pub min_tokens: u32,
    /// A matched stop string is kept at the end of the text.
    pub include_stop_str_in_output: bool,
    /// Constrains the output to a grammar; `None` = free text.
    pub structured: Option<StructuredOutput>,
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
            logit_bias: Vec::new(),
            min_tokens: 0,
            include_stop_str_in_output: false,
            structured: None,
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
    /// Prefix-cache isolation (vLLM's `cache_salt`): cached blocks are shared only between
    /// requests with equal salts; `None` = the shared namespace. Not empty, at most
    /// [`MAX_CACHE_SALT_BYTES`] bytes.
    pub cache_salt: Option<String>,
    /// OpenAI tool definitions (JSON array text) for the chat template's `tools` variable;
    /// chat prompts only.
    pub tools: Option<String>,
    /// vLLM's `chat_template_kwargs` (JSON object text): each entry an extra variable of the
    /// chat template (e.g. `enable_thinking`), never replacing a standard one
    /// ([`crate::model::chat_template::RESERVED_TEMPLATE_NAMES`]); chat prompts only.
    pub chat_template_kwargs: Option<String>,
}

/// Why a choice ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// `max_tokens` reached or the context window full.
    Length,
    /// Aborted (deadline, engine shutdown), or failed (the output's `error` says why).
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
    /// Prompt tokens of choice 0 whose KV came from the prefix cache at its first
    /// scheduling (OpenAI's `usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: u32,
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
    /// Why the choice failed after the request was accepted (its last output, with
    /// `finish_reason` `Abort`): e.g. its grammar exceeded llguidance's limits mid-way. Servers
    /// end the request with this error instead of a finish reason.
    pub error: Option<EngineError>,
    /// Set on the request's last output.
    pub usage: Option<Usage>,
    /// Prompt length in tokens (every output carries it).
    pub prompt_tokens: u32,
}

/// Engine errors, classified where the cause is known; mapped to gRPC/HTTP in one place
/// per service (`InvalidRequest` → INVALID_ARGUMENT/400, `Overloaded` → RESOURCE_EXHAUSTED/429,
/// `Unavailable` → UNAVAILABLE/503, `Internal` → INTERNAL/500).
#[derive(Clone, Debug, thiserror::Error)]
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

fn invalid(field: &'static str, message: String) -> EngineError {
    EngineError::InvalidRequest { field, message }
}

impl SamplingParams {
    /// Checks every parameter; returns the sampler settings.
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] naming the first offending field.
    pub fn validate(&self) -> Result<SamplingConfig, EngineError> {
        let t = self.temperature;
        if !(t >= 0.0 && t.is_finite()) {
            return Err(invalid("temperature", format!("temperature must be >= 0, got {t}")));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(invalid("top_p", format!("top_p must be in (0, 1], got {p}")));
        }
        if self.top_k < -1 {
            return Err(invalid("top_k", format!("top_k must be -1 (disabled) or >= 0, got {}", self.top_k)));
        }
        let m = self.min_p;
        if !(0.0..=1.0).contains(&m) {
            return Err(invalid("min_p", format!("min_p must be in [0, 1], got {m}")));
        }
        let rp = self.repetition_penalty;
        if !(rp > 0.0 && rp.is_finite()) {
            return Err(invalid("repetition_penalty", format!("repetition_penalty must be > 0, got {rp}")));
        }
        for (field, v) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(invalid(field, format!("{field} must be in [-2, 2], got {v}")));
            }
        }
        if let Some(mt) = self.max_tokens
            && mt < 1
        {
            return Err(invalid("max_tokens", format!("max_tokens must be at least 1, got {mt}")));
        }
        if self.n == 0 || self.n > MAX_N {
            return Err(invalid("n", format!("n must be in [1, {MAX_N}], got {}", self.n)));
        }
        if let Some(k) = self.logprobs
            && k > MAX_LOGPROBS
        {
            return Err(invalid("logprobs", format!("logprobs must be <= {MAX_LOGPROBS}, got {k}")));
        }
        if self.stop.iter().any(String::is_empty) {
            return Err(invalid("stop", "stop strings must not be empty".to_owned()));
        }
        if let Some(&(token, bias)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(invalid(
                "logit_bias",
                format!("logit_bias values must be in [-100, 100], got {bias} for token {token}"),
            ));
        }
        if let Some(mt) = self.max_tokens
            && i64::from(self.min_tokens) > mt
        {
            return Err(invalid(
                "min_tokens",
                format!("min_tokens ({}) must be at most max_tokens ({mt})", self.min_tokens),
            ));
        }
        Ok(SamplingConfig {
            temperature: t,
            top_k: usize::try_from(self.top_k).unwrap_or(0),
            top_p: p,
            min_p: m,
            repetition_penalty: rp,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            logprobs: self.logprobs.map(|k| k as usize),
        })
    }
}

/// Checks that every id is in the vocabulary.
///
/// # Errors
/// [`EngineError::InvalidRequest`] naming `field` and the first bad id.
pub fn check_token_ids(ids: &[u32], vocab_size: usize, field: &'static str) -> Result<(), EngineError> {
    match ids.iter().find(|&&t| t as usize >= vocab_size) {
        Some(bad) => Err(invalid(field, format!("token id {bad} is outside the vocabulary (size {vocab_size})"))),
        None => Ok(()),
    }
}

/// Checks prompt and generation lengths against the context window and returns how many
/// tokens the request may generate in total (`prior_len` included).
///
/// # Errors
/// [`EngineError::InvalidRequest`]: empty prompt (`prompt`), prompt too long for the
/// window (`prompt`), prompt + `max_tokens` over the window (`max_tokens`), or
/// `prior_len` already at the limit (`prior_output_ids`).
pub fn check_lengths(
    prompt_len: usize,
    prior_len: usize,
    max_tokens: Option<i64>,
    max_model_len: usize,
) -> Result<usize, EngineError> {
    if prompt_len == 0 {
        return Err(invalid("prompt", "prompt is empty".to_owned()));
    }
    if prompt_len >= max_model_len {
        return Err(invalid(
            "prompt",
            format!(
                "this model's maximum context length is {max_model_len} tokens, but the prompt has \
                 {prompt_len} tokens, leaving no room to generate"
            ),
        ));
    }
    let room = max_model_len - prompt_len;
    let max_new = match max_tokens {
        None => room,
        Some(mt) => {
            let mt = usize::try_from(mt).unwrap_or(0);
            if mt > room {
                return Err(invalid(
                    "max_tokens",
                    format!(
                        "this model's maximum context length is {max_model_len} tokens; {} tokens were \
                         requested ({prompt_len} in the prompt, {mt} for the completion)",
                        prompt_len + mt
                    ),
                ));
            }
            mt
        }
    };
    if prior_len >= max_new {
        return Err(invalid(
            "prior_output_ids",
            format!("{prior_len} tokens were already generated; the limit is {max_new}"),
        ));
    }
    Ok(max_new)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(r: Result<SamplingConfig, EngineError>) -> &'static str {
        match r {
            Err(EngineError::InvalidRequest { field, .. }) => field,
            other => panic!("expected InvalidRequest, got {other:?}"),
        }
    }

    #[test]
    fn each_bad_parameter_names_its_field() {
        let ok = SamplingParams::default();
        assert!(ok.validate().is_ok());
        let cases: Vec<(SamplingParams, &str)> = vec![
            (SamplingParams { temperature: -0.1, ..ok.clone() }, "temperature"),
            (SamplingParams { temperature: f32::NAN, ..ok.clone() }, "temperature"),
            (SamplingParams { top_p: 0.0, ..ok.clone() }, "top_p"),
            (SamplingParams { top_p: 1.01, ..ok.clone() }, "top_p"),
            (SamplingParams { top_k: -2, ..ok.clone() }, "top_k"),
            (SamplingParams { min_p: 1.5, ..ok.clone() }, "min_p"),
            (SamplingParams { repetition_penalty: 0.0, ..ok.clone() }, "repetition_penalty"),
            (SamplingParams { frequency_penalty: 2.5, ..ok.clone() }, "frequency_penalty"),
            (SamplingParams { presence_penalty: -3.0, ..ok.clone() }, "presence_penalty"),
            (SamplingParams { max_tokens: Some(0), ..ok.clone() }, "max_tokens"),
            (SamplingParams { max_tokens: Some(-1), ..ok.clone() }, "max_tokens"),
            (SamplingParams { n: 0, ..ok.clone() }, "n"),
            (SamplingParams { logprobs: Some(21), ..ok.clone() }, "logprobs"),
            (SamplingParams { stop: vec![String::new()], ..ok.clone() }, "stop"),
            (SamplingParams { logit_bias: vec![(3, 100.5)], ..ok.clone() }, "logit_bias"),
            (SamplingParams { logit_bias: vec![(3, 1.0), (4, -101.0)], ..ok.clone() }, "logit_bias"),
            (SamplingParams { logit_bias: vec![(3, f32::NAN)], ..ok.clone() }, "logit_bias"),
            (SamplingParams { min_tokens: 9, max_tokens: Some(8), ..ok.clone() }, "min_tokens"),
        ];
        let edge = SamplingParams {
            logit_bias: vec![(1, -100.0), (2, 100.0)],
            min_tokens: 8,
            max_tokens: Some(8),
            ..ok.clone()
        };
        assert!(edge.validate().is_ok());
        for (p, f) in cases {
            assert_eq!(field(p.validate()), f, "{p:?}");
        }
        let c = SamplingParams { top_k: -1, logprobs: Some(20), ..ok }.validate().expect("valid");
        assert_eq!((c.top_k, c.logprobs), (0, Some(20)));
    }

    #[test]
    fn lengths_against_the_window() {
        let f = |r: Result<usize, EngineError>| match r {
            Err(EngineError::InvalidRequest { field, .. }) => field,
            other => panic!("expected InvalidRequest, got {other:?}"),
        };
        assert_eq!(f(check_lengths(0, 0, None, 100)), "prompt");
        assert_eq!(f(check_lengths(100, 0, None, 100)), "prompt");
        assert_eq!(f(check_lengths(90, 0, Some(11), 100)), "max_tokens");
        assert_eq!(check_lengths(90, 0, Some(10), 100).ok(), Some(10));
        assert_eq!(check_lengths(90, 0, None, 100).ok(), Some(10));
        assert_eq!(f(check_lengths(10, 5, Some(5), 100)), "prior_output_ids");
        assert_eq!(check_lengths(10, 4, Some(5), 100).ok(), Some(5));
        assert!(check_token_ids(&[1, 2, 9], 10, "prompt").is_ok());
        assert!(check_token_ids(&[1, 10], 10, "prompt").is_err());
    }
}
