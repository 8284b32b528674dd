//! Long delays: a Retry-After longer than what the broker holds a message
//! for (SQS's 12 h visibility, Pub/Sub's 600 s ack deadline, a RabbitMQ
//! tier's TTL) is kept on the broker, survives `kill -9` of courier and
//! fires on time after a restart, on every broker (docs/sources.md, "Long
//! delays"). A test cannot wait hours: where the limit is a clock of the
//! broker's, courier's operations knob lowers it to 2 s, so that a 5 s
//! Retry-After is past it and goes through the same chain of copies a
//! 13 h one would; RabbitMQ's 5 s goes through two tiers (4 s, then 1 s).
//! Each run prints how late the retry came.

use std::time::{Duration, Instant};

use crate::common::*;

/// The `Retry-After` the app answers the first delivery with.
const RETRY_AFTER: Duration = Duration::from_secs(5);
/// Kafka's: a killed replica's partitions, and the retry copies on them,
/// reach the restarted one only after the group's session timeout (3 s
/// here) and a rebalance, and its partitions start after up to a few held
/// fetches (3 s each): 1 to 11 s after the kill on the mock cluster
/// (docs/sources.md). A retry due in that time comes when the partitions
/// do; this one is due after it, and tests that the delay consumer holds
/// it until then.
const KAFKA_RETRY_AFTER: Duration = Duration::from_secs(20);
/// How long after that answer courier is killed.
const KILLED_AFTER: Duration = Duration::from_secs(1);
/// How late the retry may come after its due time.
const LATE_BY_AT_MOST: Duration = Duration::from_secs(1);
/// SQS's, on moto: the last copy, received 0.9 s before its due time, is
/// made invisible for the whole second SQS allows (until :27.22, due at
/// :27.10, in a debug log). At :27.14 courier leaves it to SQS, whose own
/// timer is under `SURFACE_GUARD` (100 ms) away (crates/sqs/src/settle.rs:
/// a receipt may be someone else's by then); moto showed it to the long
/// poll only at :28.14, about a second after its timer. Every run on
/// 2026-12-06 came 1.017 to 1.022 s late, idle or busy.
const SQS_LATE_BY_AT_MOST: Duration = Duration::from_millis(1500);
/// Due times are stored in whole milliseconds.
const ROUNDING: Duration = Duration::from_millis(5);
/// The limits lowered for the run: 2 s, under the 5 s.
const LOWERED: &str = "2s";
/// Kafka's session timeout for the run: the mock cluster holds a first
/// join for 3 s (`group.initial.rebalance.delay.ms`), and a member whose
/// session is shorter is dropped while it waits there.
const KAFKA_SESSION: &str = "3s";

/// The environment of `courier run` that lowers `broker`'s limit: a retry
/// of 5 s is then past SQS's visibility and Pub/Sub's ack deadline, and
/// Kafka hands a killed replica's partitions on sooner. The others hold
/// any delay natively (Redis, NATS, embedded) or chain tiers (RabbitMQ).
/// SQS keeps its 15 min `DelaySeconds`: a copy delayed 2 s would come back
/// within the 3 s long poll the killed courier left at SQS, which takes it
/// for nobody (docs/sources.md, "A crash costs an attempt number").
fn lowered_limits(broker: BrokerKind) -> Vec<(&'static str, &'static str)> {
    match broker {
        BrokerKind::Sqs => vec![(courier::source::sqs::MAX_VISIBILITY_ENV, LOWERED)],
        BrokerKind::PubSub => vec![(courier::source::pubsub::MAX_ACK_DEADLINE_ENV, LOWERED)],
        BrokerKind::Kafka => vec![(courier::source::kafka::SESSION_TIMEOUT_ENV, KAFKA_SESSION)],
        BrokerKind::Redis
        | BrokerKind::RedisCluster
        | BrokerKind::Amqp
        | BrokerKind::Nats
        | BrokerKind::Embedded => Vec::new(),
    }
}

/// The `Retry-After` of the test on `broker`.
fn retry_after(broker: BrokerKind) -> Duration {
    match broker {
        BrokerKind::Kafka => KAFKA_RETRY_AFTER,
        BrokerKind::Redis
        | BrokerKind::RedisCluster
        | BrokerKind::Amqp
        | BrokerKind::Nats
        | BrokerKind::Embedded
        | BrokerKind::Sqs
        | BrokerKind::PubSub => RETRY_AFTER,
    }
}

/// The app answers `503` with `Retry-After: 5` (the policy honours up to
/// 1 h); courier stores the retry and is killed a second later; a new
/// courier delivers the retry no earlier than its due time and within a
/// second after it, as attempt 2, and acks it.
async fn a_retry_after_past_the_brokers_limit_survives_a_kill_and_fires_on_time(fixture: Fixture) {
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 3\ntimeout: 2s\nbackoff: {initial: 100ms, max: 100ms, jitter: none}\nretryAfter: {honor: true, max: 1h}",
    );
    let retry_after = retry_after(fixture.broker);
    let body = format!("script:503ra{},200\nlong delay", retry_after.as_secs());
    let producer = fixture.producer().await;
    let id = producer.send(body.clone(), &[]).await;
    producer.release(&fixture).await;
    let args = run_args(&fixture, &app, &policy, "long-delay");
    let env = lowered_limits(fixture.broker);

    let mut first = CourierProcess::run_with_env(&args, &env);
    let addr = first.metrics_addr().await;
    let stored = tokio::time::timeout(SETTLE, async {
        while metric(&scrape(addr).await, "courier_retries_total", &fixture.queue) < 1.0 {
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    })
    .await;
    assert!(
        stored.is_ok(),
        "the retry was not stored within {SETTLE:?}; log:\n{}",
        first.log()
    );
    let answered = app.received_body(body.as_bytes())[0].clone();
    tokio::time::sleep_until((answered.at + KILLED_AFTER).into()).await;
    first.kill9();
    let killed = Instant::now();
    let due = answered.at + retry_after;

    let mut second = CourierProcess::run_with_env(&args, &env);
    let running = second.wait_running().await;
    assert!(
        running < due,
        "the restarted courier must be running before the retry is due for this test to mean \
         anything (killed {:?} after the answer, running {:?} after it)",
        killed - answered.at,
        running - answered.at
    );
    wait_for("the second attempt", SETTLE, async || {
        app.received_body(body.as_bytes()).len() >= 2
    })
    .await;
    let seen = app.received_body(body.as_bytes());
    // Early only if early by both clocks: courier keeps due times by the
    // wall clock, a broker's own timer (a queue's TTL, a lease) by its
    // monotonic one, and the two drift apart on this machine.
    let after = seen[1].at - seen[0].at;
    let wall = seen[1]
        .wall
        .duration_since(seen[0].wall)
        .unwrap_or_default();
    assert!(
        after.max(wall) + ROUNDING >= retry_after,
        "the retry came {after:?} after the first attempt, early: Retry-After was {retry_after:?}"
    );
    let late = after.saturating_sub(retry_after);
    eprintln!(
        "{}: the retry came {late:?} after its due time (courier killed {:?} after the answer, \
         running again {:?} after it)",
        fixture.broker.name(),
        killed - answered.at,
        running - answered.at
    );
    let bound = match fixture.broker {
        BrokerKind::Sqs => SQS_LATE_BY_AT_MOST,
        _ => LATE_BY_AT_MOST,
    };
    assert!(
        late <= bound,
        "the retry came {late:?} after its due time; log of the restarted courier:\n{}",
        second.log()
    );
    assert_eq!(seen[1].attempt(), 2, "the retry is the second attempt");
    assert_eq!(
        seen[1].header("idempotency-key"),
        seen[0].header("idempotency-key")
    );

    // Acked: nothing comes again, nothing is left, nothing dead-lettered.
    let metrics = second.metrics_addr().await;
    wait_for("the retry to be acked", SETTLE, async || {
        metric(&scrape(metrics).await, "courier_acks_total", &fixture.queue) >= 1.0
    })
    .await;
    second.terminate();
    let status = second.exit_within(SETTLE).await;
    assert!(status.success(), "{status}; log:\n{}", second.log());
    assert_eq!(app.received_body(body.as_bytes()).len(), 2);
    let source = fixture.open().await;
    wait_settled(&source, SETTLE).await;
    assert!(
        fixture.dead_letters(&source).await.is_empty(),
        "message {id} must not be dead-lettered"
    );
    release(&fixture, source).await;
}

crate::per_source!(
    [
        redis => Fixture::redis(),
        amqp => Fixture::amqp(),
        nats => Fixture::nats(),
        kafka => Fixture::kafka(),
        sqs => Fixture::sqs(),
        pubsub => Fixture::pubsub(),
        embedded => Fixture::embedded(),
    ],
    [a_retry_after_past_the_brokers_limit_survives_a_kill_and_fires_on_time]
);
