//! Parallel CUDA replicas on ONE GPU (built with `--features cuda`; run on the GPU machine):
//! parity of sharded / staged / rank-process replicas with the unsharded backend and with
//! Hugging Face, and the rank-process overhead of a one-rank replica at batch-1 decode.
//!
//! `cuda_parallel --rank-program .gpu-bin/prism-rank [--model DIR] [--speed-model DIR] [--steps N] [--two-gpus]`
//!
//! - `--model DIR`: the trained reference model of `scripts/gpu/hf_reference.py` (its
//!   `reference.json`: 8 prompts, HF f32 last-token logits, 64 HF f32 greedy tokens each,
//!   `hf_bf16_vs_f32_max_abs`). The unsharded `CudaBackend` (fast mode, loaded from the
//!   safetensors) runs every prompt alone: last-token logits and 64 greedy tokens. Then the same
//!   through a `ParallelBackend` in each layout — `tp2_host` (TP=2, both ranks on GPU 0, host
//!   collectives), `pp2_host` (PP=2, host collectives), `tp1_rank_process` (one rank, run as a
//!   child process: `rank0_in_process: false`). A layout passes when its logits are within the
//!   HF bound (`2 · e_hf + 0.01`, as `cuda_check`) of HF f32 and all 64 × 8 greedy tokens equal
//!   both the unsharded backend's and HF's; the max |logit diff| against the unsharded backend
//!   is reported (0 is expected for the layouts without TP: same kernels, f32 residual sent).
//! - `--speed-model DIR`: a Llama-3-8B-shape checkpoint (`hf_trace.py --save`). The unsharded
//!   backend and a one-rank `ParallelBackend` (rank process on the same GPU) both load it;
//!   batch-1 greedy decode steps at a 512-token context run in rounds of 10 back-to-back steps
//!   alternating between the two, each timed wall clock to its host synchronisation; p50 over
//!   `--steps` (≥ 200), the ratio, and the rank's own compute time per step (its `StepDone`)
//!   with the rest of the step (the control path's overhead).
//!
//! - `--two-gpus` (a two-GPU machine): the parity check also runs `tp2_nccl` and `pp2_nccl`
//!   (ranks on GPUs 0 and 1, NCCL all-reduces captured in the decode graphs, `ncclSend` /
//!   `ncclRecv` between the stages).
//!
//! Prints one JSON line per check (`"check": "parity" | "speed"`, `"pass"`), then
//! `cuda_parallel: PASS|FAIL`, and exits 1 when one fails.

#[cfg(feature = "cuda")]
fn main() -> anyhow::Result<()> {
    run::main()
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("cuda_parallel needs --features cuda");
    std::process::exit(2);
}

#[cfg(feature = "cuda")]
mod run {
    use std::path::{Path, PathBuf};
    use std::time::{Duration, Instant};

    use anyhow::{Context, bail};
    use prism_engine::backend::cuda::{CudaBackend, CudaOptions};
    use prism_engine::backend::{Backend, SeqStep, StepBatch, StepControl};
    use prism_engine::model::safetensors::open_dir_model;
    use prism_engine::parallel::driver::DriverModel;
    use prism_engine::parallel::spawn::RankProgram;
    use prism_engine::parallel::stage::{InitSpec, StageBackendKind};
    use prism_engine::parallel::{ParallelBackend, ParallelConfig, ParallelSizes};
    use serde_json::{Value, json};

    const BS: usize = 16;
    const NEW: usize = 64;
    /// Parity runs: KV budget of every backend / rank (the reference model needs ~2 KiB per token).
    const PARITY_KV: u64 = 256 << 20;
    /// Speed runs: KV budget of each of the two 8B backends sharing the GPU.
    const SPEED_KV: u64 = 4 << 30;
    const SPEED_CTX: usize = 512;

    struct Args {
        rank_program: PathBuf,
        model: Option<PathBuf>,
        speed_model: Option<PathBuf>,
        steps: usize,
        two_gpus: bool,
    }

    fn parse() -> anyhow::Result<Args> {
        let mut a = Args { rank_program: PathBuf::new(), model: None, speed_model: None, steps: 300, two_gpus: false };
        let mut it = std::env::args().skip(1);
        while let Some(flag) = it.next() {
            let mut val = || it.next().with_context(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--rank-program" => a.rank_program = val()?.into(),
                "--model" => a.model = Some(val()?.into()),
                "--speed-model" => a.speed_model = Some(val()?.into()),
                "--steps" => a.steps = val()?.parse().context("--steps")?,
                "--two-gpus" => a.two_gpus = true,
                other => bail!("unknown flag {other} (see the example's doc)"),
            }
        }
        if a.rank_program.as_os_str().is_empty() || !a.rank_program.is_file() {
            bail!("--rank-program must name the prism-rank binary (built with --features cuda)");
        }
        if a.steps < 200 {
            bail!("--steps must be >= 200 (p50 over at least 200 steps)");
        }
        Ok(a)
    }

    pub fn main() -> anyhow::Result<()> {
        let args = parse()?;
        let mut pass = true;
        if let Some(dir) = &args.model {
            pass &= parity(dir, &args.rank_program, args.two_gpus)?;
        }
        if let Some(dir) = &args.speed_model {
            pass &= speed(dir, &args.rank_program, args.steps)?;
        }
        if args.model.is_none() && args.speed_model.is_none() {
            bail!("nothing to run: pass --model and/or --speed-model");
        }
        if !pass {
            println!("cuda_parallel: FAIL (see the lines with \"pass\": false)");
            std::process::exit(1);
        }
        println!("cuda_parallel: PASS");
        Ok(())
    }

    /// One parallel layout.
    struct Layout {
        name: &'static str,
        sizes: ParallelSizes,
        host_collectives: bool,
        rank0_in_process: bool,
        /// CUDA ordinal of each rank.
        devices: Vec<u32>,
    }

    impl Layout {
        /// Every rank on GPU 0.
        fn one_gpu(name: &'static str, tp: usize, pp: usize, host_collectives: bool, rank0_in_process: bool) -> Self {
            let sizes = ParallelSizes::new(tp, pp);
            let devices = vec![0; sizes.world_size()];
            Self { name, sizes, host_collectives, rank0_in_process, devices }
        }

        /// NCCL over GPUs 0 and 1 (a two-GPU machine).
        fn two_gpus(name: &'static str, tp: usize, pp: usize) -> Self {
            Self {
                name,
                sizes: ParallelSizes::new(tp, pp),
                host_collectives: false,
                rank0_in_process: true,
                devices: vec![0, 1],
            }
        }
    }

    /// What the driver and every rank get; the same limits as the unsharded options.
    fn init_spec(dir: &Path, opts: &CudaOptions, l: &Layout) -> InitSpec {
        InitSpec {
            model: dir.to_path_buf(),
            backend: StageBackendKind::Cuda,
            sizes: l.sizes,
            block_size: opts.block_size,
            kv_cache_bytes: opts.kv_cache_bytes,
            gpu_memory_utilization: opts.gpu_memory_utilization,
            max_num_batched_tokens: opts.max_num_batched_tokens,
            max_num_seqs: opts.max_num_seqs,
            batch_invariant: opts.batch_invariant,
            mesh: Vec::new(),
            collective_timeout_ms: 60_000,
            nccl_unique_id: None,
            engine_threads: None,
            host_collectives: l.host_collectives,
        }
    }

    /// Starts `l` (rank `i` on `l.devices[i]`).
    fn start(dir: &Path, opts: &CudaOptions, l: &Layout, program: &Path) -> anyhow::Result<ParallelBackend> {
        let world = l.sizes.world_size();
        let cfg = ParallelConfig {
            sizes: l.sizes,
            local_ranks: (0..world).collect(),
            rank_program: Some(RankProgram { program: program.to_path_buf(), args: Vec::new() }),
            join_timeout: Duration::from_secs(300),
            collective_timeout: Duration::from_secs(60),
            rank0_in_process: l.rank0_in_process,
            host_collectives: l.host_collectives,
            ..ParallelConfig::default()
        };
        let config = open_dir_model(dir)?.config;
        let model = DriverModel { config, weights: None, devices: l.devices.clone() };
        let be = ParallelBackend::start_with_model(&cfg, init_spec(dir, opts, l), StepControl::default(), model)
            .with_context(|| format!("starting the {} replica", l.name))?;
        Ok(be)
    }

    /// One sequence's step: its last `q` tokens (positions `ctx - q .. ctx`) over blocks
    /// `0..ctx/BS`.
    fn step(tokens: &[u32], q: usize) -> StepBatch {
        let ctx = tokens.len();
        let blocks: Vec<u32> = (0..ctx.div_ceil(BS) as u32).collect();
        let mut b = StepBatch::default();
        for p in ctx - q..ctx {
            b.token_ids.push(tokens[p]);
            b.positions.push(p as u32);
            b.slot_mapping.push(blocks[p / BS] * BS as u32 + (p % BS) as u32);
        }
        b.seqs.push(SeqStep { query_start: 0, query_len: q, context_len: ctx, block_table: blocks, want_logits: true });
        b
    }

    /// Per prompt, one at a time (each reuses blocks from 0): the prefill's last-token logits
    /// and 64 greedy tokens (the first from those logits, then device greedy decode steps).
    fn run_prompts(be: &mut dyn Backend, prompts: &[Vec<u32>]) -> anyhow::Result<Vec<(Vec<f32>, Vec<u32>)>> {
        let mut out = Vec::new();
        for p in prompts {
            let lg = be.forward(&step(p, p.len()))?;
            if lg.rows != 1 {
                bail!("prefill returned {} logit rows, not 1", lg.rows);
            }
            let logits = lg.row(0).to_vec();
            let mut seq = p.clone();
            let mut toks = vec![prism_engine::sampler::argmax(&logits)];
            seq.push(toks[0]);
            while toks.len() < NEW {
                let t = *be.forward_greedy(&step(&seq, 1))?.first().context("a decode step returned no token")?;
                toks.push(t);
                seq.push(t);
            }
            out.push((logits, toks));
        }
        Ok(out)
    }

    fn col<T: serde::de::DeserializeOwned>(v: &Value, k: &str) -> anyhow::Result<T> {
        serde_json::from_value(v.get(k).cloned().with_context(|| format!("reference.json lacks {k}"))?)
            .with_context(|| format!("reference.json {k}"))
    }

    fn max_abs_f64(a: &[f32], b: &[f64]) -> f64 {
        if a.len() != b.len() {
            return f64::INFINITY;
        }
        a.iter().zip(b).map(|(x, y)| (f64::from(*x) - y).abs()).fold(0.0, f64::max)
    }

    fn max_abs(a: &[f32], b: &[f32]) -> f64 {
        if a.len() != b.len() {
            return f64::INFINITY;
        }
        a.iter().zip(b).map(|(x, y)| f64::from((x - y).abs())).fold(0.0, f64::max)
    }

    /// Parity of every layout with the unsharded backend and HF; prints one line each.
    fn parity(dir: &Path, program: &Path, two_gpus: bool) -> anyhow::Result<bool> {
        let path = dir.join("reference.json");
        let raw = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
        let v: Value = serde_json::from_str(&raw).with_context(|| format!("parsing {}", path.display()))?;
        let prompts: Vec<Vec<u32>> = col(&v, "prompts")?;
        let hf_logits: Vec<Vec<f64>> = col(&v, "logits_f32")?;
        let hf_greedy: Vec<Vec<u32>> = col(&v, "greedy_f32")?;
        let e_hf: f64 = col(&v, "hf_bf16_vs_f32_max_abs")?;
        if prompts.is_empty() || hf_logits.len() != prompts.len() || hf_greedy.len() != prompts.len() {
            bail!("{}: inconsistent columns", path.display());
        }
        let bound = 2.0 * e_hf + 0.01;
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(1);
        let opts = CudaOptions {
            kv_cache_bytes: Some(PARITY_KV),
            block_size: BS,
            max_num_batched_tokens: longest.next_power_of_two().max(512),
            max_num_seqs: 8,
            ..CudaOptions::default()
        };
        let base = {
            let m = open_dir_model(dir)?;
            let mut be = CudaBackend::from_safetensors(&m.files, &m.config, &opts, &|_, _| {})?;
            run_prompts(&mut be, &prompts)?
        };
        let versus_hf = |got: &[(Vec<f32>, Vec<u32>)]| {
            let e = got.iter().zip(&hf_logits).map(|(g, h)| max_abs_f64(&g.0, h)).fold(0.0, f64::max);
            let equal = got.iter().zip(&hf_greedy).filter(|(g, h)| g.1 == **h).count();
            (e, equal)
        };
        let (e_base, eq_base) = versus_hf(&base);
        let base_pass = e_base <= bound && eq_base == prompts.len();
        println!(
            "{}",
            json!({"check": "parity", "config": "unsharded", "vs_hf_max_abs": e_base, "bound": bound,
                   "prompts": prompts.len(), "greedy_equal_hf": eq_base, "pass": base_pass})
        );
        let mut pass = base_pass;
        let mut layouts = vec![
            Layout::one_gpu("tp2_host", 2, 1, true, true),
            Layout::one_gpu("pp2_host", 1, 2, true, true),
            Layout::one_gpu("tp1_rank_process", 1, 1, false, false),
        ];
        if two_gpus {
            layouts.push(Layout::two_gpus("tp2_nccl", 2, 1));
            layouts.push(Layout::two_gpus("pp2_nccl", 1, 2));
        }
        for l in &layouts {
            let t0 = Instant::now();
            let got = start(dir, &opts, l, program).and_then(|mut be| {
                let started = t0.elapsed().as_secs_f64();
                run_prompts(&mut be, &prompts).map(|r| (r, started))
            });
            let line = match got {
                Ok((got, start_s)) => {
                    let (e_hf_l, eq_hf) = versus_hf(&got);
                    let e_vs_base = got.iter().zip(&base).map(|(g, b)| max_abs(&g.0, &b.0)).fold(0.0, f64::max);
                    let eq_base = got.iter().zip(&base).filter(|(g, b)| g.1 == b.1).count();
                    let ok = e_hf_l <= bound && eq_hf == prompts.len() && eq_base == prompts.len();
                    pass &= ok;
                    json!({"check": "parity", "config": l.name, "vs_unsharded_max_abs": e_vs_base,
                           "vs_hf_max_abs": e_hf_l, "bound": bound, "prompts": prompts.len(),
                           "greedy_equal_unsharded": eq_base, "greedy_equal_hf": eq_hf,
                           "start_seconds": start_s, "pass": ok})
                }
                Err(e) => {
                    pass = false;
                    json!({"check": "parity", "config": l.name, "error": format!("{e:#}"), "pass": false})
                }
            };
            println!("{line}");
        }
        Ok(pass)
    }

    /// A batch-1 decode step at `SPEED_CTX` (the same slot each time: timing does not depend on
    /// the cache's contents).
    fn decode_step() -> StepBatch {
        let tokens: Vec<u32> = (0..SPEED_CTX).map(|p| ((p * 7919) % 128_000) as u32).collect();
        step(&tokens, 1)
    }

    fn p50(v: &mut [f64]) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    /// Unsharded backend vs a one-rank replica in a rank process, interleaved; one line.
    fn speed(dir: &Path, program: &Path, steps: usize) -> anyhow::Result<bool> {
        let opts = CudaOptions {
            kv_cache_bytes: Some(SPEED_KV),
            block_size: BS,
            max_num_batched_tokens: 2048,
            max_num_seqs: 256,
            ..CudaOptions::default()
        };
        let m = open_dir_model(dir)?;
        let t0 = Instant::now();
        let mut base = CudaBackend::from_safetensors(&m.files, &m.config, &opts, &|_, _| {})?;
        let base_init = t0.elapsed().as_secs_f64();
        drop(m);
        let l = Layout::one_gpu("tp1_rank_process", 1, 1, false, false);
        let t0 = Instant::now();
        let mut par = start(dir, &opts, &l, program)?;
        let par_init = t0.elapsed().as_secs_f64();
        // The context's KV once (prefill), then warm-up decode steps (graph capture on the
        // second use of a bucket).
        let tokens: Vec<u32> = (0..SPEED_CTX).map(|p| ((p * 7919) % 128_000) as u32).collect();
        let prefill = step(&tokens, SPEED_CTX);
        base.forward_greedy(&prefill)?;
        Backend::forward_greedy(&mut par, &prefill)?;
        let b = decode_step();
        // Rounds of back-to-back steps on each backend in turn (as a serving loop sends
        // them; interleaving the rounds cancels clock drift), the first round a warm-up.
        const ROUND: usize = 10;
        let (mut tb, mut tp) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
        let (mut compute, mut overhead) = (Vec::with_capacity(steps), Vec::with_capacity(steps));
        let (mut same, mut first) = (true, None);
        let rounds = steps.div_ceil(ROUND) + 1;
        for r in 0..rounds {
            let mut ids = Vec::with_capacity(ROUND);
            for _ in 0..ROUND {
                let t = Instant::now();
                ids.push(base.forward_greedy(&b)?);
                if r > 0 {
                    tb.push(t.elapsed().as_secs_f64());
                }
            }
            for a in ids {
                let t = Instant::now();
                let p = Backend::forward_greedy(&mut par, &b)?;
                let dt = t.elapsed().as_secs_f64();
                let timing = par.last_step_timing().ok_or_else(|| anyhow::anyhow!("no step timing"))?;
                same &= a == p;
                first.get_or_insert((a, p));
                if r > 0 {
                    tp.push(dt);
                    compute.push(timing.rank_compute.as_secs_f64());
                    overhead.push(dt - timing.rank_compute.as_secs_f64());
                }
            }
        }
        let (pb, pp) = (p50(&mut tb), p50(&mut tp));
        let (pc, po) = (p50(&mut compute), p50(&mut overhead));
        let ratio = pp / pb;
        println!(
            "{}",
            json!({"check": "speed", "config": "tp1_rank_process", "context": SPEED_CTX, "steps": tp.len(),
                   "unsharded_p50_ms": pb * 1e3, "rank_process_p50_ms": pp * 1e3, "ratio": ratio,
                   "rank_compute_p50_ms": pc * 1e3, "control_overhead_p50_ms": po * 1e3,
                   "unsharded_tok_s": 1.0 / pb, "rank_process_tok_s": 1.0 / pp,
                   "init_seconds": {"unsharded": base_init, "rank_process": par_init},
                   "argmax_equal": same, "first_argmax": first.map(|(a, p)| json!([a, p])),
                   "graph_replays_unsharded": base.graph_replays, "pass": same})
        );
        Ok(same)
    }
}
