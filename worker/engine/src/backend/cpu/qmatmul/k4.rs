//! The 6-bit scales and minimums of a Q4_K/Q5_K super-block, as integers (ggml's
//! `get_scale_min_k4`), for the 8-bit-activation kernels.

/// Scales and minimums of the eight groups of the super-block starting at `p` (its
/// bytes 4..16).
pub(super) fn k4_scales_mins(p: &[u8]) -> ([u8; 8], [u8; 8]) {
    let q = |i: usize| p[4 + i];
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for g in 0..8 {
        (sc[g], m[g]) = if g < 4 {
            (q(g) & 63, q(g + 4) & 63)
        } else {
            ((q(g + 4) & 0xF) | ((q(g - 4) >> 6) << 4), (q(g + 4) >> 4) | ((q(g) >> 6) << 4))
        };
    }
    (sc, m)
}
