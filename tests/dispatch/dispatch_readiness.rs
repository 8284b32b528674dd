//! Readiness tells the truth about the broker: a private `redis-server` is
//! stopped under a running sidecar, reads from it fail, `/readyz` says not
//! ready and `courier_broker_read_errors_total` counts them; when the broker
//! is started again courier is ready by itself and delivers what was sent
//! meanwhile.
//!
//! `--readiness` chooses what `/readyz` looks at: per value, the broker down
//! and then the app down, each seen in the metrics before `/readyz` is asked.

use std::time::Duration;

use crate::common::*;
use courier::telemetry::Readiness;

const SETTLE: Duration = Duration::from_secs(30);

/// A sidecar with `readiness` on a private Redis, once it delivered a first
/// message and is ready.
async fn delivering(readiness: Readiness) -> (PrivateRedis, Fixture, TestApp, Running) {
    let redis = PrivateRedis::start().await;
    let mut fixture = Fixture::redis();
    fixture.url = courier::source::parse_url(&redis.url()).unwrap();
    let app = TestApp::start().await;
    let mut config = run_config(&fixture, &app, fast_policy());
    config.endpoint.readiness = readiness;
    let running = Running::start(config).await;
    let source = fixture.open().await;
    fixture.send(&source, "before").await;
    wait_for(
        "the first message delivered and courier ready",
        SETTLE,
        async || {
            app.received_body(b"before").len() == 1
                && get_status(running.metrics_addr, "/readyz").await == 200
        },
    )
    .await;
    (redis, fixture, app, running)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_broker_reads_make_courier_not_ready_until_it_is_back() {
    let (mut redis, fixture, app, running) = delivering(Readiness::default()).await;

    redis.kill9();
    wait_for(
        "failed reads counted and /readyz failing",
        SETTLE,
        async || {
            let text = scrape(running.metrics_addr).await;
            metric(&text, "courier_broker_read_errors_total", &fixture.queue) >= 3.0
                && get_status(running.metrics_addr, "/readyz").await == 503
        },
    )
    .await;

    redis.spawn().await;
    wait_for("ready again by itself", SETTLE, async || {
        get_status(running.metrics_addr, "/readyz").await == 200
    })
    .await;
    let source = fixture.open().await;
    fixture.send(&source, "after").await;
    wait_for(
        "the message sent after the restart delivered",
        SETTLE,
        async || app.received_body(b"after").len() == 1,
    )
    .await;
    running.stop().await;
}

/// `/readyz` of a sidecar with `readiness` while its broker is down (reads
/// failing), then while its app is down (the gate closed).
async fn readyz_with(readiness: Readiness) -> (u16, u16) {
    let (mut redis, fixture, app, running) = delivering(readiness).await;
    redis.kill9();
    wait_for("failed reads counted", SETTLE, async || {
        let text = scrape(running.metrics_addr).await;
        metric(&text, "courier_broker_read_errors_total", &fixture.queue) >= 3.0
    })
    .await;
    let broker_down = get_status(running.metrics_addr, "/readyz").await;

    redis.spawn().await;
    let source = fixture.open().await;
    app.stop();
    fixture.send(&source, "to a stopped app").await;
    wait_for("the app seen down", SETTLE, async || {
        scrape(running.metrics_addr)
            .await
            .contains("courier_app_up 0\n")
    })
    .await;
    let app_down = get_status(running.metrics_addr, "/readyz").await;
    running.stop().await;
    (broker_down, app_down)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_broker_the_default_fails_with_the_broker_and_with_the_app() {
    assert_eq!(Readiness::default(), Readiness::Broker);
    assert_eq!(readyz_with(Readiness::Broker).await, (503, 503));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_app_ignores_the_broker_and_fails_with_the_app() {
    assert_eq!(readyz_with(Readiness::App).await, (200, 503));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_none_stays_ready() {
    assert_eq!(readyz_with(Readiness::Always).await, (200, 200));
}

/// Found at 21da363: with the broker unreachable at start, `/readyz` said
/// "the policy or the source is not ready yet" and `courier_app_up` was 0,
/// so CourierAppDown fired and blamed the app. Now `/readyz` names the
/// broker and its error, `courier_broker_up` is 0 (CourierBrokerDown), and
/// the app is presumed up; once the broker answers, both turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_at_start_is_named_and_the_app_not_blamed() {
    let mut redis = PrivateRedis::start().await;
    let url = redis.url();
    redis.terminate().await;
    let mut fixture = Fixture::redis();
    fixture.url = courier::source::parse_url(&url).unwrap();
    let app = TestApp::start().await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_for("the first failed open", SETTLE, async || {
        readyz(running.metrics_addr).await.1.contains("the broker")
    })
    .await;
    let (status, body) = readyz(running.metrics_addr).await;
    assert_eq!(status, 503);
    assert!(
        body.contains("the broker: cannot open --source") && body.contains(&fixture.queue),
        "{body}"
    );
    let metrics = running.metrics.encode();
    assert!(metrics.contains("courier_app_up 1"), "{metrics}");
    assert!(metrics.contains("courier_broker_up 0"), "{metrics}");

    redis.spawn().await;
    wait_for(
        "courier ready once the broker answers",
        SETTLE,
        async || get_status(running.metrics_addr, "/readyz").await == 200,
    )
    .await;
    assert!(running.metrics.encode().contains("courier_broker_up 1"));
    running.stop().await;
}

/// `GET /readyz`: the status and the body.
async fn readyz(addr: std::net::SocketAddr) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).await.unwrap();
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}
