//! The admin commands against a cluster of several heads (etcd), with the real `prism`
//! binary and no worker (every replica stays Pending):
//! - `writes_sent_to_a_follower_reach_the_leader`: `--head FOLLOWER` and `--head A,B` (a
//!   list, as workers and routers take it) deploy, scale and delete: a follower's refusal
//!   naming the leader is followed once; `prism status` is answered by a follower itself; an
//!   unreachable head at the front of the list is skipped.

use anyhow::{Context, Result, ensure};
use prism_tests::{Cluster, bin_path, workspace_root};
use std::process::Output;
use std::time::Duration;

/// `prism --head HEAD ARGS` in the workspace root (stdout and stderr, whatever the exit).
fn prism(head: &str, args: &[&str]) -> Result<Output> {
    let out = std::process::Command::new(bin_path("prism")?)
        .args(["--head", head])
        .args(args)
        .current_dir(workspace_root())
        .output()?;
    Ok(out)
}

/// As [`prism`], failing unless it exits 0; returns its stdout.
fn prism_ok(head: &str, args: &[&str]) -> Result<String> {
    let out = tokio::task::block_in_place(|| prism(head, args))?;
    ensure!(
        out.status.success(),
        "prism --head {head} {} failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A deployment file of `replicas` replicas of a model no worker will load (there is none).
fn deployment_file(dir: &std::path::Path, replicas: u32) -> Result<String> {
    let path = dir.join("smol.yaml");
    std::fs::write(&path, format!("name: smol\nmodel: /nowhere/smol.gguf\nreplicas: {replicas}\n"))?;
    Ok(path.to_str().context("path")?.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_sent_to_a_follower_reach_the_leader() -> Result<()> {
    let cluster = Cluster::builder().heads(2).start().await?;
    let outcome = async {
        let leader_index = cluster.wait_leader(Duration::from_secs(30)).await?;
        let urls: Vec<String> = cluster.head_urls().split(',').map(str::to_owned).collect();
        let (leader, follower) = (&urls[leader_index], &urls[1 - leader_index]);
        let file = deployment_file(cluster.dir(), 0)?;

        let out = prism_ok(follower, &["deploy", "-f", &file])?;
        assert!(out.contains("deployment smol created"), "{out}");
        let out = prism_ok(follower, &["scale", "smol", "2"])?;
        assert!(out.contains("deployment smol scaled to 2 replicas"), "{out}");
        let listed = format!("{follower},{leader}");
        let out = prism_ok(&listed, &["scale", "smol", "3"])?;
        assert!(out.contains("scaled to 3 replicas"), "{out}");
        let spec = cluster.status().await?.deployments.into_iter().find_map(|d| d.spec).context("no deployment")?;
        assert_eq!(spec.replicas, 3);

        // Reads are answered by the follower itself (from the store).
        let out = prism_ok(follower, &["status"])?;
        let leader_port = leader.rsplit(':').next().unwrap_or_default();
        let line = out.lines().next().unwrap_or_default();
        assert!(line.starts_with("Head leader: ") && line.ends_with(leader_port), "{out}");
        assert!(out.contains("smol"), "{out}");
        // A head that does not answer at the front of the list is skipped.
        let out = prism_ok(&format!("http://127.0.0.1:1,{follower}"), &["status"])?;
        assert!(out.contains("smol"), "{out}");

        let out = prism_ok(&listed, &["delete", "smol"])?;
        assert!(out.contains("deployment smol deleted"), "{out}");
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}
