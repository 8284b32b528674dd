//! Redis Sentinel (`redis+sentinel://host:port[,host:port]/MASTER_NAME/DB`):
//! courier asks the Sentinels for the master and follows a failover to the
//! new one. The test starts its own master, replica and three Sentinels on
//! free ports in 17110-17144; the shared Redis is never touched.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;

const MASTER_NAME: &str = "courier";
/// How long a failover and what follows it may take on a busy machine.
const SETTLE: Duration = Duration::from_secs(60);

/// A master, its replica and three Sentinels (quorum 2) watching it, with
/// a 1 s down-after so a failover takes seconds.
struct SentinelSet {
    master: u16,
    replica: u16,
    sentinels: Vec<u16>,
    children: Vec<Option<Child>>,
    dir: tempfile::TempDir,
}

impl SentinelSet {
    /// On free ports in `ports` (a range no other test running at once
    /// takes).
    async fn start(ports: std::ops::RangeInclusive<u16>) -> Self {
        let ports = free_ports(ports, 5);
        let dir = tempfile::tempdir().unwrap();
        let mut set = Self {
            master: ports[0],
            replica: ports[1],
            sentinels: ports[2..].to_vec(),
            children: Vec::new(),
            dir,
        };
        let (master, replica) = (set.master, set.replica);
        set.spawn_server(master, &[]);
        set.spawn_server(replica, &["--replicaof", "127.0.0.1", &master.to_string()]);
        wait_for("the replica to sync", Duration::from_secs(30), async || {
            info(replica, "replication")
                .await
                .contains("master_link_status:up")
        })
        .await;
        for port in set.sentinels.clone() {
            let config = set.dir.path().join(format!("sentinel-{port}.conf"));
            std::fs::write(
                &config,
                format!(
                    "port {port}\nbind 127.0.0.1\ndir {dir}\n\
                     sentinel monitor {MASTER_NAME} 127.0.0.1 {master} 2\n\
                     sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                     sentinel failover-timeout {MASTER_NAME} 5000\n",
                    dir = set.dir.path().display()
                ),
            )
            .unwrap();
            let log = set.dir.path().join(format!("sentinel-{port}.log"));
            set.children.push(Some(
                Command::new("redis-server")
                    .arg(&config)
                    .arg("--sentinel")
                    .args(["--logfile", &log.display().to_string()])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start redis-server --sentinel"),
            ));
        }
        for port in set.sentinels.clone() {
            wait_for(
                "a Sentinel to see the replica and the others",
                Duration::from_secs(30),
                async || {
                    let text = info(port, "sentinel").await;
                    text.contains("status=ok") && text.contains("slaves=1,sentinels=3")
                },
            )
            .await;
        }
        set
    }

    fn spawn_server(&mut self, port: u16, extra: &[&str]) {
        let log = self.dir.path().join(format!("redis-{port}.log"));
        self.children.push(Some(
            Command::new("redis-server")
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no"])
                .args(["--dir", &self.dir.path().display().to_string()])
                .args(["--logfile", &log.display().to_string()])
                .args(extra)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start redis-server (is it installed?)"),
        ));
    }

    fn url(&self) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+sentinel://{}/{MASTER_NAME}/0", hosts.join(","))
    }

    /// `kill -9` of the master (the first process started).
    fn kill_master(&mut self) {
        if let Some(mut child) = self.children[0].take() {
            child.kill().expect("SIGKILL redis-server");
            child.wait().expect("reap redis-server");
        }
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        for child in self.children.iter_mut().filter_map(Option::take) {
            let mut child = child;
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A plain connection to the server on `port`.
async fn plain(port: u16) -> redis::aio::MultiplexedConnection {
    redis_connection(&format!("redis://127.0.0.1:{port}"))
        .await
        .expect("connect to the server")
}

/// `INFO <section>` of the server on `port`, or nothing.
async fn info(port: u16, section: &str) -> String {
    let Ok(client) = redis::Client::open(format!("redis://127.0.0.1:{port}")) else {
        return String::new();
    };
    let Ok(mut con) = client.get_multiplexed_async_connection().await else {
        return String::new();
    };
    redis::cmd("INFO")
        .arg(section)
        .query_async(&mut con)
        .await
        .unwrap_or_default()
}

/// courier reaches the master through the Sentinels; the master is killed
/// with `kill -9` while courier drains the queue, the Sentinels promote the
/// replica, and courier follows: every message is acked or dead-lettered,
/// none is lost.
///
/// Everything is written, and copied to the replica (`WAIT`), before the
/// kill: Redis replicates asynchronously, so a write the master took in its
/// last moment may be lost with it. courier's own writes after that are
/// each one transaction: lost whole, the delivery is handed out again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_mid_drain_loses_nothing() {
    const MESSAGES: usize = 400;
    let mut set = SentinelSet::start(17110..=17124).await;
    let app = TestApp::start().await;
    let queue = unique("sentinel");
    let fixture = Fixture::redis_at(&set.url(), &queue);
    let source = fixture.open().await;
    let mut master = plain(set.master).await;
    for i in 0..MESSAGES {
        let _: String = redis::cmd("XADD")
            .arg(&queue)
            .arg("*")
            .arg(courier::model::PAYLOAD)
            .arg(failover_body(i))
            .query_async(&mut master)
            .await
            .unwrap();
    }
    // The dead letters as a plain client reads them on the replica, the
    // new master.
    let replica = format!("redis://127.0.0.1:{}", set.replica);
    drain_through_a_kill(
        &app,
        &fixture,
        &source,
        &mut master,
        MESSAGES,
        || set.kill_master(),
        &replica,
    )
    .await;
    assert!(
        info(set.replica, "replication")
            .await
            .contains("role:master"),
        "the replica was promoted"
    );
}

/// An idle reader waits in a blocking `XREADGROUP` on the master; when that
/// master is killed, the connection drops, and the new one goes to the
/// master the Sentinels name after the failover, where a message arriving
/// at the idle queue is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_waiting_reader_follows_a_failover() {
    let mut set = SentinelSet::start(17130..=17144).await;
    let app = TestApp::start().await;
    let fixture = Fixture::redis_at(&set.url(), &unique("sentinel-idle"));
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    let waiting_on = async |port: u16| {
        let list: String = redis::cmd("CLIENT")
            .arg("LIST")
            .query_async(&mut plain(port).await)
            .await
            .unwrap();
        !waiting_readers(&list).is_empty()
    };
    wait_for("a reader waiting on the master", SETTLE, async || {
        waiting_on(set.master).await
    })
    .await;
    set.kill_master();
    wait_for("the replica to be promoted", SETTLE, async || {
        info(set.replica, "replication")
            .await
            .contains("role:master")
    })
    .await;
    wait_for("a reader waiting on the new master", SETTLE, async || {
        waiting_on(set.replica).await
    })
    .await;
    let _: String = redis::cmd("XADD")
        .arg(&fixture.queue)
        .arg("*")
        .arg(courier::model::PAYLOAD)
        .arg("after the failover")
        .query_async(&mut plain(set.replica).await)
        .await
        .unwrap();
    wait_for("the arrival to be delivered", SETTLE, async || {
        !app.received_body(b"after the failover").is_empty()
    })
    .await;
    running.stop().await;
}

/// Sentinels that know no master by the URL's name: courier says so, and
/// keeps asking (not ready meanwhile) as for any broker it cannot reach.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unknown_master_name_is_logged_and_asked_again() {
    let port = free_ports(17125..=17129, 1)[0];
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("sentinel.conf");
    std::fs::write(&config, format!("port {port}\nbind 127.0.0.1\n")).unwrap();
    let mut sentinel = Command::new("redis-server")
        .arg(&config)
        .arg("--sentinel")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start redis-server --sentinel");
    wait_for(
        "the Sentinel to answer",
        Duration::from_secs(10),
        async || info(port, "sentinel").await.contains("sentinel_masters"),
    )
    .await;
    let url = format!("redis+sentinel://127.0.0.1:{port}/nosuchmaster/0");
    let mut courier = CourierProcess::run(
        &[
            "--source",
            &url,
            "--queue",
            "orders",
            "--listen",
            "127.0.0.1:0",
        ]
        .map(String::from),
    );
    let line = courier
        .wait_log(
            "cannot open the source; not ready, trying again",
            Duration::from_secs(20),
        )
        .await;
    let _ = sentinel.kill();
    let _ = sentinel.wait();
    let error = line["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(r#"knows no master named "nosuchmaster""#),
        "{line}"
    );
}
