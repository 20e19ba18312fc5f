//! The API-key flags shared by `prism-router` and `prism up` (`--api-key`, `--api-key-file`,
//! the per-key limits, `--metrics-without-auth`) and the key file's syntax:
//!
//! ```text
//! # one key per line; blank lines and lines starting with `#` are ignored
//! sk-team-a-0123456789 name=team-a rps=5 tpm=20000
//! sk-batch-9876543210  tpm=0
//! ```
//!
//! After the key, whitespace-separated options: `name=LABEL` (the `key` label of the
//! rate-limit metric; default: the key's position, `0`, `1`, … in flag-then-file order),
//! `rps=N` (requests per second) and `tpm=N` (tokens per minute), which override
//! `--api-key-rate-limit` / `--api-key-token-limit` for that key; `0` = no limit. Errors name
//! the file and line, never the key.

use std::path::{Path, PathBuf};

/// A problem with the configured keys (never shows a key).
#[derive(Debug, thiserror::Error)]
pub enum KeyConfigError {
    /// The key file cannot be read.
    #[error("--api-key-file {path}: cannot read it: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The key file holds no key.
    #[error("--api-key-file {path}: no key in the file (one key per line; `#` starts a comment line)")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// A line of the key file is malformed.
    #[error("--api-key-file {path} line {line}: {message}")]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        message: String,
    },
    /// An `--api-key` value is not a usable key.
    #[error("--api-key number {0}: a key is printable ASCII without spaces")]
    BadFlagKey(usize),
    /// The same key twice.
    #[error("{0}: the same API key is given twice")]
    Duplicate(String),
    /// A limit flag without any key.
    #[error("{0} needs --api-key or --api-key-file")]
    LimitWithoutKey(&'static str),
    /// A limit flag that is not a positive finite number.
    #[error("{0} must be a finite number >= 0 (0 = no limit)")]
    BadLimit(&'static str),
}

/// One accepted key with its resolved limits (`Debug` does not show the key).
#[derive(Clone, PartialEq)]
pub struct ApiKeyEntry {
    /// The secret.
    pub key: String,
    /// The `key` label of the rate-limit metric.
    pub label: String,
    /// Requests per second (burst: one second's worth, at least 1); `None` = no limit.
    pub rps: Option<f64>,
    /// Tokens (prompt + max_tokens × n, estimated at admission) per minute; `None` = no limit.
    pub tpm: Option<u64>,
}

impl std::fmt::Debug for ApiKeyEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeyEntry")
            .field("key", &"<redacted>")
            .field("label", &self.label)
            .field("rps", &self.rps)
            .field("tpm", &self.tpm)
            .finish()
    }
}

impl From<&str> for ApiKeyEntry {
    /// A key without limits, labelled by nothing in particular (`-`).
    fn from(key: &str) -> Self {
        Self { key: key.to_owned(), label: "-".into(), rps: None, tpm: None }
    }
}

/// The API-key flags (`#[command(flatten)]` into a binary's flags; `Debug` hides the keys).
#[derive(clap::Args, Clone, Default)]
pub struct ApiKeyArgs {
    /// Accepted API key (repeatable, or comma separated in PRISM_API_KEY). With any key set,
    /// every HTTP route but /health, /healthz and /readyz, and every gRPC method but
    /// grpc.health.v1, needs `Authorization: Bearer KEY`.
    #[arg(long = "api-key", env = "PRISM_API_KEY", value_delimiter = ',', hide_env_values = true)]
    pub api_key: Vec<String>,
    /// File of accepted API keys: one per line, `KEY [name=LABEL] [rps=N] [tpm=N]`; blank
    /// lines and lines starting with `#` are ignored (docs/security.md).
    #[arg(long = "api-key-file", env = "PRISM_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// Requests per second each key may send (bursts of one second's worth); past it: 429 with
    /// Retry-After. A key file's `rps=` overrides it. Default: no limit.
    #[arg(long = "api-key-rate-limit", env = "PRISM_API_KEY_RATE_LIMIT")]
    pub api_key_rate_limit: Option<f64>,
    /// Tokens per minute each key may request (prompt + max_tokens × n, counted at
    /// admission); past it: 429 with Retry-After. A key file's `tpm=` overrides it. Default: no limit.
    #[arg(long = "api-key-token-limit", env = "PRISM_API_KEY_TOKEN_LIMIT")]
    pub api_key_token_limit: Option<u64>,
    /// Serve /metrics without an API key (for a Prometheus that scrapes without credentials);
    /// by default /metrics needs a key like every other route once keys are set.
    #[arg(long = "metrics-without-auth", env = "PRISM_METRICS_WITHOUT_AUTH")]
    pub metrics_without_auth: bool,
}

impl std::fmt::Debug for ApiKeyArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeyArgs")
            .field("api_key", &format_args!("<{} redacted>", self.api_key.len()))
            .field("api_key_file", &self.api_key_file)
            .field("api_key_rate_limit", &self.api_key_rate_limit)
            .field("api_key_token_limit", &self.api_key_token_limit)
            .field("metrics_without_auth", &self.metrics_without_auth)
            .finish()
    }
}

/// A key is printable ASCII without whitespace (it travels in a header).
fn valid_key(k: &str) -> bool {
    !k.is_empty() && k.bytes().all(|b| b.is_ascii_graphic())
}

/// A per-key limit value (`0` = none).
fn per_key_limit(v: &str) -> Option<f64> {
    v.parse::<f64>().ok().filter(|x| x.is_finite() && *x >= 0.0)
}

impl ApiKeyArgs {
    /// The accepted keys (flags first, then the file) with their limits resolved.
    ///
    /// # Errors
    /// [`KeyConfigError`] for an unreadable, empty or malformed key file, a bad or repeated
    /// key, or a limit flag without keys.
    pub fn entries(&self) -> Result<Vec<ApiKeyEntry>, KeyConfigError> {
        let rps = match self.api_key_rate_limit {
            Some(r) if !(r.is_finite() && r >= 0.0) => return Err(KeyConfigError::BadLimit("--api-key-rate-limit")),
            r => r.filter(|r| *r > 0.0),
        };
        let tpm = self.api_key_token_limit.filter(|t| *t > 0);
        let mut out: Vec<ApiKeyEntry> = Vec::new();
        for (i, k) in self.api_key.iter().map(|k| k.trim()).filter(|k| !k.is_empty()).enumerate() {
            if !valid_key(k) {
                return Err(KeyConfigError::BadFlagKey(i + 1));
            }
            if out.iter().any(|e| e.key == k) {
                return Err(KeyConfigError::Duplicate(format!("--api-key number {}", i + 1)));
            }
            out.push(ApiKeyEntry { key: k.to_owned(), label: out.len().to_string(), rps, tpm });
        }
        if let Some(path) = &self.api_key_file {
            let text =
                std::fs::read_to_string(path).map_err(|source| KeyConfigError::Read { path: path.clone(), source })?;
            let before = out.len();
            parse_file(path, &text, rps, tpm, &mut out)?;
            if out.len() == before {
                return Err(KeyConfigError::Empty { path: path.clone() });
            }
        }
        if out.is_empty() {
            if self.api_key_rate_limit.is_some() {
                return Err(KeyConfigError::LimitWithoutKey("--api-key-rate-limit"));
            }
            if self.api_key_token_limit.is_some() {
                return Err(KeyConfigError::LimitWithoutKey("--api-key-token-limit"));
            }
        }
        Ok(out)
    }
}

/// Appends the keys of a key file's `text` to `out`.
fn parse_file(
    path: &Path,
    text: &str,
    rps: Option<f64>,
    tpm: Option<u64>,
    out: &mut Vec<ApiKeyEntry>,
) -> Result<(), KeyConfigError> {
    for (n, line) in text.lines().enumerate() {
        let err = |message: String| KeyConfigError::Line { path: path.to_owned(), line: n + 1, message };
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut fields = line.split_whitespace();
        let key = fields.next().unwrap_or_default();
        if ["name=", "rps=", "tpm="].iter().any(|p| key.starts_with(p)) {
            return Err(err("the line must start with the key, then its options".into()));
        }
        if !valid_key(key) {
            return Err(err("a key is printable ASCII without spaces".into()));
        }
        if out.iter().any(|e| e.key == key) {
            return Err(KeyConfigError::Duplicate(format!("--api-key-file {} line {}", path.display(), n + 1)));
        }
        let mut entry = ApiKeyEntry { key: key.to_owned(), label: out.len().to_string(), rps, tpm };
        for opt in fields {
            let (name, value) = opt.split_once('=').ok_or_else(|| err("options are NAME=VALUE".into()))?;
            match name {
                "name" if !value.is_empty() && value.bytes().all(|b| b.is_ascii_graphic()) => {
                    entry.label = value.to_owned();
                }
                "rps" => {
                    let v =
                        per_key_limit(value).ok_or_else(|| err("rps must be a number >= 0 (0 = no limit)".into()))?;
                    entry.rps = (v > 0.0).then_some(v);
                }
                "tpm" => {
                    let v: u64 =
                        value.parse().map_err(|_| err("tpm must be a whole number >= 0 (0 = no limit)".into()))?;
                    entry.tpm = (v > 0).then_some(v);
                }
                "name" => return Err(err("name must be printable ASCII without spaces".into())),
                _ => return Err(err(format!("unknown option `{name}` (name, rps, tpm)"))),
            }
        }
        out.push(entry);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        keys: ApiKeyArgs,
    }

    fn parse(args: &[&str]) -> ApiKeyArgs {
        Cli::parse_from(std::iter::once("x").chain(args.iter().copied())).keys
    }

    #[test]
    fn flags_and_file_give_keys_with_limits() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("keys");
        std::fs::write(&file, "# team keys\n\nsk-file-1 name=team-a rps=5 tpm=20000\n  sk-file-2 tpm=0\nc2stMw==\n")?;
        let f = file.to_string_lossy().into_owned();
        let a = parse(&["--api-key", "sk-a", "--api-key=sk-b", "--api-key-file", &f, "--api-key-rate-limit", "2"]);
        let e = a.entries()?;
        let got: Vec<_> = e.iter().map(|e| (e.key.as_str(), e.label.as_str(), e.rps, e.tpm)).collect();
        assert_eq!(
            got,
            vec![
                ("sk-a", "0", Some(2.0), None),
                ("sk-b", "1", Some(2.0), None),
                ("sk-file-1", "team-a", Some(5.0), Some(20000)),
                ("sk-file-2", "3", Some(2.0), None),
                ("c2stMw==", "4", Some(2.0), None),
            ]
        );
        let shown = format!("{a:?} {e:?}");
        for k in ["sk-a", "sk-b", "sk-file-1", "sk-file-2", "c2stMw=="] {
            assert!(!shown.contains(k), "Debug shows a key: {shown}");
        }
        Ok(())
    }

    #[test]
    fn bad_key_files_are_errors_naming_the_path_and_line_not_the_key() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let missing = dir.path().join("nope");
        let m = missing.to_string_lossy().into_owned();
        let err = parse(&["--api-key-file", &m]).entries().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains(&m) && err.contains("cannot read"), "{err}");
        for (text, want) in [
            ("# only comments\n\n", "no key in the file"),
            ("sk-secret-1 rps=fast\n", "line 1: rps must be"),
            ("# c\nsk-secret-1 color=red\n", "line 2: unknown option `color`"),
            ("sk-secret-1\nsk-secret-1\n", "line 2: the same API key is given twice"),
            ("rps=5 sk-secret-1\n", "line 1: the line must start with the key"),
            ("sk-secret-1 tpm=-3\n", "line 1: tpm must be"),
        ] {
            let file = dir.path().join("keys");
            std::fs::write(&file, text)?;
            let f = file.to_string_lossy().into_owned();
            let err = parse(&["--api-key-file", &f]).entries().err().map(|e| e.to_string()).unwrap_or_default();
            assert!(err.contains(&f) && err.contains(want), "{text:?}: {err}");
            assert!(!err.contains("sk-secret-1"), "the error shows the key: {err}");
        }
        let err = parse(&["--api-key-rate-limit", "3"]).entries().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("--api-key-rate-limit needs --api-key"), "{err}");
        let err = parse(&["--api-key", "a", "--api-key-rate-limit=-1"]).entries().err().map(|e| e.to_string());
        assert!(err.unwrap_or_default().contains("--api-key-rate-limit must be"));
        let err = parse(&["--api-key", "sk-x,sk-x"]).entries().err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("twice") && !err.contains("sk-x"), "{err}");
        assert!(parse(&[]).entries()?.is_empty(), "no key = no authentication");
        Ok(())
    }
}
