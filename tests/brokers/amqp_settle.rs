//! RabbitMQ: a settlement is written or not at all, courier's queues take
//! the work queue's type, and reading depth or dead letters leaves the
//! dead-letter queue as it was.
//!
//! - A retry or dead letter RabbitMQ refuses (a queue full with
//!   `x-overflow: reject-publish`) is never followed by the ack: the message
//!   comes back, on classic and quorum queues alike, and on a quorum queue
//!   even past its own `x-delivery-limit`.
//! - Tiers and the dead-letter queue of a quorum work queue are quorum.
//! - A message a quorum queue handed out `max_deliveries` times without a
//!   settlement is dead-lettered `undeliverable` without reaching the app.

use std::time::Duration;

use crate::common::*;
use courier::source::SourceOptions;
use lapin::options::{BasicGetOptions, BasicNackOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};

const SETTLE: Duration = Duration::from_secs(30);

async fn connect() -> lapin::Connection {
    lapin::Connection::connect(AMQP_URL, Default::default())
        .await
        .unwrap()
}

fn args(pairs: &[(&str, AMQPValue)]) -> FieldTable {
    let mut table = FieldTable::default();
    for (name, value) in pairs {
        table.insert((*name).into(), value.clone());
    }
    table
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(value.into())
}

/// A queue that refuses every publish with a publisher nack.
fn unwritable() -> FieldTable {
    args(&[
        ("x-max-length", AMQPValue::LongLongInt(0)),
        ("x-overflow", text("reject-publish")),
    ])
}

async fn declare(queue: &str, arguments: FieldTable) {
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), arguments)
        .await
        .unwrap();
    let _ = connection.close(200, "declared".into()).await;
}

async fn delete(queue: &str) {
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    let _ = connection.close(200, "deleted".into()).await;
}

/// The head of `queue` as a plain client sees it, put back afterwards:
/// its headers and whether it was handed out before.
async fn peek(queue: &str) -> Option<(FieldTable, bool)> {
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    let got = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()?;
    let seen = (
        got.delivery
            .properties
            .headers()
            .clone()
            .unwrap_or_default(),
        got.delivery.redelivered,
    );
    let _ = connection.close(200, "peeked".into()).await;
    Some(seen)
}

fn config(fixture: &Fixture, app: &TestApp) -> courier::sidecar::RunConfig {
    let mut config = run_config(fixture, app, fast_policy());
    config.options.live.max_deliveries = fast_policy().max_deliveries();
    config
}

/// A 400 whose dead letter RabbitMQ refuses is not acked away: it comes
/// back again and again, is counted as a settle error, and stays in the
/// work queue; once the dead-letter queue takes writes it lands there.
async fn an_unwritable_dead_letter_queue_acks_nothing_away(fixture: Fixture, limit: Option<i64>) {
    declare(&fixture.dlq(), unwritable()).await;
    let app = TestApp::start().await;
    let source = fixture.open().await;
    fixture.send(&source, "script:400").await;
    let running = Running::start(config(&fixture, &app)).await;
    // More deliveries than a quorum work queue's own delivery limit allows.
    let comebacks = limit.map_or(3, |l| l as usize + 2);
    wait_for("the refused 400 to come back", SETTLE, async || {
        app.received_body(b"script:400").len() >= comebacks
    })
    .await;
    let errors = metric(
        &scrape(running.metrics_addr).await,
        "courier_settle_errors_total",
        &fixture.queue,
    );
    running.stop().await;
    assert!(errors >= 1.0, "settle errors counted: {errors}");
    wait_for("the message back in the work queue", SETTLE, async || {
        source.depth().await.unwrap().ready == Some(1)
    })
    .await;
    assert_eq!(source.depth().await.unwrap().dead_letters, 0);

    delete(&fixture.dlq()).await;
    let running = Running::start(config(&fixture, &app)).await;
    wait_for("the dead letter", SETTLE, async || {
        source.depth().await.unwrap().dead_letters == 1
    })
    .await;
    running.stop().await;
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].body.as_ref(), b"script:400");
    wait_for("an empty work queue", SETTLE, async || {
        source.depth().await.unwrap().ready == Some(0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_classic_unwritable_dead_letter_queue_acks_nothing_away() {
    an_unwritable_dead_letter_queue_acks_nothing_away(Fixture::amqp(), None).await;
}

/// On a quorum queue with `x-delivery-limit: 2` the message comes back more
/// often than the limit allows: courier re-publishes a returned delivery,
/// which resets the broker's counter, so the limit never drops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_quorum_unwritable_dead_letter_queue_acks_nothing_away() {
    let fixture = Fixture::amqp();
    declare(
        &fixture.queue,
        args(&[
            ("x-queue-type", text("quorum")),
            ("x-delivery-limit", AMQPValue::LongLongInt(2)),
        ]),
    )
    .await;
    an_unwritable_dead_letter_queue_acks_nothing_away(fixture.clone(), Some(2)).await;
    // The dead-letter queue courier declared took the work queue's type:
    // a quorum queue counts deliveries from the first.
    let (headers, _) = peek(&fixture.dlq()).await.expect("the dead letter");
    assert!(
        headers.inner().contains_key("x-delivery-count"),
        "{}.dlq is a quorum queue",
        fixture.queue
    );
}

/// A retry RabbitMQ refuses (the 50 ms tier is full) is not acked away:
/// the message comes back, each return counts as an attempt, and when they
/// run out it is dead-lettered; the tier never held it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_unwritable_retry_tier_acks_nothing_away() {
    let fixture = Fixture::amqp();
    // Every tier the backoff of the fast policy uses (50, 100, 200 ms).
    for tier in ["50ms", "100ms", "200ms"] {
        declare(&format!("{}.retry.{tier}", fixture.queue), unwritable()).await;
    }
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let id = fixture.send(&source, "script:503").await;
    let running = Running::start(config(&fixture, &app)).await;
    wait_for("the dead letter", SETTLE, async || {
        source.depth().await.unwrap().dead_letters == 1
    })
    .await;
    running.stop().await;
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].field("courier-message-id"), Some(id.as_str()));
    assert_eq!(
        letters[0].field("courier-reason"),
        Some("attempts-exhausted")
    );
    assert_eq!(app.received_body(b"script:503").len(), 3);
    for tier in ["50ms", "100ms", "200ms"] {
        let tier = format!("{}.retry.{tier}", fixture.queue);
        assert!(peek(&tier).await.is_none(), "the full tier never took it");
    }
}

/// The tiers of a quorum work queue are quorum queues that dead-letter at
/// least once; a retry through one arrives as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_quorum_tiers_are_quorum() {
    let fixture = Fixture::amqp();
    declare(&fixture.queue, args(&[("x-queue-type", text("quorum"))])).await;
    let app = TestApp::start().await;
    let source = fixture.open().await;
    fixture.send(&source, "script:503,200").await;
    let running = Running::start(config(&fixture, &app)).await;
    wait_for("the retry", SETTLE, async || {
        app.received_body(b"script:503,200").len() >= 2
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    // Declaring the tier again with exactly the quorum arguments succeeds
    // only if that is what it was declared with.
    let tier = format!("{}.retry.50ms", fixture.queue);
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            tier.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("the tier exists");
    let quorum_tier = args(&[
        ("x-queue-type", text("quorum")),
        ("x-message-ttl", AMQPValue::LongLongInt(50)),
        ("x-dead-letter-exchange", text("")),
        ("x-dead-letter-routing-key", text(&fixture.queue)),
        ("x-dead-letter-strategy", text("at-least-once")),
        ("x-overflow", text("reject-publish")),
    ]);
    channel
        .queue_declare(
            tier.as_str().into(),
            QueueDeclareOptions::durable(),
            quorum_tier,
        )
        .await
        .expect("the tier is a quorum queue with at-least-once dead-lettering");
    let _ = connection.close(200, "checked".into()).await;
}

/// A message a quorum queue handed out `max_deliveries` times (here by a
/// plain client that never settles) is dead-lettered `undeliverable`
/// without being offered to the app; the others are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_quorum_poison_pill_is_dead_lettered_by_the_counter() {
    let fixture = Fixture::amqp();
    declare(&fixture.queue, args(&[("x-queue-type", text("quorum"))])).await;
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let poison = fixture.send(&source, "poison").await;
    let limit = fast_policy().max_deliveries();
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    for _ in 0..limit {
        let got = channel
            .basic_get(fixture.queue.as_str().into(), BasicGetOptions::default())
            .await
            .unwrap()
            .expect("the message");
        got.delivery
            .acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .await
            .unwrap();
    }
    let _ = connection.close(200, "handed out".into()).await;
    fixture.send(&source, "good").await;
    let running = Running::start(config(&fixture, &app)).await;
    wait_for("the dead letter", SETTLE, async || {
        source.depth().await.unwrap().dead_letters == 1
    })
    .await;
    wait_for("the good message", SETTLE, async || {
        !app.received_body(b"good").is_empty()
    })
    .await;
    running.stop().await;
    assert!(app.received_body(b"poison").is_empty(), "never offered");
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(letter.field("courier-message-id"), Some(poison.as_str()));
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    let error = letter.field("courier-error").unwrap_or_default();
    assert!(
        error.contains(&format!("handed out {limit} times without being settled")),
        "{error}"
    );
}

/// Depth never hands dead letters out (they would come back flagged
/// redelivered), and replaying one from the middle leaves the others listed
/// and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_depth_and_replay_leave_the_other_dead_letters_alone() {
    let fixture = Fixture::amqp();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    for n in 0..3 {
        fixture.send(&source, format!("script:400\n{n}")).await;
    }
    let running = Running::start(config(&fixture, &app)).await;
    wait_for("three dead letters", SETTLE, async || {
        source.depth().await.unwrap().dead_letters == 3
    })
    .await;
    running.stop().await;
    for _ in 0..5 {
        let depth = source.depth().await.unwrap();
        assert_eq!(depth.dead_letters, 3);
        assert_eq!(depth.oldest_dead_letter_age, None);
    }
    let (_, redelivered) = peek(&fixture.dlq()).await.unwrap();
    assert!(!redelivered, "reading depth handed no dead letter out");

    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters.len(), 3);
    source.purge(&fixture.dlq(), &letters[1]).await.unwrap();
    assert!(
        source.purge(&fixture.dlq(), &letters[1]).await.is_err(),
        "a purged letter is gone"
    );
    let left = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(left, vec![letters[0].clone(), letters[2].clone()]);
    source.replay(&fixture.dlq(), &letters[2]).await.unwrap();
    source.replay(&fixture.dlq(), &letters[0]).await.unwrap();
    let depth = source.depth().await.unwrap();
    assert_eq!((depth.dead_letters, depth.ready), (0, Some(2)));
}

/// A live policy change of the dead-letter queue moves where depth reads
/// dead letters.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_depth_follows_a_live_dead_letter_queue_change() {
    let fixture = Fixture::amqp();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    fixture.send(&source, "script:400").await;
    let running = Running::start(config(&fixture, &app)).await;
    wait_for("the dead letter", SETTLE, async || {
        source.depth().await.unwrap().dead_letters == 1
    })
    .await;
    running.stop().await;
    let mut settings = config(&fixture, &app).options.live.clone();
    settings.dead_letter_queue = format!("{}.elsewhere", fixture.queue);
    source.apply(&settings);
    assert_eq!(source.depth().await.unwrap().dead_letters, 0);
    settings.dead_letter_queue = fixture.dlq();
    source.apply(&settings);
    assert_eq!(source.depth().await.unwrap().dead_letters, 1);
}

/// A `courier-deliveries` header a producer wrote on a new message is not
/// courier's count: the message is delivered, not taken for a poison pill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_forged_delivery_count_is_not_a_poison_pill() {
    let fixture = Fixture::amqp();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    source
        .send(
            "forged".into(),
            &[("courier-deliveries".into(), "1000".into())],
        )
        .await
        .unwrap();
    let running = Running::start(config(&fixture, &app)).await;
    wait_for("the delivery", SETTLE, async || {
        !app.received_body(b"forged").is_empty()
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert_eq!(source.depth().await.unwrap().dead_letters, 0);
}

/// On a classic queue the broker only flags a redelivery, so each one
/// courier sees counts one hand-out: with a limit of 1, a message another
/// client took and returned comes out of the source as a poison pill (the
/// dispatcher dead-letters such a delivery without offering it to the app).
/// The limit is set on the source here: a policy's is at least 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_classic_redelivery_counts_one_hand_out() {
    let fixture = Fixture::amqp();
    let source = fixture.open().await;
    fixture.send(&source, "returned").await;
    let connection = connect().await;
    let channel = connection.create_channel().await.unwrap();
    let got = channel
        .basic_get(fixture.queue.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("the message");
    got.delivery
        .acker
        .nack(BasicNackOptions {
            multiple: false,
            requeue: true,
        })
        .await
        .unwrap();
    let _ = connection.close(200, "returned".into()).await;
    let mut options = SourceOptions::new(&fixture.queue);
    options.live.max_deliveries = 1;
    let reader = courier::source::open(&fixture.url, options).await.unwrap();
    let mut got = Vec::new();
    wait_for("the returned message", SETTLE, async || {
        got = reader.receive(1).await.unwrap();
        !got.is_empty()
    })
    .await;
    assert_eq!(
        got[0].problem.as_deref(),
        Some("handed out 1 times without being settled")
    );
    release(&fixture, reader).await;
}

// === What a new process, a large body and the metrics show ===

/// A retry an earlier process parked in a delay tier counts in a new
/// process's `courier_retry_backlog`, though the new one never declared
/// that tier nor saw anything come back from it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_new_process_counts_the_retries_an_earlier_one_parked() {
    let fixture = Fixture::amqp();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    fixture.send(&source, "script:503,200").await;
    let dir = tempfile::tempdir().unwrap();
    // The retry waits in the 1m tier, longer than this test runs.
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 3\nbackoff: {initial: 50s, max: 50s, jitter: none}",
    );
    let backlog = async |courier: &mut CourierProcess| {
        let addr = courier.metrics_addr().await;
        metric(&scrape(addr).await, "courier_retry_backlog", &fixture.queue)
    };
    let mut first = CourierProcess::run(&run_args(&fixture, &app, &policy, "first"));
    wait_for("the retry parked in a tier", SETTLE, async || {
        backlog(&mut first).await == 1.0
    })
    .await;
    first.terminate();
    let status = first.exit_within(SETTLE).await;
    assert!(status.success(), "{status}\n{}", first.log());
    assert_eq!(app.received_body(b"script:503,200").len(), 1);

    let mut second = CourierProcess::run(&run_args(&fixture, &app, &policy, "second"));
    second.wait_running().await;
    wait_for(
        "the new process to count the parked retry",
        SETTLE,
        async || backlog(&mut second).await == 1.0,
    )
    .await;
    assert_eq!(
        app.received_body(b"script:503,200").len(),
        1,
        "still parked, not delivered early"
    );
}

/// RabbitMQ cannot tell a dead letter's age without handing it out, so the
/// oldest-age gauge is left out for the queue, not reported as 0; the
/// dead-letter count is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_the_oldest_dead_letter_age_is_left_out_not_zero() {
    let fixture = Fixture::amqp();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    fixture.send(&source, "script:400").await;
    let running = Running::start(config(&fixture, &app)).await;
    let mut text = String::new();
    wait_for("the dead letter in the gauge", SETTLE, async || {
        text = scrape(running.metrics_addr).await;
        metric(&text, "courier_dlq_depth", &fixture.queue) == 1.0
    })
    .await;
    running.stop().await;
    let label = format!("queue=\"{}\"", fixture.queue);
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("courier_dlq_oldest_age_seconds{") && l.contains(&label)),
        "{text}"
    );
}

/// Whether `tier` was declared classic or quorum: a declaration with
/// exactly one type's arguments is accepted only by a queue of that type.
async fn tier_type(tier: &str, work_queue: &str) -> &'static str {
    let classic = args(&[
        ("x-message-ttl", AMQPValue::LongLongInt(50)),
        ("x-dead-letter-exchange", text("")),
        ("x-dead-letter-routing-key", text(work_queue)),
    ]);
    let mut quorum = classic.clone();
    quorum.insert("x-queue-type".into(), text("quorum"));
    quorum.insert("x-dead-letter-strategy".into(), text("at-least-once"));
    quorum.insert("x-overflow".into(), text("reject-publish"));
    let connection = connect().await;
    let mut found = "neither";
    for (kind, arguments) in [("classic", classic), ("quorum", quorum)] {
        let channel = connection.create_channel().await.unwrap();
        if channel
            .queue_declare(tier.into(), QueueDeclareOptions::durable(), arguments)
            .await
            .is_ok()
        {
            found = kind;
            break;
        }
    }
    let _ = connection.close(200, "checked".into()).await;
    found
}

/// Runs one retry through the 50 ms tier and says which type the tier got.
async fn tier_type_after_a_retry(fixture: &Fixture) -> &'static str {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    fixture.send(&source, "script:503,200").await;
    let running = Running::start(config(fixture, &app)).await;
    wait_for("the retry", SETTLE, async || {
        app.received_body(b"script:503,200").len() >= 2
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    tier_type(&format!("{}.retry.50ms", fixture.queue), &fixture.queue).await
}

/// The work queue's type is told from RabbitMQ's reply codes, not the text
/// of its answers: a classic queue gets classic tiers, a quorum queue
/// quorum ones, also when an operator gave it arguments of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_tiers_take_the_type_of_a_classic_work_queue() {
    let fixture = Fixture::amqp();
    declare(&fixture.queue, FieldTable::default()).await;
    assert_eq!(tier_type_after_a_retry(&fixture).await, "classic");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_tiers_take_the_type_of_a_quorum_work_queue_with_arguments() {
    let fixture = Fixture::amqp();
    declare_amqp_quorum(&fixture.queue).await;
    assert_eq!(tier_type_after_a_retry(&fixture).await, "quorum");
}

/// A 40 MiB body with the default `--max-body` (4 MiB). RabbitMQ pushes a
/// message whole, so courier holds it once it is delivered (AMQP reads are
/// not bounded in bytes); it dead-letters it `undeliverable` without
/// offering it, keeps running and delivers what comes after, and its peak
/// memory stays within a small multiple of the body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_a_40_mib_body_is_dead_lettered_and_courier_keeps_running() {
    const BIG: usize = 40 << 20;
    let fixture = Fixture::amqp();
    let (peak, ids, letters) =
        oversized_through_the_binary(&fixture, vec![vec![b'x'; BIG]], &[]).await;
    // Alone it peaks near 120 MiB; beside other tests it reached 160 MiB
    // once (lapin's frame buffers and the assembled body overlap for
    // longer on a busy machine). Holding one such message per delivery
    // slot would be 16 × 40 MiB, far above this bound.
    assert!(
        peak < 5 * BIG as u64,
        "courier's peak RSS was {} MiB",
        peak >> 20
    );
    assert_eq!(letters.len(), 1);
    assert_oversized(&letters[0], &ids, BIG, 4 << 20);
    let source = fixture.open().await;
    source.purge(&fixture.dlq(), &letters[0]).await.unwrap();
}

/// Found at 21da363: a healthy start on RabbitMQ logged one `NOT_FOUND …
/// no queue '…retry.10ms'` ERROR per delay tier (29 of 36 lines), lapin
/// reporting the channels courier's passive declares make the broker
/// close. A start that delivers, retries and polls depth logs no ERROR.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_start_logs_no_error() {
    let fixture = Fixture::amqp();
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(dir.path(), "maxAttempts: 3");
    let mut args = run_args(&fixture, &app, &policy, "healthy");
    args.push("--create".into());
    let mut courier = CourierProcess::run(&args);
    courier.wait_running().await;
    let source = fixture.open().await;
    fixture.send(&source, "script:503,200\nonce retried").await;
    // The retry delivered first: this process's depth counts a delay tier
    // only once it has seen it exist, and its first reading may come
    // before the sidecar made the tier.
    wait_for("the retry delivered", SETTLE, async || {
        app.received_body(b"script:503,200\nonce retried").len() == 2
    })
    .await;
    wait_settled(&source, SETTLE).await;
    // A depth poll passively declares every tier: the retry backlog on
    // /metrics is that poll's answer, so once it shows, the declares that
    // used to log the errors have run.
    let addr = courier.metrics_addr().await;
    wait_for("a depth poll", SETTLE, async || {
        series(&scrape(addr).await, "courier_retry_backlog", &fixture.queue).is_some()
    })
    .await;
    courier.terminate();
    courier.exit_within(SETTLE).await;
    let log = courier.log();
    let errors: Vec<&str> = log.lines().filter(|l| l.contains("\"ERROR\"")).collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    assert_eq!(app.received_body(b"script:503,200\nonce retried").len(), 2);
}
