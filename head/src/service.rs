//! `HeadService` over gRPC: worker sessions, route watches and admin RPCs. Errors are
//! mapped to `tonic::Status` once, through `From<HeadError>`; followers answer
//! `UNAVAILABLE` naming the leader (message and `prism-leader` metadata). Every call is
//! first checked against the caller's token and role (`auth.rs`); every admin action leaves
//! an audit line (`audit.rs`), refused ones too.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use prism_common::proto::v1::head_service_server::HeadService;
use prism_common::proto::v1::{
    ApplyDeploymentRequest, ApplyDeploymentResponse, ClusterStatusRequest, ClusterStatusResponse,
    DeleteDeploymentRequest, DeleteDeploymentResponse, DrainNodeRequest, HeadMessage, ListDeploymentsRequest,
    ListDeploymentsResponse, ListNodesRequest, ListNodesResponse, ListReplicasRequest, ListReplicasResponse,
    NodeRequest, NodeResponse, RouteTable, RouterDemandAck, RouterDemandReport, ScaleDeploymentRequest,
    ScaleDeploymentResponse, WatchRoutesRequest, WorkerMessage,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};

use crate::auth::{Caller, HeadAuth, Rpc};
use crate::cluster::{Cluster, registry};
use crate::election::Leadership;
use crate::error::HeadError;
use crate::{admin, audit, drain};

/// Route tables buffered per watching router.
const ROUTE_QUEUE: usize = 16;

/// The gRPC service; cheap to clone.
#[derive(Clone)]
pub struct HeadGrpc {
    cluster: Arc<Cluster>,
    auth: HeadAuth,
    shutdown: CancellationToken,
}

impl HeadGrpc {
    /// Wraps the shared cluster state (its configuration's tokens guard every call);
    /// streams end when `shutdown` fires.
    pub fn new(cluster: Arc<Cluster>, shutdown: CancellationToken) -> Self {
        let auth = cluster.cfg().auth.clone();
        Self { cluster, auth, shutdown }
    }

    /// The caller of `rpc`, or the refusal (`UNAUTHENTICATED` / `PERMISSION_DENIED`); a
    /// refused admin action is audited with `args`.
    fn authorize<T>(&self, request: &Request<T>, rpc: Rpc, args: &str) -> Result<Caller, Status> {
        let value = request.metadata().get(prism_common::head_auth::AUTHORIZATION).map(|v| v.as_bytes());
        self.auth.authorize(value, rpc).map_err(|refused| {
            if rpc.is_admin_action() {
                audit::record(&refused.caller, rpc, args, Err(&refused.status));
            } else {
                tracing::debug!(rpc = rpc.name(), who = %refused.caller.name, code = ?refused.status.code(), "call refused");
            }
            refused.status
        })
    }

    /// Runs an admin action as `caller` (on the leader only) and audits its outcome.
    async fn audited<R>(
        &self,
        caller: &Caller,
        rpc: Rpc,
        args: &str,
        action: impl Future<Output = Result<R, HeadError>>,
    ) -> Result<Response<R>, Status> {
        let result = match self.leader_only() {
            Ok(()) => action.await.map_err(Status::from),
            Err(s) => Err(s),
        };
        audit::record(caller, rpc, args, result.as_ref().map(|_| ()));
        result.map(Response::new)
    }

    fn leader_only(&self) -> Result<(), Status> {
        match self.cluster.leadership() {
            Leadership::Leader => Ok(()),
            Leadership::Follower { leader } => Err(HeadError::NotLeader { leader }.into()),
        }
    }
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl HeadService for HeadGrpc {
    type WorkerSessionStream = ReceiverStream<Result<HeadMessage, Status>>;
    type WatchRoutesStream = BoxStream<RouteTable>;

    async fn worker_session(
        &self,
        request: Request<Streaming<WorkerMessage>>,
    ) -> Result<Response<Self::WorkerSessionStream>, Status> {
        let caller = self.authorize(&request, Rpc::WorkerSession, "")?;
        tracing::debug!(who = %caller.name, "worker session opened");
        self.leader_only()?;
        let peer = request.remote_addr();
        Ok(Response::new(registry::open_session(&self.cluster, request.into_inner(), peer).await?))
    }

    /// Keeps the router's latest demand (the autoscaler's queue input); a model with queued
    /// requests and no replica wakes the reconciler at once (scale from zero).
    async fn report_demand(&self, request: Request<RouterDemandReport>) -> Result<Response<RouterDemandAck>, Status> {
        self.authorize(&request, Rpc::ReportDemand, "")?;
        self.leader_only()?;
        let r = request.into_inner();
        if r.router_id.is_empty() {
            return Err(HeadError::InvalidArgument("router_id is required".into()).into());
        }
        let mut st = self.cluster.lock().await;
        let wake = r.models.iter().any(|m| {
            m.queued > 0
                && st
                    .view()
                    .deployments
                    .values()
                    .filter_map(|d| d.record.spec.as_ref())
                    .any(|s| s.replicas == 0 && prism_common::deployment::served_name(s) == m.model)
        });
        st.record_demand(r.router_id, r.models, tokio::time::Instant::now());
        drop(st);
        if wake {
            self.cluster.kick();
        }
        Ok(Response::new(RouterDemandAck {}))
    }

    async fn watch_routes(
        &self,
        request: Request<WatchRoutesRequest>,
    ) -> Result<Response<Self::WatchRoutesStream>, Status> {
        self.authorize(&request, Rpc::WatchRoutes, "")?;
        self.leader_only()?;
        let router = request.into_inner().router_id;
        let mut routes = self.cluster.subscribe_routes();
        let mut leadership = self.cluster.watch_leadership();
        let shutdown = self.shutdown.clone();
        let (tx, rx) = mpsc::channel(ROUTE_QUEUE);
        tracing::info!(%router, "router watching routes");
        tokio::spawn(async move {
            loop {
                // `None`: no table to send (the state is still loading, or leadership is being
                // lost): wait; a deposed head ends the stream below, never sending an empty table.
                let table = routes.borrow_and_update().as_ref().map(|t| t.as_ref().clone());
                if let Some(table) = table
                    && tx.send(Ok(table)).await.is_err()
                {
                    return; // the router left
                }
                let deposed: Option<Option<String>> = tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tx.closed() => return,
                    r = routes.changed() => if r.is_err() { return } else { None },
                    r = leadership.wait_for(|l| !l.is_leader()) => Some(r.ok().and_then(|l| match &*l {
                        Leadership::Follower { leader } => leader.clone(),
                        Leadership::Leader => None,
                    })),
                };
                if let Some(leader) = deposed {
                    let status: Status = HeadError::NotLeader { leader }.into();
                    let _ = tx.send(Err(status)).await;
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn apply_deployment(
        &self,
        request: Request<ApplyDeploymentRequest>,
    ) -> Result<Response<ApplyDeploymentResponse>, Status> {
        let args = request.get_ref().spec.as_ref().map_or_else(String::new, |s| {
            format!(
                "deployment={:?} replicas={} model={:?}",
                s.name,
                s.replicas,
                s.engine.as_ref().map_or("", |e| e.model.as_str())
            )
        });
        let caller = self.authorize(&request, Rpc::ApplyDeployment, &args)?;
        let spec = request.into_inner().spec;
        self.audited(&caller, Rpc::ApplyDeployment, &args, async {
            let spec = spec.ok_or_else(|| HeadError::InvalidArgument("spec is required".into()))?;
            let (deployment, created) = admin::apply_deployment(&self.cluster, spec).await?;
            Ok(ApplyDeploymentResponse { deployment: Some(deployment), created })
        })
        .await
    }

    async fn delete_deployment(
        &self,
        request: Request<DeleteDeploymentRequest>,
    ) -> Result<Response<DeleteDeploymentResponse>, Status> {
        let args = format!("deployment={:?}", request.get_ref().name);
        let caller = self.authorize(&request, Rpc::DeleteDeployment, &args)?;
        let name = request.into_inner().name;
        self.audited(&caller, Rpc::DeleteDeployment, &args, async {
            admin::delete_deployment(&self.cluster, &name).await?;
            Ok(DeleteDeploymentResponse {})
        })
        .await
    }

    async fn scale_deployment(
        &self,
        request: Request<ScaleDeploymentRequest>,
    ) -> Result<Response<ScaleDeploymentResponse>, Status> {
        let args = format!("deployment={:?} replicas={}", request.get_ref().name, request.get_ref().replicas);
        let caller = self.authorize(&request, Rpc::ScaleDeployment, &args)?;
        let r = request.into_inner();
        self.audited(&caller, Rpc::ScaleDeployment, &args, async {
            let d = admin::scale_deployment(&self.cluster, &r.name, r.replicas).await?;
            Ok(ScaleDeploymentResponse { deployment: Some(d) })
        })
        .await
    }

    async fn list_deployments(
        &self,
        request: Request<ListDeploymentsRequest>,
    ) -> Result<Response<ListDeploymentsResponse>, Status> {
        self.authorize(&request, Rpc::ListDeployments, "")?;
        self.leader_only()?;
        let s = admin::snapshot(&self.cluster).await?;
        Ok(Response::new(ListDeploymentsResponse { deployments: s.deployments }))
    }

    async fn list_nodes(&self, request: Request<ListNodesRequest>) -> Result<Response<ListNodesResponse>, Status> {
        self.authorize(&request, Rpc::ListNodes, "")?;
        self.leader_only()?;
        let s = admin::snapshot(&self.cluster).await?;
        Ok(Response::new(ListNodesResponse { nodes: s.nodes }))
    }

    async fn list_replicas(
        &self,
        request: Request<ListReplicasRequest>,
    ) -> Result<Response<ListReplicasResponse>, Status> {
        self.authorize(&request, Rpc::ListReplicas, "")?;
        self.leader_only()?;
        let dep = request.into_inner().deployment;
        let s = admin::snapshot(&self.cluster).await?;
        let replicas = s.replicas.into_iter().filter(|r| dep.is_empty() || r.deployment == dep).collect();
        Ok(Response::new(ListReplicasResponse { replicas }))
    }

    /// Answered by followers too (from the store), with `is_leader = false`.
    async fn cluster_status(
        &self,
        request: Request<ClusterStatusRequest>,
    ) -> Result<Response<ClusterStatusResponse>, Status> {
        self.authorize(&request, Rpc::ClusterStatus, "")?;
        Ok(Response::new(admin::snapshot(&self.cluster).await?))
    }

    async fn cordon_node(&self, request: Request<NodeRequest>) -> Result<Response<NodeResponse>, Status> {
        let args = format!("node={:?}", request.get_ref().node_id);
        let caller = self.authorize(&request, Rpc::CordonNode, &args)?;
        let node = request.into_inner().node_id;
        self.audited(&caller, Rpc::CordonNode, &args, async {
            Ok(NodeResponse { node: Some(admin::cordon(&self.cluster, &node).await?) })
        })
        .await
    }

    async fn uncordon_node(&self, request: Request<NodeRequest>) -> Result<Response<NodeResponse>, Status> {
        let args = format!("node={:?}", request.get_ref().node_id);
        let caller = self.authorize(&request, Rpc::UncordonNode, &args)?;
        let node = request.into_inner().node_id;
        self.audited(&caller, Rpc::UncordonNode, &args, async {
            Ok(NodeResponse { node: Some(admin::uncordon(&self.cluster, &node).await?) })
        })
        .await
    }

    async fn drain_node(&self, request: Request<DrainNodeRequest>) -> Result<Response<NodeResponse>, Status> {
        let r = request.get_ref();
        let args = format!("node={:?} deadline_ms={} reason={:?}", r.node_id, r.deadline_ms, r.reason);
        let caller = self.authorize(&request, Rpc::DrainNode, &args)?;
        let r = request.into_inner();
        self.audited(&caller, Rpc::DrainNode, &args, async {
            let node = drain::drain_node(&self.cluster, &r.node_id, r.deadline_ms, &r.reason).await?;
            Ok(NodeResponse { node: Some(node) })
        })
        .await
    }
}
