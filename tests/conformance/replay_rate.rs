//! `courier dlq replay --rate`: the built binary replays at the rate asked,
//! neither faster (the app that just recovered is not flattened) nor much
//! slower.

use crate::common::*;
use crate::dlq::Spawned;

/// How many letters at what rate each broker replays in the scenario: a
/// thousand at 100/s where a replay costs well under 10 ms (the issue's
/// figure); fewer, at a rate they keep, where each replay first looks its
/// letter up among the others: RabbitMQ browses the queue, SQS and Pub/Sub
/// receive from it (their stand-ins answer in tens of milliseconds), and
/// Kafka reads the dead-letter topic, so its replays slow as the queue
/// grows (200 letters went at about 5 a second). About 10 s each.
fn size(broker: BrokerKind) -> (usize, f64) {
    match broker {
        BrokerKind::Redis | BrokerKind::RedisCluster | BrokerKind::Nats | BrokerKind::Embedded => {
            (1000, 100.0)
        }
        BrokerKind::Amqp => (200, 20.0),
        BrokerKind::Sqs | BrokerKind::PubSub => (20, 2.0),
        // 20 at 2/s missed its 10 % once (the figure was not kept) with 23
        // other replay scenarios beside it; at 1/s each replay has a second.
        BrokerKind::Kafka => (10, 1.0),
    }
}

/// The dead letters are replayed with `--rate N/s`: the first and the last
/// replay are (letters - 1) / rate apart, within 10 %, and every letter
/// left the dead-letter queue.
pub async fn a_replay_keeps_its_rate(fixture: Fixture) {
    let (letters, rate) = size(fixture.broker);
    let app = TestApp::start().await;
    drop(fixture.open().await);
    wait_released(&fixture).await;
    let producer = fixture.producer().await;
    for i in 0..letters {
        producer.send(format!("script:400\n{i}"), &[]).await;
    }
    producer.release(&fixture).await;
    let source = fixture.open().await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    let dlq = fixture.dlq();
    let count = async || source.dead_letters(&dlq, usize::MAX).await.map(|l| l.len());
    wait_for("every message dead-lettered", SETTLE * 2, async || {
        count().await.is_ok_and(|n| n == letters)
    })
    .await;
    running.stop().await;
    release(&fixture, source).await;

    let mut replay = Spawned::start(
        &fixture,
        &["dlq", "replay", "--all", "--rate", &format!("{rate}/s")],
    );
    assert!(replay.wait().success());
    let replayed = replay.lines_starting("replayed ");
    assert_eq!(replayed.len(), letters, "every letter replayed");
    let took = (replayed[letters - 1] - replayed[0]).as_secs_f64();
    let expected = (letters - 1) as f64 / rate;
    assert!(
        (took - expected).abs() <= expected * 0.1,
        "{letters} letters at {rate}/s: {took:.2} s from the first replay to the last, expected {expected:.2} s ± 10 %"
    );
    let source = fixture.open().await;
    assert_eq!(
        source.dead_letters(&dlq, usize::MAX).await.unwrap().len(),
        0,
        "the dead-letter queue is empty"
    );
    release(&fixture, source).await;
}
