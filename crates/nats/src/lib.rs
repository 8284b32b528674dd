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
//!   and an expiry of three seconds: the server holds it until a message is
//!   there, delivers what the stream has, and ends it at once. Its answers
//!   come to one subscription the source keeps (each request on a reply
//!   subject of its own), so a read costs one publish, and a message sent
//!   to a request the reader stopped waiting for is handed out by the next
//!   read rather than lost until `AckWait`. A read that came back full
//!   sends the next read's request ahead (no expiry: answered at once);
//!   what it brings is kept in progress until a read takes it and given
//!   back at `close`. A request for more than one message is bounded in
//!   bytes too (8 MiB, or one message of the server's `max_payload`). A
//!   read registers its deliveries in flight only once nothing in it can
//!   fail any more.
//! - A message JetStream handed out more than `max_deliveries` times
//!   (`num_delivered`) is marked undeliverable: the dispatcher dead-letters
//!   it without offering it to the app.
//! - Acks are `+ACK` publishes to the reply subject, queued to the
//!   connection's writer, which writes concurrent ones together; `close`
//!   flushes it.
//! - Deliveries still in flight get `+WPI` (in progress) every third of
//!   `AckWait` (and on `keep_alive`), so a policy timeout raised at run
//!   time does not make the server hand them out twice. A live change
//!   (`apply`) moves the dead-letter subject depth reads, the poison-pill
//!   limit, and the consumer's `AckWait` (updated on the server).
//! - A retry that uses up an attempt is a `Nak` with the decided delay: the
//!   attempt is `courier-attempt` (1 when absent) plus the deliveries
//!   JetStream counted. A retry that must *not* use up an attempt (the app
//!   was unreachable) cannot be a `Nak`, which JetStream counts. It is a copy
//!   published to the message's own subject with `courier-attempt` and
//!   `courier-retry-at` set, and the original is acked. The first delivery of
//!   a copy carrying `courier-retry-at` is never offered: it is `Nak`ed with
//!   the time still to wait, and the attempt formula subtracts that one
//!   delivery. So the delay is durable in the server and the count exact.
//!   A copy the work stream does not store leaves the original unacked.
//! - Dead letters are published, with `Nats-Expected-Stream`, to the subject
//!   `<queue>.dlq` (or the policy's queue); the dead-letter stream capturing
//!   it is created on first use and named after the subject with every
//!   character a stream name cannot hold (`.`, `*`, `>`, `/`, `\`,
//!   whitespace) replaced by `_`: subject `orders.dlq`, stream `orders_dlq`.
//!   Once the server acknowledged the dead letter, the original is `Term`ed
//!   (and that is confirmed); a dead letter it did not store leaves the
//!   original unsettled (`Nak`ed with a short delay). A dead letter's id is its sequence in the
//!   dead-letter stream, and it records the original subject as
//!   `courier-subject`, where replay publishes it again.
//! - NATS header values cannot hold CR or LF: in dead-letter fields they
//!   become spaces.
//! - Depth: stream and consumer info. JetStream counts a `Nak`ed message as
//!   pending until it is redelivered, so the retry backlog is the
//!   consumer's pending count minus what the sources of this process hold.
//!   The oldest dead letter's age is the time since its
//!   `courier-last-attempt-at`.
//! - The records of `courier dlq` jobs are keys of the key-value bucket
//!   `courier-jobs` (stream `KV_courier-jobs`), `<dead-letter stream>.<job
//!   key>`, one revision each; the first put makes the bucket, bounded to
//!   64 MiB, with the work stream's replicas. A removal purges the key.
//!
//! Files: `connection` (connecting, the durable consumer, in-progress
//! ticker), `pull` (pull requests and admitting a delivery), `fields`
//! (fields ↔ headers), `settle` (ack, retry, dead letter, publish),
//! `dead_letters` (the dead-letter streams and browsing them; its `jobs`,
//! the job records), `depth`.
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

mod connection;
mod dead_letters;
mod depth;
mod fields;
mod read;
mod settle;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_nats::Client;
use async_nats::connection::State;
use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::context::Context;
use async_trait::async_trait;

use courier_core::model::Delivery;
use courier_core::source::{
    Broker, Capabilities, Consumer, DeadLetterStore, Depth, LiveSettings, Observed, Recent,
    Settlement, Source, SourceError, SourceOptions, WithStore, settle_by_parts,
};
use dead_letters::NatsStore;
use read::Puller;

pub use connection::check_url;
pub use dead_letters::dead_letter_stream;

/// NATS JetStream: `nats://[user:pass@]host:port`.
pub const BROKER: Broker = Broker {
    name: "nats",
    messaging_system: "nats",
    schemes: &["nats", "tls"],
    tls_schemes: &["tls"],
    url_form: "nats://host:port",
    check_url,
    open: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(NatsSource::connect(url.as_str(), options).await?) as Arc<dyn Source>)
        })
    },
    admin: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(NatsStore::open(url.as_str(), options).await?) as Arc<dyn DeadLetterStore>)
        })
    },
};

pub struct NatsSource {
    client: Client,
    js: Context,
    options: SourceOptions,
    /// Where `send` publishes: the stream's first subject without wildcards.
    send_subject: Option<String>,
    /// The work stream's subjects: a dead-letter subject must not be one.
    work_subjects: Vec<String>,
    replicas: usize,
    /// Shared, not cloned per read: its cached info is a deep structure.
    consumer: Arc<tokio::sync::Mutex<Option<Arc<PullConsumer>>>>,
    /// Receipts (reply subjects) in flight, with their stream sequence.
    /// This map and the next are written twice per message: hashed with
    /// foldhash, as std's SipHash cost more than the maps' own work.
    in_flight: Arc<Mutex<foldhash::HashMap<String, u64>>>,
    /// When messages this source retried with `Nak` were first offered, by
    /// stream sequence: a `Nak` cannot carry `courier-first-attempt-at`.
    /// Bounded: a message another replica then took is never settled here.
    first_attempts: Mutex<Recent<u64, SystemTime>>,
    /// The delivery count at which this process last retried a message with
    /// `Nak`, by stream sequence: JetStream's count goes on with deliveries
    /// courier settled, so only a delivery after one not settled here can
    /// make a poison pill.
    retried: Mutex<Recent<u64, u64>>,
    held: Arc<AtomicI64>,
    /// Created on the first read; the in-progress ticker parks what a
    /// request sent ahead brought while no read takes it.
    puller: Arc<tokio::sync::Mutex<Option<Puller>>>,
    dead_letter_streams: Mutex<Vec<String>>,
    progress: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The consumer's `AckWait` in ms, which paces the in-progress ticker.
    ack_wait_ms: Arc<AtomicU64>,
    /// What a live policy change updates: the dead-letter queue depth is
    /// read from, the poison-pill limit, the visibility timeout.
    live: Mutex<LiveSettings>,
    /// Proves which copies courier stored (the stream's key in the bucket
    /// `courier-seal-keys`).
    seal: Arc<courier_core::source::shared::Seal>,
    /// The dead letters, on the same connection.
    store: NatsStore,
}

#[async_trait]
impl Consumer for NatsSource {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: true,
            out_of_order_acks: true,
            dead_letter_browsing: true,
            dedup: false,
            byte_bounded_reads: true,
            dead_letter_age: true,
            key_ordering: false,
            shared_rate_limit: false,
            dead_letter_jobs: true,
            exact_replay: true,
            multi_process: true,
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        self.read_batch(max).await
    }

    async fn settle(
        &self,
        delivery: &Delivery,
        settlement: Settlement<'_>,
    ) -> Result<(), SourceError> {
        settle_by_parts(self, delivery, settlement).await
    }

    async fn keep_alive(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        self.in_progress(in_flight).await
    }

    async fn close(&self) {
        self.give_back_unread().await;
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
}

#[async_trait]
impl Observed for NatsSource {
    async fn depth(&self) -> Result<Depth, SourceError> {
        // Read where the current policy writes dead letters.
        self.store.depth(&self.live().dead_letter_queue).await
    }

    fn check(&self, settings: &LiveSettings) -> Result<(), String> {
        dead_letters::check_dead_letter_subject(
            &settings.dead_letter_queue,
            &self.options.queue,
            &self.work_subjects,
        )
    }

    fn apply(&self, settings: &LiveSettings) {
        self.follow(settings);
    }

    fn connected(&self) -> bool {
        self.client.connection_state() == State::Connected
    }
}

impl WithStore for NatsSource {
    fn store(&self) -> &dyn DeadLetterStore {
        &self.store
    }
}

impl NatsSource {
    fn live(&self) -> LiveSettings {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).clone()
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
