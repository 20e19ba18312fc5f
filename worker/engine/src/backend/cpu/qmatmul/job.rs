//! [`Job`]: one matmul task's pointers and strides, [`scalar_tail`], the f32 tail every
//! kernel (scalar, AVX2, AVX-512) adds in the same order after the whole blocks, and
//! [`reduce_lanes`], the fixed reduction of eight f32 lanes.

use crate::model::gguf::dequant::QK;

/// One matmul's pointers and strides (bytes for `w`, elements for `x`/`y`).
pub(super) struct Job {
    pub w: *const u8,
    pub w_stride: usize,
    pub nblocks: usize,
    pub tail: usize,
    pub x: *const f32,
    pub x_stride: usize,
    pub y: *mut f32,
    pub y_stride: usize,
}

/// Adds the f32 tail (`inp % 32` elements after the last whole block) in order.
#[inline(always)]
pub(super) fn scalar_tail(job: &Job, wrow: &[u8], x: &[f32], mut sum: f32) -> f32 {
    let start = job.nblocks * QK;
    for k in start..start + job.tail {
        let wv = f32::from_le_bytes([wrow[4 * k], wrow[4 * k + 1], wrow[4 * k + 2], wrow[4 * k + 3]]);
        sum = wv.mul_add(x[k], sum);
    }
    sum
}

/// The fixed lane reduction: `(l0+l4) + (l2+l6)` and `(l1+l5) + (l3+l7)`, then their sum
/// (ggml's `hsum_float_8` order as well).
#[inline(always)]
pub(super) fn reduce_lanes(l: &[f32; 8]) -> f32 {
    let q = [l[0] + l[4], l[1] + l[5], l[2] + l[6], l[3] + l[7]];
    let r = [q[0] + q[2], q[1] + q[3]];
    r[0] + r[1]
}
