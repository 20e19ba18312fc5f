//! CPU kernels in f32: matrix products (`y = x · Wᵀ` with `W` in `[out, in]` layout), RMSNorm,
//! RoPE (Hugging Face rotate-half layout) and SiLU·mul. Batches of up to [`GEMV_MAX_ROWS`]
//! tokens take a GEMV path (rayon over weight rows, each weight row read once for all
//! tokens, AVX2+FMA when the CPU has it); larger batches go to the `gemm` crate.

use rayon::prelude::*;

/// Token counts up to this use the GEMV path (weight-bandwidth bound); above it, `gemm`.
pub const GEMV_MAX_ROWS: usize = 8;

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_generic(a, b)
}

#[inline(always)]
fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 32;
    let mut acc = [0f32; L];
    let ca = a.chunks_exact(L);
    let cb = b.chunks_exact(L);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..L {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let mut s = 0f32;
    for (x, y) in ra.iter().zip(rb) {
        s = x.mul_add(*y, s);
    }
    // Pairwise reduction of the lanes.
    let mut w = L;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            acc[i] += acc[i + w];
        }
    }
    acc[0] + s
}

#[inline]
fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Dot product of two equal-length slices.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() {
            // SAFETY: the CPU supports AVX2 and FMA (checked above).
            return unsafe { dot_avx2(a, b) };
        }
    }
    dot_generic(a, b)
}

/// `y[t] += a * x[t]` over slices (attention's weighted sum of V rows).
#[inline]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi = xi.mul_add(a, *yi);
    }
}

/// Scratch for [`matmul_t`] (the GEMV path's transposed output).
#[derive(Default)]
pub struct MatmulScratch {
    yt: Vec<f32>,
}

/// `y[n, out] = x[n, inp] · w[out, inp]ᵀ`.
pub fn matmul_t(x: &[f32], n: usize, w: &[f32], out: usize, inp: usize, y: &mut [f32], scratch: &mut MatmulScratch) {
    debug_assert_eq!(x.len(), n * inp);
    debug_assert_eq!(w.len(), out * inp);
    debug_assert_eq!(y.len(), n * out);
    if n == 0 {
        return;
    }
    let threads = rayon::current_num_threads().max(1);
    if n == 1 {
        let chunk = (out / (threads * 8)).max(16);
        y.par_chunks_mut(chunk).enumerate().for_each(|(c, ys)| {
            let base = c * chunk;
            for (j, yj) in ys.iter_mut().enumerate() {
                let r = base + j;
                *yj = dot(&w[r * inp..(r + 1) * inp], x);
            }
        });
        return;
    }
    if n <= GEMV_MAX_ROWS {
        let yt = &mut scratch.yt;
        yt.resize(out * n, 0.0);
        let chunk = (out / (threads * 8)).max(16);
        yt.par_chunks_mut(chunk * n).enumerate().for_each(|(c, ys)| {
            let base = c * chunk;
            for (j, yrow) in ys.chunks_exact_mut(n).enumerate() {
                let r = base + j;
                let wr = &w[r * inp..(r + 1) * inp];
                for (t, yv) in yrow.iter_mut().enumerate() {
                    *yv = dot(wr, &x[t * inp..(t + 1) * inp]);
                }
            }
        });
        for t in 0..n {
            let row = &mut y[t * out..(t + 1) * out];
            for (j, v) in row.iter_mut().enumerate() {
                *v = yt[j * n + t];
            }
        }
        return;
    }
    let par = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    // SAFETY: the pointers and strides describe `x` ([n, inp] row-major), `w`ᵀ (`[inp, out]`
    // with row stride 1 and column stride `inp`) and `y` ([n, out]); all lengths were
    // checked by the caller to match these shapes.
    unsafe {
        gemm::gemm(
            n,
            out,
            inp,
            y.as_mut_ptr(),
            1,
            out as isize,
            false,
            x.as_ptr(),
            1,
            inp as isize,
            w.as_ptr(),
            inp as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            par,
        );
    }
}

/// RMSNorm (Zhang & Sennrich 2019) over rows of `x`: `y = x / sqrt(mean(x²) + eps) · g`.
pub fn rms_norm(x: &[f32], g: &[f32], eps: f32, y: &mut [f32]) {
    let h = g.len();
    for (xr, yr) in x.chunks_exact(h).zip(y.chunks_exact_mut(h)) {
        let ss = dot(xr, xr) / h as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((yv, xv), gv) in yr.iter_mut().zip(xr).zip(g) {
            *yv = gv * (xv * inv);
        }
    }
}

/// Fills `cos`/`sin` (`[n, half]`) for the given positions: angle = `pos · inv_freq[i]` (f32,
/// as transformers computes it).
pub fn rope_tables(positions: &[u32], inv_freq: &[f32], cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
    let half = inv_freq.len();
    cos.resize(positions.len() * half, 0.0);
    sin.resize(positions.len() * half, 0.0);
    for (t, &p) in positions.iter().enumerate() {
        for (i, &f) in inv_freq.iter().enumerate() {
            let a = p as f32 * f;
            let (s, c) = a.sin_cos();
            cos[t * half + i] = c;
            sin[t * half + i] = s;
        }
    }
}

/// Applies rotate-half RoPE in place to `heads` consecutive head vectors of width
/// `2 * cos.len()` in `x` (one token): `x1' = x1·cos − x2·sin`, `x2' = x2·cos + x1·sin`.
pub fn rope_apply(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for head in x.chunks_exact_mut(2 * half) {
        let (a, b) = head.split_at_mut(half);
        for i in 0..half {
            let (x1, x2) = (a[i], b[i]);
            a[i] = x1 * cos[i] - x2 * sin[i];
            b[i] = x2 * cos[i] + x1 * sin[i];
        }
    }
}

/// `act[t, i] = silu(gu[t, i]) · gu[t, I + i]` for the fused `[n, 2I]` gate/up output.
pub fn silu_mul(gu: &[f32], inter: usize, act: &mut [f32]) {
    for (g, a) in gu.chunks_exact(2 * inter).zip(act.chunks_exact_mut(inter)) {
        let (gate, up) = g.split_at(inter);
        for i in 0..inter {
            let x = gate[i];
            a[i] = x / (1.0 + (-x).exp()) * up[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(x: &[f32], n: usize, w: &[f32], out: usize, inp: usize) -> Vec<f32> {
        let mut y = vec![0f32; n * out];
        for t in 0..n {
            for j in 0..out {
                y[t * out + j] = (0..inp).map(|k| f64::from(x[t * inp + k]) * f64::from(w[j * inp + k])).sum::<f64>() as f32;
            }
        }
        y
    }

    #[test]
    fn matmul_paths_agree_with_naive() {
        let (out, inp) = (70, 45);
        let w: Vec<f32> = (0..out * inp).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let mut s = MatmulScratch::default();
        for n in [1, 3, 8, 9, 40] {
            let x: Vec<f32> = (0..n * inp).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
            let mut y = vec![0f32; n * out];
            matmul_t(&x, n, &w, out, inp, &mut y, &mut s);
            let r = naive(&x, n, &w, out, inp);
            for (a, b) in y.iter().zip(&r) {
                assert!((a - b).abs() < 1e-4, "n={n}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn rope_rotates_pairs() {
        let mut x = vec![1.0, 0.0, 0.0, 1.0]; // head_dim 4: pairs (0,2) and (1,3)
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        rope_tables(&[1], &[std::f32::consts::FRAC_PI_2, 0.0], &mut cos, &mut sin);
        rope_apply(&mut x, &cos, &sin);
        // pair (x0=1, x2=0) rotated by 90°: (0, 1); pair (x1=0, x3=1) by 0°: unchanged.
        assert!((x[0]).abs() < 1e-6 && (x[2] - 1.0).abs() < 1e-6);
        assert_eq!((x[1], x[3]), (0.0, 1.0));
    }

    #[test]
    fn rmsnorm_unit() {
        let mut y = [0f32; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut y);
        let r = (12.5f32).sqrt();
        assert!((y[0] - 3.0 / r).abs() < 1e-6 && (y[1] - 8.0 / r).abs() < 1e-6);
    }
}

/// Dot product of f16 weights (raw IEEE half bits) with f32 activations.
#[inline]
pub fn dot_f16(w: &[u16], x: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2_fma() && std::is_x86_feature_detected!("f16c") {
            // SAFETY: AVX2, FMA and F16C are present (checked above).
            return unsafe { dot_f16_avx2(w, x) };
        }
    }
    w.iter().zip(x).map(|(&h, &v)| half::f16::from_bits(h).to_f32() * v).sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot_f16_avx2(w: &[u16], x: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = w.len().min(x.len());
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    // SAFETY: every load reads 8 elements at `i + 8k` with `i + 32 <= n` (or `i + 8 <= n`
    // below), inside both slices; unaligned loads are used throughout.
    unsafe {
        while i + 32 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i + 8 * k).cast::<__m128i>()));
                *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(i + 8 * k)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            let wv = _mm256_cvtph_ps(_mm_loadu_si128(wp.add(i).cast::<__m128i>()));
            acc[0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xp.add(i)), acc[0]);
            i += 8;
        }
        let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let hi = _mm256_extractf128_ps(s, 1);
        let q = _mm_add_ps(_mm256_castps256_ps128(s), hi);
        let q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        let q = _mm_add_ss(q, _mm_shuffle_ps(q, q, 1));
        let mut total = _mm_cvtss_f32(q);
        while i < n {
            total += half::f16::from_bits(w[i]).to_f32() * x[i];
            i += 1;
        }
        total
    }
}

/// Converts f32 weights to f16 bits (round to nearest) for [`gemv_f16`].
pub fn to_f16_bits(w: &[f32]) -> Vec<u16> {
    w.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect()
}

/// `y[n, out] = x[n, inp] · w[out, inp]ᵀ` with f16 weights, for small `n` (decode): each
/// weight row is read once for all `n` tokens; rayon over weight rows.
pub fn gemv_f16(x: &[f32], n: usize, w: &[u16], out: usize, inp: usize, y: &mut [f32], scratch: &mut MatmulScratch) {
    let threads = rayon::current_num_threads().max(1);
    let chunk = (out / (threads * 8)).max(16);
    let yt = &mut scratch.yt;
    yt.resize(out * n, 0.0);
    yt.par_chunks_mut(chunk * n).enumerate().for_each(|(c, ys)| {
        let base = c * chunk;
        for (j, yrow) in ys.chunks_exact_mut(n).enumerate() {
            let r = base + j;
            let wr = &w[r * inp..(r + 1) * inp];
            for (t, yv) in yrow.iter_mut().enumerate() {
                *yv = dot_f16(wr, &x[t * inp..(t + 1) * inp]);
            }
        }
    });
    for t in 0..n {
        for (j, v) in y[t * out..(t + 1) * out].iter_mut().enumerate() {
            *v = yt[j * n + t];
        }
    }
}

#[cfg(test)]
mod f16_tests {
    use super::*;

    #[test]
    fn gemv_f16_matches_f32_on_representable_weights() {
        let (out, inp, n) = (40, 77, 3);
        let w: Vec<f32> = (0..out * inp).map(|i| ((i * 7 % 64) as f32 - 32.0) / 64.0).collect();
        let x: Vec<f32> = (0..n * inp).map(|i| ((i * 5 % 17) as f32 - 8.0) / 8.0).collect();
        let (mut a, mut b) = (vec![0f32; n * out], vec![0f32; n * out]);
        let mut s = MatmulScratch::default();
        matmul_t(&x, n, &w, out, inp, &mut a, &mut s);
        gemv_f16(&x, n, &to_f16_bits(&w), out, inp, &mut b, &mut s);
        for (p, q) in a.iter().zip(&b) {
            assert!((p - q).abs() < 1e-4, "{p} vs {q}");
        }
    }
}

#[cfg(test)]
mod bench {
    use super::*;

    #[test]
    #[ignore = "micro-benchmark"]
    fn gemm_gflops() {
        let (n, out, inp) = (512, 1536, 576);
        let x = vec![0.5f32; n * inp];
        let w = vec![0.25f32; out * inp];
        let mut y = vec![0f32; n * out];
        let mut s = MatmulScratch::default();
        let t = std::time::Instant::now();
        for _ in 0..5 {
            matmul_t(&x, n, &w, out, inp, &mut y, &mut s);
        }
        let dt = t.elapsed().as_secs_f64();
        eprintln!("gemm path: {:.1} GFLOPS", 5.0 * 2.0 * (n * out * inp) as f64 / dt / 1e9);
        let t = std::time::Instant::now();
        for c in 0..(n / 8) {
            let xs = &x[c * 8 * inp..(c + 1) * 8 * inp];
            let mut yy = vec![0f32; 8 * out];
            matmul_t(xs, 8, &w, out, inp, &mut yy, &mut s);
        }
        let dt = t.elapsed().as_secs_f64();
        eprintln!("gemv-8 path: {:.1} GFLOPS", 2.0 * (n * out * inp) as f64 / dt / 1e9);
    }
}
