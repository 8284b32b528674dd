//! What an idle courier costs its broker (issue 28): the binary, run as a
//! user runs it (every flag at its default but the source, queue, app and
//! listen address), on an empty queue, sends the broker at most one
//! request a second, counted by the broker itself. The embedded queue's
//! broker is its file: there, not one page of it is read or written, by the
//! kernel's count of the bytes the process reads and writes. Each test has
//! a broker of its own, so that every request it counts is courier's.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use crate::common::*;
use courier::source::{Source, shared};

/// How long the requests of an idle courier are counted.
const WINDOW: Duration = Duration::from_secs(15);
/// The same for Kafka (see its test).
const KAFKA_WINDOW: Duration = Duration::from_secs(30);
/// The wake-ups a second of an idle courier's threads, at most: its
/// timers and the broker's answers (3 to 6 a second on every broker but
/// Kafka, where each of librdkafka's threads wakes once a second).
const WAKEUPS: f64 = 10.0;
/// The same for Kafka: librdkafka's threads (a main thread and one per
/// broker for each of courier's clients) wake once a second each; 23 a
/// second on the three-broker mock (30 while the producer stayed open).
const KAFKA_WAKEUPS: f64 = 30.0;

/// `courier run` for `fixture` with nothing but the flags a user must give
/// (and `--create`, so that the queue is there) and `extra`, with `env`
/// set.
fn idle_courier(
    fixture: &Fixture,
    app: &TestApp,
    env: &[(&str, &str)],
    extra: &[&str],
) -> CourierProcess {
    let mut args = [
        "--source",
        &fixture.source_arg(),
        "--queue",
        &fixture.queue,
        "--app",
        &app.url(),
        "--listen",
        "127.0.0.1:0",
        "--create",
    ]
    .map(str::to_string)
    .to_vec();
    args.extend(extra.iter().map(|a| a.to_string()));
    CourierProcess::run_with_env(&args, env)
}

/// At most one request a second over [`WINDOW`]: `count` of them, as
/// the broker counted; `shown`, what it recorded of them, when there are
/// too many. The figure is printed for the run's log.
fn assert_at_most_one_a_second(broker: &str, count: u64, shown: &str) {
    assert_at_most_one_a_second_over(WINDOW, broker, count, shown);
}

/// [`assert_at_most_one_a_second`] over `window`.
fn assert_at_most_one_a_second_over(window: Duration, broker: &str, count: u64, shown: &str) {
    eprintln!("an idle courier sent {broker} {count} requests in {window:?}");
    assert!(
        count <= window.as_secs(),
        "an idle courier sent {broker} {count} requests in {window:?}:\n{shown}"
    );
}

/// The times process `pid`'s threads went to sleep so far, each followed
/// by a wake-up: the voluntary context switches the kernel counts in
/// `/proc/PID/task/*/status` (the involuntary ones are other processes'
/// load preempting it, not courier waking). An idle
/// process wakes for its timers and its sockets; a timer that ticks while
/// nothing happens shows here whatever the build (an SDK's 100 ms
/// throughput check cost an idle courier on SQS 30 wake-ups and 0.19 % of
/// a core a second, a cost the request counts do not see).
fn wakeups(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| std::fs::read_to_string(task.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|l| l.starts_with("voluntary_ctxt_switches:"))
                .filter_map(|l| l.rsplit('\t').next()?.trim().parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// Counts `pid`'s wake-ups from its creation to [`Self::assert_at_most`].
struct Wakeups {
    pid: u32,
    before: u64,
    since: std::time::Instant,
}

impl Wakeups {
    fn start(pid: u32) -> Self {
        Self {
            pid,
            before: wakeups(pid),
            since: std::time::Instant::now(),
        }
    }

    /// At most `per_second` wake-ups a second of all of the process's
    /// threads since [`Self::start`]. The figure is printed for the run's
    /// log.
    fn assert_at_most(&self, per_second: f64, broker: &str) {
        let woke = wakeups(self.pid).saturating_sub(self.before);
        let secs = self.since.elapsed().as_secs_f64();
        let rate = woke as f64 / secs;
        eprintln!(
            "an idle courier on {broker} woke {woke} times in {secs:.1} s ({rate:.1} a second)"
        );
        assert!(
            rate <= per_second,
            "an idle courier on {broker} woke {woke} times in {secs:.1} s ({rate:.1} a second, more than {per_second})"
        );
    }
}

/// The commands clients send `port`'s Redis over `window`, as `MONITOR`
/// shows them; those a script runs (`[0 lua]`) are the script's one
/// request, not more.
async fn redis_requests(port: u16, window: Duration) -> Vec<String> {
    let socket = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect to the private Redis");
    let (read, mut write) = socket.into_split();
    write.write_all(b"MONITOR\r\n").await.unwrap();
    let mut lines = BufReader::new(read).lines();
    assert_eq!(lines.next_line().await.unwrap().as_deref(), Some("+OK"));
    let mut requests = Vec::new();
    let _ = tokio::time::timeout(window, async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if !line.contains(" lua] ") {
                requests.push(line);
            }
        }
    })
    .await;
    requests
}

/// Redis: a read that blocks until the next look for abandoned entries is
/// due, that look and the retry mover's heartbeat each one script call,
/// and the depth gauges one script call a `--depth-interval`. Then a
/// SIGTERM: the blocking read is ended, not waited out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_an_idle_courier_sends_at_most_one_request_a_second() {
    let redis = PrivateRedis::start().await;
    let fixture = Fixture::redis_at(&redis.url(), "idle");
    let app = TestApp::start().await;
    let mut courier = idle_courier(&fixture, &app, &[], &[]);
    courier.wait_running().await;
    let mut con = redis_connection(&redis.url()).await.unwrap();
    wait_for(
        "courier's blocking read",
        Duration::from_secs(30),
        async || {
            let clients: String = redis::cmd("CLIENT")
                .arg("LIST")
                .query_async(&mut con)
                .await
                .unwrap();
            waiting_readers(&clients).len() == 1
        },
    )
    .await;

    let woke = Wakeups::start(courier.id());
    let requests = redis_requests(redis.port(), WINDOW).await;
    assert_at_most_one_a_second("Redis", requests.len() as u64, &requests.join("\n"));
    woke.assert_at_most(WAKEUPS, "Redis");
    // Not an idle figure of zero because nothing ran: the reads are there.
    assert!(
        requests.iter().any(|r| r.contains("\"XREADGROUP\"")),
        "no read of new entries in {WINDOW:?}:\n{}",
        requests.join("\n")
    );

    courier.stop_cleanly(Duration::from_secs(30)).await;
}

/// The bytes `pid` read and wrote through system calls so far
/// (`/proc/PID/io`'s `rchar` and `wchar`): on files, sockets and the
/// runtime's wake-up descriptors alike, every thread.
fn bytes_read_and_written(pid: u32) -> u64 {
    let io = std::fs::read_to_string(format!("/proc/{pid}/io"))
        .unwrap_or_else(|e| panic!("/proc/{pid}/io: {e}"));
    io.lines()
        .filter(|l| l.starts_with("rchar:") || l.starts_with("wchar:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum()
}

/// The embedded queue: its file is the broker, and an idle courier reads
/// and writes none of it. A receive with nothing to do waits inside the
/// writer thread for a send or a due time, not on the file, and the depth
/// gauges read pages redb's cache holds. What is counted is every byte the
/// process read or wrote through a system call: under one page of the file
/// (4 KiB) in the window, where the threads' wake-ups (8 bytes each on an
/// eventfd, two a second) are all there is. One message sent before the
/// start is delivered first, so the idle figure is of a courier that read
/// the queue, not of one that never did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_an_idle_courier_reads_and_writes_no_page_of_its_file() {
    let fixture = Fixture::embedded();
    let source = fixture.open_as_created().await;
    fixture.send(&source, "before the rest".to_string()).await;
    release(&fixture, source).await;
    let app = TestApp::start().await;
    let mut courier = idle_courier(&fixture, &app, &[], &[]);
    courier.wait_running().await;
    wait_for(
        "the message sent before the start",
        Duration::from_secs(30),
        async || !app.received_body(b"before the rest").is_empty(),
    )
    .await;
    // The ack's write, due within the writer's flush interval, is not idle
    // work: it is let through before the count starts.
    tokio::time::sleep(Duration::from_secs(1)).await;

    let before = bytes_read_and_written(courier.id());
    let woke = Wakeups::start(courier.id());
    tokio::time::sleep(WINDOW).await;
    woke.assert_at_most(WAKEUPS, "the embedded queue");
    let bytes = bytes_read_and_written(courier.id()) - before;
    eprintln!("an idle courier on the embedded queue read and wrote {bytes} bytes in {WINDOW:?}");
    assert!(
        bytes < 4096,
        "an idle courier on the embedded queue read and wrote {bytes} bytes in {WINDOW:?} (/proc/PID/io): a page of its file or more"
    );

    courier.stop_cleanly(Duration::from_secs(30)).await;
}

/// What clients published to `monitor_port`'s NATS so far (pull requests,
/// JetStream API calls, acks), by its monitoring endpoint's `/varz`.
async fn nats_published(monitor_port: u16) -> u64 {
    let answer = http_get(([127, 0, 0, 1], monitor_port).into(), "/varz").await;
    let body = answer.split_once("\r\n\r\n").map_or("", |(_, body)| body);
    let varz: serde_json::Value =
        serde_json::from_str(body).unwrap_or_else(|e| panic!("/varz is not JSON ({e}): {answer}"));
    varz["in_msgs"].as_u64().expect("in_msgs in /varz")
}

/// NATS: a pull request the server holds for a few seconds, and the depth
/// gauges' JetStream API calls a `--depth-interval`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_an_idle_courier_sends_at_most_one_request_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let nats = crate::brokers::PrivateNats::start(dir.path(), None).await;
    let fixture = Fixture::broker(&nats.url());
    fixture.open_as_created().await;
    let app = TestApp::start().await;
    let mut courier = idle_courier(&fixture, &app, &[], &[]);
    courier.wait_running().await;
    wait_for(
        "courier's first pull",
        Duration::from_secs(30),
        async || nats_published(nats.monitor_port).await > 0,
    )
    .await;

    let before = nats_published(nats.monitor_port).await;
    let woke = Wakeups::start(courier.id());
    tokio::time::sleep(WINDOW).await;
    woke.assert_at_most(WAKEUPS, "NATS");
    let published = nats_published(nats.monitor_port).await - before;
    assert_at_most_one_a_second("NATS", published, "(published messages, from /varz)");
    assert!(published > 0, "no pull request in {WINDOW:?}");

    courier.stop_cleanly(Duration::from_secs(30)).await;
}

/// SQS: a long poll the server holds for a few seconds, and the depth
/// gauges' attribute reads a `--depth-interval`; counted in the log of a
/// moto of the test's own, a line per request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_an_idle_courier_sends_at_most_one_request_a_second() {
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("moto.log");
    let moto = Moto::logging_to(&log);
    let requests = || {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter(|line| line.contains("\"POST "))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let fixture = Fixture::broker(&format!("sqs://{SQS_REGION}"));
    let app = TestApp::start().await;
    let endpoint = moto.endpoint();
    let env = [
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_REGION", SQS_REGION),
    ];
    let mut courier = idle_courier(&fixture, &app, &env, &[]);
    courier.wait_running().await;
    wait_for(
        "courier's first receive",
        Duration::from_secs(30),
        async || requests().len() > 3,
    )
    .await;

    let before = requests().len();
    let woke = Wakeups::start(courier.id());
    tokio::time::sleep(WINDOW).await;
    woke.assert_at_most(WAKEUPS, "SQS");
    let sent = requests()[before..].to_vec();
    assert_at_most_one_a_second("SQS", sent.len() as u64, &sent.join("\n"));
    assert!(!sent.is_empty(), "no receive in {WINDOW:?}");

    courier.stop_cleanly(Duration::from_secs(30)).await;
}

/// What RabbitMQ read from the connections of courier on `queue` so far
/// (`recv_cnt`: socket reads, a frame or a batch of frames each), by
/// `rabbitmqctl`; courier names its connection after its queue.
fn amqp_reads(queue: &str) -> u64 {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-q", "list_connections", "client_properties", "recv_cnt"])
        .output()
        .expect("run rabbitmqctl");
    assert!(out.status.success(), "rabbitmqctl: {out:?}");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|line| line.contains(&format!("({queue})")))
        .filter_map(|line| line.rsplit('\t').next()?.trim().parse::<u64>().ok())
        .sum()
}

/// RabbitMQ: the broker pushes; an idle courier sends heartbeats and the
/// depth gauges' passive declares a `--depth-interval`. The shared broker
/// is counted on courier's own connection, which bears its queue's name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_an_idle_courier_sends_at_most_one_request_a_second() {
    let fixture = Fixture::amqp();
    let app = TestApp::start().await;
    let mut courier = idle_courier(&fixture, &app, &[], &[]);
    courier.wait_running().await;
    wait_for(
        "courier's connection",
        Duration::from_secs(30),
        async || amqp_reads(&fixture.queue) > 0,
    )
    .await;

    let before = amqp_reads(&fixture.queue);
    let woke = Wakeups::start(courier.id());
    tokio::time::sleep(WINDOW).await;
    woke.assert_at_most(WAKEUPS, "RabbitMQ");
    let reads = amqp_reads(&fixture.queue) - before;
    assert_at_most_one_a_second("RabbitMQ", reads, "(socket reads, from rabbitmqctl)");

    courier.stop_cleanly(Duration::from_secs(30)).await;
}

/// The depth gauges of a queue where nothing changes are read further and
/// further apart, up to four `--depth-interval`s; a change is still seen.
/// Redis's depth reading is one script call, told apart in `MONITOR` by its
/// argument `courier-last-attempt-at`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_queues_depth_is_read_four_times_less_often_and_a_change_is_still_seen() {
    const INTERVAL: Duration = Duration::from_millis(250);
    const COUNTED: Duration = Duration::from_secs(4);
    let redis = PrivateRedis::start().await;
    let fixture = Fixture::redis_at(&redis.url(), "paced");
    let app = TestApp::start().await;
    let mut config = run_config(&fixture, &app, fast_policy());
    config.endpoint.depth_interval = INTERVAL;
    let running = Running::start(config).await;
    // An unchanged reading stretches the wait to its longest.
    tokio::time::sleep(INTERVAL * 8).await;

    let readings = redis_requests(redis.port(), COUNTED)
        .await
        .into_iter()
        .filter(|r| r.contains("courier-last-attempt-at"))
        .count();
    // Every 250 ms: 16 in 4 s; every second: 4 or 5.
    assert!(
        (2..=6).contains(&readings),
        "{readings} depth readings in {COUNTED:?} of an idle queue, polled every {INTERVAL:?}"
    );

    // A dead letter written behind courier's back: no message received,
    // and the gauge shows it within the longest wait.
    let mut con = redis_connection(&redis.url()).await.unwrap();
    let _: String = redis::cmd("XADD")
        .arg(fixture.dlq())
        .arg("*")
        .arg("payload")
        .arg("written by hand")
        .query_async(&mut con)
        .await
        .unwrap();
    wait_for(
        "the dead-letter gauge",
        Duration::from_secs(30),
        async || {
            metric(
                &scrape(running.metrics_addr).await,
                "courier_dlq_depth",
                &fixture.queue,
            ) == 1.0
        },
    )
    .await;
    running.stop().await;
}

/// Data segments process `pid` has sent on its sockets to 127.0.0.1:`port`
/// so far, by the kernel's counters (`ss -ti`): a request each, or a batch
/// of them, where the broker counts none courier can read.
fn segments_sent(pid: u32, port: u16) -> u64 {
    let out = std::process::Command::new("ss")
        .args(["-tinpH", &format!("( dport = :{port} )")])
        .output()
        .expect("run ss");
    let text = String::from_utf8_lossy(&out.stdout);
    let owner = format!("pid={pid},");
    let mut ours = false;
    let mut sent = 0;
    for line in text.lines() {
        if !line.starts_with(char::is_whitespace) {
            ours = line.contains(&owner);
        } else if std::mem::take(&mut ours) {
            sent += line
                .split_whitespace()
                .find_map(|field| field.strip_prefix("data_segs_out:"))
                .and_then(|n| n.parse::<u64>().ok())
                .unwrap_or(0);
        }
    }
    sent
}

/// Pub/Sub: with nothing in flight and nothing coming, a pull the server
/// holds on the work subscription (the emulator answers it empty after
/// `HELD_WAIT`, a second before its deadline) and the retry subscription
/// looked at every 10 s: about 6.5 calls in the window, held to 8 (a
/// deadline of `HELD_WAIT` itself, answered after 2 s, made it 9).
/// Counted on courier's own connections to the shared emulator as data
/// segments: a gRPC call is two, its headers and its message. The depth
/// count (some 13 calls a reading, a reading a minute on an idle queue:
/// the pacing test above, and the bench's rest run, which counts it) is
/// moved out of the window with `--depth-interval 1h`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pubsub_an_idle_reader_makes_at_most_one_call_a_second() {
    let emulator = shared_pubsub();
    let fixture = Fixture::pubsub();
    let app = TestApp::start().await;
    let mut courier = idle_courier(&fixture, &app, &[], &["--depth-interval", "1h"]);
    courier.wait_running().await;
    // Past the start's calls: the first depth count has made the shadow
    // subscriptions and set the gauges.
    let metrics = courier.metrics_addr().await;
    wait_for(
        "the first depth count",
        Duration::from_secs(60),
        async || {
            series(
                &scrape(metrics).await,
                "courier_retry_backlog",
                &fixture.queue,
            )
            .is_some()
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    let before = segments_sent(courier.id(), emulator.port);
    let woke = Wakeups::start(courier.id());
    tokio::time::sleep(WINDOW).await;
    woke.assert_at_most(WAKEUPS, "Pub/Sub");
    let calls = (segments_sent(courier.id(), emulator.port) - before) / 2;
    assert_at_most_one_a_second(
        "Pub/Sub",
        calls,
        "(gRPC calls, from the data segments ss counts)",
    );
    assert!(calls > 0, "no pull in {WINDOW:?}");
    // A pull answered after each `HELD_WAIT`, a look every 10 s, and one
    // of each cut by the window's ends.
    let most = WINDOW.as_secs() / shared::HELD_WAIT.as_secs() + WINDOW.as_secs() / 10 + 2;
    assert!(
        calls <= most,
        "an idle courier made {calls} calls to Pub/Sub in {WINDOW:?}, more than {most}: is its held pull answered before HELD_WAIT?"
    );

    // An arrival at the resting reader is delivered.
    let source = fixture.open().await;
    delivered_after_a_rest(&fixture, &source, &app, courier).await;
}

/// Kafka, on a mock cluster of three brokers of the test's own: a fetch
/// each broker holds 3 s (`HELD_WAIT`) and the group's heartbeat every
/// 3 s, over a window twice the others' (so that where a 3 s tick falls
/// weighs less); and then one depth read, which asks each broker at most
/// three requests (its partitions' earliest and latest offsets, one
/// `ListOffsets` each; the group's commits from the coordinator; the
/// partitions are known for a minute), and which an idle replica makes
/// once a minute (the pacing test above): 0.05 a second. A cluster is many
/// brokers, and each is counted as "the broker": its requests on the
/// connections to it, as data segments (the mock's own request tracking
/// is C API only; a Kafka request this small is one segment).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_an_idle_courier_sends_each_broker_at_most_one_request_a_second() {
    let mock = KafkaMock::start(3);
    let fixture = Fixture::broker(&mock.url());
    fixture.open_as_created().await;
    let app = TestApp::start().await;
    let mut courier = idle_courier(&fixture, &app, &[], &["--depth-interval", "1h"]);
    courier.wait_running().await;
    // Past the start's requests (the group's join takes the mock a few
    // seconds): a first message delivered shows the partitions assigned
    // and fetched; then the queue is idle.
    let source = fixture.open().await;
    fixture.send(&source, "before a rest".to_string()).await;
    wait_for("the first message", Duration::from_secs(60), async || {
        !app.received_body(b"before a rest").is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    let ports: Vec<u16> = mock
        .bootstrap
        .split(',')
        .map(|server| server.rsplit_once(':').unwrap().1.parse().unwrap())
        .collect();
    let before: Vec<u64> = ports
        .iter()
        .map(|port| segments_sent(courier.id(), *port))
        .collect();
    let woke = Wakeups::start(courier.id());
    tokio::time::sleep(KAFKA_WINDOW).await;
    woke.assert_at_most(KAFKA_WAKEUPS, "Kafka");
    let sent: Vec<u64> = ports
        .iter()
        .zip(&before)
        .map(|(port, before)| segments_sent(courier.id(), *port) - before)
        .collect();
    eprintln!(
        "an idle courier sent the cluster {} requests in {KAFKA_WINDOW:?}: {sent:?} by broker",
        sent.iter().sum::<u64>()
    );
    for (port, sent) in ports.iter().zip(&sent) {
        assert_at_most_one_a_second_over(
            KAFKA_WINDOW,
            &format!("the Kafka broker on port {port}"),
            *sent,
            "(requests, from the data segments ss counts)",
        );
    }
    assert!(sent.iter().sum::<u64>() > 0, "no fetch in {KAFKA_WINDOW:?}");

    // One depth read, by a source in this process.
    source.depth().await.expect("a first depth read");
    let before: Vec<u64> = ports
        .iter()
        .map(|port| segments_sent(std::process::id(), *port))
        .collect();
    source.depth().await.expect("a depth read");
    let read: Vec<u64> = ports
        .iter()
        .zip(&before)
        .map(|(port, before)| segments_sent(std::process::id(), *port) - before)
        .collect();
    eprintln!("a depth read sent the cluster {read:?} requests by broker");
    assert!(
        read.iter().all(|n| *n <= 3),
        "a depth read sent the brokers {read:?} requests"
    );
    assert!(read.iter().sum::<u64>() > 0, "no depth read seen");

    // An arrival at the idle reader is delivered.
    delivered_after_a_rest(&fixture, &source, &app, courier).await;
}

/// A message sent to the idle `courier`'s queue reaches the app; then
/// `courier` stops cleanly on SIGTERM.
async fn delivered_after_a_rest(
    fixture: &Fixture,
    source: &Arc<dyn Source>,
    app: &TestApp,
    mut courier: CourierProcess,
) {
    fixture.send(source, "after a rest".to_string()).await;
    wait_for("the arrival", Duration::from_secs(30), async || {
        !app.received_body(b"after a rest").is_empty()
    })
    .await;
    courier.stop_cleanly(Duration::from_secs(30)).await;
}

/// A stop does not wait out a receive's wait where courier holds it
/// itself, in the process (RabbitMQ's consumer channel, librdkafka's
/// queue, the embedded queue's writer; `IN_PROCESS_WAIT`, 5 s): `interrupt` ends it, the receive returns
/// at once, empty, and the next one still gets what arrives. The source is
/// reading first (a message received and acked), so the wait is the idle
/// one a stop meets.
async fn an_interrupt_ends_a_waiting_receive(fixture: Fixture) {
    use courier::source::Settlement;
    let source = fixture.open_as_created().await;
    let receive_one = async |body: &str| {
        let got = tokio::time::timeout(Duration::from_secs(60), async {
            loop {
                let read = source.receive(16).await.expect("receive");
                if let Some(delivery) = read.into_iter().next() {
                    return delivery;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{body:?} not received in 60 s"));
        assert_eq!(got.message.body.as_ref(), body.as_bytes());
        source.settle(&got, Settlement::Ack).await.expect("ack");
    };
    fixture.send(&source, "before".to_string()).await;
    receive_one("before").await;

    let reading = tokio::spawn({
        let source = source.clone();
        async move {
            let read = source.receive(16).await;
            (read, std::time::Instant::now())
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let interrupted = std::time::Instant::now();
    source.interrupt().await;
    let (read, returned) = reading.await.unwrap();
    assert!(read.expect("receive").is_empty());
    let took = returned.saturating_duration_since(interrupted);
    assert!(
        took < shared::IN_PROCESS_WAIT / 10,
        "the receive returned {took:?} after the interrupt, as if its wait of {:?} had run out",
        shared::IN_PROCESS_WAIT
    );

    fixture.send(&source, "after".to_string()).await;
    receive_one("after").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_an_interrupt_ends_a_waiting_receive() {
    an_interrupt_ends_a_waiting_receive(Fixture::amqp()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_an_interrupt_ends_a_waiting_receive() {
    an_interrupt_ends_a_waiting_receive(Fixture::kafka()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn embedded_an_interrupt_ends_a_waiting_receive() {
    an_interrupt_ends_a_waiting_receive(Fixture::embedded()).await;
}
