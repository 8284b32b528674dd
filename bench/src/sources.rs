//! The brokers the benchmark runs courier against: how each is reached,
//! pre-filled and cleaned up.
//!
//! Producers use courier's own [`Source::send`] where it is a plain publish
//! (AMQP, NATS, Redis at a fixed rate). Bulk pre-fills that would otherwise
//! dominate the run write the broker directly in the format courier reads:
//! pipelined `XADD payload <body>` for Redis, and one redb transaction into
//! the embedded queue's `ready/<queue>` table (see
//! `crates/embedded/src/lib.rs`); the smoke test catches a drift in either.
//! SQS and Pub/Sub pre-fills are the brokers' own batch writes of plain
//! messages (`SendMessageBatch` of 10, `Publish` of 1,000), which courier
//! reads as any producer's: one send per message through moto, a Python
//! server, would take longer than the drain it feeds.
//!
//! Kafka, SQS and Pub/Sub run on servers of the harness's own
//! ([`crate::servers`]); the others on the shared ones `scripts/services`
//! starts.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use bytes::Bytes;
use courier::source::{self, Source, SourceOptions, encode_fields};
use futures::StreamExt;

use crate::servers::{self, PUBSUB_PROJECT};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Redis,
    Amqp,
    Nats,
    Embedded,
    Kafka,
    Sqs,
    PubSub,
}

impl Kind {
    pub const ALL: [Kind; 7] = [
        Kind::Redis,
        Kind::Amqp,
        Kind::Nats,
        Kind::Embedded,
        Kind::Kafka,
        Kind::Sqs,
        Kind::PubSub,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Redis => "redis",
            Kind::Amqp => "amqp",
            Kind::Nats => "nats",
            Kind::Embedded => "embedded",
            Kind::Kafka => "kafka",
            Kind::Sqs => "sqs",
            Kind::PubSub => "pubsub",
        }
    }

    pub fn title(self) -> &'static str {
        match self {
            Kind::Redis => "Redis Streams",
            Kind::Amqp => "RabbitMQ",
            Kind::Nats => "NATS JetStream",
            Kind::Embedded => "embedded",
            Kind::Kafka => "Kafka (mock cluster)",
            Kind::Sqs => "Amazon SQS (moto)",
            Kind::PubSub => "Google Pub/Sub (emulator)",
        }
    }

    pub fn parse(name: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|k| k.name() == name)
    }
}

/// One broker, one queue name for one run.
#[derive(Debug, Clone)]
pub struct Target {
    pub kind: Kind,
    pub url: String,
    pub queue: String,
}

pub const REDIS_URL: &str = "redis://127.0.0.1:6379/0";
pub const AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const NATS_URL: &str = "nats://127.0.0.1:4222";

impl Target {
    /// A fresh queue for `purpose` (`drain`, `latency`, ...).
    pub fn new(kind: Kind, purpose: &str, work_dir: &std::path::Path) -> Self {
        let queue = format!(
            "courier-bench-{}-{}-{purpose}",
            std::process::id(),
            kind.name()
        );
        let url = match kind {
            Kind::Redis => REDIS_URL.to_string(),
            Kind::Amqp => AMQP_URL.to_string(),
            Kind::Nats => NATS_URL.to_string(),
            Kind::Embedded => format!("embedded:{}", work_dir.join(&queue).display()),
            // A cluster that did not start has no address: `reachable` says
            // why before anything uses this one.
            Kind::Kafka => format!(
                "kafka://{}",
                servers::kafka_bootstrap().unwrap_or_else(|_| "127.0.0.1:9".into())
            ),
            Kind::Sqs => format!("sqs://{}", aws_region()),
            Kind::PubSub => format!("pubsub://{PUBSUB_PROJECT}"),
        };
        Self { kind, url, queue }
    }

    pub fn embedded_dir(&self) -> Option<PathBuf> {
        self.url.strip_prefix("embedded:").map(PathBuf::from)
    }

    /// The broker server's loopback port (of a cluster, its first
    /// broker's: one process serves them all); `None` for the embedded
    /// queue, which runs inside the consumer.
    pub fn port(&self) -> Option<u16> {
        self.ports().first().copied()
    }

    /// Every broker's port: the mock cluster's three, else one.
    pub fn ports(&self) -> Vec<u16> {
        match self.kind {
            Kind::Redis => vec![6379],
            Kind::Amqp => vec![5672],
            Kind::Nats => vec![4222],
            Kind::Embedded => Vec::new(),
            Kind::Kafka => servers::kafka_bootstrap()
                .unwrap_or_default()
                .split(',')
                .filter_map(|server| server.rsplit_once(':')?.1.parse().ok())
                .collect(),
            Kind::Sqs => servers::moto().map(|(port, _)| port).into_iter().collect(),
            Kind::PubSub => servers::pubsub_port().into_iter().collect(),
        }
    }

    /// Why this broker cannot be used, if it is not listening.
    pub fn reachable(&self) -> Result<(), String> {
        match self.kind {
            Kind::Kafka => servers::kafka_bootstrap().map(drop)?,
            Kind::Sqs => servers::moto().map(drop)?,
            Kind::PubSub => servers::pubsub_port().map(drop)?,
            _ => {}
        }
        let Some(port) = self.port() else {
            return Ok(());
        };
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        TcpStream::connect_timeout(&addr, Duration::from_secs(2))
            .map(drop)
            .map_err(|e| format!("nothing answers on {addr} ({e}); scripts/services starts it"))
    }

    /// Flags of `courier run` for this target.
    pub fn run_args(&self) -> Vec<String> {
        let mut args = vec![
            "--source".into(),
            self.url.clone(),
            "--queue".into(),
            self.queue.clone(),
            "--consumer".into(),
            "bench".into(),
        ];
        if !matches!(self.kind, Kind::Redis | Kind::Embedded) {
            args.push("--create".into());
        }
        args
    }

    pub fn options(&self) -> SourceOptions {
        let mut options = SourceOptions::new(&self.queue);
        options.create = true;
        options.consumer = "bench-producer".into();
        options
    }

    /// courier's own source for this target, used as a producer.
    pub async fn producer(&self) -> anyhow::Result<Arc<dyn Source>> {
        let url = courier::source::parse_url(&self.url).map_err(anyhow::Error::msg)?;
        Ok(source::open(&url, self.options()).await?)
    }

    /// Writes `n` messages with `body` to the queue.
    pub async fn prefill(&self, n: u64, body: &Bytes) -> anyhow::Result<()> {
        match self.kind {
            Kind::Redis => prefill_redis(&self.queue, n, body).await,
            Kind::Embedded => {
                let dir = self
                    .embedded_dir()
                    .expect("an embedded target has a directory");
                let (queue, body) = (self.queue.clone(), body.clone());
                tokio::task::spawn_blocking(move || prefill_embedded(&dir, &queue, n, &body))
                    .await?
            }
            Kind::Sqs => {
                self.producer().await?.close().await;
                prefill_sqs(&self.queue, n, body).await
            }
            Kind::PubSub => self.prefill_pubsub(n, body).await,
            Kind::Amqp | Kind::Nats | Kind::Kafka => {
                let producer = self.producer().await?;
                let results: Vec<_> = futures::stream::iter(0..n)
                    .map(|_| producer.send(body.clone(), &[]))
                    .buffer_unordered(256)
                    .collect()
                    .await;
                producer.close().await;
                for result in results {
                    result?;
                }
                Ok(())
            }
        }
    }

    /// Removes what this run left in the broker.
    pub async fn cleanup(&self) {
        let result = match self.kind {
            Kind::Redis => cleanup_redis(&self.queue).await,
            Kind::Amqp => cleanup_amqp(&self.queue).await,
            Kind::Nats => cleanup_nats(&self.queue).await,
            Kind::Embedded => self
                .embedded_dir()
                .map_or(Ok(()), |d| std::fs::remove_dir_all(d).map_err(Into::into)),
            Kind::PubSub => cleanup_pubsub(&self.queue).await,
            // The run's own servers, in memory, end with it; every run has
            // a queue of its own. (The mock cluster cannot delete topics.)
            Kind::Kafka | Kind::Sqs => Ok(()),
        };
        if let Err(e) = result {
            eprintln!(
                "  (cleanup of {} {} failed: {e:#})",
                self.kind.name(),
                self.queue
            );
        }
    }
}

/// The region courier and the clients use on moto: the one the
/// environment names.
fn aws_region() -> String {
    std::env::var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into())
}

impl Target {
    /// Makes the topic and subscription as `courier run --create` does (by
    /// opening courier's own source once, as SQS's pre-fill does for the
    /// queue), then publishes `n` plain messages, 1,000 a call (Pub/Sub's
    /// most).
    async fn prefill_pubsub(&self, n: u64, body: &Bytes) -> anyhow::Result<()> {
        use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
            PublishRequest, PubsubMessage, publisher_client::PublisherClient,
        };
        self.producer().await?.close().await;
        let mut publisher = PublisherClient::new(servers::pubsub_channel().await?);
        let topic = format!("projects/{PUBSUB_PROJECT}/topics/{}", self.queue);
        let message = PubsubMessage {
            data: body.clone(),
            ..PubsubMessage::default()
        };
        let mut left = n;
        while left > 0 {
            let batch = left.min(1000);
            publisher
                .publish(PublishRequest {
                    topic: topic.clone(),
                    messages: vec![message.clone(); batch as usize],
                })
                .await?;
            left -= batch;
        }
        Ok(())
    }
}

/// Sends `n` plain messages to the queue, 10 a call, 16 calls at a time.
async fn prefill_sqs(queue: &str, n: u64, body: &Bytes) -> anyhow::Result<()> {
    use aws_sdk_sqs::types::SendMessageBatchRequestEntry;
    let client = servers::sqs_client().await;
    let url = servers::sqs_queue_url(&client, queue).await?;
    let text = std::str::from_utf8(body).context("an SQS body is text")?;
    let batches = (0..n).step_by(10).map(|first| (n - first).min(10));
    let results: Vec<anyhow::Result<()>> = futures::stream::iter(batches)
        .map(|size| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let entries = (0..size)
                    .map(|i| {
                        SendMessageBatchRequestEntry::builder()
                            .id(i.to_string())
                            .message_body(text)
                            .build()
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                let out = client
                    .send_message_batch()
                    .queue_url(url)
                    .set_entries(Some(entries))
                    .send()
                    .await?;
                if let Some(failed) = out.failed().first() {
                    anyhow::bail!("SQS refused a message: {failed:?}");
                }
                Ok(())
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    results.into_iter().collect()
}

/// Deletes the subscriptions and topics of a queue: its own, and those
/// courier made beside it (`<queue>.retry`, `<queue>.dlq`, the depth
/// shadows `….courier-depth`). The emulator keeps every message a
/// subscription has not acked, and a shadow acks at most what a depth
/// count read: left behind, each drain's messages stayed in its heap for
/// the rest of the run.
async fn cleanup_pubsub(queue: &str) -> anyhow::Result<()> {
    use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
        DeleteSubscriptionRequest, DeleteTopicRequest, ListSubscriptionsRequest, ListTopicsRequest,
        publisher_client::PublisherClient, subscriber_client::SubscriberClient,
    };
    let channel = servers::pubsub_channel().await?;
    let mut subscriber = SubscriberClient::new(channel.clone());
    let mut publisher = PublisherClient::new(channel);
    let project = format!("projects/{PUBSUB_PROJECT}");
    let of_queue = |name: &str| {
        name.rsplit('/')
            .next()
            .and_then(|short| short.strip_prefix(queue))
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
    };
    let mut page_token = String::new();
    loop {
        let page = subscriber
            .list_subscriptions(ListSubscriptionsRequest {
                project: project.clone(),
                page_size: 1000,
                page_token,
            })
            .await?
            .into_inner();
        for subscription in page.subscriptions.into_iter().map(|s| s.name) {
            if of_queue(&subscription) {
                subscriber
                    .delete_subscription(DeleteSubscriptionRequest { subscription })
                    .await?;
            }
        }
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    let mut page_token = String::new();
    loop {
        let page = publisher
            .list_topics(ListTopicsRequest {
                project: project.clone(),
                page_size: 1000,
                page_token,
            })
            .await?
            .into_inner();
        for topic in page.topics.into_iter().map(|t| t.name) {
            if of_queue(&topic) {
                publisher.delete_topic(DeleteTopicRequest { topic }).await?;
            }
        }
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    Ok(())
}

pub async fn redis() -> anyhow::Result<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(REDIS_URL)?;
    Ok(client.get_multiplexed_async_connection().await?)
}

async fn prefill_redis(queue: &str, n: u64, body: &Bytes) -> anyhow::Result<()> {
    let mut con = redis().await?;
    let mut left = n;
    while left > 0 {
        let batch = left.min(1000);
        let mut pipe = redis::pipe();
        for _ in 0..batch {
            pipe.cmd("XADD")
                .arg(queue)
                .arg("*")
                .arg(courier::model::PAYLOAD)
                .arg(body.as_ref())
                .ignore();
        }
        pipe.query_async::<()>(&mut con).await?;
        left -= batch;
    }
    Ok(())
}

async fn cleanup_redis(queue: &str) -> anyhow::Result<()> {
    let mut con = redis().await?;
    redis::cmd("UNLINK")
        .arg(queue)
        .arg(format!("{queue}.retry"))
        .arg(format!("{queue}.dlq"))
        .query_async::<()>(&mut con)
        .await?;
    Ok(())
}

/// The embedded queue's layout (`crates/embedded/src/lib.rs`): table
/// `ready/<queue>` keyed by `(due ms, seq)` holding the encoded fields, and
/// the sequence counter `seq` in table `meta`.
fn prefill_embedded(
    dir: &std::path::Path,
    queue: &str,
    n: u64,
    body: &Bytes,
) -> anyhow::Result<()> {
    use redb::ReadableTable;
    type QueueTable<'a> = redb::TableDefinition<'a, (u64, u64), &'static [u8]>;
    const META: redb::TableDefinition<'_, &str, u64> = redb::TableDefinition::new("meta");
    std::fs::create_dir_all(dir)?;
    let db = redb::Database::create(dir.join("courier.redb"))
        .with_context(|| format!("cannot open the embedded queue in {}", dir.display()))?;
    let data = encode_fields(&[(
        Bytes::from_static(courier::model::PAYLOAD.as_bytes()),
        body.clone(),
    )]);
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64;
    let tx = db.begin_write()?;
    {
        let mut meta = tx.open_table(META)?;
        let first = meta.get("seq")?.map(|v| v.value()).unwrap_or(0);
        let mut ready = tx.open_table(QueueTable::new(&format!("ready/{queue}")))?;
        for seq in first + 1..=first + n {
            ready.insert((now, seq), data.as_slice())?;
        }
        meta.insert("seq", first + n)?;
    }
    tx.commit()?;
    Ok(())
}

async fn cleanup_amqp(queue: &str) -> anyhow::Result<()> {
    use lapin::options::QueueDeleteOptions;
    let connection =
        lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    for name in [queue.to_string(), format!("{queue}.dlq")] {
        // A queue that was never declared closes the channel; use a new one each time.
        let channel = if channel.status().connected() {
            channel.clone()
        } else {
            connection.create_channel().await?
        };
        let _ = channel
            .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
            .await;
    }
    let _ = connection.close(200, "bye".into()).await;
    Ok(())
}

async fn cleanup_nats(queue: &str) -> anyhow::Result<()> {
    let client = async_nats::connect(NATS_URL).await?;
    let js = async_nats::jetstream::new(client);
    let _ = js.delete_stream(queue).await;
    let _ = js.delete_stream(format!("{queue}_dlq")).await;
    Ok(())
}
