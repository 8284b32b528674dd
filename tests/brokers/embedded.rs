//! The embedded queue's own behaviour, beyond the conformance suite: what it
//! does with a stored record it cannot read.

use std::time::Duration;

use crate::common::*;

const SETTLE: Duration = Duration::from_secs(20);

/// A record that cannot be decoded does not stop the queue: it is
/// dead-lettered as `undeliverable` with its raw bytes as the body, never
/// offered to the app, and the message behind it is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_record_is_dead_lettered_and_the_rest_delivered() {
    const RAW: &[u8] = b"\xc1\x00 not a stored message";
    let fixture = Fixture::embedded();
    let bad = store_raw(&fixture, RAW);
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let good = fixture.send(&source, "behind the bad one").await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;

    let received = app.received();
    assert_eq!(received.len(), 1, "only the good message reaches the app");
    assert_eq!(received[0].body.as_ref(), b"behind the bad one");
    assert_eq!(
        received[0].header("courier-message-id"),
        Some(good.as_str())
    );

    let letters = source.dead_letters(&fixture.dlq(), 100).await.unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    let letter = &letters[0];
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    assert_eq!(
        letter.field("courier-message-id"),
        Some(bad.to_string().as_str())
    );
    assert_eq!(letter.body.as_ref(), RAW, "the raw bytes are kept");
    let error = letter.field("courier-error").unwrap();
    assert!(error.contains("cannot be read"), "{error}");
}
