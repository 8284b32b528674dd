//! A live policy edit takes full effect while a delivery is in flight: the
//! policy file's `timeout` is raised from 1 s to 6 s, then a message the app
//! takes 4 s to answer arrives. The visibility timeout courier started with
//! (2 s) is shorter than that delivery; the raised policy raises it, and
//! the delivery is kept claimed while it runs, so the app receives the
//! message exactly once. An edit also applies to a retry already waiting
//! in the broker when it lands (docs/runbook.md).

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
    config.policy.file = Some(path.clone());
    config.options.live.visibility_timeout = Duration::from_secs(2);
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

/// docs/runbook.md (CourierDeadLettersArrivingFast): list a status in
/// `statusCodes.retry` and "the change applies to the next decision" —
/// also for a message already waiting for its retry. The message answers
/// 503 (retried in 3 s), then 422, then 200. While its retry waits, 422 is
/// moved to the retry list (and the backoff shortened); the waiting retry
/// then answers 422 under the new policy and is retried, not dead-lettered.
async fn an_edit_applies_to_a_retry_already_waiting(fixture: Fixture) {
    const BEFORE: &str =
        "maxAttempts: 5\ntimeout: 2s\nbackoff: {initial: 3s, max: 3s, jitter: none}";
    const AFTER: &str = "maxAttempts: 5\ntimeout: 2s\nbackoff: {initial: 50ms, max: 50ms, jitter: none}\n\
         statusCodes: {retry: [\"408\", \"429\", \"5xx\", \"422\"], deadLetter: [\"501\", \"4xx\"]}";
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_policy(dir.path(), BEFORE);
    let mut config = run_config(&fixture, &app, policy::file::load(&path).unwrap());
    config.policy.file = Some(path.clone());
    let running = Running::start(config).await;
    let text = async || scrape(running.metrics_addr).await;
    let generation = async || {
        text()
            .await
            .lines()
            .find_map(|l| l.strip_prefix("courier_policy_generation{policy=\"test\"} "))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    wait_for("the first policy in force", SETTLE, async || {
        generation().await == Some(1)
    })
    .await;

    let source = fixture.open().await;
    let body = "script:503,422,200\nwaiting for its retry";
    fixture.send(&source, body).await;
    wait_for("the retry scheduled", SETTLE, async || {
        metric(&text().await, "courier_retries_total", &fixture.queue) >= 1.0
    })
    .await;
    write_policy(dir.path(), AFTER);
    wait_for("the edited policy in force", SETTLE, async || {
        generation().await == Some(2)
    })
    .await;
    assert_eq!(
        app.received_body(body.as_bytes()).len(),
        1,
        "the edit landed while the retry was still waiting"
    );

    wait_for("the message acked or dead-lettered", SETTLE, async || {
        let text = text().await;
        metric(&text, "courier_acks_total", &fixture.queue)
            + metric(&text, "courier_dead_letters_total", &fixture.queue)
            >= 1.0
    })
    .await;
    let attempts: Vec<u32> = app
        .received_body(body.as_bytes())
        .iter()
        .map(Received::attempt)
        .collect();
    assert_eq!(attempts, [1, 2, 3], "the 422 of attempt 2 was retried");
    let depth = wait_settled(&source, SETTLE).await;
    assert_eq!(depth.dead_letters, 0, "{depth:?}");
    running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_an_edit_applies_to_a_retry_already_waiting() {
    an_edit_applies_to_a_retry_already_waiting(Fixture::redis()).await;
}
