//! Redis Cluster: the stream, `<queue>.retry` and the dead-letter stream
//! must share a hash slot, so a queue name without a hash tag is refused at
//! start, and a tagged one works.
//!
//! - `redis://` to one cluster node: a private single-node cluster on a free
//!   port, serving every slot;
//! - `redis+cluster://`: the 3+3 cluster `scripts/services` starts (the
//!   conformance suite's `redis_cluster` module runs every scenario on it),
//!   and a private 3+3 cluster of this test binary's own for killing a
//!   master mid-drain.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::common::*;

struct ClusterNode {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl ClusterNode {
    async fn start() -> Self {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no"])
            .args(["--cluster-enabled", "yes"])
            .args(["--dir", &dir.path().display().to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server (is it installed?)");
        let node = Self {
            port,
            child,
            _dir: dir,
        };
        let url = node.url();
        wait_for(
            "the cluster node to answer",
            Duration::from_secs(10),
            async || {
                let Ok(client) = redis::Client::open(url.as_str()) else {
                    return false;
                };
                let Ok(mut con) = client.get_multiplexed_async_connection().await else {
                    return false;
                };
                // One node serving every slot is a whole cluster.
                let _: redis::RedisResult<()> = redis::cmd("CLUSTER")
                    .arg("ADDSLOTSRANGE")
                    .arg(0)
                    .arg(16383)
                    .query_async(&mut con)
                    .await;
                let info: String = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query_async(&mut con)
                    .await
                    .unwrap_or_default();
                info.contains("cluster_state:ok")
            },
        )
        .await;
        node
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }
}

impl Drop for ClusterNode {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_without_a_hash_tag_is_refused_on_a_cluster() {
    let node = ClusterNode::start().await;
    let mut courier = CourierProcess::run(
        &[
            "--source",
            &node.url(),
            "--queue",
            "orders",
            "--listen",
            "127.0.0.1:0",
        ]
        .map(String::from),
    );
    let status = courier.exit_within(Duration::from_secs(10)).await;
    let stderr = courier.log();
    assert_eq!(status.code(), Some(1), "{stderr}");
    for words in ["Redis Cluster", "no hash tag", r#"--queue "{orders}""#] {
        assert!(stderr.contains(words), "{words:?} not in: {stderr}");
    }
    // Nothing was created on the refused run.
    let mut con = redis_connection(&node.url()).await.unwrap();
    let exists: u64 = redis::cmd("EXISTS")
        .arg("orders")
        .query_async(&mut con)
        .await
        .unwrap();
    assert_eq!(exists, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tagged_queue_delivers_retries_and_dead_letters_on_a_cluster() {
    let node = ClusterNode::start().await;
    let app = TestApp::start().await;
    let fixture = Fixture::redis_at(&node.url(), "{orders}");
    let source = fixture.open().await;
    let ok = fixture.send(&source, "ok").await;
    let flaky = fixture.send(&source, "script:503,200").await;
    let bad = fixture.send(&source, "script:400").await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    let depth = wait_settled(&source, Duration::from_secs(20)).await;
    running.stop().await;
    assert_eq!(app.received_body(b"ok").len(), 1, "{ok}");
    // The retry crossed {orders} and {orders}.retry: one slot.
    assert_eq!(app.received_body(b"script:503,200").len(), 2, "{flaky}");
    assert_eq!(depth.dead_letters, 1, "{bad}");
    let letters = source.dead_letters(&fixture.dlq(), 10).await.unwrap();
    assert_eq!(letters.len(), 1);
}

/// A live policy change that moves the dead-letter queue out of the queue's
/// hash slot is refused, saying why; one that keeps the tag is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_dead_letter_queue_outside_the_slot_is_refused_on_a_cluster() {
    let node = ClusterNode::start().await;
    let fixture = Fixture::redis_at(&node.url(), "{orders}");
    let source = fixture.open().await;
    let mut live = courier::source::SourceOptions::new("{orders}").live;
    live.dead_letter_queue = "orders-failed".into();
    let refused = source.check(&live).unwrap_err();
    assert!(refused.contains("hash tag {orders}"), "{refused}");
    assert!(refused.contains("\"{orders}.dlq\""), "{refused}");
    live.dead_letter_queue = "{orders}.failed".into();
    assert_eq!(source.check(&live), Ok(()));
}

// === redis+cluster:// ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_without_a_hash_tag_is_refused_on_a_cluster_url() {
    let mut courier = CourierProcess::run(
        &[
            "--source",
            REDIS_CLUSTER_URL,
            "--queue",
            "orders",
            "--listen",
            "127.0.0.1:0",
        ]
        .map(String::from),
    );
    let status = courier.exit_within(Duration::from_secs(20)).await;
    let stderr = courier.log();
    assert_eq!(status.code(), Some(1), "{stderr}");
    for words in ["Redis Cluster", "no hash tag", r#"--queue "{orders}""#] {
        assert!(stderr.contains(words), "{words:?} not in: {stderr}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_dead_letter_queue_outside_the_slot_is_refused_on_a_cluster_url() {
    let fixture = Fixture::of(BrokerKind::RedisCluster);
    let source = fixture.open().await;
    let mut live = courier::source::SourceOptions::new(&fixture.queue).live;
    live.dead_letter_queue = "orders-failed".into();
    let refused = source.check(&live).unwrap_err();
    assert!(refused.contains("hash tag"), "{refused}");
    live.dead_letter_queue = format!("{}.failed", fixture.queue);
    assert_eq!(source.check(&live), Ok(()));
}

/// A malformed cluster or Sentinel URL is bad usage: exit 2 before
/// anything connects, saying what to write, without the password.
#[test]
fn malformed_cluster_and_sentinel_urls_are_bad_usage() {
    for (url, says) in [
        ("redis+cluster://:hunter2@127.0.0.1:17101,", "an empty host"),
        (
            "redis+cluster://:hunter2@127.0.0.1:17101/3",
            "only database 0",
        ),
        (
            "redis+sentinel://:hunter2@127.0.0.1:26379",
            "no master name",
        ),
    ] {
        let out = courier_command()
            .args(["send", "--source", url, "--queue", "{orders}", "x"])
            .output()
            .expect("run courier send");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{url}: {stderr}");
        assert!(stderr.contains(says), "{url}: {stderr}");
        assert!(stderr.contains("redis+sentinel://host:port"), "{stderr}");
        assert!(!stderr.contains("hunter2"), "{stderr}");
    }
}

/// `courier send` takes a cluster URL too, through a node that does not
/// own the queue's slot (`courier dlq` on it: the conformance suite's
/// `redis_cluster::list_show_replay_purge`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn courier_send_works_on_a_cluster_url() {
    let fixture = Fixture::of(BrokerKind::RedisCluster);
    let source = fixture.open().await;
    let out = courier_command()
        .args(["send", "--source", &fixture.source_arg()])
        .args(["--queue", &fixture.queue, "hello"])
        .output()
        .expect("run courier send");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let deliveries = source.receive(10).await.unwrap();
    assert_eq!(deliveries.len(), 1);
    assert_eq!(deliveries[0].message.id, id);
    assert_eq!(deliveries[0].message.body.as_ref(), b"hello");
}

/// A Redis Cluster of the test's own: 3 masters and 3 replicas on free
/// ports, with a short node timeout so a replica takes over within seconds.
/// The shared cluster of `scripts/services` is never killed.
struct PrivateCluster {
    ports: Vec<u16>,
    children: Vec<Option<Child>>,
    _dir: tempfile::TempDir,
}

/// A port free for a cluster node: the port and its cluster bus port
/// (port + 10000).
fn free_node_port(taken: &[u16]) -> u16 {
    loop {
        let port = free_port();
        if port > 55_000 || taken.contains(&port) {
            continue;
        }
        if std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

impl PrivateCluster {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut ports = Vec::new();
        for _ in 0..6 {
            ports.push(free_node_port(&ports));
        }
        let children = ports
            .iter()
            .map(|port| {
                let path = |name: String| dir.path().join(name).display().to_string();
                Some(
                    Command::new("redis-server")
                        .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                        .args(["--save", "", "--appendonly", "no"])
                        .args(["--cluster-enabled", "yes"])
                        .args(["--cluster-config-file", &path(format!("nodes-{port}.conf"))])
                        .args(["--cluster-node-timeout", "1000"])
                        .args(["--dir", &dir.path().display().to_string()])
                        .args(["--logfile", &path(format!("redis-{port}.log"))])
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .spawn()
                        .expect("start redis-server (is it installed?)"),
                )
            })
            .collect();
        let cluster = Self {
            ports,
            children,
            _dir: dir,
        };
        for port in &cluster.ports {
            wait_for(
                "a cluster node to answer",
                Duration::from_secs(10),
                async || node(*port).await.is_some(),
            )
            .await;
        }
        let nodes: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let created = tokio::process::Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&nodes)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .output()
            .await
            .expect("run redis-cli --cluster create");
        assert!(
            created.status.success(),
            "{}",
            String::from_utf8_lossy(&created.stdout)
        );
        cluster.wait_ok().await;
        cluster
    }

    /// Until every node still running says `cluster_state:ok` and every
    /// replica's link to its master is up.
    async fn wait_ok(&self) {
        let ports: Vec<u16> = self
            .ports
            .iter()
            .zip(&self.children)
            .filter(|(_, child)| child.is_some())
            .map(|(port, _)| *port)
            .collect();
        wait_for(
            "the cluster to be ok",
            Duration::from_secs(60),
            async || {
                for port in &ports {
                    let Some(mut con) = node(*port).await else {
                        return false;
                    };
                    let info: String = redis::cmd("CLUSTER")
                        .arg("INFO")
                        .query_async(&mut con)
                        .await
                        .unwrap_or_default();
                    let replication: String = redis::cmd("INFO")
                        .arg("replication")
                        .query_async(&mut con)
                        .await
                        .unwrap_or_default();
                    if !info.contains("cluster_state:ok")
                        || (replication.contains("role:slave")
                            && !replication.contains("master_link_status:up"))
                    {
                        return false;
                    }
                }
                true
            },
        )
        .await;
    }

    /// Every node, as a user would list them: any that answers is enough.
    fn url(&self) -> String {
        let nodes: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", nodes.join(","))
    }

    /// The index of the master that owns `key`'s slot: the one node that
    /// does not redirect a question about it.
    async fn owner(&self, key: &str) -> usize {
        for (i, port) in self.ports.iter().enumerate() {
            let mut con = node(*port).await.expect("a cluster node");
            let asked: redis::RedisResult<String> =
                redis::cmd("TYPE").arg(key).query_async(&mut con).await;
            if asked.is_ok() {
                return i;
            }
        }
        panic!("no node owns the slot of {key}");
    }

    /// `kill -9` of one node.
    fn kill9(&mut self, i: usize) {
        if let Some(mut child) = self.children[i].take() {
            child.kill().expect("SIGKILL redis-server");
            child.wait().expect("reap redis-server");
        }
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        for i in 0..self.children.len() {
            self.kill9(i);
        }
    }
}

/// A plain connection to one node, if it answers.
async fn node(port: u16) -> Option<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    let mut con = client.get_multiplexed_async_connection().await.ok()?;
    let pong: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut con).await;
    pong.ok().map(|_| con)
}

/// The master that owns the queue's slot is killed with `kill -9` while
/// courier drains the queue; its replica takes over. Every message is acked
/// or dead-lettered in the end, none is lost.
///
/// Everything is written, and copied to the replica (`WAIT`), before the
/// kill: Redis replicates asynchronously, so a write the master took in
/// its last moment may be lost with it. courier's own writes after that (an
/// ack, a retry, a dead letter) are each one transaction: lost whole, the
/// delivery is handed out again, never lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_master_killed_mid_drain_loses_nothing() {
    const MESSAGES: usize = 600;
    let mut cluster = PrivateCluster::start().await;
    let app = TestApp::start().await;
    let queue = format!("{{{}}}", unique("kill"));
    let fixture = Fixture::redis_at(&cluster.url(), &queue);
    let source = fixture.open().await;
    let producer = fixture.producer().await;
    for i in 0..MESSAGES {
        producer.send(failover_body(i), &[]).await;
    }
    let owner = cluster.owner(&queue).await;
    let mut master = node(cluster.ports[owner]).await.unwrap();
    let url = cluster.url();
    drain_through_a_kill(
        &app,
        &fixture,
        &source,
        &mut master,
        MESSAGES,
        || cluster.kill9(owner),
        &url,
    )
    .await;
}
