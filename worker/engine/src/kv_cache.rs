//! Paged KV-cache bookkeeping (PagedAttention, Kwon et al., SOSP 2023; vLLM's
//! `BlockPool` / `BlockTable`). The scheduler owns which blocks a sequence holds; the
//! backend owns the block memory (see [`super::backend`]).
//!
//! - [`BlockPool`]: fixed number of blocks, a free list, usage in `[0, 1]`.
//! - [`KvBlock`]: one allocated block; returns itself to the pool on `Drop` (RAII), so
//!   finish, abort and preemption all free blocks by dropping the sequence's table.
//! - [`BlockTable`]: a sequence's blocks in position order and its slot mapping.
//! - [`prefix_hash`]: the chained block hashes of the prefix cache (shared with routers).

pub mod block_pool;
pub mod block_table;
pub mod prefix_hash;

pub use block_pool::{BlockPool, KvBlock};
pub use block_table::BlockTable;
pub use prefix_hash::{CacheEvent, CacheEvents, block_hashes};
