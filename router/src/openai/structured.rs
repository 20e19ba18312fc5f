//! Structured outputs on the OpenAI API: OpenAI's `response_format` and vLLM's
//! `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and
//! `structured_outputs` objects, mapped onto `SamplingParams.structured_output` (the
//! engine compiles the grammar: llguidance). At most one of them may constrain a request;
//! each rejection names the field as the client wrote it, and [`StructuredSource::param`]
//! names it again when the engine rejects the grammar (`structured_output.*` from the worker).
//!
//! | field | constraint |
//! |---|---|
//! | `response_format: {"type": "text"}` | none |
//! | `response_format: {"type": "json_object"}` | any JSON object |
//! | `response_format: {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}` | JSON valid against `schema` |
//! | `guided_json` (a schema object or its JSON text), `structured_outputs.json` | JSON valid against it |
//! | `guided_regex`, `structured_outputs.regex` | the whole output matches |
//! | `guided_choice`, `structured_outputs.choice` (strings) | exactly one of them |
//! | `guided_grammar`, `structured_outputs.grammar` | llguidance Lark (GBNF where convertible) |
//! | `structured_outputs.json_object: true` | any JSON object |

use prism_common::proto::v1::structured_output::Constraint;
use prism_common::proto::v1::{Choices, StructuredOutput};
use serde_json::Value;

use super::errors::ApiError;
use crate::tools::ToolPlan;

/// The request fields that may constrain the output (each `None` when absent).
#[derive(Debug, Clone, Copy, Default)]
pub struct StructuredFields<'a> {
    /// OpenAI's `response_format`.
    pub response_format: Option<&'a Value>,
    /// vLLM's `guided_json`.
    pub guided_json: Option<&'a Value>,
    /// vLLM's `guided_regex`.
    pub guided_regex: Option<&'a Value>,
    /// vLLM's `guided_choice`.
    pub guided_choice: Option<&'a Value>,
    /// vLLM's `guided_grammar`.
    pub guided_grammar: Option<&'a Value>,
    /// vLLM's `structured_outputs`.
    pub structured_outputs: Option<&'a Value>,
}

/// Which request field a structured output came from (what errors name).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StructuredSource {
    /// The OpenAI/vLLM parameter, e.g. `response_format.json_schema.schema`, `guided_regex`.
    pub param: &'static str,
}

/// A JSON Schema given as an object or as its JSON text; must be an object (or `true`).
fn schema_text(v: &Value, param: &'static str) -> Result<String, ApiError> {
    let parsed;
    let schema = match v {
        Value::String(s) => {
            parsed = serde_json::from_str::<Value>(s)
                .map_err(|e| ApiError::invalid(param, format!("{param} is not valid JSON: {e}")))?;
            &parsed
        }
        other => other,
    };
    match schema {
        Value::Object(_) | Value::Bool(true) => Ok(schema.to_string()),
        _ => Err(ApiError::invalid(param, format!("{param} must be a JSON Schema object"))),
    }
}

fn nonempty_str(v: &Value, param: &'static str) -> Result<String, ApiError> {
    match v {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        _ => Err(ApiError::invalid(param, format!("{param} must be a non-empty string"))),
    }
}

fn choices(v: &Value, param: &'static str) -> Result<Constraint, ApiError> {
    let bad = || ApiError::invalid(param, format!("{param} must be a non-empty list of strings"));
    let Value::Array(items) = v else { return Err(bad()) };
    let list: Option<Vec<String>> = items.iter().map(|c| c.as_str().map(str::to_owned)).collect();
    match list {
        Some(l) if !l.is_empty() => Ok(Constraint::Choice(Choices { choices: l })),
        _ => Err(bad()),
    }
}

/// `response_format`: `None` for text (or null).
fn response_format(v: &Value) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    const P: &str = "response_format";
    let obj = match v {
        Value::Null => return Ok(None),
        Value::Object(o) => o,
        _ => return Err(ApiError::invalid(P, "response_format must be an object with a type")),
    };
    match obj.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some((Constraint::JsonObject(true), P))),
        Some("json_schema") => {
            const JS: &str = "response_format.json_schema";
            let Some(js) = obj.get("json_schema").and_then(Value::as_object) else {
                return Err(ApiError::invalid(JS, "response_format.json_schema must be an object"));
            };
            if let Some(name) = js.get("name")
                && !name.as_str().is_some_and(crate::tools::valid_name)
            {
                return Err(ApiError::invalid(
                    "response_format.json_schema.name",
                    "response_format.json_schema.name must match ^[a-zA-Z0-9_-]{1,64}$",
                ));
            }
            if js.get("strict").is_some_and(|s| !(s.is_boolean() || s.is_null())) {
                return Err(ApiError::invalid("response_format.json_schema.strict", "strict must be a boolean"));
            }
            if js.get("description").is_some_and(|s| !(s.is_string() || s.is_null())) {
                return Err(ApiError::invalid(
                    "response_format.json_schema.description",
                    "description must be a string",
                ));
            }
            const S: &str = "response_format.json_schema.schema";
            let Some(schema) = js.get("schema") else {
                return Err(ApiError::invalid(S, "response_format.json_schema.schema is required"));
            };
            Ok(Some((Constraint::JsonSchema(schema_text(schema, S)?), S)))
        }
        Some(other) => Err(ApiError::invalid(
            "response_format.type",
            format!("response_format.type must be text, json_object or json_schema, got `{other}`"),
        )),
        None => Err(ApiError::invalid("response_format.type", "response_format.type is required")),
    }
}

/// vLLM's `structured_outputs` object: exactly one of `json`, `regex`, `choice`, `grammar`,
/// `json_object`.
fn structured_outputs(v: &Value) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    let obj = match v {
        Value::Null => return Ok(None),
        Value::Object(o) => o,
        _ => return Err(ApiError::invalid("structured_outputs", "structured_outputs must be an object")),
    };
    let mut found: Vec<(Constraint, &'static str)> = Vec::new();
    for (k, v) in obj {
        if v.is_null() {
            continue;
        }
        let c = match k.as_str() {
            "json" => (Constraint::JsonSchema(schema_text(v, "structured_outputs.json")?), "structured_outputs.json"),
            "regex" => (Constraint::Regex(nonempty_str(v, "structured_outputs.regex")?), "structured_outputs.regex"),
            "choice" => (choices(v, "structured_outputs.choice")?, "structured_outputs.choice"),
            "grammar" => {
                (Constraint::Grammar(nonempty_str(v, "structured_outputs.grammar")?), "structured_outputs.grammar")
            }
            "json_object" => match v {
                Value::Bool(true) => (Constraint::JsonObject(true), "structured_outputs.json_object"),
                Value::Bool(false) => continue,
                _ => {
                    return Err(ApiError::invalid(
                        "structured_outputs.json_object",
                        "structured_outputs.json_object must be a boolean",
                    ));
                }
            },
            other => {
                return Err(ApiError::invalid(
                    "structured_outputs",
                    format!("structured_outputs.{other} is not supported (json, regex, choice, grammar, json_object)"),
                ));
            }
        };
        found.push(c);
    }
    one_of(found)
}

/// At most one constraint: more than one is a 400 naming them all.
fn one_of(mut found: Vec<(Constraint, &'static str)>) -> Result<Option<(Constraint, &'static str)>, ApiError> {
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|(_, p)| *p).collect();
        return Err(ApiError::invalid(
            found[1].1,
            format!("only one structured output may be given, got {}", names.join(" and ")),
        ));
    }
    Ok(found.pop())
}

/// The request's structured output and the field it came from; `None` = free text.
///
/// # Errors
/// 400 naming the field: a malformed or non-object schema, an empty regex / grammar / choice
/// list, an unknown `response_format.type`, or more than one constraint.
pub fn structured(s: &StructuredFields<'_>) -> Result<Option<(StructuredOutput, StructuredSource)>, ApiError> {
    let mut found: Vec<(Constraint, &'static str)> = Vec::new();
    if let Some(v) = s.response_format {
        found.extend(response_format(v)?);
    }
    if let Some(v) = s.guided_json.filter(|v| !v.is_null()) {
        found.push((Constraint::JsonSchema(schema_text(v, "guided_json")?), "guided_json"));
    }
    if let Some(v) = s.guided_regex.filter(|v| !v.is_null()) {
        found.push((Constraint::Regex(nonempty_str(v, "guided_regex")?), "guided_regex"));
    }
    if let Some(v) = s.guided_choice.filter(|v| !v.is_null()) {
        found.push((choices(v, "guided_choice")?, "guided_choice"));
    }
    if let Some(v) = s.guided_grammar.filter(|v| !v.is_null()) {
        found.push((Constraint::Grammar(nonempty_str(v, "guided_grammar")?), "guided_grammar"));
    }
    if let Some(v) = s.structured_outputs {
        found.extend(structured_outputs(v)?);
    }
    Ok(one_of(found)?.map(|(c, param)| (StructuredOutput { constraint: Some(c) }, StructuredSource { param })))
}

/// What the router knows to name the field of a worker's INVALID_ARGUMENT.
pub(super) struct ErrorFields {
    /// The OpenAI field a structured output came from.
    pub structured: Option<&'static str>,
    /// Tool calling: a forced choice's grammar is the router's, built from `tools`.
    pub tools: Option<ToolPlan>,
}

impl ErrorFields {
    /// The client's field for the worker's `param` (`structured_output.*` → the field the
    /// constraint came from, `tools` for a tool-choice grammar; `prompt` → `messages` in chat).
    pub(super) fn client_param(&self, chat: bool, param: &str) -> Option<String> {
        if param.starts_with("structured_output") {
            if self.tools.as_ref().is_some_and(|t| t.forced) {
                return Some("tools".into());
            }
            return self.structured.map(str::to_owned);
        }
        (chat && param == "prompt").then(|| "messages".into())
    }

    /// `e` (a worker's error) naming the client's field: its `param`, and the message's
    /// `<worker field>: ` prefix (`structured_output.json_schema: Unsatisfiable schema…` →
    /// `response_format.json_schema.schema: Unsatisfiable schema…`).
    pub(super) fn client_error(&self, chat: bool, mut e: ApiError) -> ApiError {
        let Some(worker) = e.param.take() else { return e };
        let Some(client) = self.client_param(chat, &worker) else {
            e.param = Some(worker);
            return e;
        };
        if let Some(rest) = e.message.strip_prefix(worker.as_str()).and_then(|m| m.strip_prefix(": ")) {
            e.message = format!("{client}: {rest}");
        }
        e.param = Some(client);
        e
    }
}

#[cfg(test)]
#[path = "structured_tests.rs"]
mod tests;
