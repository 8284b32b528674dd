//! A bulk command's set is fixed before it acts: letters dead-lettered
//! while a paced replay runs are not in it, and stay in the dead-letter
//! queue.

use crate::common::*;
use crate::dlq::{Spawned, courier, json_lines};

/// Four dead letters are replayed at 1 a second by the built binary while
/// the sidecar runs; once the first is replayed (the snapshot is taken),
/// two new messages are answered 400 and dead-lettered. The replay moves
/// its four and says so; the two new letters are the dead-letter queue's
/// only ones afterwards, and the four reach the app again.
pub async fn a_replay_leaves_letters_arriving_after_its_snapshot(fixture: Fixture) {
    let app = TestApp::start().await;
    // Opened first, as a deployed sidecar has (see `dlq::send_all`).
    drop(fixture.open().await);
    wait_released(&fixture).await;
    let producer = fixture.producer().await;
    let old: Vec<String> = (0..4).map(|i| format!("script:400,200\nold {i}")).collect();
    for body in &old {
        producer.send(body.clone(), &[]).await;
    }
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    let listed = || json_lines(&courier(&fixture, &["dlq", "list", "--output", "json"]));
    wait_for("the four dead letters", SETTLE, async || {
        listed().len() == 4
    })
    .await;

    let mut replay = Spawned::start(&fixture, &["dlq", "replay", "--all", "--rate", "1"]);
    wait_for("the first replay", SETTLE, async || {
        !replay.lines_starting("replayed ").is_empty()
    })
    .await;
    let new: Vec<String> = (0..2).map(|i| format!("script:400\nnew {i}")).collect();
    for body in &new {
        producer.send(body.clone(), &[]).await;
    }
    wait_for("the new messages answered", SETTLE, async || {
        new.iter()
            .all(|b| !app.received_body(b.as_bytes()).is_empty())
    })
    .await;
    // Four at 1 a second take 3 s; a replay that took in the new letters
    // would go on replaying them as the sidecar dead-letters them again.
    let mut status = None;
    poll_until(SETTLE, async || {
        status = replay.child.try_wait().unwrap();
        status.is_some()
    })
    .await;
    if status.is_none() {
        replay.child.kill().unwrap();
        replay.wait();
        panic!(
            "the replay did not end: it took in letters that came after its snapshot: {}",
            replay.stdout()
        );
    }
    let status = replay.wait();
    let stdout = replay.stdout();
    assert!(status.success(), "{stdout}");
    assert!(
        stdout.contains(&format!("4 dead letters replayed to {}", fixture.queue)),
        "{stdout}"
    );
    let bodies = |letters: Vec<serde_json::Value>| -> Vec<String> {
        let mut bodies: Vec<String> = letters
            .iter()
            .map(|l| l["body"].as_str().unwrap_or_default().to_string())
            .collect();
        bodies.sort();
        bodies
    };
    wait_for("the new letters in the queue", SETTLE, async || {
        bodies(listed()) == new
    })
    .await;
    wait_for("the replayed messages acked", SETTLE, async || {
        old.iter()
            .all(|b| app.received_body(b.as_bytes()).len() == 2)
    })
    .await;
    running.stop().await;
    producer.release(&fixture).await;
}
