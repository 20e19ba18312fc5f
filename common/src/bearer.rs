//! Bearer credentials as both the router (API keys) and the head (role tokens) read them:
//! the token of an `Authorization: Bearer TOKEN` value and a comparison whose time does not
//! depend on where two secrets first differ.

/// Compares without stopping at the first differing byte.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The token of an `Authorization: Bearer TOKEN` value (scheme in any case, surrounding
/// whitespace ignored); `None` for another scheme or an empty token.
pub fn bearer_token(v: &[u8]) -> Option<&[u8]> {
    let v = std::str::from_utf8(v).ok()?.trim();
    let (scheme, token) = v.split_once([' ', '\t'])?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_values_and_comparison() {
        assert_eq!(bearer_token(b"BEARER  k1 "), Some(&b"k1"[..]));
        assert_eq!(bearer_token(b"Basic k1"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
        assert!(ct_eq(b"abc", b"abc"));
        assert!(!ct_eq(b"abc", b"abd"));
        assert!(!ct_eq(b"abc", b"abcd"));
    }
}
