//! `courier dlq` jobs: a replay or purge keeps its record on the broker,
//! so that it is listed, resumed after a kill and cancelled from another
//! process.

use bytes::Bytes;
use courier::source::SourceOptions;

use crate::common::*;
use crate::dlq::{Spawned, audit_line, courier, drain, json_lines, send_all, stderr, stdout};

/// The records the jobs keep, through the admin handles the commands
/// open: a fresh dead-letter queue has none; a record put is read back by
/// another handle, the last one put under a key is the one kept, a removal
/// takes one key's record only (and removing a missing one is no error),
/// a record of the largest size and of every byte value comes back byte
/// for byte, and another queue's records are its own.
pub async fn job_records_are_kept(fixture: Fixture) {
    let other = fixture.sibling("other");
    let admin = |queue: &Fixture| {
        let queue = queue.clone();
        async move {
            courier::source::open_admin(&queue.url, SourceOptions::new(&queue.queue))
                .await
                .expect("open an admin handle")
        }
    };
    let dlq = fixture.dlq();
    let writer = admin(&fixture).await;
    let sorted = |mut records: Vec<(String, Bytes)>| {
        records.sort();
        records
    };
    assert_eq!(
        writer.job_records(&dlq).await.unwrap(),
        vec![],
        "no records on a fresh dead-letter queue"
    );
    // Every byte value, not only text: a store must not assume UTF-8.
    let big = Bytes::from(
        (0..courier::source::JOB_RECORD_MAX)
            .map(|i| (i % 256) as u8)
            .collect::<Vec<u8>>(),
    );
    writer
        .put_job_record(&dlq, "job-a", Bytes::from_static(b"{\"v\":1}"))
        .await
        .unwrap();
    writer
        .put_job_record(&dlq, "job-b", big.clone())
        .await
        .unwrap();
    writer
        .put_job_record(&dlq, "job-a", Bytes::from_static(b"{\"v\":2}"))
        .await
        .unwrap();
    writer.flush().await;

    let reader = admin(&fixture).await;
    assert_eq!(
        sorted(reader.job_records(&dlq).await.unwrap()),
        vec![
            ("job-a".to_string(), Bytes::from_static(b"{\"v\":2}")),
            ("job-b".to_string(), big.clone()),
        ],
        "another handle reads the last record of each key"
    );
    assert_eq!(
        admin(&other).await.job_records(&other.dlq()).await.unwrap(),
        vec![],
        "another queue's dead letters have records of their own"
    );

    reader.remove_job_record(&dlq, "job-a").await.unwrap();
    reader.remove_job_record(&dlq, "job-missing").await.unwrap();
    reader.flush().await;
    assert_eq!(
        sorted(writer.job_records(&dlq).await.unwrap()),
        vec![("job-b".to_string(), big)],
        "a removal takes that key's record only"
    );
    writer.remove_job_record(&dlq, "job-b").await.unwrap();
    writer.flush().await;
    assert_eq!(writer.job_records(&dlq).await.unwrap(), vec![]);
}

/// How many letters at what rate the job scenarios replay: enough that a
/// kill lands halfway through, at a pace each broker keeps (see
/// `replay_rate::size` for why some go slower).
fn size(broker: BrokerKind) -> (usize, u32) {
    match broker {
        BrokerKind::Redis | BrokerKind::RedisCluster | BrokerKind::Nats | BrokerKind::Embedded => {
            (120, 40)
        }
        BrokerKind::Amqp => (60, 20),
        BrokerKind::Sqs | BrokerKind::PubSub => (24, 6),
        BrokerKind::Kafka => (12, 3),
    }
}

/// `n` messages answered 400 then 200, dead-lettered by a sidecar; their
/// bodies.
async fn dead_letters(fixture: &Fixture, app: &TestApp, n: usize) -> Vec<Bytes> {
    let bodies: Vec<Bytes> = (0..n)
        .map(|i| Bytes::from(format!("script:400,200\n{i}")))
        .collect();
    send_all(fixture, &bodies).await;
    drain(fixture, app).await;
    assert_eq!(listed(fixture).len(), n, "every message dead-lettered");
    bodies
}

/// The dead letters `courier dlq list` shows, by message id.
fn listed(fixture: &Fixture) -> Vec<String> {
    json_lines(&courier(fixture, &["dlq", "list", "--output", "json"]))
        .iter()
        .map(|l| {
            l["courier-message-id"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

/// The jobs `courier dlq jobs --output json` shows.
fn jobs(fixture: &Fixture) -> Vec<serde_json::Value> {
    let out = courier(fixture, &["dlq", "jobs", "--output", "json"]);
    assert!(out.status.success(), "dlq jobs: {}", stderr(&out));
    json_lines(&out)
}

/// Waits until `command` has printed `at_least` lines `replayed ...`,
/// then kills it with SIGKILL; how many it printed.
async fn kill_after(command: &mut Spawned, at_least: usize) -> usize {
    wait_for("replays before the kill", SETTLE, async || {
        command.lines_starting("replayed ").len() >= at_least
    })
    .await;
    command.child.kill().unwrap();
    command.wait();
    command.lines_starting("replayed ").len()
}

/// Waits until the dead-letter queue shows at least `left` letters: a
/// letter the killed process held to look at is hidden until its lease
/// ends on SQS and Pub/Sub, and the resume acts only on what it sees.
async fn wait_visible(fixture: &Fixture, left: usize) {
    wait_for("the killed job's leases to end", SETTLE, async || {
        listed(fixture).len() >= left
    })
    .await;
}

/// A replay job killed with SIGKILL a third of the way, resumed with `dlq
/// jobs resume ID` and killed again, then resumed by running the same
/// command: `dlq jobs` shows it interrupted each time, with its count, who
/// started it and why; the last run finishes it, and every letter is in
/// exactly one place: the dead-letter queue is empty and the app got each
/// message once from the replays (where the broker replays exactly; else
/// at most the letter in flight at each kill twice, never none).
pub async fn a_killed_replay_job_resumes(fixture: Fixture) {
    let (n, rate) = size(fixture.broker);
    let app = TestApp::start().await;
    let bodies = dead_letters(&fixture, &app, n).await;
    let replay = [
        "dlq",
        "replay",
        "--all",
        "--rate",
        &format!("{rate}/s"),
        "--why",
        "INC-7",
    ];

    let mut first = Spawned::start(&fixture, &replay);
    let before_first_kill = kill_after(&mut first, n / 3).await;
    wait_visible(&fixture, n - before_first_kill - 1).await;
    let listed_jobs = jobs(&fixture);
    assert_eq!(listed_jobs.len(), 1, "one job: {listed_jobs:?}");
    let job = &listed_jobs[0];
    let id = job["id"].as_str().unwrap().to_string();
    assert_eq!(job["state"], "interrupted", "{job}");
    assert_eq!(job["total"], n, "{job}");
    assert_eq!(job["why"], "INC-7", "{job}");
    assert!(job["by"].as_str().unwrap().starts_with("local:"), "{job}");
    assert!(
        job["done"].as_u64().unwrap() as usize <= before_first_kill,
        "{job}"
    );

    let mut resumed = Spawned::start(&fixture, &["dlq", "jobs", "resume", &id]);
    let before_second_kill = kill_after(&mut resumed, n / 3).await;
    wait_visible(&fixture, n - before_first_kill - before_second_kill - 2).await;
    let job = &jobs(&fixture)[0];
    assert_eq!(job["state"], "interrupted", "{job}");
    assert_eq!(job["resumed"], 1, "{job}");

    let again = courier(&fixture, &replay);
    assert!(again.status.success(), "{}", stderr(&again));
    assert!(
        stdout(&again).contains(&format!("resuming job {id}")),
        "the same command resumes the job: {}",
        stdout(&again)
    );
    let job = &jobs(&fixture)[0];
    assert_eq!(
        (&job["id"], &job["state"], &job["done"], &job["total"]),
        (&id.clone().into(), &"done".into(), &n.into(), &n.into()),
        "{job}"
    );
    assert_eq!(
        listed(&fixture),
        Vec::<String>::new(),
        "nothing left in the dead-letter queue"
    );

    drain(&fixture, &app).await;
    let twice: Vec<usize> = bodies
        .iter()
        .enumerate()
        .filter(|(_, body)| app.received_body(body).len() > 2)
        .map(|(i, _)| i)
        .collect();
    let never: Vec<usize> = bodies
        .iter()
        .enumerate()
        .filter(|(_, body)| app.received_body(body).len() < 2)
        .map(|(i, _)| i)
        .collect();
    assert!(never.is_empty(), "messages {never:?} were never replayed");
    let exact = fixture.open().await.capabilities().exact_replay;
    if exact {
        assert!(twice.is_empty(), "messages {twice:?} were replayed twice");
    } else {
        assert!(
            twice.len() <= 2,
            "more than one letter per kill in both places: {twice:?}"
        );
    }
}

/// A replay job cancelled from another process: `dlq jobs` shows it
/// running, with who started it; `dlq jobs cancel ID` stops it at its next
/// letter, the job's own command exits 1 naming who cancelled it, the job
/// shows cancelled with what it did, and the letters it did not reach
/// are still dead letters. A cancelled job is not resumed.
pub async fn a_replay_job_is_cancelled(fixture: Fixture) {
    let (n, rate) = size(fixture.broker);
    let app = TestApp::start().await;
    dead_letters(&fixture, &app, n).await;
    let mut running = Spawned::start(
        &fixture,
        &[
            "dlq",
            "replay",
            "--all",
            "--rate",
            &format!("{}/s", rate / 2),
        ],
    );
    wait_for("a few replays", SETTLE, async || {
        running.lines_starting("replayed ").len() >= 2
    })
    .await;
    let job = &jobs(&fixture)[0];
    assert_eq!(job["state"], "running", "{job}");
    let id = job["id"].as_str().unwrap().to_string();

    let cancel = courier(
        &fixture,
        &["dlq", "jobs", "cancel", &id, "--why", "wrong filter"],
    );
    assert!(cancel.status.success(), "{}", stderr(&cancel));
    assert!(
        stdout(&cancel).contains(&format!("job {id} cancelled after")),
        "{}",
        stdout(&cancel)
    );
    assert_eq!(audit_line(&cancel)["audit"], "cancel");
    assert_eq!(audit_line(&cancel)["why"], "wrong filter");
    let status = running.wait();
    assert_eq!(status.code(), Some(1), "the cancelled command exits 1");
    assert!(
        running.stdout().contains("cancelled by local:"),
        "{}",
        running.stdout()
    );

    let done = running.lines_starting("replayed ").len();
    assert!(done < n, "cancelled before the end: {done} of {n}");
    let job = &jobs(&fixture)[0];
    assert_eq!(
        (&job["state"], &job["done"]),
        (&"cancelled".into(), &done.into()),
        "{job}"
    );
    wait_visible(&fixture, n - done).await;
    assert_eq!(
        listed(&fixture).len(),
        n - done,
        "the rest are still dead letters"
    );

    let resume = courier(&fixture, &["dlq", "jobs", "resume", &id]);
    assert_eq!(resume.status.code(), Some(2), "{}", stderr(&resume));
    assert!(
        stderr(&resume).contains("is cancelled"),
        "{}",
        stderr(&resume)
    );
}
