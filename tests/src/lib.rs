//! Test fixtures shared by Prism's integration tests: a real `etcd` on free loopback ports
//! ([`EtcdFixture`]), child processes killed on drop ([`ProcessGuard`]), the path of workspace
//! binaries ([`bin_path`]), free ports and polling helpers ([`free_port`], [`wait_until`]).
//! Nothing here sleeps for readiness: everything polls with a deadline.

pub mod etcd;
pub mod process;
pub mod wait;

pub use etcd::EtcdFixture;
pub use process::{ProcessGuard, bin_path, workspace_root};
pub use wait::{free_port, poll_until, wait_until};
