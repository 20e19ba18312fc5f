//! Device check and benchmark of the tensor-core decode attention
//! (`engine::backend::cuda::attn_decode`) against the backend's reference paged-attention kernel
//! (`paged_attention_*` + `attn_combine` of `kernels/llama.cu`, launched as `cuda.rs` does).
//!
//! `cargo run --release -p prism-engine --features cuda --example cuda_attn_decode -- OUT.json [HEAD_DIM]`
//! (with HEAD_DIM: only the correctness cases of that head_dim, no graph or timing)
//!
//! Correctness (bound: max |new − reference| ≤ 2e-2 on bf16 outputs, no NaN, every output
//! written): random bf16 Q (inside fused QKV rows), random K/V caches, shuffled block tables,
//! mixed contexts (1, 2, 63 … 4,096, 16,384), head_dim 64/128 with 1/2/4/8 query heads per KV
//! head and 256 with 1/2/4,
//! block sizes 1/8/16/32, batches 1…256, several split caps, cache slots past each context
//! poisoned with NaN, a grid smaller than the contexts need; bitwise determinism; batch
//! invariance with the constant split cap (a token alone = the same token in a batch of 256);
//! one CUDA-graph capture replayed with new metadata at the same addresses (twice, to check that
//! the split counters are reset).
//!
//! Timing at Llama-3-8B heads (32 q, 8 KV, head_dim 128, block 16): batch 1 × ctx 128 / 1,024 /
//! 4,096, batch 8 / 32 / 128 / 256 × 1,024. `cold`: median of 30 single launches between CUDA
//! events, L2 flushed (256 MiB memset) before each, as in a real step where weights stream
//! through L2 between layers; `warm`: mean of 30 back-to-back launches. Effective TB/s = KV bytes
//! read (contexts · kv_heads · head_dim · 2 B · K and V) / time. Exit status 1 on any FAIL.
//!
//! `-- OUT.json --fp8` checks and times the FP8-KV build instead (`DecodeAttention::with_kv`):
//! random e4m3 caches (|x| ≤ 1) whose values the bf16 caches hold too; correctness of the FP8-KV
//! kernel against the reference kernel on those values (same bound, shapes, block sizes, caps,
//! a grid smaller than the contexts, NaN-poisoned tails), bitwise determinism and batch
//! invariance; then at Llama-3-8B heads both kernels timed on the same values for batch 1 ×
//! ctx 128 / 1,024 / 4,096, batch 8 / 32 / 64 / 128 / 256 × 1,024 and 64 × 4,096, every cap,
//! with the FP8-KV time as a fraction of the bf16 kernel's at the same cap (and at each one's
//! occupancy cap, the engine's choice).

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    check::main()
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_attn_decode needs --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
#[path = "support/cold_timing.rs"]
mod cold_timing;
#[cfg(feature = "cuda")]
#[path = "support/splitmix.rs"]
#[allow(dead_code)]
mod splitmix;

#[cfg(feature = "cuda")]
mod check {
    use std::time::Instant;

    use anyhow::{Context, Result};
    use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
    use cudarc::driver::{CudaEvent, LaunchConfig, PushKernelArg};
    use prism_engine::backend::cuda::attn_decode::{
        AttnShape, DecodeArgs, DecodeAttention, INVARIANT_SPLIT_CAP, grid_splits, splits_for,
    };
    use prism_engine::backend::cuda::device::{DevBuf, Gpu};
    use prism_engine::model::fp8::e4m3_to_f32;
    use rayon::prelude::*;
    use serde_json::{Value, json};

    /// Largest accepted |new − reference| on a bf16 output.
    const TOL: f32 = 2e-2;
    /// `ATTN_CHUNK` of `kernels/llama.cu` (the reference kernel's context chunk).
    const REF_CHUNK: usize = 128;
    /// Written into outputs before each launch: an unwritten output fails the comparison.
    const SENTINEL: f32 = 1000.0;
    const MAX_TOKENS: usize = 256;

    use crate::cold_timing::time_cold;
    use crate::splitmix::Rng;

    fn bf16_to_f32(b: u16) -> f32 {
        f32::from_bits(u32::from(b) << 16)
    }

    /// One problem on the device: `n` tokens, fused QKV rows with random Q, random K/V caches of
    /// `num_blocks` blocks, metadata (pos | tok_bt | bts) at fixed addresses.
    struct Problem {
        shape: AttnShape,
        n: usize,
        bs: usize,
        num_blocks: usize,
        ctxs: Vec<usize>,
        qkv: DevBuf,
        kc: DevBuf,
        vc: DevBuf,
        meta: DevBuf,
        /// Reference output and partials (sized for contexts up to `ctx_cap`).
        out_ref: DevBuf,
        part_ref: DevBuf,
        out: DevBuf,
    }

    impl Problem {
        /// Allocates and fills a problem whose block pool holds `ctxs` (or `ctx_cap` per token
        /// if larger, so later metadata up to `ctx_cap` fits), then uploads `ctxs`' metadata.
        fn new(
            gpu: &Gpu,
            shape: AttnShape,
            ctxs: &[usize],
            bs: usize,
            q_scale: f32,
            ctx_cap: usize,
            rng: &mut Rng,
        ) -> Result<Self> {
            let n = ctxs.len();
            let (qh, kvh, hd) = (shape.q_heads, shape.kv_heads, shape.head_dim);
            let need: usize = ctxs.iter().map(|c| c.div_ceil(bs)).sum();
            let num_blocks = need.max(n * ctx_cap.div_ceil(bs)) + 3;
            let qkv_dim = (qh + 2 * kvh) * hd;
            let cache = num_blocks * bs * kvh * hd;
            let ctx_cap = ctx_cap.max(ctxs.iter().copied().max().unwrap_or(1));
            let chunks = ctx_cap.div_ceil(REF_CHUNK);
            let p = Self {
                shape,
                n,
                bs,
                num_blocks,
                ctxs: Vec::new(),
                qkv: DevBuf::zeroed(gpu, n * qkv_dim * 2)?,
                kc: DevBuf::zeroed(gpu, cache * 2)?,
                vc: DevBuf::zeroed(gpu, cache * 2)?,
                meta: DevBuf::zeroed(gpu, (2 * n + num_blocks) * 4)?,
                out_ref: DevBuf::zeroed(gpu, n * qh * hd * 2)?,
                part_ref: DevBuf::zeroed(gpu, n * qh * chunks * (hd + 2) * 4)?,
                out: DevBuf::zeroed(gpu, n * qh * hd * 2)?,
            };
            let seed = rng.next() as u32;
            gpu.fill_uniform(p.qkv.ptr, n * qkv_dim, seed, q_scale)?;
            gpu.fill_uniform(p.kc.ptr, cache, seed ^ 0x1111, 1.0)?;
            gpu.fill_uniform(p.vc.ptr, cache, seed ^ 0x2222, 1.0)?;
            let mut p = p;
            p.set_meta(gpu, ctxs, rng)?;
            Ok(p)
        }

        fn pos(&self) -> u64 {
            self.meta.ptr
        }
        fn tok_bt(&self) -> u64 {
            self.meta.ptr + (self.n * 4) as u64
        }
        fn bts(&self) -> u64 {
            self.meta.ptr + (2 * self.n * 4) as u64
        }
        fn max_ctx(&self) -> usize {
            self.ctxs.iter().copied().max().unwrap_or(1)
        }
        fn kv_bytes(&self) -> f64 {
            let per_pos = (self.shape.kv_heads * self.shape.head_dim * 2 * 2) as f64;
            self.ctxs.iter().map(|&c| c as f64 * per_pos).sum()
        }
        fn qkv_dim(&self) -> usize {
            (self.shape.q_heads + 2 * self.shape.kv_heads) * self.shape.head_dim
        }
        fn out_len(&self) -> usize {
            self.n * self.shape.q_heads * self.shape.head_dim
        }

        /// New contexts and freshly shuffled block tables at the same addresses.
        fn set_meta(&mut self, gpu: &Gpu, ctxs: &[usize], rng: &mut Rng) -> Result<()> {
            anyhow::ensure!(ctxs.len() == self.n, "token count changed");
            let mut perm: Vec<u32> = (0..self.num_blocks as u32).collect();
            rng.shuffle(&mut perm);
            let mut m = Vec::with_capacity(2 * self.n + self.num_blocks);
            m.extend(ctxs.iter().map(|&c| (c - 1) as u32));
            let mut off = 0usize;
            for &c in ctxs {
                m.push(off as u32);
                off += c.div_ceil(self.bs);
            }
            anyhow::ensure!(off <= self.num_blocks, "block pool too small");
            m.extend_from_slice(&perm[..off]);
            gpu.upload(&self.meta, 0, &m)?;
            self.ctxs = ctxs.to_vec();
            Ok(())
        }

        /// Writes NaN into the K and V rows of every slot past each token's context in its last
        /// block (both kernels must never read them).
        fn poison_tails(&self, gpu: &Gpu) -> Result<()> {
            let mut m = vec![0u32; 2 * self.n + self.num_blocks];
            gpu.download(&mut m, self.meta.ptr)?;
            let kvd = self.shape.kv_heads * self.shape.head_dim;
            let nan = vec![0x7FC0u16; kvd];
            for (i, &c) in self.ctxs.iter().enumerate() {
                let bt = &m[2 * self.n + m[self.n + i] as usize..];
                for p in c..c.div_ceil(self.bs) * self.bs {
                    let slot = bt[p / self.bs] as usize * self.bs + p % self.bs;
                    gpu.upload(&self.kc, slot * kvd * 2, &nan)?;
                    gpu.upload(&self.vc, slot * kvd * 2, &nan)?;
                }
            }
            Ok(())
        }

        /// The reference: `paged_attention_hd{hd}_g{G}` over 128-position chunks + `attn_combine`,
        /// exactly as `cuda.rs` launches them.
        fn run_ref(&self, gpu: &Gpu) -> Result<()> {
            let s = self.shape;
            let g = s.q_heads / s.kv_heads;
            let chunks = self.max_ctx().div_ceil(REF_CHUNK);
            let f = gpu.k.attention_for(s.head_dim, g).context("no reference kernel for this shape")?;
            let (qh, kvh, hd, bs) = (s.q_heads as i32, s.kv_heads as i32, s.head_dim as i32, self.bs as i32);
            let scale = 1.0 / (s.head_dim as f32).sqrt();
            // t0: first token of the launch; window 0: the whole context (no sliding window).
            let (t0, chunks_i, window) = (0i32, chunks as i32, 0i32);
            let (pos, tok_bt, bts) = (self.pos(), self.tok_bt(), self.bts());
            let mut b = gpu.stream.launch_builder(f);
            b.arg(&self.out_ref.ptr).arg(&self.part_ref.ptr).arg(&self.qkv.ptr).arg(&self.kc.ptr).arg(&self.vc.ptr);
            b.arg(&pos).arg(&tok_bt).arg(&bts).arg(&qh).arg(&kvh).arg(&bs).arg(&scale).arg(&t0).arg(&window);
            let cfg = LaunchConfig {
                grid_dim: (self.n as u32, s.kv_heads as u32, chunks as u32),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: buffers sized in `new` for these shapes; block tables cover every context.
            unsafe { b.launch(cfg) }.context("paged_attention")?;
            if chunks > 1 {
                let mut b = gpu.stream.launch_builder(&gpu.k.attn_combine);
                b.arg(&self.out_ref.ptr).arg(&self.part_ref.ptr).arg(&pos).arg(&qh).arg(&hd).arg(&chunks_i).arg(&t0);
                let cfg = LaunchConfig {
                    grid_dim: (self.n as u32, s.q_heads as u32, 1),
                    block_dim: (s.head_dim as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: as above.
                unsafe { b.launch(cfg) }.context("attn_combine")?;
            }
            Ok(())
        }

        fn args(&self, cap: usize, max_ctx: usize) -> DecodeArgs {
            DecodeArgs {
                n_tokens: self.n,
                max_ctx,
                split_cap: cap,
                out: self.out.ptr,
                qkv: self.qkv.ptr,
                k_cache: self.kc.ptr,
                v_cache: self.vc.ptr,
                pos: self.pos(),
                tok_bt: self.tok_bt(),
                bts: self.bts(),
                block_size: self.bs,
                scale: 1.0 / (self.shape.head_dim as f32).sqrt(),
            }
        }

        /// Sentinel into `out`, then the new kernel.
        fn run_new(&self, gpu: &Gpu, da: &DecodeAttention, cap: usize, max_ctx: usize) -> Result<()> {
            gpu.fill_const(self.out.ptr, self.out_len(), SENTINEL)?;
            da.launch(gpu, &self.args(cap, max_ctx))?;
            Ok(())
        }

        fn download(&self, gpu: &Gpu, ptr: u64) -> Result<Vec<u16>> {
            let mut v = vec![0u16; self.out_len()];
            gpu.download(&mut v, ptr)?;
            Ok(v)
        }

        /// Random e4m3 K and V caches (|x| ≤ 1, no NaN) of the same shape, returned on the
        /// device; the bf16 caches are overwritten with the same values (exact), so the
        /// reference and bf16 kernels read what the FP8-KV kernel reads. With `poison`, the
        /// slots past each context in its last block hold NaN in both.
        fn e4m3_caches(&self, gpu: &Gpu, seed: u64, poison: bool) -> Result<Fp8Cache> {
            let n = self.num_blocks * self.bs * self.shape.kv_heads * self.shape.head_dim;
            let widen: Vec<u16> = (0..=255u8).map(|c| half::bf16::from_f32(e4m3_to_f32(c)).to_bits()).collect();
            let mut out = Vec::new();
            for (which, wide_buf) in [(0u64, &self.kc), (1, &self.vc)] {
                let mut codes = vec![0u8; n];
                codes.par_chunks_mut(1 << 16).enumerate().for_each(|(i, c)| {
                    let mut r = Rng(seed ^ (which << 40) ^ ((i as u64) << 1));
                    for b in c.iter_mut() {
                        let x = r.next();
                        // Sign, and a magnitude code ≤ 0x38 (1.0).
                        *b = ((x >> 8) as u8 & 0x80) | (x % 0x39) as u8;
                    }
                });
                let wide: Vec<u16> = codes.par_iter().map(|&c| widen[usize::from(c)]).collect();
                gpu.upload(wide_buf, 0, &wide)?;
                let d = DevBuf::zeroed(gpu, n)?;
                gpu.upload(&d, 0, &codes)?;
                out.push(d);
            }
            if poison {
                self.poison_tails(gpu)?;
                let mut m = vec![0u32; 2 * self.n + self.num_blocks];
                gpu.download(&mut m, self.meta.ptr)?;
                let kvd = self.shape.kv_heads * self.shape.head_dim;
                let nan = vec![0x7Fu8; kvd];
                for (i, &c) in self.ctxs.iter().enumerate() {
                    let bt = &m[2 * self.n + m[self.n + i] as usize..];
                    for p in c..c.div_ceil(self.bs) * self.bs {
                        let slot = bt[p / self.bs] as usize * self.bs + p % self.bs;
                        gpu.upload(&out[0], slot * kvd, &nan)?;
                        gpu.upload(&out[1], slot * kvd, &nan)?;
                    }
                }
            }
            let v = out.pop().context("v cache")?;
            let k = out.pop().context("k cache")?;
            Ok(Fp8Cache { k, v })
        }

        fn args8(&self, c: &Fp8Cache, cap: usize, max_ctx: usize) -> DecodeArgs {
            DecodeArgs { k_cache: c.k.ptr, v_cache: c.v.ptr, ..self.args(cap, max_ctx) }
        }
    }

    /// e4m3 K and V caches of a [`Problem`].
    struct Fp8Cache {
        k: DevBuf,
        v: DevBuf,
    }

    /// (max |a − b|, max |b|, non-finite values in a).
    fn compare(a: &[u16], b: &[u16]) -> (f32, f32, usize) {
        let (mut d, mut r, mut bad) = (0f32, 0f32, 0usize);
        for (&x, &y) in a.iter().zip(b) {
            let (x, y) = (bf16_to_f32(x), bf16_to_f32(y));
            if !x.is_finite() {
                bad += 1;
                continue;
            }
            d = d.max((x - y).abs());
            r = r.max(y.abs());
        }
        (d, r, bad)
    }

    fn verdict(ok: bool) -> &'static str {
        if ok { "PASS" } else { "FAIL" }
    }

    struct Case {
        name: &'static str,
        ctxs: Vec<usize>,
        bs: usize,
        q_scale: f32,
        poison: bool,
        caps: Vec<usize>,
        /// `max_ctx` passed to the launch (`None`: the largest context).
        max_ctx: Option<usize>,
    }

    /// Runs one case against the reference for each cap; returns (pass, JSON).
    fn run_case(gpu: &Gpu, da: &DecodeAttention, c: &Case, rng: &mut Rng) -> Result<(bool, Value)> {
        let s = da.shape();
        let p = Problem::new(gpu, s, &c.ctxs, c.bs, c.q_scale, 1, rng)?;
        if c.poison {
            p.poison_tails(gpu)?;
        }
        p.run_ref(gpu)?;
        let want = p.download(gpu, p.out_ref.ptr)?;
        let (_, _, ref_bad) = compare(&want, &want);
        let mut ok_all = ref_bad == 0;
        let max_ctx = c.max_ctx.unwrap_or(p.max_ctx());
        let mut rows = Vec::new();
        for &cap in &c.caps {
            p.run_new(gpu, da, cap, max_ctx)?;
            let got = p.download(gpu, p.out.ptr)?;
            let (d, r, bad) = compare(&got, &want);
            // Determinism: a second launch is bitwise equal.
            p.run_new(gpu, da, cap, max_ctx)?;
            let again = p.download(gpu, p.out.ptr)?;
            let det = again == got;
            let ok = bad == 0 && d <= TOL && det && r > 0.0;
            ok_all &= ok;
            println!(
                "{} {:<22} hd={} G={} kvh={} n={} bs={} cap={cap:>2} grid_splits={:>2} max|diff|={d:.2e} max|ref|={r:.3} nonfinite={bad} deterministic={det}",
                verdict(ok),
                c.name,
                s.head_dim,
                s.q_heads / s.kv_heads,
                s.kv_heads,
                p.n,
                c.bs,
                grid_splits(max_ctx, cap),
            );
            rows.push(
                json!({"cap": cap, "grid_splits": grid_splits(max_ctx, cap), "max_abs_diff": d, "max_abs_ref": r,
                             "nonfinite": bad, "deterministic": det, "pass": ok}),
            );
        }
        if ref_bad > 0 {
            println!("FAIL {:<22} reference produced {ref_bad} non-finite values", c.name);
        }
        let j = json!({"case": c.name, "head_dim": s.head_dim, "group": s.q_heads / s.kv_heads, "kv_heads": s.kv_heads,
                       "n": p.n, "block_size": c.bs, "q_scale": c.q_scale, "poison": c.poison, "max_ctx_arg": max_ctx,
                       "ctx_min": c.ctxs.iter().min(), "ctx_max": c.ctxs.iter().max(), "runs": rows, "pass": ok_all});
        Ok((ok_all, j))
    }

    const MIXED: [usize; 14] = [1, 2, 63, 64, 65, 127, 128, 129, 1000, 4096, 17, 300, 1025, 2049];

    fn mixed(n: usize) -> Vec<usize> {
        (0..n).map(|i| MIXED[i % MIXED.len()]).collect()
    }

    /// Correctness over shapes (those of head_dim `only_hd` when given), contexts, block sizes
    /// and caps; batch invariance.
    fn correctness(gpu: &Gpu, rng: &mut Rng, out: &mut Vec<Value>, only_hd: Option<usize>) -> Result<bool> {
        let mut pass = true;
        // (head_dim, group, kv_heads); head_dim 256 as Gemma 3 270M/1B (4/1) and 4B (8/4).
        let shapes = [
            (128, 4, 8),
            (128, 8, 4),
            (128, 1, 8),
            (128, 2, 4),
            (64, 1, 4),
            (64, 4, 2),
            (64, 8, 2),
            (256, 4, 1),
            (256, 2, 4),
            (256, 1, 2),
        ];
        for (hd, g, kvh) in shapes.into_iter().filter(|s| only_hd.is_none_or(|h| h == s.0)) {
            let shape = AttnShape { q_heads: g * kvh, kv_heads: kvh, head_dim: hd };
            let da = DecodeAttention::new(gpu, shape, MAX_TOKENS)?;
            let occ = |n: usize| da.occupancy_split_cap(n);
            let mut cases = vec![Case {
                name: "mixed",
                ctxs: mixed(14),
                bs: 16,
                q_scale: 4.0,
                poison: true,
                caps: vec![INVARIANT_SPLIT_CAP, 1, 3, occ(14)],
                max_ctx: None,
            }];
            if (hd, g, kvh) == (256, 4, 1) {
                for ctx in [1usize, 600, 4096] {
                    cases.push(Case {
                        name: "b1",
                        ctxs: vec![ctx],
                        bs: 16,
                        q_scale: 4.0,
                        poison: true,
                        caps: vec![INVARIANT_SPLIT_CAP, occ(1), 4],
                        max_ctx: None,
                    });
                }
            }
            if (hd, g, kvh) == (128, 4, 8) {
                let mut rnd: Vec<usize> = (0..MAX_TOKENS).map(|_| 1 + rng.below(4096)).collect();
                rnd[3] = 1;
                rnd[4] = 4096;
                cases.push(Case {
                    name: "b256-random",
                    ctxs: rnd,
                    bs: 16,
                    q_scale: 4.0,
                    poison: false,
                    caps: vec![INVARIANT_SPLIT_CAP, occ(256), 2],
                    max_ctx: None,
                });
                for ctx in [1usize, 128, 4096, 5000, 16384] {
                    cases.push(Case {
                        name: "b1",
                        ctxs: vec![ctx],
                        bs: 16,
                        q_scale: 4.0,
                        poison: true,
                        caps: vec![INVARIANT_SPLIT_CAP, occ(1), 4],
                        max_ctx: None,
                    });
                }
                for bs in [1usize, 8, 32] {
                    cases.push(Case {
                        name: "block-size",
                        ctxs: mixed(14),
                        bs,
                        q_scale: 4.0,
                        poison: bs != 1,
                        caps: vec![INVARIANT_SPLIT_CAP, 2],
                        max_ctx: None,
                    });
                }
                cases.push(Case {
                    name: "peaky-softmax",
                    ctxs: mixed(28),
                    bs: 16,
                    q_scale: 16.0,
                    poison: true,
                    caps: vec![INVARIANT_SPLIT_CAP, 1],
                    max_ctx: None,
                });
                cases.push(Case {
                    name: "grid-smaller-than-ctx",
                    ctxs: mixed(14),
                    bs: 16,
                    q_scale: 4.0,
                    poison: false,
                    caps: vec![INVARIANT_SPLIT_CAP, 5],
                    max_ctx: Some(64),
                });
                cases.push(Case {
                    name: "flat-softmax",
                    ctxs: mixed(14),
                    bs: 16,
                    q_scale: 0.05,
                    poison: false,
                    caps: vec![INVARIANT_SPLIT_CAP],
                    max_ctx: None,
                });
            }
            for c in &cases {
                let (ok, j) = run_case(gpu, &da, c, rng)?;
                pass &= ok;
                out.push(j);
                if c.name == "b256-random" {
                    let (ok, j) = invariance(gpu, &da, &c.ctxs, rng)?;
                    pass &= ok;
                    out.push(j);
                }
            }
        }
        Ok(pass)
    }

    /// Batch invariance with the constant cap: tokens launched alone (pointers offset into the
    /// same QKV rows and metadata) equal their rows of the full launch bitwise.
    fn invariance(gpu: &Gpu, da: &DecodeAttention, ctxs: &[usize], rng: &mut Rng) -> Result<(bool, Value)> {
        let s = da.shape();
        let p = Problem::new(gpu, s, ctxs, 16, 4.0, 1, rng)?;
        p.run_new(gpu, da, INVARIANT_SPLIT_CAP, p.max_ctx())?;
        let full = p.download(gpu, p.out.ptr)?;
        let row = s.q_heads * s.head_dim;
        let one = DevBuf::zeroed(gpu, row * 2)?;
        let mut ok = true;
        let mut toks = Vec::new();
        for i in [0usize, 3, 4, 77, p.n - 1] {
            let mut a = p.args(INVARIANT_SPLIT_CAP, p.ctxs[i]);
            a.n_tokens = 1;
            a.out = one.ptr;
            a.qkv = p.qkv.ptr + (i * p.qkv_dim() * 2) as u64;
            a.pos = p.pos() + (i * 4) as u64;
            a.tok_bt = p.tok_bt() + (i * 4) as u64;
            gpu.fill_const(one.ptr, row, SENTINEL)?;
            da.launch(gpu, &a)?;
            let mut v = vec![0u16; row];
            gpu.download(&mut v, one.ptr)?;
            let same = v[..] == full[i * row..(i + 1) * row];
            ok &= same;
            toks.push(json!({"token": i, "ctx": p.ctxs[i], "splits": splits_for(p.ctxs[i], INVARIANT_SPLIT_CAP), "bitwise_equal": same}));
        }
        println!(
            "{} batch invariance (cap {INVARIANT_SPLIT_CAP}): 5 tokens alone vs in a batch of {}: bitwise equal = {ok}",
            verdict(ok),
            p.n
        );
        Ok((ok, json!({"case": "batch-invariance", "n": p.n, "tokens": toks, "pass": ok})))
    }

    /// One capture of the launch, replayed with new contexts and block tables at the same
    /// addresses (twice, to check that the split counters are reset).
    fn graph(gpu: &Gpu, rng: &mut Rng) -> Result<(bool, Value)> {
        let shape = AttnShape { q_heads: 32, kv_heads: 8, head_dim: 128 };
        let da = DecodeAttention::new(gpu, shape, MAX_TOKENS)?;
        let (n, bucket) = (64usize, 2048usize);
        let ctx_a: Vec<usize> = (0..n).map(|i| if i == 0 { 1 } else { 1 + rng.below(bucket) }).collect();
        let ctx_b: Vec<usize> = (0..n).map(|i| if i == 1 { bucket } else { 1 + rng.below(bucket) }).collect();
        let mut p = Problem::new(gpu, shape, &ctx_a, 16, 4.0, bucket, rng)?;
        let mut pass = true;
        let mut rows = Vec::new();
        for cap in [INVARIANT_SPLIT_CAP, da.occupancy_split_cap(n)] {
            p.set_meta(gpu, &ctx_a, rng)?;
            gpu.fill_const(p.out.ptr, p.out_len(), SENTINEL)?;
            gpu.sync()?;
            gpu.stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).context("begin_capture")?;
            let res = da.launch(gpu, &p.args(cap, bucket));
            let g = gpu
                .stream
                .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)
                .context("end_capture")?;
            res?;
            let g = g.context("empty capture")?;
            // The second B replay gets freshly shuffled block tables too; a stale split counter
            // would leave outputs unwritten or merged early.
            for (label, ctxs) in [("A", &ctx_a), ("B", &ctx_b), ("B again", &ctx_b)] {
                p.set_meta(gpu, ctxs, rng)?;
                p.run_ref(gpu)?;
                let want = p.download(gpu, p.out_ref.ptr)?;
                gpu.fill_const(p.out.ptr, p.out_len(), SENTINEL)?;
                g.launch().context("graph launch")?;
                let got = p.download(gpu, p.out.ptr)?;
                let (d, r, bad) = compare(&got, &want);
                let ok = bad == 0 && d <= TOL && r > 0.0;
                pass &= ok;
                println!(
                    "{} graph replay cap={cap:>2} metadata {label:<7} n={n} bucket={bucket}: max|diff|={d:.2e} nonfinite={bad}",
                    verdict(ok)
                );
                rows.push(json!({"cap": cap, "metadata": label, "max_abs_diff": d, "nonfinite": bad, "pass": ok}));
            }
        }
        Ok((pass, json!({"n": n, "bucket": bucket, "replays": rows, "pass": pass})))
    }

    fn events(gpu: &Gpu, k: usize) -> Result<Vec<CudaEvent>> {
        (0..k).map(|_| gpu.ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).context("event")).collect()
    }

    /// Mean (µs) of `reps` back-to-back launches of `f`.
    fn time_warm(gpu: &Gpu, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
        let ev = events(gpu, 2)?;
        for _ in 0..3 {
            f()?;
        }
        ev[0].record(&gpu.stream)?;
        for _ in 0..reps {
            f()?;
        }
        ev[1].record(&gpu.stream)?;
        gpu.sync()?;
        Ok(f64::from(ev[0].elapsed_ms(&ev[1])?) * 1e3 / reps as f64)
    }

    /// Timings at Llama-3-8B heads.
    fn perf(gpu: &Gpu, rng: &mut Rng) -> Result<(bool, Vec<Value>)> {
        let shape = AttnShape { q_heads: 32, kv_heads: 8, head_dim: 128 };
        let da = DecodeAttention::new(gpu, shape, MAX_TOKENS)?;
        let flush = DevBuf::zeroed(gpu, 256 << 20)?;
        let reps = 30;
        let mut pass = true;
        let mut out = Vec::new();
        for (b, ctx) in [(1usize, 128usize), (1, 1024), (1, 4096), (8, 1024), (32, 1024), (128, 1024), (256, 1024)] {
            let p = Problem::new(gpu, shape, &vec![ctx; b], 16, 4.0, 1, rng)?;
            let kv = p.kv_bytes();
            let tbs = |us: f64| kv / (us * 1e-6) / 1e12;
            p.run_ref(gpu)?;
            let want = p.download(gpu, p.out_ref.ptr)?;
            let (ref_cold, ref_min) = time_cold(gpu, &flush, reps, &mut || p.run_ref(gpu))?;
            let ref_warm = time_warm(gpu, reps, &mut || p.run_ref(gpu))?;
            println!(
                "perf b={b:<3} ctx={ctx:<4} KV {:.1} MB | reference: cold {ref_cold:7.1} us ({:.2} TB/s, min {ref_min:.1}), warm {ref_warm:7.1} us",
                kv / 1e6,
                tbs(ref_cold)
            );
            let occ = da.occupancy_split_cap(b);
            let mut caps = vec![1usize, 2, 4, 8, 16];
            if !caps.contains(&occ) {
                caps.push(occ);
            }
            let mut rows = Vec::new();
            for cap in caps {
                let a = p.args(cap, ctx);
                da.launch(gpu, &a)?;
                let got = p.download(gpu, p.out.ptr)?;
                let (d, _, bad) = compare(&got, &want);
                let ok = bad == 0 && d <= TOL;
                pass &= ok;
                let (cold, min) = time_cold(gpu, &flush, reps, &mut || Ok(da.launch(gpu, &a)?))?;
                let warm = time_warm(gpu, reps, &mut || Ok(da.launch(gpu, &a)?))?;
                // After ~70 launches the split counters must still be consistent.
                p.run_new(gpu, &da, cap, ctx)?;
                let (d2, _, bad2) = compare(&p.download(gpu, p.out.ptr)?, &want);
                let ok = ok && bad2 == 0 && d2 <= TOL;
                pass &= ok;
                let tag = if cap == occ {
                    " (occupancy cap)"
                } else if cap == INVARIANT_SPLIT_CAP {
                    " (invariant cap)"
                } else {
                    ""
                };
                println!(
                    "  {} cap={cap:>2} splits={:>2} blocks={:>6}: cold {cold:7.1} us ({:.2} TB/s, min {min:.1}), warm {warm:7.1} us, x{:.2} vs reference, max|diff| {d:.1e}{tag}",
                    verdict(ok),
                    splits_for(ctx, cap),
                    grid_splits(ctx, cap) * 8 * b,
                    tbs(cold),
                    ref_cold / cold
                );
                rows.push(json!({"cap": cap, "splits": splits_for(ctx, cap), "cold_us": cold, "cold_min_us": min, "warm_us": warm,
                                 "cold_tb_s": tbs(cold), "speedup_vs_reference": ref_cold / cold, "occupancy_cap": cap == occ,
                                 "max_abs_diff": d, "pass": ok}));
            }
            out.push(json!({"batch": b, "ctx": ctx, "kv_bytes": kv, "reference": {"cold_us": ref_cold, "cold_min_us": ref_min,
                            "warm_us": ref_warm, "cold_tb_s": tbs(ref_cold)}, "new": rows}));
        }
        Ok((pass, out))
    }

    include!("support/attn_decode_fp8.rs");

    pub fn main() -> Result<()> {
        let path = std::env::args().nth(1).unwrap_or_else(|| "cuda_attn_decode.json".into());
        if std::env::args().any(|a| a == "--fp8") {
            return main_fp8(&path);
        }
        // A second argument restricts the run to the correctness cases of that head_dim.
        let only_hd = std::env::args().nth(2).map(|a| a.parse::<usize>()).transpose().context("HEAD_DIM")?;
        let t0 = Instant::now();
        let gpu = Gpu::new(0)?;
        println!("device {} ({}), tolerance {TOL}", gpu.name, gpu.arch);
        let mut rng = Rng(0x5EED_A77E);
        let mut cases = Vec::new();
        let ok_c = correctness(&gpu, &mut rng, &mut cases, only_hd)?;
        let (ok_g, graph_j) = if only_hd.is_none() { graph(&gpu, &mut rng)? } else { (true, Value::Null) };
        let (ok_p, perf_j) = if only_hd.is_none() { perf(&gpu, &mut rng)? } else { (true, Vec::new()) };
        let pass = ok_c && ok_g && ok_p;
        let secs = t0.elapsed().as_secs_f64();
        let j = json!({"device": gpu.name, "arch": gpu.arch, "tolerance": TOL, "correctness": cases, "graph": graph_j,
                       "perf": perf_j, "pass": pass, "seconds": secs});
        std::fs::write(&path, serde_json::to_string_pretty(&j)?).with_context(|| format!("write {path}"))?;
        println!(
            "cuda_attn_decode: {} (correctness {}, graph {}, perf-shape checks {}) in {secs:.1} s; JSON in {path}",
            verdict(pass),
            verdict(ok_c),
            if only_hd.is_none() { verdict(ok_g) } else { "skipped" },
            if only_hd.is_none() { verdict(ok_p) } else { "skipped" }
        );
        if !pass {
            std::process::exit(1);
        }
        Ok(())
    }
}
