//! What the binaries write when their output is not a terminal (here: pipes, as for a log
//! file or a container runtime):
//! - a `prism-head`'s logs carry no ANSI colour codes unless `CLICOLOR_FORCE` asks for them,
//!   and never with `NO_COLOR`;
//! - `prism deploy --dry-run` prints the deployment as a YAML deployment file (the keys a user
//!   writes, the defaults filled in) that `prism deploy` reads back as the same deployment.
//!
//! Neither needs the model or a running cluster.

use anyhow::{Context, Result, ensure};
use prism_tests::{Head, prism_cli, workspace_root};
use std::time::Duration;

/// The stderr of a `prism-head` (embedded store) started with `envs`, once it leads.
async fn head_logs(envs: &[(&str, &str)]) -> Result<String> {
    let dir = tempfile::tempdir()?;
    let store = format!("embedded:{}", dir.path().join("state.json").display());
    // The test's own environment must not decide: both variables are set, empty = unset.
    let mut all = vec![("NO_COLOR".to_owned(), String::new()), ("CLICOLOR_FORCE".to_owned(), String::new())];
    all.extend(envs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
    all.push(("RUST_LOG".to_owned(), "info".to_owned()));
    let mut head = Head::spawn("prism-head", &store, &[], &all)?;
    head.wait_leader(Duration::from_secs(30)).await?;
    head.process.kill();
    head.process.wait_stderr_closed(Duration::from_secs(10)).await?;
    let logs = head.process.stderr();
    ensure!(logs.contains("became leader"), "no leader line in the logs:\n{logs}");
    Ok(logs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_written_to_a_pipe_carry_no_colour_codes() -> Result<()> {
    let plain = head_logs(&[]).await?;
    assert!(!plain.contains('\x1b'), "ANSI escape codes in piped logs:\n{plain:?}");
    assert!(plain.lines().any(|l| l.contains(" INFO ") && l.contains("became leader")), "{plain}");

    let forced = head_logs(&[("CLICOLOR_FORCE", "1")]).await?;
    assert!(forced.contains("\x1b["), "CLICOLOR_FORCE=1 gives colour even on a pipe:\n{forced}");

    let refused = head_logs(&[("CLICOLOR_FORCE", "1"), ("NO_COLOR", "1")]).await?;
    assert!(!refused.contains('\x1b'), "NO_COLOR wins over CLICOLOR_FORCE:\n{refused:?}");
    Ok(())
}

#[test]
fn deploy_dry_run_prints_a_deployment_file_that_reads_back_the_same() -> Result<()> {
    let example = workspace_root().join("docs/examples/smollm2.yaml");
    let example = example.to_str().context("path")?;
    let printed = prism_cli(&["deploy", "--dry-run", "-f", example])?;
    let file: serde_yaml::Value = serde_yaml::from_str(&std::fs::read_to_string(example)?)?;
    let out: serde_yaml::Value =
        serde_yaml::from_str(&printed).with_context(|| format!("the dry run is not YAML:\n{printed}"))?;
    for key in ["name", "model", "replicas", "placement"] {
        assert_eq!(out[key], file[key], "{key}:\n{printed}");
    }
    for key in ["max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"] {
        assert_eq!(out["engine"][key], file["engine"][key], "engine.{key}:\n{printed}");
    }
    // Defaults that apply are written out: the served name is the deployment's name unless set.
    let served = file["served_model_name"].as_str().or(file["name"].as_str());
    assert_eq!(out["served_model_name"].as_str(), served, "{printed}");
    assert_eq!(out["engine"]["tensor_parallel_size"].as_u64(), Some(1), "{printed}");

    // Its own output read back prints the same again: nothing lost, nothing added.
    let dir = tempfile::tempdir()?;
    let again = dir.path().join("again.yaml");
    std::fs::write(&again, &printed)?;
    let reprinted = prism_cli(&["deploy", "--dry-run", "-f", again.to_str().context("path")?])?;
    assert_eq!(reprinted, printed);
    Ok(())
}
