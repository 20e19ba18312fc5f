//! Incremental detokenization over raw token bytes (byte-level BPE tokens can split a
//! UTF-8 character, so text is decoded from the concatenated bytes, not per token).
//!
//! Guarantees, streamed or not:
//! - every delta is valid UTF-8: bytes of an unfinished character are held back until the
//!   character completes (truly invalid bytes become U+FFFD; unfinished bytes left when the
//!   sequence ends are dropped);
//! - no part of a stop string is ever emitted before it is known to match or not: text that
//!   ends with a prefix of a stop string is held back until it is known not to become the
//!   stop string; when a stop string appears the text is cut before it, or after it with
//!   `include_stop_str` (vLLM's `include_stop_str_in_output`);
//! - stop strings are matched against the output text and against the text *with* special
//!   tokens' text, also when `skip_special` hides them from the output (so `"<|im_end|>"` as a
//!   stop string stops at that token, as it does in vLLM): the earlier match wins. Hidden text is
//!   never emitted, also not as part of a kept stop string;
//! - the token that ends a sequence (EOS, a stop token id) adds its text only with
//!   `include_stop` ([`Detokenizer::push_end`]), as vLLM's detokenizer does;
//! - the concatenation of all deltas equals [`Detokenizer::text`].

/// Incremental detokenizer of one sequence.
#[derive(Debug, Default)]
pub struct Detokenizer {
    stops: Vec<String>,
    skip_special: bool,
    include_stop: bool,
    /// Bytes of an unfinished UTF-8 character.
    pending: Vec<u8>,
    /// Decoded text with special tokens' text, hidden or not (what stop strings match).
    full: String,
    /// Byte ranges of `full` that the output does not show (skipped special tokens), in order.
    hidden: Vec<(usize, usize)>,
    /// Offset in `full` from which a stop string may still start.
    scan_from: usize,
    /// Offset in `text` from which a stop string may still start.
    text_scan_from: usize,
    /// The output text (cut at a stop string once one is found).
    text: String,
    /// Bytes of `text` already emitted.
    emitted: usize,
    stopped: bool,
}

impl Detokenizer {
    /// A detokenizer cutting at any of `stops` (empty strings are ignored); with
    /// `include_stop` the matched stop string is kept at the end of the text.
    pub fn new(stops: &[String], skip_special: bool, include_stop: bool) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            skip_special,
            include_stop,
            ..Self::default()
        }
    }

    /// Feeds tokens generated before (stream migration): their text counts as already
    /// emitted and is not searched for stop strings again.
    pub fn prime(&mut self, token_bytes: &[u8], special: bool) {
        self.append(token_bytes, special);
        self.scan_from = self.full.len();
        self.text_scan_from = self.text.len();
        self.emitted = self.text.len();
    }

    /// Adds one token's bytes. Returns the text that can be emitted now and whether a stop
    /// string was completed (the sequence must then finish with reason `stop`).
    pub fn push(&mut self, token_bytes: &[u8], special: bool) -> (String, bool) {
        if self.stopped {
            return (String::new(), true);
        }
        self.append(token_bytes, special);
        if let Some(cut) = self.find_stop() {
            self.text.truncate(cut.max(self.emitted));
            self.stopped = true;
            self.pending.clear();
            return (self.take_until(self.text.len()), true);
        }
        self.scan_from = self.full.len() - held_back(&self.stops, &self.full[self.scan_from..]);
        self.text_scan_from = self.text.len() - held_back(&self.stops, &self.text[self.text_scan_from..]);
        let safe = self.visible_offset(self.scan_from).min(self.text_scan_from).max(self.emitted);
        (self.take_until(safe), false)
    }

    /// Adds the token that ended the sequence (EOS or a stop token id) and returns the text
    /// that can be emitted now. Its text is kept only with `include_stop` (vLLM's detokenizer
    /// drops the stop token otherwise), and then hidden like any special token under
    /// `skip_special`: so `skip_special_tokens: false` with `include_stop_str_in_output: true`
    /// ends the text with the EOS text (`<|im_end|>`).
    pub fn push_end(&mut self, token_bytes: &[u8], special: bool) -> String {
        if !self.include_stop {
            return String::new();
        }
        self.push(token_bytes, special).0
    }

    /// Ends the sequence: returns whatever was held back for a possible stop string
    /// (never a stop string itself). Unfinished character bytes are dropped.
    pub fn finish(&mut self) -> String {
        self.pending.clear();
        self.take_until(self.text.len())
    }

    /// The full output text so far (emitted and held back).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// Appends a token: its text goes to `full`, and to `text` unless it is a skipped
    /// special token (whose range in `full` is then hidden).
    fn append(&mut self, bytes: &[u8], special: bool) {
        if special && self.skip_special {
            let t = String::from_utf8_lossy(bytes);
            self.hidden.push((self.full.len(), t.len()));
            self.full.push_str(&t);
            return;
        }
        let before = self.full.len();
        self.decode_into_full(bytes);
        let added = &self.full[before..];
        self.text.push_str(added);
    }

    /// The offset in `text` of offset `f` of `full` (inside a hidden range: its start).
    fn visible_offset(&self, f: usize) -> usize {
        let hidden: usize = self.hidden.iter().filter(|(a, _)| *a < f).map(|&(a, l)| l.min(f - a)).sum();
        f - hidden
    }

    fn decode_into_full(&mut self, bytes: &[u8]) {
        self.pending.extend_from_slice(bytes);
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    self.full.push_str(s);
                    self.pending.clear();
                    return;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: from_utf8 said these bytes are valid.
                    if let Ok(s) = std::str::from_utf8(&self.pending[start..start + valid]) {
                        self.full.push_str(s);
                    }
                    match e.error_len() {
                        Some(bad) => {
                            self.full.push(char::REPLACEMENT_CHARACTER);
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

    /// Where the output text ends when a stop string was completed: the earliest match in
    /// the output text or in the text with special tokens, cut before it (or after it with
    /// `include_stop`; a hidden special token of a kept stop string stays hidden).
    fn find_stop(&self) -> Option<usize> {
        let mut best: Option<(usize, usize)> = None; // (start, end) in `text`
        for s in &self.stops {
            let in_text = self.text[self.text_scan_from..].find(s.as_str()).map(|i| {
                let at = self.text_scan_from + i;
                (at, at + s.len())
            });
            let in_full = self.full[self.scan_from..].find(s.as_str()).map(|i| {
                let at = self.scan_from + i;
                (self.visible_offset(at), self.visible_offset(at + s.len()))
            });
            for m in [in_text, in_full].into_iter().flatten() {
                if best.is_none_or(|b| m.0 < b.0) {
                    best = Some(m);
                }
            }
        }
        best.map(|(start, end)| if self.include_stop { end } else { start })
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

/// Length of the longest suffix of `tail` that is a proper prefix of one of `stops`.
fn held_back(stops: &[String], tail: &str) -> usize {
    let mut hold = 0;
    for s in stops {
        for (l, _) in s.char_indices().skip(1) {
            if l > hold && l <= tail.len() && tail.ends_with(&s[..l]) {
                hold = l;
            }
        }
    }
    hold
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
        let mut d = Detokenizer::new(&[], true, false);
        let (deltas, stop) = run(&mut d, &tokens);
        assert!(!stop);
        assert!(deltas.iter().all(|d| !d.contains('\u{FFFD}')));
        assert_eq!(deltas.concat(), s);
        assert_eq!(deltas[1], "", "first emoji byte alone is held back");
        assert_eq!(deltas[4], "😀");
    }

    #[test]
    fn stop_string_never_emitted_across_tokens() {
        let mut d = Detokenizer::new(&["END!".to_owned()], true, false);
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
        let mut d = Detokenizer::new(&["###".to_owned()], true, false);
        assert_eq!(d.push(b"ab#", false).0, "ab");
        assert_eq!(d.push(b"<eos>", true).0, "");
        assert_eq!(d.finish(), "#");
        let mut d = Detokenizer::new(&[], false, false);
        assert_eq!(d.push(b"<s>", true).0, "<s>");
    }

    #[test]
    fn invalid_bytes_become_replacement_and_prime_counts_as_emitted() {
        let mut d = Detokenizer::new(&[], true, false);
        assert_eq!(d.push(&[b'a', 0xFF, b'b'], false).0, "a\u{FFFD}b");
        let mut d = Detokenizer::new(&["xy".to_owned()], true, false);
        d.prime(b"before x", false);
        let (delta, stop) = d.push(b"y", false);
        assert_eq!((delta.as_str(), stop), ("y", false), "primed text is not searched again");
    }

    #[test]
    fn include_stop_keeps_the_stop_string_and_never_emits_a_partial_one() {
        let mut d = Detokenizer::new(&["END!".to_owned()], true, true);
        let (deltas, stop) = run(&mut d, &[b"hello E", b"N", b"x E", b"ND", b"!", b"tail"]);
        assert!(stop);
        assert_eq!(deltas.concat(), "hello ENx END!");
        assert_eq!(d.text(), "hello ENx END!");
        assert_eq!(deltas, ["hello ", "", "ENx ", "", "END!"], "the prefix waits until it is known to match");
        // The earliest of several stop strings wins, kept whole.
        let mut d = Detokenizer::new(&["cd".to_owned(), "b".to_owned()], true, true);
        assert_eq!(d.push(b"abcd", false), ("ab".to_owned(), true));
    }

    /// vLLM's rule for the token that ended the sequence: its text only with
    /// `include_stop_str_in_output`, and a special one only when special tokens are shown.
    #[test]
    fn the_end_token_shows_only_with_include_stop_and_shown_special_tokens() {
        for (skip, include, want) in
            [(false, true, "Hi<|im_end|>"), (false, false, "Hi"), (true, true, "Hi"), (true, false, "Hi")]
        {
            let mut d = Detokenizer::new(&[], skip, include);
            let mut out = d.push(b"Hi", false).0;
            out.push_str(&d.push_end(b"<|im_end|>", true));
            out.push_str(&d.finish());
            assert_eq!((out.as_str(), d.text()), (want, want), "skip {skip} include {include}");
        }
        // A stop token id that is plain text shows with include_stop whatever skip_special says.
        let mut d = Detokenizer::new(&[], true, true);
        d.push(b"a", false);
        assert_eq!(d.push_end(b".", false), ".");
    }

    #[test]
    fn stop_strings_match_special_tokens_hidden_or_shown() {
        let im_end = "<|im_end|>".to_owned();
        // Hidden by skip_special: the stop matches the token, the text stays without it.
        for include in [false, true] {
            let mut d = Detokenizer::new(std::slice::from_ref(&im_end), true, include);
            assert_eq!(d.push(b"Hi", false), ("Hi".to_owned(), false));
            assert_eq!(d.push(b"<|im_end|>", true), (String::new(), true));
            assert_eq!(d.text(), "Hi");
        }
        // Shown: cut before it, or kept.
        let mut d = Detokenizer::new(std::slice::from_ref(&im_end), false, false);
        assert_eq!(d.push(b"Hi", false).0, "Hi");
        assert_eq!(d.push(b"<|im_end|>", true), (String::new(), true));
        let mut d = Detokenizer::new(std::slice::from_ref(&im_end), false, true);
        d.push(b"Hi", false);
        assert_eq!(d.push(b"<|im_end|>", true), ("<|im_end|>".to_owned(), true));
        assert_eq!(d.text(), "Hi<|im_end|>");
        // A stop string spanning text and a hidden special token matches the text with it;
        // the kept part is the visible one.
        let mut d = Detokenizer::new(&[".<|im_end|>\n".to_owned()], true, true);
        assert_eq!(d.push(b"ok.", false).0, "ok", "'.' may start the stop string");
        assert_eq!(d.push(b"<|im_end|>", true).0, "");
        assert_eq!(d.push(b"\n", false), (".\n".to_owned(), true));
        // A special token that breaks a stop prefix in the full text does not hide a match in
        // the output text (hidden tokens are invisible there, as in vLLM).
        let mut d = Detokenizer::new(&["ab".to_owned()], true, false);
        d.push(b"xa", false);
        d.push(b"<s>", true);
        assert_eq!(d.push(b"b", false), (String::new(), true));
        assert_eq!(d.text(), "x");
    }
}
