//! Paged KV-cache bookkeeping (PagedAttention, Kwon et al., SOSP 2023; vLLM's
//! `BlockPool` / `BlockTable`). The scheduler owns which blocks a sequence holds; the
//! backend owns the block memory (see [`super::backend`]).
//!
//! - [`BlockPool`]: fixed number of reference-counted blocks, a free list, an LRU of
//!   evictable cached blocks, usage in `[0, 1]`.
//! - [`KvBlock`]: one holder's reference to a block; released on `Drop` (RAII), so
//!   finish, abort and preemption all release blocks by dropping the sequence's table.
//! - [`prefix_cache`]: the exact prefix-cache index (hash → block, verified by tokens and
//!   parent version) and its event log for routers.
//! - [`BlockTable`]: a sequence's blocks in position order and its slot mapping.
//! - [`prefix_hash`]: the chained block hashes of the prefix cache (shared with routers).

pub mod block_pool;
pub mod block_table;
pub mod prefix_cache;
pub mod prefix_hash;

pub use block_pool::{BlockPool, KvBlock, PrefixAllocation};
pub use block_table::BlockTable;
pub use prefix_cache::{PrefixChain, RootKey};
pub use prefix_hash::{CacheEvent, CacheEvents, block_hashes};
