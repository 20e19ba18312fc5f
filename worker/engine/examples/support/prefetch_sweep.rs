//! `PRISM_GEMV_PREFETCH_SWEEP=1 cuda_bench …`: the decode GEMVs' L2 prefetch plans
//! (`gemv::PREFETCH_PLANS`) side by side in one process (`#[path]`-included by `cuda_bench`).
//!
//! For every plan: the logits of one batch-1 decode step (context 300), which must equal those
//! of plan 0 (no prefetch) bit for bit (prefetches and cache policies change where bytes come
//! from, not the arithmetic), and the batch-1 decode step at contexts 128 / 1,024 (greedy on the
//! device, CUDA graphs), with programmatic dependent launch off and on. Then the per-kernel
//! profile of one eager step (b=1, ctx 1,024) without prefetches and with the plan in use.

use super::bench::{batch, time_greedy};
use prism_engine::backend::Backend;
use prism_engine::backend::cuda::CudaBackend;
use prism_engine::backend::cuda::gemv::PREFETCH_PLANS;
use serde_json::json;

/// Runs the sweep into `results`; false when a plan's logits differ from plan 0's.
pub fn run(be: &mut CudaBackend, results: &mut serde_json::Map<String, serde_json::Value>) -> anyhow::Result<bool> {
    let in_use = be.gemv_prefetch_plan();
    let pdl_in_use = be.pdl();
    let mut ok = true;
    let mut base: Option<Vec<f32>> = None;
    for p in 0..PREFETCH_PLANS.len() {
        anyhow::ensure!(be.set_gemv_prefetch(p), "no decode GEMVs to sweep");
        let l = be.forward(&batch(1, 300, 1, true))?;
        let row = l.data[..l.vocab_size].to_vec();
        let same = base.as_ref().is_none_or(|b| b.iter().zip(&row).all(|(x, y)| x.to_bits() == y.to_bits()));
        ok &= same;
        println!(
            "{} prefetch plan {p}: logits {} plan 0's ({:?})",
            if same { "PASS" } else { "FAIL" },
            if same { "equal" } else { "differ from" },
            PREFETCH_PLANS[p]
        );
        results.insert(format!("prefetch_plan_{p}_logits_equal"), json!(same));
        base.get_or_insert(row);
    }
    for pdl in [false, true] {
        be.set_pdl(pdl);
        for p in 0..PREFETCH_PLANS.len() {
            be.set_gemv_prefetch(p);
            let t128 = time_greedy(be, &batch(1, 128, 1, true), 5, 50)?;
            let t1024 = time_greedy(be, &batch(1, 1024, 1, true), 5, 50)?;
            println!(
                "prefetch plan {p} pdl={pdl}: decode b=1 ctx 128 / 1024 {:.3} / {:.3} ms/step",
                t128 * 1e3,
                t1024 * 1e3
            );
            results.insert(
                format!("prefetch_plan_{p}_pdl_{pdl}"),
                json!({"decode_b1_ctx128_ms": t128 * 1e3, "decode_b1_ctx1024_ms": t1024 * 1e3}),
            );
        }
    }
    be.set_pdl(pdl_in_use);
    for p in [0, in_use] {
        be.set_gemv_prefetch(p);
        let b = batch(1, 1024, 1, true);
        be.profile_step(&b)?;
        let prof = be.profile_step(&b)?;
        let total: f64 = prof.iter().map(|p| p.1).sum();
        println!("profile prefetch plan {p} b=1 ctx=1024 q=1: {total:.0} us of kernels");
        for (name, us, cnt) in &prof {
            println!("  {name:<20} {us:>9.1} us  {cnt:>3} launches  {:>7.2} us each", us / *cnt as f64);
        }
        results.insert(
            format!("prefetch_plan_{p}_profile_b1_ctx1024"),
            json!(prof.iter().map(|p| json!({"kernel": p.0, "us": p.1, "launches": p.2})).collect::<Vec<_>>()),
        );
    }
    be.set_gemv_prefetch(in_use);
    Ok(ok)
}
