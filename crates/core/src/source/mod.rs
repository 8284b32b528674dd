//! Sources: the traits every broker implements and the parts brokers share.
//! Each broker is a crate of its own (`crates/<broker>`); the table of the
//! brokers a build has is `courier::source::BROKERS`.
//!
//! A source hands out [`Delivery`]s and settles them: ack, durable retry at a
//! time, or dead-letter with failure metadata. Every source stores a message
//! the same way: a list of fields where `payload` is the body, `courier-*`
//! fields are courier's bookkeeping, and every other field is a message
//! header. That keeps the meaning of a message identical across brokers.

pub mod batch;
pub mod jobs;
pub mod recent;
pub mod redact;
pub mod sasl;
pub mod seal;
#[doc(hidden)]
pub mod shared;
pub mod tls;
pub mod wire;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use futures::future::BoxFuture;

pub use crate::model::{DeadLetter, Delivery, Failure};

pub use batch::{Batcher, Linger};
pub use jobs::{JOB_RECORD_MAX, is_job_key};
pub use recent::{REMEMBERED, Recent};
pub use redact::{redact, redact_error, secrets_of};
pub use sasl::Sasl;
pub use seal::Seal;
pub use tls::{Tls, TlsFiles};
pub use wire::{decode_fields, encode_fields};

/// How much sits where, read from the broker.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Depth {
    /// Messages waiting for their first or next delivery; `None` while the
    /// broker cannot count them (a Redis group's `lag` is nil after entries
    /// ahead of it were deleted), never a made-up 0.
    pub ready: Option<u64>,
    /// Delivered and not yet settled.
    pub pending: u64,
    /// Scheduled for a later retry.
    pub retry_backlog: u64,
    pub dead_letters: u64,
    /// `None` when there are no dead letters, and always from a source
    /// that cannot read it ([`Capabilities::dead_letter_age`]).
    pub oldest_dead_letter_age: Option<Duration>,
    /// The work queue as the broker counts it (`courier_queue_depth`): not
    /// yet handed to any consumer, plus handed out and not settled where the
    /// broker reports those; what each broker counts is in docs/sources.md.
    /// `None` while the broker cannot count them: `courier_queue_depth` is
    /// then left out, not reported as 0.
    pub queue_depth: Option<u64>,
    /// Age of the oldest message not yet handed to any consumer
    /// (`courier_queue_oldest_age_seconds`): zero when none waits, `None`
    /// where the broker cannot tell.
    pub oldest_waiting_age: Option<Duration>,
}

// === The trait ===

/// What a source can do beyond receive, ack, retry and dead-letter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Capabilities {
    /// A retry is due at the exact time asked for (not rounded to a tier).
    pub per_message_delay: bool,
    /// Deliveries can be settled in any order, not only the order read.
    pub out_of_order_acks: bool,
    /// Dead letters can be listed, replayed and purged one by one.
    pub dead_letter_browsing: bool,
    /// A deduplication window can be kept ([`Consumer::remember_ack`],
    /// [`Consumer::was_acked`]).
    pub dedup: bool,
    /// A read is bounded in bytes as well as in count.
    pub byte_bounded_reads: bool,
    /// The oldest dead letter's age ([`Depth::oldest_dead_letter_age`]) can
    /// be read without taking the letter off its queue. Without it,
    /// `courier_dlq_oldest_age_seconds` is left out, never reported as 0.
    pub dead_letter_age: bool,
    /// Messages of one key can be delivered one at a time, in order
    /// ([`Ordering::Key`]); a source without it refuses `--ordering key`.
    pub key_ordering: bool,
    /// A rate-limit bucket every replica on the queue shares can be kept
    /// on the broker ([`Consumer::take_shared_token`],
    /// `rateLimit.scope: queue`); without it each replica is limited alone.
    pub shared_rate_limit: bool,
    /// The records of `courier dlq` jobs can be kept on the broker, beside
    /// the dead-letter queue ([`DeadLetterStore::job_records`]), so that a
    /// killed replay or purge is resumed and a job is cancelled from
    /// another process.
    pub dead_letter_jobs: bool,
    /// A replay killed halfway and resumed leaves every letter in exactly
    /// one place, the queue or the dead-letter queue: its write and its
    /// removal are one change (a script, a transaction), or the write made
    /// again on resume is dropped by the broker as a duplicate (NATS, by
    /// the message id, within the stream's duplicate window). Without it,
    /// the one letter in flight at the kill may end in both; never in
    /// neither.
    pub exact_replay: bool,
    /// Several processes can open the queue at once: a `courier dlq`
    /// command beside a running sidecar, or beside another command (to
    /// list or cancel a running job). The embedded queue's file is held by
    /// one process at a time.
    pub multi_process: bool,
}

/// What kind of failure a [`SourceError`] is: what the caller does next
/// follows it (retry the call, try the start again, or stop).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The broker cannot be reached or stopped answering: the same call may
    /// work later. A start is tried again with backoff, not ready meanwhile.
    Unavailable,
    /// The broker refused this call (a full queue, a rejected write, a
    /// protocol error): the next call may go through.
    Broker,
    /// The broker turned down who courier is (a wrong password, a user
    /// without the permission, a database index out of range): nothing
    /// changes until the operator fixes the setting. A start ends with
    /// exit 1; while running, courier keeps trying (a Secret may be
    /// rotated back), not ready meanwhile.
    Refused,
    /// A setting or an input the broker can never accept (a missing queue
    /// without `--create`, a name too long, bad TLS files): a start ends.
    Invalid,
    /// What the call names is not there (a dead letter already replayed or
    /// purged by someone else).
    Gone,
    /// The write is over the broker's limit on one message (its size, its
    /// header or attribute count): the same write never goes through. The
    /// source leaves the delivery in flight and the dispatcher settles it
    /// with a dead letter that fits instead ([`Failure::cut`],
    /// [`SourceError::awaits_a_letter_that_fits`]).
    TooLarge,
}

/// A broker failure: its kind, what the operator should check, and the
/// client library's error it came from, when there is one.
#[derive(Debug, Clone)]
pub struct SourceError {
    kind: ErrorKind,
    message: String,
    cause: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl SourceError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            cause: None,
        }
    }

    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unavailable, message)
    }

    pub fn broker(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Broker, message)
    }

    pub fn refused(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Refused, message)
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Invalid, message)
    }

    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Gone, message)
    }

    pub fn too_large(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::TooLarge, message)
    }

    /// The same error, caused by `cause` ([`std::error::Error::source`]).
    pub fn caused_by(mut self, cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.cause = Some(Arc::new(cause));
        self
    }

    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// Whether this failed write of a retry copy or of `failure`'s dead
    /// letter leaves the delivery in flight, unsettled, because the
    /// dispatcher settles it next with a letter that fits: the write was
    /// too large and was not the cut letter already. A source gives the
    /// delivery back to the broker only when this is false.
    pub fn awaits_a_letter_that_fits(&self, failure: Option<&Failure>) -> bool {
        self.kind == ErrorKind::TooLarge && failure.is_none_or(|f| f.cut.is_none())
    }

    /// What the operator reads, without the kind's prefix.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The same error with `more` appended to its message.
    pub fn with_suffix(mut self, more: &str) -> Self {
        self.message.push_str(more);
        self
    }
}

impl fmt::Display for SourceError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            ErrorKind::Unavailable => write!(f, "cannot reach the broker: {}", self.message),
            _ => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for SourceError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// What a source is opened with.
#[derive(Debug, Clone)]
pub struct SourceOptions {
    pub queue: String,
    pub group: String,
    /// This replica's name inside the group.
    pub consumer: String,
    /// What the policy decides at open: the visibility timeout, the
    /// dead-letter queue and the delivery limit. Later changes reach the
    /// source through [`Observed::apply`], never through these options.
    pub live: LiveSettings,
    /// Create the work queue (AMQP queue, NATS stream) when it is missing
    /// (`--create`); without it a missing queue is an error that says so.
    pub create: bool,
    /// What `--create` makes where a broker has more than one kind of queue.
    pub queue_type: QueueType,
    /// `--ordering`: whether messages of one key go to the app one at a
    /// time, in the order stored ([`Capabilities::key_ordering`]).
    pub ordering: Ordering,
    /// Deliveries this replica has with the app at most (`--concurrency`),
    /// and as many more being settled;
    /// brokers that push (AMQP) prefetch this many, times
    /// `messages_per_delivery`.
    pub concurrency: usize,
    /// Messages one delivery takes at most: 1, or a batch's
    /// `--batch-max-messages`. A source that bounds what it hands out by
    /// the concurrency (AMQP's prefetch, SQS FIFO's waiting groups) hands
    /// out this many per delivery, or batches would never fill.
    pub messages_per_delivery: usize,
    /// `--max-body`: a source whose reads are bounded in bytes
    /// ([`Capabilities::byte_bounded_reads`]) dead-letters a larger entry as
    /// `undeliverable` without loading it.
    pub max_body: usize,
    /// Records read and not yet settled that a source keeps track of at
    /// most (Kafka: the offsets of its ledgers, the later records of a
    /// retrying key with `--ordering key`). At the bound it stops reading
    /// new ones until half of them are settled, instead of growing.
    pub max_unsettled: usize,
    /// `--tls-ca-file`, `--tls-cert-file`, `--tls-key-file`, read and
    /// checked; empty unless the URL's scheme is a TLS one.
    pub tls: Tls,
    /// Kafka's SASL login (`--kafka-sasl-*`), checked; none: no SASL.
    pub sasl: Option<Sasl>,
    /// The seal's keys from `--seal-keys-file`; none: the key the broker
    /// keeps per queue, made on first use.
    pub seal: Option<Arc<Seal>>,
}

/// [`SourceOptions::max_unsettled`] of `courier run`: about a megabyte of
/// bookkeeping, plus the parked records' bodies.
pub const MAX_UNSETTLED: usize = 10_000;

/// In what order messages reach the app (`--ordering`). `None`: as many at
/// once as `--concurrency` allows. `Key`: messages with the same key (a
/// Kafka record key) are never in flight together and go in the order
/// stored; a retry of one holds the later ones of its key, as a FIFO
/// consumer expects. Messages without a key are not held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Ordering {
    #[default]
    None,
    Key,
}

impl Ordering {
    /// Every value `--ordering` takes, as it is written.
    pub const NAMES: [&'static str; 2] = ["none", "key"];
}

impl std::str::FromStr for Ordering {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "none" => Ok(Self::None),
            "key" => Ok(Self::Key),
            _ => Err(format!("{text:?} is not an ordering; write none or key")),
        }
    }
}

/// The kind of work queue `--create` makes on a broker that has more than
/// one (`--queue-type`). RabbitMQ: a quorum queue, replicated over the
/// cluster's nodes, unless classic is asked for. Other brokers have one
/// kind and ignore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    #[default]
    Quorum,
    Classic,
}

impl QueueType {
    /// Every value `--queue-type` takes, as it is written.
    pub const NAMES: [&'static str; 2] = ["quorum", "classic"];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Quorum => "quorum",
            Self::Classic => "classic",
        }
    }
}

impl std::str::FromStr for QueueType {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "quorum" => Ok(Self::Quorum),
            "classic" => Ok(Self::Classic),
            _ => Err(format!(
                "{text:?} is not a queue type; write quorum or classic"
            )),
        }
    }
}

/// What a live policy change means to an open source: the values it
/// started with, updated. A source knows no policy; the sidecar derives
/// these from the current one and hands them over on every change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveSettings {
    /// A delivery not settled within this time is handed out again.
    pub visibility_timeout: Duration,
    /// `<queue>.dlq` unless the policy names another: where dead letters
    /// go, where depth is read and dead letters are browsed.
    pub dead_letter_queue: String,
    /// A message handed out more than this many times without being
    /// settled is a poison pill: dead-lettered as `undeliverable` by the
    /// broker's own delivery counter, before it is loaded where the broker
    /// allows (the policy's `maxAttempts + 2`).
    pub max_deliveries: u32,
}

impl SourceOptions {
    /// How many messages may be handed out and not yet settled for the
    /// deliveries in flight: the concurrency times the messages of one.
    pub fn in_flight_messages(&self) -> usize {
        self.concurrency
            .max(1)
            .saturating_mul(self.messages_per_delivery.max(1))
    }

    pub fn new(queue: &str) -> Self {
        Self {
            queue: queue.to_string(),
            group: "courier".into(),
            consumer: default_consumer_name(),
            live: LiveSettings {
                visibility_timeout: Duration::from_secs(60),
                dead_letter_queue: crate::model::default_dead_letter_queue(queue),
                max_deliveries: 7,
            },
            create: false,
            queue_type: QueueType::default(),
            ordering: Ordering::default(),
            concurrency: 16,
            messages_per_delivery: 1,
            max_body: 4 << 20,
            max_unsettled: MAX_UNSETTLED,
            tls: Tls::default(),
            sasl: None,
            seal: None,
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

/// What the operator commands (`courier dlq`, `courier send`) use: the
/// dead letters of a queue, and a way to enqueue. An admin handle
/// ([`open_admin`]) is only this: opening one creates nothing on the broker
/// (no group, consumer, queue, stream, topic, subscription or seal key) and
/// starts no background task; only the writes below change the broker.
#[async_trait]
pub trait DeadLetterStore: Send + Sync + 'static {
    /// Dead letters, oldest first. Reads only.
    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError>;
    /// A page of dead letters, oldest first: at most `limit`, those after
    /// the letter `after` (from the oldest when `None`) and up to and
    /// including the letter `through` (to the newest when `None`; a
    /// snapshot's last letter, so that letters arriving later are not in
    /// it). Where the broker's ids are ordered (a Redis entry id, a stream
    /// sequence, a key), this reads one page, and a bulk command over a
    /// million letters holds one page at a time. `None` where they are not:
    /// the caller lists with [`Self::dead_letters`] instead.
    async fn dead_letters_after(
        &self,
        _dead_letter_queue: &str,
        _after: Option<&str>,
        _through: Option<&str>,
        _limit: usize,
    ) -> Result<Option<Vec<DeadLetter>>, SourceError> {
        Ok(None)
    }
    /// The dead letter `id` alone, where the broker finds one by its id
    /// without reading the others (the brokers that page): `Some` of what
    /// it found (`None` inside: no such letter). `None` where it cannot;
    /// the caller walks the queue instead.
    async fn dead_letter_by_id(
        &self,
        _dead_letter_queue: &str,
        _id: &str,
    ) -> Result<Option<Option<DeadLetter>>, SourceError> {
        Ok(None)
    }
    /// Writes a dead letter back to the work queue
    /// ([`DeadLetter::fields_for_replay`]), then removes it from the
    /// dead-letter queue: a replay cut short leaves the message in both
    /// queues, never in neither. `letter` may be an edit
    /// ([`DeadLetter::edited`]): the letter is removed by its id, and a
    /// broker that reads it again before writing writes
    /// [`DeadLetter::fields_for_replay_of`] what it read.
    async fn replay(&self, dead_letter_queue: &str, letter: &DeadLetter)
    -> Result<(), SourceError>;
    /// Deletes a dead letter.
    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError>;
    /// Enqueues a message; returns its id. Writes the message and nothing
    /// else.
    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError>;
    /// Waits until what was written is on the broker (a producer's queue
    /// flushed); call it before the process exits.
    async fn flush(&self) {}
    /// The records of the `courier dlq` jobs on `dead_letter_queue`: for
    /// each key, the last record put, in no particular order; none when
    /// nothing was ever put. The records are opaque here (the command's
    /// JSON, at most [`JOB_RECORD_MAX`] bytes); keys are
    /// [`is_job_key`]. Where the broker keeps none
    /// ([`Capabilities::dead_letter_jobs`] false) this and the two below
    /// are an [`ErrorKind::Invalid`] error saying so.
    async fn job_records(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        Err(no_job_records(dead_letter_queue))
    }
    /// Stores `record` under `key` beside `dead_letter_queue`, in place of
    /// the one before: once it returns, [`Self::job_records`] in any process
    /// returns it. Makes what it needs on the broker on the first call.
    async fn put_job_record(
        &self,
        dead_letter_queue: &str,
        _key: &str,
        _record: Bytes,
    ) -> Result<(), SourceError> {
        Err(no_job_records(dead_letter_queue))
    }
    /// The queue's depth as the sidecar's gauges read it, for an operator
    /// who has no sidecar at hand (`courier console`): read without joining
    /// a consumer group or taking anything. `None` where this broker's
    /// store cannot read it alone; the console then says so.
    async fn depth_of(&self, _dead_letter_queue: &str) -> Result<Option<Depth>, SourceError> {
        Ok(None)
    }
    /// How long a dead letter a process held to look at stays hidden from
    /// everyone else once that process is gone: SQS's visibility timeout,
    /// Pub/Sub's lease, while a listing or a replay holds it. `None` where
    /// reading takes nothing. A resumed job waits this long after its
    /// killed process was last heard from, so that it sees every letter
    /// of its snapshot.
    fn browse_lease(&self) -> Option<Duration> {
        None
    }
    /// Removes `key`'s record; removing one that is not there is no error.
    async fn remove_job_record(
        &self,
        dead_letter_queue: &str,
        _key: &str,
    ) -> Result<(), SourceError> {
        Err(no_job_records(dead_letter_queue))
    }
}

fn no_job_records(dead_letter_queue: &str) -> SourceError {
    SourceError::invalid(format!(
        "this broker keeps no dlq job records beside {dead_letter_queue}, so a replay or purge \
         on it cannot be resumed or cancelled from another process (docs/sources.md)"
    ))
}

/// A consumer's dead letters are those of the store on its connection:
/// one impl here instead of a delegation per broker.
pub trait WithStore {
    fn store(&self) -> &dyn DeadLetterStore;
}

#[async_trait]
impl<T: WithStore + Send + Sync + 'static> DeadLetterStore for T {
    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        self.store().dead_letters(dead_letter_queue, limit).await
    }

    async fn dead_letters_after(
        &self,
        dead_letter_queue: &str,
        after: Option<&str>,
        through: Option<&str>,
        limit: usize,
    ) -> Result<Option<Vec<DeadLetter>>, SourceError> {
        self.store()
            .dead_letters_after(dead_letter_queue, after, through, limit)
            .await
    }

    async fn dead_letter_by_id(
        &self,
        dead_letter_queue: &str,
        id: &str,
    ) -> Result<Option<Option<DeadLetter>>, SourceError> {
        self.store().dead_letter_by_id(dead_letter_queue, id).await
    }

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        self.store().replay(dead_letter_queue, letter).await
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        self.store().purge(dead_letter_queue, letter).await
    }

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        self.store().send(body, headers).await
    }

    async fn flush(&self) {
        self.store().flush().await
    }

    async fn job_records(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        self.store().job_records(dead_letter_queue).await
    }

    async fn put_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        self.store()
            .put_job_record(dead_letter_queue, key, record)
            .await
    }

    async fn remove_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        self.store().remove_job_record(dead_letter_queue, key).await
    }

    async fn depth_of(&self, dead_letter_queue: &str) -> Result<Option<Depth>, SourceError> {
        self.store().depth_of(dead_letter_queue).await
    }

    fn browse_lease(&self) -> Option<Duration> {
        self.store().browse_lease()
    }
}

/// How a delivery is settled: the policy's verdict, as the broker needs it.
#[derive(Debug, Clone, Copy)]
pub enum Settlement<'a> {
    /// The app said 2xx: the message is done.
    Ack,
    /// Store the message durably for delivery `next_attempt` at `at`, and
    /// settle this delivery, as one step.
    Retry {
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    },
    /// Write the dead letter and settle this delivery, as one step as far
    /// as the broker allows.
    DeadLetter(&'a Failure),
}

/// What the dispatcher uses: reading deliveries and settling them.
#[async_trait]
pub trait Consumer: Send + Sync + 'static {
    /// What this broker can do; the dispatcher and the conformance suite
    /// follow it instead of asking which broker this is.
    fn capabilities(&self) -> Capabilities;
    /// Up to `max` deliveries; when there are none it waits on the broker a
    /// few seconds at most (`shared::RECEIVE_WAIT`, `shared::HELD_WAIT`, or
    /// Redis's block until its next reclaim) and may then return an empty
    /// list.
    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError>;
    /// Ends the wait of a `receive` under way, so that a stop or a `/drain`
    /// does not wait out the broker's blocking read; that `receive` then
    /// returns what the broker had handed out, maybe nothing. Only a source
    /// whose wait can end without losing or counting a delivery does
    /// anything here: a long poll cut off on the client side would leave
    /// what the broker picked for it claimed, and counted as an attempt.
    async fn interrupt(&self) {}
    /// Settles `delivery` as the policy decided.
    async fn settle(
        &self,
        delivery: &Delivery,
        settlement: Settlement<'_>,
    ) -> Result<(), SourceError>;
    /// Keeps deliveries still in flight claimed by this consumer, so that
    /// the broker does not hand them to another while the app works on
    /// them (Redis: reset their idle time; embedded: extend the lease;
    /// JetStream: in-progress). Called well within the visibility timeout.
    async fn keep_alive(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        let _ = in_flight;
        Ok(())
    }
    /// The longest a keep-alive claims a delivery for, when the broker
    /// caps it below the visibility timeout (Pub/Sub: 600 s): keep-alives
    /// then come three times per this, not per visibility timeout.
    fn longest_claim(&self) -> Option<Duration> {
        None
    }
    /// With [`Capabilities::shared_rate_limit`]: takes one token from the
    /// queue's bucket on the broker, refilled at
    /// `per_second` up to `burst`, and says how long the delivery waits
    /// before it may go: tokens are taken ahead, so waits are spaced.
    async fn take_shared_token(
        &self,
        per_second: f64,
        burst: u32,
    ) -> Result<Duration, SourceError> {
        let _ = (per_second, burst);
        Err(SourceError::invalid(
            "this source keeps no rate-limit bucket shared by the replicas",
        ))
    }
    /// Remembers for `window` that the message with this idempotency key was
    /// acked.
    async fn remember_ack(&self, key: &str, window: Duration) -> Result<(), SourceError> {
        let _ = (key, window);
        Err(SourceError::invalid(
            "this source keeps no deduplication window",
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
}

/// Shorthands for [`Consumer::settle`], for tests and tools that settle
/// by hand; a broker implements only `settle`.
#[async_trait]
pub trait SettleBy: Consumer {
    async fn ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        self.settle(delivery, Settlement::Ack).await
    }

    async fn retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let retry = Settlement::Retry {
            next_attempt,
            first_attempt_at,
            at,
        };
        self.settle(delivery, retry).await
    }

    async fn dead_letter(&self, delivery: &Delivery, failure: &Failure) -> Result<(), SourceError> {
        self.settle(delivery, Settlement::DeadLetter(failure)).await
    }
}

impl<T: Consumer + ?Sized> SettleBy for T {}

/// The three ways a broker settles, implemented in its `settle.rs`, so
/// that its `Consumer::settle` is [`settle_by_parts`] and the match over
/// [`Settlement`] is written once.
#[async_trait]
pub trait SettleParts: Send + Sync {
    async fn settle_ack(&self, delivery: &Delivery) -> Result<(), SourceError>;
    async fn settle_retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError>;
    async fn settle_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError>;
}

/// [`Consumer::settle`] of a broker that implements [`SettleParts`].
pub async fn settle_by_parts<S: SettleParts + ?Sized>(
    source: &S,
    delivery: &Delivery,
    settlement: Settlement<'_>,
) -> Result<(), SourceError> {
    match settlement {
        Settlement::Ack => source.settle_ack(delivery).await,
        Settlement::Retry {
            next_attempt,
            first_attempt_at,
            at,
        } => {
            source
                .settle_retry(delivery, next_attempt, first_attempt_at, at)
                .await
        }
        Settlement::DeadLetter(failure) => source.settle_dead_letter(delivery, failure).await,
    }
}

/// What the sidecar watches and steers while the dispatcher consumes:
/// depth for metrics, the connection for readiness, live settings.
#[async_trait]
pub trait Observed: Send + Sync + 'static {
    async fn depth(&self) -> Result<Depth, SourceError>;
    /// False while the broker connection is lost and the source is
    /// reconnecting, or while it cannot consume for another reason it logs
    /// (Kafka: no partition while the group consumes nothing); `/readyz`
    /// and `courier_broker_up` follow it.
    fn connected(&self) -> bool {
        true
    }
    /// Refuses settings this source cannot work with (a Redis Cluster
    /// dead-letter queue outside the work stream's hash slot), saying why;
    /// the policy change that asked for them is then refused as a whole.
    fn check(&self, settings: &LiveSettings) -> Result<(), String> {
        let _ = settings;
        Ok(())
    }
    /// Takes new settings (a live policy change); what is in flight keeps
    /// running.
    fn apply(&self, settings: &LiveSettings) {
        let _ = settings;
    }
    /// Messages this source dead-lettered inside the broker, without the
    /// dispatcher (Redis: poison pills and entries over `--max-body`, by a
    /// script), all as `undeliverable`; a running total, which the sidecar
    /// adds to `courier_dead_letters_total`.
    fn dead_lettered_inside(&self) -> u64 {
        0
    }
}

/// An opened source: a [`Consumer`] for the dispatcher, [`Observed`] by the
/// sidecar, and the [`DeadLetterStore`] on the same connection. Each broker
/// implements the three in the files of their concerns.
pub trait Source: Consumer + Observed + DeadLetterStore {}

impl<T: Consumer + Observed + DeadLetterStore> Source for T {}

// === The broker table ===

/// A source being opened.
pub type Opening = BoxFuture<'static, Result<Arc<dyn Source>, SourceError>>;

/// An admin handle being opened ([`DeadLetterStore`]).
pub type AdminOpening = BoxFuture<'static, Result<Arc<dyn DeadLetterStore>, SourceError>>;

/// One broker courier can consume from: the URL schemes that name it, how
/// such a URL is checked before anything starts, and how a source is
/// opened. Each broker crate defines its own `BROKER`;
/// `courier::source::BROKERS` lists the ones a build has (each is a cargo
/// feature).
pub struct Broker {
    pub name: &'static str,
    /// `messaging.system` of the trace spans: the OpenTelemetry
    /// conventions' name where they define one (`rabbitmq`), else the
    /// broker's own.
    pub messaging_system: &'static str,
    pub schemes: &'static [&'static str],
    /// The schemes of `schemes` that connect over TLS (`rediss`); only
    /// these take the `--tls-*` files.
    pub tls_schemes: &'static [&'static str],
    /// The URL form, for help texts and errors: `redis://host:port/db`.
    pub url_form: &'static str,
    /// Refuses a URL this broker cannot use, saying what to write instead.
    pub check_url: fn(&str) -> Result<(), String>,
    pub open: fn(SourceUrl, SourceOptions) -> Opening,
    /// Opens an admin handle: connects, and creates nothing.
    pub admin: fn(SourceUrl, SourceOptions) -> AdminOpening,
}

impl fmt::Debug for Broker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

impl PartialEq for Broker {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl Eq for Broker {}

/// A `--source` URL whose scheme names a broker of this build, checked by
/// that broker.
#[derive(Clone, PartialEq, Eq)]
pub struct SourceUrl {
    broker: &'static Broker,
    text: String,
}

/// The URL forms of `brokers`, for help and errors.
pub fn url_forms_of(brokers: &[&Broker]) -> String {
    brokers
        .iter()
        .map(|b| b.url_form)
        .collect::<Vec<_>>()
        .join(", ")
}

impl SourceUrl {
    /// A URL whose scheme names one of `brokers`, checked by that broker
    /// (`courier::source::parse_url` passes the build's table).
    pub fn parse_among(text: &str, brokers: &[&'static Broker]) -> Result<Self, String> {
        let supported = format!("use {}", url_forms_of(brokers));
        // What is not a scheme by the redaction's reading may be a user
        // name or a token, and is not echoed as one.
        let (scheme, _) = redact::split_scheme(text);
        let Some(scheme) = scheme.strip_suffix(':') else {
            return Err(format!("{:?} has no scheme; {supported}", redact(text)));
        };
        let Some(broker) = brokers.iter().find(|b| b.schemes.contains(&scheme)) else {
            return Err(format!(
                "unknown scheme {scheme:?} in {:?}; {supported}",
                redact(text)
            ));
        };
        (broker.check_url)(text)?;
        Ok(Self {
            broker,
            text: text.to_string(),
        })
    }

    pub fn broker(&self) -> &'static Broker {
        self.broker
    }

    /// Whether the URL's scheme connects over TLS (`rediss://`, `amqps://`,
    /// NATS `tls://`).
    pub fn uses_tls(&self) -> bool {
        self.text
            .split_once(':')
            .is_some_and(|(scheme, _)| self.broker.tls_schemes.contains(&scheme))
    }

    /// The URL as given, credentials included: only for connecting.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The URL without credentials, safe for logs and labels.
    pub fn redacted(&self) -> String {
        redact(&self.text)
    }
}

impl fmt::Display for SourceUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.redacted())
    }
}

impl fmt::Debug for SourceUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SourceUrl({}: {})", self.broker.name, self.redacted())
    }
}
