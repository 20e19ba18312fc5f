//! The route table from a head's `WatchRoutes` (a fake head in this test): models appear,
//! Draining replicas get no work, and the router keeps serving from the last table when
//! the head goes away (fail static).

use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::Stream;
use prism_common::proto::v1::head_service_server::{HeadService, HeadServiceServer};
use prism_common::proto::v1::*;
use prism_router::config::RouterConfig;
use prism_router::mock_engine::{MockBehavior, MockEngineWorker};
use tokio::sync::watch;
use tokio_stream::wrappers::{TcpListenerStream, WatchStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

/// A head that only publishes routes (everything else is unimplemented).
struct FakeHead(watch::Receiver<RouteTable>);

type S<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl HeadService for FakeHead {
    type WorkerSessionStream = S<HeadMessage>;
    type WatchRoutesStream = S<RouteTable>;
    async fn worker_session(&self, _: Request<Streaming<WorkerMessage>>) -> Result<Response<S<HeadMessage>>, Status> {
        Err(Status::unimplemented("fake head"))
    }
    async fn watch_routes(&self, _: Request<WatchRoutesRequest>) -> Result<Response<S<RouteTable>>, Status> {
        use futures::StreamExt;
        Ok(Response::new(Box::pin(WatchStream::new(self.0.clone()).map(Ok))))
    }
    async fn report_demand(&self, _: Request<RouterDemandReport>) -> Result<Response<RouterDemandAck>, Status> {
        Ok(Response::new(RouterDemandAck {}))
    }
    async fn apply_deployment(
        &self,
        _: Request<ApplyDeploymentRequest>,
    ) -> Result<Response<ApplyDeploymentResponse>, Status> {
        Err(Status::unimplemented("fake head"))
    }
    async fn delete_deployment(
        &self,
        _: Request<DeleteDeploymentRequest>,
    ) -> Result<Response<DeleteDeploymentResponse>, Status> {
        Err(Status::unimplemented("fake head"))
    }
    async fn scale_deployment(
        &self,
        _: Request<ScaleDeploymentRequest>,
    ) -> Result<Response<ScaleDeploymentResponse>, Status> {
        Err(Status::unimplemented("fake head"))
    }
    async fn list_deployments(
        &self,
        _: Request<ListDeploymentsRequest>,
    ) -> Result<Response<ListDeploymentsResponse>, Status> {
        Err(Status::unimplemented("fake head"))
    }
    async fn list_nodes(&self, _: Request<ListNodesRequest>) -> Result<Response<ListNodesResponse>, Status> {
        Err(Status::unimplemented("fake head"))
    }
    async fn list_replicas(&self, _: Request<ListReplicasRequest>) -> Result<Response<ListReplicasResponse>, Status> {
        Err(Status::unimplemented("fake head"))
    }
    async fn cluster_status(
        &self,
        _: Request<ClusterStatusRequest>,
    ) -> Result<Response<ClusterStatusResponse>, Status> {
        Err(Status::unimplemented("fake head"))
    }
    async fn cordon_node(&self, _: Request<NodeRequest>) -> Result<Response<NodeResponse>, Status> {
        Err(Status::unimplemented("fake head"))
    }
    async fn uncordon_node(&self, _: Request<NodeRequest>) -> Result<Response<NodeResponse>, Status> {
        Err(Status::unimplemented("fake head"))
    }
    async fn drain_node(&self, _: Request<DrainNodeRequest>) -> Result<Response<NodeResponse>, Status> {
        Err(Status::unimplemented("fake head"))
    }
}

fn entry(id: &str, endpoint: &str, state: ReplicaState) -> RouteEntry {
    RouteEntry {
        replica_id: id.into(),
        model: "mock".into(),
        endpoint: endpoint.into(),
        state: state as i32,
        ..Default::default()
    }
}

async fn wait_status(http: &str, want: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let r = reqwest::Client::new()
            .post(format!("{http}/v1/completions"))
            .json(&serde_json::json!({"model": "mock", "prompt": "a", "max_tokens": 1}))
            .send()
            .await?;
        if r.status().as_u16() == want {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "status stayed {}", r.status());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn routes_from_head_draining_and_fail_static() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let (a, b) = (MockEngineWorker::new(MockBehavior::default()), MockEngineWorker::new(MockBehavior::default()));
    let ea = format!("http://{}", a.clone().spawn(shutdown.clone()).await?);
    let eb = format!("http://{}", b.clone().spawn(shutdown.clone()).await?);

    let (tx, rx) = watch::channel(RouteTable { term: 0, models: vec![], version: 1, routes: vec![] });
    let head_stop = CancellationToken::new();
    let hl = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let head_addr = format!("http://{}", hl.local_addr()?);
    let head = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(HeadServiceServer::new(FakeHead(rx)))
            .serve_with_incoming_shutdown(TcpListenerStream::new(hl), head_stop.clone().cancelled_owned()),
    );

    let h = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let g = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let http = format!("http://{}", h.local_addr()?);
    // A model without a Ready replica waits in the admission queue for one; a short wait
    // bound makes that wait end in the 503 checked below.
    let cfg = RouterConfig { heads: vec![head_addr], max_queue_wait: Duration::from_millis(200), ..Default::default() };
    tokio::spawn(prism_router::run(cfg, h, g, shutdown.clone()));

    // Empty table: unknown model.
    wait_status(&http, 404).await?;
    tx.send(RouteTable {
        term: 0,
        models: vec![],
        version: 2,
        routes: vec![entry("ra", &ea, ReplicaState::Ready), entry("rb", &eb, ReplicaState::Draining)],
    })?;
    wait_status(&http, 200).await?;
    for _ in 0..10 {
        wait_status(&http, 200).await?;
    }
    assert_eq!(b.stats.requests.load(Ordering::Relaxed), 0, "a Draining replica never gets new work");
    let m = reqwest::get(format!("{http}/metrics")).await?.text().await?;
    assert!(m.contains("prism_route_table_version 2"), "{m}");

    // Only Draining replicas: known model, none ready → queued, 503 once the wait bound passes.
    tx.send(RouteTable {
        term: 0,
        models: vec![],
        version: 3,
        routes: vec![entry("rb", &eb, ReplicaState::Draining)],
    })?;
    wait_status(&http, 503).await?;
    tx.send(RouteTable { term: 0, models: vec![], version: 4, routes: vec![entry("rb", &eb, ReplicaState::Ready)] })?;
    wait_status(&http, 200).await?;

    // Head gone: the last table keeps serving.
    head_stop.cancel();
    drop(tx); // ends the open WatchRoutes stream so the graceful shutdown completes
    tokio::time::timeout(Duration::from_secs(10), head).await???;
    for _ in 0..10 {
        wait_status(&http, 200).await?;
    }
    assert_eq!(reqwest::get(format!("{http}/health")).await?.status().as_u16(), 200);
    shutdown.cancel();
    Ok(())
}
