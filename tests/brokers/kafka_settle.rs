//! What is Kafka's own, against the mock cluster (`kafka-mock`) over TCP:
//! offsets committed in order when deliveries settle out of order, a retry
//! waiting in the retry topic on a paused partition without a delivery
//! slot, and courier's own delivery counter (Kafka has none) surviving
//! restarts so that a poison pill still ends as a dead letter.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::common::*;
use bytes::Bytes;
use courier::model::Delivery;
use courier::source::{self, Source, SourceOptions, shared};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};

const SETTLE: Duration = Duration::from_secs(30);

/// A replica of courier's group on `fixture`'s topic, in this process.
async fn replica(fixture: &Fixture, name: &str, max_deliveries: u32) -> Arc<dyn Source> {
    let mut options = SourceOptions::new(&fixture.queue);
    options.consumer = name.into();
    options.live.max_deliveries = max_deliveries;
    source::open(&fixture.url, options).await.expect("open")
}

/// Reads until `n` deliveries came (a new group's first assignment takes
/// a few seconds on the mock cluster).
async fn receive(source: &Arc<dyn Source>, n: usize) -> Vec<Delivery> {
    let mut got = Vec::new();
    let deadline = Instant::now() + SETTLE;
    while got.len() < n {
        assert!(
            Instant::now() < deadline,
            "only {} of {n} deliveries came",
            got.len()
        );
        got.extend(source.receive(n - got.len()).await.expect("receive"));
    }
    got
}

/// Reads for `wait` and fails if anything comes.
async fn nothing_for(source: &Arc<dyn Source>, wait: Duration) {
    let until = Instant::now() + wait;
    while Instant::now() < until {
        let got = source.receive(10).await.expect("receive");
        assert!(got.is_empty(), "nothing may be delivered yet: {got:?}");
    }
}

/// Produces `bodies` to partition 0 of the fixture's topic with the plain
/// rdkafka producer; returns their offsets.
async fn produce_to_partition_0(fixture: &Fixture, bodies: &[&str]) -> Vec<i64> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap(fixture))
        .create()
        .unwrap();
    let mut offsets = Vec::new();
    for body in bodies {
        let record = FutureRecord::<(), str>::to(&fixture.queue)
            .partition(0)
            .payload(body);
        let delivered = producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
        offsets.push(delivered.offset);
    }
    offsets
}

/// The offset courier's group committed on partition `partition` of the
/// fixture's topic, as a plain client reads it.
async fn committed(fixture: &Fixture, partition: i32) -> Option<i64> {
    let bootstrap = kafka_bootstrap(fixture);
    let (topic, group) = (fixture.queue.clone(), format!("courier.{}", fixture.queue));
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", &group)
            .create()
            .unwrap();
        let mut wanted = TopicPartitionList::new();
        wanted.add_partition(&topic, partition);
        let got = consumer
            .committed_offsets(wanted, Duration::from_secs(10))
            .unwrap();
        match got.find_partition(&topic, partition).unwrap().offset() {
            Offset::Offset(o) => Some(o),
            _ => None,
        }
    })
    .await
    .unwrap()
}

fn body(delivery: &Delivery) -> &str {
    std::str::from_utf8(&delivery.message.body).unwrap()
}

/// Three deliveries of one partition settled last first: the commit stays
/// at the first until it is settled too, and a replica that dies with the
/// first unsettled hands out only that one again (attempt 2), not the two
/// settled after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offsets_are_committed_in_order_when_deliveries_settle_out_of_order() {
    let fixture = Fixture::kafka();
    let inspector = fixture.open().await;
    let offsets = produce_to_partition_0(&fixture, &["a", "b", "c"]).await;
    let first = replica(&fixture, "replica-a", 7).await;
    let mut got = receive(&first, 3).await;
    got.sort_by(|x, y| body(x).cmp(body(y)));
    first.ack(&got[2]).await.unwrap();
    first.ack(&got[1]).await.unwrap();
    // A settlement's commit is handed over within a few ms, not awaited:
    // past that, what is committed shows whether it went too far.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        committed(&fixture, 0).await,
        Some(offsets[0]),
        "the commit waits for the first"
    );
    let depth = inspector.depth().await.unwrap();
    assert_eq!(
        (depth.ready, depth.pending),
        (Some(0), 1),
        "one handed out, two settled: {depth:?}"
    );
    drop(first);

    let second = replica(&fixture, "replica-b", 7).await;
    let again = receive(&second, 1).await;
    assert_eq!(body(&again[0]), "a");
    assert_eq!(again[0].attempt, 2, "the first hand-out counts");
    assert_eq!(again[0].message.id, got[0].message.id);
    nothing_for(&second, Duration::from_secs(2)).await;
    second.ack(&again[0]).await.unwrap();
    wait_for(
        "the commit past all three",
        Duration::from_secs(2),
        async || committed(&fixture, 0).await == Some(offsets[2] + 1),
    )
    .await;
    let depth = inspector.depth().await.unwrap();
    assert_eq!(
        (depth.ready, depth.pending, depth.retry_backlog),
        (Some(0), 0, 0)
    );
}

/// A retry due in 6 s waits in the retry topic: it is counted as the retry
/// backlog, not in flight; a message sent meanwhile is delivered before it
/// (the retry holds no slot and only its retry partition is paused); the
/// retry comes back when due, not before, as attempt 2 with its id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_waits_on_a_paused_partition_and_comes_back_when_due() {
    // Twice a fetch's wait: the mock cluster answers an empty fetch only
    // when its wait (`HELD_WAIT`) is over, so a record produced to an idle
    // partition comes up to that late (a broker answers at once).
    const DELAY: Duration = Duration::from_secs(2 * shared::HELD_WAIT.as_secs());
    let fixture = Fixture::kafka();
    let inspector = fixture.open().await;
    let id = fixture.send(&inspector, "retried").await;
    let reader = replica(&fixture, "replica-a", 7).await;
    let got = receive(&reader, 1).await;
    let first_at = SystemTime::now();
    let due = first_at + DELAY;
    reader.retry(&got[0], 2, first_at, due).await.unwrap();
    let scheduled = Instant::now();
    // A settlement's commit is handed over within a few ms, not awaited.
    wait_for(
        "the retry counted as backlog, nothing pending",
        Duration::from_secs(2),
        async || {
            let depth = inspector.depth().await.unwrap();
            (depth.ready, depth.pending, depth.retry_backlog) == (Some(0), 0, 1)
        },
    )
    .await;

    fixture.send(&inspector, "meanwhile").await;
    let meanwhile = receive(&reader, 1).await;
    assert_eq!(body(&meanwhile[0]), "meanwhile");
    assert!(
        scheduled.elapsed() < DELAY,
        "the new message came while the retry waited"
    );
    reader.ack(&meanwhile[0]).await.unwrap();

    let back = receive(&reader, 1).await;
    assert!(
        SystemTime::now() >= due,
        "the retry came {:?} early",
        due.duration_since(SystemTime::now()).unwrap_or_default()
    );
    assert_eq!(body(&back[0]), "retried");
    assert_eq!(back[0].attempt, 2);
    assert_eq!(back[0].message.id, id);
    reader.ack(&back[0]).await.unwrap();
    let depth = wait_settled(&inspector, SETTLE).await;
    assert_eq!(depth.dead_letters, 0);
}

/// Kafka has no delivery counter; courier's, in the commit's metadata,
/// survives replicas that die with the message unsettled (as a message
/// that crashes courier itself would leave it): the hand-out after
/// `max_deliveries` is marked undeliverable, never offered to the app.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_delivery_counter_survives_restarts_and_stops_a_poison_pill() {
    const MAX_DELIVERIES: u32 = 3;
    let fixture = Fixture::kafka();
    let inspector = fixture.open().await;
    fixture
        .send(&inspector, Bytes::from_static(b"poison"))
        .await;
    for hand_out in 1..=MAX_DELIVERIES {
        let replica = replica(&fixture, &format!("replica-{hand_out}"), MAX_DELIVERIES).await;
        let got = receive(&replica, 1).await;
        assert_eq!(got[0].attempt, hand_out);
        assert_eq!(got[0].problem, None, "hand-out {hand_out}");
        // Dies without settling.
        drop(replica);
    }
    let last = replica(&fixture, "replica-last", MAX_DELIVERIES).await;
    let got = receive(&last, 1).await;
    let problem = got[0].problem.clone().expect("marked undeliverable");
    assert!(
        problem.contains(&format!("handed out {} times", MAX_DELIVERIES + 1)),
        "{problem}"
    );
}

/// Produces `(key, body)` records to partition 0 with the plain rdkafka
/// producer: one partition, so what holds a record back is its key alone.
async fn produce_keyed(fixture: &Fixture, records: &[(&str, &str)]) {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap(fixture))
        .create()
        .unwrap();
    for (key, body) in records {
        let record = FutureRecord::to(&fixture.queue)
            .partition(0)
            .key(*key)
            .payload(*body);
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }
}

/// `--ordering key` with a retry in the middle: the first message of key
/// `k` is answered 503 once; the two after it wait for its retry to be
/// acked, then go one at a time in the order produced, while a message of
/// another key in the same partition is delivered at once. (In another
/// partition it could wait a held fetch of 3 s on a loaded machine: the
/// mock answers an empty fetch only at its end, and a partition that becomes
/// readable meanwhile waits for it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_by_key_holds_the_later_messages_behind_a_retry() {
    let fixture = Fixture::kafka();
    let app = TestApp::start().await;
    let inspector = fixture.open().await;
    let (first, second, third) = (
        "script:503,200\nk 1",
        "script:sleep300\nk 2",
        "script:sleep300\nk 3",
    );
    let other = "script:sleep50\nother";
    produce_keyed(
        &fixture,
        &[("k", first), ("k", second), ("k", third), ("o", other)],
    )
    .await;
    // The retry waits 2 s: the other key's message, read with or just
    // after the first batch, is delivered well inside that on a loaded
    // machine (at 50 ms it was not, once, at --test-threads=4).
    let policy = fast_policy().backoff_of(
        Duration::from_secs(2),
        Duration::from_secs(2),
        2.0,
        courier::policy::Jitter::None,
    );
    let mut config = run_config(&fixture, &app, policy);
    config.options.ordering = courier::source::Ordering::Key;
    config.options.concurrency = 4;
    let running = Running::start(config).await;
    wait_settled(&inspector, SETTLE).await;
    running.stop().await;

    let of_k: Vec<String> = app
        .received()
        .iter()
        .filter(|r| r.body.starts_with(b"script:") && !r.body.ends_with(b"other"))
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .collect();
    assert_eq!(
        of_k,
        [first, first, second, third],
        "key k in order, the retry before the later ones"
    );
    let retry = &app.received_body(first.as_bytes())[1];
    let (two, three) = (
        &app.received_body(second.as_bytes())[0],
        &app.received_body(third.as_bytes())[0],
    );
    assert!(two.at >= retry.at, "the second waited for the retry");
    assert!(
        three.at >= two.at + Duration::from_millis(300),
        "the third waited for the second's answer: {:?} after it",
        three.at - two.at
    );
    let other_seen = &app.received_body(other.as_bytes())[0];
    assert!(
        other_seen.at < retry.at,
        "another key is not held behind the retry"
    );
}

/// `--ordering key` on a source that cannot keep it is refused at start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_by_key_is_refused_where_the_source_cannot_keep_it() {
    let fixture = Fixture::embedded();
    let app = TestApp::start().await;
    let mut config = run_config(&fixture, &app, fast_policy());
    config.options.ordering = courier::source::Ordering::Key;
    let sidecar = courier::sidecar::Sidecar::new(config);
    let stop = tokio_util::sync::CancellationToken::new();
    let (_, handle) = sidecar.start(stop.clone()).await.expect("start");
    let err = handle.await.unwrap().expect_err("refused");
    assert!(err.to_string().contains("--ordering key"), "{err}");
}

/// Bodies of slow messages, each answered 200 after 300 ms.
fn slow_bodies(n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("script:sleep300\nmessage {i}"))
        .collect()
}

/// A second replica joins while the first drains the topic: nothing is
/// lost, and what the first had settled before the second joined is not
/// delivered again. (The mock cluster refuses every offset commit while the
/// group is rebalancing, which Kafka accepts from a member of the current
/// generation; so here work settled during the rebalance may be delivered
/// once more by its new owner, at least once, never lost.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_joining_mid_drain_loses_nothing() {
    let fixture = Fixture::kafka();
    let app = TestApp::start().await;
    let inspector = fixture.open().await;
    let bodies = slow_bodies(60);
    let producer = fixture.producer().await;
    for body in &bodies {
        producer.send(body.clone(), &[]).await;
    }
    let mut config = run_config(&fixture, &app, fast_policy());
    config.options.concurrency = 2;
    let first = Running::start(config.clone()).await;
    wait_for("the first replica to be draining", SETTLE, async || {
        app.received().len() >= 6
    })
    .await;
    let joined = Instant::now();
    let mut second_config = config;
    second_config.options.consumer = unique("second");
    let second = Running::start(second_config).await;
    wait_settled(&inspector, Duration::from_secs(90)).await;
    first.stop().await;
    second.stop().await;
    // Answered (300 ms) and committed well before the second joined.
    let settled_before: Vec<String> = app
        .received()
        .iter()
        .filter(|r| r.at + Duration::from_millis(600) < joined)
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .collect();
    assert!(!settled_before.is_empty());
    for body in &bodies {
        let seen = app.received_body(body.as_bytes()).len();
        assert!(seen >= 1, "{body}: lost");
        if settled_before.contains(body) {
            assert_eq!(
                seen, 1,
                "{body}: settled before the rebalance, delivered again"
            );
        }
    }
    let depth = inspector.depth().await.unwrap();
    assert_eq!(depth.dead_letters, 0);
}

/// A broker of a three-broker cluster fails mid-drain: it leads every
/// partition of courier's topics (work, retry, and the dead-letter and
/// removed topics courier makes at start) and coordinates its group, and
/// the mock moves leadership and the group to another broker (as Kafka
/// elects a new leader). The drain goes on; nothing is lost or
/// dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_failing_mid_drain_loses_nothing() {
    let mock = KafkaMock::start(3);
    let fixture = Fixture::broker(&mock.url());
    let group = format!("courier.{}", fixture.queue);
    let topics = [
        fixture.queue.clone(),
        format!("{}.retry", fixture.queue),
        fixture.dlq(),
        format!("{}.removed", fixture.dlq()),
    ];
    let inspector = fixture.open().await;
    for topic in &topics {
        for partition in 0..4 {
            mock.command(&format!("leader {topic} {partition} 1"));
        }
    }
    mock.command(&format!("coordinator {group} 1"));
    let app = TestApp::start().await;
    let bodies: Vec<String> = (0..40)
        .map(|i| format!("script:sleep100\nmessage {i}"))
        .collect();
    let producer = fixture.producer().await;
    for body in &bodies {
        producer.send(body.clone(), &[]).await;
    }
    let mut config = run_config(&fixture, &app, fast_policy());
    config.options.concurrency = 4;
    let running = Running::start(config).await;
    wait_for("the drain to be under way", SETTLE, async || {
        app.received().len() >= 8
    })
    .await;
    mock.command("down 1");
    for topic in &topics {
        for partition in 0..4 {
            mock.command(&format!("leader {topic} {partition} 2"));
        }
    }
    mock.command(&format!("coordinator {group} 2"));
    wait_settled(&inspector, Duration::from_secs(90)).await;
    running.stop().await;
    for body in &bodies {
        assert!(
            !app.received_body(body.as_bytes()).is_empty(),
            "{body}: lost"
        );
    }
    assert_eq!(inspector.depth().await.unwrap().dead_letters, 0);
    mock.command("up 1");
}

/// The poison-pill rule with real crashes: a message during whose delivery
/// courier is killed (`kill -9`) every time is handed out again after each
/// restart, counted each time, and once over `maxAttempts + 2` hand-outs it
/// is dead-lettered as undeliverable without reaching the app again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_courier_every_time_ends_as_a_dead_letter() {
    let fixture = Fixture::kafka();
    let app = TestApp::start().await;
    let inspector = fixture.open().await;
    let body = "script:sleep20000\nkills courier";
    let id = fixture.send(&inspector, body).await;
    let dir = tempfile::tempdir().unwrap();
    // maxAttempts 1: the limit is 3 hand-outs.
    let policy = write_policy(dir.path(), "maxAttempts: 1\ntimeout: 25s");
    for run in 1..=3 {
        let mut courier = CourierProcess::run(&run_args(&fixture, &app, &policy, "replica"));
        wait_for("the delivery", Duration::from_secs(60), async || {
            app.received_body(body.as_bytes()).len() >= run
        })
        .await;
        courier.kill9();
    }
    let mut courier = CourierProcess::run(&run_args(&fixture, &app, &policy, "replica"));
    wait_for("the dead letter", Duration::from_secs(60), async || {
        inspector.depth().await.unwrap().dead_letters == 1
    })
    .await;
    courier.terminate();
    courier.exit_within(Duration::from_secs(20)).await;
    assert_eq!(
        app.received_body(body.as_bytes()).len(),
        3,
        "not offered to the app a fourth time"
    );
    let letters = inspector.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].field("courier-reason"), Some("undeliverable"));
    assert_eq!(letters[0].field("courier-message-id"), Some(id.as_str()));
    assert!(
        letters[0]
            .field("courier-error")
            .is_some_and(|e| e.contains("handed out 4 times")),
        "{letters:?}"
    );
}

/// Found at 21da363: with `--ordering key`, the later records of a key
/// whose message is out (or retrying) were parked in memory with no bound:
/// one key answering 503 for an hour at 100 msg/s is 360,000 records in
/// RAM. At `max_unsettled` (20 here) offsets read and not settled, the
/// source stops reading the work topic: a record of another key behind
/// them is not read, so not delivered, while the key's first is out. As
/// the key's records settle in order, reading goes on under half the bound
/// and everything arrives once, the key's records in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_by_key_stops_reading_at_the_bound_instead_of_growing() {
    let fixture = Fixture::kafka();
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", kafka_bootstrap(&fixture))
        .create()
        .unwrap();
    let mut records: Vec<(&str, String)> = (0..40).map(|i| ("k", format!("k {i}"))).collect();
    records.push(("o", "other".into()));
    for (key, body) in &records {
        let record = FutureRecord::to(&fixture.queue)
            .partition(0)
            .key(*key)
            .payload(body.as_str());
        producer
            .send(record, Duration::from_secs(10))
            .await
            .map_err(|(e, _)| e)
            .unwrap();
    }
    let mut options = SourceOptions::new(&fixture.queue);
    options.consumer = "bounded".into();
    options.ordering = source::Ordering::Key;
    options.max_unsettled = 20;
    let source = source::open(&fixture.url, options).await.expect("open");
    let first = receive(&source, 1).await.remove(0);
    assert_eq!(body(&first), "k 0");
    nothing_for(&source, Duration::from_secs(3)).await;

    let mut seen = vec![body(&first).to_string()];
    source.ack(&first).await.unwrap();
    while seen.len() < records.len() {
        for delivery in receive(&source, 1).await {
            seen.push(body(&delivery).to_string());
            source.ack(&delivery).await.unwrap();
        }
    }
    let of_k: Vec<&String> = seen.iter().filter(|b| b.starts_with("k ")).collect();
    let want: Vec<String> = (0..40).map(|i| format!("k {i}")).collect();
    assert_eq!(of_k, want.iter().collect::<Vec<_>>(), "key k in order");
    let other_at = seen.iter().position(|b| b == "other").expect("other, once");
    assert!(
        other_at >= 10,
        "other waited for the key to settle under the bound: {seen:?}"
    );
    nothing_for(&source, Duration::from_secs(1)).await;
}

/// Found at 21da363 (issue 26): with the default `--threads 1` the
/// rebalance callback runs on courier's only runtime thread, where nothing
/// can settle while it waits, so it did not wait: it forgot the
/// deliveries in flight on the partitions taken away at once, and their
/// new owner delivered them again while the app still worked on them
/// (8-9 s after the second replica started, on the mock cluster). Now the
/// partitions are given up only once their deliveries settled: while the
/// app holds the message (12 s, longer than the mock's rebalance takes)
/// nobody delivers it again.
///
/// After the hold the mock may hand it out once more: it refuses offset
/// commits while a group is joining (`REBALANCE_IN_PROGRESS`, or the member
/// is gone by then, `rdkafka_mock_cgrp.c`), where a Kafka broker takes a
/// commit of the current generation while a rebalance is prepared. So only
/// the hold is asserted, and that nothing is dead-lettered or lost.
#[tokio::test(flavor = "current_thread")]
async fn a_revoke_on_one_thread_waits_for_the_delivery_in_flight() {
    const HELD: &str = "script:hold\nheld across a rebalance";
    let fixture = Fixture::kafka();
    let app = TestApp::start().await;
    let inspector = fixture.open().await;
    fixture.producer().await.send(HELD, &[]).await;
    let mut policy = fast_policy();
    policy.timeout = Duration::from_secs(60);
    let mut config = run_config(&fixture, &app, policy);
    config.options.concurrency = 4;
    let first = Running::start(config.clone()).await;
    wait_for("the app to hold the message", SETTLE, async || {
        app.held() == 1
    })
    .await;
    let mut second_config = config;
    second_config.options.consumer = unique("second");
    let second = Running::start(second_config).await;
    let delivered_again = tokio::time::timeout(Duration::from_secs(12), async {
        while app.received_body(HELD.as_bytes()).len() < 2 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .is_ok();
    app.release_held();
    wait_settled(&inspector, Duration::from_secs(60)).await;
    first.stop().await;
    second.stop().await;
    assert!(
        !delivered_again,
        "delivered again while the app held it: {:?}",
        app.received_body(HELD.as_bytes())
    );
    assert_eq!(inspector.depth().await.unwrap().dead_letters, 0);
}

/// Finding 6 (docs/reliability.md): after a courier SIGKILL, a stop of the
/// mock cluster at the end of the new replica's join left that replica
/// without partitions for an hour. The mock parks a JoinGroup until the
/// join ends, 9 s after it began (its session timeout less 1 s), while a
/// timer expires members whose session ran out; after a stop both timers
/// are due, the session timer runs first, and the waiting member, joined
/// 10 s before, is expired with its request: no answer comes, and the
/// connection stays blocked (`rdkafka_mock_cgrp.c`). librdkafka waits for
/// that answer for `max.poll.interval.ms` (an hour here). The stop is timed
/// from the replica's "Joining group" line: from 6.5 s (the session timer,
/// every second, is then due before the join's end at 9 s, with 1.5 s for
/// the line to reach the test) to 11 s (past the member's session).
/// courier must say so (not ready: `courier_broker_up 0`, and a warning)
/// and join again with a new consumer, so that every message produced is
/// delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finding_6_a_join_lost_during_a_stop_of_the_mock_is_made_again() {
    let mock = KafkaMock::start(3);
    let fixture = Fixture::broker(&mock.url());
    let app = TestApp::start().await;
    let inspector = fixture.open().await;
    let producer = fixture.producer().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(dir.path(), "maxAttempts: 3\ntimeout: 1s");
    let mut args = run_args(&fixture, &app, &policy, "replica");
    args.extend(["--visibility-timeout".into(), "2s".into()]);
    let first: Vec<String> = (0..10).map(|i| format!("before the kill {i}")).collect();
    for body in &first {
        producer.send(body.clone(), &[]).await;
    }
    let mut holder = CourierProcess::run(&args);
    wait_for("the first replica's deliveries", SETTLE, async || {
        first
            .iter()
            .all(|b| !app.received_body(b.as_bytes()).is_empty())
    })
    .await;
    holder.kill9();
    let after: Vec<String> = (0..30).map(|i| format!("after the kill {i}")).collect();
    for body in &after {
        producer.send(body.clone(), &[]).await;
    }
    let mut replica = CourierProcess::run_with_env(
        &args,
        &[
            ("COURIER_KAFKA_DEBUG", "cgrp"),
            ("RUST_LOG", "info,courier_kafka=debug"),
        ],
    );
    let metrics = replica.metrics_addr().await;
    wait_for("the new replica to join", SETTLE, async || {
        replica.log().contains("Joining group")
    })
    .await;
    let joined = Instant::now();
    // The fault is the timing: the stop must cover the end of this join.
    tokio::time::sleep_until((joined + Duration::from_millis(6_500)).into()).await;
    signal(mock.pid(), "-STOP");
    tokio::time::sleep_until((joined + Duration::from_secs(11)).into()).await;
    signal(mock.pid(), "-CONT");
    // Not ready (`courier_broker_up 0`) while it holds nothing, then ready
    // again once the new consumer has partitions.
    let mut said_so = false;
    let deadline = Instant::now() + Duration::from_secs(90);
    let delivered = loop {
        said_so |= scrape(metrics).await.contains("courier_broker_up 0");
        let delivered = after
            .iter()
            .filter(|b| !app.received_body(b.as_bytes()).is_empty())
            .count();
        if delivered == after.len() || Instant::now() > deadline {
            break delivered;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        delivered,
        after.len(),
        "messages produced after the kill that were delivered within 90 s; log:\n{}",
        replica.log()
    );
    assert!(said_so, "never not ready; log:\n{}", replica.log());
    assert!(
        replica
            .log()
            .contains("this replica has held no Kafka partition"),
        "{}",
        replica.log()
    );
    wait_for("ready again", Duration::from_secs(10), async || {
        scrape(metrics).await.contains("courier_broker_up 1")
    })
    .await;
    replica.terminate();
    replica.exit_within(Duration::from_secs(20)).await;
    assert_eq!(inspector.depth().await.unwrap().dead_letters, 0);
}

/// Sends `signal` (`-STOP`, `-CONT`) to a process.
fn signal(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {signal} {pid} failed");
}
