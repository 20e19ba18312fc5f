//! The route table published to routers through `WatchRoutes`: every Ready or Draining
//! replica ( as Ready while an operator's drain keeps it serving until its replacement
//! is Ready) with its endpoint, served model name, load and limits, and the served models that
//! no replica is coming to serve, with why ([`availability`]). A new table (with a higher
//! `version`) is published only when its content changes.

pub mod availability;

use std::sync::Arc;

use prism_common::DeploymentName;
use prism_common::deployment::served_name;
use prism_common::proto::v1::{DeploymentRecord, ReplicaRecord, ReplicaState, RouteEntry, RouteTable, ServedModel};
use prism_common::time::unix_ms;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::cluster::state::State;
use crate::cluster::view::serves_while_draining;
use availability::{REGISTRATION_GRACE, unavailable};

/// Builds the route table content (version 0) from the leader's state.
pub fn build(st: &State) -> Vec<RouteEntry> {
    st.view()
        .replicas
        .iter()
        .filter(|(_, e)| matches!(e.record.state(), ReplicaState::Ready | ReplicaState::Draining))
        .map(|(id, e)| {
            let r = &e.record;
            let deployment = st.view().deployments.get(&DeploymentName::from(r.deployment.as_str()));
            let engine = deployment.and_then(|d| d.record.spec.as_ref()).and_then(|s| s.engine.as_ref());
            RouteEntry {
                replica_id: r.replica_id.clone(),
                deployment: r.deployment.clone(),
                model: r.served_model_name.clone(),
                endpoint: r.endpoint.clone(),
                // An operator-drained replica serves until it is replaced (see `drain`).
                state: if serves_while_draining(r) { ReplicaState::Ready as i32 } else { r.state },
                load: st.load(id).cloned(),
                node_id: r.node_id.clone(),
                max_model_len: max_model_len(r.max_model_len, engine.and_then(|e| e.max_model_len).unwrap_or(0)),
                max_in_flight: engine.and_then(|e| e.max_in_flight).unwrap_or(0),
                codec_id: deployment.and_then(|d| replica_codec_id(&d.record, r)).unwrap_or(0),
            }
        })
        .collect()
}

/// A route's context length: what the replica's engine reported (the deployment's value or
/// the model's own, capped to its KV cache, as vLLM reports it), else the deployment's
/// `max_model_len` (a replica whose worker has not reported it yet); 0 = unknown.
fn max_model_len(reported: u32, configured: u32) -> u32 {
    if reported > 0 { reported } else { configured }
}

/// The deployment's [`ServedModel::codec_id`]: FNV-1a (stable across heads and builds) of
/// its name, creation time and template generation, which every change of the engine config
/// bumps (the model file, and with it the tokenizer and chat template, is part of it). A
/// deleted and re-created deployment gets another id though its generation starts at 1
/// again. Never 0.
pub fn codec_id(d: &DeploymentRecord) -> u64 {
    let name = d.spec.as_ref().map_or("", |s| s.name.as_str());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let bytes = name.bytes().chain([0]).chain(d.created_unix_ms.to_le_bytes()).chain(d.generation.to_le_bytes());
    for b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h.max(1)
}

/// `r`'s [`RouteEntry::codec_id`]: the deployment's when the replica was created for its
/// current spec (same template generation, created after the deployment), else `None`.
fn replica_codec_id(d: &DeploymentRecord, r: &ReplicaRecord) -> Option<u64> {
    (r.generation == d.generation && r.created_unix_ms >= d.created_unix_ms).then(|| codec_id(d))
}

/// What each deployment's spec says of its served model, sorted by served name: the
/// configured `max_model_len` and the [`codec_id`], known while no replica serves it.
pub fn served(st: &State) -> Vec<ServedModel> {
    let mut served: Vec<ServedModel> = st
        .view()
        .deployments
        .values()
        .filter_map(|d| {
            let spec = d.record.spec.as_ref()?;
            Some(ServedModel {
                model: served_name(spec).to_owned(),
                deployment: spec.name.clone(),
                max_model_len: spec.engine.as_ref().and_then(|e| e.max_model_len).unwrap_or(0),
                codec_id: codec_id(&d.record),
            })
        })
        .collect();
    served.sort_unstable_by(|a, b| a.model.cmp(&b.model));
    served
}

/// Served model names of every deployment, sorted (routers answer 503, not 404, for a
/// model whose replicas are all gone, e.g. while every worker is down).
pub fn models(st: &State) -> Vec<String> {
    let mut names: Vec<String> = st
        .view()
        .deployments
        .values()
        .filter_map(|d| d.record.spec.as_ref().map(|s| served_name(s).to_owned()))
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// The content of a table of `term` (version 0); `new_term`: see [`unavailable`].
fn table(term: u64, st: &State, new_term: bool) -> RouteTable {
    let unavailable = unavailable(st.view(), &st.connected_nodes(), new_term);
    RouteTable { version: 0, routes: build(st), models: models(st), term, unavailable, served: served(st) }
}

/// The route table routers watch. Only a leader that has loaded the cluster state publishes:
/// until [`RoutePublisher::begin_term`] and after [`RoutePublisher::end_term`] subscribers
/// see `None` and send nothing, so losing leadership (a store outage, a lease that expired)
/// never reaches routers as an empty table. Within a term a new table is published only when
/// its content changed.
pub struct RoutePublisher {
    tx: watch::Sender<Option<Arc<RouteTable>>>,
    /// The current term while leading with a loaded state, and when it began.
    term: std::sync::Mutex<Option<(u64, Instant)>>,
    /// Last published version, kept across terms (versions never go back).
    last_version: std::sync::atomic::AtomicU64,
    /// `prism_route_updates_total`.
    updates: Counter,
}

impl RoutePublisher {
    /// Publishes nothing until a term begins; `updates` counts the tables published.
    pub fn new(updates: Counter) -> Self {
        let (tx, _) = watch::channel(None);
        Self { tx, term: std::sync::Mutex::new(None), last_version: 0.into(), updates }
    }

    /// The current table (`None` while this head is not a leader with a loaded state) and
    /// its changes.
    pub fn subscribe(&self) -> watch::Receiver<Option<Arc<RouteTable>>> {
        self.tx.subscribe()
    }

    /// Starts publishing for leadership `term` (the election key's store revision) on the
    /// freshly loaded state: the first table is sent even when it equals the last one, so
    /// routers learn the new term.
    pub fn begin_term(&self, term: u64, st: &State) {
        let now = Instant::now();
        *self.term.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some((term, now));
        self.send_table(table(term, st, true));
    }

    /// Stops publishing (leadership lost). Routers keep the last table they applied.
    pub fn end_term(&self) {
        *self.term.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        self.tx.send_replace(None);
    }

    /// Publishes a new table when the routes changed; nothing outside a term. Called on every
    /// change and reconcile pass, so a model whose grace ends is published within a pass.
    pub fn publish(&self, st: &State) {
        let Some((term, began)) = *self.term.lock().unwrap_or_else(std::sync::PoisonError::into_inner) else {
            return;
        };
        let next = table(term, st, began.elapsed() < REGISTRATION_GRACE);
        if let Some(cur) = self.tx.borrow().as_ref()
            && cur.term == term
            && cur.routes == next.routes
            && cur.models == next.models
            && cur.unavailable == next.unavailable
            && cur.served == next.served
        {
            return;
        }
        self.send_table(next);
    }

    /// Publishes `table` (its version set here).
    fn send_table(&self, mut table: RouteTable) {
        use std::sync::atomic::Ordering;
        // Monotonic across leaders too: a new leader never publishes a lower version.
        let version = (self.last_version.load(Ordering::Relaxed) + 1).max(unix_ms());
        self.last_version.store(version, Ordering::Relaxed);
        table.version = version;
        self.tx.send_replace(Some(Arc::new(table)));
        self.updates.inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::view::{ClusterView, Entry};
    use prism_common::ReplicaId;
    use prism_common::proto::v1::{DeploymentRecord, DeploymentSpec, EngineConfig, ReplicaRecord};

    fn state(configured: u32, replicas: &[(&str, ReplicaState, u32)]) -> State {
        let mut view = ClusterView::default();
        let engine =
            EngineConfig { served_model_name: "m".into(), max_model_len: Some(configured), ..EngineConfig::default() };
        let spec = DeploymentSpec { name: "d".into(), engine: Some(engine), replicas: 1, ..DeploymentSpec::default() };
        let record = DeploymentRecord { spec: Some(spec), ..DeploymentRecord::default() };
        view.deployments.insert(DeploymentName::from("d"), Entry { record, mod_revision: 1 });
        for (id, state, reported) in replicas {
            let record = ReplicaRecord {
                replica_id: (*id).into(),
                deployment: "d".into(),
                served_model_name: "m".into(),
                state: *state as i32,
                max_model_len: *reported,
                ..ReplicaRecord::default()
            };
            view.replicas.insert(ReplicaId::from(*id), Entry { record, mod_revision: 1 });
        }
        State::with_view(view)
    }

    fn current(p: &RoutePublisher) -> Option<(u64, usize)> {
        p.subscribe().borrow().as_ref().map(|t| (t.term, t.routes.len()))
    }

    /// Outside a term nothing is published, not even an empty table; a term's first table is
    /// sent even when it is empty (a leader that really has no replicas) and carries the term;
    /// losing the term withdraws the table instead of replacing it with an empty one.
    #[test]
    fn only_a_term_publishes_and_ending_it_publishes_no_empty_table() {
        let p = RoutePublisher::new(Counter::default());
        let st = state(0, &[("a", ReplicaState::Ready, 0)]);
        p.publish(&st);
        assert_eq!(current(&p), None, "no table before the state is loaded");
        p.begin_term(7, &State::with_view(ClusterView::default()));
        assert_eq!(current(&p), Some((7, 0)), "an empty cluster's leader publishes an empty table");
        p.publish(&st);
        assert_eq!(current(&p), Some((7, 1)));
        let v1 = p.subscribe().borrow().as_ref().map(|t| t.version);
        p.publish(&st);
        assert_eq!(p.subscribe().borrow().as_ref().map(|t| t.version), v1, "unchanged content: no new version");
        p.end_term();
        assert_eq!(current(&p), None, "deposed: nothing to send");
        p.publish(&st);
        assert_eq!(current(&p), None, "no publishing while not leading");
        p.begin_term(9, &st);
        let t = p.subscribe().borrow().clone().expect("table");
        assert_eq!((t.term, t.routes.len()), (9, 1));
        assert!(Some(t.version) > v1, "versions keep growing across terms");
    }

    fn lens(st: &State) -> Vec<(String, u32)> {
        build(st).into_iter().map(|r| (r.replica_id, r.max_model_len)).collect()
    }

    /// The engine's reported value wins (it is the deployment's or the model's own, capped to
    /// the KV cache); a replica that has not reported one yet gets the deployment's.
    #[test]
    fn routes_carry_the_reported_max_model_len_else_the_deployments() {
        let ready = ReplicaState::Ready;
        let st = state(0, &[("a", ready, 8192), ("b", ready, 0), ("c", ReplicaState::Starting, 8192)]);
        assert_eq!(lens(&st), [("a".to_owned(), 8192), ("b".to_owned(), 0)]);
        let st = state(2048, &[("a", ready, 1456), ("b", ReplicaState::Draining, 0)]);
        assert_eq!(lens(&st), [("a".to_owned(), 1456), ("b".to_owned(), 2048)]);
    }

    /// Each deployment's served model is described with no replica at all: its configured
    /// `max_model_len` (0 when unset) and a codec id that follows the template generation and
    /// the deployment's creation, not its replica count; a replica carries the id only when
    /// it was created for the current spec.
    #[test]
    fn served_models_carry_the_configured_length_and_the_codec_id_of_the_current_spec() {
        let mut st = state(4096, &[]);
        let listed = served(&st);
        assert_eq!(
            listed.iter().map(|s| (s.model.as_str(), s.deployment.as_str(), s.max_model_len)).collect::<Vec<_>>(),
            [("m", "d", 4096)]
        );
        let id = listed[0].codec_id;
        assert_ne!(id, 0);
        assert_eq!(served(&state(0, &[]))[0].max_model_len, 0, "unset: unknown until a replica reports");
        let rec = |st: &State| st.view().deployments.get(&DeploymentName::from("d")).map(|e| e.record.clone());
        let mut d = rec(&st).expect("deployment d");
        let same = codec_id(&DeploymentRecord {
            spec: d.spec.clone().map(|s| DeploymentSpec { replicas: 0, ..s }),
            ..d.clone()
        });
        assert_eq!(same, id, "scaling keeps the codec");
        assert_ne!(codec_id(&DeploymentRecord { generation: d.generation + 1, ..d.clone() }), id, "new template");
        assert_ne!(codec_id(&DeploymentRecord { created_unix_ms: 5, ..d.clone() }), id, "re-created deployment");

        d.generation = 2;
        d.created_unix_ms = 100;
        st = state(
            4096,
            &[("old", ReplicaState::Ready, 0), ("new", ReplicaState::Ready, 0), ("gone", ReplicaState::Ready, 0)],
        );
        let set = |st: &mut State, id: &str, generation: u64, created: u64| {
            let mut view = st.view().clone();
            if let Some(e) = view.replicas.get_mut(&ReplicaId::from(id)) {
                e.record.generation = generation;
                e.record.created_unix_ms = created;
            }
            view.deployments.insert(DeploymentName::from("d"), Entry { record: d.clone(), mod_revision: 1 });
            *st = State::with_view(view);
        };
        set(&mut st, "old", 1, 150);
        set(&mut st, "new", 2, 150);
        set(&mut st, "gone", 2, 50);
        let ids: Vec<(String, u64)> = build(&st).into_iter().map(|r| (r.replica_id, r.codec_id)).collect();
        let current = codec_id(&d);
        assert_eq!(
            ids.iter().map(|(r, c)| (r.as_str(), *c)).collect::<Vec<_>>(),
            [("gone", 0), ("new", current), ("old", 0)],
            "only a replica of the current generation and incarnation carries the id"
        );
        assert_eq!(served(&st)[0].codec_id, current);
    }

    /// The unavailable models are part of the table: a change publishes a new version.
    #[test]
    fn a_deployment_that_fails_publishes_a_new_table_naming_it() {
        let p = RoutePublisher::new(Counter::default());
        p.begin_term(1, &state(0, &[("a", ReplicaState::Starting, 0)]));
        let before = p.subscribe().borrow().as_ref().map(|t| (t.version, t.unavailable.len()));
        assert_eq!(before.map(|b| b.1), Some(0));
        p.publish(&state(0, &[("a", ReplicaState::Failed, 0)]));
        let after = p.subscribe().borrow().clone().expect("table");
        assert!(Some(after.version) > before.map(|b| b.0));
        assert_eq!(
            after.unavailable.iter().map(|f| (f.model.as_str(), f.deployment.as_str(), f.cause())).collect::<Vec<_>>(),
            [("m", "d", prism_common::proto::v1::UnavailableCause::Failed)]
        );
    }
}
