//! The gRPC API-key guard: a tower layer around the whole gRPC server (every service, and
//! paths no service serves), so any call but the `grpc.health.v1` probes
//! ([`crate::auth::is_grpc_probe`]) without a valid `authorization: Bearer KEY` gets
//! UNAUTHENTICATED — inference, reflection and unknown methods alike. An authenticated call
//! is counted against its key's requests-per-second limit (RESOURCE_EXHAUSTED with
//! `retry-after` metadata) and carries its [`Caller`] in the request extensions (tonic hands
//! them to the service) for the token limit of `Generate`.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::Status;

use crate::admission::RETRY_AFTER_METADATA;
use crate::auth::{ApiKeys, Caller, Limited};

/// The layer (`tonic::transport::Server::builder().layer(..)`).
#[derive(Clone)]
pub struct GrpcGuardLayer {
    /// Accepted keys and their limits.
    pub keys: ApiKeys,
}

impl<S> tower_layer::Layer<S> for GrpcGuardLayer {
    type Service = GrpcGuard<S>;
    fn layer(&self, inner: S) -> Self::Service {
        GrpcGuard { inner, keys: self.keys.clone() }
    }
}

/// The guarded service.
#[derive(Clone)]
pub struct GrpcGuard<S> {
    inner: S,
    keys: ApiKeys,
}

/// RESOURCE_EXHAUSTED for a per-key limit, with `retry-after` metadata.
pub fn limited_status(l: Limited) -> Status {
    let mut s = Status::resource_exhausted(l.message());
    s.metadata_mut().insert(RETRY_AFTER_METADATA, tonic::metadata::MetadataValue::from(l.retry_after_s));
    s
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, R> tower_service::Service<http::Request<B>> for GrpcGuard<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        if self.keys.enabled() && !crate::auth::is_grpc_probe(req.uri().path()) {
            let values = req.headers().get_all(http::header::AUTHORIZATION).iter().map(http::HeaderValue::as_bytes);
            let caller: Option<Caller> = match self.keys.authenticate(values) {
                Ok(c) => c,
                Err(_) => {
                    let s = Status::unauthenticated("missing or invalid API key (send authorization: Bearer KEY)");
                    return Box::pin(std::future::ready(Ok(s.into_http())));
                }
            };
            if let Err(l) = self.keys.admit_request(caller) {
                return Box::pin(std::future::ready(Ok(limited_status(l).into_http())));
            }
            if let Some(c) = caller {
                req.extensions_mut().insert(c);
            }
        }
        Box::pin(self.inner.call(req))
    }
}
