//! RabbitMQ (AMQP 0-9-1, `amqp://user:pass@host:port/vhost`, lapin).
//!
//! - `--queue` is a queue that must exist (classic or quorum, with whatever
//!   arguments it was declared with): courier only declares it passively and
//!   creates it, durable and without arguments, when `--create` is given.
//! - One connection with three channels: a consumer channel (manual acks,
//!   prefetch = `--concurrency`), a publisher channel in confirm mode, and an
//!   admin channel for declares. Frames are at most 16 KiB (lapin's buffers
//!   are 64 frames). Consuming starts on the first `receive`, so
//!   `courier send` and `courier dlq` never take messages.
//! - An ack is one `basic.ack` frame without a broker reply, written as soon
//!   as the app answered: acks from concurrent deliveries are pipelined by
//!   the connection's writer. `multiple` acks are never used: deliveries
//!   finish out of order, and a multiple ack would also settle an earlier
//!   delivery whose retry or dead letter is still being written.
//! - A retry is published (with confirm) to a delay tier `<queue>.retry.<d>`,
//!   a queue with `x-message-ttl = d` whose dead letters go back to the work
//!   queue through the default exchange; then the delivery is acked. Every
//!   message in a tier has the same TTL, so they expire in order at the head
//!   (per-message TTL would block behind a longer one). The tier is the
//!   shortest one not shorter than the delay, so a retry is never early and
//!   at most one tier step late. A delay longer than the longest tier (24h)
//!   carries `courier-retry-at` and is sent round the longest tier again when
//!   it comes back early. Tiers are declared on first use.
//! - The attempt number and the original id travel as headers
//!   (`courier-attempt`, `courier-message-id`). A redelivery the broker made
//!   (a crash or a lost connection mid-delivery) counts as an attempt: from
//!   `x-delivery-count` on quorum queues; on classic queues, which only flag
//!   `redelivered`, the message is first re-published with the attempt
//!   advanced, so a message that kills the sidecar still reaches its dead
//!   letter.
//! - A dead letter is published (with confirm) to `<queue>.dlq` (declared on
//!   first use when missing), then the delivery is acked.
//! - Listing dead letters gets them without ack on a channel of its own and
//!   closes it, which puts them back where they were; replay and purge find
//!   the letter the same way and ack only that one. A dead letter's id is
//!   the `message_id` courier gave it.
//! - Depth: passive declares (ready messages of the work queue, the
//!   dead-letter queue, each tier). AMQP does not report unacknowledged
//!   messages, so `pending` counts what the sources of this process hold.
//! - A lost connection is re-opened on the next call; deliveries from the
//!   old one can no longer be settled and the broker hands them out again.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use futures::StreamExt;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions,
    BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::uri::AMQPUri;
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ErrorKind};
use tokio::sync::mpsc;

use super::shared::{F_RETRY_AT, RECEIVE_WAIT, replace, without};
use super::{Broker, Capabilities, Depth, Source, SourceError, SourceOptions};
use crate::duration;
use crate::model::{
    DeadLetter, Delivery, F_ATTEMPT, F_LAST_ATTEMPT_AT, F_MESSAGE_ID, Failure, PAYLOAD, parse_time,
    rfc3339,
};

/// How long opening a connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest frame courier proposes (RabbitMQ's default is 128 KiB). lapin
/// keeps a read and a write ring buffer of 32 frames per connection, and
/// when RabbitMQ tunes 128 KiB it grows both to 4 MiB by zero-filling them:
/// 8 MiB resident from the start, a third of courier's memory. At 16 KiB
/// they are 1 MiB at most. A bigger body is split into more frames, 8 bytes
/// of overhead each. `?frame_max=` in `--source` overrides it.
const FRAME_MAX: u32 = 16 * 1024;
const CONTENT_TYPE: &str = "content-type";

/// Delay tiers: each is at most 2.5 times the one before, so a retry is late
/// by less than one tier step.
const TIERS_MS: &[u64] = &[
    10, 20, 50, 100, 200, 500, 1_000, 2_000, 4_000, 8_000, 15_000, 30_000, 60_000, 120_000,
    240_000, 480_000, 900_000, 1_800_000, 3_600_000, 7_200_000, 14_400_000, 28_800_000, 43_200_000,
    86_400_000,
];

/// Headers RabbitMQ adds when it dead-letters or redelivers; they describe
/// courier's own tier hops, not the producer's message.
fn is_broker_header(name: &str) -> bool {
    name == "x-death"
        || name == "x-delivery-count"
        || name == "x-received-from"
        || name.starts_with("x-first-death-")
        || name.starts_with("x-last-death-")
}

/// Checks an `amqp://` / `amqps://` URL at start, so a typo is a usage error.
pub fn check_url(text: &str) -> Result<(), String> {
    AMQPUri::from_str(text).map(drop).map_err(|e| {
        format!(
            "{}: {e}; write it like amqp://user:pass@host:5672/vhost (%2f for the vhost /)",
            super::redact(text)
        )
    })
}

/// The tier for a delay: the shortest not shorter than it, else the longest.
fn tier_for(delay: Duration) -> Duration {
    let ms = delay.as_millis();
    let tier = TIERS_MS
        .iter()
        .copied()
        .find(|t| u128::from(*t) >= ms)
        .unwrap_or(TIERS_MS[TIERS_MS.len() - 1]);
    Duration::from_millis(tier)
}

fn tier_queue(queue: &str, tier: Duration) -> String {
    format!("{queue}.retry.{}", duration::format(tier))
}

fn new_id() -> String {
    format!("{:032x}", rand::random::<u128>())
}

// === Process-wide bookkeeping ===

/// What every source of this process on one broker queue shares: deliveries
/// held unacked (AMQP does not report them) and the tiers known to exist.
#[derive(Default)]
struct QueueState {
    unacked: AtomicI64,
    tiers: Mutex<BTreeSet<u64>>,
}

fn queue_state(key: &str) -> Arc<QueueState> {
    static STATES: OnceLock<Mutex<HashMap<String, Arc<QueueState>>>> = OnceLock::new();
    STATES
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key.to_string())
        .or_default()
        .clone()
}

// === Errors ===

fn is_soft(e: &lapin::Error, which: AMQPSoftError) -> bool {
    matches!(e.kind(), ErrorKind::ProtocolError(p) if p.kind() == &AMQPErrorKind::Soft(which))
}

fn broker_error(e: lapin::Error) -> SourceError {
    match e.kind() {
        ErrorKind::ProtocolError(p) => SourceError::Broker(format!("RabbitMQ: {p}")),
        _ => SourceError::Unavailable(e.to_string()),
    }
}

/// How long one broker operation may take before the connection is given
/// up: an answer lost with a connection must not stall deliveries forever.
const OPERATION_TIMEOUT: Duration = Duration::from_secs(30);

enum Timed {
    Broker(lapin::Error),
    TimedOut,
}

impl From<Timed> for SourceError {
    fn from(e: Timed) -> Self {
        match e {
            Timed::Broker(e) => broker_error(e),
            Timed::TimedOut => SourceError::Unavailable(format!(
                "RabbitMQ did not answer within {OPERATION_TIMEOUT:?}"
            )),
        }
    }
}

async fn timed<T>(op: impl Future<Output = lapin::Result<T>>) -> Result<T, Timed> {
    match tokio::time::timeout(OPERATION_TIMEOUT, op).await {
        Ok(result) => result.map_err(Timed::Broker),
        Err(_) => Err(Timed::TimedOut),
    }
}

fn short(text: &str) -> Result<ShortString, SourceError> {
    ShortString::try_new(text).map_err(|_| {
        SourceError::Invalid(format!(
            "{text:?} is longer than the 255 bytes AMQP allows for a name"
        ))
    })
}

fn lost() -> SourceError {
    SourceError::Unavailable(
        "the connection this delivery came on was lost; RabbitMQ hands the message out again"
            .into(),
    )
}

// === Messages ===

/// An AMQP header value as text; tables and arrays have no text form and
/// are left out.
fn value_bytes(value: &AMQPValue) -> Option<Bytes> {
    Some(match value {
        AMQPValue::LongString(s) => Bytes::copy_from_slice(s.as_bytes()),
        AMQPValue::ShortString(s) => Bytes::copy_from_slice(s.as_str().as_bytes()),
        AMQPValue::ByteArray(b) => Bytes::copy_from_slice(b.as_slice()),
        AMQPValue::Boolean(b) => Bytes::from(b.to_string()),
        AMQPValue::ShortShortInt(v) => Bytes::from(v.to_string()),
        AMQPValue::ShortShortUInt(v) => Bytes::from(v.to_string()),
        AMQPValue::ShortInt(v) => Bytes::from(v.to_string()),
        AMQPValue::ShortUInt(v) => Bytes::from(v.to_string()),
        AMQPValue::LongInt(v) => Bytes::from(v.to_string()),
        AMQPValue::LongUInt(v) => Bytes::from(v.to_string()),
        AMQPValue::LongLongInt(v) => Bytes::from(v.to_string()),
        AMQPValue::Float(v) => Bytes::from(v.to_string()),
        AMQPValue::Double(v) => Bytes::from(v.to_string()),
        AMQPValue::Timestamp(v) => Bytes::from(v.to_string()),
        AMQPValue::DecimalValue(d) => {
            Bytes::from((f64::from(d.value) / 10f64.powi(i32::from(d.scale))).to_string())
        }
        AMQPValue::FieldArray(_) | AMQPValue::FieldTable(_) | AMQPValue::Void => return None,
    })
}

fn header<'a>(properties: &'a BasicProperties, name: &str) -> Option<&'a AMQPValue> {
    properties.headers().as_ref()?.inner().get(name)
}

fn header_text(properties: &BasicProperties, name: &str) -> Option<String> {
    header(properties, name)
        .and_then(value_bytes)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

fn header_u32(properties: &BasicProperties, name: &str) -> Option<u32> {
    match header(properties, name)? {
        AMQPValue::LongLongInt(v) => u32::try_from(*v).ok(),
        AMQPValue::LongInt(v) => u32::try_from(*v).ok(),
        AMQPValue::LongUInt(v) => Some(*v),
        other => std::str::from_utf8(&value_bytes(other)?).ok()?.parse().ok(),
    }
}

/// A message as courier's fields: `payload`, `content-type`, then the
/// headers (broker bookkeeping left out).
fn fields_of(delivery: &AmqpDelivery) -> Vec<(Bytes, Bytes)> {
    let props = &delivery.properties;
    let mut fields = vec![(
        Bytes::from_static(PAYLOAD.as_bytes()),
        Bytes::copy_from_slice(&delivery.data),
    )];
    if let Some(ct) = props.content_type() {
        fields.push((
            Bytes::from_static(CONTENT_TYPE.as_bytes()),
            Bytes::copy_from_slice(ct.as_str().as_bytes()),
        ));
    }
    if let Some(headers) = props.headers() {
        for (name, value) in headers {
            if is_broker_header(name.as_str()) {
                continue;
            }
            if let Some(value) = value_bytes(value) {
                fields.push((Bytes::copy_from_slice(name.as_str().as_bytes()), value));
            }
        }
    }
    fields
}

/// The properties and body to publish for `fields`: the content type
/// becomes the property, every other field a header, and of the original
/// properties those that describe the message are kept (not `expiration`,
/// which would expire a retry early, nor `user-id`, which RabbitMQ checks
/// against the publishing user).
fn message_for(
    fields: &[(Bytes, Bytes)],
    original: Option<&BasicProperties>,
    message_id: &str,
) -> (Vec<u8>, BasicProperties) {
    let mut props = BasicProperties::default().with_delivery_mode(2);
    if let Some(o) = original {
        if let Some(v) = o.content_encoding() {
            props = props.with_content_encoding(v.clone());
        }
        if let Some(v) = o.correlation_id() {
            props = props.with_correlation_id(v.clone());
        }
        if let Some(v) = o.reply_to() {
            props = props.with_reply_to(v.clone());
        }
        if let Some(v) = o.kind() {
            props = props.with_type(v.clone());
        }
        if let Some(v) = o.app_id() {
            props = props.with_app_id(v.clone());
        }
        if let Some(v) = o.priority() {
            props = props.with_priority(*v);
        }
        if let Some(v) = o.timestamp() {
            props = props.with_timestamp(*v);
        }
    }
    if let Ok(id) = ShortString::try_new(message_id) {
        props = props.with_message_id(id);
    }
    let mut body = Vec::new();
    let mut headers = FieldTable::default();
    for (name, value) in fields {
        let name = String::from_utf8_lossy(name);
        if name == PAYLOAD {
            body = value.to_vec();
            continue;
        }
        if name.eq_ignore_ascii_case(CONTENT_TYPE)
            && let Ok(ct) = std::str::from_utf8(value)
            && let Ok(ct) = ShortString::try_new(ct)
        {
            props = props.with_content_type(ct);
            continue;
        }
        if let Ok(name) = ShortString::try_new(name.as_ref()) {
            headers.insert(name, AMQPValue::LongString(value.to_vec().into()));
        }
    }
    (body, props.with_headers(headers))
}

/// A stable id for a dead letter someone else wrote without a `message_id`.
fn content_id(fields: &[(Bytes, Bytes)]) -> String {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for (n, v) in fields {
        for byte in n.iter().chain(b"\0").chain(v.iter()).chain(b"\0") {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("fnv-{hash:016x}")
}

fn dead_letter_of(delivery: &AmqpDelivery) -> DeadLetter {
    let fields = fields_of(delivery);
    let id = delivery
        .properties
        .message_id()
        .as_ref()
        .map(|id| id.to_string())
        .unwrap_or_else(|| content_id(&fields));
    DeadLetter::from_fields(id, fields)
}

// === The connection ===

/// One connection and its channels; replaced as a whole when anything on it
/// fails, because the broker then requeues what it held anyway.
struct Session {
    generation: u64,
    connection: Connection,
    consume: Channel,
    publish: Channel,
    admin: tokio::sync::Mutex<Option<Channel>>,
    /// Deliveries the pump took from the consumer, in order.
    inbox: tokio::sync::Mutex<Option<mpsc::UnboundedReceiver<AmqpDelivery>>>,
    consumer_tag: Mutex<Option<ShortString>>,
    pump: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Queues known to exist on this connection.
    declared: Mutex<HashSet<String>>,
    /// Delivery tags handed to courier and not yet settled.
    outstanding: Arc<Mutex<HashSet<u64>>>,
    broken: Arc<AtomicBool>,
    state: Arc<QueueState>,
}

impl Session {
    fn healthy(&self) -> bool {
        !self.broken.load(Ordering::SeqCst)
            && self.connection.status().connected()
            && self.consume.status().connected()
            && self.publish.status().connected()
    }

    /// Marks the session unusable when an error came from the connection or
    /// one of its long-lived channels (both close on any error).
    fn fail(&self, e: lapin::Error) -> SourceError {
        self.broken.store(true, Ordering::SeqCst);
        broker_error(e)
    }

    /// A settled delivery is no longer counted as pending.
    fn settled(&self, tag: u64) {
        if self
            .outstanding
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&tag)
        {
            self.state.unacked.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Gives up the connection; the broker requeues whatever it held.
    fn retire(&self) {
        self.broken.store(true, Ordering::SeqCst);
        if let Some(pump) = self.pump.lock().unwrap_or_else(|e| e.into_inner()).take() {
            pump.abort();
        }
        let held = std::mem::take(&mut *self.outstanding.lock().unwrap_or_else(|e| e.into_inner()));
        self.state
            .unacked
            .fetch_sub(held.len() as i64, Ordering::SeqCst);
        let (consume, publish) = (self.consume.clone(), self.publish.clone());
        tokio::spawn(async move {
            let _ = consume.close(200, "courier reconnects".into()).await;
            let _ = publish.close(200, "courier reconnects".into()).await;
        });
    }

    async fn admin(&self) -> Result<Channel, SourceError> {
        let mut admin = self.admin.lock().await;
        if let Some(channel) = admin.as_ref().filter(|c| c.status().connected()) {
            return Ok(channel.clone());
        }
        let channel = self
            .connection
            .create_channel()
            .await
            .map_err(|e| self.fail(e))?;
        *admin = Some(channel.clone());
        Ok(channel)
    }

    /// Forgets the admin channel after an error: the broker closed it.
    async fn drop_admin(&self) {
        *self.admin.lock().await = None;
    }

    /// Message count of a queue, or `None` when it does not exist.
    async fn passive_count(&self, queue: &str) -> Result<Option<u32>, SourceError> {
        let channel = self.admin().await?;
        let options = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        match timed(channel.queue_declare(short(queue)?, options, FieldTable::default())).await {
            Ok(q) => {
                self.known(queue);
                Ok(Some(q.message_count()))
            }
            Err(e) => {
                self.drop_admin().await;
                match e {
                    Timed::Broker(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => Ok(None),
                    e => Err(e.into()),
                }
            }
        }
    }

    fn known(&self, queue: &str) {
        self.declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.to_string());
    }

    fn is_known(&self, queue: &str) -> bool {
        self.declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(queue)
    }

    /// Declares a queue courier owns (a tier, a dead-letter queue), durable.
    async fn declare(&self, queue: &str, arguments: FieldTable) -> Result<(), SourceError> {
        if self.is_known(queue) {
            return Ok(());
        }
        let channel = self.admin().await?;
        let declared =
            timed(channel.queue_declare(short(queue)?, QueueDeclareOptions::durable(), arguments))
                .await;
        if let Err(e) = declared {
            self.drop_admin().await;
            return Err(SourceError::Broker(format!(
                "cannot declare queue {queue:?}: {}",
                SourceError::from(e)
            )));
        }
        self.known(queue);
        Ok(())
    }

    /// A dead-letter queue: used as it is when it exists (classic or quorum),
    /// else declared durable. Checked once per connection, so depth polls do
    /// not probe a missing queue (which closes a channel) again and again.
    async fn ensure_dead_letter_queue(&self, queue: &str) -> Result<(), SourceError> {
        if self.is_known(queue) || self.passive_count(queue).await?.is_some() {
            return Ok(());
        }
        self.declare(queue, FieldTable::default()).await
    }

    /// A queue that must exist; one that is missing is declared durable with
    /// no arguments when `create`, an error otherwise.
    async fn require(&self, queue: &str, create: bool, vhost: &str) -> Result<(), SourceError> {
        if self.is_known(queue) || self.passive_count(queue).await?.is_some() {
            return Ok(());
        }
        if create {
            return self.declare(queue, FieldTable::default()).await;
        }
        Err(SourceError::Invalid(format!(
            "queue {queue:?} does not exist in vhost {vhost:?}; declare it (classic or quorum, durable), or start `courier run` with --create to declare a durable classic queue"
        )))
    }

    /// Publishes through the default exchange and waits for the broker's
    /// confirm; an unroutable message (a queue deleted meanwhile) is an error.
    async fn publish(
        &self,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), SourceError> {
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let routing_key = short(queue)?;
        let published = timed(async {
            self.publish
                .basic_publish("".into(), routing_key, options, body, properties)
                .await?
                .await
        })
        .await;
        let confirm = published.map_err(|e| {
            self.broken.store(true, Ordering::SeqCst);
            SourceError::from(e)
        })?;
        match confirm {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(returned)) => {
                self.declared
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(queue);
                Err(SourceError::Broker(format!(
                    "RabbitMQ could not route the message to queue {queue:?} ({} {})",
                    returned.reply_code, returned.reply_text
                )))
            }
            Confirmation::Nack(_) => Err(SourceError::Broker(format!(
                "RabbitMQ refused to store the message for queue {queue:?} (publisher nack)"
            ))),
        }
    }

    async fn ack(&self, tag: u64) -> Result<(), SourceError> {
        self.consume
            .basic_ack(tag, BasicAckOptions { multiple: false })
            .await
            .map_err(|e| self.fail(e))?;
        self.settled(tag);
        Ok(())
    }
}

// === The source ===

/// RabbitMQ: `amqp://user:pass@host:port/vhost` (`amqps://` for TLS).
pub const BROKER: Broker = Broker {
    name: "amqp",
    schemes: &["amqp", "amqps"],
    url_form: "amqp://user:pass@host:port/vhost",
    check_url,
    open: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(AmqpSource::connect(url.as_str(), options).await?) as Arc<dyn Source>)
        })
    },
};

pub struct AmqpSource {
    uri: AMQPUri,
    redacted: String,
    options: SourceOptions,
    state: Arc<QueueState>,
    session: Mutex<Option<Arc<Session>>>,
    connecting: tokio::sync::Mutex<()>,
    generation: AtomicU64,
    /// Set by the first `receive`: this source consumes, and keeps doing so
    /// on every new connection.
    consuming: AtomicBool,
    /// Original properties of deliveries in flight, for re-publishing them.
    properties: Mutex<HashMap<String, BasicProperties>>,
}

impl AmqpSource {
    pub async fn connect(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let mut uri = AMQPUri::from_str(url)
            .map_err(|e| SourceError::Invalid(format!("--source {}: {e}", super::redact(url))))?;
        // A peer that vanishes without closing the socket is noticed within
        // two heartbeats.
        uri.query.heartbeat.get_or_insert(10);
        uri.query.connection_timeout.get_or_insert(5_000);
        uri.query.frame_max.get_or_insert(FRAME_MAX);
        short(&options.queue)?;
        let key = format!(
            "{}:{}/{}/{}",
            uri.authority.host, uri.authority.port, uri.vhost, options.queue
        );
        let source = Self {
            uri,
            redacted: super::redact(url),
            state: queue_state(&key),
            options,
            session: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(()),
            generation: AtomicU64::new(0),
            consuming: AtomicBool::new(false),
            properties: Mutex::new(HashMap::new()),
        };
        source.session().await?;
        Ok(source)
    }

    fn current(&self) -> Option<Arc<Session>> {
        self.session
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The live session, opening a new one when the last was lost.
    async fn session(&self) -> Result<Arc<Session>, SourceError> {
        if let Some(s) = self.current().filter(|s| s.healthy()) {
            return Ok(s);
        }
        let _one_at_a_time = self.connecting.lock().await;
        if let Some(s) = self.current() {
            if s.healthy() {
                return Ok(s);
            }
            s.retire();
            *self.session.lock().unwrap_or_else(|e| e.into_inner()) = None;
            tracing::warn!(source = %self.redacted, queue = %self.options.queue, "the connection to RabbitMQ was lost; reconnecting");
        }
        let session = Arc::new(self.open_session().await?);
        *self.session.lock().unwrap_or_else(|e| e.into_inner()) = Some(session.clone());
        if self.consuming.load(Ordering::SeqCst)
            && let Err(e) = self.start_consuming(&session).await
        {
            session.retire();
            return Err(e);
        }
        Ok(session)
    }

    async fn open_session(&self) -> Result<Session, SourceError> {
        let properties = ConnectionProperties::default().with_connection_name(
            format!("courier {} ({})", self.options.consumer, self.options.queue).into(),
        );
        let connection = tokio::time::timeout(
            CONNECT_TIMEOUT,
            Connection::connect_uri(self.uri.clone(), properties),
        )
        .await
        .map_err(|_| {
            SourceError::Unavailable(format!(
                "{}: no answer within {CONNECT_TIMEOUT:?}",
                self.redacted
            ))
        })?
        .map_err(|e| self.connect_error(e))?;
        let consume = connection
            .create_channel()
            .await
            .map_err(|e| self.connect_error(e))?;
        let publish = connection
            .create_channel()
            .await
            .map_err(|e| self.connect_error(e))?;
        publish
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(broker_error)?;
        let session = Session {
            generation: self.generation.fetch_add(1, Ordering::SeqCst) + 1,
            connection,
            consume,
            publish,
            admin: tokio::sync::Mutex::new(None),
            inbox: tokio::sync::Mutex::new(None),
            consumer_tag: Mutex::new(None),
            pump: Mutex::new(None),
            declared: Mutex::new(HashSet::new()),
            outstanding: Arc::default(),
            broken: Arc::default(),
            state: self.state.clone(),
        };
        if let Err(e) = session
            .require(&self.options.queue, self.options.create, &self.uri.vhost)
            .await
        {
            session.retire();
            return Err(e);
        }
        Ok(session)
    }

    fn connect_error(&self, e: lapin::Error) -> SourceError {
        let user = &self.uri.authority.userinfo.username;
        match e.kind() {
            ErrorKind::ProtocolError(p)
                if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)) =>
            {
                SourceError::Broker(format!(
                    "RabbitMQ at {} refused the login of user {user:?} ({p}); check the user name and password in --source",
                    self.redacted
                ))
            }
            ErrorKind::ProtocolError(p)
                if matches!(p.kind(), AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)) =>
            {
                SourceError::Broker(format!(
                    "RabbitMQ at {} does not let user {user:?} into vhost {:?} ({p}); check the vhost in --source (%2f is /) and the user's permissions",
                    self.redacted, self.uri.vhost
                ))
            }
            ErrorKind::ProtocolError(p) => {
                SourceError::Broker(format!("RabbitMQ at {}: {p}", self.redacted))
            }
            _ => SourceError::Unavailable(format!("{}: {e}", self.redacted)),
        }
    }

    /// Starts the consumer and the task that moves its deliveries to the
    /// inbox, counting each as held.
    async fn start_consuming(&self, session: &Session) -> Result<(), SourceError> {
        let prefetch = self.options.max_in_flight.clamp(1, usize::from(u16::MAX)) as u16;
        session
            .consume
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| session.fail(e))?;
        let mut consumer = session
            .consume
            .basic_consume(
                short(&self.options.queue)?,
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| session.fail(e))?;
        *session
            .consumer_tag
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = Some(consumer.tag());
        let (tx, rx) = mpsc::unbounded_channel();
        let (outstanding, broken, state) = (
            session.outstanding.clone(),
            session.broken.clone(),
            session.state.clone(),
        );
        let queue = self.options.queue.clone();
        let pump = tokio::spawn(async move {
            while let Some(item) = consumer.next().await {
                match item {
                    Ok(delivery) => {
                        outstanding
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .insert(delivery.delivery_tag);
                        state.unacked.fetch_add(1, Ordering::SeqCst);
                        if tx.send(delivery).is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, %queue, "the RabbitMQ consumer failed");
                        break;
                    }
                }
            }
            broken.store(true, Ordering::SeqCst);
        });
        *session.pump.lock().unwrap_or_else(|e| e.into_inner()) = Some(pump);
        *session.inbox.lock().await = Some(rx);
        Ok(())
    }

    /// The session a receipt belongs to, if it is still the live one.
    fn session_for(&self, receipt: &str) -> Result<(Arc<Session>, u64), SourceError> {
        let (generation, tag) = receipt
            .split_once(':')
            .and_then(|(g, t)| Some((g.parse::<u64>().ok()?, t.parse::<u64>().ok()?)))
            .ok_or_else(|| SourceError::Broker(format!("bad receipt {receipt:?}")))?;
        let session = self
            .current()
            .filter(|s| s.generation == generation && s.healthy())
            .ok_or_else(lost)?;
        Ok((session, tag))
    }

    fn take_properties(&self, receipt: &str) -> Option<BasicProperties> {
        self.properties
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(receipt)
    }

    /// Publishes `fields` to `queue` (after the delay of `tier`, when given),
    /// then acks the delivery `tag`.
    async fn move_to(
        &self,
        session: &Session,
        tag: u64,
        tier: Option<Duration>,
        fields: &[(Bytes, Bytes)],
        original: Option<&BasicProperties>,
        message_id: &str,
    ) -> Result<(), SourceError> {
        let target = match tier {
            Some(tier) => {
                let name = tier_queue(&self.options.queue, tier);
                if !session.is_known(&name) {
                    let mut args = FieldTable::default();
                    args.insert(
                        "x-message-ttl".into(),
                        AMQPValue::LongLongInt(tier.as_millis() as i64),
                    );
                    args.insert(
                        "x-dead-letter-exchange".into(),
                        AMQPValue::LongString("".into()),
                    );
                    args.insert(
                        "x-dead-letter-routing-key".into(),
                        AMQPValue::LongString(self.options.queue.clone().into()),
                    );
                    session.declare(&name, args).await?;
                    self.state
                        .tiers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(tier.as_millis() as u64);
                }
                name
            }
            None => self.options.queue.clone(),
        };
        let (body, properties) = message_for(fields, original, message_id);
        session.publish(&target, &body, properties).await?;
        session.ack(tag).await
    }

    /// Schedules `fields` for delivery at `at`.
    async fn schedule(
        &self,
        session: &Session,
        tag: u64,
        fields: Vec<(Bytes, Bytes)>,
        original: Option<&BasicProperties>,
        message_id: &str,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let delay = at.duration_since(SystemTime::now()).unwrap_or_default();
        let mut fields = without(fields, F_RETRY_AT);
        let tier = (!delay.is_zero()).then(|| tier_for(delay));
        if tier.is_some_and(|t| t < delay) {
            fields.push((F_RETRY_AT.into(), Bytes::from(rfc3339(at))));
        }
        self.move_to(session, tag, tier, &fields, original, message_id)
            .await
    }

    /// Turns what the broker delivered into a delivery for the app, or deals
    /// with it here: a long retry that came back early goes round a tier
    /// again, and a classic-queue redelivery is re-published with the
    /// attempt advanced first.
    async fn admit(
        &self,
        session: &Session,
        delivery: AmqpDelivery,
    ) -> Result<Option<Delivery>, SourceError> {
        let props = &delivery.properties;
        let tag = delivery.delivery_tag;
        let fields = fields_of(&delivery);
        let message_id = header_text(props, F_MESSAGE_ID)
            .or_else(|| props.message_id().as_ref().map(|id| id.to_string()))
            .unwrap_or_else(new_id);
        if let Some(at) = header_text(props, F_RETRY_AT).and_then(|t| parse_time(t.as_bytes()))
            && at.duration_since(SystemTime::now()).unwrap_or_default()
                >= Duration::from_millis(TIERS_MS[0])
        {
            self.schedule(session, tag, fields, Some(props), &message_id, at)
                .await?;
            return Ok(None);
        }
        self.learn_tiers(props);
        let quorum_count = header_u32(props, "x-delivery-count");
        if delivery.redelivered && quorum_count.is_none() {
            let attempt = header_u32(props, F_ATTEMPT).unwrap_or(1).max(1);
            let fields = replace(fields, F_ATTEMPT, (attempt + 1).to_string());
            let fields = replace(fields, F_MESSAGE_ID, message_id.clone());
            tracing::info!(id = %message_id, attempt, queue = %self.options.queue, "a delivery was never settled (crash or lost connection); it counts as an attempt");
            self.move_to(session, tag, None, &fields, Some(props), &message_id)
                .await?;
            return Ok(None);
        }
        let receipt = format!("{}:{tag}", session.generation);
        let out = Delivery::from_fields(
            &message_id,
            fields,
            quorum_count.unwrap_or(0),
            receipt.clone(),
        );
        self.properties
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(receipt, delivery.properties);
        Ok(Some(out))
    }

    /// Tiers this process did not declare (another replica did, or an
    /// earlier run) show in the `x-death` header of the messages they send
    /// back; from then on they count in the retry backlog.
    fn learn_tiers(&self, props: &BasicProperties) {
        let Some(AMQPValue::FieldArray(deaths)) = header(props, "x-death") else {
            return;
        };
        let prefix = format!("{}.retry.", self.options.queue);
        for death in deaths.as_slice() {
            let AMQPValue::FieldTable(death) = death else {
                continue;
            };
            let Some(queue) = death.inner().get("queue").and_then(value_bytes) else {
                continue;
            };
            let queue = String::from_utf8_lossy(&queue);
            let Some(tier) = queue.strip_prefix(&prefix) else {
                continue;
            };
            if let Some(ms) = TIERS_MS
                .iter()
                .find(|ms| duration::format(Duration::from_millis(**ms)) == tier)
            {
                self.state
                    .tiers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(*ms);
            }
        }
    }

    /// Gets up to `limit` messages of a queue without acking them, on a
    /// channel of their own; closing it puts them back where they were.
    async fn browse(
        &self,
        queue: &str,
        limit: usize,
        mut stop_at: impl FnMut(&AmqpDelivery) -> bool,
    ) -> Result<(Channel, Vec<AmqpDelivery>), SourceError> {
        let session = self.session().await?;
        let channel = session
            .connection
            .create_channel()
            .await
            .map_err(|e| session.fail(e))?;
        let mut out = Vec::new();
        while out.len() < limit {
            let got = channel
                .basic_get(short(queue)?, BasicGetOptions { no_ack: false })
                .await;
            match got {
                Ok(Some(message)) => {
                    let stop = stop_at(&message.delivery);
                    out.push(message.delivery);
                    if stop {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => break,
                Err(e) => return Err(broker_error(e)),
            }
        }
        Ok((channel, out))
    }

    /// Finds a dead letter by id, lets `then` act on it, acks it, and puts
    /// the others back.
    async fn take_dead_letter<F, Fut>(
        &self,
        dead_letter_queue: &str,
        id: &str,
        then: F,
    ) -> Result<(), SourceError>
    where
        F: FnOnce(AmqpDelivery) -> Fut,
        Fut: Future<Output = Result<AmqpDelivery, SourceError>>,
    {
        let (channel, mut got) = self
            .browse(dead_letter_queue, usize::MAX, |d| {
                dead_letter_of(d).id == id
            })
            .await?;
        let found = match got.last() {
            Some(d) if dead_letter_of(d).id == id => got.pop(),
            _ => None,
        };
        let result = match found {
            Some(letter) => match then(letter).await {
                Ok(letter) => letter
                    .acker
                    .ack(BasicAckOptions { multiple: false })
                    .await
                    .map(drop)
                    .map_err(broker_error),
                Err(e) => Err(e),
            },
            None => Err(SourceError::Invalid(format!(
                "dead letter {id} is not in {dead_letter_queue} (already replayed or purged?)"
            ))),
        };
        let _ = channel.close(200, "done".into()).await;
        result
    }

    async fn oldest_dead_letter_age(
        &self,
        session: &Session,
    ) -> Result<Option<Duration>, SourceError> {
        let channel = session.admin().await?;
        let got = timed(channel.basic_get(
            short(&self.options.dead_letter_queue)?,
            BasicGetOptions { no_ack: false },
        ))
        .await;
        let message = match got {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(None),
            Err(e) => {
                session.drop_admin().await;
                return match e {
                    Timed::Broker(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => Ok(None),
                    e => Err(e.into()),
                };
            }
        };
        let props = &message.delivery.properties;
        let at = header_text(props, F_LAST_ATTEMPT_AT)
            .and_then(|t| parse_time(t.as_bytes()))
            .or_else(|| {
                props
                    .timestamp()
                    .map(|s| UNIX_EPOCH + Duration::from_secs(s))
            });
        let requeued = channel
            .basic_nack(
                message.delivery.delivery_tag,
                BasicNackOptions {
                    multiple: false,
                    requeue: true,
                },
            )
            .await;
        if let Err(e) = requeued {
            session.drop_admin().await;
            return Err(broker_error(e));
        }
        Ok(at.map(|t| SystemTime::now().duration_since(t).unwrap_or_default()))
    }
}

#[async_trait]
impl Source for AmqpSource {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: false,
            out_of_order_acks: true,
            dead_letter_browsing: true,
            dedup: false,
            byte_bounded_reads: false,
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let session = self.session().await?;
        if !self.consuming.swap(true, Ordering::SeqCst)
            && let Err(e) = self.start_consuming(&session).await
        {
            self.consuming.store(false, Ordering::SeqCst);
            return Err(e);
        }
        let mut batch = Vec::new();
        {
            let mut inbox = session.inbox.lock().await;
            let Some(rx) = inbox.as_mut() else {
                session.broken.store(true, Ordering::SeqCst);
                return Err(SourceError::Unavailable(
                    "the consumer is not running".into(),
                ));
            };
            match tokio::time::timeout(RECEIVE_WAIT, rx.recv()).await {
                Err(_) => return Ok(Vec::new()),
                Ok(None) => {
                    session.broken.store(true, Ordering::SeqCst);
                    return Err(SourceError::Unavailable(
                        "the RabbitMQ consumer stopped (connection lost or queue deleted); reconnecting".into(),
                    ));
                }
                Ok(Some(d)) => batch.push(d),
            }
            while batch.len() < max.max(1) {
                match rx.try_recv() {
                    Ok(d) => batch.push(d),
                    Err(_) => break,
                }
            }
        }
        let mut out = Vec::with_capacity(batch.len());
        for delivery in batch {
            match self.admit(&session, delivery).await {
                Ok(Some(d)) => out.push(d),
                Ok(None) => {}
                // What was taken and not handed out is requeued by the
                // broker when the broken connection is replaced.
                Err(e) => {
                    session.broken.store(true, Ordering::SeqCst);
                    for d in &out {
                        self.take_properties(&d.receipt);
                    }
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        self.take_properties(&delivery.receipt);
        let (session, tag) = self.session_for(&delivery.receipt)?;
        session.ack(tag).await
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let original = self.take_properties(&delivery.receipt);
        let (session, tag) = self.session_for(&delivery.receipt)?;
        let fields = delivery.fields_for_retry(next_attempt, first_attempt_at);
        self.schedule(
            &session,
            tag,
            fields,
            original.as_ref(),
            &delivery.message.id,
            at,
        )
        .await
    }

    async fn dead_letter(&self, delivery: &Delivery, failure: &Failure) -> Result<(), SourceError> {
        let original = self.take_properties(&delivery.receipt);
        let (session, tag) = self.session_for(&delivery.receipt)?;
        let dlq = &failure.dead_letter_queue;
        session.ensure_dead_letter_queue(dlq).await?;
        let fields = without(delivery.fields_for_dead_letter(failure), F_RETRY_AT);
        let (body, mut properties) = message_for(&fields, original.as_ref(), &new_id());
        properties = properties.with_timestamp(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
        );
        session.publish(dlq, &body, properties).await?;
        session.ack(tag).await
    }

    async fn depth(&self) -> Result<Depth, SourceError> {
        let session = self.session().await?;
        let ready = session.passive_count(&self.options.queue).await?;
        session
            .ensure_dead_letter_queue(&self.options.dead_letter_queue)
            .await?;
        let dead_letters = session
            .passive_count(&self.options.dead_letter_queue)
            .await?
            .unwrap_or(0);
        let tiers: Vec<u64> = self
            .state
            .tiers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect();
        let mut retry_backlog = 0u64;
        for ms in tiers {
            let name = tier_queue(&self.options.queue, Duration::from_millis(ms));
            match session.passive_count(&name).await? {
                Some(n) => retry_backlog += u64::from(n),
                None => {
                    self.state
                        .tiers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&ms);
                }
            }
        }
        let oldest_dead_letter_age = if dead_letters > 0 {
            self.oldest_dead_letter_age(&session).await?
        } else {
            None
        };
        Ok(Depth {
            ready: u64::from(ready.unwrap_or(0)),
            pending: self.state.unacked.load(Ordering::SeqCst).max(0) as u64,
            retry_backlog,
            dead_letters: u64::from(dead_letters),
            oldest_dead_letter_age,
        })
    }

    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let (channel, got) = self.browse(dead_letter_queue, limit, |_| false).await?;
        let letters = got.iter().map(dead_letter_of).collect();
        let _ = channel.close(200, "listed".into()).await;
        Ok(letters)
    }

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let session = self.session().await?;
        session
            .require(&self.options.queue, false, &self.uri.vhost)
            .await?;
        self.take_dead_letter(dead_letter_queue, &letter.id, |found| async {
            let stored = dead_letter_of(&found);
            let fields = stored.fields_for_replay();
            let id = stored
                .field(F_MESSAGE_ID)
                .map(str::to_string)
                .unwrap_or_else(new_id);
            let (body, properties) = message_for(&fields, Some(&found.properties), &id);
            session
                .publish(&self.options.queue, &body, properties)
                .await?;
            Ok(found)
        })
        .await
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        self.take_dead_letter(dead_letter_queue, &letter.id, |found| async { Ok(found) })
            .await
    }

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        let session = self.session().await?;
        session
            .require(&self.options.queue, false, &self.uri.vhost)
            .await?;
        let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), body)];
        fields.extend(
            headers
                .iter()
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        let id = new_id();
        let (body, properties) = message_for(&fields, None, &id);
        let properties = properties.with_timestamp(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
        );
        session
            .publish(&self.options.queue, &body, properties)
            .await?;
        Ok(id)
    }

    /// Stops consuming and gives back, without counting an attempt, what
    /// was prefetched and never offered to the app; then closes.
    async fn close(&self) {
        let Some(session) = self.current() else {
            return;
        };
        let tag = session
            .consumer_tag
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(tag) = tag
            && session.healthy()
        {
            let _ = session
                .consume
                .basic_cancel(tag, BasicCancelOptions::default())
                .await;
            let pump = session
                .pump
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            if let Some(pump) = pump {
                let _ = tokio::time::timeout(Duration::from_secs(1), pump).await;
            }
            let mut inbox = session.inbox.lock().await;
            if let Some(rx) = inbox.as_mut() {
                while let Ok(d) = rx.try_recv() {
                    let fields = fields_of(&d);
                    let id = d
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.to_string())
                        .unwrap_or_else(new_id);
                    let given_back = self
                        .move_to(
                            &session,
                            d.delivery_tag,
                            None,
                            &fields,
                            Some(&d.properties),
                            &id,
                        )
                        .await;
                    if let Err(e) = given_back {
                        tracing::warn!(error = %e, "giving back prefetched messages failed; RabbitMQ requeues them");
                        break;
                    }
                }
            }
        }
        session.retire();
        let _ = session.connection.close(200, "courier stops".into()).await;
        *self.session.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn connected(&self) -> bool {
        self.current().is_some_and(|s| s.healthy())
    }
}

impl Drop for AmqpSource {
    fn drop(&mut self) {
        if let Some(session) = self.current() {
            session.broken.store(true, Ordering::SeqCst);
            if let Some(pump) = session
                .pump
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
            {
                pump.abort();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_are_never_shorter_and_at_most_one_step_longer() {
        for ms in [1u64, 10, 11, 49, 50, 51, 999, 1_000, 1_001, 3_000, 299_999] {
            let delay = Duration::from_millis(ms);
            let tier = tier_for(delay);
            assert!(tier >= delay, "{ms}ms went to {tier:?}");
            let i = TIERS_MS
                .iter()
                .position(|t| *t == tier.as_millis() as u64)
                .unwrap();
            assert!(i == 0 || TIERS_MS[i - 1] < ms, "{ms}ms skipped a tier");
        }
        assert_eq!(
            tier_for(Duration::from_secs(3 * 86_400)),
            Duration::from_secs(86_400)
        );
        for pair in TIERS_MS.windows(2) {
            assert!(pair[1] * 2 <= pair[0] * 5, "{pair:?}");
        }
        assert_eq!(
            tier_queue("orders", Duration::from_secs(120)),
            "orders.retry.2m"
        );
    }

    #[test]
    fn urls() {
        assert!(check_url("amqp://guest:guest@127.0.0.1:5672/%2f").is_ok());
        assert!(check_url("amqps://u:p@rabbit.example/prod").is_ok());
        let err = check_url("amqp://u:secret@host:port/").unwrap_err();
        assert!(!err.contains("secret"), "{err}");
    }

    #[test]
    fn messages_round_trip_through_properties() {
        let fields = vec![
            (Bytes::from("payload"), Bytes::from_static(&[0, 255, 1])),
            (Bytes::from("content-type"), Bytes::from("application/json")),
            (Bytes::from("traceparent"), Bytes::from("00-a-b-01")),
            (Bytes::from("courier-attempt"), Bytes::from("2")),
        ];
        let (body, props) = message_for(&fields, None, "id-1");
        assert_eq!(body, vec![0, 255, 1]);
        assert_eq!(
            props.content_type().as_ref().map(|c| c.as_str()),
            Some("application/json")
        );
        assert_eq!(
            props.message_id().as_ref().map(|c| c.as_str()),
            Some("id-1")
        );
        assert_eq!(header_u32(&props, "courier-attempt"), Some(2));
        assert_eq!(
            header_text(&props, "traceparent").as_deref(),
            Some("00-a-b-01")
        );
        assert!(header(&props, "content-type").is_none());
    }

    #[test]
    fn broker_bookkeeping_is_not_a_header() {
        assert!(is_broker_header("x-death"));
        assert!(is_broker_header("x-first-death-queue"));
        assert!(!is_broker_header("x-tenant"));
    }
}
