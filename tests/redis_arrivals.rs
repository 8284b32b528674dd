//! An idle Redis reader wakes when an entry arrives (`CLIENT TRACKING` on a
//! connection of its own) instead of asking Redis again and again: what an
//! operator sees of it in `CLIENT LIST` and `INFO commandstats`, the entry
//! over `--max-body` still dead-lettered without being loaded, the tracking
//! connection killed, and a Redis that refuses tracking. Each test has a
//! private `redis-server`, so the clients and counts it reads are courier's.

mod common;

use std::time::Duration;

use common::*;
use redis::aio::MultiplexedConnection;

const LIMIT: Duration = Duration::from_secs(30);
/// What the app is sent after an idle spell, to see it delivered.
const ARRIVAL: &str = "arrived while courier was idle";

async fn admin(redis: &PrivateRedis) -> MultiplexedConnection {
    redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap()
}

/// The text Redis answers `command arg` with.
async fn text(con: &mut MultiplexedConnection, command: &str, arg: &str) -> String {
    redis::cmd(command).arg(arg).query_async(con).await.unwrap()
}

/// Waits until exactly one client tracks keys, other than `not`; returns
/// its id.
async fn wait_tracking(con: &mut MultiplexedConnection, not: Option<&str>) -> String {
    let mut found = Vec::new();
    wait_for("courier's tracking connection", LIMIT, async || {
        found = tracking_clients(&text(con, "CLIENT", "LIST").await);
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

/// A sidecar on a private Redis with nothing to read, its tracking
/// connection listed.
struct Idle {
    _redis: PrivateRedis,
    fixture: Fixture,
    con: MultiplexedConnection,
    app: TestApp,
    running: Running,
    source: std::sync::Arc<dyn courier::source::Source>,
    /// The tracking connection's client id.
    tracking: String,
}

impl Idle {
    async fn start(queue: &str, max_body: usize) -> Self {
        let redis = PrivateRedis::start().await;
        let fixture = Fixture::redis_at(&redis.url(), queue);
        let mut con = admin(&redis).await;
        let app = TestApp::start().await;
        let mut config = run_config(&fixture, &app, fast_policy());
        config.max_body = max_body;
        let running = Running::start(config).await;
        let source = fixture.open().await;
        let tracking = wait_tracking(&mut con, None).await;
        Self {
            _redis: redis,
            fixture,
            con,
            app,
            running,
            source,
            tracking,
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
    // Polling every 20 ms reads some 150 times in 3 s; waiting for an
    // arrival reads about twice a second, when each receive ends.
    assert!(
        reads <= 30,
        "{reads} reads of new entries in 3 idle seconds"
    );

    idle.deliver(ARRIVAL).await;
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
async fn an_entry_arrives_when_the_tracking_connection_was_killed_and_tracking_comes_back() {
    let mut idle = Idle::start("killed", 1 << 20).await;
    let killed: u64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("ID")
        .arg(&idle.tracking)
        .query_async(&mut idle.con)
        .await
        .unwrap();
    assert_eq!(killed, 1);
    idle.deliver(ARRIVAL).await;

    let again = wait_tracking(&mut idle.con, Some(&idle.tracking)).await;
    assert_ne!(again, idle.tracking);
    idle.deliver("after tracking came back").await;
    idle.running.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_refuses_tracking_is_polled_and_says_so_once() {
    const REFUSED: &str = "Redis refused the key tracking (CLIENT TRACKING over RESP3) that tells courier of new entries at once; new entries are found by asking every 20 ms instead";
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
    let fixture = Fixture::redis_at(&url, "refused");
    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(dir.path(), "maxAttempts: 3\ntimeout: 2s");
    let mut courier = CourierProcess::run(&run_args(&fixture, &app, &policy, "polling"));
    let line = courier.wait_log(REFUSED, LIMIT).await;
    assert_eq!(line["level"], "WARN", "{line}");
    assert!(!courier.log().contains("secret"), "{}", courier.log());

    let source = fixture.open().await;
    for body in [ARRIVAL, "and another"] {
        fixture.send(&source, body).await;
        delivered(&app, body).await;
    }
    assert!(tracking_clients(&text(&mut con, "CLIENT", "LIST").await).is_empty());
    let said = courier.log().matches(REFUSED).count();
    assert_eq!(said, 1, "{}", courier.log());
    assert!(courier.running(), "{}", courier.log());
}
