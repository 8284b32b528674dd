//! `courier dlq replay --to QUEUE`: a queue's dead letters replayed into
//! another queue of the same broker, where that queue's sidecar delivers
//! them as replays.

use crate::common::*;
use crate::dlq::{courier, stderr, stdout};

/// Two messages answered 400 are dead-lettered from one queue; `replay
/// --all --to` the other queue moves both there, out of the first one's
/// dead-letter queue; a sidecar on the other queue delivers them, each with
/// `Courier-Replay-Count: 1` and `Courier-Queue` naming where it now is.
pub async fn a_replay_goes_to_the_queue_named(fixture: Fixture) {
    let into = fixture.sibling("into");
    let app = TestApp::start().await;
    for queue in [&fixture, &into] {
        drop(queue.open().await);
        wait_released(queue).await;
    }
    let bodies = ["script:400,200\nfirst", "script:400,200\nsecond"];
    let producer = fixture.producer().await;
    for body in bodies {
        producer.send(body, &[]).await;
    }
    producer.release(&fixture).await;
    let source = fixture.open().await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    let dlq = fixture.dlq();
    let letters = async || source.dead_letters(&dlq, 100).await.map(|l| l.len());
    wait_for("both dead-lettered", SETTLE, async || {
        letters().await.is_ok_and(|n| n == 2)
    })
    .await;
    running.stop().await;
    release(&fixture, source).await;

    let out = courier(&fixture, &["dlq", "replay", "--all", "--to", &into.queue]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("2 dead letters replayed to {}", into.queue)),
        "{}",
        stdout(&out)
    );

    let running = Running::start_second_of_two(run_config(&into, &app, fast_policy())).await;
    wait_for("both delivered again", SETTLE, async || {
        bodies
            .iter()
            .all(|b| app.received_body(b.as_bytes()).len() == 2)
    })
    .await;
    running.stop().await;
    for body in bodies {
        let again = &app.received_body(body.as_bytes())[1];
        assert_eq!(again.header("courier-replay-count"), Some("1"), "{again:?}");
        assert_eq!(
            again.header("courier-queue"),
            Some(into.queue.as_str()),
            "{again:?}"
        );
    }
    let source = fixture.open().await;
    assert_eq!(source.dead_letters(&dlq, 100).await.unwrap().len(), 0);
    release(&fixture, source).await;
}
