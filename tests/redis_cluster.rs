//! Redis Cluster: the stream, `<queue>.retry` and the dead-letter stream
//! must share a hash slot, so a queue name without a hash tag is refused at
//! start, and a tagged one works. A private single-node cluster on a free
//! port, serving every slot, stands in for a cluster.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

struct ClusterNode {
    port: u16,
    child: Child,
    _dir: tempfile::TempDir,
}

impl ClusterNode {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
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
    let client = redis::Client::open(node.url()).unwrap();
    let mut con = client.get_multiplexed_async_connection().await.unwrap();
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
    let mut live = courier::source::SourceOptions::new("{orders}").live();
    live.dead_letter_queue = "orders-failed".into();
    let refused = source.check(&live).unwrap_err();
    assert!(refused.contains("hash tag {orders}"), "{refused}");
    assert!(refused.contains("\"{orders}.dlq\""), "{refused}");
    live.dead_letter_queue = "{orders}.failed".into();
    assert_eq!(source.check(&live), Ok(()));
}
