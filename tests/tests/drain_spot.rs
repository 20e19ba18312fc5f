//! Spot preemption notice on a real local cluster (etcd, head, 3 workers on the bundled
//! SmolLM2 GGUF, router): worker `w1` watches a notice file
//! (`--spot-notice-file`, polled once a second, as the cloud metadata endpoints are). Under
//! streaming load the file receives a termination time 10 s ahead: the router stops using
//! w1's replica, the drain finishes (replica stopped, nothing in flight) before that time,
//! no stream fails or differs from the undisturbed run, and the SIGTERM that follows the
//! notice makes the worker exit 0 at once.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_tests::{Cluster, Load, eventually, metric_value, model, reference};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const MAX_TOKENS: u32 = 32;

async fn spot_notice(cluster: &mut Cluster, notice: &std::path::Path) -> Result<()> {
    let reference = Arc::new(reference(cluster.grpc(), MAX_TOKENS).await?);
    let load = Load::start(cluster.grpc(), 4, MAX_TOKENS, reference);
    load.wait_more(4, Duration::from_secs(60)).await?;
    let replica = cluster.replica_on("w1").await?.context("no replica on w1")?;
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?;
    let termination = Instant::now() + Duration::from_secs(10);
    std::fs::write(notice, format!("{}\n", now.as_secs() + 10))?;
    let update = cluster.wait_route_change(3, Duration::from_secs(5)).await?;
    let w1_http = cluster.worker("w1")?.http.clone();
    // Drain done before the termination time: the replica is gone at the head and the
    // worker has nothing running.
    eventually(Duration::from_secs(12), "spot drain finished", || {
        let (c, r, http) = (&*cluster, replica.clone(), w1_http.clone());
        async move {
            let gone = c.replicas().await?.iter().all(|x| x.replica_id != r);
            let text = reqwest::get(format!("{http}/metrics")).await?.text().await?;
            Ok((gone && metric_value(&text, "vllm:num_requests_running") == 0.0).then_some(()))
        }
    })
    .await?;
    let done = Instant::now();
    assert!(done < termination, "drain finished {:?} after the termination time", done - termination);
    eprintln!(
        "spot notice: route update {:?} after the notice was written; drain finished {:?} before the termination time",
        update - (termination - Duration::from_secs(10)),
        termination - done
    );
    // The platform's SIGTERM then finds an idle, drained worker.
    let t0 = Instant::now();
    let w1 = cluster.worker_mut("w1")?;
    w1.process.terminate()?;
    let status = w1.process.wait_exit(Duration::from_secs(10)).await?;
    assert!(status.success(), "{status}");
    eprintln!("SIGTERM after the spot drain: exit 0 in {:?}", t0.elapsed());
    load.wait_more(4, Duration::from_secs(60)).await?;
    let report = load.stop().await?;
    report.check()?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn spot_notice_drains_before_termination_time() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let notice = dir.path().join("spot-notice");
    let notice_path = notice.to_string_lossy().into_owned();
    let mut cluster = Cluster::serving(&model, 3, 3)
        .worker_args(&["--drain-margin", "2"])
        .worker_extra(0, &["--spot-notice-file", &notice_path])
        .start()
        .await?;
    if let Err(e) = spot_notice(&mut cluster, &notice).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
