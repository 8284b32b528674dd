//! The chaos suite: courier under failure, end to end, against real brokers
//! and a real HTTP app on loopback. Each test breaks one thing on purpose and
//! checks the promise: nothing lost, nothing dead-lettered that did not
//! deserve it, and the app protected while it struggles.
//!
//! - the broker (a private Redis the test starts) restarted twice mid-flow;
//! - the app stopped for 30 seconds mid-flow, and an app answering 503s;
//! - 1,000 poison messages among 10,000 good ones;
//! - an app slower than the policy timeout;
//! - SIGTERM under load;
//! - a 429 with Retry-After, and the adaptive concurrency limit.
//!
//! Everything waits on conditions with deadlines; nothing asserts how fast
//! the machine is. Latency is compared as a ratio inside one run.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;
use bytes::Bytes;
use courier::policy::{Jitter, Policy};
use courier::source::{DeadLetter, Source};
use courier::telemetry::serve_http;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Long enough for anything here to settle on a slow, shared machine.
const SETTLE: Duration = Duration::from_secs(60);
/// How long deliveries may make no progress at all before a test gives up.
const STALL: Duration = Duration::from_secs(30);

// === The chaos app ===

/// How the chaos app answers every request; changed while a test runs.
/// Bodies that start with `poison` always get 400, and those that start with
/// `flaky` get 503 the first time.
#[derive(Debug, Clone, Copy)]
struct Mode {
    status: u16,
    delay: Duration,
    retry_after: Option<u64>,
}

impl Mode {
    fn ok() -> Self {
        Self {
            status: 200,
            delay: Duration::ZERO,
            retry_after: None,
        }
    }
}

/// One request as the app saw it.
#[derive(Debug, Clone)]
struct Hit {
    body: String,
    start: Instant,
    /// When the answer went out or the client went away; `None` while the
    /// request is still being worked on.
    end: Option<Instant>,
    /// 0 when the client went away before the answer.
    status: u16,
}

/// What survives a restart of the app: its mode and everything it saw.
struct AppState {
    mode: Mutex<Mode>,
    hits: Mutex<Vec<Hit>>,
    in_flight: AtomicUsize,
    concurrency: AtomicUsize,
}

/// A real HTTP app on 127.0.0.1 that can be stopped and started again on the
/// same port. It counts requests being worked on; hyper drops a request's
/// handler when its client disconnects, so the count is what a client
/// (courier) still waits for.
#[derive(Clone)]
struct ChaosApp {
    addr: SocketAddr,
    state: Arc<AppState>,
    stop: CancellationToken,
}

/// Counts a request out of `in_flight` and stamps its end, however its
/// handler finishes.
struct InFlight {
    state: Arc<AppState>,
    index: usize,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.state.in_flight.fetch_sub(1, Ordering::SeqCst);
        let mut hits = self.state.hits.lock().unwrap();
        hits[self.index].end = Some(Instant::now());
    }
}

impl ChaosApp {
    async fn start(mode: Mode) -> Self {
        let state = Arc::new(AppState {
            mode: Mutex::new(mode),
            hits: Mutex::default(),
            in_flight: AtomicUsize::new(0),
            concurrency: AtomicUsize::new(0),
        });
        // Restarted on its port (`restart`).
        Self::serve(returnable_addr(), state).await
    }

    /// The same app (mode, history) on the same port, after [`Self::stop`].
    async fn restart(&self) -> Self {
        Self::serve(self.addr, self.state.clone()).await
    }

    async fn serve(addr: SocketAddr, state: Arc<AppState>) -> Self {
        let listener = TcpListener::bind(addr).await.expect("bind the chaos app");
        let app = Self {
            addr: listener.local_addr().unwrap(),
            state,
            stop: CancellationToken::new(),
        };
        let state = app.state.clone();
        tokio::spawn(serve_http(listener, app.stop.clone(), move |req| {
            answer(state.clone(), req)
        }));
        app
    }

    fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    /// Closes the port and cuts every open connection.
    fn stop(&self) {
        self.stop.cancel();
    }

    fn set_mode(&self, mode: Mode) {
        *self.state.mode.lock().unwrap() = mode;
    }

    fn hits(&self) -> Vec<Hit> {
        self.state.hits.lock().unwrap().clone()
    }

    fn concurrency(&self) -> usize {
        self.state.concurrency.load(Ordering::SeqCst)
    }

    /// Distinct bodies among `bodies` that got a 2xx.
    fn delivered(&self, bodies: &HashSet<String>) -> usize {
        self.state
            .hits
            .lock()
            .unwrap()
            .iter()
            .filter(|h| (200..300).contains(&h.status) && bodies.contains(&h.body))
            .map(|h| h.body.as_str())
            .collect::<HashSet<_>>()
            .len()
    }
}

async fn answer(state: Arc<AppState>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let mode = *state.mode.lock().unwrap();
    if req.method() == Method::GET {
        // The health path: up unless the app is answering 5xx.
        let status = if mode.status >= 500 { mode.status } else { 200 };
        return reply(status, None);
    }
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body = String::from_utf8_lossy(&body).into_owned();
    let poison = body.starts_with("poison");
    let (index, flaky_first) = {
        let mut hits = state.hits.lock().unwrap();
        let flaky_first = body.starts_with("flaky") && !hits.iter().any(|h| h.body == body);
        hits.push(Hit {
            body,
            start: Instant::now(),
            end: None,
            status: 0,
        });
        (hits.len() - 1, flaky_first)
    };
    let now = state.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    state.concurrency.fetch_max(now, Ordering::SeqCst);
    let guard = InFlight {
        state: state.clone(),
        index,
    };
    let (status, retry_after) = if poison {
        (400, None)
    } else if flaky_first {
        (503, None)
    } else {
        if !mode.delay.is_zero() {
            tokio::time::sleep(mode.delay).await;
        }
        (mode.status, mode.retry_after)
    };
    state.hits.lock().unwrap()[index].status = status;
    drop(guard);
    reply(status, retry_after)
}

fn reply(status: u16, retry_after: Option<u64>) -> Response<Full<Bytes>> {
    let mut response = Response::builder().status(status);
    if let Some(secs) = retry_after {
        response = response.header("retry-after", secs.to_string());
    }
    response
        .body(Full::new(Bytes::from(format!("answer {status}"))))
        .unwrap()
}

// === Helpers ===

/// A policy with short timings and room for many attempts.
fn chaos_policy(max_attempts: u32, timeout: Duration) -> Policy {
    Policy {
        name: "chaos".into(),
        generation: 1,
        max_attempts,
        timeout,
        ..Policy::default()
    }
    .backoff_of(
        Duration::from_millis(50),
        Duration::from_millis(500),
        2.0,
        Jitter::Full,
    )
}

async fn dead_letters(source: &Arc<dyn Source>, fixture: &Fixture) -> Vec<DeadLetter> {
    source
        .dead_letters(&fixture.dlq(), 100_000)
        .await
        .expect("read dead letters")
}

/// The `q`-quantile of sorted durations.
fn quantile(sorted: &[Duration], q: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// Sends every body, retrying a send the broker did not take (it may be
/// down); a send that failed after the broker wrote it is a duplicate, which
/// the checks count by distinct body.
async fn send_all(source: &Arc<dyn Source>, bodies: &[String]) {
    for body in bodies {
        let deadline = Instant::now() + SETTLE;
        while let Err(e) = source.send(Bytes::from(body.clone()), &[]).await {
            assert!(Instant::now() < deadline, "cannot send {body}: {e}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// Waits until the app has had a 2xx for every body in `all`. A slow,
/// shared machine may take long, so this fails only when deliveries stop
/// making progress for [`STALL`], saying how far they got.
async fn wait_delivered(app: &ChaosApp, all: &HashSet<String>, what: &str) {
    let mut last = (usize::MAX, Instant::now());
    loop {
        let now = app.delivered(all);
        if now == all.len() {
            return;
        }
        if now != last.0 {
            last = (now, Instant::now());
        }
        assert!(
            last.1.elapsed() < STALL,
            "{what}: stuck at {now} of {} delivered for {STALL:?}",
            all.len()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Reads from the broker that failed so far.
async fn broker_read_errors(running: &Running, queue: &str) -> f64 {
    metric(
        &scrape(running.metrics_addr).await,
        "courier_broker_read_errors_total",
        queue,
    )
}

// === A private Redis that can be restarted ===

// === The broker restarted twice mid-flow ===

/// Messages flow (some answered 503 first, so durable retries are in the
/// sorted set too) while the broker is killed with `kill -9` once and
/// stopped with SIGTERM once, each time mid-flow, and started again after a
/// pause. Every message sent reaches the app with a 2xx, nothing stays
/// ready, pending or scheduled, nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_restarted_twice_mid_flow_loses_nothing() {
    const MESSAGES: usize = 3000;
    let mut redis = PrivateRedis::start().await;
    let mut fixture = Fixture::redis();
    fixture.url = courier::source::parse_url(&redis.url()).unwrap();
    let app = ChaosApp::start(Mode {
        delay: Duration::from_millis(5),
        ..Mode::ok()
    })
    .await;
    // Every tenth message is answered 503 once and retried from the sorted
    // set, so retries are in flight through the restarts too.
    let bodies: Vec<String> = (0..MESSAGES)
        .map(|i| {
            if i % 10 == 0 {
                format!("flaky {i}")
            } else {
                format!("message {i}")
            }
        })
        .collect();
    let all: HashSet<String> = bodies.iter().cloned().collect();
    let source = fixture.open().await;
    // Half before courier starts, half while it runs and the broker restarts.
    send_all(&source, &bodies[..MESSAGES / 2]).await;
    let mut config = run_config_for(
        &fixture,
        &app.url(),
        chaos_policy(20, Duration::from_secs(2)),
    );
    config.options.concurrency = 16;
    let running = Running::start(config).await;
    let producer = tokio::spawn({
        let (source, rest) = (source.clone(), bodies[MESSAGES / 2..].to_vec());
        async move {
            for chunk in rest.chunks(100) {
                send_all(&source, chunk).await;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });

    for (round, threshold) in [(1, MESSAGES / 4), (2, MESSAGES / 2)] {
        wait_for("deliveries before the restart", SETTLE, async || {
            app.delivered(&all) >= threshold
        })
        .await;
        if round == 1 {
            redis.kill9();
        } else {
            redis.terminate().await;
        }
        let down_at = app.delivered(&all);
        // Down until courier has seen it fail, not for a fixed time.
        let errors = broker_read_errors(&running, &fixture.queue).await;
        wait_for("courier to see the broker gone", SETTLE, async || {
            broker_read_errors(&running, &fixture.queue).await > errors
        })
        .await;
        redis.spawn().await;
        eprintln!("broker restart {round}: down after {down_at} delivered");
    }
    producer.await.expect("the producer");
    wait_delivered(&app, &all, "every message to reach the app").await;
    let depth = wait_settled(&source, SETTLE).await;
    assert_eq!(depth.dead_letters, 0, "{depth:?}");
    assert!(dead_letters(&source, &fixture).await.is_empty());
    let report = running.stop().await;
    let hits = app.hits();
    let duplicates = hits.iter().filter(|h| h.status == 200).count() - MESSAGES;
    eprintln!(
        "broker restarts: {MESSAGES} messages delivered, {duplicates} redelivered after the restarts, drain {report:?}"
    );
    assert!(redis.log().contains("Ready to accept connections"));
}

// === The app stopped for 30 seconds ===

/// The app goes away mid-flow (port closed, open connections cut) for 30
/// seconds, far longer than every retry the policy allows. The gate closes:
/// `courier_app_up` is 0 and `/readyz` fails; nothing is dead-lettered; when
/// the app is back every message is delivered.
async fn app_stopped_for_30_seconds(fixture: Fixture, health_path: Option<&str>) {
    const MESSAGES: usize = 600;
    const OUTAGE: Duration = Duration::from_secs(30);
    let app = ChaosApp::start(Mode {
        delay: Duration::from_millis(20),
        ..Mode::ok()
    })
    .await;
    let bodies: Vec<String> = (0..MESSAGES).map(|i| format!("message {i}")).collect();
    let all: HashSet<String> = bodies.iter().cloned().collect();
    let source = fixture.open().await;
    send_all(&source, &bodies).await;
    // Three attempts 50-500 ms apart: without the gate a 30 s outage would
    // dead-letter everything it touched.
    let mut config = run_config_for(
        &fixture,
        &app.url(),
        chaos_policy(3, Duration::from_secs(1)),
    );
    config.options.concurrency = 4;
    config.app.failure_run = 5;
    config.app.health_path = health_path.map(str::to_string);
    let running = Running::start(config).await;
    wait_for("a third of the messages delivered", SETTLE, async || {
        app.delivered(&all) >= MESSAGES / 3
    })
    .await;

    app.stop();
    let stopped = Instant::now();
    let before = app.delivered(&all);
    let mut saw_down = false;
    let mut saw_not_ready = false;
    while stopped.elapsed() < OUTAGE {
        let text = scrape(running.metrics_addr).await;
        assert_eq!(
            metric(&text, "courier_dead_letters_total", &fixture.queue),
            0.0,
            "nothing is dead-lettered while the app is away"
        );
        saw_down |= plain_metric(&text, "courier_app_up") == Some(0.0);
        saw_not_ready |= get_status(running.metrics_addr, "/readyz").await == 503;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(saw_down, "courier_app_up went to 0 while the app was away");
    assert!(saw_not_ready, "/readyz failed while the app was away");
    assert!(
        before < MESSAGES,
        "the app went away mid-flow ({before} of {MESSAGES} delivered)"
    );

    let app = app.restart().await;
    let back = Instant::now();
    wait_delivered(&app, &all, "every message delivered after the app is back").await;
    let recovered_in = back.elapsed();
    wait_for("courier_app_up back to 1 and ready", SETTLE, async || {
        plain_metric(&scrape(running.metrics_addr).await, "courier_app_up") == Some(1.0)
            && get_status(running.metrics_addr, "/readyz").await == 200
    })
    .await;
    let text = scrape(running.metrics_addr).await;
    running.stop().await;
    assert_eq!(
        metric(&text, "courier_dead_letters_total", &fixture.queue),
        0.0
    );
    assert!(dead_letters(&source, &fixture).await.is_empty());
    if fixture.dir().is_none() {
        wait_settled(&source, SETTLE).await;
    } else {
        let depth = source.depth().await.unwrap();
        assert_eq!(
            (depth.ready, depth.retry_backlog),
            (Some(0), 0),
            "{depth:?}"
        );
    }
    eprintln!(
        "app down {OUTAGE:?}: {before} delivered before, all {MESSAGES} delivered {recovered_in:?} after it came back, 0 dead letters"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_app_stopped_for_30_seconds_probed_on_its_health_path() {
    app_stopped_for_30_seconds(Fixture::redis(), Some("/healthz")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_app_stopped_for_30_seconds_probed_with_a_delivery() {
    app_stopped_for_30_seconds(Fixture::embedded(), None).await;
}

/// The app stays up but answers 503 to everything for a few seconds. A run
/// of 503s closes the gate, so the failures stop using up attempts: with
/// three attempts allowed, nothing is dead-lettered, and everything is
/// delivered once the app recovers.
async fn a_503_storm_closes_the_gate(fixture: Fixture) {
    const MESSAGES: usize = 200;
    // Healthy when courier starts (it waits for that before delivering),
    // the storm begins before the messages arrive.
    let app = ChaosApp::start(Mode::ok()).await;
    let bodies: Vec<String> = (0..MESSAGES).map(|i| format!("message {i}")).collect();
    let all: HashSet<String> = bodies.iter().cloned().collect();
    let source = fixture.open().await;
    let mut config = run_config_for(
        &fixture,
        &app.url(),
        chaos_policy(3, Duration::from_secs(1)),
    );
    config.options.concurrency = 4;
    config.app.failure_run = 5;
    config.app.health_path = Some("/healthz".into());
    let running = Running::start(config).await;
    wait_for("ready", SETTLE, async || {
        get_status(running.metrics_addr, "/readyz").await == 200
    })
    .await;
    app.set_mode(Mode {
        status: 503,
        delay: Duration::from_millis(5),
        retry_after: None,
    });
    send_all(&source, &bodies).await;
    // The gate closes on a run of 503 deliveries or on the periodic health
    // check, whichever comes first: on a loaded machine the check came
    // before the first message was even sent (2 of 3 CI runs at 9e09c8d
    // timed out waiting for five 503 deliveries that never had to happen).
    wait_for("the gate to close", SETTLE, async || {
        get_status(running.metrics_addr, "/readyz").await == 503
            && plain_metric(&scrape(running.metrics_addr).await, "courier_app_up") == Some(0.0)
    })
    .await;
    let storm = Instant::now();
    while storm.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let during = app.hits().len();
    app.set_mode(Mode::ok());
    wait_delivered(&app, &all, "every message delivered after the storm").await;
    let text = scrape(running.metrics_addr).await;
    running.stop().await;
    assert_eq!(
        metric(&text, "courier_dead_letters_total", &fixture.queue),
        0.0
    );
    assert!(dead_letters(&source, &fixture).await.is_empty());
    // Closed, the gate asks the health path instead of sending deliveries:
    // a handful of 503s reached the app, not three per message.
    assert!(
        during < MESSAGES,
        "{during} deliveries reached the failing app"
    );
    eprintln!("503 storm: {during} deliveries reached the failing app, 0 dead letters");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_503_storm_closes_the_gate() {
    a_503_storm_closes_the_gate(Fixture::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_a_503_storm_closes_the_gate() {
    a_503_storm_closes_the_gate(Fixture::embedded()).await;
}

// === Poison messages ===

/// 10,000 good messages with 1,000 poison ones (answered 400) among them,
/// and 5,000 more good ones with no poison near them, sent at a steady rate
/// in alternating blocks so both see the same machine. Every poison message
/// is dead-lettered exactly once (one delivery, one dead letter), and
/// nothing holds the good ones behind it: no delivery is retried, every good
/// message reaches the app once, and the app-health gate never closes. Their
/// latency next to poison and without it is printed for the record; a ratio
/// of two loopback latencies on a shared machine is not asserted.
async fn poison_is_dead_lettered_once_and_does_not_hold_the_rest(fixture: Fixture) {
    const BLOCKS: usize = 10;
    const GOOD_PER_POISON_BLOCK: usize = 1000;
    const POISON_PER_BLOCK: usize = 100;
    const GOOD_PER_CLEAN_BLOCK: usize = 500;
    /// Messages sent per tick, every 10 ms.
    const PER_TICK: usize = 10;
    let app = ChaosApp::start(Mode::ok()).await;
    let source = fixture.open().await;
    let mut config = run_config_for(
        &fixture,
        &app.url(),
        chaos_policy(5, Duration::from_secs(5)),
    );
    config.options.concurrency = 16;
    config.app.failure_run = 5;
    let running = Running::start(config).await;
    let gate = watch_app_up(running.metrics_addr);

    // body -> (sent at, next to poison)
    let mut sent: HashMap<String, (Instant, usize)> = HashMap::new();
    let mut poison_ids: HashMap<String, String> = HashMap::new();
    let mut ticker = tokio::time::interval(Duration::from_millis(10));
    let mut n = 0usize;
    for block in 0..BLOCKS * 2 {
        let with_poison = block % 2 == 1;
        let mut plan = Vec::new();
        if with_poison {
            for i in 0..GOOD_PER_POISON_BLOCK {
                plan.push(false);
                if i % (GOOD_PER_POISON_BLOCK / POISON_PER_BLOCK) == 5 {
                    plan.push(true);
                }
            }
        } else {
            plan = vec![false; GOOD_PER_CLEAN_BLOCK];
        }
        for tick in plan.chunks(PER_TICK) {
            ticker.tick().await;
            for &poison in tick {
                n += 1;
                let body = if poison {
                    format!("poison {n}")
                } else {
                    format!("good {n}")
                };
                let at = Instant::now();
                let id = fixture.send(&source, body.clone()).await;
                if poison {
                    poison_ids.insert(id, body);
                } else {
                    sent.insert(body, (at, block));
                }
            }
        }
    }
    assert_eq!(poison_ids.len(), BLOCKS * POISON_PER_BLOCK);
    assert_eq!(
        sent.values().filter(|(_, block)| block % 2 == 1).count(),
        BLOCKS * GOOD_PER_POISON_BLOCK
    );
    let good: HashSet<String> = sent.keys().cloned().collect();
    wait_delivered(&app, &good, "every good message delivered").await;
    let poison_count = poison_ids.len();
    wait_for("every poison message dead-lettered", SETTLE, async || {
        metric(
            &scrape(running.metrics_addr).await,
            "courier_dead_letters_total",
            &fixture.queue,
        ) >= poison_count as f64
    })
    .await;
    // Settled and stopped: no stray second dead letter can come later.
    wait_settled(&source, SETTLE).await;
    let metrics = scrape(running.metrics_addr).await;
    running.stop().await;
    assert!(
        !gate.closed(),
        "the app-health gate closed: poison answers are not app failures"
    );
    assert_eq!(
        metric(&metrics, "courier_retries_total", &fixture.queue),
        0.0,
        "nothing was retried: poison is dead-lettered at once, good messages acked"
    );

    let letters = dead_letters(&source, &fixture).await;
    let mut per_id: HashMap<&str, usize> = HashMap::new();
    for letter in &letters {
        assert_eq!(letter.field("courier-reason"), Some("permanent-status"));
        assert_eq!(letter.field("courier-status"), Some("400"));
        assert_eq!(letter.field("courier-attempts"), Some("1"));
        *per_id
            .entry(letter.field("courier-message-id").unwrap_or_default())
            .or_default() += 1;
    }
    assert_eq!(
        letters.len(),
        poison_count,
        "one dead letter per poison message"
    );
    for (id, body) in &poison_ids {
        assert_eq!(per_id.get(id.as_str()), Some(&1), "{body} ({id})");
    }
    let hits = app.hits();
    let mut poison_hits: HashMap<&str, usize> = HashMap::new();
    for hit in hits.iter().filter(|h| h.body.starts_with("poison")) {
        *poison_hits.entry(hit.body.as_str()).or_default() += 1;
    }
    assert!(
        poison_hits.values().all(|&n| n == 1) && poison_hits.len() == poison_count,
        "each poison message reached the app once"
    );

    let mut first_seen: HashMap<&str, Instant> = HashMap::new();
    for hit in &hits {
        first_seen.entry(hit.body.as_str()).or_insert(hit.start);
    }
    let mut blocks: Vec<Vec<Duration>> = vec![Vec::new(); BLOCKS * 2];
    for (body, (at, block)) in &sent {
        blocks[*block].push(first_seen[body.as_str()].saturating_duration_since(*at));
    }
    for block in &mut blocks {
        block.sort();
    }
    let all = |with_poison: usize| {
        let mut all: Vec<Duration> = blocks
            .iter()
            .skip(with_poison)
            .step_by(2)
            .flatten()
            .copied()
            .collect();
        all.sort();
        all
    };
    let (near, clean) = (all(1), all(0));
    // The p99 of a typical block: the median over blocks of each block's
    // p99, so a stall of the shared machine that hits one block does not
    // decide the comparison.
    let block_p99 = |with_poison: usize| {
        let mut p99s: Vec<Duration> = blocks
            .iter()
            .skip(with_poison)
            .step_by(2)
            .map(|b| quantile(b, 0.99))
            .collect();
        p99s.sort();
        quantile(&p99s, 0.5)
    };
    let (near_p99, clean_p99) = (block_p99(1), block_p99(0));
    eprintln!(
        "poison ({:?}): good next to poison p50 {:?} p99 {:?} (typical block {near_p99:?}); without p50 {:?} p99 {:?} (typical block {clean_p99:?})",
        fixture.url,
        quantile(&near, 0.5),
        quantile(&near, 0.99),
        quantile(&clean, 0.5),
        quantile(&clean, 0.99),
    );
    for body in &good {
        let hits = hits.iter().filter(|h| &h.body == body).count();
        assert_eq!(hits, 1, "{body} reached the app {hits} times");
    }
}

/// Samples `courier_app_up` every 20 ms until dropped, remembering whether
/// it was ever seen 0 after it was first 1 (it is 0 until the first probe).
struct AppUpWatch {
    closed: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl AppUpWatch {
    fn closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

impl Drop for AppUpWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn watch_app_up(addr: SocketAddr) -> AppUpWatch {
    let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = closed.clone();
    let task = tokio::spawn(async move {
        let mut up_once = false;
        loop {
            let text = scrape(addr).await;
            if text.contains("courier_app_up 1") {
                up_once = true;
            } else if up_once && text.contains("courier_app_up 0") {
                seen.store(true, Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    AppUpWatch { closed, task }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_poison_is_dead_lettered_once_and_does_not_hold_the_rest() {
    poison_is_dead_lettered_once_and_does_not_hold_the_rest(Fixture::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_poison_is_dead_lettered_once_and_does_not_hold_the_rest() {
    poison_is_dead_lettered_once_and_does_not_hold_the_rest(Fixture::embedded()).await;
}

// === An app slower than the timeout ===

/// The app takes 1 s per request; the policy gives it 200 ms. Courier times
/// out, and each timed-out request is dropped (its connection closed), so
/// the app never works on more than `--concurrency` requests at once, and
/// never on two copies of the same message at once. The timeouts halve the
/// limit (a slow app is up: they do not close the gate), so the deliveries
/// slow to one at a time instead of piling up. When the app is fast again,
/// everything is delivered.
async fn slow_app_gets_no_pile_up(fixture: Fixture) {
    const MESSAGES: usize = 40;
    const CONCURRENCY: usize = 4;
    const SLOW_FOR: Duration = Duration::from_secs(6);
    let app = ChaosApp::start(Mode {
        delay: Duration::from_secs(1),
        ..Mode::ok()
    })
    .await;
    let bodies: Vec<String> = (0..MESSAGES).map(|i| format!("message {i}")).collect();
    let all: HashSet<String> = bodies.iter().cloned().collect();
    let source = fixture.open().await;
    send_all(&source, &bodies).await;
    let timeout = Duration::from_millis(200);
    let mut config = run_config_for(&fixture, &app.url(), chaos_policy(20, timeout));
    config.options.concurrency = CONCURRENCY;
    config.app.failure_run = 5;
    let running = Running::start(config).await;
    let started = Instant::now();
    let mut lowest_limit = f64::MAX;
    let mut saw_gate_closed = false;
    let mut seen_up = false;
    while started.elapsed() < SLOW_FOR {
        let text = scrape(running.metrics_addr).await;
        // 0 until the dispatcher has started and shown the gauge.
        let now = metric(&text, "courier_concurrency_limit", &fixture.queue);
        if now >= 1.0 {
            lowest_limit = lowest_limit.min(now);
        }
        // 0 until the dispatcher has started too; a 0 after a 1 is a close.
        match plain_metric(&text, "courier_app_up") {
            Some(1.0) => seen_up = true,
            Some(0.0) => saw_gate_closed |= seen_up,
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let slow_hits = app.hits().len();
    app.set_mode(Mode::ok());
    wait_delivered(&app, &all, "every message delivered once the app is fast").await;
    let text = scrape(running.metrics_addr).await;
    running.stop().await;

    let max = app.concurrency();
    assert!(
        max <= CONCURRENCY,
        "the app worked on {max} requests at once, over --concurrency {CONCURRENCY}"
    );
    // No message was ever in flight twice: each request of a body ended
    // before the next one of the same body started.
    let mut by_body: HashMap<&str, Vec<(Instant, Instant)>> = HashMap::new();
    let hits = app.hits();
    for hit in &hits {
        let end = hit.end.expect("every request ended");
        by_body
            .entry(hit.body.as_str())
            .or_default()
            .push((hit.start, end));
    }
    let mut most_attempts = 0;
    for (body, mut spans) in by_body {
        spans.sort();
        most_attempts = most_attempts.max(spans.len());
        for pair in spans.windows(2) {
            assert!(
                pair[1].0 >= pair[0].1,
                "{body}: a second delivery started while the first was in flight"
            );
        }
    }
    // Unprotected, `CONCURRENCY` deliveries would time out every 200 ms for
    // the whole slow period. The limiter keeps it far lower.
    let unprotected = CONCURRENCY * (SLOW_FOR.as_millis() / timeout.as_millis()) as usize;
    assert!(
        slow_hits * 3 < unprotected,
        "{slow_hits} deliveries while the app was slow (unprotected: {unprotected})"
    );
    assert!(
        !saw_gate_closed,
        "a slow app is up: timeouts do not close the gate"
    );
    assert!(
        lowest_limit < CONCURRENCY as f64,
        "timeouts lowered the concurrency limit (lowest {lowest_limit})"
    );
    assert_eq!(
        metric(&text, "courier_dead_letters_total", &fixture.queue),
        0.0
    );
    eprintln!(
        "slow app: {slow_hits} deliveries in {SLOW_FOR:?} (unprotected {unprotected}), at most {max} at once, limit down to {lowest_limit}, at most {most_attempts} deliveries of one message"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_slow_app_gets_no_pile_up() {
    slow_app_gets_no_pile_up(Fixture::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_slow_app_gets_no_pile_up() {
    slow_app_gets_no_pile_up(Fixture::embedded()).await;
}

// === SIGTERM under load ===

fn binary_args(fixture: &Fixture, app: &ChaosApp, policy: &Path, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--source",
        &fixture.source_arg(),
        "--queue",
        &fixture.queue,
        "--app",
        &app.url(),
        "--policy-file",
        &policy.display().to_string(),
        "--consumer",
        "replica-a",
        "--listen",
        "127.0.0.1:0",
        "--depth-interval",
        "200ms",
        "--visibility-timeout",
        "3s",
    ]
    .map(str::to_string)
    .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Thousands of messages in flow, 16 at a time, and SIGTERM in the middle:
/// the process stops pulling, finishes what is in flight and exits 0 within
/// `--drain-timeout`, abandoning nothing. A restart delivers the rest;
/// nothing is lost and, since the drain settled everything it started,
/// nothing is delivered twice.
async fn sigterm_under_load_drains_and_loses_nothing(fixture: Fixture) {
    const MESSAGES: usize = 3000;
    const DRAIN: Duration = Duration::from_secs(5);
    let app = ChaosApp::start(Mode {
        delay: Duration::from_millis(10),
        ..Mode::ok()
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 5\ntimeout: 2s\nbackoff: {initial: 50ms, max: 200ms, jitter: none}",
    );
    let bodies: Vec<String> = (0..MESSAGES).map(|i| format!("message {i}")).collect();
    let all: HashSet<String> = bodies.iter().cloned().collect();
    let source = fixture.open().await;
    send_all(&source, &bodies).await;
    release(&fixture, source).await;
    let args = binary_args(
        &fixture,
        &app,
        &policy,
        &["--concurrency", "16", "--drain-timeout", "5s"],
    );

    let mut first = CourierProcess::run(&args);
    wait_for("a third of the messages delivered", SETTLE, async || {
        app.delivered(&all) >= MESSAGES / 3
    })
    .await;
    first.terminate();
    let signalled = Instant::now();
    let status = first.exit_within(DRAIN + Duration::from_secs(10)).await;
    let took = signalled.elapsed();
    assert!(
        status.success(),
        "exit after SIGTERM: {status}; log:\n{}",
        first.log()
    );
    assert!(
        took < DRAIN,
        "the drain took {took:?}, over --drain-timeout {DRAIN:?}"
    );
    let stopped = logged(&first, "stopped").await;
    assert_eq!(stopped["abandoned"], 0, "nothing cut off: {stopped}");
    let delivered_first = app.delivered(&all);
    assert!(delivered_first < MESSAGES, "SIGTERM came mid-flow");
    let source = fixture.open().await;
    let depth = source.depth().await.unwrap();
    assert_eq!(
        depth.pending, 0,
        "every delivery in flight at SIGTERM was settled: {depth:?}"
    );
    let left = depth.ready.expect("the broker counts what waits") + depth.retry_backlog;
    release(&fixture, source).await;

    let mut second = CourierProcess::run(&args);
    second.wait_running().await;
    let addr = second.metrics_addr().await;
    wait_delivered(&app, &all, "every message delivered after the restart").await;
    // Stop once the restart has acked exactly what was left and holds
    // nothing: a redelivery of something the drain settled would have to
    // come from an unsettled message, and the depth below shows none.
    wait_for("the restart to ack what was left", SETTLE, async || {
        let text = scrape(addr).await;
        metric(&text, "courier_acks_total", &fixture.queue) >= left as f64
            && metric(&text, "courier_in_flight", &fixture.queue) == 0.0
    })
    .await;
    second.terminate();
    assert!(second.exit_within(SETTLE).await.success());
    let source = fixture.open().await;
    let depth = source.depth().await.unwrap();
    assert_eq!(
        (
            depth.ready,
            depth.pending,
            depth.retry_backlog,
            depth.dead_letters
        ),
        (Some(0), 0, 0, 0),
        "{depth:?}"
    );
    let hits = app.hits();
    let twice = hits.iter().filter(|h| h.status == 200).count() - MESSAGES;
    eprintln!(
        "SIGTERM under load: drained in {took:?} ({stopped}), {delivered_first} delivered before, {twice} delivered twice"
    );
    assert_eq!(twice, 0, "a drained delivery was delivered again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_sigterm_under_load_drains_and_loses_nothing() {
    sigterm_under_load_drains_and_loses_nothing(Fixture::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_sigterm_under_load_drains_and_loses_nothing() {
    sigterm_under_load_drains_and_loses_nothing(Fixture::embedded()).await;
}

// === Retry-After and the concurrency limit ===

/// A 429 with `Retry-After: 2` holds every new delivery to the app for two
/// seconds, not just the message that got it: messages sent after the 429
/// was settled reach the app only once the hold has passed.
async fn retry_after_holds_new_deliveries(fixture: Fixture) {
    const LATER: usize = 20;
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let mut config = run_config(&fixture, &app, fast_policy());
    config.options.concurrency = 4;
    let running = Running::start(config).await;
    let first = "script:429ra2,200\nthe one that gets the 429";
    fixture.send(&source, first).await;
    wait_for("the 429 to be settled", SETTLE, async || {
        metric(
            &scrape(running.metrics_addr).await,
            "courier_retries_total",
            &fixture.queue,
        ) >= 1.0
    })
    .await;
    let answered = app.received_body(first.as_bytes())[0].at;
    let mut later = Vec::new();
    for i in 0..LATER {
        let body = format!("sent during the hold {i}");
        fixture.send(&source, body.clone()).await;
        later.push(body);
    }
    wait_for("every message delivered", SETTLE, async || {
        later
            .iter()
            .all(|b| !app.received_body(b.as_bytes()).is_empty())
            && app.received_body(first.as_bytes()).len() == 2
    })
    .await;
    running.stop().await;
    let earliest = later
        .iter()
        .map(|b| app.received_body(b.as_bytes())[0].at)
        .min()
        .unwrap();
    let held = earliest.duration_since(answered);
    let retried = app.received_body(first.as_bytes())[1]
        .at
        .duration_since(answered);
    eprintln!(
        "Retry-After 2: new deliveries held {held:?}, the 429'd message retried after {retried:?}"
    );
    // 2 s less the time between the app's answer and courier reading it.
    assert!(
        held >= Duration::from_millis(1800),
        "a message reached the app {held:?} after a 429 with Retry-After: 2"
    );
    assert!(retried >= Duration::from_millis(1800), "{retried:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_retry_after_holds_new_deliveries() {
    retry_after_holds_new_deliveries(Fixture::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_retry_after_holds_new_deliveries() {
    retry_after_holds_new_deliveries(Fixture::embedded()).await;
}

/// While the app answers 429 (without Retry-After) the concurrency limit
/// falls from `--concurrency` to 2 or less; once it answers 2xx again the
/// limit climbs back towards `--concurrency`. Nothing is lost on the way.
async fn the_limit_drops_under_429s_and_recovers(fixture: Fixture) {
    const CONCURRENCY: usize = 16;
    let app = ChaosApp::start(Mode {
        status: 429,
        delay: Duration::from_millis(5),
        retry_after: None,
    })
    .await;
    let source = fixture.open().await;
    let bodies: Vec<String> = (0..400).map(|i| format!("message {i}")).collect();
    send_all(&source, &bodies).await;
    let mut config = run_config_for(
        &fixture,
        &app.url(),
        chaos_policy(1000, Duration::from_secs(2)).backoff_of(
            Duration::from_millis(10),
            Duration::from_millis(50),
            2.0,
            Jitter::Full,
        ),
    );
    config.options.concurrency = CONCURRENCY;
    config.app.failure_run = 5;
    let running = Running::start(config).await;
    let limit = async || {
        metric(
            &scrape(running.metrics_addr).await,
            "courier_concurrency_limit",
            &fixture.queue,
        )
    };
    // The gauge appears once the dispatcher runs.
    wait_for("the dispatcher to start", SETTLE, async || {
        limit().await >= 1.0
    })
    .await;
    wait_for("the limit to fall under 429s", SETTLE, async || {
        let now = limit().await;
        (1.0..=2.0).contains(&now)
    })
    .await;
    let lowest = limit().await;

    app.set_mode(Mode {
        delay: Duration::from_millis(2),
        ..Mode::ok()
    });
    // A steady flow of healthy answers: the limit climbs about one per
    // round of answers.
    let more: Vec<String> = (0..3000).map(|i| format!("after {i}")).collect();
    let producer = tokio::spawn({
        let (source, more) = (source.clone(), more.clone());
        async move {
            for chunk in more.chunks(50) {
                send_all(&source, chunk).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    });
    // Healthy answers add about one per round; answers slower than twice
    // the best seen trim it, and a busy shared machine makes some, so the
    // test asks for most of the way back rather than every last slot.
    let mut highest = 0.0f64;
    wait_for("the limit to recover", SETTLE, async || {
        highest = highest.max(limit().await);
        highest >= (CONCURRENCY * 3 / 4) as f64
    })
    .await;
    producer.await.unwrap();
    let all: HashSet<String> = bodies.iter().chain(&more).cloned().collect();
    wait_delivered(&app, &all, "every message delivered").await;
    let text = scrape(running.metrics_addr).await;
    running.stop().await;
    assert_eq!(
        metric(&text, "courier_dead_letters_total", &fixture.queue),
        0.0
    );
    eprintln!("429s: the limit fell from {CONCURRENCY} to {lowest} and recovered to {highest}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_the_limit_drops_under_429s_and_recovers() {
    the_limit_drops_under_429s_and_recovers(Fixture::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_the_limit_drops_under_429s_and_recovers() {
    the_limit_drops_under_429s_and_recovers(Fixture::embedded()).await;
}
