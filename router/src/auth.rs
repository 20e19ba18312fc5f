//! API-key authentication: `Authorization: Bearer KEY` on HTTP `/v1/*` routes and the same
//! value in gRPC metadata (`authorization`). No configured key = no authentication.

use std::sync::Arc;

/// The accepted keys (cheap `Clone`).
#[derive(Debug, Clone, Default)]
pub struct ApiKeys(Arc<Vec<String>>);

/// Compares without stopping at the first differing byte.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl ApiKeys {
    /// Keys from the configuration; empty disables authentication.
    pub fn new(keys: Vec<String>) -> Self {
        Self(Arc::new(keys.into_iter().filter(|k| !k.is_empty()).collect()))
    }

    /// Whether a request with this `Authorization` header value may proceed.
    pub fn check(&self, authorization: Option<&str>) -> bool {
        if self.0.is_empty() {
            return true;
        }
        let Some(v) = authorization else { return false };
        let Some(token) = v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")) else { return false };
        let token = token.trim().as_bytes();
        self.0.iter().fold(false, |ok, k| ok | ct_eq(k.as_bytes(), token))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_keys() {
        let k = ApiKeys::new(vec!["a1".into(), "b2".into()]);
        assert!(k.check(Some("Bearer b2")));
        assert!(!k.check(Some("Bearer b3")));
        assert!(!k.check(Some("b2")));
        assert!(!k.check(None));
        assert!(ApiKeys::new(vec![]).check(None));
    }
}
