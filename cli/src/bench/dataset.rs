//! The prompts of `prism bench serve`, built before the run from a seeded RNG so that two runs
//! with the same flags send the same requests:
//!
//! - `random` (vLLM's random dataset): random token ids; input length uniform in
//!   `[len·(1−r), len·(1+r)]` after a `--random-prefix-len` prefix shared by every request,
//!   output length likewise. Sent as token ids, so the input length is exact.
//! - `multi-turn`: `conversations` chats that share one system prompt; turn `t` of a
//!   conversation sends the system prompt, the `t−1` earlier user/assistant exchanges and a
//!   new user message, so each turn's prompt extends the previous turn's (what prefix caching
//!   serves). The assistant replies in the history are synthetic text of the output length.
//!   Requests are ordered turn by turn (turn 1 of every conversation, then turn 2, …).
//! - `prefix_repetition` (vLLM's name): requests over a few shared prefixes, each with its own
//!   suffix (`dataset/prefix_repetition.rs`).
//! - `custom` (vLLM's name; alias `jsonl`): one JSON object per line, `{"prompt": "…"}` (or
//!   token ids) or `{"messages": [{"role": …, "content": …}, …]}`, with optional `max_tokens`
//!   or `output_len`.
//!
//! Synthetic text is made of common English words that are one token each in the usual BPE
//! vocabularies, so a length in words is close to a length in tokens; the servers' `usage`
//! gives the exact counts that the report uses.

pub mod prefix_repetition;

use rand::Rng;
use rand::rngs::StdRng;
use serde::Deserialize;
use serde_json::Value;

/// Token ids below this are never drawn: vocabularies put control and special tokens first.
pub const RANDOM_TOKEN_FLOOR: u32 = 256;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The message text.
    pub content: String,
}

/// What a request sends as its prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Token ids (completions `prompt: [ids]`, gRPC `token_ids`).
    TokenIds(Vec<u32>),
    /// Plain text (completions `prompt`, gRPC `text`; one user message on the chat API).
    Text(String),
    /// A conversation (chat completions `messages`, gRPC `chat`).
    Chat(Vec<Message>),
}

/// One benchmark request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BenchRequest {
    /// The prompt.
    pub prompt: Prompt,
    /// Prompt length in tokens: exact for token ids, an estimate (words) for text; the
    /// report prefers the server's `usage.prompt_tokens`.
    pub prompt_len: usize,
    /// `max_tokens` of the request.
    pub output_len: u32,
}

/// A dataset that cannot be built; the error names the flag or the file line at fault.
#[derive(Debug, thiserror::Error)]
pub enum DatasetError {
    /// A line of a JSONL file is not a valid prompt object (`line` counts from 1).
    #[error("{path}:{line}: {reason}")]
    BadLine {
        /// The file.
        path: String,
        /// 1-based line number.
        line: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A flag value that makes no dataset.
    #[error("{0}")]
    Invalid(String),
    /// The file cannot be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The read error.
        source: std::io::Error,
    },
}

/// `--random-*` settings (vLLM's names and meanings).
#[derive(Debug, Clone, Copy)]
pub struct RandomConfig {
    /// Mean input length in tokens (after the prefix).
    pub input_len: usize,
    /// Mean output length in tokens.
    pub output_len: u32,
    /// Lengths are uniform in `[len·(1−r), len·(1+r)]`; `r` in `[0, 1)`.
    pub range_ratio: f64,
    /// Tokens of a prefix shared by every request, before the random part.
    pub prefix_len: usize,
    /// Token ids are drawn from `[RANDOM_TOKEN_FLOOR, vocab_size)`.
    pub vocab_size: u32,
}

/// The `multi-turn` dataset's shape.
#[derive(Debug, Clone, Copy)]
pub struct MultiTurnConfig {
    /// Conversations sharing the system prompt.
    pub conversations: usize,
    /// Turns (requests) per conversation.
    pub turns: usize,
    /// Words of the shared system prompt.
    pub system_len: usize,
    /// Words of each user message.
    pub user_len: usize,
    /// `max_tokens` of each turn, and words of each synthetic assistant reply in the history.
    pub output_len: u32,
}

/// Inclusive `[lo, hi]` bounds of a length drawn around `len` with ratio `r` (at least 1).
pub fn length_range(len: usize, r: f64) -> (usize, usize) {
    let lo = ((len as f64) * (1.0 - r)).floor().max(1.0) as usize;
    let hi = ((len as f64) * (1.0 + r)).ceil().max(lo as f64) as usize;
    (lo, hi)
}

fn draw_len(rng: &mut StdRng, len: usize, r: f64) -> usize {
    let (lo, hi) = length_range(len, r);
    rng.random_range(lo..=hi)
}

impl RandomConfig {
    /// Checks the ranges.
    ///
    /// # Errors
    /// A ratio outside `[0, 1)`, a zero length or a vocabulary too small to draw from.
    pub fn validate(&self) -> Result<(), DatasetError> {
        if !(0.0..1.0).contains(&self.range_ratio) {
            return Err(DatasetError::Invalid(format!(
                "--random-range-ratio must be in [0, 1), got {}",
                self.range_ratio
            )));
        }
        if self.input_len == 0 && self.prefix_len == 0 {
            return Err(DatasetError::Invalid("--random-input-len must be at least 1".into()));
        }
        if self.output_len == 0 {
            return Err(DatasetError::Invalid("--random-output-len must be at least 1".into()));
        }
        if self.vocab_size <= RANDOM_TOKEN_FLOOR {
            return Err(DatasetError::Invalid(format!(
                "--random-vocab-size must be above {RANDOM_TOKEN_FLOOR}, got {}",
                self.vocab_size
            )));
        }
        Ok(())
    }
}

/// `n` requests of random token ids.
///
/// # Errors
/// See [`RandomConfig::validate`].
pub fn random(cfg: &RandomConfig, n: usize, rng: &mut StdRng) -> Result<Vec<BenchRequest>, DatasetError> {
    cfg.validate()?;
    let token = |rng: &mut StdRng| rng.random_range(RANDOM_TOKEN_FLOOR..cfg.vocab_size);
    let prefix: Vec<u32> = (0..cfg.prefix_len).map(|_| token(rng)).collect();
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let input = if cfg.input_len == 0 { 0 } else { draw_len(rng, cfg.input_len, cfg.range_ratio) };
        let output = draw_len(rng, cfg.output_len as usize, cfg.range_ratio) as u32;
        let mut ids = prefix.clone();
        ids.extend((0..input).map(|_| token(rng)));
        out.push(BenchRequest { prompt_len: ids.len(), prompt: Prompt::TokenIds(ids), output_len: output });
    }
    Ok(out)
}

/// Words that are one token each (with their leading space) in common BPE vocabularies.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "it", "that", "for", "on", "with", "as", "was", "at", "by", "be", "this",
    "from", "or", "have", "an", "they", "which", "you", "one", "were", "all", "we", "when", "there", "can", "more",
    "if", "no", "out", "so", "said", "what", "up", "its", "about", "into", "than", "them", "only", "other", "new",
    "some", "time", "could", "these", "two", "may", "then", "do", "first", "any", "my", "now", "such", "like", "our",
    "over", "man", "even", "most", "made", "after", "also", "did", "many", "before", "must", "through", "back",
    "years", "where", "much", "your", "way", "well", "down", "should", "because", "each", "just", "those", "people",
    "how", "too", "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work", "long",
    "get", "here", "between", "both", "life", "being", "under", "never", "day", "same", "another", "know", "while",
    "last", "might", "us", "great", "old", "year", "off", "come", "since", "against", "go", "came", "right", "used",
    "take", "three", "house", "light", "water", "city", "night", "river", "small", "open", "story", "sea",
];

/// `words` random words separated by spaces.
pub fn synthetic_text(rng: &mut StdRng, words: usize) -> String {
    let mut s = String::with_capacity(words * 6);
    for i in 0..words {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

fn message(role: &str, content: String) -> Message {
    Message { role: role.to_owned(), content }
}

/// The `multi-turn` requests: `conversations × turns`, turn by turn.
///
/// # Errors
/// A zero count or length.
pub fn multi_turn(cfg: &MultiTurnConfig, rng: &mut StdRng) -> Result<Vec<BenchRequest>, DatasetError> {
    if cfg.conversations == 0 || cfg.turns == 0 || cfg.user_len == 0 || cfg.output_len == 0 {
        return Err(DatasetError::Invalid(
            "--multi-turn-conversations, --multi-turn-turns, --multi-turn-user-len and --multi-turn-output-len \
             must be at least 1"
                .into(),
        ));
    }
    let system = synthetic_text(rng, cfg.system_len);
    // Each conversation's user messages and assistant replies, drawn up front.
    let conversations: Vec<Vec<(String, String)>> = (0..cfg.conversations)
        .map(|_| {
            (0..cfg.turns)
                .map(|_| (synthetic_text(rng, cfg.user_len), synthetic_text(rng, cfg.output_len as usize)))
                .collect()
        })
        .collect();
    let mut out = Vec::with_capacity(cfg.conversations * cfg.turns);
    for turn in 0..cfg.turns {
        for exchanges in &conversations {
            let mut messages = Vec::with_capacity(2 * turn + 2);
            if cfg.system_len > 0 {
                messages.push(message("system", system.clone()));
            }
            for (user, assistant) in &exchanges[..turn] {
                messages.push(message("user", user.clone()));
                messages.push(message("assistant", assistant.clone()));
            }
            messages.push(message("user", exchanges[turn].0.clone()));
            let prompt_len = cfg.system_len + turn * (cfg.user_len + cfg.output_len as usize) + cfg.user_len;
            out.push(BenchRequest { prompt: Prompt::Chat(messages), prompt_len, output_len: cfg.output_len });
        }
    }
    Ok(out)
}

/// One line of a JSONL dataset.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    prompt: Option<Value>,
    messages: Option<Vec<Message>>,
    max_tokens: Option<u32>,
    output_len: Option<u32>,
}

fn words(s: &str) -> usize {
    s.split_whitespace().count().max(1)
}

fn parse_line(text: &str, default_output_len: u32) -> Result<BenchRequest, String> {
    let line: Line = serde_json::from_str(text).map_err(|e| format!("not a prompt object: {e}"))?;
    let output_len = match (line.max_tokens, line.output_len) {
        (Some(_), Some(_)) => return Err("give max_tokens or output_len, not both".into()),
        (Some(n), None) | (None, Some(n)) => n,
        (None, None) => default_output_len,
    };
    if output_len == 0 {
        return Err("max_tokens/output_len must be at least 1".into());
    }
    let (prompt_len, prompt) = match (line.prompt, line.messages) {
        (Some(_), Some(_)) => return Err("give prompt or messages, not both".into()),
        (None, None) => return Err("missing \"prompt\" or \"messages\"".into()),
        (Some(Value::String(s)), None) if s.is_empty() => return Err("\"prompt\" is empty".into()),
        (Some(Value::String(s)), None) => (words(&s), Prompt::Text(s)),
        (Some(Value::Array(ids)), None) => {
            let ids: Option<Vec<u32>> = ids.iter().map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok())).collect();
            match ids {
                Some(ids) if !ids.is_empty() => (ids.len(), Prompt::TokenIds(ids)),
                _ => return Err("\"prompt\" must be a string or a non-empty list of token ids".into()),
            }
        }
        (Some(_), None) => return Err("\"prompt\" must be a string or a non-empty list of token ids".into()),
        (None, Some(m)) if m.is_empty() => return Err("\"messages\" is empty".into()),
        (None, Some(m)) => (m.iter().map(|m| words(&m.content)).sum(), Prompt::Chat(m)),
    };
    Ok(BenchRequest { prompt, prompt_len, output_len })
}

/// Parses a JSONL dataset (`path` names it in errors); blank lines are skipped.
///
/// # Errors
/// [`DatasetError::BadLine`] for the first line that is not a prompt object; `Invalid`
/// when the file holds no prompt.
pub fn parse_jsonl(text: &str, path: &str, default_output_len: u32) -> Result<Vec<BenchRequest>, DatasetError> {
    let mut out = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let raw = raw.trim();
        if raw.is_empty() {
            continue;
        }
        let request = parse_line(raw, default_output_len).map_err(|reason| DatasetError::BadLine {
            path: path.to_owned(),
            line: i + 1,
            reason,
        })?;
        out.push(request);
    }
    if out.is_empty() {
        return Err(DatasetError::Invalid(format!("{path} holds no prompt")));
    }
    Ok(out)
}

/// Reads and parses a JSONL dataset file.
///
/// # Errors
/// As [`parse_jsonl`], or [`DatasetError::Io`].
pub fn read_jsonl(path: &std::path::Path, default_output_len: u32) -> Result<Vec<BenchRequest>, DatasetError> {
    let name = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| DatasetError::Io { path: name.clone(), source })?;
    parse_jsonl(&text, &name, default_output_len)
}

/// `requests` cut or repeated (in order) to exactly `n`.
pub fn fit(requests: Vec<BenchRequest>, n: usize) -> Vec<BenchRequest> {
    if requests.len() >= n {
        let mut requests = requests;
        requests.truncate(n);
        return requests;
    }
    requests.iter().cycle().take(n).cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn cfg(input_len: usize, output_len: u32, range_ratio: f64, prefix_len: usize) -> RandomConfig {
        RandomConfig { input_len, output_len, range_ratio, prefix_len, vocab_size: 32000 }
    }

    #[test]
    fn random_lengths_exact_without_range() {
        let mut rng = StdRng::seed_from_u64(7);
        let reqs = random(&cfg(32, 8, 0.0, 0), 50, &mut rng).unwrap();
        assert_eq!(reqs.len(), 50);
        for r in &reqs {
            let Prompt::TokenIds(ids) = &r.prompt else { panic!("random sends token ids") };
            assert_eq!(ids.len(), 32);
            assert_eq!(r.prompt_len, 32);
            assert_eq!(r.output_len, 8);
            assert!(ids.iter().all(|&t| (RANDOM_TOKEN_FLOOR..32000).contains(&t)));
        }
    }

    #[test]
    fn random_lengths_within_range_and_prefix_shared() {
        let mut rng = StdRng::seed_from_u64(1);
        let reqs = random(&cfg(100, 50, 0.5, 16), 400, &mut rng).unwrap();
        let prefix = match &reqs[0].prompt {
            Prompt::TokenIds(ids) => ids[..16].to_vec(),
            _ => unreachable!(),
        };
        let (mut min_in, mut max_in) = (usize::MAX, 0);
        for r in &reqs {
            let Prompt::TokenIds(ids) = &r.prompt else { panic!() };
            assert_eq!(&ids[..16], prefix.as_slice(), "every prompt starts with the shared prefix");
            let input = ids.len() - 16;
            assert!((50..=150).contains(&input), "input {input}");
            assert!((25..=75).contains(&r.output_len), "output {}", r.output_len);
            min_in = min_in.min(input);
            max_in = max_in.max(input);
        }
        // 400 uniform draws over 101 values reach close to both ends.
        assert!(min_in <= 55 && max_in >= 145, "{min_in}..{max_in}");
        let again = random(&cfg(100, 50, 0.5, 16), 400, &mut StdRng::seed_from_u64(1)).unwrap();
        assert_eq!(reqs, again, "same seed, same requests");
    }

    #[test]
    fn random_rejects_bad_ratio() {
        let mut rng = StdRng::seed_from_u64(1);
        assert!(matches!(random(&cfg(10, 10, 1.0, 0), 1, &mut rng), Err(DatasetError::Invalid(_))));
        assert!(matches!(random(&cfg(10, 0, 0.0, 0), 1, &mut rng), Err(DatasetError::Invalid(_))));
    }

    #[test]
    fn length_range_bounds() {
        assert_eq!(length_range(100, 0.0), (100, 100));
        assert_eq!(length_range(100, 0.25), (75, 125));
        assert_eq!(length_range(1, 0.9), (1, 2));
    }

    #[test]
    fn multi_turn_histories_extend_turn_by_turn() {
        let cfg = MultiTurnConfig { conversations: 3, turns: 4, system_len: 20, user_len: 5, output_len: 7 };
        let reqs = multi_turn(&cfg, &mut StdRng::seed_from_u64(3)).unwrap();
        assert_eq!(reqs.len(), 12);
        let chat = |i: usize| match &reqs[i].prompt {
            Prompt::Chat(m) => m.clone(),
            _ => panic!("multi-turn sends chats"),
        };
        let system = chat(0)[0].clone();
        assert_eq!(system.role, "system");
        assert_eq!(system.content.split(' ').count(), 20);
        for turn in 0..4 {
            for conv in 0..3 {
                let i = turn * 3 + conv;
                let m = chat(i);
                assert_eq!(m.len(), 2 + 2 * turn, "system + {turn} exchanges + the new user message");
                assert_eq!(m[0], system, "every conversation shares the system prompt");
                assert_eq!(m.last().unwrap().role, "user");
                assert_eq!(reqs[i].prompt_len, 20 + turn * 12 + 5);
                assert_eq!(reqs[i].output_len, 7);
                if turn > 0 {
                    let before = chat(i - 3);
                    assert_eq!(&m[..before.len()], before.as_slice(), "turn {turn} extends turn {}", turn - 1);
                    assert_eq!(m[before.len()].role, "assistant");
                    assert_eq!(m[before.len()].content.split(' ').count(), 7);
                }
            }
        }
        assert_ne!(chat(0)[1], chat(1)[1], "conversations differ after the system prompt");
    }

    #[test]
    fn jsonl_prompts_messages_and_lengths() {
        let text = concat!(
            "{\"prompt\": \"hello there world\"}\n",
            "\n",
            "{\"prompt\": [1, 2, 3], \"max_tokens\": 5}\n",
            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi you\"}], \"output_len\": 9}\n",
        );
        let reqs = parse_jsonl(text, "p.jsonl", 16).unwrap();
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0].prompt, Prompt::Text("hello there world".into()));
        assert_eq!((reqs[0].prompt_len, reqs[0].output_len), (3, 16));
        assert_eq!(reqs[1].prompt, Prompt::TokenIds(vec![1, 2, 3]));
        assert_eq!((reqs[1].prompt_len, reqs[1].output_len), (3, 5));
        assert_eq!(reqs[2].prompt, Prompt::Chat(vec![message("user", "hi you".into())]));
        assert_eq!(reqs[2].output_len, 9);
    }

    #[test]
    fn jsonl_bad_lines_name_the_line() {
        let cases = [
            ("{\"prompt\": \"a\"}\n{\"prompt\": \"b\"\n", 2),  // broken JSON
            ("{\"prompt\": \"a\"}\n\n{\"text\": \"b\"}\n", 3), // unknown field
            ("{\"max_tokens\": 3}\n", 1),                      // no prompt
            ("{\"prompt\": \"a\", \"messages\": []}\n", 1),    // both
            ("{\"prompt\": 5}\n", 1),                          // wrong type
            ("{\"prompt\": [1, -2]}\n", 1),                    // not token ids
            ("{\"prompt\": \"a\", \"max_tokens\": 0}\n", 1),   // zero output
            ("{\"prompt\": \"a\"}\n{\"messages\": [{\"role\": \"user\"}]}\n", 2), // message without content
        ];
        for (text, want) in cases {
            match parse_jsonl(text, "d.jsonl", 8) {
                Err(DatasetError::BadLine { path, line, .. }) => {
                    assert_eq!(path, "d.jsonl");
                    assert_eq!(line, want, "{text:?}");
                }
                other => panic!("{text:?}: expected a bad line, got {other:?}"),
            }
        }
        assert!(matches!(parse_jsonl("\n\n", "e.jsonl", 8), Err(DatasetError::Invalid(_))));
    }

    #[test]
    fn fit_cuts_or_cycles() {
        let reqs = parse_jsonl("{\"prompt\": \"a\"}\n{\"prompt\": \"b\"}\n", "f", 1).unwrap();
        assert_eq!(fit(reqs.clone(), 1), reqs[..1].to_vec());
        let five = fit(reqs.clone(), 5);
        assert_eq!(five.len(), 5);
        assert_eq!(five[4], reqs[0]);
    }
}
