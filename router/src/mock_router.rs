//! The real router in front of [`MockEngineWorker`](crate::mock_engine::MockEngineWorker)s on static routes (model `mock`), for
//! the router's own tests: started on free loopback ports, stopped when dropped.

use tokio_util::sync::CancellationToken;

use crate::config::{RouterConfig, StaticRoute};
use crate::mock_engine::{MockBehavior, MockEngineWorker};

/// A running router and its mock replicas.
pub struct MockRouter {
    /// The router's HTTP address (`http://127.0.0.1:port`).
    pub http: String,
    /// The router's gRPC address (`http://127.0.0.1:port`).
    pub grpc: String,
    /// The mock replicas, in the order their behaviours were given.
    pub mocks: Vec<MockEngineWorker>,
    shutdown: CancellationToken,
}

impl Drop for MockRouter {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl MockRouter {
    /// Starts one mock replica of model `mock` per behaviour and a router in front of them;
    /// `tweak` adjusts the router's config.
    ///
    /// # Errors
    /// A listener that cannot bind.
    pub async fn start(behaviors: Vec<MockBehavior>, tweak: impl FnOnce(&mut RouterConfig)) -> anyhow::Result<Self> {
        let shutdown = CancellationToken::new();
        let mut mocks = Vec::new();
        let mut static_routes = Vec::new();
        for b in behaviors {
            let mock = MockEngineWorker::new(b);
            let addr = mock.clone().spawn(shutdown.clone()).await?;
            static_routes.push(StaticRoute { model: "mock".into(), endpoint: format!("http://{addr}") });
            mocks.push(mock);
        }
        let mut cfg = RouterConfig { static_routes, ..Default::default() };
        tweak(&mut cfg);
        let h = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let g = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let (http, grpc) = (format!("http://{}", h.local_addr()?), format!("http://{}", g.local_addr()?));
        tokio::spawn(crate::run(cfg, h, g, shutdown.clone()));
        Ok(Self { http, grpc, mocks, shutdown })
    }
}
