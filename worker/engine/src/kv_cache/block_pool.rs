//! The KV-cache block pool shared by all sequences of one replica (vLLM's `BlockPool`),
//! with the prefix cache's bookkeeping.
//!
//! Every block is reference-counted: a holder has a [`KvBlock`] guard, and sharing a cached
//! block is one more guard. When the last guard drops, a block that is not registered in
//! the prefix cache goes back to the free list; a registered one is kept as an *evictable*
//! cached block at the tail of an LRU list. Allocation takes free (never or no longer cached)
//! blocks first, then evicts the LRU head, unregistering it before its memory is reused.
//! A sequence's table drops its blocks tail first, so a sequence's tail blocks are evicted
//! before its head blocks (which other requests are more likely to share).
//!
//! [`BlockPool::num_free`] counts free plus evictable blocks (what allocation can get);
//! usage is the fraction held by sequences.

use super::prefix_cache::{PrefixChain, PrefixIndex, Registered, RootKey};
use super::prefix_hash::CacheEvents;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

const NIL: u32 = u32::MAX;

/// Intrusive doubly linked LRU list over block ids (O(1) push, pop and unlink).
#[derive(Debug)]
struct Lru {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Lru {
    fn new(n: usize) -> Self {
        Self { prev: vec![NIL; n], next: vec![NIL; n], head: NIL, tail: NIL, len: 0 }
    }

    fn push_back(&mut self, id: u32) {
        let i = id as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            self.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.len += 1;
    }

    fn unlink(&mut self, id: u32) {
        let i = id as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.len -= 1;
    }

    fn pop_front(&mut self) -> Option<u32> {
        let id = self.head;
        if id == NIL {
            return None;
        }
        self.unlink(id);
        Some(id)
    }
}

#[derive(Debug)]
struct PoolState {
    /// Holders per block (0 = free or evictable).
    refs: Vec<u32>,
    /// Unregistered unheld blocks; the most recently freed is reused first (warm in cache).
    free: Vec<u32>,
    /// Registered unheld blocks, least recently released first.
    lru: Lru,
    index: PrefixIndex,
}

impl PoolState {
    fn available(&self) -> usize {
        self.free.len() + self.lru.len
    }

    /// One block for a new holder: a free one, else the LRU cached block (unregistered first).
    fn take(&mut self) -> Option<u32> {
        let id = match self.free.pop() {
            Some(id) => id,
            None => {
                let id = self.lru.pop_front()?;
                self.index.unregister(id);
                id
            }
        };
        self.refs[id as usize] = 1;
        Some(id)
    }

    /// One more holder of block `id` (a cache hit).
    fn touch(&mut self, id: u32) {
        if self.refs[id as usize] == 0 {
            self.lru.unlink(id);
        }
        self.refs[id as usize] += 1;
    }

    fn release(&mut self, id: u32) {
        let r = &mut self.refs[id as usize];
        debug_assert!(*r > 0, "block {id} freed twice");
        *r = r.saturating_sub(1);
        if *r == 0 {
            if self.index.is_registered(id) {
                self.lru.push_back(id);
            } else {
                self.free.push(id);
            }
        }
    }
}

#[derive(Debug)]
struct PoolInner {
    state: Mutex<PoolState>,
    /// Mirror of free + evictable blocks, readable without the lock (stats, metrics).
    num_free: AtomicUsize,
    num_blocks: usize,
}

/// A pool of `num_blocks` KV-cache blocks. Cheap to clone (shared state); `Send + Sync`.
#[derive(Clone, Debug)]
pub struct BlockPool {
    inner: Arc<PoolInner>,
}

/// Blocks handed out by [`BlockPool::allocate_with_prefix`]: the matched cached blocks
/// first, then the new ones.
#[derive(Debug)]
pub struct PrefixAllocation {
    /// Blocks in position order.
    pub blocks: Vec<KvBlock>,
    /// How many leading blocks came from the prefix cache.
    pub matched: usize,
    /// The chain after the matched blocks.
    pub chain: PrefixChain,
}

impl BlockPool {
    /// A pool with blocks `0..num_blocks`, all free.
    pub fn new(num_blocks: usize) -> Self {
        let free: Vec<u32> = (0..num_blocks as u32).rev().collect();
        let state = PoolState {
            refs: vec![0; num_blocks],
            free,
            lru: Lru::new(num_blocks),
            index: PrefixIndex::new(num_blocks),
        };
        Self {
            inner: Arc::new(PoolInner { state: Mutex::new(state), num_free: AtomicUsize::new(num_blocks), num_blocks }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.inner.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn publish(&self, st: &PoolState) {
        self.inner.num_free.store(st.available(), Ordering::Relaxed);
    }

    fn guard(&self, id: u32) -> KvBlock {
        KvBlock { id, pool: self.clone() }
    }

    /// Takes one block (evicting a cached one when nothing else is free), or `None` when
    /// every block is held.
    pub fn allocate(&self) -> Option<KvBlock> {
        let mut st = self.lock();
        let id = st.take()?;
        self.publish(&st);
        Some(self.guard(id))
    }

    /// Takes `n` blocks at once, or none at all when fewer than `n` can be had.
    pub fn allocate_n(&self, n: usize) -> Option<Vec<KvBlock>> {
        let mut st = self.lock();
        if st.available() < n {
            return None;
        }
        let ids: Vec<u32> = (0..n).filter_map(|_| st.take()).collect();
        self.publish(&st);
        drop(st);
        Some(ids.into_iter().map(|id| self.guard(id)).collect())
    }

    /// Admission with the prefix cache, all-or-nothing: finds the cached blocks holding the
    /// first (at most `max_blocks`) full blocks of `tokens` under `root`, and takes them
    /// plus `extra(matched)` new blocks. `None` (nothing taken, nothing reordered) when the
    /// pool cannot supply the new blocks.
    pub fn allocate_with_prefix(
        &self,
        root: &RootKey,
        tokens: &[u32],
        block_size: usize,
        max_blocks: usize,
        extra: impl FnOnce(usize) -> usize,
    ) -> Option<PrefixAllocation> {
        let mut st = self.lock();
        let mut ids = Vec::new();
        let chain = st.index.lookup(root, tokens, block_size, max_blocks, &mut ids);
        let matched = ids.len();
        let need = extra(matched);
        // Matched blocks nobody holds are counted as available; taking them uses them up.
        let unheld = ids.iter().filter(|&&id| st.refs[id as usize] == 0).count();
        if st.available() < unheld + need {
            return None;
        }
        for &id in &ids {
            st.touch(id);
        }
        for _ in 0..need {
            if let Some(id) = st.take() {
                ids.push(id);
            }
        }
        self.publish(&st);
        drop(st);
        Some(PrefixAllocation { blocks: ids.into_iter().map(|id| self.guard(id)).collect(), matched, chain })
    }

    /// Registers `block` (full, every token computed) as holding `tokens` after `parent`
    /// under `root`. Returns the chain after it, or `None` when another block in use holds
    /// the same hash with other content (this block stays unregistered; the caller stops
    /// registering the sequence). Content already cached in another block (two sequences
    /// computed the same prefix at once) leaves this block unregistered and continues the
    /// chain from the cached one.
    pub fn register(
        &self,
        block: &KvBlock,
        parent: PrefixChain,
        tokens: &[u32],
        root: &RootKey,
    ) -> Option<PrefixChain> {
        let mut guard = self.lock();
        let st = &mut *guard;
        for _ in 0..2 {
            let refs = &st.refs;
            let r = st.index.register(block.id, parent, tokens, root, |o| refs[o as usize] > 0);
            match r {
                Registered::Stored(c) | Registered::Duplicate(c) => return Some(c),
                Registered::Conflict { evict: Some(other) } => {
                    // An unheld stale entry under our hash: free it and retry once.
                    st.lru.unlink(other);
                    st.index.unregister(other);
                    st.free.push(other);
                }
                Registered::Conflict { evict: None } => return None,
            }
        }
        None
    }

    /// Changes to the set of cached hashes after `after` (see [`CacheEvents`]).
    pub fn events(&self, after: u64) -> CacheEvents {
        self.lock().index.events(after)
    }

    /// Bounds the event log (tests; the default keeps 4 events per block, at least 1024).
    pub fn set_event_capacity(&self, capacity: usize) {
        self.lock().index.log.set_capacity(capacity);
    }

    /// Blocks registered in the prefix cache now (held or evictable).
    pub fn num_cached(&self) -> usize {
        self.lock().index.len()
    }

    /// Cached blocks no sequence holds (reused, LRU first, when nothing else is free).
    pub fn num_evictable(&self) -> usize {
        self.lock().lru.len
    }

    /// Whether block `id` is registered in the prefix cache.
    pub fn is_cached(&self, id: u32) -> bool {
        self.lock().index.is_registered(id)
    }

    /// Holders of block `id` now.
    pub fn ref_count(&self, id: u32) -> u32 {
        self.lock().refs.get(id as usize).copied().unwrap_or(0)
    }

    fn release(&self, id: u32) {
        let mut st = self.lock();
        st.release(id);
        self.publish(&st);
    }

    /// Blocks allocation can get now: free plus evictable cached blocks.
    pub fn num_free(&self) -> usize {
        self.inner.num_free.load(Ordering::Relaxed)
    }

    /// Total blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.inner.num_blocks
    }

    /// Fraction of blocks held by sequences, in `[0, 1]` (0 for an empty pool).
    pub fn usage(&self) -> f64 {
        if self.inner.num_blocks == 0 {
            return 0.0;
        }
        1.0 - self.num_free() as f64 / self.inner.num_blocks as f64
    }
}

/// One holder's reference to a KV-cache block; released to its pool on drop.
#[derive(Debug)]
pub struct KvBlock {
    id: u32,
    pool: BlockPool,
}

impl KvBlock {
    /// Physical block id (index into the backend's K/V block arrays).
    pub fn id(&self) -> u32 {
        self.id
    }
}

impl Drop for KvBlock {
    fn drop(&mut self) {
        self.pool.release(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_until_empty_then_free_on_drop() {
        let pool = BlockPool::new(3);
        assert_eq!(pool.num_free(), 3);
        assert_eq!(pool.usage(), 0.0);
        let a = pool.allocate().expect("free block");
        let b = pool.allocate().expect("free block");
        let c = pool.allocate().expect("free block");
        let mut ids = vec![a.id(), b.id(), c.id()];
        ids.sort_unstable();
        assert_eq!(ids, vec![0, 1, 2]);
        assert!(pool.allocate().is_none());
        assert_eq!(pool.usage(), 1.0);
        drop(b);
        assert_eq!(pool.num_free(), 1);
        assert!((pool.usage() - 2.0 / 3.0).abs() < 1e-12);
        drop((a, c));
        assert_eq!(pool.num_free(), 3);
    }

    #[test]
    fn allocate_n_is_all_or_nothing() {
        let pool = BlockPool::new(4);
        let held = pool.allocate_n(3).expect("three free");
        assert_eq!(held.len(), 3);
        assert!(pool.allocate_n(2).is_none());
        assert_eq!(pool.num_free(), 1, "a failed allocate_n takes nothing");
        drop(held);
        assert_eq!(pool.num_free(), 4);
        assert_eq!(BlockPool::new(0).usage(), 0.0);
    }

    use crate::kv_cache::prefix_cache::RootKey;

    /// Allocates one block, registers it as the chain's next block and returns it.
    fn cached(pool: &BlockPool, parent: PrefixChain, toks: &[u32], root: &RootKey) -> (KvBlock, PrefixChain) {
        let b = pool.allocate().expect("a block");
        let c = pool.register(&b, parent, toks, root).expect("registered");
        (b, c)
    }

    #[test]
    fn registered_blocks_go_to_the_lru_and_are_shared_by_refcount() {
        let pool = BlockPool::new(4);
        let r = RootKey::default();
        let (a, ca) = cached(&pool, r.chain(), &[1, 2], &r);
        let (b, _) = cached(&pool, ca, &[3, 4], &r);
        let (ida, idb) = (a.id(), b.id());
        assert_eq!((pool.num_free(), pool.num_cached(), pool.num_evictable()), (2, 2, 0));
        // A second holder of the cached prefix.
        let hit = pool.allocate_with_prefix(&r, &[1, 2, 3, 4, 5], 2, 2, |_| 1).expect("fits");
        assert_eq!(hit.matched, 2);
        assert_eq!(hit.blocks.iter().map(KvBlock::id).take(2).collect::<Vec<_>>(), vec![ida, idb]);
        assert_eq!(pool.ref_count(ida), 2);
        assert_eq!(pool.num_free(), 1);
        drop((a, b));
        assert_eq!(pool.ref_count(ida), 1);
        assert_eq!(pool.num_evictable(), 0, "still held by the hit");
        drop(hit);
        assert_eq!((pool.num_free(), pool.num_evictable(), pool.num_cached()), (4, 2, 2));
        assert_eq!(pool.usage(), 0.0);
    }

    #[test]
    fn allocation_prefers_free_blocks_then_evicts_lru_tail_first() {
        let pool = BlockPool::new(4);
        let r = RootKey::default();
        let mut table = crate::kv_cache::BlockTable::new();
        let mut chain = r.chain();
        let mut ids = Vec::new();
        for t in 0..3u32 {
            let (b, c) = cached(&pool, chain, &[t], &r);
            chain = c;
            ids.push(b.id());
            table.extend(vec![b]);
        }
        drop(table); // tail first: ids[2], ids[1], ids[0] enter the LRU in that order
        assert_eq!((pool.num_free(), pool.num_evictable()), (4, 3));
        let never = pool.allocate().expect("the never-cached block first");
        assert!(!ids.contains(&never.id()));
        assert_eq!(pool.num_cached(), 3, "nothing evicted yet");
        let e1 = pool.allocate().expect("evicts");
        assert_eq!(e1.id(), ids[2], "the sequence's tail is evicted first");
        assert!(!pool.is_cached(e1.id()), "unregistered before reuse");
        let e2 = pool.allocate().expect("evicts");
        assert_eq!(e2.id(), ids[1]);
        // The head is still found; the evicted continuation is not.
        let hit = pool.allocate_with_prefix(&r, &[0, 1, 2, 9], 1, 3, |_| 0).expect("fits");
        assert_eq!((hit.matched, hit.blocks[0].id()), (1, ids[0]));
        assert!(pool.allocate().is_none(), "every block held");
    }

    #[test]
    fn reused_memory_is_never_returned_by_a_lookup() {
        // Fill the pool with one chain, evict it by filling with others, refill: every
        // lookup returns only blocks whose registered tokens are the asked ones.
        let pool = BlockPool::new(10);
        let r = RootKey::default();
        // What each block's memory holds: the prefix whose K/V its last new holder wrote.
        let mut owner: std::collections::HashMap<u32, Vec<u32>> = Default::default();
        let mut hits = 0;
        for round in 0..40u32 {
            // Three families in an irregular order: heads are both re-hit and evicted.
            let family = (round * round + round / 3) % 3;
            let prompt: Vec<u32> = (0..12).map(|i| family * 100 + i + u32::from(i > 8) * round).collect();
            let Some(got) = pool.allocate_with_prefix(&r, &prompt, 2, 5, |m| 6 - m) else { continue };
            hits += got.matched;
            for (i, b) in got.blocks.iter().enumerate().take(got.matched) {
                assert_eq!(owner.get(&b.id()), Some(&prompt[..(i + 1) * 2].to_vec()), "a hit is exact");
            }
            let mut chain = got.chain;
            for (i, b) in got.blocks.iter().enumerate().skip(got.matched) {
                // The new holder writes this prefix's K/V into the block's memory.
                owner.insert(b.id(), prompt[..(i + 1) * 2].to_vec());
                if let Some(c) = pool.register(b, chain, &prompt[i * 2..i * 2 + 2], &r) {
                    chain = c;
                }
            }
            assert!(pool.num_cached() <= pool.num_blocks());
            // Released tail first, as a sequence's block table does.
            let mut blocks = got.blocks;
            while blocks.pop().is_some() {}
        }
        assert!(hits > 0, "some rounds hit");
        assert_eq!(pool.num_free(), pool.num_blocks());
    }

    #[test]
    fn duplicate_content_stays_unregistered_and_salts_are_isolated() {
        let pool = BlockPool::new(4);
        let r = RootKey::default();
        let (a, ca) = cached(&pool, r.chain(), &[1, 2], &r);
        let dup = pool.allocate().expect("block");
        assert_eq!(pool.register(&dup, r.chain(), &[1, 2], &r), Some(ca), "the chain continues from the cached copy");
        assert!(!pool.is_cached(dup.id()) && pool.num_cached() == 1);
        drop(dup);
        assert_eq!(pool.num_evictable(), 0, "an unregistered duplicate is simply freed");
        let salted = RootKey { namespace: 0, salt: Some("tenant-a".into()) };
        let miss = pool.allocate_with_prefix(&salted, &[1, 2, 3], 2, 1, |_| 0).expect("fits");
        assert_eq!(miss.matched, 0, "another salt never sees the shared block");
        let other_ns = RootKey { namespace: 1, salt: None };
        assert_eq!(pool.allocate_with_prefix(&other_ns, &[1, 2, 3], 2, 1, |_| 0).map(|h| h.matched), Some(0));
        drop(a);
    }

    #[test]
    fn failed_prefix_allocation_takes_nothing() {
        let pool = BlockPool::new(3);
        let r = RootKey::default();
        let (a, _) = cached(&pool, r.chain(), &[1, 2], &r);
        drop(a);
        let held = pool.allocate_n(2).expect("two free");
        // The cached block is evictable; taking it as a hit plus 1 new block needs 2.
        assert!(pool.allocate_with_prefix(&r, &[1, 2, 3], 2, 1, |_| 1).is_none());
        assert_eq!((pool.num_free(), pool.num_evictable(), pool.num_cached()), (1, 1, 1));
        drop(held);
        assert_eq!(pool.allocate_with_prefix(&r, &[1, 2, 3], 2, 1, |_| 1).map(|h| h.matched), Some(1));
        assert_eq!(pool.num_free(), 3);
    }

    #[test]
    fn events_record_stored_and_removed_hashes() {
        let pool = BlockPool::new(1);
        let r = RootKey::default();
        let (a, ca) = cached(&pool, r.chain(), &[1], &r);
        drop(a);
        let e = pool.events(0);
        assert_eq!((e.snapshot.clone(), e.next), (Some(vec![ca.hash]), 1));
        let _b = pool.allocate().expect("evicts the cached block");
        let e2 = pool.events(e.next);
        assert_eq!(e2.events, vec![crate::kv_cache::CacheEvent::Removed(ca.hash)]);
        assert_eq!((e2.snapshot, e2.next), (None, 2));
        assert_eq!(pool.events(0).snapshot, Some(vec![]));
    }
}
