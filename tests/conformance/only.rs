//! What holds for one broker only: how Redis reads a stream entry a
//! producer wrote without a `payload` field and how it hands a restarted
//! consumer its own history, and a RabbitMQ quorum queue declared by
//! someone else.

use std::collections::HashSet;
use std::time::Duration;

use crate::common::*;
use crate::{delivery, process};
use courier::source::{self, SourceOptions};

const SETTLE: Duration = Duration::from_secs(20);

/// Redis-only: an entry a producer wrote without a `payload` field is
/// dead-lettered as undeliverable, not dropped and not retried forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_entry_without_payload_is_undeliverable() {
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let client = ::redis::Client::open(REDIS_URL).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
    let id: String = ::redis::cmd("XADD")
        .arg(&fixture.queue)
        .arg("*")
        .arg("body")
        .arg("oops, wrong field name")
        .query_async(&mut con)
        .await
        .unwrap();
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert!(app.received().is_empty());
    let letter = delivery::dead_letter_of(&source, &fixture, &id).await;
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    assert!(letter.field("courier-error").unwrap().contains("payload"));
    assert_eq!(
        letter.field("body"),
        Some("oops, wrong field name"),
        "the entry's fields are kept"
    );
}

/// Regression: a restarted Redis consumer whose unsettled history filled a
/// whole read read the history from the start again on the next read, and
/// handed out entries that were still in flight a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_restart_hands_out_each_unsettled_entry_once() {
    let fixture = Fixture::redis();
    let mut options = SourceOptions::new(&fixture.queue);
    options.consumer = "replica-a".into();
    let killed = source::open(&fixture.url, options.clone()).await.unwrap();
    for i in 0..4 {
        fixture.send(&killed, format!("message {i}")).await;
    }
    assert_eq!(killed.receive(4).await.unwrap().len(), 4);
    // Nothing settled: all four stay pending for replica-a.
    drop(killed);

    let restarted = source::open(&fixture.url, options).await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..2 {
        ids.extend(
            restarted
                .receive(2)
                .await
                .unwrap()
                .into_iter()
                .map(|d| d.message.id),
        );
    }
    let distinct: HashSet<&String> = ids.iter().collect();
    assert_eq!(
        (ids.len(), distinct.len()),
        (4, 4),
        "each pending entry once: {ids:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_quorum_crash_mid_delivery_counts_an_attempt() {
    let fixture = Fixture::amqp();
    declare_amqp_quorum(&fixture.queue).await;
    process::a_crash_mid_delivery_counts_an_attempt(fixture).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_crash_restart_same_consumer() {
    process::crash_mid_flight_with(Fixture::redis(), process::Restart::SameConsumer).await;
}
