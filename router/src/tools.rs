//! Tool calling, the router's part, for both APIs (the OpenAI HTTP API maps its `tools` /
//! `tool_choice` fields onto `GenerateRequest.tools_json` / `tool_choice` first):
//!
//! - [`plan`] checks the request's tool definitions and choice, drops the tools for
//!   `tool_choice: "none"` (the worker then renders no tools and nothing is parsed), and for
//!   `"required"` or a named function constrains decoding with a grammar in the parser's
//!   format ([`grammar`]) so that the output is always a valid call.
//! - [`parse::ToolParser`] reads the calls out of the generated text, streamed or whole, in
//!   the format of [`ParserKind`]: chosen by the model's chat template ([`ParserKind::for_template`])
//!   or by the router's `--tool-call-parser` flag (vLLM's name for it).
//!
//! The worker renders the tools into the prompt with the model's chat template (the router's
//! prompt codec renders them the same way for prefix hashing).

pub mod grammar;
pub mod parse;
mod spec;

use prism_common::proto::v1::{GenerateRequest, StructuredOutput, generate_request, structured_output};
use serde_json::Value;

use crate::validate::Invalid;
pub use spec::{ParserKind, ToolSpec};

/// Longest function name and its characters (OpenAI's rule: `^[a-zA-Z0-9_-]{1,64}$`).
pub const MAX_TOOL_NAME: usize = 64;

/// The router's `--tool-call-parser`: a fixed parser, or `auto` (by chat template).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ParserChoice {
    /// By the model's chat template ([`ParserKind::for_template`]).
    #[default]
    #[value(name = "auto")]
    Auto,
    /// Always `hermes`.
    #[value(name = "hermes")]
    Hermes,
    /// Always `llama3_json`.
    #[value(name = "llama3_json")]
    Llama3Json,
}

impl ParserChoice {
    /// The parser for a model whose chat template is `template` (`None`: unknown to the router).
    pub fn resolve(self, template: Option<&str>) -> ParserKind {
        match self {
            Self::Auto => ParserKind::for_template(template),
            Self::Hermes => ParserKind::Hermes,
            Self::Llama3Json => ParserKind::Llama3Json,
        }
    }
}

/// What `tool_choice` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (`auto`, the default with tools).
    Auto,
    /// No call: tools are not rendered and nothing is parsed.
    None,
    /// At least one call (exactly one without parallel calls).
    Required,
    /// Exactly one call of this function.
    Named(String),
}

impl ToolChoice {
    /// `GenerateRequest.tool_choice`: "" / "auto", "none", "required", or a function name.
    pub fn from_proto(s: &str) -> Self {
        match s {
            "" | "auto" => Self::Auto,
            "none" => Self::None,
            "required" => Self::Required,
            name => Self::Named(name.to_owned()),
        }
    }
}

/// How a request's output is read for tool calls.
#[derive(Debug, Clone)]
pub struct ToolPlan {
    /// The output format.
    pub parser: ParserKind,
    /// Whether decoding is constrained to calls (`required` / a named function).
    pub forced: bool,
}

fn invalid(param: &'static str, message: impl Into<String>) -> Invalid {
    Invalid { param, message: message.into() }
}

/// Whether `name` is a valid function name.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TOOL_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Parses and checks `tools_json`: a JSON array of `{"type": "function", "function": {"name",
/// "description"?, "parameters"?, "strict"?}}`, names valid and distinct, `parameters` a
/// JSON object.
///
/// # Errors
/// [`Invalid`] (param `tools`) naming the element at fault.
pub fn parse_tools(tools_json: &str) -> Result<Vec<ToolSpec>, Invalid> {
    let v: Value =
        serde_json::from_str(tools_json).map_err(|e| invalid("tools", format!("tools is not valid JSON: {e}")))?;
    let Value::Array(items) = v else { return Err(invalid("tools", "tools must be a list of tool objects")) };
    let mut out: Vec<ToolSpec> = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let Some(obj) = t.as_object() else { return Err(invalid("tools", format!("tools[{i}] must be an object"))) };
        match obj.get("type").and_then(Value::as_str) {
            Some("function") => {}
            _ => return Err(invalid("tools", format!("tools[{i}].type must be \"function\""))),
        }
        let Some(f) = obj.get("function").and_then(Value::as_object) else {
            return Err(invalid("tools", format!("tools[{i}].function must be an object")));
        };
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        if !valid_name(name) {
            return Err(invalid(
                "tools",
                format!("tools[{i}].function.name must match ^[a-zA-Z0-9_-]{{1,{MAX_TOOL_NAME}}}$"),
            ));
        }
        if out.iter().any(|s| s.name == name) {
            return Err(invalid("tools", format!("tools[{i}].function.name `{name}` is given twice")));
        }
        if let Some(d) = f.get("description")
            && !(d.is_string() || d.is_null())
        {
            return Err(invalid("tools", format!("tools[{i}].function.description must be a string")));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => serde_json::json!({"type": "object"}),
            Some(p @ Value::Object(_)) => p.clone(),
            Some(_) => {
                return Err(invalid("tools", format!("tools[{i}].function.parameters must be a JSON Schema object")));
            }
        };
        out.push(ToolSpec { name: name.to_owned(), parameters });
    }
    Ok(out)
}

/// Checks the request's tools and choice and prepares it for the worker: `none` drops the
/// tools (nothing rendered, nothing parsed), `required` / a named function set a grammar.
/// `None`: the output is not parsed for calls.
///
/// # Errors
/// [`Invalid`]: `tools` malformed or on a non-chat prompt; `tool_choice` given without
/// tools, or naming a function that is not among them; `tool_choice` `required` / named
/// together with a structured output (both constrain decoding).
pub fn plan(req: &mut GenerateRequest, parser: ParserKind) -> Result<Option<ToolPlan>, Invalid> {
    let choice = ToolChoice::from_proto(&req.tool_choice);
    if req.tools_json.is_empty() {
        return match choice {
            ToolChoice::None => Ok(None),
            _ => Err(invalid("tool_choice", "tool_choice needs tools")),
        };
    }
    if !matches!(req.prompt, Some(generate_request::Prompt::Chat(_))) {
        return Err(invalid("tools", "tools are only supported for chat messages"));
    }
    let tools = parse_tools(&req.tools_json)?;
    if tools.is_empty() {
        // An empty list is no tools (clients send `tools: []`).
        req.tools_json.clear();
        return match choice {
            ToolChoice::Auto | ToolChoice::None => Ok(None),
            _ => Err(invalid("tool_choice", "tool_choice needs tools")),
        };
    }
    let chosen: Vec<ToolSpec> = match &choice {
        ToolChoice::None => {
            req.tools_json.clear();
            return Ok(None);
        }
        ToolChoice::Auto => return Ok(Some(ToolPlan { parser, forced: false })),
        ToolChoice::Required => tools,
        ToolChoice::Named(name) => match tools.into_iter().find(|t| t.name == *name) {
            Some(t) => vec![t],
            None => return Err(invalid("tool_choice", format!("tool_choice names `{name}`, which is not in tools"))),
        },
    };
    let sampling = req.sampling.get_or_insert_with(Default::default);
    if sampling.structured_output.as_ref().is_some_and(|s| s.constraint.is_some()) {
        return Err(invalid(
            "tool_choice",
            "tool_choice required or a named function cannot be combined with a structured output",
        ));
    }
    // A named function is called once; `required` once or more, once without parallel calls.
    let parallel = matches!(choice, ToolChoice::Required) && req.parallel_tool_calls != Some(false);
    let g = grammar::build(parser, &chosen, parallel);
    sampling.structured_output = Some(StructuredOutput { constraint: Some(structured_output::Constraint::Grammar(g)) });
    Ok(Some(ToolPlan { parser, forced: true }))
}

#[cfg(test)]
#[path = "tools/tests.rs"]
mod tests;
