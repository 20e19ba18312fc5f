//! The engine's "batching changes nothing" test body (`tests/engine_real_model.rs`) on the CUDA
//! backend, through the real engine (`EngineHandle`, `BackendKind::Cuda`), on a Hugging Face
//! model that `scripts/gpu/hf_reference.py OUT` writes (run on the GPU machine): the trained
//! model `OUT/trained` (clear top-2 margins, so equal tokens are expected in every mode) or the
//! random-weight one `OUT` (near-ties: a kernel change may flip tokens).
//!
//! `cargo run --release -p prism-engine --features cuda --example cuda_engine_parity -- DIR [OUT.json]
//!  [--batch-invariant | --both-modes]`
//!
//! Mode: the engine's default (fast kernels), `--batch-invariant` (or `PRISM_BATCH_INVARIANT=1`)
//! for `EngineConfig::batch_invariant`, or `--both-modes` to run the four scenarios in each mode.
//!
//! Prompts: `parity_prompts` of `DIR/reference.json` when it has them (the trained model's:
//! sentences of its training language, 9–200 tokens), else five token-id prompts of 9–200 tokens
//! from a fixed formula. The longer ones span several 128-position attention chunks.
//!
//! Greedy tokens (16 per prompt) must be identical, in each mode:
//! 1. one request at a time (KV cache sized from `gpu_memory_utilization`);
//! 2. all five submitted together (continuous batching, decode steps replayed from CUDA graphs
//!    of a larger bucket);
//! 3. together with a 7-token step budget (chunked prefill mixed with decodes);
//! 4. together with a 16-block KV cache (the first four prompts fill it, their decodes need more
//!    blocks: preemption by recompute; at least one must happen).
//!
//! Scenarios 1–4 run with the prefix cache off, so each computes every prompt. With it on:
//! 5. the prompts one at a time on a fresh engine (cold: every full block gets registered);
//! 6. the same prompts again, together (warm: all full blocks but the one holding the last
//!    token come from the cache; hits must be counted);
//! 7. each prompt's first two thirds followed by its remaining tokens reversed, together (hits
//!    ending mid-prompt), against the same prompts on the cache-off engine one at a time.
//!
//! When `reference.json` also has HF f32's greedy tokens for these prompts (`parity_greedy_f32`,
//! `parity_margins_f32`), the one-at-a-time tokens are compared with them and, with
//! `--both-modes`, the two modes with each other. These two checks are strict when HF's smallest
//! top-1 − top-2 margin over the 16 compared steps is at least [`CONFIDENT_MARGIN`] (a model on
//! which any correct bf16 engine picks HF's tokens), else reported as information.
//!
//! Prints `name: ok|FAIL` per check and `cuda_engine_parity: PASS|FAIL`; writes JSON to OUT.json
//! when given; exits 1 on any failure.

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    parity::main()
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_engine_parity needs --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
mod parity {
    use anyhow::{Context, Result, bail, ensure};
    use prism_engine::{BackendKind, EngineConfig, EngineHandle, EngineRequest, Prompt, SamplingParams};
    use serde_json::{Value, json};
    use std::path::{Path, PathBuf};
    use std::time::{Duration, Instant};

    const LENS: [usize; 5] = [9, 21, 45, 150, 200];
    const NEW: i64 = 16;
    /// Smallest HF f32 top-2 margin (logits) at which token equality with HF is required: about
    /// ten times the logit bound `cuda_check` measures on these models (0.1–0.2).
    pub const CONFIDENT_MARGIN: f64 = 1.0;

    fn formula_prompts(vocab: usize) -> Vec<Vec<u32>> {
        LENS.iter()
            .enumerate()
            .map(|(i, &len)| (0..len).map(|p| ((p * 37 + i * 101 + 11) % (vocab - 4) + 3) as u32).collect())
            .collect()
    }

    /// HF f32 greedy tokens per prompt and HF f32's top-1 − top-2 logit margin at each step.
    type HfGreedy = (Vec<Vec<u32>>, Vec<Vec<f64>>);

    /// What `DIR/reference.json` offers for this check.
    struct Reference {
        /// `parity_prompts`, when present (else the formula's, made once the vocabulary is known).
        prompts: Option<Vec<Vec<u32>>>,
        /// HF f32 greedy tokens and per-step top-2 margins (first [`NEW`] steps), when present.
        hf: Option<HfGreedy>,
    }

    fn reference(dir: &Path) -> Result<Reference> {
        let path = dir.join("reference.json");
        let none = Reference { prompts: None, hf: None };
        let Ok(raw) = std::fs::read_to_string(&path) else {
            return Ok(none);
        };
        let v: Value = serde_json::from_str(&raw).with_context(|| format!("parsing {}", path.display()))?;
        let Some(ps) = v.get("parity_prompts") else {
            return Ok(none);
        };
        let prompts: Vec<Vec<u32>> = serde_json::from_value(ps.clone()).context("reference.json parity_prompts")?;
        ensure!(!prompts.is_empty() && prompts.iter().all(|p| !p.is_empty()), "reference.json parity_prompts: empty");
        let hf = match (v.get("parity_greedy_f32"), v.get("parity_margins_f32")) {
            (Some(g), Some(m)) => {
                let g: Vec<Vec<u32>> = serde_json::from_value(g.clone()).context("reference.json parity_greedy_f32")?;
                let m: Vec<Vec<f64>> =
                    serde_json::from_value(m.clone()).context("reference.json parity_margins_f32")?;
                let n = NEW as usize;
                ensure!(
                    g.len() == prompts.len()
                        && m.len() == prompts.len()
                        && g.iter().all(|t| t.len() >= n)
                        && m.iter().all(|x| x.len() >= n),
                    "reference.json parity_greedy_f32 / parity_margins_f32: want {} prompts of >= {NEW} steps",
                    prompts.len()
                );
                Some((
                    g.into_iter().map(|t| t[..n].to_vec()).collect(),
                    m.into_iter().map(|x| x[..n].to_vec()).collect(),
                ))
            }
            _ => None,
        };
        Ok(Reference { prompts: Some(prompts), hf })
    }

    fn start(dir: &Path, invariant: bool, tweak: impl FnOnce(&mut EngineConfig)) -> Result<EngineHandle> {
        let mut cfg = EngineConfig::new(dir);
        cfg.served_model_name = "hf-reference".into();
        cfg.backend = BackendKind::Cuda { devices: vec![0] };
        cfg.gpu_memory_utilization = 0.2;
        cfg.batch_invariant = invariant;
        tweak(&mut cfg);
        Ok(EngineHandle::start(cfg, None)?)
    }

    fn req(ids: &[u32]) -> EngineRequest {
        let params =
            SamplingParams { temperature: 0.0, max_tokens: Some(NEW), ignore_eos: true, ..SamplingParams::default() };
        EngineRequest {
            id: "parity".into(),
            prompt: Prompt::TokenIds(ids.to_vec()),
            params,
            prior_output_ids: Vec::new(),
            deadline: None,
            cache_salt: None,
            tools: None,
            chat_template_kwargs: None,
        }
    }

    fn collect(mut s: prism_engine::OutputStream) -> Vec<u32> {
        let mut toks = Vec::new();
        while let Some(o) = s.blocking_recv() {
            toks.extend(&o.token_ids);
        }
        toks
    }

    fn run(e: &EngineHandle, ps: &[Vec<u32>], together: bool) -> Result<Vec<Vec<u32>>> {
        if together {
            let streams: Vec<_> = ps.iter().map(|p| e.submit(req(p))).collect::<Result<_, _>>()?;
            Ok(streams.into_iter().map(collect).collect())
        } else {
            ps.iter().map(|p| Ok(collect(e.submit(req(p))?))).collect()
        }
    }

    fn wait_idle(e: &EngineHandle) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let s = e.stats();
            if s.requests_in_flight == 0 && s.running == 0 && s.waiting == 0 && s.free_blocks == s.total_blocks {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "engine did not return to idle: {s:?}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The four scenarios in one mode.
    struct ModeRun {
        invariant: bool,
        kv_blocks: usize,
        alone: Vec<Vec<u32>>,
        batched: Vec<Vec<u32>>,
        chunked: Vec<Vec<u32>>,
        preempted: Vec<Vec<u32>>,
        preemptions: u64,
        cold: Vec<Vec<u32>>,
        warm: Vec<Vec<u32>>,
        partial: Vec<Vec<u32>>,
        partial_ref: Vec<Vec<u32>>,
        prefix_hits: u64,
        seconds: f64,
    }

    /// Scenario 7's prompts: the first two thirds of each prompt, then its other tokens reversed.
    fn partial_prompts(ps: &[Vec<u32>]) -> Vec<Vec<u32>> {
        ps.iter()
            .map(|p| {
                let k = p.len() * 2 / 3;
                p[..k].iter().chain(p[k..].iter().rev()).copied().collect()
            })
            .collect()
    }

    /// Runs the four scenarios; `prompts` is filled from the formula (the engine's vocabulary)
    /// when empty.
    fn run_mode(dir: &Path, prompts: &mut Option<Vec<Vec<u32>>>, invariant: bool) -> Result<ModeRun> {
        let t0 = Instant::now();
        let e = start(dir, invariant, |c| c.enable_prefix_caching = false)?;
        let info = e.model_info();
        let ps: &[Vec<u32>] = prompts.get_or_insert_with(|| formula_prompts(info.vocab_size));
        println!(
            "[{}] engine on CUDA: {} KV blocks of {} tokens",
            mode_name(invariant),
            info.num_kv_blocks,
            info.block_size
        );
        let alone = run(&e, ps, false)?;
        ensure!(alone.iter().all(|t| t.len() == NEW as usize), "short output: {alone:?}");
        let batched = run(&e, ps, true)?;
        let partial_ps = partial_prompts(ps);
        let partial_ref = run(&e, &partial_ps, false)?;
        wait_idle(&e)?;
        e.shutdown();

        let pc = start(dir, invariant, |c| c.enable_prefix_caching = true)?;
        let cold = run(&pc, ps, false)?;
        let warm = run(&pc, ps, true)?;
        let prefix_hits = pc.stats().prefix_cache_hits_total;
        let partial = run(&pc, &partial_ps, true)?;
        wait_idle(&pc)?;
        pc.shutdown();

        let chunked_e = start(dir, invariant, |c| {
            c.max_num_batched_tokens = 7;
            c.enable_prefix_caching = false;
        })?;
        let chunked = run(&chunked_e, ps, true)?;
        wait_idle(&chunked_e)?;
        chunked_e.shutdown();

        let kv = 16 * 16 * info.kv_bytes_per_token as u64;
        let tiny = start(dir, invariant, |c| {
            c.kv_cache_bytes = Some(kv);
            c.enable_prefix_caching = false;
        })?;
        ensure!(tiny.model_info().num_kv_blocks == 16, "{:?}", tiny.model_info());
        let preempted = run(&tiny, ps, true)?;
        let preemptions = tiny.stats().num_preemptions_total;
        wait_idle(&tiny)?;
        tiny.shutdown();
        Ok(ModeRun {
            invariant,
            kv_blocks: info.num_kv_blocks,
            alone,
            batched,
            chunked,
            preempted,
            preemptions,
            cold,
            warm,
            partial,
            partial_ref,
            prefix_hits,
            seconds: t0.elapsed().as_secs_f64(),
        })
    }

    fn mode_name(invariant: bool) -> &'static str {
        if invariant { "batch-invariant" } else { "fast" }
    }

    /// One named check: (name, passed, strict). A non-strict check is information only.
    type Check = (String, bool, bool);

    pub fn main() -> Result<()> {
        let mut dir = None;
        let mut out = None;
        let mut both = false;
        let mut invariant = std::env::var("PRISM_BATCH_INVARIANT").is_ok_and(|v| v == "1" || v == "true");
        for a in std::env::args().skip(1) {
            match a.as_str() {
                "--both-modes" => both = true,
                "--batch-invariant" => invariant = true,
                s if s.starts_with("--") => bail!("unknown flag {s}"),
                _ if dir.is_none() => dir = Some(PathBuf::from(a)),
                _ if out.is_none() => out = Some(PathBuf::from(a)),
                _ => bail!("usage: cuda_engine_parity DIR [OUT.json] [--batch-invariant | --both-modes]"),
            }
        }
        let dir = dir.context("usage: cuda_engine_parity DIR [OUT.json] [--batch-invariant | --both-modes]")?;
        let r = reference(&dir)?;
        let min_margin = r.hf.as_ref().map(|(_, m)| m.iter().flatten().copied().fold(f64::INFINITY, f64::min));
        let confident = min_margin.is_some_and(|m| m >= CONFIDENT_MARGIN);
        let from_reference = r.prompts.is_some();
        let mut prompts = r.prompts;

        let modes: Vec<bool> = if both { vec![true, false] } else { vec![invariant] };
        let mut runs = Vec::new();
        for &m in &modes {
            runs.push(run_mode(&dir, &mut prompts, m)?);
        }
        let ps = prompts.unwrap_or_default();
        println!(
            "prompts: {} ({}), lengths {:?}; HF f32 min top-2 margin over {NEW} steps: {} -> HF/mode comparisons {}",
            ps.len(),
            if from_reference { "reference.json parity_prompts" } else { "formula" },
            ps.iter().map(Vec::len).collect::<Vec<_>>(),
            min_margin.map_or("n/a".into(), |m| format!("{m:.3}")),
            if confident { "strict" } else { "information" }
        );

        let mut checks: Vec<Check> = Vec::new();
        for m in &runs {
            let n = mode_name(m.invariant);
            checks.push((format!("{n}/batched"), m.batched == m.alone, true));
            checks.push((format!("{n}/chunked_prefill_7_tokens"), m.chunked == m.alone, true));
            checks.push((format!("{n}/preemption"), m.preempted == m.alone, true));
            checks.push((format!("{n}/preemptions_happened"), m.preemptions > 0, true));
            checks.push((format!("{n}/prefix_cache_cold"), m.cold == m.alone, true));
            checks.push((format!("{n}/prefix_cache_warm"), m.warm == m.alone, true));
            checks.push((format!("{n}/prefix_cache_hits_counted"), m.prefix_hits > 0, true));
            checks.push((format!("{n}/prefix_cache_partial"), m.partial == m.partial_ref, true));
            if let Some((hf, _)) = &r.hf {
                checks.push((format!("{n}/alone_eq_hf_f32"), &m.alone == hf, confident));
            }
        }
        if runs.len() == 2 {
            checks.push(("modes_agree".into(), runs[0].alone == runs[1].alone, confident));
        }
        for (name, ok, strict) in &checks {
            println!("{name}: {}{}", if *ok { "ok" } else { "FAIL" }, if *strict { "" } else { " (information)" });
        }
        let pass = checks.iter().all(|(_, ok, strict)| *ok || !*strict);
        if !pass {
            for m in &runs {
                println!(
                    "[{}]\nalone     {:?}\nbatched   {:?}\nchunked   {:?}\npreempted {:?}\nwarm      {:?}\npartial   {:?}\npart_ref  {:?}",
                    mode_name(m.invariant),
                    m.alone,
                    m.batched,
                    m.chunked,
                    m.preempted,
                    m.warm,
                    m.partial,
                    m.partial_ref
                );
            }
            if let Some((hf, _)) = &r.hf {
                println!("hf_f32    {hf:?}");
            }
        }
        if let Some(out) = out {
            let report = json!({
                "dir": dir.display().to_string(), "prompt_lens": ps.iter().map(Vec::len).collect::<Vec<_>>(),
                "prompts_from_reference": from_reference, "new_tokens": NEW, "hf_min_margin_f32": min_margin,
                "hf_comparisons_strict": confident,
                "modes": runs.iter().map(|m| json!({
                    "mode": mode_name(m.invariant), "batch_invariant": m.invariant, "kv_blocks": m.kv_blocks,
                    "preemptions": m.preemptions, "alone": m.alone, "seconds": m.seconds,
                    "prefix_cache_hits": m.prefix_hits,
                })).collect::<Vec<_>>(),
                "checks": checks.iter().map(|(n, ok, strict)| json!({"name": n, "pass": ok, "strict": strict})).collect::<Vec<_>>(),
                "pass": pass,
            });
            std::fs::write(out, serde_json::to_string_pretty(&report)?)?;
        }
        println!("cuda_engine_parity: {}", if pass { "PASS" } else { "FAIL" });
        if !pass {
            std::process::exit(1);
        }
        Ok(())
    }
}
