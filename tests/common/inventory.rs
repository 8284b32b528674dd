//! What a broker holds for one queue, read with the broker's own client:
//! the names of the streams, keys, groups, queues, topics, subscriptions,
//! committed offsets, seal keys or files that exist for it. The read-only
//! commands must leave it as they found it, and `courier send` may add the
//! work queue alone.

use std::collections::BTreeSet;

use std::time::Duration;

use super::{
    BrokerKind, Fixture, PUBSUB_PROJECT, RedisConnection, kafka_bootstrap, kafka_records,
    pubsub_clients, sqs_client,
};

/// Everything of `fixture`'s queue that exists on its broker now, as
/// `kind:name` strings (`stream:q`, `group:q/courier`, `key:q.courier-key`).
pub async fn inventory(fixture: &Fixture) -> BTreeSet<String> {
    match fixture.broker {
        BrokerKind::Redis | BrokerKind::RedisCluster => redis(fixture).await,
        BrokerKind::Amqp => amqp(fixture).await,
        BrokerKind::Nats => nats(fixture).await,
        BrokerKind::Embedded => embedded(fixture),
        BrokerKind::Kafka => kafka(fixture).await,
        BrokerKind::Sqs => sqs(fixture).await,
        BrokerKind::PubSub => pubsub(fixture).await,
    }
}

/// The item [`inventory`] shows for the work queue itself, which a send
/// may create.
pub fn work_queue_item(fixture: &Fixture) -> String {
    match fixture.broker {
        BrokerKind::Redis | BrokerKind::RedisCluster => format!("stream:{}", fixture.queue),
        BrokerKind::Amqp => format!("queue:{}", fixture.queue),
        BrokerKind::Nats => format!("stream:{}", fixture.queue),
        BrokerKind::Embedded => format!("table:ready/{}", fixture.queue),
        BrokerKind::Kafka => format!("topic:{}", fixture.queue),
        BrokerKind::Sqs => format!("queue:{}", fixture.queue),
        BrokerKind::PubSub => format!("subscription:{}", fixture.queue),
    }
}

/// Every key courier derives from the queue name (they share its hash
/// slot, so this works on a Redis Cluster, where KEYS sees one node), and
/// the groups of the streams among them.
async fn redis(fixture: &Fixture) -> BTreeSet<String> {
    let url = fixture.source_arg();
    let mut con = RedisConnection::open(&url).await.expect("connect to Redis");
    let q = &fixture.queue;
    let mut found = BTreeSet::new();
    for key in [
        q.clone(),
        format!("{q}.retry"),
        format!("{q}.dlq"),
        format!("{q}.courier-key"),
    ] {
        let kind: String = ::redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut con)
            .await
            .expect("TYPE");
        match kind.as_str() {
            "none" => {}
            "stream" => {
                found.insert(format!("stream:{key}"));
                let groups: Vec<::redis::Value> = ::redis::cmd("XINFO")
                    .arg("GROUPS")
                    .arg(&key)
                    .query_async(&mut con)
                    .await
                    .expect("XINFO GROUPS");
                for group in groups {
                    let name = group_name(&group).expect("a group's name");
                    found.insert(format!("group:{key}/{name}"));
                }
            }
            other => {
                found.insert(format!("{other}:{key}"));
            }
        }
    }
    found
}

/// The delay tiers courier declares for a RabbitMQ work queue
/// (`crates/amqp/src/tiers.rs`), as their queue names end.
const AMQP_TIERS: [&str; 24] = [
    "10ms", "20ms", "50ms", "100ms", "200ms", "500ms", "1s", "2s", "4s", "8s", "15s", "30s", "1m",
    "2m", "4m", "8m", "15m", "30m", "1h", "2h", "4h", "8h", "12h", "24h",
];

/// A passive declare of every queue courier derives from the queue name
/// (the queue, `.dlq`, each `.retry.<tier>`, `.courier-key`), with the
/// number of consumers on each; one that is missing closes its channel,
/// so each declare has a channel of its own.
async fn amqp(fixture: &Fixture) -> BTreeSet<String> {
    use lapin::options::QueueDeclareOptions;
    let connection = lapin::Connection::connect(fixture.url.as_str(), Default::default())
        .await
        .expect("connect to RabbitMQ");
    let q = &fixture.queue;
    let mut names = vec![q.clone(), format!("{q}.dlq"), format!("{q}.courier-key")];
    names.extend(AMQP_TIERS.iter().map(|tier| format!("{q}.retry.{tier}")));
    let mut found = BTreeSet::new();
    for name in names {
        let channel = connection.create_channel().await.expect("open a channel");
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        if let Ok(queue) = channel
            .queue_declare(name.as_str().into(), passive, Default::default())
            .await
        {
            found.insert(format!("queue:{name}"));
            if queue.consumer_count() > 0 {
                found.insert(format!("consumers:{name}/{}", queue.consumer_count()));
            }
            let _ = channel.close(200, "looked".into()).await;
        }
    }
    let _ = connection.close(200, "done".into()).await;
    found
}

/// The work stream and the dead-letter stream (`<queue>_dlq`) with their
/// consumers, and the queue's key in the seal bucket `courier-seal-keys`.
async fn nats(fixture: &Fixture) -> BTreeSet<String> {
    use futures::TryStreamExt;
    let client = async_nats::connect(fixture.url.as_str())
        .await
        .expect("connect to NATS");
    let js = async_nats::jetstream::new(client);
    let q = &fixture.queue;
    let mut found = BTreeSet::new();
    for name in [q.clone(), format!("{q}_dlq")] {
        let Ok(stream) = js.get_stream(&name).await else {
            continue;
        };
        found.insert(format!("stream:{name}"));
        let consumers: Vec<String> = stream
            .consumer_names()
            .try_collect()
            .await
            .expect("the stream's consumers");
        for consumer in consumers {
            found.insert(format!("consumer:{name}/{consumer}"));
        }
    }
    if let Ok(bucket) = js.get_key_value("courier-seal-keys").await
        && let Ok(Some(_)) = bucket.entry(q).await
    {
        found.insert(format!("key:courier-seal-keys/{q}"));
    }
    found
}

/// The embedded queue's file, and the tables in it of the queue and of the
/// dead-letter queues named after it (`ready/`, `leased/`, `acked/`,
/// `dlq/`), read without writing; no process may have the file open.
fn embedded(fixture: &Fixture) -> BTreeSet<String> {
    use redb::{ReadableDatabase, TableHandle};
    let path = fixture
        .dir()
        .expect("an embedded fixture")
        .join("courier.redb");
    let mut found = BTreeSet::new();
    if !path.exists() {
        return found;
    }
    found.insert("file:courier.redb".to_string());
    let db = redb::ReadOnlyDatabase::open(&path).expect("open the embedded queue to read it");
    let tx = db.begin_read().expect("a read transaction");
    for table in tx.list_tables().expect("the file's tables") {
        let name = table.name().to_string();
        let of_queue = name
            .split_once('/')
            .is_some_and(|(_, queue)| queue.starts_with(fixture.queue.as_str()));
        if of_queue {
            found.insert(format!("table:{name}"));
        }
    }
    found
}

/// The topics named after the queue (the topic, `.retry`, `.dlq`,
/// `.dlq.removed`), the queue's record in the seal topic
/// `courier-seal-keys`, and the offsets the group `courier.<queue>`
/// committed on the topics, read with plain rdkafka clients that join no
/// group and commit nothing. (The mock cluster lists no groups; what a
/// group leaves on a cluster is its committed offsets.)
async fn kafka(fixture: &Fixture) -> BTreeSet<String> {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::message::Message;
    let bootstrap = kafka_bootstrap(fixture);
    let q = fixture.queue.clone();
    let mut found = tokio::task::spawn_blocking({
        let (bootstrap, q) = (bootstrap.clone(), q.clone());
        move || {
            let timeout = Duration::from_secs(10);
            let consumer: BaseConsumer = rdkafka::ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .set("group.id", format!("courier.{q}"))
                .set("enable.auto.commit", "false")
                .set("allow.auto.create.topics", "false")
                .create()
                .expect("an rdkafka consumer");
            let metadata = consumer
                .fetch_metadata(None, timeout)
                .expect("the cluster's topics");
            let mut found = BTreeSet::new();
            let mut committed = rdkafka::TopicPartitionList::new();
            for topic in metadata.topics() {
                if !topic.name().starts_with(q.as_str()) || topic.error().is_some() {
                    continue;
                }
                found.insert(format!("topic:{}", topic.name()));
                for p in topic.partitions() {
                    committed.add_partition(topic.name(), p.id());
                }
            }
            if committed.count() > 0 {
                let committed = consumer
                    .committed_offsets(committed, timeout)
                    .expect("the group's committed offsets");
                for element in committed.elements() {
                    if let rdkafka::Offset::Offset(_) = element.offset() {
                        found.insert(format!("offsets:courier.{q}/{}", element.topic()));
                    }
                }
            }
            found
        }
    })
    .await
    .unwrap();
    let seal_keys = kafka_records(&bootstrap, "courier-seal-keys").await;
    if seal_keys.iter().any(|r| r.key() == Some(q.as_bytes())) {
        found.insert(format!("key:courier-seal-keys/{q}"));
    }
    found
}

/// The queues whose names start with the queue's (the queue, `<queue>-dlq`)
/// and the `courier-*` tags of each (the seal key).
async fn sqs(fixture: &Fixture) -> BTreeSet<String> {
    let client = sqs_client().await;
    let urls = client
        .list_queues()
        .queue_name_prefix(&fixture.queue)
        .send()
        .await
        .expect("ListQueues")
        .queue_urls
        .unwrap_or_default();
    let mut found = BTreeSet::new();
    for url in urls {
        let name = url.rsplit('/').next().unwrap_or_default().to_string();
        found.insert(format!("queue:{name}"));
        let tags = client
            .list_queue_tags()
            .queue_url(&url)
            .send()
            .await
            .expect("ListQueueTags")
            .tags
            .unwrap_or_default();
        for tag in tags.keys().filter(|t| t.starts_with("courier")) {
            found.insert(format!("tag:{name}/{tag}"));
        }
    }
    found
}

/// The topics and subscriptions of the test project whose names start with
/// the queue's (work, `.retry`, `.dlq` and the `.courier-depth` shadows),
/// and the `courier-*` labels of each topic (the seal key).
async fn pubsub(fixture: &Fixture) -> BTreeSet<String> {
    use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
        ListSubscriptionsRequest, ListTopicsRequest,
    };
    let (mut publisher, mut subscriber) = pubsub_clients().await;
    let project = format!("projects/{PUBSUB_PROJECT}");
    let ours = |full: &str| {
        let name = full.rsplit('/').next().unwrap_or_default();
        name.starts_with(fixture.queue.as_str())
            .then(|| name.to_string())
    };
    let mut found = BTreeSet::new();
    let mut page_token = String::new();
    loop {
        let page = publisher
            .list_topics(ListTopicsRequest {
                project: project.clone(),
                page_size: 1000,
                page_token,
            })
            .await
            .expect("ListTopics")
            .into_inner();
        for topic in page.topics {
            let Some(name) = ours(&topic.name) else {
                continue;
            };
            for label in topic.labels.keys().filter(|l| l.starts_with("courier")) {
                found.insert(format!("label:{name}/{label}"));
            }
            found.insert(format!("topic:{name}"));
        }
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    let mut page_token = String::new();
    loop {
        let page = subscriber
            .list_subscriptions(ListSubscriptionsRequest {
                project: project.clone(),
                page_size: 1000,
                page_token,
            })
            .await
            .expect("ListSubscriptions")
            .into_inner();
        found.extend(
            page.subscriptions
                .iter()
                .filter_map(|s| ours(&s.name))
                .map(|name| format!("subscription:{name}")),
        );
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    found
}

/// The `name` of one entry of `XINFO GROUPS` (a map in RESP3, a flat
/// list in RESP2).
fn group_name(group: &::redis::Value) -> Option<String> {
    let text = |v: &::redis::Value| match v {
        ::redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        ::redis::Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    match group {
        ::redis::Value::Map(pairs) => pairs
            .iter()
            .find(|(k, _)| text(k).as_deref() == Some("name"))
            .and_then(|(_, v)| text(v)),
        ::redis::Value::Array(items) => items
            .chunks(2)
            .find(|pair| text(&pair[0]).as_deref() == Some("name"))
            .and_then(|pair| pair.get(1).and_then(text)),
        _ => None,
    }
}

/// Deletes what a test made of `fixture`'s queue outside the fixture's own
/// clean-up (a queue that only the test's `courier send` created).
pub async fn remove(fixture: &Fixture) {
    fixture
        .broker
        .clean_up(&fixture.source_arg(), &fixture.queue)
        .await;
    if let BrokerKind::Redis | BrokerKind::RedisCluster = fixture.broker {
        let mut con = RedisConnection::open(&fixture.source_arg())
            .await
            .expect("connect to Redis");
        let _: Result<i64, _> = ::redis::cmd("DEL")
            .arg(&fixture.queue)
            .query_async(&mut con)
            .await;
    }
}

impl Fixture {
    /// Makes this fixture's work queue alone with the broker's own client,
    /// as an operator does before courier runs: nothing of courier's (no
    /// group, seal key, dead-letter queue). Where a write makes the queue
    /// (a Redis stream, a table of the embedded queue), there is nothing to
    /// make.
    pub async fn make_work_queue(&self) {
        match self.broker {
            BrokerKind::Redis | BrokerKind::RedisCluster | BrokerKind::Embedded => {}
            BrokerKind::Amqp => {
                use lapin::options::QueueDeclareOptions;
                let connection = lapin::Connection::connect(self.url.as_str(), Default::default())
                    .await
                    .expect("connect to RabbitMQ");
                let channel = connection.create_channel().await.expect("open a channel");
                channel
                    .queue_declare(
                        self.queue.as_str().into(),
                        QueueDeclareOptions::durable(),
                        Default::default(),
                    )
                    .await
                    .expect("declare the work queue");
                let _ = connection.close(200, "done".into()).await;
            }
            BrokerKind::Nats => {
                let client = async_nats::connect(self.url.as_str())
                    .await
                    .expect("connect to NATS");
                async_nats::jetstream::new(client)
                    .create_stream(async_nats::jetstream::stream::Config {
                        name: self.queue.clone(),
                        subjects: vec![self.queue.clone()],
                        retention: async_nats::jetstream::stream::RetentionPolicy::WorkQueue,
                        ..Default::default()
                    })
                    .await
                    .expect("create the work stream");
            }
            BrokerKind::Kafka => make_kafka_topic(self).await,
            BrokerKind::Sqs => {
                sqs_client()
                    .await
                    .create_queue()
                    .queue_name(&self.queue)
                    .send()
                    .await
                    .expect("create the work queue");
            }
            BrokerKind::PubSub => super::create_pubsub_subscription(&self.queue, None).await,
        }
    }
}

/// Has the mock cluster make the fixture's topic, as a cluster with topic
/// auto-creation does on a producer's metadata request (the mock has no
/// `CreateTopics`), and waits until it has partitions.
async fn make_kafka_topic(fixture: &Fixture) {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    use rdkafka::producer::Producer as _;
    let bootstrap = kafka_bootstrap(fixture);
    let topic = fixture.queue.clone();
    tokio::task::spawn_blocking(move || {
        let timeout = Duration::from_secs(10);
        let producer: rdkafka::producer::BaseProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("allow.auto.create.topics", "true")
            .create()
            .expect("an rdkafka producer");
        let _ = producer.client().fetch_metadata(Some(&topic), timeout);
        let reader: BaseConsumer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("allow.auto.create.topics", "false")
            .create()
            .expect("an rdkafka consumer");
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let metadata = reader
                .fetch_metadata(Some(&topic), timeout)
                .expect("topic metadata");
            let made = metadata
                .topics()
                .iter()
                .any(|t| t.error().is_none() && !t.partitions().is_empty());
            if made {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the mock cluster did not make {topic}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    })
    .await
    .unwrap();
}
