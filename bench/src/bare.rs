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
    /// redis, amqp, nats or embedded.
    #[arg(long)]
    pub source: String,
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
