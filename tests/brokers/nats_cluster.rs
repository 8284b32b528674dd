//! NATS JetStream clustering: three `nats-server` processes of this test
//! binary's own (private ports 17201-17203, routes on 17211-17213), an R3
//! work-queue stream, and the built `courier` consuming through a URL that
//! lists the three servers. The stream's leader is killed with `kill -9`
//! mid-drain: courier keeps consuming from the two left, and every message
//! is acked or dead-lettered, none lost.

use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;
use async_nats::jetstream::{self, stream};

/// Long enough for a drain and a leader election on a slow machine.
const SETTLE: Duration = Duration::from_secs(90);

/// Client ports `BASE + 1..=3`, route ports `BASE + 11..=13`: inside the
/// range kept for this test (17200-17249).
const BASE: u16 = 17200;

struct Node {
    name: String,
    port: u16,
    child: Option<Child>,
}

/// Three clustered JetStream servers, killed when dropped.
struct NatsCluster {
    nodes: Vec<Node>,
    dir: tempfile::TempDir,
}

impl NatsCluster {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let route = |i: u16| format!("nats://127.0.0.1:{}", BASE + 10 + i);
        let nodes = (1..=3u16)
            .map(|i| {
                let name = format!("n{i}");
                let routes: Vec<String> = (1..=3).filter(|&j| j != i).map(route).collect();
                let child = Command::new("nats-server")
                    .args(["-a", "127.0.0.1", "-p", &(BASE + i).to_string()])
                    .args(["-js", "-sd", &dir.path().join(&name).display().to_string()])
                    .args(["--cluster", &route(i), "--routes", &routes.join(",")])
                    .args(["--server_name", &name, "--cluster_name", "courier-test"])
                    .args([
                        "-l",
                        &dir.path().join(format!("{name}.log")).display().to_string(),
                    ])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start nats-server (is it installed?)");
                Node {
                    name,
                    port: BASE + i,
                    child: Some(child),
                }
            })
            .collect();
        Self { nodes, dir }
    }

    /// `nats://h:p,h:p,h:p`, as a user lists a cluster in `--source`.
    fn url(&self) -> String {
        let servers: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port))
            .collect();
        format!("nats://{}", servers.join(","))
    }

    /// `kill -9` the server named `name`.
    fn kill9(&mut self, name: &str) {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no server {name:?} in the cluster"));
        let mut child = node.child.take().expect("the server runs");
        child.kill().expect("SIGKILL nats-server");
        child.wait().expect("reap nats-server");
    }

    fn logs(&self) -> String {
        self.nodes
            .iter()
            .map(|n| {
                let log = std::fs::read_to_string(self.dir.path().join(format!("{}.log", n.name)))
                    .unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(15).collect();
                format!(
                    "--- {} ---\n{}",
                    n.name,
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

/// A client of the test's own, on whichever server of the cluster answers.
async fn jetstream_of(cluster: &NatsCluster) -> jetstream::Context {
    let servers: Vec<String> = cluster
        .url()
        .trim_start_matches("nats://")
        .split(',')
        .map(|s| format!("nats://{s}"))
        .collect();
    let mut client = None;
    wait_for("a cluster server to accept a client", SETTLE, async || {
        client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(2))
            .connect(servers.clone())
            .await
            .ok();
        client.is_some()
    })
    .await;
    jetstream::new(client.unwrap())
}

/// The R3 work-queue stream `name`, created once JetStream has a meta
/// leader (until then creating fails).
async fn create_r3_stream(js: &jetstream::Context, name: &str) {
    let config = stream::Config {
        name: name.into(),
        subjects: vec![name.into()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        num_replicas: 3,
        ..Default::default()
    };
    wait_for("the cluster to create an R3 stream", SETTLE, async || {
        js.create_stream(config.clone()).await.is_ok()
    })
    .await;
}

/// The stream's state as the cluster reports it: (leader, messages).
async fn stream_state(js: &jetstream::Context, name: &str) -> Option<(String, u64)> {
    let mut stream = js.get_stream(name).await.ok()?;
    let info = stream.info().await.ok()?;
    let leader = info.cluster.as_ref()?.leader.clone()?;
    Some((leader, info.state.messages))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_leader_killed_mid_drain_loses_nothing() {
    const MESSAGES: usize = 300;
    let started = Instant::now();
    let mut cluster = NatsCluster::start();
    let js = jetstream_of(&cluster).await;
    let queue = unique("cluster");
    create_r3_stream(&js, &queue).await;
    let cluster_ready = started.elapsed();

    // Every 50th fails for good (400); every 10th fails once (503). 100 ms
    // a message keeps the drain going for seconds after the wait below
    // sees a quarter: at 20 ms it took under a second, and a loaded CI
    // machine saw it end before the kill.
    let mut permanent = HashSet::new();
    let mut bodies = HashSet::new();
    for i in 0..MESSAGES {
        let script = match i {
            i if i % 50 == 7 => "400",
            i if i % 10 == 3 => "503,sleep100",
            _ => "sleep100",
        };
        let body = format!("script:{script}\nmessage {i}");
        js.publish(queue.clone(), body.clone().into())
            .await
            .expect("publish")
            .await
            .expect("the R3 stream stores the message");
        if script == "400" {
            permanent.insert(body.clone());
        }
        bodies.insert(body);
    }

    let app = TestApp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(
        dir.path(),
        "maxAttempts: 10\ntimeout: 1s\nbackoff: {initial: 50ms, max: 200ms, jitter: none}",
    );
    let fixture = Fixture::redis_at(&cluster.url(), &queue);
    let mut args = run_args(&fixture, &app, &policy, "cluster-a");
    args.extend(["--concurrency", "8", "--visibility-timeout", "3s"].map(str::to_string));
    let mut courier = CourierProcess::run(&args);
    let addr = courier.metrics_addr().await;

    // The first dead letter creates the R3 dead-letter stream, which needs
    // all three servers: wait for it before the kill.
    wait_for("some messages and a dead letter", SETTLE, async || {
        let text = scrape(addr).await;
        app.reached(&bodies) >= MESSAGES / 4
            && metric(&text, "courier_dead_letters_total", &queue) >= 1.0
    })
    .await;
    let (leader, _) = stream_state(&js, &queue)
        .await
        .expect("the stream's leader");
    cluster.kill9(&leader);
    let killed_at = Instant::now();
    let before = app.reached(&bodies);
    assert!(
        before < MESSAGES,
        "everything was delivered before the kill; nothing was mid-drain"
    );

    wait_for("every message to reach the app", SETTLE, async || {
        app.reached(&bodies) == MESSAGES
    })
    .await;
    let js = jetstream_of(&cluster).await;
    let mut last = None;
    wait_for(
        "the stream to be empty under a new leader",
        SETTLE,
        async || {
            last = stream_state(&js, &queue).await;
            matches!(&last, Some((new_leader, 0)) if *new_leader != leader)
        },
    )
    .await;
    let drained_after_kill = killed_at.elapsed();
    let text = scrape(addr).await;
    assert_eq!(
        metric(&text, "courier_in_flight", &queue),
        0.0,
        "nothing left in flight"
    );

    // Every permanent failure is in the dead-letter stream (once, or twice
    // when an ack was lost with the leader and the app saw it again).
    let mut dlq = js
        .get_stream(format!("{queue}_dlq"))
        .await
        .expect("the dead-letter stream");
    let info = dlq.info().await.expect("the dead-letter stream's info");
    let (first, last_seq) = (info.state.first_sequence, info.state.last_sequence);
    let mut letters = Vec::new();
    for sequence in first..=last_seq {
        if let Ok(message) = dlq.get_raw_message(sequence).await {
            letters.push(String::from_utf8_lossy(&message.payload).into_owned());
        }
    }
    let lettered: HashSet<&String> = letters.iter().collect();
    assert_eq!(
        lettered,
        permanent.iter().collect::<HashSet<_>>(),
        "exactly the permanent failures are dead-lettered"
    );
    assert!(
        letters.len() <= permanent.len() * 2,
        "{} dead letters for {} permanent failures",
        letters.len(),
        permanent.len()
    );
    for body in &bodies {
        let seen = app.received_body(body.as_bytes());
        if body.starts_with("script:503") {
            assert!(seen.len() >= 2, "{body}: the 503 must be retried");
        } else {
            assert!(!seen.is_empty(), "{body} never reached the app");
        }
    }

    courier.terminate();
    let status = courier.exit_within(Duration::from_secs(15)).await;
    assert!(
        status.success(),
        "exit after SIGTERM: {status}; log:\n{}\n{}",
        courier.log(),
        cluster.logs()
    );
    eprintln!(
        "figures: cluster ready in {cluster_ready:?}; leader {leader} killed after {before} of {MESSAGES} messages; drained {drained_after_kill:?} after the kill; {} deliveries for {MESSAGES} messages",
        app.received().len()
    );
}
