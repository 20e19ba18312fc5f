//! [`Cluster`]: a real local Prism cluster for integration tests, each component its own
//! process on free loopback ports: the state store (a real single-member etcd, or the heads'
//! embedded store in a file), N `prism-head`s, M `prism-worker`s (the real engine on the
//! CPU backend, or simulated GPUs with `--simulate-gpus`) and `prism-router`s, described
//! with [`ClusterBuilder`].
//!
//! [`ClusterBuilder::start`] polls with deadlines instead of sleeping: until a head leads,
//! then until every worker has registered, then (with [`ClusterBuilder::deploy`]) until the
//! deployment is Ready at the head and listed by the router. Every process can be signalled
//! (SIGTERM, SIGSTOP / SIGCONT, SIGKILL), restarted with the same flags and ports, and read
//! for its logs ([`Cluster::logs`]); dropping the cluster kills routers, workers and heads,
//! then etcd, then removes the temporary directory.

mod deployment;
mod head;
mod router;
mod worker;

pub use deployment::Deployment;
pub use head::Head;
pub use router::Router;
pub use worker::Worker;

use crate::cli::prism_cli;
use crate::client::{SERVED, router_ready_replicas, wait_route_change};
use crate::etcd::EtcdFixture;
use crate::metrics::metric_value;
use crate::wait::{eventually, poll_until};
use anyhow::{Context, Result, bail};
use prism_common::proto::v1::{ClusterStatusResponse, NodeState, ReplicaRecord, ReplicaState};
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long the heads may take until one leads.
const LEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the workers may take to register.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a deployment of the bundled model may take to become Ready (2 cores).
const DEPLOY_TIMEOUT: Duration = Duration::from_secs(240);
/// How long the router may take to list replicas the head reports Ready.
const ROUTES_TIMEOUT: Duration = Duration::from_secs(30);
/// Bytes of each process's stderr that [`Cluster::logs`] shows.
const LOG_TAIL: usize = 6000;

/// Where the heads keep the cluster state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Store {
    /// A real single-member etcd ([`EtcdFixture`]) that every head uses.
    #[default]
    Etcd,
    /// The embedded store, persisted to `state.json` in the cluster's temporary directory
    /// (one head at a time can open it).
    Embedded,
    /// A real etcd cluster of this many members; heads get every member's endpoint.
    EtcdCluster(usize),
}

/// What to start; see [`Cluster::builder`] and [`Cluster::serving`].
#[derive(Clone, Debug)]
pub struct ClusterBuilder {
    store: Store,
    heads: usize,
    head_args: Vec<String>,
    workers: Vec<String>,
    worker_args: Vec<String>,
    worker_extra: HashMap<usize, Vec<String>>,
    routers: usize,
    router_args: Vec<String>,
    envs: Vec<(String, String)>,
    cli_args: Vec<String>,
    deployment: Option<Deployment>,
    head_auth: bool,
}

/// The tokens of a cluster started with [`ClusterBuilder::head_auth`], one per role, each
/// also in a file of the cluster's directory (`admin.token` …); the heads' token file is
/// `head-tokens`.
#[derive(Clone, Debug)]
pub struct HeadTokens {
    /// Role `admin`, label `ops`: what the fixture's own queries and [`Cluster::cli`] use.
    pub admin: String,
    /// Role `read`, label `dashboard`.
    pub read: String,
    /// Role `worker`, label `workers`: every worker's `--head-token-file`.
    pub worker: String,
    /// Role `router`, label `routers`: every router's `--head-token-file`.
    pub router: String,
}

impl HeadTokens {
    fn generate() -> Result<Self> {
        let random = || -> Result<String> {
            let mut b = [0u8; 16];
            std::io::Read::read_exact(&mut std::fs::File::open("/dev/urandom")?, &mut b)?;
            Ok(b.iter().map(|x| format!("{x:02x}")).collect())
        };
        Ok(Self { admin: random()?, read: random()?, worker: random()?, router: random()? })
    }

    /// Every token, for "no token appears in the logs" checks.
    pub fn all(&self) -> [&str; 4] {
        [&self.admin, &self.read, &self.worker, &self.router]
    }
}

fn owned<'a>(args: &'a [&'a str]) -> impl Iterator<Item = String> + 'a {
    args.iter().map(|s| (*s).to_owned())
}

impl ClusterBuilder {
    /// Where the heads keep the state (etcd unless set).
    #[must_use]
    pub fn store(mut self, store: Store) -> Self {
        self.store = store;
        self
    }

    /// Number of heads started (1 unless set; 0 for none).
    #[must_use]
    pub fn heads(mut self, n: usize) -> Self {
        self.heads = n;
        self
    }

    /// Flags added to every head's command line.
    #[must_use]
    pub fn head_args(mut self, args: &[&str]) -> Self {
        self.head_args.extend(owned(args));
        self
    }

    /// `n` workers named `w1` … `wn` (replaces the node ids given so far).
    #[must_use]
    pub fn workers(mut self, n: usize) -> Self {
        self.workers = (1..=n).map(|i| format!("w{i}")).collect();
        self
    }

    /// Workers with these node ids (replaces the node ids given so far).
    #[must_use]
    pub fn worker_nodes(mut self, nodes: &[&str]) -> Self {
        self.workers = owned(nodes).collect();
        self
    }

    /// Flags added to every worker's command line (`--simulate-gpus 4`, `--drain-grace 30` …).
    #[must_use]
    pub fn worker_args(mut self, args: &[&str]) -> Self {
        self.worker_args.extend(owned(args));
        self
    }

    /// Flags added to the command line of the worker at `index` (0 for `w1`), after the
    /// flags every worker gets.
    #[must_use]
    pub fn worker_extra(mut self, index: usize, args: &[&str]) -> Self {
        self.worker_extra.entry(index).or_default().extend(owned(args));
        self
    }

    /// Number of routers started (0 unless set).
    #[must_use]
    pub fn routers(mut self, n: usize) -> Self {
        self.routers = n;
        self
    }

    /// Flags added to every router's command line.
    #[must_use]
    pub fn router_args(mut self, args: &[&str]) -> Self {
        self.router_args.extend(owned(args));
        self
    }

    /// An environment variable for every process (`RUST_LOG` …); the test's own environment
    /// is inherited otherwise.
    #[must_use]
    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.envs.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Flags every [`Cluster::cli`] call passes before its own (e.g. the TLS identity).
    #[must_use]
    pub fn cli_args(mut self, args: &[&str]) -> Self {
        self.cli_args.extend(owned(args));
        self
    }

    /// Turns on the heads' authentication: [`HeadTokens`] are generated into a token file
    /// given as `--auth-token-file`; workers and routers get their role's token through
    /// `--head-token-file`, and the fixture's own queries and [`Cluster::cli`] use the admin
    /// token ([`Cluster::tokens`]).
    #[must_use]
    pub fn head_auth(mut self) -> Self {
        self.head_auth = true;
        self
    }

    /// Applies `deployment` once the workers have registered, and waits until its replicas
    /// are Ready at the head and listed by the router.
    #[must_use]
    pub fn deploy(mut self, deployment: Deployment) -> Self {
        self.deployment = Some(deployment);
        self
    }

    /// Starts the store, the heads (then waits until one leads), the workers, the routers
    /// (then waits until every worker has registered), and applies the deployment if one
    /// was given (then waits until it is Ready).
    ///
    /// # Errors
    /// When a process cannot be started or a wait times out; the message ends with every
    /// process's log.
    pub async fn start(mut self) -> Result<Cluster> {
        let dir = tempfile::Builder::new().prefix("prism-cluster-").tempdir()?;
        let tokens = if self.head_auth { Some(self.write_tokens(dir.path())?) } else { None };
        let (etcd, store) = match self.store {
            Store::Etcd | Store::EtcdCluster(_) => {
                let members = if let Store::EtcdCluster(n) = self.store { n } else { 1 };
                let etcd = EtcdFixture::start_cluster(members).await?;
                let store = format!("etcd://{}", etcd.endpoints().join(","));
                (Some(etcd), store)
            }
            Store::Embedded => (None, format!("embedded:{}", dir.path().join("state.json").display())),
        };
        let mut cluster = Cluster {
            routers: Vec::new(),
            workers: Vec::new(),
            heads: Vec::new(),
            served: SERVED.to_owned(),
            store,
            spec: self,
            tokens,
            etcd,
            dir,
        };
        if let Err(e) = cluster.launch().await {
            bail!("{e:#}\n{}", cluster.logs());
        }
        Ok(cluster)
    }

    /// Generates the tokens, writes the heads' token file and one file per token into
    /// `dir`, and adds the flags that use them.
    fn write_tokens(&mut self, dir: &Path) -> Result<HeadTokens> {
        let t = HeadTokens::generate()?;
        let file = dir.join("head-tokens");
        std::fs::write(
            &file,
            format!(
                "# role per token\n{} role=admin name=ops\n{} role=read name=dashboard\n{} role=worker name=workers\n\
                 {} role=router name=routers\n",
                t.admin, t.read, t.worker, t.router
            ),
        )?;
        let path = |name: &str, token: &str| -> Result<String> {
            let p = dir.join(name);
            std::fs::write(&p, format!("{token}\n"))?;
            Ok(p.to_string_lossy().into_owned())
        };
        path("admin.token", &t.admin)?;
        path("read.token", &t.read)?;
        let (worker, router) = (path("worker.token", &t.worker)?, path("router.token", &t.router)?);
        self.head_args.extend(["--auth-token-file".to_owned(), file.to_string_lossy().into_owned()]);
        self.worker_args.extend(["--head-token-file".to_owned(), worker]);
        self.router_args.extend(["--head-token-file".to_owned(), router]);
        Ok(t)
    }
}

/// A running cluster; see the module documentation. Fields drop in order: routers, workers,
/// heads, etcd, the temporary directory.
pub struct Cluster {
    /// The routers, in start order.
    pub routers: Vec<Router>,
    /// The workers, in node order.
    pub workers: Vec<Worker>,
    /// The heads, in start order.
    pub heads: Vec<Head>,
    served: String,
    store: String,
    spec: ClusterBuilder,
    tokens: Option<HeadTokens>,
    etcd: Option<EtcdFixture>,
    dir: tempfile::TempDir,
}

impl Cluster {
    /// An empty description: etcd, one head, no worker, no router.
    pub fn builder() -> ClusterBuilder {
        ClusterBuilder {
            store: Store::Etcd,
            heads: 1,
            head_args: Vec::new(),
            workers: Vec::new(),
            worker_args: Vec::new(),
            worker_extra: HashMap::new(),
            routers: 0,
            router_args: Vec::new(),
            envs: Vec::new(),
            cli_args: Vec::new(),
            deployment: None,
            head_auth: false,
        }
    }

    /// The serving cluster of the drain, failover and router tests: etcd, one head
    /// (`--worker-timeout 2s`, `--drain-timeout 30s`), `workers` workers `w1` … with a 64 MiB
    /// KV cache, one router (`--ejection-base 0.5`), and `replicas` replicas of `model`
    /// served as [`SERVED`], spread over the workers.
    pub fn serving(model: &Path, workers: usize, replicas: u32) -> ClusterBuilder {
        Self::builder()
            .head_args(&["--worker-timeout", "2s", "--drain-timeout", "30s"])
            .workers(workers)
            .worker_args(&["--kv-cache-bytes", "67108864"])
            .routers(1)
            .router_args(&["--ejection-base", "0.5"])
            .deploy(Deployment::new(model).replicas(replicas))
    }

    async fn launch(&mut self) -> Result<()> {
        for _ in 0..self.spec.heads {
            self.add_head()?;
        }
        if !self.heads.is_empty() {
            // The leader becomes the first head: the one the queries below and `cli` talk to.
            let leader = self.wait_leader(LEADER_TIMEOUT).await?;
            self.heads.swap(0, leader);
        }
        let heads = self.head_urls();
        for (i, node) in self.spec.workers.iter().enumerate() {
            let mut args = self.spec.worker_args.clone();
            args.extend(self.spec.worker_extra.get(&i).into_iter().flatten().cloned());
            self.workers.push(Worker::spawn(node, &heads, &args, &self.spec.envs)?);
        }
        for _ in 0..self.spec.routers {
            self.add_router()?;
        }
        if !self.workers.is_empty() && !self.heads.is_empty() {
            self.wait_registered(self.workers.len(), REGISTER_TIMEOUT).await?;
        }
        if let Some(deployment) = self.spec.deployment.clone() {
            self.deploy(&deployment)?;
            self.wait_ready(deployment.replicas as usize, DEPLOY_TIMEOUT).await?;
        }
        Ok(())
    }

    /// Every head's gRPC URL, comma-separated (the `--head` value of workers and routers).
    pub fn head_urls(&self) -> String {
        self.heads.iter().map(|h| h.url.as_str()).collect::<Vec<_>>().join(",")
    }

    /// Starts one more head with the same store and flags on new ports (it does not wait:
    /// a head on an embedded file that another head holds exits at once).
    ///
    /// # Errors
    /// When it cannot be started.
    pub fn add_head(&mut self) -> Result<&mut Head> {
        let name = match self.heads.len() {
            0 => "prism-head".to_owned(),
            n => format!("prism-head-{}", n + 1),
        };
        let mut head = Head::spawn(&name, &self.store, &self.spec.head_args, &self.spec.envs)?;
        head.token = self.tokens.as_ref().map(|t| t.admin.clone());
        self.heads.push(head);
        self.heads.last_mut().context("head just added")
    }

    /// Starts one more worker with node id `node`, pointed at every head, with the flags
    /// every worker gets (it does not wait for the registration).
    ///
    /// # Errors
    /// When it cannot be started.
    pub fn add_worker(&mut self, node: &str) -> Result<&mut Worker> {
        let worker = Worker::spawn(node, &self.head_urls(), &self.spec.worker_args, &self.spec.envs)?;
        self.workers.push(worker);
        self.workers.last_mut().context("worker just added")
    }

    /// Starts one more router pointed at every head.
    ///
    /// # Errors
    /// When it cannot be started.
    pub fn add_router(&mut self) -> Result<&mut Router> {
        let name = match self.routers.len() {
            0 => "prism-router".to_owned(),
            n => format!("prism-router-{}", n + 1),
        };
        let router = Router::spawn(&name, &self.head_urls(), &self.spec.router_args, &self.spec.envs)?;
        self.routers.push(router);
        self.routers.last_mut().context("router just added")
    }

    /// The first head (the one [`Cluster::cli`] and the queries below talk to).
    ///
    /// # Panics
    /// When the cluster has no head.
    pub fn head(&self) -> &Head {
        &self.heads[0]
    }

    /// The first head, mutably (to kill or restart it).
    ///
    /// # Panics
    /// When the cluster has no head.
    pub fn head_mut(&mut self) -> &mut Head {
        &mut self.heads[0]
    }

    /// The first head's gRPC URL.
    ///
    /// # Panics
    /// When the cluster has no head.
    pub fn head_url(&self) -> &str {
        &self.head().url
    }

    /// The first router.
    ///
    /// # Panics
    /// When the cluster has no router.
    pub fn router(&self) -> &Router {
        &self.routers[0]
    }

    /// The first router's gRPC URL.
    ///
    /// # Panics
    /// When the cluster has no router.
    pub fn grpc(&self) -> &str {
        &self.router().grpc
    }

    /// The first router's HTTP base.
    ///
    /// # Panics
    /// When the cluster has no router.
    pub fn http(&self) -> &str {
        &self.router().http
    }

    /// The tokens, with [`ClusterBuilder::head_auth`].
    pub fn tokens(&self) -> Option<&HeadTokens> {
        self.tokens.as_ref()
    }

    /// The store the heads were given (`etcd://127.0.0.1:PORT` or `embedded:FILE`).
    pub fn store(&self) -> &str {
        &self.store
    }

    /// The embedded store's file (meaningful with [`Store::Embedded`]).
    pub fn store_file(&self) -> std::path::PathBuf {
        self.dir.path().join("state.json")
    }

    /// The cluster's temporary directory (deployment files, the embedded store).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The etcd, with [`Store::Etcd`] (its endpoints, its log).
    pub fn etcd(&self) -> Option<&EtcdFixture> {
        self.etcd.as_ref()
    }

    /// The etcd, mutably (to kill or restart it).
    pub fn etcd_mut(&mut self) -> Option<&mut EtcdFixture> {
        self.etcd.as_mut()
    }

    /// The served model name the queries below use: the last deployment's (or [`SERVED`]).
    pub fn served(&self) -> &str {
        &self.served
    }

    /// Waits until one of the heads leads and has loaded the state; returns its index.
    ///
    /// # Errors
    /// When `timeout` passes first.
    pub async fn wait_leader(&self, timeout: Duration) -> Result<usize> {
        poll_until(timeout, "a head to lead", || async {
            for (i, h) in self.heads.iter().enumerate() {
                if h.wait_leader(Duration::ZERO).await.is_ok() {
                    return Some(i);
                }
            }
            None
        })
        .await
    }

    /// `ClusterStatus` from the first head.
    ///
    /// # Errors
    /// When it does not answer.
    pub async fn status(&self) -> Result<ClusterStatusResponse> {
        self.head().status().await
    }

    /// Waits until the first head leads with `n` registered nodes.
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_registered(&self, n: usize, timeout: Duration) -> Result<()> {
        eventually(timeout, "workers registered", || async {
            let st = self.status().await?;
            Ok((st.is_leader && st.nodes.len() == n).then_some(()))
        })
        .await
    }

    /// Writes `deployment` to a file and applies it with `prism --head HEAD deploy -f FILE`
    /// (without waiting for replicas); returns the CLI's output. Later queries use its served
    /// model name.
    ///
    /// # Errors
    /// When the file cannot be written or the CLI fails.
    pub fn deploy(&mut self, deployment: &Deployment) -> Result<String> {
        let file = self.dir.path().join(format!("{}.yaml", deployment.name));
        std::fs::write(&file, deployment.to_yaml())?;
        deployment.served_model_name.clone_into(&mut self.served);
        let f = file.to_string_lossy().into_owned();
        self.cli(&["deploy", "-f", &f])
    }

    /// Waits until the head has `n` Ready replicas and the router (when there is one) lists `n`
    /// ready replicas.
    ///
    /// # Errors
    /// On timeout, or at once when a replica is Failed.
    pub async fn wait_ready(&self, n: usize, timeout: Duration) -> Result<()> {
        eventually(timeout, "replicas Ready at the head", || async {
            let st = self.status().await?;
            no_failed_replica(&st)?;
            let ready = st.replicas.iter().filter(|r| r.state == ReplicaState::Ready as i32).count();
            Ok((ready == n).then_some(()))
        })
        .await?;
        if self.routers.is_empty() {
            return Ok(());
        }
        eventually(ROUTES_TIMEOUT, "router lists the replicas", || async {
            Ok((self.router_ready_replicas().await? == n as u32).then_some(()))
        })
        .await
    }

    /// Waits until the first router's ready replicas of the served model names in `served` add
    /// up to one per name (one single-replica deployment each).
    ///
    /// # Errors
    /// On timeout, or at once when a replica is Failed at the head.
    pub async fn wait_listed(&self, served: &[&str], timeout: Duration) -> Result<()> {
        eventually(timeout, "the router lists each model's replica", || async {
            no_failed_replica(&self.status().await?)?;
            let mut listed = 0;
            for name in served {
                listed += router_ready_replicas(self.grpc(), name).await?;
            }
            Ok((listed as usize == served.len()).then_some(()))
        })
        .await
    }

    /// The head's replica records.
    ///
    /// # Errors
    /// When the head does not answer.
    pub async fn replicas(&self) -> Result<Vec<ReplicaRecord>> {
        Ok(self.status().await?.replicas)
    }

    /// The node state of `node` at the head, and whether it is cordoned.
    ///
    /// # Errors
    /// When the head does not answer or does not know the node.
    pub async fn node_state(&self, node: &str) -> Result<(NodeState, bool)> {
        let rec = self
            .status()
            .await?
            .nodes
            .into_iter()
            .find(|n| n.inventory.as_ref().is_some_and(|i| i.node_id == node))
            .context("node unknown")?;
        Ok((rec.state(), rec.cordoned))
    }

    /// Replica id hosted on `node` (Ready or Draining), if any.
    ///
    /// # Errors
    /// When the head does not answer.
    pub async fn replica_on(&self, node: &str) -> Result<Option<String>> {
        Ok(self
            .replicas()
            .await?
            .into_iter()
            .find(|r| r.node_id == node && matches!(r.state(), ReplicaState::Ready | ReplicaState::Draining))
            .map(|r| r.replica_id))
    }

    /// Worker by node id.
    ///
    /// # Errors
    /// When there is no such worker.
    pub fn worker(&self, node: &str) -> Result<&Worker> {
        self.workers.iter().find(|w| w.node == node).context("no such worker")
    }

    /// Worker by node id, mutably (to kill, wait for or restart it).
    ///
    /// # Errors
    /// When there is no such worker.
    pub fn worker_mut(&mut self, node: &str) -> Result<&mut Worker> {
        self.workers.iter_mut().find(|w| w.node == node).context("no such worker")
    }

    /// Starts an exited worker again with its original flags (same node id and ports), as a
    /// StatefulSet pod comes back.
    ///
    /// # Errors
    /// When it is still running or cannot be started.
    pub fn restart_worker(&mut self, node: &str) -> Result<()> {
        self.worker_mut(node)?.process.restart()
    }

    /// Waits until `node`'s worker answers `/readyz` with 200.
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_worker_ready(&self, node: &str, timeout: Duration) -> Result<()> {
        self.worker(node)?.wait_ready(timeout).await
    }

    /// Kills the first head with SIGKILL.
    pub fn kill_head(&mut self) {
        self.head_mut().process.kill();
    }

    /// Starts the first head again (same flags, ports and store).
    ///
    /// # Errors
    /// When it is still running or cannot be started.
    pub fn restart_head(&mut self) -> Result<()> {
        self.head_mut().process.restart()
    }

    /// Runs `prism --head HEAD ARGS` against the first head (on a blocking section of the
    /// multi-threaded runtime; with [`ClusterBuilder::head_auth`], `--token-file` of the
    /// admin token too) and returns its stdout.
    ///
    /// # Errors
    /// When the command fails.
    pub fn cli(&self, args: &[&str]) -> Result<String> {
        let admin = self.dir.path().join("admin.token").to_string_lossy().into_owned();
        let mut all = vec!["--head", self.head_url()];
        all.extend(self.spec.cli_args.iter().map(String::as_str));
        if self.tokens.is_some() {
            all.extend(["--token-file", admin.as_str()]);
        }
        all.extend_from_slice(args);
        tokio::task::block_in_place(|| prism_cli(&all))
    }

    /// The first router's `/metrics` sum of the samples whose line starts with `name` (0 when
    /// absent).
    ///
    /// # Errors
    /// On transport errors.
    pub async fn router_metric(&self, name: &str) -> Result<f64> {
        Ok(metric_value(&self.router().metrics().await?, name))
    }

    /// The first router's `prism_router_replica_dispatches_total` of `replica`; `None` once
    /// the router dropped the series, which it does when the replica has left its route table
    /// (nothing can be dispatched to it then).
    ///
    /// # Errors
    /// On transport errors.
    pub async fn router_dispatches(&self, replica: &str) -> Result<Option<f64>> {
        let series = format!("prism_router_replica_dispatches_total{{replica_id=\"{replica}\"}}");
        Ok(crate::metrics::series_value(&self.router().metrics().await?, &series))
    }

    /// Ready replicas of the served model according to the first router (`ListModels`).
    ///
    /// # Errors
    /// When the router does not answer.
    pub async fn router_ready_replicas(&self) -> Result<u32> {
        router_ready_replicas(self.grpc(), &self.served).await
    }

    /// Polls the first router every 2 ms until its ready replica count of the served model
    /// differs from `from`; returns when that was seen.
    ///
    /// # Errors
    /// On timeout.
    pub async fn wait_route_change(&self, from: u32, timeout: Duration) -> Result<Instant> {
        wait_route_change(self.grpc(), &self.served, from, timeout).await
    }

    /// The rank processes of this cluster's parallel replicas (children of its workers),
    /// grouped by the rendezvous they joined, each group in rank order.
    pub fn rank_groups(&self) -> std::collections::BTreeMap<String, Vec<crate::ranks::RankProcess>> {
        let workers: Vec<u32> = self.workers.iter().map(|w| w.process.pid()).collect();
        crate::ranks::rank_groups(&workers)
    }

    /// Fails when a process has exited.
    ///
    /// # Errors
    /// Names the first exited process, with its log.
    pub fn check_alive(&mut self) -> Result<()> {
        let procs = self.heads.iter_mut().map(|h| &mut h.process);
        let procs = procs.chain(self.workers.iter_mut().map(|w| &mut w.process));
        for p in procs.chain(self.routers.iter_mut().map(|r| &mut r.process)) {
            if p.exited() {
                bail!("{} exited early:\n{}", p.name(), p.stderr());
            }
        }
        Ok(())
    }

    /// The tail of every process's stderr (etcd's log too), for failure messages.
    pub fn logs(&self) -> String {
        let mut out = String::new();
        let procs = self.heads.iter().map(|h| &h.process);
        let procs = procs.chain(self.workers.iter().map(|w| &w.process));
        for p in procs.chain(self.routers.iter().map(|r| &r.process)) {
            out.push_str(&format!("--- {} ---\n{}\n", p.name(), p.stderr_tail(LOG_TAIL)));
        }
        if let Some(etcd) = &self.etcd {
            let log = etcd.log();
            let cut = log.len().saturating_sub(LOG_TAIL);
            let cut = (cut..log.len()).find(|i| log.is_char_boundary(*i)).unwrap_or(log.len());
            out.push_str(&format!("--- etcd ---\n{}\n", &log[cut..]));
        }
        out
    }

    /// Every process's whole kept stderr (etcd's log too), for checks over all the logs.
    pub fn logs_full(&self) -> String {
        let procs = self.heads.iter().map(|h| &h.process);
        let procs = procs.chain(self.workers.iter().map(|w| &w.process));
        let mut out: String = procs.chain(self.routers.iter().map(|r| &r.process)).map(|p| p.stderr()).collect();
        if let Some(etcd) = &self.etcd {
            out.push_str(&etcd.log());
        }
        out
    }

    /// `result`, with [`Cluster::logs`] appended to its error.
    ///
    /// # Errors
    /// `result`'s error.
    pub fn with_logs<T>(&self, result: Result<T>) -> Result<T> {
        result.map_err(|e| anyhow::anyhow!("{e:#}\n{}", self.logs()))
    }
}

/// Fails naming the first Failed replica of `status`, with its reason.
fn no_failed_replica(status: &ClusterStatusResponse) -> Result<()> {
    if let Some(f) = status.replicas.iter().find(|r| r.state == ReplicaState::Failed as i32) {
        bail!("replica {} failed: {}", f.replica_id, f.reason);
    }
    Ok(())
}
