//! What the broker failover tests share: messages whose fate the app's
//! answers decide, and the check that every one met it.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use courier::source::Source;

use super::brokers::redis_dead_letters;
use super::{Fixture, Received, Running, TestApp, fast_policy, run_config, wait_for};

/// Message `i` of a failover test: every tenth is answered 503, then 200
/// (a retry); every tenth after that 400 (a dead letter); the rest 200.
/// Each 200 comes after 10 ms, so a drain lasts long enough to be cut.
pub fn failover_body(i: usize) -> String {
    match i % 10 {
        0 => format!("script:503,sleep10\nretried {i}"),
        1 => format!("script:400\ndead {i}"),
        _ => format!("script:sleep10\nok {i}"),
    }
}

/// Waits until every message of `0..messages` met its fate, asking
/// `letters` for the dead letters' bodies each time, for at most `limit`;
/// then fails, naming the ones that did not, unless all did (see
/// [`assert_none_lost`]). What the app saw and what the dead-letter queue
/// holds decide, not the broker's depth: a promoted Redis replica may
/// report a consumer group's lag as unknown.
pub async fn wait_none_lost(
    app: &TestApp,
    messages: usize,
    limit: Duration,
    mut letters: impl AsyncFnMut() -> Vec<String>,
) -> Vec<String> {
    let deadline = Instant::now() + limit;
    loop {
        let now = letters().await;
        if lost(app, &now, messages).is_empty() || Instant::now() >= deadline {
            assert_none_lost(app, &now, messages);
            return now;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The messages of `0..messages` that did not meet their fate.
fn lost(app: &TestApp, letters: &[String], messages: usize) -> Vec<String> {
    let mut seen: HashMap<Bytes, usize> = HashMap::new();
    for received in app.received() {
        *seen.entry(received.body).or_default() += 1;
    }
    (0..messages)
        .map(failover_body)
        .enumerate()
        .filter(|(i, body)| {
            let seen = seen.get(body.as_bytes()).copied().unwrap_or(0);
            !match i % 10 {
                0 => seen >= 2,
                1 => letters.contains(body),
                _ => seen >= 1,
            }
        })
        .map(|(_, body)| body)
        .collect()
}

/// Fails unless every message of `0..messages` met its fate: the retried
/// ones reached the app at least twice, the rejected ones are among the
/// dead letters' bodies `letters`, the rest reached the app; and nothing
/// else was dead-lettered.
pub fn assert_none_lost(app: &TestApp, letters: &[String], messages: usize) {
    let lost = lost(app, letters, messages);
    assert!(lost.is_empty(), "lost {} messages: {lost:?}", lost.len());
    assert!(
        letters.iter().all(|l| l.starts_with("script:400")),
        "only the rejected ones are dead letters: {letters:?}"
    );
}

/// The bodies of the dead letters in the Redis stream `dlq` at `url`
/// (`redis://` or `redis+cluster://`), read with a plain client; none while
/// the broker cannot answer.
pub async fn dead_letter_bodies(url: &str, dlq: &str) -> Vec<String> {
    redis_dead_letters(url, dlq)
        .await
        .unwrap_or_default()
        .into_iter()
        .map(|letter| String::from_utf8_lossy(&letter.body).into_owned())
        .collect()
}

/// How many times message `i` of [`failover_body`] reaches the app when
/// nothing goes wrong: twice for the one answered 503 first, once for the
/// others.
fn deliveries_without_a_kill(i: usize) -> usize {
    if i.is_multiple_of(10) { 2 } else { 1 }
}

/// Fails if a message of `0..messages` reached the app more often in
/// `received` than it does when no broker node dies: before the kill,
/// nothing may be delivered twice.
pub fn assert_none_twice(received: &[Received], messages: usize) {
    let mut seen: HashMap<&[u8], usize> = HashMap::new();
    for r in received {
        *seen.entry(&r.body[..]).or_default() += 1;
    }
    let twice: Vec<String> = (0..messages)
        .map(|i| (failover_body(i), deliveries_without_a_kill(i)))
        .filter(|(body, most)| seen.get(body.as_bytes()).copied().unwrap_or(0) > *most)
        .map(|(body, _)| body)
        .collect();
    assert!(
        twice.is_empty(),
        "delivered twice before the kill: {twice:?}"
    );
}

/// The middle of a failover test, the same for a Redis Cluster and for
/// Sentinel: checks the replica holds every message (`WAIT` on `master`),
/// then [`drain_across_a_kill`] with the dead letters read from the stream
/// `dlq` at `letters_url`.
#[allow(clippy::too_many_arguments)]
pub async fn drain_through_a_kill(
    app: &TestApp,
    fixture: &Fixture,
    source: &Arc<dyn Source>,
    master: &mut redis::aio::MultiplexedConnection,
    messages: usize,
    kill: impl FnOnce(),
    letters_url: &str,
) {
    // WAIT blocks until the replica has caught up (up to its own 10 s);
    // the client's default 500 ms ran out first on a busy machine.
    master.set_response_timeout(Duration::from_secs(15));
    let copies: i64 = redis::cmd("WAIT")
        .arg(1)
        .arg(10_000)
        .query_async(master)
        .await
        .unwrap();
    assert_eq!(copies, 1, "the replica has every message before the kill");
    let dlq = fixture.dlq();
    drain_across_a_kill(app, fixture, source, messages, kill, async || {
        dead_letter_bodies(letters_url, &dlq).await
    })
    .await;
}

/// The middle of a failover test on any broker: runs the sidecar until a
/// third of `messages` reached the app, checks none reached it twice, calls
/// `kill`, then waits until every message met its fate (the dead letters'
/// bodies from `letters`) and `source` has nothing pending or scheduled;
/// the kill must come before the drain ended.
pub async fn drain_across_a_kill(
    app: &TestApp,
    fixture: &Fixture,
    source: &Arc<dyn Source>,
    messages: usize,
    kill: impl FnOnce(),
    letters: impl AsyncFnMut() -> Vec<String>,
) {
    let running = Running::start(run_config(fixture, app, fast_policy())).await;
    wait_for(
        "a third to be delivered",
        Duration::from_secs(30),
        async || app.received().len() >= messages / 3,
    )
    .await;
    let before_kill = app.received();
    kill();
    let killed_at = Instant::now();
    assert_none_twice(&before_kill, messages);
    let delivered_at_kill = before_kill.len();
    wait_none_lost(app, messages, Duration::from_secs(90), letters).await;
    let settled_in = killed_at.elapsed();
    // And the broker agrees: nothing left pending or scheduled.
    wait_for("nothing pending", Duration::from_secs(30), async || {
        matches!(source.depth().await,
            Ok(d) if d.pending == 0 && d.retry_backlog == 0)
    })
    .await;
    running.stop().await;
    if fixture.broker == super::BrokerKind::Amqp {
        // RabbitMQ reports no unacked messages, so `pending` above is what
        // the sidecar in this process held; stopped, it holds nothing, and
        // RabbitMQ counts what it left unacked.
        let left = super::amqp_count_without_consumers(fixture.url.as_str(), &fixture.queue).await;
        assert_eq!(left, 0, "RabbitMQ holds {left} messages after the stop");
    }
    assert!(
        delivered_at_kill < messages,
        "the kill came after the drain: {delivered_at_kill} delivered"
    );
    eprintln!(
        "{messages} messages, {delivered_at_kill} delivered at the kill, settled {settled_in:?} after it, {} deliveries in all",
        app.received().len()
    );
}
