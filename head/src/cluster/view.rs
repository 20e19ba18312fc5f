//! The leader's in-memory mirror of the stored cluster records (nodes, deployments,
//! replicas), each with the `mod_revision` it was read or written at, so writes can be
//! compare-and-swap transactions. Only the leader writes, so while it leads this mirror is
//! authoritative; it is reloaded from the store whenever leadership is gained or a
//! transaction finds the store changed underneath.

use std::collections::{BTreeMap, HashMap, HashSet};

use prism_common::proto::v1::{
    DeploymentRecord, EngineConfig, NodeRecord, NodeState, PlacementStrategy, RankGroup, ReplicaRecord, ReplicaState,
};
use prism_common::state_store::{Revision, StateStore, keys};
use prism_common::{DeploymentName, NodeId, ReplicaId};
use prost::Message;

use crate::error::{HeadError, HeadResult};
use crate::placement::planner::{DeploymentView, NodeView, ReplicaView};

/// A record with the revision of its last write (0 = not stored yet).
#[derive(Debug, Clone)]
pub struct Entry<T> {
    /// The record.
    pub record: T,
    /// `mod_revision` of its key.
    pub mod_revision: Revision,
}

/// Mirror of every stored record.
#[derive(Debug, Clone, Default)]
pub struct ClusterView {
    /// Node records by id.
    pub nodes: BTreeMap<NodeId, Entry<NodeRecord>>,
    /// Deployment records by name.
    pub deployments: BTreeMap<DeploymentName, Entry<DeploymentRecord>>,
    /// Replica records by id.
    pub replicas: BTreeMap<ReplicaId, Entry<ReplicaRecord>>,
}

/// Decodes a stored protobuf record.
///
/// # Errors
/// [`HeadError::Corrupt`] when the bytes are not a `T`.
pub fn decode<T: Message + Default>(key: &str, bytes: &[u8]) -> HeadResult<T> {
    T::decode(bytes).map_err(|e| HeadError::Corrupt { key: key.to_owned(), reason: e.to_string() })
}

/// Node id of a node record (from its inventory).
pub fn node_id(r: &NodeRecord) -> NodeId {
    NodeId::from(r.inventory.as_ref().map(|i| i.node_id.as_str()).unwrap_or_default())
}

impl ClusterView {
    /// Loads every record from the store.
    ///
    /// # Errors
    /// Store failures and undecodable records.
    pub async fn load(store: &dyn StateStore) -> HeadResult<Self> {
        let mut v = Self::default();
        let (nodes, _) = store.list(keys::NODES).await?;
        for (k, val) in nodes {
            let r: NodeRecord = decode(&k, &val.value)?;
            v.nodes.insert(node_id(&r), Entry { record: r, mod_revision: val.mod_revision });
        }
        let (deps, _) = store.list(keys::DEPLOYMENTS).await?;
        for (k, val) in deps {
            let r: DeploymentRecord = decode(&k, &val.value)?;
            let name = DeploymentName::from(r.spec.as_ref().map(|s| s.name.as_str()).unwrap_or_default());
            v.deployments.insert(name, Entry { record: r, mod_revision: val.mod_revision });
        }
        let (reps, _) = store.list(keys::REPLICAS).await?;
        for (k, val) in reps {
            let r: ReplicaRecord = decode(&k, &val.value)?;
            v.replicas
                .insert(ReplicaId::from(r.replica_id.as_str()), Entry { record: r, mod_revision: val.mod_revision });
        }
        Ok(v)
    }

    /// The store key of a replica record.
    pub fn replica_key(r: &ReplicaRecord) -> String {
        keys::replica(&DeploymentName::from(r.deployment.as_str()), &ReplicaId::from(r.replica_id.as_str()))
    }

    /// Replicas placed on `node`: those whose driver (rank 0) runs there.
    pub fn replicas_on<'a>(&'a self, node: &'a NodeId) -> impl Iterator<Item = &'a Entry<ReplicaRecord>> + 'a {
        self.replicas.values().filter(move |e| e.record.node_id == node.as_str())
    }

    /// Replicas whose GPU group has ranks on `node` besides their driver's node (member ranks).
    pub fn members_on<'a>(&'a self, node: &'a NodeId) -> impl Iterator<Item = &'a Entry<ReplicaRecord>> + 'a {
        self.replicas.values().filter(move |e| member_part(&e.record, node).is_some())
    }

    /// Replicas with any rank on `node` (driver or member).
    pub fn replicas_touching<'a>(&'a self, node: &'a NodeId) -> impl Iterator<Item = &'a Entry<ReplicaRecord>> + 'a {
        self.replicas
            .values()
            .filter(move |e| e.record.node_id == node.as_str() || member_part(&e.record, node).is_some())
    }

    /// GPUs (slots) per replica of a deployment: `tensor_parallel_size x
    /// pipeline_parallel_size` (1 when unknown).
    pub fn tp_of(&self, deployment: &str) -> u32 {
        self.deployments
            .get(&DeploymentName::from(deployment))
            .and_then(|d| d.record.spec.as_ref())
            .and_then(|s| s.engine.as_ref())
            .map_or(1, world_size)
    }

    /// GPUs (slots) asked for by Pending replicas: unmet demand for cluster autoscalers.
    pub fn pending_gpus(&self) -> u32 {
        self.replicas
            .values()
            .filter(|e| e.record.state() == ReplicaState::Pending)
            .map(|e| self.tp_of(&e.record.deployment))
            .sum()
    }

    /// The planner's inputs. `connected` holds the nodes with a live worker session;
    /// a replica that failed after being Ready is due for replacement `restart_delay`
    /// after it failed. A GPU group (more than one rank) that failed while starting is
    /// due too, after `restart_delay x 2^n` (n = `group_start_retries` of its deployment,
    /// at most 6): a rank that crashed or was OOM-killed while loading is transient, and a
    /// start failure that repeats backs off instead of looping. A one-rank replica that
    /// failed while starting stays Failed (a bad spec). Replica loads are 0 here (the
    /// caller fills them from load reports).
    pub fn planner_inputs(
        &self,
        connected: &HashSet<NodeId>,
        restart_delay: std::time::Duration,
        group_start_retries: &HashMap<DeploymentName, u32>,
    ) -> (Vec<NodeView>, Vec<DeploymentView>, Vec<ReplicaView>) {
        let now = prism_common::time::unix_ms();
        let nodes = self
            .nodes
            .iter()
            .map(|(id, e)| {
                let r = &e.record;
                let inv = r.inventory.clone().unwrap_or_default();
                let gpu = !inv.gpus.is_empty();
                let slots = if gpu { inv.gpus.iter().map(|g| g.index).collect() } else { (0..inv.cpu_slots).collect() };
                let alive = r.state() != NodeState::Dead;
                NodeView {
                    id: id.clone(),
                    slots,
                    gpu,
                    labels: inv.labels.into_iter().collect(),
                    schedulable: alive && !r.cordoned && r.state() == NodeState::Ready && connected.contains(id),
                    alive,
                }
            })
            .collect();
        let deployments = self
            .deployments
            .iter()
            .filter_map(|(name, e)| {
                let s = e.record.spec.as_ref()?;
                Some(DeploymentView {
                    name: name.clone(),
                    tensor_parallel_size: s.engine.as_ref().map_or(1, |e| e.tensor_parallel_size.max(1)),
                    pipeline_parallel_size: s.engine.as_ref().map_or(1, pipeline_size),
                    replicas: s.replicas,
                    strategy: PlacementStrategy::try_from(s.placement).unwrap_or(PlacementStrategy::Spread),
                    node_selector: s.node_selector.clone().into_iter().collect(),
                    min_on_demand: s.min_on_demand,
                    generation: e.record.generation,
                })
            })
            .collect();
        let replicas = self
            .replicas
            .iter()
            .map(|(id, e)| {
                let r = &e.record;
                ReplicaView {
                    id: id.clone(),
                    deployment: DeploymentName::from(r.deployment.as_str()),
                    node: (!r.node_id.is_empty()).then(|| NodeId::from(r.node_id.as_str())),
                    slots: r.gpu_indices.clone(),
                    members: member_parts(r)
                        .map(|g| (NodeId::from(g.node_id.as_str()), g.gpu_indices.clone()))
                        .collect(),
                    state: r.state(),
                    reason: r.reason.clone(),
                    generation: r.generation,
                    restart_due: r.state() == ReplicaState::Failed && {
                        let delay = restart_delay.as_millis() as u64;
                        let since = now.saturating_sub(r.failed_unix_ms);
                        if r.ready_unix_ms > 0 {
                            since >= delay
                        } else if self.tp_of(&r.deployment) > 1 {
                            let n = group_start_retries
                                .get(&DeploymentName::from(r.deployment.as_str()))
                                .copied()
                                .unwrap_or(0);
                            since >= delay.saturating_mul(1 << n.min(6))
                        } else {
                            false
                        }
                    },
                    load: 0,
                }
            })
            .collect();
        (nodes, deployments, replicas)
    }
}

/// Whether a replica is Draining but still takes new requests (an operator's node drain
/// keeps it serving until it is replaced or its deadline passes; the route table lists it
/// as Ready).
pub fn serves_while_draining(r: &ReplicaRecord) -> bool {
    r.state() == ReplicaState::Draining && r.drain_serving
}

/// Pipeline stages of an engine config (absent or 0 = 1).
pub fn pipeline_size(e: &EngineConfig) -> u32 {
    e.pipeline_parallel_size.unwrap_or(1).max(1)
}

/// GPUs (slots) one replica of an engine config holds: `tensor_parallel_size x
/// pipeline_parallel_size`.
pub fn world_size(e: &EngineConfig) -> u32 {
    e.tensor_parallel_size.max(1).saturating_mul(pipeline_size(e))
}

/// The parts of a replica's GPU group on nodes other than its driver's (none when every
/// rank is on the driver's node, or on records written before groups could span nodes).
pub fn member_parts(r: &ReplicaRecord) -> impl Iterator<Item = &RankGroup> {
    r.rank_groups.iter().filter(move |g| g.node_id != r.node_id)
}

/// The part of a replica's GPU group on member node `node` (None for its driver's node).
pub fn member_part<'a>(r: &'a ReplicaRecord, node: &NodeId) -> Option<&'a RankGroup> {
    member_parts(r).find(|g| g.node_id == node.as_str())
}

/// Every node of a replica's GPU group with its slots, the driver's first (none while Pending).
pub fn group_nodes(r: &ReplicaRecord) -> Vec<(NodeId, Vec<u32>)> {
    if r.node_id.is_empty() {
        return Vec::new();
    }
    std::iter::once((NodeId::from(r.node_id.as_str()), r.gpu_indices.clone()))
        .chain(member_parts(r).map(|g| (NodeId::from(g.node_id.as_str()), g.gpu_indices.clone())))
        .collect()
}
