// The FP8-KV mode of `cuda_attn_decode` (`--fp8`): the FP8-KV decode attention kernel on e4m3
// caches against the reference kernel on the same values, then its speed against the bf16-KV
// kernel. Included into the example's `check` module (`include!`), whose helpers it uses.

/// FP8-KV correctness: the FP8-KV kernel on e4m3 caches against the reference kernel on the
/// same values, bitwise determinism, batch invariance with the constant cap.
fn fp8_correctness(gpu: &Gpu, rng: &mut Rng, out: &mut Vec<Value>) -> Result<bool> {
    let mut pass = true;
    let shapes = [(128, 4, 8), (128, 8, 4), (128, 1, 8), (128, 2, 4), (64, 1, 4), (64, 4, 2), (64, 8, 2)];
    for (hd, g, kvh) in shapes {
        let shape = AttnShape { q_heads: g * kvh, kv_heads: kvh, head_dim: hd };
        let da = DecodeAttention::with_kv(gpu, shape, MAX_TOKENS, true)?;
        let mut cases = vec![Case {
            name: "mixed",
            ctxs: mixed(14),
            bs: 16,
            q_scale: 4.0,
            poison: true,
            caps: vec![INVARIANT_SPLIT_CAP, 1, 3, da.occupancy_split_cap(14)],
            max_ctx: None,
        }];
        if (hd, g, kvh) == (128, 4, 8) {
            let case = |name, ctxs, bs, q_scale, poison, caps, max_ctx| Case {
                name,
                ctxs,
                bs,
                q_scale,
                poison,
                caps,
                max_ctx,
            };
            for bs in [1usize, 8, 32] {
                cases.push(case("block-size", mixed(14), bs, 4.0, bs != 1, vec![INVARIANT_SPLIT_CAP, 2], None));
            }
            cases.push(case("peaky-softmax", mixed(28), 16, 16.0, true, vec![INVARIANT_SPLIT_CAP, 1], None));
            cases.push(case(
                "grid-smaller-than-ctx",
                mixed(14),
                16,
                4.0,
                false,
                vec![INVARIANT_SPLIT_CAP, 5],
                Some(64),
            ));
            cases.push(case("b1-16k", vec![16384], 16, 4.0, true, vec![INVARIANT_SPLIT_CAP, 4], None));
        }
        for c in &cases {
            let (name, bs) = (c.name, c.bs);
            let p = Problem::new(gpu, shape, &c.ctxs, bs, c.q_scale, 1, rng)?;
            let c8 = p.e4m3_caches(gpu, rng.next(), c.poison)?;
            p.run_ref(gpu)?;
            let want = p.download(gpu, p.out_ref.ptr)?;
            let max_ctx = c.max_ctx.unwrap_or(p.max_ctx());
            for &cap in &c.caps {
                let a = p.args8(&c8, cap, max_ctx);
                gpu.fill_const(p.out.ptr, p.out_len(), SENTINEL)?;
                da.launch(gpu, &a)?;
                let got = p.download(gpu, p.out.ptr)?;
                gpu.fill_const(p.out.ptr, p.out_len(), SENTINEL)?;
                da.launch(gpu, &a)?;
                let det = p.download(gpu, p.out.ptr)? == got;
                let (d, r, bad) = compare(&got, &want);
                let ok = bad == 0 && d <= TOL && det && r > 0.0;
                pass &= ok;
                println!(
                    "{} fp8-kv {name:<22} hd={hd} G={g} kvh={kvh} n={} bs={bs} cap={cap:>2}: max|diff| vs reference {d:.2e} max|ref|={r:.3} nonfinite={bad} deterministic={det}",
                    verdict(ok),
                    p.n
                );
                out.push(json!({"case": name, "kv": "fp8", "head_dim": hd, "group": g, "kv_heads": kvh, "n": p.n,
                                "block_size": bs, "cap": cap, "max_abs_diff": d, "max_abs_ref": r, "nonfinite": bad,
                                "deterministic": det, "pass": ok}));
            }
        }
    }
    // Batch invariance at the constant cap: 5 tokens alone = their rows of a batch of 256.
    let shape = AttnShape { q_heads: 32, kv_heads: 8, head_dim: 128 };
    let da = DecodeAttention::with_kv(gpu, shape, MAX_TOKENS, true)?;
    let mut ctxs: Vec<usize> = (0..MAX_TOKENS).map(|_| 1 + rng.below(4096)).collect();
    ctxs[3] = 1;
    ctxs[4] = 4096;
    let p = Problem::new(gpu, shape, &ctxs, 16, 4.0, 1, rng)?;
    let c8 = p.e4m3_caches(gpu, rng.next(), false)?;
    da.launch(gpu, &p.args8(&c8, INVARIANT_SPLIT_CAP, p.max_ctx()))?;
    let full = p.download(gpu, p.out.ptr)?;
    let row = shape.q_heads * shape.head_dim;
    let one = DevBuf::zeroed(gpu, row * 2)?;
    let mut inv = true;
    for i in [0usize, 3, 4, 77, p.n - 1] {
        let mut a = p.args8(&c8, INVARIANT_SPLIT_CAP, p.ctxs[i]);
        a.n_tokens = 1;
        a.out = one.ptr;
        a.qkv = p.qkv.ptr + (i * p.qkv_dim() * 2) as u64;
        a.pos = p.pos() + (i * 4) as u64;
        a.tok_bt = p.tok_bt() + (i * 4) as u64;
        gpu.fill_const(one.ptr, row, SENTINEL)?;
        da.launch(gpu, &a)?;
        let mut v = vec![0u16; row];
        gpu.download(&mut v, one.ptr)?;
        inv &= v[..] == full[i * row..(i + 1) * row];
    }
    println!(
        "{} fp8-kv batch invariance (cap {INVARIANT_SPLIT_CAP}): 5 tokens alone vs in a batch of 256: bitwise equal = {inv}",
        verdict(inv)
    );
    out.push(json!({"case": "batch-invariance", "kv": "fp8", "n": p.n, "pass": inv}));
    Ok(pass && inv)
}

/// Both kernels on the same values at Llama-3-8B heads, every cap: cold / warm times and the
/// FP8-KV / bf16 ratio.
fn fp8_perf(gpu: &Gpu, rng: &mut Rng) -> Result<(bool, Vec<Value>)> {
    let shape = AttnShape { q_heads: 32, kv_heads: 8, head_dim: 128 };
    let d16 = DecodeAttention::new(gpu, shape, MAX_TOKENS)?;
    let d8 = DecodeAttention::with_kv(gpu, shape, MAX_TOKENS, true)?;
    let flush = DevBuf::zeroed(gpu, 256 << 20)?;
    let reps = 30;
    let mut pass = true;
    let mut out = Vec::new();
    let shapes = [
        (1usize, 128usize),
        (1, 1024),
        (1, 4096),
        (8, 1024),
        (32, 1024),
        (64, 1024),
        (64, 4096),
        (128, 1024),
        (256, 1024),
    ];
    for (b, ctx) in shapes {
        let p = Problem::new(gpu, shape, &vec![ctx; b], 16, 4.0, 1, rng)?;
        let c8 = p.e4m3_caches(gpu, rng.next(), false)?;
        let kv16 = p.kv_bytes();
        p.run_ref(gpu)?;
        let want = p.download(gpu, p.out_ref.ptr)?;
        let occ16 = d16.occupancy_split_cap(b);
        let occ8 = d8.occupancy_split_cap(b);
        let mut rows = Vec::new();
        let mut at_occ = [0.0f64; 2];
        let mut caps = vec![1usize, 2, 4, 8, 16];
        for occ in [occ16, occ8] {
            if !caps.contains(&occ) {
                caps.push(occ);
            }
        }
        for cap in caps {
            let mut t = [[0.0f64; 2]; 2];
            let mut diff = [0f32; 2];
            for (k, (da, a)) in [(&d16, p.args(cap, ctx)), (&d8, p.args8(&c8, cap, ctx))].into_iter().enumerate() {
                da.launch(gpu, &a)?;
                let (d, _, bad) = compare(&p.download(gpu, p.out.ptr)?, &want);
                let ok = bad == 0 && d <= TOL;
                pass &= ok;
                diff[k] = if bad == 0 { d } else { f32::NAN };
                let (cold, _) = time_cold(gpu, &flush, reps, &mut || Ok(da.launch(gpu, &a)?))?;
                let warm = time_warm(gpu, reps, &mut || Ok(da.launch(gpu, &a)?))?;
                t[k] = [cold, warm];
            }
            if cap == occ16 {
                at_occ[0] = t[0][0];
            }
            if cap == occ8 {
                at_occ[1] = t[1][0];
            }
            let tbs = |us: f64, bytes: f64| bytes / (us * 1e-6) / 1e12;
            println!(
                "fp8-kv perf b={b:<3} ctx={ctx:<4} cap={cap:>2}: bf16 cold {:7.1} us ({:.2} TB/s) warm {:7.1} | fp8 cold {:7.1} us ({:.2} TB/s of e4m3) warm {:7.1} | fp8/bf16 cold {:.3} warm {:.3} | max|diff| vs ref bf16 {:.1e} fp8 {:.1e}",
                t[0][0],
                tbs(t[0][0], kv16),
                t[0][1],
                t[1][0],
                tbs(t[1][0], kv16 / 2.0),
                t[1][1],
                t[1][0] / t[0][0],
                t[1][1] / t[0][1],
                diff[0],
                diff[1]
            );
            rows.push(json!({"cap": cap, "bf16_cold_us": t[0][0], "bf16_warm_us": t[0][1], "fp8_cold_us": t[1][0],
                             "fp8_warm_us": t[1][1], "ratio_cold": t[1][0] / t[0][0], "ratio_warm": t[1][1] / t[0][1],
                             "bf16_max_abs_diff": diff[0], "fp8_max_abs_diff": diff[1]}));
        }
        println!(
            "fp8-kv perf b={b:<3} ctx={ctx:<4} at the occupancy caps (bf16 {occ16}, fp8 {occ8}): bf16 {:.1} us, fp8 {:.1} us, fp8/bf16 {:.3}",
            at_occ[0],
            at_occ[1],
            at_occ[1] / at_occ[0]
        );
        out.push(json!({"batch": b, "ctx": ctx, "kv_bytes_bf16": kv16, "occupancy_cap_bf16": occ16, "occupancy_cap_fp8": occ8,
                        "bf16_cold_us_at_occupancy_cap": at_occ[0], "fp8_cold_us_at_occupancy_cap": at_occ[1],
                        "ratio_at_occupancy_caps": at_occ[1] / at_occ[0], "caps": rows}));
    }
    Ok((pass, out))
}

fn main_fp8(path: &str) -> Result<()> {
    let t0 = Instant::now();
    let gpu = Gpu::new(0)?;
    println!("device {} ({}), FP8-KV build, tolerance {TOL}", gpu.name, gpu.arch);
    let mut rng = Rng(0x5EED_F8F8);
    let mut cases = Vec::new();
    let ok_c = fp8_correctness(&gpu, &mut rng, &mut cases)?;
    let (ok_p, perf_j) = fp8_perf(&gpu, &mut rng)?;
    let pass = ok_c && ok_p;
    let secs = t0.elapsed().as_secs_f64();
    let j = json!({"device": gpu.name, "arch": gpu.arch, "kv": "fp8", "tolerance": TOL, "correctness": cases,
                   "perf": perf_j, "pass": pass, "seconds": secs});
    std::fs::write(path, serde_json::to_string_pretty(&j)?).with_context(|| format!("write {path}"))?;
    println!(
        "cuda_attn_decode --fp8: {} (correctness {}, perf-shape checks {}) in {secs:.1} s; JSON in {path}",
        verdict(pass),
        verdict(ok_c),
        verdict(ok_p)
    );
    if !pass {
        std::process::exit(1);
    }
    Ok(())
}
