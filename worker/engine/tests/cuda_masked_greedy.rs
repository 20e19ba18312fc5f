//! The CUDA backend's constrained greedy path (`forward_greedy_constrained`: `logit_edits` and
//! the masked `argmax_rows` on the device) chooses the same tokens as the host path
//! (`LogitConstraints::apply` on the downloaded logits, then `sampler::argmax`) for the same
//! step: masks that exclude the free choice, masks over the last, partial mask word, an empty
//! mask, masks stored in another order than the rows, biases and bans with and without masks.
//!
//! Needs a GPU (`--features cuda`); without CUDA libraries it says so and passes. A small
//! synthetic Llama (seeded random bf16 weights; vocabulary 4,100 so the last mask word is
//! partial) runs one prefill step of 6 sequences twice: once returning logits, once greedy on
//! the device. A prefill step replays no CUDA graph, so both runs compute the same logits.
#![cfg(feature = "cuda")]

use prism_engine::backend::cuda::{CudaBackend, CudaOptions, SyntheticShape, cuda_available};
use prism_engine::backend::{Backend, LogitConstraints, LogitEdit, SeqStep, StepBatch};
use prism_engine::sampler::argmax;

const VOCAB: usize = 4_100;
const BS: usize = 16;
const ROWS: usize = 6;
const PROMPT: usize = 5;

/// splitmix64: seeded test data.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
}

/// `ROWS` sequences of `PROMPT` tokens each, every one wanting logits (one block each).
fn prefill() -> StepBatch {
    let mut b = StepBatch::default();
    for i in 0..ROWS {
        let start = b.token_ids.len();
        for p in 0..PROMPT {
            b.token_ids.push(((p * 7919 + i * 104_729) % VOCAB) as u32);
            b.positions.push(p as u32);
            b.slot_mapping.push((i * BS + p) as u32);
        }
        b.seqs.push(SeqStep {
            query_start: start,
            query_len: PROMPT,
            context_len: PROMPT,
            block_table: vec![i as u32],
            want_logits: true,
        });
    }
    b
}

fn allow(mask: &mut [u32], token: usize) {
    mask[token / 32] |= 1 << (token % 32);
}

fn allowed(mask: &[u32], token: u32) -> bool {
    mask[token as usize / 32] >> (token % 32) & 1 == 1
}

#[test]
fn device_masked_greedy_equals_host_masked_greedy() {
    if !cuda_available() {
        eprintln!("no CUDA libraries: the device comparison did not run");
        return;
    }
    let shape = SyntheticShape {
        layers: 2,
        hidden: 512,
        heads: 8,
        kv_heads: 2,
        intermediate: 1024,
        vocab: VOCAB,
        rope_theta: 10_000.0,
        seed: 7,
    };
    let opts = CudaOptions {
        block_size: BS,
        kv_cache_bytes: Some(64 << 20),
        max_num_batched_tokens: 256,
        max_num_seqs: 16,
        ..CudaOptions::default()
    };
    let mut be = CudaBackend::synthetic(&shape, &opts).expect("synthetic backend");
    let batch = prefill();
    let logits = be.forward(&batch).expect("forward");
    assert_eq!((logits.rows, logits.vocab_size), (ROWS, VOCAB));
    let free: Vec<u32> = (0..ROWS).map(|r| argmax(logits.row(r))).collect();
    assert_eq!(be.forward_greedy(&batch).expect("forward_greedy"), free, "unconstrained device argmax");

    let words = VOCAB.div_ceil(32);
    let mut rng = Rng(42);
    let mut sparse = vec![0u32; words];
    while sparse.iter().map(|w| w.count_ones()).sum::<u32>() < 40 {
        allow(&mut sparse, rng.below(VOCAB));
    }
    sparse[free[1] as usize / 32] &= !(1 << (free[1] % 32));
    let mut dense = vec![0u32; words];
    for t in 0..VOCAB {
        if rng.below(10) < 3 {
            allow(&mut dense, t);
        }
    }
    let mut tail = vec![0u32; words];
    for t in VOCAB - 4..VOCAB {
        allow(&mut tail, t);
    }
    let empty = vec![0u32; words];
    // Masks stored tail, empty, sparse, dense: not the rows' order.
    let masks = [tail.clone(), empty, sparse.clone(), dense.clone()].concat();
    let mask_of_row = vec![-1, 2, 3, 0, 1, -1];
    // Row 2: the best allowed token banned, a weak allowed token boosted past the rest.
    let best_dense = (0..VOCAB as u32)
        .filter(|&t| allowed(&dense, t))
        .max_by(|&a, &b| logits.row(2)[a as usize].total_cmp(&logits.row(2)[b as usize]))
        .expect("dense mask allows tokens");
    let boosted = (0..VOCAB as u32).find(|&t| allowed(&dense, t) && t != best_dense).expect("a second token");
    // Row 5 (no mask): its free choice banned, a bias on another token; a bias on a token
    // that row 3's mask forbids must not make it win.
    let edits = vec![
        LogitEdit { row: 2, token: best_dense, value: f32::NEG_INFINITY },
        LogitEdit { row: 2, token: boosted, value: 1.0e4 },
        LogitEdit { row: 5, token: free[5], value: f32::NEG_INFINITY },
        LogitEdit { row: 5, token: 17, value: 0.25 },
        LogitEdit { row: 3, token: 3, value: 1.0e4 },
    ];
    let c = LogitConstraints { mask_words: words, masks, mask_of_row, edits };

    let mut host_logits = logits.clone();
    c.apply(&mut host_logits);
    let host: Vec<u32> = (0..ROWS).map(|r| argmax(host_logits.row(r))).collect();
    let device = be.forward_greedy_constrained(&batch, &mut || c.clone()).expect("constrained greedy");
    assert_eq!(device, host, "device-masked greedy vs host-masked greedy (free choices {free:?})");

    assert_eq!(host[0], free[0], "an unconstrained row keeps its choice");
    assert!(allowed(&sparse, host[1]) && host[1] != free[1], "row 1 follows its mask: {}", host[1]);
    assert_eq!(host[2], boosted, "row 2: the boosted allowed token");
    assert!(host[3] as usize >= VOCAB - 4, "row 3 stays in the partial last word: {}", host[3]);
    assert_eq!(host[4], 0, "a row whose mask allows nothing falls back to token 0");
    assert_ne!(host[5], free[5], "row 5's banned free choice");

    // A few rows' argmax is split over many blocks per row (ROWS rows: 43 each): a tie between
    // the first and the last block's range goes to the lower id, and NaN never wins, whichever
    // block finishes last. Adding 3e38 to a logit of a few units gives exactly 3e38 (an f32
    // step there is ~2e31), so the two tokens tie exactly.
    let (lo, hi) = (3u32, (VOCAB - 2) as u32);
    let edits = vec![
        LogitEdit { row: 0, token: hi, value: 3.0e38 },
        LogitEdit { row: 0, token: lo, value: 3.0e38 },
        LogitEdit { row: 5, token: lo, value: f32::NAN },
        LogitEdit { row: 5, token: hi, value: 3.0e38 },
        LogitEdit { row: 5, token: 100, value: f32::NAN },
    ];
    let c = LogitConstraints { mask_words: 0, masks: Vec::new(), mask_of_row: Vec::new(), edits };
    let mut host_logits = logits.clone();
    c.apply(&mut host_logits);
    let host: Vec<u32> = (0..ROWS).map(|r| argmax(host_logits.row(r))).collect();
    assert_eq!((host[0], host[5]), (lo, hi), "host sampler: lowest id on ties, NaN skipped");
    for _ in 0..3 {
        let device = be.forward_greedy_constrained(&batch, &mut || c.clone()).expect("tie/NaN greedy");
        assert_eq!(device, host, "split device argmax vs host argmax on ties and NaN");
    }
}
