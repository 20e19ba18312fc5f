//! Grammars that make the output a valid call (`tool_choice: "required"` or a named
//! function), in llguidance's Lark syntax (`StructuredOutput.grammar`): the call text of the
//! parser's format with each function's `parameters` schema embedded through `%json`, so
//! the arguments are always JSON valid against it.
//!
//! The arguments are written compactly as Python's `json.dumps` would (`", "`, `": "`, no
//! other whitespace: `x-guidance` options on the embedded schema) unless the tool's schema
//! sets its own `x-guidance`; without this a small model may loop on whitespace. Objects
//! that list their properties are closed (`additionalProperties: false` unless the schema
//! says otherwise, as for `response_format` schemas), so a call carries no invented argument.
//!
//! - `hermes`: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, calls
//!   separated by `\n`.
//! - `llama3_json`: `{"name": "f", "parameters": {...}}`, calls separated by `; `.

use serde_json::Value;

use super::spec::{ParserKind, ToolSpec};

/// A Lark string literal of `text` (JSON string escapes, which Lark literals accept).
fn literal(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_default()
}

/// `schema` with compact-JSON `x-guidance` options unless it has its own, and its objects
/// closed as the engine closes a JSON schema's (no argument the schema does not name).
fn compact(schema: &Value) -> Value {
    let mut s = schema.clone();
    prism_engine::structured::close_objects(&mut s);
    if let Some(obj) = s.as_object_mut()
        && !obj.contains_key("x-guidance")
    {
        obj.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    s
}

/// The grammar of one or more calls (`parallel`: one or more; else exactly one) of the
/// functions in `tools`, in `parser`'s format.
pub fn build(parser: ParserKind, tools: &[ToolSpec], parallel: bool) -> String {
    let (open, args_key, close, sep) = match parser {
        ParserKind::Hermes => ("<tool_call>\n", "arguments", "\n</tool_call>", "\n"),
        ParserKind::Llama3Json => ("", "parameters", "", "; "),
    };
    let mut g = String::new();
    if parallel {
        g.push_str(&format!("start: call ({} call)*\n", literal(sep)));
    } else {
        g.push_str("start: call\n");
    }
    let bodies: Vec<String> = (0..tools.len()).map(|i| format!("body_{i}")).collect();
    let head = if open.is_empty() { String::new() } else { format!("{} ", literal(open)) };
    let tail = if close.is_empty() { String::new() } else { format!(" {}", literal(close)) };
    g.push_str(&format!("call: {head}({}){tail}\n", bodies.join(" | ")));
    for (i, t) in tools.iter().enumerate() {
        let prefix = format!("{{\"name\": \"{}\", \"{args_key}\": ", t.name);
        g.push_str(&format!("body_{i}: {} args_{i} \"}}\"\n", literal(&prefix)));
        let schema = serde_json::to_string(&compact(&t.parameters)).unwrap_or_default();
        g.push_str(&format!("args_{i}: %json {schema}\n"));
    }
    g
}
