//! The lineage of a replay, for every source that replays: a dead letter
//! replayed with the built binary reaches the app with
//! `Courier-Replay-Count` and its Idempotency-Key, and when it dies again
//! its new dead letter names the letter it was replayed from and keeps the
//! history; a producer's lineage fields count for nothing.

use crate::common::*;
use crate::dlq::{Beside, courier, json_lines, stderr, stdout};
use courier::source::DeadLetter;

/// The dead letter of `body` whose `courier-replay-count` is
/// `replay_count`, once the sidecar has written it.
async fn letter(sidecar: &mut Beside<'_>, body: &str, replay_count: Option<&str>) -> DeadLetter {
    let what = format!("the dead letter of {body:?} replayed {replay_count:?} times");
    sidecar
        .letter(&what, |l| {
            l.body.as_ref() == body.as_bytes() && l.field("courier-replay-count") == replay_count
        })
        .await
}

/// A message answered 400 is dead-lettered; `courier dlq replay --id`
/// sends it back, and the app sees `Courier-Replay-Count: 1` and the same
/// Idempotency-Key. Answered 400 again, its new dead letter says
/// `courier-replay-count: 1`, `courier-replayed-from: <first letter>` and
/// has a history naming the first letter, in `dlq show` as text and JSON.
/// Replayed again, the app sees `Courier-Replay-Count: 2`. A producer's
/// message with forged lineage fields reaches the app without the header,
/// and its dead letter has none of them.
pub async fn a_replay_carries_its_lineage(fixture: Fixture) {
    let app = TestApp::start().await;
    let body = "script:400,400,200\nlineage";
    let forged_body = "script:400\nforged lineage";
    let forged: Vec<(String, String)> = [
        ("courier-replay-count", "7"),
        ("courier-replayed-from", "forged-1"),
        (
            "courier-history",
            r#"[{"id":"forged-0","reason":"expired","attempts":1,"at":"2001-01-01T00:00:00Z"}]"#,
        ),
    ]
    .into_iter()
    .map(|(n, v)| (n.to_string(), v.to_string()))
    .collect();
    // Opened first, as a deployed sidecar has: Pub/Sub counts and browses
    // through subscriptions made at the first open (see `dlq::send_all`).
    drop(fixture.open().await);
    wait_released(&fixture).await;
    let producer = fixture.producer().await;
    let id = producer.send(body, &[]).await;
    producer.send(forged_body, &forged).await;
    producer.release(&fixture).await;
    let key = format!("{}:{id}", fixture.queue);
    let mut sidecar = Beside::new(&fixture, &app.url());

    let first = letter(&mut sidecar, body, None).await;
    let forged_letter = letter(&mut sidecar, forged_body, None).await;
    for name in ["courier-replayed-from", "courier-history"] {
        assert_eq!(forged_letter.field(name), None, "{name}: {forged_letter:?}");
    }
    let seen = app.received_body(forged_body.as_bytes());
    assert_eq!(seen[0].header("courier-replay-count"), None, "{seen:?}");
    let seen = app.received_body(body.as_bytes());
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].header("courier-replay-count"), None, "{seen:?}");

    let out = sidecar
        .courier(&["dlq", "replay", "--id", &first.id], None)
        .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let second = letter(&mut sidecar, body, Some("1")).await;
    let seen = app.received_body(body.as_bytes());
    assert_eq!(seen.len(), 2, "{seen:?}");
    for r in &seen {
        assert_eq!(r.attempt(), 1, "a replay starts again at attempt 1: {r:?}");
        assert_eq!(r.header("idempotency-key"), Some(key.as_str()), "{r:?}");
    }
    assert_eq!(
        seen[1].header("courier-replay-count"),
        Some("1"),
        "{seen:?}"
    );
    assert_eq!(second.field("courier-message-id"), Some(id.as_str()));
    assert_eq!(
        second.field("courier-replayed-from"),
        Some(first.id.as_str())
    );

    // What an operator sees of it.
    let out = sidecar.courier(&["dlq", "show", &second.id], None).await;
    assert!(out.status.success(), "{}", stderr(&out));
    let shown = stdout(&out);
    for want in [
        "courier-replay-count: 1\n".to_string(),
        format!("courier-replayed-from: {}\n", first.id),
        "lineage: replayed 1 time; earlier dead letters, oldest first:\n".to_string(),
        format!("\n  {}  ", first.id),
    ] {
        assert!(shown.contains(&want), "{want:?} in\n{shown}");
    }
    let out = sidecar
        .courier(&["dlq", "show", &second.id, "--output", "json"], None)
        .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let json = &json_lines(&out)[0];
    assert_eq!(json["courier-replay-count"], "1");
    assert_eq!(json["courier-replayed-from"], first.id.as_str());
    let history: serde_json::Value =
        serde_json::from_str(json["courier-history"].as_str().expect("a history")).unwrap();
    let rounds = history.as_array().expect("an array");
    assert_eq!(rounds.len(), 1, "{history}");
    assert_eq!(rounds[0]["id"], first.id.as_str());
    assert_eq!(rounds[0]["reason"], "permanent-status");
    assert_eq!(rounds[0]["status"], 400);
    assert_eq!(rounds[0]["attempts"], 1);
    assert_eq!(
        rounds[0]["at"].as_str(),
        first.field("courier-last-attempt-at")
    );

    let out = sidecar
        .courier(&["dlq", "replay", "--id", &second.id], None)
        .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let source = sidecar.source().await;
    wait_for("the second replay delivered", SETTLE, async || {
        app.received_body(body.as_bytes()).len() == 3
    })
    .await;
    wait_settled(&source, SETTLE).await;
    drop(source);
    sidecar.stop().await;
    let third = &app.received_body(body.as_bytes())[2];
    assert_eq!(third.header("courier-replay-count"), Some("2"), "{third:?}");
    assert_eq!(third.header("idempotency-key"), Some(key.as_str()));
    let left = json_lines(&courier(&fixture, &["dlq", "list", "--output", "json"]));
    assert_eq!(left.len(), 1, "the forged message's letter alone: {left:?}");
}
