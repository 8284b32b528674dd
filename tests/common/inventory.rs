//! What a broker holds for one queue, read with the broker's own client:
//! the names of the streams, keys, groups, queues, topics, subscriptions
//! or files that exist for it. The read-only commands must leave it as
//! they found it, and `courier send` may add the work queue alone.

use std::collections::BTreeSet;

use super::{BrokerKind, Fixture, RedisConnection};

/// Everything of `fixture`'s queue that exists on its broker now, as
/// `kind:name` strings (`stream:q`, `group:q/courier`, `key:q.courier-key`).
pub async fn inventory(fixture: &Fixture) -> BTreeSet<String> {
    match fixture.broker {
        BrokerKind::Redis | BrokerKind::RedisCluster => redis(fixture).await,
        BrokerKind::Amqp => amqp(fixture).await,
        BrokerKind::Nats => nats(fixture).await,
        other => panic!("no inventory for {other:?} yet"),
    }
}

/// The item [`inventory`] shows for the work queue itself, which a send
/// may create.
pub fn work_queue_item(fixture: &Fixture) -> String {
    match fixture.broker {
        BrokerKind::Redis | BrokerKind::RedisCluster => format!("stream:{}", fixture.queue),
        BrokerKind::Amqp => format!("queue:{}", fixture.queue),
        BrokerKind::Nats => format!("stream:{}", fixture.queue),
        other => panic!("no inventory for {other:?} yet"),
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
/// (`src/source/amqp/tiers.rs`), as their queue names end.
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
    /// (a Redis stream), there is nothing to make.
    pub async fn make_work_queue(&self) {
        match self.broker {
            BrokerKind::Redis | BrokerKind::RedisCluster => {}
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
            other => panic!("no inventory for {other:?} yet"),
        }
    }
}
