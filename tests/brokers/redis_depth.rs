//! Redis depth when Redis cannot count: `XINFO GROUPS` answers the group's
//! `lag` with nil once an entry ahead of the group was deleted (`XDEL`, as
//! courier's own replay does when it loses a race) or the group's read
//! counter is unknown (`XGROUP SETID`, a promoted replica). Then the ready
//! count and `courier_queue_depth` are unknown: left out, never 0. Real
//! Redis on loopback with private stream names, a real app.

use std::time::Duration;

use crate::common::*;
use courier::source::Depth;

const SETTLE: Duration = Duration::from_secs(30);
const DEPTH: &str = "courier_queue_depth";
const AGE: &str = "courier_queue_oldest_age_seconds";

async fn redis() -> RedisConnection {
    RedisConnection::open(REDIS_URL)
        .await
        .expect("connect to Redis")
}

async fn lag(queue: &str) -> redis::Value {
    let groups: Vec<std::collections::HashMap<String, redis::Value>> = redis::cmd("XINFO")
        .arg("GROUPS")
        .arg(queue)
        .query_async(&mut redis().await)
        .await
        .expect("XINFO GROUPS");
    groups[0]["lag"].clone()
}

/// Four messages wait; the third is deleted before the group reads it.
/// While the group is behind the tombstone the depth is unknown and the
/// series is absent, though the oldest waiting age is still told; once the
/// group has read to the end Redis counts again and the depth reads 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nil_lag_leaves_the_queue_depth_out_until_redis_counts_again() {
    let fixture = Fixture::redis();
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let mut ids = Vec::new();
    for i in 0..4 {
        let body = format!("script:sleep700\n{i}");
        ids.push(producer.send(body, &[]).await);
    }
    let counted = source.depth().await.unwrap();
    assert_eq!(
        (counted.ready, counted.queue_depth),
        (Some(4), Some(4)),
        "{counted:?}"
    );

    let deleted: i64 = redis::cmd("XDEL")
        .arg(&fixture.queue)
        .arg(&ids[2])
        .query_async(&mut redis().await)
        .await
        .unwrap();
    assert_eq!(deleted, 1);
    assert_eq!(
        lag(&fixture.queue).await,
        redis::Value::Nil,
        "Redis cannot count"
    );
    let unknown = source.depth().await.unwrap();
    assert_eq!(
        (unknown.ready, unknown.queue_depth),
        (None, None),
        "{unknown:?}"
    );
    assert!(
        unknown.oldest_waiting_age.is_some(),
        "the first undelivered entry is still found: {unknown:?}"
    );

    let app = TestApp::start().await;
    let mut policy = fast_policy();
    policy.timeout = Duration::from_secs(5);
    let mut config = run_config(&fixture, &app, policy);
    config.options.concurrency = 1;
    let running = Running::start(config).await;
    let mut seen = String::new();
    // The age is set in the same poll that leaves the depth out, so its
    // presence shows a poll happened.
    wait_for(
        "a depth poll while the app works through the backlog",
        SETTLE,
        async || {
            seen = scrape(running.metrics_addr).await;
            series(&seen, AGE, &fixture.queue).is_some()
        },
    )
    .await;
    assert!(
        app.received().len() < 3,
        "the backlog was still there: {:?}",
        app.received().len()
    );
    assert_eq!(
        series(&seen, DEPTH, &fixture.queue),
        None,
        "an unknown depth is left out, not 0: {seen}"
    );

    wait_for(
        "the depth to read 0 once the group has read to the end",
        SETTLE,
        async || {
            seen = scrape(running.metrics_addr).await;
            series(&seen, DEPTH, &fixture.queue) == Some(0.0)
        },
    )
    .await;
    let bodies: Vec<String> = app
        .received()
        .iter()
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .collect();
    assert_eq!(
        bodies,
        [
            "script:sleep700\n0",
            "script:sleep700\n1",
            "script:sleep700\n3"
        ],
        "the deleted entry is not delivered"
    );
    running.stop().await;
    let settled: Depth = wait_settled(&source, SETTLE).await;
    assert_eq!(settled.queue_depth, Some(0), "{settled:?}");
}

/// `XGROUP SETID` without `ENTRIESREAD` (what a promoted replica's group
/// looks like) leaves the read counter unknown: the ready count is unknown
/// while the group stands inside the stream, and known once it is at the
/// end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_moved_without_its_read_counter_has_an_unknown_depth() {
    let fixture = Fixture::redis();
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(producer.send(format!("m{i}"), &[]).await);
    }
    let set_id = async |id: &str| {
        let _: () = redis::cmd("XGROUP")
            .arg("SETID")
            .arg(&fixture.queue)
            .arg("courier")
            .arg(id)
            .query_async(&mut redis().await)
            .await
            .unwrap();
    };
    // At the first entry or the last Redis still counts exactly; between
    // them it cannot.
    set_id(&ids[1]).await;
    let unknown = source.depth().await.unwrap();
    assert_eq!(
        (unknown.ready, unknown.queue_depth),
        (None, None),
        "{unknown:?}"
    );
    set_id(&ids[2]).await;
    let known = source.depth().await.unwrap();
    assert_eq!(
        (known.ready, known.queue_depth),
        (Some(0), Some(0)),
        "{known:?}"
    );
}
