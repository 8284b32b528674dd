//! Redis under hostile state: keys of the wrong type where courier writes
//! retries and dead letters, messages wider than a Lua script can write,
//! unreadable stored retries, deliveries kept in flight, live settings, and
//! poison pills counted by Redis itself. Real Redis on loopback, a real app.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use bytes::Bytes;
use courier::source::{self, LiveSettings, Source, SourceOptions, encode_fields};
use redis::aio::MultiplexedConnection;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const SETTLE: Duration = Duration::from_secs(30);
/// More fields than a Lua script can pass to one command (about 8,000
/// values, i.e. 4,000 fields), and more headers than courier offers an app.
const WIDE: usize = 5_000;
/// As many header fields as courier offers an app.
const CAP: usize = courier::forward::MAX_HEADERS;

async fn redis() -> MultiplexedConnection {
    redis_connection(REDIS_URL).await.unwrap()
}

/// How many entries of `queue` the group `courier` holds pending.
async fn pending(con: &mut MultiplexedConnection, queue: &str) -> u64 {
    let reply: redis::Value = redis::cmd("XPENDING")
        .arg(queue)
        .arg("courier")
        .query_async(con)
        .await
        .unwrap();
    match reply {
        redis::Value::Array(parts) => match parts.first() {
            Some(redis::Value::Int(n)) => *n as u64,
            _ => 0,
        },
        _ => 0,
    }
}

async fn xlen(con: &mut MultiplexedConnection, key: &str) -> u64 {
    redis::cmd("XLEN").arg(key).query_async(con).await.unwrap()
}

async fn get(con: &mut MultiplexedConnection, key: &str) -> Option<String> {
    redis::cmd("GET").arg(key).query_async(con).await.unwrap()
}

/// A source on `fixture`'s queue as consumer `consumer`.
async fn open_as(fixture: &Fixture, consumer: &str, visibility: Duration) -> Arc<dyn Source> {
    let mut options = SourceOptions::new(&fixture.queue);
    options.consumer = consumer.into();
    options.live.visibility_timeout = visibility;
    source::open(&fixture.url, options).await.unwrap()
}

// === Settle atomically or not at all ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwritable_dead_letter_queue_acks_nothing_away() {
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let mut con = redis().await;
    let _: () = redis::cmd("SET")
        .arg(fixture.dlq())
        .arg("x")
        .query_async(&mut con)
        .await
        .unwrap();
    let body = "script:400";
    fixture.send(&source, body).await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;

    // The dead letter cannot be written, so the message is not acked: it
    // stays pending and is handed out again after the visibility timeout.
    wait_for("the 400 to be delivered twice", SETTLE, async || {
        app.received_body(body.as_bytes()).len() >= 2
    })
    .await;
    assert_eq!(pending(&mut con, &fixture.queue).await, 1, "still pending");
    assert_eq!(get(&mut con, &fixture.dlq()).await.as_deref(), Some("x"));

    // Once the key is fixed, the next delivery is dead-lettered.
    let _: () = redis::cmd("DEL")
        .arg(fixture.dlq())
        .query_async(&mut con)
        .await
        .unwrap();
    wait_for("the dead letter", SETTLE, async || {
        xlen(&mut con, &fixture.dlq()).await == 1 && pending(&mut con, &fixture.queue).await == 0
    })
    .await;
    running.stop().await;
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters[0].field("courier-reason"), Some("permanent-status"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unwritable_retry_set_acks_nothing_away() {
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let mut con = redis().await;
    let retry_key = format!("{}.retry", fixture.queue);
    let _: () = redis::cmd("SET")
        .arg(&retry_key)
        .arg("x")
        .query_async(&mut con)
        .await
        .unwrap();
    let body = "script:503";
    fixture.send(&source, body).await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;

    wait_for("the 503 to be delivered twice", SETTLE, async || {
        app.received_body(body.as_bytes()).len() >= 2
    })
    .await;
    assert_eq!(pending(&mut con, &fixture.queue).await, 1, "still pending");
    assert_eq!(get(&mut con, &retry_key).await.as_deref(), Some("x"));
    assert_eq!(xlen(&mut con, &fixture.dlq()).await, 0);

    // Fixed, the message goes on: retried, then out of attempts.
    let _: () = redis::cmd("DEL")
        .arg(&retry_key)
        .query_async(&mut con)
        .await
        .unwrap();
    wait_for("the dead letter", SETTLE, async || {
        xlen(&mut con, &fixture.dlq()).await == 1
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(
        letters[0].field("courier-reason"),
        Some("attempts-exhausted")
    );
}

// === Whatever courier stored, it can move and read back ===

/// An app that takes any number of headers (hyper's server stops at 100):
/// it answers the n-th request for a body with the n-th of `statuses` (the
/// last repeats) and records each request's body and `x-f*` header count.
#[derive(Clone)]
struct WideApp {
    url: String,
    seen: Arc<Mutex<Vec<(Bytes, usize)>>>,
}

impl WideApp {
    async fn start(statuses: &'static [u16]) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let app = Self {
            url: format!("http://{}/", listener.local_addr().unwrap()),
            seen: Arc::default(),
        };
        let seen = app.seen.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let seen = seen.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 65536];
                    let head_end = loop {
                        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            break at + 4;
                        }
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    };
                    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    let wide = head.lines().filter(|l| l.starts_with("x-f")).count();
                    while buf.len() < head_end + length {
                        match stream.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let body = Bytes::copy_from_slice(&buf[head_end..head_end + length]);
                    let status = {
                        let mut seen = seen.lock().unwrap();
                        let n = seen.iter().filter(|(b, _)| *b == body).count();
                        seen.push((body, wide));
                        statuses[n.min(statuses.len() - 1)]
                    };
                    let answer = format!(
                        "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                    );
                    let _ = stream.write_all(answer.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        app
    }

    fn seen(&self) -> Vec<(Bytes, usize)> {
        self.seen.lock().unwrap().clone()
    }
}

/// XADDs a message with a body and `fields` header fields.
async fn send_wide(
    con: &mut MultiplexedConnection,
    queue: &str,
    body: &str,
    fields: usize,
) -> String {
    let mut xadd = redis::cmd("XADD");
    xadd.arg(queue).arg("*").arg("payload").arg(body);
    for i in 0..fields {
        xadd.arg(format!("x-f{i}")).arg(format!("v{i}"));
    }
    xadd.query_async(con).await.unwrap()
}

/// A message with as many headers as courier offers keeps them all through
/// a retry: the fields courier adds to the stored retry do not push it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_of_the_most_headers_goes_through_a_retry() {
    let fixture = Fixture::redis();
    let app = WideApp::start(&[503, 200]).await;
    let source = fixture.open().await;
    let mut con = redis().await;
    send_wide(&mut con, &fixture.queue, "wide", CAP).await;
    let running = Running::start(run_config_for(&fixture, &app.url, fast_policy())).await;
    wait_for("the retry to be delivered", SETTLE, async || {
        app.seen().len() >= 2
    })
    .await;
    let depth = wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert_eq!(depth.dead_letters, 0);
    let seen = app.seen();
    assert_eq!(seen.len(), 2, "one 503, one 200");
    assert!(
        seen.iter().all(|(_, wide)| *wide == CAP),
        "every field arrived both times: {:?}",
        seen.iter().map(|(_, w)| w).collect::<Vec<_>>()
    );
}

/// A message wider than a Lua script can write in one command, and with
/// more headers than courier offers: it is dead-lettered whole as
/// undeliverable, and a replay writes every field back to the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_of_5000_fields_is_dead_lettered_whole_and_replayed_whole() {
    let fixture = Fixture::redis();
    let app = WideApp::start(&[200]).await;
    let source = fixture.open().await;
    let mut con = redis().await;
    send_wide(&mut con, &fixture.queue, "wide", WIDE).await;
    let running = Running::start(run_config_for(&fixture, &app.url, fast_policy())).await;
    wait_for("the dead letter", SETTLE, async || {
        xlen(&mut con, &fixture.dlq()).await == 1
    })
    .await;
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters[0].field("courier-reason"), Some("undeliverable"));
    assert_eq!(letters[0].field(&format!("x-f{}", WIDE - 1)), Some("v4999"));
    assert_eq!(letters[0].body, Bytes::from("wide"));
    running.stop().await;
    source.replay(&fixture.dlq(), &letters[0]).await.unwrap();
    let entries: redis::Value = redis::cmd("XRANGE")
        .arg(&fixture.queue)
        .arg("-")
        .arg("+")
        .query_async(&mut con)
        .await
        .unwrap();
    let replayed = last_entry_fields(entries);
    let headers = replayed.iter().filter(|f| f.starts_with("x-f")).count();
    assert_eq!(headers, WIDE, "every field was replayed");
    assert_eq!(xlen(&mut con, &fixture.dlq()).await, 0, "the letter left");
    assert!(app.seen().is_empty(), "the app was never offered it");
    // A second replay of the same letter finds it gone and writes nothing.
    let again = source.replay(&fixture.dlq(), &letters[0]).await;
    assert!(again.is_err());
    assert_eq!(
        xlen(&mut con, &fixture.queue).await,
        2,
        "sent once, replayed once"
    );
}

/// The field names of the last entry of an XRANGE reply.
fn last_entry_fields(reply: redis::Value) -> Vec<String> {
    let redis::Value::Array(entries) = reply else {
        panic!("XRANGE answered {reply:?}")
    };
    let Some(redis::Value::Array(entry)) = entries.last() else {
        panic!("the queue is empty")
    };
    let Some(redis::Value::Array(fields)) = entry.get(1) else {
        panic!("an entry without fields: {entry:?}")
    };
    fields
        .iter()
        .step_by(2)
        .map(|f| match f {
            redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
            other => panic!("a field name {other:?}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_stored_retry_is_dead_lettered_and_the_rest_move_on() {
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let mut con = redis().await;
    let retry_key = format!("{}.retry", fixture.queue);
    let good = encode_fields(&[(Bytes::from("payload"), Bytes::from("good retry"))]);
    let _: () = redis::cmd("ZADD")
        .arg(&retry_key)
        .arg(0)
        .arg("not a stored message")
        .arg(1)
        .arg(good)
        .query_async(&mut con)
        .await
        .unwrap();
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_for("the good retry to be delivered", SETTLE, async || {
        !app.received_body(b"good retry").is_empty()
    })
    .await;
    wait_for(
        "the unreadable one to be dead-lettered",
        SETTLE,
        async || xlen(&mut con, &fixture.dlq()).await == 1,
    )
    .await;
    let depth = wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert_eq!(depth.retry_backlog, 0);
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters[0].field("courier-reason"), Some("undeliverable"));
    assert_eq!(letters[0].body, Bytes::from("not a stored message"));
}

/// `ACL SETUSER user ...rules` on the shared Redis.
/// How many XADDs Redis refused `user`, by its ACL log.
async fn refused_xadds(con: &mut MultiplexedConnection, user: &str) -> i64 {
    let entries: Vec<std::collections::HashMap<String, redis::Value>> =
        redis::cmd("ACL").arg("LOG").query_async(con).await.unwrap();
    let text = |v: Option<&redis::Value>| match v {
        Some(redis::Value::BulkString(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(redis::Value::SimpleString(s)) => s.clone(),
        _ => String::new(),
    };
    entries
        .iter()
        .filter(|e| text(e.get("username")) == user && text(e.get("object")) == "xadd")
        .map(|e| match e.get("count") {
            Some(redis::Value::Int(n)) => *n,
            _ => 0,
        })
        .sum()
}

async fn acl(con: &mut MultiplexedConnection, user: &str, rules: &[&str]) {
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(user)
        .arg(rules)
        .query_async(con)
        .await
        .unwrap();
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A due retry is claimed (its score pushed 30 s ahead) before it is
/// written back; when that write fails, as when a cluster master dies
/// between the two, the mover writes it again on its next round rather
/// than leaving it idle until the claim runs out. Here Redis refuses the
/// user's `XADD` until the retry has been claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_whose_move_failed_is_moved_again_before_its_claim_runs_out() {
    let mut con = redis().await;
    let user = unique("mover");
    acl(
        &mut con,
        &user,
        &["on", ">secret", "~*", "&*", "+@all", "-xadd"],
    )
    .await;
    let url = REDIS_URL.replace("redis://", &format!("redis://{user}:secret@"));
    let fixture = Fixture::redis_at(&url, &unique("unmoved"));
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let retry_key = format!("{}.retry", fixture.queue);
    let stored = encode_fields(&[(Bytes::from("payload"), Bytes::from("moved again"))]);
    let _: () = redis::cmd("ZADD")
        .arg(&retry_key)
        .arg(0)
        .arg(&stored[..])
        .query_async(&mut con)
        .await
        .unwrap();
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_for("the retry to be claimed", SETTLE, async || {
        let score: Option<f64> = redis::cmd("ZSCORE")
            .arg(&retry_key)
            .arg(&stored[..])
            .query_async(&mut con)
            .await
            .unwrap();
        score.is_some_and(|s| s as u64 > now_ms() + 20_000)
    })
    .await;
    // A few of the mover's rounds (one each 50 ms) fail meanwhile: Redis
    // logs each XADD it refused the user in its ACL log.
    wait_for("three refused moves", SETTLE, async || {
        refused_xadds(&mut con, &user).await >= 3
    })
    .await;
    assert!(app.received_body(b"moved again").is_empty());
    assert_eq!(
        xlen(&mut con, &fixture.queue).await,
        0,
        "nothing written back"
    );

    acl(&mut con, &user, &["+xadd"]).await;
    // Well inside the claim's 30 s: without the mover's memory of what it
    // claimed, the retry waits out the claim.
    wait_for(
        "the retry to be delivered before its claim ran out",
        Duration::from_secs(15),
        async || !app.received_body(b"moved again").is_empty(),
    )
    .await;
    let depth = wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert_eq!(depth.retry_backlog, 0);
    assert_eq!(
        app.received_body(b"moved again").len(),
        1,
        "written back once"
    );
    let _: () = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(&user)
        .query_async(&mut con)
        .await
        .unwrap();
}

// === Keep in-flight claimed; live settings ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_kept_alive_is_not_reclaimed() {
    let fixture = Fixture::redis();
    let visibility = Duration::from_secs(60);
    let a = open_as(&fixture, "a", visibility).await;
    let mut con = redis().await;
    fixture.send(&a, "in flight").await;
    let mut held = Vec::new();
    wait_for("the delivery", SETTLE, async || {
        held = a.receive(10).await.unwrap();
        !held.is_empty()
    })
    .await;
    let id = held[0].receipt.clone();
    // As if the app had worked on it for ten minutes.
    let make_idle = async |con: &mut MultiplexedConnection| {
        let _: redis::Value = redis::cmd("XCLAIM")
            .arg(&fixture.queue)
            .arg("courier")
            .arg("a")
            .arg(0)
            .arg(&id)
            .arg("IDLE")
            .arg(600_000)
            .arg("JUSTID")
            .query_async(con)
            .await
            .unwrap();
    };
    let autoclaim = async |con: &mut MultiplexedConnection| -> Vec<String> {
        let reply: (String, Vec<String>, Vec<String>) = redis::cmd("XAUTOCLAIM")
            .arg(&fixture.queue)
            .arg("courier")
            .arg("b")
            .arg(visibility.as_millis() as u64)
            .arg("0-0")
            .arg("JUSTID")
            .query_async(con)
            .await
            .unwrap();
        reply.1
    };
    make_idle(&mut con).await;
    a.keep_alive(&held).await.unwrap();
    assert!(autoclaim(&mut con).await.is_empty(), "kept alive");

    // Without keep-alive another consumer takes it; keep-alive then leaves
    // it with that consumer rather than stealing it back.
    make_idle(&mut con).await;
    assert_eq!(autoclaim(&mut con).await, vec![id.clone()]);
    a.keep_alive(&held).await.unwrap();
    let owner: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(&fixture.queue)
        .arg("courier")
        .arg(&id)
        .arg(&id)
        .arg(1)
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(owner[0].1, "b");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_visibility_timeout_takes_effect() {
    let fixture = Fixture::redis();
    let a = open_as(&fixture, "a", Duration::from_secs(60)).await;
    fixture.send(&a, "left pending by a").await;
    wait_for("a to take it", SETTLE, async || {
        !a.receive(10).await.unwrap().is_empty()
    })
    .await;
    let b = open_as(&fixture, "b", Duration::from_secs(60)).await;
    b.apply(&LiveSettings {
        visibility_timeout: Duration::from_millis(300),
        dead_letter_queue: fixture.dlq(),
        max_deliveries: 7,
    });
    // At 60 s this would take a minute; at 300 ms it is reclaimed at once.
    wait_for("b to reclaim it", Duration::from_secs(10), async || {
        b.receive(10)
            .await
            .unwrap()
            .iter()
            .any(|d| d.message.body == "left pending by a")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn depth_follows_a_live_dead_letter_queue() {
    let fixture = Fixture::redis();
    let source = open_as(&fixture, "a", Duration::from_secs(60)).await;
    let mut con = redis().await;
    let other = format!("{}.elsewhere", fixture.queue);
    let _: String = redis::cmd("XADD")
        .arg(&other)
        .arg("*")
        .arg("payload")
        .arg("x")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(source.depth().await.unwrap().dead_letters, 0);
    let live = LiveSettings {
        visibility_timeout: Duration::from_secs(60),
        dead_letter_queue: other.clone(),
        max_deliveries: 7,
    };
    assert_eq!(source.check(&live), Ok(()), "not a cluster: any name");
    source.apply(&live);
    assert_eq!(source.depth().await.unwrap().dead_letters, 1);
    let _: () = redis::cmd("DEL")
        .arg(&other)
        .query_async(&mut con)
        .await
        .unwrap();
}

// === Poison pills ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_handed_out_too_often_is_dead_lettered_by_the_counter() {
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let mut con = redis().await;
    let pill = fixture.send(&source, "poison pill").await;
    fixture.send(&source, "good message").await;
    // A consumer that crashes on it every time: handed out 7 times, never
    // settled, and idle long past the visibility timeout.
    hand_out_unsettled(&mut con, &fixture.queue, &pill, 7).await;
    let mut config = run_config(&fixture, &app, fast_policy());
    config.options.live.max_deliveries = 7;
    let running = Running::start(config).await;
    wait_for("the pill's dead letter", SETTLE, async || {
        xlen(&mut con, &fixture.dlq()).await == 1
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert!(
        app.received_body(b"poison pill").is_empty(),
        "never offered"
    );
    assert_eq!(app.received_body(b"good message").len(), 1);
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    let letter = &letters[0];
    assert_eq!(letter.body, Bytes::from("poison pill"));
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    assert_eq!(
        letter.field("courier-error"),
        Some("handed out 7 times without being settled")
    );
    assert_eq!(letter.field("courier-message-id"), Some(pill.as_str()));
    // It replays like any other dead letter.
    source.replay(&fixture.dlq(), letter).await.unwrap();
}

// === Reads bounded in bytes ===

/// `courier run` as a child process on `fixture` with `extra` flags (the
/// built binary, so its memory is its own), returned once a first message
/// went through, with its peak RSS then (the baseline of a memory bound)
/// and the directory of its policy file, which must outlive it.
async fn warmed_up(
    fixture: &Fixture,
    source: &Arc<dyn Source>,
    app: &TestApp,
    name: &str,
    extra: &[&str],
) -> (std::process::Child, u64, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(dir.path(), "maxAttempts: 3\ntimeout: 2s");
    let courier = courier_command()
        .args(["run"])
        .args(run_args(fixture, app, &policy, name))
        .args(extra)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start courier run");
    fixture.send(source, "warm-up").await;
    delivered(app, "warm-up").await;
    let warm = peak_rss(courier.id());
    (courier, warm, dir)
}

async fn delivered(app: &TestApp, body: &str) {
    wait_for(body, SETTLE, async || {
        !app.received_body(body.as_bytes()).is_empty()
    })
    .await
}

/// A 40 MiB entry read alone, with the default `--max-body` (4 MiB): its
/// bytes never sit in courier's memory (the peak RSS grows by far less than
/// the entry from what it was after a first delivery; an absolute bound
/// would measure the binary's own size instead), the message after it is
/// delivered, and the dead letter keeps the whole body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_40_mib_entry_is_dead_lettered_without_being_loaded() {
    const BIG: usize = 40 << 20;
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let mut con = redis().await;
    let (mut courier, warm, _policy) = warmed_up(&fixture, &source, &app, "bounded", &[]).await;
    let id: String = redis::cmd("XADD")
        .arg(&fixture.queue)
        .arg("*")
        .arg("payload")
        .arg(vec![b'x'; BIG])
        .query_async(&mut con)
        .await
        .unwrap();
    fixture.send(&source, "small, after it").await;
    delivered(&app, "small, after it").await;
    wait_for("the dead letter", SETTLE, async || {
        xlen(&mut con, &fixture.dlq()).await == 1
    })
    .await;
    let peak = peak_rss(courier.id());
    courier.kill().unwrap();
    courier.wait().unwrap();
    assert_rss_grew_less(warm, peak, BIG / 8, "a 40 MiB entry");
    assert!(app.received().iter().all(|r| r.body.len() < BIG));
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    let letter = &letters[0];
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    assert_eq!(letter.field("courier-message-id"), Some(id.as_str()));
    assert_eq!(
        letter.field("courier-error"),
        Some(format!("the body is {BIG} bytes, over --max-body {}", 4 << 20).as_str())
    );
    assert_eq!(letter.body.len(), BIG, "the body is kept");
    // 80 MiB of a shared Redis's memory, not left behind.
    let _: () = redis::cmd("DEL")
        .arg(&fixture.queue)
        .arg(fixture.dlq())
        .query_async(&mut con)
        .await
        .unwrap();
}

/// A 20 MiB entry between two small ones, all three in one read's batch
/// (one MULTI while the reader waits), with `--max-body 1MiB`: the reader
/// discards its bytes as they arrive, so courier's memory never holds it
/// (its peak RSS grows by far less than the entry from what it was after a
/// first delivery), the small ones are delivered, and the dead letter is
/// the one the read script wrote: the whole body and the entry's other
/// fields, reason `undeliverable`, the size in the error, attempt 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_20_mib_entry_in_a_batch_is_discarded_on_the_way_in_and_dead_lettered_whole() {
    const BIG: usize = 20 << 20;
    const MAX_BODY: usize = 1 << 20;
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let mut con = redis().await;
    let (mut courier, warm, _policy) = warmed_up(
        &fixture,
        &source,
        &app,
        "discarding",
        &["--max-body", "1MiB"],
    )
    .await;
    let (_, id, _): (String, String, String) = redis::pipe()
        .atomic()
        .cmd("XADD")
        .arg(&fixture.queue)
        .arg("*")
        .arg("payload")
        .arg("small, before it")
        .cmd("XADD")
        .arg(&fixture.queue)
        .arg("*")
        .arg("payload")
        .arg(vec![b'x'; BIG])
        .arg("content-type")
        .arg("text/plain")
        .cmd("XADD")
        .arg(&fixture.queue)
        .arg("*")
        .arg("payload")
        .arg("small, after it")
        .query_async(&mut con)
        .await
        .unwrap();
    delivered(&app, "small, before it").await;
    delivered(&app, "small, after it").await;
    wait_for("the dead letter", SETTLE, async || {
        xlen(&mut con, &fixture.dlq()).await == 1
    })
    .await;
    let peak = peak_rss(courier.id());
    courier.kill().unwrap();
    courier.wait().unwrap();
    assert_rss_grew_less(warm, peak, BIG / 4, "a 20 MiB entry");
    assert!(app.received().iter().all(|r| r.body.len() <= MAX_BODY));
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    let letter = &letters[0];
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    assert_eq!(letter.field("courier-message-id"), Some(id.as_str()));
    assert_eq!(letter.field("courier-queue"), Some(fixture.queue.as_str()));
    assert_eq!(letter.field("courier-attempts"), Some("1"));
    assert_eq!(letter.field("courier-status"), Some(""));
    assert_eq!(letter.field("content-type"), Some("text/plain"));
    assert_eq!(
        letter.field("courier-error"),
        Some(format!("the body is {BIG} bytes, over --max-body {MAX_BODY}").as_str())
    );
    assert_eq!(letter.body.len(), BIG, "the body is kept");
    // The big entry itself: the small ones' acks may still be on their way
    // (they are gathered in the background), so the group's pending total
    // is not yet 0 when the dead letter appears.
    let still: Vec<redis::Value> = redis::cmd("XPENDING")
        .arg(&fixture.queue)
        .arg("courier")
        .arg(&id)
        .arg(&id)
        .arg(1)
        .query_async(&mut con)
        .await
        .unwrap();
    assert!(
        still.is_empty(),
        "the big entry is acked with its dead letter: {still:?}"
    );
    let _: () = redis::cmd("DEL")
        .arg(&fixture.queue)
        .arg(fixture.dlq())
        .query_async(&mut con)
        .await
        .unwrap();
}

/// Hands entry `id` (the first new one) out `times` times to a consumer that
/// never settles it, leaving it idle long past any visibility timeout.
async fn hand_out_unsettled(con: &mut MultiplexedConnection, queue: &str, id: &str, times: u32) {
    let _: redis::Value = redis::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("courier")
        .arg("crashy")
        .arg("COUNT")
        .arg(1)
        .arg("STREAMS")
        .arg(queue)
        .arg(">")
        .query_async(con)
        .await
        .unwrap();
    for _ in 1..times {
        let _: redis::Value = redis::cmd("XCLAIM")
            .arg(queue)
            .arg("courier")
            .arg("crashy")
            .arg(0)
            .arg(id)
            .arg("IDLE")
            .arg(600_000)
            .query_async(con)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_pill_too_wide_for_a_script_keeps_its_body() {
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let mut con = redis().await;
    let pill = send_wide(&mut con, &fixture.queue, "wide pill", WIDE).await;
    hand_out_unsettled(&mut con, &fixture.queue, &pill, 7).await;
    let mut config = run_config(&fixture, &app, fast_policy());
    config.options.live.max_deliveries = 7;
    let running = Running::start(config).await;
    wait_for("the pill's dead letter", SETTLE, async || {
        xlen(&mut con, &fixture.dlq()).await == 1
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert!(app.received().is_empty(), "never offered");
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    let letter = &letters[0];
    assert_eq!(letter.body, Bytes::from("wide pill"));
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    let error = letter.field("courier-error").unwrap();
    assert!(
        error.starts_with("handed out 7 times without being settled")
            && error.contains("its 5001 fields were too many to keep"),
        "{error}"
    );
}

/// Found at 21da363: an entry over `--max-body` that a Redis script
/// dead-lettered (never loaded into courier) was not counted in
/// `courier_dead_letters_total`, so the dashboards and the dead-letter
/// alerts did not see it. It counts as `undeliverable`, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_entry_dead_lettered_inside_redis_is_counted() {
    let fixture = Fixture::redis();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let mut config = run_config(&fixture, &app, fast_policy());
    config.options.max_body = 1024;
    let running = Running::start(config).await;
    let mut con = redis().await;
    let _: String = redis::cmd("XADD")
        .arg(&fixture.queue)
        .arg("*")
        .arg("payload")
        .arg(vec![b'x'; 4096])
        .query_async(&mut con)
        .await
        .unwrap();
    fixture.send(&source, "small, after it").await;
    delivered(&app, "small, after it").await;
    let counted = |text: &str| {
        let reason = "reason=\"undeliverable\"";
        text.lines()
            .filter(|l| {
                l.starts_with("courier_dead_letters_total{")
                    && l.contains(&fixture.queue)
                    && l.contains(reason)
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>()
    };
    wait_for("the dead letter counted", SETTLE, async || {
        counted(&running.metrics.encode()) == 1.0
    })
    .await;
    assert_eq!(xlen(&mut con, &fixture.dlq()).await, 1);
    // Counted once, not at every depth poll.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(counted(&running.metrics.encode()), 1.0);
    running.stop().await;
}
