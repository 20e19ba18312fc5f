//! Request-body JSON: lone UTF-16 surrogate escapes tolerated, duplicate top-level keys and
//! over-deep nesting refused with messages that say so.
//!
//! JSON text may escape half of a surrogate pair on its own (`"\ud800"`): Python's `json.dumps`
//! writes one for a string holding a lone surrogate, and Python's decoder (so vLLM) reads it
//! back. serde_json refuses it, with the misleading "unexpected end of hex escape". A body that
//! fails to parse is therefore read again with every lone surrogate escape replaced by
//! `\ufffd` (U+FFFD, the replacement character, what a lossy UTF-8 conversion of such a Python
//! string gives). The replacement has the same length, so error positions stay right; only a
//! body that failed to parse pays for the scan.
//!
//! A top-level key given twice (`{"model": "a", "model": "b"}`) is refused: serde_json's
//! `Value` keeps the last silently, so a proxy that read the first would be bypassed. The
//! check is the map insert the parse does anyway (nested objects keep serde_json's last-wins).
//! A body nested deeper than serde_json's recursion limit is valid JSON that is refused for its
//! depth: the error says so rather than "not valid JSON".

use std::fmt;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};

/// Most nesting levels (objects and arrays) a body may have: serde_json's recursion limit
/// (128) refuses the 128th.
pub const MAX_DEPTH: usize = 127;

/// Why a request body is not a JSON value the API reads.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Not JSON.
    #[error("request body is not valid JSON: {0}")]
    Syntax(serde_json::Error),
    /// Valid JSON nested deeper than [`MAX_DEPTH`].
    #[error("request body is nested too deeply (more than {MAX_DEPTH} levels)")]
    TooDeep,
    /// A top-level key given more than once.
    #[error("duplicate field `{0}`")]
    Duplicate(String),
}

/// Parses a request body, reading lone surrogate escapes as U+FFFD.
///
/// # Errors
/// [`BodyError`]: not JSON, too deep, or a top-level key given twice.
pub fn parse_body(bytes: &[u8]) -> Result<Value, BodyError> {
    match parse_once(bytes) {
        Ok(v) => Ok(v),
        Err(e @ (BodyError::Duplicate(_) | BodyError::TooDeep)) => Err(e),
        Err(_) if nesting_depth(bytes) > MAX_DEPTH => Err(BodyError::TooDeep),
        Err(e) => match replace_lone_surrogates(bytes) {
            Some(fixed) => parse_once(&fixed),
            None => Err(e),
        },
    }
}

/// One parse, noting the first duplicate top-level key.
fn parse_once(bytes: &[u8]) -> Result<Value, BodyError> {
    let mut duplicate = None;
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let parsed = TopLevel { duplicate: &mut duplicate }.deserialize(&mut de).and_then(|v| de.end().map(|()| v));
    match (parsed, duplicate) {
        (Ok(v), _) => Ok(v),
        (Err(_), Some(k)) => Err(BodyError::Duplicate(k)),
        (Err(e), None) => Err(BodyError::Syntax(e)),
    }
}

/// The deepest nesting of objects and arrays in `bytes`, brackets inside strings not counted.
fn nesting_depth(bytes: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in bytes {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// The body as a `Value`, its top-level object's keys checked for duplicates (the first one
/// is written to `duplicate`, which makes the parse fail).
struct TopLevel<'a> {
    duplicate: &'a mut Option<String>,
}

impl<'de> DeserializeSeed<'de> for TopLevel<'_> {
    type Value = Value;
    fn deserialize<D: de::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for TopLevel<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut out = Map::new();
        while let Some(k) = map.next_key::<String>()? {
            let v = map.next_value::<Value>()?;
            if out.contains_key(&k) {
                let e = de::Error::custom(format_args!("duplicate field `{k}`"));
                *self.duplicate = Some(k);
                return Err(e);
            }
            out.insert(k, v);
        }
        Ok(Value::Object(out))
    }

    // Anything but an object is a value of its own (refused by the caller).
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut out = Vec::new();
        while let Some(v) = seq.next_element::<Value>()? {
            out.push(v);
        }
        Ok(Value::Array(out))
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(v.into())
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
}

/// The four hex digits of a `\u` escape.
fn hex4(b: &[u8]) -> Option<u16> {
    let s = std::str::from_utf8(b).ok()?;
    if s.len() != 4 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    u16::from_str_radix(s, 16).ok()
}

fn is_high(n: u16) -> bool {
    (0xD800..=0xDBFF).contains(&n)
}

fn is_low(n: u16) -> bool {
    (0xDC00..=0xDFFF).contains(&n)
}

/// `bytes` with each `\uXXXX` escape inside a JSON string that is a surrogate without its
/// pair replaced by `\ufffd`; `None` when there is none. Quotes and backslashes are ASCII, so
/// scanning UTF-8 bytes never mistakes part of a multi-byte character for one.
pub fn replace_lone_surrogates(bytes: &[u8]) -> Option<Vec<u8>> {
    let mut out: Option<Vec<u8>> = None;
    let mut in_string = false;
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if !in_string {
            in_string = b == b'"';
            i += 1;
            continue;
        }
        match b {
            b'"' => {
                in_string = false;
                i += 1;
            }
            b'\\' if bytes.get(i + 1) == Some(&b'u') => {
                let Some(n) = bytes.get(i + 2..i + 6).and_then(hex4) else {
                    i += 2;
                    continue;
                };
                if is_high(n)
                    && bytes.get(i + 6..i + 8) == Some(b"\\u")
                    && bytes.get(i + 8..i + 12).and_then(hex4).is_some_and(is_low)
                {
                    i += 12; // a proper pair
                    continue;
                }
                if is_high(n) || is_low(n) {
                    let o = out.get_or_insert_with(|| bytes.to_vec());
                    o[i + 2..i + 6].copy_from_slice(b"fffd");
                }
                i += 6;
            }
            b'\\' => i += 2, // a one-character escape, `\"` and `\\` included
            _ => i += 1,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lone_surrogates_become_replacement_characters() {
        let v = parse_body(br#"{"a": "x\ud800y", "b": "\udc00", "c": "\uD83D\uDE00", "d": "\ud800\ud800\udc00"}"#)
            .expect("parses");
        assert_eq!(v["a"], "x\u{FFFD}y");
        assert_eq!(v["b"], "\u{FFFD}");
        assert_eq!(v["c"], "😀", "a proper pair is kept");
        assert_eq!(v["d"], "\u{FFFD}\u{10000}", "a lone high surrogate before a pair");
    }

    #[test]
    fn escaped_backslashes_and_text_outside_strings_are_left_alone() {
        // `\\ud800` is a backslash and the text "ud800", not an escape.
        let v = parse_body(br#"{"a": "\\ud800", "b\ud800": "\"\ud800"}"#).expect("parses");
        assert_eq!(v["a"], "\\ud800");
        assert_eq!(v["b\u{FFFD}"], "\"\u{FFFD}");
        assert_eq!(replace_lone_surrogates(br#"{"a": "\\ud800", "n": 1}"#), None);
        // Other syntax errors stay errors, at the same position.
        let e = parse_body(br#"{"a": "\ud800", }"#).expect_err("trailing comma");
        let BodyError::Syntax(e) = e else { panic!("a syntax error: {e:?}") };
        assert_eq!(e.column(), serde_json::from_slice::<Value>(br#"{"a": "x", }"#).expect_err("same").column() + 5);
        assert!(parse_body(br#"{"a": "\u12"}"#).is_err());
    }

    #[test]
    fn duplicate_top_level_keys_are_refused_nested_ones_keep_the_last() {
        let e = parse_body(br#"{"model": "smol", "prompt": "x", "model": "gemma"}"#).expect_err("duplicate");
        assert!(matches!(e, BodyError::Duplicate(ref k) if k == "model"), "{e:?}");
        // With a lone surrogate elsewhere (the retried parse) too.
        let e = parse_body(br#"{"model": "a\ud800", "model": "b"}"#).expect_err("duplicate");
        assert!(matches!(e, BodyError::Duplicate(ref k) if k == "model"), "{e:?}");
        let v = parse_body(br#"{"a": {"b": 1, "b": 2}, "c": [1, {"d": 1}]}"#).expect("nested duplicates pass");
        assert_eq!(v["a"]["b"], 2);
        assert_eq!(v["c"][1]["d"], 1);
        assert_eq!(parse_body(b"[1, 2.5, true, null]").expect("array"), serde_json::json!([1, 2.5, true, null]));
        assert!(matches!(parse_body(br#"{"a": 1,}"#), Err(BodyError::Syntax(_))));
    }

    #[test]
    fn too_deep_bodies_say_so() {
        let nested = |n: usize| format!(r#"{{"a": {}1{}}}"#, "[".repeat(n - 1), "]".repeat(n - 1)).into_bytes();
        assert!(parse_body(&nested(MAX_DEPTH)).is_ok());
        assert!(matches!(parse_body(&nested(MAX_DEPTH + 1)), Err(BodyError::TooDeep)));
        assert!(matches!(parse_body(&nested(10_000)), Err(BodyError::TooDeep)));
        // Brackets inside strings are not nesting; a shallow syntax error stays one.
        assert_eq!(nesting_depth(br#"{"a": "[[[[{{", "b": ["\"[["]}"#), 2);
        assert!(matches!(parse_body(br#"{"a": "[[[[", }"#), Err(BodyError::Syntax(_))));
    }
}
