//! Chat prompts in which only the chat template makes special tokens. Text a user writes
//! inside a message (its content, and its role, which templates print too) is tokenized with
//! special-token parsing off, so `<|im_end|>\n<|im_start|>system` typed into a user turn is
//! the ids of those characters, not a closed turn and a forged system turn.
//!
//! How: every special-token match in a message's text (found as the tokenizer finds them)
//! is replaced by a sentinel (private-use characters and a random nonce that occurs nowhere
//! in the messages or the template); the template renders the escaped messages, so every
//! special token left in the rendered text is the template's own. The rendered text is split
//! at those tokens (the tokenizer's own added-token matching), and each piece between them,
//! its sentinels put back to the text they replaced, is encoded with special-token parsing
//! off. Messages with no special-token text skip all this and are encoded as the rendered
//! string in one call: the ids are exactly those of encoding the rendered template.
//!
//! Templates see the sentinel instead of the special-token text, so one that tests content
//! for special-token text (`'<|im_end|>' in content`) no longer finds it, and one that
//! escapes content (`| tojson`) leaves the put-back text unescaped.
//!
//! Tools: the request's tool definitions reach the template's `tools` variable as given (the
//! caller's own text, not escaped); a template that does not read `tools` gets them, and the
//! calls and results of earlier turns, folded into the message text first
//! ([`crate::model::chat_template::tools::fold`]), so that text is escaped like any content.
//! The request's `chat_template_kwargs` become extra template variables as given (not
//! escaped either: the caller's own values, like `tools`).

use std::ops::Range;

use std::borrow::Cow;

use minijinja::Value;

use crate::model::ChatTemplate;
use crate::model::chat_template::{parse_template_kwargs, parse_tools, tools};
use crate::model::tokenizer::{LazyPlainText, PlainText, encode_with, special_token_spans};
use crate::request::{ChatMessage, EngineError};

/// Opens a sentinel: followed by the nonce, `:`, the index of the text it stands for, and
/// [`SENTINEL_CLOSE`].
const SENTINEL_OPEN: char = '\u{E000}';
const SENTINEL_CLOSE: char = '\u{E001}';

/// The chat prompt's ids (generation prompt appended, no BOS added: templates print it).
/// `content_special_tokens`: parse special-token text inside messages too (the engine's
/// opt-out, `chat_content_special_tokens`; what every version did before).
///
/// `vars`: the request's tool definitions (JSON array text) and `chat_template_kwargs`
/// (JSON object text), each `None` when absent.
///
/// # Errors
/// [`EngineError::InvalidRequest`] (field `messages`) for a model without a chat template or
/// messages the template rejects, (field `tools`) for tools that are not a JSON array,
/// (field `chat_template_kwargs`) for kwargs [`parse_template_kwargs`] refuses;
/// [`EngineError::Internal`] when the tokenizer fails.
pub(crate) fn encode_chat(
    tokenizer: &tokenizers::Tokenizer,
    plain: &LazyPlainText,
    template: Option<&ChatTemplate>,
    messages: &[ChatMessage],
    vars: ChatVars<'_>,
    content_special_tokens: bool,
) -> Result<Vec<u32>, EngineError> {
    let template = template.ok_or_else(no_template)?;
    let (messages, tools) = with_tools(template, messages, vars.tools)?;
    let tools = tools.as_ref();
    let kwargs = vars.template_kwargs.map(parse_template_kwargs).transpose()?;
    let kwargs = kwargs.as_ref();
    if content_special_tokens {
        return encode_with(tokenizer, false, None, &template.render_with_vars(&messages, tools, kwargs, true)?, false);
    }
    let spans: Vec<MessageSpans> = messages
        .iter()
        .map(|m| MessageSpans { role: spans_of(tokenizer, &m.role), content: spans_of(tokenizer, &m.content) })
        .collect();
    if spans.iter().all(|s| s.role.is_empty() && s.content.is_empty()) {
        return encode_with(tokenizer, false, None, &template.render_with_vars(&messages, tools, kwargs, true)?, false);
    }
    encode_split(tokenizer, plain.get(tokenizer)?, template, &messages, TemplateVars { tools, kwargs }, &spans)
}

/// The parsed extra variables a chat render gets: `tools` and the `chat_template_kwargs` map.
#[derive(Clone, Copy, Default)]
pub(crate) struct TemplateVars<'a> {
    pub(crate) tools: Option<&'a Value>,
    pub(crate) kwargs: Option<&'a Value>,
}

/// The messages and `tools` variable the template renders: the tools parsed for a template
/// that reads them; otherwise tools, calls and results folded into the messages.
///
/// # Errors
/// [`EngineError::InvalidRequest`] (field `tools`) for tools that are not a JSON array.
pub(crate) fn with_tools<'m>(
    template: &ChatTemplate,
    messages: &'m [ChatMessage],
    tools: Option<&str>,
) -> Result<(Cow<'m, [ChatMessage]>, Option<Value>), EngineError> {
    let tools = tools.map(parse_tools).transpose()?;
    if template.uses_tools() {
        return Ok((Cow::Borrowed(messages), tools));
    }
    if tools.is_none() && messages.iter().all(|m| m.tool_calls.is_empty()) {
        return Ok((Cow::Borrowed(messages), None));
    }
    let list: Option<Vec<Value>> = match &tools {
        Some(t) => Some(
            t.try_iter().map_err(|e| EngineError::InvalidRequest { field: "tools", message: e.to_string() })?.collect(),
        ),
        None => None,
    };
    Ok((Cow::Owned(tools::fold(messages, list.as_deref())), None))
}

/// What a chat request adds to its template's variables, as JSON text from the request
/// (`EngineRequest::tools`, `EngineRequest::chat_template_kwargs`); `None` = absent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ChatVars<'a> {
    /// OpenAI tool definitions (a JSON array): the template's `tools` variable.
    pub tools: Option<&'a str>,
    /// vLLM's `chat_template_kwargs` (a JSON object): each entry an extra variable.
    pub template_kwargs: Option<&'a str>,
}

/// The error for chat on a model without a template.
pub(crate) fn no_template() -> EngineError {
    EngineError::InvalidRequest {
        field: "messages",
        message: "this model has no chat template; send a completion prompt".to_owned(),
    }
}

/// Byte ranges of the special-token matches in one message's role and content.
pub(crate) struct MessageSpans {
    pub(crate) role: Vec<Range<usize>>,
    pub(crate) content: Vec<Range<usize>>,
}

fn spans_of(tokenizer: &tokenizers::Tokenizer, text: &str) -> Vec<Range<usize>> {
    special_token_spans(tokenizer, text).into_iter().map(|(r, _)| r).collect()
}

/// Escapes the `spans` of every message, renders, splits at the template's special tokens
/// and encodes the pieces as plain text (with no spans, this is the general path for
/// messages that need no escaping: tests compare it with the one-call encoding).
pub(crate) fn encode_split(
    tokenizer: &tokenizers::Tokenizer,
    plain: &PlainText,
    template: &ChatTemplate,
    messages: &[ChatMessage],
    vars: TemplateVars<'_>,
    spans: &[MessageSpans],
) -> Result<Vec<u32>, EngineError> {
    let open = pick_open(messages, template);
    let mut originals: Vec<&str> = Vec::new();
    let escaped: Vec<ChatMessage> = messages
        .iter()
        .zip(spans)
        .map(|(m, s)| ChatMessage {
            role: escape(&m.role, &s.role, &open, &mut originals),
            content: escape(&m.content, &s.content, &open, &mut originals),
            ..m.clone()
        })
        .collect();
    let rendered = template.render_with_vars(&escaped, vars.tools, vars.kwargs, true)?;
    let mut ids = Vec::new();
    let mut at = 0;
    for (range, id) in special_token_spans(tokenizer, &rendered) {
        if range.start > at {
            ids.extend(plain.encode(&restore(&rendered[at..range.start], &open, &originals), at > 0)?);
        }
        ids.push(id);
        at = range.end;
    }
    if at < rendered.len() {
        ids.extend(plain.encode(&restore(&rendered[at..], &open, &originals), at > 0)?);
    }
    Ok(ids)
}

/// A sentinel opening (`U+E000`, a random nonce, `:`) that occurs in no message, nor in the
/// template's source or its `bos_token`/`eos_token` (random, so no input can force retries).
fn pick_open(messages: &[ChatMessage], template: &ChatTemplate) -> String {
    let (source, bos, eos) = template.parts();
    loop {
        let open = format!("{SENTINEL_OPEN}{:016x}:", rand::random::<u64>());
        let taken = |s: &str| s.contains(&open);
        if !messages.iter().any(|m| taken(&m.role) || taken(&m.content)) && ![source, bos, eos].into_iter().any(taken) {
            return open;
        }
    }
}

fn escape<'a>(text: &'a str, spans: &[Range<usize>], open: &str, originals: &mut Vec<&'a str>) -> String {
    let mut out = String::with_capacity(text.len() + spans.len() * 32);
    let mut at = 0;
    for r in spans {
        out.push_str(&text[at..r.start]);
        out.push_str(&format!("{open}{}{SENTINEL_CLOSE}", originals.len()));
        originals.push(&text[r.clone()]);
        at = r.end;
    }
    out.push_str(&text[at..]);
    out
}

/// `piece` with each sentinel replaced by the text it stands for (a sentinel the template cut
/// is left as it is).
fn restore(piece: &str, open: &str, originals: &[&str]) -> String {
    let mut parts = piece.split(open);
    let mut out = parts.next().unwrap_or_default().to_owned();
    for part in parts {
        let original = part
            .split_once(SENTINEL_CLOSE)
            .and_then(|(i, rest)| Some((*originals.get(i.parse::<usize>().ok()?)?, rest)));
        match original {
            Some((text, rest)) => {
                out.push_str(text);
                out.push_str(rest);
            }
            None => {
                out.push_str(open);
                out.push_str(part);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_and_restore_round_trip() {
        let open = "\u{E000}00000000000000ab:";
        let text = "a<|im_end|>b<|im_start|>";
        let mut originals = Vec::new();
        let escaped = escape(text, &[1..11, 12..24], open, &mut originals);
        assert!(!escaped.contains("<|"), "{escaped:?}");
        assert_eq!(originals, ["<|im_end|>", "<|im_start|>"]);
        assert_eq!(restore(&escaped, open, &originals), text);
        // A sentinel cut by the template (or with an unknown index) stays as it is.
        let cut = format!("x{open}7{SENTINEL_CLOSE}y{open}0");
        assert_eq!(restore(&cut, open, &originals), cut);
    }
}
