use super::*;
use courier_core::source::{ErrorKind, SettleBy};

use crate::dead_letters::RECORDS_PER_QUEUE;

fn open(dir: &Path) -> EmbeddedSource {
    let mut options = SourceOptions::new("q");
    options.live.visibility_timeout = Duration::from_secs(30);
    EmbeddedSource::open(dir, options).unwrap()
}

/// Stores `data` as the next message, the way a broken writer would.
fn store_raw(source: &EmbeddedSource, data: &[u8]) -> u64 {
    let tx = source.file.db.begin_write().unwrap();
    let seq = next_seq(&tx).unwrap();
    tx.open_table(QueueTable::new(&source.tables.ready))
        .unwrap()
        .insert((now_ms(), seq), data)
        .unwrap();
    tx.commit().unwrap();
    seq
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_record_is_handed_out_as_undeliverable() {
    let dir = tempfile::tempdir().unwrap();
    let source = open(dir.path());
    let raw = b"\xc1 not a record";
    let seq = store_raw(&source, raw);
    source.send(Bytes::from("good"), &[]).await.unwrap();
    let got = source.receive(10).await.unwrap();
    assert_eq!(got.len(), 2, "{got:?}");
    let (bad, good) = (&got[0], &got[1]);
    assert_eq!(bad.message.id, seq.to_string());
    assert_eq!(bad.message.body.as_ref(), raw, "the raw bytes are the body");
    assert!(
        bad.problem.as_deref().unwrap().contains("cannot be read"),
        "{:?}",
        bad.problem
    );
    assert_eq!(good.message.body, Bytes::from("good"));
    assert!(good.problem.is_none());
    // Both are leased and settle like any delivery.
    assert_eq!(source.depth().await.unwrap().pending, 2);
    source.ack(bad).await.unwrap();
    source.ack(good).await.unwrap();
    assert_eq!(source.depth().await.unwrap().pending, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_reaches_a_waiting_receive_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let source = Arc::new(open(dir.path()));
    let waiting = tokio::spawn({
        let source = source.clone();
        async move {
            let got = source.receive(4).await.unwrap();
            (got, Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let sent = Instant::now();
    source.send(Bytes::from("x"), &[]).await.unwrap();
    let (got, at) = waiting.await.unwrap();
    assert_eq!(got.len(), 1);
    let took = at.saturating_duration_since(sent);
    assert!(took < Duration::from_millis(150), "took {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_reaches_a_waiting_receive_when_due_and_not_before() {
    let dir = tempfile::tempdir().unwrap();
    let source = open(dir.path());
    source.send(Bytes::from("x"), &[]).await.unwrap();
    let first = source.receive(1).await.unwrap().remove(0);
    let delay = Duration::from_millis(300);
    let scheduled = Instant::now();
    source
        .retry(&first, 2, SystemTime::now(), SystemTime::now() + delay)
        .await
        .unwrap();
    let again = source.receive(1).await.unwrap();
    let took = scheduled.elapsed();
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].attempt, 2);
    // Due times are whole milliseconds.
    assert!(took + Duration::from_millis(2) >= delay, "early: {took:?}");
    assert!(took < delay + Duration::from_millis(150), "late: {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_sends_share_commits_and_get_their_own_ids() {
    let dir = tempfile::tempdir().unwrap();
    let source = Arc::new(open(dir.path()));
    let sends: Vec<_> = (0..200)
        .map(|i| {
            let source = source.clone();
            tokio::spawn(async move { source.send(Bytes::from(format!("{i}")), &[]).await })
        })
        .collect();
    let mut ids = std::collections::HashSet::new();
    for send in sends {
        ids.insert(send.await.unwrap().unwrap());
    }
    assert_eq!(ids.len(), 200);
    assert_eq!(source.depth().await.unwrap().ready, Some(200));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_runs_out_is_handed_out_again_as_the_next_attempt() {
    let dir = tempfile::tempdir().unwrap();
    let mut options = SourceOptions::new("q");
    options.live.visibility_timeout = Duration::from_millis(300);
    let source = EmbeddedSource::open(dir.path(), options).unwrap();
    source.send(Bytes::from("x"), &[]).await.unwrap();
    let first = source.receive(1).await.unwrap().remove(0);
    assert_eq!(first.attempt, 1);
    let again = source.receive(1).await.unwrap();
    assert_eq!(again.len(), 1, "handed out again within the wait");
    assert_eq!(again[0].attempt, 2);
    // When it was sent, as the first delivery had it: the lease's record
    // carries it, since a lease's key is when the lease ends.
    assert!(first.enqueued_at.is_some());
    assert_eq!(again[0].enqueued_at, first.enqueued_at);
    // The first delivery's lease is gone: settling it changes nothing.
    source.ack(&first).await.unwrap();
    assert_eq!(source.depth().await.unwrap().pending, 1);
    source.ack(&again[0]).await.unwrap();
    let depth = source.depth().await.unwrap();
    assert_eq!((depth.ready, depth.pending), (Some(0), 0), "{depth:?}");
}

/// Hand-outs and acks live in memory for a moment; closing the last
/// source on the file writes them, so a clean restart redelivers nothing
/// that was acked and keeps what is still leased as leased.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_and_leases_outlive_a_clean_stop() {
    let dir = tempfile::tempdir().unwrap();
    let source = open(dir.path());
    for i in 0..3 {
        source.send(Bytes::from(format!("{i}")), &[]).await.unwrap();
    }
    let got = source.receive(3).await.unwrap();
    source.ack(&got[0]).await.unwrap();
    source.ack(&got[1]).await.unwrap();
    drop(source);
    let source = open(dir.path());
    let depth = source.depth().await.unwrap();
    assert_eq!((depth.ready, depth.pending), (Some(0), 1), "{depth:?}");
}

fn admin(dir: &Path) -> EmbeddedStore {
    EmbeddedStore::open(dir, SourceOptions::new("q")).unwrap()
}

/// The tables of the file in `dir`, and whether it was marked open, read
/// without writing to it.
fn file_tables(dir: &Path) -> (Vec<String>, bool) {
    let db = redb::ReadOnlyDatabase::open(dir.join("courier.redb")).unwrap();
    let tx = db.begin_read().unwrap();
    let mut tables: Vec<String> = tx
        .list_tables()
        .unwrap()
        .map(|t| t.name().to_string())
        .collect();
    tables.sort();
    let marked = tx.open_table(META).unwrap().get(OPEN).unwrap().is_some();
    (tables, marked)
}

/// Issue 27: an admin handle on a directory without a queue makes nothing
/// by reading, nor by a replay or purge that finds no letter; a send makes
/// the file and the work table, and starts no writer (the file is never
/// marked open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_handle_makes_nothing_but_its_message() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("queue");
    let store = admin(&dir);
    assert!(store.dead_letters("q.dlq", 10).await.unwrap().is_empty());
    let letter = DeadLetter::from_fields("1".into(), Vec::new());
    let err = store.replay("q.dlq", &letter).await.unwrap_err();
    assert!(err.to_string().contains("is not in q.dlq"), "{err}");
    assert!(store.purge("q.dlq", &letter).await.is_err());
    assert!(!dir.exists(), "a read made the directory");
    store.send(Bytes::from("x"), &[]).await.unwrap();
    // With the file there, a lookup of a missing letter still makes no
    // dead-letter table.
    assert!(store.purge("q.dlq", &letter).await.is_err());
    drop(store);
    assert_eq!(
        file_tables(&dir),
        (vec!["meta".to_string(), "ready/q".to_string()], false)
    );
}

/// In one process an admin handle and a consumer share the file: what the
/// handle wrote alone, and what it writes through the consumer's writer
/// once that runs, are both handed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_handle_shares_the_file_with_a_consumer() {
    let dir = tempfile::tempdir().unwrap();
    let store = admin(dir.path());
    store.send(Bytes::from("before"), &[]).await.unwrap();
    let source = open(dir.path());
    store.send(Bytes::from("after"), &[]).await.unwrap();
    let got = source.receive(10).await.unwrap();
    let bodies: Vec<_> = got.iter().map(|d| d.message.body.clone()).collect();
    assert_eq!(bodies, [Bytes::from("before"), Bytes::from("after")]);
}

/// Regression: a replay or purge of a letter that is not there fails as
/// gone, and the writer aborted the whole batch on it, failing the sends
/// that shared its transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_of_a_missing_letter_fails_only_itself() {
    let dir = tempfile::tempdir().unwrap();
    let source = Arc::new(open(dir.path()));
    let missing = DeadLetter::from_fields("999999".into(), Vec::new());
    let mut calls = Vec::new();
    for i in 0..200 {
        let (source, missing) = (source.clone(), missing.clone());
        calls.push(tokio::spawn(async move {
            match i % 10 {
                0 => source
                    .purge("q.dlq", &missing)
                    .await
                    .map(drop)
                    .map_err(|e| (true, e)),
                _ => source
                    .send(Bytes::from(format!("{i}")), &[])
                    .await
                    .map(drop)
                    .map_err(|e| (false, e)),
            }
        }));
    }
    let mut sent = 0;
    for call in calls {
        match call.await.unwrap() {
            Ok(()) => sent += 1,
            Err((true, e)) => assert_eq!(e.kind(), courier_core::source::ErrorKind::Gone, "{e}"),
            Err((false, e)) => panic!("a send failed beside a purge: {e}"),
        }
    }
    assert_eq!(sent, 180);
}

/// Rows of `table` in the file as the writer last committed them.
fn rows(source: &EmbeddedSource, table: &str) -> usize {
    let tx = source.file.db.begin_read().unwrap();
    let table = tx.open_table(QueueTable::new(table)).unwrap();
    table.len().unwrap() as usize
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ack_with_no_call_after_it_is_written_within_the_flush_interval() {
    let dir = tempfile::tempdir().unwrap();
    let source = open(dir.path());
    source.send(Bytes::from("x"), &[]).await.unwrap();
    let got = source.receive(1).await.unwrap().remove(0);
    // The receive's lease is held in memory: written within the interval.
    tokio::time::sleep(FLUSH_EVERY * 5).await;
    assert_eq!(rows(&source, &source.tables.leased), 1);
    source.ack(&got).await.unwrap();
    // Nothing else is asked of the writer: the ack alone must wake it.
    tokio::time::sleep(FLUSH_EVERY * 5).await;
    assert_eq!(
        rows(&source, &source.tables.ready),
        0,
        "the acked row is gone"
    );
    assert_eq!(
        rows(&source, &source.tables.leased),
        0,
        "and so is its lease"
    );
}

fn open_with_visibility(dir: &Path, visibility: Duration) -> EmbeddedSource {
    let mut options = SourceOptions::new("q");
    options.live.visibility_timeout = visibility;
    EmbeddedSource::open(dir, options).unwrap()
}

async fn send_numbered(source: &EmbeddedSource, n: usize) {
    for i in 0..n {
        source.send(Bytes::from(format!("{i}")), &[]).await.unwrap();
    }
}

fn bodies(got: &[Delivery]) -> Vec<String> {
    got.iter()
        .map(|d| String::from_utf8_lossy(&d.message.body).into_owned())
        .collect()
}

/// A read that came back full is followed by the next one's hand-out;
/// the receive that takes it gets the next messages in order, first
/// attempts, held and written like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_read_hands_out_the_next_one_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let source = open(dir.path());
    send_numbered(&source, 6).await;
    let first = source.receive(3).await.unwrap();
    assert_eq!(bodies(&first), ["0", "1", "2"]);
    wait_until(|| !source.tables.ahead.is_empty()).await;
    let next = source.receive(3).await.unwrap();
    assert_eq!(bodies(&next), ["3", "4", "5"]);
    assert!(next.iter().all(|d| d.attempt == 1), "{next:?}");
    // Taken from the read-ahead, they are held leases: written in time.
    tokio::time::sleep(FLUSH_EVERY * 5).await;
    assert_eq!(rows(&source, &source.tables.leased), 6);
    for d in first.iter().chain(&next) {
        source.ack(d).await.unwrap();
    }
    tokio::time::sleep(FLUSH_EVERY * 5).await;
    assert_eq!(rows(&source, &source.tables.ready), 0);
    assert_eq!(rows(&source, &source.tables.leased), 0);
}

/// What waits ahead and no receive takes in time (a hold, a slow app) is
/// given back: it is ready again, its delivery not counted, and never in
/// `leased` (a restart finds it ready too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_ahead_no_receive_takes_is_given_back_uncounted() {
    let dir = tempfile::tempdir().unwrap();
    // A tenth of the lease: given back after 100 ms.
    let source = open_with_visibility(dir.path(), Duration::from_secs(1));
    send_numbered(&source, 4).await;
    let first = source.receive(2).await.unwrap();
    assert_eq!(bodies(&first), ["0", "1"]);
    wait_until(|| !source.tables.ahead.is_empty()).await;
    wait_until(|| source.tables.ahead.is_empty()).await;
    tokio::time::sleep(FLUSH_EVERY * 5).await;
    assert_eq!(rows(&source, &source.tables.leased), 2, "only the two read");
    let depth = source.depth().await.unwrap();
    assert_eq!((depth.ready, depth.pending), (Some(2), 2), "{depth:?}");
    let again = source.receive(2).await.unwrap();
    assert_eq!(bodies(&again), ["2", "3"]);
    assert!(again.iter().all(|d| d.attempt == 1), "{again:?}");
}

/// A stop gives back what waits ahead: the next source on the queue gets
/// it at once as a first attempt, not when it would have gone stale (1 s
/// here) or a lease ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_gives_back_the_read_ahead() {
    let dir = tempfile::tempdir().unwrap();
    let source = open(dir.path());
    send_numbered(&source, 4).await;
    let first = source.receive(2).await.unwrap();
    wait_until(|| !source.tables.ahead.is_empty()).await;
    source.close().await;
    assert!(source.tables.ahead.is_empty());
    // The same process, so the same file and overlay: what the stop did
    // not give back would still be taken.
    let next = open(dir.path());
    let again = tokio::time::timeout(Duration::from_millis(500), next.receive(4))
        .await
        .expect("given back at the stop, not when stale")
        .unwrap();
    assert_eq!(bodies(&again), ["2", "3"]);
    assert!(again.iter().all(|d| d.attempt == 1), "{again:?}");
    drop(first);
}

/// A receive that reached the writer before the read-ahead was made does
/// not wait while the read-ahead holds what is due: it gets it at once,
/// not when the read-ahead would have gone stale (1 s here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receive_that_missed_the_read_ahead_gets_its_messages() {
    let dir = tempfile::tempdir().unwrap();
    let source = open(dir.path());
    send_numbered(&source, 4).await;
    source.receive(2).await.unwrap();
    wait_until(|| !source.tables.ahead.is_empty()).await;
    // As if it had looked just before the read-ahead was made.
    let (reply, answer) = oneshot::channel();
    let now = Instant::now();
    source
        .file
        .submit::<Vec<Delivery>>(|_| {
            Call::Lease(Lease {
                tables: source.tables.clone(),
                max: 2,
                terms: Terms {
                    visibility: 30_000,
                    dead_letter_queue: "q.dlq".into(),
                    max_deliveries: 10,
                },
                deadline: now + Duration::from_secs(10),
                next_try: now,
                reply,
            })
        })
        .unwrap();
    let got = tokio::time::timeout(Duration::from_millis(500), answer)
        .await
        .expect("answered at once, not after its wait")
        .unwrap()
        .unwrap();
    assert_eq!(bodies(&got), ["2", "3"]);
}

async fn wait_until(mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < Duration::from_secs(5), "timed out");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// The table names of the file in `dir`, read without writing to it.
fn table_names(dir: &Path) -> Vec<String> {
    let db = redb::ReadOnlyDatabase::open(dir.join("courier.redb")).unwrap();
    let tx = db.begin_read().unwrap();
    let mut tables: Vec<String> = tx
        .list_tables()
        .unwrap()
        .map(|t| t.name().to_string())
        .collect();
    tables.sort();
    tables
}

/// An admin handle lists and removes job records without making the
/// directory, the file or the table; the first put makes the file and
/// that queue's table only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_records_make_nothing_until_the_first_put() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("queue");
    let store = admin(&dir);
    assert!(store.job_records("q.dlq").await.unwrap().is_empty());
    store.remove_job_record("q.dlq", "job-a").await.unwrap();
    assert!(!dir.exists(), "a read or a removal made the directory");
    store
        .put_job_record("q.dlq", "job-a", Bytes::from("{}"))
        .await
        .unwrap();
    assert!(store.job_records("other.dlq").await.unwrap().is_empty());
    store.remove_job_record("other.dlq", "job-a").await.unwrap();
    drop(store);
    assert_eq!(table_names(&dir), ["jobs/q.dlq"]);
}

/// While a consumer of this process runs the writer, job records go
/// through it; a put refused (a bad key, a record too large, a new key
/// beyond the bound) fails alone, and the sends that share its
/// transaction are stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_records_go_through_the_writer_and_are_bounded() {
    use courier_core::source::{ErrorKind, JOB_RECORD_MAX};
    let dir = tempfile::tempdir().unwrap();
    let source = Arc::new(open(dir.path()));
    let store = Arc::new(admin(dir.path()));
    let mut calls = Vec::new();
    for i in 0..RECORDS_PER_QUEUE {
        let (source, store) = (source.clone(), store.clone());
        calls.push(tokio::spawn(async move {
            let key = format!("job-{i}");
            store
                .put_job_record("q.dlq", &key, Bytes::from(key.clone()))
                .await
                .unwrap();
            if i % 8 == 0 {
                source.send(Bytes::from(key), &[]).await.unwrap();
            }
        }));
    }
    for call in calls {
        call.await.unwrap();
    }
    let refused = [
        ("job-new", Bytes::from("{}")),
        ("Job-A", Bytes::from("{}")),
        ("job-0", Bytes::from(vec![b' '; JOB_RECORD_MAX + 1])),
    ];
    for (key, record) in refused {
        let err = store
            .put_job_record("q.dlq", key, record)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Invalid, "{key}: {err}");
    }
    let mut records = source.job_records("q.dlq").await.unwrap();
    assert_eq!(records.len(), RECORDS_PER_QUEUE);
    records.sort();
    assert_eq!(records[0], ("job-0".into(), Bytes::from("job-0")));
    // A key already there is rewritten at the bound, and a removal makes
    // room for another.
    store
        .put_job_record("q.dlq", "job-0", Bytes::from("again"))
        .await
        .unwrap();
    store.remove_job_record("q.dlq", "job-1").await.unwrap();
    store
        .put_job_record("q.dlq", "job-new", Bytes::from("{}"))
        .await
        .unwrap();
    let records = store.job_records("q.dlq").await.unwrap();
    assert!(records.contains(&("job-0".into(), Bytes::from("again"))));
    assert!(records.contains(&("job-new".into(), Bytes::from("{}"))));
    assert!(!records.iter().any(|(key, _)| key == "job-1"));
    let sent = source.receive(1000).await.unwrap();
    assert_eq!(sent.len(), RECORDS_PER_QUEUE / 8);
}

fn failure_of(message_id: &str) -> Failure {
    Failure {
        reason: courier_core::model::DeadLetterReason::PermanentStatus,
        status: Some(422),
        error: None,
        attempts: 1,
        first_attempt_at: SystemTime::now(),
        last_attempt_at: SystemTime::now(),
        queue: "q".into(),
        message_id: message_id.into(),
        excerpt: Bytes::new(),
        policy: "p@1".into(),
        dead_letter_queue: "q.dlq".into(),
        app_directive: None,
        cut: None,
    }
}

/// Two readings taken one after the other: equal, but for the ages, which
/// grow by the time between them.
fn assert_same_depth(admin: &Depth, sidecar: &Depth) {
    let close = |a: Option<Duration>, b: Option<Duration>| match (a, b) {
        (Some(a), Some(b)) => a.abs_diff(b) < Duration::from_secs(2),
        (a, b) => a == b,
    };
    let counts = |d: &Depth| {
        (
            d.ready,
            d.pending,
            d.retry_backlog,
            d.dead_letters,
            d.queue_depth,
        )
    };
    assert_eq!(
        counts(admin),
        counts(sidecar),
        "admin {admin:?}, sidecar {sidecar:?}"
    );
    assert!(
        close(admin.oldest_dead_letter_age, sidecar.oldest_dead_letter_age)
            && close(admin.oldest_waiting_age, sidecar.oldest_waiting_age),
        "admin {admin:?}, sidecar {sidecar:?}"
    );
}

/// An admin handle reads the figures the sidecar's gauges read: through the
/// writer while a consumer of its process runs it (messages ready, one
/// held, one scheduled for a retry, one dead-lettered), and from the file
/// alone in a process without one, where it reads what the next sidecar on
/// the file reads. A directory without a queue, and a file without the
/// queue, are named; reading makes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_handle_reads_the_depth_the_sidecar_reads() {
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("queue");
    let store = admin(&dir);
    let err = store.depth_of("q.dlq").await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Gone, "{err}");
    assert!(err.message().contains(&dir.display().to_string()), "{err}");
    assert!(!dir.exists(), "a read made the directory");

    let source = open(&dir);
    for i in 0..6 {
        store.send(Bytes::from(format!("m{i}")), &[]).await.unwrap();
    }
    assert_same_depth(
        &store.depth_of("q.dlq").await.unwrap().unwrap(),
        &source.depth().await.unwrap(),
    );
    let got = source.receive(4).await.unwrap();
    assert_eq!(got.len(), 4);
    let now = SystemTime::now();
    source
        .dead_letter(&got[0], &failure_of(&got[0].message.id))
        .await
        .unwrap();
    source
        .retry(&got[1], 2, now, now + Duration::from_secs(3600))
        .await
        .unwrap();
    source.ack(&got[2]).await.unwrap();
    let sidecar = source.depth().await.unwrap();
    let read = store.depth_of("q.dlq").await.unwrap().unwrap();
    assert_same_depth(&read, &sidecar);
    let counts = (
        read.ready,
        read.pending,
        read.retry_backlog,
        read.dead_letters,
        read.queue_depth,
    );
    assert_eq!(counts, (Some(2), 1, 1, 1, Some(3)), "{read:?}");
    assert!(read.oldest_dead_letter_age.is_some(), "{read:?}");

    // A clean stop writes the held delivery's lease; the file is then all
    // there is.
    source.close().await;
    drop(source);
    drop(store);
    let alone = admin(&dir);
    let read = alone.depth_of("q.dlq").await.unwrap().unwrap();
    let err = admin_of(&dir, "other")
        .depth_of("other.dlq")
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Gone, "{err}");
    assert!(err.message().contains("\"other\""), "{err}");
    drop(alone);
    assert_eq!(
        table_names(&dir),
        ["dlq/q.dlq", "leased/q", "meta", "ready/q"],
        "a reading made a table"
    );
    let source = open(&dir);
    assert_same_depth(&read, &source.depth().await.unwrap());
    assert_eq!(
        (
            read.ready,
            read.pending,
            read.retry_backlog,
            read.dead_letters
        ),
        (Some(2), 1, 1, 1),
        "{read:?}"
    );
}

fn admin_of(dir: &Path, queue: &str) -> EmbeddedStore {
    EmbeddedStore::open(dir, SourceOptions::new(queue)).unwrap()
}
