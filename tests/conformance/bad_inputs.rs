//! Bad inputs that reach a running sidecar, end to end, for the rows of
//! docs/bad-inputs.md that no other suite covers: a producer header HTTP
//! cannot carry as the Idempotency-Key, an unreadable Retry-After from the
//! app, and an app answer far larger than the dead-letter excerpt.

use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use courier::source::DeadLetter;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn only_dead_letter(
    source: &std::sync::Arc<dyn courier::source::Source>,
    fixture: &Fixture,
) -> DeadLetter {
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    letters.into_iter().next().unwrap()
}

/// A producer's `idempotency-key` with a line break cannot be an HTTP
/// header: the message is dead-lettered as `undeliverable` with the reason,
/// never offered to the app, and messages after it flow on.
pub async fn an_idempotency_key_http_cannot_carry_is_undeliverable(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let bad = [(
        "idempotency-key".to_string(),
        "order-1\r\nx-evil: 1".to_string(),
    )];
    if !producer.carries(&bad[0].0, &bad[0].1) {
        eprintln!(
            "skipped: a {} producer cannot publish a header with a line break",
            fixture.broker.name()
        );
        return;
    }
    producer.send("first", &bad).await;
    producer.send("second", &[]).await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert!(
        app.received_body(b"first").is_empty(),
        "never offered to the app"
    );
    assert_eq!(app.received_body(b"second").len(), 1);
    let letter = only_dead_letter(&source, &fixture).await;
    assert_eq!(letter.body, Bytes::from("first"));
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    let error = letter.field("courier-error").unwrap_or_default();
    assert!(
        error.contains("idempotency key") && error.contains("not a valid header value"),
        "{error}"
    );
}

/// Found at 21da363: a CloudEvent in structured mode (parsed by default)
/// with about 24,600 attributes, or a message with as many headers, made
/// building the request panic, and nothing settled the message. Past
/// courier's cap of 1,000 headers it is undeliverable, with the count in
/// the reason, never offered, and the next message flows. 1,500 attributes
/// fit every broker's size limit (at 21da363 they reached the app as 1,500
/// `ce-*` headers, which it refused with 431).
pub async fn more_headers_than_the_cap_is_undeliverable(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let attributes: String = (0..1500).map(|i| format!(",\"x{i}\":{i}")).collect();
    let event = format!(
        "{{\"specversion\":\"1.0\",\"id\":\"wide-1\",\"source\":\"/tests\",\"type\":\"wide\"{attributes}}}"
    );
    producer.send(event.clone(), &[]).await;
    producer.send("after the wide one", &[]).await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert!(
        app.received_body(event.as_bytes()).is_empty() && app.received().len() == 1,
        "only the next message reaches the app"
    );
    assert_eq!(app.received_body(b"after the wide one").len(), 1);
    let letter = only_dead_letter(&source, &fixture).await;
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    let error = letter.field("courier-error").unwrap_or_default();
    assert!(
        error.contains("headers") && error.contains("at most 1000"),
        "{error}"
    );
}

/// Found at 21da363: a producer's header, attribute or field named
/// `payload` replaced the body on Kafka, SQS and Pub/Sub. The body the
/// producer sent reaches the app, and the header is a header.
pub async fn a_header_named_payload_is_a_header(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let header = [("payload".to_string(), "not the body".to_string())];
    producer.send("the body", &header).await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    let received = app.received();
    assert_eq!(received.len(), 1, "{received:?}");
    assert_eq!(received[0].body, Bytes::from("the body"));
    assert_eq!(
        received[0].headers.get("payload").map(String::as_str),
        Some("not the body")
    );
}

/// `Retry-After: soon` is not a delay: it is ignored (the policy's own
/// backoff applies), counted in `courier_retry_after_invalid_total`, and the
/// message is delivered on the next attempt.
pub async fn an_unreadable_retry_after_is_ignored_and_counted(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let body = "script:503rasoon,200";
    producer.send(body, &[]).await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    let text = scrape(running.metrics_addr).await;
    running.stop().await;
    let seen = app.received_body(body.as_bytes());
    assert_eq!(seen.len(), 2);
    // fast_policy backs off 50 ms with no jitter; an honored "soon" would
    // be nothing to honor, so the backoff alone decides.
    let gap = seen[1].at.duration_since(seen[0].at);
    assert!(gap < Duration::from_secs(5), "{gap:?}");
    assert_eq!(
        metric(&text, "courier_retry_after_invalid_total", &fixture.queue),
        1.0,
        "{text}"
    );
    assert_no_dead_letters(&source, &fixture).await;
}

/// The app answers 400 with a 1 MiB body: the dead letter keeps exactly
/// the first 1 KiB of it as `courier-response-excerpt`.
pub async fn a_huge_answer_is_cut_to_the_excerpt(fixture: Fixture) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = vec![0u8; 64 * 1024];
                let _ = stream.read(&mut request).await;
                let body = "x".repeat(1 << 20);
                let head = format!(
                    "HTTP/1.1 400 Bad Request\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes()).await;
                let _ = stream.write_all(body.as_bytes()).await;
            });
        }
    });
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    producer.send("an order the app refuses", &[]).await;
    let running = Running::start_second_of_two(run_config_for(&fixture, &url, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    let letter = only_dead_letter(&source, &fixture).await;
    assert_eq!(letter.field("courier-reason"), Some("permanent-status"));
    assert_eq!(letter.field("courier-status"), Some("400"));
    assert_eq!(
        letter.field("courier-response-excerpt"),
        Some("x".repeat(courier::model::EXCERPT_LIMIT).as_str())
    );
}

/// Producer header values with a line break or non-ASCII text: the text
/// survives every trip through the broker (first delivery, a stored retry,
/// the dead letter) byte for byte; the app gets the non-ASCII value as
/// sent, and a value HTTP cannot carry (CR/LF) is left out of the request
/// instead of failing the delivery. Where a broker's own client refuses a
/// value (NATS headers hold no line breaks) the producer cannot send it.
pub async fn header_values_with_line_breaks_and_non_ascii_survive(fixture: Fixture) {
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    let wanted = [
        ("x-name".to_string(), "café ✓ Ünïcödé".to_string()),
        ("x-note".to_string(), "line one\r\nline two".to_string()),
        ("x-plain".to_string(), "kept".to_string()),
    ];
    let headers: Vec<_> = wanted
        .iter()
        .filter(|(name, value)| producer.carries(name, value))
        .cloned()
        .collect();
    let carries_crlf = headers.iter().any(|(name, _)| name == "x-note");
    producer.send("script:503,200\nretried", &headers).await;
    producer.send("script:400\nrefused", &headers).await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;

    let seen = app.received_body(b"script:503,200\nretried");
    assert_eq!(seen.len(), 2, "the first delivery and the retry");
    for r in &seen {
        assert_eq!(r.header("x-name"), Some("café ✓ Ünïcödé"), "{r:?}");
        assert_eq!(r.header("x-plain"), Some("kept"), "{r:?}");
        assert_eq!(r.header("x-note"), None, "CR/LF cannot be an HTTP value");
    }
    let letter = only_dead_letter(&source, &fixture).await;
    assert_eq!(letter.field("courier-reason"), Some("permanent-status"));
    assert_eq!(letter.field("x-name"), Some("café ✓ Ünïcödé"));
    if carries_crlf {
        assert_eq!(letter.field("x-note"), Some("line one\r\nline two"));
    }
}
