//! prism-head: the control plane. Keeps cluster state in the state store, places
//! replicas on workers, publishes routes to routers, and elects one leader among heads.

pub mod config;
pub mod placement;
pub mod election;
pub mod store;
