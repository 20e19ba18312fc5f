//! The HTTP server of the OpenAI API: hyper-util's HTTP/1.1 + HTTP/2 connection builder
//! (what `axum::serve` uses) with a header read timeout, so a client that sends half a
//! request head cannot hold a connection forever (body reads are bounded in
//! [`crate::openai`]). Graceful shutdown: stop accepting, let open connections finish.
//! Optional server-only TLS (`--public-tls-cert`): the handshake runs in the connection's
//! task with the identity's current (reloaded) configuration.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves `app` on `listener` until `shutdown`, then waits for open connections to finish.
/// A connection whose request head does not arrive within `header_read_timeout` is closed.
///
/// # Errors
/// None so far (accept errors are logged and retried); `io::Result` for the caller's `?`.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    header_read_timeout: Duration,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_with_tls(listener, app, header_read_timeout, None, shutdown).await
}

/// As [`serve`], with TLS from `tls` when given (HTTP/1.1 and h2 through ALPN).
///
/// # Errors
/// As [`serve`].
pub async fn serve_with_tls(
    listener: TcpListener,
    app: axum::Router,
    header_read_timeout: Duration,
    tls: Option<Arc<prism_common::tls::Tls>>,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let graceful = GracefulShutdown::new();
    let mut builder = Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(header_read_timeout);
    builder.http2().timer(TokioTimer::new());
    loop {
        let (tcp, peer) = tokio::select! {
            _ = shutdown.cancelled() => break,
            r = listener.accept() => match r {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "http accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        // TCP_NODELAY: small responses written in parts must not wait for delayed ACKs.
        let _ = tcp.set_nodelay(true);
        if let Some(tls) = &tls {
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config());
            let (builder, app, watcher) = (builder.clone(), app.clone(), graceful.watcher());
            tokio::spawn(async move {
                let stream = match tokio::time::timeout(header_read_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => return tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
                };
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), TowerToHyperService::new(app));
                if let Err(e) = watcher.watch(conn.into_owned()).await {
                    tracing::debug!(error = %e, "http connection ended with an error");
                }
            });
            continue;
        }
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(tcp), TowerToHyperService::new(app.clone()));
        let conn = graceful.watch(conn.into_owned());
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "http connection ended with an error");
            }
        });
    }
    drop(listener);
    graceful.shutdown().await;
    Ok(())
}
