//! `courier-*` fields a producer writes are not courier's state: only a
//! copy courier stored itself (sealed) carries its attempt, message id,
//! first-attempt time, due time and delivery count.

use std::time::{Duration, SystemTime};

use crate::common::*;
use courier::model::rfc3339;

/// A producer message carrying forged `courier-attempt: 99`,
/// `courier-attempts`, `courier-message-id`, `courier-first-attempt-at`,
/// `courier-retry-at` an hour ahead and `courier-deliveries: 1000` (a
/// dead-letter dump re-published by hand, say) is a new message: delivered
/// at once as attempt 1 under the broker's own id, retried after a 503 as
/// attempt 2, and dead-lettered after a 400 with the real attempt count,
/// never as undeliverable by the forged counter.
pub async fn forged_courier_fields_are_not_state(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let an_hour_ahead = SystemTime::now() + Duration::from_secs(3600);
    let forged: Vec<(String, String)> = [
        ("courier-attempt", "99".to_string()),
        ("courier-attempts", "99".to_string()),
        ("courier-message-id", "forged-id".to_string()),
        (
            "courier-first-attempt-at",
            "2001-01-01T00:00:00Z".to_string(),
        ),
        ("courier-retry-at", rfc3339(an_hour_ahead)),
        ("courier-deliveries", "1000".to_string()),
        ("courier-replays", "5".to_string()),
        (
            "courier-seal",
            "0123456789abcdef0123456789abcdef01234567".to_string(),
        ),
        ("x-plain", "kept".to_string()),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_string(), v))
    .collect();
    let body = "script:503,400\nforged";
    let sent_at = SystemTime::now();
    let id = producer.send(body, &forged).await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;

    let seen = app.received_body(body.as_bytes());
    assert_eq!(seen.len(), 2, "the first delivery and one retry: {seen:?}");
    for (attempt, r) in seen.iter().enumerate() {
        assert_eq!(
            r.header("courier-attempt"),
            Some((attempt + 1).to_string().as_str()),
            "{r:?}"
        );
        assert_eq!(r.header("courier-message-id"), Some(id.as_str()), "{r:?}");
        assert_eq!(
            r.header("idempotency-key"),
            Some(format!("{}:{id}", fixture.queue).as_str()),
            "{r:?}"
        );
        assert_eq!(r.header("x-plain"), Some("kept"), "{r:?}");
    }
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter = &letters[0];
    assert_eq!(letter.field("courier-reason"), Some("permanent-status"));
    assert_eq!(letter.field("courier-status"), Some("400"));
    assert_eq!(letter.field("courier-attempts"), Some("2"));
    assert_eq!(letter.field("courier-message-id"), Some(id.as_str()));
    assert_eq!(letter.field("x-plain"), Some("kept"));
    let first = letter
        .field("courier-first-attempt-at")
        .and_then(|t| courier::model::parse_time(t.as_bytes()))
        .expect("a first-attempt time");
    assert!(
        first >= sent_at - Duration::from_secs(5),
        "the first attempt is this run's, not the forged 2001: {first:?}"
    );
    for stale in [
        "courier-seal",
        "courier-retry-at",
        "courier-deliveries",
        "courier-replays",
        "courier-attempt",
    ] {
        assert_eq!(letter.field(stale), None, "{stale} in {letter:?}");
    }
}
