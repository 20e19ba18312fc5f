//! The `prefix_repetition` dataset (vLLM's `--dataset-name prefix_repetition`): `num_prefixes`
//! random prefixes of `prefix_len` tokens; each request is one of them followed by its own random
//! suffix of `suffix_len` tokens, and asks for `output_len` tokens. Requests are spread evenly
//! over the prefixes and shuffled (seeded), so requests sharing a prefix arrive interleaved with
//! the others — what prefix caching, and a router that knows where each prefix is cached, serve.
//! With one prefix of about 1,000 tokens and short suffixes it is the shared-system-prompt trace.
//!
//! Two forms, picked by the backend:
//! - [`PrefixForm::TokenIds`] (completions, gRPC): token ids drawn from
//!   `[RANDOM_TOKEN_FLOOR, vocab_size)`, so lengths are exact and the prefix is shared token for
//!   token. vLLM decodes such ids to text and re-encodes them; Prism takes ids directly.
//! - [`PrefixForm::Chat`] (chat completions): the prefix is a system message and the suffix the
//!   user turn, both synthetic words (one token each in the usual BPE vocabularies, so lengths
//!   are close to `prefix_len` / `suffix_len` tokens; the server's `usage` gives the exact counts).
//!
//! vLLM sends `num_requests / num_prefixes` requests per prefix (then oversamples to the number
//! asked); here the remainder goes one request each to the first prefixes, so exactly `n`
//! requests are made and no prompt is sent twice.

use super::{BenchRequest, DatasetError, Message, Prompt, RANDOM_TOKEN_FLOOR, synthetic_text};
use rand::Rng;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;

/// vLLM's defaults.
pub const DEFAULT_PREFIX_LEN: usize = 256;
/// vLLM's default suffix length.
pub const DEFAULT_SUFFIX_LEN: usize = 256;
/// vLLM's default number of prefixes.
pub const DEFAULT_NUM_PREFIXES: usize = 10;
/// vLLM's default output length.
pub const DEFAULT_OUTPUT_LEN: u32 = 128;

/// How the prompts are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefixForm {
    /// Prefix ids then suffix ids, one token-id prompt.
    TokenIds,
    /// A system message (the prefix) and a user message (the suffix).
    Chat,
}

/// `--prefix-repetition-*` settings.
#[derive(Debug, Clone, Copy)]
pub struct PrefixRepetitionConfig {
    /// Tokens (words for chat) of each shared prefix.
    pub prefix_len: usize,
    /// Tokens (words for chat) of each request's own suffix.
    pub suffix_len: usize,
    /// Distinct prefixes.
    pub num_prefixes: usize,
    /// `max_tokens` of every request.
    pub output_len: u32,
    /// Token ids are drawn from `[RANDOM_TOKEN_FLOOR, vocab_size)` (token-id form).
    pub vocab_size: u32,
}

impl PrefixRepetitionConfig {
    /// Checks the settings against `n` requests.
    ///
    /// # Errors
    /// A zero length or count, fewer requests than prefixes, or a vocabulary too small.
    pub fn validate(&self, n: usize) -> Result<(), DatasetError> {
        if self.prefix_len == 0 {
            return Err(DatasetError::Invalid("--prefix-repetition-prefix-len must be at least 1".into()));
        }
        if self.suffix_len == 0 {
            // The last prompt token is always computed, so a request must bring one of its own.
            return Err(DatasetError::Invalid("--prefix-repetition-suffix-len must be at least 1".into()));
        }
        if self.output_len == 0 {
            return Err(DatasetError::Invalid("--prefix-repetition-output-len must be at least 1".into()));
        }
        if self.num_prefixes == 0 {
            return Err(DatasetError::Invalid("--prefix-repetition-num-prefixes must be at least 1".into()));
        }
        if n < self.num_prefixes {
            return Err(DatasetError::Invalid(format!(
                "--num-prompts ({n}) must be at least --prefix-repetition-num-prefixes ({})",
                self.num_prefixes
            )));
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

/// One prefix or suffix, in the form's terms.
enum Part {
    Ids(Vec<u32>),
    Text(String),
}

fn part(cfg: &PrefixRepetitionConfig, form: PrefixForm, len: usize, rng: &mut StdRng) -> Part {
    match form {
        PrefixForm::TokenIds => {
            Part::Ids((0..len).map(|_| rng.random_range(RANDOM_TOKEN_FLOOR..cfg.vocab_size)).collect())
        }
        PrefixForm::Chat => Part::Text(synthetic_text(rng, len)),
    }
}

/// `n` requests over `cfg.num_prefixes` shared prefixes, shuffled.
///
/// # Errors
/// See [`PrefixRepetitionConfig::validate`].
pub fn prefix_repetition(
    cfg: &PrefixRepetitionConfig,
    form: PrefixForm,
    n: usize,
    rng: &mut StdRng,
) -> Result<Vec<BenchRequest>, DatasetError> {
    cfg.validate(n)?;
    let (per_prefix, extra) = (n / cfg.num_prefixes, n % cfg.num_prefixes);
    let mut out = Vec::with_capacity(n);
    for p in 0..cfg.num_prefixes {
        let prefix = part(cfg, form, cfg.prefix_len, rng);
        for _ in 0..per_prefix + usize::from(p < extra) {
            let prompt = match (&prefix, part(cfg, form, cfg.suffix_len, rng)) {
                (Part::Ids(prefix), Part::Ids(suffix)) => Prompt::TokenIds([prefix.as_slice(), &suffix].concat()),
                (Part::Text(system), Part::Text(user)) => Prompt::Chat(vec![
                    Message { role: "system".into(), content: system.clone() },
                    Message { role: "user".into(), content: user },
                ]),
                _ => unreachable!("prefix and suffix are drawn in the same form"),
            };
            out.push(BenchRequest { prompt, prompt_len: cfg.prefix_len + cfg.suffix_len, output_len: cfg.output_len });
        }
    }
    out.shuffle(rng);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use std::collections::BTreeMap;

    fn cfg(prefix_len: usize, suffix_len: usize, num_prefixes: usize) -> PrefixRepetitionConfig {
        PrefixRepetitionConfig { prefix_len, suffix_len, num_prefixes, output_len: 16, vocab_size: 32000 }
    }

    fn ids(r: &BenchRequest) -> &[u32] {
        match &r.prompt {
            Prompt::TokenIds(ids) => ids,
            other => panic!("expected token ids, got {other:?}"),
        }
    }

    #[test]
    fn token_ids_share_each_prefix_exactly() {
        let reqs = prefix_repetition(&cfg(32, 8, 4), PrefixForm::TokenIds, 23, &mut StdRng::seed_from_u64(5)).unwrap();
        assert_eq!(reqs.len(), 23, "exactly --num-prompts requests");
        let mut by_prefix: BTreeMap<Vec<u32>, usize> = BTreeMap::new();
        for r in &reqs {
            let ids = ids(r);
            assert_eq!(ids.len(), 40);
            assert_eq!((r.prompt_len, r.output_len), (40, 16));
            assert!(ids.iter().all(|&t| (RANDOM_TOKEN_FLOOR..32000).contains(&t)));
            *by_prefix.entry(ids[..32].to_vec()).or_default() += 1;
        }
        // 23 over 4 prefixes: 6, 6, 6, 5; every request with a prefix shares it token for token.
        let mut counts: Vec<usize> = by_prefix.values().copied().collect();
        counts.sort_unstable();
        assert_eq!(counts, vec![5, 6, 6, 6]);
        let suffixes: std::collections::BTreeSet<&[u32]> = reqs.iter().map(|r| &ids(r)[32..]).collect();
        assert_eq!(suffixes.len(), 23, "every suffix is its own");
        // Shuffled: the first 6 requests do not all carry the same prefix.
        assert!(reqs[..6].iter().any(|r| ids(r)[..32] != ids(&reqs[0])[..32]), "requests are interleaved");
    }

    #[test]
    fn chat_prefix_is_the_system_message() {
        let reqs = prefix_repetition(&cfg(50, 6, 1), PrefixForm::Chat, 5, &mut StdRng::seed_from_u64(2)).unwrap();
        assert_eq!(reqs.len(), 5);
        let chat = |r: &BenchRequest| match &r.prompt {
            Prompt::Chat(m) => m.clone(),
            other => panic!("expected chat, got {other:?}"),
        };
        let first = chat(&reqs[0]);
        assert_eq!(first[0].role, "system");
        assert_eq!(first[0].content.split(' ').count(), 50);
        for r in &reqs {
            let m = chat(r);
            assert_eq!(m.len(), 2);
            assert_eq!(m[0], first[0], "one system prompt, the same text in every request");
            assert_eq!(m[1].role, "user");
            assert_eq!(m[1].content.split(' ').count(), 6);
        }
        let users: std::collections::BTreeSet<String> = reqs.iter().map(|r| chat(r)[1].content.clone()).collect();
        assert_eq!(users.len(), 5, "short user turns differ");
    }

    #[test]
    fn seeded_and_deterministic() {
        let make = |seed| prefix_repetition(&cfg(16, 4, 3), PrefixForm::TokenIds, 12, &mut StdRng::seed_from_u64(seed));
        assert_eq!(make(9).unwrap(), make(9).unwrap(), "same seed, same requests in the same order");
        assert_ne!(make(9).unwrap(), make(10).unwrap());
        let chat = |seed| prefix_repetition(&cfg(16, 4, 3), PrefixForm::Chat, 12, &mut StdRng::seed_from_u64(seed));
        assert_eq!(chat(1).unwrap(), chat(1).unwrap());
    }

    #[test]
    fn bad_settings_name_the_flag() {
        let mut rng = StdRng::seed_from_u64(0);
        let mut err = |c: PrefixRepetitionConfig, n| match prefix_repetition(&c, PrefixForm::TokenIds, n, &mut rng) {
            Err(DatasetError::Invalid(m)) => m,
            other => panic!("expected an invalid setting, got {other:?}"),
        };
        assert!(err(cfg(8, 8, 10), 9).contains("--prefix-repetition-num-prefixes"));
        assert!(err(cfg(0, 8, 1), 4).contains("--prefix-repetition-prefix-len"));
        assert!(err(cfg(8, 0, 1), 4).contains("--prefix-repetition-suffix-len"));
        assert!(err(cfg(8, 8, 0), 4).contains("--prefix-repetition-num-prefixes"));
        assert!(err(PrefixRepetitionConfig { output_len: 0, ..cfg(8, 8, 1) }, 4).contains("output-len"));
        assert!(err(PrefixRepetitionConfig { vocab_size: 100, ..cfg(8, 8, 1) }, 4).contains("--random-vocab-size"));
    }
}
