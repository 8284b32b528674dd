//! The producer of retries, dead letters, replays and `send`: librdkafka's
//! producer with a polling thread of courier's own.
//!
//! rdkafka's `FutureProducer` polls its producer in a thread that asks for
//! 100 ms at a time, and its poll turns what is left of the last
//! millisecond into a wait of 0 and calls again until the time is up: it
//! spins for up to a millisecond every 100 ms, 0.9 % of a core on an idle
//! sidecar (issue 28). This thread asks for a wait a little over a whole
//! number of milliseconds, so librdkafka's wait ends at or just past the
//! deadline, and at most that little is spun.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::client::{Client, ClientContext};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::{KafkaError, KafkaResult, RDKafkaErrorCode};
use rdkafka::message::{Message, OwnedHeaders};
use rdkafka::producer::{BaseProducer, BaseRecord, DeliveryResult, Producer as _, ProducerContext};
use tokio::sync::oneshot;

use super::connection::Quiet;

/// How long one poll of the thread waits for a delivery report: whole
/// milliseconds (librdkafka's unit) and a little, less than a thread's
/// usual wake-up lateness. A report ends the wait at once; this bounds how
/// long the thread lives on after the last clone is dropped.
const POLL: Duration = Duration::from_micros(1_000_010);

/// What a record's delivery report says: where it was stored, or why not.
type Report = Result<(i32, i64), KafkaError>;

/// The producer; clones share it, and the last one dropped stops its
/// thread.
#[derive(Clone)]
pub(super) struct Producer(Arc<Polled>);

struct Polled {
    base: Arc<BaseProducer<Reports>>,
    stop: Arc<AtomicBool>,
}

/// Hands each delivery report to the sender waiting for it, and
/// librdkafka's log to courier's.
pub(super) struct Reports;

impl ClientContext for Reports {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        Quiet.log(level, facility, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        Quiet.error(error, reason);
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
    pub(super) fn create(config: &ClientConfig) -> KafkaResult<Self> {
        let base = Arc::new(config.create_with_context::<_, BaseProducer<Reports>>(Reports)?);
        let stop = Arc::new(AtomicBool::new(false));
        std::thread::Builder::new()
            .name("courier-kafka-producer".into())
            .spawn({
                let (base, stop) = (base.clone(), stop.clone());
                move || {
                    while !stop.load(Ordering::Relaxed) {
                        base.poll(POLL);
                    }
                }
            })
            .map_err(|e| KafkaError::ClientCreation(format!("producer thread: {e}")))?;
        Ok(Self(Arc::new(Polled { base, stop })))
    }

    /// Produces a record to `topic` and waits for its delivery report. A
    /// full local queue is waited out for up to `queue_timeout`, as rdkafka's
    /// `FutureProducer::send` does.
    pub(super) async fn send(
        &self,
        topic: &str,
        key: Option<&[u8]>,
        payload: &[u8],
        headers: Option<OwnedHeaders>,
        queue_timeout: Duration,
    ) -> Report {
        let started = Instant::now();
        let (tx, rx) = oneshot::channel();
        let mut record = BaseRecord::with_opaque_to(topic, Box::new(tx)).payload(payload);
        if let Some(key) = key {
            record = record.key(key);
        }
        if let Some(headers) = headers {
            record = record.headers(headers);
        }
        loop {
            match self.0.base.send(record) {
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

    pub(super) fn client(&self) -> &Client<Reports> {
        self.0.base.client()
    }

    /// Waits until every record produced is stored or failed (blocking).
    pub(super) fn flush(&self, timeout: Duration) -> KafkaResult<()> {
        self.0.base.flush(timeout)
    }
}

impl Drop for Polled {
    /// The thread ends within [`POLL`] and drops librdkafka's producer
    /// then. It is not waited for: a drop may come on an async thread, and
    /// `close` flushed what was produced.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}
