//! NATS JetStream settling under failing writes and live edits, against the
//! real server on loopback: a dead letter or retry copy the server will not
//! store leaves the original unsettled in the work stream; a message handed
//! out too often without a settlement is dead-lettered without the app; a
//! live policy change moves `AckWait` and the dead-letter stream depth is
//! read from; one read is bounded in bytes.

use std::time::{Duration, SystemTime};

use crate::common::*;
use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, pull};
use async_nats::jetstream::stream::{Config as StreamConfig, DiscardPolicy, StorageType};
use bytes::Bytes;
use courier::model::rfc3339;
use courier::source::{self, LiveSettings, SourceOptions};
use futures::StreamExt;

const SETTLE: Duration = Duration::from_secs(30);

async fn jetstream() -> async_nats::jetstream::Context {
    async_nats::jetstream::new(async_nats::connect(NATS_URL).await.unwrap())
}

async fn messages_in(js: &async_nats::jetstream::Context, stream: &str) -> u64 {
    js.get_stream(stream)
        .await
        .unwrap()
        .cached_info()
        .state
        .messages
}

/// A dead-letter stream that is full and refuses new messages: every
/// dead-letter write to it fails.
async fn full_dead_letter_stream(js: &async_nats::jetstream::Context, fixture: &Fixture) -> String {
    let name = format!("{}_dlq", fixture.queue);
    js.create_stream(StreamConfig {
        name: name.clone(),
        subjects: vec![fixture.dlq()],
        max_messages: 1,
        discard: DiscardPolicy::New,
        storage: StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();
    js.publish(fixture.dlq(), Bytes::from_static(b"filler"))
        .await
        .unwrap()
        .await
        .unwrap();
    name
}

/// A 400 whose dead letter the server will not store is not acked away: the
/// message stays in the work stream, is handed out again, and once the
/// dead-letter stream takes writes again it is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_unwritable_dead_letter_stream_acks_nothing_away() {
    let fixture = Fixture::nats();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let js = jetstream().await;
    let dlq_stream = full_dead_letter_stream(&js, &fixture).await;
    fixture.send(&source, "script:400").await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;

    wait_for(
        "the 400 to be handed out a second time",
        SETTLE,
        async || app.received_body(b"script:400").len() >= 2,
    )
    .await;
    assert_eq!(
        messages_in(&js, &fixture.queue).await,
        1,
        "the message is still in the work stream"
    );
    assert_eq!(messages_in(&js, &dlq_stream).await, 1, "only the filler");

    let mut stream = js.get_stream(&dlq_stream).await.unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.max_messages = -1;
    js.update_stream(config).await.unwrap();
    wait_for(
        "the dead letter once the stream takes it",
        SETTLE,
        async || {
            messages_in(&js, &dlq_stream).await == 2 && messages_in(&js, &fixture.queue).await == 0
        },
    )
    .await;
    running.stop().await;
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    let letter = letters
        .iter()
        .find(|l| l.body.as_ref() == b"script:400")
        .expect("the dead letter");
    assert_eq!(letter.field("courier-reason"), Some("permanent-status"));
}

/// A retry that must not use up an attempt is a copy published to the work
/// stream; when the stream refuses the copy, the original is not acked: the
/// retry fails and the same message is handed out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_unwritable_work_stream_keeps_the_original_of_a_retry_copy() {
    let fixture = Fixture::nats();
    let source = fixture.open().await;
    let js = jetstream().await;
    fixture.send(&source, "keep me").await;
    let mut stream = js.get_stream(&fixture.queue).await.unwrap();
    let mut config = stream.info().await.unwrap().config.clone();
    config.max_messages = 1;
    config.discard = DiscardPolicy::New;
    js.update_stream(config).await.unwrap();

    let mut got = Vec::new();
    wait_for("the message", SETTLE, async || {
        got = source.receive(1).await.unwrap();
        !got.is_empty()
    })
    .await;
    let delivery = got.remove(0);
    let now = SystemTime::now();
    let err = source
        .retry(
            &delivery,
            delivery.attempt,
            now,
            now + Duration::from_secs(1),
        )
        .await
        .expect_err("the stream refuses the copy");
    assert!(err.to_string().contains("did not store"), "{err}");
    assert_eq!(messages_in(&js, &fixture.queue).await, 1);

    wait_for("the same message again", SETTLE, async || {
        got = source.receive(1).await.unwrap();
        !got.is_empty()
    })
    .await;
    assert_eq!(got[0].message.body.as_ref(), b"keep me");
    assert_eq!(got[0].message.id, delivery.message.id);
    source.ack(&got[0]).await.unwrap();
    wait_for("the work stream to be empty", SETTLE, async || {
        messages_in(&js, &fixture.queue).await == 0
    })
    .await;
}

/// A message some consumer fetched and never settled, again and again (a
/// sidecar that crashed on it each time), is dead-lettered `undeliverable`
/// by JetStream's delivery counter, and the app never sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_message_handed_out_too_often_is_dead_lettered_without_the_app() {
    let fixture = Fixture::nats();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let js = jetstream().await;
    let stream = js.get_stream(&fixture.queue).await.unwrap();
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("courier".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(1),
            max_deliver: -1,
            ..Default::default()
        })
        .await
        .unwrap();
    fixture.send(&source, "poison").await;

    // The limit is the policy's maxAttempts + 2: 3 for one attempt.
    let policy = fast_policy().max_attempts(1);
    let limit = i64::from(policy.max_deliveries());
    let mut delivered = 0;
    while delivered < limit {
        let mut batch = consumer
            .fetch()
            .max_messages(1)
            .expires(Duration::from_secs(3))
            .messages()
            .await
            .unwrap();
        if let Some(Ok(message)) = batch.next().await {
            // Not acked: handed out again after AckWait.
            delivered = message.info().unwrap().delivered;
        }
    }

    let running = Running::start(run_config(&fixture, &app, policy)).await;
    let mut letters = Vec::new();
    wait_for(
        "the poison pill in the dead-letter stream",
        SETTLE,
        async || {
            letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
            !letters.is_empty()
        },
    )
    .await;
    running.stop().await;
    let letter = &letters[0];
    assert_eq!(letter.body.as_ref(), b"poison");
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    let error = letter.field("courier-error").unwrap_or_default();
    assert!(
        error.contains(&format!(
            "handed out {} times without being settled",
            limit + 1
        )),
        "{error}"
    );
    assert!(app.received().is_empty(), "the app never saw it");
    assert_eq!(messages_in(&js, &fixture.queue).await, 0);
}

/// A live change naming a dead-letter subject the work stream captures is
/// refused; one of the visibility timeout becomes the consumer's
/// `AckWait`; depth reads the dead-letter stream the change names, with
/// the oldest letter's age from its `courier-last-attempt-at`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_live_settings_are_checked_and_move_ack_wait_and_the_dead_letters_depth_reads() {
    let fixture = Fixture::nats();
    let js = jetstream().await;
    let mut options = SourceOptions::new(&fixture.queue);
    options.create = true;
    options.live.visibility_timeout = Duration::from_secs(5);
    let source = source::open(&fixture.url, options).await.unwrap();
    // The first read creates the durable consumer.
    source.receive(1).await.unwrap();
    let stream = js.get_stream(&fixture.queue).await.unwrap();
    assert_eq!(
        stream
            .consumer_info("courier")
            .await
            .unwrap()
            .config
            .ack_wait,
        Duration::from_secs(5)
    );

    // Another dead-letter queue, holding a letter dead-lettered a minute ago.
    let other = format!("{}.failed", fixture.queue);
    let other_stream = format!("{}_failed", fixture.queue);
    js.create_stream(StreamConfig {
        name: other_stream.clone(),
        subjects: vec![other.clone()],
        storage: StorageType::Memory,
        ..Default::default()
    })
    .await
    .unwrap();
    let mut headers = HeaderMap::new();
    let a_minute_ago = rfc3339(SystemTime::now() - Duration::from_secs(60));
    headers.insert("courier-last-attempt-at", a_minute_ago.as_str());
    js.publish_with_headers(other.clone(), headers, Bytes::from_static(b"old"))
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(source.depth().await.unwrap().dead_letters, 0);

    // A dead-letter subject the work stream captures is refused, saying why.
    let captured = LiveSettings {
        visibility_timeout: Duration::from_secs(20),
        dead_letter_queue: fixture.queue.clone(),
        max_deliveries: 7,
    };
    let err = source.check(&captured).unwrap_err();
    assert!(err.contains("captured by the work stream"), "{err}");
    let moved = LiveSettings {
        dead_letter_queue: other.clone(),
        ..captured
    };
    assert_eq!(source.check(&moved), Ok(()));

    source.apply(&LiveSettings {
        visibility_timeout: Duration::from_secs(20),
        dead_letter_queue: other.clone(),
        max_deliveries: 7,
    });
    wait_for("AckWait to follow the policy", SETTLE, async || {
        stream
            .consumer_info("courier")
            .await
            .unwrap()
            .config
            .ack_wait
            == Duration::from_secs(20)
    })
    .await;
    let depth = source.depth().await.unwrap();
    assert_eq!(depth.dead_letters, 1);
    let age = depth.oldest_dead_letter_age.expect("an age");
    assert!(
        age >= Duration::from_secs(60) && age < Duration::from_secs(120),
        "{age:?}"
    );
    let _ = js.delete_stream(&other_stream).await;
}

/// One read asks for many messages but brings in at most 8 MiB of them
/// (more than one message of the server's largest size), so a batch of
/// large messages cannot exhaust memory; the rest come with later reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_read_is_bounded_in_bytes() {
    let fixture = Fixture::nats();
    let source = fixture.open().await;
    assert!(source.capabilities().byte_bounded_reads);
    let js = jetstream().await;
    let body = Bytes::from(vec![b'x'; 900_000]);
    for _ in 0..12 {
        js.publish(fixture.queue.clone(), body.clone())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let mut first = Vec::new();
    wait_for("a first read", SETTLE, async || {
        first = source.receive(16).await.unwrap();
        !first.is_empty()
    })
    .await;
    let bytes: usize = first.iter().map(|d| d.message.body.len()).sum();
    assert!(
        first.len() < 12 && bytes <= 8 << 20,
        "{} messages, {bytes} bytes in one read",
        first.len()
    );
    let mut total = first.len();
    for d in &first {
        source.ack(d).await.unwrap();
    }
    wait_for("the rest in later reads", SETTLE, async || {
        let got = source.receive(16).await.unwrap();
        for d in &got {
            source.ack(d).await.unwrap();
        }
        total += got.len();
        total == 12
    })
    .await;
}

/// Two replays of one dead letter at once (two operators, a command run
/// twice) both read it before either deletes it; the replay publish
/// carries a `Nats-Msg-Id` of the letter, so JetStream stores it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_two_replays_of_one_letter_at_once_store_it_once() {
    let fixture = Fixture::nats();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    fixture.send(&source, "script:400").await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_for("the dead letter", SETTLE, async || {
        source.depth().await.unwrap().dead_letters == 1
    })
    .await;
    running.stop().await;
    let letter = source.dead_letters(&fixture.dlq(), 10).await.unwrap()[0].clone();
    let (a, b) = (fixture.open().await, fixture.open().await);
    let dlq = fixture.dlq();
    let (first, second) = tokio::join!(a.replay(&dlq, &letter), b.replay(&dlq, &letter));
    assert!(
        first.is_ok() || second.is_ok(),
        "one replay went through: {first:?} {second:?}"
    );
    let js = jetstream().await;
    // The work stream held the original (acked, so gone from a work-queue
    // stream) and now exactly one replayed copy.
    let depth = source.depth().await.unwrap();
    assert_eq!(
        (depth.ready, depth.dead_letters),
        (Some(1), 0),
        "one copy in the work stream, none left dead"
    );
    assert_eq!(messages_in(&js, &fixture.queue).await, 1);
}

/// NATS's `max_payload` here is 1 MiB, so a 40 MiB message cannot be
/// published at all; a body above `--max-body` that NATS does take is
/// dead-lettered `undeliverable` by the built binary, which keeps running,
/// delivers what comes after, and stays small.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_a_body_over_max_body_is_dead_lettered_and_courier_keeps_running() {
    const BIG: usize = 900 << 10;
    let fixture = Fixture::nats();
    let bodies = (0..3u8).map(|n| vec![b'a' + n; BIG]).collect();
    let (peak, ids, letters) =
        oversized_through_the_binary(&fixture, bodies, &["--max-body", "64KiB"]).await;
    assert!(peak < 64 << 20, "courier's peak RSS was {} MiB", peak >> 20);
    assert_eq!(letters.len(), 3);
    for letter in &letters {
        assert_oversized(letter, &ids, BIG, 64 << 10);
    }
}

/// `Nats-Expected-Stream`, which courier's own `send` publishes with as the
/// server's precondition, reaches the app on no attempt: a copy courier
/// publishes (a retry while the app was unreachable) goes without it, so
/// forwarding it would show the app headers that change between attempts.
/// The producer's own headers arrive on both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_publish_preconditions_reach_the_app_on_no_attempt() {
    let fixture = Fixture::nats();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let headers = [("order-region".to_string(), "eu".to_string())];
    let sequence = source
        .send(Bytes::from_static(b"script:503,200"), &headers)
        .await
        .expect("send");
    let js = jetstream().await;
    let stored = js
        .get_stream(&fixture.queue)
        .await
        .unwrap()
        .get_raw_message(sequence.parse().unwrap())
        .await
        .unwrap();
    assert_eq!(
        stored
            .headers
            .get("Nats-Expected-Stream")
            .map(|v| v.as_str()),
        Some(fixture.queue.as_str()),
        "courier's send stores the precondition with the message"
    );

    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    let seen = app.received_body(b"script:503,200");
    assert_eq!(
        seen.iter().map(Received::attempt).collect::<Vec<_>>(),
        vec![1, 2]
    );
    for r in &seen {
        assert_eq!(r.header("nats-expected-stream"), None);
        assert_eq!(r.header("order-region"), Some("eu"));
    }
}
