//! [`ChatTemplate`]: Hugging Face chat templates (`tokenizer_config.json` `chat_template`,
//! GGUF `tokenizer.chat_template`) rendered with minijinja the way transformers'
//! `apply_chat_template` does: `trim_blocks` and `lstrip_blocks` on, loop controls,
//! `raise_exception`, `strftime_now`, and the Python string/dict methods templates use
//! (`strip`, `startswith`, `items`, ...), and `tojson` writing JSON as Python's
//! `json.dumps` does (`", "` / `": "` separators, no HTML escaping, key order kept).
//! Context: `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and `tools` (the
//! OpenAI tool objects) when the request has tools, plus the request's `chat_template_kwargs`
//! entries as extra variables (vLLM's, e.g. Qwen3's `enable_thinking`). An entry may not
//! replace a variable or function the renderer sets ([`RESERVED_TEMPLATE_NAMES`]): vLLM lets
//! kwargs override `add_generation_prompt` or `tools`, which would render a prompt other
//! than the one the request's own fields describe, so here such an entry is refused.
//!
//! Tool calling: messages carry `tool_calls` as `[{id, type: "function", function: {name,
//! arguments}}]` with `arguments` parsed to a JSON object (as vLLM passes them), and
//! `tool_call_id` / `name`. A template that does not reference `tools` (ChatML templates
//! such as SmolLM2's) gets them folded into the messages instead ([`tools`]): a Hermes-style
//! tool description in the system message, earlier calls as `<tool_call>` text.

pub mod tools;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State, context};
use serde::Serialize;

use super::error::ModelError;
use crate::request::{ChatMessage, EngineError};

const NAME: &str = "chat";

/// Gemma 3's chat template as Google publishes it (`chat_template` of the
/// `google/gemma-3-*-it` tokenizer configs): the system message becomes a prefix of the first
/// user turn, `assistant` is printed as `model`, roles must alternate starting with the user.
const GEMMA3: &str = include_str!("../../templates/gemma3.jinja");

/// The chat template a model family publishes, for GGUF files converted without one (no
/// `tokenizer.chat_template`, as llama.cpp's conversion of a base checkpoint writes them):
/// by GGUF `general.architecture`. `None` for families without a known template.
pub fn builtin_source(architecture: &str) -> Option<&'static str> {
    match architecture {
        "gemma3" => Some(GEMMA3),
        _ => None,
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    /// Whether the template reads the `tools` variable (else tools are folded into messages).
    uses_tools: bool,
    /// Whether the template knows the `developer` role (else it is rendered as `system`).
    knows_developer: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

#[derive(Serialize)]
struct Msg<'a> {
    role: &'a str,
    /// `None` (JSON null) for an assistant turn that only called tools, as OpenAI sends it.
    content: Option<&'a str>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<MsgToolCall<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<&'a str>,
}

#[derive(Serialize)]
struct MsgToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: MsgFunction<'a>,
}

#[derive(Serialize)]
struct MsgFunction<'a> {
    name: &'a str,
    /// The arguments as a JSON value (templates `tojson` them); text that is not JSON stays text.
    arguments: Value,
}

impl<'a> Msg<'a> {
    fn of(m: &'a ChatMessage, knows_developer: bool) -> Self {
        let tool_calls: Vec<MsgToolCall<'a>> = m
            .tool_calls
            .iter()
            .map(|c| MsgToolCall {
                id: &c.id,
                kind: "function",
                function: MsgFunction { name: &c.name, arguments: json_value(&c.arguments) },
            })
            .collect();
        let content = (!m.content.is_empty() || tool_calls.is_empty()).then_some(m.content.as_str());
        // OpenAI's `developer` role is the system prompt of newer models; older templates
        // know only `system`.
        let role = if m.role == "developer" && !knows_developer { "system" } else { m.role.as_str() };
        Msg { role, content, tool_calls, tool_call_id: m.tool_call_id.as_deref(), name: m.name.as_deref() }
    }
}

/// JSON text as a template value (object key order kept); text that does not parse stays a string.
pub(crate) fn json_value(text: &str) -> Value {
    serde_json::from_str::<Value>(text).unwrap_or_else(|_| Value::from(text))
}

/// Parses the request's tools (a JSON array of OpenAI tool objects) for the template.
///
/// # Errors
/// [`EngineError::InvalidRequest`] (field `tools`) when it is not a JSON array.
pub fn parse_tools(tools_json: &str) -> Result<Value, EngineError> {
    let invalid = |m: String| EngineError::InvalidRequest { field: "tools", message: m };
    let v: Value = serde_json::from_str(tools_json).map_err(|e| invalid(format!("tools is not valid JSON: {e}")))?;
    if v.kind() != ValueKind::Seq {
        return Err(invalid("tools must be a JSON array".to_owned()));
    }
    Ok(v)
}

/// The names a request's `chat_template_kwargs` may not use: the variables every render
/// sets (or leaves unset on purpose, as `tools` without tools) and the functions templates
/// call.
pub const RESERVED_TEMPLATE_NAMES: [&str; 7] =
    ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception", "strftime_now"];

/// Parses a request's `chat_template_kwargs` (JSON object text) into the extra template
/// variables (a map, key order kept).
///
/// # Errors
/// [`EngineError::InvalidRequest`] (field `chat_template_kwargs`) when it is not a JSON
/// object or an entry is named in [`RESERVED_TEMPLATE_NAMES`].
pub fn parse_template_kwargs(json: &str) -> Result<Value, EngineError> {
    let invalid = |m: String| EngineError::InvalidRequest { field: "chat_template_kwargs", message: m };
    let map: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(json).map_err(|e| invalid(format!("chat_template_kwargs must be a JSON object: {e}")))?;
    if let Some(name) = map.keys().find(|k| RESERVED_TEMPLATE_NAMES.contains(&k.as_str())) {
        return Err(invalid(format!(
            "chat_template_kwargs may not set `{name}`: the renderer sets {} itself",
            RESERVED_TEMPLATE_NAMES.join(", ")
        )));
    }
    Ok(Value::from_serialize(&map))
}

/// `tojson` as transformers defines it: Python's `json.dumps(x, ensure_ascii=False,
/// indent=indent)` (no HTML escaping, `", "` and `": "` separators, `","` + newlines when
/// indented).
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    // Accepted for compatibility; keys are written in their order either way.
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v)?),
    };
    let mut out = String::new();
    write_json(&mut out, value, indent, 0)?;
    Ok(Value::from_safe_string(out))
}

/// `value` as Python's `json.dumps` writes it (what [`tojson`] gives without `indent`).
pub(crate) fn python_json(value: &Value) -> String {
    let mut out = String::new();
    // Values built from JSON always serialise.
    let _ = write_json(&mut out, value, None, 0);
    out
}

fn write_json_str(out: &mut String, s: &str) {
    // serde_json escapes as Python does with ensure_ascii=False (quotes, backslash, controls).
    out.push_str(&serde_json::to_string(s).unwrap_or_default());
}

fn write_json(out: &mut String, v: &Value, indent: Option<usize>, depth: usize) -> Result<(), Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::String => write_json_str(out, v.as_str().unwrap_or_default()),
        ValueKind::Number => {
            let text = serde_json::to_string(v).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            out.push_str(&text);
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, k) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                write_json_str(out, &k.to_string());
                out.push_str(": ");
                write_json(out, &v.get_item(k)?, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => {
            let text = serde_json::to_string(v).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            out.push_str(&text);
        }
    }
    Ok(())
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31) (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// `strftime_now(fmt)` (UTC), supporting `%Y %m %d %B %b %H %M %S %%`.
fn strftime_now(fmt: String) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    let (y, m, d) = civil_from_days(secs.div_euclid(86_400));
    let sod = secs.rem_euclid(86_400);
    let month = MONTHS[(m as usize).saturating_sub(1) % 12];
    let mut out = String::new();
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('H') => out.push_str(&format!("{:02}", sod / 3600)),
            Some('M') => out.push_str(&format!("{:02}", sod / 60 % 60)),
            Some('S') => out.push_str(&format!("{:02}", sod % 60)),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

fn str_arg(args: &[Value], i: usize) -> Option<String> {
    args.get(i).and_then(|v| v.as_str().map(str::to_owned))
}

/// Python methods on strings and dicts that chat templates call.
fn py_method(_: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    let unknown = || Error::new(ErrorKind::UnknownMethod, format!("unknown method {method}"));
    if let Some(s) = value.as_str() {
        let chars = str_arg(args, 0);
        let strip_set = |c: char| chars.as_deref().map_or(c.is_whitespace(), |set| set.contains(c));
        return Ok(match method {
            "strip" => Value::from(s.trim_matches(strip_set)),
            "lstrip" => Value::from(s.trim_start_matches(strip_set)),
            "rstrip" => Value::from(s.trim_end_matches(strip_set)),
            "upper" => Value::from(s.to_uppercase()),
            "lower" => Value::from(s.to_lowercase()),
            "startswith" => Value::from(str_arg(args, 0).is_some_and(|p| s.starts_with(&p))),
            "endswith" => Value::from(str_arg(args, 0).is_some_and(|p| s.ends_with(&p))),
            "replace" => match (str_arg(args, 0), str_arg(args, 1)) {
                (Some(a), Some(b)) => Value::from(s.replace(&a, &b)),
                _ => return Err(unknown()),
            },
            "split" => match str_arg(args, 0) {
                Some(sep) => Value::from(s.split(sep.as_str()).map(Value::from).collect::<Vec<_>>()),
                None => Value::from(s.split_whitespace().map(Value::from).collect::<Vec<_>>()),
            },
            _ => return Err(unknown()),
        });
    }
    if value.kind() == ValueKind::Map {
        return match method {
            "items" => {
                let mut items = Vec::new();
                for k in value.try_iter()? {
                    let v = value.get_item(&k)?;
                    items.push(Value::from(vec![k, v]));
                }
                Ok(Value::from(items))
            }
            "keys" => Ok(Value::from(value.try_iter()?.collect::<Vec<_>>())),
            "values" => {
                let mut vals = Vec::new();
                for k in value.try_iter()? {
                    vals.push(value.get_item(&k)?);
                }
                Ok(Value::from(vals))
            }
            "get" => {
                let key = args.first().cloned().unwrap_or(Value::UNDEFINED);
                let v = value.get_item(&key)?;
                Ok(if v.is_undefined() { args.get(1).cloned().unwrap_or(Value::from(())) } else { v })
            }
            _ => Err(unknown()),
        };
    }
    Err(unknown())
}

impl ChatTemplate {
    /// Compiles a template. `bos_token`/`eos_token` are exposed to it as variables.
    ///
    /// # Errors
    /// [`ModelError::ChatTemplate`] when the template does not parse.
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self, ModelError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.set_unknown_method_callback(py_method);
        env.add_filter("tojson", tojson);
        env.add_template_owned(NAME, source.to_owned())?;
        let uses_tools = env.get_template(NAME)?.undeclared_variables(false).contains("tools");
        let knows_developer = source.contains("developer");
        Ok(Self { env, source: source.to_owned(), bos_token, eos_token, uses_tools, knows_developer })
    }

    /// Whether the template reads the `tools` variable; when it does not, tools reach the
    /// model through [`tools::fold`] instead.
    pub fn uses_tools(&self) -> bool {
        self.uses_tools
    }

    /// The template's source and the `bos_token`/`eos_token` it was compiled with.
    pub fn parts(&self) -> (&str, &str, &str) {
        (&self.source, &self.bos_token, &self.eos_token)
    }

    /// Renders `messages`; with `add_generation_prompt` the template appends the assistant
    /// turn's opening (e.g. `<|im_start|>assistant\n`).
    ///
    /// # Errors
    /// [`EngineError::InvalidRequest`] (field `messages`) when the template raises (e.g.
    /// roles out of order) or fails to render.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String, EngineError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the request's tools (from [`parse_tools`]) in the
    /// template's `tools` variable (unset without tools, as transformers leaves it).
    ///
    /// # Errors
    /// As [`ChatTemplate::render`].
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        self.render_with_vars(messages, tools, None, add_generation_prompt)
    }

    /// [`ChatTemplate::render_with_tools`] with the request's `chat_template_kwargs` (from
    /// [`parse_template_kwargs`]) as extra variables. The standard variables always win: an
    /// entry named in [`RESERVED_TEMPLATE_NAMES`] is dropped here even if the caller did not
    /// refuse it, so `tools` stays unset without tools.
    ///
    /// # Errors
    /// As [`ChatTemplate::render`].
    pub fn render_with_vars(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Value>,
        template_kwargs: Option<&Value>,
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        let msgs: Vec<Msg<'_>> = messages.iter().map(|m| Msg::of(m, self.knows_developer)).collect();
        let tmpl = self.env.get_template(NAME).map_err(|e| EngineError::Internal(format!("chat template: {e}")))?;
        let tools = tools.cloned().unwrap_or(Value::UNDEFINED);
        let standard = context! {
            messages => msgs,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        };
        let ctx = match template_kwargs {
            None => standard,
            Some(kwargs) => {
                let mut vars = std::collections::BTreeMap::new();
                for key in kwargs.try_iter().map_err(|e| EngineError::Internal(format!("chat template: {e}")))? {
                    let name = key.to_string();
                    if !RESERVED_TEMPLATE_NAMES.contains(&name.as_str()) {
                        vars.insert(name, kwargs.get_item(&key).unwrap_or(Value::UNDEFINED));
                    }
                }
                // The standard map last: it wins on any name both define.
                minijinja::value::merge_maps([Value::from(vars), standard])
            }
        };
        tmpl.render(ctx)
            .map_err(|e| EngineError::InvalidRequest { field: "messages", message: format!("chat template: {e}") })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into(), ..Default::default() }
    }

    #[test]
    fn renders_chatml_with_default_system() -> anyhow::Result<()> {
        let t = ChatTemplate::new(SMOLLM, String::new(), "<|im_end|>".into())?;
        let out = t.render(&[msg("user", "Hi")], true)?;
        assert_eq!(
            out,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t.render(&[msg("system", "S"), msg("user", "U")], false)?;
        assert_eq!(out, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n");
        Ok(())
    }

    #[test]
    fn trims_blocks_and_supports_python_methods() -> anyhow::Result<()> {
        let src = "{{ bos_token }}\n{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content.strip() }}]\n  {% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(src, "<s>".into(), "</s>".into())?;
        assert_eq!(t.render(&[msg("user", "  x ")], false)?, "<s>\n[x]\n");
        Ok(())
    }

    #[test]
    fn raise_exception_is_invalid_request() -> anyhow::Result<()> {
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", String::new(), String::new())?;
        assert!(matches!(t.render(&[], false), Err(EngineError::InvalidRequest { field: "messages", .. })));
        Ok(())
    }

    #[test]
    fn tools_tool_calls_and_developer_reach_the_template() -> anyhow::Result<()> {
        use crate::request::ToolCall;
        let src = "{% for m in messages %}[{{ m.role }}|{{ m.content }}|{% for c in m.tool_calls or [] %}{{ c.id }} {{ c.type }} {{ c.function.name }} {{ c.function.arguments | tojson }} {{ c.function.arguments.city }}{% endfor %}|{{ m.tool_call_id }}]{% endfor %}{% if tools %}{{ tools | tojson }}{{ tools[0] | tojson(indent=2) }}{% endif %}";
        let t = ChatTemplate::new(src, String::new(), String::new())?;
        assert!(t.uses_tools());
        let tools = parse_tools(r#"[{"type": "function", "function": {"name": "w", "description": "<b>&'"}}]"#)?;
        let msgs = [
            msg("developer", "D"),
            ChatMessage {
                role: "assistant".into(),
                tool_calls: vec![ToolCall {
                    id: "call_1".into(),
                    name: "w".into(),
                    arguments: r#"{"city":"Oslo","n":[1,2.5]}"#.into(),
                }],
                ..Default::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: "9".into(),
                tool_call_id: Some("call_1".into()),
                ..Default::default()
            },
        ];
        let out = t.render_with_tools(&msgs, Some(&tools), false)?;
        assert_eq!(
            out,
            concat!(
                "[system|D||][assistant|None|call_1 function w {\"city\": \"Oslo\", \"n\": [1, 2.5]} Oslo|][tool|9||call_1]",
                "[{\"type\": \"function\", \"function\": {\"name\": \"w\", \"description\": \"<b>&'\"}}]",
                "{\n  \"type\": \"function\",\n  \"function\": {\n    \"name\": \"w\",\n    \"description\": \"<b>&'\"\n  }\n}"
            )
        );
        // Without tools the variable is undefined; SmolLM2's template never reads it.
        assert_eq!(t.render_with_tools(&msgs[..1], None, false)?, "[system|D||]");
        assert!(!ChatTemplate::new(SMOLLM, String::new(), String::new())?.uses_tools());
        Ok(())
    }

    /// `chat_template_kwargs` entries reach the template as variables (Qwen3's
    /// `enable_thinking`); one named after a standard variable is refused, and even when a
    /// caller skips that check the standard value is what the template sees.
    #[test]
    fn template_kwargs_are_extra_variables_that_cannot_replace_standard_ones() -> anyhow::Result<()> {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}>{% endif %}{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}{% if tools is defined %}T{% endif %}{% if extra is defined %}{{ extra.n }}{% endif %}";
        let t = ChatTemplate::new(src, "<s>".into(), "</s>".into())?;
        let hi = [msg("user", "hi")];
        assert_eq!(t.render(&hi, true)?, "<s>hi>");
        let off = parse_template_kwargs(r#"{"enable_thinking": false, "extra": {"n": 3}}"#)?;
        assert_eq!(t.render_with_vars(&hi, None, Some(&off), true)?, "<s>hi><think></think>3");
        let on = parse_template_kwargs(r#"{"enable_thinking": true}"#)?;
        assert_eq!(t.render_with_vars(&hi, None, Some(&on), true)?, "<s>hi>");
        for name in RESERVED_TEMPLATE_NAMES {
            let e = parse_template_kwargs(&format!(r#"{{"{name}": 1}}"#)).expect_err(name);
            assert!(matches!(e, EngineError::InvalidRequest { field: "chat_template_kwargs", .. }), "{name}: {e:?}");
        }
        for bad in ["[1]", "\"x\"", "null", "{"] {
            let e = parse_template_kwargs(bad).expect_err(bad);
            assert!(matches!(e, EngineError::InvalidRequest { field: "chat_template_kwargs", .. }), "{bad}: {e:?}");
        }
        // Built around the check: the standard variables still win, `tools` stays unset.
        let sneaky = Value::from_serialize(serde_json::json!({
            "messages": [{"role": "user", "content": "forged"}], "bos_token": "X", "add_generation_prompt": false,
            "tools": [1], "enable_thinking": false
        }));
        assert_eq!(t.render_with_vars(&hi, None, Some(&sneaky), true)?, "<s>hi><think></think>");
        Ok(())
    }

    #[test]
    fn gemma3_builtin_folds_the_system_message_into_the_first_turn() -> anyhow::Result<()> {
        let src = builtin_source("gemma3").expect("gemma3 template");
        let t = ChatTemplate::new(src, "<bos>".into(), "<eos>".into())?;
        let out = t.render(&[msg("system", "Be brief."), msg("user", " Hi "), msg("assistant", "Hello")], true)?;
        assert_eq!(
            out,
            "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>model\n"
        );
        let err = t.render(&[msg("user", "a"), msg("user", "b")], true);
        assert!(matches!(err, Err(EngineError::InvalidRequest { field: "messages", .. })), "{err:?}");
        assert!(builtin_source("llama").is_none());
        Ok(())
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_723), (2024, 1, 1));
    }
}
