//! NATS JetStream (`nats://[user:pass@]host:port`, async-nats).
//!
//! - `--queue` names the stream. It must exist (with `--create`, courier
//!   creates a work-queue stream capturing the subject of the same name).
//!   `--group` is a durable pull consumer, created on the first `receive`
//!   when missing, with explicit acks, `AckWait` = the visibility timeout
//!   (longer than the policy timeout) and no `MaxDeliver` or
//!   `MaxAckPending` limit: courier, not the server, decides when a message
//!   is done.
//! - A read is one pull request for up to the free slots, with `no_wait`
//!   and an expiry of a second: the server holds it until a message is
//!   there, delivers what the stream has, and ends it at once. Its answers
//!   come to one subscription the source keeps (each request on a reply
//!   subject of its own), so a read costs one publish, and a message sent
//!   to a request the reader stopped waiting for is handed out by the next
//!   read rather than lost until `AckWait`.
//! - Acks are `+ACK` publishes to the reply subject, queued to the
//!   connection's writer, which writes concurrent ones together; `close`
//!   flushes it.
//! - Deliveries still in flight get `+WPI` (in progress) every third of
//!   `AckWait`, so a policy timeout raised at run time does not make the
//!   server hand them out twice.
//! - A retry that uses up an attempt is a `Nak` with the decided delay: the
//!   attempt is `courier-attempt` (1 when absent) plus the deliveries
//!   JetStream counted. A retry that must *not* use up an attempt (the app
//!   was unreachable) cannot be a `Nak`, which JetStream counts. It is a copy
//!   published to the message's own subject with `courier-attempt` and
//!   `courier-retry-at` set, and the original is acked. The first delivery of
//!   a copy carrying `courier-retry-at` is never offered: it is `Nak`ed with
//!   the time still to wait, and the attempt formula subtracts that one
//!   delivery. So the delay is durable in the server and the count exact.
//! - Dead letters are published, with `Nats-Expected-Stream`, to the subject
//!   `<queue>.dlq` (or the policy's queue); the dead-letter stream capturing
//!   it is created on first use and named after the subject with every
//!   character a stream name cannot hold (`.`, `*`, `>`, `/`, `\`,
//!   whitespace) replaced by `_`: subject `orders.dlq`, stream `orders_dlq`.
//!   Once the server acknowledged the dead letter, the original is `Term`ed
//!   (and that is confirmed). A dead letter's id is its sequence in the
//!   dead-letter stream, and it records the original subject as
//!   `courier-subject`, where replay publishes it again.
//! - NATS header values cannot hold CR or LF: in dead-letter fields they
//!   become spaces.
//! - Depth: stream and consumer info. JetStream counts a `Nak`ed message as
//!   pending until it is redelivered, so the retry backlog is the
//!   consumer's pending count minus what the sources of this process hold.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use async_nats::connection::State;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::consumer::pull::{BatchConfig, Config as PullConfig};
use async_nats::jetstream::consumer::{AckPolicy, PullConsumer};
use async_nats::jetstream::context::Context;
use async_nats::jetstream::context::{
    ConsumerInfoError, ConsumerInfoErrorKind, CreateStreamError, CreateStreamErrorKind,
    GetStreamError, GetStreamErrorKind,
};
use async_nats::jetstream::message::{AckKind, StreamMessage};
use async_nats::jetstream::stream::{
    Config as StreamConfig, ConsumerError, ConsumerErrorKind, DeleteMessageError,
    DeleteMessageErrorKind, RawMessageError, RawMessageErrorKind, RetentionPolicy, StorageType,
};
use async_nats::jetstream::{self, Message};
use async_nats::{
    Client, ConnectErrorKind, ConnectOptions, HeaderMap, HeaderName, HeaderValue, StatusCode,
    Subscriber,
};
use async_trait::async_trait;
use bytes::Bytes;
use futures::{FutureExt, StreamExt};
use tokio::time::Instant;

use super::shared::{F_RETRY_AT, RECEIVE_WAIT, not_there, replace};
use super::{Broker, Capabilities, Depth, Source, SourceError, SourceOptions};
use crate::model::{
    DeadLetter, Delivery, F_FIRST_ATTEMPT_AT, Failure, PAYLOAD, parse_time, rfc3339,
};

/// The subject a message was published to; kept in dead letters for replay.
const F_SUBJECT: &str = "courier-subject";

/// Checks a `nats://` URL at start.
pub fn check_url(text: &str) -> Result<(), String> {
    async_nats::ServerAddr::from_str(text)
        .map(drop)
        .map_err(|e| {
            format!(
                "{}: {e}; write it like nats://host:4222 or nats://user:pass@host:4222",
                super::redact(text)
            )
        })
}

/// `%40` → `@`: URL user info is percent-encoded.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The stream that holds a dead-letter subject: stream names cannot hold
/// `.`, `*`, `>`, `/`, `\` or whitespace, so each becomes `_`.
pub fn dead_letter_stream(subject: &str) -> String {
    subject
        .chars()
        .map(|c| match c {
            '.' | '*' | '>' | '/' | '\\' => '_',
            c if c.is_whitespace() => '_',
            c => c,
        })
        .collect()
}

fn check_stream_name(name: &str) -> Result<(), SourceError> {
    if name.is_empty() || name != dead_letter_stream(name) {
        return Err(SourceError::Invalid(format!(
            "--queue {name:?} is not a JetStream stream name: it names the stream, and stream names cannot contain '.', '*', '>', '/', '\\' or whitespace"
        )));
    }
    Ok(())
}

/// A header value NATS can carry: no CR or LF.
fn header_value(value: &[u8]) -> HeaderValue {
    let text = String::from_utf8_lossy(value).replace(['\r', '\n'], " ");
    HeaderValue::from_str(&text).unwrap_or_default()
}

/// Fields as NATS headers; the body is returned apart. Names NATS cannot
/// carry are left out (the forwarder would drop them anyway), and so are
/// `Nats-*` headers, which steer the publish (a `Nats-Msg-Id` would make
/// JetStream drop a retry copy as a duplicate).
fn to_headers(fields: &[(Bytes, Bytes)]) -> (Bytes, HeaderMap) {
    let mut body = Bytes::new();
    let mut headers = HeaderMap::new();
    for (name, value) in fields {
        if name.as_ref() == PAYLOAD.as_bytes() {
            body = value.clone();
            continue;
        }
        let name = String::from_utf8_lossy(name);
        if name.to_ascii_lowercase().starts_with("nats-") {
            continue;
        }
        match HeaderName::from_str(&name) {
            Ok(n) => headers.append(n, header_value(value)),
            Err(_) => {
                tracing::debug!(header = %name, "a header name NATS cannot carry is left out")
            }
        }
    }
    (body, headers)
}

fn text(name: &HeaderName) -> &str {
    name.as_ref()
}

fn from_headers(payload: &Bytes, headers: Option<&HeaderMap>) -> Vec<(Bytes, Bytes)> {
    let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), payload.clone())];
    if let Some(headers) = headers {
        let mut named: Vec<_> = headers.iter().collect();
        named.sort_by(|(a, _), (b, _)| text(a).cmp(text(b)));
        for (name, values) in named {
            for value in values {
                fields.push((
                    Bytes::copy_from_slice(text(name).as_bytes()),
                    Bytes::copy_from_slice(value.as_str().as_bytes()),
                ));
            }
        }
    }
    fields
}

fn field<'a>(fields: &'a [(Bytes, Bytes)], name: &str) -> Option<&'a str> {
    fields
        .iter()
        .find(|(n, _)| n.as_ref() == name.as_bytes())
        .and_then(|(_, v)| std::str::from_utf8(v).ok())
}

fn unavailable(e: impl std::fmt::Display) -> SourceError {
    SourceError::Unavailable(format!("NATS: {e}"))
}

/// The JetStream error code an async-nats error carries, if any.
trait JsCode {
    fn code(&self) -> Option<ErrorCode>;
}

impl JsCode for GetStreamError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            GetStreamErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for CreateStreamError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            CreateStreamErrorKind::NotFound => Some(ErrorCode::STREAM_NOT_FOUND),
            CreateStreamErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for ConsumerError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            ConsumerErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for ConsumerInfoError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            ConsumerInfoErrorKind::NotFound => Some(ErrorCode::CONSUMER_NOT_FOUND),
            ConsumerInfoErrorKind::StreamNotFound => Some(ErrorCode::STREAM_NOT_FOUND),
            ConsumerInfoErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for RawMessageError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            RawMessageErrorKind::NoMessageFound => Some(ErrorCode::NO_MESSAGE_FOUND),
            RawMessageErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

impl JsCode for DeleteMessageError {
    fn code(&self) -> Option<ErrorCode> {
        match self.kind() {
            DeleteMessageErrorKind::JetStream(e) => Some(e.error_code()),
            _ => None,
        }
    }
}

fn js_code(e: &impl JsCode) -> Option<ErrorCode> {
    e.code()
}

/// What every source of this process on one consumer shares: deliveries
/// handed out and not yet settled.
fn held_counter(key: &str) -> Arc<AtomicI64> {
    static HELD: OnceLock<Mutex<HashMap<String, Arc<AtomicI64>>>> = OnceLock::new();
    HELD.get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .entry(key.to_string())
        .or_default()
        .clone()
}

// === Pull requests ===

/// One subscription, for the life of the source, that receives the answers
/// to all its pull requests; each request has a reply subject of its own
/// under it. async-nats' `fetch` and `batch` subscribe and unsubscribe for
/// every request, which costs two more protocol round trips per read, and
/// a message the server sent to a request the reader stopped waiting for
/// was lost with the dropped subscription (and counted as an attempt when
/// AckWait handed it out again). Here it waits for the next read.
struct Puller {
    subscriber: Subscriber,
    inbox: String,
    requests: u64,
}

impl Puller {
    /// Up to `max` messages: what earlier requests left, else one request
    /// that the server holds until a message arrives (at most `wait`) and
    /// ends as soon as it has delivered what the stream had (`no_wait` with
    /// `expires`). So a read is one publish and one answer, a message is
    /// handed out as soon as it is stored, and the request is over when the
    /// read returns (unless it gave up waiting for an answer).
    async fn pull(
        &mut self,
        consumer: &PullConsumer,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<async_nats::Message>, SourceError> {
        let mut got = Vec::new();
        while got.len() < max {
            match self.subscriber.next().now_or_never() {
                Some(Some(message)) if is_delivery(&message) => got.push(message),
                Some(Some(_)) => {}
                Some(None) => return Err(unavailable("the pull subscription ended")),
                None => break,
            }
        }
        if !got.is_empty() {
            return Ok(got);
        }
        self.requests += 1;
        let reply = format!("{}.{}", self.inbox, self.requests);
        let request = BatchConfig {
            batch: max,
            expires: Some(wait),
            no_wait: true,
            ..Default::default()
        };
        let sent = Instant::now();
        consumer
            .request_batch(request, reply.clone().into())
            .await
            .map_err(unavailable)?;
        // A request whose answer was lost with the connection must not hold
        // the reader forever.
        let deadline = sent + wait + Duration::from_secs(5);
        while got.len() < max {
            let message = match tokio::time::timeout_at(deadline, self.subscriber.next()).await {
                Ok(Some(message)) => message,
                Ok(None) => return Err(unavailable("the pull subscription ended")),
                Err(_) if got.is_empty() => {
                    return Err(unavailable("no answer to a pull request"));
                }
                Err(_) => break,
            };
            if is_delivery(&message) {
                got.push(message);
                continue;
            }
            // Status messages come on the request's own reply subject; one
            // on another is the end of an earlier request.
            if message.subject.as_str() != reply {
                continue;
            }
            match message.status {
                Some(StatusCode::IDLE_HEARTBEAT) => continue,
                Some(StatusCode::TIMEOUT | StatusCode::NOT_FOUND) => {
                    // An empty end before the wait is over means other
                    // readers' requests are waiting for the messages there
                    // are ("Requests Pending"): pause, or the dispatcher's
                    // next read would ask again at once, and again.
                    if got.is_empty() && sent.elapsed() < wait / 2 {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    break;
                }
                status if got.is_empty() => {
                    return Err(SourceError::Broker(format!(
                        "JetStream refused a pull request: {} {}",
                        status.map(|s| s.as_u16()).unwrap_or_default(),
                        message.description.unwrap_or_default()
                    )));
                }
                _ => break,
            }
        }
        Ok(got)
    }
}

/// A message from the stream, not a status about a pull request.
fn is_delivery(message: &async_nats::Message) -> bool {
    matches!(message.status, None | Some(StatusCode::OK))
}

// === The source ===

/// NATS JetStream: `nats://[user:pass@]host:port`.
pub const BROKER: Broker = Broker {
    name: "nats",
    schemes: &["nats"],
    url_form: "nats://host:port",
    check_url,
    open: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(NatsSource::connect(url.as_str(), options).await?) as Arc<dyn Source>)
        })
    },
};

pub struct NatsSource {
    client: Client,
    js: Context,
    options: SourceOptions,
    /// Where `send` publishes: the stream's first subject without wildcards.
    send_subject: Option<String>,
    replicas: usize,
    /// Shared, not cloned per read: its cached info is a deep structure.
    consumer: tokio::sync::Mutex<Option<Arc<PullConsumer>>>,
    /// Receipts (reply subjects) in flight, with their stream sequence.
    in_flight: Arc<Mutex<HashMap<String, u64>>>,
    /// When messages this source retried with `Nak` were first offered, by
    /// stream sequence: a `Nak` cannot carry `courier-first-attempt-at`.
    first_attempts: Mutex<HashMap<u64, SystemTime>>,
    held: Arc<AtomicI64>,
    /// Created on the first read.
    puller: tokio::sync::Mutex<Option<Puller>>,
    dead_letter_streams: Mutex<Vec<String>>,
    progress: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

impl NatsSource {
    pub async fn connect(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let redacted = super::redact(url);
        check_stream_name(&options.queue)?;
        let addr = async_nats::ServerAddr::from_str(url)
            .map_err(|e| SourceError::Invalid(format!("--source {redacted}: {e}")))?;
        // async-nats does not read credentials from the URL itself.
        let connect = match (addr.username(), addr.password()) {
            (Some(user), Some(pass)) => {
                ConnectOptions::with_user_and_password(percent_decode(user), percent_decode(pass))
            }
            (Some(token), None) => ConnectOptions::with_token(percent_decode(token)),
            _ => ConnectOptions::new(),
        };
        let client = connect
            .name(format!("courier {} ({})", options.consumer, options.queue))
            .ping_interval(Duration::from_secs(10))
            .connection_timeout(Duration::from_secs(5))
            .max_reconnects(None)
            .connect(url)
            .await
            .map_err(|e| match e.kind() {
                ConnectErrorKind::AuthorizationViolation | ConnectErrorKind::Authentication => {
                    SourceError::Broker(format!(
                        "NATS at {redacted} refused the credentials ({e}); check the user and password in --source"
                    ))
                }
                ConnectErrorKind::ServerParse => {
                    SourceError::Invalid(format!("--source {redacted}: {e}"))
                }
                _ => SourceError::Unavailable(format!("{redacted}: {e}")),
            })?;
        let js = jetstream::new(client.clone());
        let info = match js.get_stream(&options.queue).await {
            Ok(mut stream) => stream.info().await.map_err(unavailable)?.clone(),
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) && options.create => {
                let config = StreamConfig {
                    name: options.queue.clone(),
                    subjects: vec![options.queue.clone()],
                    retention: RetentionPolicy::WorkQueue,
                    storage: StorageType::File,
                    ..Default::default()
                };
                js.create_stream(config).await.map_err(|e| {
                    SourceError::Broker(format!("cannot create stream {:?}: {e}", options.queue))
                })?;
                let mut stream = js.get_stream(&options.queue).await.map_err(unavailable)?;
                stream.info().await.map_err(unavailable)?.clone()
            }
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => {
                return Err(SourceError::Invalid(format!(
                    "stream {:?} does not exist on {redacted}; create it (nats stream add {} --subjects {}), or start `courier run` with --create to create a work-queue stream capturing subject {:?}",
                    options.queue, options.queue, options.queue, options.queue
                )));
            }
            Err(e) => {
                return Err(SourceError::Unavailable(format!(
                    "{redacted}: cannot read stream {:?} ({e}); is JetStream enabled (nats-server -js)?",
                    options.queue
                )));
            }
        };
        let send_subject = info
            .config
            .subjects
            .iter()
            .find(|s| !s.split('.').any(|t| t == "*" || t == ">"))
            .cloned();
        let held = held_counter(&format!("{}/{}/{}", redacted, options.queue, options.group));
        Ok(Self {
            client,
            js,
            send_subject,
            replicas: info.config.num_replicas.max(1),
            consumer: tokio::sync::Mutex::new(None),
            in_flight: Arc::default(),
            first_attempts: Mutex::new(HashMap::new()),
            held,
            puller: tokio::sync::Mutex::new(None),
            dead_letter_streams: Mutex::new(Vec::new()),
            progress: Mutex::new(None),
            options,
        })
    }

    /// The durable consumer, created when missing; starts the in-progress
    /// ticker for its `AckWait`.
    async fn consumer(&self) -> Result<Arc<PullConsumer>, SourceError> {
        let mut slot = self.consumer.lock().await;
        if let Some(c) = slot.as_ref() {
            return Ok(c.clone());
        }
        let stream = self
            .js
            .get_stream_no_info(&self.options.queue)
            .await
            .map_err(unavailable)?;
        let mut consumer: PullConsumer = match stream.consumer_info(&self.options.group).await {
            Ok(_) => stream
                .get_consumer(&self.options.group)
                .await
                .map_err(unavailable)?,
            Err(e) if js_code(&e) == Some(ErrorCode::CONSUMER_NOT_FOUND) => {
                let config = PullConfig {
                    durable_name: Some(self.options.group.clone()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: self.options.visibility_timeout,
                    max_deliver: -1,
                    max_ack_pending: -1,
                    ..Default::default()
                };
                stream.create_consumer(config).await.map_err(|e| {
                    SourceError::Broker(format!(
                        "cannot create the durable consumer {:?} on stream {:?}: {e}",
                        self.options.group, self.options.queue
                    ))
                })?
            }
            Err(e) => return Err(unavailable(e)),
        };
        let info = consumer.info().await.map_err(unavailable)?;
        if info.config.ack_policy != AckPolicy::Explicit {
            return Err(SourceError::Invalid(format!(
                "consumer {:?} on stream {:?} does not use explicit acks; courier needs AckPolicy explicit (delete it and let courier create it)",
                self.options.group, self.options.queue
            )));
        }
        let ack_wait = info.config.ack_wait;
        self.start_progress(ack_wait);
        let consumer = Arc::new(consumer);
        *slot = Some(consumer.clone());
        Ok(consumer)
    }

    /// Sends `+WPI` for every delivery in flight, every third of `AckWait`,
    /// so none runs out of it however long the app takes.
    fn start_progress(&self, ack_wait: Duration) {
        let every = (ack_wait / 3).max(Duration::from_millis(500));
        let (client, in_flight) = (self.client.clone(), self.in_flight.clone());
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                let due: Vec<String> = in_flight
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .keys()
                    .cloned()
                    .collect();
                for receipt in due {
                    let _ = client.publish(receipt, AckKind::Progress.into()).await;
                }
            }
        });
        if let Some(old) = self
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .replace(task)
        {
            old.abort();
        }
    }

    fn hand_out(&self, receipt: &str, sequence: u64) {
        self.in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(receipt.to_string(), sequence);
        self.held.fetch_add(1, Ordering::SeqCst);
    }

    /// This delivery is settled; when `done`, the message is too.
    fn settled(&self, receipt: &str, done: bool) {
        let held = self
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(receipt);
        if let Some(sequence) = held {
            self.held.fetch_sub(1, Ordering::SeqCst);
            if done {
                self.first_attempts
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&sequence);
            }
        }
    }

    /// An ack the server confirms (`AckSync`).
    async fn confirmed(&self, receipt: &str, kind: AckKind) -> Result<(), SourceError> {
        self.client
            .request(receipt.to_string(), kind.into())
            .await
            .map(drop)
            .map_err(|e| {
                SourceError::Unavailable(format!(
                    "NATS did not confirm the settlement ({e}); the message is handed out again after AckWait"
                ))
            })
    }

    /// Turns a delivery into one for the app, or makes the first delivery
    /// of a waiting copy wait.
    async fn admit(&self, message: Message) -> Result<Option<Delivery>, SourceError> {
        let info = message.info().map_err(|e| {
            SourceError::Broker(format!("a message without JetStream metadata: {e}"))
        })?;
        let (sequence, delivered) = (info.stream_sequence, info.delivered.max(1) as u32);
        let Some(receipt) = message.reply.as_ref().map(|r| r.to_string()) else {
            return Err(SourceError::Broker(
                "a message without a reply subject".into(),
            ));
        };
        let fields = from_headers(&message.payload, message.headers.as_ref());
        let waits = field(&fields, F_RETRY_AT).and_then(|t| parse_time(t.as_bytes()));
        if let Some(at) = waits
            && delivered == 1
        {
            let delay = at.duration_since(SystemTime::now()).unwrap_or_default();
            self.client
                .publish(receipt, AckKind::Nak(Some(delay)).into())
                .await
                .map_err(unavailable)?;
            return Ok(None);
        }
        let mut fields = replace(fields, F_SUBJECT, message.subject.to_string());
        let extra = delivered - 1 - u32::from(waits.is_some());
        if field(&fields, F_FIRST_ATTEMPT_AT).is_none() {
            let mut first = self
                .first_attempts
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if extra == 0 {
                first.insert(sequence, SystemTime::now());
            } else {
                // Another replica or an earlier run offered it first: the
                // time it was stored is the closest bound known.
                let at = first
                    .get(&sequence)
                    .copied()
                    .unwrap_or_else(|| SystemTime::from(info.published));
                fields.push((F_FIRST_ATTEMPT_AT.into(), Bytes::from(rfc3339(at))));
            }
        }
        self.hand_out(&receipt, sequence);
        Ok(Some(Delivery::from_fields(
            &sequence.to_string(),
            fields,
            extra,
            receipt,
        )))
    }

    /// The dead-letter stream for a subject, created on first use with the
    /// work stream's replica count.
    async fn dead_letter_stream(&self, subject: &str) -> Result<String, SourceError> {
        let name = dead_letter_stream(subject);
        if self
            .dead_letter_streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&name)
        {
            return Ok(name);
        }
        match self.js.get_stream(&name).await {
            Ok(_) => {}
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => {
                let config = StreamConfig {
                    name: name.clone(),
                    subjects: vec![subject.to_string()],
                    storage: StorageType::File,
                    num_replicas: self.replicas,
                    ..Default::default()
                };
                if let Err(e) = self.js.create_stream(config).await {
                    let overlap = js_code(&e) == Some(ErrorCode::STREAM_SUBJECT_OVERLAP);
                    return Err(if overlap {
                        SourceError::Invalid(format!(
                            "the dead-letter subject {subject:?} is already captured by another stream (the work stream's subjects may cover it); name another deadLetterQueue in the policy"
                        ))
                    } else {
                        SourceError::Broker(format!(
                            "cannot create the dead-letter stream {name:?}: {e}"
                        ))
                    });
                }
            }
            Err(e) => return Err(unavailable(e)),
        }
        self.dead_letter_streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(name.clone());
        Ok(name)
    }

    /// Publishes to `subject` and waits for the stream `stream` to store it.
    async fn publish(
        &self,
        subject: &str,
        stream: &str,
        fields: &[(Bytes, Bytes)],
    ) -> Result<u64, SourceError> {
        let (body, mut headers) = to_headers(fields);
        headers.insert("Nats-Expected-Stream", stream);
        let ack = self
            .js
            .publish_with_headers(subject.to_string(), headers, body)
            .await
            .map_err(|e| SourceError::Broker(format!("publishing to {subject:?}: {e}")))?
            .await
            .map_err(|e| {
                SourceError::Broker(format!(
                    "JetStream did not store the message for {subject:?}: {e}"
                ))
            })?;
        Ok(ack.sequence)
    }

    async fn stored(&self, stream: &str, id: &str) -> Result<Option<StreamMessage>, SourceError> {
        let Ok(sequence) = id.parse::<u64>() else {
            return Err(SourceError::Invalid(format!(
                "{id:?} is not a dead-letter id of NATS (a stream sequence number)"
            )));
        };
        let stream = match self.js.get_stream(stream).await {
            Ok(s) => s,
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => return Ok(None),
            Err(e) => return Err(unavailable(e)),
        };
        match stream.get_raw_message(sequence).await {
            Ok(m) => Ok(Some(m)),
            Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => Ok(None),
            Err(e) => Err(unavailable(e)),
        }
    }
}

#[async_trait]
impl Source for NatsSource {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: true,
            out_of_order_acks: true,
            dead_letter_browsing: true,
            dedup: false,
            byte_bounded_reads: false,
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        let consumer = self.consumer().await?;
        let got = {
            let mut puller = self.puller.lock().await;
            if puller.is_none() {
                let inbox = self.client.new_inbox();
                let subscriber = self
                    .client
                    .subscribe(format!("{inbox}.*"))
                    .await
                    .map_err(unavailable)?;
                *puller = Some(Puller {
                    subscriber,
                    inbox,
                    requests: 0,
                });
            }
            // A consumer someone else created may cap what one request asks.
            let limits = &consumer.cached_info().config;
            let mut max = max.max(1);
            if limits.max_batch > 0 {
                max = max.min(limits.max_batch as usize);
            }
            let mut wait = RECEIVE_WAIT;
            if !limits.max_expires.is_zero() {
                wait = wait.min(limits.max_expires);
            }
            let puller = puller.as_mut().expect("created above");
            puller.pull(&consumer, max, wait).await?
        };
        let mut out = Vec::with_capacity(got.len());
        for message in got {
            let message = Message {
                message,
                context: self.js.clone(),
            };
            if let Some(d) = self.admit(message).await? {
                out.push(d);
            }
        }
        Ok(out)
    }

    async fn ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        // Queued to the connection's writer, which writes what concurrent
        // deliveries queued together; `close` flushes it. An ack lost with
        // the connection only means a redelivery.
        let result = self
            .client
            .publish(delivery.receipt.clone(), AckKind::Ack.into())
            .await
            .map_err(unavailable);
        self.settled(&delivery.receipt, true);
        result
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let receipt = &delivery.receipt;
        if next_attempt > delivery.attempt {
            let delay = at.duration_since(SystemTime::now()).unwrap_or_default();
            let result = self
                .client
                .publish(receipt.clone(), AckKind::Nak(Some(delay)).into())
                .await
                .map_err(unavailable);
            self.settled(receipt, false);
            return result;
        }
        // The attempt is not used up: a copy that remembers the attempt.
        let fields = delivery.fields_for_retry(next_attempt, first_attempt_at);
        let fields = replace(fields, F_RETRY_AT, rfc3339(at));
        let subject = field(&fields, F_SUBJECT)
            .map(str::to_string)
            .or_else(|| self.send_subject.clone())
            .unwrap_or_else(|| self.options.queue.clone());
        let result = async {
            self.publish(&subject, &self.options.queue, &fields).await?;
            self.confirmed(receipt, AckKind::Ack).await
        }
        .await;
        self.settled(receipt, true);
        result
    }

    async fn dead_letter(&self, delivery: &Delivery, failure: &Failure) -> Result<(), SourceError> {
        let receipt = &delivery.receipt;
        let result = async {
            let subject = &failure.dead_letter_queue;
            let stream = self.dead_letter_stream(subject).await?;
            let fields = delivery.fields_for_dead_letter(failure);
            let fields: Vec<_> = fields
                .into_iter()
                .filter(|(n, _)| n.as_ref() != F_RETRY_AT.as_bytes())
                .collect();
            self.publish(subject, &stream, &fields).await?;
            self.confirmed(receipt, AckKind::Term).await
        }
        .await;
        self.settled(receipt, true);
        result
    }

    async fn depth(&self) -> Result<Depth, SourceError> {
        let stream = self
            .js
            .get_stream_no_info(&self.options.queue)
            .await
            .map_err(unavailable)?;
        let stream_info = stream.get_info().await.map_err(unavailable)?;
        let (ready, ack_pending) = match stream.consumer_info(&self.options.group).await {
            Ok(info) => (info.num_pending, info.num_ack_pending as u64),
            Err(e) if js_code(&e) == Some(ErrorCode::CONSUMER_NOT_FOUND) => {
                (stream_info.state.messages, 0)
            }
            Err(e) => return Err(unavailable(e)),
        };
        let held = (self.held.load(Ordering::SeqCst).max(0) as u64).min(ack_pending);
        let dlq = dead_letter_stream(&self.options.dead_letter_queue);
        let (dead_letters, oldest_dead_letter_age) = match self.js.get_stream(&dlq).await {
            Ok(s) => {
                let state = &s.cached_info().state;
                let age = (state.messages > 0).then(|| {
                    SystemTime::now()
                        .duration_since(SystemTime::from(state.first_timestamp))
                        .unwrap_or_default()
                });
                (state.messages, age)
            }
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => (0, None),
            Err(e) => return Err(unavailable(e)),
        };
        Ok(Depth {
            ready,
            pending: held,
            retry_backlog: ack_pending - held,
            dead_letters,
            oldest_dead_letter_age,
        })
    }

    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let name = dead_letter_stream(dead_letter_queue);
        let stream = match self.js.get_stream(&name).await {
            Ok(s) => s,
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => return Ok(Vec::new()),
            Err(e) => return Err(unavailable(e)),
        };
        let state = stream.cached_info().state.clone();
        let mut out = Vec::new();
        let mut next = state.first_sequence;
        while out.len() < limit && state.messages > 0 && next <= state.last_sequence {
            let got = stream
                .raw_message_builder()
                .sequence(next)
                .next_by_subject(dead_letter_queue.to_string())
                .send()
                .await;
            let message = match got {
                Ok(m) => m,
                Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => break,
                Err(e) => return Err(unavailable(e)),
            };
            next = message.sequence + 1;
            out.push(DeadLetter::from_fields(
                message.sequence.to_string(),
                from_headers(&message.payload, Some(&message.headers)),
            ));
        }
        Ok(out)
    }

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let name = dead_letter_stream(dead_letter_queue);
        let stored = self
            .stored(&name, &letter.id)
            .await?
            .ok_or_else(|| not_there(dead_letter_queue, &letter.id))?;
        let stored = DeadLetter::from_fields(
            stored.sequence.to_string(),
            from_headers(&stored.payload, Some(&stored.headers)),
        );
        let subject = stored
            .field(F_SUBJECT)
            .map(str::to_string)
            .or_else(|| self.send_subject.clone())
            .ok_or_else(|| {
                SourceError::Invalid(format!(
                    "dead letter {} does not record its subject and stream {:?} has no subject without wildcards to publish to",
                    letter.id, self.options.queue
                ))
            })?;
        self.publish(&subject, &self.options.queue, &stored.fields_for_replay())
            .await?;
        let stream = self
            .js
            .get_stream_no_info(&name)
            .await
            .map_err(unavailable)?;
        match stream
            .delete_message(letter.id.parse().unwrap_or_default())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => {
                Err(not_there(dead_letter_queue, &letter.id))
            }
            Err(e) => Err(unavailable(e)),
        }
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        let name = dead_letter_stream(dead_letter_queue);
        if self.stored(&name, &letter.id).await?.is_none() {
            return Err(not_there(dead_letter_queue, &letter.id));
        }
        let stream = self
            .js
            .get_stream_no_info(&name)
            .await
            .map_err(unavailable)?;
        match stream
            .delete_message(letter.id.parse().unwrap_or_default())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => {
                Err(not_there(dead_letter_queue, &letter.id))
            }
            Err(e) => Err(unavailable(e)),
        }
    }

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        let subject = self.send_subject.clone().ok_or_else(|| {
            SourceError::Invalid(format!(
                "stream {:?} has only wildcard subjects; publish with a NATS client to a subject it captures",
                self.options.queue
            ))
        })?;
        let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), body)];
        fields.extend(
            headers
                .iter()
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        let sequence = self.publish(&subject, &self.options.queue, &fields).await?;
        Ok(sequence.to_string())
    }

    async fn close(&self) {
        if let Some(task) = self
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            task.abort();
        }
        let _ = self.client.flush().await;
    }

    fn connected(&self) -> bool {
        self.client.connection_state() == State::Connected
    }
}

impl Drop for NatsSource {
    fn drop(&mut self) {
        if let Some(task) = self
            .progress
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
        {
            task.abort();
        }
        let held = self
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .count();
        self.held.fetch_sub(held as i64, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_credentials_are_percent_decoded() {
        assert_eq!(percent_decode("p%40ss%2Fword"), "p@ss/word");
        assert_eq!(percent_decode("plain%"), "plain%");
    }

    #[test]
    fn dead_letter_streams_have_no_dots() {
        assert_eq!(dead_letter_stream("orders.dlq"), "orders_dlq");
        assert_eq!(dead_letter_stream("a.*.b>"), "a___b_");
        assert_eq!(dead_letter_stream("failed orders"), "failed_orders");
        assert!(check_stream_name("orders").is_ok());
        assert!(check_stream_name("orders.v1").is_err());
    }

    #[test]
    fn headers_round_trip_and_drop_what_nats_cannot_carry() {
        let fields = vec![
            (Bytes::from("payload"), Bytes::from_static(&[0, 255])),
            (Bytes::from("content-type"), Bytes::from("text/plain")),
            (
                Bytes::from("courier-response-excerpt"),
                Bytes::from("a\r\nb"),
            ),
            (Bytes::from("Nats-Msg-Id"), Bytes::from("dedupe-me")),
            (Bytes::from("bad:name"), Bytes::from("x")),
        ];
        let (body, headers) = to_headers(&fields);
        assert_eq!(body, Bytes::from_static(&[0, 255]));
        let back = from_headers(&body, Some(&headers));
        assert_eq!(field(&back, "content-type"), Some("text/plain"));
        assert_eq!(field(&back, "courier-response-excerpt"), Some("a  b"));
        assert_eq!(field(&back, "Nats-Msg-Id"), None);
        assert_eq!(back.len(), 3);
    }
}
