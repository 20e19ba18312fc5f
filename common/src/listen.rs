//! Binding the listening sockets that command-line flags name. A port already taken is the
//! common startup failure, and the OS's "Address already in use" names neither the address
//! nor the flag; [`BindError`] says both, and which flag picks another.

use std::net::SocketAddr;
use tokio::net::TcpListener;

/// A listening socket could not be bound.
#[derive(Debug, thiserror::Error)]
pub enum BindError {
    /// Another socket listens on the address already (`EADDRINUSE`).
    #[error("{flag} {addr} is already in use (another process is listening); pick another with {flag}")]
    InUse {
        /// The flag that gave the address, e.g. `--http-listen`.
        flag: &'static str,
        /// The address asked for.
        addr: SocketAddr,
    },
    /// Any other failure: an address this host does not have, a privileged port.
    #[error("cannot listen on {flag} {addr}: {source}")]
    Other {
        /// The flag that gave the address.
        flag: &'static str,
        /// The address asked for.
        addr: SocketAddr,
        /// The OS's error.
        #[source]
        source: std::io::Error,
    },
}

impl BindError {
    /// The flag that gave the address.
    pub fn flag(&self) -> &'static str {
        match self {
            Self::InUse { flag, .. } | Self::Other { flag, .. } => flag,
        }
    }

    /// The address that could not be bound.
    pub fn addr(&self) -> SocketAddr {
        match self {
            Self::InUse { addr, .. } | Self::Other { addr, .. } => *addr,
        }
    }
}

/// Listens on `addr`, which the command-line flag `flag` (e.g. `--http-listen`) gave.
///
/// # Errors
/// [`BindError::InUse`] when another socket listens there, [`BindError::Other`] otherwise.
pub async fn bind(addr: SocketAddr, flag: &'static str) -> Result<TcpListener, BindError> {
    TcpListener::bind(addr).await.map_err(|source| match source.kind() {
        std::io::ErrorKind::AddrInUse => BindError::InUse { flag, addr },
        _ => BindError::Other { flag, addr, source },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_taken_port_names_the_flag_and_the_address() {
        let taken = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = taken.local_addr().expect("addr");
        let err = bind(addr, "--http-listen").await.expect_err("the port is taken");
        assert!(matches!(err, BindError::InUse { flag: "--http-listen", addr: a } if a == addr), "{err:?}");
        let shown = err.to_string();
        assert!(shown.starts_with(&format!("--http-listen {addr} is already in use")), "{shown}");
        assert!(shown.ends_with("pick another with --http-listen"), "{shown}");
    }

    #[tokio::test]
    async fn a_free_port_is_bound() {
        let l = bind(SocketAddr::from(([127, 0, 0, 1], 0)), "--listen").await.expect("free");
        assert_ne!(l.local_addr().expect("addr").port(), 0);
    }
}
