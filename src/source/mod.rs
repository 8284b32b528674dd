//! Sources: one trait, one file per broker.
//!
//! A source hands out [`Delivery`]s and settles them: ack, durable retry at a
//! time, or dead-letter with failure metadata. Every source stores a message
//! the same way: a list of fields where `payload` is the body, `courier-*`
//! fields are courier's bookkeeping, and every other field is a message
//! header. That keeps the meaning of a message identical across brokers.

pub mod amqp;
pub mod embedded;
pub mod nats;
pub mod redis;
mod wire;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use crate::policy::DeadLetterReason;

pub use wire::{decode_fields, encode_fields};

/// Field that carries the body.
pub const PAYLOAD: &str = "payload";
/// The broker id of the original message; kept across retries and replays.
pub const F_MESSAGE_ID: &str = "courier-message-id";
/// The attempt number of the next delivery.
pub const F_ATTEMPT: &str = "courier-attempt";
pub const F_FIRST_ATTEMPT_AT: &str = "courier-first-attempt-at";
pub const F_LAST_ATTEMPT_AT: &str = "courier-last-attempt-at";
pub const F_REASON: &str = "courier-reason";
pub const F_STATUS: &str = "courier-status";
pub const F_ERROR: &str = "courier-error";
pub const F_ATTEMPTS: &str = "courier-attempts";
pub const F_QUEUE: &str = "courier-queue";
pub const F_EXCERPT: &str = "courier-response-excerpt";
pub const F_POLICY: &str = "courier-policy";
/// Deliveries since the message was last stored, for sources that count
/// unsettled deliveries themselves (the embedded queue).
pub const F_DELIVERIES: &str = "courier-deliveries";
/// How often a message was sent back from the dead-letter queue.
pub const F_REPLAYS: &str = "courier-replays";

/// Bookkeeping that describes one stored copy and never outlives it.
fn is_transient_bookkeeping(name: &[u8]) -> bool {
    matches!(
        name,
        b"courier-message-id"
            | b"courier-attempt"
            | b"courier-first-attempt-at"
            | b"courier-deliveries"
    )
}

// === Messages and deliveries ===

/// A message as the app will see it: id, body, headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The broker's id of the original message.
    pub id: String,
    pub body: Bytes,
    /// Producer headers, in the order they were stored.
    pub headers: Vec<(String, String)>,
}

impl Message {
    /// A header by name, ignoring case.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// One delivery of a message, with what the source needs to settle it.
#[derive(Debug, Clone)]
pub struct Delivery {
    pub message: Message,
    /// 1 on the first delivery, +1 on each later one.
    pub attempt: u32,
    /// When the message was first offered to the app, if it has been.
    pub first_attempt_at: Option<SystemTime>,
    /// Why this entry cannot be offered to the app at all (a Redis entry
    /// without `payload`, say); it is dead-lettered as `undeliverable`.
    pub problem: Option<String>,
    /// Source-specific handle used to settle this delivery.
    pub receipt: String,
    /// Every stored field, for sources that re-store the message on retry.
    fields: Vec<(Bytes, Bytes)>,
}

impl Delivery {
    /// Reads a stored message: `payload` is the body, `courier-*` fields are
    /// bookkeeping, the rest are headers. `extra_attempts` counts deliveries
    /// the broker made that courier never settled (a crash mid-flight).
    pub fn from_fields(
        fallback_id: &str,
        fields: Vec<(Bytes, Bytes)>,
        extra_attempts: u32,
        receipt: String,
    ) -> Self {
        let mut body = None;
        let mut id = None;
        let mut attempt = 1u32;
        let mut first_attempt_at = None;
        let mut headers = Vec::new();
        for (name, value) in &fields {
            let name = String::from_utf8_lossy(name);
            match name.as_ref() {
                PAYLOAD => body = Some(value.clone()),
                F_MESSAGE_ID => id = Some(String::from_utf8_lossy(value).into_owned()),
                F_ATTEMPT => attempt = parse_text(value).unwrap_or(1).max(1),
                F_FIRST_ATTEMPT_AT => first_attempt_at = parse_time(value),
                n if n.to_ascii_lowercase().starts_with("courier-") => {}
                _ => headers.push((
                    name.into_owned(),
                    String::from_utf8_lossy(value).into_owned(),
                )),
            }
        }
        let problem = body
            .is_none()
            .then(|| format!("the entry has no {PAYLOAD:?} field; a producer writes XADD <queue> * payload <body> [header value ...]"));
        Self {
            message: Message {
                id: id.unwrap_or_else(|| fallback_id.to_string()),
                body: body.unwrap_or_default(),
                headers,
            },
            attempt: attempt.saturating_add(extra_attempts),
            first_attempt_at,
            problem,
            receipt,
            fields,
        }
    }

    /// The fields to store when this message is scheduled for `next_attempt`.
    pub fn fields_for_retry(
        &self,
        next_attempt: u32,
        first_attempt_at: SystemTime,
    ) -> Vec<(Bytes, Bytes)> {
        let mut out: Vec<(Bytes, Bytes)> = self
            .fields
            .iter()
            .filter(|(n, _)| !is_transient_bookkeeping(n))
            .cloned()
            .collect();
        out.push((F_MESSAGE_ID.into(), Bytes::from(self.message.id.clone())));
        out.push((F_ATTEMPT.into(), Bytes::from(next_attempt.to_string())));
        out.push((
            F_FIRST_ATTEMPT_AT.into(),
            Bytes::from(rfc3339(first_attempt_at)),
        ));
        out
    }

    /// The original fields plus the failure metadata: a dead letter.
    pub fn fields_for_dead_letter(&self, failure: &Failure) -> Vec<(Bytes, Bytes)> {
        let mut out: Vec<(Bytes, Bytes)> = self
            .fields
            .iter()
            .filter(|(n, _)| !failure.names().any(|f| f.as_bytes() == n.as_ref()))
            .filter(|(n, _)| !is_transient_bookkeeping(n))
            .cloned()
            .collect();
        out.extend(
            failure
                .fields()
                .map(|(n, v)| (Bytes::from_static(n.as_bytes()), Bytes::from(v))),
        );
        out
    }
}

fn parse_text<T: std::str::FromStr>(value: &[u8]) -> Option<T> {
    std::str::from_utf8(value).ok()?.trim().parse().ok()
}

/// Reads an RFC 3339 time as courier writes it.
pub fn parse_time(value: &[u8]) -> Option<SystemTime> {
    httpdate_rfc3339::parse(std::str::from_utf8(value).ok()?)
}

/// RFC 3339 in UTC with milliseconds, e.g. `2026-11-29T19:51:26.123Z`.
pub fn rfc3339(t: SystemTime) -> String {
    httpdate_rfc3339::format(t)
}

/// Small, dependency-free RFC 3339 (UTC) formatting and parsing; civil-date
/// arithmetic after Howard Hinnant's algorithms.
mod httpdate_rfc3339 {
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    pub fn format(t: SystemTime) -> String {
        let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
        let secs = since.as_secs() as i64;
        let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
        let (y, m, d) = civil_from_days(days);
        format!(
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
            rem / 3600,
            rem / 60 % 60,
            rem % 60,
            since.subsec_millis()
        )
    }

    pub fn parse(s: &str) -> Option<SystemTime> {
        let s = s.trim();
        let b = s.as_bytes();
        if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !(b[10] == b'T' || b[10] == b't') {
            return None;
        }
        let num = |r: std::ops::Range<usize>| s.get(r)?.parse::<i64>().ok();
        let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
        let (h, mi, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
        let mut rest = &s[19..];
        let mut nanos = 0u32;
        if let Some(frac) = rest.strip_prefix('.') {
            let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
            let text = &frac[..digits.min(9)];
            nanos = format!("{text:0<9}").parse().ok()?;
            rest = &frac[digits..];
        }
        let offset = match rest {
            "Z" | "z" => 0,
            _ => {
                let sign = match rest.as_bytes().first()? {
                    b'+' => 1,
                    b'-' => -1,
                    _ => return None,
                };
                let oh: i64 = rest.get(1..3)?.parse().ok()?;
                let om: i64 = rest.get(4..6)?.parse().ok()?;
                sign * (oh * 3600 + om * 60)
            }
        };
        let days = days_from_civil(y, mo, d);
        let secs = days * 86_400 + h * 3600 + mi * 60 + sec - offset;
        let secs = u64::try_from(secs).ok()?;
        Some(UNIX_EPOCH + Duration::new(secs, nanos))
    }

    fn civil_from_days(z: i64) -> (i64, i64, i64) {
        let z = z + 719_468;
        let era = z.div_euclid(146_097);
        let doe = z.rem_euclid(146_097);
        let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
        let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
        let mp = (5 * doy + 2) / 153;
        let d = doy - (153 * mp + 2) / 5 + 1;
        let m = if mp < 10 { mp + 3 } else { mp - 9 };
        (yoe + era * 400 + i64::from(m <= 2), m, d)
    }

    fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
        let y = if m <= 2 { y - 1 } else { y };
        let era = y.div_euclid(400);
        let yoe = y.rem_euclid(400);
        let mp = (m + 9) % 12;
        let doy = (153 * mp + 2) / 5 + d - 1;
        let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
        era * 146_097 + doe - 719_468
    }
}

// === Failures and dead letters ===

/// Everything a dead letter records about why it could not be delivered.
#[derive(Debug, Clone)]
pub struct Failure {
    pub reason: DeadLetterReason,
    pub status: Option<u16>,
    pub error: Option<String>,
    pub attempts: u32,
    pub first_attempt_at: SystemTime,
    pub last_attempt_at: SystemTime,
    pub queue: String,
    pub message_id: String,
    pub excerpt: Bytes,
    /// `name@generation`.
    pub policy: String,
    /// Where the dead letter goes (`<queue>.dlq` unless the policy says).
    pub dead_letter_queue: String,
}

impl Failure {
    fn names(&self) -> impl Iterator<Item = &'static str> {
        [
            F_REASON,
            F_STATUS,
            F_ERROR,
            F_ATTEMPTS,
            F_FIRST_ATTEMPT_AT,
            F_LAST_ATTEMPT_AT,
            F_QUEUE,
            F_MESSAGE_ID,
            F_EXCERPT,
            F_POLICY,
        ]
        .into_iter()
    }

    /// The `courier-*` fields of a dead letter, the same for every source.
    pub fn fields(&self) -> impl Iterator<Item = (&'static str, String)> {
        let values = [
            self.reason.as_str().to_string(),
            self.status.map(|s| s.to_string()).unwrap_or_default(),
            self.error.clone().unwrap_or_default(),
            self.attempts.to_string(),
            rfc3339(self.first_attempt_at),
            rfc3339(self.last_attempt_at),
            self.queue.clone(),
            self.message_id.clone(),
            String::from_utf8_lossy(&self.excerpt).into_owned(),
            self.policy.clone(),
        ];
        self.names().zip(values)
    }
}

/// A dead letter as read back from a dead-letter queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The dead-letter queue's own id of this entry.
    pub id: String,
    pub body: Bytes,
    /// `courier-*` fields and the original headers, as stored.
    pub fields: Vec<(String, String)>,
}

impl DeadLetter {
    pub fn field(&self, name: &str) -> Option<&str> {
        self.fields
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The fields of the fresh message a replay writes to the work queue:
    /// body and original headers, the original message id (so the app sees
    /// the same Idempotency-Key), `courier-replays` + 1, and no failure
    /// record, so the attempt count starts again at 1.
    pub fn fields_for_replay(&self) -> Vec<(Bytes, Bytes)> {
        let replays: u32 = self
            .field(F_REPLAYS)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut out = vec![(Bytes::from_static(PAYLOAD.as_bytes()), self.body.clone())];
        out.extend(
            self.fields
                .iter()
                .filter(|(n, _)| !n.to_ascii_lowercase().starts_with("courier-"))
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        if let Some(id) = self.field(F_MESSAGE_ID) {
            out.push((F_MESSAGE_ID.into(), Bytes::from(id.to_string())));
        }
        out.push((F_REPLAYS.into(), Bytes::from((replays + 1).to_string())));
        out
    }

    pub fn from_fields(id: String, fields: Vec<(Bytes, Bytes)>) -> Self {
        let mut body = Bytes::new();
        let mut out = Vec::new();
        for (name, value) in fields {
            if name.as_ref() == PAYLOAD.as_bytes() {
                body = value;
            } else {
                out.push((
                    String::from_utf8_lossy(&name).into_owned(),
                    String::from_utf8_lossy(&value).into_owned(),
                ));
            }
        }
        Self {
            id,
            body,
            fields: out,
        }
    }
}

/// How much sits where, read from the broker.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Depth {
    /// Messages waiting for their first or next delivery.
    pub ready: u64,
    /// Delivered and not yet settled.
    pub pending: u64,
    /// Scheduled for a later retry.
    pub retry_backlog: u64,
    pub dead_letters: u64,
    pub oldest_dead_letter_age: Option<Duration>,
}

// === The trait ===

/// A broker failure, with what the operator should check.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SourceError {
    #[error("cannot reach the broker: {0}")]
    Unavailable(String),
    #[error("{0}")]
    Broker(String),
    #[error("{0}")]
    Invalid(String),
}

/// What a source is opened with.
#[derive(Debug, Clone)]
pub struct SourceOptions {
    pub queue: String,
    pub group: String,
    /// This replica's name inside the group.
    pub consumer: String,
    /// A delivery not settled within this time is handed out again.
    pub visibility_timeout: Duration,
    /// `<queue>.dlq` unless the policy names another; used for depth.
    pub dead_letter_queue: String,
    /// Create the work queue (AMQP queue, NATS stream) when it is missing
    /// (`--create`); without it a missing queue is an error that says so.
    pub create: bool,
    /// Deliveries this replica has in flight at most (`--concurrency`);
    /// brokers that push (AMQP) prefetch this many.
    pub max_in_flight: usize,
}

impl SourceOptions {
    pub fn new(queue: &str) -> Self {
        Self {
            queue: queue.to_string(),
            group: "courier".into(),
            consumer: default_consumer_name(),
            visibility_timeout: Duration::from_secs(60),
            dead_letter_queue: format!("{queue}.dlq"),
            create: false,
            max_in_flight: 16,
        }
    }
}

/// `POD_NAME` in Kubernetes, else the host name: stable across a container
/// restart, so a restarted sidecar picks up what it left pending at once.
pub fn default_consumer_name() -> String {
    std::env::var("POD_NAME")
        .ok()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/etc/hostname")
                .ok()
                .map(|h| h.trim().to_string())
        })
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| "courier".into())
}

#[async_trait]
pub trait Source: Send + Sync + 'static {
    /// Up to `max` deliveries; waits about a second when there are none and
    /// may then return an empty list.
    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError>;
    /// The app said 2xx: the message is done.
    async fn ack(&self, delivery: &Delivery) -> Result<(), SourceError>;
    /// Stores the message durably for delivery `next_attempt` at `at`, and
    /// settles this delivery, as one step.
    async fn retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError>;
    /// Writes the dead letter and settles this delivery, as one step as far
    /// as the broker allows.
    async fn dead_letter(&self, delivery: &Delivery, failure: &Failure) -> Result<(), SourceError>;
    async fn depth(&self) -> Result<Depth, SourceError>;
    /// Dead letters, oldest first.
    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError>;
    /// Writes a dead letter back to the work queue
    /// ([`DeadLetter::fields_for_replay`]), then removes it from the
    /// dead-letter queue: a replay cut short leaves the message in both
    /// queues, never in neither.
    async fn replay(&self, dead_letter_queue: &str, letter: &DeadLetter)
    -> Result<(), SourceError>;
    /// Deletes a dead letter.
    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError>;
    /// Enqueues a message; returns its id.
    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError>;
    /// Whether this source can keep a deduplication window
    /// ([`Source::remember_ack`], [`Source::was_acked`]).
    fn supports_dedup(&self) -> bool {
        false
    }
    /// Remembers for `window` that the message with this idempotency key was
    /// acked.
    async fn remember_ack(&self, key: &str, window: Duration) -> Result<(), SourceError> {
        let _ = (key, window);
        Err(SourceError::Invalid(
            "this source keeps no deduplication window".into(),
        ))
    }
    /// Whether the message with this idempotency key was acked within the
    /// window.
    async fn was_acked(&self, key: &str) -> Result<bool, SourceError> {
        let _ = key;
        Ok(false)
    }
    /// Flushes what is buffered (pipelined acks) before the process exits.
    async fn close(&self) {}
    /// False while the broker connection is lost and the source is
    /// reconnecting; `/readyz` follows it.
    fn connected(&self) -> bool {
        true
    }
}

/// Opens the source a `--source` URL names.
pub async fn open(url: &SourceUrl, options: SourceOptions) -> Result<Arc<dyn Source>, SourceError> {
    Ok(match url {
        SourceUrl::Redis(url) => Arc::new(redis::RedisSource::connect(url, options).await?),
        SourceUrl::Embedded(dir) => Arc::new(embedded::EmbeddedSource::open(dir, options)?),
        SourceUrl::Amqp(url) => Arc::new(amqp::AmqpSource::connect(url, options).await?),
        SourceUrl::Nats(url) => Arc::new(nats::NatsSource::connect(url, options).await?),
    })
}

/// A `--source` URL, checked for a scheme courier knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceUrl {
    Redis(String),
    Embedded(std::path::PathBuf),
    /// `amqp://user:pass@host:port/vhost` or `amqps://...` (RabbitMQ).
    Amqp(String),
    /// `nats://[user:pass@]host:port` (NATS JetStream).
    Nats(String),
}

impl SourceUrl {
    pub fn parse(text: &str) -> Result<Self, String> {
        let supported = "use redis://host:port/db, amqp://user:pass@host:port/vhost, nats://host:port or embedded:<dir>";
        let Some((scheme, rest)) = text.split_once(':') else {
            return Err(format!("{text:?} has no scheme; {supported}"));
        };
        match scheme {
            "redis" | "rediss" => Ok(Self::Redis(text.to_string())),
            "amqp" | "amqps" => amqp::check_url(text).map(|()| Self::Amqp(text.to_string())),
            "nats" => nats::check_url(text).map(|()| Self::Nats(text.to_string())),
            "embedded" if !rest.is_empty() => {
                Ok(Self::Embedded(rest.trim_start_matches("//").into()))
            }
            "embedded" => Err(format!(
                "{text:?} names no directory; write embedded:/path/to/dir"
            )),
            other => Err(format!("unknown scheme {other:?} in {text:?}; {supported}")),
        }
    }

    /// The URL without credentials, safe for logs and labels.
    pub fn redacted(&self) -> String {
        match self {
            Self::Redis(url) | Self::Amqp(url) | Self::Nats(url) => redact(url),
            Self::Embedded(dir) => format!("embedded:{}", dir.display()),
        }
    }
}

impl fmt::Display for SourceUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

/// `redis://user:secret@host` becomes `redis://user:***@host`.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    match rest.split_once('@') {
        Some((auth, host)) if auth.contains(':') => {
            let user = auth.split(':').next().unwrap_or_default();
            format!("{scheme}://{user}:***@{host}")
        }
        Some((_, host)) => format!("{scheme}://***@{host}"),
        None => url.to_string(),
    }
}

// === Pipelined settlement ===

type Pending<T> = (T, oneshot::Sender<Result<(), SourceError>>);

/// Collects settlements from many concurrent deliveries and writes them to
/// the broker in one round trip; each caller still learns its own result.
pub struct Batcher<T> {
    tx: mpsc::Sender<Pending<T>>,
}

impl<T: Send + 'static> Batcher<T> {
    pub fn spawn<F, Fut>(max_batch: usize, flush: F) -> Self
    where
        F: Fn(Vec<T>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), SourceError>> + Send,
    {
        let (tx, mut rx) = mpsc::channel::<Pending<T>>(max_batch * 4);
        tokio::spawn(async move {
            let mut items = Vec::with_capacity(max_batch);
            let mut waiters = Vec::with_capacity(max_batch);
            while let Some((item, waiter)) = rx.recv().await {
                items.push(item);
                waiters.push(waiter);
                while items.len() < max_batch {
                    match rx.try_recv() {
                        Ok((item, waiter)) => {
                            items.push(item);
                            waiters.push(waiter);
                        }
                        Err(_) => break,
                    }
                }
                let result = flush(std::mem::take(&mut items)).await;
                for waiter in waiters.drain(..) {
                    let _ = waiter.send(result.clone());
                }
            }
        });
        Self { tx }
    }

    pub async fn submit(&self, item: T) -> Result<(), SourceError> {
        let (done, wait) = oneshot::channel();
        self.tx
            .send((item, done))
            .await
            .map_err(|_| SourceError::Broker("the settlement writer has stopped".into()))?;
        wait.await
            .map_err(|_| SourceError::Broker("the settlement writer has stopped".into()))?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_round_trips() {
        let t = SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_241_086_123);
        let text = rfc3339(t);
        assert_eq!(text, "2026-12-02T19:51:26.123Z");
        assert_eq!(httpdate_rfc3339::parse(&text), Some(t));
        assert_eq!(
            httpdate_rfc3339::parse("2026-12-02T20:51:26.123+01:00"),
            Some(t)
        );
        assert_eq!(httpdate_rfc3339::parse("yesterday"), None);
    }

    #[test]
    fn source_urls() {
        assert!(matches!(
            SourceUrl::parse("redis://127.0.0.1:6379/0"),
            Ok(SourceUrl::Redis(_))
        ));
        assert_eq!(
            SourceUrl::parse("embedded:/tmp/q"),
            Ok(SourceUrl::Embedded("/tmp/q".into()))
        );
        let err = SourceUrl::parse("kafka://broker:9092").unwrap_err();
        assert!(err.contains("unknown scheme \"kafka\""), "{err}");
        assert!(SourceUrl::parse("embedded:").is_err());
        assert!(SourceUrl::parse("localhost").is_err());
        assert!(matches!(
            SourceUrl::parse("amqp://guest:guest@127.0.0.1:5672/%2f"),
            Ok(SourceUrl::Amqp(_))
        ));
        assert!(matches!(
            SourceUrl::parse("nats://127.0.0.1:4222"),
            Ok(SourceUrl::Nats(_))
        ));
        assert!(SourceUrl::parse("amqp://host:notaport/").is_err());
    }

    #[test]
    fn credentials_are_redacted() {
        assert_eq!(redact("redis://:pw@host:6379"), "redis://:***@host:6379");
        assert_eq!(redact("amqp://guest:guest@h/v"), "amqp://guest:***@h/v");
        assert_eq!(redact("redis://host:6379"), "redis://host:6379");
    }

    #[test]
    fn an_entry_without_payload_is_a_problem_not_a_message() {
        let d = Delivery::from_fields(
            "1-0",
            vec![("content-type".into(), "text/plain".into())],
            0,
            "r".into(),
        );
        assert!(d.problem.is_some());
        assert_eq!(d.message.id, "1-0");
    }

    #[test]
    fn retry_fields_keep_the_original_id_and_count_attempts() {
        let d = Delivery::from_fields(
            "5-0",
            vec![
                ("payload".into(), "x".into()),
                ("traceparent".into(), "00-a-b-01".into()),
            ],
            0,
            "r".into(),
        );
        let fields = d.fields_for_retry(2, SystemTime::UNIX_EPOCH);
        let again = Delivery::from_fields("9-0", fields, 0, "r2".into());
        assert_eq!(again.message.id, "5-0");
        assert_eq!(again.attempt, 2);
        assert_eq!(again.message.body, Bytes::from("x"));
        assert_eq!(again.message.header("traceparent"), Some("00-a-b-01"));
        assert_eq!(again.first_attempt_at, Some(SystemTime::UNIX_EPOCH));
    }
}
