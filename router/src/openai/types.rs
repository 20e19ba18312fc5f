//! OpenAI request bodies (completions and chat completions, with vLLM's extra sampling
//! fields) and their validation into `prism.v1` requests. Every rejection is a 400 that
//! names the field. OpenAI/vLLM parameters Prism does not implement (legacy `functions`, …)
//! are rejected by name rather than ignored; limits shared with gRPC (`n`, roles, …) are
//! checked in [`crate::validate`]. Structured outputs are mapped in [`super::structured`];
//! tools are checked again, for both APIs, in [`crate::tools::plan`].

use prism_common::proto::v1::{
    ChatMessage, ChatMessages, GenerateRequest, SamplingParams, TokenIds, ToolCall, generate_request,
};
use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;

use super::errors::ApiError;
use crate::validate::{MAX_LOGPROBS, check_request};

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopSpec {
    /// One stop string.
    One(String),
    /// Several stop strings.
    Many(Vec<String>),
}

/// Completions `prompt`: text, token ids, a list of texts or a list of id lists. A list of
/// several prompts is a batch ([`super::batch`]); `[]` is an empty id list (a 400 in
/// [`check_request`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PromptSpec {
    /// A string.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
    /// A list of strings, one prompt each.
    Texts(Vec<String>),
    /// A list of id lists, one prompt each.
    IdLists(Vec<Vec<u32>>),
}

impl PromptSpec {
    /// How many prompts this is.
    pub fn len(&self) -> usize {
        match self {
            Self::Text(_) | Self::Ids(_) => 1,
            Self::Texts(v) => v.len(),
            Self::IdLists(v) => v.len(),
        }
    }

    /// Whether this is a list of no prompts (never: `[]` is one empty id list).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Each prompt on its own (`Text` or `Ids`), in order.
    pub fn split(&self) -> Vec<PromptSpec> {
        match self {
            Self::Text(_) | Self::Ids(_) => vec![self.clone()],
            Self::Texts(v) => v.iter().cloned().map(Self::Text).collect(),
            Self::IdLists(v) => v.iter().cloned().map(Self::Ids).collect(),
        }
    }
}

/// A token id of a prompt, named by its place (`prompt[3]`, `prompt[1][3]`) when it is not one.
fn token_id(v: &Value, at: impl FnOnce() -> String) -> Result<u32, String> {
    v.as_u64()
        .and_then(|x| u32::try_from(x).ok())
        .ok_or_else(|| format!("{} must be a token id (an integer from 0 below the vocabulary size), got {v}", at()))
}

impl<'de> Deserialize<'de> for PromptSpec {
    /// Read by hand rather than `untagged`, so that a list mixing strings, ids and id lists
    /// says which entry broke the pattern instead of "did not match any variant".
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        const SHAPES: &str =
            "prompt must be a string, a list of token ids, a list of strings or a list of token-id lists";
        let items = match Value::deserialize(d)? {
            Value::String(s) => return Ok(Self::Text(s)),
            Value::Array(items) => items,
            _ => return Err(D::Error::custom(SHAPES)),
        };
        let mixed = |i: usize| {
            D::Error::custom(format!(
                "prompt[{i}] is not of the same kind as prompt[0]: {SHAPES}, not a mix (a batch holds \
                 prompts of one kind)"
            ))
        };
        match items.first() {
            None | Some(Value::Number(_)) => {
                let ids = items.iter().enumerate().map(|(i, v)| token_id(v, || format!("prompt[{i}]")));
                ids.collect::<Result<_, _>>().map(Self::Ids).map_err(D::Error::custom)
            }
            Some(Value::String(_)) => {
                let texts = items.into_iter().enumerate().map(|(i, v)| match v {
                    Value::String(s) => Ok(s),
                    _ => Err(mixed(i)),
                });
                texts.collect::<Result<_, _>>().map(Self::Texts)
            }
            Some(Value::Array(_)) => {
                let mut lists = Vec::with_capacity(items.len());
                for (i, v) in items.iter().enumerate() {
                    let Value::Array(ids) = v else { return Err(mixed(i)) };
                    let ids = ids.iter().enumerate().map(|(j, t)| token_id(t, || format!("prompt[{i}][{j}]")));
                    lists.push(ids.collect::<Result<Vec<u32>, _>>().map_err(D::Error::custom)?);
                }
                Ok(Self::IdLists(lists))
            }
            Some(_) => Err(D::Error::custom(SHAPES)),
        }
    }
}

/// `stream_options`: only with `stream: true`, as in vLLM. Keys other than `include_usage`
/// (vLLM's `continuous_usage_stats`, OpenAI's `include_obfuscation`, …) are accepted and
/// ignored, as vLLM's request models ignore unknown fields.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with `usage` (and `"usage": null` on the others).
    #[serde(default)]
    pub include_usage: Option<bool>,
    /// The other keys (ignored; kept so that a non-empty object counts as set).
    #[serde(flatten)]
    pub other: serde_json::Map<String, Value>,
}

impl StreamOptions {
    /// Whether the object says anything: vLLM refuses a non-empty `stream_options` without
    /// `stream: true` and lets `{}` pass.
    fn is_set(&self) -> bool {
        self.include_usage.is_some() || !self.other.is_empty()
    }
}

/// `max_tokens` of a `/v1/completions` request that does not send the field, as OpenAI's
/// legacy completions API and vLLM's `CompletionRequest` default it. `"max_tokens": null`
/// stays unset there, and chat completions have no default.
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: i64 = 16;

/// Reads a field that may be absent (`None`, through `#[serde(default)]`), `null`
/// (`Some(None)`) or a value (`Some(Some(v))`): `max_tokens` means different things when
/// absent and when `null` on completions.
fn present<'de, D, T>(d: D) -> Result<Option<Option<T>>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// Sampling fields shared by both endpoints (OpenAI + vLLM extras).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    /// Tokens to generate: `None` when the field is absent, `Some(None)` for `null` (unset:
    /// until EOS or the context limit). An absent one is [`COMPLETIONS_DEFAULT_MAX_TOKENS`]
    /// on completions and unset on chat ([`SamplingFields::to_proto`]).
    #[serde(default, deserialize_with = "present")]
    pub max_tokens: Option<Option<i64>>,
    /// OpenAI's newer name of `max_tokens`: when both are set it wins, as in vLLM
    /// (`max_completion_tokens or max_tokens`).
    pub max_completion_tokens: Option<i64>,
    /// 0 = greedy.
    pub temperature: Option<f32>,
    /// Nucleus sampling.
    pub top_p: Option<f32>,
    /// -1/0 = off.
    pub top_k: Option<i32>,
    /// Min-p sampling.
    pub min_p: Option<f32>,
    /// Seed for reproducible sampling.
    pub seed: Option<i64>,
    /// vLLM repetition penalty (> 0).
    pub repetition_penalty: Option<f32>,
    /// [-2, 2].
    pub frequency_penalty: Option<f32>,
    /// [-2, 2].
    pub presence_penalty: Option<f32>,
    /// Stop strings.
    pub stop: Option<StopSpec>,
    /// Stop token ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Keep generating past EOS.
    pub ignore_eos: Option<bool>,
    /// Drop special tokens from text (default true).
    pub skip_special_tokens: Option<bool>,
    /// Choices per prompt.
    pub n: Option<u32>,
    /// Stream as server-sent events.
    pub stream: Option<bool>,
    /// Streaming options.
    pub stream_options: Option<StreamOptions>,
    /// Relative deadline in milliseconds (Prism extension).
    pub timeout_ms: Option<u64>,
    /// Prefix-cache isolation (vLLM's `cache_salt`): requests reuse each other's cached KV
    /// blocks only when their salts are equal; absent or `null` = the shared cache. A
    /// non-empty string of at most 256 bytes (checked in [`crate::validate`]).
    pub cache_salt: Option<String>,
    /// OpenAI's `logit_bias`: token id (a decimal string) → bias in [-100, 100], added to
    /// the token's logit before sampling. Parsed in [`logit_bias`]; ids at or above the
    /// vocabulary size are refused by the engine.
    pub logit_bias: Option<Value>,
    /// Candidates per choice; only `best_of == n` is supported.
    pub best_of: Option<u32>,
    /// vLLM's beam search: unsupported, only absent, null or `false`.
    pub use_beam_search: Option<bool>,
    /// vLLM: EOS and stop token ids are masked until this many tokens were generated
    /// (0..=max_tokens).
    pub min_tokens: Option<i64>,
    /// vLLM: keep the matched stop string at the end of the text.
    pub include_stop_str_in_output: Option<bool>,
    /// OpenAI's `{"type": "text" | "json_object" | "json_schema", ...}` ([`super::structured`]).
    pub response_format: Option<Value>,
    /// vLLM: a JSON Schema (object or JSON text) the output follows.
    pub guided_json: Option<Value>,
    /// vLLM: a regular expression the whole output matches.
    pub guided_regex: Option<Value>,
    /// vLLM: the output is one of these strings.
    pub guided_choice: Option<Value>,
    /// vLLM: a context-free grammar (llguidance Lark) the output follows.
    pub guided_grammar: Option<Value>,
    /// vLLM: `{json | regex | choice | grammar | json_object}`, one of them.
    pub structured_outputs: Option<Value>,
    /// Tool definitions (chat only; checked in [`crate::tools::parse_tools`]).
    pub tools: Option<Value>,
    /// Legacy function calling is unsupported: only absent, null or an empty list.
    pub functions: Option<Value>,
    /// `auto`, `none`, `required` or `{"type": "function", "function": {"name"}}` (chat only).
    pub tool_choice: Option<Value>,
    /// Whether the model may call several tools in one turn (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Legacy: only absent, null or `"none"`.
    pub function_call: Option<Value>,
}

/// `POST /v1/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    /// Served model name.
    pub model: String,
    /// The prompt.
    pub prompt: PromptSpec,
    /// Sampling and streaming fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Number of top alternatives per token (0..=20).
    pub logprobs: Option<u32>,
    /// The prompt's text precedes the output (`text`; the first chunk of each choice when
    /// streamed). With `max_tokens: 0` only the prompt is returned, as in vLLM.
    pub echo: Option<bool>,
    /// Text after the completion (unsupported: only absent, null or empty).
    pub suffix: Option<Value>,
    /// Chat-only fields, refused here (only absent or null) rather than ignored: a prompt is
    /// not rendered with a chat template.
    pub chat_template: Option<Value>,
    /// See `chat_template`.
    pub chat_template_kwargs: Option<Value>,
}

/// One chat message.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessageIn {
    /// system, user, assistant, developer or tool.
    pub role: String,
    /// A string or a non-empty list of `{"type": "text", "text": …}` parts; missing or
    /// `null` only on assistant turns (read as empty). Checked in [`ChatMessageIn::text`].
    pub content: Option<Value>,
    /// Assistant turns: the calls it made, `[{id, type: "function", function: {name, arguments}}]`.
    pub tool_calls: Option<Value>,
    /// Role `tool`: the id of the call this message answers. Optional, as in vLLM: a `tool`
    /// message without it is passed to the chat template as it is.
    pub tool_call_id: Option<String>,
    /// The participant's name (or, on legacy `function` results, the function's).
    pub name: Option<String>,
}

impl ChatMessageIn {
    /// The message as a proto message (text, tool calls, tool fields).
    ///
    /// # Errors
    /// 400 (`messages`) for bad content ([`ChatMessageIn::text`]) or malformed `tool_calls`
    /// (not on an assistant turn, not function calls, `arguments` not JSON text). A `tool`
    /// message without `tool_call_id` is not an error (see the body).
    pub fn to_proto(&self, i: usize) -> Result<ChatMessage, ApiError> {
        let bad = |m: String| ApiError::invalid("messages", m);
        let mut tool_calls = Vec::new();
        match &self.tool_calls {
            None | Some(Value::Null) => {}
            Some(Value::Array(calls)) if self.role == "assistant" => {
                for (j, c) in calls.iter().enumerate() {
                    let at = format!("messages[{i}].tool_calls[{j}]");
                    let id = c.get("id").and_then(Value::as_str).unwrap_or_default();
                    if c.get("type").and_then(Value::as_str).is_some_and(|t| t != "function") {
                        return Err(bad(format!("{at}.type must be \"function\"")));
                    }
                    let f = c.get("function").ok_or_else(|| bad(format!("{at}.function is required")))?;
                    let Some(name) = f.get("name").and_then(Value::as_str) else {
                        return Err(bad(format!("{at}.function.name must be a string")));
                    };
                    let arguments = match f.get("arguments") {
                        None | Some(Value::Null) => "{}".to_owned(),
                        Some(Value::String(a)) => {
                            serde_json::from_str::<Value>(a)
                                .map_err(|_| bad(format!("{at}.function.arguments must be JSON text")))?;
                            a.clone()
                        }
                        Some(_) => return Err(bad(format!("{at}.function.arguments must be a string of JSON"))),
                    };
                    tool_calls.push(ToolCall { id: id.to_owned(), name: name.to_owned(), arguments });
                }
            }
            Some(Value::Array(_)) => return Err(bad(format!("messages[{i}].tool_calls is only for assistant turns"))),
            Some(_) => return Err(bad(format!("messages[{i}].tool_calls must be a list"))),
        }
        // A tool message without `tool_call_id` is accepted, as vLLM accepts it: the template
        // gets the message without the id, and templates that do not read it render the same.
        let content = if !tool_calls.is_empty() && matches!(self.content, None | Some(Value::Null)) {
            String::new()
        } else {
            self.text(i)?
        };
        Ok(ChatMessage {
            role: self.role.clone(),
            content,
            tool_calls,
            tool_call_id: self.tool_call_id.clone(),
            name: self.name.clone(),
        })
    }

    /// The message text (parts concatenated).
    ///
    /// # Errors
    /// 400 (`messages`) for missing content on a non-assistant turn, `[]`, a part that is not
    /// a text part, or content of another JSON type.
    pub fn text(&self, i: usize) -> Result<String, ApiError> {
        let bad = |m: String| ApiError::invalid("messages", m);
        match &self.content {
            None | Some(Value::Null) if self.role == "assistant" => Ok(String::new()),
            None | Some(Value::Null) => Err(bad(format!("messages[{i}].content is required"))),
            Some(Value::String(t)) => Ok(t.clone()),
            Some(Value::Array(parts)) if parts.is_empty() => {
                Err(bad(format!("messages[{i}].content must not be an empty list")))
            }
            Some(Value::Array(parts)) => {
                let mut s = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => s.push_str(t),
                        (Some("text"), _) => {
                            return Err(bad(format!("messages[{i}].content[{j}].text must be a string")));
                        }
                        _ => return Err(bad("only text content parts are supported".to_owned())),
                    }
                }
                Ok(s)
            }
            Some(_) => Err(bad(format!("messages[{i}].content must be a string or a list of text parts"))),
        }
    }
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// Served model name.
    pub model: String,
    /// The conversation.
    pub messages: Vec<ChatMessageIn>,
    /// Sampling and streaming fields.
    #[serde(flatten)]
    pub sampling: SamplingFields,
    /// Return log probabilities of the output tokens.
    pub logprobs: Option<bool>,
    /// Alternatives per token (0..=20; needs `logprobs: true`).
    pub top_logprobs: Option<u32>,
    /// vLLM: echo the last message (unsupported when true).
    pub echo: Option<bool>,
    /// vLLM: append the assistant turn header (only `true`, the default, is supported).
    pub add_generation_prompt: Option<bool>,
    /// vLLM: continue the final assistant message (unsupported when true).
    pub continue_final_message: Option<bool>,
    /// vLLM: a chat template for this request (refused: [`template_fields`]).
    pub chat_template: Option<Value>,
    /// vLLM: extra variables for the chat template (a JSON object: [`template_fields`]).
    pub chat_template_kwargs: Option<Value>,
}

/// Refuses a request-supplied chat template, which Prism does not apply: the model's own
/// template renders every chat prompt. vLLM refuses `chat_template` too unless the server
/// trusts request templates (`--trust-request-chat-template`, off by default); silently
/// ignoring it would render another prompt than the client asked for.
///
/// `chat_template_kwargs` (vLLM's extra template variables, e.g. `{"enable_thinking":
/// false}`) becomes the proto's `chat_template_kwargs_json`: `""` for absent, `null` or `{}`,
/// else the object's JSON text. Entry names are checked with the rest of the request
/// (`validate::check_request`).
///
/// # Errors
/// 400 (`chat_template`) for any value but `null`; 400 (`chat_template_kwargs`) for anything
/// but `null` or a JSON object.
pub fn template_fields(chat_template: Option<&Value>, kwargs: Option<&Value>) -> Result<String, ApiError> {
    if chat_template.is_some_and(|t| !t.is_null()) {
        return Err(ApiError::invalid(
            "chat_template",
            "chat_template is not supported: request-supplied chat templates are not accepted, \
             the model's own chat template is used",
        ));
    }
    match kwargs {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::Object(m)) if m.is_empty() => Ok(String::new()),
        Some(v @ Value::Object(_)) => Ok(v.to_string()),
        Some(_) => Err(ApiError::invalid("chat_template_kwargs", "chat_template_kwargs must be a JSON object")),
    }
}

fn range(param: &'static str, v: Option<f32>, lo: f32, hi: f32) -> Result<(), ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) => {
            Err(ApiError::invalid(param, format!("{param} must be in [{lo}, {hi}], got {x}")))
        }
        _ => Ok(()),
    }
}

/// OpenAI's `logit_bias` map: keys are token ids as decimal strings, values numbers in
/// [-100, 100]; `null` or absent = none.
///
/// # Errors
/// 400 (`logit_bias`) naming the first bad key: not a map, a key that is not a token id, a
/// value that is not a number or is out of range.
pub fn logit_bias(v: Option<&Value>) -> Result<HashMap<u32, f32>, ApiError> {
    let bad = |m: String| ApiError::invalid("logit_bias", m);
    let map = match v {
        None | Some(Value::Null) => return Ok(HashMap::new()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(bad("logit_bias must be a map of token id to bias".to_owned())),
    };
    let mut out = HashMap::with_capacity(map.len());
    for (k, v) in map {
        let id: u32 = k
            .parse()
            .ok()
            .filter(|_| k.bytes().all(|b| b.is_ascii_digit()))
            .ok_or_else(|| bad(format!("logit_bias key {k:?} is not a token id")))?;
        let b = v.as_f64().ok_or_else(|| bad(format!("logit_bias[{k:?}] must be a number")))?;
        if !(-100.0..=100.0).contains(&b) {
            return Err(bad(format!("logit_bias[{k:?}] must be in [-100, 100], got {b}")));
        }
        out.insert(id, b as f32);
    }
    Ok(out)
}

impl SamplingFields {
    /// Validates and converts to `SamplingParams` (`logprobs`: top alternatives wanted;
    /// `echo`: `max_tokens: 0` is allowed, the prompt alone is returned; `absent_max_tokens`:
    /// the value of a `max_tokens` the body does not have, `None` = unset).
    ///
    /// # Errors
    /// 400 naming the first invalid field.
    pub fn to_proto(
        &self,
        logprobs: Option<u32>,
        echo: bool,
        absent_max_tokens: Option<i64>,
    ) -> Result<SamplingParams, ApiError> {
        if self.stream != Some(true) && self.stream_options.as_ref().is_some_and(StreamOptions::is_set) {
            return Err(ApiError::invalid("stream_options", "stream_options can only be set when stream is true"));
        }
        let (field, max_tokens) = match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => ("max_completion_tokens", Some(m)),
            (None, Some(m)) => ("max_tokens", m),
            (None, None) => ("max_tokens", absent_max_tokens),
        };
        let least = if echo { 0 } else { 1 };
        if let Some(m) = max_tokens
            && m < least
        {
            let hint = if echo { "" } else { " (0 only with echo)" };
            return Err(ApiError::invalid(field, format!("{field} must be at least {least}{hint}, got {m}")));
        }
        let min_tokens = match self.min_tokens {
            None => None,
            Some(m) if m < 0 => {
                return Err(ApiError::invalid("min_tokens", format!("min_tokens must be >= 0, got {m}")));
            }
            Some(m) if max_tokens.is_some_and(|x| m > x) => {
                let default = if self.max_tokens.is_none() && self.max_completion_tokens.is_none() {
                    ", the default when it is absent"
                } else {
                    ""
                };
                return Err(ApiError::invalid(
                    "min_tokens",
                    format!("min_tokens must be at most {field} ({}{default}), got {m}", max_tokens.unwrap_or(0)),
                ));
            }
            Some(m) => Some(
                u32::try_from(m)
                    .map_err(|_| ApiError::invalid("min_tokens", format!("min_tokens is too large: {m}")))?,
            ),
        };
        let logit_bias = logit_bias(self.logit_bias.as_ref())?;
        if let Some(t) = self.temperature
            && !(t >= 0.0 && t.is_finite())
        {
            return Err(ApiError::invalid("temperature", format!("temperature must be >= 0, got {t}")));
        }
        if let Some(p) = self.top_p
            && !(p > 0.0 && p <= 1.0)
        {
            return Err(ApiError::invalid("top_p", format!("top_p must be in (0, 1], got {p}")));
        }
        if let Some(k) = self.top_k
            && k < -1
        {
            return Err(ApiError::invalid("top_k", format!("top_k must be -1 (off) or >= 0, got {k}")));
        }
        range("min_p", self.min_p, 0.0, 1.0)?;
        range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        if let Some(r) = self.repetition_penalty
            && !(r > 0.0 && r.is_finite())
        {
            return Err(ApiError::invalid("repetition_penalty", format!("repetition_penalty must be > 0, got {r}")));
        }
        let seed = match self.seed {
            Some(s) => Some(u64::try_from(s).map_err(|_| ApiError::invalid("seed", "seed must be >= 0"))?),
            None => None,
        };
        self.check_unsupported()?;
        let n = self.n.unwrap_or(1);
        if let Some(k) = logprobs
            && k > MAX_LOGPROBS
        {
            return Err(ApiError::invalid("logprobs", format!("at most {MAX_LOGPROBS} top logprobs, got {k}")));
        }
        let stop = match &self.stop {
            None => vec![],
            Some(StopSpec::One(s)) => vec![s.clone()],
            Some(StopSpec::Many(v)) => v.clone(),
        };
        if stop.iter().any(String::is_empty) {
            return Err(ApiError::invalid("stop", "stop strings must not be empty"));
        }
        Ok(SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed,
            repetition_penalty: self.repetition_penalty,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            stop,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            max_tokens,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            n: Some(n),
            logprobs,
            skip_special_tokens: Some(self.skip_special_tokens.unwrap_or(true)),
            logit_bias,
            min_tokens,
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            structured_output: super::structured::structured(&self.structured_fields())?.map(|(s, _)| s),
        })
    }

    /// Rejects parameters Prism does not implement (OpenAI / vLLM ones that would change
    /// the output if honoured), naming each.
    fn check_unsupported(&self) -> Result<(), ApiError> {
        let unsupported = |p: &str, why: &str| ApiError::invalid(p, format!("{p} is not supported{why}"));
        if let Some(b) = self.best_of
            && b != self.n.unwrap_or(1)
        {
            return Err(unsupported("best_of", " (only best_of equal to n)"));
        }
        if self.use_beam_search == Some(true) {
            return Err(unsupported("use_beam_search", " (beam search is not implemented; outputs are sampled)"));
        }
        match &self.functions {
            None | Some(Value::Null) => {}
            Some(Value::Array(a)) if a.is_empty() => {}
            Some(_) => return Err(unsupported("functions", " (use tools)")),
        }
        match &self.function_call {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "none" => {}
            Some(_) => return Err(unsupported("function_call", " (use tool_choice)")),
        }
        Ok(())
    }

    /// The fields that may constrain the output ([`super::structured::structured`]).
    pub fn structured_fields(&self) -> super::structured::StructuredFields<'_> {
        super::structured::StructuredFields {
            response_format: self.response_format.as_ref(),
            guided_json: self.guided_json.as_ref(),
            guided_regex: self.guided_regex.as_ref(),
            guided_choice: self.guided_choice.as_ref(),
            guided_grammar: self.guided_grammar.as_ref(),
            structured_outputs: self.structured_outputs.as_ref(),
        }
    }

    /// `tools` as JSON text (`""` for none) and `tool_choice` as the proto string.
    ///
    /// # Errors
    /// 400 (`tools`) when it is not a list; (`tool_choice`) for a value that is not `auto`,
    /// `none`, `required` or a function object with a name.
    pub fn tools_proto(&self) -> Result<(String, String), ApiError> {
        let tools = match &self.tools {
            None | Some(Value::Null) => String::new(),
            Some(t @ Value::Array(_)) => t.to_string(),
            Some(_) => return Err(ApiError::invalid("tools", "tools must be a list of tool objects")),
        };
        let bad_choice = || {
            ApiError::invalid(
                "tool_choice",
                "tool_choice must be auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            )
        };
        let choice = match &self.tool_choice {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) if matches!(s.as_str(), "auto" | "none" | "required") => s.clone(),
            Some(Value::Object(o)) => {
                if o.get("type").and_then(Value::as_str).is_some_and(|t| t != "function") {
                    return Err(bad_choice());
                }
                let name = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str);
                match name {
                    Some(n) if crate::tools::valid_name(n) => n.to_owned(),
                    _ => return Err(bad_choice()),
                }
            }
            Some(_) => return Err(bad_choice()),
        };
        Ok((tools, choice))
    }

    /// Whether the client asked for a usage chunk at the end of the stream.
    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false)
    }
}

impl CompletionRequest {
    /// Validates and converts to a `GenerateRequest` of its one prompt (a batch is split into
    /// requests of one prompt each first: [`super::batch`]).
    ///
    /// # Errors
    /// 400 naming the invalid field; `prompt` for a list of several prompts.
    pub fn to_proto(&self) -> Result<GenerateRequest, ApiError> {
        let echo = self.echo == Some(true);
        match &self.suffix {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s.is_empty() => {}
            Some(_) => return Err(ApiError::invalid("suffix", "suffix is not supported")),
        }
        for (field, value) in
            [("chat_template", &self.chat_template), ("chat_template_kwargs", &self.chat_template_kwargs)]
        {
            if value.as_ref().is_some_and(|v| !v.is_null()) {
                return Err(ApiError::invalid(
                    field,
                    format!(
                        "{field} applies to chat messages only (/v1/chat/completions); a completion prompt is not rendered with a chat template"
                    ),
                ));
            }
        }
        let prompt = match &self.prompt {
            PromptSpec::Text(t) => generate_request::Prompt::Text(t.clone()),
            PromptSpec::Ids(ids) => generate_request::Prompt::TokenIds(TokenIds { ids: ids.clone() }),
            PromptSpec::Texts(v) if v.len() == 1 => generate_request::Prompt::Text(v[0].clone()),
            PromptSpec::IdLists(v) if v.len() == 1 => {
                generate_request::Prompt::TokenIds(TokenIds { ids: v[0].clone() })
            }
            p => return Err(ApiError::invalid("prompt", format!("a list of {} prompts is not one prompt", p.len()))),
        };
        let (tools, choice) = self.sampling.tools_proto()?;
        if !tools.is_empty() && tools != "[]" {
            return Err(ApiError::invalid("tools", "tools are only supported on /v1/chat/completions"));
        }
        if !choice.is_empty() && choice != "none" {
            return Err(ApiError::invalid("tool_choice", "tool_choice is only supported on /v1/chat/completions"));
        }
        let req = GenerateRequest {
            model: self.model.clone(),
            prompt: Some(prompt),
            sampling: Some(self.sampling.to_proto(self.logprobs, echo, Some(COMPLETIONS_DEFAULT_MAX_TOKENS))?),
            request_id: String::new(),
            timeout_ms: self.sampling.timeout_ms,
            cache_salt: self.sampling.cache_salt.clone(),
            echo,
            ..Default::default()
        };
        check_request(&req)?;
        Ok(req)
    }
}

impl ChatRequest {
    /// Validates and converts to a `GenerateRequest` (chat messages, rendered by the worker).
    ///
    /// # Errors
    /// 400 naming the invalid field.
    pub fn to_proto(&self) -> Result<GenerateRequest, ApiError> {
        if self.echo == Some(true) {
            return Err(ApiError::invalid("echo", "echo is not supported"));
        }
        if self.add_generation_prompt == Some(false) {
            return Err(ApiError::invalid("add_generation_prompt", "add_generation_prompt: false is not supported"));
        }
        if self.continue_final_message == Some(true) {
            return Err(ApiError::invalid("continue_final_message", "continue_final_message is not supported"));
        }
        let chat_template_kwargs_json =
            template_fields(self.chat_template.as_ref(), self.chat_template_kwargs.as_ref())?;
        if self.top_logprobs.is_some() && self.logprobs != Some(true) {
            return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs: true"));
        }
        if let Some(k) = self.top_logprobs
            && k > MAX_LOGPROBS
        {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("top_logprobs must be at most {MAX_LOGPROBS}, got {k}"),
            ));
        }
        let mut messages = Vec::with_capacity(self.messages.len());
        for (i, m) in self.messages.iter().enumerate() {
            messages.push(m.to_proto(i)?);
        }
        let (tools_json, tool_choice) = self.sampling.tools_proto()?;
        let logprobs = (self.logprobs == Some(true)).then(|| self.top_logprobs.unwrap_or(0));
        let req = GenerateRequest {
            model: self.model.clone(),
            prompt: Some(generate_request::Prompt::Chat(ChatMessages { messages })),
            sampling: Some(self.sampling.to_proto(logprobs, false, None)?),
            request_id: String::new(),
            timeout_ms: self.sampling.timeout_ms,
            cache_salt: self.sampling.cache_salt.clone(),
            tools_json,
            tool_choice,
            parallel_tool_calls: self.sampling.parallel_tool_calls,
            chat_template_kwargs_json,
            ..Default::default()
        };
        check_request(&req)?;
        Ok(req)
    }
}

#[cfg(test)]
#[path = "types_tests.rs"]
mod tests;
