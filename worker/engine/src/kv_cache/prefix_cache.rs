//! The prefix cache's index over a [`super::BlockPool`]'s blocks (vLLM's
//! `cached_block_hash_to_block`) and its change log for routers.
//!
//! A *registered* block is a full block whose every token has been computed; it is indexed
//! by its chained hash ([`super::prefix_hash::block_hash`]). The hash only finds a
//! candidate: each entry also keeps the block's tokens, a version id that is never reused,
//! its parent's version (0 for a first block) and, for a first block, the root key (model
//! namespace and cache salt). A lookup walks from the first block and accepts a block only
//! when its tokens, its parent version and (first block) its root key equal the request's,
//! so a hit is exact whatever the hash's quality: by induction, a version names one exact
//! token sequence from position 0 under one salt, and the block's K/V was computed for
//! exactly that sequence. Unregistering (eviction) happens before a block's memory is
//! reused, and a version, once gone, never comes back.

use super::prefix_hash::{CacheEvent, CacheEvents, block_hash, root_hash};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// What a chain starts from: the model namespace and the request's cache salt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RootKey {
    /// The model identity ([`crate::RuntimeConfig::cache_namespace`]).
    pub namespace: u64,
    /// The request's cache salt (`None` = shared).
    pub salt: Option<Arc<str>>,
}

impl RootKey {
    /// The chain before its first block.
    pub fn chain(&self) -> PrefixChain {
        PrefixChain { hash: root_hash(self.namespace, self.salt.as_deref()), version: 0 }
    }
}

/// Where a sequence's chain of cached blocks stands: the hash and version of its last
/// matched or registered block (the root hash and version 0 before the first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PrefixChain {
    /// Chained hash so far.
    pub hash: u64,
    /// Version of the last block (0 = none yet).
    pub version: u64,
}

#[derive(Debug)]
struct Entry {
    hash: u64,
    version: u64,
    parent_version: u64,
    /// Set for first blocks only (the rest inherit it through `parent_version`).
    root: Option<RootKey>,
}

/// Result of [`PrefixIndex::register`].
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Registered {
    /// The block is now cached.
    Stored(PrefixChain),
    /// Another block already holds the same content; this one stays unregistered and the
    /// chain continues from the other's version.
    Duplicate(PrefixChain),
    /// Another block with this hash but other content is unavailable; this one stays
    /// unregistered. `evict` names an unheld block that the caller should free first and
    /// then register again.
    Conflict { evict: Option<u32> },
}

/// Hash index, per-block entries and token store of one pool.
#[derive(Debug)]
pub(crate) struct PrefixIndex {
    num_blocks: usize,
    /// Set by the first registration (all blocks of one pool have one size).
    block_size: usize,
    by_hash: HashMap<u64, u32>,
    entries: Vec<Option<Entry>>,
    /// `num_blocks × block_size` token ids, one row per registered block (no allocation per block).
    tokens: Vec<u32>,
    next_version: u64,
    pub(crate) log: EventLog,
}

impl PrefixIndex {
    pub(crate) fn new(num_blocks: usize) -> Self {
        Self {
            num_blocks,
            block_size: 0,
            by_hash: HashMap::new(),
            entries: (0..num_blocks).map(|_| None).collect(),
            tokens: Vec::new(),
            next_version: 1,
            log: EventLog::new((4 * num_blocks).clamp(1024, 1 << 20)),
        }
    }

    /// Blocks registered now.
    pub(crate) fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub(crate) fn is_registered(&self, id: u32) -> bool {
        self.entries.get(id as usize).is_some_and(Option::is_some)
    }

    fn row(&self, id: u32) -> &[u32] {
        let at = id as usize * self.block_size;
        &self.tokens[at..at + self.block_size]
    }

    /// Whether `id` holds exactly `tokens` after `parent_version` (under `root` when first).
    fn matches(&self, id: u32, tokens: &[u32], parent_version: u64, root: &RootKey) -> Option<&Entry> {
        let e = self.entries.get(id as usize)?.as_ref()?;
        let exact = tokens.len() == self.block_size
            && e.parent_version == parent_version
            && (parent_version != 0 || e.root.as_ref() == Some(root))
            && self.row(id) == tokens;
        exact.then_some(e)
    }

    /// The longest run of cached blocks holding `tokens`' first `max_blocks` full blocks,
    /// appended to `out`; returns the chain after them.
    pub(crate) fn lookup(
        &self,
        root: &RootKey,
        tokens: &[u32],
        block_size: usize,
        max_blocks: usize,
        out: &mut Vec<u32>,
    ) -> PrefixChain {
        let mut chain = root.chain();
        if self.by_hash.is_empty() || block_size != self.block_size {
            return chain;
        }
        for block in tokens.chunks_exact(block_size).take(max_blocks) {
            let hash = block_hash(chain.hash, block);
            let Some(&id) = self.by_hash.get(&hash) else { break };
            let Some(e) = self.matches(id, block, chain.version, root) else { break };
            chain = PrefixChain { hash, version: e.version };
            out.push(id);
        }
        chain
    }

    /// Registers block `id` as holding `tokens` after `parent`; `held(other)` says whether
    /// another block is in use by some sequence.
    pub(crate) fn register(
        &mut self,
        id: u32,
        parent: PrefixChain,
        tokens: &[u32],
        root: &RootKey,
        held: impl Fn(u32) -> bool,
    ) -> Registered {
        if tokens.is_empty() || id as usize >= self.num_blocks {
            return Registered::Conflict { evict: None };
        }
        if self.block_size == 0 {
            self.block_size = tokens.len();
            self.tokens = vec![0; self.num_blocks * self.block_size];
        }
        if tokens.len() != self.block_size {
            return Registered::Conflict { evict: None };
        }
        let hash = block_hash(parent.hash, tokens);
        if let Some(e) = &self.entries[id as usize] {
            // Already cached (a block matched from the cache): the chain goes on from it.
            return Registered::Duplicate(PrefixChain { hash: e.hash, version: e.version });
        }
        if let Some(&other) = self.by_hash.get(&hash) {
            if let Some(e) = self.matches(other, tokens, parent.version, root) {
                return Registered::Duplicate(PrefixChain { hash, version: e.version });
            }
            // A different block under the same hash (a collision, or a block whose parent
            // was evicted and re-registered under a new version).
            return Registered::Conflict { evict: (!held(other)).then_some(other) };
        }
        let version = self.next_version;
        self.next_version += 1;
        let at = id as usize * self.block_size;
        self.tokens[at..at + self.block_size].copy_from_slice(tokens);
        self.entries[id as usize] = Some(Entry {
            hash,
            version,
            parent_version: parent.version,
            root: (parent.version == 0).then(|| root.clone()),
        });
        self.by_hash.insert(hash, id);
        self.log.push(CacheEvent::Stored(hash));
        Registered::Stored(PrefixChain { hash, version })
    }

    /// Forgets block `id` (before its memory is reused). Returns whether it was registered.
    pub(crate) fn unregister(&mut self, id: u32) -> bool {
        let Some(e) = self.entries.get_mut(id as usize).and_then(Option::take) else { return false };
        if self.by_hash.get(&e.hash) == Some(&id) {
            self.by_hash.remove(&e.hash);
        }
        self.log.push(CacheEvent::Removed(e.hash));
        true
    }

    /// Changes after `after`, or a snapshot of every registered hash.
    pub(crate) fn events(&self, after: u64) -> CacheEvents {
        match self.log.since(after) {
            Some(events) => CacheEvents { snapshot: None, events, next: self.log.last() },
            None => {
                let mut all: Vec<u64> = self.by_hash.keys().copied().collect();
                all.sort_unstable();
                CacheEvents { snapshot: Some(all), events: Vec::new(), next: self.log.last() }
            }
        }
    }
}

/// A bounded ring of the latest cache events, each numbered by a global sequence number
/// (the first event is 1).
#[derive(Debug)]
pub(crate) struct EventLog {
    ring: VecDeque<(u64, CacheEvent)>,
    capacity: usize,
    last: u64,
}

impl EventLog {
    pub(crate) fn new(capacity: usize) -> Self {
        Self { ring: VecDeque::new(), capacity: capacity.max(1), last: 0 }
    }

    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        self.capacity = capacity.max(1);
        while self.ring.len() > self.capacity {
            self.ring.pop_front();
        }
    }

    fn push(&mut self, e: CacheEvent) {
        self.last += 1;
        if self.ring.len() == self.capacity {
            self.ring.pop_front();
        }
        self.ring.push_back((self.last, e));
    }

    /// Sequence number of the latest event (0 before any).
    pub(crate) fn last(&self) -> u64 {
        self.last
    }

    /// Events after `after`, or `None` when the reader must take a snapshot: `after` is 0,
    /// older than the ring, or ahead of this log (another incarnation's number).
    fn since(&self, after: u64) -> Option<Vec<CacheEvent>> {
        let oldest = self.ring.front().map_or(self.last + 1, |e| e.0);
        if after == 0 || after > self.last || after + 1 < oldest {
            return None;
        }
        let skip = (after + 1 - oldest) as usize;
        Some(self.ring.iter().skip(skip).map(|e| e.1).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(salt: Option<&str>) -> RootKey {
        RootKey { namespace: 9, salt: salt.map(Arc::from) }
    }

    fn stored(r: Registered) -> PrefixChain {
        match r {
            Registered::Stored(c) => c,
            other => panic!("expected Stored, got {other:?}"),
        }
    }

    #[test]
    fn lookup_walks_exact_chain_and_salt() {
        let mut ix = PrefixIndex::new(8);
        let toks: Vec<u32> = (0..12).collect();
        let r = root(None);
        let c0 = stored(ix.register(3, r.chain(), &toks[0..4], &r, |_| false));
        let c1 = stored(ix.register(5, c0, &toks[4..8], &r, |_| false));
        assert_ne!(c0.version, c1.version);
        let mut out = Vec::new();
        assert_eq!(ix.lookup(&r, &toks, 4, 3, &mut out), c1);
        assert_eq!(out, vec![3, 5]);
        out.clear();
        ix.lookup(&r, &toks, 4, 1, &mut out);
        assert_eq!(out, vec![3], "max_blocks caps the match");
        out.clear();
        ix.lookup(&root(Some("tenant")), &toks, 4, 3, &mut out);
        assert!(out.is_empty(), "another salt sees nothing");
        let mut other = toks.clone();
        other[5] = 99;
        out.clear();
        ix.lookup(&r, &other, 4, 3, &mut out);
        assert_eq!(out, vec![3], "stops at the first differing block");
    }

    #[test]
    fn collision_is_never_a_hit() {
        // Force a "collision": plant block 1's entry under the hash the lookup computes for
        // other tokens. The lookup must compare tokens and reject it.
        let mut ix = PrefixIndex::new(4);
        let r = root(None);
        stored(ix.register(1, r.chain(), &[1, 2], &r, |_| false));
        let fake = block_hash(r.chain().hash, &[7, 7]);
        let real = ix.entries[1].as_ref().map(|e| e.hash).expect("entry");
        ix.by_hash.remove(&real);
        ix.by_hash.insert(fake, 1);
        let mut out = Vec::new();
        ix.lookup(&r, &[7, 7, 0], 2, 1, &mut out);
        assert!(out.is_empty(), "hash matched, tokens did not: miss");
    }

    #[test]
    fn duplicates_and_conflicts_stay_unregistered() {
        let mut ix = PrefixIndex::new(4);
        let r = root(None);
        let c = stored(ix.register(0, r.chain(), &[1, 2], &r, |_| false));
        assert_eq!(ix.register(1, r.chain(), &[1, 2], &r, |_| false), Registered::Duplicate(c));
        assert!(!ix.is_registered(1));
        assert_eq!(ix.len(), 1);
        // Same tokens under another parent version: same hash (same parent hash), other content.
        let stale = PrefixChain { hash: r.chain().hash, version: 77 };
        assert_eq!(ix.register(2, stale, &[1, 2], &r, |_| true), Registered::Conflict { evict: None });
        assert_eq!(ix.register(2, stale, &[1, 2], &r, |_| false), Registered::Conflict { evict: Some(0) });
        assert!(ix.unregister(0));
        assert!(!ix.unregister(0));
        let c2 = stored(ix.register(2, stale, &[1, 2], &r, |_| false));
        assert!(c2.version > c.version, "versions are never reused");
    }

    #[test]
    fn events_snapshot_and_gap() {
        let mut ix = PrefixIndex::new(4);
        ix.log.set_capacity(3);
        let r = root(None);
        let e = ix.events(0);
        assert_eq!((e.snapshot, e.next), (Some(vec![]), 0));
        let c = stored(ix.register(0, r.chain(), &[1], &r, |_| false));
        stored(ix.register(1, c, &[2], &r, |_| false));
        let e = ix.events(0);
        assert_eq!(e.next, 2);
        let mut want = vec![c.hash, block_hash(c.hash, &[2])];
        want.sort_unstable();
        assert_eq!(e.snapshot, Some(want));
        let e = ix.events(1);
        assert_eq!((e.snapshot, e.events, e.next), (None, vec![CacheEvent::Stored(block_hash(c.hash, &[2]))], 2));
        assert!(ix.events(2).events.is_empty() && ix.events(2).snapshot.is_none());
        ix.unregister(0);
        ix.unregister(1);
        // The ring holds events 2..=4 now; a reader at 1 still has them all.
        assert_eq!(ix.events(1).events.len(), 3);
        stored(ix.register(2, r.chain(), &[5], &r, |_| false));
        // Event 2 fell out: a reader at 1 has a gap and gets a snapshot.
        let e = ix.events(1);
        assert_eq!(e.snapshot, Some(vec![r.chain().hash].into_iter().map(|h| block_hash(h, &[5])).collect()));
        assert_eq!(e.next, 5);
        assert_eq!(ix.events(2).events.len(), 3);
        assert!(ix.events(9).snapshot.is_some(), "a number from the future resets");
    }
}
