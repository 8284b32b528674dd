//! CloudEvents end to end (issue 20 part 1): messages on the embedded queue
//! (and, sent by each broker's own client, on Redis, RabbitMQ and NATS),
//! offered by courier to a real app on loopback that reads every request
//! with the CloudEvents Python SDK (`scripts/cloudevents-app`, which installs
//! the pinned SDK into `.venv-cloudevents/` on first use). What the SDK reads
//! is what a user's app would read.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use clap::ValueEnum;
use courier::forward::cloudevents::Mode;
use serde_json::{Value, json};

const SETTLE: Duration = Duration::from_secs(30);

/// The SDK app; stopped (by its process id) when dropped.
struct SdkApp {
    child: Child,
    port: u16,
    records: Arc<Mutex<Vec<Value>>>,
}

impl SdkApp {
    fn start() -> Self {
        let mut child = Command::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/cloudevents-app"
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start scripts/cloudevents-app");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().and_then(Result::ok).unwrap_or_default();
        let port = first
            .strip_prefix("READY ")
            .and_then(|p| p.trim().parse().ok())
            .unwrap_or_else(|| panic!("scripts/cloudevents-app did not start: {first:?}"));
        let records = Arc::new(Mutex::new(Vec::new()));
        let sink = records.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let record: Value = serde_json::from_str(&line).expect("a JSON line");
                sink.lock().unwrap().push(record);
            }
        });
        Self {
            child,
            port,
            records,
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/", self.port)
    }

    /// Waits for `n` requests and returns every one so far.
    async fn wait_for(&self, n: usize) -> Vec<Value> {
        wait_for(&format!("{n} requests at the app"), SETTLE, async || {
            self.records.lock().unwrap().len() >= n
        })
        .await;
        self.records.lock().unwrap().clone()
    }
}

impl Drop for SdkApp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The request whose body or event carries `marker` (an event id or a body).
fn request<'a>(records: &'a [Value], marker: &str) -> &'a Value {
    records
        .iter()
        .find(|r| {
            r["event"]["attributes"]["id"] == marker
                || body(r).as_ref() == marker.as_bytes()
                || r["headers"]["courier-message-id"] == marker
        })
        .unwrap_or_else(|| panic!("no request for {marker:?} in {records:#?}"))
}

fn body(record: &Value) -> Bytes {
    Bytes::from(
        BASE64
            .decode(record["body_base64"].as_str().unwrap())
            .unwrap(),
    )
}

fn header<'a>(record: &'a Value, name: &str) -> Option<&'a str> {
    record["headers"][name].as_str()
}

fn ce_headers(record: &Value) -> Vec<&str> {
    let mut names: Vec<&str> = record["headers"]
        .as_object()
        .unwrap()
        .keys()
        .map(String::as_str)
        .filter(|n| n.starts_with("ce-"))
        .collect();
    names.sort();
    names
}

/// The attributes the SDK read, without `time`, which the SDK fills in
/// with its own clock when an event has none.
fn attributes(record: &Value, keep_time: bool) -> Value {
    let mut attributes = record["event"]["attributes"].clone();
    if !keep_time {
        attributes.as_object_mut().unwrap().remove("time");
    }
    attributes
}

fn headers(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect()
}

/// A structured event: the body is the event in the JSON format.
const STRUCTURED: &str = r#"{"specversion":"1.0","id":"order-1","source":"/shop/orders","type":"com.example.order.created","subject":"42","priority":7,"datacontenttype":"application/json","data":{"order":42,"items":["a","b"]}}"#;

/// A binary message's event: its attributes as `ce-*` headers, the body
/// (`paid in full`) its data.
fn payment_headers() -> Vec<(String, String)> {
    headers(&[
        ("ce-specversion", "1.0"),
        ("ce-id", "pay-9"),
        ("ce-source", "urn:shop:payments"),
        ("ce-type", "com.example.payment.settled"),
        ("ce-note", "50% off"),
        ("content-type", "text/plain"),
    ])
}

/// The SDK read the binary message's event (`pay-9`), in either mode, and
/// its key is `<source>:<id>`.
fn assert_payment_read(r: &Value) {
    assert_eq!(
        attributes(r, false),
        json!({"specversion": "1.0", "id": "pay-9", "source": "urn:shop:payments",
               "type": "com.example.payment.settled", "note": "50% off",
               "datacontenttype": "text/plain"})
    );
    assert_eq!(r["event"]["data"], "paid in full");
    assert_eq!(
        header(r, "idempotency-key"),
        Some("urn:shop:payments:pay-9")
    );
}

/// Sends the three kinds of message: a structured event, a binary one
/// (ce-* headers, the body its data), and a message that is no event.
/// Returns the plain message's broker id.
async fn send_three(fixture: &Fixture) -> String {
    let source = fixture.open().await;
    source
        .send(
            Bytes::from_static(STRUCTURED.as_bytes()),
            &headers(&[("x-tenant", "t1")]),
        )
        .await
        .unwrap();
    source
        .send(Bytes::from_static(b"paid in full"), &payment_headers())
        .await
        .unwrap();
    let plain = source
        .send(
            Bytes::from_static(br#"{"id":42,"specversion":"is a field here too"}"#),
            &headers(&[("content-type", "text/plain"), ("x-tenant", "t2")]),
        )
        .await
        .unwrap();
    release(fixture, source).await;
    plain
}

async fn deliver_three(mode: Mode) -> (Fixture, Vec<Value>, String) {
    let app = SdkApp::start();
    let fixture = Fixture::embedded();
    let plain = send_three(&fixture).await;
    let mut config = run_config_for(&fixture, &app.url(), fast_policy());
    config.app.cloudevents = mode;
    let running = Running::start(config).await;
    let records = app.wait_for(3).await;
    running.stop().await;
    (fixture, records, plain)
}

/// The plain message reaches the app as it was sent, in every mode.
fn assert_untouched(fixture: &Fixture, records: &[Value], plain: &str) {
    let r = request(records, plain);
    assert_eq!(
        body(r).as_ref(),
        br#"{"id":42,"specversion":"is a field here too"}"#
    );
    assert_eq!(header(r, "content-type"), Some("text/plain"));
    assert_eq!(header(r, "x-tenant"), Some("t2"));
    assert!(ce_headers(r).is_empty(), "{r:#}");
    assert_eq!(
        header(r, "idempotency-key"),
        Some(format!("{}:{plain}", fixture.queue).as_str())
    );
}

#[tokio::test]
async fn binary_mode_is_the_default_and_the_sdk_reads_each_event() {
    assert_eq!(Mode::default(), Mode::Binary);
    let (fixture, records, plain) = deliver_three(Mode::default()).await;

    let r = request(&records, "order-1");
    assert_eq!(
        ce_headers(r),
        [
            "ce-id",
            "ce-priority",
            "ce-source",
            "ce-specversion",
            "ce-subject",
            "ce-type"
        ]
    );
    assert_eq!(header(r, "content-type"), Some("application/json"));
    assert_eq!(body(r).as_ref(), br#"{"order":42,"items":["a","b"]}"#);
    assert_eq!(
        attributes(r, false),
        json!({"specversion": "1.0", "id": "order-1", "source": "/shop/orders",
               "type": "com.example.order.created", "subject": "42", "priority": "7",
               "datacontenttype": "application/json"})
    );
    assert_eq!(
        r["event"]["data"],
        json!({"order": 42, "items": ["a", "b"]})
    );
    assert_eq!(
        header(r, "idempotency-key"),
        Some("/shop/orders:order-1"),
        "an event's key is <source>:<id>"
    );
    assert_eq!(
        header(r, "x-tenant"),
        Some("t1"),
        "other headers still pass"
    );

    let r = request(&records, "pay-9");
    assert_eq!(body(r).as_ref(), b"paid in full");
    assert_eq!(header(r, "ce-note"), Some("50%25%20off"), "percent-encoded");
    assert_payment_read(r);

    assert_untouched(&fixture, &records, &plain);
}

#[tokio::test]
async fn structured_mode_sends_the_event_in_the_json_format() {
    let (fixture, records, plain) = deliver_three(Mode::Structured).await;

    let r = request(&records, "order-1");
    assert_eq!(
        header(r, "content-type"),
        Some("application/cloudevents+json")
    );
    assert!(ce_headers(r).is_empty(), "{r:#}");
    assert_eq!(
        body(r).as_ref(),
        STRUCTURED.as_bytes(),
        "a structured message is sent as it is"
    );
    assert_eq!(
        attributes(r, false),
        json!({"specversion": "1.0", "id": "order-1", "source": "/shop/orders",
               "type": "com.example.order.created", "subject": "42", "priority": 7,
               "datacontenttype": "application/json"})
    );
    assert_eq!(
        r["event"]["data"],
        json!({"order": 42, "items": ["a", "b"]})
    );
    assert_eq!(header(r, "idempotency-key"), Some("/shop/orders:order-1"));

    let r = request(&records, "pay-9");
    assert_eq!(
        header(r, "content-type"),
        Some("application/cloudevents+json")
    );
    assert!(ce_headers(r).is_empty(), "{r:#}");
    assert_payment_read(r);

    assert_untouched(&fixture, &records, &plain);
}

#[tokio::test]
async fn off_offers_every_message_as_it_is() {
    let (fixture, records, plain) = deliver_three(Mode::Off).await;
    let r = request(&records, STRUCTURED);
    assert_eq!(header(r, "content-type"), Some("application/octet-stream"));
    assert!(ce_headers(r).is_empty(), "{r:#}");
    let r = request(&records, "paid in full");
    assert_eq!(header(r, "ce-id"), Some("pay-9"), "headers as they were");
    assert_eq!(header(r, "ce-note"), Some("50% off"));
    let key = header(r, "idempotency-key").unwrap();
    assert!(key.starts_with(&format!("{}:", fixture.queue)), "{key}");
    assert_untouched(&fixture, &records, &plain);
}

/// Each broker's own client carries an event: as `ce-*` headers (Redis
/// fields, AMQP headers with the content type as the property, NATS
/// headers, SQS message attributes) and as a structured body; the SDK reads both in binary mode.
async fn a_brokers_own_client_carries_an_event(kind: BrokerKind) {
    let app = SdkApp::start();
    let fixture = Fixture::of(kind);
    let producer = fixture.producer().await;
    producer
        .send(Bytes::from_static(b"paid in full"), &payment_headers())
        .await;
    producer
        .send(Bytes::from_static(STRUCTURED.as_bytes()), &[])
        .await;
    producer.release(&fixture).await;
    let running = Running::start(run_config_for(&fixture, &app.url(), fast_policy())).await;
    let records = app.wait_for(2).await;
    running.stop().await;
    assert_payment_read(request(&records, "pay-9"));
    let r = request(&records, "order-1");
    assert_eq!(
        r["event"]["attributes"]["type"],
        "com.example.order.created"
    );
    assert_eq!(
        r["event"]["data"],
        json!({"order": 42, "items": ["a", "b"]})
    );
}

#[tokio::test]
async fn redis_fields_carry_an_event() {
    a_brokers_own_client_carries_an_event(BrokerKind::Redis).await;
}

#[tokio::test]
async fn amqp_headers_carry_an_event() {
    a_brokers_own_client_carries_an_event(BrokerKind::Amqp).await;
}

#[tokio::test]
async fn nats_headers_carry_an_event() {
    a_brokers_own_client_carries_an_event(BrokerKind::Nats).await;
}

#[tokio::test]
async fn sqs_message_attributes_carry_an_event() {
    a_brokers_own_client_carries_an_event(BrokerKind::Sqs).await;
}

/// A producer's own Idempotency-Key wins over `<source>:<id>`.
#[tokio::test]
async fn the_producers_idempotency_key_wins() {
    let app = SdkApp::start();
    let fixture = Fixture::embedded();
    let source = fixture.open().await;
    source
        .send(
            Bytes::from_static(STRUCTURED.as_bytes()),
            &headers(&[("idempotency-key", "mine-1")]),
        )
        .await
        .unwrap();
    release(&fixture, source).await;
    let running = Running::start(run_config_for(&fixture, &app.url(), fast_policy())).await;
    let records = app.wait_for(1).await;
    running.stop().await;
    assert_eq!(header(&records[0], "idempotency-key"), Some("mine-1"));
}

/// The same event published twice (same source and id, two messages) is
/// one delivery under `--dedup-window`: the window remembers the event's
/// key, `<source>:<id>`.
#[tokio::test]
async fn the_dedup_window_knows_an_event_by_source_and_id() {
    let app = SdkApp::start();
    let fixture = Fixture::embedded();
    let source = fixture.open().await;
    for _ in 0..2 {
        source
            .send(Bytes::from_static(STRUCTURED.as_bytes()), &[])
            .await
            .unwrap();
    }
    let mut config = run_config_for(&fixture, &app.url(), fast_policy());
    config.delivery.dedup_window = Some(Duration::from_secs(60));
    // One at a time: the second is checked after the first was acked.
    config.options.concurrency = 1;
    let running = Running::start(config).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    release(&fixture, source).await;
    let records = app.records.lock().unwrap().clone();
    assert_eq!(records.len(), 1, "{records:#?}");
    assert_eq!(
        header(&records[0], "idempotency-key"),
        Some("/shop/orders:order-1")
    );
}

/// An event the app refuses (400) is dead-lettered as it was sent, body and
/// ce-* headers, with the courier-* record beside them; one that claims to
/// be an event and is not a valid one is dead-lettered `undeliverable` with
/// what is wrong, without reaching the app.
#[tokio::test]
async fn a_dead_lettered_event_is_intact() {
    let app = SdkApp::start();
    let fixture = Fixture::embedded();
    let source = fixture.open().await;
    let structured_id = source
        .send(
            Bytes::from_static(STRUCTURED.as_bytes()),
            &headers(&[("x-answer", "400")]),
        )
        .await
        .unwrap();
    let mut binary = payment_headers();
    binary.extend(headers(&[("x-answer", "400")]));
    let binary_id = source
        .send(Bytes::from_static(b"paid in full"), &binary)
        .await
        .unwrap();
    let invalid = r#"{"specversion":"1.0","id":"x-1","type":"t","data":1}"#;
    let invalid_id = source
        .send(Bytes::from_static(invalid.as_bytes()), &[])
        .await
        .unwrap();
    release(&fixture, source).await;

    let running = Running::start(run_config_for(&fixture, &app.url(), fast_policy())).await;
    app.wait_for(2).await;
    let source = fixture.open().await;
    wait_for("three dead letters", SETTLE, async || {
        fixture.dead_letters(&source).await.len() == 3
    })
    .await;
    let letters = fixture.dead_letters(&source).await;
    running.stop().await;
    let letter = |id: &str| {
        letters
            .iter()
            .find(|l| l.field("courier-message-id") == Some(id))
            .unwrap_or_else(|| panic!("no dead letter of {id}: {letters:#?}"))
    };

    let l = letter(&structured_id);
    assert_eq!(l.body.as_ref(), STRUCTURED.as_bytes());
    assert_eq!(l.field("courier-reason"), Some("permanent-status"));
    assert_eq!(l.field("courier-status"), Some("400"));
    assert!(l.fields.iter().all(|(n, _)| !n.starts_with("ce-")));

    let l = letter(&binary_id);
    assert_eq!(l.body.as_ref(), b"paid in full");
    for (name, value) in &binary {
        assert_eq!(l.field(name), Some(value.as_str()), "{name}");
    }
    assert_eq!(l.field("courier-reason"), Some("permanent-status"));

    let l = letter(&invalid_id);
    assert_eq!(l.body.as_ref(), invalid.as_bytes());
    assert_eq!(l.field("courier-reason"), Some("undeliverable"));
    let error = l.field("courier-error").unwrap();
    assert!(
        error.contains("not a valid CloudEvent: \"source\" is missing"),
        "{error}"
    );
    assert_eq!(
        app.records.lock().unwrap().len(),
        2,
        "the invalid one never reached the app"
    );
    release(&fixture, source).await;
}

#[tokio::test]
async fn courier_send_cloudevent_builds_one() {
    let app = SdkApp::start();
    let fixture = Fixture::embedded();
    let send = |args: &[&str]| courier_send(&fixture, args);
    let out = send(&[
        "--cloudevent",
        "--ce-type",
        "com.example.ping",
        "--header",
        "content-type=application/json",
        "--header",
        "ce-subject=s-1",
        r#"{"ping":1}"#,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = send(&[
        "--cloudevent",
        "--ce-id",
        "fixed",
        "--ce-source",
        "urn:me",
        "hello",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    for (args, want) in [
        (&["--ce-id", "1", "x"][..], "--cloudevent"),
        (
            &["--cloudevent", "--header", "ce-id=1", "x"][..],
            "use --ce-id",
        ),
        (
            &["--cloudevent", "--ce-type", "", "x"][..],
            "--ce-type is empty",
        ),
    ] {
        let out = send(args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    }

    let running = Running::start(run_config_for(&fixture, &app.url(), fast_policy())).await;
    let records = app.wait_for(2).await;
    running.stop().await;

    let r = records
        .iter()
        .find(|r| r["event"]["attributes"]["type"] == "com.example.ping")
        .expect("the first event");
    let attributes = &r["event"]["attributes"];
    assert_eq!(attributes["source"], "/courier/send", "the default source");
    assert_eq!(attributes["subject"], "s-1");
    assert_eq!(attributes["datacontenttype"], "application/json");
    let id = attributes["id"].as_str().unwrap();
    assert!(
        id.len() == 36 && id.as_bytes()[14] == b'4',
        "a random UUID by default: {id}"
    );
    let time = header(r, "ce-time").expect("send stamps the time");
    assert!(time.starts_with("20") && time.ends_with('Z'), "{time}");
    assert_eq!(r["event"]["data"], json!({"ping": 1}));
    assert_eq!(
        header(r, "idempotency-key"),
        Some(format!("/courier/send:{id}").as_str())
    );

    let r = request(&records, "fixed");
    assert_eq!(r["event"]["attributes"]["source"], "urn:me");
    assert_eq!(
        r["event"]["attributes"]["type"], "dev.courier.send",
        "the default type"
    );
    assert_eq!(r["event"]["data"], "hello");
}

/// The injector checks `courier.dev/cloudevents` against its own copy of
/// the flag's words (it does not import the HTTP client); they must agree.
#[test]
fn the_annotation_takes_the_flags_words() {
    use courier::inject::flags::{Kind, PASSTHROUGH};
    let annotation = PASSTHROUGH
        .iter()
        .find(|p| p.annotation == "courier.dev/cloudevents")
        .expect("a passthrough annotation");
    assert_eq!(annotation.env, "COURIER_CLOUDEVENTS");
    assert_eq!(annotation.kind, Kind::OneOf(&Mode::NAMES));
    let names: Vec<String> = Mode::value_variants()
        .iter()
        .map(|m| m.to_possible_value().unwrap().get_name().to_string())
        .collect();
    assert_eq!(names, Mode::NAMES);
}
