//! RabbitMQ clustering: three RabbitMQ nodes of this test binary's own
//! (`courier-t1@localhost` … on private ports, AMQP 17261-17263,
//! distribution 17271-17273, an `epmd` of their own on 17279), a quorum
//! queue replicated on all three, and courier consuming through a node
//! that survives. The queue's leader is killed with `kill -9` mid-drain:
//! nothing was delivered twice before the kill, courier keeps consuming,
//! and every message is acked or dead-lettered, none lost. The shared node
//! on 5672 is never touched.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::*;

/// AMQP ports `AMQP_BASE + 1..=3`, distribution ports `DIST_BASE + 1..=3`
/// and `EPMD_PORT`: inside the range kept for this test (17260-17279).
const AMQP_BASE: u16 = 17260;
const DIST_BASE: u16 = 17270;
const EPMD_PORT: u16 = 17279;

/// The package's scripts themselves: `/usr/sbin/rabbitmq-server` is a
/// wrapper that switches to the rabbitmq user, who cannot read this
/// process's temporary files.
const SBIN: &str = "/usr/lib/rabbitmq/bin";

/// A node's first boot takes about 10 s on an idle machine; far longer
/// under a full build.
const BOOT: Duration = Duration::from_secs(240);

struct Node {
    name: String,
    port: u16,
    child: Option<Child>,
}

/// Three clustered RabbitMQ nodes and their `epmd`, all killed when
/// dropped, however the test ends.
struct RabbitCluster {
    nodes: Vec<Node>,
    epmd: Option<Child>,
    dir: tempfile::TempDir,
}

impl RabbitCluster {
    /// Starts the three nodes at once. Node 1 boots as a new cluster of
    /// one; nodes 2 and 3 list node 1 as their only peer
    /// (`classic_config` peer discovery) and join it during their first
    /// boot, retrying until node 1 answers. So no node boots twice (as
    /// `stop_app`, `join_cluster`, `start_app` would make it), and no two
    /// nodes can form clusters of their own (each joins node 1 or fails).
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        fs::create_dir(&home).unwrap();
        let cookie = home.join(".erlang.cookie");
        fs::write(&cookie, "COURIERCLUSTERTEST").unwrap();
        // Erlang refuses a cookie file others can read.
        fs::set_permissions(&cookie, fs::Permissions::from_mode(0o400)).unwrap();
        // Instead of /etc/rabbitmq/rabbitmq-env.conf, which names the
        // shared node.
        fs::write(dir.path().join("rabbitmq-env.conf"), "").unwrap();
        let epmd = Command::new("epmd")
            .args(["-port", &EPMD_PORT.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start epmd (is Erlang installed?)");
        let mut cluster = Self {
            nodes: Vec::new(),
            epmd: Some(epmd),
            dir,
        };
        let started = Instant::now();
        while std::net::TcpStream::connect(("127.0.0.1", EPMD_PORT)).is_err() {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "epmd did not listen on {EPMD_PORT}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        for i in 1..=3 {
            let node = cluster.spawn(i);
            cluster.nodes.push(node);
        }
        cluster
    }

    fn node_dir(&self, i: u16) -> PathBuf {
        self.dir.path().join(format!("t{i}"))
    }

    /// What every node and `rabbitmqctl` share: the cookie (in `HOME`),
    /// the `epmd`, no environment file of the host's.
    fn env(&self) -> Vec<(&'static str, String)> {
        let path = |p: &Path| p.display().to_string();
        vec![
            ("HOME", path(&self.dir.path().join("home"))),
            ("ERL_EPMD_PORT", EPMD_PORT.to_string()),
            (
                "RABBITMQ_CONF_ENV_FILE",
                path(&self.dir.path().join("rabbitmq-env.conf")),
            ),
        ]
    }

    fn spawn(&self, i: u16) -> Node {
        let dir = self.node_dir(i);
        fs::create_dir(&dir).unwrap();
        let port = AMQP_BASE + i;
        let mut config = format!(
            "listeners.tcp.default = 127.0.0.1:{port}\nloopback_users = none\nlog.console = false\n"
        );
        if i != 1 {
            // 600 tries 250 ms apart: node 1 may take minutes under load.
            config.push_str(
                "cluster_formation.peer_discovery_backend = classic_config\n\
                 cluster_formation.classic_config.nodes.1 = courier-t1@localhost\n\
                 cluster_formation.discovery_retry_limit = 600\n\
                 cluster_formation.discovery_retry_interval = 250\n",
            );
        }
        fs::write(dir.join("rabbitmq.conf"), config).unwrap();
        // No plugins: the management plugin alone adds seconds to a boot.
        fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();
        let log = fs::File::create(dir.join("console.log")).unwrap();
        let path = |name: &str| dir.join(name).display().to_string();
        let name = format!("courier-t{i}@localhost");
        let child = Command::new(format!("{SBIN}/rabbitmq-server"))
            .envs(self.env())
            .env("RABBITMQ_NODENAME", &name)
            .env("RABBITMQ_NODE_PORT", port.to_string())
            .env("RABBITMQ_DIST_PORT", (DIST_BASE + i).to_string())
            .env("RABBITMQ_CONFIG_FILE", path("rabbitmq.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", path("enabled_plugins"))
            .env("RABBITMQ_MNESIA_BASE", path("mnesia"))
            .env("RABBITMQ_LOG_BASE", path("log"))
            .env("RABBITMQ_PID_FILE", path("rabbitmq.pid"))
            // The package's defaults, plus one scheduler and no busy
            // waiting: the boot was no faster for them (measured), but
            // three idle nodes then leave the shared cores to the builds.
            .env(
                "RABBITMQ_SERVER_ERL_ARGS",
                "+P 1048576 +t 5000000 +stbt db +zdbbl 128000 +S 1:1 +sbwt none +sbwtdcpu none +sbwtdio none",
            )
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            // The script stays the parent of the Erlang VM: a group of its
            // own is what `kill -9` reaches whole.
            .process_group(0)
            .spawn()
            .expect("start rabbitmq-server (is RabbitMQ installed?)");
        Node {
            name,
            port,
            child: Some(child),
        }
    }

    fn url(&self, name: &str) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.node(name).port)
    }

    fn node(&self, name: &str) -> &Node {
        self.nodes
            .iter()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name:?} in the cluster"))
    }

    /// Waits until every node takes AMQP connections: a node opens its
    /// listener last, after it joined the cluster. A node that exits while
    /// it boots gets one more boot from an empty directory: a CI run's
    /// node 1 stopped in its first boot on a machine that had just started
    /// (exit 0, `rabbit` failed to start); the test is about courier, not
    /// about booting RabbitMQ under load. The first boot's log is kept
    /// in the failure message if the second fails too.
    async fn wait_ready(&mut self) {
        for i in 0..self.nodes.len() {
            let url = self.url(&self.nodes[i].name.clone());
            let deadline = Instant::now() + BOOT;
            let mut first_boot: Option<String> = None;
            loop {
                if amqp_opens(&url).await {
                    break;
                }
                let exited = self.nodes[i]
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten());
                if exited.is_some() && first_boot.is_none() && Instant::now() < deadline {
                    let n = i as u16 + 1;
                    let log = self.log(n);
                    eprintln!(
                        "{} exited in its first boot ({exited:?}); booting it again:\n{log}",
                        self.nodes[i].name
                    );
                    first_boot = Some(log);
                    fs::remove_dir_all(self.node_dir(n)).unwrap();
                    self.nodes[i] = self.spawn(n);
                    continue;
                }
                assert!(
                    exited.is_none() && Instant::now() < deadline,
                    "{} did not start ({exited:?}):\n{}\n--- its first boot ---\n{}",
                    self.nodes[i].name,
                    self.logs(),
                    first_boot.unwrap_or_default()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }

    /// `rabbitmqctl -n <node> <args>`, its output; fails on an error.
    fn ctl(&self, node: &str, args: &[&str]) -> String {
        let out = Command::new(format!("{SBIN}/rabbitmqctl"))
            .envs(self.env())
            .args(["-n", node, "-q"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run rabbitmqctl");
        assert!(
            out.status.success(),
            "rabbitmqctl {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The quorum queue `queue` as `node` reports it: (leader, members,
    /// members online).
    fn quorum(&self, node: &str, queue: &str) -> (String, Vec<String>, Vec<String>) {
        let text = self.ctl(
            node,
            &[
                "list_queues",
                "name",
                "type",
                "leader",
                "members",
                "online",
                "--formatter",
                "json",
            ],
        );
        let queues: Vec<serde_json::Value> =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let q = queues
            .iter()
            .find(|q| q["name"] == queue)
            .unwrap_or_else(|| panic!("no queue {queue:?} in {text}"));
        assert_eq!(q["type"], "quorum", "{queue} is a quorum queue: {q}");
        let names = |key: &str| -> Vec<String> {
            let mut names: Vec<String> = q[key]
                .as_array()
                .unwrap_or_else(|| panic!("{key} in {q}"))
                .iter()
                .map(|n| n.as_str().unwrap().to_string())
                .collect();
            names.sort();
            names
        };
        (
            q["leader"].as_str().unwrap().to_string(),
            names("members"),
            names("online"),
        )
    }

    /// `kill -9` the node `name`: the Erlang VM and the script above it.
    fn kill9(&mut self, name: &str) {
        let node = self
            .nodes
            .iter_mut()
            .find(|n| n.name == name)
            .unwrap_or_else(|| panic!("no node {name:?} in the cluster"));
        let child = node.child.take().expect("the node runs");
        kill_group(child);
    }

    /// Every node's log, as [`Self::log`] shows it.
    fn logs(&self) -> String {
        (1..=3)
            .map(|i| format!("--- courier-t{i} ---\n{}", self.log(i)))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Node `i`'s log: why its boot failed, if it did (the lines from
    /// RabbitMQ's `BOOT FAILED` on, which the crash reports after it push
    /// out of any tail), and its last 15 lines.
    fn log(&self, i: u16) -> String {
        let dir = self.node_dir(i);
        let log = fs::read_to_string(dir.join("log").join(format!("courier-t{i}@localhost.log")))
            .or_else(|_| fs::read_to_string(dir.join("console.log")))
            .unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        let mut shown = Vec::new();
        if let Some(at) = lines.iter().position(|l| l.contains("BOOT FAILED")) {
            shown.extend_from_slice(&lines[at..lines.len().min(at + 30)]);
            shown.push("...");
        }
        shown.extend_from_slice(&lines[lines.len().saturating_sub(15)..]);
        shown.join("\n")
    }
}

/// SIGKILL to the process group `child` leads, then reaps it.
fn kill_group(mut child: Child) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{}", child.id())])
        .status();
    let _ = child.wait();
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(child) = node.child.take() {
                kill_group(child);
            }
        }
        if let Some(mut epmd) = self.epmd.take() {
            let _ = epmd.kill();
            let _ = epmd.wait();
        }
    }
}

/// The quorum queue's leader is killed with `kill -9` a third into a drain
/// of 300 messages (one in ten answered 503 once, one in ten 400 for good)
/// while courier consumes through another node. Before the kill nothing
/// reached the app twice; after it courier goes on through its node, every
/// message reaches the app or the dead-letter queue, and the queue ends
/// with nothing pending or scheduled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quorum_leader_killed_mid_drain_loses_nothing() {
    const MESSAGES: usize = 300;
    let started = Instant::now();
    let mut cluster = RabbitCluster::start();
    cluster.wait_ready().await;
    let cluster_ready = started.elapsed();

    let queue = unique("cluster");
    // Declared through node 1 as `courier run --create` declares it: a
    // quorum queue with a replica on every node of the cluster.
    let first = cluster.nodes[0].name.clone();
    drop(
        Fixture::redis_at(&cluster.url(&first), &queue)
            .open_as_created()
            .await,
    );
    let all: Vec<String> = cluster.nodes.iter().map(|n| n.name.clone()).collect();
    let (leader, members, online) = cluster.quorum(&first, &queue);
    assert_eq!(members, all, "the queue has a replica on every node");
    assert_eq!(online, all, "every replica is online");

    // courier (one URL, one node) consumes through a node that stays.
    let survivor = all.iter().find(|n| **n != leader).unwrap().clone();
    let fixture = Fixture::redis_at(&cluster.url(&survivor), &queue);
    let source = fixture.open_as_created().await;
    // Each send returns after the broker's confirm: on a quorum queue, once
    // a majority of the replicas wrote the message.
    for i in 0..MESSAGES {
        fixture.send(&source, failover_body(i)).await;
    }

    let app = TestApp::start().await;
    let dlq_reader = fixture.clone();
    drain_across_a_kill(
        &app,
        &fixture,
        &source,
        MESSAGES,
        || cluster.kill9(&leader),
        async || {
            dlq_reader
                .read_dead_letters()
                .await
                .into_iter()
                .map(|l| String::from_utf8_lossy(&l.body).into_owned())
                .collect()
        },
    )
    .await;

    let (new_leader, _, online) = cluster.quorum(&survivor, &queue);
    assert_ne!(new_leader, leader, "a new leader took over");
    assert_eq!(online.len(), 2, "two replicas left: {online:?}");
    eprintln!(
        "figures: 3 nodes clustered and taking connections {cluster_ready:?} after the start; leader {leader} killed, {new_leader} took over; courier on {survivor}"
    );
}
