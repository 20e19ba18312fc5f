//! `TcpProxy`: a TCP forwarder a test puts between two components (a router and its head, a
//! worker and its head) and then cuts and heals, to partition the network without network
//! namespaces. While cut it forwards nothing in either direction and keeps every socket open
//! (a partition is silence, not a reset): peers notice through their own timeouts and
//! keep-alives, as across a real network. Healing closes the silenced connections; peers
//! reconnect through the proxy.

use anyhow::Result;
use std::net::SocketAddr;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy; dropping it stops accepting (open connections end with their tasks).
pub struct TcpProxy {
    addr: SocketAddr,
    cut: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on a free loopback port and forwards every connection to `target`.
    ///
    /// # Errors
    /// When the listener cannot be bound.
    pub async fn start(target: SocketAddr) -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (cut, cut_rx) = watch::channel(false);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(forward(client, target, cut_rx.clone()));
            }
        });
        Ok(Self { addr, cut, task })
    }

    /// `http://127.0.0.1:PORT`, to give a component instead of its peer's address.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Partitions: nothing passes until [`TcpProxy::heal`].
    pub fn cut(&self) {
        self.cut.send_replace(true);
    }

    /// Ends the partition: silenced connections close, new ones are forwarded again.
    pub fn heal(&self) {
        self.cut.send_replace(false);
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(mut client: TcpStream, target: SocketAddr, mut cut: watch::Receiver<bool>) {
    // A connection opened during a partition is accepted and then hears nothing.
    if *cut.borrow() {
        let _ = cut.wait_for(|c| !*c).await;
        return;
    }
    let Ok(mut server) = TcpStream::connect(target).await else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => return,
        _ = cut.wait_for(|c| *c) => {}
    }
    // Cut: both sockets stay open and silent until healed, then close.
    let _ = cut.wait_for(|c| !*c).await;
}
