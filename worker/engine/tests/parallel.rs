//! Parallel replicas on the CPU backend with the bundled SmolLM2-135M (30 layers, 9 heads,
//! 3 KV heads): tensor-parallel, pipeline-parallel and TP×PP groups against the unsharded
//! backend on the same batches (logits within 1e-4, argmax equal) — stages on threads over
//! an in-process communicator, and whole groups of rank processes (`prism-rank`) behind a
//! `ParallelBackend`; greedy tokens through `EngineHandle`; splits the model cannot take are
//! refused before any process starts; a rank killed or frozen mid-stream fails the replica
//! quickly and leaves no rank process behind.
//!
//! The tests skip (printing a notice) only when the model file is missing and
//! `PRISM_REQUIRE_MODEL` is unset.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use prism_engine::backend::cpu::CpuBackend;
use prism_engine::backend::cpu::stage::build_cpu_stage;
use prism_engine::backend::{Backend, Logits, SeqStep, StepBatch, StepControl};
use prism_engine::model::{LoadOptions, LoadedModel, ModelSource, load_model_with};
use prism_engine::parallel::comm::{AbortHandle, CommError, Communicator};
use prism_engine::parallel::layout::ParallelSizes;
use prism_engine::parallel::rank::{RankSpec, Rendezvous};
use prism_engine::parallel::spawn::{RankProgram, spawn_rank};
use prism_engine::parallel::stage::{InitSpec, StageBackendKind, StageContext, StageOutput, run_micro_batches};
use prism_engine::parallel::{ParallelBackend, ParallelConfig};
use prism_engine::{EngineConfig, EngineError, EngineHandle, EngineRequest, Prompt, SamplingParams};

const BLOCK: usize = 16;
const KV_BYTES: u64 = 32 << 20;

fn model_path() -> Result<Option<PathBuf>> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    if path.exists() {
        return Ok(Some(path));
    }
    if std::env::var_os("PRISM_REQUIRE_MODEL").is_some() {
        bail!("{} is missing and PRISM_REQUIRE_MODEL is set", path.display());
    }
    eprintln!("SKIPPED: {} not found (run scripts/fetch-model.sh)", path.display());
    Ok(None)
}

fn load(path: &Path) -> Result<LoadedModel> {
    Ok(load_model_with(&ModelSource::detect(path)?, None, LoadOptions { keep_quantized: true })?)
}

fn rank_program() -> RankProgram {
    RankProgram { program: env!("CARGO_BIN_EXE_prism-rank").into(), args: Vec::new() }
}

fn init_spec(path: &Path, sizes: ParallelSizes, kv_bytes: u64) -> InitSpec {
    InitSpec {
        model: path.to_path_buf(),
        backend: StageBackendKind::Cpu,
        sizes,
        block_size: BLOCK,
        kv_cache_bytes: Some(kv_bytes),
        gpu_memory_utilization: 0.9,
        max_num_batched_tokens: 512,
        max_num_seqs: 16,
        batch_invariant: false,
        mesh: Vec::new(),
        collective_timeout_ms: 30_000,
        nccl_unique_id: None,
        engine_threads: Some(1),
        host_collectives: false,
    }
}

fn parallel_config(sizes: ParallelSizes) -> ParallelConfig {
    ParallelConfig {
        sizes,
        local_ranks: (0..sizes.world_size()).collect(),
        rank_program: Some(rank_program()),
        join_timeout: Duration::from_secs(60),
        ..ParallelConfig::default()
    }
}

/// A fixed run: a prefill of three prompts in one step, then decode steps feeding each
/// sequence the unsharded model's argmax. Sequence `i` uses blocks `4i..4i+4`.
struct Script {
    batches: Vec<StepBatch>,
    reference: Vec<Logits>,
}

fn argmax(row: &[f32]) -> u32 {
    prism_engine::sampler::argmax(row)
}

fn script(m: LoadedModel, decode_steps: usize) -> Result<Script> {
    let prompts: Vec<Vec<u32>> = ["The capital of France is", "def fib(n):", "Hello there, my"]
        .iter()
        .map(|p| m.tokenizer.encode(p, false))
        .collect::<Result<_, _>>()?;
    let mut whole = CpuBackend::new(m.weights, &m.config, KV_BYTES, BLOCK)?;
    let mut seqs: Vec<Vec<u32>> = prompts.clone();
    let mut done: Vec<usize> = vec![0; seqs.len()];
    let (mut batches, mut reference) = (Vec::new(), Vec::new());
    for _ in 0..=decode_steps {
        let mut b = StepBatch::default();
        for (i, s) in seqs.iter().enumerate() {
            let start = b.token_ids.len();
            for (p, &t) in s.iter().enumerate().skip(done[i]) {
                b.token_ids.push(t);
                b.positions.push(p as u32);
                b.slot_mapping.push((i * 4 * BLOCK + p) as u32);
            }
            let block_table = (0..s.len().div_ceil(BLOCK) as u32).map(|k| i as u32 * 4 + k).collect();
            let query_len = s.len() - done[i];
            b.seqs.push(SeqStep {
                query_start: start,
                query_len,
                context_len: s.len(),
                block_table,
                want_logits: true,
            });
        }
        let logits = whole.forward(&b)?;
        for (i, s) in seqs.iter_mut().enumerate() {
            done[i] = s.len();
            s.push(argmax(logits.row(i)));
        }
        batches.push(b);
        reference.push(logits);
    }
    Ok(Script { batches, reference })
}

fn compare(what: &str, got: &[Logits], want: &[Logits]) -> Result<()> {
    ensure!(got.len() == want.len(), "{what}: {} steps, want {}", got.len(), want.len());
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        ensure!(g.rows == w.rows && g.vocab_size == w.vocab_size, "{what} step {step}: shape");
        let d = g.data.iter().zip(&w.data).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        ensure!(d <= 1e-4, "{what} step {step}: max |logit diff| {d}");
        for r in 0..g.rows {
            ensure!(argmax(g.row(r)) == argmax(w.row(r)), "{what} step {step} row {r}: argmax differs");
        }
    }
    eprintln!("{what}: {} steps within 1e-4 of the unsharded backend", got.len());
    Ok(())
}

/// An in-process communicator for stages on threads: one channel per ordered pair of
/// ranks; an all-reduce sends the buffer to every other member and sums all members'
/// buffers in ascending rank order (bitwise the same result on every member).
struct LocalComm {
    rank: usize,
    to: Vec<Option<Sender<Vec<f32>>>>,
    from: Vec<Option<Receiver<Vec<f32>>>>,
    abort: AbortHandle,
}

impl LocalComm {
    fn mesh(world: usize) -> Vec<LocalComm> {
        let mut comms: Vec<LocalComm> = (0..world)
            .map(|rank| LocalComm {
                rank,
                to: (0..world).map(|_| None).collect(),
                from: (0..world).map(|_| None).collect(),
                abort: AbortHandle::default(),
            })
            .collect();
        for a in 0..world {
            for b in 0..world {
                if a != b {
                    let (tx, rx) = channel();
                    comms[a].to[b] = Some(tx);
                    comms[b].from[a] = Some(rx);
                }
            }
        }
        comms
    }

    fn get(&mut self, peer: usize) -> Result<Vec<f32>, CommError> {
        let rx = self.from[peer].as_ref().ok_or_else(|| CommError::Invalid(format!("no peer {peer}")))?;
        rx.recv_timeout(Duration::from_secs(30)).map_err(|e| CommError::PeerGone { peer, message: e.to_string() })
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.to.len()
    }
    fn all_reduce_sum(&mut self, group: &[usize], buf: &mut [f32]) -> Result<(), CommError> {
        let me = self.rank;
        for &p in group.iter().filter(|&&p| p != me) {
            self.send(p, buf)?;
        }
        let mut sum: Option<Vec<f32>> = None;
        for &p in group {
            let part = if p == self.rank { buf.to_vec() } else { self.get(p)? };
            match &mut sum {
                None => sum = Some(part),
                Some(s) => s.iter_mut().zip(&part).for_each(|(a, b)| *a += b),
            }
        }
        buf.copy_from_slice(&sum.unwrap_or_default());
        Ok(())
    }
    fn all_gather(&mut self, _group: &[usize], _local: &[f32], _out: &mut [f32]) -> Result<(), CommError> {
        Err(CommError::Invalid("not used by the CPU stages".into()))
    }
    fn send(&mut self, peer: usize, buf: &[f32]) -> Result<(), CommError> {
        let tx = self.to[peer].as_ref().ok_or_else(|| CommError::Invalid(format!("no peer {peer}")))?;
        tx.send(buf.to_vec()).map_err(|e| CommError::PeerGone { peer, message: e.to_string() })
    }
    fn recv(&mut self, peer: usize, buf: &mut [f32]) -> Result<(), CommError> {
        let got = self.get(peer)?;
        if got.len() != buf.len() {
            return Err(CommError::Invalid(format!("{} values, want {}", got.len(), buf.len())));
        }
        buf.copy_from_slice(&got);
        Ok(())
    }
    fn barrier(&mut self, _group: &[usize]) -> Result<(), CommError> {
        Ok(())
    }
    fn abort_handle(&self) -> AbortHandle {
        self.abort.clone()
    }
}

/// Runs the script's batches on a group of CPU stages on threads; returns the logits of
/// the last stage's tensor-parallel rank 0.
fn run_stages_in_process(
    m: &LoadedModel,
    path: &Path,
    sizes: ParallelSizes,
    micro: usize,
    s: &Script,
) -> Result<Vec<Logits>> {
    let out_rank = sizes.rank_of(0, sizes.pipeline_parallel_size - 1);
    let kv = prism_engine::parallel::driver::rank_kv_budget(KV_BYTES, &m.config, sizes, BLOCK);
    let handles: Vec<_> = LocalComm::mesh(sizes.world_size())
        .into_iter()
        .map(|comm| {
            let coords = sizes.coords(comm.rank);
            let ctx = StageContext {
                init: init_spec(path, sizes, kv),
                coords,
                layers: sizes.stage_layers(coords.pp_rank, m.config.num_hidden_layers),
                device: None,
                comm: Box::new(comm),
            };
            let (weights, config, batches) = (m.weights.clone(), m.config.clone(), s.batches.clone());
            std::thread::spawn(move || -> Result<Vec<Logits>> {
                let mut stage = build_cpu_stage(ctx, Some((weights, config)), None)?;
                let mut got = Vec::new();
                for b in &batches {
                    let outs = run_micro_batches(&mut stage, b, false, micro)?;
                    let mut l = Logits { rows: 0, vocab_size: 0, data: Vec::new() };
                    for o in outs {
                        if let StageOutput::Logits(part) = o {
                            l.rows += part.rows;
                            l.vocab_size = part.vocab_size;
                            l.data.extend(part.data);
                        }
                    }
                    got.push(l);
                }
                Ok(got)
            })
        })
        .collect();
    let mut out = None;
    for (rank, h) in handles.into_iter().enumerate() {
        let got = h.join().map_err(|_| anyhow::anyhow!("rank {rank} panicked"))??;
        if rank == out_rank {
            out = Some(got);
        }
    }
    out.context("no output rank")
}

#[test]
fn cpu_stages_on_threads_match_the_unsharded_backend() -> Result<()> {
    let Some(path) = model_path()? else { return Ok(()) };
    let m = load(&path)?;
    let s = script(load(&path)?, 3)?;
    for (tp, pp, micro) in [(3, 1, 1), (1, 2, 2), (1, 3, 3), (3, 2, 2)] {
        let got = run_stages_in_process(&m, &path, ParallelSizes::new(tp, pp), micro, &s)?;
        compare(&format!("stages TP={tp} PP={pp} micro-batches {micro}"), &got, &s.reference)?;
    }
    Ok(())
}

/// One group of rank processes at a time (the fault tests count processes).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Live rank processes (by their `PRISM_RANK_SPEC`): `(pid, rank)` of those whose spec
/// names `rendezvous`, or of this process's children when `None`.
fn rank_processes(rendezvous: Option<&str>) -> Vec<(u32, usize)> {
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(env) = std::fs::read(entry.path().join("environ")) else { continue };
        let Some(spec) = env
            .split(|&b| b == 0)
            .find_map(|kv| kv.strip_prefix(b"PRISM_RANK_SPEC=").map(|v| String::from_utf8_lossy(v).into_owned()))
        else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // pid (comm) state ppid ...: fields after the last ')'.
        let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
        let fields: Vec<&str> = after.split_whitespace().collect();
        if fields.first() == Some(&"Z") {
            continue;
        }
        let ours = match rendezvous {
            Some(r) => spec.contains(&format!("\"rendezvous\":\"{r}\"")),
            None => fields.get(1) == Some(&me.as_str()),
        };
        if ours {
            let v: serde_json::Value = serde_json::from_str(&spec).unwrap_or_default();
            found.push((pid, v["rank"].as_u64().unwrap_or(u64::MAX) as usize));
        }
    }
    found
}

fn start_group(path: &Path, sizes: ParallelSizes, micro: Option<usize>) -> Result<ParallelBackend> {
    let cfg = ParallelConfig { micro_batches: micro, ..parallel_config(sizes) };
    let m = load(path)?;
    let kv = prism_engine::parallel::driver::rank_kv_budget(KV_BYTES, &m.config, sizes, BLOCK);
    Ok(ParallelBackend::start(&cfg, init_spec(path, sizes, kv), StepControl::default())?)
}

#[test]
fn rank_process_groups_match_the_unsharded_backend() -> Result<()> {
    let Some(path) = model_path()? else { return Ok(()) };
    let _serial = serial();
    let s = script(load(&path)?, 3)?;
    for (tp, pp, micro) in [(3, 1, None), (1, 2, None), (1, 3, Some(2)), (3, 2, None)] {
        let sizes = ParallelSizes::new(tp, pp);
        let started = Instant::now();
        let mut group = start_group(&path, sizes, micro)?;
        let load_time = started.elapsed();
        assert_eq!(group.rank_pids().len(), sizes.world_size() - 1, "rank 0 runs in this process");
        assert_eq!(group.num_kv_blocks(), (KV_BYTES / (30 * 2 * 192 * 4 * BLOCK as u64)) as usize);
        let got: Vec<Logits> = s.batches.iter().map(|b| group.forward(b)).collect::<Result<_, _>>()?;
        compare(&format!("rank processes TP={tp} PP={pp} (loaded in {load_time:?})"), &got, &s.reference)?;
        let address = group.rendezvous_address().to_owned();
        drop(group);
        ensure!(rank_processes(Some(&address)).is_empty(), "rank processes left after the group was dropped");
    }
    Ok(())
}

fn engine(path: &Path, parallel: Option<ParallelConfig>) -> Result<EngineHandle, EngineError> {
    let mut cfg = EngineConfig::new(path);
    cfg.kv_cache_bytes = Some(KV_BYTES);
    if let Some(p) = parallel {
        cfg.engine_threads = Some(1);
        cfg.parallel = p;
    }
    EngineHandle::start(cfg, None)
}

fn request(prompt: &str, max_tokens: i64) -> EngineRequest {
    EngineRequest {
        id: "parallel".into(),
        prompt: Prompt::Text(prompt.to_owned()),
        params: SamplingParams {
            temperature: 0.0,
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            ..Default::default()
        },
        prior_output_ids: Vec::new(),
        deadline: None,
        cache_salt: None,
        tools: None,
        chat_template_kwargs: None,
    }
}

const PROMPTS: [&str; 3] = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"];

/// Greedy tokens of the prompts, submitted together (one batch).
fn generate(e: &EngineHandle, max_tokens: i64) -> Result<Vec<Vec<u32>>> {
    let streams: Vec<_> = PROMPTS.iter().map(|p| e.submit(request(p, max_tokens))).collect::<Result<_, _>>()?;
    let mut out = Vec::new();
    for mut s in streams {
        let mut toks = Vec::new();
        let mut finish = None;
        while let Some(o) = s.blocking_recv() {
            toks.extend(o.token_ids);
            finish = finish.or(o.finish_reason);
        }
        ensure!(finish.is_some(), "a stream ended without a finish reason");
        out.push(toks);
    }
    Ok(out)
}

#[test]
fn parallel_replicas_generate_the_unsharded_replicas_greedy_tokens() -> Result<()> {
    let Some(path) = model_path()? else { return Ok(()) };
    let _serial = serial();
    let whole = engine(&path, None)?;
    let (want, blocks) = (generate(&whole, 32)?, whole.model_info().num_kv_blocks);
    whole.shutdown();
    assert!(want.iter().all(|t| t.len() == 32));
    for (tp, pp, micro) in [(3, 1, None), (3, 2, None), (1, 3, Some(2))] {
        let cfg = ParallelConfig { micro_batches: micro, ..parallel_config(ParallelSizes::new(tp, pp)) };
        let e = engine(&path, Some(cfg))?;
        assert_eq!(e.model_info().num_kv_blocks, blocks, "TP={tp} PP={pp}: the unsharded replica's KV blocks");
        assert_eq!(e.model_info().backend, "parallel");
        let got = generate(&e, 32)?;
        assert_eq!(got, want, "TP={tp} PP={pp} micro-batches {micro:?}: greedy tokens");
        e.shutdown();
    }
    ensure!(rank_processes(None).is_empty(), "rank processes left after shutdown");
    Ok(())
}

#[test]
fn splits_the_model_cannot_take_are_refused_before_any_rank_starts() -> Result<()> {
    let Some(path) = model_path()? else { return Ok(()) };
    let _serial = serial();
    let cases = [
        (
            ParallelSizes::new(2, 1),
            "tensor_parallel_size",
            "tensor_parallel_size 2 does not divide the model's num_attention_heads 9",
        ),
        (
            ParallelSizes::new(1, 31),
            "pipeline_parallel_size",
            "pipeline_parallel_size 31 is more than the model's num_hidden_layers 30",
        ),
    ];
    for (sizes, want_field, want_message) in cases {
        match engine(&path, Some(parallel_config(sizes))) {
            Err(EngineError::InvalidRequest { field, message }) => {
                assert_eq!(field, want_field);
                assert_eq!(message, want_message);
            }
            other => bail!("{sizes:?}: expected InvalidRequest, got {other:?}"),
        }
        ensure!(rank_processes(None).is_empty(), "{sizes:?}: a rank process was started");
    }
    Ok(())
}

fn signal(pid: u32, sig: &str) -> Result<()> {
    let st = std::process::Command::new("kill").args([sig, &pid.to_string()]).status()?;
    ensure!(st.success(), "kill {sig} {pid} failed");
    Ok(())
}

/// Starts a TP=3 replica on a rendezvous the test knows, streams a long greedy request and
/// returns once it has produced a few tokens.
fn streaming_replica(
    path: &Path,
    token: &str,
    tweak: impl FnOnce(&mut ParallelConfig),
) -> Result<(EngineHandle, String, prism_engine::OutputStream)> {
    let rdv = Arc::new(Rendezvous::bind(IpAddr::V4(Ipv4Addr::LOCALHOST), "127.0.0.1", token)?);
    let address = rdv.address().to_owned();
    let mut cfg = ParallelConfig { rendezvous: Some(rdv), ..parallel_config(ParallelSizes::new(3, 1)) };
    tweak(&mut cfg);
    let e = engine(path, Some(cfg))?;
    let mut s = e.submit(request("Tell me a long story about a dragon.", 600))?;
    let mut n = 0;
    while n < 3 {
        n += s.blocking_recv().context("the stream ended early")?.token_ids.len();
    }
    Ok((e, address, s))
}

/// Drains the stream; returns how long it took and whether it carried a finish reason.
fn drain_stream(mut s: prism_engine::OutputStream) -> (Duration, bool) {
    let t = Instant::now();
    let mut finished = false;
    while let Some(o) = s.blocking_recv() {
        finished |= o.finish_reason.is_some();
    }
    (t.elapsed(), finished)
}

fn wait_for(what: &str, within: Duration, mut f: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + within;
    while !f() {
        ensure!(Instant::now() < deadline, "{what} not within {within:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

#[test]
fn a_killed_rank_fails_the_replica_within_seconds_and_leaves_no_rank_behind() -> Result<()> {
    let Some(path) = model_path()? else { return Ok(()) };
    let _serial = serial();
    let (e, address, s) = streaming_replica(&path, "kill-test", |_| {})?;
    let ranks = rank_processes(Some(&address));
    assert_eq!(ranks.iter().map(|r| r.1).collect::<std::collections::BTreeSet<_>>(), [1, 2].into());
    let victim = ranks.iter().find(|r| r.1 == 1).context("rank 1")?.0;
    let killed = Instant::now();
    signal(victim, "-9")?;
    let (took, finished) = drain_stream(s);
    assert!(!finished, "the stream of a failed replica ends without a finish reason");
    assert!(took < Duration::from_secs(5), "the stream ended {took:?} after the kill");
    wait_for("the engine dead", Duration::from_secs(5).saturating_sub(killed.elapsed()), || !e.is_alive())?;
    wait_for("no rank process left", Duration::from_secs(2), || rank_processes(Some(&address)).is_empty())?;
    // The engine's failure names the killed rank (the agent reports it as the replica's reason).
    let why = e.failure().context("a failed engine says why")?;
    assert!(why.contains("rank 1"), "{why}");
    eprintln!("kill -9 of rank 1: stream ended after {took:?}: {why}");
    Ok(())
}

#[test]
fn a_frozen_rank_fails_the_replica_after_the_collective_timeout_and_never_rejoins() -> Result<()> {
    let Some(path) = model_path()? else { return Ok(()) };
    let _serial = serial();
    // Rank 2 joins from outside the driver (as from another node), so the driver cannot
    // kill it: after SIGCONT it must notice by itself that its group is gone.
    let token = "stop-test";
    let mut outsider = None;
    let (e, address, s) = streaming_replica(&path, token, |cfg| {
        cfg.local_ranks = vec![0, 1];
        cfg.collective_timeout = Duration::from_secs(3);
        let spec = RankSpec {
            rendezvous: cfg.rendezvous.as_ref().map(|r| r.address().to_owned()).unwrap_or_default(),
            token: token.into(),
            rank: 2,
            device: None,
            bind_ip: Some(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            advertise_host: "127.0.0.1".into(),
            engine_threads: Some(1),
        };
        outsider = Some(spawn_rank(&rank_program(), &spec));
    })?;
    let mut outsider = outsider.context("rank 2 not started")??;
    signal(outsider.pid(), "-STOP")?;
    let (took, finished) = drain_stream(s);
    assert!(!finished, "the stream of a failed replica ends without a finish reason");
    assert!(took < Duration::from_secs(6), "the stream ended {took:?} after SIGSTOP (collective timeout 3 s)");
    wait_for("the engine dead", Duration::from_secs(2), || !e.is_alive())?;
    // The failure names the frozen rank, not a peer that waited on it.
    let why = e.failure().context("a failed engine says why")?;
    assert!(why.contains("rank 2 did not answer"), "{why}");
    eprintln!("SIGSTOP of rank 2: {why}");
    wait_for("rank 1 gone", Duration::from_secs(2), || rank_processes(Some(&address)).iter().all(|r| r.1 == 2))?;
    signal(outsider.pid(), "-CONT")?;
    wait_for("the continued rank exited", Duration::from_secs(10), || matches!(outsider.try_wait(), Ok(Some(_))))?;
    assert!(!e.is_alive(), "a continued rank does not bring the group back");
    assert!(e.submit(request("hi", 4)).is_err() || !e.is_alive());
    eprintln!("SIGSTOP of rank 2: stream ended after {took:?}");
    Ok(())
}

/// A one-sequence step at `pos` (prefill of `0..=pos` when `prefill`), sequence blocks `0..`.
fn one_seq_step(token: u32, pos: usize, prefill: bool) -> StepBatch {
    let start = if prefill { 0 } else { pos };
    let n = pos + 1 - start;
    StepBatch {
        token_ids: vec![token; n],
        positions: (start as u32..=pos as u32).collect(),
        slot_mapping: (start as u32..=pos as u32).collect(),
        seqs: vec![SeqStep {
            query_start: 0,
            query_len: n,
            context_len: pos + 1,
            block_table: (0..(pos + 1).div_ceil(BLOCK) as u32).collect(),
            want_logits: true,
        }],
    }
}

/// The rank-process overhead of a one-rank replica: the plain CPU backend against a
/// `ParallelBackend` with its one rank in this process and one whose only rank is a child
/// process (`rank0_in_process: false`), all on every core, greedy decode steps of one
/// sequence interleaved in rounds; and the control round trip of an empty step.
#[test]
#[ignore = "measurement"]
fn one_rank_process_overhead_per_decode_step() -> Result<()> {
    let Some(path) = model_path()? else { return Ok(()) };
    let _serial = serial();
    let m = load(&path)?;
    // RAYON_NUM_THREADS sizes this process's pool (the plain backend's) and the ranks' alike.
    let threads = std::env::var("RAYON_NUM_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get));
    let mut plain = CpuBackend::new(m.weights, &m.config, KV_BYTES, BLOCK)?;
    let sizes = ParallelSizes::new(1, 1);
    let cfg = ParallelConfig { rank0_in_process: false, ..parallel_config(sizes) };
    let init = InitSpec { engine_threads: Some(threads), ..init_spec(&path, sizes, KV_BYTES) };
    let mut group = ParallelBackend::start(&cfg, init.clone(), StepControl::default())?;
    let in_process_cfg = parallel_config(sizes);
    let mut in_process = ParallelBackend::start(&in_process_cfg, init, StepControl::default())?;
    let mut times = [Duration::ZERO; 3];
    let (prompt, rounds, per_round) = (16, 16, 8);
    {
        let mut backends: [&mut dyn Backend; 3] = [&mut plain, &mut in_process, &mut group];
        for b in backends.iter_mut() {
            b.forward(&one_seq_step(42, prompt - 1, true))?;
        }
        let mut pos = [prompt; 3];
        for _ in 0..rounds {
            for (i, b) in backends.iter_mut().enumerate() {
                let t = Instant::now();
                for _ in 0..per_round {
                    b.forward_greedy(&one_seq_step(42, pos[i], false))?;
                    pos[i] += 1;
                }
                times[i] += t.elapsed();
            }
        }
    }
    // An empty step (no sequence): the control round trip alone.
    let empty = StepBatch::default();
    let t = Instant::now();
    for _ in 0..200 {
        group.forward_greedy(&empty)?;
    }
    eprintln!("empty step round trip to a rank process: {:?}", t.elapsed() / 200);
    let steps = (rounds * per_round) as u32;
    let [a, b, c] = times.map(|t| t / steps);
    let pct = |x: Duration| (x.as_secs_f64() / a.as_secs_f64() - 1.0) * 100.0;
    eprintln!(
        "greedy decode step, batch 1, {threads} threads: plain CpuBackend {a:?}; ParallelBackend with rank 0 in process {b:?} ({:+.1}%); rank 0 a child process {c:?} ({:+.1}%)",
        pct(b),
        pct(c)
    );
    Ok(())
}
