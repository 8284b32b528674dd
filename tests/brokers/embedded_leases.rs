//! The embedded queue's leases and reads: a delivery kept alive is not
//! handed out again, live settings take effect, a message handed out too
//! often without being settled is dead-lettered by the lease count, and
//! reads are bounded in bytes.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use crate::common::*;
use bytes::Bytes;
use courier::model::{DeadLetter, Delivery};
use courier::source::{self, LiveSettings, Source, SourceOptions};

/// Opens the fixture's queue with these options changed.
async fn open_with(fixture: &Fixture, change: impl FnOnce(&mut SourceOptions)) -> Arc<dyn Source> {
    let mut options = SourceOptions::new(&fixture.queue);
    options.create = true;
    change(&mut options);
    source::open(&fixture.url, options).await.expect("open")
}

/// Receives until something comes (or `limit` passes).
async fn receive_some(source: &Arc<dyn Source>, limit: Duration) -> Vec<Delivery> {
    let deadline = Instant::now() + limit;
    loop {
        let got = source.receive(10).await.unwrap();
        if !got.is_empty() || Instant::now() >= deadline {
            return got;
        }
    }
}

async fn letters(source: &Arc<dyn Source>, dlq: &str) -> Vec<DeadLetter> {
    source.dead_letters(dlq, 100).await.unwrap()
}

/// A delivery the app is still working on is kept alive, and is not handed
/// out again after the visibility timeout it was handed out with, nor
/// after several; settled at last, it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_kept_alive_is_not_handed_out_again() {
    const VISIBILITY: Duration = Duration::from_millis(300);
    let fixture = Fixture::embedded();
    let source = open_with(&fixture, |o| o.live.visibility_timeout = VISIBILITY).await;
    fixture.send(&source, "slow work").await;
    let got = source.receive(1).await.unwrap();
    assert_eq!(got.len(), 1);
    let handed_out = Instant::now();
    // Kept alive at once (the lease may still be in memory) and then well
    // within the visibility timeout, as the dispatcher does.
    let keeper = tokio::spawn({
        let (source, got) = (source.clone(), got.clone());
        async move {
            loop {
                source.keep_alive(&got).await.unwrap();
                tokio::time::sleep(VISIBILITY / 4).await;
            }
        }
    });
    // Each receive waits about a second for something to come.
    while handed_out.elapsed() < VISIBILITY * 6 {
        let again = source.receive(10).await.unwrap();
        assert!(
            again.is_empty(),
            "handed out again {:?} after the first hand-out while kept alive: {again:?}",
            handed_out.elapsed()
        );
    }
    keeper.abort();
    let _ = keeper.await;
    source.ack(&got[0]).await.unwrap();
    let depth = source.depth().await.unwrap();
    assert_eq!((depth.ready, depth.pending), (Some(0), 0), "{depth:?}");

    // Not kept alive any more, a delivery is handed out again.
    fixture.send(&source, "abandoned").await;
    let first = source.receive(1).await.unwrap();
    source.keep_alive(&first).await.unwrap();
    let again = receive_some(&source, Duration::from_secs(5)).await;
    assert_eq!(again.len(), 1, "handed out again once its lease ran out");
    assert_eq!(again[0].attempt, 2);
    source.ack(&again[0]).await.unwrap();
}

/// A delivery kept alive after its lease was written to the file (past the
/// 20 ms flush) still settles by its receipt: a retry comes back as the
/// next attempt, a dead letter is written, and nothing stays leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_alive_delivery_settles_by_retry_and_dead_letter() {
    let fixture = Fixture::embedded();
    let source = open_with(&fixture, |o| {
        o.live.visibility_timeout = Duration::from_secs(30)
    })
    .await;
    fixture.send(&source, "retried").await;
    fixture.send(&source, "dead").await;
    let got = source.receive(2).await.unwrap();
    assert_eq!(got.len(), 2);
    // Written to `leased` by the next flush, then kept alive twice.
    source.close().await;
    source.keep_alive(&got).await.unwrap();
    source.keep_alive(&got).await.unwrap();

    let now = SystemTime::now();
    source.retry(&got[0], 2, now, now).await.unwrap();
    let failure = fixture.failure_of(&got[1].message.id);
    source.dead_letter(&got[1], &failure).await.unwrap();
    let again = receive_some(&source, Duration::from_secs(5)).await;
    assert_eq!(again.len(), 1, "{again:?}");
    assert_eq!(
        (again[0].message.body.as_ref(), again[0].attempt),
        (&b"retried"[..], 2)
    );
    source.ack(&again[0]).await.unwrap();
    let letters = letters(&source, &fixture.dlq()).await;
    assert_eq!(letters.len(), 1);
    assert_eq!(letters[0].body.as_ref(), b"dead");
    let depth = source.depth().await.unwrap();
    assert_eq!((depth.ready, depth.pending), (Some(0), 0), "{depth:?}");
}

/// A live change of the visibility timeout applies to the next hand-out
/// and to keep-alives; one of the dead-letter queue moves where depth is
/// read; one of `max_deliveries` moves when a poison pill is caught.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_settings_take_effect() {
    let fixture = Fixture::embedded();
    let source = open_with(&fixture, |o| {
        o.live.visibility_timeout = Duration::from_millis(200);
        o.live.max_deliveries = 100;
    })
    .await;
    let moved = format!("{}.elsewhere", fixture.queue);
    source.apply(&LiveSettings {
        visibility_timeout: Duration::from_secs(30),
        dead_letter_queue: moved.clone(),
        max_deliveries: 1,
    });
    assert_eq!(
        source.depth().await.unwrap().dead_letters,
        0,
        "a new dead-letter queue is empty"
    );

    fixture.send(&source, "long").await;
    let got = source.receive(1).await.unwrap();
    let again = source.receive(1).await.unwrap();
    assert!(
        again.is_empty(),
        "the raised timeout held the lease: {again:?}"
    );
    source.ack(&got[0]).await.unwrap();

    // max_deliveries 1: handed out once, then its lease runs out and it is
    // dead-lettered into the dead-letter queue now named, which depth reads.
    source.apply(&LiveSettings {
        visibility_timeout: Duration::from_millis(200),
        dead_letter_queue: moved.clone(),
        max_deliveries: 1,
    });
    fixture.send(&source, "poison").await;
    assert_eq!(source.receive(1).await.unwrap().len(), 1);
    wait_for(
        "the poison pill to be dead-lettered",
        Duration::from_secs(10),
        async || {
            source.receive(1).await.unwrap().is_empty()
                && source.depth().await.unwrap().dead_letters == 1
        },
    )
    .await;
    let letters = letters(&source, &moved).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].body.as_ref(), b"poison");
}

/// A message handed out `max_deliveries` times without being settled (the
/// app never answers, or courier dies with it in flight) is dead-lettered
/// as `undeliverable` by the lease count instead of being handed out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_handed_out_too_often_is_dead_lettered() {
    let fixture = Fixture::embedded();
    let source = open_with(&fixture, |o| {
        o.live.visibility_timeout = Duration::from_millis(200);
        o.live.max_deliveries = 3;
    })
    .await;
    let id = fixture.send(&source, "never settled").await;
    fixture.send(&source, "fine").await;
    let mut handed_out = 0;
    let deadline = Instant::now() + Duration::from_secs(20);
    while source.depth().await.unwrap().dead_letters == 0 {
        assert!(Instant::now() < deadline, "never dead-lettered");
        for delivery in source.receive(10).await.unwrap() {
            if delivery.message.body.as_ref() == b"fine" {
                source.ack(&delivery).await.unwrap();
            } else {
                handed_out += 1;
                assert_eq!(delivery.attempt, handed_out, "each hand-out counts");
            }
        }
    }
    assert_eq!(handed_out, 3, "handed out max_deliveries times, not more");
    let letters = letters(&source, &fixture.dlq()).await;
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(letter.body.as_ref(), b"never settled");
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    assert_eq!(letter.field("courier-message-id"), Some(id.as_str()));
    assert_eq!(
        letter.field("courier-error"),
        Some("handed out 3 times without being settled")
    );
    let depth = source.depth().await.unwrap();
    assert_eq!((depth.ready, depth.pending), (Some(0), 0), "{depth:?}");
}

const MIB: usize = 1 << 20;

/// A receive stops at 16 MiB of messages (always one at least), whatever
/// count it asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_are_bounded_in_bytes() {
    let fixture = Fixture::embedded();
    let source = fixture.open().await;
    assert!(source.capabilities().byte_bounded_reads);
    for i in 0..3u8 {
        source
            .send(Bytes::from(vec![b'a' + i; 6 * MIB]), &[])
            .await
            .unwrap();
    }
    source
        .send(Bytes::from(vec![b'z'; 17 * MIB]), &[])
        .await
        .unwrap();
    let mut sizes = Vec::new();
    while sizes.iter().map(Vec::len).sum::<usize>() < 4 {
        let got = source.receive(100).await.unwrap();
        assert!(!got.is_empty(), "a receive always gets one at least");
        sizes.push(
            got.iter()
                .map(|d| d.message.body.len() / MIB)
                .collect::<Vec<_>>(),
        );
        for delivery in &got {
            source.ack(delivery).await.unwrap();
        }
    }
    assert_eq!(sizes, vec![vec![6, 6], vec![6], vec![17]]);
}

/// A message over the embedded queue's limit for one message (32 MiB) is
/// refused by `send`; one that another tool stored is dead-lettered as
/// `undeliverable`, its bytes kept, without being handed out, and the
/// message behind it is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_limit_is_refused_or_dead_lettered() {
    let fixture = Fixture::embedded();
    let huge = Bytes::from(vec![b'h'; 33 * MIB]);
    {
        let source = fixture.open().await;
        let refused = source.send(huge.clone(), &[]).await.unwrap_err();
        assert!(
            {
                let m = refused.message();
                refused.kind() == courier::source::ErrorKind::Invalid && m.contains("limit")
            },
            "{refused}"
        );
        release(&fixture, source).await;
    }
    store_raw(
        &fixture,
        &courier::source::encode_fields(&[("payload".into(), huge)]),
    );
    let source = fixture.open().await;
    fixture.send(&source, "behind it").await;
    let got = receive_some(&source, Duration::from_secs(5)).await;
    assert_eq!(got.len(), 1, "only the message behind it is handed out");
    assert_eq!(got[0].message.body.as_ref(), b"behind it");
    source.ack(&got[0]).await.unwrap();
    wait_for(
        "the big one to be dead-lettered",
        Duration::from_secs(10),
        async || source.depth().await.unwrap().dead_letters == 1,
    )
    .await;
    let letter = letters(&source, &fixture.dlq()).await.remove(0);
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    assert_eq!(letter.body.len(), 33 * MIB, "its bytes are kept");
    assert!(letter.field("courier-error").unwrap().contains("limit"));
}
