//! The KV-cache block pool: a free list of physical block ids shared by all sequences of
//! one replica (vLLM's `BlockPool`). Allocation hands out a [`KvBlock`] guard that puts the
//! id back on the free list when dropped, so blocks cannot leak through an early return,
//! an abort or a preemption.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

#[derive(Debug)]
struct PoolInner {
    /// Free block ids; the most recently freed is reused first (warm in cache).
    free: Mutex<Vec<u32>>,
    /// Mirror of `free.len()` readable without the lock (stats, metrics).
    num_free: AtomicUsize,
    num_blocks: usize,
}

/// A pool of `num_blocks` KV-cache blocks. Cheap to clone (shared state); `Send + Sync`.
#[derive(Clone, Debug)]
pub struct BlockPool {
    inner: Arc<PoolInner>,
}

impl BlockPool {
    /// A pool with blocks `0..num_blocks`, all free.
    pub fn new(num_blocks: usize) -> Self {
        let free: Vec<u32> = (0..num_blocks as u32).rev().collect();
        Self {
            inner: Arc::new(PoolInner { free: Mutex::new(free), num_free: AtomicUsize::new(num_blocks), num_blocks }),
        }
    }

    /// Takes one free block, or `None` when the pool is exhausted.
    pub fn allocate(&self) -> Option<KvBlock> {
        let mut free = self.inner.free.lock().unwrap_or_else(PoisonError::into_inner);
        let id = free.pop()?;
        self.inner.num_free.store(free.len(), Ordering::Relaxed);
        Some(KvBlock { id, pool: self.clone() })
    }

    /// Takes `n` blocks at once, or none at all when fewer than `n` are free.
    pub fn allocate_n(&self, n: usize) -> Option<Vec<KvBlock>> {
        let mut free = self.inner.free.lock().unwrap_or_else(PoisonError::into_inner);
        if free.len() < n {
            return None;
        }
        let at = free.len() - n;
        let ids: Vec<u32> = free.drain(at..).rev().collect();
        self.inner.num_free.store(free.len(), Ordering::Relaxed);
        drop(free);
        Some(ids.into_iter().map(|id| KvBlock { id, pool: self.clone() }).collect())
    }

    fn release(&self, id: u32) {
        let mut free = self.inner.free.lock().unwrap_or_else(PoisonError::into_inner);
        debug_assert!(!free.contains(&id), "block {id} freed twice");
        free.push(id);
        self.inner.num_free.store(free.len(), Ordering::Relaxed);
    }

    /// Free blocks now.
    pub fn num_free(&self) -> usize {
        self.inner.num_free.load(Ordering::Relaxed)
    }

    /// Total blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.inner.num_blocks
    }

    /// Fraction of blocks in use, in `[0, 1]` (0 for an empty pool).
    pub fn usage(&self) -> f64 {
        if self.inner.num_blocks == 0 {
            return 0.0;
        }
        1.0 - self.num_free() as f64 / self.inner.num_blocks as f64
    }
}

/// One allocated KV-cache block; returned to its pool on drop.
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
}
