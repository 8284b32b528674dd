//! `courier dlq edit`, for every source that replays: a JSON message the
//! app refuses for one field is fixed with a JSON Patch and replayed with
//! the built binary, and reaches the app patched, as a replay
//! (`Courier-Replay-Count: 1`, the same Idempotency-Key); a patch whose
//! `test` does not hold leaves the letter where it was; and a message
//! edited into one the app still refuses dies again with the digest of its
//! original in its record.

use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime};

use crate::common::*;
use crate::dlq::{Beside, audit_line, courier, json_lines, stderr, stdout};
use bytes::Bytes;
use courier::source::DeadLetter;
use http_body_util::{BodyExt, Full};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// An app that takes an order only with a positive `amount`, and answers
/// 400 to anything else, as an app validating its input does: the message
/// is refused for what it says, whatever the number of attempts.
struct OrdersApp {
    url: String,
    received: Arc<Mutex<Vec<Received>>>,
    stop: CancellationToken,
}

impl OrdersApp {
    async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let (received, stop) = (
            Arc::<Mutex<Vec<Received>>>::default(),
            CancellationToken::new(),
        );
        let seen = received.clone();
        tokio::spawn(courier::telemetry::serve_http(
            listener,
            stop.clone(),
            move |req: http::Request<hyper::body::Incoming>| {
                let seen = seen.clone();
                async move {
                    let path = req.uri().path().to_string();
                    let headers = req
                        .headers()
                        .iter()
                        .map(|(n, v)| {
                            let value = String::from_utf8_lossy(v.as_bytes()).into_owned();
                            (n.as_str().to_string(), value)
                        })
                        .collect();
                    let body = req.into_body().collect().await.unwrap().to_bytes();
                    let amount = serde_json::from_slice::<serde_json::Value>(&body)
                        .ok()
                        .and_then(|order| order["amount"].as_f64());
                    seen.lock().unwrap().push(Received {
                        at: Instant::now(),
                        wall: SystemTime::now(),
                        headers,
                        body,
                        path,
                    });
                    let (status, answer) = match amount {
                        Some(amount) if amount > 0.0 => (200, "taken"),
                        _ => (400, "amount must be a positive number"),
                    };
                    http::Response::builder()
                        .status(status)
                        .body(Full::new(Bytes::from(answer)))
                        .unwrap()
                }
            },
        ));
        Self {
            url,
            received,
            stop,
        }
    }

    fn received_body(&self, body: &str) -> Vec<Received> {
        self.received
            .lock()
            .unwrap()
            .iter()
            .filter(|r| r.body.as_ref() == body.as_bytes())
            .cloned()
            .collect()
    }
}

impl Drop for OrdersApp {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The dead letter of `body`, once the sidecar has written it.
async fn letter(sidecar: &mut Beside<'_>, body: &str) -> DeadLetter {
    let what = format!("the dead letter of {body}");
    sidecar
        .letter(&what, |l| l.body.as_ref() == body.as_bytes())
        .await
}

/// Two orders with an amount the app refuses (400) are dead-lettered.
/// `dlq edit --dry-run` prints the fixed document and changes nothing; a
/// patch from stdin whose `test` does not hold exits 1 and leaves the
/// letter; `dlq edit ID --patch FILE` replays the first fixed: the app
/// takes `{"amount":5,...}` with `Courier-Replay-Count: 1`, attempt 1, the
/// same Idempotency-Key and the added header, and the audit line records
/// the patch. The second, edited to an amount the app still refuses, dies
/// again: its letter says `courier-edited-from-digest` (the digest of the
/// letter it was edited from) beside its lineage. Neither first letter is
/// left.
pub async fn edit_replays_the_patched_message(fixture: Fixture) {
    let app = OrdersApp::start().await;
    let refused = r#"{"order": "A-1", "amount": -5}"#;
    let still_refused = r#"{"order": "B-2", "amount": -1}"#;
    let json = [("content-type".to_string(), "application/json".to_string())];
    // Opened first, as a deployed sidecar has: Pub/Sub counts and browses
    // through subscriptions made at the first open (see `dlq::send_all`).
    drop(fixture.open().await);
    wait_released(&fixture).await;
    let producer = fixture.producer().await;
    let id = producer.send(refused, &json).await;
    let other_id = producer.send(still_refused, &json).await;
    producer.release(&fixture).await;
    let key = format!("{}:{id}", fixture.queue);
    let mut sidecar = Beside::new(&fixture, &app.url);
    let first = letter(&mut sidecar, refused).await;
    let other = letter(&mut sidecar, still_refused).await;

    let patches = tempfile::tempdir().unwrap();
    let fix = patches.path().join("fix.json");
    std::fs::write(
        &fix,
        r#"[{"op": "test", "path": "/body/amount", "value": -5},
            {"op": "replace", "path": "/body/amount", "value": 5},
            {"op": "add", "path": "/headers/x-fixed", "value": "1"}]"#,
    )
    .unwrap();
    let fix = fix.to_str().unwrap();
    let zero = patches.path().join("zero.json");
    std::fs::write(
        &zero,
        r#"[{"op": "replace", "path": "/body/amount", "value": 0}]"#,
    )
    .unwrap();
    let zero = zero.to_str().unwrap();

    let edit = ["dlq", "edit", first.id.as_str(), "--patch"];
    let out = sidecar
        .courier(&[&edit[..], &[fix, "--dry-run"]].concat(), None)
        .await;
    assert!(out.status.success(), "{}", stderr(&out));
    let shown: serde_json::Value = serde_json::from_str(&stdout(&out)).unwrap();
    assert_eq!(
        shown,
        serde_json::json!({
            "headers": {"content-type": "application/json", "x-fixed": "1"},
            "body": {"order": "A-1", "amount": 5},
        })
    );
    let out = sidecar
        .courier(
            &[&edit[..], &["-"]].concat(),
            Some(r#"[{"op": "test", "path": "/body/amount", "value": 0}, {"op": "remove", "path": "/body/order"}]"#),
        )
        .await;
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("value did not match"),
        "{}",
        stderr(&out)
    );
    let left = json_lines(
        &sidecar
            .courier(&["dlq", "list", "--output", "json"], None)
            .await,
    );
    assert_eq!(
        left.len(),
        2,
        "a dry run and a failed patch change nothing: {left:?}"
    );
    assert_eq!(app.received_body(refused).len(), 1, "nothing was replayed");

    let out = sidecar
        .courier(&[&edit[..], &[fix, "--why", "INC-7 sign"]].concat(), None)
        .await;
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("replayed {} edited", first.id)),
        "{}",
        stdout(&out)
    );
    let audit = audit_line(&out);
    assert_eq!(audit["audit"], "edit");
    assert_eq!((&audit["selected"], &audit["done"]), (&1.into(), &1.into()));
    assert_eq!(audit["why"], "INC-7 sign");
    assert_eq!(audit["patch"][1]["value"], 5);
    assert_eq!(audit["edited_from_digest"], first.digest().as_str());
    let out = sidecar
        .courier(&["dlq", "edit", &other.id, "--patch", zero], None)
        .await;
    assert!(out.status.success(), "{}", stderr(&out));

    // The second dies again, edited; by then the first was offered too.
    let again = letter(&mut sidecar, r#"{"amount":0,"order":"B-2"}"#).await;
    let fixed = r#"{"amount":5,"order":"A-1"}"#;
    wait_for("the fixed order taken", SETTLE, async || {
        !app.received_body(fixed).is_empty()
    })
    .await;
    let source = sidecar.source().await;
    wait_settled(&source, SETTLE).await;
    drop(source);
    sidecar.stop().await;
    let taken = app.received_body(fixed);
    assert_eq!(taken.len(), 1, "{taken:?}");
    let taken = &taken[0];
    assert_eq!(taken.header("courier-replay-count"), Some("1"), "{taken:?}");
    assert_eq!(taken.attempt(), 1, "{taken:?}");
    assert_eq!(taken.header("idempotency-key"), Some(key.as_str()));
    assert_eq!(taken.header("x-fixed"), Some("1"));
    assert_eq!(taken.header("content-type"), Some("application/json"));

    assert_eq!(
        again.field("courier-edited-from-digest"),
        Some(other.digest().as_str()),
        "{again:?}"
    );
    assert_eq!(again.field("courier-replay-count"), Some("1"));
    assert_eq!(
        again.field("courier-replayed-from"),
        Some(other.id.as_str())
    );
    assert_eq!(again.field("courier-message-id"), Some(other_id.as_str()));

    let left = json_lines(&courier(&fixture, &["dlq", "list", "--output", "json"]));
    let ids: Vec<&str> = left.iter().filter_map(|l| l["id"].as_str()).collect();
    assert_eq!(ids, [again.id.as_str()], "{left:?}");
}
