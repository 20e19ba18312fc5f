//! What the admin commands and `prism up` tell their user, with the real `prism` binary:
//! - `prism_scale_and_delete_name_the_deployment_and_what_cannot_be_placed`: against a real
//!   head and one worker offering one CPU slot (the bundled model; skipped when absent unless
//!   `PRISM_REQUIRE_MODEL=1`): an unknown deployment is named as given, never as a Rust
//!   value nor after a gRPC code's name, by `prism delete` and `prism scale`; `prism scale` past the cluster's room is
//!   accepted, in the right number, with a notice of how many replicas stay Pending and why.
//! - `prism_up_refuses_an_empty_served_model_name_at_once`: no waiting for a name that no
//!   client could ask for.
//! - `the_example_deployments_have_served_names_of_their_own`: the README deploys them into
//!   one cluster, and a head refuses a served name that another deployment already serves.

use anyhow::Result;
use prism_tests::{Cluster, Deployment, bin_path, model, prism_cli, workspace_root};
use std::collections::HashMap;
use std::process::Output;
use std::time::{Duration, Instant};

/// `prism --head HEAD ARGS` (stdout and stderr, whatever the exit).
fn prism(head: &str, args: &[&str]) -> Result<Output> {
    let out = std::process::Command::new(bin_path("prism")?).args(["--head", head]).args(args).output()?;
    Ok(out)
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prism_scale_and_delete_name_the_deployment_and_what_cannot_be_placed() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::builder()
        .worker_nodes(&["w1"])
        .worker_args(&["--cpu-slots", "1", "--kv-cache-bytes", "67108864", "--engine-threads", "1"])
        .start()
        .await?;
    let outcome = async {
        let head = cluster.head_url().to_owned();
        for args in [&["delete", "nope"][..], &["scale", "nope", "2"]] {
            let out = tokio::task::block_in_place(|| prism(&head, args))?;
            let err = text(&out.stderr);
            assert!(!out.status.success(), "prism {args:?} succeeded");
            assert!(err.contains("deployment \"nope\" not found"), "prism {args:?}: {err}");
            assert!(!err.contains("DeploymentName"), "prism {args:?}: {err}");
            // A sentence, not the gRPC code's name.
            assert!(!err.contains("NotFound"), "prism {args:?}: {err}");
        }

        cluster.deploy(&Deployment::new(&model).replicas(1))?;
        let out = tokio::task::block_in_place(|| prism(&head, &["scale", "smollm2", "3"]))?;
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(out.status.success(), "{stderr}");
        assert_eq!(stdout.trim(), "deployment smollm2 scaled to 3 replicas");
        assert!(
            stderr.contains(
                "notice: 2 of 3 replicas cannot be placed on the current nodes: needs 1 CPU slot on one node; \
                 largest free group is 0; they stay Pending until capacity joins"
            ),
            "{stderr}"
        );

        let out = tokio::task::block_in_place(|| prism(&head, &["scale", "smollm2", "1"]))?;
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(text(&out.stdout).trim(), "deployment smollm2 scaled to 1 replica");
        assert!(!text(&out.stderr).contains("notice"), "{}", text(&out.stderr));
        anyhow::Ok(())
    }
    .await;
    cluster.with_logs(outcome)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prism_up_refuses_an_empty_served_model_name_at_once() -> Result<()> {
    for name in ["", "  "] {
        let started = Instant::now();
        let out = std::process::Command::new(bin_path("prism")?)
            .args(["up", "--served-model-name", name, "--port", "0", "--grpc-port", "0", "--head-port", "0"])
            .args(["--head-http-port", "0", "--worker-port", "0", "--worker-http-port", "0"])
            .current_dir(workspace_root())
            .output()?;
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{name:?}: prism up started");
        assert!(err.contains("--served-model-name (PRISM_SERVED_MODEL_NAME) is empty"), "{name:?}: {err}");
        assert!(started.elapsed() < Duration::from_secs(20), "{name:?}: took {:?}", started.elapsed());
    }
    Ok(())
}

#[test]
fn the_example_deployments_have_served_names_of_their_own() -> Result<()> {
    let mut served: HashMap<String, String> = HashMap::new();
    for entry in std::fs::read_dir(workspace_root().join("docs/examples"))? {
        let path = entry?.path();
        if path.extension().is_none_or(|e| e != "yaml") {
            continue;
        }
        let file = path.to_string_lossy().into_owned();
        let printed: serde_yaml::Value = serde_yaml::from_str(&prism_cli(&["deploy", "--dry-run", "-f", &file])?)?;
        let name = printed["served_model_name"].as_str().unwrap_or_default().to_owned();
        assert!(!name.is_empty(), "{file}: no served_model_name in the dry run:\n{printed:?}");
        if let Some(other) = served.insert(name.clone(), file.clone()) {
            panic!("{file} and {other} are both served as {name}");
        }
    }
    assert!(served.len() >= 2, "{served:?}");
    Ok(())
}
