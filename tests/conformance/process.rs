//! The built binary as a child process, against a real broker and a real
//! HTTP app on loopback: what only a whole process can show. A `kill -9`
//! mid-flight loses nothing, a scheduled retry survives a restart and does
//! not fire early, and SIGTERM drains in-flight deliveries (or cuts them off
//! at `--drain-timeout` and leaves them for redelivery). A graceful stop
//! uses no attempts; a crash mid-delivery counts one.
//!
//! Brokers differ in what they show of another process's deliveries: Redis
//! and NATS keep a killed consumer's deliveries pending until the visibility
//! timeout (NATS counts them with the retry backlog), RabbitMQ makes them
//! ready again as the connection drops. The checks here hold for all.
//!
//! The embedded queue is a redb file that one process holds at a time, so
//! these tests enqueue and inspect it only while no `courier` runs.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use crate::common::*;
use courier::source::{Depth, shared};

/// How a message's body asks the test app to answer, and what must become of
/// it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// 200 after 20 ms.
    Slow,
    /// 503 first, then 200 after 20 ms.
    Transient,
    /// 400: dead-lettered on the first attempt.
    Permanent,
}

struct Sent {
    id: String,
    body: String,
    kind: Kind,
}

async fn depth(fixture: &Fixture) -> Depth {
    let source = fixture.open().await;
    let depth = source.depth().await.expect("depth");
    release(fixture, source).await;
    depth
}

/// Waits until the running `courier` has nothing left to do, then stops it
/// with SIGTERM and checks it exits 0. `done` says when the app has seen
/// what it should; `settlements` is how many messages were unsettled when
/// this process started, each of which it must ack or dead-letter once.
///
/// courier's own counters show that: its final settlements reach
/// `settlements`, and every delivery it took is settled. A broker cannot
/// always tell (the embedded queue cannot be opened while courier runs, and
/// RabbitMQ does not count another connection's unacked deliveries), and a
/// delivery a killed process held comes back only once its lease runs out.
/// Where the queue can be watched while courier runs, it must settle too.
async fn stop_when_settled(
    courier: &mut CourierProcess,
    fixture: &Fixture,
    settlements: u64,
    mut done: impl FnMut() -> bool,
) {
    wait_for("the app to see every message", SETTLE, async || done()).await;
    let addr = courier.metrics_addr().await;
    let queue = fixture.queue.clone();
    wait_for(
        &format!("courier to settle {settlements} messages and go idle"),
        SETTLE,
        async || {
            let text = scrape(addr).await;
            let received = metric(&text, "courier_messages_received_total", &queue);
            let finals = metric(&text, "courier_acks_total", &queue)
                + metric(&text, "courier_dead_letters_total", &queue);
            let settled = finals + metric(&text, "courier_retries_total", &queue);
            finals >= settlements as f64
                && received == settled
                && metric(&text, "courier_in_flight", &queue) == 0.0
                && metric(&text, "courier_retry_backlog", &queue) == 0.0
        },
    )
    .await;
    if fixture.dir().is_none() {
        let source = fixture.open().await;
        wait_settled(&source, SETTLE).await;
        release(fixture, source).await;
    }
    courier.terminate();
    let status = courier.exit_within(Duration::from_secs(10)).await;
    assert!(
        status.success(),
        "exit after SIGTERM: {status}; log:\n{}",
        courier.log()
    );
}

fn assert_settled(depth: &Depth) {
    assert_eq!(
        (depth.ready, depth.pending, depth.retry_backlog),
        (Some(0), 0, 0),
        "nothing may be left ready, pending or scheduled: {depth:?}"
    );
}

// === kill -9 mid-flight ===

/// How the restarted sidecar gets back what the killed one held.
#[derive(Debug, Clone, Copy)]
pub enum Restart {
    /// Redis, the same `--consumer`: it reads its own unsettled entries back
    /// at once. The visibility timeout is longer than the test may take, so
    /// nothing else could bring them back in time.
    SameConsumer,
    /// Another `--consumer`, with a 2 s visibility timeout: Redis reclaims
    /// the killed one's entries once they sat pending that long, the
    /// embedded queue's leases and a NATS consumer's AckWait run out after
    /// it, and RabbitMQ requeues them as soon as the connection drops.
    OtherConsumer,
}

impl Restart {
    fn consumers(self) -> (&'static str, &'static str) {
        match self {
            Self::SameConsumer => ("replica-a", "replica-a"),
            Self::OtherConsumer => ("replica-a", "replica-b"),
        }
    }

    fn visibility_timeout(self) -> Duration {
        match self {
            Self::SameConsumer => Duration::from_secs(60),
            Self::OtherConsumer => Duration::from_secs(2),
        }
    }
}

/// [`crash_mid_flight_with`] another consumer, as a new pod would be.
pub async fn crash_mid_flight_loses_nothing(fixture: Fixture) {
    crash_mid_flight_with(fixture, Restart::OtherConsumer).await;
}

/// Hundreds of messages, `kill -9` once some but not all reached the app,
/// start again: every message reached the app or sits in the dead-letter
/// queue, nothing is lost, nothing is left pending or scheduled.
pub async fn crash_mid_flight_with(fixture: Fixture, restart: Restart) {
    const MESSAGES: usize = 400;
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 10\ntimeout: 500ms\nbackoff: {initial: 50ms, max: 200ms, jitter: none}",
    );
    let producer = fixture.producer().await;
    let mut sent = Vec::new();
    for i in 0..MESSAGES {
        let (kind, script) = match i {
            i if i % 50 == 7 => (Kind::Permanent, "400"),
            i if i % 10 == 3 => (Kind::Transient, "503,sleep20"),
            _ => (Kind::Slow, "sleep20"),
        };
        let body = format!("script:{script}\nmessage {i}");
        let id = producer.send(body.clone(), &[]).await;
        sent.push(Sent { id, body, kind });
    }
    producer.release(&fixture).await;
    let bodies: HashSet<String> = sent.iter().map(|s| s.body.clone()).collect();
    let visibility = restart.visibility_timeout();
    let args = |consumer: &str| {
        let mut args = run_args_second_of_two(&fixture, &app, &policy, consumer);
        args.extend(["--concurrency".into(), "8".into()]);
        args.extend([
            "--visibility-timeout".into(),
            format!("{}ms", visibility.as_millis()),
        ]);
        args
    };
    let (first_consumer, second_consumer) = restart.consumers();

    let mut first = CourierProcess::run(&args(first_consumer));
    wait_for("some messages to reach the app", SETTLE, async || {
        app.reached(&bodies) >= MESSAGES / 4
    })
    .await;
    first.kill9();
    let before = app.reached(&bodies);
    assert!(
        before < MESSAGES,
        "everything was delivered before the kill; nothing was mid-flight"
    );
    // Unsettled work is left: pending where the broker keeps a dead
    // consumer's deliveries, ready again where it requeues them at once
    // (RabbitMQ, as the connection drops), or in the retry backlog where it
    // cannot tell them from scheduled retries (NATS).
    let at_kill = depth(&fixture).await;
    let unsettled =
        at_kill.pending + at_kill.ready.expect("a count of what is ready") + at_kill.retry_backlog;
    assert!(
        unsettled > 0,
        "the killed sidecar left nothing unsettled, so the kill was not mid-flight: {at_kill:?}"
    );

    let mut second = CourierProcess::run(&args(second_consumer));
    stop_when_settled(&mut second, &fixture, unsettled, || {
        app.reached(&bodies) == MESSAGES
    })
    .await;

    let source = fixture.open().await;
    assert_settled(&source.depth().await.unwrap());
    let letters = source.dead_letters(&fixture.dlq(), 10_000).await.unwrap();
    drop(source);
    for message in &sent {
        let seen = app.received_body(message.body.as_bytes());
        let letters: Vec<_> = letters
            .iter()
            .filter(|l| l.field("courier-message-id") == Some(message.id.as_str()))
            .collect();
        match message.kind {
            Kind::Slow => assert!(!seen.is_empty(), "{} never reached the app", message.body),
            // Acked only after the 200 that follows the 503.
            Kind::Transient => assert!(
                seen.len() >= 2,
                "{}: {} deliveries; the 503 must be retried",
                message.body,
                seen.len()
            ),
            Kind::Permanent => {
                // A kill between publishing a dead letter and acking the
                // original leaves a second copy where those are two steps.
                let most = if fixture.broker.moves_atomically() {
                    1
                } else {
                    2
                };
                assert!(
                    (1..=most).contains(&letters.len()),
                    "{}: {} dead letters",
                    message.body,
                    letters.len()
                );
                for letter in &letters {
                    assert_eq!(letter.field("courier-reason"), Some("permanent-status"));
                    assert_eq!(letter.body.as_ref(), message.body.as_bytes());
                }
            }
        }
        if message.kind != Kind::Permanent {
            assert!(letters.is_empty(), "{} was dead-lettered", message.body);
        }
        for r in &seen {
            assert_eq!(
                r.header("idempotency-key"),
                Some(format!("{}:{}", fixture.queue, message.id).as_str()),
                "{}: the key survives the crash",
                message.body
            );
        }
    }
    let permanent = sent.iter().filter(|s| s.kind == Kind::Permanent).count();
    if fixture.broker.moves_atomically() {
        assert_eq!(letters.len(), permanent, "dead letters");
    } else {
        // At most one extra copy per delivery in flight at the kill.
        assert!(
            (permanent..=permanent + 8).contains(&letters.len()),
            "{} dead letters for {permanent} permanent failures",
            letters.len()
        );
    }
}

// === A scheduled retry across a restart ===

/// A retry scheduled with a 4 s backoff survives `kill -9` and a restart,
/// and the restarted sidecar, already running well before it is due, does
/// not deliver it early.
pub async fn scheduled_retry_survives_restart(fixture: Fixture) {
    // Longer than a held read (NATS pull, SQS long poll), which outlives
    // the killed process at the broker: a retry due inside it is received
    // for nobody and counted (SQS's `ApproximateReceiveCount`), so its
    // attempt number would be one higher; that is a crash's documented
    // cost (docs/sources.md), not what this test is about.
    const BACKOFF: Duration = shared::HELD_WAIT.saturating_add(Duration::from_secs(1));
    // Due times are stored in whole milliseconds.
    const ROUNDING: Duration = Duration::from_millis(5);
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        &format!(
            "maxAttempts: 3\ntimeout: 500ms\nbackoff: {{initial: {0}ms, max: {0}ms, jitter: none}}",
            BACKOFF.as_millis()
        ),
    );
    let body = "script:503,200\nscheduled";
    let producer = fixture.producer().await;
    let id = producer.send(body, &[]).await;
    producer.release(&fixture).await;
    let args = run_args_second_of_two(&fixture, &app, &policy, "replica-a");

    let mut first = CourierProcess::run(&args);
    let addr = first.metrics_addr().await;
    wait_for("the retry to be scheduled", SETTLE, async || {
        metric(&scrape(addr).await, "courier_retries_total", &fixture.queue) >= 1.0
    })
    .await;
    first.kill9();
    let seen = app.received_body(body.as_bytes());
    assert_eq!(seen.len(), 1, "one attempt before the kill");
    let due = seen[0].at + BACKOFF;

    let source = fixture.open().await;
    let scheduled = source.depth().await.expect("depth");
    let capabilities = source.capabilities();
    release(&fixture, source).await;
    if capabilities.per_message_delay {
        assert_eq!(
            (scheduled.retry_backlog, scheduled.pending),
            (1, 0),
            "the retry is stored, not left in flight: {scheduled:?}"
        );
    } else {
        // Retries wait in delay-tier queues (RabbitMQ), and a process counts
        // only the tiers it has used itself, so a fresh one sees no backlog
        // yet; the redelivery below shows the retry was stored.
        assert_eq!(
            (scheduled.ready, scheduled.pending),
            (Some(0), 0),
            "the retry is not left in flight: {scheduled:?}"
        );
    }
    let mut second = CourierProcess::run(&args);
    let running = second.wait_running().await;
    assert!(
        running < due,
        "the restarted sidecar must be pulling before the retry is due for this test to mean anything"
    );
    wait_for("the second attempt", SETTLE, async || {
        app.received_body(body.as_bytes()).len() >= 2
    })
    .await;
    stop_when_settled(&mut second, &fixture, 1, || true).await;

    let seen = app.received_body(body.as_bytes());
    assert_eq!(seen.len(), 2, "one retry, then acked");
    // Early only if early by both clocks: courier keeps due times by the
    // wall clock, a broker's own timer (a NATS `Nak` delay, a queue's TTL)
    // by its monotonic one, and the two drift apart on this machine.
    let wall = seen[1]
        .wall
        .duration_since(seen[0].wall)
        .unwrap_or_default();
    let gap = (seen[1].at - seen[0].at).max(wall);
    assert!(
        gap + ROUNDING >= BACKOFF,
        "the retry came {gap:?} after the first attempt; the backoff is {BACKOFF:?}"
    );
    assert_eq!(seen[1].attempt(), 2);
    assert_eq!(
        seen[1].header("idempotency-key"),
        seen[0].header("idempotency-key")
    );
    let source = fixture.open().await;
    assert_settled(&source.depth().await.unwrap());
    assert!(
        source
            .dead_letters(&fixture.dlq(), 10)
            .await
            .unwrap()
            .is_empty(),
        "message {id} must not be dead-lettered"
    );
}

// === SIGTERM ===

/// Bodies the app has seen, in arrival order, with no repeats.
fn bodies_seen(app: &TestApp) -> Vec<String> {
    let mut seen = Vec::new();
    for r in app.received() {
        let body = String::from_utf8_lossy(&r.body).into_owned();
        if !seen.contains(&body) {
            seen.push(body);
        }
    }
    seen
}

/// SIGTERM while four slow deliveries (1 s each) are in flight: no new
/// pulls, the four finish and are acked, the process exits 0 within
/// `--drain-timeout`; a restart delivers the rest and redelivers none of
/// the four.
pub async fn sigterm_drains_in_flight(fixture: Fixture) {
    const MESSAGES: usize = 10;
    const DRAIN: Duration = Duration::from_secs(10);
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 3\ntimeout: 3s\nbackoff: {initial: 50ms, max: 200ms, jitter: none}",
    );
    let producer = fixture.producer().await;
    let mut bodies = Vec::new();
    for i in 0..MESSAGES {
        let body = format!("script:sleep1000\nmessage {i}");
        producer.send(body.clone(), &[]).await;
        bodies.push(body);
    }
    producer.release(&fixture).await;
    let mut args = run_args_second_of_two(&fixture, &app, &policy, "replica-a");
    args.extend(["--concurrency", "4", "--drain-timeout", "10s"].map(String::from));

    let mut first = CourierProcess::run(&args);
    wait_for("four deliveries in flight", SETTLE, async || {
        app.received().len() >= 4
    })
    .await;
    let in_flight = bodies_seen(&app);
    first.terminate();
    let signalled = Instant::now();
    let status = first.exit_within(DRAIN + Duration::from_secs(5)).await;
    let took = signalled.elapsed();
    assert!(
        status.success(),
        "exit after SIGTERM: {status}; log:\n{}",
        first.log()
    );
    assert!(
        took < DRAIN,
        "the drain took {took:?}, over --drain-timeout"
    );
    assert_eq!(in_flight.len(), 4);
    assert_eq!(
        app.received().len(),
        4,
        "nothing new is pulled after SIGTERM"
    );
    let after = depth(&fixture).await;
    assert_eq!(
        (after.pending, after.ready),
        (0, Some((MESSAGES - 4) as u64)),
        "the in-flight deliveries were settled, the rest left waiting: {after:?}"
    );

    let mut second = CourierProcess::run(&args);
    stop_when_settled(&mut second, &fixture, (MESSAGES - 4) as u64, || {
        bodies_seen(&app).len() == MESSAGES
    })
    .await;
    for body in &bodies {
        assert_eq!(
            app.received_body(body.as_bytes()).len(),
            1,
            "{body}: delivered once, not redelivered after the drain"
        );
    }
    let source = fixture.open().await;
    assert_settled(&source.depth().await.unwrap());
    assert_no_dead_letters(&source, &fixture).await;
}

/// A `--drain-timeout` shorter than the in-flight work: the process exits 0
/// without waiting for it, the cut-off deliveries stay unsettled, and a
/// restart redelivers them (attempt 2, same key); nothing is lost. The app
/// holds every first delivery until the first courier has exited, so the
/// four in flight at the SIGTERM are all its work: on Kafka the deliveries
/// reach the app as partitions' fetches return, which can spread them over
/// more than a fixed amount of work would cover.
pub async fn drain_timeout_cuts_off_and_redelivers(fixture: Fixture) {
    const MESSAGES: usize = 6;
    const IN_FLIGHT: usize = 4;
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    // The policy timeout must not end a held delivery before the fourth
    // arrives. Kafka's come as the mock's fetches return, seconds apart
    // under load, and it redelivers from the committed offset rather than
    // after a lease, so it gets a timeout far past that spread; the others
    // keep a short lease so that their redelivery comes soon.
    let (timeout, visibility) = match fixture.broker {
        BrokerKind::Kafka => ("30s", "35s"),
        _ => ("3s", "4s"),
    };
    let policy = write_policy(
        dir.path(),
        &format!(
            "maxAttempts: 5\ntimeout: {timeout}\nbackoff: {{initial: 50ms, max: 200ms, jitter: none}}"
        ),
    );
    let producer = fixture.producer().await;
    let mut bodies = Vec::new();
    for i in 0..MESSAGES {
        // Held until released on the first delivery, answered at once on
        // the redelivery.
        let body = format!("script:hold,200\nmessage {i}");
        producer.send(body.clone(), &[]).await;
        bodies.push(body);
    }
    producer.release(&fixture).await;
    let mut args = run_args_second_of_two(&fixture, &app, &policy, "replica-a");
    args.extend(
        [
            "--concurrency",
            "4",
            "--drain-timeout",
            "300ms",
            "--visibility-timeout",
            visibility,
        ]
        .map(String::from),
    );

    let mut first = CourierProcess::run(&args);
    wait_for("four deliveries held by the app", SETTLE, async || {
        app.held() == IN_FLIGHT
    })
    .await;
    let cut_off = bodies_seen(&app);
    first.terminate();
    // A courier that waited for its work in flight would not exit: the app
    // holds it until after this.
    let status = first.exit_within(Duration::from_secs(10)).await;
    assert!(
        status.success(),
        "exit after SIGTERM: {status}; log:\n{}",
        first.log()
    );
    assert_eq!(app.held(), IN_FLIGHT, "the app still held the four");
    app.release_held();
    let stopped = logged(&first, "stopped").await;
    assert_eq!(
        (&stopped["finished"], &stopped["abandoned"]),
        (&serde_json::json!(0), &serde_json::json!(IN_FLIGHT)),
        "the four in flight cut off, none finished: {stopped}"
    );
    assert_eq!(cut_off.len(), IN_FLIGHT);
    // Nothing was acked or dead-lettered: the cut-off four are pending, or
    // ready again where the broker requeues a closed connection's
    // deliveries (RabbitMQ), or in the retry backlog where it cannot tell
    // another process's unsettled delivery from a scheduled retry (NATS).
    let after = depth(&fixture).await;
    assert_eq!(
        (
            after
                .ready
                .map(|ready| ready + after.pending + after.retry_backlog),
            after.dead_letters
        ),
        (Some(MESSAGES as u64), 0),
        "the cut-off deliveries stay unsettled for redelivery: {after:?}"
    );

    let mut second = CourierProcess::run(&args);
    stop_when_settled(&mut second, &fixture, MESSAGES as u64, || {
        cut_off
            .iter()
            .all(|b| app.received_body(b.as_bytes()).len() >= 2)
            && bodies_seen(&app).len() == MESSAGES
    })
    .await;
    for body in &bodies {
        let seen = app.received_body(body.as_bytes());
        if cut_off.contains(body) {
            assert_eq!(seen.len(), 2, "{body}: cut off once, redelivered once");
            assert_eq!(seen[1].attempt(), 2, "{body}: the cut-off delivery counts");
            assert_eq!(
                seen[1].header("idempotency-key"),
                seen[0].header("idempotency-key")
            );
        } else {
            assert_eq!(seen.len(), 1, "{body}");
        }
    }
    let source = fixture.open().await;
    assert_settled(&source.depth().await.unwrap());
    assert_no_dead_letters(&source, &fixture).await;
}

// === Attempts across stops and crashes ===

/// A graceful stop lets in-flight deliveries finish and gives back what was
/// fetched and never offered (AMQP prefetch), so the next run offers every
/// remaining message as attempt 1. The stop comes while four deliveries are
/// at the app: it holds them until courier logged that it is draining them,
/// and courier reports the four finished, not abandoned.
pub async fn a_graceful_stop_uses_no_attempts(fixture: Fixture) {
    const IN_FLIGHT: usize = 4;
    let app = TestApp::start().await;
    let producer = fixture.producer().await;
    let n = 24;
    let body = |i: usize| format!("script:hold\nstop {i}");
    for i in 0..n {
        producer.send(body(i), &[]).await;
    }
    producer.release(&fixture).await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 3\ntimeout: 20s\nbackoff: {initial: 50ms, max: 200ms, jitter: none}",
    );
    let mut args = run_args_second_of_two(&fixture, &app, &policy, "stopping");
    args.extend(["--concurrency", "4", "--drain-timeout", "20s"].map(String::from));

    let mut first = CourierProcess::run(&args);
    wait_for("four deliveries held by the app", SETTLE, async || {
        app.held() == IN_FLIGHT
    })
    .await;
    first.terminate();
    let draining = first
        .wait_log("draining in-flight deliveries", SETTLE)
        .await;
    assert_eq!(draining["in_flight"], IN_FLIGHT, "{draining}");
    assert_eq!(
        app.held(),
        IN_FLIGHT,
        "the stop came while the app held them"
    );
    app.release_held();
    let status = first.exit_within(SETTLE).await;
    assert!(status.success(), "{status}\n{}", first.log());
    let stopped = logged(&first, "stopped").await;
    assert_eq!(
        (&stopped["finished"], &stopped["abandoned"]),
        (&IN_FLIGHT.into(), &0.into()),
        "{stopped}"
    );
    assert_eq!(
        app.received().len(),
        IN_FLIGHT,
        "nothing new after the stop"
    );

    let mut second = CourierProcess::run(&args);
    stop_when_settled(&mut second, &fixture, (n - IN_FLIGHT) as u64, || {
        bodies_seen(&app).len() == n
    })
    .await;
    for i in 0..n {
        let seen = app.received_body(body(i).as_bytes());
        assert_eq!(seen.len(), 1, "message {i} offered once");
        assert_eq!(seen[0].attempt(), 1, "message {i}");
    }
}

/// A sidecar killed mid-delivery: the broker hands the message out again
/// and that counts as an attempt (so a message that kills the sidecar every
/// time still reaches its dead letter).
pub async fn a_crash_mid_delivery_counts_an_attempt(fixture: Fixture) {
    let app = TestApp::start().await;
    let body = "script:sleep1500,200\ncrash";
    let producer = fixture.producer().await;
    producer.send(body, &[]).await;
    producer.release(&fixture).await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 3\ntimeout: 2s\nbackoff: {initial: 50ms, max: 200ms, jitter: none}",
    );
    let mut args = run_args_second_of_two(&fixture, &app, &policy, "crashing");
    // Longer than a held read (an SQS long poll), which outlives the killed
    // process at the broker: the message, visible again inside it, would be
    // received for nobody and counted, and the redelivery be attempt 3 (CI,
    // with 3 s); a crash's documented cost, not what this test is about.
    let visibility = shared::HELD_WAIT.saturating_add(Duration::from_secs(2));
    args.extend([
        "--visibility-timeout".to_string(),
        format!("{}ms", visibility.as_millis()),
    ]);
    let mut courier = CourierProcess::run(&args);
    wait_for("the first delivery", Duration::from_secs(20), async || {
        !app.received_body(body.as_bytes()).is_empty()
    })
    .await;
    let received = app.received_body(body.as_bytes())[0].at;
    fixture.broker.handed_out_durably(received).await;
    courier.kill9();

    let source = fixture.open().await;
    let running = Running::start_second_of_two(run_config(&fixture, &app, fast_policy())).await;
    wait_for("the redelivery", Duration::from_secs(20), async || {
        app.received_body(body.as_bytes()).len() >= 2
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    let attempts: Vec<u32> = app
        .received_body(body.as_bytes())
        .iter()
        .map(Received::attempt)
        .collect();
    assert_eq!(attempts, vec![1, 2]);
}
