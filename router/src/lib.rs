//! `prism-router`: the public front end of Prism. Serves the OpenAI-compatible HTTP API and
//! the gRPC `InferenceService`, keeps the route table from the head (or static routes), and
//! dispatches each request to a Ready replica chosen by cache-aware routing (the longest
//! prompt prefix in a replica's prefix cache, weighed against load, `balance/prefix.rs`) or
//! power-of-two-choices on load counted from dispatch, with retry before the first token, migration after it, ejection of failing
//! replicas, a bounded per-model admission queue (backpressure, 429, only past its bounds),
//! demand reports to the head, and cancellation on client disconnect.
//!
//! The `mock-engine` cargo feature (off by default; on in the router's own tests) adds
//! `mock_engine`, a fake worker for runtime tests, `mock_router` (the router in front of such
//! workers), and the `mock-engine` binary.

pub mod admission;
pub mod auth;
pub mod balance;
pub mod config;
pub mod demand;
pub mod dispatch;
pub mod grpc;
pub mod http_server;
pub mod metrics;
#[cfg(feature = "mock-engine")]
pub mod mock_engine;
#[cfg(feature = "mock-engine")]
pub mod mock_router;
pub mod openai;
pub mod prefix;
pub mod prefix_watch;
pub mod routes;
pub mod tokenize;
pub mod tools;
pub mod validate;

use prism_common::proto::v1::inference_service_server::InferenceServiceServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use config::{Args, RouterConfig, RoutingPolicy, StaticRoute};

/// Runs the router until `shutdown` is cancelled: HTTP on `http_listener`, gRPC (inference,
/// health, reflection) on `grpc_listener`, and the route watch on the configured heads.
///
/// # Errors
/// Server errors (bind problems are the caller's, as listeners come in bound).
pub async fn run(
    config: RouterConfig,
    http_listener: TcpListener,
    grpc_listener: TcpListener,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let metrics = metrics::Metrics::new();
    let routes = routes::Routes::new(config.max_in_flight_per_replica, metrics.clone());
    if !config.static_routes.is_empty() {
        routes.set_static(&config.static_routes);
    }
    let policy: Box<dyn balance::BalancePolicy> = match config.routing_policy {
        RoutingPolicy::P2c => Box::new(balance::PowerOfTwoChoices),
        RoutingPolicy::PrefixAware => Box::new(balance::PrefixAware::new(config.prefix_cache_weight, metrics.clone())),
    };
    let dispatcher = dispatch::Dispatcher::new(
        routes.clone(),
        policy,
        metrics.clone(),
        dispatch::DispatchConfig {
            default_timeout: config.request_timeout,
            ejection_base: config.ejection_base,
            header_timeout: config.worker_header_timeout,
        },
        admission::AdmissionConfig {
            max_queued_requests: config.max_queued_requests,
            max_queued_tokens: config.max_queued_tokens,
            max_queue_wait: config.max_queue_wait,
        },
    );
    let keys = auth::ApiKeys::new(&config.api_keys, metrics.clone());
    if keys.enabled() {
        // The count only: keys are never logged.
        tracing::info!(
            keys = config.api_keys.len(),
            metrics_without_auth = config.metrics_without_auth,
            "API keys required"
        );
    }
    let router_id = format!("router-{}", uuid::Uuid::new_v4().simple());
    let watch = tokio::spawn(routes.clone().watch(
        config.heads.clone(),
        router_id.clone(),
        config.head_token.clone(),
        shutdown.child_token(),
    ));
    let queue = tokio::spawn(dispatcher.admission().clone().run(shutdown.child_token()));
    // Prompt codecs and prefix indexes of the replicas, for cache-aware routing only.
    let caches = (config.routing_policy == RoutingPolicy::PrefixAware)
        .then(|| tokio::spawn(prefix_watch::run(routes.clone(), metrics.clone(), shutdown.child_token())));
    let demand = tokio::spawn(demand::report(
        dispatcher.admission().clone(),
        routes.clone(),
        config.heads.clone(),
        router_id,
        config.head_token.clone(),
        shutdown.child_token(),
    ));

    let codecs = std::sync::Arc::new(tokenize::ModelCodecs::new(routes.clone()));
    let http_state = openai::HttpState {
        dispatcher: dispatcher.clone(),
        metrics: metrics.clone(),
        keys: keys.clone(),
        metrics_open: config.metrics_without_auth,
        max_body_bytes: config.max_body_bytes,
        started_at: openai::unix_now(),
        max_prompts: config.max_prompts_per_request,
        codecs: codecs.clone(),
        tool_parser: config.tool_call_parser,
    };
    let app = openai::router(http_state);
    let http_shutdown = shutdown.clone();
    let http = http_server::serve_with_tls(
        http_listener,
        app,
        config.http_header_read_timeout,
        config.public_tls.clone(),
        http_shutdown,
    );

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    // grpc.health.v1 follows readiness (`RouteSnapshot::readiness`, as /readyz): SERVING while
    // a model has a Ready replica or one on its way.
    let health_task = {
        let routes = routes.clone();
        let stop = shutdown.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(std::time::Duration::from_millis(500));
            loop {
                tokio::select! { _ = stop.cancelled() => break, _ = tick.tick() => {} }
                if routes.snapshot().readiness().is_ok() {
                    health_reporter.set_serving::<InferenceServiceServer<grpc::InferenceApi>>().await;
                    health_reporter.set_service_status("", tonic_health::ServingStatus::Serving).await;
                } else {
                    health_reporter.set_not_serving::<InferenceServiceServer<grpc::InferenceApi>>().await;
                    health_reporter.set_service_status("", tonic_health::ServingStatus::NotServing).await;
                }
            }
        })
    };
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(prism_common::proto::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let api = grpc::InferenceApi {
        dispatcher,
        keys: keys.clone(),
        metrics,
        started_at: openai::unix_now(),
        tool_parser: config.tool_call_parser,
        codecs,
    };
    // The key guard wraps the whole server: reflection and unknown methods too (health stays open).
    let grpc = tonic::transport::Server::builder()
        .layer(grpc::guard::GrpcGuardLayer { keys })
        .add_service(health_service)
        .add_service(reflection)
        .add_service(InferenceServiceServer::new(api))
        .serve_with_incoming_shutdown(
            prism_common::tls::server::incoming_with(grpc_listener, config.public_tls.clone(), "public grpc"),
            shutdown.clone().cancelled_owned(),
        );
    let (h, g) = tokio::join!(http, grpc);
    watch.abort();
    health_task.abort();
    demand.abort();
    queue.abort();
    if let Some(c) = caches {
        c.abort();
    }
    h?;
    g?;
    Ok(())
}
