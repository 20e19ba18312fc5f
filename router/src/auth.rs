//! API keys: which requests may pass and how much each key may send. With any key
//! configured, every HTTP request but the probes ([`is_http_probe`]) and every gRPC call but
//! `grpc.health.v1` ([`is_grpc_probe`]) needs `Authorization: Bearer KEY` (scheme in any case);
//! the guards that apply this sit in front of routing (`openai/guard.rs`, `grpc/guard.rs`).
//! Per-key limits are token buckets: requests per second on every authenticated request,
//! tokens per minute on generation requests (prompt + max_tokens × n, estimated at admission
//! as the admission queue does; given back unless a replica accepts the request, see
//! [`TokenCharge`]). Keys are never logged; metrics name a key by its label.
//! No configured key = no authentication.

mod bucket;
mod keyfile;

use prism_common::bearer::{bearer_token, ct_eq};
use std::sync::{Arc, Mutex};
use std::time::Instant;

pub use keyfile::{ApiKeyArgs, ApiKeyEntry, KeyConfigError};

use crate::metrics::Metrics;
use bucket::Bucket;

/// HTTP paths open without a key (exact match on the raw path, GET or HEAD only).
pub const HTTP_PROBES: [&str; 3] = ["/health", "/healthz", "/readyz"];
/// gRPC methods open without a key: the standard health service.
pub const GRPC_PROBES: [&str; 2] = ["/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"];

/// Whether an HTTP request is a probe that needs no key: GET/HEAD on exactly one of
/// [`HTTP_PROBES`] (or `/metrics` when `metrics_open`), compared to the path as received, so
/// no spelling of another route (`/healthz/../v1/models`, `/health%2F..`) counts as one.
pub fn is_http_probe(method: &http::Method, raw_path: &str, metrics_open: bool) -> bool {
    (method == http::Method::GET || method == http::Method::HEAD)
        && (HTTP_PROBES.contains(&raw_path) || (metrics_open && raw_path == "/metrics"))
}

/// Whether a gRPC request path is a health probe.
pub fn is_grpc_probe(path: &str) -> bool {
    GRPC_PROBES.contains(&path)
}

/// Who sent an authenticated request: the index of its key (put in request extensions by the
/// guards, read by the generation endpoints for the token limit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller(usize);

/// Why a request was refused authentication (`reason` label of
/// `prism_router_auth_rejected_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejected {
    /// No `Authorization`.
    Missing,
    /// Not `Bearer TOKEN`, several `Authorization` values, or not text.
    Malformed,
    /// A token that is no configured key.
    Invalid,
}

impl Rejected {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Malformed => "malformed",
            Self::Invalid => "invalid",
        }
    }
}

/// A per-key limit was hit: retry after this many seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limited {
    /// `requests` or `tokens` (the `limit` label).
    pub limit: &'static str,
    /// Seconds until the bucket holds enough (at least 1).
    pub retry_after_s: u32,
    /// Whether the request is larger than the key's whole per-minute token budget.
    pub over_budget: bool,
}

impl Limited {
    /// The client-facing message (names the limit, never the key).
    pub fn message(&self) -> String {
        match self.limit {
            "requests" => "rate limit reached for this API key (requests per second)".into(),
            _ if self.over_budget => "request exceeds this API key's tokens-per-minute limit".into(),
            _ => "rate limit reached for this API key (tokens per minute)".into(),
        }
    }
}

struct KeyState {
    secret: Vec<u8>,
    label: String,
    rps: Option<Mutex<Bucket>>,
    tpm: Option<(u64, Mutex<Bucket>)>,
}

/// The accepted keys and their limits (cheap `Clone`; `Debug` shows only the count).
#[derive(Clone)]
pub struct ApiKeys {
    keys: Arc<Vec<KeyState>>,
    metrics: Metrics,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.keys.len())
    }
}

impl ApiKeys {
    /// Keys from the configuration (empty entries dropped); none disables authentication.
    pub fn new(entries: &[ApiKeyEntry], metrics: Metrics) -> Self {
        let now = Instant::now();
        let keys = entries
            .iter()
            .filter(|e| !e.key.is_empty())
            .map(|e| KeyState {
                secret: e.key.as_bytes().to_vec(),
                label: e.label.clone(),
                rps: e.rps.map(|r| Mutex::new(Bucket::new(r.max(1.0), r, now))),
                tpm: e.tpm.map(|t| (t, Mutex::new(Bucket::new(t as f64, t as f64 / 60.0, now)))),
            })
            .collect();
        Self { keys: Arc::new(keys), metrics }
    }

    /// Whether any key is configured (authentication on).
    pub fn enabled(&self) -> bool {
        !self.keys.is_empty()
    }

    /// Authenticates the `Authorization` values of a request (all of them: more than one is
    /// refused, as a proxy in front may have checked another). `Ok(None)` when authentication
    /// is off. Refusals are counted in `prism_router_auth_rejected_total{reason}`.
    ///
    /// # Errors
    /// [`Rejected`] when no valid key is presented.
    pub fn authenticate<'a>(&self, mut values: impl Iterator<Item = &'a [u8]>) -> Result<Option<Caller>, Rejected> {
        if !self.enabled() {
            return Ok(None);
        }
        let r = match (values.next(), values.next()) {
            (None, _) => Err(Rejected::Missing),
            (Some(_), Some(_)) => Err(Rejected::Malformed),
            (Some(v), None) => match bearer_token(v) {
                None => Err(Rejected::Malformed),
                // Every key is compared, so the time taken does not tell which one matched.
                Some(t) => self
                    .keys
                    .iter()
                    .enumerate()
                    .fold(None, |found, (i, k)| if ct_eq(&k.secret, t) { Some(i) } else { found })
                    .map(|i| Some(Caller(i)))
                    .ok_or(Rejected::Invalid),
            },
        };
        if let Err(why) = r {
            self.metrics.auth_rejected(why.as_str());
        }
        r
    }

    fn limited(&self, k: &KeyState, limit: &'static str, retry_after_s: u32, over_budget: bool) -> Limited {
        self.metrics.rate_limited(&k.label, limit);
        Limited { limit, retry_after_s, over_budget }
    }

    /// Counts one request of `caller` against its requests-per-second limit.
    ///
    /// # Errors
    /// [`Limited`] when the key is over it.
    pub fn admit_request(&self, caller: Option<Caller>) -> Result<(), Limited> {
        let Some(k) = caller.and_then(|c| self.keys.get(c.0)) else { return Ok(()) };
        let Some(b) = &k.rps else { return Ok(()) };
        let r = b.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take(1.0, Instant::now());
        r.map_err(|s| self.limited(k, "requests", s, false))
    }

    /// Takes `tokens` (a generation request's estimate) from `caller`'s tokens-per-minute
    /// budget. The returned [`TokenCharge`] gives them back when dropped before
    /// [`TokenCharge::commit`]: a request refused after this (unknown model, over the context
    /// length, no replica, queue bound, client gone while queued) costs the key nothing.
    ///
    /// # Errors
    /// [`Limited`] when the key is over it.
    pub fn admit_tokens(&self, caller: Option<Caller>, tokens: u64) -> Result<TokenCharge, Limited> {
        let none = TokenCharge { keys: None, index: 0, tokens: 0.0 };
        let Some((i, k)) = caller.and_then(|c| self.keys.get(c.0).map(|k| (c.0, k))) else { return Ok(none) };
        let Some((tpm, b)) = &k.tpm else { return Ok(none) };
        let r = b.lock().unwrap_or_else(std::sync::PoisonError::into_inner).take(tokens as f64, Instant::now());
        r.map_err(|s| self.limited(k, "tokens", s, tokens > *tpm))?;
        Ok(TokenCharge { keys: Some(Arc::clone(&self.keys)), index: i, tokens: tokens as f64 })
    }
}

/// Tokens taken from a key's per-minute budget for one request, held while the request waits
/// for a replica: [`TokenCharge::commit`] keeps them once a replica accepted it (its first
/// message came back); dropping the charge uncommitted gives them back.
#[must_use = "dropping the charge gives the tokens back"]
pub struct TokenCharge {
    keys: Option<Arc<Vec<KeyState>>>,
    index: usize,
    tokens: f64,
}

impl std::fmt::Debug for TokenCharge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenCharge({} tokens, committed: {})", self.tokens, self.keys.is_none())
    }
}

impl TokenCharge {
    /// Keeps the tokens charged: the request was accepted by a replica (or answered).
    pub fn commit(mut self) {
        self.keys = None;
    }
}

impl Drop for TokenCharge {
    fn drop(&mut self) {
        let Some(keys) = self.keys.take() else { return };
        if let Some((_, b)) = keys.get(self.index).and_then(|k| k.tpm.as_ref()) {
            b.lock().unwrap_or_else(std::sync::PoisonError::into_inner).refund(self.tokens, Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(entries: &[ApiKeyEntry]) -> ApiKeys {
        ApiKeys::new(entries, Metrics::new())
    }

    fn auth(k: &ApiKeys, values: &[&str]) -> Result<Option<Caller>, Rejected> {
        k.authenticate(values.iter().map(|v| v.as_bytes()))
    }

    #[test]
    fn bearer_keys_in_any_scheme_case() {
        let k = keys(&["a1".into(), "b2".into()]);
        for ok in ["Bearer b2", "bearer b2", "BEARER b2", "BeArEr   b2 ", "Bearer\tb2"] {
            assert_eq!(auth(&k, &[ok]), Ok(Some(Caller(1))), "{ok:?}");
        }
        assert_eq!(auth(&k, &["Bearer b3"]), Err(Rejected::Invalid));
        assert_eq!(auth(&k, &["Bearer a1b2"]), Err(Rejected::Invalid));
        for bad in ["b2", "Basic b2", "Bearer", "Bearer ", "Bearerb2", "Token b2"] {
            assert_eq!(auth(&k, &[bad]), Err(Rejected::Malformed), "{bad:?}");
        }
        assert_eq!(auth(&k, &["Bearer b2", "Bearer b2"]), Err(Rejected::Malformed), "two Authorization values");
        assert_eq!(auth(&k, &[]), Err(Rejected::Missing));
        assert_eq!(keys(&[]).authenticate(std::iter::empty()), Ok(None), "no keys: open");
        let m = k.metrics.encode();
        assert!(m.contains(r#"prism_router_auth_rejected_total{reason="malformed"} 7"#), "{m}");
        assert!(m.contains(r#"prism_router_auth_rejected_total{reason="missing"} 1"#), "{m}");
    }

    #[test]
    fn limits_are_per_key() {
        let limited = ApiKeyEntry { label: "team-a".into(), rps: Some(2.0), tpm: Some(600), .."a".into() };
        let k = keys(&[limited, "b".into()]);
        let (a, b) = (Some(Caller(0)), Some(Caller(1)));
        assert_eq!((k.admit_request(a), k.admit_request(a)), (Ok(()), Ok(())));
        let third = k.admit_request(a).expect_err("third request in the same instant");
        assert_eq!((third.limit, third.retry_after_s), ("requests", 1));
        for _ in 0..10 {
            assert_eq!(k.admit_request(b), Ok(()), "the other key has no limit");
        }
        k.admit_tokens(a, 500).expect("within the budget").commit();
        let over = k.admit_tokens(a, 200).expect_err("past 600 tokens/min");
        assert_eq!((over.limit, over.retry_after_s, over.over_budget), ("tokens", 10, false));
        assert!(k.admit_tokens(a, 700).expect_err("bigger than the budget").over_budget);
        k.admit_tokens(b, 1 << 30).expect("no limit").commit();
        let m = k.metrics.encode();
        assert!(m.contains(r#"prism_router_rate_limited_total{key="team-a",limit="requests"} 1"#), "{m}");
        assert!(m.contains(r#"prism_router_rate_limited_total{key="team-a",limit="tokens"} 2"#), "{m}");
    }

    /// A charge dropped before commit (the request was refused after it: unknown model, over
    /// the context length, no replica) gives its tokens back; a committed one keeps them.
    #[test]
    fn uncommitted_token_charges_are_given_back() {
        let limited = ApiKeyEntry { label: "team-a".into(), tpm: Some(20_000), .."a".into() };
        let k = keys(&[limited]);
        let a = Some(Caller(0));
        for _ in 0..5 {
            drop(k.admit_tokens(a, 15_001).expect("refused later: given back"));
        }
        k.admit_tokens(a, 15_001).expect("accepted").commit();
        let over = k.admit_tokens(a, 15_001).expect_err("the committed charge stays");
        assert_eq!(over.limit, "tokens");
    }

    #[test]
    fn probes_are_exact_raw_paths_and_read_only() {
        use http::Method;
        for p in ["/health", "/healthz", "/readyz"] {
            assert!(is_http_probe(&Method::GET, p, false) && is_http_probe(&Method::HEAD, p, false));
            assert!(!is_http_probe(&Method::POST, p, false), "POST {p}");
        }
        for p in
            ["/healthz/", "/HEALTHZ", "//healthz", "/healthz/../v1/models", "/health%7A", "/healthz;x=1", "/metrics"]
        {
            assert!(!is_http_probe(&Method::GET, p, false), "{p}");
        }
        assert!(is_http_probe(&Method::GET, "/metrics", true));
        assert!(is_grpc_probe("/grpc.health.v1.Health/Check"));
        assert!(!is_grpc_probe("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"));
        assert!(!is_grpc_probe("/grpc.health.v1.Health/Check/../x"));
    }
}
