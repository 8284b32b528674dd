//! RabbitMQ (AMQP 0-9-1, `amqp://user:pass@host:port/vhost`, lapin).
//!
//! - `--queue` is a queue that must exist (classic or quorum, with whatever
//!   arguments it was declared with): courier only declares it passively and
//!   creates it, durable, when `--create` is given: a quorum queue with a
//!   delivery limit courier never reaches, or a classic one without
//!   arguments with `--queue-type classic` (`queues.rs`).
//! - One connection with three channels: a consumer channel (manual acks,
//!   prefetch = `--concurrency`), a publisher channel in confirm mode, and an
//!   admin channel for declares. Frames are at most 16 KiB (lapin's buffers
//!   are 64 frames). Consuming starts on the first `receive`.
//! - `courier dlq` and `courier send` open the dead-letter store alone
//!   (`AmqpStore`, `dead_letters.rs`): a connection that declares nothing
//!   and starts no consumer; a consumer's store has a connection of its own,
//!   opened on first use.
//! - An ack is one `basic.ack` frame without a broker reply, written as soon
//!   as the app answered: acks from concurrent deliveries are pipelined by
//!   the connection's writer. `multiple` acks are never used: deliveries
//!   finish out of order, and a multiple ack would also settle an earlier
//!   delivery whose retry or dead letter is still being written.
//! - A retry is published (with confirm) to a delay tier `<queue>.retry.<d>`,
//!   a queue with `x-message-ttl = d` whose dead letters go back to the work
//!   queue through the default exchange; then the delivery is acked. Every
//!   message in a tier has the same TTL, so they expire in order at the head
//!   (per-message TTL would block behind a longer one). A retry waits in the
//!   shortest tier not shorter than the delay when that ends at most 10 ms
//!   after its due time; otherwise in the longest tier not longer than the
//!   delay, carrying `courier-retry-at`, and when it comes back before that
//!   time it is sent round a tier again for what remains (a delay over the
//!   longest tier, 24h, the same way). So a retry is never early and at
//!   most 10 ms late plus the broker's latency; each hop more is one
//!   confirmed publish and one ack (5 s: 4 s, then 1 s). Tiers are declared
//!   on first use (`tiers.rs`).
//! - A dead letter is published (with confirm) to `<queue>.dlq` (declared on
//!   first use when missing), then the delivery is acked.
//! - Settled atomically or not at all: the ack follows only a publish the
//!   broker confirmed. A retry or dead letter that is refused (a publisher
//!   nack, a queue that cannot be declared, a lost connection) leaves the
//!   delivery unacked; it is requeued after a second and handed out again,
//!   and the error says so (`Session::give_back`).
//! - Tiers and the dead-letter queue take the work queue's type: quorum
//!   tiers dead-letter `at-least-once` with `reject-publish` overflow
//!   (`queues.rs`). Queues that already exist are used as they are.
//! - The attempt number and the original id travel as headers
//!   (`courier-attempt`, `courier-message-id`). A redelivery the broker made
//!   (a crash or a lost connection mid-delivery, a settlement handed back)
//!   counts as an attempt, and the message is first re-published with the
//!   attempt and `courier-deliveries` (hand-outs without a settlement)
//!   advanced: that resets a quorum queue's own counter, so its
//!   `x-delivery-limit` never drops a message courier still means to retry.
//!   A message handed out `max_deliveries` times without a settlement
//!   (quorum: `x-delivery-count` as well) goes to the app's dispatcher as
//!   undeliverable and is dead-lettered without being offered.
//! - Listing dead letters gets them without ack on a channel of its own and
//!   closes it, which puts them back where they were; replay and purge read
//!   through a cursor, so each letter is read once per run
//!   (`dead_letters.rs`). A dead letter's id is the `message_id` courier
//!   gave it. A replay's copy is published with a confirm, then its letter
//!   acked: a refused copy leaves the letter, a kill between the two leaves
//!   it in both. Not one transaction: in transaction mode a full quorum
//!   queue with `reject-publish` drops the copy without a word while the
//!   commit acks the letter (`dead_letters.rs`).
//! - The records of `courier dlq` jobs are messages of
//!   `<dead-letter queue>.courier-jobs`, one per job, read and rewritten
//!   under a lock, the exclusive consumer of
//!   `<dead-letter queue>.courier-jobs.lock`; both are declared by the
//!   first record put (`jobs.rs`).
//! - Depth: passive declares only (ready messages of the work queue, the
//!   dead-letter queue, each tier). The retry backlog counts every tier
//!   that exists, also those an earlier process declared: a process's
//!   first depth reading looks for each possible tier. AMQP does not
//!   report unacknowledged messages, so
//!   `pending` counts what the sources of this process hold; nor the age of
//!   a message, so the oldest dead letter's age is not reported and its
//!   gauge is left out (`depth.rs`). A retry is counted from its tier
//!   until it is back with this process: on its way from a tier to the
//!   work queue (a quorum tier hands it to a dead-letter worker first) and
//!   on to the consumer it is in no queue's count.
//! - A graceful stop gives back, as copies, what was prefetched and never
//!   offered; it cancels the consumer only once no delivery can be on its
//!   way, since a quorum queue sends some after `basic.cancel-ok` and lapin
//!   drops them (`connection.rs`).
//! - A lost connection is re-opened on the next call; deliveries from the
//!   old one can no longer be settled and the broker hands them out again.
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

mod connection;
mod convert;
mod dead_letters;
mod depth;
mod errors;
mod jobs;
mod queues;
mod seal;
mod session;
mod settle;
mod tiers;

use std::collections::{BTreeSet, HashMap};
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use lapin::BasicProperties;
use lapin::uri::AMQPUri;

use self::connection::Link;
use self::dead_letters::AmqpStore;
use self::queues::QueueKind;
use self::session::Session;
use courier_core::model::Delivery;
use courier_core::source::{
    Broker, Capabilities, Consumer, DeadLetterStore, Depth, LiveSettings, Observed, Settlement,
    Source, SourceError, SourceOptions, WithStore, settle_by_parts,
};

/// How long opening a connection may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest frame courier proposes (RabbitMQ's default is 128 KiB). lapin
/// keeps a read and a write ring buffer of 32 frames per connection, and
/// when RabbitMQ tunes 128 KiB it grows both to 4 MiB by zero-filling them:
/// 8 MiB resident from the start, a third of courier's memory. At 16 KiB
/// they are 1 MiB at most. A bigger body is split into more frames, 8 bytes
/// of overhead each. `?frame_max=` in `--source` overrides it. A message's
/// headers travel in one frame, so one whose headers are larger makes lapin
/// drop the connection; courier then connects with the broker's frame size
/// (`Link::large_frames`) rather than meet that message first again, forever.
const FRAME_MAX: u32 = 16 * 1024;

/// How an AMQP URL is written, for errors.
const URL_FORM: &str = "write it like amqp://user:pass@host:5672/vhost (%2f for the vhost /)";

/// Checks an `amqp://` / `amqps://` URL at start, so a typo is a usage error.
/// Without the `//`, `amqp:/user:pass@host` parses as the host `localhost`
/// and the vhost `user:pass@host`, which would then be named in errors.
pub fn check_url(text: &str) -> Result<(), String> {
    if !["amqp://", "amqps://"].iter().any(|s| text.starts_with(s)) {
        return Err(format!(
            "{}: the scheme is not followed by //; {URL_FORM}",
            courier_core::source::redact(text)
        ));
    }
    AMQPUri::from_str(text).map(drop).map_err(|e| {
        format!(
            "{}: {}; {URL_FORM}",
            courier_core::source::redact(text),
            courier_core::source::redact_error(text, e)
        )
    })
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
    /// Depth looked for every tier once, which finds those an earlier
    /// process declared.
    tiers_probed: AtomicBool,
    /// Retries this process put in a tier, by message id, until they come
    /// back to it (or until the given instant, when another replica may
    /// have taken them); depth counts them on their way back (`depth.rs`).
    retries_out: Mutex<HashMap<String, std::time::Instant>>,
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

// === The source ===

/// RabbitMQ: `amqp://user:pass@host:port/vhost` (`amqps://` for TLS).
pub const BROKER: Broker = Broker {
    name: "amqp",
    messaging_system: "rabbitmq",
    schemes: &["amqp", "amqps"],
    tls_schemes: &["amqps"],
    url_form: "amqp://user:pass@host:port/vhost",
    check_url,
    open: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(AmqpSource::connect(url.as_str(), options).await?) as Arc<dyn Source>)
        })
    },
    admin: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(AmqpStore::open(url.as_str(), options).await?) as Arc<dyn DeadLetterStore>)
        })
    },
};

pub struct AmqpSource {
    link: Arc<Link>,
    options: SourceOptions,
    session: Mutex<Option<Arc<Session>>>,
    connecting: tokio::sync::Mutex<()>,
    /// Set by the first `receive`: this source consumes, and keeps doing so
    /// on every new connection.
    consuming: AtomicBool,
    /// Ends a receive's wait (a stop, a `/drain`); one that comes before
    /// the wait ends the next wait at once.
    interrupted: tokio::sync::Notify,
    /// Original properties of deliveries in flight, for re-publishing them.
    properties: Mutex<HashMap<String, BasicProperties>>,
    /// Where depth reads dead letters; follows live policy changes.
    dead_letter_queue: Mutex<String>,
    /// Unsettled hand-outs after which a message is a poison pill; follows
    /// live policy changes.
    max_deliveries: AtomicU32,
    /// The work queue's type, once known.
    kind: Mutex<Option<QueueKind>>,
    /// Proves which copies courier stored; read at connect.
    seal: Arc<courier_core::source::shared::Seal>,
    /// The dead letters, on a connection of their own.
    store: AmqpStore,
}

impl AmqpSource {
    /// The work queue's type, which the queues courier declares for it
    /// take: from a delivery that shows it, else asked of the broker once.
    async fn work_queue_kind(
        &self,
        session: &Session,
        seen: Option<&BasicProperties>,
    ) -> Result<QueueKind, SourceError> {
        if let Some(kind) = *self.kind.lock().unwrap_or_else(|e| e.into_inner()) {
            return Ok(kind);
        }
        let kind = match seen.and_then(QueueKind::seen_in) {
            Some(kind) => kind,
            None => QueueKind::of_queue(session, &self.options.queue).await?,
        };
        tracing::debug!(queue = %self.options.queue, ?kind, "the work queue's type");
        *self.kind.lock().unwrap_or_else(|e| e.into_inner()) = Some(kind);
        Ok(kind)
    }

    fn seal(&self) -> &courier_core::source::shared::Seal {
        &self.seal
    }

    fn dead_letter_queue(&self) -> String {
        self.dead_letter_queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

#[async_trait]
impl Consumer for AmqpSource {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: false,
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
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        self.receive_batch(max).await
    }

    async fn interrupt(&self) {
        self.interrupted.notify_one();
    }

    async fn settle(
        &self,
        delivery: &Delivery,
        settlement: Settlement<'_>,
    ) -> Result<(), SourceError> {
        settle_by_parts(self, delivery, settlement).await
    }

    /// Stops consuming and gives back, without counting an attempt, what
    /// was prefetched and never offered to the app; then closes.
    async fn close(&self) {
        self.shut_down().await
    }
}

#[async_trait]
impl Observed for AmqpSource {
    async fn depth(&self) -> Result<Depth, SourceError> {
        let session = self.session().await?;
        depth::read(
            &session,
            &self.options.queue,
            &self.dead_letter_queue(),
            &self.link.uri.vhost,
        )
        .await
    }

    /// A live policy change: depth reads the new dead-letter queue, and the
    /// poison-pill limit follows `maxAttempts`. The visibility timeout has
    /// no meaning here: a delivery stays with this consumer as long as its
    /// channel is open.
    fn apply(&self, settings: &LiveSettings) {
        *self
            .dead_letter_queue
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = settings.dead_letter_queue.clone();
        self.max_deliveries
            .store(settings.max_deliveries, Ordering::SeqCst);
    }

    fn connected(&self) -> bool {
        self.current().is_some_and(|s| s.healthy())
    }
}

impl WithStore for AmqpSource {
    fn store(&self) -> &dyn DeadLetterStore {
        &self.store
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
    fn urls() {
        assert!(check_url("amqp://guest:guest@127.0.0.1:5672/%2f").is_ok());
        assert!(check_url("amqps://u:p@rabbit.example/prod").is_ok());
        let err = check_url("amqp://u:secret@host:port/").unwrap_err();
        assert!(!err.contains("secret"), "{err}");
    }

    /// The parser quotes what it chokes on, which in these shapes is the
    /// password.
    #[test]
    fn a_malformed_url_is_refused_without_its_password() {
        for url in [
            "amqp:user:hunter2@host",
            "amqp:/user:hunter2@host",
            "amqp://user:hunter2",
            "amqp://user:hunter2/vhost",
            "amqps:user:hunter2",
            "amqp://user:hun@ter2@host:port",
        ] {
            let err = check_url(url).unwrap_err();
            for secret in ["hunter2", "hun", "ter2"] {
                assert!(!err.contains(secret), "{url}: {err}");
            }
            assert!(err.contains("amqp://user:pass@host:5672/vhost"), "{err}");
        }
    }
}
