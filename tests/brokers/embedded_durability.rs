//! What the embedded queue promises across `kill -9`, tested on a real
//! process: a child (this test binary run again, see [`child_workload`])
//! sends and acks as fast as it can and says on stdout what returned and
//! when; it is killed with SIGKILL mid-stream; the file is opened again and
//! drained.
//!
//! - every `send` that returned is there (handed out again, or acked);
//! - every ack that returned more than [`ACK_BOUND`] before the kill stays
//!   acked: the message is not handed out again. An ack younger than that
//!   may be undone (at-least-once: the message comes again).
//!
//! The bound in `docs/sources.md` is the flush interval (20 ms) plus the one
//! fsynced commit that writes it; [`COMMIT_ALLOWANCE`] is what this test
//! grants a commit on a loaded, shared machine.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::common::*;
use bytes::Bytes;
use courier::source::{self, SourceOptions};

/// Set, the child runs the workload in this directory.
const CHILD_DIR: &str = "EMBEDDED_DURABILITY_CHILD_DIR";
const QUEUE: &str = "durable";
const VISIBILITY: Duration = Duration::from_millis(300);
/// The flush interval of hand-outs and acks held in memory.
const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// What one fsynced commit may take here.
const COMMIT_ALLOWANCE: Duration = Duration::from_millis(500);
const ACK_BOUND: Duration =
    Duration::from_millis(FLUSH_EVERY.as_millis() as u64 + COMMIT_ALLOWANCE.as_millis() as u64);

/// The name libtest gives the test `name` of this module (its path without
/// the crate's), for `--exact` when a test runs this binary again on it.
fn this_module_test(name: &str) -> String {
    let module = module_path!().split_once("::").map_or("", |(_, m)| m);
    format!("{module}::{name}")
}

fn wall_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn options() -> SourceOptions {
    let mut options = SourceOptions::new(QUEUE);
    options.live.visibility_timeout = VISIBILITY;
    options.create = true;
    options
}

/// The child: four tasks send, one receives and acks, and every call that
/// returned is printed (`sent <id>`, `acked <id> <wall ms>`) before the next
/// is made; an ack is also announced before it is made (`acking <id>`). Without [`CHILD_DIR`] (an ordinary test run) it does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn child_workload() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let url = courier::source::embedded::url(std::path::Path::new(&dir));
    let source = source::open(&url, options()).await.unwrap();
    let say = |line: String| {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}").unwrap();
        out.flush().unwrap();
    };
    // libtest has printed "test child_workload ... " without a line end;
    // ending that line keeps the first "sent"/"acked" line whole.
    say(String::new());
    for task in 0..4 {
        let source = source.clone();
        tokio::spawn(async move {
            for i in 0.. {
                let id = source
                    .send(Bytes::from(format!("{task}/{i}")), &[])
                    .await
                    .unwrap();
                say(format!("sent {id}"));
            }
        });
    }
    loop {
        for delivery in source.receive(16).await.unwrap() {
            say(format!("acking {}", delivery.message.id));
            source.ack(&delivery).await.unwrap();
            say(format!("acked {} {}", delivery.message.id, wall_ms()));
        }
    }
}

#[derive(Default)]
struct Said {
    sent: Vec<String>,
    /// Ids whose ack was started.
    acking: HashSet<String>,
    /// Id -> wall ms when its ack returned.
    acked: HashMap<String, u64>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_loses_no_send_and_undoes_no_ack_older_than_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &this_module_test("child_workload"),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the child");
    let said = Arc::new(Mutex::new(Said::default()));
    let reader = std::thread::spawn({
        let (stdout, said) = (child.stdout.take().unwrap(), said.clone());
        move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let mut said = said.lock().unwrap();
                let words: Vec<&str> = line.split(' ').collect();
                match words.as_slice() {
                    ["sent", id] => said.sent.push(id.to_string()),
                    ["acking", id] => {
                        said.acking.insert(id.to_string());
                    }
                    ["acked", id, at] => {
                        said.acked.insert(id.to_string(), at.parse().unwrap());
                    }
                    _ => {}
                }
            }
        }
    });
    wait_for(
        "the child to send and ack a few hundred",
        Duration::from_secs(60),
        async || {
            let said = said.lock().unwrap();
            said.sent.len() >= 400 && said.acked.len() >= 300
        },
    )
    .await;
    let killed_at = wall_ms();
    child.kill().expect("SIGKILL the child");
    child.wait().unwrap();
    reader.join().unwrap();
    let said = std::mem::take(&mut *said.lock().unwrap());

    // Opened again: what the child left is delivered, its leases once they
    // run out.
    let url = courier::source::embedded::url(dir.path());
    let source = source::open(&url, options()).await.unwrap();
    let mut again = HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for delivery in source.receive(64).await.unwrap() {
            again.insert(delivery.message.id.clone());
            source.ack(&delivery).await.unwrap();
        }
        let depth = source.depth().await.unwrap();
        if depth.ready == Some(0) && depth.pending + depth.retry_backlog == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "not drained: {depth:?}");
    }

    // A message whose ack was under way at the kill may be acked without
    // the child having said so (found in CI at 9e09c8d: the kill fell
    // between the ack's return and its line): it is not lost, and nothing
    // says whether it is delivered again.
    let lost: Vec<&String> = said
        .sent
        .iter()
        .filter(|id| !said.acking.contains(*id) && !again.contains(*id))
        .collect();
    assert!(
        lost.is_empty(),
        "{} of {} sends that returned are gone after kill -9: {lost:?}",
        lost.len(),
        said.sent.len()
    );
    let undone: Vec<(&String, u64)> = said
        .acked
        .iter()
        .filter(|(id, _)| again.contains(*id))
        .map(|(id, at)| (id, killed_at.saturating_sub(*at)))
        .collect();
    let too_old: Vec<_> = undone
        .iter()
        .filter(|(_, age)| *age > ACK_BOUND.as_millis() as u64)
        .collect();
    assert!(
        too_old.is_empty(),
        "acks older than {ACK_BOUND:?} at the kill were undone (id, ms before the kill): {too_old:?}"
    );
    println!(
        "{} sent, {} acked, {} acks undone by the kill (at most {} ms old)",
        said.sent.len(),
        said.acked.len(),
        undone.len(),
        undone.iter().map(|(_, age)| *age).max().unwrap_or(0)
    );
}

/// Set, the child runs [`poison_child`] on this directory and queue.
const POISON_DIR: &str = "EMBEDDED_POISON_CHILD_DIR";
const POISON_QUEUE: &str = "EMBEDDED_POISON_CHILD_QUEUE";
const MAX_DELIVERIES: u32 = 3;

/// The child: a courier that dies (abort, as a segfault or an OOM kill
/// would) the instant it is handed the message `poison`, and acks every
/// other; once the poison pill is a dead letter it says so and ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_child() {
    let (Ok(dir), Ok(queue)) = (std::env::var(POISON_DIR), std::env::var(POISON_QUEUE)) else {
        return;
    };
    let url = courier::source::embedded::url(std::path::Path::new(&dir));
    let mut options = SourceOptions::new(&queue);
    options.live.visibility_timeout = VISIBILITY;
    options.live.max_deliveries = MAX_DELIVERIES;
    let source = source::open(&url, options).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        for delivery in source.receive(1).await.unwrap() {
            if delivery.message.body.as_ref() == b"poison" {
                std::process::abort();
            }
            source.ack(&delivery).await.unwrap();
        }
        if source.depth().await.unwrap().dead_letters > 0 {
            println!("dead-lettered");
            source.close().await;
            return;
        }
    }
}

/// A message that crashes courier the moment it is handed out, before its
/// hand-out would be written in the ordinary course (20 ms), does not
/// crash-loop courier for ever: after an unclean stop hand-outs are made
/// durable first, so each crash counts, and after `max_deliveries` the
/// message is dead-lettered as `undeliverable`; the others are delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_crashes_courier_is_dead_lettered_not_crash_looped() {
    let fixture = Fixture::embedded();
    let source = fixture.open().await;
    fixture.send(&source, "poison").await;
    for i in 0..5 {
        fixture.send(&source, format!("good {i}")).await;
    }
    release(&fixture, source).await;
    let dir = fixture.dir().unwrap();
    let mut crashes = 0;
    loop {
        let out = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &this_module_test("poison_child"),
                "--nocapture",
                "--test-threads=1",
            ])
            .env(POISON_DIR, &dir)
            .env(POISON_QUEUE, &fixture.queue)
            .stderr(Stdio::null())
            .output()
            .expect("run the child");
        if String::from_utf8_lossy(&out.stdout).contains("dead-lettered") {
            break;
        }
        assert!(
            !out.status.success(),
            "the child ended without a dead letter"
        );
        crashes += 1;
        assert!(
            crashes <= MAX_DELIVERIES + 1,
            "{crashes} crashes and the poison pill is still handed out"
        );
    }
    // The first crash is not counted: that hand-out was still in memory.
    assert!(crashes >= MAX_DELIVERIES, "crashed only {crashes} times");
    let source = fixture.open().await;
    let depth = source.depth().await.unwrap();
    assert_eq!(
        (depth.ready, depth.pending),
        (Some(0), 0),
        "the good ones were delivered: {depth:?}"
    );
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].body.as_ref(), b"poison");
    assert_eq!(letters[0].field("courier-reason"), Some("undeliverable"));
    let error = letters[0].field("courier-error").unwrap();
    assert!(error.contains("without being settled"), "{error}");
}
