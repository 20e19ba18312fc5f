//! Tools for chat templates that do not know them. A template that never reads `tools`
//! (ChatML templates such as SmolLM2's print only role and content) would drop the request's
//! tool definitions and the calls of earlier turns, so [`fold`] writes them into the
//! messages in the Hermes format (the one Qwen 2.5 and Hermes 2 Pro templates render, and
//! the router's `hermes` tool-call parser reads):
//!
//! - the tool description (each tool object as JSON inside `<tools></tools>`, then how to
//!   call one) ends the system message; without a system message it becomes one;
//! - an assistant turn's `tool_calls` follow its content, one
//!   `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` each;
//! - a `tool` message's content is wrapped in `<tool_response>\n...\n</tool_response>`.

use minijinja::Value;

use super::{json_value, python_json};
use crate::request::ChatMessage;

/// The instructions after the tool list (Hermes / Qwen 2.5 wording).
const CALL_FORMAT: &str = "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

/// The system-message text describing `tools` (OpenAI tool objects, written as the
/// Qwen 2.5 template writes them: `tool | tojson`).
pub fn tool_description(tools: &[Value]) -> String {
    let mut s = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools {
        s.push('\n');
        s.push_str(&python_json(t));
    }
    s.push_str("\n</tools>\n\n");
    s.push_str(CALL_FORMAT);
    s
}

/// One call as the Hermes format writes it.
pub fn call_text(name: &str, arguments: &str) -> String {
    let name = python_json(&Value::from(name));
    format!("<tool_call>\n{{\"name\": {name}, \"arguments\": {}}}\n</tool_call>", python_json(&json_value(arguments)))
}

/// `messages` with `tools` (parsed JSON array; `None` = the request has none) and tool
/// calls / results written into the text, for a template that does not read `tools`.
pub fn fold(messages: &[ChatMessage], tools: Option<&[Value]>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = messages
        .iter()
        .map(|m| {
            let mut m = m.clone();
            if !m.tool_calls.is_empty() {
                let calls: Vec<String> = m.tool_calls.iter().map(|c| call_text(&c.name, &c.arguments)).collect();
                let calls = calls.join("\n");
                m.content = if m.content.is_empty() { calls } else { format!("{}\n{calls}", m.content) };
                m.tool_calls.clear();
            }
            if m.role == "tool" {
                m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
            }
            m
        })
        .collect();
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        let description = tool_description(tools);
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                first.content =
                    if first.content.is_empty() { description } else { format!("{}\n\n{description}", first.content) };
            }
            _ => out.insert(0, ChatMessage { role: "system".into(), content: description, ..Default::default() }),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ToolCall;

    #[test]
    fn folds_tools_calls_and_results() {
        let tools: Vec<Value> = serde_json::from_str(
            r#"[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]"#,
        )
        .expect("json");
        let msgs = vec![
            ChatMessage { role: "user".into(), content: "hi".into(), ..Default::default() },
            ChatMessage {
                role: "assistant".into(),
                tool_calls: vec![ToolCall { id: "call_1".into(), name: "f".into(), arguments: r#"{"a":1}"#.into() }],
                ..Default::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: "42".into(),
                tool_call_id: Some("call_1".into()),
                ..Default::default()
            },
        ];
        let out = fold(&msgs, Some(&tools));
        assert_eq!(out.len(), 4);
        assert_eq!(out[0].role, "system");
        assert!(
            out[0].content.contains(
                "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\"}}}\n</tools>"
            ),
            "{}",
            out[0].content
        );
        assert_eq!(out[2].content, "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>");
        assert!(out[2].tool_calls.is_empty());
        assert_eq!(out[3].content, "<tool_response>\n42\n</tool_response>");
        // An existing system message is extended, not replaced.
        let mut with_system = msgs.clone();
        with_system.insert(0, ChatMessage { role: "system".into(), content: "Be brief.".into(), ..Default::default() });
        let out = fold(&with_system, Some(&tools));
        assert_eq!(out.len(), 4);
        assert!(out[0].content.starts_with("Be brief.\n\n# Tools\n"), "{}", out[0].content);
        // No tools: calls and results are still written out, no system message is added.
        assert_eq!(fold(&msgs, None).len(), 3);
    }
}
