//! Parallel replicas end to end, on real processes and the real model
//! (`models/SmolLM2-135M-Instruct.Q4_1.gguf`, CPU engine: 9 heads and 3 KV heads, so the
//! tensor-parallel size is 1 or 3): `prism-head`, `prism-worker`s whose parallel replicas
//! run rank 0 in the worker and every other rank as a `prism-worker` process started with
//! `PRISM_RANK_SPEC`, and `prism-router`.
//!
//! - A TP=3, a PP=2 and a TP=3 × PP=2 replica on one worker give, through the router's
//!   OpenAI HTTP API, exactly the greedy text of an unsharded replica of the same model.
//! - A TP=1 × PP=2 replica on two workers of one CPU slot each (no worker holds it, so the
//!   head gang-schedules a stage on each): the same text as the unsharded replica; the
//!   head's record holds the group over both nodes, and the member node's rank runs under
//!   that node's worker; `kill -9` of that rank fails the group within 5 s and a new group
//!   (a new replica id) serves the same text.
//! - `kill -9` of a rank mid-stream: the replica turns Failed within 5 s, every in-flight
//!   stream completes token-exact (the router migrates it to the other replica), no rank of
//!   the group is left, and the replica is replaced.
//! - `SIGSTOP` of a rank (`--collective-timeout 3`): detected within the timeout plus 3 s,
//!   same outcome; after `SIGCONT` the old group does not come back (its rank is gone, the
//!   replacement is a new replica id).
//!
//! The token reference of the fault tests is an unsharded replica in the same cluster
//! (96-token streams of the reference fixture's prompts). Budget: 2-core CI; 16-token completions, a few requests, one cluster
//! at a time. Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail, ensure};
use nix::sys::signal::Signal;
use prism_common::proto::v1::{
    FinishReason, GenerateRequest, ReplicaRecord, ReplicaState, SamplingParams, TokenIds, generate_request,
};
use prism_tests::{
    Cluster, Deployment, SERVED, alive, eventually, model, post_json, reference_cases, router_ready_replicas,
    signal_pid, stream, stream_counted,
};
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// One cluster at a time (2 cores).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Tokens per completion in the equivalence tests.
const MAX_TOKENS: u32 = 16;
/// The completion prompts of the equivalence tests.
const PROMPTS: &[&str] = &["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"];
/// How long a replica of the bundled model may take to load (2 cores, several ranks).
const LOAD_TIMEOUT: Duration = Duration::from_secs(240);

/// Greedy completions of [`PROMPTS`] by `served` through the router's OpenAI HTTP API.
async fn completions(http: &str, served: &str) -> Result<Vec<String>> {
    let mut out = Vec::new();
    for prompt in PROMPTS {
        let body = json!({
            "model": served, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": true,
        });
        let (status, answer) = post_json(&format!("{http}/v1/completions"), &body).await?;
        if status != 200 {
            bail!("{served}: completion of {prompt:?} got {status}: {answer}");
        }
        let text = answer["choices"][0]["text"].as_str().context("choices[0].text")?.to_owned();
        assert_eq!(answer["usage"]["completion_tokens"], json!(MAX_TOKENS), "{served}: {answer}");
        out.push(text);
    }
    Ok(out)
}

/// The head's records of `deployment`.
async fn records(c: &Cluster, deployment: &str) -> Result<Vec<ReplicaRecord>> {
    Ok(c.replicas().await?.into_iter().filter(|r| r.deployment == deployment).collect())
}

/// Deploys `d` and waits until its `replicas` are Ready at the head and listed by the router
/// (failing at once when one of them fails).
async fn deploy_ready(c: &mut Cluster, d: &Deployment) -> Result<Vec<ReplicaRecord>> {
    c.deploy(d)?;
    let (name, served, n) = (d.name.clone(), d.served_model_name.clone(), d.replicas as usize);
    let c = &*c;
    let ready = eventually(LOAD_TIMEOUT, &format!("{name}: {n} replicas Ready"), || async {
        let recs = records(c, &name).await?;
        if let Some(f) = recs.iter().find(|r| r.state() == ReplicaState::Failed) {
            bail!("{name}: replica {} failed: {}", f.replica_id, f.reason);
        }
        let ready: Vec<_> = recs.into_iter().filter(|r| r.state() == ReplicaState::Ready).collect();
        Ok((ready.len() == n).then_some(ready))
    })
    .await?;
    eventually(Duration::from_secs(30), &format!("router lists {served}"), || async {
        Ok((router_ready_replicas(c.grpc(), &served).await? == n as u32).then_some(()))
    })
    .await?;
    Ok(ready)
}

/// Waits until `name` has one Ready replica other than `failed` (its replacement) and the
/// router lists it.
async fn deploy_ready_again(c: &Cluster, name: &str, failed: &str) -> Result<[ReplicaRecord; 1]> {
    let ready = eventually(LOAD_TIMEOUT, &format!("{name}: {failed} replaced"), || async {
        let ready: Vec<_> = records(c, name).await?.into_iter().filter(|r| r.state() == ReplicaState::Ready).collect();
        ensure!(ready.iter().all(|r| r.replica_id != failed), "{failed} came back");
        Ok(<[ReplicaRecord; 1]>::try_from(ready).ok())
    })
    .await?;
    eventually(Duration::from_secs(30), &format!("router lists {name}"), || async {
        Ok((router_ready_replicas(c.grpc(), name).await? == 1).then_some(()))
    })
    .await?;
    Ok(ready)
}

/// Scales `name` to 0 and waits until its records are gone (its ranks freed).
async fn undeploy(c: &Cluster, name: &str) -> Result<()> {
    c.cli(&["scale", name, "0"])?;
    eventually(Duration::from_secs(60), &format!("{name} scaled to 0"), || async {
        Ok(records(c, name).await?.is_empty().then_some(()))
    })
    .await
}

/// A parallel deployment of the bundled model running at most `max_num_seqs` sequences.
fn parallel(model: &Path, name: &str, tp: u32, pp: u32, max_num_seqs: u32) -> Deployment {
    Deployment::new(model)
        .named(name)
        .served_as(name)
        .engine("tensor_parallel_size", tp)
        .engine("pipeline_parallel_size", pp)
        .engine("max_num_seqs", max_num_seqs)
        .engine("max_num_batched_tokens", 64)
}

/// TP=3, PP=2 and TP=3 × PP=2 replicas serve exactly the unsharded replica's greedy text;
/// each parallel deployment is scaled away before the next (one worker of 6 CPU slots).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tensor_and_pipeline_parallel_replicas_match_the_unsharded_replica() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::builder()
        .workers(1)
        .worker_args(&["--cpu-slots", "7", "--kv-cache-bytes", "16777216"])
        .routers(1)
        .start()
        .await?;
    let outcome = async {
        let unsharded = Deployment::new(&model).named("unsharded").served_as("unsharded");
        deploy_ready(&mut c, &unsharded.engine("max_num_seqs", 4)).await?;
        let want = completions(c.http(), "unsharded").await?;
        assert!(want.iter().all(|t| !t.is_empty()), "{want:?}");
        for (name, tp, pp) in [("tp3", 3, 1), ("pp2", 1, 2), ("tp3pp2", 3, 2)] {
            let ready = deploy_ready(&mut c, &parallel(&model, name, tp, pp, 4)).await?;
            let world = (tp * pp) as usize;
            assert_eq!(ready[0].gpu_indices.len(), world, "{name}: one CPU slot per rank");
            // Rank 0 runs in the worker; the others are processes of one group.
            let groups = c.rank_groups();
            let ranks: Vec<Vec<usize>> = groups.values().map(|g| g.iter().map(|p| p.rank).collect()).collect();
            assert_eq!(ranks, vec![(1..world).collect::<Vec<_>>()], "{name}: rank processes {groups:?}");
            let got = completions(c.http(), name).await?;
            assert_eq!(got, want, "{name} (tp {tp} x pp {pp}) against the unsharded replica");
            undeploy(&c, name).await?;
            eventually(Duration::from_secs(10), &format!("{name}: no rank process outlives its replica"), || async {
                Ok(c.rank_groups().is_empty().then_some(()))
            })
            .await?;
        }
        anyhow::Ok(())
    }
    .await;
    c.with_logs(outcome)
}

/// A TP=1 × PP=2 replica over two workers of one slot each: the head splits it into a stage
/// per node; the member node's worker runs rank 1; the text is the unsharded replica's. A
/// `kill -9` of that rank fails the group within 5 s and a new group serves the same text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipeline_over_two_workers_matches_the_unsharded_replica() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::builder()
        .head_args(&["--replica-restart-delay", "1s"])
        .workers(3)
        .worker_args(&["--cpu-slots", "1", "--kv-cache-bytes", "16777216"])
        .routers(1)
        .start()
        .await?;
    let outcome = async {
        let unsharded = Deployment::new(&model).named("unsharded").served_as("unsharded");
        let Ok([reference]) =
            <[ReplicaRecord; 1]>::try_from(deploy_ready(&mut c, &unsharded.engine("max_num_seqs", 4)).await?)
        else {
            bail!("one unsharded replica");
        };
        let want = completions(c.http(), "unsharded").await?;
        let Ok([r]) = <[ReplicaRecord; 1]>::try_from(deploy_ready(&mut c, &parallel(&model, "pp2", 1, 2, 4)).await?)
        else {
            bail!("one pp2 replica")
        };
        let nodes: Vec<&str> = r.rank_groups.iter().map(|g| g.node_id.as_str()).collect();
        assert_eq!(nodes.len(), 2, "a stage per node: {:?}", r.rank_groups);
        assert!(!nodes.contains(&reference.node_id.as_str()), "the free nodes: {nodes:?}");
        assert_eq!(r.node_id, nodes[0], "the driver's node holds rank 0");
        let shape: Vec<(u32, Vec<u32>)> = r.rank_groups.iter().map(|g| (g.first_rank, g.gpu_indices.clone())).collect();
        assert_eq!(shape, vec![(0, vec![0]), (1, vec![0])]);
        assert!(!r.rendezvous.is_empty(), "the driver reported its rendezvous");
        let groups = c.rank_groups();
        let member = groups.get(&r.rendezvous).context("rank processes joined the driver's rendezvous")?;
        assert_eq!(member.iter().map(|p| p.rank).collect::<Vec<_>>(), vec![1]);
        assert_eq!(member[0].parent, c.worker(nodes[1])?.process.pid(), "rank 1 runs under the member node's worker");
        let got = completions(c.http(), "pp2").await?;
        assert_eq!(got, want, "pp2 over {nodes:?} against the unsharded replica");
        let status = c.cli(&["status"])?;
        assert!(status.contains(&r.replica_id), "{status}");

        // The member node's rank dies: the member entry and the driver's replica fail, the
        // head stops the group on both nodes and places a new one, which serves the same text.
        let killed = Instant::now();
        signal_pid(member[0].pid, Signal::SIGKILL)?;
        let reason = eventually(Duration::from_secs(10), "the group Failed", || async {
            let recs = records(&c, "pp2").await?;
            Ok(recs
                .into_iter()
                .find(|x| x.replica_id == r.replica_id && x.state() == ReplicaState::Failed)
                .map(|x| x.reason))
        })
        .await?;
        let detected = killed.elapsed();
        eprintln!("member rank kill -9: group Failed after {detected:?}: {reason}");
        ensure!(detected < Duration::from_secs(5), "member rank failure seen after {detected:?}");
        let [again] = deploy_ready_again(&c, "pp2", &r.replica_id).await?;
        eprintln!("member rank kill -9: replaced by {} {:?} after the kill", again.replica_id, killed.elapsed());
        let got = completions(c.http(), "pp2").await?;
        assert_eq!(got, want, "the replacement group against the unsharded replica");
        undeploy(&c, "pp2").await?;
        eventually(Duration::from_secs(10), "member ranks gone", || async {
            Ok(c.rank_groups().is_empty().then_some(()))
        })
        .await?;
        anyhow::Ok(())
    }
    .await;
    c.with_logs(outcome)
}

/// Tokens per stream in the fault tests: long enough to be mid-stream when the rank goes.
const FAULT_TOKENS: u32 = 96;

/// The fault tests' cluster: one worker of 5 CPU slots and 64 MiB of KV cache per replica
/// (`extra` flags added) holding an
/// unsharded replica served as `unsharded` (the token reference) and two TP=1 × PP=2
/// replicas served as [`SERVED`]; failed replicas are replaced after 1 s.
async fn two_pipeline_replicas(model: &Path, extra: &[&str]) -> Result<Cluster> {
    let mut args = vec!["--cpu-slots", "5", "--kv-cache-bytes", "67108864"];
    args.extend_from_slice(extra);
    let mut c = Cluster::builder()
        .head_args(&["--worker-timeout", "2s", "--replica-restart-delay", "1s"])
        .workers(1)
        .worker_args(&args)
        .routers(1)
        .router_args(&["--ejection-base", "0.5"])
        .start()
        .await?;
    let unsharded = Deployment::new(model).named("unsharded").served_as("unsharded").engine("max_num_seqs", 4);
    let ready = deploy_ready(&mut c, &unsharded).await;
    c.with_logs(ready)?;
    // Room for every stream on the surviving replica (6 of up to 135 tokens each).
    let d = parallel(model, "smollm2", 1, 2, 8).served_as(SERVED).replicas(2);
    let ready = deploy_ready(&mut c, &d).await;
    c.with_logs(ready)?;
    Ok(c)
}

/// Greedy requests (EOS ignored, [`FAULT_TOKENS`]) of the reference fixture's prompts.
fn greedy_requests(served: &str) -> Result<Vec<GenerateRequest>> {
    let mut out = Vec::new();
    for case in reference_cases()? {
        out.push(GenerateRequest {
            model: served.into(),
            prompt: Some(generate_request::Prompt::TokenIds(TokenIds {
                ids: case.prompt_ids.context("reference case without prompt ids")?,
            })),
            sampling: Some(SamplingParams {
                temperature: Some(0.0),
                max_tokens: Some(i64::from(FAULT_TOKENS)),
                ignore_eos: true,
                skip_special_tokens: Some(true),
                ..SamplingParams::default()
            }),
            ..GenerateRequest::default()
        });
    }
    Ok(out)
}

/// What a rank fault did, measured from the signal.
struct FaultOutcome {
    /// When the signal was sent.
    signalled: Instant,
    /// Signal → the head's record says Failed.
    detected: Duration,
    /// Largest gap between two token messages of any in-flight stream (the migration).
    max_gap: Duration,
    /// The failed replica.
    failed: String,
    /// Rank pids of the failed group.
    group_pids: Vec<u32>,
}

/// Streams every reference prompt through the router, signals rank 1 of one group with
/// `signal` mid-stream, and checks: the replica turns Failed, every stream ends with the
/// unsharded replica's tokens (migrated), the router counted a migration, the group's ranks
/// are gone.
async fn rank_fault(c: &Cluster, signal: Signal) -> Result<FaultOutcome> {
    let reference = greedy_requests("unsharded")?.into_iter().map(|req| stream(c.grpc(), req));
    let mut want = Vec::new();
    for r in futures::future::join_all(reference).await {
        want.push(r?.tokens);
    }
    ensure!(want.iter().all(|t| t.len() == FAULT_TOKENS as usize), "unsharded reference lengths");
    let migrations_before = c.router_metric("prism_router_migrations_total").await?;
    let mut streams = Vec::new();
    let mut received = Vec::new();
    for req in greedy_requests(SERVED)? {
        let (grpc, count) = (c.grpc().to_owned(), Arc::new(AtomicUsize::new(0)));
        received.push(Arc::clone(&count));
        streams.push(tokio::spawn(async move { stream_counted(&grpc, req, &count).await }));
    }
    // Mid-stream: every stream has some of its tokens.
    eventually(Duration::from_secs(60), "every stream has 4 tokens", || async {
        Ok(received.iter().all(|n| n.load(Ordering::SeqCst) >= 4).then_some(()))
    })
    .await?;
    let groups = c.rank_groups();
    let (_, victim_group) = groups.iter().next().context("a rank group")?;
    let victim = victim_group.iter().find(|p| p.rank == 1).context("rank 1")?.clone();
    let group_pids: Vec<u32> = victim_group.iter().map(|p| p.pid).collect();
    let signalled = Instant::now();
    signal_pid(victim.pid, signal)?;
    let at_fault: Vec<usize> = received.iter().map(|n| n.load(Ordering::SeqCst)).collect();
    ensure!(
        at_fault.iter().all(|n| *n < FAULT_TOKENS as usize),
        "a stream ended before the fault ({at_fault:?} tokens): make them longer"
    );
    let failed = eventually(Duration::from_secs(20), "a replica Failed", || async {
        let recs = records(c, "smollm2").await?;
        Ok(recs.into_iter().find(|r| r.state() == ReplicaState::Failed).map(|r| (r.replica_id, r.reason)))
    })
    .await?;
    let detected = signalled.elapsed();
    eprintln!("rank fault ({signal}): replica {} Failed after {detected:?}: {}", failed.0, failed.1);
    let mut max_gap = Duration::ZERO;
    for (i, (want, s)) in want.iter().zip(streams).enumerate() {
        let r = s.await??;
        ensure!(&r.tokens == want, "stream {i} after the fault: {:?}, unsharded: {want:?}", r.tokens);
        ensure!(r.finish == FinishReason::Length as i32, "stream {i} finish {}", r.finish);
        max_gap = max_gap.max(r.max_gap);
    }
    let migrations = c.router_metric("prism_router_migrations_total").await? - migrations_before;
    ensure!(migrations >= 1.0, "the failed replica's streams were migrated ({migrations})");
    eprintln!("rank fault ({signal}): {migrations} streams migrated, largest token gap {max_gap:?}");
    eventually(Duration::from_secs(5), "the failed group's ranks are gone", || async {
        Ok(group_pids.iter().all(|p| !alive(*p)).then_some(()))
    })
    .await?;
    Ok(FaultOutcome { signalled, detected, max_gap, failed: failed.0, group_pids })
}

/// Waits until two replicas are Ready again, neither of them `failed`; returns how long
/// after `since` that was.
async fn replaced(c: &Cluster, failed: &str, since: Instant) -> Result<Duration> {
    eventually(LOAD_TIMEOUT, "the failed replica replaced", || async {
        let recs = records(c, "smollm2").await?;
        let ready: Vec<_> = recs.iter().filter(|r| r.state() == ReplicaState::Ready).collect();
        ensure!(!ready.iter().any(|r| r.replica_id == failed), "the failed replica {failed} came back: {recs:?}");
        Ok((ready.len() == 2).then_some(()))
    })
    .await?;
    eventually(Duration::from_secs(30), "router lists 2 replicas", || async {
        Ok((router_ready_replicas(c.grpc(), SERVED).await? == 2).then_some(()))
    })
    .await?;
    Ok(since.elapsed())
}

/// `kill -9` of a rank mid-stream: Failed within 5 s, the streams complete token-exact on
/// the other replica, no rank of the group left, a replacement serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_rank_fails_its_replica_and_the_streams_migrate_token_exact() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let _serial = SERIAL.lock().await;
    let c = two_pipeline_replicas(&model, &[]).await?;
    let outcome = async {
        let fault = rank_fault(&c, Signal::SIGKILL).await?;
        ensure!(fault.detected < Duration::from_secs(5), "Failed {:?} after kill -9", fault.detected);
        let took = replaced(&c, &fault.failed, fault.signalled).await?;
        eprintln!(
            "kill -9: detected {:?}, largest token gap {:?}, replaced {took:?} after the signal",
            fault.detected, fault.max_gap
        );
        anyhow::Ok(())
    }
    .await;
    c.with_logs(outcome)
}

/// `SIGSTOP` of a rank mid-stream with `--collective-timeout 3`: the stalled collective fails
/// the replica within 3 s + 3 s; after `SIGCONT` the old group stays gone and the
/// replacement is a new replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_rank_fails_its_replica_after_the_collective_timeout() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let _serial = SERIAL.lock().await;
    let c = two_pipeline_replicas(&model, &["--collective-timeout", "3"]).await?;
    let outcome = async {
        let fault = rank_fault(&c, Signal::SIGSTOP).await?;
        ensure!(
            fault.detected >= Duration::from_millis(2500) && fault.detected < Duration::from_secs(6),
            "Failed {:?} after SIGSTOP (collective timeout 3 s)",
            fault.detected
        );
        for pid in &fault.group_pids {
            // Already killed by the driver: nothing to continue (an error is expected).
            let _ = signal_pid(*pid, Signal::SIGCONT);
        }
        let took = replaced(&c, &fault.failed, fault.signalled).await?;
        ensure!(fault.group_pids.iter().all(|p| !alive(*p)), "the old group does not come back");
        let recs = records(&c, "smollm2").await?;
        ensure!(
            recs.iter().all(|r| r.replica_id != fault.failed || r.state() != ReplicaState::Ready),
            "the failed replica is never Ready again: {recs:?}"
        );
        eprintln!(
            "SIGSTOP: detected {:?}, largest token gap {:?}, replaced {took:?} after the signal",
            fault.detected, fault.max_gap
        );
        anyhow::Ok(())
    }
    .await;
    c.with_logs(outcome)
}
