//! Request-body JSON that tolerates lone UTF-16 surrogate escapes.
//!
//! JSON text may escape half of a surrogate pair on its own (`"\ud800"`): Python's `json.dumps`
//! writes one for a string holding a lone surrogate, and Python's decoder (so vLLM) reads it
//! back. serde_json refuses it, with the misleading "unexpected end of hex escape". A body that
//! fails to parse is therefore read again with every lone surrogate escape replaced by
//! `\ufffd` (U+FFFD, the replacement character, what a lossy UTF-8 conversion of such a Python
//! string gives). The replacement has the same length, so error positions stay right; only a
//! body that failed to parse pays for the scan.

use serde_json::Value;

/// Parses a request body, reading lone surrogate escapes as U+FFFD.
///
/// # Errors
/// serde_json's error for a body that is not JSON for another reason.
pub fn parse_body(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    match serde_json::from_slice(bytes) {
        Ok(v) => Ok(v),
        Err(e) => match replace_lone_surrogates(bytes) {
            Some(fixed) => serde_json::from_slice(&fixed),
            None => Err(e),
        },
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
        assert_eq!(e.column(), serde_json::from_slice::<Value>(br#"{"a": "x", }"#).expect_err("same").column() + 5);
        assert!(parse_body(br#"{"a": "\u12"}"#).is_err());
    }
}
