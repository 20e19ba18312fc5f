//! CPU kernels in f32 besides the matrix products (those are in [`super::qmatmul`]): dot
//! product, RMSNorm, RoPE (Hugging Face rotate-half layout), SiLU·mul and GELU(tanh)·mul.

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

/// [`rms_norm`] of one row in place (a head vector, or a layer output).
pub fn rms_norm_in_place(x: &mut [f32], g: &[f32], eps: f32) {
    let ss = dot(x, x) / g.len() as f32;
    let inv = 1.0 / (ss + eps).sqrt();
    for (xv, gv) in x.iter_mut().zip(g) {
        *xv = gv * (*xv * inv);
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

/// `act[t, i] = gelu_tanh(gu[t, i]) · gu[t, I + i]` (GeGLU; PyTorch's
/// `gelu(x, approximate="tanh")`: `0.5·x·(1 + tanh(sqrt(2/π)·(x + 0.044715·x³)))`).
pub fn gelu_tanh_mul(gu: &[f32], inter: usize, act: &mut [f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for (g, a) in gu.chunks_exact(2 * inter).zip(act.chunks_exact_mut(inter)) {
        let (gate, up) = g.split_at(inter);
        for i in 0..inter {
            let x = gate[i];
            let inner = SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x);
            a[i] = 0.5 * x * (1.0 + inner.tanh()) * up[i];
        }
    }
}

/// ggml's GELU table: for every f16 bit pattern `b`, the f16 of
/// `0.5·x·(1 + tanh(√(2/π)·x·(1 + 0.044715·x²)))` at `x = f16(b)`, as f32.
fn gelu_f16_table() -> &'static [f32] {
    static TABLE: std::sync::OnceLock<Vec<f32>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        (0..=u16::MAX)
            .map(|b| {
                let x = half::f16::from_bits(b).to_f32();
                let g = 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + 0.044_715 * x * x)).tanh());
                half::f16::from_f32(g).to_f32()
            })
            .collect()
    })
}

/// [`gelu_tanh_mul`] as ggml's CPU backend computes it (`ggml_vec_geglu_f32`): the GELU of
/// the gate looked up in an f16 table at the gate rounded to f16 (0 below -10, the gate
/// itself above 10), times `up` in f32.
pub fn gelu_tanh_mul_f16_table(gu: &[f32], inter: usize, act: &mut [f32]) {
    let table = gelu_f16_table();
    for (g, a) in gu.chunks_exact(2 * inter).zip(act.chunks_exact_mut(inter)) {
        let (gate, up) = g.split_at(inter);
        for ((a, &x), &u) in a.iter_mut().zip(gate).zip(up) {
            *a = if x <= -10.0 {
                0.0
            } else if x >= 10.0 {
                x * u
            } else {
                table[usize::from(half::f16::from_f32(x).to_bits())] * u
            };
        }
    }
}

/// [`rms_norm`] as ggml computes it: the squares (f32) summed in f64, the mean and
/// `1/√(mean + eps)` in f32, then `x·scale` and the gain.
pub fn rms_norm_f64_sum(x: &[f32], g: &[f32], eps: f32, y: &mut [f32]) {
    let h = g.len();
    for (xr, yr) in x.chunks_exact(h).zip(y.chunks_exact_mut(h)) {
        yr.copy_from_slice(xr);
        rms_norm_f64_sum_in_place(yr, g, eps);
    }
}

/// [`rms_norm_f64_sum`] of one row in place.
pub fn rms_norm_f64_sum_in_place(x: &mut [f32], g: &[f32], eps: f32) {
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / g.len() as f64) as f32;
    let scale = 1.0 / (mean + eps).sqrt();
    for (xv, gv) in x.iter_mut().zip(g) {
        *xv = (*xv * scale) * gv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
