//! Block hashes of the prefix cache: one `u64` per *full* KV block of a token sequence,
//! chained so a block's hash names its whole prefix (vLLM's `hash_block_tokens`):
//!
//! `h[0] = H(namespace, salt, tokens[0..B])`, `h[i] = H(h[i-1], tokens[i·B..(i+1)·B])`.
//!
//! The engine keys cached blocks by these hashes and reports them to routers; a router
//! computes the same hashes for a request (same tokenizer, block size and namespace) to find
//! the replica holding most of its prefix. The hash only indexes: the engine verifies the
//! tokens and the chain of every hit, so a collision can cost a miss, never wrong KV.
//!
//! The function is fixed (not `std`'s randomly seeded hasher) so that every process of one
//! build computes the same values.

/// Mixes one 64-bit word into the state (splitmix64's finaliser over a multiply-xor step).
#[inline]
fn mix(state: u64, word: u64) -> u64 {
    let mut z = (state ^ word).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(0x632B_E59B_D9B4_E019);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The root of a chain: the model identity and the request's cache salt (`None` = shared).
pub fn root_hash(namespace: u64, salt: Option<&str>) -> u64 {
    let mut h = mix(0x5052_4953_4d00_0001, namespace);
    match salt {
        None => h = mix(h, 0),
        Some(s) => {
            h = mix(h, 1 + s.len() as u64);
            for chunk in s.as_bytes().chunks(8) {
                let mut w = [0u8; 8];
                w[..chunk.len()].copy_from_slice(chunk);
                h = mix(h, u64::from_le_bytes(w));
            }
        }
    }
    h
}

/// Hash of one block given its parent's hash (the root for the first block).
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = mix(parent, tokens.len() as u64);
    for pair in tokens.chunks(2) {
        let w = u64::from(pair[0]) | (u64::from(*pair.get(1).unwrap_or(&u32::MAX)) << 32);
        h = mix(h, w);
    }
    h
}

/// Chained hashes of every full block of `tokens` (a trailing partial block has none).
pub fn block_hashes(namespace: u64, salt: Option<&str>, tokens: &[u32], block_size: usize) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let mut parent = root_hash(namespace, salt);
    tokens
        .chunks_exact(block_size)
        .map(|b| {
            parent = block_hash(parent, b);
            parent
        })
        .collect()
}

/// A fixed 64-bit hash of bytes (codec fingerprints, model identities).
pub fn fingerprint(bytes: &[u8]) -> u64 {
    let mut h = mix(0x5052_4953_4d00_0002, bytes.len() as u64);
    for chunk in bytes.chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = mix(h, u64::from_le_bytes(w));
    }
    h
}

/// A change to the set of block hashes a replica's prefix cache holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A block with this hash became available for reuse.
    Stored(u64),
    /// A block with this hash was evicted (its memory reused).
    Removed(u64),
}

/// Changes since a reader's last sequence number, or the whole set when the reader is too
/// far behind (or new): what [`crate::EngineHandle::prefix_cache_events`] returns.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheEvents {
    /// `Some(all hashes held now)` when the reader must reset its view; then `events` is empty.
    pub snapshot: Option<Vec<u64>>,
    /// Changes in order, after `after` up to `next`.
    pub events: Vec<CacheEvent>,
    /// Pass this as `after` next time.
    pub next: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_over_full_blocks_only() {
        let t: Vec<u32> = (0..37).collect();
        let h = block_hashes(7, None, &t, 16);
        assert_eq!(h.len(), 2);
        assert_eq!(h[0], block_hash(root_hash(7, None), &t[..16]));
        assert_eq!(h[1], block_hash(h[0], &t[16..32]));
        // A shared prefix gives shared hashes; a different first block changes all after it.
        let mut u = t.clone();
        u[20] = 999;
        let hu = block_hashes(7, None, &u, 16);
        assert_eq!(hu[0], h[0]);
        assert_ne!(hu[1], h[1]);
        u[3] = 999;
        assert_ne!(block_hashes(7, None, &u, 16)[1], h[1]);
    }

    #[test]
    fn namespace_and_salt_separate_chains() {
        let t: Vec<u32> = (0..16).collect();
        let base = block_hashes(1, None, &t, 16);
        assert_ne!(base, block_hashes(2, None, &t, 16));
        assert_ne!(base, block_hashes(1, Some(""), &t, 16));
        assert_ne!(block_hashes(1, Some("a"), &t, 16), block_hashes(1, Some("b"), &t, 16));
        assert_ne!(block_hashes(1, Some("abcdefgh"), &t, 16), block_hashes(1, Some("abcdefgh\0"), &t, 16));
        assert_eq!(block_hashes(1, Some("a"), &t, 16), block_hashes(1, Some("a"), &t, 16));
        assert!(block_hashes(1, None, &t, 0).is_empty());
    }
}
