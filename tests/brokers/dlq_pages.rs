//! Paging through a dead-letter queue longer than a page, on the brokers
//! whose ids are ordered (Redis, NATS, the embedded queue): every letter
//! once, in queue order, across page boundaries; a `through` bound stops
//! at its letter; a letter is found by its id alone; and the built binary
//! lists, counts, limits and shows across its own 256-letter pages as it
//! did when it read the queue whole.

use std::process::Command;

use crate::common::*;

const LETTERS: usize = 300;

async fn pages_cover_the_queue_once_in_order(fixture: Fixture) {
    let app = TestApp::start().await;
    drop(fixture.open().await);
    wait_released(&fixture).await;
    let producer = fixture.producer().await;
    for i in 0..LETTERS {
        producer.send(format!("script:400\n{i}"), &[]).await;
    }
    producer.release(&fixture).await;
    let source = fixture.open().await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    let dlq = fixture.dlq();
    wait_for("every message dead-lettered", SETTLE, async || {
        source
            .dead_letters(&dlq, usize::MAX)
            .await
            .is_ok_and(|l| l.len() == LETTERS)
    })
    .await;
    running.stop().await;
    let whole: Vec<String> = source
        .dead_letters(&dlq, usize::MAX)
        .await
        .unwrap()
        .into_iter()
        .map(|l| l.id)
        .collect();

    let walk = async |through: Option<&str>| {
        let mut ids: Vec<String> = Vec::new();
        loop {
            let page = source
                .dead_letters_after(&dlq, ids.last().map(String::as_str), through, 128)
                .await
                .unwrap()
                .expect("this broker pages");
            assert!(page.len() <= 128, "a page holds at most the limit");
            if page.is_empty() {
                return ids;
            }
            ids.extend(page.into_iter().map(|l| l.id));
        }
    };
    assert_eq!(walk(None).await, whole, "every letter once, in queue order");
    assert_eq!(
        walk(Some(&whole[199])).await,
        whole[..200],
        "a page ends at its bound"
    );
    let found = source
        .dead_letter_by_id(&dlq, &whole[250])
        .await
        .unwrap()
        .expect("this broker finds a letter by its id");
    assert_eq!(found.map(|l| l.id).as_ref(), Some(&whole[250]));
    for absent in ["99999999999999-0", "99999999999999", "not an id"] {
        let found = source.dead_letter_by_id(&dlq, absent).await.unwrap();
        assert!(matches!(found, Some(None)), "{absent}: {found:?}");
    }
    drop(source);
    wait_released(&fixture).await;

    let courier = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_courier"))
            .args(args)
            .args(["--source", &fixture.source_arg(), "--queue", &fixture.queue])
            .output()
            .unwrap();
        assert!(out.status.success(), "{args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let listed: Vec<String> = courier(&["dlq", "list", "--output", "json"])
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(listed, whole);
    let dry = courier(&["dlq", "replay", "--all", "--limit", "260", "--dry-run"]);
    assert!(dry.contains("260 dead letters would be replayed"), "{dry}");
    let lines = dry
        .lines()
        .filter(|l| l.starts_with("would replay "))
        .count();
    assert_eq!(lines, 260);
    let shown = courier(&["dlq", "show", &whole[290], "--output", "json"]);
    assert!(shown.contains(&whole[290]), "{shown}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_pages_cover_the_queue_once_in_order() {
    pages_cover_the_queue_once_in_order(Fixture::redis()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_pages_cover_the_queue_once_in_order() {
    pages_cover_the_queue_once_in_order(Fixture::nats()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_pages_cover_the_queue_once_in_order() {
    pages_cover_the_queue_once_in_order(Fixture::embedded()).await;
}
