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
    config.delivery.dedup_window = window;
    let running = Running::start_second_of_two(config).await;
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
    config.delivery.dedup_window = Some(Duration::from_millis(300));
    let running = Running::start_second_of_two(config).await;
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

/// docs/design.md ("Dedup window"): a source without a deduplication
/// window logs that the window is off, and delivers as without one. The
/// built binary runs with `--dedup-window 30s`: it warns once at start and
/// hands both copies of a duplicate to the app, acking each without
/// trying the window it does not have.
pub async fn without_support_the_window_is_off_with_a_warning(fixture: Fixture) {
    const WARNING: &str = "--dedup-window: this source keeps no deduplication window; deliveries are not deduplicated";
    let app = TestApp::start().await;
    let producer = fixture.producer().await;
    let key = [("idempotency-key".to_string(), "charge-9".to_string())];
    producer.send("charge 9", &key).await;
    producer.send("charge 9", &key).await;
    producer.release(&fixture).await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(dir.path(), "maxAttempts: 3\ntimeout: 2s");
    let mut args = run_args_second_of_two(&fixture, &app, &policy, "no-dedup");
    args.extend(["--dedup-window", "30s"].map(str::to_string));
    let mut courier = CourierProcess::run(&args);
    let warning = courier.wait_log(WARNING, Duration::from_secs(30)).await;
    assert_eq!(warning["level"], "WARN", "{warning}");
    let addr = courier.metrics_addr().await;
    wait_for("both copies acked", Duration::from_secs(30), async || {
        metric(&scrape(addr).await, "courier_acks_total", &fixture.queue) >= 2.0
    })
    .await;
    courier.terminate();
    let status = courier.exit_within(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}\n{}", courier.log());
    assert_eq!(
        app.received_body(b"charge 9").len(),
        2,
        "the duplicate reached the app: the window is off"
    );
    let text = courier.log();
    // Once for this queue (the subscription beside it warns for its own).
    let for_this_queue = text
        .lines()
        .filter(|l| l.contains(WARNING) && l.contains(&format!("\"queue\":\"{}\"", fixture.queue)))
        .count();
    assert_eq!(for_this_queue, 1, "warned once:\n{text}");
    assert!(
        !text.contains("could not remember the ack for deduplication"),
        "the window is ignored, not tried on every ack:\n{text}"
    );
}
