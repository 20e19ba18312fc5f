//! The admin commands against real heads (etcd), with the real `prism` binary and no worker
//! (every replica stays Pending):
//! - `writes_sent_to_a_follower_reach_the_leader`: `--head FOLLOWER` and `--head A,B` (a
//!   list, as workers and routers take it) deploy, scale and delete: a follower's refusal
//!   naming the leader is followed once; `prism status` is answered by a follower itself; an
//!   unreachable head at the front of the list is skipped.
//! - `a_large_status_shows_pending_replicas_once_and_stops_quietly_when_its_reader_goes`:
//!   3,000 Pending replicas make one row of `prism status`; `prism status --all` lists each,
//!   and when the reader of its output goes after one line (`| head -1`) it exits as a
//!   process ended by SIGPIPE does (141), without a panic.

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_status_shows_pending_replicas_once_and_stops_quietly_when_its_reader_goes() -> Result<()> {
    const PENDING: usize = 3000;
    let cluster = Cluster::builder().start().await?;
    let outcome = async {
        let head = cluster.head_url().to_owned();
        prism_ok(&head, &["deploy", "-f", &deployment_file(cluster.dir(), PENDING as u32)?])?;
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while cluster.status().await?.replicas.len() < PENDING {
            ensure!(std::time::Instant::now() < deadline, "the head did not create {PENDING} replicas in 60 s");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }

        let out = prism_ok(&head, &["status"])?;
        // Replica rows: REPLICA DEPLOYMENT NODE GPUS CPU-SLOTS STATE …
        let pending = |l: &&str| l.split_whitespace().nth(5) == Some("Pending");
        let rows: Vec<&str> = out.lines().filter(pending).collect();
        assert_eq!(rows.len(), 1, "{out}");
        assert!(rows[0].starts_with(&format!("×{PENDING} ")), "{out}");
        let all = prism_ok(&head, &["status", "--all"])?;
        assert_eq!(all.lines().filter(pending).count(), PENDING);

        // `prism status --all | head -1`: far more than a pipe holds, and the reader goes.
        let out = tokio::task::block_in_place(|| -> Result<Output> {
            use std::io::BufRead;
            let mut child = std::process::Command::new(bin_path("prism")?)
                .args(["--head", &head, "status", "--all"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()?;
            let stdout = child.stdout.take().context("stdout")?;
            let mut first = String::new();
            std::io::BufReader::new(stdout).read_line(&mut first)?;
            ensure!(first.starts_with("Head leader:"), "{first}");
            Ok(child.wait_with_output()?)
        })?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert_eq!(out.status.code(), Some(141), "{stderr}");
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}
