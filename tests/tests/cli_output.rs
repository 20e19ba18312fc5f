//! What the binaries write when their output is not a terminal (here: pipes, as for a log
//! file or a container runtime):
//! - a `prism-head`'s logs carry no ANSI colour codes unless `CLICOLOR_FORCE` asks for them,
//!   and never with `NO_COLOR`;
//! - `prism deploy --dry-run` prints the deployment as a YAML deployment file (the keys a user
//!   writes, the defaults filled in) that `prism deploy` reads back as the same deployment,
//!   and refuses what a head refuses on apply, with the head's message and a non-zero exit.
//!
//! None needs the model or a worker.

use anyhow::{Context, Result, ensure};
use prism_common::proto::v1::{ApplyDeploymentRequest, DeploymentSpec, EngineConfig};
use prism_tests::{Head, bin_path, prism_cli, workspace_root};
use std::time::Duration;

/// The stderr of a `prism-head` (embedded store) started with `envs`, once it leads.
async fn head_logs(envs: &[(&str, &str)]) -> Result<String> {
    let dir = tempfile::tempdir()?;
    let store = format!("embedded:{}", dir.path().join("state.json").display());
    // The test's own environment must not decide: every variable is set, empty = unset.
    let mut all: Vec<(String, String)> =
        ["NO_COLOR", "CLICOLOR_FORCE", "CLICOLOR", "TERM"].iter().map(|k| ((*k).to_owned(), String::new())).collect();
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

/// Each deployment a head refuses on apply (asked over gRPC with the spec `prism deploy`
/// sends for the file) is refused by `prism deploy --dry-run` too: non-zero exit, nothing
/// printed, the head's own message on stderr.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deploy_dry_run_refuses_what_the_head_refuses_with_its_message() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let store = format!("embedded:{}", dir.path().join("state.json").display());
    let head = Head::spawn("prism-head", &store, &[], &[])?;
    let mut client = head.wait_leader(Duration::from_secs(30)).await?;
    let engine = |tensor_parallel_size| EngineConfig {
        model: "/m.gguf".into(),
        served_model_name: "a".into(),
        tensor_parallel_size,
        ..EngineConfig::default()
    };
    let spec = |tp, replicas, max_replicas| DeploymentSpec {
        name: "a".into(),
        engine: Some(engine(tp)),
        replicas,
        max_replicas,
        ..DeploymentSpec::default()
    };
    let cases = [
        ("engine: {tensor_parallel_size: 2000}\n", spec(2000, 1, 0)),
        ("replicas: 5\nmax_replicas: 2\n", spec(1, 5, 2)),
        ("replicas: 0\nmin_replicas: 1\n", DeploymentSpec { min_replicas: 1, ..spec(1, 0, 0) }),
    ];
    for (extra, spec) in cases {
        let refused = client.apply_deployment(ApplyDeploymentRequest { spec: Some(spec) }).await;
        let status = refused.err().with_context(|| format!("the head accepted {extra:?}"))?;
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{extra:?}: {status:?}");

        let file = dir.path().join("bad.yaml");
        std::fs::write(&file, format!("name: a\nmodel: /m.gguf\n{extra}"))?;
        let out = std::process::Command::new(bin_path("prism")?)
            .args(["deploy", "--dry-run", "-f"])
            .arg(&file)
            .env("RUST_BACKTRACE", "0")
            .output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "--dry-run accepted {extra:?}:\n{}", String::from_utf8_lossy(&out.stdout));
        assert!(out.stdout.is_empty(), "{extra:?}: printed {:?}", String::from_utf8_lossy(&out.stdout));
        assert!(stderr.contains(status.message()), "{extra:?}: {stderr:?} does not say {:?}", status.message());
    }
    Ok(())
}
