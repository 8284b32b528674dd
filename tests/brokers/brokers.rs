//! RabbitMQ and NATS beyond the conformance suite: what the app receives
//! from a message the broker's own client published, `courier send`, a
//! broker that restarts mid-flow (a private instance this test starts on
//! ports of its own), and a broker that is unreachable or refuses the
//! credentials at start.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::*;
use bytes::Bytes;
use courier::source::Source;

const SETTLE: Duration = Duration::from_secs(30);

fn answers(port: u16) -> bool {
    std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
}

/// `GET /readyz`: true on 200.
async fn ready(addr: SocketAddr) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let _ = stream
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await;
    let mut out = String::new();
    let _ = stream.read_to_string(&mut out).await;
    out.starts_with("HTTP/1.1 200")
}

/// Sends SIGTERM to a child this test started.
fn terminate(child: &Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
}

// === Private brokers ===

/// A `nats-server` with JetStream on a port and data directory of its own,
/// and its monitoring endpoint on another (`/varz`, `/connz`).
pub(crate) struct PrivateNats {
    port: u16,
    pub(crate) monitor_port: u16,
    dir: PathBuf,
    auth: Option<(String, String)>,
    child: Option<Child>,
}

impl PrivateNats {
    pub(crate) async fn start(dir: &Path, auth: Option<(&str, &str)>) -> Self {
        let mut nats = Self {
            port: free_port(),
            monitor_port: free_port(),
            dir: dir.to_path_buf(),
            auth: auth.map(|(u, p)| (u.to_string(), p.to_string())),
            child: None,
        };
        nats.restart().await;
        nats
    }

    async fn restart(&mut self) {
        let mut command = Command::new("nats-server");
        command
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-m",
                &self.monitor_port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if let Some((user, pass)) = &self.auth {
            command.args(["--user", user, "--pass", pass]);
        }
        self.child = Some(command.spawn().expect("start nats-server"));
        let port = self.port;
        wait_for(
            "nats-server to answer",
            Duration::from_secs(10),
            async || answers(port),
        )
        .await;
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    pub(crate) fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A RabbitMQ node of its own: node name, AMQP and distribution ports,
/// data, log and plugins under a temporary directory, and its own Erlang
/// cookie (`HOME`). It shares the machine's `epmd`.
struct PrivateRabbit {
    port: u16,
    dist_port: u16,
    node: String,
    dir: PathBuf,
    child: Option<Child>,
}

impl PrivateRabbit {
    async fn start(dir: &Path) -> Self {
        let port = free_port();
        std::fs::create_dir_all(dir.join("mnesia")).unwrap();
        std::fs::create_dir_all(dir.join("log")).unwrap();
        std::fs::write(dir.join("enabled_plugins"), "[].\n").unwrap();
        std::fs::write(dir.join("rabbitmq-env.conf"), "").unwrap();
        std::fs::write(
            dir.join("rabbitmq.conf"),
            format!("listeners.tcp.local = 127.0.0.1:{port}\n"),
        )
        .unwrap();
        let mut rabbit = Self {
            port,
            dist_port: free_port(),
            node: format!("courier-test-{}@localhost", unique("node")),
            dir: dir.to_path_buf(),
            child: None,
        };
        rabbit.restart().await;
        rabbit
    }

    async fn restart(&mut self) {
        let dir = &self.dir;
        let child = Command::new("/usr/lib/rabbitmq/bin/rabbitmq-server")
            .current_dir(dir)
            .env("HOME", dir)
            .env("RABBITMQ_CONF_ENV_FILE", dir.join("rabbitmq-env.conf"))
            .env("RABBITMQ_CONFIG_FILE", dir.join("rabbitmq.conf"))
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", dir.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", dir.join("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", dir.join("enabled_plugins"))
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            // Run the VM in place of the script, so the child is the broker.
            .env("RUNNING_UNDER_SYSTEMD", "1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start a private rabbitmq-server");
        self.child = Some(child);
        // The AMQP port taking a TCP connection was not enough: a CI run's
        // first open after it failed. Ready is when an AMQP connection opens.
        let url = self.url();
        wait_for(
            "the private RabbitMQ node to take AMQP connections",
            Duration::from_secs(120),
            async || amqp_opens(&url).await,
        )
        .await;
    }

    /// A graceful stop (SIGTERM), waiting for the node to exit.
    async fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            terminate(&child);
            let deadline = Instant::now() + Duration::from_secs(60);
            while child.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }
}

impl Drop for PrivateRabbit {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

// === Interop: the broker's own client publishes ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_message_from_the_plain_client_reaches_the_app_as_published() {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    use lapin::types::{AMQPValue, FieldTable};
    let fixture = Fixture::amqp();
    let app = TestApp::start().await;
    let source = fixture.open().await;

    let connection = lapin::Connection::connect(AMQP_URL, Default::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let body: &[u8] = &[b'{', 0, 0xff, b'}'];
    let mut headers = FieldTable::default();
    headers.insert(
        "idempotency-key".into(),
        AMQPValue::LongString("order-7".into()),
    );
    headers.insert("x-tenant".into(), AMQPValue::LongString("acme".into()));
    headers.insert("retries-allowed".into(), AMQPValue::LongInt(42));
    headers.insert(
        "traceparent".into(),
        AMQPValue::LongString("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
    );
    let properties = lapin::BasicProperties::default()
        .with_content_type("application/json".into())
        .with_message_id("m-1".into())
        .with_headers(headers);
    for (payload, props) in [
        (body, properties),
        (
            &b"plain"[..],
            lapin::BasicProperties::default().with_message_id("m-2".into()),
        ),
    ] {
        channel
            .basic_publish(
                "".into(),
                fixture.queue.as_str().into(),
                BasicPublishOptions::default(),
                payload,
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    // The test's own source counts only what it holds itself, so the
    // queue reads settled as soon as the sidecar has taken both messages
    // into its prefetch: wait for the app to have them first.
    wait_for("both messages at the app", SETTLE, async || {
        app.received().len() >= 2
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;

    let seen = app.received_body(body);
    assert_eq!(seen.len(), 1, "the body arrives byte for byte");
    let r = &seen[0];
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("idempotency-key"), Some("order-7"));
    assert_eq!(r.header("x-tenant"), Some("acme"));
    assert_eq!(r.header("retries-allowed"), Some("42"));
    assert_eq!(
        r.header("traceparent"),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    assert_eq!(r.header("courier-message-id"), Some("m-1"));
    assert_eq!(r.header("courier-queue"), Some(fixture.queue.as_str()));
    assert_eq!(r.header("courier-attempt"), Some("1"));

    let seen = app.received_body(b"plain");
    assert_eq!(seen.len(), 1);
    let key = format!("{}:m-2", fixture.queue);
    assert_eq!(seen[0].header("idempotency-key"), Some(key.as_str()));
    assert_eq!(
        seen[0].header("content-type"),
        Some("application/octet-stream")
    );
    let _ = connection.close(200, "done".into()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_message_from_the_plain_client_reaches_the_app_as_published() {
    let fixture = Fixture::nats();
    let app = TestApp::start().await;
    let source = fixture.open().await;

    let client = async_nats::connect(NATS_URL).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let body = Bytes::from_static(&[b'{', 0, 0xff, b'}']);
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Content-Type", "application/json");
    headers.insert("Idempotency-Key", "order-7");
    headers.insert("X-Tenant", "acme");
    headers.insert(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    );
    let first = js
        .publish_with_headers(fixture.queue.clone(), headers, body.clone())
        .await
        .unwrap()
        .await
        .unwrap();
    let second = js
        .publish(fixture.queue.clone(), Bytes::from_static(b"plain"))
        .await
        .unwrap()
        .await
        .unwrap();

    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    wait_for("both messages at the app", SETTLE, async || {
        app.received().len() >= 2
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;

    let seen = app.received_body(&body);
    assert_eq!(seen.len(), 1, "the body arrives byte for byte");
    let r = &seen[0];
    assert_eq!(r.header("content-type"), Some("application/json"));
    assert_eq!(r.header("idempotency-key"), Some("order-7"));
    assert_eq!(r.header("x-tenant"), Some("acme"));
    assert_eq!(
        r.header("traceparent"),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    let id = first.sequence.to_string();
    assert_eq!(r.header("courier-message-id"), Some(id.as_str()));
    assert_eq!(r.header("courier-queue"), Some(fixture.queue.as_str()));

    let seen = app.received_body(b"plain");
    assert_eq!(seen.len(), 1);
    let key = format!("{}:{}", fixture.queue, second.sequence);
    assert_eq!(seen[0].header("idempotency-key"), Some(key.as_str()));
}

// === courier send ===

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn courier_send_publishes_to_rabbitmq() {
    use lapin::options::BasicGetOptions;
    let fixture = Fixture::amqp();
    let source = fixture.open().await;
    let out = courier_send(
        &fixture,
        &[
            "--header",
            "content-type=text/plain",
            "--header",
            "x-tenant=acme",
            "hello",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = String::from_utf8(out.stdout).unwrap().trim().to_string();

    let connection = lapin::Connection::connect(AMQP_URL, Default::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let got = channel
        .basic_get(
            fixture.queue.as_str().into(),
            BasicGetOptions { no_ack: true },
        )
        .await
        .unwrap()
        .expect("the message is in the queue");
    let props = &got.delivery.properties;
    assert_eq!(got.delivery.data, b"hello");
    assert_eq!(
        props.message_id().as_ref().map(|m| m.as_str()),
        Some(id.as_str())
    );
    assert_eq!(
        props.content_type().as_ref().map(|c| c.as_str()),
        Some("text/plain")
    );
    assert_eq!(props.delivery_mode(), &Some(2), "persistent");
    let tenant = props
        .headers()
        .as_ref()
        .unwrap()
        .inner()
        .get("x-tenant")
        .cloned();
    assert_eq!(
        tenant,
        Some(lapin::types::AMQPValue::LongString("acme".into()))
    );
    let _ = connection.close(200, "done".into()).await;

    // A queue that does not exist is an error that says so, not a message
    // silently dropped by the exchange.
    let missing = Fixture::amqp();
    let out = courier_send(&missing, &["hello"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("does not exist") && err.contains("--create"),
        "{err}"
    );
    drop(source);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn courier_send_publishes_to_nats() {
    let fixture = Fixture::nats();
    let source = fixture.open().await;
    let out = courier_send(
        &fixture,
        &[
            "--header",
            "content-type=text/plain",
            "--header",
            "x-tenant=acme",
            "hello",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let sequence: u64 = String::from_utf8(out.stdout)
        .unwrap()
        .trim()
        .parse()
        .unwrap();

    let client = async_nats::connect(NATS_URL).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(&fixture.queue).await.unwrap();
    let stored = stream.get_raw_message(sequence).await.unwrap();
    assert_eq!(stored.payload, Bytes::from_static(b"hello"));
    assert_eq!(stored.subject.as_str(), fixture.queue);
    assert_eq!(
        stored.headers.get("content-type").map(|v| v.as_str()),
        Some("text/plain")
    );
    assert_eq!(
        stored.headers.get("x-tenant").map(|v| v.as_str()),
        Some("acme")
    );

    let missing = Fixture::nats();
    let out = courier_send(&missing, &["hello"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("does not exist") && err.contains("--create"),
        "{err}"
    );
    drop(source);
}

// === A broker that restarts mid-flow ===

/// A private broker a test stops and starts again.
trait Restartable {
    async fn down(&mut self);
    async fn up(&mut self);
}

impl Restartable for PrivateNats {
    async fn down(&mut self) {
        self.kill();
    }
    async fn up(&mut self) {
        self.restart().await;
    }
}

impl Restartable for PrivateRabbit {
    async fn down(&mut self) {
        self.stop().await;
    }
    async fn up(&mut self) {
        self.restart().await;
    }
}

/// Sends `n` messages the app takes a while over, lets some through,
/// restarts the broker, and checks that readiness went false and back to
/// true and that every message reached the app and nothing was
/// dead-lettered.
async fn survives_a_restart(
    fixture: &Fixture,
    source: Arc<dyn Source>,
    broker: &mut impl Restartable,
) {
    let app = TestApp::start().await;
    let n = 30;
    for i in 0..n {
        fixture
            .send(&source, format!("script:sleep100\nmessage {i}"))
            .await;
    }
    let mut config = run_config(fixture, &app, fast_policy());
    config.options.concurrency = 4;
    let running = Running::start(config).await;
    let addr = running.metrics_addr;
    wait_for(
        "the sidecar to be ready",
        Duration::from_secs(20),
        async || ready(addr).await,
    )
    .await;
    wait_for("some deliveries", Duration::from_secs(20), async || {
        app.received().len() >= 5
    })
    .await;

    broker.down().await;
    // Down until the sidecar has noticed, not for a fixed time. Readiness
    // asks the source when probed, so it is false only while the broker
    // is gone: a watcher polling beside the restart could miss a broker
    // back within tens of milliseconds.
    wait_for(
        "readiness to go false while the broker is down",
        Duration::from_secs(60),
        async || !ready(addr).await,
    )
    .await;
    broker.up().await;
    wait_for(
        "readiness to come back once the broker is",
        Duration::from_secs(180),
        async || ready(addr).await,
    )
    .await;
    wait_settled(&source, Duration::from_secs(60)).await;
    let metrics = scrape(addr).await;
    running.stop().await;
    for i in 0..n {
        let body = format!("script:sleep100\nmessage {i}");
        assert!(
            !app.received_body(body.as_bytes()).is_empty(),
            "message {i} was lost"
        );
    }
    let letters = source.dead_letters(&fixture.dlq(), 1000).await.unwrap();
    assert!(letters.is_empty(), "{letters:?}");
    assert!(metrics.contains("courier_app_up 1"), "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_restart_mid_flow_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut nats = PrivateNats::start(dir.path(), None).await;
    let fixture = Fixture::broker(&nats.url());
    let source = fixture.open().await;
    survives_a_restart(&fixture, source.clone(), &mut nats).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_restart_mid_flow_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut rabbit = PrivateRabbit::start(dir.path()).await;
    let fixture = Fixture::broker(&rabbit.url());
    let source = fixture.open().await;
    survives_a_restart(&fixture, source.clone(), &mut rabbit).await;
}

// === Unreachable broker and wrong credentials at start ===

/// Nothing listens yet: not ready, retried with backoff; once the broker
/// is there the sidecar connects, becomes ready and delivers. Readiness is
/// checked after each try the sidecar reports as failed, not at times the
/// test picks: every check follows a try that saw no broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_unreachable_at_start_is_retried_until_it_is_there() {
    const FAILED: &str = "cannot open the source; not ready, trying again";
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let fixture = Fixture::broker(&format!("nats://127.0.0.1:{port}"));
    let app = TestApp::start().await;
    let mut args = run_args(&fixture, &app, &dir.path().join("none"), "unreachable");
    // No policy file: the defaults.
    let at = args.iter().position(|a| a == "--policy-file").unwrap();
    args.drain(at..at + 2);
    args.push("--create".into());
    let mut courier = CourierProcess::run(&args);
    let addr = courier.metrics_addr().await;
    for tries in 1..=3 {
        wait_for("another failed try", SETTLE, async || {
            courier.log().matches(FAILED).count() >= tries
        })
        .await;
        assert!(!ready(addr).await, "ready without a broker");
    }
    let mut nats = PrivateNats {
        port,
        monitor_port: free_port(),
        dir: dir.path().to_path_buf(),
        auth: None,
        child: None,
    };
    nats.restart().await;
    wait_for(
        "the sidecar to connect",
        Duration::from_secs(40),
        async || ready(addr).await,
    )
    .await;
    let source = fixture.open().await;
    fixture.send(&source, "hello").await;
    wait_for("the delivery", Duration::from_secs(10), async || {
        !app.received_body(b"hello").is_empty()
    })
    .await;
    courier.terminate();
    let status = courier.exit_within(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}\n{}", courier.log());
}

/// `courier run` with credentials the broker turns down ends the start
/// with exit 1 and a message naming the setting to fix, instead of a retry
/// loop that looks like an outage; the password is in no line it wrote.
async fn refused_credentials_end_the_start(url: &str, expected: &str) {
    let args: Vec<String> = [
        "--source",
        url,
        "--queue",
        "anything",
        "--listen",
        "127.0.0.1:0",
        "--app",
        "http://127.0.0.1:9/",
    ]
    .map(str::to_string)
    .to_vec();
    let mut courier = CourierProcess::run(&args);
    let status = courier.exit_within(Duration::from_secs(30)).await;
    let log = courier.log();
    assert_eq!(status.code(), Some(1), "{status}\n{log}");
    assert!(log.contains(expected), "{log}");
    assert!(log.contains("--source"), "the setting is named: {log}");
    assert!(
        !log.contains("wrong-password"),
        "the password is not logged: {log}"
    );
    assert!(
        !log.contains("trying again"),
        "a refusal is not retried: {log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_wrong_credentials_end_the_start() {
    refused_credentials_end_the_start(
        "amqp://guest:wrong-password@127.0.0.1:5672/%2f",
        "refused the login of user \"guest\"",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_wrong_credentials_end_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let nats = PrivateNats::start(dir.path(), Some(("courier", "right"))).await;
    let url = format!("nats://courier:wrong-password@127.0.0.1:{}", nats.port);
    refused_credentials_end_the_start(&url, "refused the credentials").await;
}

/// Found at 45e36c9: a wrong Redis password, or a database index the
/// server does not have, was retried forever as "cannot reach the broker".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_wrong_password_and_database_end_the_start() {
    refused_credentials_end_the_start(
        "redis://nobody:wrong-password@127.0.0.1:6379",
        "check the user name and password in --source",
    )
    .await;
    refused_credentials_end_the_start(
        "redis://127.0.0.1:6379/99",
        "check the database index at the end of --source",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_right_credentials_in_the_url_work() {
    let dir = tempfile::tempdir().unwrap();
    let nats = PrivateNats::start(dir.path(), Some(("courier", "right"))).await;
    let url = format!("nats://courier:right@127.0.0.1:{}", nats.port);
    let fixture = Fixture::broker(&url);
    let source = fixture.open().await;
    let id = fixture.send(&source, "hello").await;
    assert_eq!(id, "1");
    assert_eq!(fixture.url.broker().name, "nats");
}

/// A missing queue without `--create` is a clear error, and a queue name
/// NATS cannot use as a stream name says why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_queues_and_bad_stream_names_are_clear_errors() {
    use courier::source::{ErrorKind, SourceOptions, open};
    let amqp = courier::source::parse_url(AMQP_URL).unwrap();
    let err = open(&amqp, SourceOptions::new(&unique("missing")))
        .await
        .err()
        .expect("a missing queue is an error");
    assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
    assert!(err.to_string().contains("--create"), "{err}");

    let nats = courier::source::parse_url(NATS_URL).unwrap();
    let err = open(&nats, SourceOptions::new(&unique("missing")))
        .await
        .err()
        .expect("a missing stream is an error");
    assert!(err.to_string().contains("--create"), "{err}");
    let err = open(&nats, SourceOptions::new("orders.v1"))
        .await
        .err()
        .expect("a dotted stream name is an error");
    assert!(err.to_string().contains("cannot contain '.'"), "{err}");
}

// === RabbitMQ: a queue that exists with its own arguments ===

/// A quorum queue declared with arguments courier does not know: used as it
/// is (never redeclared), with retries, dead letters and replay working.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_quorum_queue_with_its_own_arguments_works_the_same() {
    let fixture = Fixture::amqp();
    declare_amqp_quorum(&fixture.queue).await;
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let retried = fixture.send(&source, "script:503,500,200").await;
    let dead = fixture.send(&source, "script:400,200").await;
    let running = Running::start(run_config(&fixture, &app, fast_policy())).await;
    // A quorum queue's message count lags a little behind a message that a
    // tier just sent back, so wait for the deliveries themselves first.
    wait_for("three attempts", SETTLE, async || {
        app.received_body(b"script:503,500,200").len() >= 3
    })
    .await;
    wait_settled(&source, SETTLE).await;
    let seen: Vec<u32> = app
        .received_body(b"script:503,500,200")
        .iter()
        .map(Received::attempt)
        .collect();
    assert_eq!(seen, vec![1, 2, 3]);
    let letters = source.dead_letters(&fixture.dlq(), 100).await.unwrap();
    assert_eq!(letters.len(), 1);
    let letter = &letters[0];
    assert_eq!(letter.field("courier-message-id"), Some(dead.as_str()));
    assert_eq!(letter.field("courier-reason"), Some("permanent-status"));
    // Listing did not consume it; replay sends it back with the same id.
    let again = source.dead_letters(&fixture.dlq(), 100).await.unwrap();
    assert_eq!(again, letters);
    source.replay(&fixture.dlq(), letter).await.unwrap();
    wait_for("the replayed delivery", SETTLE, async || {
        app.received_body(b"script:400,200").len() >= 2
    })
    .await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    let replayed = app.received_body(b"script:400,200");
    assert_eq!(replayed.len(), 2);
    let key = format!("{}:{dead}", fixture.queue);
    assert_eq!(replayed[1].header("idempotency-key"), Some(key.as_str()));
    assert_eq!(replayed[1].attempt(), 1);
    assert_no_dead_letters(&source, &fixture).await;
    assert_ne!(retried, dead);
}

// === NATS: in-progress acks ===

/// A delivery that runs longer than the consumer's `AckWait` is kept alive
/// with in-progress acks and is not handed out a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_long_delivery_is_kept_in_progress() {
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    let fixture = Fixture::nats();
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let client = async_nats::connect(NATS_URL).await.unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(&fixture.queue).await.unwrap();
    stream
        .create_consumer(pull::Config {
            durable_name: Some("courier".into()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(2),
            max_deliver: -1,
            ..Default::default()
        })
        .await
        .unwrap();
    fixture.send(&source, "script:sleep5000").await;
    let mut policy = fast_policy();
    policy.timeout = Duration::from_secs(8);
    let running = Running::start(run_config(&fixture, &app, policy)).await;
    wait_settled(&source, SETTLE).await;
    running.stop().await;
    assert_eq!(
        app.received_body(b"script:sleep5000").len(),
        1,
        "handed out once although it took 2.5 x AckWait"
    );
}

/// `amqps://` is TLS: against a plain AMQP port the handshake fails; it
/// never falls back to plain text (which would send the password in clear).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_never_falls_back_to_plain_text() {
    use courier::source::{ErrorKind, SourceOptions, open};
    let url = courier::source::parse_url("amqps://guest:guest@localhost:5672/%2f").unwrap();
    let mut options = SourceOptions::new(&unique("tls"));
    options.create = true;
    let err = open(&url, options)
        .await
        .err()
        .expect("a TLS handshake with a plain port fails");
    assert_eq!(err.kind(), ErrorKind::Unavailable, "{err}");
    assert!(!err.to_string().contains("guest:guest"), "{err}");
}
