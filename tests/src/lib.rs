//! Test fixtures shared by Prism's integration tests. Everything runs for real on loopback:
//! - [`Cluster`] / [`ClusterBuilder`]: etcd (or the embedded store), N `prism-head`s,
//!   M `prism-worker`s and routers as child processes on free ports, each one signalled,
//!   restarted and read for its logs through [`Process`]; [`Deployment`] is what it deploys.
//! - [`PrismUp`]: `prism up` (the one-machine mode) as one child process.
//! - [`EtcdFixture`]: a real etcd (one member or a cluster), killed and restarted on demand.
//! - [`TcpProxy`]: a TCP forwarder between two components that a test cuts and heals.
//! - rank processes of parallel replicas, from `/proc` ([`rank_processes`], [`rank_groups`]),
//!   and signals to them ([`signal_pid`]).
//! - clients: greedy gRPC streams ([`stream`]), checked closed-loop load ([`Load`]), the
//!   OpenAI HTTP API ([`post_json`], [`post_sse`]), the model's greedy reference
//!   ([`check_reference_greedy`]), Prometheus text ([`metric_sum`], [`metric_value`]).
//! - Python: the venvs of the `setup.sh` scripts ([`venv_python`], [`openai_venv`]) and the
//!   OpenAI-client scripts run against a [`PrismUp`] ([`run_openai_script`]).
//! - paths and polling: [`bin_path`], [`model`], [`free_port`], [`wait_until`],
//!   [`poll_until`], [`eventually`]. Nothing here sleeps for readiness: everything polls
//!   with a deadline.

pub mod cli;
pub mod client;
pub mod cluster;
pub mod etcd;
pub mod metrics;
pub mod paths;
pub mod process;
pub mod proxy;
pub mod python;
pub mod ranks;
pub mod up;
pub mod wait;

pub use cli::prism_cli;
pub use client::{
    Load, LoadReport, PROMPTS, ReferenceCase, SERVED, StreamResult, check_models, check_reference_greedy,
    greedy_request, post_json, post_sse, reference, reference_cases, router_ready_replicas, stream, stream_counted,
    wait_route_change,
};
pub use cluster::{Cluster, ClusterBuilder, Deployment, Head, HeadTokens, Router, Store, Worker};
pub use etcd::EtcdFixture;
pub use metrics::{metric_sum, metric_value, quantile, series_value};
pub use paths::{GEMMA_FILE, MODEL_FILE, bin_path, gemma_model, model, workspace_root};
pub use process::{Process, ProcessGuard, alive, descendants};
pub use proxy::TcpProxy;
pub use python::{OPENAI_SETUP, openai_venv, run_openai_script, venv_python};
pub use ranks::{RankProcess, rank_groups, rank_processes, signal_pid};
pub use up::{PrismUp, UpEndpoints};
pub use wait::{eventually, free_port, poll_until, wait_until};
