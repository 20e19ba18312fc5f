//! Server-sent events framing as OpenAI streams it: `data: {json}\n\n` per chunk and a
//! final `data: [DONE]\n\n`.

use bytes::{BufMut, Bytes, BytesMut};

/// The terminating event.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// Appends one `data:` event holding `value` to `buf`.
pub fn push_event(buf: &mut BytesMut, value: &serde_json::Value) {
    buf.put_slice(b"data: ");
    // Serialising a Value into memory cannot fail.
    let _ = serde_json::to_writer((&mut *buf).writer(), value);
    buf.put_slice(b"\n\n");
}

/// One event as bytes.
pub fn event(value: &serde_json::Value) -> Bytes {
    let mut b = BytesMut::new();
    push_event(&mut b, value);
    b.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing() {
        assert_eq!(&event(&serde_json::json!({"a": 1}))[..], b"data: {\"a\":1}\n\n");
    }
}
