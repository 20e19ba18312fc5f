//! Unit tests of the admission queue over a real route table (no worker: a slot is a
//! `DispatchGuard`, held or dropped by the test).

use super::*;
use crate::balance::PowerOfTwoChoices;
use prism_common::proto::v1::{ReplicaState, RouteEntry, RouteTable, UnavailableCause};

const MODEL: &str = "m";

/// A table with one Ready replica of [`MODEL`] taking `limit` requests, plus the model
/// `cold`, listed with no replica.
fn routes(limit: u32) -> Routes {
    let routes = Routes::new(256, Metrics::new());
    routes.apply(table(1, limit));
    routes
}

fn table(version: u64, limit: u32) -> RouteTable {
    RouteTable {
        served: vec![],
        unavailable: vec![],
        term: 0,
        version,
        models: vec![MODEL.into(), "cold".into()],
        routes: vec![RouteEntry {
            replica_id: "r0".into(),
            model: MODEL.into(),
            endpoint: "http://r0".into(),
            state: ReplicaState::Ready as i32,
            max_in_flight: limit,
            ..Default::default()
        }],
    }
}

struct Fixture {
    adm: Admission,
    routes: Routes,
    metrics: Metrics,
    stop: CancellationToken,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

fn fixture(limit: u32, cfg: AdmissionConfig) -> Fixture {
    let routes = routes(limit);
    let metrics = Metrics::new();
    let adm = Admission::new(routes.clone(), Arc::new(PowerOfTwoChoices), metrics.clone(), cfg);
    let stop = CancellationToken::new();
    tokio::spawn(adm.clone().run(stop.clone()));
    Fixture { adm, routes, metrics, stop }
}

fn hint(tokens: u64) -> RequestHint {
    RequestHint::tokens(tokens)
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

async fn admit_now(f: &Fixture) -> Admitted {
    f.adm.admit(MODEL, hint(10), far()).await.expect("a free slot")
}

/// Waits (bounded) until `n` requests of `model` are queued.
async fn queued(f: &Fixture, model: &str, n: usize) {
    let until = Instant::now() + Duration::from_secs(5);
    while f.adm.queued(model) != n {
        assert!(Instant::now() < until, "queue of {model} stayed at {} (want {n})", f.adm.queued(model));
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

fn in_flight(f: &Fixture) -> u32 {
    f.routes.snapshot().models[MODEL][0].stats.in_flight.load(Ordering::Relaxed)
}

/// Spawns a waiter that reports `tag` on `done` once it has a slot, holding it until `release`.
fn waiter(
    f: &Fixture,
    tag: usize,
    done: tokio::sync::mpsc::UnboundedSender<usize>,
    release: Arc<Notify>,
) -> tokio::task::JoinHandle<Result<(), AdmitError>> {
    let adm = f.adm.clone();
    tokio::spawn(async move {
        let slot = adm.admit(MODEL, hint(10), far()).await?;
        let _ = done.send(tag);
        release.notified().await;
        drop(slot);
        Ok(())
    })
}

#[tokio::test]
async fn waiters_are_served_in_arrival_order_as_slots_free() {
    let f = fixture(2, AdmissionConfig::default());
    let held = vec![admit_now(&f).await, admit_now(&f).await];
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    let mut tasks = Vec::new();
    for tag in 0..3 {
        tasks.push(waiter(&f, tag, tx.clone(), release.clone()));
        queued(&f, MODEL, tag + 1).await;
    }
    assert!(f.metrics.encode().contains("prism_router_queue_depth{model=\"m\"} 3"));
    // Each freed slot goes to the first in line, and only to it.
    let mut order = Vec::new();
    for (i, g) in held.into_iter().enumerate() {
        drop(g);
        let tag = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("woken").expect("tag");
        order.push(tag);
        queued(&f, MODEL, 2 - i).await;
        assert!(rx.try_recv().is_err(), "one slot, one waiter served");
    }
    release.notify_one(); // the first waiter finishes: its slot goes to the third
    order.push(tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.expect("woken").expect("tag"));
    assert_eq!(order, vec![0, 1, 2]);
    queued(&f, MODEL, 0).await;
    assert!(f.metrics.encode().contains("prism_router_queue_depth{model=\"m\"} 0"));
    release.notify_waiters();
    for t in tasks {
        t.await.expect("join").expect("slot");
    }
    assert_eq!(in_flight(&f), 0, "every slot released");
    assert!(f.metrics.encode().contains("prism_router_queue_wait_seconds_count 3"));
}

#[tokio::test]
async fn a_new_arrival_never_overtakes_a_waiting_request() {
    let f = fixture(1, AdmissionConfig::default());
    let g = admit_now(&f).await;
    // The first waiter keeps its slot (the task's output) until joined.
    let first = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.admit(MODEL, hint(10), far()).await }
    });
    queued(&f, MODEL, 1).await;
    // The slot frees and a new request arrives before the pump runs: the new one queues
    // behind (the pump serves the first in line).
    drop(g);
    let second = f.adm.admit(MODEL, hint(10), Instant::now() + Duration::from_millis(300)).await;
    assert_eq!(second.err(), Some(AdmitError::DeadlineExceeded), "the slot went to the first waiter");
    assert!(first.await.expect("join").is_ok());
}

#[tokio::test]
async fn count_bound_refuses_with_retry_after_when_slots_free() {
    let f = fixture(2, AdmissionConfig { max_queued_requests: 3, ..AdmissionConfig::default() });
    // Two requests of 0.3 s done: the model's requests hold a slot for 0.3 s.
    let warm = vec![admit_now(&f).await, admit_now(&f).await];
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(warm);
    let held = vec![admit_now(&f).await, admit_now(&f).await];
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let adm = f.adm.clone();
            tokio::spawn(async move { adm.admit(MODEL, hint(10), far()).await.map(|_| ()) })
        })
        .collect();
    queued(&f, MODEL, 3).await;
    let r = f.adm.admit(MODEL, hint(10), far()).await;
    // Fourth in line, 2 slots of 0.3 s just taken: 0.3 + 3 × 0.3 / 2 = 0.75 s.
    assert_eq!(r.err(), Some(AdmitError::Rejected { bound: Bound::Full, retry_after_s: 1 }));
    assert_eq!(f.adm.queued(MODEL), 3, "a refused request leaves no trace in the queue");
    assert!(f.metrics.encode().contains("prism_router_queue_rejected_total{model=\"m\",reason=\"full\"} 1"));
    drop(held);
    for w in waiters {
        w.abort();
    }
}

/// `Retry-After` never outlasts the waits of those queued: each leaves by its
/// `--max-queue-wait` (served or refused), so the queue has room by then whatever the
/// running requests do.
#[tokio::test]
async fn retry_after_is_at_most_the_wait_left_to_those_queued() {
    let wait = Duration::from_secs(2);
    let cfg = AdmissionConfig { max_queued_requests: 3, max_queue_wait: wait, ..AdmissionConfig::default() };
    let f = fixture(1, cfg);
    // One request running for 1 s, none finished: expected to run 1 s more, then one slot
    // per 2 s; the fourth in line would wait 7 s.
    let _held = admit_now(&f).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let waiters: Vec<_> = (0..3)
        .map(|_| {
            let adm = f.adm.clone();
            tokio::spawn(async move { adm.admit(MODEL, hint(10), far()).await.map(|_| ()) })
        })
        .collect();
    queued(&f, MODEL, 3).await;
    let r = f.adm.admit(MODEL, hint(10), far()).await;
    // All three ahead have left within 2 s.
    assert_eq!(r.err(), Some(AdmitError::Rejected { bound: Bound::Full, retry_after_s: 2 }));
    for w in waiters {
        w.abort();
    }
}

/// Holds `slots` for `hold`, then releases them (requests running on the replica).
fn hold_for(slots: Vec<Admitted>, hold: Duration) {
    tokio::spawn(async move {
        tokio::time::sleep(hold).await;
        drop(slots);
    });
}

/// Requests that ran for `took` each on all `limit` slots: the model's service time.
async fn warm_up(f: &Fixture, limit: usize, took: Duration) {
    let mut slots = Vec::new();
    for _ in 0..limit {
        slots.push(admit_now(f).await);
    }
    tokio::time::sleep(took).await;
    drop(slots);
}

/// A burst fills every free slot at once, the queue and more: the refused client that comes
/// back after `Retry-After` is admitted. (The admission rate of the burst, 4 slots taken in
/// an instant, said 1 s, while the queue has no room before the running requests end.)
#[tokio::test]
async fn a_client_back_after_retry_after_from_a_full_queue_is_admitted() {
    let service = Duration::from_millis(1500);
    let f = fixture(4, AdmissionConfig { max_queued_requests: 1, ..AdmissionConfig::default() });
    warm_up(&f, 4, service).await;
    let mut burst = Vec::new();
    for _ in 0..4 {
        burst.push(admit_now(&f).await);
    }
    hold_for(burst, service);
    let queued_one = tokio::spawn({
        let adm = f.adm.clone();
        async move {
            let slot = adm.admit(MODEL, hint(10), far()).await;
            tokio::time::sleep(service).await;
            slot.map(|_| ())
        }
    });
    queued(&f, MODEL, 1).await;
    let Err(AdmitError::Rejected { bound: Bound::Full, retry_after_s }) = f.adm.admit(MODEL, hint(10), far()).await
    else {
        panic!("not refused by the full queue");
    };
    // 1.5 s until the first slot frees, then a slot each 1.5 s / 4: 1.875 s.
    assert_eq!(retry_after_s, 2);
    tokio::time::sleep(Duration::from_secs(u64::from(retry_after_s))).await;
    let again = tokio::time::timeout(Duration::from_secs(5), f.adm.admit(MODEL, hint(10), far())).await;
    assert!(matches!(again, Ok(Ok(_))), "the retry after {retry_after_s} s was not admitted: {again:?}");
    assert_eq!(queued_one.await.ok(), Some(Ok(())));
}

/// A waiter whose `--max-queue-wait` ends while every slot is busy is told when a slot is
/// expected to free, and a retry then is admitted. (The queue had emptied as it left, so the
/// bound by the waits of those queued said 1 s, and the retry timed out again.)
#[tokio::test]
async fn a_client_back_after_retry_after_from_a_queue_timeout_is_admitted() {
    let service = Duration::from_secs(2);
    let wait = Duration::from_millis(300);
    let f = fixture(2, AdmissionConfig { max_queue_wait: wait, ..AdmissionConfig::default() });
    warm_up(&f, 2, service).await;
    hold_for(vec![admit_now(&f).await, admit_now(&f).await], service);
    let r = f.adm.admit(MODEL, hint(10), far()).await;
    let Err(AdmitError::Rejected { bound: Bound::Timeout, retry_after_s }) = r else {
        panic!("not refused at its wait bound: {r:?}");
    };
    // The running requests, 0.3 s in, end 1.7 s later.
    assert_eq!(retry_after_s, 2);
    tokio::time::sleep(Duration::from_secs(u64::from(retry_after_s))).await;
    let again = f.adm.admit(MODEL, hint(10), far()).await;
    assert!(again.is_ok(), "the retry after {retry_after_s} s was not admitted: {:?}", again.err());
}

#[tokio::test]
async fn no_queue_refuses_at_once_when_full() {
    let f = fixture(1, AdmissionConfig { max_queued_requests: 0, ..AdmissionConfig::default() });
    let _g = admit_now(&f).await;
    let r = f.adm.admit(MODEL, hint(10), far()).await;
    assert!(matches!(r, Err(AdmitError::Rejected { bound: Bound::Full, retry_after_s: 1 })), "{r:?}");
}

#[tokio::test]
async fn token_bound_counts_the_queued_estimates() {
    let f = fixture(1, AdmissionConfig { max_queued_tokens: 100, ..AdmissionConfig::default() });
    let _g = admit_now(&f).await;
    let a = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.admit(MODEL, hint(60), far()).await.map(|_| ()) }
    });
    queued(&f, MODEL, 1).await;
    assert!(f.metrics.encode().contains("prism_router_queue_tokens{model=\"m\"} 60"));
    let r = f.adm.admit(MODEL, hint(41), far()).await;
    assert!(matches!(r, Err(AdmitError::Rejected { bound: Bound::Tokens, .. })), "{r:?}");
    // 60 + 40 fits exactly.
    let b = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.admit(MODEL, hint(40), far()).await.map(|_| ()) }
    });
    queued(&f, MODEL, 2).await;
    a.abort();
    b.abort();
    queued(&f, MODEL, 0).await;
    assert!(f.metrics.encode().contains("prism_router_queue_tokens{model=\"m\"} 0"));
}

#[tokio::test]
async fn time_bounds_end_the_wait() {
    let wait = Duration::from_millis(150);
    let f = fixture(1, AdmissionConfig { max_queue_wait: wait, ..AdmissionConfig::default() });
    let _g = admit_now(&f).await;
    let t = Instant::now();
    let r = f.adm.admit(MODEL, hint(10), far()).await;
    assert!(matches!(r, Err(AdmitError::Rejected { bound: Bound::Timeout, .. })), "{r:?}");
    assert!(t.elapsed() >= wait && t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let r = f.adm.admit(MODEL, hint(10), Instant::now() + Duration::from_millis(20)).await;
    assert_eq!(r.err(), Some(AdmitError::DeadlineExceeded), "the request's own deadline came first");
    // A listed model with no Ready replica waits, then is unavailable.
    let r = f.adm.admit("cold", hint(10), far()).await;
    assert!(matches!(r, Err(AdmitError::NoReplicaInTime { retry_after_s }) if retry_after_s >= 1), "{r:?}");
    let m = f.metrics.encode();
    assert!(m.contains("prism_router_queue_rejected_total{model=\"m\",reason=\"timeout\"} 1"), "{m}");
    assert!(m.contains("prism_router_queue_rejected_total{model=\"m\",reason=\"deadline\"} 1"), "{m}");
    assert!(m.contains("prism_router_queue_rejected_total{model=\"cold\",reason=\"timeout\"} 1"), "{m}");
    assert_eq!(f.adm.queued(MODEL) + f.adm.queued("cold"), 0);
}

#[tokio::test]
async fn a_client_that_leaves_takes_no_slot_and_no_count() {
    let f = fixture(1, AdmissionConfig::default());
    let g = admit_now(&f).await;
    let gone = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.admit(MODEL, hint(10), far()).await.map(|_| ()) }
    });
    queued(&f, MODEL, 1).await;
    gone.abort(); // the client disconnects: its future is dropped
    let _ = gone.await;
    assert_eq!(f.adm.queued(MODEL), 0, "left the queue at once");
    let m = f.metrics.encode();
    assert!(m.contains("prism_router_queue_depth{model=\"m\"} 0") && m.contains("queue_tokens{model=\"m\"} 0"), "{m}");
    drop(g);
    // The freed slot is not held by the departed waiter: the next request gets it at once.
    let g = tokio::time::timeout(Duration::from_millis(500), admit_now(&f)).await.expect("slot free at once");
    assert_eq!(in_flight(&f), 1);
    drop(g);
    assert_eq!(in_flight(&f), 0);
}

#[tokio::test]
async fn unknown_model_fails_at_once_and_a_cold_model_waits_for_its_first_replica() {
    let f = fixture(1, AdmissionConfig::default());
    assert_eq!(f.adm.admit("nope", hint(1), far()).await.err(), Some(AdmitError::UnknownModel));
    let cold = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.admit("cold", hint(10), far()).await.map(|(r, _g)| r.replica_id.clone()) }
    });
    tokio::time::timeout(Duration::from_secs(5), f.adm.scale_from_zero_wanted()).await.expect("demand signalled");
    queued(&f, "cold", 1).await;
    let d = f.adm.demand();
    let c = d.iter().find(|d| d.model == "cold").expect("cold listed");
    assert_eq!((c.queued, c.queued_tokens, c.in_flight), (1, 10, 0));
    // Its first replica becomes Ready: the route-table update wakes the waiter.
    let mut t = table(2, 1);
    t.routes.push(RouteEntry {
        replica_id: "c0".into(),
        model: "cold".into(),
        endpoint: "http://c0".into(),
        state: ReplicaState::Ready as i32,
        ..Default::default()
    });
    f.routes.apply(t);
    let got = tokio::time::timeout(Duration::from_secs(5), cold).await.expect("woken").expect("join");
    assert_eq!(got.ok().as_deref(), Some("c0"));
}

/// Ready replicas that are all out of rotation after failures (their worker died or froze)
/// make a request wait, not fail: the pump's tick serves it when the ejection ends (the
/// replica takes one request then), and a replacement in the route table serves it at once.
/// Past its wait bound with no usable replica it gets 503 (`NoReplicaInTime`), not 429.
#[tokio::test]
async fn a_request_waits_while_every_replica_is_ejected() {
    let f = fixture(4, AdmissionConfig::default());
    let stats = f.routes.snapshot().models[MODEL][0].stats.clone();
    stats.record_failure(f.routes.now_ms(), Duration::from_millis(300));
    let t = Instant::now();
    let (r, g) = tokio::time::timeout(Duration::from_secs(5), admit_now(&f)).await.expect("served");
    assert_eq!(r.replica_id, "r0");
    assert!(t.elapsed() >= Duration::from_millis(250), "served before the ejection ended: {:?}", t.elapsed());
    // Back from the ejection, it takes one request until one succeeds.
    let second = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.admit(MODEL, hint(10), far()).await.map(|(r, _g)| r.replica_id.clone()) }
    });
    queued(&f, MODEL, 1).await;
    stats.record_success();
    drop(g);
    let got = tokio::time::timeout(Duration::from_secs(5), second).await.expect("woken").expect("join");
    assert_eq!(got.ok().as_deref(), Some("r0"));

    // Ejected again; a replacement appears in the table: the waiter goes there at once.
    stats.record_failure(f.routes.now_ms(), Duration::from_secs(20));
    let waiter = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.admit(MODEL, hint(10), far()).await.map(|(r, _g)| r.replica_id.clone()) }
    });
    queued(&f, MODEL, 1).await;
    let mut t = table(2, 4);
    let mut r1 = t.routes[0].clone();
    r1.replica_id = "r1".into();
    t.routes.push(r1);
    f.routes.apply(t);
    let got = tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("woken").expect("join");
    assert_eq!(got.ok().as_deref(), Some("r1"));

    // Only the ejected one left: past the wait bound it is unavailable (503), not overloaded.
    f.routes.apply(table(3, 4));
    let short = AdmissionConfig { max_queue_wait: Duration::from_millis(100), ..AdmissionConfig::default() };
    let adm = Admission::new(f.routes.clone(), Arc::new(PowerOfTwoChoices), f.metrics.clone(), short);
    let r = adm.admit(MODEL, hint(1), far()).await;
    assert!(matches!(r, Err(AdmitError::NoReplicaInTime { .. })), "{r:?}");
}

/// A request whose attempt failed before its first token comes back first in line, with
/// what is left of its queue wait.
#[tokio::test]
async fn a_request_back_after_a_failed_attempt_goes_first_with_the_rest_of_its_wait() {
    let f = fixture(1, AdmissionConfig { max_queue_wait: Duration::from_secs(2), ..AdmissionConfig::default() });
    let g = admit_now(&f).await;
    let first = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.admit(MODEL, hint(10), far()).await.map(|(r, _g)| r.replica_id.clone()) }
    });
    queued(&f, MODEL, 1).await;
    let back = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.readmit(MODEL, hint(10), far(), Duration::from_millis(1500)).await.map(|_| ()) }
    });
    queued(&f, MODEL, 2).await;
    let t = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(5), back).await.expect("bounded").expect("join");
    assert!(matches!(r, Err(AdmitError::Rejected { bound: Bound::Timeout, .. })), "{r:?}");
    assert!(t.elapsed() < Duration::from_millis(1200), "waited its whole bound again: {:?}", t.elapsed());
    // Put first in line, it takes the next free slot before the earlier waiter.
    let back = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.readmit(MODEL, hint(10), far(), Duration::ZERO).await.map(|(r, _g)| r.replica_id.clone()) }
    });
    queued(&f, MODEL, 2).await;
    drop(g);
    let got = tokio::time::timeout(Duration::from_secs(5), back).await.expect("served").expect("join");
    assert_eq!(got.ok().as_deref(), Some("r0"));
    let got = tokio::time::timeout(Duration::from_secs(5), first).await.expect("served").expect("join");
    assert_eq!(got.ok().as_deref(), Some("r0"));
}

/// The head's table naming `cold` as unavailable for `cause`.
fn unavailable_table(version: u64, cause: UnavailableCause) -> RouteTable {
    let mut t = table(version, 1);
    t.unavailable.push(prism_common::proto::v1::UnavailableModel {
        model: "cold".into(),
        deployment: "cold-dep".into(),
        reason: "model file not found".into(),
        cause: cause as i32,
    });
    t
}

/// A model that no replica is coming to serve (its replicas failed to start, it is scaled to
/// 0, no node can run one) is refused at once with why, never queued. Requests already
/// waiting for it (a replica that was Starting, then failed; every worker lost) are answered
/// when the news comes. Once a replica is on its way again, requests wait for it as before.
#[tokio::test]
async fn a_model_no_replica_is_coming_to_is_refused_at_once_and_its_waiters_answered() {
    use UnavailableCause::{Failed, NoNode, ScaledToZero, Unspecified};
    let f = fixture(1, AdmissionConfig::default());
    let mut version = 1;
    // An older head's entry has no cause: its replicas failed.
    for (sent, read) in [(Failed, Failed), (ScaledToZero, ScaledToZero), (NoNode, NoNode), (Unspecified, Failed)] {
        let waiting = tokio::spawn({
            let adm = f.adm.clone();
            async move { adm.admit("cold", hint(10), far()).await.map(|(r, _g)| r.replica_id.clone()) }
        });
        queued(&f, "cold", 1).await;
        version += 1;
        f.routes.apply(unavailable_table(version, sent));
        let got = tokio::time::timeout(Duration::from_secs(5), waiting).await.expect("answered at once").expect("join");
        let why = Arc::new(ModelUnavailable {
            deployment: "cold-dep".into(),
            cause: read,
            reason: "model file not found".into(),
        });
        assert_eq!(got.err(), Some(AdmitError::Unavailable(why.clone())), "{sent:?}");
        assert_eq!(f.adm.queued("cold"), 0);

        let started = Instant::now();
        let r = f.adm.admit("cold", hint(10), far()).await;
        assert_eq!(r.err(), Some(AdmitError::Unavailable(why)), "{sent:?}");
        assert!(started.elapsed() < Duration::from_secs(1), "refused at once, not after the queue wait");
        assert_eq!(f.adm.queued("cold"), 0);
        // Other models are not affected.
        assert!(f.adm.admit(MODEL, hint(1), far()).await.is_ok());

        // A replica on its way again (workers back, the deployment fixed or scaled up).
        version += 1;
        f.routes.apply(table(version, 1));
    }
    let cold = tokio::spawn({
        let adm = f.adm.clone();
        async move { adm.admit("cold", hint(10), far()).await.map(|(r, _g)| r.replica_id.clone()) }
    });
    queued(&f, "cold", 1).await;
    cold.abort();
}

/// Before the first route table a request is answered at once with NoRouteTable (503, not a
/// 404 for a model that may well exist); once the table comes the same request is served.
#[tokio::test]
async fn before_the_first_table_requests_are_refused_as_unavailable_not_unknown() {
    let routes = Routes::new(256, Metrics::new());
    let adm = Admission::new(routes.clone(), Arc::new(PowerOfTwoChoices), Metrics::new(), AdmissionConfig::default());
    let started = Instant::now();
    assert_eq!(adm.admit(MODEL, hint(1), far()).await.err(), Some(AdmitError::NoRouteTable));
    assert_eq!(adm.admit("nope", hint(1), far()).await.err(), Some(AdmitError::NoRouteTable));
    assert!(started.elapsed() < Duration::from_secs(1));
    assert_eq!(adm.queued(MODEL), 0);
    routes.apply(table(1, 1));
    assert!(adm.admit(MODEL, hint(1), far()).await.is_ok());
    assert_eq!(adm.admit("nope", hint(1), far()).await.err(), Some(AdmitError::UnknownModel));
}
