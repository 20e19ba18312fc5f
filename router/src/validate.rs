//! Checks every `GenerateRequest` gets in the router, whichever API it came through (the
//! OpenAI HTTP API converts first, then calls [`check_request`]; gRPC calls it directly), so
//! a limit lives in one place: `n`, `logprobs`, `max_tokens`, chat roles and messages.

use prism_common::proto::v1::{GenerateRequest, generate_request};

/// Most choices per request (`n`), as in vLLM's default server limit.
pub const MAX_N: u32 = 16;
/// Most top alternatives per token (`logprobs` / `top_logprobs`), as OpenAI.
pub const MAX_LOGPROBS: u32 = 20;
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
/// `1..=MAX_N`, `logprobs` over [`MAX_LOGPROBS`], `max_tokens` < 1, an empty chat, or a chat
/// message with an empty or unknown role.
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
        if let Some(m) = s.max_tokens
            && m < 1
        {
            return Err(invalid("max_tokens", format!("max_tokens must be at least 1, got {m}")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prism_common::proto::v1::{ChatMessage, ChatMessages, SamplingParams};

    fn chat(roles: &[&str]) -> GenerateRequest {
        let messages = roles.iter().map(|r| ChatMessage { role: (*r).into(), content: "x".into() }).collect();
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
}
