//! The bare loops: for each broker, the simplest correct at-least-once
//! consumer, with the same client crate as courier's source and the same
//! concurrency, that POSTs each message's body to the app and acks it after
//! the answer. No policy, no retries, no metrics: what courier's design
//! could reach on this machine, the row courier is compared with.
//!
//! `courier-bench bare ...` runs one as a child process on one thread (as
//! courier runs by default), so its CPU, RSS, instructions and system calls
//! are measured the same way as courier's. SIGTERM ends it cleanly (so
//! callgrind writes its profile).
//!
//! - Redis: `XREADGROUP COUNT <concurrency> BLOCK`, POST them all at once,
//!   one `XACK` for the batch.
//! - RabbitMQ: `basic_consume` with prefetch = concurrency, POST, `basic_ack`.
//! - NATS: a durable pull consumer's message stream, batches of
//!   concurrency, POST, ack.
//! - Embedded: a redb file, read in key order from an in-memory cursor;
//!   acked rows are removed by one fsynced transaction at most every 20 ms,
//!   the durability courier's embedded queue gives acks.
//! - Kafka: an rdkafka `StreamConsumer` in a group of its own, without
//!   auto-commit; the batch the stream has ready (up to concurrency), POST
//!   (each until the app takes it: a commit covers every offset below it),
//!   then one commit of the batch's offsets. librdkafka's defaults
//!   otherwise, `fetch.wait.max.ms` 500 ms among them.
//! - SQS: `ReceiveMessage` long polls of up to 10 (as many at once as
//!   concurrency needs: 2 for 16), POST, `DeleteMessageBatch`.
//! - Pub/Sub: unary `Pull` of up to concurrency, POST, `Acknowledge`.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;
use futures::StreamExt;
use http::{Method, Request, Uri};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use redis::Value;

use crate::app::SENT_HEADER;
use crate::sources::{AMQP_URL, Kind, NATS_URL, REDIS_URL};

/// What `courier-bench bare` is given.
#[derive(Debug, Clone, clap::Args)]
pub struct BareArgs {
    /// redis, amqp, nats, embedded, kafka, sqs or pubsub.
    #[arg(long)]
    pub source: String,
    /// The source URL courier is given (Kafka's bootstrap servers,
    /// Pub/Sub's project).
    #[arg(long)]
    pub url: Option<String>,
    #[arg(long)]
    pub queue: String,
    /// The embedded queue's directory.
    #[arg(long)]
    pub dir: Option<PathBuf>,
    #[arg(long)]
    pub app: String,
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
}

/// The same group name courier's sources use by default is not needed: each
/// run has a queue of its own.
const GROUP: &str = "bare";
/// The embedded queue's acks become durable at most this long after they
/// were made, as in courier's embedded queue.
const FLUSH_EVERY: Duration = Duration::from_millis(20);
/// The page cache courier's embedded queue gives redb.
const CACHE_BYTES: usize = 4 << 20;

/// The pooled keep-alive client, as courier's forwarder builds it.
#[derive(Clone)]
struct Poster {
    client: Client<HttpConnector, Full<Bytes>>,
    app: Uri,
}

impl Poster {
    fn new(app: &str, concurrency: usize) -> anyhow::Result<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(concurrency.max(1))
            .build(connector);
        Ok(Self {
            client,
            app: app.parse().context("--app is not a URL")?,
        })
    }

    /// POSTs `body` (with the latency stamp, when the message has one);
    /// true on a 2xx answer read to its end.
    async fn post(&self, body: Bytes, sent: Option<&[u8]>) -> bool {
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(self.app.clone())
            .header("content-type", "application/octet-stream");
        if let Some(sent) = sent {
            builder = builder.header(SENT_HEADER, sent);
        }
        let Ok(request) = builder.body(Full::new(body)) else {
            return false;
        };
        match self.client.request(request).await {
            Ok(response) => {
                let ok = response.status().is_success();
                response.into_body().collect().await.is_ok() && ok
            }
            Err(_) => false,
        }
    }
}

/// Runs the loop until SIGTERM.
pub fn run(args: BareArgs) -> anyhow::Result<()> {
    let kind =
        Kind::parse(&args.source).with_context(|| format!("unknown source {:?}", args.source))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let poster = Poster::new(&args.app, args.concurrency)?;
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        let work = async {
            match kind {
                Kind::Redis => redis_loop(&args, &poster).await,
                Kind::Amqp => amqp_loop(&args, &poster).await,
                Kind::Nats => nats_loop(&args, &poster).await,
                Kind::Embedded => embedded_loop(&args, &poster).await,
                Kind::Kafka => kafka_loop(&args, &poster).await,
                Kind::Sqs => sqs_loop(&args, &poster).await,
                Kind::PubSub => pubsub_loop(&args, &poster).await,
            }
        };
        tokio::select! {
            result = work => result,
            _ = term.recv() => Ok(()),
        }
    })
}

// === Redis ===

async fn redis_loop(args: &BareArgs, poster: &Poster) -> anyhow::Result<()> {
    let client = redis::Client::open(REDIS_URL)?;
    // No response timeout: a blocking read waits longer than the default
    // 500 ms. A generous connection timeout: under valgrind on a busy
    // machine connecting took longer than the default second.
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(None)
        .set_connection_timeout(Some(Duration::from_secs(60)));
    let mut con = client
        .get_multiplexed_async_connection_with_config(&config)
        .await?;
    let created: Result<Value, _> = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&args.queue)
        .arg(GROUP)
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut con)
        .await;
    if let Err(e) = created
        && e.code() != Some("BUSYGROUP")
    {
        return Err(e.into());
    }
    loop {
        let reply: Value = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg("bare")
            .arg("COUNT")
            .arg(args.concurrency)
            .arg("BLOCK")
            .arg(1000)
            .arg("STREAMS")
            .arg(&args.queue)
            .arg(">")
            .query_async(&mut con)
            .await?;
        let entries = stream_entries(reply);
        if entries.is_empty() {
            continue;
        }
        let posts = entries.iter().map(|(_, fields)| {
            let body = field(fields, courier::model::PAYLOAD.as_bytes()).unwrap_or_default();
            let sent = field(fields, SENT_HEADER.as_bytes());
            async move { poster.post(body, sent.as_deref()).await }
        });
        let answers = futures::future::join_all(posts).await;
        let acked: Vec<&Bytes> = entries
            .iter()
            .zip(answers)
            .filter(|(_, ok)| *ok)
            .map(|((id, _), _)| id)
            .collect();
        if !acked.is_empty() {
            let mut xack = redis::cmd("XACK");
            xack.arg(&args.queue).arg(GROUP);
            for id in acked {
                xack.arg(id.as_ref());
            }
            xack.query_async::<Value>(&mut con).await?;
        }
    }
}

type Entry = (Bytes, Vec<(Bytes, Bytes)>);

/// The entries of an `XREADGROUP` reply of one stream.
fn stream_entries(reply: Value) -> Vec<Entry> {
    let Value::Array(streams) = reply else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for stream in streams {
        let Value::Array(mut parts) = stream else {
            continue;
        };
        let Some(Value::Array(entries)) = parts.pop() else {
            continue;
        };
        for entry in entries {
            let Value::Array(mut pair) = entry else {
                continue;
            };
            let (Some(Value::Array(flat)), Some(Value::BulkString(id))) = (pair.pop(), pair.pop())
            else {
                continue;
            };
            let mut fields = Vec::with_capacity(flat.len() / 2);
            let mut flat = flat.into_iter();
            while let (Some(Value::BulkString(name)), Some(Value::BulkString(value))) =
                (flat.next(), flat.next())
            {
                fields.push((Bytes::from(name), Bytes::from(value)));
            }
            out.push((Bytes::from(id), fields));
        }
    }
    out
}

fn field(fields: &[(Bytes, Bytes)], name: &[u8]) -> Option<Bytes> {
    fields
        .iter()
        .find(|(n, _)| n.as_ref() == name)
        .map(|(_, v)| v.clone())
}

// === RabbitMQ ===

async fn amqp_loop(args: &BareArgs, poster: &Poster) -> anyhow::Result<()> {
    use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
    use lapin::types::{AMQPValue, FieldTable};
    let connection =
        lapin::Connection::connect(AMQP_URL, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let prefetch = u16::try_from(args.concurrency).unwrap_or(u16::MAX);
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            args.queue.as_str().into(),
            "bare".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    consumer
        .for_each_concurrent(args.concurrency, |delivery| async move {
            let Ok(delivery) = delivery else {
                return;
            };
            let sent = delivery
                .properties
                .headers()
                .as_ref()
                .and_then(|h| h.inner().get(SENT_HEADER))
                .and_then(|v| match v {
                    AMQPValue::LongString(s) => Some(s.as_bytes().to_vec()),
                    _ => None,
                });
            let body = Bytes::from(delivery.data.clone());
            if poster.post(body, sent.as_deref()).await {
                let _ = delivery.acker.ack(BasicAckOptions::default()).await;
            }
        })
        .await;
    bail!("the consumer ended")
}

// === NATS ===

async fn nats_loop(args: &BareArgs, poster: &Poster) -> anyhow::Result<()> {
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    let client = async_nats::connect(NATS_URL).await?;
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream(&args.queue).await?;
    let consumer = stream
        .get_or_create_consumer(
            GROUP,
            pull::Config {
                durable_name: Some(GROUP.into()),
                ack_policy: AckPolicy::Explicit,
                ..Default::default()
            },
        )
        .await?;
    let messages = consumer
        .stream()
        .max_messages_per_batch(args.concurrency)
        .messages()
        .await?;
    messages
        .for_each_concurrent(args.concurrency, |message| async move {
            let Ok(message) = message else {
                return;
            };
            let sent = message
                .headers
                .as_ref()
                .and_then(|h| h.get(SENT_HEADER))
                .map(|v| v.as_str().as_bytes().to_vec());
            if poster.post(message.payload.clone(), sent.as_deref()).await {
                let _ = message.ack().await;
            }
        })
        .await;
    bail!("the pull stream ended")
}

// === Embedded ===

type QueueTable<'a> = redb::TableDefinition<'a, (u64, u64), &'static [u8]>;

async fn embedded_loop(args: &BareArgs, poster: &Poster) -> anyhow::Result<()> {
    use redb::ReadableDatabase;
    let dir = args.dir.clone().context("--dir is required for embedded")?;
    let db = redb::Builder::new()
        .set_cache_size(CACHE_BYTES)
        .create(dir.join("courier.redb"))?;
    let table_name = format!("ready/{}", args.queue);
    let table = QueueTable::new(&table_name);
    // Rows handed out are past the cursor; rows acked wait for the next
    // durable removal.
    let mut cursor: Option<(u64, u64)> = None;
    let mut acked: Vec<(u64, u64)> = Vec::new();
    let mut flushed_at = Instant::now();
    let mut idle = Duration::from_millis(1);
    loop {
        let batch: Vec<((u64, u64), Bytes)> = {
            let tx = db.begin_read()?;
            match tx.open_table(table) {
                Ok(ready) => {
                    let range = match cursor {
                        Some(after) => ready.range((
                            std::ops::Bound::Excluded(after),
                            std::ops::Bound::Unbounded,
                        ))?,
                        None => ready.range::<(u64, u64)>(..)?,
                    };
                    range
                        .take(args.concurrency)
                        .map(|row| row.map(|(k, v)| (k.value(), Bytes::copy_from_slice(v.value()))))
                        .collect::<Result<_, _>>()?
                }
                Err(redb::TableError::TableDoesNotExist(_)) => Vec::new(),
                Err(e) => return Err(e.into()),
            }
        };
        if batch.is_empty() {
            if !acked.is_empty() {
                flush(&db, table, &mut acked)?;
                flushed_at = Instant::now();
            }
            tokio::time::sleep(idle).await;
            idle = (idle * 2).min(Duration::from_millis(20));
            continue;
        }
        idle = Duration::from_millis(1);
        cursor = batch.last().map(|(k, _)| *k);
        let posts = batch.iter().map(|(key, data)| async move {
            let fields = courier::source::decode_fields(data).unwrap_or_default();
            let body = field(&fields, courier::model::PAYLOAD.as_bytes()).unwrap_or_default();
            let sent = field(&fields, SENT_HEADER.as_bytes());
            (*key, poster.post(body, sent.as_deref()).await)
        });
        for (key, ok) in futures::future::join_all(posts).await {
            if ok {
                acked.push(key);
            }
        }
        if flushed_at.elapsed() >= FLUSH_EVERY {
            flush(&db, table, &mut acked)?;
            flushed_at = Instant::now();
        }
    }
}

/// One fsynced transaction removing the acked rows.
fn flush(
    db: &redb::Database,
    table: QueueTable<'_>,
    acked: &mut Vec<(u64, u64)>,
) -> anyhow::Result<()> {
    let tx = db.begin_write()?;
    {
        let mut ready = tx.open_table(table)?;
        for key in acked.drain(..) {
            ready.remove(key)?;
        }
    }
    tx.commit()?;
    Ok(())
}

// === Kafka ===

async fn kafka_loop(args: &BareArgs, poster: &Poster) -> anyhow::Result<()> {
    use std::collections::HashMap;

    use rdkafka::consumer::{CommitMode, Consumer, StreamConsumer};
    use rdkafka::message::{Headers, Message};
    use rdkafka::{Offset, TopicPartitionList};
    let bootstrap = args
        .url
        .as_deref()
        .and_then(|u| u.strip_prefix("kafka://"))
        .context("--url kafka://host:port,... is required for kafka")?;
    let consumer: StreamConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        // A Kafka group is cluster-wide: one over every run's topic would
        // make each run's member wait for the last run's to leave.
        .set("group.id", format!("{GROUP}.{}", args.queue))
        .set("enable.auto.commit", "false")
        // The topic is filled before the loop starts, and a new group
        // begins at the latest offset by default, past all of it.
        .set("auto.offset.reset", "earliest")
        .create()?;
    consumer.subscribe(&[&args.queue])?;
    let mut batches = consumer.stream().ready_chunks(args.concurrency.max(1));
    while let Some(batch) = batches.next().await {
        let messages: Vec<_> = batch.into_iter().filter_map(Result::ok).collect();
        let posts = messages.iter().map(|m| async move {
            let body = Bytes::copy_from_slice(m.payload().unwrap_or_default());
            let sent = m.headers().and_then(|headers| {
                headers
                    .iter()
                    .find(|h| h.key == SENT_HEADER)
                    .and_then(|h| h.value)
            });
            // The commit below covers every offset under it: what the app
            // refused is tried again, not left behind.
            while !poster.post(body.clone(), sent).await {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        futures::future::join_all(posts).await;
        let mut next: HashMap<(&str, i32), i64> = HashMap::new();
        for m in &messages {
            let at = next.entry((m.topic(), m.partition())).or_default();
            *at = (*at).max(m.offset() + 1);
        }
        if next.is_empty() {
            continue;
        }
        let mut offsets = TopicPartitionList::new();
        for ((topic, partition), offset) in next {
            offsets.add_partition_offset(topic, partition, Offset::Offset(offset))?;
        }
        // Not awaited: a commit lost to a crash redelivers the batch, which
        // at-least-once allows.
        consumer.commit(&offsets, CommitMode::Async)?;
    }
    bail!("the consumer's stream ended")
}

// === SQS ===

/// The most messages one `ReceiveMessage` returns.
const SQS_BATCH: usize = 10;

async fn sqs_loop(args: &BareArgs, poster: &Poster) -> anyhow::Result<()> {
    let client = crate::servers::sqs_client().await;
    let url = crate::servers::sqs_queue_url(&client, &args.queue).await?;
    // Receives of 10 side by side, so that up to concurrency messages are
    // with the app at once.
    let receivers = (0..args.concurrency.max(1))
        .step_by(SQS_BATCH)
        .map(|first| (args.concurrency.max(1) - first).min(SQS_BATCH))
        .map(|size| sqs_receiver(&client, &url, size, poster));
    futures::future::try_join_all(receivers).await?;
    Ok(())
}

async fn sqs_receiver(
    client: &aws_sdk_sqs::Client,
    url: &str,
    size: usize,
    poster: &Poster,
) -> anyhow::Result<()> {
    use aws_sdk_sqs::types::DeleteMessageBatchRequestEntry;
    loop {
        // 20 s, the longest long poll SQS allows, is what AWS's guides and
        // most hand-written consumers use: the fewest (billed) empty
        // receives, and a message is returned as soon as it arrives anyway.
        let got = client
            .receive_message()
            .queue_url(url)
            .max_number_of_messages(size as i32)
            .wait_time_seconds(20)
            .message_attribute_names("All")
            .send()
            .await?;
        let messages = got.messages.unwrap_or_default();
        if messages.is_empty() {
            continue;
        }
        let posts = messages.iter().map(|m| async move {
            let body = Bytes::copy_from_slice(m.body().unwrap_or_default().as_bytes());
            let sent = m
                .message_attributes()
                .and_then(|a| a.get(SENT_HEADER))
                .and_then(|v| v.string_value());
            poster.post(body, sent.map(str::as_bytes)).await
        });
        let answers = futures::future::join_all(posts).await;
        let entries = messages
            .iter()
            .zip(answers)
            .enumerate()
            .filter(|(_, (_, ok))| *ok)
            .filter_map(|(i, (m, _))| {
                DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(m.receipt_handle()?)
                    .build()
                    .ok()
            })
            .collect::<Vec<_>>();
        if !entries.is_empty() {
            client
                .delete_message_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await?;
        }
    }
}

// === Pub/Sub ===

async fn pubsub_loop(args: &BareArgs, poster: &Poster) -> anyhow::Result<()> {
    use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
        AcknowledgeRequest, PullRequest, subscriber_client::SubscriberClient,
    };
    let project = args
        .url
        .as_deref()
        .and_then(|u| u.strip_prefix("pubsub://"))
        .context("--url pubsub://PROJECT is required for pubsub")?;
    let subscription = format!("projects/{project}/subscriptions/{}", args.queue);
    let mut subscriber = SubscriberClient::new(crate::servers::pubsub_channel().await?);
    loop {
        // Held by the server until a message comes (or it gives up and
        // answers empty): `return_immediately` is deprecated for that.
        #[allow(deprecated)]
        let request = PullRequest {
            subscription: subscription.clone(),
            return_immediately: false,
            max_messages: i32::try_from(args.concurrency).unwrap_or(i32::MAX),
        };
        let received = subscriber
            .pull(request)
            .await?
            .into_inner()
            .received_messages;
        if received.is_empty() {
            continue;
        }
        let posts = received.iter().map(|r| async move {
            let message = r.message.as_ref();
            let body = message.map(|m| m.data.clone()).unwrap_or_default();
            let sent = message.and_then(|m| m.attributes.get(SENT_HEADER));
            poster.post(body, sent.map(String::as_bytes)).await
        });
        let answers = futures::future::join_all(posts).await;
        let ack_ids: Vec<String> = received
            .into_iter()
            .zip(answers)
            .filter(|(_, ok)| *ok)
            .map(|(r, _)| r.ack_id)
            .collect();
        if !ack_ids.is_empty() {
            subscriber
                .acknowledge(AcknowledgeRequest {
                    subscription: subscription.clone(),
                    ack_ids,
                })
                .await?;
        }
    }
}
