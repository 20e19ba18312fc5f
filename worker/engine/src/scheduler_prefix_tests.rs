//! The scheduler with the prefix cache on: partial hits, the always-computed last token,
//! admission failures, `n > 1` followers and preemption.

use super::kv_cache::BlockPool;
use super::scheduler::{ScheduleOutput, Scheduled, Scheduler, SchedulerConfig, SeqOptions};

fn sched(budget: usize, blocks: usize) -> Scheduler {
    let cfg = SchedulerConfig { max_num_seqs: 8, max_num_batched_tokens: budget, block_size: 4 };
    Scheduler::new(cfg, BlockPool::new(blocks)).with_prefix_caching(42)
}

/// One step; every sequence with logits gets token 7.
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
fn partial_prefix_ending_mid_block_computes_from_the_first_uncached_token() {
    let mut s = sched(100, 16);
    s.add(1, (0..10).collect());
    let o = step(&mut s);
    let first = o.batch.seqs[0].block_table.clone();
    assert_eq!(s.pool().num_cached(), 2, "the two full blocks of the prompt");
    s.remove(1);
    assert_eq!(s.pool().num_free(), 16);
    // Shares the first block fully and two tokens of the second.
    let mut t: Vec<u32> = (0..6).collect();
    t.extend([50, 51, 52, 53]);
    s.add(2, t.clone());
    let o = step(&mut s);
    assert_eq!(o.admitted, vec![(2, 4)]);
    assert_eq!(o.scheduled, vec![Scheduled { seq: 2, num_tokens: 6, want_logits: true }]);
    assert_eq!(o.batch.positions, (4..10).collect::<Vec<u32>>());
    assert_eq!(o.batch.token_ids, t[4..].to_vec());
    assert_eq!(o.batch.seqs[0].context_len, 10);
    assert_eq!(o.batch.seqs[0].block_table[0], first[0], "the cached block");
    assert_ne!(o.batch.seqs[0].block_table[1], first[1], "the differing block is new");
    assert_eq!(s.first_cached_tokens(2), Some(4));
    let c = s.prefix_counters();
    assert_eq!((c.queries, c.hits, c.prompt_tokens_computed), (20, 4, 16));
}

#[test]
fn the_last_token_is_always_computed() {
    let mut s = sched(100, 16);
    s.add(1, (0..8).collect());
    step(&mut s);
    assert_eq!(s.pool().num_cached(), 2);
    s.remove(1);
    s.add(2, (0..8).collect());
    let o = step(&mut s);
    // 8 tokens = 2 full blocks, but only (8 - 1) / 4 = 1 may come from the cache.
    assert_eq!(o.scheduled, vec![Scheduled { seq: 2, num_tokens: 4, want_logits: true }]);
    assert_eq!(o.batch.positions, vec![4, 5, 6, 7]);
    // Chunked prefill starts at the first uncached token too.
    let mut c = sched(3, 16);
    c.add(1, (0..12).collect());
    while c.tokens(1).len() == 12 {
        step(&mut c);
    }
    c.remove(1);
    c.add(2, (0..12).collect());
    let o = step(&mut c);
    assert_eq!(o.batch.positions, vec![8, 9, 10]);
    assert!(!o.scheduled[0].want_logits);
    let o = step(&mut c);
    assert_eq!(o.batch.positions, vec![11]);
    assert!(o.scheduled[0].want_logits);
}

#[test]
fn failed_admission_releases_the_matched_blocks() {
    let mut s = sched(100, 4);
    s.add(1, (0..9).collect());
    step(&mut s);
    s.remove(1);
    assert_eq!((s.pool().num_evictable(), s.pool().num_free()), (2, 4));
    // Another sequence takes the two free blocks (and keeps decoding inside them).
    s.add(2, (100..107).collect());
    step(&mut s);
    assert_eq!(s.pool().num_free(), 2);
    // Needs its 2 cached blocks plus 2 new ones: only the 2 cached are available.
    let mut t: Vec<u32> = (0..8).collect();
    t.extend(200..208);
    s.add(3, t);
    let o = step(&mut s);
    assert!(o.admitted.is_empty() && o.scheduled.iter().all(|x| x.seq != 3), "{:?}", o.scheduled);
    assert_eq!((s.pool().num_free(), s.pool().num_evictable(), s.pool().num_cached()), (2, 2, 4));
    assert_eq!(s.first_cached_tokens(3), None);
    assert_eq!(s.prefix_counters().queries, 9 + 7, "a failed admission is not a lookup");
    s.remove(2);
    let o = step(&mut s);
    assert_eq!(o.admitted, vec![(3, 8)]);
    s.remove(3);
    assert_eq!(s.pool().num_free(), 4);
}

#[test]
fn followers_wait_for_the_leader_then_hit_its_blocks() {
    let mut s = sched(12, 32);
    let prompt: Vec<u32> = (0..10).collect();
    s.add_with(1, prompt.clone(), SeqOptions::default());
    s.add_with(2, prompt.clone(), SeqOptions { follows: Some(1), ..SeqOptions::default() });
    s.add(3, vec![90, 91]);
    let o = step(&mut s);
    let ids: Vec<_> = o.scheduled.iter().map(|x| x.seq).collect();
    assert_eq!(ids, vec![1, 3], "the follower is skipped, the sequence behind it admitted");
    assert_eq!(s.num_waiting(), 1);
    let leader_table = o.batch.seqs[0].block_table.clone();
    let o = step(&mut s);
    let f = o.batch.seqs.iter().zip(&o.scheduled).find(|(_, x)| x.seq == 2).expect("follower admitted");
    assert_eq!(f.1.num_tokens, 2, "only the prompt's partial last block is computed");
    assert_eq!(f.0.block_table[..2], leader_table[..2]);
    assert_eq!(s.prefix_counters().prompt_tokens_computed, 10 + 2 + 2);
    // Without the prefix cache there is no deferral.
    let cfg = SchedulerConfig { max_num_seqs: 8, max_num_batched_tokens: 100, block_size: 4 };
    let mut off = Scheduler::new(cfg, BlockPool::new(32));
    off.add_with(1, prompt.clone(), SeqOptions::default());
    off.add_with(2, prompt, SeqOptions { follows: Some(1), ..SeqOptions::default() });
    assert_eq!(step(&mut off).scheduled.len(), 2);
    assert_eq!(off.pool().num_cached(), 0, "nothing registered with the cache off");
}

#[test]
fn preemption_keeps_the_head_cached_and_evicts_the_tail_first() {
    let mut s = sched(100, 4);
    s.add(1, (0..7).collect());
    s.add(2, (10..17).collect());
    let o = step(&mut s); // 2 blocks each; block 0 of each registered
    let seq2_table = o.batch.seqs[1].block_table.clone();
    step(&mut s); // both decode position 7: block 1 of each registered
    assert_eq!(s.pool().num_cached(), 4);
    let o = step(&mut s); // seq 1 needs a third block: seq 2 is preempted
    assert_eq!(o.preempted, vec![2]);
    assert_eq!(o.batch.seqs[0].block_table[2], seq2_table[1], "seq 2's tail block is evicted first");
    assert!(s.pool().is_cached(seq2_table[0]), "its head stays cached");
    s.remove(1);
    let o = step(&mut s);
    assert_eq!(o.admitted, vec![(2, 4)], "re-admission hits the cached head");
    assert_eq!(o.scheduled, vec![Scheduled { seq: 2, num_tokens: 5, want_logits: true }]);
    assert_eq!(o.batch.seqs[0].block_table[0], seq2_table[0]);
    assert_eq!(s.first_cached_tokens(2), Some(0), "the first admission's count is kept");
    s.remove(2);
    assert_eq!(s.pool().num_free(), 4);
}

/// Step-thread cost of the prefix cache: 256 sequences of 1,024 tokens (half sharing a
/// 512-token prefix), prefilled and decoded 64 steps, with the cache on and off. Ignored by
/// default (a measurement); prints the time per step.
#[test]
#[ignore = "measurement"]
fn scheduler_overhead_with_and_without_the_cache() {
    for caching in [false, true] {
        let cfg = SchedulerConfig { max_num_seqs: 256, max_num_batched_tokens: 8192, block_size: 16 };
        let mut s = Scheduler::new(cfg, BlockPool::new(20_000));
        if caching {
            s = s.with_prefix_caching(1);
        }
        for i in 0..256u32 {
            let t: Vec<u32> = (0..1024u32).map(|p| if i % 2 == 0 && p < 512 { p } else { p * 7 + i }).collect();
            s.add(u64::from(i), t);
        }
        let t0 = std::time::Instant::now();
        let mut steps = 0;
        let mut decode_start = None;
        while steps < 2000 {
            let o = step(&mut s);
            steps += 1;
            if decode_start.is_none() && o.scheduled.iter().all(|x| x.num_tokens == 1) && o.scheduled.len() == 256 {
                decode_start = Some((std::time::Instant::now(), steps));
            }
            if let Some((_, at)) = decode_start
                && steps - at >= 64
            {
                break;
            }
        }
        let (d0, at) = decode_start.expect("reached decode");
        let decode = d0.elapsed() / (steps - at) as u32;
        let c = s.prefix_counters();
        eprintln!(
            "prefix caching {caching}: {steps} steps in {:?}, decode step {decode:?}, hits {} of {} queried, cached {}",
            t0.elapsed(),
            c.hits,
            c.queries,
            s.pool().num_cached()
        );
    }
}
