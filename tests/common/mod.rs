//! What the integration tests share: a real HTTP app on loopback whose
//! answers are scripted per message, the sources under test, and a way to
//! run the sidecar in-process or as the built binary.
#![allow(dead_code)]

// A headless Chromium through WebDriver, for the console's tests.
pub mod browser;
mod embedded_file;
mod failover;
mod inventory;
mod kafka_mock;
mod kube_stub;
mod moto;
mod private_redis;
mod pubsub_emulator;
mod server_process;
// Tests settle by hand with ack/retry/dead_letter.
#[allow(unused_imports)]
pub use courier::source::SettleBy;
#[allow(unused_imports)]
pub use embedded_file::store_raw;
#[allow(unused_imports)]
pub use failover::{
    assert_none_lost, assert_none_twice, dead_letter_bodies, drain_across_a_kill,
    drain_through_a_kill, failover_body, wait_none_lost,
};
#[allow(unused_imports)]
pub use inventory::{inventory, remove as remove_queue, work_queue_item};
#[allow(unused_imports)]
pub use kafka_mock::{KAFKA_MOCK_BIN, KafkaMock, shared_kafka};
#[allow(unused_imports)]
pub use kube_stub::KubeStub;
#[allow(unused_imports)]
pub use moto::{Moto, SQS_REGION, shared_moto, sqs_client, sqs_queue_url, sqs_url};
#[allow(unused_imports)]
pub use private_redis::PrivateRedis;
#[allow(unused_imports)]
pub use pubsub_emulator::{
    PUBSUB_PROJECT, PubSubEmulator, create_pubsub_subscription, pubsub_clients,
    pubsub_subscription, pubsub_topic, pubsub_url, shared_pubsub,
};

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use courier::dispatch::{AppSettings, DeliverySettings};
use courier::policy::{Jitter, Policy};
use courier::sidecar::Sidecar;
use courier::sidecar::{EndpointSettings, PolicySettings, RunConfig};
use courier::source::{self, Depth, Source, SourceError, SourceOptions, SourceUrl};
use courier::telemetry::serve_http;
use http::Response;
use http_body_util::{BodyExt, Full};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub const REDIS_URL: &str = "redis://127.0.0.1:6379/0";
/// The first node of the Redis Cluster (3 masters, 3 replicas on
/// 17101-17106) that `scripts/services` starts.
pub const REDIS_CLUSTER_PORT: u16 = 17101;
pub const REDIS_CLUSTER_URL: &str = "redis+cluster://127.0.0.1:17101";
pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// The repository's root, where `docs/`, `examples/` and the charts are.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

// === Ports ===

/// A port on 127.0.0.1 that nothing listened on a moment ago (the system
/// picks it); the caller binds it, or gives it to a server, next.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// [`free_port`] as an address on 127.0.0.1.
pub fn free_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// An address on 127.0.0.1 for a server a test stops and starts again on
/// the same port: below the system's ephemeral range (32768 and up), and
/// free a moment ago. While the server is down, an ephemeral port can be
/// taken as the source port of any outgoing connection (courier's own
/// connects to the closed port included, which can meet themselves), and
/// the server's second bind then failed with "Address already in use"
/// (stop 56's CI, dispatch_gate::amqp); a port no connect is given stays
/// free. Picked at random from 20000-24999, a range no fixed port of the
/// suite uses (RabbitMQ's 25672 and the Redis Cluster buses, 27xxx, lie
/// above it), so tests running at once do not pick the same one.
pub fn returnable_addr() -> SocketAddr {
    use std::hash::{BuildHasher, Hasher};
    loop {
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        let port = 20_000 + (random % 5_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return SocketAddr::from(([127, 0, 0, 1], port));
        }
    }
}

/// `n` ports in `range` that nothing listens on. Each test has a range of
/// its own, so tests running at once never pick the same port.
pub fn free_ports(range: std::ops::RangeInclusive<u16>, n: usize) -> Vec<u16> {
    let ports: Vec<u16> = range
        .clone()
        .filter(|port| std::net::TcpListener::bind(("127.0.0.1", *port)).is_ok())
        .take(n)
        .collect();
    assert_eq!(ports.len(), n, "{n} free ports in {range:?}");
    ports
}

// === The app ===

/// One request as the app saw it.
#[derive(Debug, Clone)]
pub struct Received {
    pub at: Instant,
    /// The wall clock at `at`: what durable due times are stored in. Here
    /// it has run up to 0.5 % ahead of `Instant` (20 ms in 4 s).
    pub wall: SystemTime,
    pub headers: HashMap<String, String>,
    pub body: Bytes,
    /// The request's path and query (`/orders?x=1`).
    pub path: String,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .get(&name.to_ascii_lowercase())
            .map(String::as_str)
    }

    pub fn attempt(&self) -> u32 {
        self.header("courier-attempt")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }
}

/// A real HTTP server on 127.0.0.1. A message body may start with a script
/// line `script:<step>,<step>,...`; the app answers the n-th request for
/// that body with the n-th step (the last step repeats). A step is a status
/// (`503`), a status with Retry-After seconds (`429ra1`), `sleepN` (wait N
/// ms, then 200), or `hold` (wait until [`TestApp::release_held`], then 200;
/// at once after it), followed by any answer headers as `+name=value`
/// (`500+courier-dead-letter=out of stock`). Any other body gets 200. Every
/// request is recorded.
#[derive(Clone)]
pub struct TestApp {
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
    stop: CancellationToken,
    /// Requests waiting in a `hold` step now.
    held: Arc<std::sync::atomic::AtomicUsize>,
    released: CancellationToken,
}

/// A script step's answer headers (`+name=value` after the step) and the
/// step without them.
fn answer_headers(step: &str) -> (&str, Vec<(String, String)>) {
    let mut parts = step.split('+');
    let step = parts.next().unwrap_or_default();
    let headers = parts
        .filter_map(|h| h.split_once('='))
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    (step, headers)
}

fn answer(step: &str) -> (u16, Option<String>, Option<u64>) {
    if let Some(ms) = step.strip_prefix("sleep") {
        return (200, None, ms.parse().ok());
    }
    if let Some((status, secs)) = step.split_once("ra") {
        return (status.parse().unwrap_or(200), Some(secs.to_string()), None);
    }
    (step.parse().unwrap_or(200), None, None)
}

impl TestApp {
    pub async fn start() -> Self {
        Self::start_on("127.0.0.1:0").await
    }

    /// A [`TestApp`] the test stops and starts again with [`Self::start_on`]
    /// its `addr` ([`returnable_addr`]).
    pub async fn start_returnable() -> Self {
        Self::start_on(&returnable_addr().to_string()).await
    }

    pub async fn start_on(addr: &str) -> Self {
        let listener = TcpListener::bind(addr).await.expect("bind the test app");
        let app = Self {
            addr: listener.local_addr().unwrap(),
            received: Arc::default(),
            stop: CancellationToken::new(),
            held: Arc::default(),
            released: CancellationToken::new(),
        };
        let received = app.received.clone();
        let (held, released) = (app.held.clone(), app.released.clone());
        tokio::spawn(serve_http(listener, app.stop.clone(), move |req| {
            let received = received.clone();
            let (held, released) = (held.clone(), released.clone());
            async move {
                let path = req
                    .uri()
                    .path_and_query()
                    .map_or_else(|| "/".to_string(), |p| p.as_str().to_string());
                let headers = req
                    .headers()
                    .iter()
                    .map(|(n, v)| {
                        (
                            n.as_str().to_string(),
                            String::from_utf8_lossy(v.as_bytes()).into_owned(),
                        )
                    })
                    .collect();
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let (at, wall) = (Instant::now(), SystemTime::now());
                let seen = {
                    let mut all = received.lock().unwrap();
                    let seen = all.iter().filter(|r: &&Received| r.body == body).count();
                    all.push(Received {
                        at,
                        wall,
                        headers,
                        body: body.clone(),
                        path,
                    });
                    seen
                };
                let script = std::str::from_utf8(&body).ok().and_then(|b| {
                    b.lines()
                        .next()?
                        .strip_prefix("script:")
                        .map(str::to_string)
                });
                let (step, headers) = match &script {
                    Some(script) => {
                        let steps: Vec<&str> = script.split(',').collect();
                        answer_headers(steps[seen.min(steps.len() - 1)])
                    }
                    None => ("200", Vec::new()),
                };
                if step == "hold" && !released.is_cancelled() {
                    use std::sync::atomic::Ordering::SeqCst;
                    held.fetch_add(1, SeqCst);
                    released.cancelled().await;
                    held.fetch_sub(1, SeqCst);
                }
                let (status, retry_after, sleep) = answer(step);
                if let Some(ms) = sleep {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                let mut response = Response::builder().status(status);
                if let Some(ra) = retry_after {
                    response = response.header("retry-after", ra);
                }
                for (name, value) in headers {
                    response = response.header(name, value);
                }
                response
                    .body(Full::new(Bytes::from(format!(
                        "answer {status} to attempt {}",
                        seen + 1
                    ))))
                    .unwrap()
            }
        }));
        app
    }

    pub fn url(&self) -> String {
        format!("http://{}/", self.addr)
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Distinct bodies among `bodies` that the app has seen.
    pub fn reached(&self, bodies: &std::collections::HashSet<String>) -> usize {
        self.received()
            .iter()
            .filter_map(|r| std::str::from_utf8(&r.body).ok())
            .filter(|b| bodies.contains(*b))
            .collect::<std::collections::HashSet<_>>()
            .len()
    }

    /// Requests whose body is exactly `body`, in arrival order.
    pub fn received_body(&self, body: &[u8]) -> Vec<Received> {
        self.received()
            .into_iter()
            .filter(|r| r.body.as_ref() == body)
            .collect()
    }

    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Requests the app is holding in a `hold` step now.
    pub fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Answers every held request, and from now on every `hold` at once.
    pub fn release_held(&self) {
        self.released.cancel();
    }
}

// === Sources ===

mod brokers;

/// A connection to a Redis server for a test to write and inspect with.
/// redis 1.x gives up on an answer after 500 ms, the handshake's included;
/// on a busy 2-core machine a test's first connection missed that (a CI
/// run's `redis_settle` test), and 40 MiB writes take longer too.
pub async fn redis_connection(
    url: &str,
) -> ::redis::RedisResult<::redis::aio::MultiplexedConnection> {
    let config = ::redis::AsyncConnectionConfig::new()
        .set_connection_timeout(Some(Duration::from_secs(30)))
        .set_response_timeout(Some(Duration::from_secs(30)));
    ::redis::Client::open(url)?
        .get_multiplexed_async_connection_with_config(&config)
        .await
}

// Not every test crate uses every name.
#[allow(unused_imports)]
pub use brokers::{
    Amqp, BrokerCleanup, BrokerFixture, BrokerKind, Embedded, Kafka, Nats, PlainLetter, Producer,
    PubSub, Redis, RedisCluster, RedisConnection, Sqs, amqp_count_without_consumers,
    declare_amqp_quorum, kafka_bootstrap, kafka_records, pubsub_messages, queue_on_another_node,
    sqs_messages, sqs_plain_letter,
};

/// A source under test, with a fresh queue of its own.
#[derive(Clone, Debug)]
pub struct Fixture {
    pub url: SourceUrl,
    pub queue: String,
    /// Which broker: decides the producer and the clean-up.
    pub broker: BrokerKind,
    /// Keeps the embedded queue's directory alive.
    _dir: Option<Arc<tempfile::TempDir>>,
    /// Deletes the broker's queues or streams when the last clone goes.
    _cleanup: Option<Arc<BrokerCleanup>>,
}

pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}-{}", std::process::id(), rand::random::<u32>())
}

impl Fixture {
    /// A fresh queue on the shared Redis on loopback.
    pub fn redis() -> Self {
        Redis::fixture()
    }

    /// Redis at `url` (a private server), with the queue named `queue`;
    /// nothing is deleted afterwards (the private server goes with it).
    pub fn redis_at(url: &str, queue: &str) -> Self {
        let url = courier::source::parse_url(url).unwrap();
        Self {
            broker: BrokerKind::of_url(&url),
            url,
            queue: queue.into(),
            _dir: None,
            _cleanup: None,
        }
    }

    /// RabbitMQ; `open` declares the queue (as `--create` would).
    pub fn amqp() -> Self {
        Amqp::fixture()
    }

    /// NATS JetStream; `open` creates the stream (as `--create` would).
    pub fn nats() -> Self {
        Nats::fixture()
    }

    /// A fresh queue on the broker at `url`, deleted when the test is done.
    pub fn broker(url: &str) -> Self {
        let kind = BrokerKind::of_url(&courier::source::parse_url(url).unwrap());
        Self::with_cleanup(kind.name(), url, unique("test"))
    }

    pub fn embedded() -> Self {
        Embedded::fixture()
    }

    /// A fresh topic on the mock Kafka cluster this test binary shares.
    pub fn kafka() -> Self {
        Kafka::fixture()
    }

    /// A fresh queue on the moto server this test binary shares.
    pub fn sqs() -> Self {
        Sqs::fixture()
    }

    /// A fresh subscription on the Pub/Sub emulator this test binary shares.
    pub fn pubsub() -> Self {
        PubSub::fixture()
    }

    /// A fresh queue on the broker `kind`.
    pub fn of(kind: BrokerKind) -> Self {
        kind.fixture()
    }

    /// `queue` on the broker at `url` (named `name` by courier), deleted
    /// when the last clone goes.
    fn with_cleanup(name: &str, url: &str, queue: String) -> Self {
        let url = courier::source::parse_url(url).unwrap();
        let broker = BrokerKind::of_url(&url);
        assert_eq!(broker.name(), name, "{} is not a {name} URL", url.as_str());
        Self {
            _cleanup: Some(Arc::new(BrokerCleanup {
                kind: broker,
                url: url.as_str().to_string(),
                queue: queue.clone(),
            })),
            url,
            broker,
            queue,
            _dir: None,
        }
    }

    /// The embedded queue in `dir`, which lives as long as the fixture.
    fn in_dir(dir: tempfile::TempDir) -> Self {
        Self {
            url: courier::source::embedded::url(dir.path()),
            broker: BrokerKind::Embedded,
            queue: unique("test"),
            _dir: Some(Arc::new(dir)),
            _cleanup: None,
        }
    }

    /// Another queue on the same broker, named after this one (so on a
    /// Redis Cluster it shares this one's hash tag, and on the embedded
    /// queue its file), cleaned up like it.
    pub fn sibling(&self, suffix: &str) -> Self {
        let queue = format!("{}-{suffix}", self.queue);
        Self {
            url: self.url.clone(),
            broker: self.broker,
            _dir: self._dir.clone(),
            _cleanup: self._cleanup.as_ref().map(|_| {
                Arc::new(BrokerCleanup {
                    kind: self.broker,
                    url: self.url.as_str().to_string(),
                    queue: queue.clone(),
                })
            }),
            queue,
        }
    }

    /// The `--source` text.
    pub fn source_arg(&self) -> String {
        self.url.as_str().to_string()
    }

    pub fn dir(&self) -> Option<PathBuf> {
        courier::source::embedded::dir_of(self.url.as_str()).ok()
    }

    pub fn dlq(&self) -> String {
        format!("{}.dlq", self.queue)
    }

    /// A permanent-status failure (a 400 at attempt 1) of message `id`,
    /// bound for [`Fixture::dlq`], as the dispatcher would describe it.
    pub fn failure_of(&self, id: &str) -> courier::model::Failure {
        let now = std::time::SystemTime::now();
        courier::model::Failure {
            reason: courier::model::DeadLetterReason::PermanentStatus,
            status: Some(400),
            error: None,
            attempts: 1,
            first_attempt_at: now,
            last_attempt_at: now,
            queue: self.queue.clone(),
            message_id: id.to_string(),
            excerpt: Bytes::new(),
            policy: "test@1".into(),
            dead_letter_queue: self.dlq(),
            app_directive: None,
            cut: None,
        }
    }

    /// A handle for producing and inspecting; in-process it shares the
    /// embedded queue with a sidecar started in this process.
    ///
    /// A missing queue is created as `courier run --create` does, so the
    /// suite runs on what users get (RabbitMQ: a quorum queue).
    pub async fn open(&self) -> Arc<dyn Source> {
        let mut options = SourceOptions::new(&self.queue);
        options.consumer = "inspector".into();
        options.create = true;
        source::open(&self.url, options)
            .await
            .expect("open the source")
    }

    /// [`Fixture::open`] with the seal's keys from a keys file, so that
    /// nothing makes a key in the broker.
    pub async fn open_sealed(&self, seal: Arc<courier::source::Seal>) -> Arc<dyn Source> {
        let mut options = SourceOptions::new(&self.queue);
        options.consumer = "inspector".into();
        options.create = true;
        options.seal = Some(seal);
        source::open(&self.url, options)
            .await
            .expect("open the source")
    }

    /// [`Fixture::open`], named for tests that are about what
    /// `courier run --create` makes.
    pub async fn open_as_created(&self) -> Arc<dyn Source> {
        self.open().await
    }

    /// Sends through courier's own `Source::send`.
    pub async fn send(&self, source: &Arc<dyn Source>, body: impl Into<Bytes>) -> String {
        source.send(body.into(), &[]).await.expect("send")
    }

    /// A producer with the broker's own client (the queue is created first).
    pub async fn producer(&self) -> Producer {
        self.broker.producer(self).await
    }

    /// The dead letters as the broker's own client reads them.
    pub async fn read_dead_letters(&self) -> Vec<PlainLetter> {
        self.broker.read_dead_letters(self).await
    }

    /// Every dead letter of this fixture's queue, oldest first.
    pub async fn dead_letters(&self, source: &Arc<dyn Source>) -> Vec<courier::source::DeadLetter> {
        source
            .dead_letters(&self.dlq(), 100_000)
            .await
            .expect("list the dead letters")
    }
}

/// A policy with short, exact timings so tests stay fast.
pub fn fast_policy() -> Policy {
    Policy {
        name: "test".into(),
        generation: 1,
        max_attempts: 3,
        timeout: Duration::from_millis(500),
        ..Policy::default()
    }
    .backoff_of(
        Duration::from_millis(50),
        Duration::from_millis(200),
        2.0,
        Jitter::None,
    )
}

pub fn run_config(fixture: &Fixture, app: &TestApp, policy: Policy) -> RunConfig {
    run_config_for(fixture, &app.url(), policy)
}

/// [`run_config`] for an app at `app_url` that is not a [`TestApp`].
pub fn run_config_for(fixture: &Fixture, app_url: &str, policy: Policy) -> RunConfig {
    let mut options = SourceOptions::new(&fixture.queue);
    options.consumer = unique("consumer");
    options.live.visibility_timeout = policy.timeout + Duration::from_secs(2);
    options.live.dead_letter_queue = fixture.dlq();
    options.concurrency = 8;
    options.max_body = 1 << 20;
    RunConfig {
        source: fixture.url.clone(),
        options,
        app: AppSettings {
            // The conformance scenarios fail on purpose, many in a row; the
            // 503/timeout gate is tested on its own in tests/brokers/chaos.rs.
            failure_run: 0,
            ..AppSettings::new(app_url.parse().unwrap())
        },
        delivery: DeliverySettings {
            drain_timeout: Duration::from_secs(5),
            dedup_window: None,
            batch: None,
        },
        policy: PolicySettings {
            poll: Duration::from_millis(100),
            ..PolicySettings::fixed(policy)
        },
        endpoint: EndpointSettings {
            listen: "127.0.0.1:0".parse().unwrap(),
            drain_token: None,
            drain_resume_after: Duration::from_secs(90),
            depth_interval: Duration::from_millis(200),
            readiness: courier::telemetry::Readiness::default(),
        },
    }
}

/// A sidecar running in this process.
pub struct Running {
    pub metrics_addr: SocketAddr,
    pub metrics: Arc<courier::telemetry::Metrics>,
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<anyhow::Result<courier::dispatch::DrainReport>>,
}

impl Running {
    pub async fn start(config: RunConfig) -> Self {
        Self::start_all(vec![config]).await
    }

    /// [`Running::start`] with `config`'s queue as the second of two
    /// subscriptions of one sidecar. The first consumes a queue of its own
    /// on the same broker (`<queue>-first`, created, in a group of its own,
    /// with the default policy), so that every scenario that runs this way
    /// also shows a subscription working beside another (issue 32).
    pub async fn start_second_of_two(config: RunConfig) -> Self {
        let mut first = config.clone();
        first.options.queue = format!("{}-first", config.options.queue);
        first.options.group = format!("{}-first", config.options.group);
        first.options.create = true;
        first.options.live.dead_letter_queue =
            Policy::default().dead_letter_queue_for(&first.options.queue);
        first.policy = PolicySettings::fixed(Policy::default());
        Self::start_all(vec![first, config]).await
    }

    /// One sidecar running every subscription of `configs`.
    pub async fn start_all(configs: Vec<RunConfig>) -> Self {
        let sidecar = Sidecar::with_subscriptions(configs);
        let metrics = sidecar.metrics.clone();
        let stop = CancellationToken::new();
        let (metrics_addr, handle) = sidecar
            .start(stop.clone())
            .await
            .expect("start the sidecar");
        Self {
            metrics_addr,
            metrics,
            stop,
            handle,
        }
    }

    pub async fn stop(self) -> courier::dispatch::DrainReport {
        self.stop.cancel();
        self.handle.await.expect("join").expect("sidecar result")
    }
}

/// Polls `check` until it is true (true) or `limit` passes (false).
pub async fn poll_until(limit: Duration, mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// Polls `check` until it is true or `limit` passes; the failure message
/// says what was awaited.
pub async fn wait_for(what: &str, limit: Duration, check: impl AsyncFnMut() -> bool) {
    assert!(
        poll_until(limit, check).await,
        "timed out after {limit:?} waiting for {what}"
    );
}

/// Whether an AMQP connection to `url` opens (and closes) within 5 s. A
/// booting RabbitMQ node may take the TCP connection and never answer the
/// handshake, and lapin's connect then waits for good (a CI run hung on
/// it; courier's own connect is bounded for the same reason).
pub async fn amqp_opens(url: &str) -> bool {
    let open = async {
        let connection = lapin::Connection::connect(url, Default::default()).await?;
        connection.close(200, "up".into()).await
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), open).await,
        Ok(Ok(()))
    )
}

/// How long the conformance scenarios wait for a queue to settle, or for
/// a sidecar to get through its work: an upper bound, only reached when
/// something is wrong or the machine is far behind. 20 and 30 s were too
/// short for a loaded CI run: moto answering for two test binaries at once
/// (SQS's acked_exactly_once and scheduled_retry_survives_restart), and a
/// Kafka group whose join the mock cluster dropped, which courier finds
/// and joins again after the session timeout and the visibility timeout
/// (dlq::kafka_a_replay_stopped_at_the_publish_loses_nothing, reproduced
/// once in a local run of every binary).
pub const SETTLE: Duration = Duration::from_secs(60);

/// Waits until nothing is ready, pending or scheduled; the failure says
/// what the last depth read was. A read that fails is read again: the first
/// command on a connection whose broker restarted since fails, as courier's
/// own depth poll sees and counts.
pub async fn wait_settled(source: &Arc<dyn Source>, limit: Duration) -> Depth {
    let mut last = Err(SourceError::unavailable("no depth read yet"));
    let settled = poll_until(limit, async || {
        last = source.depth().await;
        last.as_ref().is_ok_and(|depth| {
            depth.ready == Some(0) && depth.pending == 0 && depth.retry_backlog == 0
        })
    })
    .await;
    assert!(
        settled,
        "timed out after {limit:?} waiting for the queue to settle; the last depth read: {last:?}"
    );
    last.expect("a settled depth")
}

/// The fixture's dead-letter queue holds nothing (its first 100 letters
/// are shown when it does).
pub async fn assert_no_dead_letters(source: &Arc<dyn Source>, fixture: &Fixture) {
    let letters = source
        .dead_letters(&fixture.dlq(), 100)
        .await
        .expect("list the dead letters");
    assert!(letters.is_empty(), "dead letters: {letters:?}");
}

/// Reads `/metrics` from a running sidecar.
pub async fn scrape(addr: SocketAddr) -> String {
    http_get(addr, "/metrics").await
}

/// `GET path` at `addr`: the whole answer, head and body.
pub async fn http_get(addr: SocketAddr, path: &str) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect to {addr} for {path}: {e}"));
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut out = String::new();
    stream.read_to_string(&mut out).await.unwrap();
    out
}

/// `GET path` on courier's telemetry port: the status code.
pub async fn get_status(addr: SocketAddr, path: &str) -> u16 {
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return 0;
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    if tokio::io::AsyncWriteExt::write_all(&mut stream, request.as_bytes())
        .await
        .is_err()
    {
        return 0;
    }
    let mut out = String::new();
    let _ = tokio::io::AsyncReadExt::read_to_string(&mut stream, &mut out).await;
    out.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// The ids of the clients a Redis `CLIENT LIST` text shows blocked (flag
/// `b`) in `XREADGROUP`: courier's idle readers waiting for arrivals.
pub fn waiting_readers(client_list: &str) -> Vec<String> {
    client_list
        .lines()
        .filter(|line| {
            let mut fields = line.split(' ');
            fields
                .clone()
                .any(|f| f.strip_prefix("flags=").is_some_and(|v| v.contains('b')))
                && fields.any(|f| f == "cmd=xreadgroup")
        })
        .filter_map(|line| line.split(' ').find_map(|f| f.strip_prefix("id=")))
        .map(str::to_string)
        .collect()
}

/// A metric without labels (`courier_app_up`) from a `/metrics` text.
pub fn plain_metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

// === The built binary ===

use std::io::BufRead as _;
use std::path::Path;
use std::process::{Command as ProcessCommand, ExitStatus, Stdio};

/// The `courier` binary cargo built for these tests.
pub const COURIER_BIN: &str = env!("CARGO_BIN_EXE_courier");

/// A command for the built binary that inherits no `COURIER_*`, `OTEL_*`,
/// `RUST_LOG` or `POD_NAME` from whoever runs the tests: only the flags
/// given count, and no trace export starts unless a test asks for one.
pub fn courier_command() -> ProcessCommand {
    let mut command = ProcessCommand::new(COURIER_BIN);
    for (name, _) in std::env::vars_os() {
        let text = name.to_string_lossy();
        if text.starts_with("COURIER_") || text.starts_with("OTEL_") {
            command.env_remove(name);
        }
    }
    command.env_remove("RUST_LOG").env_remove("POD_NAME");
    command
}

/// `courier send ARGS` to `fixture`'s queue with the built binary.
pub fn courier_send(fixture: &Fixture, args: &[&str]) -> std::process::Output {
    courier_command()
        .args([
            "send",
            "--source",
            &fixture.source_arg(),
            "--queue",
            &fixture.queue,
        ])
        .args(args)
        .output()
        .expect("run courier send")
}

/// `courier run` flags for `fixture` and `app` with a policy file, a fixed
/// consumer name, a free telemetry port and fast depth polling.
pub fn run_args(
    fixture: &Fixture,
    app: &TestApp,
    policy_file: &Path,
    consumer: &str,
) -> Vec<String> {
    run_args_for(fixture, &app.url(), policy_file, consumer)
}

/// [`run_args`] with `fixture`'s queue as the second of two subscriptions
/// (`--subscriptions`), the first on a queue of its own as in
/// [`Running::start_second_of_two`].
pub fn run_args_second_of_two(
    fixture: &Fixture,
    app: &TestApp,
    policy_file: &Path,
    consumer: &str,
) -> Vec<String> {
    let mut args = run_args(fixture, app, policy_file, consumer);
    let at = args.iter().position(|a| a == "--queue").expect("--queue");
    args.drain(at..at + 2);
    let first = format!("{}-first", fixture.queue);
    args.extend([
        "--subscriptions".to_string(),
        format!(
            "subscriptions:\n  - queue: {first:?}\n    group: courier-first\n    create: true\n  - queue: {:?}\n",
            fixture.queue
        ),
    ]);
    args
}

/// [`run_args`] for an app at `app_url` that is not a [`TestApp`] (or not
/// listening yet).
pub fn run_args_for(
    fixture: &Fixture,
    app_url: &str,
    policy_file: &Path,
    consumer: &str,
) -> Vec<String> {
    [
        "--source",
        &fixture.source_arg(),
        "--queue",
        &fixture.queue,
        "--app",
        app_url,
        "--policy-file",
        &policy_file.display().to_string(),
        "--consumer",
        consumer,
        "--listen",
        "127.0.0.1:0",
        "--depth-interval",
        "200ms",
    ]
    .map(str::to_string)
    .to_vec()
}

/// Writes a RetryPolicy document whose `spec` is `spec` (YAML flow-mapping
/// entries, one per line, without indentation) to `dir/policy.yaml`.
pub fn write_policy(dir: &Path, spec: &str) -> PathBuf {
    let mut doc = String::from(
        "apiVersion: courier.dev/v1alpha1\nkind: RetryPolicy\nmetadata:\n  name: test\nspec:\n",
    );
    for line in spec.lines() {
        doc.push_str("  ");
        doc.push_str(line);
        doc.push('\n');
    }
    let path = dir.join("policy.yaml");
    std::fs::write(&path, doc).expect("write the policy file");
    path
}

/// Drops the test's handle on the source and, for the embedded queue, waits
/// until its redb file is free: a redb file serves one process at a time, so
/// a child `courier` can open it only after every handle here is gone (the
/// same directory shares one handle in a process, so drop every clone).
pub async fn release(fixture: &Fixture, source: Arc<dyn Source>) {
    drop(source);
    wait_released(fixture).await;
}

/// For the embedded queue, waits until no handle in this process holds its
/// file (see [`release`]); nothing for the other brokers.
pub async fn wait_released(fixture: &Fixture) {
    if let Some(dir) = fixture.dir() {
        let path = dir.join("courier.redb");
        wait_for(
            "this process to let go of the embedded queue",
            Duration::from_secs(10),
            async || match std::fs::File::open(&path) {
                // redb holds an exclusive flock while the file is open.
                Ok(file) => file.try_lock().is_ok(),
                Err(_) => true,
            },
        )
        .await;
    }
}

/// The sum of every series of `name` labelled with `queue` in a `/metrics`
/// text (e.g. dead letters over all reasons); 0 when there is none.
pub fn metric(text: &str, name: &str, queue: &str) -> f64 {
    let label = format!("queue=\"{queue}\"");
    text.lines()
        .filter(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') && rest.contains(&label))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// The value of `name{queue="…"}` in a `/metrics` text, or `None` when the
/// series is not there (a gauge left out because the broker cannot tell).
pub fn series(text: &str, name: &str, queue: &str) -> Option<f64> {
    let label = format!("queue=\"{queue}\"");
    text.lines()
        .find(|line| {
            line.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') && rest.contains(&label))
        })
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
}

/// The peak resident memory of process `pid` (`VmHWM`), in bytes.
pub fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmHWM in /proc/<pid>/status")
        * 1024
}

/// The memory a bounded read or count may take: courier's peak RSS grew by
/// less than `bound` bytes from `warm`, its peak after a first delivery (an
/// absolute bound would measure the binary's own size, ~40 MiB in a debug
/// build). Both figures are printed, so a passing run shows its margin.
pub fn assert_rss_grew_less(warm: u64, peak: u64, bound: usize, holding: &str) {
    eprintln!(
        "courier's peak RSS: {} KiB after a first delivery, {} KiB after {holding}",
        warm >> 10,
        peak >> 10
    );
    assert!(
        peak - warm < bound as u64,
        "courier's peak RSS grew by {} KiB after {holding}",
        (peak - warm) >> 10
    );
}

/// Bodies over `--max-body` through the built binary (its memory is its
/// own): sends `bodies` and a small message after them, runs `courier run`
/// with `extra` flags until the small one is delivered and each big one is
/// a dead letter, checks it still runs, stops it with SIGTERM and returns
/// its peak RSS with the ids sent and the dead letters. The app never sees
/// a big body.
pub async fn oversized_through_the_binary(
    fixture: &Fixture,
    bodies: Vec<Vec<u8>>,
    extra: &[&str],
) -> (u64, Vec<String>, Vec<courier::source::DeadLetter>) {
    const LIMIT: Duration = Duration::from_secs(60);
    let app = TestApp::start().await;
    let source = fixture.open().await;
    let smallest_big = bodies.iter().map(Vec::len).min().unwrap_or(0);
    let mut ids = Vec::new();
    for body in bodies {
        ids.push(fixture.send(&source, body).await);
    }
    fixture.send(&source, "small, after them").await;
    let dir = tempfile::tempdir().unwrap();
    let policy = write_policy(dir.path(), "maxAttempts: 3\ntimeout: 2s");
    let mut args = run_args(fixture, &app, &policy, "bounded");
    args.extend(extra.iter().map(|a| a.to_string()));
    let mut courier = CourierProcess::run(&args);
    wait_for("the small message", LIMIT, async || {
        !app.received_body(b"small, after them").is_empty()
    })
    .await;
    wait_for("the dead letters", LIMIT, async || {
        source.depth().await.unwrap().dead_letters == ids.len() as u64
    })
    .await;
    let peak = peak_rss(courier.id());
    assert!(
        courier.running(),
        "courier keeps running\n{}",
        courier.log()
    );
    courier.terminate();
    let status = courier.exit_within(LIMIT).await;
    assert!(status.success(), "{status}\n{}", courier.log());
    eprintln!("courier's peak RSS: {} MiB", peak >> 20);
    assert!(app.received().iter().all(|r| r.body.len() < smallest_big));
    let letters = source.dead_letters(&fixture.dlq(), 100).await.unwrap();
    (peak, ids, letters)
}

/// A dead letter of a body of `size` bytes over `--max-body max_body`,
/// sent as one of `ids`: undeliverable, saying why, the body kept.
pub fn assert_oversized(
    letter: &courier::source::DeadLetter,
    ids: &[String],
    size: usize,
    max_body: usize,
) {
    assert_eq!(letter.field("courier-reason"), Some("undeliverable"));
    assert!(
        ids.iter()
            .any(|id| letter.field("courier-message-id") == Some(id))
    );
    assert_eq!(
        letter.field("courier-error"),
        Some(format!("the body is {size} bytes, over --max-body {max_body}").as_str())
    );
    assert_eq!(letter.body.len(), size, "the body is kept");
}

/// `courier run` as a child process, logging JSON into a buffer the test
/// reads. Dropping it kills the process, so a failing test leaves none
/// behind.
pub struct CourierProcess {
    child: std::process::Child,
    log: Arc<Mutex<Vec<String>>>,
    /// Set when the log reader has read stderr to its end.
    log_read: Arc<std::sync::atomic::AtomicBool>,
    pub started: Instant,
}

impl CourierProcess {
    /// Starts `courier --log-format json run <args>`.
    pub fn run(args: &[String]) -> Self {
        Self::run_with_env(args, &[])
    }

    /// [`CourierProcess::run`] with environment variables set.
    pub fn run_with_env(args: &[String], env: &[(&str, &str)]) -> Self {
        let mut child = courier_command()
            .envs(env.iter().copied())
            .args(["--log-format", "json", "run"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start courier run");
        let log = Arc::new(Mutex::new(Vec::new()));
        let stderr = child.stderr.take().expect("piped stderr");
        let lines = log.clone();
        let log_read = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let read = log_read.clone();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                lines.lock().unwrap().push(line);
            }
            read.store(true, std::sync::atomic::Ordering::Release);
        });
        Self {
            child,
            log,
            log_read,
            started: Instant::now(),
        }
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Whether the process still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Everything the process logged so far.
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Waits for a log line whose message is `message` and returns it,
    /// parsed; fails early, with the log, if the process exits first.
    pub async fn wait_log(&mut self, message: &str, limit: Duration) -> serde_json::Value {
        let deadline = Instant::now() + limit;
        loop {
            let found = self.log.lock().unwrap().iter().find_map(|line| {
                let value: serde_json::Value = serde_json::from_str(line).ok()?;
                (value["message"] == message).then_some(value)
            });
            if let Some(value) = found {
                return value;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "courier exited ({status}) before logging {message:?}; log:\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "courier did not log {message:?} within {limit:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The address of `/metrics`, from the start-up log line.
    pub async fn metrics_addr(&mut self) -> SocketAddr {
        let line = self
            .wait_log(
                "serving /metrics, /healthz, /readyz and /drain",
                Duration::from_secs(10),
            )
            .await;
        line["addr"]
            .as_str()
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("no addr in {line}"))
    }

    /// Waits until the sidecar has opened the source and started pulling;
    /// returns when that was seen.
    pub async fn wait_running(&mut self) -> Instant {
        self.wait_log("courier is running", Duration::from_secs(10))
            .await;
        Instant::now()
    }

    /// `kill -9`: no drain, no flush, nothing settled.
    pub fn kill9(&mut self) {
        self.child.kill().expect("SIGKILL courier");
        self.child.wait().expect("reap courier");
    }

    /// Sends SIGTERM, as Kubernetes does to stop a pod.
    pub fn terminate(&self) {
        let status = ProcessCommand::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill -TERM");
        assert!(status.success(), "kill -TERM failed");
    }

    /// SIGTERM, then an exit with success within `limit`; fails with the
    /// log otherwise.
    pub async fn stop_cleanly(&mut self, limit: Duration) {
        self.terminate();
        let status = self.exit_within(limit).await;
        assert!(status.success(), "{status}; log:\n{}", self.log());
    }

    /// Waits for the process to exit, and for what it wrote last to be in
    /// [`CourierProcess::log`]; fails, with the log, after `limit`.
    pub async fn exit_within(&mut self, limit: Duration) -> ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for courier") {
                // Found at adde7bb: the exit came before the reader thread
                // had the last line (the error a failed start prints), and
                // a test reading the log on a loaded machine missed it.
                while !self.log_read.load(std::sync::atomic::Ordering::Acquire)
                    && Instant::now() < deadline
                {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "courier did not exit within {limit:?}; log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for CourierProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// One `#[tokio::test]` per source and scenario, in a module per source:
/// a new source is one more `name => fixture` pair, a new scenario one more
/// name. Each scenario is an `async fn(Fixture)` of the calling file. For a
/// scenario every broker should pass, add it to the conformance suite
/// (`tests/conformance/main.rs`), which runs it on every broker whose
/// capabilities allow it.
///
/// `crate::per_source!([redis => Fixture::redis(), embedded => Fixture::embedded()], [scenario_a, scenario_b]);`
#[macro_export]
macro_rules! per_source {
    ([$($source:ident => $fixture:expr),+ $(,)?], $scenarios:tt) => {
        $( $crate::per_source!(@source $source, $fixture, $scenarios); )+
    };
    (@source $source:ident, $fixture:expr, [$($scenario:ident),+ $(,)?]) => {
        mod $source {
            use super::*;

            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    super::$scenario($fixture).await;
                }
            )+
        }
    };
}

/// A line the process logged, read after it exited: the thread that reads
/// its stderr may still be catching up.
pub async fn logged(process: &CourierProcess, message: &str) -> serde_json::Value {
    let mut found = None;
    wait_for("the line in the log", Duration::from_secs(10), async || {
        found = process.log().lines().find_map(|line| {
            let value: serde_json::Value = serde_json::from_str(line).ok()?;
            (value["message"] == message).then_some(value)
        });
        found.is_some()
    })
    .await;
    found.unwrap()
}
