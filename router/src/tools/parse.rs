//! Reading tool calls out of generated text, streamed or whole ([`ToolParser`]): text is
//! pushed as it arrives and comes back as [`Piece`]s, plain text (`content`) and complete
//! calls, with no call text ever in the content. A call is returned once its text is
//! complete (so its arguments arrive in one piece); text that only might start a call is
//! held back until it is known. Whitespace next to calls is dropped (OpenAI returns
//! `content: null` for a reply that only calls tools; text before a call loses its trailing
//! whitespace). Text that looks like a call
//! but does not parse as one (malformed JSON, no `name`) is returned as content, unchanged.
//!
//! - `hermes`: each call is `<tool_call>{"name": "f", "arguments": {...}}</tool_call>`
//!   (`arguments` may be JSON text; `parameters` is accepted too); an unclosed `<tool_call>`
//!   at the end of the output (cut by `max_tokens`, maybe inside `</tool_call>`) is parsed as
//!   a call when its JSON is complete.
//! - `llama3_json`: the output is calls when it starts (after whitespace and an optional
//!   `<|python_tag|>`) with `{`: JSON objects `{"name": "f", "parameters": {...}}`
//!   (`arguments` accepted), separated by `;` or whitespace; otherwise it is all content.

use serde_json::Value;

use super::spec::ParserKind;

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// A parsed call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedCall {
    /// Position among the choice's calls (0, 1, ...).
    pub index: u32,
    /// `call_` + random (OpenAI's id shape).
    pub id: String,
    /// Function name.
    pub name: String,
    /// The arguments object as compact JSON text.
    pub arguments: String,
}

/// What the parser gives back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// Plain text.
    Content(String),
    /// A complete call.
    Call(ParsedCall),
}

/// A new call id.
pub fn call_id() -> String {
    format!("call_{}", &uuid::Uuid::new_v4().simple().to_string()[..24])
}

/// `(name, arguments JSON text)` of a call object, or `None` when it is not one.
fn call_of(v: &Value) -> Option<(String, String)> {
    let obj = v.as_object()?;
    let name = obj.get("name")?.as_str()?.to_owned();
    if name.is_empty() {
        return None;
    }
    let args = match obj.get("arguments").or_else(|| obj.get("parameters")) {
        None | Some(Value::Null) => Value::Object(serde_json::Map::new()),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).ok().filter(Value::is_object)?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    Some((name, serde_json::to_string(&args).ok()?))
}

/// The length of the longest suffix of `text` that is a proper prefix of `tag` (text that
/// may be the start of the tag).
fn partial_tag(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[derive(Debug)]
enum State {
    /// hermes: outside a call.
    Text,
    /// hermes: inside `<tool_call>`, collecting its JSON.
    InCall,
    /// llama3_json: nothing but whitespace (and a partial `<|python_tag|>`) seen yet.
    Start,
    /// llama3_json: the output is calls.
    Calls,
    /// llama3_json: the output is plain text (or turned out not to be calls).
    Plain,
}

/// Incremental tool-call parser of one choice.
#[derive(Debug)]
pub struct ToolParser {
    kind: ParserKind,
    state: State,
    /// Text not returned yet.
    buf: String,
    /// Whitespace held back (returned only when text follows it).
    space: String,
    calls: u32,
}

impl ToolParser {
    /// A parser for `kind`.
    pub fn new(kind: ParserKind) -> Self {
        let state = match kind {
            ParserKind::Hermes => State::Text,
            ParserKind::Llama3Json => State::Start,
        };
        Self { kind, state, buf: String::new(), space: String::new(), calls: 0 }
    }

    /// Calls returned so far.
    pub fn calls(&self) -> u32 {
        self.calls
    }

    fn content(&mut self, text: &str, out: &mut Vec<Piece>) {
        // Trailing whitespace is held (however the text was cut) until text follows it.
        let body = text.trim_end();
        if body.is_empty() {
            self.space.push_str(text);
            return;
        }
        let mut s = std::mem::take(&mut self.space);
        s.push_str(body);
        self.space.push_str(&text[body.len()..]);
        match out.last_mut() {
            Some(Piece::Content(c)) => c.push_str(&s),
            _ => out.push(Piece::Content(s)),
        }
    }

    fn call(&mut self, name: String, arguments: String, out: &mut Vec<Piece>) {
        self.space.clear();
        out.push(Piece::Call(ParsedCall { index: self.calls, id: call_id(), name, arguments }));
        self.calls += 1;
    }

    /// Feeds generated text; returns what is now known.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        self.buf.push_str(text);
        match self.kind {
            ParserKind::Hermes => self.hermes(&mut out, false),
            ParserKind::Llama3Json => self.llama(&mut out, false),
        }
        out
    }

    /// The end of the output: everything held back.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        match self.kind {
            ParserKind::Hermes => self.hermes(&mut out, true),
            ParserKind::Llama3Json => self.llama(&mut out, true),
        }
        // Trailing whitespace of a reply with no calls is its own.
        if self.calls == 0 && !self.space.is_empty() {
            let s = std::mem::take(&mut self.space);
            match out.last_mut() {
                Some(Piece::Content(c)) => c.push_str(&s),
                _ => out.push(Piece::Content(s)),
            }
        }
        self.space.clear();
        out
    }

    fn hermes(&mut self, out: &mut Vec<Piece>, end: bool) {
        loop {
            match self.state {
                State::Text => match self.buf.find(HERMES_OPEN) {
                    Some(at) => {
                        let before: String = self.buf[..at].to_owned();
                        self.content(&before, out);
                        self.buf.drain(..at + HERMES_OPEN.len());
                        self.state = State::InCall;
                    }
                    None => {
                        let keep = if end { 0 } else { partial_tag(&self.buf, HERMES_OPEN) };
                        let text: String = self.buf.drain(..self.buf.len() - keep).collect();
                        self.content(&text, out);
                        return;
                    }
                },
                State::InCall => match self.buf.find(HERMES_CLOSE) {
                    Some(at) => {
                        let body: String = self.buf[..at].to_owned();
                        self.buf.drain(..at + HERMES_CLOSE.len());
                        self.state = State::Text;
                        match serde_json::from_str::<Value>(body.trim()).ok().as_ref().and_then(call_of) {
                            Some((name, args)) => self.call(name, args, out),
                            None => self.content(&format!("{HERMES_OPEN}{body}{HERMES_CLOSE}"), out),
                        }
                    }
                    None if end => {
                        let body = std::mem::take(&mut self.buf);
                        self.state = State::Text;
                        // Output cut inside the closing tag (`max_tokens` ran out at `</tool_call`)
                        // still holds a whole call.
                        let json = &body[..body.len() - partial_tag(&body, HERMES_CLOSE)];
                        match serde_json::from_str::<Value>(json.trim()).ok().as_ref().and_then(call_of) {
                            Some((name, args)) => self.call(name, args, out),
                            None => self.content(&format!("{HERMES_OPEN}{body}"), out),
                        }
                        return;
                    }
                    None => return,
                },
                _ => return,
            }
        }
    }

    fn llama(&mut self, out: &mut Vec<Piece>, end: bool) {
        if let State::Start = self.state {
            let rest = self.buf.trim_start();
            let rest = rest.strip_prefix(PYTHON_TAG).map_or(rest, str::trim_start);
            if rest.starts_with('{') {
                let skip = self.buf.len() - rest.len();
                self.buf.drain(..skip);
                self.state = State::Calls;
            } else if rest.is_empty() || (PYTHON_TAG.starts_with(rest) && !end) {
                if !end {
                    return;
                }
                self.state = State::Plain;
            } else {
                self.state = State::Plain;
            }
        }
        match self.state {
            State::Plain => {
                let text = std::mem::take(&mut self.buf);
                self.content(&text, out);
            }
            State::Calls => loop {
                let rest = self.buf.trim_start_matches(|c: char| c.is_whitespace() || c == ';');
                let skip = self.buf.len() - rest.len();
                if rest.is_empty() {
                    if end {
                        self.buf.clear();
                    }
                    return;
                }
                let mut values = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
                match values.next() {
                    Some(Ok(v)) => {
                        let used = values.byte_offset();
                        match call_of(&v) {
                            Some((name, args)) => {
                                self.buf.drain(..skip + used);
                                self.call(name, args, out);
                            }
                            None => return self.give_up(out),
                        }
                    }
                    Some(Err(e)) if e.is_eof() && !end => return,
                    _ => return self.give_up(out),
                }
            },
            _ => {}
        }
    }

    /// llama3_json: the rest is not a call; it is returned as content.
    fn give_up(&mut self, out: &mut Vec<Piece>) {
        self.state = State::Plain;
        let text = std::mem::take(&mut self.buf);
        self.content(&text, out);
    }
}

/// The whole output parsed at once: content (text outside calls, `None` when there is
/// none) and the calls.
pub fn parse_whole(kind: ParserKind, text: &str) -> (Option<String>, Vec<ParsedCall>) {
    let mut p = ToolParser::new(kind);
    let mut pieces = p.push(text);
    pieces.extend(p.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for piece in pieces {
        match piece {
            Piece::Content(c) => content.push_str(&c),
            Piece::Call(c) => calls.push(c),
        }
    }
    ((!content.is_empty()).then_some(content), calls)
}
