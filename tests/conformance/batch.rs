//! Batches (`--batch-max-messages`, `--batch-max-wait`; docs/batches.md): a
//! sidecar in this process posting batches to an app on loopback that
//! answers a status per entry, decided by each entry's body:
//!
//! - `poison`: the whole request is answered 500 (so a batch holding it is
//!   split until it stands alone);
//! - `retry-once` / `skip-once`: `retry`, or no status at all, on attempt
//!   1; success after;
//! - `drop`: `drop` with the reason `bad sku`;
//! - anything else: success.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use courier::dispatch::BatchSettings;
use http::Response;
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::common::*;

/// One entry as the app read it.
#[derive(Debug, Clone)]
struct Entry {
    id: String,
    body: String,
    attempt: u32,
}

/// One request as the app saw it.
#[derive(Debug, Clone)]
struct Post {
    at: Instant,
    content_type: String,
    entries: Vec<Entry>,
    status: u16,
}

/// The app of this module (above), recording every request.
struct BatchApp {
    url: String,
    posts: Arc<Mutex<Vec<Post>>>,
    stop: CancellationToken,
}

impl Drop for BatchApp {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl BatchApp {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/batch", listener.local_addr().unwrap());
        let posts: Arc<Mutex<Vec<Post>>> = Arc::default();
        let stop = CancellationToken::new();
        let recorded = posts.clone();
        tokio::spawn(courier::telemetry::serve_http(
            listener,
            stop.clone(),
            move |request| {
                let recorded = recorded.clone();
                async move {
                    let content_type = request
                        .headers()
                        .get("content-type")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string();
                    let body = request.into_body().collect().await.unwrap().to_bytes();
                    let entries = read_entries(&content_type, &body);
                    let (status, answer) = answer(&entries);
                    recorded.lock().unwrap().push(Post {
                        at: Instant::now(),
                        content_type,
                        entries,
                        status,
                    });
                    Response::builder()
                        .status(status)
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(answer.to_string())))
                        .unwrap()
                }
            },
        ));
        Self { url, posts, stop }
    }

    fn posts(&self) -> Vec<Post> {
        self.posts.lock().unwrap().clone()
    }

    /// The attempts at which entry `body` was answered success.
    fn succeeded(&self, body: &str) -> Vec<u32> {
        self.posts()
            .iter()
            .filter(|p| p.status == 200)
            .flat_map(|p| p.entries.clone())
            .filter(|e| e.body == body && status_of(e).is_some_and(|s| s == "success"))
            .map(|e| e.attempt)
            .collect()
    }

    /// The attempts at which entry `body` was offered.
    fn offered(&self, body: &str) -> Vec<u32> {
        self.posts()
            .iter()
            .flat_map(|p| p.entries.clone())
            .filter(|e| e.body == body)
            .map(|e| e.attempt)
            .collect()
    }
}

/// The entries of a request: courier's own, or CloudEvents' batched mode
/// (an event's `data` is its body).
fn read_entries(content_type: &str, body: &[u8]) -> Vec<Entry> {
    let value: Value = serde_json::from_slice(body).expect("a batch is JSON");
    if content_type == "application/cloudevents-batch+json" {
        return value
            .as_array()
            .expect("an array of events")
            .iter()
            .map(|event| Entry {
                id: event["id"].as_str().unwrap().to_string(),
                body: event["data"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string(),
                attempt: event["courierattempt"].as_u64().unwrap() as u32,
            })
            .collect();
    }
    assert_eq!(content_type, "application/json");
    value["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|entry| Entry {
            id: entry["id"].as_str().unwrap().to_string(),
            body: entry["body"].as_str().unwrap().to_string(),
            attempt: entry["headers"]["courier-attempt"]
                .as_str()
                .unwrap()
                .parse()
                .unwrap(),
        })
        .collect()
}

/// What the app says of an entry (`None`: nothing).
fn status_of(entry: &Entry) -> Option<&'static str> {
    match (entry.body.as_str(), entry.attempt) {
        ("retry-once", 1) => Some("retry"),
        ("skip-once", 1) => None,
        ("drop", _) => Some("drop"),
        _ => Some("success"),
    }
}

fn answer(entries: &[Entry]) -> (u16, Value) {
    if entries.iter().any(|e| e.body == "poison") {
        return (500, json!({"error": "poisoned"}));
    }
    let statuses: Vec<Value> = entries
        .iter()
        .filter_map(|e| {
            let status = status_of(e)?;
            Some(match status {
                "drop" => json!({"id": e.id, "status": "drop", "reason": "bad sku"}),
                _ => json!({"id": e.id, "status": status}),
            })
        })
        .collect();
    (200, json!({ "statuses": statuses }))
}

async fn start(
    fixture: &Fixture,
    app: &BatchApp,
    policy: courier::policy::Policy,
    max_messages: usize,
    max_wait: Duration,
) -> Running {
    let mut config = run_config_for(fixture, &app.url, policy);
    config.options.messages_per_delivery = max_messages;
    config.delivery.batch = Some(BatchSettings {
        max_messages,
        max_wait,
    });
    Running::start(config).await
}

async fn metric_of(running: &Running, name: &str, labels: &str) -> f64 {
    series(&scrape(running.metrics_addr).await, name, labels).unwrap_or(0.0)
}

/// A batch of 100 with one poison message: the 99 others are acked at
/// their first attempt, and the poison, split down to stand alone within
/// log2(100) + 1 = 8 requests, is judged alone and dead-lettered (one
/// attempt allowed here).
pub async fn one_poison_message_costs_its_neighbours_nothing(fixture: Fixture) {
    let app = BatchApp::start().await;
    let source = fixture.open().await;
    let bodies: Vec<String> = (0..100)
        .map(|i| match i {
            37 => "poison".to_string(),
            i => format!("m{i}"),
        })
        .collect();
    for body in &bodies {
        fixture.send(&source, body.clone()).await;
    }
    let policy = courier::policy::Policy {
        max_attempts: 1,
        ..fast_policy()
    };
    let running = start(&fixture, &app, policy, 100, Duration::from_secs(2)).await;
    let dead_letters = format!("{}\",reason=\"attempts-exhausted", fixture.queue);
    wait_for(
        "99 acks and a dead letter",
        Duration::from_secs(40),
        async || {
            metric_of(&running, "courier_acks_total", &fixture.queue).await == 99.0
                && metric_of(&running, "courier_dead_letters_total", &dead_letters).await == 1.0
        },
    )
    .await;
    wait_settled(&source, Duration::from_secs(15)).await;
    running.stop().await;

    let posts = app.posts();
    let sizes: Vec<usize> = posts.iter().map(|p| p.entries.len()).collect();
    eprintln!("{}: requests of {sizes:?}", fixture.queue);
    for body in bodies.iter().filter(|b| *b != "poison") {
        // In the requests that were split too, at attempt 1: a split uses
        // no attempt.
        let offered = app.offered(body);
        assert!(offered.iter().all(|&a| a == 1), "{body}: {offered:?}");
        assert_eq!(app.succeeded(body), [1], "{body}");
    }
    let holding: Vec<&Post> = posts
        .iter()
        .filter(|p| p.entries.iter().any(|e| e.body == "poison"))
        .collect();
    assert!(
        holding.len() <= 8,
        "the poison was in {} requests: {sizes:?}",
        holding.len()
    );
    assert_eq!(holding.last().unwrap().entries.len(), 1, "it ends alone");
    assert!(holding.iter().all(|p| p.status == 500));
    let letters = fixture.read_dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].body, "poison");
    assert_eq!(
        letters[0].field("courier-reason"),
        Some("attempts-exhausted")
    );
    assert_eq!(letters[0].field("courier-status"), Some("500"));
    assert_eq!(letters[0].field("courier-attempts"), Some("1"));
}

/// Each entry's status is honoured: success acked, retry and an entry not
/// mentioned redelivered at the next attempt, drop dead-lettered with the
/// app's reason.
pub async fn each_entry_is_settled_as_its_status_says(fixture: Fixture) {
    let app = BatchApp::start().await;
    let source = fixture.open().await;
    let bodies = ["ok-1", "retry-once", "drop", "skip-once", "ok-2"];
    for body in bodies {
        fixture.send(&source, body).await;
    }
    let running = start(
        &fixture,
        &app,
        fast_policy(),
        10,
        Duration::from_millis(500),
    )
    .await;
    let dead_letters = format!("{}\",reason=\"app-dead-letter", fixture.queue);
    wait_for(
        "4 acks and a dead letter",
        Duration::from_secs(40),
        async || {
            metric_of(&running, "courier_acks_total", &fixture.queue).await == 4.0
                && metric_of(&running, "courier_dead_letters_total", &dead_letters).await == 1.0
        },
    )
    .await;
    wait_settled(&source, Duration::from_secs(15)).await;
    running.stop().await;

    assert_eq!(app.succeeded("ok-1"), [1]);
    assert_eq!(app.succeeded("ok-2"), [1]);
    assert_eq!(app.offered("retry-once"), [1, 2]);
    assert_eq!(app.succeeded("retry-once"), [2]);
    assert_eq!(app.offered("skip-once"), [1, 2]);
    assert_eq!(app.succeeded("skip-once"), [2]);
    assert_eq!(app.offered("drop"), [1]);
    let letters = fixture.read_dead_letters().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter = &letters[0];
    assert_eq!(letter.body, "drop");
    assert_eq!(letter.field("courier-reason"), Some("app-dead-letter"));
    assert_eq!(
        letter.field("courier-app-directive"),
        Some("drop: bad sku"),
        "{letter:?}"
    );
    assert_eq!(letter.field("courier-status"), Some("200"));
    let excerpt = letter.field("courier-response-excerpt").unwrap_or_default();
    assert!(excerpt.contains("bad sku"), "{excerpt}");
}

/// A batch that does not fill goes out when its first message has waited
/// `--batch-max-wait`, not later.
pub async fn a_partial_batch_goes_after_its_wait(fixture: Fixture) {
    let app = BatchApp::start().await;
    let source = fixture.open().await;
    let max_wait = Duration::from_millis(300);
    let running = start(&fixture, &app, fast_policy(), 100, max_wait).await;
    // A first message, so that the sidecar is reading (the Kafka mock
    // takes seconds to join a group) before the ones timed.
    fixture.send(&source, "warm-up").await;
    wait_for("the warm-up", Duration::from_secs(20), async || {
        !app.succeeded("warm-up").is_empty()
    })
    .await;
    let before = app.posts().len();
    let sent = Instant::now();
    for body in ["p-1", "p-2", "p-3"] {
        fixture.send(&source, body).await;
    }
    wait_for("the three", Duration::from_secs(20), async || {
        ["p-1", "p-2", "p-3"]
            .iter()
            .all(|b| !app.succeeded(b).is_empty())
    })
    .await;
    wait_settled(&source, Duration::from_secs(15)).await;
    running.stop().await;
    let posts = app.posts().split_off(before);
    let sizes: Vec<usize> = posts.iter().map(|p| p.entries.len()).collect();
    assert_eq!(sizes.iter().sum::<usize>(), 3, "{sizes:?}");
    let last = posts.iter().map(|p| p.at).max().unwrap();
    // The wait, and the broker's own delay to hand a message out (the
    // Kafka mock's fetch, a Pub/Sub emulator's pull).
    assert!(
        last.duration_since(sent) < max_wait + Duration::from_secs(3),
        "the last batch went {:?} after the sends",
        last.duration_since(sent)
    );
}

/// When every message of a batch is a CloudEvent, the batch is
/// CloudEvents' batched mode, and the app may name an entry by its event
/// id.
pub async fn events_go_in_cloudevents_batched_mode(fixture: Fixture) {
    let app = BatchApp::start().await;
    let source = fixture.open().await;
    let headers = [(
        "content-type".to_string(),
        "application/cloudevents+json".to_string(),
    )];
    for (id, name) in [("e-1", "ok-1"), ("e-2", "retry-once"), ("e-3", "ok-2")] {
        let body = format!(
            r#"{{"specversion":"1.0","id":"{id}","source":"/shop","type":"order.created","data":{{"name":"{name}"}}}}"#
        );
        source.send(body.into(), &headers).await.expect("send");
    }
    let running = start(
        &fixture,
        &app,
        fast_policy(),
        10,
        Duration::from_millis(500),
    )
    .await;
    wait_for("3 acks", Duration::from_secs(40), async || {
        metric_of(&running, "courier_acks_total", &fixture.queue).await == 3.0
    })
    .await;
    wait_settled(&source, Duration::from_secs(15)).await;
    running.stop().await;
    let posts = app.posts();
    assert!(!posts.is_empty());
    for post in &posts {
        assert_eq!(post.content_type, "application/cloudevents-batch+json");
    }
    let ids: HashMap<String, Vec<u32>> =
        posts
            .iter()
            .flat_map(|p| p.entries.clone())
            .fold(HashMap::new(), |mut ids, e| {
                ids.entry(e.id).or_default().push(e.attempt);
                ids
            });
    assert_eq!(ids["e-1"], [1]);
    assert_eq!(ids["e-2"], [1, 2], "retried by its event id");
    assert_eq!(ids["e-3"], [1]);
}
