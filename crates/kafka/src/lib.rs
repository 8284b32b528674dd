//! Kafka (`kafka://host:port[,host:port]`, `kafkas://` over TLS, rdkafka on
//! librdkafka), with a SASL login (PLAIN, SCRAM, OAUTHBEARER by OAuth client
//! credentials) from `--kafka-sasl-*`: TLS and SASL are librdkafka's own,
//! on OpenSSL, and the token of OAUTHBEARER is fetched and renewed by
//! librdkafka's OIDC client (`connection::Cluster`).
//!
//! - `--queue` names the topic, which must exist (with `--create`, courier
//!   has the cluster create it on first use). `--group` names the readers:
//!   the Kafka consumer group is `<group>.<topic>` (a Kafka group is
//!   cluster-wide; sharing one over several topics would rebalance every
//!   sidecar when any one starts). The group reads the topic and
//!   `<topic>.retry`. Nothing is committed by librdkafka itself.
//! - Deliveries of one partition run concurrently and settle in any order.
//!   The group commits, per partition, the lowest offset not yet settled,
//!   with metadata that records each unsettled offset's hand-outs (Kafka
//!   has no delivery counter) and the offsets settled above it
//!   (`offsets`). Hand-outs are committed before the deliveries are
//!   returned, so a message that crashes courier is counted, and one
//!   handed out more than `max_deliveries` times is marked undeliverable;
//!   a restart skips what was settled out of order. A crash therefore
//!   redelivers only what was unsettled.
//! - A retry is a copy produced to `<topic>.retry` with `courier-retry-at`
//!   and `courier-attempt` (sealed), awaited, and only then is the
//!   original's settlement committed. A retry copy that is not yet due is
//!   held in memory and its partition paused until it is, so it holds no
//!   delivery slot; a restart reads it again from the retry topic. Copies
//!   behind it in the same partition wait for it (a partition is a queue).
//!   A retry that uses no attempt (app unreachable, a read-ahead given
//!   back) stays in the work topic uncommitted, its hand-out uncounted,
//!   and is handed out again in-process when due.
//! - A dead letter is produced to `<topic>.dlq` (or the policy's queue)
//!   with the `courier-*` headers, awaited, then the settlement committed.
//!   A write that fails leaves the message unsettled; it is handed out
//!   again after [`AFTER_FAILED_SETTLE`].
//! - With `--ordering key`, a record whose key has a message handed out or
//!   retrying waits, in offset order, until that one is acked or
//!   dead-lettered; a retry copy carries the key and keeps it held.
//! - Dead letters are browsed by reading the dead-letter topic; Kafka
//!   cannot delete one record, so replay and purge record the letter's id
//!   in `<dlq>.removed`, and browsing leaves out what is recorded there.
//!   A replay writes the letter to the work topic, then its id to
//!   `<dlq>.removed`: one cut short between the two leaves the letter in
//!   both, never in neither. It is not one transaction because the commit
//!   markers would leave the group's committed offset one short of each
//!   partition's end, which depth and stall detection would read as a
//!   waiting record (and the mock cluster writes none, so it could not be
//!   tested here). `courier dlq` and `courier send` open the dead-letter
//!   store alone (`KafkaStore`): a producer and the inspector, no group,
//!   nothing created. The records of `courier dlq` jobs are kept in
//!   `<dlq>.courier-jobs`, made (compacted where the cluster takes
//!   CreateTopics) by the first put.
//! - A replica that holds no partition for longer than the session
//!   timeout plus the visibility timeout, while records wait and the
//!   group commits nothing, says so (a warning, `/readyz` not ready) and
//!   joins the group again with a new consumer (`stall`). The session
//!   timeout is 10 s (`COURIER_KAFKA_SESSION_TIMEOUT` sets another): the
//!   partitions of a replica that was killed, and the retry copies held on
//!   them, wait that long for another.
//! - Depth: per partition, the high watermark minus the committed offset,
//!   less what the commit's metadata says is handed out or settled; the
//!   oldest waiting message's age from the timestamp of the first waiting
//!   record.
//!
//! Files: `connection` (URL, clients, topics, the seal key, reading a
//! topic), `offsets` (the per-partition ledger and its metadata), `read`
//! (receiving, holding retries until due), `settle` (ack, retry, dead
//! letter, commits, produce), `dead_letters` (the dead-letter store:
//! browse, replay, purge, send), `jobs` (the records of `courier dlq`
//! jobs), `depth`, `fields`, `rebalance` (giving partitions up), `stall`
//! (a replica left without partitions).
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

mod connection;
mod dead_letters;
mod depth;
mod fields;
mod jobs;
mod offsets;
mod producer;
mod read;
mod rebalance;
mod settle;
mod stall;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use rdkafka::message::OwnedMessage;

use connection::{GroupConsumer, Inspector, Producer};
use courier_core::model::Delivery;
use courier_core::source::shared::Seal;
use courier_core::source::{
    Broker, Capabilities, Consumer, DeadLetterStore, Depth, LiveSettings, Observed, Settlement,
    Source, SourceError, SourceOptions, WithStore, settle_by_parts,
};
use dead_letters::KafkaStore;
use offsets::Ledger;
use rdkafka::consumer::Consumer as _;

pub use connection::{SESSION_TIMEOUT_ENV, check_url};

/// How long a message whose retry copy or dead letter could not be written
/// waits before it is handed out again: not at once, since the write that
/// failed is likely to fail again, and not never, since Kafka would not
/// hand it out again before a restart.
const AFTER_FAILED_SETTLE: Duration = Duration::from_secs(5);

/// Kafka: `kafka://host:port[,host:port]`, `kafkas://` over TLS.
pub const BROKER: Broker = Broker {
    name: "kafka",
    messaging_system: "kafka",
    schemes: &["kafka", "kafkas"],
    tls_schemes: &["kafkas"],
    url_form: "kafka://host:port[,host:port]",
    check_url,
    open: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(KafkaSource::connect(url.as_str(), options).await?) as Arc<dyn Source>)
        })
    },
    admin: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(KafkaStore::open(url.as_str(), options).await?)
                as Arc<dyn DeadLetterStore>)
        })
    },
};

/// A topic and partition.
type Partition = (String, i32);

/// A delivery handed out and not settled.
#[derive(Debug, Clone)]
struct Out {
    topic: String,
    partition: i32,
    offset: i64,
    key: Option<Vec<u8>>,
}

/// What the reader keeps between reads.
#[derive(Default)]
struct Reading {
    /// The ledger of each partition read since it was assigned.
    ledgers: HashMap<Partition, Ledger>,
    /// Retry copies read before they are due, per retry partition, in
    /// offset order; the partition is paused while any wait.
    held: HashMap<i32, VecDeque<(SystemTime, OwnedMessage)>>,
    /// Deliveries whose settlement could not be written, due again.
    again: VecDeque<(SystemTime, Delivery, Out)>,
    /// With `--ordering key`: the keys with a message handed out or
    /// retrying, each with the later records of that key read meanwhile,
    /// in offset order.
    keys: HashMap<Vec<u8>, VecDeque<OwnedMessage>>,
    /// Records whose key came free, to hand out next.
    unblocked: VecDeque<OwnedMessage>,
    /// Receipts handed out and not settled.
    out: HashMap<String, Out>,
    /// Commits sent and not answered: a rebalance waits for them, or one
    /// answered after its own would move the group's offsets back.
    committing: usize,
    subscribed: bool,
    /// The work topic's partitions are paused: its ledgers reached
    /// `max_unsettled` offsets ([`KafkaSource::bound_reads`]).
    paused_at_bound: bool,
    /// Bumped on every ledger change; what a commit has carried.
    version: u64,
    /// Partitions being taken away while their deliveries in flight
    /// finish (`rebalance.rs`): nothing more of them is handed out.
    revoking: HashSet<Partition>,
    /// Partitions with a hand-out in the read under way that must be
    /// committed before it is delivered ([`offsets::Ledger::careful`]).
    careful: Vec<Partition>,
    /// The retry topic's partitions are paused since an assignment, until
    /// then ([`rebalance::Shared::hold_retry`]).
    retry_resume_at: Option<std::time::Instant>,
}

/// What commits need, shared with the task that hands over settlements'
/// commits ([`settle::hand_over_commits`]).
struct Commits {
    /// The group's consumer; replaced by a new one when this one holds no
    /// partition while the group stalls (`stall.rs`).
    consumer: Mutex<Arc<GroupConsumer>>,
    reading: Arc<Mutex<Reading>>,
    /// One commit at a time, in order; holds the version it committed.
    committed: tokio::sync::Mutex<u64>,
}

pub struct KafkaSource {
    commits: Arc<Commits>,
    /// Tells the task of [`settle::hand_over_commits`] that the ledgers
    /// changed.
    changed: Arc<tokio::sync::Notify>,
    hand_over: tokio::task::JoinHandle<()>,
    cluster: connection::Cluster,
    /// What `stall.rs` watches of the assignment.
    watch: Mutex<stall::Watch>,
    /// The group's session timeout ([`connection::session_timeout`]).
    session_timeout: Duration,
    producer: Producer,
    inspector: Arc<Inspector>,
    options: SourceOptions,
    retry_topic: String,
    /// Tells a rebalance during the stop not to wait for deliveries.
    closing: Arc<AtomicBool>,
    live: Mutex<LiveSettings>,
    seal: Arc<Seal>,
    /// The dead letters and sends, on the same producer and inspector.
    store: KafkaStore,
    /// Dead-letter topics known to exist with their `.removed` topics.
    ensured: Mutex<HashSet<String>>,
    /// The partitions of the topics depth reads count.
    known: Arc<depth::KnownPartitions>,
    /// Ends a read's wait for records (a stop, a `/drain`); one that comes
    /// before the wait ends the next wait at once.
    interrupted: tokio::sync::Notify,
}

/// Makes sure `dead_letter_topic` and its `.removed` topic exist, once per
/// name: the inspector asks about a topic the depth counts, and librdkafka
/// keeps asking the cluster about a topic it found missing, once a second
/// for as long as the client lives (an idle replica whose dead-letter topic
/// was not made yet sent a metadata request a second; issue 28).
async fn ensure_dead_letter_topics(
    producer: &Producer,
    inspector: &Arc<Inspector>,
    ensured: &Mutex<HashSet<String>>,
    dead_letter_topic: &str,
) -> Result<(), SourceError> {
    if ensured
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .contains(dead_letter_topic)
    {
        return Ok(());
    }
    let (producer, inspector) = (producer.clone(), inspector.clone());
    let topic = dead_letter_topic.to_string();
    connection::blocking(move || {
        connection::ensure_topic(&producer, &inspector, &topic)?;
        connection::ensure_topic(&producer, &inspector, &fields::removed_topic(&topic)).map(drop)
    })
    .await?;
    ensured
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(dead_letter_topic.to_string());
    Ok(())
}

#[async_trait]
impl Consumer for KafkaSource {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: true,
            out_of_order_acks: true,
            dead_letter_browsing: true,
            dedup: false,
            byte_bounded_reads: false,
            dead_letter_age: false,
            key_ordering: true,
            shared_rate_limit: false,
            dead_letter_jobs: true,
            exact_replay: false,
            multi_process: true,
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        self.read_batch(max).await
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

    /// Commits what is settled (never past what is not) and waits for the
    /// producer's queue; leaving the group happens when the source is
    /// dropped, after the drain is reported. The commit is made and
    /// awaited even when the settlements' own commits carried it: those
    /// were not awaited.
    async fn close(&self) {
        self.closing.store(true, AtomicOrdering::SeqCst);
        if let Err(e) = self.commit_at_stop().await {
            tracing::warn!(error = %e, "the last offset commit failed; what it covered is delivered again");
        }
        let producer = self.producer.clone();
        let _ = connection::blocking(move || {
            producer
                .flush(connection::REQUEST)
                .map_err(connection::unavailable)
        })
        .await;
    }
}

#[async_trait]
impl Observed for KafkaSource {
    async fn depth(&self) -> Result<Depth, SourceError> {
        self.read_depth().await
    }

    fn check(&self, settings: &LiveSettings) -> Result<(), String> {
        dead_letters::check_dead_letter_topic(&settings.dead_letter_queue, &self.options.queue)
    }

    fn apply(&self, settings: &LiveSettings) {
        *self.live.lock().unwrap_or_else(|e| e.into_inner()) = settings.clone();
    }

    /// False while this replica holds no partition and the group it waits
    /// for consumes nothing (`stall.rs`).
    fn connected(&self) -> bool {
        !self.stalled()
    }
}

impl WithStore for KafkaSource {
    fn store(&self) -> &dyn DeadLetterStore {
        &self.store
    }
}

impl Drop for KafkaSource {
    /// Leaving the group revokes every partition: nothing waits then.
    fn drop(&mut self) {
        self.closing.store(true, AtomicOrdering::SeqCst);
        self.hand_over.abort();
    }
}

impl KafkaSource {
    fn live(&self) -> LiveSettings {
        self.live.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn reading(&self) -> std::sync::MutexGuard<'_, Reading> {
        self.commits.reading()
    }

    fn consumer(&self) -> Arc<GroupConsumer> {
        self.commits
            .consumer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A consumer of the group whose rebalances share this source's
    /// reading state.
    fn join(&self) -> Result<Arc<GroupConsumer>, SourceError> {
        group_consumer(
            &self.cluster,
            &self.options,
            self.session_timeout,
            &self.commits.reading,
            &self.closing,
            &self.retry_topic,
        )
    }

    pub(crate) async fn connect(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let cluster = connection::Cluster::of(url, &options)?;
        connection::check_topic(&options.queue)?;
        let session_timeout = connection::session_timeout()?;
        let producer = connection::producer(&cluster, &options)?;
        let inspector = Arc::new(connection::inspector(&cluster, &options)?);
        let retry_topic = fields::retry_topic(&options.queue);
        {
            let (producer, inspector) = (producer.clone(), inspector.clone());
            let (topic, retry, create) =
                (options.queue.clone(), retry_topic.clone(), options.create);
            let at = cluster.clone();
            connection::blocking(move || {
                at.reach(&inspector, &topic)?;
                if create {
                    connection::ensure_topic(&producer, &inspector, &topic)?;
                } else if connection::partitions(&inspector, &topic)?.is_none() {
                    return Err(connection::missing_topic(&topic));
                }
                connection::ensure_topic(&producer, &inspector, &retry).map(drop)
            })
            .await?;
        }
        let ensured = Mutex::default();
        ensure_dead_letter_topics(
            &producer,
            &inspector,
            &ensured,
            &options.live.dead_letter_queue,
        )
        .await?;
        let seal = match &options.seal {
            Some(seal) => seal.clone(),
            None => Arc::new(connection::seal_of(&producer, &inspector, &options.queue).await?),
        };
        producer.started();
        let reading: Arc<Mutex<Reading>> = Arc::default();
        let closing = Arc::new(AtomicBool::new(false));
        let consumer = group_consumer(
            &cluster,
            &options,
            session_timeout,
            &reading,
            &closing,
            &retry_topic,
        )?;
        let commits = Arc::new(Commits {
            consumer: Mutex::new(consumer),
            reading: reading.clone(),
            committed: tokio::sync::Mutex::new(0),
        });
        let changed = Arc::new(tokio::sync::Notify::new());
        let known: Arc<depth::KnownPartitions> = Arc::default();
        let hand_over = tokio::spawn(settle::hand_over_commits(
            Arc::downgrade(&commits),
            changed.clone(),
            closing.clone(),
        ));
        Ok(Self {
            commits,
            changed,
            hand_over,
            store: KafkaStore::new(
                &cluster,
                &options,
                producer.clone(),
                inspector.clone(),
                known.clone(),
                seal.clone(),
            ),
            cluster,
            watch: Mutex::default(),
            session_timeout,
            producer,
            inspector,
            live: Mutex::new(options.live.clone()),
            options,
            retry_topic,
            ensured,
            known,
            interrupted: tokio::sync::Notify::new(),
            closing,
            seal,
        })
    }
}

/// A consumer of the group whose rebalance callbacks share `reading`.
fn group_consumer(
    cluster: &connection::Cluster,
    options: &SourceOptions,
    session_timeout: Duration,
    reading: &Arc<Mutex<Reading>>,
    closing: &Arc<AtomicBool>,
    retry_topic: &str,
) -> Result<Arc<GroupConsumer>, SourceError> {
    let consumer = Arc::new(connection::consumer(cluster, options, session_timeout)?);
    let _ = consumer.context().shared.set(rebalance::Shared {
        reading: reading.clone(),
        retry_topic: retry_topic.to_string(),
        bound: options.live.visibility_timeout,
        closing: closing.clone(),
        consumer: Arc::downgrade(&consumer),
    });
    Ok(consumer)
}
