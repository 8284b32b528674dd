//! Delivery: what the app receives and what becomes of each answer, with a
//! sidecar running in this process against a real broker and a real HTTP
//! app on loopback.

use std::time::{Duration, Instant, SystemTime};

use crate::common::*;
use bytes::Bytes;
use courier::source::{DeadLetter, Source};
use std::sync::Arc;

pub async fn dead_letter_of(
    source: &Arc<dyn Source>,
    fixture: &Fixture,
    message_id: &str,
) -> DeadLetter {
    let letters = source
        .dead_letters(&fixture.dlq(), 10_000)
        .await
        .expect("list dead letters");
    letters
        .into_iter()
        .find(|l| l.field("courier-message-id") == Some(message_id))
        .unwrap_or_else(|| panic!("no dead letter for message {message_id}"))
}

async fn dead_letter_ids(source: &Arc<dyn Source>, fixture: &Fixture) -> Vec<String> {
    let mut ids: Vec<String> = source
        .dead_letters(&fixture.dlq(), 10_000)
        .await
        .unwrap()
        .iter()
        .filter_map(|l| l.field("courier-message-id").map(str::to_string))
        .collect();
    ids.sort();
    ids
}

/// Every row of the classification table, end to end.
pub async fn classification_table(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    // (script, deliveries the app should see, dead-letter reason if any)
    let rows: &[(&str, usize, Option<&str>)] = &[
        ("200", 1, None),
        ("201", 1, None),
        ("204", 1, None),
        ("408,200", 2, None),
        ("429,200", 2, None),
        ("500,200", 2, None),
        ("502,200", 2, None),
        ("503,200", 2, None),
        ("504,200", 2, None),
        ("sleep900,200", 2, None),
        ("501", 1, Some("permanent-status")),
        ("400", 1, Some("permanent-status")),
        ("404", 1, Some("permanent-status")),
        ("422", 1, Some("permanent-status")),
        ("302", 1, Some("permanent-status")),
        ("503", 3, Some("attempts-exhausted")),
        ("sleep900", 3, Some("attempts-exhausted")),
    ];
    let mut ids = Vec::new();
    for (script, _, _) in rows {
        ids.push(producer.send(format!("script:{script}"), &[]).await);
    }
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    for ((script, deliveries, reason), id) in rows.iter().zip(&ids) {
        let body = format!("script:{script}");
        let seen = app.received_body(body.as_bytes());
        let attempts: Vec<u32> = seen.iter().map(Received::attempt).collect();
        if attempts != (1..=*deliveries as u32).collect::<Vec<_>>() {
            // What tells a delivery courier counted but the app never got
            // from a lost one: when each came, and what the letter says.
            let gaps: Vec<Duration> = seen.windows(2).map(|w| w[1].at - w[0].at).collect();
            let letter = source
                .dead_letters(&fixture.dlq(), 10_000)
                .await
                .ok()
                .and_then(|ls| {
                    ls.into_iter()
                        .find(|l| l.field("courier-message-id") == Some(id.as_str()))
                })
                .map(|l| l.fields);
            panic!(
                "{script}: the app saw Courier-Attempt {attempts:?} (expected 1..={deliveries}), \
                 {gaps:?} apart; its dead letter: {letter:?}"
            );
        }
        match reason {
            Some(reason) => {
                let letter = dead_letter_of(&source, &fixture, id).await;
                assert_eq!(letter.field("courier-reason"), Some(*reason), "{script}");
                assert_eq!(
                    letter.body,
                    Bytes::from(body.clone()),
                    "{script}: body kept"
                );
            }
            None => assert!(
                !dead_letter_ids(&source, &fixture).await.contains(id),
                "{script} must not be dead-lettered"
            ),
        }
    }
    assert_eq!(
        dead_letter_ids(&source, &fixture).await.len(),
        rows.iter().filter(|r| r.2.is_some()).count()
    );
}

/// Retry-After is honored: the next attempt comes no earlier than it said.
pub async fn retry_after_is_honored(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    producer.send("script:429ra1,200", &[]).await;
    producer.send("script:503ra1,200", &[]).await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    for body in ["script:429ra1,200", "script:503ra1,200"] {
        let seen = app.received_body(body.as_bytes());
        assert_eq!(seen.len(), 2, "{body}");
        let gap = seen[1].at - seen[0].at;
        assert!(
            gap >= Duration::from_millis(1000),
            "{body}: second attempt after {gap:?}, Retry-After said 1s"
        );
    }
}

/// The same Idempotency-Key on every attempt; Courier-Attempt counts 1, 2, 3;
/// the headers of the design arrive; producer headers pass, reserved ones do
/// not.
pub async fn headers_and_idempotency(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let plain = producer.send("script:503,503,200", &[]).await;
    let headers = [
        ("idempotency-key".to_string(), "order-42".to_string()),
        ("content-type".to_string(), "application/json".to_string()),
        (
            "traceparent".to_string(),
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_string(),
        ),
        ("courier-queue".to_string(), "not-this-one".to_string()),
        ("host".to_string(), "evil.example".to_string()),
        ("bad header".to_string(), "dropped".to_string()),
    ];
    // A producer cannot publish what its broker's client refuses (NATS
    // headers hold no spaces in names); the rest must arrive as described.
    let headers: Vec<_> = headers
        .into_iter()
        .filter(|(name, value)| producer.carries(name, value))
        .collect();
    producer.send("script:500,200", &headers).await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;

    let seen = app.received_body(b"script:503,503,200");
    assert_eq!(
        seen.iter().map(Received::attempt).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    let key = format!("{}:{plain}", fixture.queue);
    for r in &seen {
        assert_eq!(r.header("idempotency-key"), Some(key.as_str()));
        assert_eq!(r.header("courier-message-id"), Some(plain.as_str()));
        assert_eq!(r.header("courier-queue"), Some(fixture.queue.as_str()));
        assert_eq!(r.header("content-type"), Some("application/octet-stream"));
    }
    let seen = app.received_body(b"script:500,200");
    assert_eq!(seen.len(), 2);
    for r in &seen {
        assert_eq!(
            r.header("idempotency-key"),
            Some("order-42"),
            "the producer's key wins"
        );
        assert_eq!(r.header("content-type"), Some("application/json"));
        assert_eq!(
            r.header("traceparent"),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        assert_ne!(r.header("host"), Some("evil.example"));
        assert_eq!(
            r.header("courier-queue"),
            Some(fixture.queue.as_str()),
            "courier-* names are courier's own"
        );
        assert!(r.header("bad header").is_none());
    }
    assert_eq!(
        seen.iter().map(Received::attempt).collect::<Vec<_>>(),
        vec![1, 2]
    );
}

/// maxAttempts reached is a dead letter `attempts-exhausted` with the last
/// status and the whole failure record.
pub async fn attempts_exhausted(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let id = producer.send("script:503", &[]).await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert_eq!(app.received_body(b"script:503").len(), 3);
    let letter = dead_letter_of(&source, &fixture, &id).await;
    assert_eq!(letter.field("courier-reason"), Some("attempts-exhausted"));
    assert_eq!(letter.field("courier-status"), Some("503"));
    assert_eq!(letter.field("courier-attempts"), Some("3"));
    assert_eq!(letter.field("courier-error"), Some(""));
    assert_eq!(letter.field("courier-queue"), Some(fixture.queue.as_str()));
    assert_eq!(letter.field("courier-policy"), Some("test@1"));
    assert_eq!(
        letter.field("courier-response-excerpt"),
        Some("answer 503 to attempt 3")
    );
    let first = letter.field("courier-first-attempt-at").unwrap();
    let last = letter.field("courier-last-attempt-at").unwrap();
    assert!(
        first.ends_with('Z') && last.ends_with('Z') && first < last,
        "{first} < {last}"
    );
}

/// A 400 is dead-lettered after one attempt with status and excerpt.
pub async fn permanent_status(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let id = producer.send("script:400", &[]).await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert_eq!(app.received_body(b"script:400").len(), 1);
    let letter = dead_letter_of(&source, &fixture, &id).await;
    assert_eq!(letter.field("courier-reason"), Some("permanent-status"));
    assert_eq!(letter.field("courier-status"), Some("400"));
    assert_eq!(letter.field("courier-attempts"), Some("1"));
    assert_eq!(
        letter.field("courier-response-excerpt"),
        Some("answer 400 to attempt 1")
    );
}

/// 2xx messages are acked exactly once and nothing is left pending;
/// metrics agree with what the app saw.
pub async fn acked_exactly_once(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let n = 200;
    for i in 0..n {
        producer.send(format!("message {i}"), &[]).await;
    }
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    let depth = wait_settled(&source, SETTLE).await;
    // The counter moves just after the broker confirms the ack, which on
    // a loaded machine can come seconds after the depth reads 0 (SQS at
    // two test binaries at a time missed a 5 s bound once): waited for
    // as long as the settle, then it must be exactly n.
    let mut acks = 0.0;
    wait_for("the ack counter", SETTLE, async || {
        acks = metric(
            &scrape(running.metrics_addr).await,
            "courier_acks_total",
            &fixture.queue,
        );
        acks >= n as f64
    })
    .await;
    assert_eq!(acks, n as f64, "acks counted");
    running.stop().await;
    assert_eq!(depth.pending, 0);
    assert_eq!(depth.dead_letters, 0);
    if fixture.broker == BrokerKind::Amqp {
        // RabbitMQ reports no unacked messages, so `pending` above is what
        // the sidecar in this process says it holds. Stopped, it holds
        // nothing: what it left unacked is requeued, and RabbitMQ counts it.
        let left = amqp_count_without_consumers(fixture.url.as_str(), &fixture.queue).await;
        assert_eq!(left, 0, "RabbitMQ holds {left} messages after the stop");
    }
    let received = app.received();
    assert_eq!(received.len(), n);
    for i in 0..n {
        assert_eq!(
            app.received_body(format!("message {i}").as_bytes()).len(),
            1,
            "message {i}"
        );
    }
}

/// Bodies are bytes: non-UTF-8 passes unchanged; a body over --max-body is
/// dead-lettered as undeliverable, not sent.
pub async fn bodies_are_bytes(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let binary = Bytes::from_static(&[0, 159, 146, 150, 255, 254, b'\n', 0]);
    producer.send(binary.clone(), &[]).await;
    let big = Bytes::from(vec![b'x'; 2048]);
    let big_id = producer.send(big.clone(), &[]).await;
    let mut config = run_config(&fixture, &app, fast_policy());
    config.options.max_body = 1024;
    let running = Running::start_second_of_two(config).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert_eq!(
        app.received_body(&binary).len(),
        1,
        "binary body arrives unchanged"
    );
    assert!(
        app.received_body(&big).is_empty(),
        "an oversized body is not sent"
    );
    let letter = dead_letter_of(&source, &fixture, &big_id).await;
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    assert!(
        letter
            .field("courier-error")
            .unwrap()
            .contains("--max-body")
    );
    assert_eq!(letter.body, big, "the dead letter keeps the body");
}

/// An app that refuses connections uses up no attempts: once it is back, the
/// message arrives with Courier-Attempt 1 and nothing is dead-lettered.
/// The app goes away after courier started delivering (before the first
/// delivery courier waits for the app and sends nothing: `tests/dispatch/app_starting.rs`).
pub async fn unreachable_app_uses_no_attempts(fixture: Fixture) {
    let first = TestApp::start_returnable().await;
    let addr = first.addr.to_string();
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let running = Running::start_second_of_two(run_config(&fixture, &first, fast_policy())).await;
    // The answer closes its connection, so courier keeps none open to the
    // app: a request written on a pooled connection while the app goes away
    // is cut off, a lost connection, which rightly uses an attempt.
    producer.send("script:200+connection=close", &[]).await;
    wait_for("an ack before the app goes", SETTLE, async || {
        let text = scrape(running.metrics_addr).await;
        metric(&text, "courier_acks_total", &fixture.queue) >= 1.0
    })
    .await;
    first.stop();
    wait_for("the app's port to refuse connections", SETTLE, async || {
        tokio::net::TcpStream::connect(first.addr).await.is_err()
    })
    .await;
    producer.send("hello", &[]).await;
    wait_for(
        "a few refused deliveries",
        Duration::from_secs(20),
        async || {
            // At least two refusals: the app-health gate spaces its probes
            // out, so the count climbs slowly, and by how much depends on the
            // source's retry delays.
            scrape(running.metrics_addr).await.lines().any(|l| {
                l.contains("result=\"unreachable\"}")
                    && l.rsplit(' ')
                        .next()
                        .and_then(|v| v.parse::<u64>().ok())
                        .is_some_and(|n| n >= 2)
            })
        },
    )
    .await;
    let app = TestApp::start_on(&addr).await;
    wait_settled(&source, SETTLE).await;
    let metrics = scrape(running.metrics_addr).await;
    running.stop().await;
    let seen = app.received_body(b"hello");
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].attempt(),
        1,
        "refused connections did not count as attempts"
    );
    assert!(dead_letter_ids(&source, &fixture).await.is_empty());
    assert!(metrics.contains("courier_app_up 1"), "{metrics}");
}

/// A policy file edit applies to the next decision; an invalid edit is
/// refused and the last good policy stays.
pub async fn policy_file_reload(fixture: Fixture) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    let doc = |max: &str| {
        format!(
            "apiVersion: courier.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: orders\nspec:\n  maxAttempts: {max}\n  timeout: 500ms\n  backoff: {{initial: 20ms, max: 50ms, jitter: none}}\n"
        )
    };
    std::fs::write(&path, doc("3")).unwrap();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let mut config = run_config(&fixture, &app, courier::policy::file::load(&path).unwrap());
    config.policy.file = Some(path.clone());
    let running = Running::start_second_of_two(config).await;
    // Each message ends as a dead letter; waiting for it, not only for a
    // settled depth, because a depth read can fall between two queues: on
    // RabbitMQ a message expiring from a delay tier is in neither the tier
    // nor the work queue for a moment, and reads all zero.
    let dead = async |n: u64| {
        wait_for("the dead letter", SETTLE, async || {
            source.depth().await.unwrap().dead_letters == n
        })
        .await;
        wait_settled(&source, SETTLE).await;
    };
    let first = producer.send("script:503\nfirst", &[]).await;
    dead(1).await;
    assert_eq!(app.received_body(b"script:503\nfirst").len(), 3);

    std::fs::write(&path, doc("1")).unwrap();
    wait_for("the edit to apply", Duration::from_secs(5), async || {
        scrape(running.metrics_addr)
            .await
            .contains("courier_policy_generation{policy=\"orders\"} 2")
    })
    .await;
    let second = producer.send("script:503\nsecond", &[]).await;
    dead(2).await;
    assert_eq!(
        app.received_body(b"script:503\nsecond").len(),
        1,
        "maxAttempts 1 applies to the next message"
    );

    std::fs::write(&path, doc("0")).unwrap();
    wait_for(
        "the bad edit to be rejected",
        Duration::from_secs(5),
        async || {
            scrape(running.metrics_addr)
                .await
                .contains("courier_policy_reloads_total{result=\"rejected\"} 1")
        },
    )
    .await;
    let third = producer.send("script:503\nthird", &[]).await;
    dead(3).await;
    let metrics = scrape(running.metrics_addr).await;
    running.stop().await;
    assert_eq!(
        app.received_body(b"script:503\nthird").len(),
        1,
        "the last good policy stays"
    );
    assert!(
        metrics.contains("courier_policy_generation{policy=\"orders\"} 2"),
        "{metrics}"
    );
    for (id, policy) in [
        (first, "orders@1"),
        (second, "orders@2"),
        (third, "orders@2"),
    ] {
        let letter = dead_letter_of(&source, &fixture, &id).await;
        assert_eq!(letter.field("courier-policy"), Some(policy));
    }
}

/// Findings 4 and 10: a live edit that lowers `maxAttempts` below the
/// attempts a message has used dead-letters it `attempts-exhausted` at its
/// next answer. On NATS and SQS the broker's delivery count, which the
/// poison-pill limit (`maxAttempts + 2`) reads, also counts the retries
/// courier settled in place; it made this `undeliverable`, "handed out 6
/// times without being settled", without offering it again.
pub async fn a_live_lower_max_attempts_exhausts_attempts(fixture: Fixture) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    let doc = |max: &str| {
        format!(
            "apiVersion: courier.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: orders\nspec:\n  maxAttempts: {max}\n  timeout: 500ms\n  backoff: {{initial: 700ms, max: 700ms, jitter: none}}\n"
        )
    };
    std::fs::write(&path, doc("10")).unwrap();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let mut config = run_config(&fixture, &app, courier::policy::file::load(&path).unwrap());
    config.policy.file = Some(path.clone());
    let running = Running::start_second_of_two(config).await;
    let body = b"script:503\nlowered";
    let id = producer.send(&body[..], &[]).await;
    wait_for("five attempts", Duration::from_secs(20), async || {
        app.received_body(body).len() >= 5
    })
    .await;
    // maxAttempts 2: the limit is 4 hand-outs, and the next one is the 6th.
    std::fs::write(&path, doc("2")).unwrap();
    wait_for("the edit to apply", Duration::from_secs(5), async || {
        scrape(running.metrics_addr)
            .await
            .contains("courier_policy_generation{policy=\"orders\"} 2")
    })
    .await;
    wait_for("the dead letter", SETTLE, async || {
        source.depth().await.unwrap().dead_letters == 1
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    let letter = dead_letter_of(&source, &fixture, &id).await;
    assert_eq!(
        letter.field("courier-reason"),
        Some("attempts-exhausted"),
        "error: {:?}",
        letter.field("courier-error")
    );
    assert_eq!(letter.field("courier-status"), Some("503"));
    let seen = app.received_body(body);
    assert!(
        (6..=7).contains(&seen.len()),
        "offered once more after the edit: {} deliveries",
        seen.len()
    );
}

/// A dead letter is there for the broker's own tools too: read with the
/// broker's client, it has the body byte for byte, the producer's headers
/// and courier's failure fields, and reading it leaves it in place.
pub async fn dead_letters_are_readable_with_the_brokers_own_client(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let body = Bytes::from("script:400\nnon-ASCII: é ✓");
    let id = producer
        .send(body.clone(), &[("x-tenant".into(), "acme".into())])
        .await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    let letters = fixture.read_dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter = &letters[0];
    assert_eq!(letter.body, body);
    for (name, value) in [
        ("x-tenant", "acme"),
        ("courier-reason", "permanent-status"),
        ("courier-status", "400"),
        ("courier-attempts", "1"),
        ("courier-message-id", id.as_str()),
        ("courier-queue", fixture.queue.as_str()),
    ] {
        assert_eq!(letter.field(name), Some(value), "{name} in {letter:?}");
    }
    assert_eq!(
        fixture.dead_letters(&source).await.len(),
        1,
        "reading with the broker's client left the dead letter in place"
    );
}

/// Every delivery knows when its message entered the queue
/// (`Delivery::enqueued_at`): the broker's own time for the entry, and the
/// same time again after a retry and after a give-back, which several
/// brokers store as a new entry with a time of its own (the copy carries
/// the first in `courier-enqueued-at`).
pub async fn enqueued_at_survives_retries(fixture: Fixture) {
    let source = fixture.open().await;
    let sent_at = SystemTime::now();
    fixture.send(&source, "enqueued").await;
    let first = receive_within(&source, Duration::from_secs(30)).await;
    let enqueued = first.enqueued_at.expect("the broker's time for the entry");
    assert_near(enqueued, sent_at, Duration::from_secs(2), "as sent");
    // Long enough that a copy's own time would show.
    tokio::time::sleep(Duration::from_millis(1_100)).await;
    let first_attempt_at = SystemTime::now();
    source
        .retry(&first, 2, first_attempt_at, first_attempt_at)
        .await
        .expect("retry");
    let retried = receive_within(&source, Duration::from_secs(30)).await;
    assert_eq!(
        (&retried.message.id, retried.attempt),
        (&first.message.id, 2)
    );
    let again = retried.enqueued_at.expect("a time after the retry");
    assert_near(again, enqueued, Duration::from_millis(5), "after a retry");
    // A give-back: the attempt is not used up.
    let now = SystemTime::now();
    source
        .retry(&retried, 2, first_attempt_at, now)
        .await
        .expect("give back");
    let given_back = receive_within(&source, Duration::from_secs(30)).await;
    assert_eq!(given_back.attempt, 2);
    let again = given_back.enqueued_at.expect("a time after the give-back");
    assert_near(
        again,
        enqueued,
        Duration::from_millis(5),
        "after a give-back",
    );
    source.ack(&given_back).await.expect("ack");
}

/// The next delivery of the queue, within `limit`.
async fn receive_within(source: &Arc<dyn Source>, limit: Duration) -> courier::source::Delivery {
    let deadline = Instant::now() + limit;
    loop {
        let mut got = source.receive(1).await.expect("receive");
        if let Some(delivery) = got.pop() {
            return delivery;
        }
        assert!(
            Instant::now() < deadline,
            "nothing received within {limit:?}"
        );
    }
}

/// `got` is within `within` of `want`, before or after.
fn assert_near(got: SystemTime, want: SystemTime, within: Duration, what: &str) {
    let off = got
        .duration_since(want)
        .unwrap_or_else(|early| early.duration());
    assert!(
        off <= within,
        "enqueued_at {what} is {got:?}, {off:?} from {want:?} (at most {within:?})"
    );
}
