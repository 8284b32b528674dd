//! An app that is still starting (issue 20, part 4), with the built
//! `courier run` against Redis and a real HTTP app on loopback:
//! - nothing is delivered before the app accepts connections: not even a
//!   refused attempt, and courier is not ready meanwhile;
//! - with `--app-health-path`, nothing before that path answers 2xx, though
//!   the app listens and would answer a message 404;
//! - `examples/app-starting.yaml` retries the 404 and 409 a starting app
//!   can answer, and dead-letters other 4xx at once.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use courier::telemetry::serve_http;
use http::{Method, Response};
use http_body_util::Full;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

const SETTLE: Duration = Duration::from_secs(30);
/// How long courier is watched doing nothing while the app is not ready.
const NOT_READY_FOR: Duration = Duration::from_millis(1500);

fn args(fixture: &Fixture, app: &str, policy: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = run_args_for(fixture, app, policy, &unique("starting"));
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// courier started on `fixture` with an app address nothing listens on yet
/// (the caller's app may take it later), once it says it is waiting; the
/// directory holds its policy file.
async fn courier_before_the_app(
    fixture: &Fixture,
) -> (std::net::SocketAddr, tempfile::TempDir, CourierProcess) {
    let addr = returnable_addr();
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(dir.path(), "maxAttempts: 2");
    let mut courier = CourierProcess::run(&args(fixture, &format!("http://{addr}/"), &policy, &[]));
    courier
        .wait_log(
            "waiting for the app to be ready before the first delivery",
            SETTLE,
        )
        .await;
    (addr, dir, courier)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_delivery_before_the_app_accepts_connections() {
    let fixture = Fixture::redis();
    let source = fixture.open().await;
    let id = fixture.send(&source, "hello, late app").await;
    let (addr, _dir, mut courier) = courier_before_the_app(&fixture).await;
    let metrics = courier.metrics_addr().await;
    courier.wait_running().await;
    tokio::time::sleep(NOT_READY_FOR).await;
    let text = scrape(metrics).await;
    assert_eq!(
        metric(&text, "courier_deliveries_total", &fixture.queue),
        0.0,
        "not even a refused attempt:\n{text}"
    );
    assert_eq!(plain_metric(&text, "courier_app_up"), Some(0.0), "{text}");
    assert_eq!(get_status(metrics, "/readyz").await, 503);
    assert_eq!(source.depth().await.unwrap().dead_letters, 0);

    let app = TestApp::start_on(&addr.to_string()).await;
    let up = std::time::Instant::now();
    wait_for("the delivery once the app listens", SETTLE, async || {
        !app.received_body(b"hello, late app").is_empty()
    })
    .await;
    eprintln!("delivered {:?} after the app listened", up.elapsed());
    wait_settled(&source, SETTLE).await;
    let seen = app.received_body(b"hello, late app");
    assert_eq!(seen.len(), 1, "delivered once");
    assert_eq!(seen[0].attempt(), 1, "no attempt was used while waiting");
    assert_eq!(seen[0].header("courier-message-id"), Some(id.as_str()));
    wait_for("ready", SETTLE, async || {
        get_status(metrics, "/readyz").await == 200
    })
    .await;
    courier
        .wait_log("the app is ready: delivering", SETTLE)
        .await;
    courier.stop_cleanly(SETTLE).await;
}

/// An app that listens at once but is not ready: `GET /healthz` answers 503
/// and a message 404 (its routes are not mounted yet) until `ready` is set.
struct StartingApp {
    addr: SocketAddr,
    ready: Arc<AtomicBool>,
    /// (method, path, whether the app was ready)
    seen: Arc<Mutex<Vec<(Method, String, bool)>>>,
    stop: CancellationToken,
}

impl StartingApp {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let app = Self {
            addr: listener.local_addr().unwrap(),
            ready: Arc::default(),
            seen: Arc::default(),
            stop: CancellationToken::new(),
        };
        let (ready, seen) = (app.ready.clone(), app.seen.clone());
        tokio::spawn(serve_http(listener, app.stop.clone(), move |req| {
            let (ready, seen) = (ready.clone(), seen.clone());
            async move {
                let ready = ready.load(Ordering::SeqCst);
                seen.lock().unwrap().push((
                    req.method().clone(),
                    req.uri().path().to_string(),
                    ready,
                ));
                let status = match (req.method() == Method::GET, ready) {
                    (_, true) => 200,
                    (true, false) => 503,
                    (false, false) => 404,
                };
                Response::builder()
                    .status(status)
                    .body(Full::new(Bytes::new()))
                    .unwrap()
            }
        }));
        app
    }

    fn posts(&self) -> Vec<bool> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|(m, _, _)| *m == Method::POST)
            .map(|(_, _, ready)| *ready)
            .collect()
    }

    fn health_checks(&self) -> usize {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|(m, p, _)| *m == Method::GET && p == "/healthz")
            .count()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_delivery_before_the_health_path_answers_2xx() {
    let fixture = Fixture::redis();
    let source = fixture.open().await;
    fixture.send(&source, "order 1").await;
    let app = StartingApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    // The default classification: a 404 would be dead-lettered at once.
    let policy = write_policy(dir.path(), "maxAttempts: 2");
    let mut courier = CourierProcess::run(&args(
        &fixture,
        &format!("http://{}/", app.addr),
        &policy,
        &["--app-health-path", "/healthz"],
    ));
    let metrics = courier.metrics_addr().await;
    courier.wait_running().await;
    wait_for("a few health checks", SETTLE, async || {
        app.health_checks() >= 3
    })
    .await;
    tokio::time::sleep(NOT_READY_FOR).await;
    assert!(
        app.posts().is_empty(),
        "no message before /healthz said 2xx"
    );
    assert_eq!(get_status(metrics, "/readyz").await, 503);

    app.ready.store(true, Ordering::SeqCst);
    wait_for("the delivery once /healthz says 2xx", SETTLE, async || {
        !app.posts().is_empty()
    })
    .await;
    wait_settled(&source, SETTLE).await;
    assert_eq!(app.posts(), [true], "one delivery, after the app was ready");
    assert_eq!(source.depth().await.unwrap().dead_letters, 0);
    courier.stop_cleanly(SETTLE).await;
    app.stop.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_policy_retries_404_and_409_while_the_app_starts() {
    let fixture = Fixture::redis();
    let source = fixture.open().await;
    let app = TestApp::start().await;
    let starting = "script:404,409,200\nstarting";
    let conflict = "script:409,200\nconflict";
    let bad = "script:400\nbad request";
    let gone = "script:404+courier-retry=never\ngone for good";
    let mut ids = Vec::new();
    for body in [starting, conflict, bad, gone] {
        ids.push(fixture.send(&source, body).await);
    }
    let example = root().join("examples/app-starting.yaml");
    let mut courier = CourierProcess::run(&args(&fixture, &app.url(), &example, &[]));
    wait_settled(&source, SETTLE).await;
    courier.stop_cleanly(SETTLE).await;

    let times = |body: &str| app.received_body(body.as_bytes()).len();
    assert_eq!(times(starting), 3, "404 and 409 retried, then acked");
    assert_eq!(times(conflict), 2);
    assert_eq!(times(bad), 1, "another 4xx is final");
    assert_eq!(times(gone), 1, "the app can still say a 404 is final");
    let letters = fixture.dead_letters(&source).await;
    assert_eq!(letters.len(), 2, "{letters:?}");
    let letter = |id: &str| {
        letters
            .iter()
            .find(|l| l.field("courier-message-id") == Some(id))
            .unwrap_or_else(|| panic!("no dead letter for {id}"))
    };
    let bad_letter = letter(&ids[2]);
    assert_eq!(bad_letter.field("courier-reason"), Some("permanent-status"));
    assert_eq!(bad_letter.field("courier-status"), Some("400"));
    assert_eq!(bad_letter.field("courier-policy"), Some("app-starting@1"));
    let gone_letter = letter(&ids[3]);
    assert_eq!(gone_letter.field("courier-status"), Some("404"));
    assert_eq!(
        gone_letter.field("courier-app-directive"),
        Some("Courier-Retry: never")
    );
}

/// Waiting for an app that never comes does not hold up a stop: SIGTERM
/// ends the wait and courier exits cleanly, having sent nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_waiting_for_the_app_exits_at_once() {
    let fixture = Fixture::redis();
    let source = fixture.open().await;
    fixture.send(&source, "never delivered").await;
    let (_addr, _dir, mut courier) = courier_before_the_app(&fixture).await;
    courier.terminate();
    let status = courier.exit_within(Duration::from_secs(5)).await;
    assert!(status.success(), "{status}\n{}", courier.log());
    let depth = source.depth().await.unwrap();
    assert_eq!(depth.dead_letters, 0);
    assert_eq!(depth.retry_backlog, 0, "nothing was tried: {depth:?}");
}
