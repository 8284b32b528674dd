//! Many replicas on one queue, per broker: three `courier` processes (the
//! built binary) in one consumer group, each in front of an app of its own,
//! so the test sees which replica delivered what. The broker divides the
//! work (every replica gets some) and no message reaches an app twice while
//! all three run. Then one replica is killed with `kill -9` mid-drain: what
//! it held unsettled reaches the others once the broker gives it up (Redis:
//! `XAUTOCLAIM` after the visibility timeout; RabbitMQ: at once, as the
//! connection drops; NATS: after `AckWait`, the visibility timeout), and
//! every message is acked, none lost, none dead-lettered.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::common::*;

/// Long enough for anything here to settle on a slow machine.
const SETTLE: Duration = Duration::from_secs(60);

/// Short, so the killed replica's messages come back within the test.
const VISIBILITY: Duration = Duration::from_secs(3);

/// On top of the visibility timeout, before a killed replica's message must
/// have reached another app: Redis looks for entries to reclaim every
/// visibility timeout (so up to one more); RabbitMQ returns them at once,
/// but courier re-publishes a redelivery (to count the attempt) at the
/// tail, behind the backlog the survivors are working through (about 5 s
/// of it here).
const REDELIVERY_SLACK: Duration = Duration::from_secs(8);

const MESSAGES: usize = 300;
const REPLICAS: usize = 3;

/// Each delivery takes the app this long, so the drain lasts seconds.
const APP_TIME: &str = "sleep150";

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
        .map(|i| format!("script:{APP_TIME}\nmessage {i}"))
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
    wait_for("every replica to deliver some", SETTLE, async || {
        apps.iter().all(|app| app.received().len() >= 5)
    })
    .await;
    let killed_at = Instant::now();
    replicas[0].kill9();

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
    // the visibility timeout (and the slack above).
    let held = first_seen(&apps[0], Some(killed_at));
    let mut latest = Duration::ZERO;
    let mut redelivered = 0;
    for app in &apps[1..] {
        for (body, at) in first_seen(app, None) {
            if held.contains_key(&body) && at >= killed_at {
                redelivered += 1;
                latest = latest.max(at - killed_at);
            }
        }
    }
    assert!(
        redelivered > 0,
        "the killed replica held nothing unsettled; the kill was not mid-delivery"
    );
    assert!(
        latest <= VISIBILITY + REDELIVERY_SLACK,
        "the killed replica's messages took {latest:?} to reach another replica"
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
        "figures ({}): {MESSAGES} messages, {APP_TIME} ms each, 3 replicas x concurrency 4; shares before the kill {shares:?}; {redelivered} held by the killed replica reached another within {latest:?} (visibility timeout {VISIBILITY:?}); all settled {drained:?} after the first send; {} deliveries in all",
        fixture.broker.name(),
        apps.iter().map(|a| a.received().len()).sum::<usize>()
    );
}

crate::per_source!(
    [redis => Fixture::redis(), amqp => Fixture::amqp(), nats => Fixture::nats()],
    [three_replicas_divide_the_work_and_survive_a_kill]
);
