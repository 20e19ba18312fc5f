//! The 8-bit-activation path ([`super::q8`]): the AVX2 and AVX-512 kernels give the scalar
//! kernel's bits for every format, row tile, weight-row count and batch; a row's value does not depend on the batch;
//! the activation quantization follows ggml's formulas; products stay close to the f32
//! product; a fused weight of mixed formats equals its parts.

use super::q8::{ActBlocks, QuantRows, dot_scalar, quantize};
use super::tests_support::random_linear;
use super::*;

const TYPES: [GgmlType; 6] =
    [GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q5K, GgmlType::Q6K];

fn input(n: usize, inp: usize) -> Vec<f32> {
    (0..n * inp).map(|i| (((i * 7919) % 1013) as f32 - 506.0) / 97.0 * if i % 11 == 0 { 4.0 } else { 1.0 }).collect()
}

fn run_with(w: &PackedWeight, x: &[f32], n: usize, kernels: q8::Kernels) -> Vec<f32> {
    let kind = ActBlocks::for_format(w.fmt.ggml()).expect("8-bit path");
    let mut a = QuantRows::default();
    quantize(x, n, w.inp, kind, &mut a);
    let mut y = vec![0f32; n * w.out];
    let out = q8::Out { y: y.as_mut_ptr(), stride: w.out };
    // SAFETY: `y` holds `n * out` values, `a` `n` rows for `w`; only kernels the CPU has.
    unsafe { q8::run(&w.block_rows(), &a, (0, n), (0, w.out), &out, kernels) };
    y
}

/// The kernels this CPU runs, scalar first.
fn kernels() -> Vec<q8::Kernels> {
    use q8::Kernels::*;
    match q8::Kernels::best() {
        Avx512 => vec![Scalar, Avx2, Avx512],
        Avx2 => vec![Scalar, Avx2],
        Scalar => vec![Scalar],
    }
}

#[test]
fn simd_kernels_equal_scalar_and_rows_do_not_depend_on_the_batch() {
    let best = q8::Kernels::best();
    for ty in TYPES {
        // 13, 14, 15 and 16 weight rows: the AVX-512 kernels' groups of four, a pair and a
        // single row all occur.
        for out in 13..=16 {
            let inp = 512;
            let w = PackedWeight::stack_q8(vec![random_linear(ty, out, inp, 11 + out as u64)]);
            assert!(w.activation_blocks().is_some(), "{ty:?}");
            for n in [1, 3, 4, 9] {
                let x = input(n, inp);
                let scalar = run_with(&w, &x, n, q8::Kernels::Scalar);
                for k in kernels() {
                    assert_eq!(run_with(&w, &x, n, k), scalar, "{ty:?} {k:?} out={out} n={n}");
                }
                let mut y = vec![0f32; n * out];
                matmul(&x, n, &w, &mut y);
                assert_eq!(y, scalar, "{ty:?} n={n}: matmul");
                let last = run_with(&w, &x[(n - 1) * inp..], 1, best);
                assert_eq!(last.as_slice(), &y[(n - 1) * out..], "{ty:?} n={n}: last row alone");
            }
        }
    }
}

#[test]
fn simd_kernels_equal_scalar_at_extreme_quants() {
    // Activations at ±127 everywhere (blocks of one magnitude) against weight bytes of all
    // ones or all zeros: the largest integer sums each kernel forms.
    for ty in TYPES {
        let (out, inp) = (6, 256);
        for fill in [0x00u8, 0xFF, 0x80, 0x7F] {
            let mut l = random_linear(ty, out, inp, 3);
            let q = l.quant.as_mut().expect("quantized");
            let (_, bb) = ty.block_layout();
            let keep = super::tests_support::scale_offsets(ty);
            for blk in q.bytes.chunks_exact_mut(bb) {
                for (i, b) in blk.iter_mut().enumerate() {
                    if !keep.contains(&i) {
                        *b = fill;
                    }
                }
            }
            let w = PackedWeight::stack_q8(vec![l]);
            let x: Vec<f32> = (0..2 * inp).map(|i| if i % 3 == 0 { -1.0 } else { 1.0 }).collect();
            let scalar = run_with(&w, &x, 2, q8::Kernels::Scalar);
            for k in kernels() {
                assert_eq!(run_with(&w, &x, 2, k), scalar, "{ty:?} {k:?} fill={fill:#x}");
            }
        }
    }
}

#[test]
fn close_to_the_f32_product() {
    for ty in TYPES {
        let (out, inp) = (7, 1024);
        let q = random_linear(ty, out, inp, 5);
        let f = q.clone().dequantized();
        let w = PackedWeight::stack_q8(vec![q]);
        let x = input(2, inp);
        let mut y = vec![0f32; 2 * out];
        matmul(&x, 2, &w, &mut y);
        for t in 0..2 {
            for j in 0..out {
                let (xr, wr) = (&x[t * inp..][..inp], &f.data[j * inp..][..inp]);
                let exact: f64 = xr.iter().zip(wr).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                let scale: f64 = xr.iter().zip(wr).map(|(a, b)| f64::from((a * b).abs())).sum();
                let err = (f64::from(y[t * out + j]) - exact).abs();
                assert!(err <= 0.02 * scale, "{ty:?} t={t} j={j}: {} vs {exact} (scale {scale})", y[t * out + j]);
            }
        }
    }
}

#[test]
fn activation_blocks_follow_ggml() {
    // Q8_K: iscale = -127 / (the value of largest magnitude), q = nearest(iscale·x) capped
    // at 127, d = 1 / iscale, sums of 16.
    let mut x = vec![0f32; 256];
    x[0] = 2.0;
    x[1] = -4.0;
    x[2] = 1.0;
    x[3] = 0.031_496_06; // 0.5 / 127·4: a tie, rounded to even (0)
    x[17] = 3.0;
    let mut a = QuantRows::default();
    quantize(&x, 1, 256, ActBlocks::Q8K, &mut a);
    let iscale = -127.0f32 / -4.0;
    assert_eq!(a.d, vec![1.0 / iscale]);
    assert_eq!(&a.qs[..4], &[64, -127, 32, (0.031_496_06f32 * iscale).round_ties_even() as i8]);
    assert_eq!(a.qs[17], (3.0f32 * iscale).round_ties_even() as i8);
    assert_eq!(a.bsums[0], a.qs[..16].iter().map(|&q| i16::from(q)).sum::<i16>());
    assert_eq!(a.bsums[1], i16::from(a.qs[17]));
    // Q8_0: d = f16(max|x| / 127), q = round-to-even(x · 127 / max|x|).
    let x: Vec<f32> = (0..32).map(|i| i as f32 - 8.5).collect();
    quantize(&x, 1, 32, ActBlocks::Q8_0, &mut a);
    assert_eq!(a.d, vec![half::f16::from_f32(22.5 / 127.0).to_f32()]);
    let id = 127.0f32 / 22.5;
    assert!(a.qs.iter().zip(&x).all(|(&q, &v)| i32::from(q) == (v * id).round_ties_even() as i32));
    // An all-zero block quantizes to zeros with scale 0.
    quantize(&[0.0; 256], 1, 256, ActBlocks::Q8K, &mut a);
    assert!(a.d == [0.0] && a.qs.iter().all(|&q| q == 0) && a.bsums.iter().all(|&s| s == 0));
}

#[test]
fn mixed_formats_sharing_q8_0_activations_equal_their_parts() {
    let inp = 96;
    let parts = vec![random_linear(GgmlType::Q5_0, 5, inp, 1), random_linear(GgmlType::Q8_0, 3, inp, 2)];
    let fused = PackedWeight::stack_q8(parts.clone());
    assert_eq!((fused.out_features(), fused.activation_blocks()), (8, Some(ActBlocks::Q8_0)));
    let x = input(3, inp);
    let mut y = vec![0f32; 3 * 8];
    matmul(&x, 3, &fused, &mut y);
    for (c0, part) in [(0, &parts[0]), (5, &parts[1])] {
        let w = PackedWeight::stack_q8(vec![part.clone()]);
        let mut yp = vec![0f32; 3 * w.out_features()];
        matmul(&x, 3, &w, &mut yp);
        for t in 0..3 {
            let o = w.out_features();
            assert_eq!(&y[t * 8 + c0..t * 8 + c0 + o], &yp[t * o..(t + 1) * o]);
        }
    }
    // A scalar dot of the first row equals the fused output.
    let mut a = QuantRows::default();
    quantize(&x[..inp], 1, inp, ActBlocks::Q8_0, &mut a);
    let w0 = PackedWeight::stack_q8(vec![parts[0].clone()]);
    let (qs, d, bs) = a.row(0, ActBlocks::Q8_0);
    assert_eq!(dot_scalar(GgmlType::Q5_0, &w0.bytes[..w0.row_bytes()], qs, d, bs), y[0]);
    // Formats with different activation blocks fall back to f32 activations.
    let other =
        PackedWeight::stack_q8(vec![random_linear(GgmlType::Q5_0, 2, 256, 4), random_linear(GgmlType::Q4K, 2, 256, 3)]);
    assert_eq!(other.activation_blocks(), None);
}
