//! CPU matmul kernels per weight format: `y[n, out] = x[n, inp] · Wᵀ` with the weight kept
//! in its GGUF blocks (dequantized in registers) against the same weight dequantized to f32
//! at load, for the shapes of Gemma 3 270M (640 × 2048, 2048 × 640) and SmolLM2-135M
//! (576 × 1536), at batch 1 (decode) and 32. Every format's output equals its f32
//! dequantization bit for bit (checked here once per shape), so the figures compare speed
//! alone. Prints one table row per (format, shape, batch): µs per call (fastest of seven
//! interleaved rounds) and the weight bytes streamed per second.
//!
//! A second table times the 8-bit-activation path (`PackedWeight::stack_q8`, ggml's
//! numerics: activations quantized to Q8_0/Q8_K, integer block dots) of the formats that
//! have one against the same f32 dequantized weight; its outputs differ from the f32
//! product by the activation rounding (checked to stay within 2% of the row's |x|·|w|).
//!
//! Run: `cargo bench -p prism-engine --bench qmatmul`. Env: `PRISM_BENCH_MS` (time per row,
//! default 600).

use std::time::{Duration, Instant};

use prism_engine::backend::cpu::qmatmul::{PackedWeight, matmul};
use prism_engine::model::gguf::GgmlType;
use prism_engine::model::{Linear, QuantizedData};

/// `(f16 scale offsets, f32 scale offset)` in one block of `ty`.
fn scale_fields(ty: GgmlType) -> (&'static [usize], Option<usize>) {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q8_0 | GgmlType::Q5_0 => (&[0], None),
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => (&[0, 2], None),
        GgmlType::Q6K => (&[208], None),
        GgmlType::Q8K => (&[], Some(0)),
        _ => (&[], None),
    }
}

fn random_linear(ty: GgmlType, out: usize, inp: usize) -> Linear {
    let (per, bb) = ty.block_layout();
    let mut state = 0x2545_F491_4F6C_DD1Du64;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let (f16s, f32_at) = scale_fields(ty);
    let mut bytes = Vec::with_capacity(out * inp / per * bb);
    for _ in 0..out * inp / per {
        let mut b: Vec<u8> = (0..bb).map(|_| next() as u8).collect();
        for &o in f16s {
            let v = (next() % 1000) as f32 / 1000.0 * 0.02 - 0.01;
            b[o..o + 2].copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
        }
        if let Some(o) = f32_at {
            b[o..o + 4].copy_from_slice(&0.001f32.to_le_bytes());
        }
        bytes.extend(b);
    }
    Linear { out_features: out, in_features: inp, data: Vec::new(), quant: Some(QuantizedData { ty, bytes }) }
}

/// µs per call of `a` and of `b`: rounds alternate between the two (so drift in the
/// machine's load hits both alike) and each figure is the fastest round's mean, the one
/// least disturbed by other processes.
fn time_pair(a: &PackedWeight, b: &PackedWeight, x: &[f32], n: usize, y: &mut [f32], budget: Duration) -> (f64, f64) {
    const ROUNDS: u32 = 7;
    let round = |w: &PackedWeight, y: &mut [f32]| {
        let t = Instant::now();
        let mut reps = 0u32;
        while t.elapsed() < budget / (2 * ROUNDS) || reps < 2 {
            matmul(x, n, w, y);
            reps += 1;
        }
        t.elapsed().as_secs_f64() * 1e6 / f64::from(reps)
    };
    matmul(x, n, a, y);
    matmul(x, n, b, y);
    let (mut ta, mut tb) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..ROUNDS {
        ta = ta.min(round(a, y));
        tb = tb.min(round(b, y));
    }
    (ta, tb)
}

fn main() {
    let budget =
        Duration::from_millis(std::env::var("PRISM_BENCH_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(600));
    let types = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
    ];
    // (out, inp): Gemma 3 270M up/gate (inp 640) and down (inp 2048); SmolLM2 up (inp 576).
    let shapes: [(usize, usize); 3] = [(2048, 640), (640, 2048), (1536, 576)];
    println!("threads: {}", rayon::current_num_threads());
    println!(
        "| format | out × inp | batch | µs (blocks) | µs (f32 dequantized) | blocks / f32 | weight GB/s (blocks) |"
    );
    println!("|---|---|---|---|---|---|---|");
    for &(out, inp) in &shapes {
        for ty in types {
            if !inp.is_multiple_of(ty.block_layout().0) {
                continue;
            }
            let q = random_linear(ty, out, inp);
            let f = q.clone().dequantized();
            let (pq, pf) = (PackedWeight::stack(vec![q]), PackedWeight::stack(vec![f]));
            for n in [1usize, 32] {
                let x: Vec<f32> = (0..n * inp).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
                let (mut yq, mut yf) = (vec![0f32; n * out], vec![0f32; n * out]);
                matmul(&x, n, &pq, &mut yq);
                matmul(&x, n, &pf, &mut yf);
                assert_eq!(yq, yf, "{ty:?} {out}×{inp}: blocks and f32 must agree");
                let (tq, tf) = time_pair(&pq, &pf, &x, n, &mut yq, budget);
                let gbs = pq.size_bytes() as f64 / tq / 1e3;
                println!("| {} | {out} × {inp} | {n} | {tq:.1} | {tf:.1} | {:.2} | {gbs:.1} |", ty.name(), tq / tf);
            }
        }
    }
    println!();
    println!("| format | out × inp | batch | µs (8-bit activations) | µs (f32 dequantized) | 8-bit / f32 |");
    println!("|---|---|---|---|---|---|");
    for &(out, inp) in &shapes {
        for ty in types {
            let q8 = PackedWeight::stack_q8(vec![random_linear(ty, out, inp)]);
            if !inp.is_multiple_of(ty.block_layout().0) || q8.activation_blocks().is_none() {
                continue;
            }
            let fl = random_linear(ty, out, inp).dequantized();
            let f = PackedWeight::stack(vec![fl.clone()]);
            for n in [1usize, 32] {
                let x: Vec<f32> = (0..n * inp).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
                let (mut yq, mut yf) = (vec![0f32; n * out], vec![0f32; n * out]);
                matmul(&x, n, &q8, &mut yq);
                matmul(&x, n, &f, &mut yf);
                for j in 0..out {
                    let w = &fl.data[j * inp..(j + 1) * inp];
                    let scale: f32 = x[..inp].iter().zip(w).map(|(a, b)| (a * b).abs()).sum();
                    assert!((yq[j] - yf[j]).abs() <= 0.02 * scale, "{ty:?} row {j}: 8-bit path far off");
                }
                let (tq, tf) = time_pair(&q8, &f, &x, n, &mut yq, budget);
                println!("| {} | {out} × {inp} | {n} | {tq:.1} | {tf:.1} | {:.2} |", ty.name(), tq / tf);
            }
        }
    }
}
