//! The producer of retries, dead letters, replays and `send`: librdkafka's
//! producer with a polling thread of courier's own, made when a record is
//! first sent and closed again after [`IDLE`] without one.
//!
//! rdkafka's `FutureProducer` polls its producer in a thread that asks for
//! 100 ms at a time, and its poll turns what is left of the last
//! millisecond into a wait of 0 and calls again until the time is up: it
//! spins for up to a millisecond every 100 ms, 0.9 % of a core on an idle
//! sidecar (issue 28). This thread asks for a wait a little over a whole
//! number of milliseconds, so librdkafka's wait ends at or just past the
//! deadline, and at most that little is spun.
//!
//! A sidecar whose app takes everything sends nothing, and an idle producer
//! still costs librdkafka's threads (a main thread and one per broker, each
//! awake once a second): about a third of an idle courier's CPU on a
//! three-broker cluster. So the producer exists only while it is used, and
//! what a start used it for (creating topics, recording the seal key) is
//! not kept for [`IDLE`]: that keeps a producer for the next of a run of
//! retries, and a start's writes are not one.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::client::ClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{Message, OwnedHeaders};
use rdkafka::metadata::Metadata;
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer as _, ProducerContext};
use tokio::sync::oneshot;

use super::connection::Quiet;

/// How long one poll of the thread waits for a delivery report: whole
/// milliseconds (librdkafka's unit) and a little, less than a thread's
/// usual wake-up lateness. A report ends the wait at once; this bounds how
/// long the thread lives on after the last clone is dropped, and how late
/// an idle producer is closed.
const POLL: Duration = Duration::from_micros(1_000_010);

/// How long the producer lives on after its last record's report: a run
/// of retries keeps one producer, an idle sidecar has none.
const IDLE: Duration = Duration::from_secs(30);

/// What a record's delivery report says: where it was stored, or why not.
type Report = Result<(i32, i64), KafkaError>;

/// The producer; clones share it. librdkafka's producer is made on first
/// use and closed after [`IDLE`] without a record; the last clone dropped
/// stops its thread.
#[derive(Clone)]
pub(super) struct Producer(Arc<Lazy>);

struct Lazy {
    config: ClientConfig,
    /// The context of every producer made: where its errors are kept.
    quiet: Quiet,
    /// The producer while it is open.
    open: Mutex<Option<Arc<Polled>>>,
    /// When this was made: the clock of `Polled::last_used`.
    epoch: Instant,
    /// [`IDLE`], but in tests.
    idle: Duration,
}

struct Polled {
    base: BaseProducer<Reports>,
    /// Records sent and not yet reported, and callers holding the producer
    /// for a request: counted up under `Lazy::open`'s lock, so the thread
    /// never closes a producer someone just took.
    users: AtomicUsize,
    /// Milliseconds from `Lazy::epoch` to the last use's end.
    last_used: AtomicU64,
    /// A record was sent through it since the start: it is kept for
    /// [`IDLE`] after its last use, not closed at once.
    sent: std::sync::atomic::AtomicBool,
}

/// One use of the open producer: it is not closed while this lives.
struct Use {
    polled: Arc<Polled>,
    epoch: Instant,
}

impl Drop for Use {
    fn drop(&mut self) {
        let now = self.epoch.elapsed().as_millis() as u64;
        self.polled.last_used.store(now, Ordering::Relaxed);
        self.polled.users.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Hands each delivery report to the sender waiting for it, and
/// librdkafka's log to courier's.
pub(super) struct Reports(Quiet);

impl ClientContext for Reports {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        self.0.log(level, facility, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        self.0.error(error, reason);
    }
}

impl ProducerContext for Reports {
    type DeliveryOpaque = Box<oneshot::Sender<Report>>;

    fn delivery(&self, result: &DeliveryResult<'_>, waiting: Self::DeliveryOpaque) {
        let report = match result {
            Ok(stored) => Ok((stored.partition(), stored.offset())),
            Err((e, _)) => Err(e.clone()),
        };
        // Nobody waits any more when the send was dropped: nothing to tell.
        let _ = waiting.send(report);
    }
}

impl Producer {
    /// A producer of `config`, made when it is first used. The settings
    /// are checked now, so that a wrong one fails the start, not a retry.
    pub(super) fn create(config: &ClientConfig, quiet: Quiet) -> KafkaResult<Self> {
        Self::closing_after(config, quiet, IDLE)
    }

    fn closing_after(config: &ClientConfig, quiet: Quiet, idle: Duration) -> KafkaResult<Self> {
        config.create_native_config()?;
        Ok(Self(Arc::new(Lazy {
            config: config.clone(),
            quiet,
            open: Mutex::new(None),
            epoch: Instant::now(),
            idle,
        })))
    }

    #[cfg(test)]
    fn is_open(&self) -> bool {
        self.0.open.lock().unwrap().is_some()
    }

    /// The open producer, made (with its polling thread) when there is
    /// none.
    fn take(&self) -> KafkaResult<Use> {
        let lazy = &self.0;
        let mut open = lazy.open.lock().unwrap_or_else(|e| e.into_inner());
        let polled = match &*open {
            Some(polled) => polled.clone(),
            None => {
                let polled = Arc::new(Polled {
                    base: lazy
                        .config
                        .create_with_context::<_, BaseProducer<Reports>>(Reports(
                            lazy.quiet.clone(),
                        ))?,
                    users: AtomicUsize::new(0),
                    last_used: AtomicU64::new(lazy.epoch.elapsed().as_millis() as u64),
                    sent: std::sync::atomic::AtomicBool::new(false),
                });
                let weak = Arc::downgrade(lazy);
                let polling = polled.clone();
                std::thread::Builder::new()
                    .name("courier-kafka-producer".into())
                    .spawn(move || poll(polling, weak))
                    .map_err(|e| KafkaError::ClientCreation(format!("producer thread: {e}")))?;
                *open = Some(polled.clone());
                polled
            }
        };
        polled.users.fetch_add(1, Ordering::AcqRel);
        Ok(Use {
            polled,
            epoch: lazy.epoch,
        })
    }

    /// The start's topic checks and seal key are done: the producer they
    /// opened is closed as soon as nothing uses it (within [`POLL`]).
    pub(super) fn started(&self) {
        if let Some(polled) = &*self.0.open.lock().unwrap_or_else(|e| e.into_inner()) {
            polled.sent.store(false, Ordering::Relaxed);
        }
    }

    /// Produces a record to `topic` and waits for its delivery report. A
    /// full local queue is waited out for up to `queue_timeout`, as rdkafka's
    /// `FutureProducer::send` does. A `payload` of `None` is a null value:
    /// a tombstone, which compaction takes as the key's removal.
    pub(super) async fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: Option<&[u8]>,
        headers: Option<OwnedHeaders>,
        queue_timeout: Duration,
    ) -> Report {
        let using = self.take()?;
        using.polled.sent.store(true, Ordering::Relaxed);
        let started = Instant::now();
        let (tx, rx) = oneshot::channel();
        let mut record = BaseRecord::with_opaque_to(topic, Box::new(tx));
        if let Some(payload) = payload {
            record = record.payload(payload);
        }
        if let Some(key) = key {
            record = record.key(key);
        }
        if let Some(headers) = headers {
            record = record.headers(headers);
        }
        loop {
            match using.polled.base.send(record) {
                Ok(()) => break,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if started.elapsed() < queue_timeout =>
                {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err((e, _)) => return Err(e),
            }
        }
        rx.await.unwrap_or(Err(KafkaError::Canceled))
    }

    /// The cluster's metadata of `topic`, asked through the producer
    /// (blocking): where the cluster creates topics on first use, this
    /// creates it.
    pub(super) fn fetch_metadata(&self, topic: &str, timeout: Duration) -> KafkaResult<Metadata> {
        self.take()?
            .polled
            .base
            .client()
            .fetch_metadata(Some(topic), timeout)
    }

    /// Waits until every record produced is stored or failed (blocking).
    /// A producer that is not open has none.
    pub(super) fn flush(&self, timeout: Duration) -> KafkaResult<()> {
        let open = self
            .0
            .open
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match open {
            Some(polled) => polled.base.flush(timeout),
            None => Ok(()),
        }
    }
}

/// The producer's thread: serves delivery reports until the last clone of
/// the [`Producer`] is dropped, or until it has been idle for [`IDLE`]
/// (at once when it sent no record since the start), when it closes
/// it (and a later send opens a new one). librdkafka's
/// producer is destroyed here, off the async threads, when the thread
/// lets go of it last.
fn poll(polled: Arc<Polled>, lazy: std::sync::Weak<Lazy>) {
    loop {
        polled.base.poll(POLL);
        let Some(lazy) = lazy.upgrade() else {
            return;
        };
        let now = lazy.epoch.elapsed().as_millis() as u64;
        let idle_since = polled.last_used.load(Ordering::Relaxed);
        let keep = if polled.sent.load(Ordering::Relaxed) {
            lazy.idle.as_millis() as u64
        } else {
            0
        };
        if now.saturating_sub(idle_since) < keep {
            continue;
        }
        let mut open = lazy.open.lock().unwrap_or_else(|e| e.into_inner());
        // Under the lock no new use can begin: closed only with none.
        if polled.users.load(Ordering::Acquire) == 0
            && open.as_ref().is_some_and(|o| Arc::ptr_eq(o, &polled))
        {
            *open = None;
            drop(open);
            tracing::debug!("the Kafka producer was idle; closed until the next record");
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::mocking::MockCluster;

    /// A producer on a mock cluster of one broker with `topic`, closing
    /// after `idle`.
    fn on_mock(
        topic: &str,
        idle: Duration,
    ) -> (
        MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
        Producer,
    ) {
        let cluster = MockCluster::new(1).unwrap();
        cluster.create_topic(topic, 1, 1).unwrap();
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", cluster.bootstrap_servers());
        let producer = Producer::closing_after(&config, Quiet::default(), idle).unwrap();
        (cluster, producer)
    }

    async fn send(producer: &Producer, topic: &str, body: &[u8]) -> Report {
        producer
            .send(topic, None, Some(body), None, Duration::from_secs(5))
            .await
    }

    /// A producer opens at its first record, closes when idle, and the
    /// next record opens it again.
    #[tokio::test]
    async fn an_idle_producer_is_closed_and_the_next_record_opens_it_again() {
        let (_cluster, producer) = on_mock("lazy", Duration::from_millis(300));
        assert!(!producer.is_open(), "made before its first record");
        assert_eq!(send(&producer, "lazy", b"first").await.unwrap(), (0, 0));
        assert!(producer.is_open());
        let deadline = Instant::now() + Duration::from_secs(10);
        while producer.is_open() {
            assert!(Instant::now() < deadline, "still open after 10 s idle");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(send(&producer, "lazy", b"second").await.unwrap(), (0, 1));
        assert!(producer.is_open());
        producer.flush(Duration::from_secs(5)).unwrap();
    }

    /// A producer opened only to ask for metadata (the topic checks at
    /// start), or whose records were the start's, is closed when that is
    /// done, not [`IDLE`] later: here within 5 s, though it keeps a
    /// producer that sent a record after the start for 10 min.
    #[tokio::test]
    async fn what_a_start_opened_is_closed_at_once() {
        let (_cluster, producer) = on_mock("checked", Duration::from_secs(600));
        let metadata = producer
            .fetch_metadata("checked", Duration::from_secs(5))
            .unwrap();
        assert_eq!(metadata.topics()[0].name(), "checked");
        let closes = |what: &'static str| {
            let producer = producer.clone();
            async move {
                assert!(producer.is_open(), "{what}: open");
                let deadline = Instant::now() + Duration::from_secs(5);
                while producer.is_open() {
                    assert!(Instant::now() < deadline, "{what}: still open after 5 s");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        };
        closes("metadata").await;
        send(&producer, "checked", b"the seal key").await.unwrap();
        producer.started();
        closes("the start's record").await;
        send(&producer, "checked", b"a retry").await.unwrap();
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(producer.is_open(), "a producer that sent is kept for IDLE");
    }

    /// Settings librdkafka refuses fail at creation, not at the first
    /// record.
    #[test]
    fn a_wrong_setting_fails_at_creation() {
        let mut config = ClientConfig::new();
        config.set("linger.ms", "not a number");
        assert!(Producer::create(&config, Quiet::default()).is_err());
    }
}
