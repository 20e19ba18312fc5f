//! The head's autoscaler and drain-safe scale-down on a real local cluster (etcd, head, one
//! worker with 3 CPU slots on the bundled SmolLM2 GGUF, router), streams compared token by
//! token with an undisturbed run:
//! - `step_load_scales_up_then_down_and_settles`: closed-loop streaming clients 1 → 8 → 1 on
//!   a deployment autoscaled with min 1, max 3, target_ongoing_requests 2, upscale 2 s,
//!   downscale 8 s, look-back 3 s: the target rises to 3, holds (at most one change in a
//!   60 s window of constant load), falls back to 1 no sooner than the downscale delay; every
//!   stream is token-exact; the decision is in `prism status`, `/v1/events` and the metrics.
//! - `scale_up_then_down_within_200ms_keeps_the_ready_replica`: `ScaleDeployment` 1 → 2 → 1
//!   under load on a fixed-size deployment: the new (Starting) replica goes, the original
//!   Ready one is never drained, no request fails.
//! - `invalid_autoscaling_configs_are_refused_naming_the_field`: through `prism deploy` and
//!   through the head's API; `prism scale` on an autoscaled deployment is refused.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1` (the last test needs no model).

use anyhow::{Context, Result, bail, ensure};
use prism_common::proto::v1::{
    ApplyDeploymentRequest, AutoscalingConfig, ClusterStatusResponse, DeploymentSpec, EngineConfig, ReplicaState,
    ScaleDeploymentRequest, ScalingDecision,
};
use prism_tests::{
    Cluster, Deployment, Load, PROMPTS, eventually, greedy_request, metric_value, model, reference, stream,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tokens per stream: a few seconds per stream on a loaded 2-core machine.
const MAX_TOKENS: u32 = 32;
/// The deployment's name (the fixture's default).
const NAME: &str = "smollm2";

/// The deployment's target replica count and last decision.
fn target(st: &ClusterStatusResponse) -> Result<(u32, Option<ScalingDecision>)> {
    let d = st.deployments.iter().find(|d| d.spec.as_ref().is_some_and(|s| s.name == NAME)).context("no deployment")?;
    Ok((d.spec.as_ref().map_or(0, |s| s.replicas), d.last_scaling.clone()))
}

fn count(st: &ClusterStatusResponse, state: ReplicaState) -> usize {
    st.replicas.iter().filter(|r| r.state == state as i32).count()
}

/// Polls the target every 250 ms until `want` (returns when it got there) or `timeout`.
async fn wait_target(cluster: &Cluster, want: u32, timeout: Duration) -> Result<(Instant, ScalingDecision)> {
    eventually(timeout, &format!("target {want} replicas"), || async {
        let (n, last) = target(&cluster.status().await?)?;
        Ok((n == want).then(|| (Instant::now(), last)).and_then(|(t, l)| l.map(|l| (t, l))))
    })
    .await
}

/// Target changes seen while polling for `window`.
async fn changes_during(cluster: &Cluster, window: Duration) -> Result<Vec<u32>> {
    let end = Instant::now() + window;
    let mut seen = vec![target(&cluster.status().await?)?.0];
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let n = target(&cluster.status().await?)?.0;
        if seen.last() != Some(&n) {
            seen.push(n);
        }
    }
    Ok(seen)
}

/// The undisturbed outputs of [`PROMPTS`], one request at a time: one ongoing request, below
/// the target of 2, so the reference run itself never asks for a replica.
async fn sequential_reference(cluster: &Cluster) -> Result<Vec<Vec<u32>>> {
    let mut out = Vec::new();
    for p in PROMPTS {
        let r = stream(cluster.grpc(), greedy_request(p, MAX_TOKENS, true)).await?;
        ensure!(r.tokens.len() == MAX_TOKENS as usize, "reference run gave {} tokens", r.tokens.len());
        out.push(r.tokens);
    }
    Ok(out)
}

async fn step_load(cluster: &mut Cluster) -> Result<()> {
    let reference = Arc::new(sequential_reference(cluster).await?);
    let one = Load::start(cluster.grpc(), 1, MAX_TOKENS, reference.clone());
    one.wait_more(2, Duration::from_secs(60)).await?;
    // 1 ongoing request at target 2 per replica: no change.
    let steady = changes_during(cluster, Duration::from_secs(4)).await?;
    ensure!(steady == [1], "1 client changed the target: {steady:?}");

    let t_up = Instant::now();
    let seven = Load::start(cluster.grpc(), 7, MAX_TOKENS, reference.clone());
    let (at, up) = wait_target(cluster, 3, Duration::from_secs(30)).await?;
    let up_after = at.duration_since(t_up);
    ensure!((up.from_replicas, up.to_replicas) == (1, 3), "{up:?}");
    ensure!(up.reason.starts_with("ongoing ") && up.reason.contains("> target 2.0 for "), "{}", up.reason);
    ensure!(up_after >= Duration::from_secs(2), "upscaled {up_after:?} after the step: before the 2 s delay");
    cluster.wait_ready(3, Duration::from_secs(120)).await?;
    // Constant load (8 clients over 3 replicas): the target settles.
    let window = Duration::from_secs(60);
    let held = changes_during(cluster, window).await?;
    ensure!(held.len() <= 2, "target changed more than once in {window:?} of constant load: {held:?}");

    let status = cluster.cli(&["status"])?;
    ensure!(status.contains("smollm2: 1 -> 3 replicas, "), "{status}");
    let events: serde_json::Value = reqwest::get(format!("{}/v1/events", cluster.head().http)).await?.json().await?;
    let scaling: Vec<&serde_json::Value> =
        events["events"].as_array().context("events")?.iter().filter(|e| e["kind"] == "scaling").collect();
    ensure!(scaling.iter().any(|e| e["message"].as_str().is_some_and(|m| m.starts_with("1 -> 3: "))), "{events}");
    let metrics = reqwest::get(format!("{}/metrics", cluster.head().http)).await?.text().await?;
    ensure!(metric_value(&metrics, "prism_deployment_target_replicas{deployment=\"smollm2\"}") == 3.0, "{metrics}");

    let t_down = Instant::now();
    let r7 = seven.stop().await?;
    let (at, down) = wait_target(cluster, 1, Duration::from_secs(40)).await?;
    let down_after = at.duration_since(t_down);
    ensure!((down.from_replicas, down.to_replicas) == (3, 1), "{down:?}");
    // Held for the downscale delay (8 s), give or take a reconcile pass.
    let held_s: f64 = down
        .reason
        .rsplit_once(" for ")
        .and_then(|(head, t)| head.contains("< target 2.0").then_some(t))
        .and_then(|t| t.trim_end_matches(" s").parse().ok())
        .context("a downscale reason with its held time")?;
    ensure!((8.0..10.0).contains(&held_s), "{}", down.reason);
    ensure!(down_after >= Duration::from_secs(8), "downscaled {down_after:?} after the step: before the 8 s delay");
    // The two extra replicas drain and stop; the load keeps flowing on the one left.
    eventually(Duration::from_secs(60), "one replica left", || async {
        let st = cluster.status().await?;
        let active = count(&st, ReplicaState::Ready) + count(&st, ReplicaState::Starting);
        Ok((active == 1 && count(&st, ReplicaState::Draining) == 0).then_some(()))
    })
    .await?;
    one.wait_more(2, Duration::from_secs(60)).await?;
    let r1 = one.stop().await?;
    r7.check()?;
    r1.check()?;
    eprintln!(
        "step load: up 1 -> 3 {up_after:?} after 1 -> 8 clients ({:?}), target over {window:?} of constant load \
         {held:?}, down 3 -> 1 {down_after:?} after 8 -> 1 ({:?}); {} + {} streams token-exact",
        up.reason, down.reason, r7.ok, r1.ok
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn step_load_scales_up_then_down_and_settles() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let deployment = Deployment::new(&model).autoscaling(&[
        ("min_replicas", "1"),
        ("max_replicas", "3"),
        ("target_ongoing_requests", "2"),
        ("upscale_delay_s", "2"),
        ("downscale_delay_s", "8"),
        ("look_back_period_s", "3"),
    ]);
    let mut cluster = Cluster::builder()
        .head_args(&["--worker-timeout", "2s", "--drain-timeout", "30s"])
        .workers(1)
        .worker_args(&["--kv-cache-bytes", "67108864", "--cpu-slots", "3"])
        .routers(1)
        .deploy(deployment)
        .start()
        .await?;
    let res = step_load(&mut cluster).await;
    cluster.with_logs(res)
}

async fn quick_scale(cluster: &Cluster) -> Result<()> {
    let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
    let load = Load::start(cluster.grpc(), 2, MAX_TOKENS, reference);
    load.wait_more(2, Duration::from_secs(60)).await?;
    let st = cluster.status().await?;
    let original = st.replicas.iter().find(|r| r.state == ReplicaState::Ready as i32).context("no Ready replica")?;
    let original = original.replica_id.clone();
    let mut head = cluster.head().client().await?;
    let t0 = Instant::now();
    head.scale_deployment(ScaleDeploymentRequest { name: NAME.into(), replicas: 2 }).await?;
    // The second replica exists (placed, Starting) before the scale-down, so the order is tested.
    eventually(Duration::from_millis(150), "a second replica", || async {
        Ok((cluster.status().await?.replicas.len() == 2).then_some(()))
    })
    .await?;
    head.scale_deployment(ScaleDeploymentRequest { name: NAME.into(), replicas: 1 }).await?;
    let within = t0.elapsed();
    ensure!(within < Duration::from_millis(200), "the two scales took {within:?}");
    // Settled: the original Ready replica is the only one, and was never drained.
    let settle_until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < settle_until {
        let st = cluster.status().await?;
        let orig = st.replicas.iter().find(|r| r.replica_id == original).context("the original replica is gone")?;
        ensure!(orig.state == ReplicaState::Ready as i32, "the original replica is {:?}", orig.state());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let events: serde_json::Value = reqwest::get(format!("{}/v1/events", cluster.head().http)).await?.json().await?;
    let events = events["events"].as_array().context("events")?.clone();
    let placed: Vec<&str> = events
        .iter()
        .filter(|e| e["kind"] == "replica_placed")
        .filter_map(|e| e["replica"].as_str())
        .filter(|r| *r != original)
        .collect();
    let removed: Vec<&str> =
        events.iter().filter(|e| e["kind"] == "replica_removed").filter_map(|e| e["replica"].as_str()).collect();
    ensure!(!removed.contains(&original.as_str()), "the Ready replica was removed: {events:?}");
    let second = placed.first().context("no second replica was placed")?;
    ensure!(removed.contains(second), "the second replica was placed but not removed: {events:?}");
    load.wait_more(4, Duration::from_secs(60)).await?;
    let report = load.stop().await?;
    report.check()?;
    let st = cluster.status().await?;
    ensure!(count(&st, ReplicaState::Ready) == 1, "{:?}", st.replicas);
    eprintln!(
        "1 -> 2 -> 1 in {within:?}: second replica {second} removed, original {original} kept Ready; {} streams token-exact",
        report.ok
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scale_up_then_down_within_200ms_keeps_the_ready_replica() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let cluster = Cluster::builder()
        .head_args(&["--worker-timeout", "2s", "--drain-timeout", "30s"])
        .workers(1)
        .worker_args(&["--kv-cache-bytes", "67108864", "--cpu-slots", "2"])
        .routers(1)
        .deploy(Deployment::new(&model))
        .start()
        .await?;
    let res = quick_scale(&cluster).await;
    cluster.with_logs(res)
}

async fn refusals(cluster: &mut Cluster) -> Result<()> {
    let base = Deployment::new(std::path::Path::new("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let cases: [(&[(&str, &str)], &str); 6] = [
        (
            &[("min_replicas", "3"), ("max_replicas", "1")],
            "autoscaling_config.min_replicas (3) is greater than max_replicas (1)",
        ),
        (&[("max_replicas", "0")], "autoscaling_config.max_replicas"),
        (
            &[("min_replicas", "1"), ("max_replicas", "2"), ("initial_replicas", "5")],
            "autoscaling_config.initial_replicas (5)",
        ),
        (&[("max_replicas", "2"), ("target_ongoing_requests", "0")], "autoscaling_config.target_ongoing_requests"),
        (&[("max_replicas", "2"), ("target_kv_cache_usage", "1.5")], "autoscaling_config.target_kv_cache_usage"),
        (&[("max_replicas", "2"), ("downscale_delay_s", "-1")], "autoscaling_config.downscale_delay_s"),
    ];
    for (keys, field) in cases {
        match cluster.deploy(&base.clone().autoscaling(keys)) {
            Ok(out) => bail!("{keys:?} accepted: {out}"),
            Err(e) => ensure!(format!("{e:#}").contains(field), "{keys:?}: {e:#}"),
        }
    }
    match cluster.deploy(&base.clone().autoscaling(&[("max_replicas", "2"), ("max_replica", "3")])) {
        Ok(out) => bail!("an unknown key was accepted: {out}"),
        Err(e) => ensure!(format!("{e:#}").contains("max_replica"), "{e:#}"),
    }
    // The head checks too (a client other than the cli), with the same wording.
    let mut head = cluster.head().client().await?;
    let spec = |a: AutoscalingConfig| DeploymentSpec {
        name: NAME.into(),
        engine: Some(EngineConfig { model: "/m.gguf".into(), tensor_parallel_size: 1, ..Default::default() }),
        autoscaling: Some(a),
        ..Default::default()
    };
    let bad =
        AutoscalingConfig { min_replicas: 1, max_replicas: 2, upscaling_factor: Some(f64::NAN), ..Default::default() };
    let err = head.apply_deployment(ApplyDeploymentRequest { spec: Some(spec(bad)) }).await.expect_err("NaN accepted");
    ensure!(err.code() == tonic::Code::InvalidArgument, "{err:?}");
    ensure!(err.message().starts_with("autoscaling_config.upscaling_factor "), "{}", err.message());
    ensure!(cluster.status().await?.deployments.is_empty(), "a refused deployment was stored");
    // A valid one is stored; scaling it by hand is refused.
    let ok = AutoscalingConfig { min_replicas: 0, max_replicas: 2, ..Default::default() };
    head.apply_deployment(ApplyDeploymentRequest { spec: Some(spec(ok)) }).await?;
    let err =
        head.scale_deployment(ScaleDeploymentRequest { name: NAME.into(), replicas: 2 }).await.expect_err("scaled");
    ensure!(err.code() == tonic::Code::FailedPrecondition, "{err:?}");
    match cluster.cli(&["scale", NAME, "2"]) {
        Ok(out) => bail!("prism scale accepted: {out}"),
        Err(e) => ensure!(format!("{e:#}").contains("is autoscaled"), "{e:#}"),
    }
    ensure!(target(&cluster.status().await?)?.0 == 0, "min 0: starts at 0 replicas");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_autoscaling_configs_are_refused_naming_the_field() -> Result<()> {
    let mut cluster = Cluster::builder().start().await?;
    let res = refusals(&mut cluster).await;
    cluster.with_logs(res)
}
