//! A sequence's block table: the physical blocks holding its KV entries in position
//! order, and the slot mapping (`block * block_size + offset`) the backend writes to.

use super::block_pool::{BlockPool, KvBlock};

/// Blocks of one sequence. Dropping the table (finish, abort) or calling
/// [`BlockTable::release`] (preemption) returns every block to the pool, last block first
/// (so the pool evicts a sequence's tail before its shared head).
///
/// Under a sliding window every layer has, [`BlockTable::release_front`] gives back the
/// leading blocks no future query can attend to; the table keeps its positions (block `i`
/// still covers positions `i·block_size..`), and [`BlockTable::ids`] names such a block by
/// the first held block's id — a placeholder the attention never reads.
#[derive(Debug, Default)]
pub struct BlockTable {
    /// Held blocks, for positions from `released · block_size` on.
    blocks: Vec<KvBlock>,
    /// Leading blocks given back by [`BlockTable::release_front`].
    released: usize,
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

    /// Number of blocks the table covers (held and released ones).
    pub fn len(&self) -> usize {
        self.released + self.blocks.len()
    }

    /// Whether the table covers no block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Slots of the held blocks.
    pub fn capacity(&self, block_size: usize) -> usize {
        self.blocks.len() * block_size
    }

    /// Positions covered by released blocks (`0..released_tokens`).
    pub fn released_tokens(&self, block_size: usize) -> usize {
        self.released * block_size
    }

    /// Gives back the blocks wholly below position `keep_from` (they are never read again);
    /// returns how many were released now.
    pub fn release_front(&mut self, keep_from: usize, block_size: usize) -> usize {
        let n = (keep_from / block_size).saturating_sub(self.released).min(self.blocks.len());
        // Drop order: oldest first, so the pool evicts the sequence's oldest blocks first.
        self.blocks.drain(..n);
        self.released += n;
        n
    }

    /// Grows the table so it covers positions `0..num_tokens`. All-or-nothing: returns
    /// `false` (and allocates nothing) when the pool lacks the blocks.
    pub fn ensure_capacity(&mut self, pool: &BlockPool, num_tokens: usize, block_size: usize) -> bool {
        let needed = num_tokens.div_ceil(block_size).saturating_sub(self.len());
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
        num_tokens.div_ceil(block_size).saturating_sub(self.len())
    }

    /// Appends blocks (from [`BlockPool::allocate_with_prefix`]) after those held.
    pub fn extend(&mut self, blocks: Vec<KvBlock>) {
        self.blocks.extend(blocks);
    }

    /// The `i`-th block (`None` beyond the table or when released).
    pub fn block(&self, i: usize) -> Option<&KvBlock> {
        self.blocks.get(i.checked_sub(self.released)?)
    }

    /// Physical block ids in position order (released blocks named by a placeholder, see
    /// the type's docs).
    pub fn ids(&self) -> Vec<u32> {
        let placeholder = self.blocks.first().map_or(0, KvBlock::id);
        let mut ids = vec![placeholder; self.released];
        ids.extend(self.blocks.iter().map(KvBlock::id));
        ids
    }

    /// KV slot of position `pos`. Panics if `pos` is beyond the table or in a released block
    /// (scheduler bug).
    pub fn slot(&self, pos: usize, block_size: usize) -> u32 {
        let block = self.blocks[pos / block_size - self.released].id();
        block * block_size as u32 + (pos % block_size) as u32
    }

    /// Releases every block, last first (preemption by recompute).
    pub fn release(&mut self) {
        while self.blocks.pop().is_some() {}
        self.released = 0;
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
    fn releasing_the_front_keeps_positions() {
        let pool = BlockPool::new(4);
        let mut t = BlockTable::new();
        assert!(t.ensure_capacity(&pool, 12, 4));
        let ids = t.ids();
        assert_eq!(t.release_front(9, 4), 2, "blocks 0 and 1 lie wholly below position 9");
        assert_eq!(pool.num_free(), 3);
        assert_eq!((t.len(), t.capacity(4), t.released_tokens(4)), (3, 4, 8));
        assert_eq!(t.slot(10, 4), ids[2] * 4 + 2);
        assert_eq!(t.ids(), vec![ids[2], ids[2], ids[2]]);
        assert!(t.block(1).is_none() && t.block(2).is_some());
        assert_eq!(t.release_front(9, 4), 0, "nothing more below 9");
        assert!(t.ensure_capacity(&pool, 16, 4));
        assert_eq!(t.len(), 4);
        t.release();
        assert_eq!((pool.num_free(), t.len()), (4, 0));
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
