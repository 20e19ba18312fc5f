//! Checks every `GenerateRequest` gets in the router, whichever API it came through (the
//! OpenAI HTTP API converts first, then calls [`check_request`]; gRPC calls it directly), so
//! a limit lives in one place: `n`, `logprobs`, `max_tokens`, chat roles and messages,
//! `cache_salt`, `echo`, `logit_bias` values, `min_tokens`, `chat_template_kwargs`.

use prism_common::proto::v1::{GenerateRequest, generate_request};

/// Most choices per request (`n`), as in vLLM's default server limit.
pub const MAX_N: u32 = 16;
/// Most top alternatives per token (`logprobs` / `top_logprobs`), as OpenAI.
pub const MAX_LOGPROBS: u32 = 20;
/// Longest `cache_salt`, in bytes: the engine's limit (`prism_engine::MAX_CACHE_SALT_BYTES`,
/// repeated here because the router does not depend on the engine crate), so a salt the
/// router accepts is never refused by a worker.
pub const MAX_CACHE_SALT_BYTES: usize = 256;
/// Chat roles accepted (OpenAI's, with `developer` and `tool`).
pub const CHAT_ROLES: [&str; 5] = ["system", "user", "assistant", "developer", "tool"];

/// A rejected request: the parameter at fault (OpenAI name) and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Invalid {
    /// The parameter at fault, e.g. `n`, `messages`.
    pub param: &'static str,
    /// Human-readable reason (never contains prompt text).
    pub message: String,
}

fn invalid(param: &'static str, message: impl Into<String>) -> Invalid {
    Invalid { param, message: message.into() }
}

/// Validates a request before dispatch.
///
/// # Errors
/// [`Invalid`] naming the first bad parameter: empty model, no prompt, `n` outside
/// `1..=MAX_N`, `logprobs` over [`MAX_LOGPROBS`], `max_tokens` < 1 (0 is allowed with
/// `echo`: the prompt alone), an empty chat, a chat message with an empty or unknown role, a
/// `cache_salt` that is empty or longer than [`MAX_CACHE_SALT_BYTES`], `echo` on a chat
/// prompt, a `logit_bias` value outside [-100, 100], `min_tokens` over `max_tokens`,
/// `chat_template_kwargs_json` on a prompt that is not chat, not a JSON object, or naming a
/// standard template variable.
pub fn check_request(req: &GenerateRequest) -> Result<(), Invalid> {
    if req.model.is_empty() {
        return Err(invalid("model", "model must not be empty"));
    }
    match &req.prompt {
        None => return Err(invalid("prompt", "prompt must be set")),
        Some(generate_request::Prompt::TokenIds(t)) if t.ids.is_empty() => {
            return Err(invalid("prompt", "prompt is empty"));
        }
        Some(generate_request::Prompt::Chat(c)) => {
            if c.messages.is_empty() {
                return Err(invalid("messages", "messages must not be empty"));
            }
            for (i, m) in c.messages.iter().enumerate() {
                if m.role.is_empty() {
                    return Err(invalid("messages", format!("messages[{i}].role must not be empty")));
                }
                if !CHAT_ROLES.contains(&m.role.as_str()) {
                    return Err(invalid(
                        "messages",
                        format!("messages[{i}].role must be one of {}", CHAT_ROLES.join(", ")),
                    ));
                }
            }
        }
        Some(_) => {}
    }
    if !req.chat_template_kwargs_json.is_empty() {
        if !matches!(req.prompt, Some(generate_request::Prompt::Chat(_))) {
            return Err(invalid("chat_template_kwargs", "chat_template_kwargs applies to chat prompts only"));
        }
        // The engine's own rule (a JSON object naming no standard variable), so the router
        // refuses exactly what a replica would.
        if let Err(e) = prism_engine::model::chat_template::parse_template_kwargs(&req.chat_template_kwargs_json) {
            let message = match e {
                prism_engine::EngineError::InvalidRequest { message, .. } => message,
                e => e.to_string(),
            };
            return Err(invalid("chat_template_kwargs", message));
        }
    }
    if req.echo && matches!(req.prompt, Some(generate_request::Prompt::Chat(_))) {
        return Err(invalid("echo", "echo is supported on completion prompts (text or token ids) only"));
    }
    if let Some(salt) = &req.cache_salt {
        if salt.is_empty() {
            return Err(invalid("cache_salt", "cache_salt must not be empty (omit it for the shared prefix cache)"));
        }
        if salt.len() > MAX_CACHE_SALT_BYTES {
            return Err(invalid(
                "cache_salt",
                format!("cache_salt must be at most {MAX_CACHE_SALT_BYTES} bytes, got {}", salt.len()),
            ));
        }
    }
    if let Some(s) = &req.sampling {
        let n = s.n.unwrap_or(1);
        if !(1..=MAX_N).contains(&n) {
            return Err(invalid("n", format!("n must be in [1, {MAX_N}], got {n}")));
        }
        if let Some(k) = s.logprobs
            && k > MAX_LOGPROBS
        {
            return Err(invalid("logprobs", format!("at most {MAX_LOGPROBS} top logprobs, got {k}")));
        }
        let least = i64::from(!req.echo);
        if let Some(m) = s.max_tokens
            && m < least
        {
            return Err(invalid("max_tokens", format!("max_tokens must be at least {least}, got {m}")));
        }
        if let Some((id, b)) = s.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(*b)) {
            return Err(invalid("logit_bias", format!("logit_bias[\"{id}\"] must be in [-100, 100], got {b}")));
        }
        if let (Some(min), Some(max)) = (s.min_tokens, s.max_tokens)
            && i64::from(min) > max
        {
            return Err(invalid("min_tokens", format!("min_tokens must be at most max_tokens ({max}), got {min}")));
        }
        check_sampling(s)?;
    }
    Ok(())
}

/// The sampling ranges the OpenAI API checks while converting (the same rules and messages),
/// for requests that come through gRPC: `temperature` >= 0, `top_p` in (0, 1], `top_k` >= -1,
/// `min_p` in [0, 1], the frequency and presence penalties in [-2, 2], `repetition_penalty` > 0.
fn check_sampling(s: &prism_common::proto::v1::SamplingParams) -> Result<(), Invalid> {
    if let Some(t) = s.temperature
        && !(t >= 0.0 && t.is_finite())
    {
        return Err(invalid("temperature", format!("temperature must be >= 0, got {t}")));
    }
    if let Some(p) = s.top_p
        && !(p > 0.0 && p <= 1.0)
    {
        return Err(invalid("top_p", format!("top_p must be in (0, 1], got {p}")));
    }
    if let Some(k) = s.top_k
        && k < -1
    {
        return Err(invalid("top_k", format!("top_k must be -1 (off) or >= 0, got {k}")));
    }
    let ranges = [
        ("min_p", s.min_p, 0.0, 1.0),
        ("frequency_penalty", s.frequency_penalty, -2.0, 2.0),
        ("presence_penalty", s.presence_penalty, -2.0, 2.0),
    ];
    for (param, v, lo, hi) in ranges {
        if let Some(v) = v
            && !(lo..=hi).contains(&v)
        {
            return Err(invalid(param, format!("{param} must be in [{lo}, {hi}], got {v}")));
        }
    }
    if let Some(r) = s.repetition_penalty
        && !(r > 0.0 && r.is_finite())
    {
        return Err(invalid("repetition_penalty", format!("repetition_penalty must be > 0, got {r}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_common::proto::v1::{ChatMessage, ChatMessages, SamplingParams};

    fn chat(roles: &[&str]) -> GenerateRequest {
        let messages = roles
            .iter()
            .map(|r| ChatMessage { role: (*r).into(), content: "x".into(), ..Default::default() })
            .collect();
        GenerateRequest {
            model: "m".into(),
            prompt: Some(generate_request::Prompt::Chat(ChatMessages { messages })),
            ..Default::default()
        }
    }

    #[test]
    fn chat_roles_and_n_limit() {
        assert!(check_request(&chat(&["system", "developer", "user", "assistant", "tool"])).is_ok());
        assert_eq!(check_request(&chat(&[])).map_err(|e| e.param), Err("messages"));
        assert_eq!(check_request(&chat(&["user", ""])).map_err(|e| e.param), Err("messages"));
        assert_eq!(check_request(&chat(&["wizard"])).map_err(|e| e.param), Err("messages"));
        let mut r = chat(&["user"]);
        r.sampling = Some(SamplingParams { n: Some(MAX_N), ..Default::default() });
        assert!(check_request(&r).is_ok());
        r.sampling = Some(SamplingParams { n: Some(MAX_N + 1), ..Default::default() });
        assert_eq!(check_request(&r).map_err(|e| e.param), Err("n"));
        r.sampling = Some(SamplingParams { n: Some(0), ..Default::default() });
        assert_eq!(check_request(&r).map_err(|e| e.param), Err("n"));
    }

    /// The gRPC API's `chat_template_kwargs_json`: a JSON object on a chat prompt, naming no
    /// standard template variable.
    #[test]
    fn chat_template_kwargs_json_is_an_object_on_chat_only() {
        let with = |mut r: GenerateRequest, k: &str| {
            r.chat_template_kwargs_json = k.into();
            check_request(&r).map_err(|e| e.param)
        };
        assert_eq!(with(chat(&["user"]), r#"{"enable_thinking": false}"#), Ok(()));
        for bad in ["[]", "false", "{", r#"{"tools": []}"#, r#"{"eos_token": ""}"#] {
            assert_eq!(with(chat(&["user"]), bad), Err("chat_template_kwargs"), "{bad}");
        }
        let text = GenerateRequest {
            model: "m".into(),
            prompt: Some(generate_request::Prompt::Text("hi".into())),
            ..Default::default()
        };
        assert_eq!(with(text, r#"{"enable_thinking": false}"#), Err("chat_template_kwargs"));
    }

    /// gRPC requests get the OpenAI API's sampling ranges.
    #[test]
    fn sampling_ranges() {
        let mut r = chat(&["user"]);
        let d = SamplingParams::default;
        let bad = [
            ("temperature", SamplingParams { temperature: Some(-1.0), ..d() }),
            ("temperature", SamplingParams { temperature: Some(f32::NAN), ..d() }),
            ("top_p", SamplingParams { top_p: Some(0.0), ..d() }),
            ("top_k", SamplingParams { top_k: Some(-2), ..d() }),
            ("min_p", SamplingParams { min_p: Some(1.5), ..d() }),
            ("frequency_penalty", SamplingParams { frequency_penalty: Some(-2.5), ..d() }),
            ("presence_penalty", SamplingParams { presence_penalty: Some(2.5), ..d() }),
            ("repetition_penalty", SamplingParams { repetition_penalty: Some(0.0), ..d() }),
        ];
        for (want, s) in bad {
            r.sampling = Some(s);
            assert_eq!(check_request(&r).map_err(|e| e.param), Err(want));
        }
        r.sampling = Some(SamplingParams {
            temperature: Some(0.0),
            top_p: Some(1.0),
            top_k: Some(-1),
            min_p: Some(0.0),
            repetition_penalty: Some(1.0),
            ..Default::default()
        });
        assert!(check_request(&r).is_ok());
    }

    #[test]
    fn cache_salt_is_non_empty_and_bounded() {
        let mut r = chat(&["user"]);
        for ok in [None, Some("a".to_owned()), Some("x".repeat(MAX_CACHE_SALT_BYTES))] {
            r.cache_salt = ok;
            assert!(check_request(&r).is_ok());
        }
        // Counted in bytes: 129 two-byte characters are 258 bytes.
        for bad in [String::new(), "x".repeat(MAX_CACHE_SALT_BYTES + 1), "é".repeat(129)] {
            r.cache_salt = Some(bad);
            let e = check_request(&r).expect_err("rejected");
            assert_eq!(e.param, "cache_salt");
            assert!(e.message.starts_with("cache_salt"), "the message names the field: {}", e.message);
        }
    }

    #[test]
    fn echo_logit_bias_and_min_tokens() {
        let text = |echo, max_tokens, sampling: SamplingParams| GenerateRequest {
            model: "m".into(),
            prompt: Some(generate_request::Prompt::Text("hi".into())),
            sampling: Some(SamplingParams { max_tokens, ..sampling }),
            echo,
            ..Default::default()
        };
        let d = SamplingParams::default;
        assert!(check_request(&text(true, Some(0), d())).is_ok(), "echo alone: max_tokens 0");
        assert_eq!(check_request(&text(false, Some(0), d())).map_err(|e| e.param), Err("max_tokens"));
        assert_eq!(check_request(&text(true, Some(-1), d())).map_err(|e| e.param), Err("max_tokens"));
        let mut c = chat(&["user"]);
        c.echo = true;
        assert_eq!(check_request(&c).map_err(|e| e.param), Err("echo"));
        let bias = |b: f32| SamplingParams { logit_bias: [(5, b)].into_iter().collect(), ..d() };
        for ok in [-100.0, 0.0, 100.0] {
            assert!(check_request(&text(false, None, bias(ok))).is_ok());
        }
        for bad in [-100.5, 101.0, f32::NAN, f32::INFINITY] {
            let e = check_request(&text(false, None, bias(bad))).expect_err("out of range");
            assert_eq!(e.param, "logit_bias");
            assert!(e.message.contains("\"5\""), "names the key: {}", e.message);
        }
        let min = |m| SamplingParams { min_tokens: Some(m), ..d() };
        assert!(check_request(&text(false, Some(4), min(4))).is_ok());
        assert!(check_request(&text(false, None, min(400))).is_ok(), "no max_tokens: the engine bounds it");
        assert_eq!(check_request(&text(false, Some(4), min(5))).map_err(|e| e.param), Err("min_tokens"));
    }
}
