//! The route table from a head's `WatchRoutes` (a fake head in this test): models appear,
//! Draining replicas get no work, and the router keeps serving from the last table when
//! the head goes away (fail static). The router's `ReportDemand` calls reach that head:
//! about once a second, and at once when a request queues for a model with no replica.
//! A router started while its head is down answers 503 / UNAVAILABLE with `Retry-After`
//! (never 404 or an empty model list) until the head's first table comes, then serves.

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

/// A head that only publishes routes and records demand reports with their arrival time
/// (everything else is unimplemented).
struct FakeHead(watch::Receiver<RouteTable>, Reports);

type Reports = std::sync::Arc<std::sync::Mutex<Vec<(Instant, RouterDemandReport)>>>;

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
    async fn report_demand(&self, r: Request<RouterDemandReport>) -> Result<Response<RouterDemandAck>, Status> {
        if let Ok(mut v) = self.1.lock() {
            v.push((Instant::now(), r.into_inner()));
        }
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

/// A table (version 1) with one Ready replica `ra` of model `mock` at `endpoint`.
fn one_ready_replica(endpoint: &str) -> RouteTable {
    RouteTable {
        served: vec![],
        unavailable: vec![],
        term: 0,
        models: vec!["mock".into()],
        version: 1,
        routes: vec![entry("ra", endpoint, ReplicaState::Ready)],
    }
}

/// Serves a [`FakeHead`] publishing `rx` on `listener` until `stop`.
fn serve_head(
    listener: tokio::net::TcpListener,
    rx: watch::Receiver<RouteTable>,
    reports: Reports,
    stop: &CancellationToken,
) -> tokio::task::JoinHandle<Result<(), tonic::transport::Error>> {
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(HeadServiceServer::new(FakeHead(rx, reports)))
            .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop.clone().cancelled_owned()),
    )
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

    let (tx, rx) = watch::channel(RouteTable {
        served: vec![],
        unavailable: vec![],
        term: 0,
        models: vec![],
        version: 1,
        routes: vec![],
    });
    let head_stop = CancellationToken::new();
    let hl = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let head_addr = format!("http://{}", hl.local_addr()?);
    let head = serve_head(hl, rx, Reports::default(), &head_stop);

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
        served: vec![],
        unavailable: vec![],
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
        served: vec![],
        unavailable: vec![],
        term: 0,
        models: vec![],
        version: 3,
        routes: vec![entry("rb", &eb, ReplicaState::Draining)],
    })?;
    wait_status(&http, 503).await?;
    tx.send(RouteTable {
        served: vec![],
        unavailable: vec![],
        term: 0,
        models: vec![],
        version: 4,
        routes: vec![entry("rb", &eb, ReplicaState::Ready)],
    })?;
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

/// Demand reports: every model of the table about once a second, and a request queued for a
/// model listed without a replica (scale from zero) reported at once, with its wait.
#[tokio::test]
async fn demand_reports_reach_the_head() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let a = MockEngineWorker::new(MockBehavior::default());
    let ea = format!("http://{}", a.clone().spawn(shutdown.clone()).await?);
    let table = RouteTable {
        served: vec![],
        unavailable: vec![],
        term: 0,
        models: vec!["mock".into(), "cold".into()],
        version: 1,
        routes: vec![entry("ra", &ea, ReplicaState::Ready)],
    };
    let (_tx, rx) = watch::channel(table);
    let reports = Reports::default();
    let hl = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let head_addr = format!("http://{}", hl.local_addr()?);
    serve_head(hl, rx, reports.clone(), &shutdown);
    let h = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let g = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let http = format!("http://{}", h.local_addr()?);
    let cfg = RouterConfig { heads: vec![head_addr], max_queue_wait: Duration::from_secs(3), ..Default::default() };
    tokio::spawn(prism_router::run(cfg, h, g, shutdown.clone()));
    wait_status(&http, 200).await?;
    let count = || reports.lock().map(|v| v.len()).unwrap_or(0);
    // The periodic report: both models, nothing queued.
    let t = Instant::now();
    let n0 = count();
    tokio::time::sleep(Duration::from_millis(3100)).await;
    let periodic = count() - n0;
    anyhow::ensure!((2..=5).contains(&periodic), "{periodic} reports in {:?}", t.elapsed());
    let last = reports.lock().map(|v| v.last().map(|(_, r)| r.clone())).ok().flatten().expect("a report");
    assert!(last.router_id.starts_with("router-"), "{last:?}");
    let names: Vec<&str> = last.models.iter().map(|m| m.model.as_str()).collect();
    assert_eq!(names, ["cold", "mock"]);
    assert!(last.models.iter().all(|m| m.queued == 0 && m.in_flight == 0), "{last:?}");

    // A request for the cold model queues: reported at once, not at the next tick.
    let sent = Instant::now();
    let cold = tokio::spawn(
        reqwest::Client::new()
            .post(format!("{http}/v1/completions"))
            .json(&serde_json::json!({"model": "cold", "prompt": "a", "max_tokens": 4}))
            .send(),
    );
    let until = sent + Duration::from_secs(2);
    let seen = loop {
        let hit = reports.lock().ok().and_then(|v| {
            v.iter().find(|(at, r)| *at >= sent && r.models.iter().any(|m| m.model == "cold" && m.queued == 1)).cloned()
        });
        if let Some((at, r)) = hit {
            break (at, r);
        }
        anyhow::ensure!(Instant::now() < until, "the queued request was never reported");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let latency = seen.0 - sent;
    let m = seen.1.models.iter().find(|m| m.model == "cold").expect("cold");
    assert!(m.queued_tokens > 0 && m.oldest_queued_s < 1.0, "{m:?}");
    assert!(latency < Duration::from_millis(300), "reported {latency:?} after queueing, not at once");
    // No replica comes: 503 with Retry-After once the wait bound passes.
    let r = cold.await??;
    assert_eq!(r.status().as_u16(), 503);
    assert!(r.headers().contains_key("retry-after"));
    assert!(sent.elapsed() >= Duration::from_secs(3), "waited the bound");
    shutdown.cancel();
    Ok(())
}

/// A router whose head is down has no route table: every model answer is a retryable 503 /
/// UNAVAILABLE (an OpenAI SDK gives up on a 404, and an empty `/v1/models` would say that no
/// model exists), readiness fails, and once the head is up the same requests are served.
#[tokio::test]
async fn before_the_first_route_table_requests_get_503_not_404() -> anyhow::Result<()> {
    use prism_common::proto::v1::inference_service_client::InferenceServiceClient;
    let shutdown = CancellationToken::new();
    let a = MockEngineWorker::new(MockBehavior::default());
    let ea = format!("http://{}", a.clone().spawn(shutdown.clone()).await?);
    // The head's address, with nothing listening on it yet.
    let head_addr = tokio::net::TcpListener::bind("127.0.0.1:0").await?.local_addr()?;
    let h = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let g = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let (http, grpc) = (format!("http://{}", h.local_addr()?), format!("http://{}", g.local_addr()?));
    let cfg = RouterConfig { heads: vec![format!("http://{head_addr}")], ..Default::default() };
    tokio::spawn(prism_router::run(cfg, h, g, shutdown.clone()));

    let client = reqwest::Client::new();
    let completion = serde_json::json!({"model": "mock", "prompt": "a", "max_tokens": 1});
    let started = Instant::now();
    let r = loop {
        match client.post(format!("{http}/v1/completions")).json(&completion).send().await {
            Ok(r) => break r,
            Err(_) if started.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => return Err(e.into()),
        }
    };
    assert_eq!(r.status().as_u16(), 503);
    assert!(r.headers().contains_key("retry-after"), "{:?}", r.headers());
    let body: serde_json::Value = r.json().await?;
    assert!(body["error"]["message"].is_string(), "an OpenAI error object: {body}");
    for (method, path) in [("GET", "/v1/models"), ("GET", "/v1/models/mock"), ("POST", "/tokenize")] {
        let req = client.request(method.parse()?, format!("{http}{path}"));
        let r = req.json(&serde_json::json!({"model": "mock", "prompt": "a"})).send().await?;
        assert_eq!(r.status().as_u16(), 503, "{method} {path}");
        assert!(r.headers().contains_key("retry-after"), "{method} {path}");
    }
    for probe in ["/readyz", "/health"] {
        assert_eq!(client.get(format!("{http}{probe}")).send().await?.status().as_u16(), 503, "{probe}");
    }
    let mut c = InferenceServiceClient::connect(grpc.clone()).await?;
    let generate = GenerateRequest {
        model: "mock".into(),
        prompt: Some(generate_request::Prompt::Text("a".into())),
        sampling: Some(SamplingParams { max_tokens: Some(1), ..Default::default() }),
        ..Default::default()
    };
    let s = c.generate(generate.clone()).await.expect_err("no table: UNAVAILABLE");
    assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
    assert!(s.metadata().get("retry-after").is_some(), "{s:?}");
    let s = c.list_models(ListModelsRequest {}).await.expect_err("no table: UNAVAILABLE, not an empty list");
    assert_eq!(s.code(), tonic::Code::Unavailable, "{s:?}");
    assert!(started.elapsed() < Duration::from_secs(10), "answered at once, not after a queue wait");

    // The head comes up: served, listed, ready.
    let table = one_ready_replica(&ea);
    let (_tx, rx) = watch::channel(table);
    let hl = tokio::net::TcpListener::bind(head_addr).await?;
    serve_head(hl, rx, Reports::default(), &shutdown);
    wait_status(&http, 200).await?;
    assert_eq!(client.get(format!("{http}/readyz")).send().await?.status().as_u16(), 200);
    let models: serde_json::Value = client.get(format!("{http}/v1/models")).send().await?.json().await?;
    assert_eq!(models["data"][0]["id"], "mock", "{models}");
    assert_eq!(c.list_models(ListModelsRequest {}).await?.into_inner().models.len(), 1);
    shutdown.cancel();
    Ok(())
}

/// A stream whose replica fails mid-way waits for another replica to continue it, but not
/// once the head lists the model as unavailable: it ends at once with that answer (an SSE
/// error event naming the deployment), as queued and new requests get it.
#[tokio::test]
async fn a_stream_waiting_to_migrate_ends_when_the_model_becomes_unavailable() -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let _stop = shutdown.clone().drop_guard();
    let flaky =
        MockBehavior { fail_after_tokens: Some(3), token_delay: Duration::from_millis(100), ..Default::default() };
    let ea = format!("http://{}", MockEngineWorker::new(flaky).spawn(shutdown.clone()).await?);
    let table = one_ready_replica(&ea);
    let (tx, rx) = watch::channel(table);
    let hl = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let head_addr = format!("http://{}", hl.local_addr()?);
    serve_head(hl, rx, Reports::default(), &shutdown);
    let h = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let g = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let http = format!("http://{}", h.local_addr()?);
    tokio::spawn(prism_router::run(
        RouterConfig { heads: vec![head_addr], ..Default::default() },
        h,
        g,
        shutdown.clone(),
    ));
    wait_status(&http, 200).await?;

    let r = reqwest::Client::new()
        .post(format!("{http}/v1/completions"))
        .json(&serde_json::json!({"model": "mock", "prompt": "a", "max_tokens": 20, "stream": true}))
        .send()
        .await?;
    assert_eq!(r.status().as_u16(), 200, "the stream started");
    // The replica's worker is gone and no node can run another one.
    let started = Instant::now();
    tx.send(RouteTable {
        served: vec![],
        unavailable: vec![UnavailableModel {
            model: "mock".into(),
            deployment: "mock-dep".into(),
            reason: String::new(),
            cause: UnavailableCause::NoNode as i32,
        }],
        term: 0,
        models: vec!["mock".into()],
        version: 2,
        routes: vec![],
    })?;
    let body = tokio::time::timeout(Duration::from_secs(20), r.text()).await??;
    let waited = started.elapsed();
    assert!(waited < Duration::from_secs(5), "the stream ended {waited:?} after the model became unavailable");
    let error = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .find(|v| v.get("error").is_some())
        .unwrap_or_else(|| panic!("an SSE error event: {body}"));
    let message = error["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("mock-dep"), "the unavailable answer, not the replica's loss: {error}");
    Ok(())
}
