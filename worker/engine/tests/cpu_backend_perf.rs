//! Quick CPU-backend throughput check on the bundled model (ignored by default; the real
//! benchmark is `prism bench engine`): prefill of a 512-token prompt and batch-1 / batch-8
//! decode, printed as tokens/s, with the weights kept in their GGUF blocks (as the engine
//! loads them; `PRISM_CPU_F32=1` dequantizes them to f32 at load instead).
//! Run: `cargo test -p prism-engine --test cpu_backend_perf -- --ignored --nocapture`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use prism_engine::backend::cpu::CpuBackend;
use prism_engine::backend::{Backend, SeqStep, StepBatch};
use prism_engine::model::{LoadOptions, ModelSource, load_model_with};

fn step(seqs: &[(u32, usize, usize)], bs: usize) -> StepBatch {
    // (token, start position, query_len) per sequence; sequence i uses blocks from i * 64.
    let mut b = StepBatch::default();
    for (i, &(tok, start, len)) in seqs.iter().enumerate() {
        let ctx = start + len;
        let table: Vec<u32> = (0..ctx.div_ceil(bs) as u32).map(|x| i as u32 * 4 + x).collect();
        let qs = b.token_ids.len();
        for p in start..ctx {
            b.token_ids.push(tok + (p % 100) as u32);
            b.positions.push(p as u32);
            b.slot_mapping.push(table[p / bs] * bs as u32 + (p % bs) as u32);
        }
        b.seqs.push(SeqStep {
            query_start: qs,
            query_len: len,
            context_len: ctx,
            block_table: table,
            want_logits: true,
        });
    }
    b
}

#[test]
#[ignore = "benchmark"]
fn cpu_backend_throughput() -> Result<()> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if !path.exists() {
        eprintln!("SKIPPED: model missing");
        return Ok(());
    }
    let keep_quantized = std::env::var_os("PRISM_CPU_F32").is_none();
    let m = load_model_with(&ModelSource::detect(path)?, None, LoadOptions { keep_quantized })?;
    let bs = 16;
    let mut be = CpuBackend::new(m.weights, &m.config, 512 * 16 * 92160, bs)?;
    eprintln!("weights kept quantized: {keep_quantized}; weight matrices {} MiB", be.weight_bytes() >> 20);
    let t = Instant::now();
    be.forward(&step(&[(1000, 0, 512)], bs))?;
    let dt = t.elapsed().as_secs_f64();
    eprintln!("prefill 512: {:.3}s = {:.1} tok/s", dt, 512.0 / dt);
    let t = Instant::now();
    let n = 64;
    for i in 0..n {
        be.forward(&step(&[(500, 512 + i, 1)], bs))?;
    }
    let dt = t.elapsed().as_secs_f64();
    eprintln!("decode b1 (ctx ~512): {:.1} tok/s", n as f64 / dt);
    let t = Instant::now();
    for i in 0..n {
        be.forward(&step(&[(500, 10 + i, 1)], bs))?;
    }
    let dt = t.elapsed().as_secs_f64();
    eprintln!("decode b1 (ctx ~40): {:.1} tok/s", n as f64 / dt);
    for batch in [8usize, 32] {
        // sequence i uses blocks i*4.. (4 blocks = 64 tokens each)
        let seqs: Vec<(u32, usize, usize)> = (0..batch).map(|i| (100 + i as u32, 0, 16)).collect();
        be.forward(&step(&seqs, bs))?;
        let t = Instant::now();
        let steps = 16;
        for s in 0..steps {
            let seqs: Vec<(u32, usize, usize)> = (0..batch).map(|i| (100 + i as u32, 16 + s, 1)).collect();
            be.forward(&step(&seqs, bs))?;
        }
        let dt = t.elapsed().as_secs_f64();
        eprintln!("decode b{batch}: {:.1} tok/s aggregate", (steps * batch) as f64 / dt);
    }
    Ok(())
}
