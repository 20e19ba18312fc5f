//! Incremental detokenization over raw token bytes (byte-level BPE tokens can split a
//! UTF-8 character, so text is decoded from the concatenated bytes, not per token).
//!
//! Guarantees, streamed or not:
//! - every delta is valid UTF-8: bytes of an unfinished character are held back until the
//!   character completes (truly invalid bytes become U+FFFD; unfinished bytes left when the
//!   sequence ends are dropped);
//! - no part of a stop string is ever emitted: text that ends with a prefix of a stop
//!   string is held back until it is known not to become the stop string; when a stop
//!   string appears the text is cut before it (vLLM's `include_stop_str_in_output=false`);
//! - the concatenation of all deltas equals [`Detokenizer::text`].

/// Incremental detokenizer of one sequence.
#[derive(Debug, Default)]
pub struct Detokenizer {
    stops: Vec<String>,
    skip_special: bool,
    /// Bytes of an unfinished UTF-8 character.
    pending: Vec<u8>,
    /// Decoded text (cut before a stop string once one is found).
    text: String,
    /// Bytes of `text` already emitted.
    emitted: usize,
    stopped: bool,
}

impl Detokenizer {
    /// A detokenizer cutting at any of `stops` (empty strings are ignored).
    pub fn new(stops: &[String], skip_special: bool) -> Self {
        Self { stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(), skip_special, ..Self::default() }
    }

    /// Feeds tokens generated before (stream migration): their text counts as already
    /// emitted and is not searched for stop strings again.
    pub fn prime(&mut self, token_bytes: &[u8], special: bool) {
        if special && self.skip_special {
            return;
        }
        self.decode_into_text(token_bytes);
        self.emitted = self.text.len();
    }

    /// Adds one token's bytes. Returns the text that can be emitted now and whether a stop
    /// string was completed (the sequence must then finish with reason `stop`).
    pub fn push(&mut self, token_bytes: &[u8], special: bool) -> (String, bool) {
        if self.stopped || (special && self.skip_special) {
            return (String::new(), self.stopped);
        }
        self.decode_into_text(token_bytes);
        if let Some(cut) = self.find_stop() {
            self.text.truncate(cut);
            self.stopped = true;
            self.pending.clear();
            return (self.take_until(self.text.len()), true);
        }
        let safe = self.text.len() - self.held_back();
        (self.take_until(safe), false)
    }

    /// Ends the sequence: returns whatever was held back for a possible stop string
    /// (never a stop string itself). Unfinished character bytes are dropped.
    pub fn finish(&mut self) -> String {
        self.pending.clear();
        self.take_until(self.text.len())
    }

    /// The full text so far (emitted and held back).
    pub fn text(&self) -> &str {
        &self.text
    }

    fn decode_into_text(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    self.text.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: from_utf8 said these bytes are valid.
                    if let Ok(s) = std::str::from_utf8(&self.pending[start..start + valid]) {
                        self.text.push_str(s);
                    }
                    match e.error_len() {
                        Some(bad) => {
                            self.text.push(char::REPLACEMENT_CHARACTER);
                            start += valid + bad;
                        }
                        None => {
                            // Unfinished character: keep its bytes for the next token.
                            self.pending.drain(..start + valid);
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Byte offset of the earliest stop string in the not-yet-emitted text.
    fn find_stop(&self) -> Option<usize> {
        let from = self.emitted;
        self.stops.iter().filter_map(|s| self.text[from..].find(s.as_str()).map(|i| from + i)).min()
    }

    /// Length of the longest unemitted suffix of `text` that is a proper prefix of a stop string.
    fn held_back(&self) -> usize {
        let tail = &self.text[self.emitted..];
        let mut hold = 0;
        for s in &self.stops {
            for (l, _) in s.char_indices().skip(1) {
                if l > hold && l <= tail.len() && tail.ends_with(&s[..l]) {
                    hold = l;
                }
            }
        }
        hold
    }

    fn take_until(&mut self, end: usize) -> String {
        if end <= self.emitted {
            return String::new();
        }
        let out = self.text[self.emitted..end].to_owned();
        self.emitted = end;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(d: &mut Detokenizer, tokens: &[&[u8]]) -> (Vec<String>, bool) {
        let mut deltas = Vec::new();
        for t in tokens {
            let (delta, stop) = d.push(t, false);
            deltas.push(delta);
            if stop {
                return (deltas, true);
            }
        }
        deltas.push(d.finish());
        (deltas, false)
    }

    #[test]
    fn split_multibyte_characters_are_held_back() {
        let s = "a😀한字";
        let bytes = s.as_bytes();
        let tokens: Vec<&[u8]> = bytes.chunks(1).collect();
        let mut d = Detokenizer::new(&[], true);
        let (deltas, stop) = run(&mut d, &tokens);
        assert!(!stop);
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')));
        assert_eq!(deltas.concat(), s);
        assert_eq!(deltas[1], "", "first emoji byte alone is held back");
        assert_eq!(deltas[4], "😀");
    }

    #[test]
    fn stop_string_never_emitted_across_tokens() {
        let mut d = Detokenizer::new(&["END!".to_owned()], true);
        let (deltas, stop) = run(&mut d, &[b"hello E", b"N", b"x E", b"ND", b"!", b"tail"]);
        assert!(stop);
        assert_eq!(deltas.concat(), "hello ENx ");
        assert_eq!(d.text(), "hello ENx ");
        for delta in &deltas {
            assert!(!delta.contains('E') || delta == "EN" || delta.contains("ENx"), "{delta:?}");
        }
        assert_eq!(deltas[0], "hello ");
        assert_eq!(deltas[1], "");
        assert_eq!(deltas[2], "ENx ");
    }

    #[test]
    fn held_back_prefix_is_flushed_at_finish_and_special_skipped() {
        let mut d = Detokenizer::new(&["###".to_owned()], true);
        assert_eq!(d.push(b"ab#", false).0, "ab");
        assert_eq!(d.push(b"<eos>", true).0, "");
        assert_eq!(d.finish(), "#");
        let mut d = Detokenizer::new(&[], false);
        assert_eq!(d.push(b"<s>", true).0, "<s>");
    }

    #[test]
    fn invalid_bytes_become_replacement_and_prime_counts_as_emitted() {
        let mut d = Detokenizer::new(&[], true);
        assert_eq!(d.push(&[b'a', 0xFF, b'b'], false).0, "a\u{FFFD}b");
        let mut d = Detokenizer::new(&["xy".to_owned()], true);
        d.prime(b"before x", false);
        let (delta, stop) = d.push(b"y", false);
        assert_eq!((delta.as_str(), stop), ("y", false), "primed text is not searched again");
    }
}
