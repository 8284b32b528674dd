//! `--dedup-window`: a redelivery of a message acked within the window is
//! acked without reaching the app; outside the window, or with the window
//! off, it is delivered again.

use std::time::Duration;

use crate::common::*;

/// Sends one message, then the same message again (a retried publish), and
/// returns how often the app saw it and the final scrape.
async fn duplicates_reaching_the_app(
    fixture: Fixture,
    window: Option<Duration>,
) -> (usize, String) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let key = [("idempotency-key".to_string(), "charge-7".to_string())];
    let mut config = run_config(&fixture, &app, fast_policy());
    config.dedup_window = window;
    let running = Running::start(config).await;
    producer.send("charge 7", &key).await;
    wait_for("the first delivery", Duration::from_secs(10), async || {
        app.received_body(b"charge 7").len() == 1
    })
    .await;
    wait_settled(&source, Duration::from_secs(10)).await;
    // The producer sends the same message again (a retried publish).
    producer.send("charge 7", &key).await;
    wait_settled(&source, Duration::from_secs(10)).await;
    // Counters move just after the broker confirms the ack.
    let acks = format!("courier_acks_total{{queue=\"{}\"}} 2", fixture.queue);
    let mut metrics = String::new();
    wait_for("both acks counted", Duration::from_secs(5), async || {
        metrics = scrape(running.metrics_addr).await;
        metrics.contains(&acks)
    })
    .await;
    running.stop().await;
    (app.received_body(b"charge 7").len(), metrics)
}

pub async fn a_duplicate_within_the_window_does_not_reach_the_app(fixture: Fixture) {
    let queue = fixture.queue.clone();
    let (seen, metrics) = duplicates_reaching_the_app(fixture, Some(Duration::from_secs(30))).await;
    assert_eq!(seen, 1);
    let hits = format!("courier_dedup_hits_total{{queue=\"{queue}\"}} 1");
    assert!(metrics.contains(&hits), "{hits} in\n{metrics}");
}

pub async fn without_a_window_duplicates_are_delivered(fixture: Fixture) {
    let (seen, _) = duplicates_reaching_the_app(fixture, None).await;
    assert_eq!(seen, 2);
}

pub async fn the_window_expires(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let key = [("idempotency-key".to_string(), "charge-8".to_string())];
    let mut config = run_config(&fixture, &app, fast_policy());
    config.dedup_window = Some(Duration::from_millis(300));
    let running = Running::start(config).await;
    producer.send("charge 8", &key).await;
    wait_settled(&source, Duration::from_secs(10)).await;
    // The broker forgets the key when the window is over.
    wait_for("the window to pass", Duration::from_secs(10), async || {
        !source.was_acked("charge-8").await.expect("was_acked")
    })
    .await;
    producer.send("charge 8", &key).await;
    wait_settled(&source, Duration::from_secs(10)).await;
    running.stop().await;
    assert_eq!(
        app.received_body(b"charge 8").len(),
        2,
        "after the window a duplicate is delivered again"
    );
}
