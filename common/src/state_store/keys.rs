//! The key layout of Prism's cluster state, in one place (see ARCHITECTURE.md "State layout").
//! Everything lives under [`ROOT`] = `/prism/v1/`; values are protobuf records from `proto/`.

use crate::ids::{DeploymentName, NodeId, ReplicaId};

/// Root prefix of every Prism key.
pub const ROOT: &str = "/prism/v1/";

/// Prefix of node records: `/prism/v1/nodes/`.
pub const NODES: &str = "/prism/v1/nodes/";

/// Prefix of deployment records: `/prism/v1/deployments/`.
pub const DEPLOYMENTS: &str = "/prism/v1/deployments/";

/// Prefix of every replica record: `/prism/v1/replicas/`.
pub const REPLICAS: &str = "/prism/v1/replicas/";

/// Prefix of GPU reservations: `/prism/v1/reservations/`.
pub const RESERVATIONS: &str = "/prism/v1/reservations/";

/// Prefix of election keys: `/prism/v1/election/`.
pub const ELECTION: &str = "/prism/v1/election/";

/// Name of the head election (key `/prism/v1/election/head`).
pub const HEAD_ELECTION: &str = "head";

/// `/prism/v1/nodes/{node_id}`.
pub fn node(id: &NodeId) -> String {
    format!("{NODES}{id}")
}

/// `/prism/v1/deployments/{name}`.
pub fn deployment(name: &DeploymentName) -> String {
    format!("{DEPLOYMENTS}{name}")
}

/// `/prism/v1/replicas/{deployment}/` — every replica of one deployment.
pub fn replicas_of(deployment: &DeploymentName) -> String {
    format!("{REPLICAS}{deployment}/")
}

/// `/prism/v1/replicas/{deployment}/{replica_id}`.
pub fn replica(deployment: &DeploymentName, id: &ReplicaId) -> String {
    format!("{REPLICAS}{deployment}/{id}")
}

/// `/prism/v1/reservations/{node_id}/` — every GPU reservation on one node.
pub fn reservations_of(node: &NodeId) -> String {
    format!("{RESERVATIONS}{node}/")
}

/// `/prism/v1/reservations/{node_id}/{gpu_index}` — created-if-absent in the same transaction
/// that writes a replica record, so two heads can never book one GPU twice.
pub fn reservation(node: &NodeId, gpu_index: u32) -> String {
    format!("{RESERVATIONS}{node}/{gpu_index}")
}

/// `/prism/v1/election/{name}`, e.g. `election("head")`.
pub fn election(name: &str) -> String {
    format!("{ELECTION}{name}")
}

/// The last path segment of a key (`/prism/v1/nodes/n1` → `n1`).
pub fn last_segment(key: &str) -> &str {
    key.rsplit('/').next().unwrap_or(key)
}

/// The smallest key greater than every key starting with `prefix` (etcd's range end for a
/// prefix); `None` when the prefix is empty or all `0xff` (then the range is unbounded).
pub fn prefix_end(prefix: &str) -> Option<Vec<u8>> {
    let mut end = prefix.as_bytes().to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout() {
        let d = DeploymentName::from("llama");
        assert_eq!(node(&NodeId::from("n1")), "/prism/v1/nodes/n1");
        assert_eq!(deployment(&d), "/prism/v1/deployments/llama");
        assert_eq!(replica(&d, &ReplicaId::from("r1")), "/prism/v1/replicas/llama/r1");
        assert!(replica(&d, &ReplicaId::from("r1")).starts_with(&replicas_of(&d)));
        assert_eq!(reservation(&NodeId::from("n1"), 3), "/prism/v1/reservations/n1/3");
        assert_eq!(election(HEAD_ELECTION), "/prism/v1/election/head");
        assert_eq!(last_segment("/prism/v1/nodes/n1"), "n1");
        assert_eq!(prefix_end("/a/"), Some(b"/a0".to_vec()));
        assert_eq!(prefix_end(""), None);
    }
}
