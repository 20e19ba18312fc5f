//! Iteration-level scheduler (Orca, OSDI 2022) with chunked prefill (Sarathi-Serve,
//! OSDI 2024), shaped like vLLM v1's: there is no separate prefill/decode phase, each
//! sequence simply has `num_computed` of its `tokens` in the KV cache and every step
//! schedules some of the rest under a token budget.
//!
//! Each step:
//! 1. running sequences, oldest admitted first, get `min(remaining, budget)` tokens (1 for
//!    a decode, a chunk for a long prompt). When the pool cannot cover them the most
//!    recently admitted running sequence is preempted (blocks freed, `num_computed = 0`,
//!    requeued at the front of the waiting queue to be recomputed);
//! 2. if nothing was preempted, waiting sequences are admitted FCFS while
//!    `max_num_seqs`, the token budget (`max_num_batched_tokens`) and free blocks allow
//!    (a follower whose leader has not computed the prompt yet is skipped, not waited on).
//!
//! With the prefix cache on ([`Scheduler::with_prefix_caching`]), a sequence admitted with
//! nothing computed (new, or preempted) first takes the cached blocks of its prefix: at most
//! `(len - 1) / block_size` full blocks (the last token is always computed, it yields the
//! logits), so its prefill starts at the first uncached token. After each step every newly
//! completed full block (prompt or generated tokens) is registered in the cache. The other
//! choices of an `n > 1` request *follow* choice 0 ([`SeqOptions::follows`]): they are not
//! admitted until choice 0 has computed the prompt's full blocks, then they hit them, so the
//! prompt is prefilled once. Preemption releases blocks, and registered ones stay cached.
//!
//! The scheduler owns the token ids and block tables; sampling and detokenization state
//! live in the step loop, keyed by [`SeqId`].

use super::backend::{SeqStep, StepBatch};
use super::kv_cache::{BlockPool, BlockTable, PrefixChain, RootKey};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Engine-internal id of one sequence (one choice of one request).
pub type SeqId = u64;

/// Scheduler limits (vLLM's knob names).
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Most sequences in the running set.
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks + decodes) in one step.
    pub max_num_batched_tokens: usize,
    /// Tokens per KV-cache block.
    pub block_size: usize,
}

/// Per-sequence options of [`Scheduler::add_with`].
#[derive(Clone, Debug, Default)]
pub struct SeqOptions {
    /// Prefix-cache salt: cached blocks are shared only between equal salts.
    pub salt: Option<Arc<str>>,
    /// Choice 0 of the same request: this sequence is not admitted while that one is
    /// still computing the prompt's full blocks (prefix caching only).
    pub follows: Option<SeqId>,
}

/// Prefix-cache counters since start (vLLM's `prefix_cache_queries` / `_hits`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheCounters {
    /// Tokens looked up: the sequence length at each admission with the cache on.
    pub queries: u64,
    /// Of those, tokens found cached.
    pub hits: u64,
    /// Tokens computed in prefill (positions below the sequence length at admission),
    /// cache hits excluded, recomputation after preemption included.
    pub prompt_tokens_computed: u64,
}

#[derive(Debug)]
struct SchedSeq {
    tokens: Vec<u32>,
    num_computed: usize,
    blocks: BlockTable,
    root: RootKey,
    follows: Option<SeqId>,
    /// Tokens at the last admission (what counts as prefill).
    prefill_len: usize,
    /// Leading full blocks whose chain is known (matched or registered).
    chained: usize,
    chain: PrefixChain,
    /// False after a registration conflict: the rest of the sequence stays uncached.
    can_register: bool,
    /// Tokens taken from the cache at the first admission.
    first_cached: Option<usize>,
}

/// One sequence's share of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scheduled {
    /// The sequence.
    pub seq: SeqId,
    /// Tokens computed for it this step.
    pub num_tokens: usize,
    /// Whether the step yields logits (and so a new token) for it.
    pub want_logits: bool,
}

/// What one call to [`Scheduler::schedule`] decided.
#[derive(Debug, Default)]
pub struct ScheduleOutput {
    /// The flattened batch for the backend (empty when nothing is runnable).
    pub batch: StepBatch,
    /// Sequences in batch order.
    pub scheduled: Vec<Scheduled>,
    /// Sequences preempted this step (their KV was freed; they will be recomputed).
    pub preempted: Vec<SeqId>,
    /// Sequences that cannot fit in the whole cache even alone; the caller must finish them.
    pub unschedulable: Vec<SeqId>,
    /// Sequences admitted this step and the tokens each took from the prefix cache.
    pub admitted: Vec<(SeqId, usize)>,
}

/// The scheduler of one replica.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: BlockPool,
    seqs: HashMap<SeqId, SchedSeq>,
    waiting: VecDeque<SeqId>,
    /// Admission order: oldest first, the preemption victim is the last.
    running: Vec<SeqId>,
    num_preemptions: u64,
    /// `Some(namespace)` when the prefix cache is on.
    prefix: Option<u64>,
    counters: PrefixCacheCounters,
    /// The window every layer of the model has ([`Scheduler::with_sliding_window`]).
    sliding_window: Option<usize>,
}

impl Scheduler {
    /// A scheduler allocating from `pool`.
    pub fn new(cfg: SchedulerConfig, pool: BlockPool) -> Self {
        Self {
            cfg,
            pool,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            num_preemptions: 0,
            prefix: None,
            counters: PrefixCacheCounters::default(),
            sliding_window: None,
        }
    }

    /// Frees KV blocks that fall wholly out of a sliding window of `window` tokens every layer
    /// of the model has: after each step, the blocks below position `computed + 1 - window`
    /// (no later query attends to them). Registered blocks stay in the prefix cache when
    /// freed (their content is intact until evicted), and a prefix hit takes only a chain of
    /// blocks from position 0, so prefix caching is unaffected.
    #[must_use]
    pub fn with_sliding_window(mut self, window: usize) -> Self {
        self.sliding_window = Some(window.max(1));
        self
    }

    /// Turns the prefix cache on, chains rooted at `namespace` (the model identity).
    #[must_use]
    pub fn with_prefix_caching(mut self, namespace: u64) -> Self {
        self.prefix = Some(namespace);
        self
    }

    /// Whether the prefix cache is on.
    pub fn prefix_caching(&self) -> bool {
        self.prefix.is_some()
    }

    /// Queues a sequence whose first `tokens.len()` tokens must be computed (prompt, plus
    /// any tokens generated before a migration).
    pub fn add(&mut self, seq: SeqId, tokens: Vec<u32>) {
        self.add_with(seq, tokens, SeqOptions::default());
    }

    /// [`Scheduler::add`] with a cache salt and, for choices 1.. of a request, the choice
    /// they follow.
    pub fn add_with(&mut self, seq: SeqId, tokens: Vec<u32>, opts: SeqOptions) {
        let root = RootKey { namespace: self.prefix.unwrap_or(0), salt: opts.salt };
        let chain = root.chain();
        let s = SchedSeq {
            prefill_len: tokens.len(),
            tokens,
            num_computed: 0,
            blocks: BlockTable::new(),
            root,
            follows: opts.follows,
            chained: 0,
            chain,
            can_register: true,
            first_cached: None,
        };
        self.seqs.insert(seq, s);
        self.waiting.push_back(seq);
    }

    /// Prefix-cache counters since start.
    pub fn prefix_counters(&self) -> PrefixCacheCounters {
        self.counters
    }

    /// Tokens the sequence took from the prefix cache at its first admission (`None`
    /// before it was admitted).
    pub fn first_cached_tokens(&self, seq: SeqId) -> Option<usize> {
        self.seqs.get(&seq).and_then(|s| s.first_cached)
    }

    /// Appends a sampled token to a sequence (computed in a later step).
    pub fn append_token(&mut self, seq: SeqId, token: u32) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            s.tokens.push(token);
        }
    }

    /// Token ids of a sequence (prompt then generated).
    pub fn tokens(&self, seq: SeqId) -> &[u32] {
        self.seqs.get(&seq).map_or(&[], |s| s.tokens.as_slice())
    }

    /// Removes a sequence (finished or aborted), freeing its blocks.
    pub fn remove(&mut self, seq: SeqId) {
        if self.seqs.remove(&seq).is_some() {
            self.running.retain(|s| *s != seq);
            self.waiting.retain(|s| *s != seq);
        }
    }

    /// Sequences admitted (holding or about to hold KV blocks).
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Sequences queued (never admitted, or preempted).
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether nothing is queued or running.
    pub fn is_idle(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Preemptions since start.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    /// The block pool.
    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// KV occupancy now: `(allocated, stored)`, the slots of every block held by a sequence
    /// (`blocks × block_size`) and the tokens whose K/V those blocks hold (each sequence's
    /// computed tokens). Read-only; after [`Scheduler::commit`] the difference is each running
    /// sequence's unfilled tail of its last block (< `block_size` per sequence).
    pub fn kv_occupancy(&self) -> (usize, usize) {
        let bs = self.cfg.block_size;
        self.seqs.values().fold((0, 0), |(alloc, stored), s| {
            let cap = s.blocks.capacity(bs);
            let held = s.num_computed.saturating_sub(s.blocks.released_tokens(bs));
            (alloc + cap, stored + held.min(cap))
        })
    }

    fn preempt(&mut self, seq: SeqId, out: &mut ScheduleOutput) {
        if let Some(s) = self.seqs.get_mut(&seq) {
            // Registered blocks stay cached: re-admission usually hits them.
            s.blocks.release();
            s.num_computed = 0;
            s.chained = 0;
            s.chain = s.root.chain();
            s.can_register = true;
        }
        self.running.retain(|s| *s != seq);
        self.waiting.push_front(seq);
        self.num_preemptions += 1;
        out.preempted.push(seq);
    }

    /// Plans one step. Call [`Scheduler::commit`] after the backend ran it.
    pub fn schedule(&mut self) -> ScheduleOutput {
        let bs = self.cfg.block_size;
        let mut out = ScheduleOutput::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut plan: Vec<(SeqId, usize)> = Vec::new();

        // 1. Running sequences, oldest first; preempt the youngest when blocks run out.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(s) = self.seqs.get(&id) else {
                i += 1;
                continue;
            };
            let n = (s.tokens.len() - s.num_computed).min(budget);
            if n == 0 {
                i += 1;
                continue;
            }
            let target = s.num_computed + n;
            let mut fits = false;
            loop {
                let pool = &self.pool;
                if let Some(s) = self.seqs.get_mut(&id)
                    && s.blocks.ensure_capacity(pool, target, bs)
                {
                    fits = true;
                    break;
                }
                // Youngest admitted is last; those after `i` are not scheduled yet.
                let victim = self.running.len() - 1;
                if victim == i {
                    break;
                }
                let vid = self.running[victim];
                self.preempt(vid, &mut out);
            }
            if fits {
                plan.push((id, n));
                budget -= n;
                i += 1;
            } else if i == 0 {
                // Alone and still too big for the whole cache.
                self.running.remove(i);
                out.unschedulable.push(id);
            } else {
                self.preempt(id, &mut out);
            }
        }

        // 2. Admit waiting sequences FCFS (not in a step that had to preempt).
        if out.preempted.is_empty() {
            let mut w = 0;
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs && w < self.waiting.len() {
                let id = self.waiting[w];
                let Some(s) = self.seqs.get(&id) else {
                    self.waiting.remove(w);
                    continue;
                };
                if s.blocks.blocks_needed(s.tokens.len(), bs) > self.pool.num_blocks() {
                    self.waiting.remove(w);
                    out.unschedulable.push(id);
                    continue;
                }
                if self.must_wait_for_leader(s) {
                    w += 1;
                    continue;
                }
                let Some(n) = self.admit(id, budget) else { break };
                let cached = self.seqs.get(&id).map_or(0, |s| s.num_computed);
                self.waiting.remove(w);
                self.running.push(id);
                out.admitted.push((id, cached));
                plan.push((id, n));
                budget -= n;
            }
        }

        // 3. Flatten into the backend's varlen batch.
        for (id, n) in plan {
            let Some(s) = self.seqs.get(&id) else { continue };
            let start = s.num_computed;
            let end = start + n;
            let want_logits = end == s.tokens.len();
            let query_start = out.batch.token_ids.len();
            for pos in start..end {
                out.batch.token_ids.push(s.tokens[pos]);
                out.batch.positions.push(pos as u32);
                out.batch.slot_mapping.push(s.blocks.slot(pos, bs));
            }
            let nblocks = end.div_ceil(bs);
            let mut table = s.blocks.ids();
            table.truncate(nblocks);
            out.batch.seqs.push(SeqStep {
                query_start,
                query_len: n,
                context_len: end,
                block_table: table,
                want_logits,
            });
            out.scheduled.push(Scheduled { seq: id, num_tokens: n, want_logits });
        }
        out
    }

    /// Whether a follower must stay queued: its leader is still computing the prompt's
    /// full blocks (which it will then take from the cache).
    fn must_wait_for_leader(&self, s: &SchedSeq) -> bool {
        if self.prefix.is_none() || s.num_computed > 0 {
            return false;
        }
        let Some(leader) = s.follows.and_then(|l| self.seqs.get(&l)) else { return false };
        let bs = self.cfg.block_size;
        let shared = s.tokens.len().saturating_sub(1) / bs * bs;
        leader.num_computed < shared
    }

    /// Gives a waiting sequence its blocks for its first chunk (taking its cached prefix
    /// first when the prefix cache is on). Returns the chunk's size, or `None` (nothing
    /// taken) when the pool lacks the blocks.
    fn admit(&mut self, id: SeqId, budget: usize) -> Option<usize> {
        let bs = self.cfg.block_size;
        let pool = &self.pool;
        let s = self.seqs.get_mut(&id)?;
        let len = s.tokens.len();
        if self.prefix.is_none() || s.num_computed > 0 || !s.blocks.is_empty() {
            let n = (len - s.num_computed).min(budget);
            if !s.blocks.ensure_capacity(pool, s.num_computed + n, bs) {
                return None;
            }
            s.prefill_len = len;
            s.first_cached.get_or_insert(0);
            return Some(n);
        }
        let max_blocks = len.saturating_sub(1) / bs;
        let extra = |matched: usize| {
            let computed = matched * bs;
            (computed + (len - computed).min(budget)).div_ceil(bs) - matched
        };
        let got = pool.allocate_with_prefix(&s.root, &s.tokens, bs, max_blocks, extra)?;
        let cached = got.matched * bs;
        s.blocks.extend(got.blocks);
        s.num_computed = cached;
        s.chained = got.matched;
        s.chain = got.chain;
        s.can_register = true;
        s.prefill_len = len;
        s.first_cached.get_or_insert(cached);
        self.counters.queries += len as u64;
        self.counters.hits += cached as u64;
        Some((len - cached).min(budget))
    }

    /// Records that the backend computed the scheduled tokens, and registers every full
    /// block they completed in the prefix cache.
    pub fn commit(&mut self, scheduled: &[Scheduled]) {
        let bs = self.cfg.block_size;
        for sc in scheduled {
            let Some(s) = self.seqs.get_mut(&sc.seq) else { continue };
            let start = s.num_computed;
            s.num_computed += sc.num_tokens;
            self.counters.prompt_tokens_computed += s.num_computed.min(s.prefill_len).saturating_sub(start) as u64;
            if self.prefix.is_some() {
                let full = (s.num_computed / bs).min(s.blocks.len());
                while s.can_register && s.chained < full {
                    let i = s.chained;
                    let Some(block) = s.blocks.block(i) else { break };
                    match self.pool.register(block, s.chain, &s.tokens[i * bs..(i + 1) * bs], &s.root) {
                        Some(chain) => {
                            s.chain = chain;
                            s.chained += 1;
                        }
                        None => s.can_register = false,
                    }
                }
            }
            // After registering, so a block leaves the table only once it is in the cache.
            if let Some(w) = self.sliding_window {
                s.blocks.release_front((s.num_computed + 1).saturating_sub(w), bs);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(max_seqs: usize, budget: usize, blocks: usize) -> Scheduler {
        let cfg = SchedulerConfig { max_num_seqs: max_seqs, max_num_batched_tokens: budget, block_size: 4 };
        Scheduler::new(cfg, BlockPool::new(blocks))
    }

    /// Runs one step with a fake sampler that appends token 7 to every sequence with logits.
    fn step(s: &mut Scheduler) -> ScheduleOutput {
        let out = s.schedule();
        s.commit(&out.scheduled);
        for sc in &out.scheduled {
            if sc.want_logits {
                s.append_token(sc.seq, 7);
            }
        }
        out
    }

    #[test]
    fn a_sliding_window_frees_the_blocks_behind_it() {
        let mut s = sched(4, 64, 8).with_sliding_window(3);
        s.add(1, (0..10).collect());
        let out = step(&mut s);
        assert_eq!(out.batch.seqs[0].block_table.len(), 3);
        // Position 10 (the next query) attends to 8..=10: blocks 0 and 1 (positions 0..8)
        // are given back, block 2 is kept.
        assert_eq!(s.pool().num_free(), 7);
        for _ in 0..4 {
            step(&mut s);
        }
        // 14 computed, next query 14 reads 12..=14: only block 3 is held.
        assert_eq!(s.pool().num_free(), 7);
        assert_eq!(s.kv_occupancy(), (4, 2));
        let out = step(&mut s);
        let seq = &out.batch.seqs[0];
        assert_eq!((seq.context_len, seq.block_table.len()), (15, 4));
        assert_eq!(out.batch.slot_mapping, vec![seq.block_table[3] * 4 + 2]);
        s.remove(1);
        assert_eq!(s.pool().num_free(), 8);
    }

    #[test]
    fn chunked_prefill_mixes_with_decode() {
        let mut s = sched(8, 6, 64);
        s.add(1, vec![1, 2]);
        let o = step(&mut s);
        assert_eq!(o.scheduled, vec![Scheduled { seq: 1, num_tokens: 2, want_logits: true }]);
        s.add(2, (0..10).collect());
        // seq 1 decodes (1 token), seq 2 gets a 5-token chunk.
        let o = step(&mut s);
        assert_eq!(o.scheduled[0], Scheduled { seq: 1, num_tokens: 1, want_logits: true });
        assert_eq!(o.scheduled[1], Scheduled { seq: 2, num_tokens: 5, want_logits: false });
        assert_eq!(o.batch.token_ids.len(), 6);
        assert_eq!(o.batch.positions, vec![2, 0, 1, 2, 3, 4]);
        assert_eq!(o.batch.seqs[1].query_start, 1);
        assert_eq!(o.batch.seqs[1].context_len, 5);
        let o = step(&mut s);
        assert_eq!(o.scheduled[1], Scheduled { seq: 2, num_tokens: 5, want_logits: true });
        assert_eq!(s.tokens(2).len(), 11);
        assert_eq!(s.num_running(), 2);
    }

    #[test]
    fn admission_respects_max_num_seqs_fcfs() {
        let mut s = sched(2, 100, 64);
        for id in 1..=3 {
            s.add(id, vec![1, 2, 3]);
        }
        let o = step(&mut s);
        let ids: Vec<_> = o.scheduled.iter().map(|x| x.seq).collect();
        assert_eq!(ids, vec![1, 2]);
        assert_eq!(s.num_waiting(), 1);
        s.remove(1);
        let o = step(&mut s);
        let ids: Vec<_> = o.scheduled.iter().map(|x| x.seq).collect();
        assert_eq!(ids, vec![2, 3]);
    }

    #[test]
    fn preempts_youngest_and_recomputes_it() {
        // 3 blocks of 4 tokens; two sequences of 4 prompt tokens each take 2 blocks... then grow.
        let mut s = sched(4, 100, 3);
        s.add(1, vec![1, 2, 3]);
        s.add(2, vec![4, 5, 6]);
        step(&mut s); // both admitted: 1 block each, 4 tokens each after sampling
        assert_eq!(s.pool().num_free(), 1);
        step(&mut s); // seq 1 needs a 2nd block (pos 3 is in block 0: no); both decode pos 3
        let o = step(&mut s); // pos 4: seq 1 takes the last block, seq 2 must be preempted
        assert_eq!(o.preempted, vec![2]);
        assert_eq!(o.scheduled.len(), 1);
        assert_eq!(s.num_waiting(), 1);
        assert_eq!(s.num_preemptions(), 1);
        s.remove(1);
        assert_eq!(s.pool().num_free(), 3);
        let o = step(&mut s);
        // recompute: all 5 tokens of seq 2 in one go
        assert_eq!(o.scheduled, vec![Scheduled { seq: 2, num_tokens: 5, want_logits: true }]);
        s.remove(2);
        assert_eq!(s.pool().num_free(), 3);
        assert!(s.is_idle());
    }

    #[test]
    fn kv_occupancy_counts_held_slots_and_computed_tokens() {
        let mut s = sched(4, 100, 16);
        assert_eq!(s.kv_occupancy(), (0, 0));
        s.add(1, (0..5).collect());
        s.add(2, (0..8).collect());
        step(&mut s); // 2 blocks (8 slots) holding 5 tokens + 2 blocks holding 8
        assert_eq!(s.kv_occupancy(), (16, 13));
        assert_eq!(s.kv_occupancy().0, (s.pool().num_blocks() - s.pool().num_free()) * 4);
        step(&mut s); // seq 2 decodes position 8: a third block
        assert_eq!(s.kv_occupancy(), (20, 15));
        s.remove(2);
        assert_eq!(s.kv_occupancy(), (8, 6));
    }

    #[test]
    fn too_big_for_the_cache_is_unschedulable() {
        let mut s = sched(4, 100, 2);
        s.add(1, (0..9).collect());
        let o = s.schedule();
        assert_eq!(o.unschedulable, vec![1]);
        assert!(o.scheduled.is_empty());
    }
}
