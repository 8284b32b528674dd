//! What holds for the SQS source alone, against moto in server mode
//! (`scripts/moto-server`, one per test binary): FIFO group order with a
//! retry in the middle and FIFO dead letters in their group, a retry past
//! SQS's 12 h taking the delayed-copy path, every write SQS can refuse (a
//! delete batch's partial failure, a retry copy, a dead letter, a replay)
//! losing nothing, the poison-pill rule on `ApproximateReceiveCount`, the
//! RedrivePolicy warning, and TLS on ring.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use crate::common::*;
use aws_sdk_sqs::types::QueueAttributeName;
use courier::source::{ErrorKind, Source};

const SETTLE: Duration = Duration::from_secs(60);

/// A fresh FIFO queue on the shared moto.
fn fifo_fixture() -> Fixture {
    let mut fixture = Fixture::sqs();
    fixture.queue = format!("{}.fifo", fixture.queue);
    fixture
}

/// The messages moto made with this body (its `/moto-api/data.json`,
/// which shows delayed ones that no receive shows; it keeps every message
/// object it made, deleted and received copies too, and names no queue).
fn moto_messages_with_body(body: &str) -> Vec<serde_json::Value> {
    let moto = shared_moto();
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", moto.port)).unwrap();
    write!(
        stream,
        "GET /moto-api/data.json HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let json = answer.split_once("\r\n\r\n").unwrap().1;
    let data: serde_json::Value = serde_json::from_str(json).expect("moto's data as JSON");
    data["sqs"]["Message"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|m| m["body"] == body)
        .collect()
}

/// The queue's (visible, invisible, delayed) counts.
async fn counts(fixture: &Fixture) -> (u64, u64, u64) {
    let client = sqs_client().await;
    let url = sqs_queue_url(&client, &fixture.queue).await.unwrap();
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .unwrap();
    let attributes = out.attributes().unwrap();
    let n = |name: QueueAttributeName| attributes[&name].parse::<u64>().unwrap();
    (
        n(QueueAttributeName::ApproximateNumberOfMessages),
        n(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
        n(QueueAttributeName::ApproximateNumberOfMessagesDelayed),
    )
}

/// A FIFO queue keeps each message group's order: a message retried in
/// the middle of its group holds the later ones of the group until it is
/// delivered again, while another group goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_group_order_holds_across_a_retry() {
    let fixture = fifo_fixture();
    let source = fixture.open().await;
    let app = TestApp::start().await;
    let producer = fixture.producer().await;
    let group = |g: &str| vec![("group".to_string(), g.to_string())];
    let a = [
        "a1".to_string(),
        "script:503,200\na2".to_string(),
        "a3".to_string(),
        "a4".to_string(),
    ];
    for (i, body) in a.iter().enumerate() {
        producer.send(body.clone(), &group("A")).await;
        producer.send(format!("b{i}"), &group("B")).await;
    }
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_for("every message delivered", SETTLE, async || {
        app.received().len() >= 9
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    let order: Vec<String> = app
        .received()
        .iter()
        .map(|r| {
            let body = String::from_utf8_lossy(&r.body).into_owned();
            body.rsplit('\n').next().unwrap().to_string()
        })
        .collect();
    let of = |prefix: &str| -> Vec<&str> {
        order
            .iter()
            .map(String::as_str)
            .filter(|b| b.starts_with(prefix))
            .collect()
    };
    assert_eq!(of("a"), ["a1", "a2", "a2", "a3", "a4"], "{order:?}");
    assert_eq!(of("b"), ["b0", "b1", "b2", "b3"], "{order:?}");
    let retried: Vec<u32> = app
        .received_body(a[1].as_bytes())
        .iter()
        .map(Received::attempt)
        .collect();
    assert_eq!(retried, [1, 2]);
}

/// A retry further off than SQS keeps a message invisible (12 h) is a copy
/// sent with the longest DelaySeconds and the due time; the original is
/// deleted once SQS took it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_past_twelve_hours_is_a_delayed_copy() {
    let fixture = Fixture::sqs();
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let body = format!("later {}", fixture.queue);
    let id = producer
        .send(body.clone(), &[("x-trace".to_string(), "t1".to_string())])
        .await;
    let delivery = receive_one(&source).await;
    let first = SystemTime::now();
    let due = first + Duration::from_secs(13 * 3600);
    source.retry(&delivery, 2, first, due).await.unwrap();

    assert_eq!(
        counts(&fixture).await,
        (0, 0, 1),
        "only the delayed copy is left"
    );
    let copies: Vec<_> = moto_messages_with_body(&body)
        .into_iter()
        .filter(|m| m["id"].as_str() != Some(id.as_str()))
        .collect();
    assert_eq!(copies.len(), 1, "{copies:#?}");
    let copy = &copies[0];
    assert_eq!(copy["delayed"], true, "{copy:#}");
    let sent = copy["sent_timestamp"].as_f64().unwrap();
    let until = copy["delayed_until"].as_f64().unwrap();
    assert!(
        (until - sent - 900_000.0).abs() < 2_000.0,
        "delayed for 15 min: {copy:#}"
    );
    let attributes = &copy["message_attributes"];
    assert_eq!(attributes["x-trace"]["StringValue"], "t1", "{copy:#}");
    let record: serde_json::Value = serde_json::from_str(
        attributes["courier-record"]["StringValue"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(record["courier-attempt"], "2");
    assert_eq!(record["courier-message-id"], id.as_str());
    assert_eq!(
        record["courier-retry-at"],
        courier::model::rfc3339(due).as_str()
    );
    assert!(record["courier-seal"].is_string(), "sealed: {record}");
}

/// Receives the one message of the queue.
async fn receive_one(source: &Arc<dyn Source>) -> courier::source::Delivery {
    let mut got = Vec::new();
    for _ in 0..20 {
        got = source.receive(1).await.unwrap();
        if !got.is_empty() {
            break;
        }
    }
    assert_eq!(got.len(), 1);
    got.remove(0)
}

/// Makes the queue `queue` refuse messages over 1 KiB from now on, so that
/// a write of a 2,000-byte body fails the way a refused one does on SQS.
async fn refuse_bodies_over_1_kib(queue: &str) {
    let client = sqs_client().await;
    let url = sqs_queue_url(&client, queue).await.unwrap();
    client
        .set_queue_attributes()
        .queue_url(&url)
        .attributes(QueueAttributeName::MaximumMessageSize, "1024")
        .send()
        .await
        .unwrap();
}

/// A retry copy SQS refuses as too large (here larger than the queue now
/// takes) leaves the original in flight, invisible, for the letter that
/// fits the dispatcher writes next (`dispatch::deliver`); that letter
/// settles it, and nothing else is left in either queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_sqs_refuses_as_too_large_waits_for_the_letter_that_fits() {
    let fixture = Fixture::sqs();
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let body = "x".repeat(2000);
    let id = producer.send(body.clone(), &[]).await;
    let delivery = receive_one(&source).await;
    refuse_bodies_over_1_kib(&fixture.queue).await;
    let now = SystemTime::now();
    let err = source
        .retry(&delivery, 2, now, now + Duration::from_secs(13 * 3600))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert!(err.to_string().contains("must be shorter than"), "{err}");
    assert_eq!(
        counts(&fixture).await,
        (0, 1, 0),
        "only the original, still in flight"
    );
    settle_with_a_cut_letter(&fixture, &source, &delivery, &id).await;
}

/// The letter that fits, written for `delivery` as the dispatcher would:
/// it settles the original, and it is the only dead letter.
async fn settle_with_a_cut_letter(
    fixture: &Fixture,
    source: &Arc<dyn Source>,
    delivery: &courier::source::Delivery,
    id: &str,
) {
    let mut failure = fixture.failure_of(id);
    failure.cut = Some("the body is left out".into());
    source.dead_letter(delivery, &failure).await.unwrap();
    assert_eq!(counts(fixture).await, (0, 0, 0), "the original is settled");
    let letters = fixture.dead_letters(source).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert!(letters[0].body.is_empty());
    assert_eq!(
        letters[0].field("courier-cut"),
        Some("the body is left out")
    );
}

/// A `DeleteMessageBatch` in which SQS refuses one entry fails only that
/// ack; its message stays in the queue, the others are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_batch_partial_failure_fails_only_its_ack() {
    let fixture = Fixture::sqs();
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let kept = producer.send("kept", &[]).await;
    let mut got = Vec::new();
    while got.len() < 3 {
        if got.is_empty() {
            producer.send("acked-1", &[]).await;
            producer.send("acked-2", &[]).await;
        }
        got.extend(source.receive(3).await.unwrap());
    }
    let (refused, good): (Vec<_>, Vec<_>) = got.into_iter().partition(|d| d.message.id == kept);
    let mut stale = refused[0].clone();
    stale.receipt = format!("{}-stale", stale.receipt);
    let (a, b, c) = tokio::join!(
        source.ack(&good[0]),
        source.ack(&stale),
        source.ack(&good[1])
    );
    assert!(a.is_ok() && c.is_ok(), "{a:?} {c:?}");
    let err = b.unwrap_err().to_string();
    assert!(err.contains("did not delete"), "{err}");
    assert_eq!(
        counts(&fixture).await,
        (0, 1, 0),
        "only the refused one is left"
    );
    drop(kept);
}

/// A native RedrivePolicy that would move a message before the policy's
/// attempts are used up is warned about at start and again when a policy
/// change makes it so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_policy_below_max_attempts_is_warned_about() {
    let fixture = Fixture::sqs();
    let client = sqs_client().await;
    let native = client
        .create_queue()
        .queue_name(format!("{}-native", fixture.queue))
        .send()
        .await
        .unwrap();
    let native_arn = client
        .get_queue_attributes()
        .queue_url(native.queue_url().unwrap())
        .attribute_names(QueueAttributeName::QueueArn)
        .send()
        .await
        .unwrap()
        .attributes()
        .unwrap()[&QueueAttributeName::QueueArn]
        .clone();
    client
        .create_queue()
        .queue_name(&fixture.queue)
        .attributes(
            QueueAttributeName::RedrivePolicy,
            format!(r#"{{"deadLetterTargetArn":"{native_arn}","maxReceiveCount":"4"}}"#),
        )
        .send()
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("policy.yaml");
    let doc = |max: u32| {
        format!(
            "apiVersion: courier.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: orders\nspec:\n  maxAttempts: {max}\n"
        )
    };
    std::fs::write(&path, doc(5)).unwrap();
    let app = TestApp::start().await;
    let args = run_args(&fixture, &app, &path, "redrive");
    let mut child = courier_command()
        .arg("run")
        .args(&args)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let reader = {
        let stderr = child.stderr.take().unwrap();
        let lines = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                lines.lock().unwrap().push(line);
            }
        })
    };
    let warnings = |max: u32| {
        lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("RedrivePolicy") && l.contains(&format!("maxAttempts {max}")))
            .count()
    };
    let shown = || lines.lock().unwrap().join("\n");
    wait_for("the warning at start", SETTLE, async || {
        warnings(5) == 1 || child.try_wait().unwrap().is_some()
    })
    .await;
    assert_eq!(warnings(5), 1, "{}", shown());
    let applied = || {
        lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("policy change applied"))
            .count()
    };
    std::fs::write(&path, doc(3)).unwrap();
    wait_for("the change to 3 attempts", SETTLE, async || applied() >= 1).await;
    // A later modification time than the last write's, whatever the
    // file system's granularity: a probe written now shows when the
    // clock the file system stamps with has moved on.
    let last = std::fs::metadata(&path).unwrap().modified().unwrap();
    let probe = path.with_extension("probe");
    wait_for("the file system's clock to move on", SETTLE, async || {
        std::fs::write(&probe, b"").unwrap();
        std::fs::metadata(&probe).unwrap().modified().unwrap() > last
    })
    .await;
    std::fs::write(&path, doc(6)).unwrap();
    wait_for("the warning on the policy change", SETTLE, async || {
        applied() >= 2 && warnings(6) == 1
    })
    .await;
    assert_eq!(warnings(3), 0, "3 attempts fit in 4 receives");
    assert!(
        lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(&native_arn)),
        "the warning names the native dead-letter queue"
    );
    let _ = child.kill();
    let _ = child.wait();
    reader.join().unwrap();
}

/// The SDK's HTTPS client is rustls on ring, kube's provider: courier
/// reaching an HTTPS endpoint fails with what is wrong (here, a plain HTTP
/// server behind it), not with rustls' panic about two crypto providers.
#[test]
fn https_to_sqs_uses_ring_without_a_panic() {
    let moto = shared_moto();
    let out = courier_command()
        .args(["send", "--source", "sqs://us-east-1", "--queue", "q", "x"])
        .env(
            "AWS_ENDPOINT_URL",
            format!("https://127.0.0.1:{}", moto.port),
        )
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot reach the broker"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A message SQS handed out more than `maxAttempts + 2` times without a
/// settlement (consumers that crashed on it) is dead-lettered as
/// undeliverable by SQS's own `ApproximateReceiveCount`, never offered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_pill_is_dead_lettered_by_the_receive_count() {
    let fixture = Fixture::sqs();
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let id = producer.send("poison", &[]).await;
    let client = sqs_client().await;
    let url = sqs_queue_url(&client, &fixture.queue).await.unwrap();
    let policy = fast_policy();
    for _ in 0..policy.max_deliveries() {
        let got = client
            .receive_message()
            .queue_url(&url)
            .visibility_timeout(0)
            .send()
            .await
            .unwrap();
        assert_eq!(got.messages().len(), 1);
    }
    let app = TestApp::start().await;
    let running = Running::start(run_config(&fixture, &app, policy)).await;
    wait_for("the dead letter", SETTLE, async || {
        !fixture.dead_letters(&source).await.is_empty()
    })
    .await;
    running.stop().await;
    assert!(app.received().is_empty(), "never offered");
    let letter = fixture.dead_letters(&source).await.remove(0);
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    assert_eq!(letter.field("courier-message-id"), Some(id.as_str()));
    assert!(
        letter
            .field("courier-error")
            .unwrap()
            .contains("received 6 times"),
        "{letter:?}"
    );
}

/// A dead letter the dead-letter queue refuses as too large leaves the
/// original in flight and nothing half-written; the letter that fits the
/// dispatcher writes next settles it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_sqs_refuses_as_too_large_waits_for_the_letter_that_fits() {
    let fixture = Fixture::sqs();
    let source = fixture.open().await;
    let client = sqs_client().await;
    let dlq = courier::source::sqs::dead_letter_queue_name(&fixture.dlq());
    client
        .create_queue()
        .queue_name(&dlq)
        .attributes(QueueAttributeName::MaximumMessageSize, "1024")
        .send()
        .await
        .unwrap();
    let producer = fixture.producer().await;
    let id = producer.send("y".repeat(2000), &[]).await;
    let delivery = receive_one(&source).await;
    let err = source
        .dead_letter(&delivery, &fixture.failure_of(&id))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::TooLarge, "{err}");
    assert_eq!(counts(&fixture).await, (0, 1, 0), "the original stays");
    assert!(fixture.dead_letters(&source).await.is_empty());
    settle_with_a_cut_letter(&fixture, &source, &delivery, &id).await;
}

/// A replay the work queue refuses leaves the letter in the dead-letter
/// queue, listed as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_sqs_refuses_leaves_the_letter() {
    let fixture = Fixture::sqs();
    let source = fixture.open().await;
    let app = TestApp::start().await;
    let producer = fixture.producer().await;
    producer
        .send(format!("script:400\n{}", "z".repeat(2000)), &[])
        .await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_for("the dead letter", SETTLE, async || {
        fixture.dead_letters(&source).await.len() == 1
    })
    .await;
    running.stop().await;
    refuse_bodies_over_1_kib(&fixture.queue).await;
    let letter = fixture.dead_letters(&source).await.remove(0);
    let err = source.replay(&fixture.dlq(), &letter).await.unwrap_err();
    assert!(err.to_string().contains("sending to SQS"), "{err}");
    let left = fixture.dead_letters(&source).await;
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].id, letter.id);
    assert_eq!(
        counts(&fixture).await,
        (0, 0, 0),
        "nothing reached the work queue"
    );
}

/// A FIFO queue's dead letters go to `<name>-dlq.fifo` in their group, and
/// a replay sends them back to that group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_dead_letters_keep_their_group() {
    let fixture = fifo_fixture();
    let source = fixture.open().await;
    let app = TestApp::start().await;
    let producer = fixture.producer().await;
    producer
        .send("script:400\nrefused", &[("group".into(), "G7".into())])
        .await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_for("the dead letter", SETTLE, async || {
        fixture.dead_letters(&source).await.len() == 1
    })
    .await;
    running.stop().await;
    let dlq = courier::source::sqs::dead_letter_queue_name(&fixture.dlq());
    assert!(dlq.ends_with("-dlq.fifo"), "{dlq}");
    let letter = fixture.dead_letters(&source).await.remove(0);
    assert_eq!(letter.field("courier-group"), Some("G7"));
    assert_eq!(letter.field("courier-reason"), Some("permanent-status"));
    source.replay(&fixture.dlq(), &letter).await.unwrap();
    let client = sqs_client().await;
    let url = sqs_queue_url(&client, &fixture.queue).await.unwrap();
    let back = sqs_messages(&client, &url).await;
    assert_eq!(back.len(), 1);
    let group = back[0]
        .attributes()
        .and_then(|a| a.get(&aws_sdk_sqs::types::MessageSystemAttributeName::MessageGroupId))
        .cloned();
    assert_eq!(group.as_deref(), Some("G7"));
    assert!(fixture.dead_letters(&source).await.is_empty());
}
