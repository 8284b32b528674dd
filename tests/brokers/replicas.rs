//! Many replicas on one queue, per broker: three `courier` processes (the
//! built binary) in one consumer group, each in front of an app of its own,
//! so the test sees which replica delivered what. The broker divides the
//! work (every replica gets some) and no message reaches an app twice while
//! all three run. Then one replica is killed with `kill -9` mid-drain, while
//! its app holds a delivery: what it held unsettled reaches the others once
//! the broker gives it up (Redis: `XAUTOCLAIM` after the visibility timeout;
//! RabbitMQ: at once, as the connection drops, re-published behind the
//! backlog; NATS: after `AckWait`, the visibility timeout), and every
//! message is acked, none lost, none dead-lettered.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::common::*;

/// Long enough for anything here to settle on a slow machine.
const SETTLE: Duration = Duration::from_secs(60);

/// Short, so the killed replica's messages come back within the test.
const VISIBILITY: Duration = Duration::from_secs(3);

const MESSAGES: usize = 300;
const REPLICAS: usize = 3;

/// Each delivery takes the app this long (a `sleep` script), so the drain
/// lasts seconds, and a delivery the app received less than this long ago
/// is one it has not answered: courier cannot have settled it.
const APP_TIME: Duration = Duration::from_millis(150);

/// From a survivor taking a message back to its app receiving it: the
/// message waits for one of the survivor's slots, behind at most the
/// delivery in that slot and a batch read ahead, two `APP_TIME`s plus
/// courier's own work around them (measured up to 0.4 s on NATS); 1 s
/// leaves room for a loaded 2-core machine.
const HAND_OUT: Duration = Duration::from_secs(1);

/// How long after the kill what the killed replica held may take to reach
/// another replica's app, by how the broker gives it up, and why.
/// `backlog`: when the last first delivery (attempt 1) reached an app,
/// counted from the kill.
fn redelivery_bound(broker: BrokerKind, backlog: Duration) -> (Duration, &'static str) {
    match broker {
        // Its pending entries become claimable once idle for the visibility
        // timeout (the killed replica last claimed them before the kill),
        // and each survivor looks for them with `XAUTOCLAIM` once a
        // visibility timeout.
        BrokerKind::Redis => (
            2 * VISIBILITY + HAND_OUT,
            "idle for the visibility timeout, then a survivor's next XAUTOCLAIM",
        ),
        // The server hands a message out again `AckWait` (the visibility
        // timeout) after it last delivered it or heard `+WPI` for it, both
        // before the kill.
        BrokerKind::Nats => (VISIBILITY + HAND_OUT, "AckWait, the visibility timeout"),
        // The broker gives the deliveries back as the connection drops, and
        // the survivor that takes one re-publishes it (to count the attempt)
        // at the tail: it is handed out after every message that was queued
        // at the kill, however long the survivors take over those.
        BrokerKind::Amqp => (
            backlog + HAND_OUT,
            "given back at once, re-published behind the backlog",
        ),
        other => panic!("no redelivery bound for {}", other.name()),
    }
}

/// The first time each body reached `app`, among those before `until`.
fn first_seen(app: &TestApp, until: Option<Instant>) -> HashMap<String, Instant> {
    let mut seen = HashMap::new();
    for r in app.received() {
        if until.is_some_and(|until| r.at >= until) {
            continue;
        }
        let body = String::from_utf8_lossy(&r.body).into_owned();
        seen.entry(body).or_insert(r.at);
    }
    seen
}

async fn three_replicas_divide_the_work_and_survive_a_kill(fixture: Fixture) {
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 10\ntimeout: 1s\nbackoff: {initial: 50ms, max: 200ms, jitter: none}",
    );
    // The queue as `courier run --create` makes it: quorum on RabbitMQ.
    drop(fixture.open_as_created().await);
    let producer = fixture.producer().await;
    let mut apps = Vec::new();
    let mut replicas = Vec::new();
    for i in 0..REPLICAS {
        let app = TestApp::start().await;
        let mut args = run_args(&fixture, &app, &policy, &format!("replica-{i}"));
        args.extend([
            "--concurrency".into(),
            "4".into(),
            "--visibility-timeout".into(),
            format!("{}ms", VISIBILITY.as_millis()),
        ]);
        replicas.push(CourierProcess::run(&args));
        apps.push(app);
    }
    for replica in &mut replicas {
        replica.wait_running().await;
    }

    let bodies: HashSet<String> = (0..MESSAGES)
        .map(|i| format!("script:sleep{}\nmessage {i}", APP_TIME.as_millis()))
        .collect();
    let started = Instant::now();
    for body in &bodies {
        producer.send(body.clone(), &[]).await;
    }
    producer.release(&fixture).await;

    let reached = |apps: &[TestApp]| {
        apps.iter()
            .flat_map(|app| first_seen(app, None).into_keys())
            .collect::<HashSet<_>>()
            .len()
    };
    // A replica's slots move nearly in step (its app gets a round of
    // deliveries together), so a kill at any moment can fall between two
    // rounds, with the last one answered and acked and the next not yet in
    // the app: then nothing the app saw comes back (1 run in 15 on a
    // loaded machine). So the kill waits for a delivery younger than a
    // third of APP_TIME, which leaves the rest for the kill to land.
    wait_for(
        "every replica to deliver some, and replica 0's app to hold a delivery",
        SETTLE,
        async || {
            apps.iter().all(|app| app.received().len() >= 5)
                && apps[0]
                    .received()
                    .iter()
                    .any(|r| r.at.elapsed() < APP_TIME / 3)
        },
    )
    .await;
    let killed_at = Instant::now();
    replicas[0].kill9();
    let dead_at = Instant::now();
    // What the app had not answered when courier died, courier had not
    // settled: the broker must hand each of these out again.
    let unanswered: HashSet<String> = apps[0]
        .received()
        .into_iter()
        .filter(|r| r.at + APP_TIME > dead_at)
        .map(|r| String::from_utf8_lossy(&r.body).into_owned())
        .collect();
    assert!(
        !unanswered.is_empty(),
        "replica 0's app had answered everything when courier died, {:?} after the kill was sent",
        dead_at - killed_at
    );

    // While all three ran: the work was divided, nothing went out twice.
    let mut before: HashMap<String, usize> = HashMap::new();
    let mut shares = Vec::new();
    for app in &apps {
        let received: Vec<Received> = app
            .received()
            .into_iter()
            .filter(|r| r.at < killed_at)
            .collect();
        shares.push(received.len());
        for r in received {
            *before
                .entry(String::from_utf8_lossy(&r.body).into_owned())
                .or_default() += 1;
        }
    }
    let twice: Vec<_> = before.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "{} messages reached the apps twice while every replica ran: {twice:?}",
        twice.len()
    );
    assert!(
        shares.iter().all(|n| *n > 0),
        "a replica got no work: {shares:?}"
    );
    assert!(
        before.len() < MESSAGES,
        "everything was delivered before the kill; nothing was mid-drain"
    );

    wait_for("every message to reach an app", SETTLE, async || {
        reached(&apps) == MESSAGES
    })
    .await;
    let source = fixture.open().await;
    let depth = wait_settled(&source, SETTLE).await;
    let drained = started.elapsed();
    assert_eq!(depth.dead_letters, 0, "nothing is dead-lettered: {depth:?}");

    // What the killed replica held in its app reached the others, within
    // the bound its broker's way of giving it up sets. Held until it died,
    // not until the kill was sent: it may hand one more to its app in
    // between, as `unanswered` counts.
    let held = first_seen(&apps[0], Some(dead_at));
    let mut latest = Duration::ZERO;
    let mut redelivered = HashSet::new();
    for app in &apps[1..] {
        for (body, at) in first_seen(app, None) {
            if held.contains_key(&body) && at >= killed_at {
                latest = latest.max(at - killed_at);
                redelivered.insert(body);
            }
        }
    }
    let lost: Vec<_> = unanswered.difference(&redelivered).collect();
    let receipts = |body: &String| -> Vec<(usize, Option<Duration>, u32)> {
        apps.iter()
            .enumerate()
            .flat_map(|(i, app)| {
                app.received()
                    .into_iter()
                    .filter(|r| String::from_utf8_lossy(&r.body) == body.as_str())
                    .map(move |r| (i, r.at.checked_duration_since(killed_at), r.attempt()))
            })
            .collect()
    };
    assert!(
        lost.is_empty(),
        "{} of the {} deliveries the killed replica's app had not answered reached no other replica: {:?} (app, after the kill, attempt: {:?}); dead {:?} after the kill was sent",
        lost.len(),
        unanswered.len(),
        lost,
        lost.iter().map(|b| receipts(b)).collect::<Vec<_>>(),
        dead_at - killed_at
    );
    let backlog = apps
        .iter()
        .flat_map(TestApp::received)
        .filter(|r| r.at >= killed_at && r.attempt() == 1)
        .map(|r| r.at - killed_at)
        .max()
        .unwrap_or_default();
    let (bound, why) = redelivery_bound(fixture.broker, backlog);
    assert!(
        latest <= bound,
        "the killed replica's messages took {latest:?} to reach another replica, over {bound:?} ({why}; the backlog took {backlog:?})"
    );

    for replica in &mut replicas[1..] {
        replica.terminate();
        let status = replica.exit_within(Duration::from_secs(15)).await;
        assert!(
            status.success(),
            "exit after SIGTERM: {status}; log:\n{}",
            replica.log()
        );
    }
    eprintln!(
        "figures ({}): {MESSAGES} messages, {APP_TIME:?} each, 3 replicas x concurrency 4; shares before the kill {shares:?}; {} held by the killed replica ({} unanswered) reached another within {latest:?}, bound {bound:?} ({why}; visibility timeout {VISIBILITY:?}, first deliveries done {backlog:?} after the kill); all settled {drained:?} after the first send; {} deliveries in all",
        fixture.broker.name(),
        redelivered.len(),
        unanswered.len(),
        apps.iter().map(|a| a.received().len()).sum::<usize>()
    );
}

crate::per_source!(
    [redis => Fixture::redis(), amqp => Fixture::amqp(), nats => Fixture::nats()],
    [three_replicas_divide_the_work_and_survive_a_kill]
);
