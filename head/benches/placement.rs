//! Placement benchmark: 1,000 replicas (10 deployments × 100, tensor_parallel_size 1) over
//! 100 simulated nodes of 16 GPUs. Reports (a) the pure planner's placement decisions per
//! second and (b) the full reconciler pass on an in-memory `EmbeddedStore` — decisions per
//! second including the store transactions, and store writes per placement.
//! Run: `cargo bench -p prism-head --bench placement`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use prism_common::proto::v1::{DeploymentSpec, EngineConfig, GpuInfo, NodeInventory, PlacementStrategy, ReplicaState};
use prism_common::state_store::{EmbeddedStore, StateStore};
use prism_head::cluster::registry;
use prism_head::placement::planner::{self, Action, DeploymentView, NodeView, PlacementDecision};
use prism_head::placement::reconciler::Pass;
use prism_head::{Cluster, HeadConfig, Leadership, StoreSpec, admin};
use tokio::sync::watch;

const NODES: u32 = 100;
const GPUS: u32 = 16;
const DEPLOYMENTS: u32 = 10;
const PER_DEPLOYMENT: u32 = 100;

fn pure_planner() {
    let nodes: Vec<NodeView> = (0..NODES)
        .map(|i| NodeView {
            id: format!("node-{i:03}").into(),
            slots: (0..GPUS).collect(),
            gpu: true,
            labels: BTreeMap::new(),
            schedulable: true,
            alive: true,
        })
        .collect();
    let deps: Vec<DeploymentView> = (0..DEPLOYMENTS)
        .map(|d| DeploymentView {
            name: format!("dep-{d}").into(),
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            replicas: PER_DEPLOYMENT,
            strategy: PlacementStrategy::Spread,
            node_selector: BTreeMap::new(),
            min_on_demand: 0,
            generation: 1,
        })
        .collect();
    let runs = 5;
    let t = Instant::now();
    let mut placed = 0;
    for _ in 0..runs {
        let actions = planner::plan(&nodes, &deps, &[]);
        placed = actions
            .iter()
            .filter(|a| matches!(a, Action::Create { placement: PlacementDecision::Assigned { .. }, .. }))
            .count();
    }
    let per_run = t.elapsed().as_secs_f64() / f64::from(runs);
    println!(
        "pure planner: {placed} placements over {NODES} nodes in {:.2} ms -> {:.0} decisions/s",
        per_run * 1e3,
        placed as f64 / per_run
    );
}

async fn reconciler_on_embedded_store() -> anyhow::Result<()> {
    let store: Arc<dyn StateStore> = Arc::new(EmbeddedStore::in_memory()?);
    let (_lead_tx, lead_rx) = watch::channel(Leadership::Leader);
    let cfg = HeadConfig::new(StoreSpec::Embedded("unused".into()), "http://127.0.0.1:50050");
    let cluster = Cluster::new(cfg, store, lead_rx, prism_head::metrics::Metrics::new());
    cluster.on_elected(1).await?;
    // Registered workers (their command streams are kept so the starts can be queued).
    let mut sessions = Vec::new();
    for i in 0..NODES {
        let inv = NodeInventory {
            node_id: format!("node-{i:03}"),
            address: format!("http://10.0.0.{i}:50061"),
            gpus: (0..GPUS).map(|g| GpuInfo { index: g, ..Default::default() }).collect(),
            ..Default::default()
        };
        sessions.push(registry::register(&cluster, inv, None).await?);
    }
    for d in 0..DEPLOYMENTS {
        let spec = DeploymentSpec {
            name: format!("dep-{d}"),
            engine: Some(EngineConfig { model: "/m.gguf".into(), tensor_parallel_size: 1, ..Default::default() }),
            replicas: PER_DEPLOYMENT,
            ..Default::default()
        };
        admin::apply_deployment(&cluster, spec).await?;
    }
    let writes_before = cluster.store_writes().await;
    let t = Instant::now();
    // A pass stops at its time budget: as many as it takes to place everything.
    while prism_head::placement::reconciler::reconcile_once(&cluster).await? == Pass::More {}
    let took = t.elapsed().as_secs_f64();
    let writes = cluster.store_writes().await - writes_before;
    let status = admin::snapshot(&cluster).await?;
    let placed = status.replicas.iter().filter(|r| r.state() == ReplicaState::Starting).count();
    println!(
        "reconciler + EmbeddedStore (in memory): {placed} placements in {:.1} ms -> {:.0} decisions/s; {writes} store transactions = {:.2} per placement (each: replica record + 1 reservation key per GPU, compare-and-swap)",
        took * 1e3,
        placed as f64 / took,
        writes as f64 / placed.max(1) as f64
    );
    drop(sessions);
    Ok(())
}

fn main() -> anyhow::Result<()> {
    pure_planner();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(reconciler_on_embedded_store())
}
