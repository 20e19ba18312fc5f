//! Llama-3-8B-shape benchmark of the CUDA backend with seeded random bf16 weights generated on
//! the GPU (32 layers, hidden 4096, 32 heads, 8 KV heads, FFN 14336, vocab 128256).
//!
//! `cargo run --release -p prism-engine --features cuda --example cuda_bench -- OUT.json`
//!
//! Measures (wall clock around steps that end in a host synchronisation, as serving does):
//! - batch-1 decode step time at contexts 128 and 1,024 (greedy argmax on the device; 4 bytes
//!   come back) and the same step returning full f32 logits (the `Backend::forward` path),
//!   against the bandwidth floor `(weight bytes + KV bytes read) / 4.3 TB/s`;
//! - decode throughput at batch 8, 32, 128, 256 with 1,024-token contexts (block tables over
//!   distinct blocks; KV contents are whatever the cache holds — timing does not depend on them);
//! - prefill tokens/s for one 512- and one 2,048-token prompt and MFU against 790 TFLOP/s
//!   (FLOPs = 2 · matmul parameters · tokens + causal attention 2 · L² · hidden per layer);
//! - fast mode only: the fused decode-GEMV path (steps of ≤ 8 tokens) against the cuBLASLt path
//!   (the same sequences inside a 9-sequence step): max |Δ logit| and argmax agreement.
//!
//! `--invariant` (second argument) runs the batch-invariant mode instead of the default fast mode.
//!
//! `--json-schema VOCAB[,VOCAB…]` runs only the structured-output overhead: decode steps at
//! batch 1 and 64 (1,024-token contexts) greedy on the device, free against every row
//! constrained by a JSON schema as the engine's step loop does it, with the host time of each
//! phase (`support/structured_overhead.rs`). A VOCAB is a 128,256-token vocabulary: written by
//! `scripts/gpu/llama3_like_vocab.py` (cl100k_base + o200k_base tokens, built as Llama 3's is)
//! or by `cuda_bench --write-vocab MODEL.gguf VOCAB` (no CUDA needed: the GGUF's tokens,
//! padded with tokens made of two of its tokens' bytes).

use std::io::Write;

/// Vocabulary size of the padded vocabulary (Llama 3's).
const LLAMA3_VOCAB: usize = 128_256;

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    if let Some(r) = write_vocab_if_asked() {
        return r;
    }
    bench::main()
}

#[cfg(not(feature = "cuda"))]
fn main() -> anyhow::Result<()> {
    if let Some(r) = write_vocab_if_asked() {
        return r;
    }
    eprintln!("cuda_bench needs --features cuda");
    std::process::exit(2);
}

/// `--write-vocab MODEL.gguf OUT`: the model's token bytes padded to [`LLAMA3_VOCAB`] tokens,
/// as records `special: u8, len: u16 LE, bytes`.
fn write_vocab_if_asked() -> Option<anyhow::Result<()>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) != Some("--write-vocab") {
        return None;
    }
    Some((|| {
        let (Some(model), Some(out)) = (args.get(2), args.get(3)) else {
            anyhow::bail!("usage: cuda_bench --write-vocab MODEL.gguf OUT");
        };
        let file = prism_engine::model::gguf::GgufFile::open(std::path::Path::new(model))?;
        let tok = prism_engine::model::Tokenizer::from_gguf(&file)?;
        let n = tok.vocab_size();
        let mut w = std::io::BufWriter::new(std::fs::File::create(out)?);
        for id in 0..LLAMA3_VOCAB {
            let (special, bytes) = if id < n {
                (tok.is_special(id as u32), tok.token_bytes(id as u32).to_vec())
            } else {
                // Two ordinary tokens' bytes joined: longer tokens, as a larger BPE vocabulary has.
                let a = tok.token_bytes((id % n) as u32);
                let b = tok.token_bytes(((id * 7919) % n) as u32);
                (false, [a, b].concat())
            };
            w.write_all(&[u8::from(special)])?;
            w.write_all(&(bytes.len() as u16).to_le_bytes())?;
            w.write_all(&bytes)?;
        }
        w.flush()?;
        println!("wrote {LLAMA3_VOCAB} tokens ({n} from {model}) to {out}");
        Ok(())
    })())
}

#[cfg(feature = "cuda")]
mod bench {
    use prism_engine::backend::cuda::{CudaBackend, CudaOptions, KvCacheDtype, Quantization, SyntheticShape};
    use prism_engine::backend::{Backend, SeqStep, StepBatch};
    use serde_json::json;
    use std::io::Write as _;
    use std::time::Instant;

    /// `--fp8-gemm-sweep`: the FP8 GEMMs of a Llama-3-8B layer at the step sizes of the serving
    /// trace, cuBLASLt's first 8 heuristic answers each timed (µs per launch, median of 20;
    /// random codes, unit scales), plain and with the scales in the epilogue (outer-vector):
    /// how far the first answer, the one the engine takes, is from the fastest.
    fn fp8_gemm_sweep(out: &str) -> anyhow::Result<()> {
        use prism_engine::backend::cuda::device::{DevBuf, Gpu};
        use prism_engine::backend::cuda::gemm_fp8::{Fp8Gemm, Fp8GemmArgs};
        let gpu = Gpu::new(0)?;
        let mut lt = Fp8Gemm::new(&gpu)?;
        let shapes =
            [("qkv", 6144usize, 4096usize), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)];
        let (max_w, max_x, max_y, max_n) = (28672 * 4096, 2048 * 14336, 2048 * 28672, 28672);
        // bf16 fills read as e4m3 bytes: random codes (timing only).
        let (w, x) = (DevBuf::zeroed(&gpu, max_w)?, DevBuf::zeroed(&gpu, max_x)?);
        gpu.fill_uniform(w.ptr, max_w / 2, 7, 0.5)?;
        gpu.fill_uniform(x.ptr, max_x / 2, 11, 0.5)?;
        let y = DevBuf::zeroed(&gpu, max_y * 2)?;
        let (ws, xs) = (DevBuf::zeroed(&gpu, max_n * 4)?, DevBuf::zeroed(&gpu, max_n * 4)?);
        gpu.upload(&ws, 0, &vec![1f32; max_n])?;
        gpu.upload(&xs, 0, &vec![1f32; max_n])?;
        gpu.sync()?;
        let mut rows = Vec::new();
        for (name, o, i) in shapes {
            for n in [64usize, 128, 256, 512, 1024, 2048] {
                let a = Fp8GemmArgs { y: y.ptr, xq: x.ptr, wq: w.ptr, n, out: o, inp: i, f32_out: false };
                for outer in [false, true] {
                    let t = lt.time_algorithms(&gpu, &a, outer.then_some((xs.ptr, ws.ptr)), 8, 20)?;
                    let Some(&first) = t.first() else {
                        println!("fp8 gemm {name} n={n} outer={outer}: no algorithm");
                        continue;
                    };
                    let (bi, best) =
                        t.iter().copied().enumerate().fold((0, f64::MAX), |b, (k, v)| if v < b.1 { (k, v) } else { b });
                    let tflops = 2.0 * (n * o * i) as f64 / (best * 1e-6) / 1e12;
                    println!(
                        "fp8 gemm {name:<8} n={n:<5} outer={outer:<5}: first {first:7.1} us, best {best:7.1} us (#{bi} of {}, {tflops:.0} TFLOP/s); all {:?}",
                        t.len(),
                        t.iter().map(|v| (v * 10.0).round() / 10.0).collect::<Vec<_>>()
                    );
                    rows.push(json!({"gemm": name, "n": n, "out": o, "inp": i, "outer_vec": outer, "us": t}));
                }
            }
        }
        std::fs::write(
            out,
            serde_json::to_string_pretty(&json!({"device": gpu.name.clone(), "fp8_gemm_sweep": rows}))?,
        )?;
        Ok(())
    }

    const BS: usize = 16;
    const HBM: f64 = 4.3e12;
    const PEAK: f64 = 790e12;

    /// `b` sequences, each with `ctx` tokens in the cache after this step and `q` query tokens.
    pub(super) fn batch(b: usize, ctx: usize, q: usize, want: bool) -> StepBatch {
        let per = ctx.div_ceil(BS);
        let mut s = StepBatch::default();
        for i in 0..b {
            let blocks: Vec<u32> = ((i * per) as u32..((i + 1) * per) as u32).collect();
            let start = s.token_ids.len();
            for p in ctx - q..ctx {
                s.token_ids.push(((p * 7919 + i * 104_729) % 128_000) as u32);
                s.positions.push(p as u32);
                s.slot_mapping.push(blocks[p / BS] * BS as u32 + (p % BS) as u32);
            }
            s.seqs.push(SeqStep {
                query_start: start,
                query_len: q,
                context_len: ctx,
                block_table: blocks,
                want_logits: want,
            });
        }
        s
    }

    pub(super) fn time_greedy(be: &mut CudaBackend, b: &StepBatch, warm: usize, iters: usize) -> anyhow::Result<f64> {
        for _ in 0..warm {
            be.forward_greedy(b)?;
        }
        let t = Instant::now();
        for _ in 0..iters {
            be.forward_greedy(b)?;
        }
        Ok(t.elapsed().as_secs_f64() / iters as f64)
    }

    /// With `PRISM_GEMV_TRACE=1`: one more step of `b` (a captured graph when timed before),
    /// its decode GEMVs' per-block records written as CSV to `{out}.gemv_trace_{label}.csv`
    /// (columns as the kernel file's `GEMV_TRACE`; `scripts/gpu/gemv_trace.py` reads them).
    fn trace_step(be: &mut CudaBackend, b: &StepBatch, out: &str, label: &str) -> anyhow::Result<()> {
        if !std::env::var("PRISM_GEMV_TRACE").is_ok_and(|v| v == "1") {
            return Ok(());
        }
        be.forward_greedy(b)?;
        be.gemv_trace_take()?;
        be.attn_trace_take()?;
        be.forward_greedy(b)?;
        let words = be.gemv_trace_take()?;
        let attn = be.attn_trace_take()?;
        let path = format!("{out}.gemv_trace_{label}.csv");
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
        writeln!(f, "mode,out,inp,sm,block,g_entry,g_prologue,g_exit,c_prologue,c_warp_first_end,c_warp_last_end")?;
        for r in words.chunks_exact(prism_engine::backend::cuda::gemv::TRACE_WORDS) {
            writeln!(
                f,
                "{},{},{},{},{},{},{},{},{},{},{}",
                r[0] & 0xff,
                (r[0] >> 8) & 0xff_ffff,
                r[0] >> 32,
                r[1] >> 32,
                r[1] & 0xffff_ffff,
                r[2],
                r[3],
                r[4],
                r[5],
                r[6],
                r[7]
            )?;
        }
        f.flush()?;
        println!(
            "gemv trace {label}: {} block records in {path}",
            words.len() / prism_engine::backend::cuda::gemv::TRACE_WORDS
        );
        // Decode attention: one row per CTA with a split (the kernel file's DA_TRACE).
        let path = format!("{out}.attn_trace_{label}.csv");
        let mut f = std::io::BufWriter::new(std::fs::File::create(&path)?);
        writeln!(f, "z,g,t,nsplits,last,sm,g_entry,g_pos,g_tile,g_computed,g_written,g_counted,g_exit")?;
        let tw = prism_engine::backend::cuda::attn_decode::TRACE_WORDS;
        for r in attn.chunks_exact(tw) {
            let h = r[0];
            write!(
                f,
                "{},{},{},{},{},{}",
                h & 0xff,
                (h >> 8) & 0xff,
                (h >> 16) & 0xffff,
                (h >> 32) & 0xff,
                (h >> 40) & 1,
                r[1]
            )?;
            for v in &r[2..] {
                write!(f, ",{v}")?;
            }
            writeln!(f)?;
        }
        f.flush()?;
        println!("attention trace {label}: {} block records in {path}", attn.len() / tw);
        Ok(())
    }

    pub fn main() -> anyhow::Result<()> {
        let out = std::env::args().nth(1).unwrap_or_else(|| "cuda_bench.json".into());
        let args: Vec<String> = std::env::args().collect();
        let has = |f: &str| args.iter().any(|a| a == f);
        let value = |f: &str| args.iter().position(|a| a == f).and_then(|i| args.get(i + 1)).map(String::as_str);
        let invariant = has("--invariant");
        // --quick: the figures only (no GEMV sweeps, PDL, profiles or eager comparison).
        let quick = has("--quick");
        let quantization = match value("--quantization") {
            None | Some("none") => Quantization::None,
            Some("fp8") => Quantization::Fp8,
            Some(q) => anyhow::bail!("--quantization {q}: none or fp8"),
        };
        let kv_cache_dtype = match value("--kv-cache-dtype") {
            None | Some("auto" | "bf16") => KvCacheDtype::Bf16,
            Some("fp8") => KvCacheDtype::Fp8,
            Some(k) => anyhow::bail!("--kv-cache-dtype {k}: auto, bf16 or fp8"),
        };
        let json_vocab = args.iter().position(|a| a == "--json-schema").and_then(|i| args.get(i + 1).cloned());
        if has("--fp8-gemm-sweep") {
            return fp8_gemm_sweep(&out);
        }
        let shape = SyntheticShape::llama3_8b(1234);
        let opts = CudaOptions {
            quantization,
            kv_cache_dtype,
            fp8_lm_head: has("--fp8-lm-head"),
            batch_invariant: invariant,
            gpu_memory_utilization: 0.9,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            block_size: BS,
            ..CudaOptions::default()
        };
        let t0 = Instant::now();
        let mut be = CudaBackend::synthetic(&shape, &opts)?;
        let init_s = t0.elapsed().as_secs_f64();
        let wbytes = be.weight_bytes() as f64;
        let kv_tok = be.kv_bytes_per_token() as f64;
        let (h, l, inter, v) = (4096f64, 32f64, 14336f64, 128_256f64);
        let matmul_params = l * (h * (4096.0 + 2.0 * 1024.0) + h * 4096.0 + 3.0 * h * inter) + v * h;
        println!(
            "device {} init {init_s:.1}s weights {:.2} GB kv {} blocks ({} tokens, {} B/token)",
            be.device_name(),
            wbytes / 1e9,
            be.num_kv_blocks(),
            be.num_kv_blocks() * BS,
            kv_tok
        );
        let mut results = serde_json::Map::new();
        if let Some(vocab) = json_vocab {
            super::structured::overhead(&mut be, &vocab, &mut results)?;
            let report = json!({"mode": "json_schema", "device": be.device_name(), "results": results});
            std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
            return Ok(());
        }
        let mut check_ok = true;
        if let Some(p) = be.fp8_gemm_path() {
            println!("fp8 GEMM path: {p}");
            results.insert("fp8_gemm_path".into(), json!(p));
        }
        // FP8: the GEMM path quantizes its activations per token, the GEMVs keep them bf16.
        let tol = if quantization == Quantization::Fp8 { 0.10 } else { 0.05 };
        if !invariant {
            // GEMV path (n <= 8) vs cuBLASLt path (same sequences as the first rows of a 9-row step).
            let big = batch(9, 300, 1, true);
            let lb = be.forward(&big)?;
            let vocab = lb.vocab_size;
            be.set_gemv_max_tokens(4);
            for bsz in [1usize, 2, 3, 4] {
                let small = batch(bsz, 300, 1, true);
                let ls = be.forward(&small)?;
                let (mut max_diff, mut max_abs, mut agree) = (0f32, 0f32, 0usize);
                for r in 0..bsz {
                    let a = &ls.data[r * vocab..(r + 1) * vocab];
                    let b = &lb.data[r * vocab..(r + 1) * vocab];
                    let am = |x: &[f32]| {
                        x.iter().enumerate().fold((0, f32::MIN), |m, (i, &v)| if v > m.1 { (i, v) } else { m }).0
                    };
                    agree += usize::from(am(a) == am(b));
                    for (x, y) in a.iter().zip(b) {
                        max_diff = max_diff.max((x - y).abs());
                        max_abs = max_abs.max(y.abs());
                    }
                }
                let ok = max_diff.is_finite() && max_abs > 0.0 && max_diff <= tol * max_abs;
                // FP8: the two paths differ by the GEMM path's per-token e4m3 rounding of the
                // activations, which 32 random layers amplify; `tests/cuda_fp8.rs` checks each
                // path against the exact product on one matrix, so here it is information.
                let fp8 = quantization == Quantization::Fp8;
                check_ok &= ok || (fp8 && max_diff.is_finite());
                println!(
                    "{} gemv vs cublasLt decode b={bsz}: max |dlogit| {max_diff:.4} (max |logit| {max_abs:.3}), argmax agree {agree}/{bsz}",
                    if ok {
                        "PASS"
                    } else if fp8 {
                        "INFO"
                    } else {
                        "FAIL"
                    }
                );
                results.insert(
                    format!("gemv_check_b{bsz}"),
                    json!({"max_abs_diff": max_diff, "max_abs_logit": max_abs, "argmax_agree": agree, "pass": ok}),
                );
            }
            be.set_gemv_max_tokens(CudaOptions::default().gemv_max_tokens);
            // FP8 GEMV variants side by side (PRISM_GEMV_FP8_SWEEP=1 compiles them all): batch-1
            // decode time and the logits against the cuBLASLt path's first row.
            let (fp8_variants, in_use) = be.gemv_fp8_variants();
            if fp8_variants.len() > 1 {
                // Logits first: the timed steps below write K/V into the blocks these read.
                let mut diffs = Vec::new();
                for &v in &fp8_variants {
                    be.set_gemv_fp8_variant(v);
                    let ls = be.forward(&batch(1, 300, 1, true))?;
                    let (a, b) = (&ls.data[..vocab], &lb.data[..vocab]);
                    diffs.push(a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())));
                }
                for (&v, &max_diff) in fp8_variants.iter().zip(&diffs) {
                    be.set_gemv_fp8_variant(v);
                    let t128 = time_greedy(&mut be, &batch(1, 128, 1, true), 5, 50)?;
                    let t1024 = time_greedy(&mut be, &batch(1, 1024, 1, true), 5, 50)?;
                    trace_step(&mut be, &batch(1, 1024, 1, true), &out, &format!("fp8_v{v}"))?;
                    println!(
                        "fp8 gemv variant {v}: decode b=1 ctx 128 / 1024 {:.3} / {:.3} ms/step; max |dlogit| vs cublasLt {max_diff:.4}",
                        t128 * 1e3,
                        t1024 * 1e3
                    );
                    results.insert(
                        format!("fp8_gemv_variant_{v}"),
                        json!({"decode_b1_ctx128_ms": t128 * 1e3, "decode_b1_ctx1024_ms": t1024 * 1e3,
                               "max_abs_diff_vs_gemm": max_diff}),
                    );
                }
                be.set_gemv_fp8_variant(in_use);
            } else {
                let b1 = batch(1, 1024, 1, true);
                time_greedy(&mut be, &b1, 3, 3)?;
                let label = if quantization == Quantization::Fp8 { "fp8" } else { "bf16" };
                trace_step(&mut be, &b1, &out, label)?;
                let b128 = batch(1, 128, 1, true);
                time_greedy(&mut be, &b128, 3, 3)?;
                trace_step(&mut be, &b128, &out, &format!("{label}_ctx128"))?;
            }
        }
        if quick && std::env::var("PRISM_BENCH_PROFILE").is_ok_and(|v| v == "1") {
            // Per-kernel device time of one eager step (CUDA events between launches).
            // Batch-1 and batch-256 decode, and a 2,048-token prefill (the trace's full steps).
            for (bsz, ctx, q) in [(1usize, 1024usize, 1usize), (256, 1024, 1), (1, 2048, 2048)] {
                let b = batch(bsz, ctx, q, true);
                be.profile_step(&b)?;
                let prof = be.profile_step(&b)?;
                let total: f64 = prof.iter().map(|p| p.1).sum();
                println!("profile b={bsz} ctx={ctx} q={q}: {total:.0} us of kernels");
                for (name, us, cnt) in &prof {
                    println!("  {name:<20} {us:>9.1} us  {cnt:>3} launches  {:>7.2} us each", us / *cnt as f64);
                }
            }
        }
        if !invariant && !quick {
            // GEMV threshold sweep: small decode batches with the fused GEMVs up to `gm` tokens
            // (0 = always cuBLASLt).
            for bsz in [1usize, 2, 3, 4] {
                let b = batch(bsz, 1024, 1, true);
                let mut row = serde_json::Map::new();
                for gm in [0usize, 1, 2, 4] {
                    if gm != 0 && gm < bsz {
                        continue;
                    }
                    be.set_gemv_max_tokens(gm);
                    let t = time_greedy(&mut be, &b, 5, 30)?;
                    println!("decode b={bsz} ctx=1024 gemv_max_tokens={gm}: {:.3} ms/step", t * 1e3);
                    row.insert(format!("gemv_max_{gm}"), json!(t * 1e3));
                }
                results.insert(format!("gemv_sweep_b{bsz}_ctx1024_ms"), serde_json::Value::Object(row));
            }
            be.set_gemv_max_tokens(CudaOptions::default().gemv_max_tokens);
            // Ending on the default (2).
            for v in [1usize, 0, 2] {
                be.set_gemv_variant(v);
                for ctx in [128usize, 1024] {
                    let t = time_greedy(&mut be, &batch(1, ctx, 1, true), 5, 50)?;
                    println!("decode b=1 ctx={ctx} gemv variant {v}: {:.3} ms/step", t * 1e3);
                    results.insert(format!("decode_b1_ctx{ctx}_gemv_variant_{v}"), json!(t * 1e3));
                }
            }
            // PDL on and off, then back to the default for everything after the sweep.
            let pdl_default = be.pdl();
            for pdl in [true, false] {
                be.set_pdl(pdl);
                for ctx in [128usize, 1024] {
                    let t = time_greedy(&mut be, &batch(1, ctx, 1, true), 5, 50)?;
                    println!("decode b=1 ctx={ctx} pdl={pdl}: {:.3} ms/step", t * 1e3);
                    results.insert(format!("decode_b1_ctx{ctx}_pdl_{pdl}"), json!(t * 1e3));
                }
            }
            be.set_pdl(pdl_default);
            // Per-kernel device time of one eager step (CUDA events between launches).
            for (bsz, ctx) in [(1usize, 1024usize), (256, 1024)] {
                let b = batch(bsz, ctx, 1, true);
                be.profile_step(&b)?;
                let prof = be.profile_step(&b)?;
                let total: f64 = prof.iter().map(|p| p.1).sum();
                println!("profile decode b={bsz} ctx={ctx}: {total:.0} us of kernels");
                for (name, us, cnt) in &prof {
                    println!("  {name:<20} {us:>9.1} us  {cnt:>3} launches  {:>7.2} us each", us / *cnt as f64);
                }
                results.insert(
                    format!("profile_b{bsz}_ctx{ctx}"),
                    json!(prof.iter().map(|p| json!({"kernel": p.0, "us": p.1, "launches": p.2})).collect::<Vec<_>>()),
                );
            }
        }
        // Batch-1 decode.
        for ctx in [128usize, 1024] {
            let b = batch(1, ctx, 1, true);
            let greedy = time_greedy(&mut be, &b, 5, 50)?;
            let t = Instant::now();
            for _ in 0..20 {
                be.forward(&b)?;
            }
            let logits = t.elapsed().as_secs_f64() / 20.0;
            let floor = (wbytes + ctx as f64 * kv_tok) / HBM;
            println!(
                "decode b=1 ctx={ctx}: {:.3} ms/step (greedy on device), {:.3} ms (f32 logits to host); floor {:.3} ms -> {:.1}% of floor",
                greedy * 1e3,
                logits * 1e3,
                floor * 1e3,
                100.0 * floor / greedy
            );
            // The same steps enqueued back to back (one wait at the end): the host's part of a
            // step is the difference.
            let enqueued = be.time_enqueued_steps(&b, 50)?;
            println!(
                "decode b=1 ctx={ctx}: {:.3} ms/step enqueued back to back (host part of a step {:.1} us)",
                enqueued * 1e3,
                (greedy - enqueued) * 1e6
            );
            results.insert(
                format!("decode_b1_ctx{ctx}"),
                json!({"ms_per_step": greedy * 1e3, "ms_per_step_logits_to_host": logits * 1e3,
                       "ms_per_step_enqueued": enqueued * 1e3,
                       "floor_ms": floor * 1e3, "fraction_of_floor": floor / greedy}),
            );
        }
        // Batched decode at 1,024-token contexts.
        for bsz in [8usize, 32, 128, 256] {
            if bsz * 1024usize.div_ceil(BS) > be.num_kv_blocks() {
                println!("decode b={bsz}: skipped (KV cache too small)");
                continue;
            }
            let b = batch(bsz, 1024, 1, true);
            let step = time_greedy(&mut be, &b, 3, 20)?;
            let enqueued = be.time_enqueued_steps(&b, 20)?;
            let floor = (wbytes + bsz as f64 * 1024.0 * kv_tok) / HBM;
            println!(
                "decode b={bsz} ctx=1024: {:.3} ms/step, {:.0} tok/s; floor {:.3} ms -> {:.1}% of floor; enqueued back to back {:.3} ms",
                step * 1e3,
                bsz as f64 / step,
                floor * 1e3,
                100.0 * floor / step,
                enqueued * 1e3
            );
            results.insert(
                format!("decode_b{bsz}_ctx1024"),
                json!({"ms_per_step": step * 1e3, "tokens_per_s": bsz as f64 / step, "floor_ms": floor * 1e3,
                       "fraction_of_floor": floor / step}),
            );
        }
        // Prefill.
        for len in [512usize, 2048] {
            let b = batch(1, len, len, true);
            let step = time_greedy(&mut be, &b, 2, 5)?;
            let flops = 2.0 * matmul_params * len as f64 + l * 2.0 * (len * len) as f64 * h;
            let mfu = flops / step / PEAK;
            println!(
                "prefill {len}: {:.2} ms, {:.0} tok/s, {:.1} TFLOP/s, MFU {:.1}%",
                step * 1e3,
                len as f64 / step,
                flops / step / 1e12,
                100.0 * mfu
            );
            results.insert(
                format!("prefill_{len}"),
                json!({"ms": step * 1e3, "tokens_per_s": len as f64 / step, "tflops": flops / step / 1e12, "mfu": mfu}),
            );
        }
        let replays = be.graph_replays;
        let plans = be.gemm_plans().to_vec();
        for p in &plans {
            println!(
                "gemm {}x{} (f32 out {}): {} candidates, {} batch-invariant, chosen {:?} invariant {} \
                 t(M=1) {:.1} us t(M={}) {:.1} us; cublasGemmEx default invariant {} t(M=1) {:.1} us",
                p.out,
                p.inp,
                p.f32_out,
                p.candidates,
                p.invariant,
                p.chosen,
                p.chosen_invariant,
                p.t_m1_us,
                p.m_mid,
                p.t_mid_us,
                p.cublas_default_invariant,
                p.cublas_t_m1_us
            );
        }
        let name = be.device_name().to_owned();
        let kv_tokens = be.num_kv_blocks() * BS;
        drop(be);
        // The same decode steps without CUDA graphs (eager launches), for the comparison.
        if !quick {
            let mut eager = CudaBackend::synthetic(&shape, &CudaOptions { cuda_graphs: false, ..opts.clone() })?;
            for ctx in [128usize, 1024] {
                let b = batch(1, ctx, 1, true);
                let t = time_greedy(&mut eager, &b, 5, 50)?;
                println!("decode b=1 ctx={ctx} without CUDA graphs: {:.3} ms/step", t * 1e3);
                results.insert(format!("decode_b1_ctx{ctx}_no_graphs"), json!({"ms_per_step": t * 1e3}));
            }
        }
        let report = json!({
            "mode": if invariant { "batch_invariant" } else { "fast" },
            "quantization": format!("{quantization:?}"), "kv_cache_dtype": format!("{kv_cache_dtype:?}"),
            "fp8_lm_head": opts.fp8_lm_head,
            "device": name, "init_seconds": init_s, "weight_bytes": wbytes, "kv_bytes_per_token": kv_tok,
            "kv_tokens": kv_tokens, "results": results, "graph_replays": replays, "gemm_plans": plans,
        });
        std::fs::write(&out, serde_json::to_string_pretty(&report)?)?;
        anyhow::ensure!(check_ok, "GEMV path disagrees with the cuBLASLt path");
        Ok(())
    }
}

/// `--json-schema`: the step-time overhead of grammar masks on the device greedy path.
#[cfg(feature = "cuda")]
#[path = "support/structured_overhead.rs"]
mod structured;
