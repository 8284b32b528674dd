//! What holds for the Pub/Sub source alone, against Google's emulator (one
//! per test binary): a retry past Pub/Sub's 600 s lease held once and then
//! published afresh, a retry copy Pub/Sub refuses leaving the original, the
//! warning about a dead-letter policy below `maxAttempts`, a subscription
//! without a dead-letter policy (a warning, attempts from courier's
//! record), `courier send` and `courier dlq`, the depth gauges (and the
//! memory a count of a large backlog takes), the poison-pill rule on
//! `delivery_attempt`, how an envelope a producer forged is read, and the
//! pull that waits a moment for settlements beside a backlog.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::common::*;
use bytes::Bytes;
use courier::model::parse_time;
use courier::source::Source;
use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
    DeleteTopicRequest, GetSubscriptionRequest, ModifyAckDeadlineRequest, PublishRequest,
    PubsubMessage, PullRequest, Subscription,
};

const SETTLE: Duration = Duration::from_secs(60);

async fn receive_one(source: &Arc<dyn Source>) -> courier::source::Delivery {
    let mut got = Vec::new();
    for _ in 0..30 {
        got = source.receive(1).await.unwrap();
        if !got.is_empty() {
            break;
        }
    }
    assert_eq!(got.len(), 1);
    got.remove(0)
}

/// A subscription of the test's own on courier's retry topic, made before
/// any copy is published: it sees every copy courier writes.
async fn watch_retry_topic(fixture: &Fixture) -> String {
    let (_, mut subscriber) = pubsub_clients().await;
    let name = pubsub_subscription(&format!("{}.watch", fixture.queue));
    subscriber
        .create_subscription(Subscription {
            name: name.clone(),
            topic: pubsub_topic(&format!("{}.retry", fixture.queue)),
            ack_deadline_seconds: 10,
            ..Subscription::default()
        })
        .await
        .expect("a subscription on the retry topic");
    name
}

/// How many deliveries the emulator has made so far, by all its
/// subscriptions: the n of the ack id (`<subscription>:<n>`) of a message
/// published to a topic of its own and pulled now.
async fn pubsub_deliveries_so_far(fixture: &Fixture) -> u32 {
    let name = format!("{}.counter", fixture.queue);
    create_pubsub_subscription(&name, None).await;
    let (mut publisher, mut subscriber) = pubsub_clients().await;
    publisher
        .publish(PublishRequest {
            topic: pubsub_topic(&name),
            messages: vec![PubsubMessage {
                data: Bytes::from("count"),
                ..PubsubMessage::default()
            }],
        })
        .await
        .expect("Pub/Sub takes the message");
    loop {
        #[allow(deprecated)]
        let pulled = subscriber
            .pull(PullRequest {
                subscription: pubsub_subscription(&name),
                return_immediately: true,
                max_messages: 1,
            })
            .await
            .expect("pull the message")
            .into_inner()
            .received_messages;
        if let Some(received) = pulled.first() {
            return received
                .ack_id
                .rsplit(':')
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("an ack id <subscription>:<n>: {}", received.ack_id));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until the sidecar has pulled the retry subscription since now:
/// it reads one read at a time, each poll pulling the retry subscription
/// before the work subscription. A message published now reaches the app
/// once a read after now returned it; one published after that reaches
/// the app through a later read, every poll of which began with a pull
/// of the retry subscription. (The app sees both, as `<what> 1` and `2`.)
async fn read_again(producer: &Producer, app: &TestApp, what: &str) {
    for n in 1..=2 {
        let probe = format!("{what} {n}");
        producer.send(probe.clone(), &[]).await;
        wait_for(&format!("{probe:?} delivered"), SETTLE, async || {
            !app.received_body(probe.as_bytes()).is_empty()
        })
        .await;
    }
}

fn attribute<'a>(message: &'a PubsubMessage, name: &str) -> &'a str {
    message
        .attributes
        .get(name)
        .map(String::as_str)
        .unwrap_or_else(|| panic!("no attribute {name} in {:?}", message.attributes))
}

/// A retry of 20 min, past Pub/Sub's longest lease: a sealed copy on
/// `<queue>.retry` with the attempt and the due time, the original acked,
/// the copy held (no plain pull gets it, the depth counts it as retry
/// backlog). Delivered again before it is due (its hold ended early), it
/// has had its one hold: courier publishes it afresh with the same due time
/// and attempt and acks the old one, and the app sees nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_past_600_s_is_held_once_then_published_afresh() {
    let fixture = Fixture::pubsub();
    let inspector = fixture.open().await;
    let watch = watch_retry_topic(&fixture).await;
    let app = TestApp::start().await;
    let producer = fixture.producer().await;
    let id = producer.send("script:503,200\nlong", &[]).await;
    let mut policy = fast_policy();
    policy = policy.backoff_of(
        Duration::from_secs(1200),
        Duration::from_secs(1200),
        2.0,
        courier::policy::Jitter::None,
    );
    let running = Running::start(run_config(&fixture, &app, policy)).await;
    wait_for("the retry copy", SETTLE, async || {
        !pubsub_messages(&watch).await.is_empty()
    })
    .await;
    let copies = pubsub_messages(&watch).await;
    assert_eq!(copies.len(), 1);
    let copy = &copies[0];
    assert_eq!(attribute(copy, "courier-attempt"), "2");
    assert_eq!(attribute(copy, "courier-message-id"), id);
    assert!(!attribute(copy, "courier-seal").is_empty());
    let due = parse_time(attribute(copy, "courier-retry-at").as_bytes()).unwrap();
    let wait = due.duration_since(SystemTime::now()).unwrap();
    assert!(
        wait > Duration::from_secs(1100) && wait <= Duration::from_secs(1200),
        "due in {wait:?}"
    );
    assert_eq!(copy.data, Bytes::from("script:503,200\nlong"));
    wait_for("the original acked and the copy held", SETTLE, async || {
        let depth = inspector.depth().await.unwrap();
        depth.ready == Some(0) && depth.retry_backlog == 1
    })
    .await;
    // Held by the sidecar: a plain pull of the retry subscription gets
    // nothing. The depth counts the copy from its publish on, before the
    // sidecar's next pull has taken it, and no figure shows that pull: a
    // plain pull inside that window would take the copy itself (and its
    // one delivery with it), so the check waits for a read that began
    // after the copy existed (`read_again`).
    read_again(&producer, &app, "after the copy").await;
    let retry = pubsub_subscription(&format!("{}.retry", fixture.queue));
    assert!(pubsub_messages(&retry).await.is_empty(), "the copy is held");

    // The hold ended early, as its 600 s lease would end: a nack of
    // courier's delivery of the copy by the plain client. The emulator's
    // ack ids are `<subscription>:<n>`, n counting every delivery of the
    // emulator, and an id it does not know is ignored: every n so far is
    // nacked, which touches nothing but this subscription's one copy. Not
    // one past them: the sidecar holds the fresh copy while the nacks are
    // still being sent, and a nack of that hold made a third copy (a
    // fresh-clone CI run). (A seek would not do: the emulator counts
    // `delivery_attempt` from 1 again after one.)
    let so_far = pubsub_deliveries_so_far(&fixture).await;
    let (_, mut subscriber) = pubsub_clients().await;
    for chunk in (1..=so_far).collect::<Vec<_>>().chunks(4000) {
        subscriber
            .modify_ack_deadline(ModifyAckDeadlineRequest {
                subscription: retry.clone(),
                ack_ids: chunk.iter().map(|n| format!("{retry}:{n}")).collect(),
                ack_deadline_seconds: 0,
            })
            .await
            .expect("end the hold");
    }
    wait_for("the copy published afresh", SETTLE, async || {
        pubsub_messages(&watch).await.len() >= 2
    })
    .await;
    let copies = pubsub_messages(&watch).await;
    assert_eq!(copies.len(), 2, "one fresh copy");
    let fresh = copies
        .iter()
        .find(|c| c.message_id != copy.message_id)
        .unwrap();
    assert_eq!(
        attribute(fresh, "courier-attempt"),
        "2",
        "the hold used no attempt"
    );
    assert_eq!(
        attribute(fresh, "courier-retry-at"),
        attribute(copy, "courier-retry-at")
    );
    assert_eq!(attribute(fresh, "courier-message-id"), id);
    wait_for(
        "the old copy acked, the fresh one held",
        SETTLE,
        async || {
            let depth = inspector.depth().await.unwrap();
            depth.ready == Some(0) && depth.retry_backlog == 1
        },
    )
    .await;
    read_again(&producer, &app, "after the fresh copy").await;
    assert!(
        pubsub_messages(&retry).await.is_empty(),
        "the fresh copy is held"
    );
    assert_eq!(
        app.received_body(b"script:503,200\nlong").len(),
        1,
        "nothing delivered early"
    );
    running.stop().await;
}

/// A retry copy Pub/Sub refuses (its topic deleted) leaves the original
/// in the work subscription: delivered again, as the same message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_pubsub_refuses_leaves_the_original() {
    let fixture = Fixture::pubsub();
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let id = producer.send("refused copy", &[]).await;
    let delivery = receive_one(&source).await;
    let (mut publisher, _) = pubsub_clients().await;
    publisher
        .delete_topic(DeleteTopicRequest {
            topic: pubsub_topic(&format!("{}.retry", fixture.queue)),
        })
        .await
        .unwrap();
    let now = SystemTime::now();
    let err = source
        .retry(&delivery, 2, now, now + Duration::from_secs(5))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("publishing to"), "{err}");
    // Delivered again after the short lease of a failed settlement.
    let mut again = Vec::new();
    wait_for("the original again", SETTLE, async || {
        again = source.receive(1).await.unwrap();
        !again.is_empty()
    })
    .await;
    assert_eq!(again[0].message.id, id);
    assert_eq!(again[0].message.body, Bytes::from("refused copy"));
    assert_eq!(again[0].attempt, 2, "Pub/Sub counted the delivery");
    source.ack(&again[0]).await.unwrap();
}

/// Runs the binary with a policy of `max` attempts on `fixture`; the
/// process and the policy file's directory.
fn run_with_max_attempts(
    fixture: &Fixture,
    app: &TestApp,
    max: u32,
) -> (CourierProcess, tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = write_policy(dir.path(), &format!("maxAttempts: {max}"));
    let args = run_args(fixture, app, &path, "cap");
    (CourierProcess::run(&args), dir, path)
}

/// A dead-letter policy whose `maxDeliveryAttempts` is below the policy's
/// `maxAttempts` is warned about at start and again when a policy change
/// makes it so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_cap_below_max_attempts_is_warned_about() {
    let fixture = Fixture::pubsub();
    let queue = format!("{}-capped", fixture.queue);
    create_pubsub_subscription(&queue, Some(5)).await;
    let mut fixture = fixture;
    fixture.queue = queue;
    let app = TestApp::start().await;
    let (mut courier, dir, path) = run_with_max_attempts(&fixture, &app, 7);
    let warnings = |courier: &CourierProcess, max: u32| {
        courier
            .log()
            .lines()
            .filter(|l| {
                l.contains("maxDeliveryAttempts") && l.contains(&format!("maxAttempts {max}"))
            })
            .count()
    };
    courier.wait_running().await;
    wait_for("the warning at start", SETTLE, async || {
        warnings(&courier, 7) == 1
    })
    .await;
    assert!(courier.log().contains("after 5 delivery attempts"));
    let addr = courier.metrics_addr().await;
    let generation = async |n: u32| {
        scrape(addr)
            .await
            .lines()
            .any(|l| l.starts_with("courier_policy_generation{") && l.ends_with(&format!(" {n}")))
    };
    write_policy(dir.path(), "maxAttempts: 4");
    // Applied (and not warned about) before the next edit, so the count of
    // 0 below means something.
    wait_for("the edit to 4 attempts to apply", SETTLE, async || {
        generation(2).await
    })
    .await;
    write_policy(dir.path(), "maxAttempts: 9");
    wait_for("the warning on the policy change", SETTLE, async || {
        warnings(&courier, 9) == 1
    })
    .await;
    assert_eq!(warnings(&courier, 4), 0, "4 attempts fit in 5 deliveries");
    drop(path);
}

/// A subscription without a dead-letter policy: Pub/Sub counts nothing,
/// courier warns at start, and attempts come from courier's own record
/// (a retry is a copy that carries its attempt).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscription_without_a_dead_letter_policy_counts_from_the_record() {
    let fixture = Fixture::pubsub();
    let queue = format!("{}-plain", fixture.queue);
    create_pubsub_subscription(&queue, None).await;
    let mut fixture = fixture;
    fixture.queue = queue;
    let app = TestApp::start().await;
    let producer = fixture.producer().await;
    let body = "script:503,503,200\nplain";
    producer.send(body, &[]).await;
    let dir = tempfile::tempdir().unwrap();
    let path = write_policy(
        dir.path(),
        "maxAttempts: 5\ntimeout: 1s\nbackoff: {initial: 100ms, max: 200ms, jitter: none}",
    );
    let mut courier = CourierProcess::run(&run_args(&fixture, &app, &path, "plain"));
    courier.wait_running().await;
    assert!(
        courier.log().contains("has no dead-letter policy"),
        "{}",
        courier.log()
    );
    wait_for("three attempts", SETTLE, async || {
        app.received_body(body.as_bytes()).len() >= 3
    })
    .await;
    let attempts: Vec<u32> = app
        .received_body(body.as_bytes())
        .iter()
        .map(Received::attempt)
        .collect();
    assert_eq!(attempts, vec![1, 2, 3]);
}

/// `--create` makes the work subscription with the visibility timeout's
/// lease as its ack deadline (10 s at least): a pull then leases for as
/// long as courier needs, and a courier killed before it could change a
/// lease leaves its messages for the visibility timeout, not a minute.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_gives_the_work_subscription_the_lease_as_ack_deadline() {
    let fixture = Fixture::pubsub();
    let (_, mut subscriber) = pubsub_clients().await;
    for (visibility, deadline) in [(Duration::from_secs(6), 10), (Duration::from_secs(25), 25)] {
        let queue = format!("{}-lease-{}", fixture.queue, visibility.as_secs());
        let mut options = courier::source::SourceOptions::new(&queue);
        options.create = true;
        options.live.visibility_timeout = visibility;
        let source = courier::source::open(&fixture.url, options).await.unwrap();
        let made = subscriber
            .get_subscription(GetSubscriptionRequest {
                subscription: pubsub_subscription(&queue),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            made.ack_deadline_seconds, deadline,
            "visibility {visibility:?}"
        );
        source.close().await;
    }
}

/// `courier send` publishes to the subscription's topic with its headers;
/// `courier dlq list`, `show`, `replay` and `purge` work on the letters
/// courier wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_and_dlq_commands() {
    let fixture = Fixture::pubsub();
    let source = fixture.open().await;
    let sent = courier_send(
        &fixture,
        &[
            "--header",
            "content-type=text/plain",
            "script:422,200\nsent",
        ],
    );
    assert!(sent.status.success(), "{sent:?}");
    let purged = courier_send(&fixture, &["script:422\npurged"]);
    assert!(purged.status.success(), "{purged:?}");
    let app = TestApp::start().await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_for("two dead letters", SETTLE, async || {
        fixture.dead_letters(&source).await.len() == 2
    })
    .await;
    assert_eq!(
        app.received_body(b"script:422,200\nsent")[0].header("content-type"),
        Some("text/plain"),
        "the header came through"
    );
    let dlq = |args: &[&str]| {
        courier_command()
            .args(["dlq"])
            .args(args)
            .args(["--source", &fixture.source_arg(), "--queue", &fixture.queue])
            .output()
            .expect("run courier dlq")
    };
    let listed = dlq(&["list"]);
    let listing = String::from_utf8_lossy(&listed.stdout).into_owned();
    assert!(listed.status.success(), "{listed:?}");
    assert!(listing.contains("permanent-status"), "{listing}");
    let letters = fixture.dead_letters(&source).await;
    let of = |text: &str| {
        letters
            .iter()
            .find(|l| String::from_utf8_lossy(&l.body).contains(text))
            .unwrap()
            .id
            .clone()
    };
    let shown = dlq(&["show", &of("sent")]);
    assert!(shown.status.success(), "{shown:?}");
    assert!(String::from_utf8_lossy(&shown.stdout).contains("courier-reason"));
    let replayed = dlq(&["replay", "--id", &of("sent")]);
    assert!(replayed.status.success(), "{replayed:?}");
    let purge = dlq(&["purge", "--id", &of("purged"), "--yes", "--why", "test"]);
    assert!(purge.status.success(), "{purge:?}");
    wait_for("the replayed message acked", SETTLE, async || {
        app.received_body(b"script:422,200\nsent").len() == 2
    })
    .await;
    let replay = &app.received_body(b"script:422,200\nsent")[1];
    assert_eq!(replay.attempt(), 1, "a replay starts again");
    wait_for("no dead letters left", SETTLE, async || {
        fixture.dead_letters(&source).await.is_empty()
    })
    .await;
    running.stop().await;
}

/// The gauges on `/metrics`: a scheduled retry is retry backlog, a dead
/// letter counts with its age, the work subscription's depth falls to 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn depth_gauges_on_metrics() {
    let fixture = Fixture::pubsub();
    let app = TestApp::start().await;
    let producer = fixture.producer().await;
    producer.send("script:503,200\nlater", &[]).await;
    producer.send("script:422\ndead", &[]).await;
    let mut policy = fast_policy();
    policy = policy.backoff_of(
        Duration::from_secs(30),
        Duration::from_secs(30),
        2.0,
        courier::policy::Jitter::None,
    );
    let running = Running::start(run_config(&fixture, &app, policy)).await;
    let queue = fixture.queue.clone();
    let mut seen = String::new();
    wait_for("the gauges", SETTLE, async || {
        seen = scrape(running.metrics_addr).await;
        series(&seen, "courier_retry_backlog", &queue) == Some(1.0)
            && series(&seen, "courier_dlq_depth", &queue) == Some(1.0)
            && series(&seen, "courier_queue_depth", &queue) == Some(1.0)
    })
    .await;
    assert!(
        series(&seen, "courier_dlq_oldest_age_seconds", &queue).is_some(),
        "{seen}"
    );
    assert_eq!(
        series(&seen, "courier_queue_oldest_age_seconds", &queue),
        None,
        "Pub/Sub cannot tell a waiting message from one with an app: {seen}"
    );
    running.stop().await;
}

/// A courier binary whose first depth count has seen its dead-letter
/// queue empty: the browsing subscription exists once a count has seen
/// it, and must exist before letters are published to be counted.
struct Counting {
    fixture: Fixture,
    courier: CourierProcess,
    addr: std::net::SocketAddr,
    queue: String,
    _app: TestApp,
    _policy: tempfile::TempDir,
}

impl Counting {
    async fn start(consumer: &str) -> Self {
        let fixture = Fixture::pubsub();
        let app = TestApp::start().await;
        let producer = fixture.producer().await;
        let dir = tempfile::tempdir().unwrap();
        let policy = write_policy(dir.path(), "maxAttempts: 3\ntimeout: 2s");
        let mut courier = CourierProcess::run(&run_args(&fixture, &app, &policy, consumer));
        let addr = courier.metrics_addr().await;
        producer.send("warm-up", &[]).await;
        let queue = fixture.queue.clone();
        wait_for("a first count", SETTLE, async || {
            !app.received_body(b"warm-up").is_empty()
                && series(&scrape(addr).await, "courier_dlq_depth", &queue) == Some(0.0)
        })
        .await;
        Self {
            fixture,
            courier,
            addr,
            queue,
            _app: app,
            _policy: dir,
        }
    }
}

/// A depth count reads every message it counts (Pub/Sub counts no
/// backlog itself), so it must hold one pull at a time, not the backlog:
/// 200 dead letters of 256 KiB (50 MiB) published with the plain client
/// are counted on `/metrics` by the built binary while its peak RSS grows
/// by far less than they weigh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_depth_count_holds_one_pull_not_the_backlog() {
    const LETTERS: usize = 200;
    const SIZE: usize = 256 << 10;
    let counting = Counting::start("counting").await;
    let (fixture, courier, addr, queue) = (
        &counting.fixture,
        &counting.courier,
        counting.addr,
        &counting.queue,
    );
    let warm = peak_rss(courier.id());
    let (publisher, _) = pubsub_clients().await;
    for n in 0..LETTERS {
        publisher
            .clone()
            .publish(PublishRequest {
                topic: pubsub_topic(&fixture.dlq()),
                messages: vec![PubsubMessage {
                    data: Bytes::from(vec![b'a' + (n % 26) as u8; SIZE]),
                    ..PubsubMessage::default()
                }],
            })
            .await
            .expect("Pub/Sub takes the letter");
    }
    wait_for("the letters counted", SETTLE, async || {
        series(&scrape(addr).await, "courier_dlq_depth", queue) == Some(LETTERS as f64)
    })
    .await;
    let peak = peak_rss(courier.id());
    assert_rss_grew_less(warm, peak, LETTERS * SIZE / 4, "counting 50 MiB of letters");
}

/// A depth count reads at most 10,000 messages of a subscription: 10,500
/// dead letters show as 10,000 on `/metrics`, and courier says once that
/// the gauge is a lower bound. Reading them all would pull the whole
/// backlog through the shadow every `--depth-interval`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_depth_count_stops_at_ten_thousand_and_says_so() {
    const COUNTED: usize = 10_000;
    let mut counting = Counting::start("capped").await;
    let (fixture, addr, queue) = (&counting.fixture, counting.addr, counting.queue.clone());
    let courier = &mut counting.courier;
    let (publisher, _) = pubsub_clients().await;
    for batch in 0..11 {
        publisher
            .clone()
            .publish(PublishRequest {
                topic: pubsub_topic(&fixture.dlq()),
                messages: (0..1000)
                    .take(COUNTED + 500 - batch * 1000)
                    .map(|n| PubsubMessage {
                        data: Bytes::from(format!("letter {batch}-{n}")),
                        ..PubsubMessage::default()
                    })
                    .collect(),
            })
            .await
            .expect("Pub/Sub takes the letters");
    }
    let said = courier
        .wait_log(
            "more messages wait than a depth count reads: the depth gauges of this subscription show that many, a lower bound, until fewer wait",
            SETTLE,
        )
        .await;
    assert_eq!(said["counted"], COUNTED, "{said}");
    assert_eq!(
        series(&scrape(addr).await, "courier_dlq_depth", &queue),
        Some(COUNTED as f64),
        "{}",
        courier.log()
    );
    let warnings = courier
        .log()
        .matches("more messages wait than a depth count reads")
        .count();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        courier
            .log()
            .matches("more messages wait than a depth count reads")
            .count(),
        warnings,
        "said once, not at every count"
    );
}

/// A message Pub/Sub delivered more than `maxAttempts + 2` times without a
/// settlement (here nacked by the plain client, as crashed sidecars would
/// leave it) is marked for the `undeliverable` dead letter without being
/// offered: the poison-pill rule reads `delivery_attempt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_pill_is_judged_by_delivery_attempt() {
    use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::PullRequest;
    let fixture = Fixture::pubsub();
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    producer.send("poison", &[]).await;
    let work = pubsub_subscription(&fixture.queue);
    let (_, mut subscriber) = pubsub_clients().await;
    // SourceOptions' default limit is 7 deliveries.
    let mut nacked = 0;
    while nacked < 7 {
        #[allow(deprecated)]
        let got = subscriber
            .pull(PullRequest {
                subscription: work.clone(),
                return_immediately: true,
                max_messages: 1,
            })
            .await
            .unwrap()
            .into_inner()
            .received_messages;
        for received in got {
            subscriber
                .modify_ack_deadline(ModifyAckDeadlineRequest {
                    subscription: work.clone(),
                    ack_ids: vec![received.ack_id],
                    ack_deadline_seconds: 0,
                })
                .await
                .unwrap();
            nacked += 1;
        }
    }
    let delivery = receive_one(&source).await;
    let problem = delivery.problem.clone().expect("a poison pill");
    assert!(problem.contains("delivered 8 times"), "{problem}");
    assert_eq!(delivery.attempt, 8, "each unsettled delivery counted");
}

/// A producer can publish what looks like one of courier's envelopes (the
/// copies over Pub/Sub's 100 attributes, finding 5 of
/// docs/reliability.md): `courier-envelope: 1` and data that holds a body
/// and fields. It is read as an envelope, and its `courier-*` fields,
/// inside the data or out, count for nothing without courier's seal: the
/// attempt is 1, the id Pub/Sub's, and the app gets no `Courier-*` field
/// of the producer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_envelope_carries_no_courier_state() {
    let fixture = Fixture::pubsub();
    let source = fixture.open().await;
    let mut data = Vec::new();
    for part in [
        "payload",
        "the body",
        "courier-attempt",
        "5",
        "courier-message-id",
        "stolen",
        "x-inner",
        "from the data",
    ] {
        data.extend_from_slice(&(part.len() as u32).to_be_bytes());
        data.extend_from_slice(part.as_bytes());
    }
    let producer = fixture.producer().await;
    let id = producer
        .send(
            data,
            &[
                ("courier-envelope".to_string(), "1".to_string()),
                (
                    "courier-first-attempt-at".to_string(),
                    "2020-01-01T00:00:00Z".to_string(),
                ),
                ("x-outer".to_string(), "an attribute".to_string()),
            ],
        )
        .await;
    let delivery = receive_one(&source).await;
    assert_eq!(delivery.attempt, 1);
    assert_eq!(delivery.message.id, id);
    assert_eq!(delivery.first_attempt_at, None);
    assert_eq!(delivery.message.body, Bytes::from("the body"));
    assert_eq!(
        delivery.message.headers,
        [
            ("x-inner".to_string(), "from the data".to_string()),
            ("x-outer".to_string(), "an attribute".to_string()),
        ]
    );
    source.ack(&delivery).await.unwrap();
}

/// On the emulator, a pull beside a backlog waits for what was pulled
/// before to be settled, and a message held unsettled delays the next pull
/// by `EMULATOR_SETTLE_WAIT` at most: the read after a full one, with one
/// of its messages still held, brings the next messages of the backlog, in
/// order, once that wait has run out. Without the wait the read comes at
/// once; with no bound on it, never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_beside_a_backlog_waits_for_settlements_a_moment_at_most() {
    use courier::source::Settlement;
    use courier::source::pubsub::EMULATOR_SETTLE_WAIT;
    const BATCH: usize = 4;
    let fixture = Fixture::pubsub();
    let source = fixture.open_as_created().await;
    for n in 0..3 * BATCH {
        fixture.send(&source, format!("m{n}")).await;
    }
    let bodies = |read: &[courier::source::Delivery]| -> Vec<String> {
        read.iter()
            .map(|d| String::from_utf8_lossy(&d.message.body).into_owned())
            .collect()
    };
    let first = source.receive(BATCH).await.expect("receive");
    assert_eq!(bodies(&first), ["m0", "m1", "m2", "m3"], "a full read");
    for delivery in &first[..BATCH - 1] {
        source.settle(delivery, Settlement::Ack).await.expect("ack");
    }
    let asked = std::time::Instant::now();
    let second = tokio::time::timeout(Duration::from_secs(30), source.receive(BATCH))
        .await
        .expect("a held message must not hold up the next read for good")
        .expect("receive");
    let waited = asked.elapsed();
    assert_eq!(bodies(&second), ["m4", "m5", "m6", "m7"]);
    assert!(
        waited >= EMULATOR_SETTLE_WAIT,
        "the read beside the held m3 came after {waited:?}, without waiting for it"
    );
    for delivery in first[BATCH - 1..].iter().chain(&second) {
        source.settle(delivery, Settlement::Ack).await.expect("ack");
    }
    let third = source.receive(BATCH).await.expect("receive");
    assert_eq!(bodies(&third), ["m8", "m9", "m10", "m11"]);
    for delivery in &third {
        source.settle(delivery, Settlement::Ack).await.expect("ack");
    }
    source.close().await;
}
