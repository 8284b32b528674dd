//! What `courier run --create` makes of a missing RabbitMQ queue: a quorum
//! queue with a delivery limit courier never reaches, unless
//! `--queue-type classic` asks for a classic one. RabbitMQ does not show a
//! queue's arguments over AMQP, so the test asks as courier does: a
//! declaration with the same arguments is accepted, any other is refused.
//! A replica of courier killed is tested on the shared node
//! (tests/brokers/replicas.rs), the loss of the quorum queue's leader node on a
//! private three-node cluster (tests/brokers/rabbitmq_cluster.rs).

use std::time::Duration;

use crate::common::*;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};

/// courier's delivery limit on a quorum work queue it creates.
const DELIVERY_LIMIT: i64 = 1_000_000_000;

/// Whether RabbitMQ takes a durable declaration of `queue` with `args` as
/// the queue it already is.
async fn declared_as(queue: &str, args: &[(&str, AMQPValue)]) -> bool {
    let connection = lapin::Connection::connect(AMQP_URL, Default::default())
        .await
        .expect("connect to RabbitMQ");
    // A refused declaration closes the channel: one channel per question.
    let channel = connection.create_channel().await.expect("a channel");
    let mut table = FieldTable::default();
    for (name, value) in args {
        table.insert((*name).into(), value.clone());
    }
    let accepted = channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), table)
        .await
        .is_ok();
    let _ = connection.close(200, "asked".into()).await;
    accepted
}

/// Starts `courier run --create <extra>` on a fresh queue, waits until it
/// runs, and stops it.
async fn create_with(extra: &[&str]) -> Fixture {
    let fixture = Fixture::amqp();
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(dir.path(), "maxAttempts: 3");
    let mut args = run_args(&fixture, &app, &policy, "creator");
    args.push("--create".into());
    args.extend(extra.iter().map(|a| a.to_string()));
    let mut courier = CourierProcess::run(&args);
    courier.wait_running().await;
    courier.terminate();
    let status = courier.exit_within(Duration::from_secs(15)).await;
    assert!(status.success(), "{status}; log:\n{}", courier.log());
    fixture
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_makes_a_quorum_queue_with_a_delivery_limit_courier_never_reaches() {
    let fixture = create_with(&[]).await;
    let quorum = AMQPValue::LongString("quorum".into());
    assert!(
        declared_as(
            &fixture.queue,
            &[
                ("x-queue-type", quorum.clone()),
                ("x-delivery-limit", AMQPValue::LongLongInt(DELIVERY_LIMIT)),
            ]
        )
        .await,
        "the created queue is not quorum with x-delivery-limit {DELIVERY_LIMIT}"
    );
    assert!(
        !declared_as(&fixture.queue, &[("x-queue-type", quorum)]).await,
        "the created quorum queue has no delivery limit of its own (RabbitMQ 4 would drop after 20)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_type_classic_makes_a_classic_queue() {
    let fixture = create_with(&["--queue-type", "classic"]).await;
    assert!(
        declared_as(&fixture.queue, &[]).await,
        "the created queue is not a classic queue without arguments"
    );
    assert!(
        !declared_as(
            &fixture.queue,
            &[("x-queue-type", AMQPValue::LongString("quorum".into()))]
        )
        .await,
        "the created queue is quorum"
    );
}
