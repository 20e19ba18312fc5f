//! A sequence's block table: the physical blocks holding its KV entries in position
//! order, and the slot mapping (`block * block_size + offset`) the backend writes to.

use super::block_pool::{BlockPool, KvBlock};

/// Blocks of one sequence. Dropping the table (finish, abort) or calling
/// [`BlockTable::release`] (preemption) returns every block to the pool, last block first
/// (so the pool evicts a sequence's tail before its shared head).
#[derive(Debug, Default)]
pub struct BlockTable {
    blocks: Vec<KvBlock>,
}

impl Drop for BlockTable {
    fn drop(&mut self) {
        self.release();
    }
}

impl BlockTable {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of blocks held.
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is held.
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Tokens the held blocks can store.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// Grows the table so it covers positions `0..num_tokens`. All-or-nothing: returns
    /// `false` (and allocates nothing) when the pool lacks the blocks.
    pub fn ensure_capacity(&mut self, pool: &BlockPool, num_tokens: usize, block_size: usize) -> bool {
        let needed = num_tokens.div_ceil(block_size).saturating_sub(self.blocks.len());
        if needed == 0 {
            return true;
        }
        match pool.allocate_n(needed) {
            Some(new) => {
                self.blocks.extend(new);
                true
            }
            None => false,
        }
    }

    /// Blocks that growing to `num_tokens` would need beyond those held.
    pub fn blocks_needed(&self, num_tokens: usize, block_size: usize) -> usize {
        num_tokens.div_ceil(block_size).saturating_sub(self.blocks.len())
    }

    /// Appends blocks (from [`BlockPool::allocate_with_prefix`]) after those held.
    pub fn extend(&mut self, blocks: Vec<KvBlock>) {
        self.blocks.extend(blocks);
    }

    /// The `i`-th block.
    pub fn block(&self, i: usize) -> Option<&KvBlock> {
        self.blocks.get(i)
    }

    /// Physical block ids in position order.
    pub fn ids(&self) -> Vec<u32> {
        self.blocks.iter().map(KvBlock::id).collect()
    }

    /// KV slot of position `pos`. Panics if `pos` is beyond the table (scheduler bug).
    pub fn slot(&self, pos: usize, block_size: usize) -> u32 {
        let block = self.blocks[pos / block_size].id();
        block * block_size as u32 + (pos % block_size) as u32
    }

    /// Releases every block, last first (preemption by recompute).
    pub fn release(&mut self) {
        while self.blocks.pop().is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_by_blocks_and_maps_slots() {
        let pool = BlockPool::new(4);
        let mut t = BlockTable::new();
        assert!(t.ensure_capacity(&pool, 5, 4));
        assert_eq!(t.len(), 2);
        assert_eq!(t.capacity(4), 8);
        assert!(t.ensure_capacity(&pool, 8, 4), "already covered");
        assert_eq!(pool.num_free(), 2);
        let ids = t.ids();
        assert_eq!(t.slot(0, 4), ids[0] * 4);
        assert_eq!(t.slot(6, 4), ids[1] * 4 + 2);
        assert_eq!(t.blocks_needed(17, 4), 3);
        assert!(!t.ensure_capacity(&pool, 17, 4), "needs 3 more, only 2 free");
        assert_eq!(pool.num_free(), 2);
        t.release();
        assert_eq!(pool.num_free(), 4);
        assert!(t.is_empty());
    }

    #[test]
    fn dropping_the_table_frees_blocks() {
        let pool = BlockPool::new(2);
        {
            let mut t = BlockTable::new();
            assert!(t.ensure_capacity(&pool, 2, 1));
            assert_eq!(pool.num_free(), 0);
        }
        assert_eq!(pool.num_free(), 2);
    }
}
