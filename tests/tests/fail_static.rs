//! Fail static: the data plane keeps serving while the state store is away. A real local
//! cluster (etcd, head with a 2 s lease, two workers on the bundled SmolLM2 GGUF, router)
//! under four streaming clients whose every stream is compared token by token with an
//! undisturbed run:
//! - `etcd_frozen_routes_stay_and_streams_complete`: etcd SIGSTOPped for 30 s (a disk stall,
//!   a long compaction): the head's lease lapses and it steps down; routers keep the last
//!   table (it never has zero replicas), workers keep serving; when etcd resumes the head
//!   leads again (a newer term) with the same replicas.
//! - `etcd_killed_and_restarted_routes_stay`: etcd SIGKILLed and restarted from its data
//!   directory after 15 s: the same.
//! - `etcd_member_lost_is_invisible` (3-member etcd, one member SIGKILLed for 15 s): the head
//!   keeps its leadership (same term) and nothing fails.
//! - `etcd_quorum_lost_for_30s_routes_stay` (two of three members SIGKILLed for 30 s): as an
//!   etcd outage — routes stay, streams complete, the head leads again once quorum is back.
//! - `leader_killed_follower_takes_over_under_load`: two heads; the leader SIGKILLed: the
//!   follower leads within about the lease TTL and publishes a newer term with the same
//!   replicas; routers and workers follow it without a failed request.
//! - `head_started_while_etcd_is_down_leads_once_it_is_back`: a head (re)started during an etcd
//!   outage keeps retrying the store instead of exiting, answers meanwhile (`/healthz` 200,
//!   `/readyz` 503 naming the store, `/metrics`, gRPC `UNAVAILABLE`), and leads once etcd is
//!   back; its worker retries and registers again.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail, ensure};
use prism_common::proto::v1::ClusterStatusRequest;
use prism_tests::{Cluster, Load, eventually, model, reference};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const MAX_TOKENS: u32 = 24;
const CLIENTS: usize = 4;
/// The heads' lease TTL: a stopped or stalled head loses leadership about this long after.
const LEASE_TTL: Duration = Duration::from_secs(2);

/// Samples the router's table size every 100 ms until stopped; returns the smallest
/// replica count seen and the number of samples.
fn watch_route_replicas(cluster: &Cluster, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(f64, usize)> {
    let url = format!("{}/metrics", cluster.router().http);
    tokio::spawn(async move {
        let (mut min, mut samples) = (f64::INFINITY, 0);
        while !stop.load(Ordering::Relaxed) {
            if let Ok(Ok(body)) =
                tokio::time::timeout(Duration::from_secs(1), async { reqwest::get(&url).await?.text().await }).await
            {
                min = min.min(prism_tests::metric_value(&body, "prism_route_table_replicas"));
                samples += 1;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        (min, samples)
    })
}

/// What happens to etcd.
#[derive(Clone, Copy, Debug)]
enum Outage {
    /// SIGSTOP, then SIGCONT after this long.
    Freeze(Duration),
    /// SIGKILL, then a restart from the same data directory after this long.
    KillRestart(Duration),
    /// The leading head SIGKILLed while a follower runs (etcd untouched).
    KillLeader,
    /// These members of a 3-member etcd SIGKILLed, restarted after this long.
    KillMembers(&'static [usize], Duration),
}

impl Outage {
    /// Whether etcd (or its quorum) is away for a while (streams finish during the outage).
    fn stops_the_store(self) -> bool {
        !matches!(self, Self::KillLeader | Self::KillMembers(&[_], _))
    }

    /// Whether the head loses its leadership (and so leads again with a newer term).
    fn ends_the_term(self) -> bool {
        !matches!(self, Self::KillMembers(m, _) if m.len() == 1)
    }
}

async fn disturb(cluster: &mut Cluster, outage: Outage) -> Result<()> {
    if let Outage::KillLeader = outage {
        let leader = cluster.wait_leader(Duration::from_secs(10)).await?;
        cluster.heads[leader].process.kill();
        let killed = Instant::now();
        // The follower becomes the cluster's first head for the checks that follow.
        cluster.heads.swap(0, 1 - leader.min(1));
        cluster.heads[0].wait_leader(Duration::from_secs(30)).await?;
        let took = killed.elapsed();
        eprintln!("leader SIGKILL: the follower leads after {:.2} s (lease TTL {LEASE_TTL:?})", took.as_secs_f64());
        assert!(took <= LEASE_TTL * 2 + Duration::from_secs(2), "takeover took {took:?}");
        return Ok(());
    }
    let Some(etcd) = cluster.etcd_mut() else { bail!("the cluster has no etcd") };
    match outage {
        Outage::Freeze(d) => {
            let Some(pid) = etcd.pid() else { bail!("etcd is not running") };
            let pid = nix::unistd::Pid::from_raw(i32::try_from(pid)?);
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP)?;
            tokio::time::sleep(d).await;
            nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT)?;
        }
        Outage::KillRestart(d) => {
            etcd.kill();
            tokio::time::sleep(d).await;
            etcd.restart().await?;
        }
        Outage::KillMembers(members, d) => {
            for &m in members {
                etcd.kill_member(m);
            }
            tokio::time::sleep(d).await;
            for &m in members {
                etcd.restart_member(m).await?;
            }
        }
        Outage::KillLeader => {}
    }
    Ok(())
}

/// Runs `outage` under streaming load and checks: no failed request, no token mismatch,
/// never an empty route table at the router, the head leading again with a newer term and
/// the same replicas.
async fn serve_through(cluster: &mut Cluster, outage: Outage) -> Result<()> {
    let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
    let mut before: Vec<String> = cluster.replicas().await?.into_iter().map(|r| r.replica_id).collect();
    before.sort();
    let term_before = cluster.router_metric("prism_route_table_term").await?;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = watch_route_replicas(cluster, stop.clone());
    let load = Load::start(cluster.grpc(), CLIENTS, MAX_TOKENS, reference);
    load.wait_more(CLIENTS, Duration::from_secs(60)).await?;
    let served_before = load.finished();
    let started = Instant::now();
    disturb(cluster, outage).await?;
    let served_during = load.finished() - served_before;
    // The store is back: the head leads again (a newer term) with the same replicas.
    let c: &Cluster = cluster;
    eventually(Duration::from_secs(60), "the head leads again", || async {
        Ok(c.status().await.is_ok_and(|s| s.is_leader).then_some(()))
    })
    .await?;
    let recovered = started.elapsed();
    if outage.ends_the_term() {
        eventually(Duration::from_secs(30), "the router applies the new term's table", || async {
            Ok((c.router_metric("prism_route_table_term").await? > term_before).then_some(()))
        })
        .await?;
    } else {
        let term = c.router_metric("prism_route_table_term").await?;
        assert_eq!(term, term_before, "losing one etcd member of three cost the head its leadership");
    }
    cluster.wait_ready(2, Duration::from_secs(60)).await?;
    let mut after: Vec<String> = cluster.replicas().await?.into_iter().map(|r| r.replica_id).collect();
    after.sort();
    assert_eq!(before, after, "replicas were replaced although they were healthy");
    load.wait_more(CLIENTS, Duration::from_secs(60)).await?;
    stop.store(true, Ordering::Relaxed);
    let (min_replicas, samples) = sampler.await?;
    let report = load.stop().await?;
    report.check()?;
    // A takeover lasts about one lease TTL, shorter than a stream on a slow machine; the
    // no-failed-request check above covers it.
    if outage.stops_the_store() {
        assert!(served_during > 0, "nothing was served while etcd was away");
    }
    assert!(samples > 10, "too few route samples: {samples}");
    assert!(min_replicas >= 2.0, "the router's table fell to {min_replicas} replicas");
    eprintln!(
        "{outage:?}: {} streams token-exact ({served_during} finished during the outage), 0 failed, \
         route table never below {min_replicas} replicas ({samples} samples), head leading again {:.1} s after \
         the outage began",
        report.ok,
        recovered.as_secs_f64()
    );
    Ok(())
}

fn serving(model: &std::path::Path) -> prism_tests::ClusterBuilder {
    Cluster::serving(model, 2, 2).head_args(&["--lease-ttl", &format!("{}s", LEASE_TTL.as_secs())])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_frozen_routes_stay_and_streams_complete() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = serving(&model).start().await?;
    if let Err(e) = serve_through(&mut cluster, Outage::Freeze(Duration::from_secs(30))).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_killed_and_restarted_routes_stay() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = serving(&model).start().await?;
    if let Err(e) = serve_through(&mut cluster, Outage::KillRestart(Duration::from_secs(15))).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_killed_follower_takes_over_under_load() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = serving(&model).heads(2).start().await?;
    if let Err(e) = serve_through(&mut cluster, Outage::KillLeader).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

fn serving_on_three_members(model: &std::path::Path) -> prism_tests::ClusterBuilder {
    serving(model).store(prism_tests::Store::EtcdCluster(3))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_member_lost_is_invisible() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    // The head's default lease TTL (5 s): the etcd client moves to a live member well within
    // the two thirds of it that the keep-alive may fail for.
    let mut cluster = Cluster::serving(&model, 2, 2).store(prism_tests::Store::EtcdCluster(3)).start().await?;
    if let Err(e) = serve_through(&mut cluster, Outage::KillMembers(&[0], Duration::from_secs(15))).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn etcd_quorum_lost_for_30s_routes_stay() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = serving_on_three_members(&model).start().await?;
    if let Err(e) = serve_through(&mut cluster, Outage::KillMembers(&[1, 2], Duration::from_secs(30))).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

/// A head that starts (or restarts) while etcd is down waits for it instead of exiting: it
/// retries with backoff, and once etcd is back it leads without being started again.
/// Meanwhile it answers: `/healthz` 200 (a startup probe must not restart it), `/readyz` 503
/// saying the state store is unreachable, `/metrics`, and `UNAVAILABLE` to every gRPC call
/// (the tester's repro: ports bound but never accepted, probes and `prism status` hung). Its
/// worker, which lost its session when the head was killed, keeps retrying through the
/// `UNAVAILABLE` answers and registers once the head leads. No model needed: etcd, one head
/// and one worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_started_while_etcd_is_down_leads_once_it_is_back() -> Result<()> {
    let mut cluster = Cluster::builder().workers(1).start().await?;
    let result = async {
        let Some(etcd) = cluster.etcd_mut() else { bail!("the cluster has no etcd") };
        etcd.kill();
        let head = cluster.head_mut();
        head.process.kill();
        head.process.restart()?;
        // Several attempts' worth of time: the head must still be running, saying why it waits.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let head = cluster.head_mut();
        ensure!(!head.process.exited(), "the head exited while etcd was down:\n{}", head.process.stderr());
        ensure!(head.process.stderr().contains("state store unavailable; retrying"), "the head says why it waits");
        answers_without_store(cluster.head()).await?;
        let cli = cluster.cli(&["--timeout", "5s", "status"]);
        ensure!(
            cli.as_ref().is_err_and(|e| e.to_string().contains(prism_head::gate::STORE_UNAVAILABLE)),
            "prism status says the head waits for its store: {cli:?}"
        );
        let Some(etcd) = cluster.etcd_mut() else { bail!("the cluster has no etcd") };
        etcd.restart().await?;
        // The backoff is at most 5 s, then the election (lease 5 s at most to take over).
        cluster.wait_leader(Duration::from_secs(30)).await.context("the head leads once etcd is back")?;
        let ready = http_get(&cluster.head().http, "/readyz").await?;
        ensure!(ready.0 == 200, "/readyz once leading: {ready:?}");
        cluster.wait_registered(1, Duration::from_secs(30)).await.context("the worker registers again")?;
        let worker_log = cluster.workers[0].process.stderr();
        ensure!(
            worker_log.contains(prism_head::gate::STORE_UNAVAILABLE),
            "the worker was answered UNAVAILABLE while the store was away, and retried:\n{worker_log}"
        );
        Ok(())
    }
    .await;
    if let Err(e) = result {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}

/// Status and body of `GET BASE PATH`, given 5 s.
async fn http_get(base: &str, path: &str) -> Result<(u16, String)> {
    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    let response = client.get(format!("{base}{path}")).send().await.with_context(|| format!("GET {path}"))?;
    Ok((response.status().as_u16(), response.text().await?))
}

/// What a head whose state store is unreachable answers, each within 5 s.
async fn answers_without_store(head: &prism_tests::Head) -> Result<()> {
    let health = http_get(&head.http, "/healthz").await?;
    ensure!(health.0 == 200, "/healthz while the store is away: {health:?}");
    let (code, body) = http_get(&head.http, "/readyz").await?;
    ensure!(code == 503 && body.contains("state store unreachable"), "/readyz while the store is away: {code} {body}");
    let (code, body) = http_get(&head.http, "/metrics").await?;
    ensure!(code == 200 && body.contains("prism_head_is_leader"), "/metrics while the store is away: {code}");
    let call =
        async { head.client().await?.cluster_status(ClusterStatusRequest {}).await.map_err(anyhow::Error::from) };
    match tokio::time::timeout(Duration::from_secs(5), call).await {
        Err(_) => bail!("ClusterStatus did not answer within 5 s while the store is away"),
        Ok(Ok(_)) => bail!("ClusterStatus answered without a state store"),
        Ok(Err(e)) => {
            let status = e.downcast_ref::<tonic::Status>().with_context(|| format!("not a gRPC status: {e:#}"))?;
            ensure!(status.code() == tonic::Code::Unavailable, "ClusterStatus while the store is away: {status:?}");
        }
    }
    Ok(())
}
