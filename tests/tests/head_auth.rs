//! Head authentication on a real local cluster (etcd, a head with `--auth-token-file`, one
//! worker on the bundled SmolLM2 GGUF and one router, each presenting its own token):
//! - every admin RPC without a token is `UNAUTHENTICATED`, with the read token
//!   `PERMISSION_DENIED` (drain included) while `ClusterStatus` answers, with the admin
//!   token it succeeds; `/v1/events` needs a read token, the probes do not;
//! - the worker and the router registered and watch routes with their own tokens (the
//!   cluster serves a completion); a worker with a wrong token never registers;
//! - one audit line per admin action in the head's log, naming who, what and the outcome,
//!   refused calls included; no token appears in any process's log;
//! - `prism status` works with `--token` / `--token-file` and fails clearly without.
//!
//! Skipped when the model is absent unless `PRISM_REQUIRE_MODEL=1`.

use anyhow::{Context, Result, bail};
use prism_common::head_auth::HeadClient;
use prism_common::proto::v1::{
    ApplyDeploymentRequest, ClusterStatusRequest, DeleteDeploymentRequest, DeploymentSpec, DrainNodeRequest,
    EngineConfig, NodeRequest, ScaleDeploymentRequest,
};
use prism_tests::{Cluster, Worker, eventually, model, post_json, prism_cli};
use serde_json::json;
use std::time::Duration;
use tonic::Code;

/// The admin RPCs, in an order the admin token can run them all successfully: a second
/// deployment with no replica is created, scaled (to its count), deleted; `w1` is cordoned,
/// uncordoned and finally drained.
const ADMIN_RPCS: [&str; 6] =
    ["ApplyDeployment", "ScaleDeployment", "DeleteDeployment", "CordonNode", "UncordonNode", "DrainNode"];

/// Calls the admin RPC `rpc` with `client`; the gRPC code of its answer.
async fn call(client: &mut HeadClient, rpc: &str) -> Result<Code> {
    let spec = DeploymentSpec {
        name: "extra".into(),
        engine: Some(EngineConfig { model: "/models/none.gguf".into(), tensor_parallel_size: 1, ..Default::default() }),
        replicas: 0,
        ..Default::default()
    };
    let node = NodeRequest { node_id: "w1".into() };
    let r = match rpc {
        "ApplyDeployment" => client.apply_deployment(ApplyDeploymentRequest { spec: Some(spec) }).await.map(|_| ()),
        "ScaleDeployment" => {
            client.scale_deployment(ScaleDeploymentRequest { name: "extra".into(), replicas: 0 }).await.map(|_| ())
        }
        "DeleteDeployment" => {
            client.delete_deployment(DeleteDeploymentRequest { name: "extra".into() }).await.map(|_| ())
        }
        "CordonNode" => client.cordon_node(node).await.map(|_| ()),
        "UncordonNode" => client.uncordon_node(node).await.map(|_| ()),
        "DrainNode" => client
            .drain_node(DrainNodeRequest { node_id: "w1".into(), deadline_ms: 5000, reason: "maintenance".into() })
            .await
            .map(|_| ()),
        other => bail!("unknown rpc {other}"),
    };
    Ok(r.err().map_or(Code::Ok, |s| s.code()))
}

/// `s` without the terminal colour sequences (`ESC [ ... m`) of the log formatter.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

async fn roles_and_audit(cluster: &mut Cluster) -> Result<()> {
    let tokens = cluster.tokens().context("auth on")?.clone();
    let head = cluster.head();

    // The worker registered and the router follows the routes with their own tokens: the
    // cluster serves.
    let url = format!("{}/v1/completions", cluster.http());
    let body = json!({"model": cluster.served(), "prompt": "The capital of France is", "max_tokens": 4});
    let (code, answer) = post_json(&url, &body).await?;
    assert_eq!(code, 200, "{answer}");
    assert!(!answer["choices"][0]["text"].as_str().unwrap_or_default().is_empty(), "{answer}");

    let mut anonymous = head.client_with(None).await?;
    let mut read = head.client_with(Some(&tokens.read)).await?;
    let mut admin = head.client_with(Some(&tokens.admin)).await?;
    let mut worker = head.client_with(Some(&tokens.worker)).await?;
    for rpc in ADMIN_RPCS {
        assert_eq!(call(&mut anonymous, rpc).await?, Code::Unauthenticated, "{rpc} without a token");
        assert_eq!(call(&mut read, rpc).await?, Code::PermissionDenied, "{rpc} with the read token");
        assert_eq!(call(&mut worker, rpc).await?, Code::PermissionDenied, "{rpc} with the worker token");
    }
    let denied = read
        .drain_node(DrainNodeRequest { node_id: "w1".into(), ..Default::default() })
        .await
        .expect_err("read cannot drain");
    assert_eq!(denied.message(), "DrainNode needs role admin; the token \"dashboard\" has role read");
    let unknown = cluster.head().client_with(Some("not-a-known-token-000000")).await?;
    let status = unknown.clone().cluster_status(ClusterStatusRequest {}).await.expect_err("unknown token");
    assert_eq!(status.code(), Code::Unauthenticated);
    // Reading is what the read token is for; nothing changed above.
    let st = read.cluster_status(ClusterStatusRequest {}).await?.into_inner();
    assert!(st.is_leader);
    assert_eq!(st.deployments.len(), 1, "a refused apply changed the state");
    assert_eq!(cluster.node_state("w1").await?, (prism_common::proto::v1::NodeState::Ready, false));
    for rpc in ADMIN_RPCS {
        assert_eq!(call(&mut admin, rpc).await?, Code::Ok, "{rpc} with the admin token");
    }
    assert_eq!(cluster.node_state("w1").await?.0, prism_common::proto::v1::NodeState::Draining);

    // The event log needs a read token; the probes and /metrics do not.
    let http = reqwest::Client::new();
    let events = format!("{}/v1/events", head.http);
    assert_eq!(http.get(&events).send().await?.status(), 401);
    assert_eq!(http.get(&events).bearer_auth(&tokens.worker).send().await?.status(), 403);
    let ok = http.get(&events).bearer_auth(&tokens.read).send().await?;
    assert_eq!(ok.status(), 200);
    assert!(ok.json::<serde_json::Value>().await?["events"].is_array());
    for probe in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(http.get(format!("{}{probe}", head.http)).send().await?.status(), 200, "{probe}");
    }

    // A worker with a wrong token is refused and never registers.
    let args = ["--head-token".to_owned(), "wrong-token-0000000000".to_owned()];
    let mut intruder = Worker::spawn("intruder", cluster.head_url(), &args, &[])?;
    eventually(Duration::from_secs(30), "the intruder's refusal in its log", || {
        let log = intruder.process.stderr();
        async move { Ok(log.contains("WorkerSession: the token is not known to this head").then_some(())) }
    })
    .await?;
    let nodes = cluster.status().await?.nodes;
    assert!(nodes.iter().all(|n| n.inventory.as_ref().is_none_or(|i| i.node_id != "intruder")), "{nodes:?}");
    intruder.process.kill();

    // `prism status`: with --token (read) and --token-file (admin, the fixture's), not without.
    let read_out = prism_cli(&["--head", cluster.head_url(), "--token", &tokens.read, "status"])?;
    assert!(read_out.contains("w1"), "{read_out}");
    let admin_out = cluster.cli(&["status"])?;
    assert!(admin_out.contains("w1"), "{admin_out}");
    let e = prism_cli(&["--head", cluster.head_url(), "status"]).expect_err("no token");
    let e = format!("{e:#}");
    assert!(e.contains("not authenticated: ClusterStatus needs a token") && e.contains("--token"), "{e}");

    // One audit line per admin action: the fixture's deploy, 6 refused anonymously, 6 + 1
    // refused for the read token, 6 for the worker token, 6 done by the admin.
    let log = strip_ansi(&cluster.head().process.stderr());
    let audit: Vec<&str> = log.lines().filter(|l| l.contains(" INFO audit ")).collect();
    for rpc in ADMIN_RPCS {
        let with = |who: &str, outcome: &str| {
            audit
                .iter()
                .filter(|l| {
                    l.contains(&format!("who={who} "))
                        && l.contains(&format!("rpc={rpc} "))
                        && l.contains(&format!("outcome={outcome}"))
                })
                .count()
        };
        assert_eq!(with("anonymous", "UNAUTHENTICATED"), 1, "{rpc}: {audit:#?}");
        let read_refusals = if rpc == "DrainNode" { 2 } else { 1 };
        assert_eq!(with("dashboard", "PERMISSION_DENIED"), read_refusals, "{rpc}: {audit:#?}");
        assert_eq!(with("workers", "PERMISSION_DENIED"), 1, "{rpc}: {audit:#?}");
        // The fixture's own `prism deploy` of the served model is the first apply.
        let done = if rpc == "ApplyDeployment" { 2 } else { 1 };
        assert_eq!(with("ops", "ok"), done, "{rpc}: {audit:#?}");
    }
    assert_eq!(audit.len(), 1 + 6 * 4 + 1, "{audit:#?}");
    let drain = audit.iter().find(|l| l.contains("who=ops") && l.contains("DrainNode")).context("drain line")?;
    assert!(drain.contains(r#"args="node=\"w1\" deadline_ms=5000 reason=\"maintenance\"""#), "{drain}");
    let scale = audit.iter().find(|l| l.contains("who=ops") && l.contains("ScaleDeployment")).context("scale")?;
    assert!(scale.contains(r#"args="deployment=\"extra\" replicas=0""#), "{scale}");

    // No token anywhere in the logs (the intruder's wrong one included) or CLI output.
    let mut logs = cluster.logs_full();
    logs.push_str(&intruder.process.stderr());
    logs.push_str(&read_out);
    logs.push_str(&e);
    for t in tokens.all().into_iter().chain(["wrong-token-0000000000", "not-a-known-token-000000"]) {
        assert!(!logs.contains(t), "a token appears in the logs");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admin_rpcs_need_the_admin_role_and_leave_an_audit_line() -> Result<()> {
    let Some(model) = model() else { return Ok(()) };
    let mut cluster = Cluster::serving(&model, 1, 1).head_auth().start().await?;
    if let Err(e) = roles_and_audit(&mut cluster).await {
        bail!("{e:#}\n{}", cluster.logs());
    }
    Ok(())
}
