//! `prism up` restarted on a kept store (`--store embedded:PATH`): the replica count set with
//! `prism scale` survives the restart (and the worker offers the CPU slots it needs), while an
//! explicit `--replicas` on the restart's command line wins. Its logs, piped here, carry no
//! ANSI colour codes, and its progress lines no transient "pending:" reason. A restart under another served name leaves the earlier deployment
//! serving beside it, says so, and `prism delete` removes it. Four starts of the bundled
//! model on the CPU backend.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, ensure};
use prism_common::proto::v1::head_service_client::HeadServiceClient;
use prism_common::proto::v1::{ClusterStatusRequest, ClusterStatusResponse, ReplicaState};
use prism_tests::{PrismUp, eventually, model, prism_cli};
use std::time::Duration;

/// The deployment `prism up` makes of the bundled model.
const DEPLOYMENT: &str = "smollm2-135m-instruct";

async fn status(up: &PrismUp) -> Result<ClusterStatusResponse> {
    let mut head = HeadServiceClient::connect(up.endpoints.head.clone()).await?;
    Ok(head.cluster_status(ClusterStatusRequest {}).await?.into_inner())
}

/// The deployment's desired replica count and how many of its replicas are Ready.
async fn replicas(up: &PrismUp) -> Result<(u32, usize)> {
    let st = status(up).await?;
    let desired = st
        .deployments
        .iter()
        .filter_map(|d| d.spec.as_ref())
        .find(|s| s.name == DEPLOYMENT)
        .map(|s| s.replicas)
        .with_context(|| format!("no deployment {DEPLOYMENT} in {st:?}"))?;
    let ready =
        st.replicas.iter().filter(|r| r.deployment == DEPLOYMENT && r.state == ReplicaState::Ready as i32).count();
    Ok((desired, ready))
}

fn check_no_escape_codes(up: &PrismUp) -> Result<()> {
    let stderr = up.proc.stderr();
    ensure!(!stderr.contains('\x1b'), "ANSI escape codes in piped logs:\n{stderr:?}");
    ensure!(stderr.contains(" INFO "), "no log lines to check:\n{stderr}");
    Ok(())
}

/// `prism up`'s progress, written as lines on a pipe, says nothing of a Pending replica when
/// the only reason was that its own worker had not registered yet (a reader of a log takes a
/// "pending:" line for an error): the worker has room for every replica here.
fn check_no_pending_line(up: &PrismUp) -> Result<()> {
    let stderr = up.proc.stderr();
    ensure!(stderr.contains("prism up: starting the head"), "no progress lines to check:\n{stderr}");
    let pending: Vec<&str> = stderr.lines().filter(|l| l.starts_with("prism up: pending:")).collect();
    ensure!(pending.is_empty(), "a transient Pending reason printed: {pending:?}\n{stderr}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_on_a_kept_store_keeps_the_scaled_replica_count_unless_replicas_is_given() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let dir = tempfile::tempdir()?;
    let store = format!("embedded:{}", dir.path().join("state.json").display());

    // First run: one replica (the default), room for a second; then `prism scale` to 2.
    let mut up = PrismUp::start(&model, &["--store", &store, "--cpu-slots", "2"]).await?;
    assert_eq!(replicas(&up).await?, (1, 1));
    let head = up.endpoints.head.clone();
    let scaled = tokio::task::block_in_place(|| prism_cli(&["--head", &head, "scale", DEPLOYMENT, "2"]))?;
    assert!(scaled.contains("scaled to 2 replicas"), "{scaled}");
    eventually(Duration::from_secs(120), "2 Ready replicas", || async {
        Ok((replicas(&up).await? == (2, 2)).then_some(()))
    })
    .await
    .with_context(|| format!("prism up stderr:\n{}", up.proc.stderr()))?;
    check_no_escape_codes(&up)?;
    check_no_pending_line(&up)?;
    up.interrupt(Duration::from_secs(10)).await?;

    // Restart with the first run's defaults (and no --cpu-slots): the stored count is kept,
    // and `prism up` printed its endpoints only once both replicas were Ready.
    let mut up = PrismUp::start(&model, &["--store", &store]).await?;
    assert_eq!(replicas(&up).await?, (2, 2), "prism up stderr:\n{}", up.proc.stderr());
    let stderr = up.proc.stderr();
    assert!(stderr.contains(&format!("{DEPLOYMENT} is in the store")), "{stderr}");
    assert!(stderr.contains("keeping its replicas 2 (pass their flags"), "{stderr}");
    check_no_escape_codes(&up)?;
    check_no_pending_line(&up)?;
    up.interrupt(Duration::from_secs(10)).await?;

    // An explicit --replicas on the command line wins over the stored count.
    let mut up = PrismUp::start(&model, &["--store", &store, "--replicas", "1"]).await?;
    let desired = replicas(&up).await?.0;
    assert_eq!(desired, 1, "prism up stderr:\n{}", up.proc.stderr());
    eventually(Duration::from_secs(60), "1 Ready replica", || async {
        Ok((replicas(&up).await? == (1, 1)).then_some(()))
    })
    .await?;
    up.interrupt(Duration::from_secs(10)).await?;

    // Another served name makes another deployment: the earlier one stays in the store, is
    // named on startup, and the worker has CPU slots for both (no --cpu-slots); `prism delete`
    // then removes it.
    let mut up = PrismUp::start(&model, &["--store", &store, "--served-model-name", "other"]).await?;
    let stderr = up.proc.stderr();
    assert!(
        stderr.contains(&format!("the store also holds deployment {DEPLOYMENT} (1 replica)"))
            && stderr.contains(&format!("`prism delete {DEPLOYMENT}`")),
        "{stderr}"
    );
    // Its replica comes back on the restarted worker beside the new deployment's: `prism up`
    // reports ready on its own deployment, so the earlier one may finish loading a moment later.
    eventually(Duration::from_secs(60), "the earlier deployment serving again", || async {
        Ok((replicas(&up).await? == (1, 1)).then_some(()))
    })
    .await?;
    let head = up.endpoints.head.clone();
    let deleted = tokio::task::block_in_place(|| prism_cli(&["--head", &head, "delete", DEPLOYMENT]))?;
    assert!(deleted.contains(&format!("deployment {DEPLOYMENT} deleted")), "{deleted}");
    eventually(Duration::from_secs(30), "the earlier deployment gone", || async {
        let st = status(&up).await?;
        let names: Vec<&str> = st.deployments.iter().filter_map(|d| d.spec.as_ref()).map(|s| s.name.as_str()).collect();
        Ok((names == ["other"]).then_some(()))
    })
    .await?;
    up.interrupt(Duration::from_secs(10)).await?;
    Ok(())
}
