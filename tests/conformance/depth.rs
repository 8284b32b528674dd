//! `courier_queue_depth` and `courier_queue_oldest_age_seconds` as an
//! operator reads them on `/metrics`: messages waiting behind a slow app
//! show as depth and a growing age, and both fall to zero once the app has
//! caught up. RabbitMQ, SQS and Pub/Sub cannot tell the age: there the
//! series is absent.

use std::time::Duration;

use crate::common::*;
use bytes::Bytes;

const DEPTH: &str = "courier_queue_depth";
const AGE: &str = "courier_queue_oldest_age_seconds";

pub async fn waiting_messages_show_as_depth_and_age(fixture: Fixture) {
    let app = TestApp::start().await;
    // Three messages the app takes 3 s each to answer, one at a time: two
    // wait in the broker while the first is delivered.
    let producer = fixture.producer().await;
    for i in 0..3 {
        producer
            .send(Bytes::from(format!("script:sleep3000\n{i}")), &[])
            .await;
    }
    producer.release(&fixture).await;
    let mut policy = fast_policy();
    policy.timeout = Duration::from_secs(20);
    let mut config = run_config(&fixture, &app, policy);
    config.options.concurrency = 1;
    let running = Running::start_second_of_two(config).await;
    let queue = fixture.queue.clone();
    // SQS tells no age without receiving the message (CloudWatch has it);
    // Pub/Sub cannot tell a message waiting from one with an app.
    let age_told = !matches!(
        fixture.broker,
        BrokerKind::Amqp | BrokerKind::Sqs | BrokerKind::PubSub
    );

    let mut seen = String::new();
    wait_for(
        "messages waiting to show as queue depth and an age of a second",
        SETTLE,
        async || {
            seen = scrape(running.metrics_addr).await;
            let depth = series(&seen, DEPTH, &queue).unwrap_or(0.0);
            // RabbitMQ counts the two ready messages, not the one handed
            // out; the others count it too.
            let age_ok = match series(&seen, AGE, &queue) {
                Some(age) => age >= 1.0,
                None => !age_told,
            };
            depth >= 2.0 && age_ok
        },
    )
    .await;
    assert!(series(&seen, DEPTH, &queue).unwrap() <= 3.0, "{seen}");
    assert_eq!(
        series(&seen, AGE, &queue).is_some(),
        age_told,
        "the age is reported exactly where the broker can tell it: {seen}"
    );

    wait_for(
        "the queue depth and age to fall to zero once the app caught up",
        SETTLE,
        async || {
            seen = scrape(running.metrics_addr).await;
            series(&seen, DEPTH, &queue) == Some(0.0)
                && series(&seen, AGE, &queue) == age_told.then_some(0.0)
        },
    )
    .await;
    assert_eq!(app.received().len(), 3);
    running.stop().await;
}
