//! The brokers the tests know, one fixture each: how to get a fresh queue
//! (connect to the broker on loopback, or make a directory), how a producer
//! that knows nothing of courier publishes to it (the broker's own client),
//! how that client reads the dead letters, and how to delete what a test
//! left.
//!
//! [`BrokerKind`] is matched exhaustively everywhere, so a broker added here
//! without a fixture, a producer or a clean-up does not compile; and the
//! conformance suite checks that every broker of `courier::source::BROKERS`
//! has a kind here.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use courier::source::{Capabilities, Source, SourceUrl};

use super::{
    AMQP_URL, Fixture, NATS_URL, REDIS_CLUSTER_PORT, REDIS_CLUSTER_URL, REDIS_URL, unique,
};

/// A broker the tests have a fixture for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BrokerKind {
    Redis,
    /// Redis again, as a Redis Cluster (`redis+cluster://`).
    RedisCluster,
    Amqp,
    Nats,
    Embedded,
    Kafka,
    Sqs,
    PubSub,
}

impl BrokerKind {
    pub const ALL: [BrokerKind; 8] = [
        Self::Redis,
        Self::RedisCluster,
        Self::Amqp,
        Self::Nats,
        Self::Embedded,
        Self::Kafka,
        Self::Sqs,
        Self::PubSub,
    ];

    /// The name `courier::source::Broker::name` gives this broker.
    pub fn name(self) -> &'static str {
        match self {
            Self::Redis => Redis::NAME,
            Self::RedisCluster => RedisCluster::NAME,
            Self::Amqp => Amqp::NAME,
            Self::Nats => Nats::NAME,
            Self::Embedded => Embedded::NAME,
            Self::Kafka => Kafka::NAME,
            Self::Sqs => Sqs::NAME,
            Self::PubSub => PubSub::NAME,
        }
    }

    /// The kind of the broker courier names `name` (the first, where one
    /// broker has several kinds); `None` when the tests have no fixture for
    /// it.
    pub fn of(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.name() == name)
    }

    /// The kind of the broker behind `url`; panics, naming it, when the
    /// tests have no fixture for it.
    pub fn of_url(url: &SourceUrl) -> Self {
        let name = url.broker().name;
        let scheme = url.as_str().split("://").next().unwrap_or_default();
        if scheme.ends_with("+cluster") {
            return Self::RedisCluster;
        }
        Self::of(name).unwrap_or_else(|| {
            panic!("no test fixture for broker {name:?}: add one to tests/common/brokers.rs")
        })
    }

    /// What courier's source for this broker claims it can do, as pinned
    /// here ([`BrokerFixture::CAPABILITIES`]).
    pub fn capabilities(self) -> Capabilities {
        match self {
            Self::Redis => Redis::CAPABILITIES,
            Self::RedisCluster => RedisCluster::CAPABILITIES,
            Self::Amqp => Amqp::CAPABILITIES,
            Self::Nats => Nats::CAPABILITIES,
            Self::Embedded => Embedded::CAPABILITIES,
            Self::Kafka => Kafka::CAPABILITIES,
            Self::Sqs => Sqs::CAPABILITIES,
            Self::PubSub => PubSub::CAPABILITIES,
        }
    }

    /// A fresh queue on this broker.
    pub fn fixture(self) -> Fixture {
        match self {
            Self::Redis => Redis::fixture(),
            Self::RedisCluster => RedisCluster::fixture(),
            Self::Amqp => Amqp::fixture(),
            Self::Nats => Nats::fixture(),
            Self::Embedded => Embedded::fixture(),
            Self::Kafka => Kafka::fixture(),
            Self::Sqs => Sqs::fixture(),
            Self::PubSub => PubSub::fixture(),
        }
    }

    /// A producer on `fixture`'s queue with this broker's own client.
    pub async fn producer(self, fixture: &Fixture) -> Producer {
        match self {
            Self::Redis => Redis::producer(fixture).await,
            Self::RedisCluster => RedisCluster::producer(fixture).await,
            Self::Amqp => Amqp::producer(fixture).await,
            Self::Nats => Nats::producer(fixture).await,
            Self::Embedded => Embedded::producer(fixture).await,
            Self::Kafka => Kafka::producer(fixture).await,
            Self::Sqs => Sqs::producer(fixture).await,
            Self::PubSub => PubSub::producer(fixture).await,
        }
    }

    /// `fixture`'s dead letters read with this broker's own client.
    pub async fn read_dead_letters(self, fixture: &Fixture) -> Vec<PlainLetter> {
        match self {
            Self::Redis => Redis::read_dead_letters(fixture).await,
            Self::RedisCluster => RedisCluster::read_dead_letters(fixture).await,
            Self::Amqp => Amqp::read_dead_letters(fixture).await,
            Self::Nats => Nats::read_dead_letters(fixture).await,
            Self::Embedded => Embedded::read_dead_letters(fixture).await,
            Self::Kafka => Kafka::read_dead_letters(fixture).await,
            Self::Sqs => Sqs::read_dead_letters(fixture).await,
            Self::PubSub => PubSub::read_dead_letters(fixture).await,
        }
    }

    /// Whether moving a message to the dead-letter queue and settling the
    /// original is one atomic step on this broker (a Redis MULTI, an
    /// embedded transaction). Where it is two (publish, then ack: RabbitMQ,
    /// NATS), a crash between them leaves a copy behind: at least once.
    pub fn moves_atomically(self) -> bool {
        match self {
            Self::Redis | Self::RedisCluster | Self::Embedded => true,
            Self::Amqp | Self::Nats | Self::Kafka | Self::Sqs | Self::PubSub => false,
        }
    }

    /// Waits until a hand-out made by `handed_out_by` is durable, so a
    /// `kill -9` now does not undo it. Redis, RabbitMQ and NATS record a
    /// hand-out before they return it. The embedded queue keeps hand-outs in
    /// memory and commits them within 20 ms (group commit), and nothing
    /// outside the process can see the commit while courier holds the file:
    /// its guarantee is a time, so this waits out five such windows.
    pub async fn handed_out_durably(self, handed_out_by: std::time::Instant) {
        match self {
            Self::Redis
            | Self::RedisCluster
            | Self::Amqp
            | Self::Nats
            | Self::Kafka
            | Self::Sqs
            | Self::PubSub => {}
            Self::Embedded => {
                tokio::time::sleep_until((handed_out_by + Duration::from_millis(100)).into()).await;
            }
        }
    }

    /// Deletes what a test left of `queue` on the broker at `url`.
    pub async fn clean_up(self, url: &str, queue: &str) {
        match self {
            Self::Redis => Redis::clean_up(url, queue).await,
            Self::RedisCluster => RedisCluster::clean_up(url, queue).await,
            Self::Amqp => Amqp::clean_up(url, queue).await,
            Self::Nats => Nats::clean_up(url, queue).await,
            Self::Embedded => Embedded::clean_up(url, queue).await,
            Self::Kafka => Kafka::clean_up(url, queue).await,
            Self::Sqs => Sqs::clean_up(url, queue).await,
            Self::PubSub => PubSub::clean_up(url, queue).await,
        }
    }
}

/// What the tests need of one broker.
pub trait BrokerFixture {
    /// `courier::source::Broker::name` of this broker.
    const NAME: &'static str;
    /// The capabilities courier's source claims for this broker, written
    /// out flag by flag. The conformance suite fails when the source claims
    /// other ones, and when a scenario is skipped that these allow: a flag
    /// flipped in `src/` cannot quietly stop scenarios on a broker.
    const CAPABILITIES: Capabilities;
    /// Connects (or makes a directory) and names a fresh queue.
    fn fixture() -> Fixture;
    /// A producer that publishes with the broker's own client, as an
    /// application that knows nothing of courier would.
    async fn producer(fixture: &Fixture) -> Producer;
    /// The dead letters of `fixture`'s queue as the broker's own client
    /// reads them, oldest first, leaving them in place.
    async fn read_dead_letters(fixture: &Fixture) -> Vec<PlainLetter>;
    /// Deletes the queue and everything courier made for it.
    async fn clean_up(url: &str, queue: &str);
}

/// A stream entry's field as Redis returns it: name and value, as bytes.
type RawField = (Vec<u8>, Vec<u8>);

pub struct Redis;
pub struct RedisCluster;
pub struct Amqp;
pub struct Nats;
pub struct Embedded;
pub struct Kafka;
pub struct Sqs;
pub struct PubSub;

/// Opens `fixture`'s queue with `--create`, so a plain client can publish
/// to it, and lets go again.
async fn create_queue(fixture: &Fixture) {
    drop(fixture.open().await);
}

impl BrokerFixture for Redis {
    const NAME: &'static str = "redis";
    const CAPABILITIES: Capabilities = Capabilities {
        per_message_delay: true,
        out_of_order_acks: true,
        dead_letter_browsing: true,
        dedup: true,
        byte_bounded_reads: true,
        dead_letter_age: true,
        key_ordering: false,
        shared_rate_limit: true,
        dead_letter_jobs: true,
        exact_replay: true,
        multi_process: true,
    };

    fn fixture() -> Fixture {
        Fixture::with_cleanup(Self::NAME, REDIS_URL, unique("test"))
    }

    async fn producer(fixture: &Fixture) -> Producer {
        let connection = RedisConnection::open(fixture.url.as_str())
            .await
            .expect("connect to Redis");
        Producer::Redis {
            connection,
            queue: fixture.queue.clone(),
        }
    }

    /// `XRANGE <queue>.dlq - +`.
    async fn read_dead_letters(fixture: &Fixture) -> Vec<PlainLetter> {
        redis_dead_letters(fixture.url.as_str(), &fixture.dlq())
            .await
            .expect("XRANGE the dead-letter stream")
    }

    /// The stream, its dead-letter stream, the retry schedule and dedup keys
    /// all start with the queue's name, which is unique to the test.
    async fn clean_up(url: &str, queue: &str) {
        let Ok(mut con) = RedisConnection::open(url).await else {
            return;
        };
        let keys: Vec<String> = ::redis::cmd("KEYS")
            .arg(format!("{queue}*"))
            .query_async(&mut con)
            .await
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: Result<i64, _> = ::redis::cmd("DEL").arg(keys).query_async(&mut con).await;
        }
    }
}

/// The Redis Cluster `scripts/services` starts, reached through a node that
/// does not own the queue's hash slot: every command courier sends for the
/// queue is redirected (MOVED) to another node.
impl BrokerFixture for RedisCluster {
    const NAME: &'static str = "redis";
    const CAPABILITIES: Capabilities = Capabilities {
        per_message_delay: true,
        out_of_order_acks: true,
        dead_letter_browsing: true,
        dedup: true,
        byte_bounded_reads: true,
        dead_letter_age: true,
        key_ordering: false,
        shared_rate_limit: true,
        dead_letter_jobs: true,
        exact_replay: true,
        multi_process: true,
    };

    fn fixture() -> Fixture {
        Fixture::with_cleanup(Self::NAME, REDIS_CLUSTER_URL, queue_on_another_node())
    }

    async fn producer(fixture: &Fixture) -> Producer {
        Redis::producer(fixture).await
    }

    async fn read_dead_letters(fixture: &Fixture) -> Vec<PlainLetter> {
        Redis::read_dead_letters(fixture).await
    }

    /// The queue's keys share its hash slot, so one node holds them all.
    async fn clean_up(url: &str, queue: &str) {
        Redis::clean_up(url, queue).await
    }
}

/// `XRANGE <dlq> - +` on the Redis (or Redis Cluster) at `url`.
pub async fn redis_dead_letters(url: &str, dlq: &str) -> ::redis::RedisResult<Vec<PlainLetter>> {
    let mut con = RedisConnection::open(url).await?;
    let entries: Vec<(String, Vec<RawField>)> = ::redis::cmd("XRANGE")
        .arg(dlq)
        .arg("-")
        .arg("+")
        .query_async(&mut con)
        .await?;
    Ok(entries
        .into_iter()
        .map(|(_, fields)| {
            let mut letter = PlainLetter::default();
            for (name, value) in fields {
                let name = String::from_utf8_lossy(&name).into_owned();
                if name == courier::model::PAYLOAD {
                    letter.body = value.into();
                } else {
                    letter
                        .fields
                        .push((name, String::from_utf8_lossy(&value).into_owned()));
                }
            }
            letter
        })
        .collect())
}

/// A hash-tagged queue name (a cluster refuses one without a tag) whose slot
/// the node at [`REDIS_CLUSTER_URL`] does not own: that node answers MOVED
/// when asked about it.
pub fn queue_on_another_node() -> String {
    let node = format!("redis://127.0.0.1:{REDIS_CLUSTER_PORT}");
    let mut con = ::redis::Client::open(node.as_str())
        .and_then(|client| client.get_connection())
        .unwrap_or_else(|e| {
            panic!("connect to the Redis Cluster node at {node} (scripts/services starts it): {e}")
        });
    loop {
        let queue = format!("{{{}}}", unique("test"));
        match ::redis::cmd("TYPE").arg(&queue).query::<String>(&mut con) {
            Ok(_) => continue,
            Err(e) if e.code() == Some("MOVED") => return queue,
            Err(e) => panic!("TYPE {queue} on {node}: {e}"),
        }
    }
}

/// A plain redis-rs connection to one server or to a Redis Cluster, as an
/// application would open one.
#[derive(Clone)]
pub enum RedisConnection {
    Node(::redis::aio::MultiplexedConnection),
    Cluster(::redis::cluster_async::ClusterConnection),
}

impl RedisConnection {
    /// `redis://…`, or `redis+cluster://host:port[,host:port]`.
    pub async fn open(url: &str) -> ::redis::RedisResult<Self> {
        match url.strip_prefix("redis+cluster://") {
            Some(hosts) => {
                let nodes = hosts
                    .trim_end_matches('/')
                    .split(',')
                    .map(|host| format!("redis://{host}"));
                let client = ::redis::cluster::ClusterClient::new(nodes)?;
                Ok(Self::Cluster(client.get_async_connection().await?))
            }
            None => Ok(Self::Node(super::redis_connection(url).await?)),
        }
    }
}

impl ::redis::aio::ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a ::redis::Cmd,
    ) -> ::redis::RedisFuture<'a, ::redis::Value> {
        match self {
            Self::Node(con) => con.req_packed_command(cmd),
            Self::Cluster(con) => con.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a ::redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> ::redis::RedisFuture<'a, Vec<::redis::Value>> {
        match self {
            Self::Node(con) => con.req_packed_commands(pipeline, offset, count),
            Self::Cluster(con) => con.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Node(con) => con.get_db(),
            Self::Cluster(con) => con.get_db(),
        }
    }
}

impl BrokerFixture for Amqp {
    const NAME: &'static str = "amqp";
    const CAPABILITIES: Capabilities = Capabilities {
        per_message_delay: false,
        out_of_order_acks: true,
        dead_letter_browsing: true,
        dedup: false,
        byte_bounded_reads: false,
        dead_letter_age: false,
        key_ordering: false,
        shared_rate_limit: false,
        dead_letter_jobs: true,
        // In a transaction a full quorum queue drops a refused copy while
        // the commit acks the letter: confirm first, ack second.
        exact_replay: false,
        multi_process: true,
    };

    fn fixture() -> Fixture {
        Fixture::with_cleanup(Self::NAME, AMQP_URL, unique("test"))
    }

    async fn producer(fixture: &Fixture) -> Producer {
        use lapin::options::ConfirmSelectOptions;
        create_queue(fixture).await;
        let connection = lapin::Connection::connect(fixture.url.as_str(), Default::default())
            .await
            .expect("connect to RabbitMQ");
        let channel = connection.create_channel().await.expect("open a channel");
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("publisher confirms");
        Producer::Amqp {
            connection,
            channel,
            queue: fixture.queue.clone(),
        }
    }

    /// `basic.get` without acking until the queue is empty; closing the
    /// channel puts every one back.
    async fn read_dead_letters(fixture: &Fixture) -> Vec<PlainLetter> {
        use lapin::options::BasicGetOptions;
        use lapin::types::AMQPValue;
        let connection = lapin::Connection::connect(fixture.url.as_str(), Default::default())
            .await
            .expect("connect to RabbitMQ");
        let channel = connection.create_channel().await.expect("open a channel");
        let mut letters = Vec::new();
        while let Some(got) = channel
            .basic_get(
                fixture.dlq().as_str().into(),
                BasicGetOptions { no_ack: false },
            )
            .await
            .expect("basic.get from the dead-letter queue")
        {
            let delivery = got.delivery;
            let mut letter = PlainLetter {
                body: delivery.data.clone().into(),
                fields: Vec::new(),
            };
            if let Some(ct) = delivery.properties.content_type() {
                letter.fields.push(("content-type".into(), ct.to_string()));
            }
            if let Some(headers) = delivery.properties.headers() {
                for (name, value) in headers.inner() {
                    let value = match value {
                        AMQPValue::LongString(v) => {
                            String::from_utf8_lossy(v.as_bytes()).into_owned()
                        }
                        AMQPValue::ShortString(v) => v.to_string(),
                        other => format!("{other:?}"),
                    };
                    letter.fields.push((name.to_string(), value));
                }
            }
            letters.push(letter);
        }
        let _ = channel.close(200, "read, put back".into()).await;
        let _ = connection.close(200, "done".into()).await;
        letters
    }

    async fn clean_up(url: &str, queue: &str) {
        use lapin::options::QueueDeleteOptions;
        let Ok(connection) = lapin::Connection::connect(url, Default::default()).await else {
            return;
        };
        let Ok(channel) = connection.create_channel().await else {
            return;
        };
        let mut names = vec![
            queue.to_string(),
            format!("{queue}.dlq"),
            format!("{queue}.dlq.courier-jobs"),
            format!("{queue}.dlq.courier-jobs.lock"),
        ];
        for tier in [
            "10ms", "20ms", "50ms", "100ms", "200ms", "500ms", "1s", "2s", "4s", "8s", "15s",
            "30s", "1m", "2m", "4m", "8m", "15m", "30m", "1h", "2h", "4h", "8h", "12h", "24h",
        ] {
            names.push(format!("{queue}.retry.{tier}"));
        }
        for name in names {
            let _ = channel
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
        let _ = connection.close(200, "test done".into()).await;
    }
}

impl BrokerFixture for Nats {
    const NAME: &'static str = "nats";
    const CAPABILITIES: Capabilities = Capabilities {
        per_message_delay: true,
        out_of_order_acks: true,
        dead_letter_browsing: true,
        dedup: false,
        byte_bounded_reads: true,
        dead_letter_age: true,
        key_ordering: false,
        shared_rate_limit: false,
        dead_letter_jobs: true,
        exact_replay: true,
        multi_process: true,
    };

    fn fixture() -> Fixture {
        Fixture::with_cleanup(Self::NAME, NATS_URL, unique("test"))
    }

    async fn producer(fixture: &Fixture) -> Producer {
        create_queue(fixture).await;
        let client = async_nats::connect(fixture.url.as_str())
            .await
            .expect("connect to NATS");
        Producer::Nats {
            js: async_nats::jetstream::new(client),
            subject: fixture.queue.clone(),
        }
    }

    /// Every message of the `<queue>_dlq` stream, by sequence.
    async fn read_dead_letters(fixture: &Fixture) -> Vec<PlainLetter> {
        let client = async_nats::connect(fixture.url.as_str())
            .await
            .expect("connect to NATS");
        let js = async_nats::jetstream::new(client);
        let Ok(mut stream) = js.get_stream(format!("{}_dlq", fixture.queue)).await else {
            return Vec::new();
        };
        let info = stream.info().await.expect("the dead-letter stream's info");
        let (first, last) = (info.state.first_sequence, info.state.last_sequence);
        let mut letters = Vec::new();
        for sequence in first..=last {
            let Ok(message) = stream.get_raw_message(sequence).await else {
                continue;
            };
            let mut letter = PlainLetter {
                body: message.payload.clone(),
                fields: Vec::new(),
            };
            for (name, values) in message.headers.iter() {
                for value in values {
                    letter.fields.push((name.to_string(), value.to_string()));
                }
            }
            letters.push(letter);
        }
        letters
    }

    async fn clean_up(url: &str, queue: &str) {
        let Ok(client) = async_nats::connect(url).await else {
            return;
        };
        let js = async_nats::jetstream::new(client);
        let _ = js.delete_stream(queue).await;
        let _ = js.delete_stream(format!("{queue}_dlq")).await;
        // The `courier dlq` job records of the queue, in the bucket every
        // queue shares.
        if let Ok(jobs) = js.get_stream_no_info("KV_courier-jobs").await {
            let _ = jobs
                .purge()
                .filter(format!("$KV.courier-jobs.{queue}_dlq.*"))
                .await;
        }
    }
}

impl BrokerFixture for Embedded {
    const NAME: &'static str = "embedded";
    const CAPABILITIES: Capabilities = Capabilities {
        per_message_delay: true,
        out_of_order_acks: true,
        dead_letter_browsing: true,
        dedup: true,
        byte_bounded_reads: true,
        dead_letter_age: true,
        key_ordering: false,
        shared_rate_limit: false,
        dead_letter_jobs: true,
        exact_replay: true,
        multi_process: false,
    };

    fn fixture() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        Fixture::in_dir(dir)
    }

    /// The embedded queue has no client but courier: `Source::send`.
    async fn producer(fixture: &Fixture) -> Producer {
        Producer::Embedded(fixture.open().await)
    }

    /// No client but courier's: `Source::dead_letters`.
    async fn read_dead_letters(fixture: &Fixture) -> Vec<PlainLetter> {
        let source = fixture.open().await;
        fixture
            .dead_letters(&source)
            .await
            .into_iter()
            .map(|letter| PlainLetter {
                body: letter.body.clone(),
                fields: letter.fields.clone(),
            })
            .collect()
    }

    /// The queue lives in the fixture's temporary directory, deleted with
    /// it; there is nothing on a server.
    async fn clean_up(_url: &str, _queue: &str) {}
}

/// The mock cluster this test binary shares (`kafka-mock`), fed and read
/// with the plain rdkafka clients.
impl BrokerFixture for Kafka {
    const NAME: &'static str = "kafka";
    const CAPABILITIES: Capabilities = Capabilities {
        per_message_delay: true,
        out_of_order_acks: true,
        dead_letter_browsing: true,
        dedup: false,
        byte_bounded_reads: false,
        dead_letter_age: false,
        key_ordering: true,
        shared_rate_limit: false,
        dead_letter_jobs: true,
        // A transaction would make it exact, but the mock does not apply
        // one, and its commit markers would read as depth (docs/sources.md).
        exact_replay: false,
        multi_process: true,
    };

    fn fixture() -> Fixture {
        Fixture::with_cleanup(Self::NAME, &super::shared_kafka().url(), unique("test"))
    }

    async fn producer(fixture: &Fixture) -> Producer {
        create_queue(fixture).await;
        let producer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", kafka_bootstrap(fixture))
            .set("acks", "all")
            .create()
            .expect("an rdkafka producer");
        Producer::Kafka {
            producer,
            topic: fixture.queue.clone(),
        }
    }

    /// Every record of the dead-letter topic, partition by partition.
    async fn read_dead_letters(fixture: &Fixture) -> Vec<PlainLetter> {
        let records = kafka_records(&kafka_bootstrap(fixture), &fixture.dlq()).await;
        records
            .into_iter()
            .map(|record| {
                use rdkafka::message::{Headers, Message};
                let mut letter = PlainLetter {
                    body: Bytes::copy_from_slice(record.payload().unwrap_or_default()),
                    fields: Vec::new(),
                };
                if let Some(headers) = record.headers() {
                    for h in headers.iter() {
                        letter.fields.push((
                            h.key.to_string(),
                            String::from_utf8_lossy(h.value.unwrap_or_default()).into_owned(),
                        ));
                    }
                }
                letter
            })
            .collect()
    }

    /// The mock cluster lives in memory and ends with the test binary;
    /// every test's topics have names of their own.
    async fn clean_up(_url: &str, _queue: &str) {}
}

/// The moto server this test binary shares (`scripts/moto-server`), fed
/// and read with the plain aws-sdk-sqs client.
impl BrokerFixture for Sqs {
    const NAME: &'static str = "sqs";
    const CAPABILITIES: Capabilities = Capabilities {
        per_message_delay: true,
        out_of_order_acks: true,
        dead_letter_browsing: true,
        dedup: false,
        byte_bounded_reads: false,
        dead_letter_age: false,
        key_ordering: false,
        shared_rate_limit: false,
        dead_letter_jobs: true,
        exact_replay: false,
        multi_process: true,
    };

    fn fixture() -> Fixture {
        Fixture::with_cleanup(Self::NAME, &super::sqs_url(), unique("test"))
    }

    async fn producer(fixture: &Fixture) -> Producer {
        create_queue(fixture).await;
        let client = super::sqs_client().await;
        let url = super::sqs_queue_url(&client, &fixture.queue)
            .await
            .expect("the queue exists");
        Producer::Sqs {
            client,
            url,
            fifo: fixture.queue.ends_with(".fifo"),
        }
    }

    /// Every message of `<queue>-dlq`, received and given back, with
    /// courier's record (the attribute `courier-record`, a JSON object)
    /// and packed headers (`courier-headers`, JSON pairs) read as fields.
    async fn read_dead_letters(fixture: &Fixture) -> Vec<PlainLetter> {
        let client = super::sqs_client().await;
        let name = courier::source::sqs::dead_letter_queue_name(&fixture.dlq());
        let Some(url) = super::sqs_queue_url(&client, &name).await else {
            return Vec::new();
        };
        sqs_messages(&client, &url)
            .await
            .iter()
            .map(sqs_plain_letter)
            .collect()
    }

    async fn clean_up(_url: &str, queue: &str) {
        let client = super::sqs_client().await;
        for name in [
            queue.to_string(),
            courier::source::sqs::dead_letter_queue_name(&format!("{queue}.dlq")),
            courier::source::sqs::jobs_queue_name(&format!("{queue}.dlq")),
        ] {
            if let Some(url) = super::sqs_queue_url(&client, &name).await {
                let _ = client.delete_queue().queue_url(url).send().await;
            }
        }
    }
}

/// The Pub/Sub emulator this test binary shares, fed and read with the
/// plain gRPC client. The subscription is made by that client, as an
/// operator would, with a dead-letter policy (100 delivery attempts) to
/// `<queue>.dlq`, so that Pub/Sub counts deliveries.
impl BrokerFixture for PubSub {
    const NAME: &'static str = "pubsub";
    const CAPABILITIES: Capabilities = Capabilities {
        per_message_delay: true,
        out_of_order_acks: true,
        dead_letter_browsing: true,
        dedup: false,
        byte_bounded_reads: false,
        dead_letter_age: true,
        key_ordering: false,
        shared_rate_limit: false,
        dead_letter_jobs: true,
        exact_replay: false,
        multi_process: true,
    };

    fn fixture() -> Fixture {
        let fixture = Fixture::with_cleanup(Self::NAME, &super::pubsub_url(), unique("test"));
        let queue = fixture.queue.clone();
        // A runtime of its own: fixtures are made outside and inside
        // runtimes alike.
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(super::create_pubsub_subscription(&queue, Some(100)))
        })
        .join()
        .expect("create the subscription");
        fixture
    }

    async fn producer(fixture: &Fixture) -> Producer {
        let (publisher, _) = super::pubsub_clients().await;
        Producer::PubSub {
            publisher,
            topic: super::pubsub_topic(&fixture.queue),
        }
    }

    /// Every message of the browsing subscription `<queue>.dlq` (courier's
    /// reader of the dead-letter topic), pulled and given back; the
    /// attributes are the fields.
    async fn read_dead_letters(fixture: &Fixture) -> Vec<PlainLetter> {
        pubsub_messages(&super::pubsub_subscription(&fixture.dlq()))
            .await
            .iter()
            .map(|m| {
                let mut names: Vec<&String> = m.attributes.keys().collect();
                names.sort();
                PlainLetter {
                    body: m.data.clone(),
                    fields: names
                        .into_iter()
                        .map(|n| (n.clone(), m.attributes[n].clone()))
                        .collect(),
                }
            })
            .collect()
    }

    /// The emulator lives in memory and ends with the test binary; every
    /// test's subscriptions have names of their own.
    async fn clean_up(_url: &str, _queue: &str) {}
}

/// Every message of the Pub/Sub subscription `name` (a full name), oldest
/// first: pulled with the plain client (each once, leased meanwhile) and
/// given back. Empty when the subscription does not exist.
pub async fn pubsub_messages(
    name: &str,
) -> Vec<googleapis_tonic_google_pubsub_v1::google::pubsub::v1::PubsubMessage> {
    use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
        ModifyAckDeadlineRequest, PullRequest,
    };
    let (_, mut subscriber) = super::pubsub_clients().await;
    let mut out = Vec::new();
    let mut ack_ids = Vec::new();
    loop {
        #[allow(deprecated)]
        let request = PullRequest {
            subscription: name.to_string(),
            return_immediately: true,
            max_messages: 1000,
        };
        let Ok(got) = subscriber.pull(request).await else {
            break;
        };
        let got = got.into_inner().received_messages;
        if got.is_empty() {
            break;
        }
        for received in got {
            ack_ids.push(received.ack_id);
            out.extend(received.message);
        }
    }
    if !ack_ids.is_empty() {
        let _ = subscriber
            .modify_ack_deadline(ModifyAckDeadlineRequest {
                subscription: name.to_string(),
                ack_ids,
                ack_deadline_seconds: 0,
            })
            .await;
    }
    out.sort_by_key(|m| m.publish_time.map(|t| (t.seconds, t.nanos)));
    out
}

/// Every message of the SQS queue at `url`, oldest first: received (each
/// once, invisible meanwhile) and given back.
pub async fn sqs_messages(
    client: &aws_sdk_sqs::Client,
    url: &str,
) -> Vec<aws_sdk_sqs::types::Message> {
    use aws_sdk_sqs::types::MessageSystemAttributeName;
    let mut out: Vec<aws_sdk_sqs::types::Message> = Vec::new();
    loop {
        let got = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(10)
            .visibility_timeout(20)
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .message_attribute_names("All")
            .send()
            .await
            .expect("receive from SQS")
            .messages
            .unwrap_or_default();
        if got.is_empty() {
            break;
        }
        out.extend(got);
    }
    for message in &out {
        let _ = client
            .change_message_visibility()
            .queue_url(url)
            .receipt_handle(message.receipt_handle().unwrap_or_default())
            .visibility_timeout(0)
            .send()
            .await;
    }
    out.sort_by_key(|m| {
        m.attributes()
            .and_then(|a| a.get(&MessageSystemAttributeName::SentTimestamp))
            .and_then(|t| t.parse::<u64>().ok())
    });
    out
}

/// An SQS message as fields, read by the documented format.
pub fn sqs_plain_letter(message: &aws_sdk_sqs::types::Message) -> PlainLetter {
    use base64::Engine;
    let attributes = message.message_attributes().cloned().unwrap_or_default();
    let text = |name: &str| attributes.get(name).and_then(|v| v.string_value());
    let body = message.body().unwrap_or_default();
    let body = if text("content-transfer-encoding") == Some("base64") {
        Bytes::from(
            base64::engine::general_purpose::STANDARD
                .decode(body)
                .expect("base64"),
        )
    } else {
        Bytes::copy_from_slice(body.as_bytes())
    };
    let mut letter = PlainLetter {
        body,
        fields: Vec::new(),
    };
    let mut names: Vec<_> = attributes.keys().collect();
    names.sort();
    for name in names {
        if [
            "courier-record",
            "courier-headers",
            "content-transfer-encoding",
        ]
        .contains(&name.as_str())
        {
            continue;
        }
        let value = attributes[name].string_value().unwrap_or_default();
        letter.fields.push((name.clone(), value.to_string()));
    }
    if let Some(pairs) = text("courier-headers") {
        let pairs: Vec<(String, String)> = serde_json::from_str(pairs).expect("JSON pairs");
        letter.fields.extend(pairs);
    }
    if let Some(record) = text("courier-record") {
        let record: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(record).expect("a JSON object");
        for (name, value) in record {
            letter
                .fields
                .push((name, value.as_str().unwrap_or_default().to_string()));
        }
    }
    letter
}

/// The bootstrap servers of a Kafka fixture's URL.
pub fn kafka_bootstrap(fixture: &Fixture) -> String {
    fixture
        .url
        .as_str()
        .strip_prefix("kafka://")
        .expect("a kafka:// URL")
        .to_string()
}

/// Every record of `topic`, as a plain rdkafka consumer outside any group
/// reads it from the oldest to the end.
pub async fn kafka_records(bootstrap: &str, topic: &str) -> Vec<rdkafka::message::OwnedMessage> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Message;
    let (bootstrap, topic) = (bootstrap.to_string(), topic.to_string());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", "test-reader")
            .set("enable.auto.commit", "false")
            .create()
            .expect("an rdkafka consumer");
        let timeout = Duration::from_secs(10);
        let metadata = consumer
            .fetch_metadata(Some(&topic), timeout)
            .expect("topic metadata");
        let mut wanted = rdkafka::TopicPartitionList::new();
        let mut ends = Vec::new();
        for t in metadata.topics().iter().filter(|t| t.error().is_none()) {
            for p in t.partitions() {
                let (low, high) = consumer
                    .fetch_watermarks(&topic, p.id(), timeout)
                    .expect("watermarks");
                if high > low {
                    wanted
                        .add_partition_offset(&topic, p.id(), rdkafka::Offset::Offset(low))
                        .unwrap();
                    ends.push((p.id(), high));
                }
            }
        }
        let mut records = Vec::new();
        if ends.is_empty() {
            return records;
        }
        consumer.assign(&wanted).expect("assign");
        let deadline = std::time::Instant::now() + timeout;
        while !ends.is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "reading {topic} took too long"
            );
            let Some(got) = consumer.poll(Duration::from_millis(100)) else {
                continue;
            };
            let record = got.expect("a record").detach();
            if let Some(at) = ends.iter().position(|(p, _)| *p == record.partition()) {
                if record.offset() + 1 >= ends[at].1 {
                    ends.swap_remove(at);
                }
                records.push(record);
            }
        }
        records
    })
    .await
    .unwrap()
}

/// A dead letter as the broker's own client shows it: the body, and every
/// other field or header by name.
#[derive(Debug, Clone, Default)]
pub struct PlainLetter {
    pub body: Bytes,
    pub fields: Vec<(String, String)>,
}

impl PlainLetter {
    /// The value of the field `name` (any case).
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Publishes to one queue the way an application would, with the broker's
/// own client; `send` returns the id courier reports as
/// `courier-message-id`.
pub enum Producer {
    Redis {
        connection: RedisConnection,
        queue: String,
    },
    Amqp {
        connection: lapin::Connection,
        channel: lapin::Channel,
        queue: String,
    },
    Nats {
        js: async_nats::jetstream::Context,
        subject: String,
    },
    Embedded(Arc<dyn Source>),
    Kafka {
        producer: rdkafka::producer::FutureProducer,
        topic: String,
    },
    Sqs {
        client: aws_sdk_sqs::Client,
        url: String,
        fifo: bool,
    },
    PubSub {
        publisher: googleapis_tonic_google_pubsub_v1::google::pubsub::v1::publisher_client::PublisherClient<
            tonic::transport::Channel,
        >,
        topic: String,
    },
}

impl Producer {
    /// Whether this broker's client can publish a header `name: value` at
    /// all (NATS headers cannot hold CR or LF, nor spaces in names).
    pub fn carries(&self, name: &str, value: &str) -> bool {
        match self {
            Self::Redis { .. } | Self::Embedded(_) | Self::Kafka { .. } => true,
            // A message attribute each, as SQS takes them.
            Self::Sqs { .. } => {
                courier::source::sqs::attribute_name_ok(name)
                    && !value.is_empty()
                    && courier::source::sqs::is_sqs_text(value)
            }
            Self::Amqp { .. } => name.len() <= 255,
            // An attribute each, as Pub/Sub takes them.
            Self::PubSub { .. } => courier::source::pubsub::attribute_ok(name, value),
            Self::Nats { .. } => {
                name.parse::<async_nats::HeaderName>().is_ok()
                    && value.parse::<async_nats::HeaderValue>().is_ok()
            }
        }
    }

    /// Publishes `body` with `headers` and waits until the broker has it;
    /// panics if a header cannot be carried (ask [`Producer::carries`]).
    pub async fn send(&self, body: impl Into<Bytes>, headers: &[(String, String)]) -> String {
        let body = body.into();
        for (name, value) in headers {
            assert!(
                self.carries(name, value),
                "this broker's client cannot publish the header {name:?}: {value:?}"
            );
        }
        match self {
            Self::Redis { connection, queue } => {
                let mut xadd = ::redis::cmd("XADD");
                xadd.arg(queue)
                    .arg("*")
                    .arg(courier::model::PAYLOAD)
                    .arg(body.as_ref());
                for (name, value) in headers {
                    xadd.arg(name).arg(value);
                }
                xadd.query_async(&mut connection.clone())
                    .await
                    .expect("XADD")
            }
            Self::Amqp { channel, queue, .. } => {
                use lapin::options::BasicPublishOptions;
                use lapin::types::{AMQPValue, FieldTable};
                let id = format!("{:032x}", rand::random::<u128>());
                let mut properties = lapin::BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(id.as_str().into());
                let mut table = FieldTable::default();
                for (name, value) in headers {
                    if name.eq_ignore_ascii_case("content-type") {
                        properties = properties.with_content_type(value.as_str().into());
                    } else {
                        table.insert(
                            name.as_str().into(),
                            AMQPValue::LongString(value.as_str().into()),
                        );
                    }
                }
                channel
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        BasicPublishOptions::default(),
                        &body,
                        properties.with_headers(table),
                    )
                    .await
                    .expect("publish")
                    .await
                    .expect("the broker confirms the publish");
                id
            }
            Self::Nats { js, subject } => {
                let mut map = async_nats::HeaderMap::new();
                for (name, value) in headers {
                    map.append(name.as_str(), value.as_str());
                }
                js.publish_with_headers(subject.clone(), map, body)
                    .await
                    .expect("publish")
                    .await
                    .expect("JetStream stores the message")
                    .sequence
                    .to_string()
            }
            Self::Embedded(source) => source.send(body, headers).await.expect("send"),
            Self::Kafka { producer, topic } => {
                use rdkafka::message::{Header, OwnedHeaders};
                let mut kafka_headers = OwnedHeaders::new();
                for (name, value) in headers {
                    kafka_headers = kafka_headers.insert(Header {
                        key: name.as_str(),
                        value: Some(value.as_str()),
                    });
                }
                let record = rdkafka::producer::FutureRecord::<(), [u8]>::to(topic)
                    .payload(body.as_ref())
                    .headers(kafka_headers);
                let delivered = producer
                    .send(record, Duration::from_secs(10))
                    .await
                    .map_err(|(e, _)| e)
                    .expect("Kafka stores the record");
                format!("{}-{}", delivered.partition, delivered.offset)
            }
            Self::Sqs { client, url, fifo } => {
                use aws_sdk_sqs::types::MessageAttributeValue;
                use base64::Engine;
                let attribute = |value: &str| {
                    MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(value)
                        .build()
                        .unwrap()
                };
                let text = std::str::from_utf8(&body)
                    .ok()
                    .filter(|t| !t.is_empty() && courier::source::sqs::is_sqs_text(t));
                let mut request = client.send_message().queue_url(url);
                request = match text {
                    Some(text) => request.message_body(text),
                    // What SQS cannot carry goes base64, and says so.
                    None => request
                        .message_body(base64::engine::general_purpose::STANDARD.encode(&body))
                        .message_attributes("content-transfer-encoding", attribute("base64")),
                };
                for (name, value) in headers {
                    request = request.message_attributes(name, attribute(value));
                }
                if *fifo {
                    let group = headers
                        .iter()
                        .find(|(n, _)| n == "group")
                        .map_or("g", |(_, v)| v.as_str());
                    request = request
                        .message_group_id(group)
                        .message_deduplication_id(format!("{:032x}", rand::random::<u128>()));
                }
                request
                    .send()
                    .await
                    .expect("SQS takes the message")
                    .message_id()
                    .unwrap_or_default()
                    .to_string()
            }
            Self::PubSub { publisher, topic } => {
                use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
                    PublishRequest, PubsubMessage,
                };
                let message = PubsubMessage {
                    data: body,
                    attributes: headers.iter().cloned().collect(),
                    ..PubsubMessage::default()
                };
                publisher
                    .clone()
                    .publish(PublishRequest {
                        topic: topic.clone(),
                        messages: vec![message],
                    })
                    .await
                    .expect("Pub/Sub takes the message")
                    .into_inner()
                    .message_ids
                    .remove(0)
            }
        }
    }

    /// Lets go of the queue; for the embedded queue, waits until another
    /// process may open it.
    pub async fn release(self, fixture: &Fixture) {
        match self {
            Self::Embedded(source) => super::release(fixture, source).await,
            Self::Amqp { connection, .. } => {
                let _ = connection.close(200, "producer done".into()).await;
            }
            Self::Redis { .. }
            | Self::Nats { .. }
            | Self::Kafka { .. }
            | Self::Sqs { .. }
            | Self::PubSub { .. } => {}
        }
    }
}

/// Deletes what a broker fixture left when the last clone of it goes.
#[derive(Debug)]
pub struct BrokerCleanup {
    pub(super) kind: BrokerKind,
    pub(super) url: String,
    pub(super) queue: String,
}

impl Drop for BrokerCleanup {
    fn drop(&mut self) {
        let (kind, url, queue) = (self.kind, self.url.clone(), self.queue.clone());
        // A runtime of its own: drops also happen outside any runtime.
        let done = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let _ = tokio::time::timeout(Duration::from_secs(10), kind.clean_up(&url, &queue))
                    .await;
            });
        });
        let _ = done.join();
    }
}

/// Declares `queue` on the shared RabbitMQ as a quorum queue with an
/// argument courier does not set itself, as an operator might.
pub async fn declare_amqp_quorum(queue: &str) {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::{AMQPValue, FieldTable};
    let connection = lapin::Connection::connect(AMQP_URL, Default::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(10_000));
    channel
        .queue_declare(queue.into(), QueueDeclareOptions::durable(), args)
        .await
        .unwrap();
    let _ = connection.close(200, "declared".into()).await;
}

/// RabbitMQ's own count of `queue` at `url` once no consumer is on it:
/// what a stopped courier left unacked is then requeued and counted with
/// the ready messages, which a passive declare reports (courier's `depth`
/// can only add what this process holds to that). Waits for the consumers
/// to go; returns the message count.
pub async fn amqp_count_without_consumers(url: &str, queue: &str) -> u32 {
    use lapin::options::QueueDeclareOptions;
    let connection = lapin::Connection::connect(url, Default::default())
        .await
        .expect("connect to RabbitMQ");
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let mut count = None;
    super::wait_for(
        &format!("no consumer left on {queue}"),
        Duration::from_secs(30),
        async || {
            let channel = connection.create_channel().await.expect("open a channel");
            let declared = channel
                .queue_declare(queue.into(), passive, Default::default())
                .await
                .expect("a passive declare of the queue");
            let _ = channel.close(200, "counted".into()).await;
            count = Some(declared.message_count());
            declared.consumer_count() == 0
        },
    )
    .await;
    let _ = connection.close(200, "counted".into()).await;
    count.unwrap()
}
