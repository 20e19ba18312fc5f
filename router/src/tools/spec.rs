//! The tool-call output formats and the router's view of one offered function.

use serde_json::Value;

/// The output format tool calls are parsed from (vLLM's `--tool-call-parser` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ParserKind {
    /// `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, ChatML, Qwen).
    #[value(name = "hermes")]
    Hermes,
    /// A JSON object `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`
    /// (Llama 3.1+), several separated by `;`.
    #[value(name = "llama3_json")]
    Llama3Json,
}

impl ParserKind {
    /// The parser a chat template asks for: `<tool_call>` in it → `hermes`; the Llama 3 tool
    /// format (`<|python_tag|>`, or `"parameters"` with `<|eot_id|>`/`<|eom_id|>`) →
    /// `llama3_json`; otherwise `hermes`, the format Prism describes tools in for templates
    /// that do not render tools themselves.
    pub fn for_template(template: Option<&str>) -> Self {
        let Some(t) = template else { return Self::Hermes };
        if t.contains("<tool_call>") {
            return Self::Hermes;
        }
        let llama_turns = t.contains("<|eot_id|>") || t.contains("<|eom_id|>");
        if t.contains("<|python_tag|>") || (llama_turns && t.contains("\"parameters\"")) {
            return Self::Llama3Json;
        }
        Self::Hermes
    }
}

/// One function a request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    /// Function name.
    pub name: String,
    /// JSON Schema of its arguments (an object schema; `{"type": "object"}` when absent).
    pub parameters: Value,
}
