//! A live policy edit takes full effect while a delivery is in flight: the
//! policy file's `timeout` is raised from 1 s to 6 s, then a message the app
//! takes 4 s to answer arrives. The visibility timeout courier started with
//! (2 s) is shorter than that delivery; the raised policy raises it, and
//! the delivery is kept claimed while it runs, so the app receives the
//! message exactly once.

use std::time::Duration;

use crate::common::*;
use courier::policy;

const SETTLE: Duration = Duration::from_secs(30);

async fn a_timeout_raised_live_keeps_a_slow_delivery_with_one_consumer(fixture: Fixture) {
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_policy(
        dir.path(),
        "maxAttempts: 3\ntimeout: 1s\nbackoff: {initial: 50ms, max: 200ms, jitter: none}",
    );
    let initial = policy::file::load(&path).expect("the first policy");
    let mut config = run_config(&fixture, &app, initial);
    config.policy_file = Some(path.clone());
    config.options.visibility_timeout = Duration::from_secs(2);
    let running = Running::start(config).await;
    let generation = async |running: &Running| {
        let text = scrape(running.metrics_addr).await;
        text.lines()
            .find_map(|l| l.strip_prefix("courier_policy_generation{policy=\"test\"} "))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    wait_for("the first policy in force", SETTLE, async || {
        generation(&running).await == Some(1)
    })
    .await;

    write_policy(
        dir.path(),
        "maxAttempts: 3\ntimeout: 6s\nbackoff: {initial: 50ms, max: 200ms, jitter: none}",
    );
    wait_for("the raised timeout in force", SETTLE, async || {
        generation(&running).await == Some(2)
    })
    .await;

    let source = fixture.open().await;
    let body = "script:sleep4000";
    fixture.send(&source, body).await;
    wait_for("the slow message acked", SETTLE, async || {
        metric(
            &scrape(running.metrics_addr).await,
            "courier_acks_total",
            &fixture.queue,
        ) >= 1.0
    })
    .await;
    // A second hand-out would have reached the app while the first was
    // still sleeping, before the ack.
    let received = app.received_body(body.as_bytes());
    assert_eq!(
        received.len(),
        1,
        "the app received the slow message {} times",
        received.len()
    );
    let depth = wait_settled(&source, SETTLE).await;
    assert_eq!(depth.dead_letters, 0, "{depth:?}");
    let text = scrape(running.metrics_addr).await;
    assert_eq!(
        metric(&text, "courier_deliveries_total", &fixture.queue),
        1.0,
        "{text}"
    );
    running.stop().await;
    assert_eq!(app.received_body(body.as_bytes()).len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_a_timeout_raised_live_keeps_a_slow_delivery_with_one_consumer() {
    a_timeout_raised_live_keeps_a_slow_delivery_with_one_consumer(Fixture::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_a_timeout_raised_live_keeps_a_slow_delivery_with_one_consumer() {
    a_timeout_raised_live_keeps_a_slow_delivery_with_one_consumer(Fixture::embedded()).await;
}
