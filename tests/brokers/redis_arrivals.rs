//! An idle Redis reader waits for an entry in a blocking `XREADGROUP` on a
//! connection of its own instead of asking Redis again and again: what an
//! operator sees of it in `CLIENT LIST` and `INFO commandstats`, the entry
//! over `--max-body` arriving at the waiting reader still dead-lettered
//! without being loaded, the waiting connection killed, and an ACL user
//! without `+client`. Each test has a private `redis-server`, so the
//! clients and counts it reads are courier's.

use std::time::Duration;

use crate::common::*;
use redis::aio::MultiplexedConnection;

const LIMIT: Duration = Duration::from_secs(30);
/// What the app is sent after an idle spell, to see it delivered.
const ARRIVAL: &str = "arrived while courier was idle";

async fn admin(redis: &PrivateRedis) -> MultiplexedConnection {
    redis_connection(&redis.url()).await.unwrap()
}

/// The text Redis answers `command arg` with.
async fn text(con: &mut MultiplexedConnection, command: &str, arg: &str) -> String {
    redis::cmd(command).arg(arg).query_async(con).await.unwrap()
}

/// Waits until exactly one client waits in `XREADGROUP`, other than `not`;
/// returns its id.
async fn wait_reader(con: &mut MultiplexedConnection, not: Option<&str>) -> String {
    let mut found = Vec::new();
    wait_for("courier's waiting reader", LIMIT, async || {
        found = waiting_readers(&text(con, "CLIENT", "LIST").await);
        found.len() == 1 && Some(found[0].as_str()) != not
    })
    .await;
    found.remove(0)
}

/// How many times Redis ran `command` (from scripts too), by
/// `INFO commandstats`.
async fn calls(con: &mut MultiplexedConnection, command: &str) -> u64 {
    text(con, "INFO", "commandstats")
        .await
        .lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:calls=")))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |n| n.parse().unwrap())
}

async fn delivered(app: &TestApp, body: &str) {
    wait_for(body, LIMIT, async || {
        !app.received_body(body.as_bytes()).is_empty()
    })
    .await;
}

/// A sidecar on a private Redis with nothing to read, its waiting reader
/// listed.
struct Idle {
    _redis: PrivateRedis,
    fixture: Fixture,
    con: MultiplexedConnection,
    app: TestApp,
    running: Running,
    source: std::sync::Arc<dyn courier::source::Source>,
    /// The waiting reader's client id.
    reader: String,
}

impl Idle {
    async fn start(queue: &str, max_body: usize) -> Self {
        let redis = PrivateRedis::start().await;
        let fixture = Fixture::redis_at(&redis.url(), queue);
        let mut con = admin(&redis).await;
        let app = TestApp::start().await;
        let mut config = run_config(&fixture, &app, fast_policy());
        config.options.max_body = max_body;
        let running = Running::start(config).await;
        let source = fixture.open().await;
        let reader = wait_reader(&mut con, None).await;
        Self {
            _redis: redis,
            fixture,
            con,
            app,
            running,
            source,
            reader,
        }
    }

    /// Sends `body` and waits until the app has it.
    async fn deliver(&self, body: &str) {
        self.fixture.send(&self.source, body.to_string()).await;
        delivered(&self.app, body).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_courier_waits_for_an_arrival_instead_of_asking_redis_again_and_again() {
    let mut idle = Idle::start("idle", 1 << 20).await;
    idle.deliver("first").await;

    let before = calls(&mut idle.con, "xreadgroup").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let reads = calls(&mut idle.con, "xreadgroup").await - before;
    // Polling every 20 ms would read some 150 times in 3 s; a blocking read
    // reads once each time its wait runs out, every few seconds
    // (`idle.rs` holds the bound of every request an idle courier sends).
    assert!(reads <= 3, "{reads} reads of new entries in 3 idle seconds");

    idle.deliver(ARRIVAL).await;
    idle.running.stop().await;
}

/// A stop does not wait out the blocking read: `interrupt` ends it on the
/// server (`CLIENT UNBLOCK`), and the receive returns at once, empty. The
/// read blocks until the next look for abandoned entries, about 5 s after
/// the source opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupt_ends_the_blocking_read_at_once() {
    let redis = PrivateRedis::start().await;
    let fixture = Fixture::redis_at(&redis.url(), "interrupt");
    let mut con = admin(&redis).await;
    let source = fixture.open().await;
    let reading = tokio::spawn({
        let source = source.clone();
        async move {
            let read = source.receive(16).await;
            (read, std::time::Instant::now())
        }
    });
    wait_reader(&mut con, None).await;
    let interrupted = std::time::Instant::now();
    source.interrupt().await;
    let (read, returned) = reading.await.unwrap();
    assert!(read.unwrap().is_empty());
    let took = returned - interrupted;
    assert!(
        took < Duration::from_secs(2),
        "the receive returned {took:?} after the interrupt, as if its wait had run out"
    );
    assert!(waiting_readers(&text(&mut con, "CLIENT", "LIST").await).is_empty());

    // The next receive blocks again and gets what arrives.
    let reading = tokio::spawn({
        let source = source.clone();
        async move { source.receive(16).await }
    });
    wait_reader(&mut con, None).await;
    fixture.send(&source, ARRIVAL.to_string()).await;
    let read = reading.await.unwrap().unwrap();
    assert_eq!(read.len(), 1);
}

/// The retry mover of an idle queue looks at the retry set every few
/// seconds, not every 50 ms; a retry the sidecar stores wakes it, so the
/// retry still goes out when it is due.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_retry_mover_asks_redis_every_few_seconds_and_a_stored_retry_wakes_it() {
    const WINDOW: Duration = Duration::from_secs(6);
    let mut idle = Idle::start("mover", 1 << 20).await;
    idle.deliver("first").await;

    // Two movers run: the sidecar's and the test's own source's. Each
    // claims with one script call that runs ZRANGEBYSCORE once.
    let before = calls(&mut idle.con, "zrangebyscore").await;
    tokio::time::sleep(WINDOW).await;
    let rounds = calls(&mut idle.con, "zrangebyscore").await - before;
    // Every 50 ms, two movers made some 240 rounds in 6 s; every 10 s at
    // most, they make 1 or 2 rounds each.
    assert!(
        rounds <= 4,
        "{rounds} rounds of the retry movers in {WINDOW:?} of an idle queue"
    );

    // The policy's first backoff is 50 ms: the retry is due at once, and
    // the mover is not left to find it at its next look.
    let body = "script:503,200\nretried while idle";
    idle.fixture.send(&idle.source, body.to_string()).await;
    let mut seen = Vec::new();
    wait_for("the retry", LIMIT, async || {
        seen = idle.app.received_body(body.as_bytes());
        seen.len() == 2
    })
    .await;
    let gap = seen[1].at - seen[0].at;
    assert!(
        gap < Duration::from_secs(2),
        "the retry, due 50 ms after the first attempt, came {gap:?} after it"
    );
    idle.running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_entry_arriving_at_an_idle_queue_is_dead_lettered_without_being_delivered() {
    const MAX_BODY: usize = 1_024;
    const SIZE: usize = 4_096;
    let idle = Idle::start("oversize", MAX_BODY).await;

    let id = idle.fixture.send(&idle.source, vec![b'x'; SIZE]).await;
    idle.deliver(ARRIVAL).await;
    wait_for("the dead letter", LIMIT, async || {
        idle.source.depth().await.unwrap().dead_letters == 1
    })
    .await;
    let letters = idle.fixture.dead_letters(&idle.source).await;
    assert_oversized(&letters[0], &[id], SIZE, MAX_BODY);
    assert!(idle.app.received().iter().all(|r| r.body.len() < SIZE));
    idle.running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_arrives_when_the_waiting_connection_was_killed_and_the_reader_waits_again() {
    let mut idle = Idle::start("killed", 1 << 20).await;
    let killed: u64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(&idle.reader)
        .query_async(&mut idle.con)
        .await
        .unwrap();
    assert_eq!(killed, 1);
    idle.deliver(ARRIVAL).await;

    let again = wait_reader(&mut idle.con, Some(&idle.reader)).await;
    assert_ne!(again, idle.reader);
    idle.deliver("after the reader came back").await;
    idle.running.stop().await;
}

/// Waiting needs nothing beyond reading the stream: an ACL user without
/// `+client` (which key tracking needed) reads, waits and is told of
/// nothing it lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_without_client_commands_waits_for_arrivals_too() {
    let redis = PrivateRedis::start().await;
    let mut con = admin(&redis).await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg("courier")
        .arg("on")
        .arg(">secret")
        .arg("~*")
        .arg("&*")
        .arg("+@all")
        .arg("-client")
        .query_async(&mut con)
        .await
        .unwrap();
    let url = redis.url().replace("redis://", "redis://courier:secret@");
    let fixture = Fixture::redis_at(&url, "no-client");
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(dir.path(), "maxAttempts: 3\ntimeout: 2s");
    let mut courier = CourierProcess::run(&run_args(&fixture, &app, &policy, "waiting"));
    let source = fixture.open().await;
    for body in [ARRIVAL, "and another"] {
        fixture.send(&source, body).await;
        delivered(&app, body).await;
    }
    wait_reader(&mut con, None).await;
    assert!(!courier.log().contains("secret"), "{}", courier.log());
    assert!(!courier.log().contains("new entries"), "{}", courier.log());
    assert!(courier.running(), "{}", courier.log());
}
