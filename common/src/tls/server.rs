//! Server side: a stream of accepted connections for tonic's `serve_with_incoming*`,
//! plaintext or TLS. Each TLS handshake runs in its own task (a slow or silent client
//! cannot hold up the accept loop) with the identity's current server configuration, so a
//! rotated certificate is served to the next connection. A refused handshake (no client
//! certificate, one not signed by the CA) is logged with the peer's address and dropped.

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::Tls;

/// A client that has not finished its handshake in this long is dropped.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// One accepted connection.
#[derive(Debug)]
pub enum ServerIo {
    /// Plaintext TCP.
    Plain(TcpStream),
    /// TLS over TCP, handshake done.
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// The accepted connections of a listener.
pub type Incoming = Pin<Box<dyn Stream<Item = io::Result<ServerIo>> + Send>>;

/// Accepted connections of `listener` with the process's internal identity (mutual TLS)
/// when one is installed ([`super::install_internal`]), else plaintext.
pub fn incoming(listener: TcpListener) -> Incoming {
    incoming_with(listener, super::internal(), "grpc")
}

/// Accepted connections of `listener`: TLS with `tls` (client certificates required when
/// it has a CA), plaintext with `None`. `what` names the listener in logs.
pub fn incoming_with(listener: TcpListener, tls: Option<Arc<Tls>>, what: &'static str) -> Incoming {
    let Some(tls) = tls else {
        return Box::pin(TcpListenerStream::new(listener).map(|r| {
            r.map(|tcp| {
                let _ = tcp.set_nodelay(true);
                ServerIo::Plain(tcp)
            })
        }));
    };
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                () = tx.closed() => return,
                r = listener.accept() => match r {
                    Ok(a) => a,
                    Err(e) => {
                        // EMFILE and the like: back off instead of spinning.
                        tracing::warn!(listener = what, error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = tokio_rustls::TlsAcceptor::from(tls.server_config());
            let tx = tx.clone();
            tokio::spawn(async move {
                match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => {
                        let _ = tx.send(Ok(ServerIo::Tls(Box::new(s)))).await;
                    }
                    Ok(Err(e)) => tracing::warn!(listener = what, %peer, error = %e, "TLS handshake refused"),
                    Err(_) => tracing::warn!(listener = what, %peer, "TLS handshake timed out"),
                }
            });
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

impl ServerIo {
    /// The TCP stream under the connection.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Self::Plain(s) => s,
            Self::Tls(s) => s.get_ref().0,
        }
    }
}

impl Connected for ServerIo {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.tcp().connect_info()
    }
}

impl AsyncRead for ServerIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ServerIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(s) => s.is_write_vectored(),
            Self::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_flush(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
