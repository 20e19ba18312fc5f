//! [`Gate`]: a gRPC service that answers `UNAVAILABLE` until the service it guards is
//! handed to it, then forwards every call to that service.
//!
//! The head binds and serves its gRPC port before the state store is open, so that a head
//! restarted during an etcd outage answers at once instead of leaving connections unaccepted
//! in the listen queue: workers and routers retry `UNAVAILABLE` with backoff, and `prism`
//! prints the reason instead of hanging.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::sync::watch;
use tonic::body::Body;
use tonic::server::NamedService;
use tower_service::Service;

/// The message of the `UNAVAILABLE` answered while the state store is not open yet.
pub const STORE_UNAVAILABLE: &str = "state store unavailable, retrying";

/// Answers `UNAVAILABLE` ([`STORE_UNAVAILABLE`]) while the watched service is `None`, then
/// forwards to it. Registered under the guarded service's name.
#[derive(Clone, Debug)]
pub struct Gate<S> {
    inner: watch::Receiver<Option<S>>,
}

impl<S> Gate<S> {
    /// A gate that opens when `inner` holds a service.
    pub fn new(inner: watch::Receiver<Option<S>>) -> Self {
        Self { inner }
    }
}

impl<S: NamedService> NamedService for Gate<S> {
    const NAME: &'static str = S::NAME;
}

type Answer = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

impl<S, B> Service<http::Request<B>> for Gate<S>
where
    S: Service<http::Request<B>, Response = http::Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Answer;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Answer {
        let inner = self.inner.borrow().clone();
        match inner {
            // tonic's generated servers are always ready; `poll_ready` is awaited all the same.
            Some(mut service) => Box::pin(async move {
                std::future::poll_fn(|cx| service.poll_ready(cx)).await?;
                service.call(request).await
            }),
            None => {
                let answer = tonic::Status::unavailable(STORE_UNAVAILABLE).into_http();
                Box::pin(async move { Ok(answer) })
            }
        }
    }
}
