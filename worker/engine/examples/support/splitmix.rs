//! splitmix64 (Steele, Lea & Flood 2014): the seeded generator the CUDA device checks share
//! (`#[path]`-included by `cuda_attn_decode` and `cuda_attn_prefill`).

use half::bf16;

/// splitmix64 state.
pub struct Rng(pub u64);

impl Rng {
    /// The next 64 random bits.
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (modulo bias is irrelevant here).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Fisher–Yates shuffle.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }

    /// Uniform in `[-a, a)` as bf16 bits.
    pub fn bf(&mut self, a: f32) -> u16 {
        let u = (self.next() >> 40) as f32 / 16_777_216.0;
        bf16::from_f32((2.0 * u - 1.0) * a).to_bits()
    }
}
