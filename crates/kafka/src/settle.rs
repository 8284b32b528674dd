//! Settling a delivery: ack, retry (a copy in the retry topic), dead
//! letter; committing the ledgers; producing.

use async_trait::async_trait;
use std::sync::atomic::{AtomicBool, Ordering as AtomicOrdering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use rdkafka::consumer::{CommitMode, Consumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::Notify;

use super::connection::{Producer, blocking, unavailable};
use super::fields::{F_RETRY_AT, to_record};
use super::{AFTER_FAILED_SETTLE, KafkaSource, Out};
use courier_core::model::{Delivery, Failure, rfc3339};
use courier_core::source::SettleParts;
use courier_core::source::SourceError;
use courier_core::source::shared::{replace, without};

/// How a hand-out ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settled {
    /// Acked: the message is done, its key free.
    Acked,
    /// Dead-lettered: the message is done, its key free.
    DeadLettered,
    /// A retry copy is stored: the offset is settled, the copy holds the key.
    Retried,
    /// The write that was to settle it failed: handed out again later.
    NotWritten,
}

impl super::Reading {
    /// The message holding `key` is done: the next record waiting for the
    /// key is handed out next, or the key is free.
    fn release(&mut self, key: &[u8]) {
        let Some(waiting) = self.keys.get_mut(key) else {
            return;
        };
        match waiting.pop_front() {
            Some(next) => self.unblocked.push_back(next),
            None => {
                self.keys.remove(key);
            }
        }
    }
}

impl super::Reading {
    /// Every ledger's commit point and metadata, as one commit carries them;
    /// `clean`: the stop's ([`Ledger::metadata`](super::offsets::Ledger::metadata)).
    fn wanted(&self, clean: bool) -> Result<TopicPartitionList, SourceError> {
        let mut wanted = TopicPartitionList::new();
        for ((topic, partition), ledger) in &self.ledgers {
            let mut element = wanted.add_partition(topic, *partition);
            element
                .set_offset(Offset::Offset(ledger.commit_point()))
                .map_err(unavailable)?;
            element.set_metadata(ledger.metadata(clean));
        }
        Ok(wanted)
    }
}

impl KafkaSource {
    /// The hand-out behind a receipt, while it is not settled.
    fn out_of(&self, delivery: &Delivery) -> Result<Out, SourceError> {
        self.reading()
            .out
            .get(&delivery.receipt)
            .cloned()
            .ok_or_else(|| {
                SourceError::invalid(format!(
                    "delivery {} is not in flight here (settled already?)",
                    delivery.receipt
                ))
            })
    }

    /// The hand-out is over: when `done`, its offset is settled and the
    /// commit point moves past it once everything below is settled too;
    /// else (its settlement could not be written) it is handed out again
    /// after [`AFTER_FAILED_SETTLE`].
    async fn finish(
        &self,
        delivery: &Delivery,
        out: Out,
        settled: Settled,
    ) -> Result<(), SourceError> {
        let done = settled != Settled::NotWritten;
        let commit = {
            // One lock with the ledger: a rebalance that waits for this
            // hand-out sees it settled in the ledger once it is gone here.
            let mut reading = self.reading();
            reading.out.remove(&delivery.receipt);
            if matches!(settled, Settled::Acked | Settled::DeadLettered)
                && let Some(key) = &out.key
            {
                reading.release(key);
            }
            let key = (out.topic.clone(), out.partition);
            let Some(ledger) = reading.ledgers.get_mut(&key) else {
                // A rebalance took the partition away: its new owner reads
                // it from the last commit.
                return Err(SourceError::unavailable(format!(
                    "Kafka gave partition {} of {:?} to another consumer; the message is delivered again there",
                    out.partition, out.topic
                )));
            };
            if !ledger.is_open(out.offset) {
                false
            } else if done {
                ledger.settle(out.offset);
                reading.version += 1;
                true
            } else {
                reading.again.push_back((
                    SystemTime::now() + AFTER_FAILED_SETTLE,
                    delivery.clone(),
                    out,
                ));
                false
            }
        };
        if !commit {
            return Ok(());
        }
        if settled == Settled::Acked {
            self.commit_soon();
            return Ok(());
        }
        // A copy was written (a retry, a dead letter): its commit is handed
        // over now, not gathered. Lost in a crash, it means the message is
        // delivered again from the work topic as well as from the copy, a
        // duplicate worth a commit of its own; an ack's costs only the
        // redelivery at-least-once allows.
        self.commits.hand_over().await
    }

    /// A retry that uses no attempt (the app was unreachable, or the
    /// dispatcher gives back what it read ahead): the record stays in the
    /// work topic, uncommitted, its hand-out not counted, and is handed out
    /// again at `at` with the same attempt; a stop or crash before then
    /// leaves it for the next reader, which hands it out at once.
    fn give_back(
        &self,
        delivery: &Delivery,
        out: Out,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) {
        let mut reading = self.reading();
        reading.out.remove(&delivery.receipt);
        let Some(ledger) = reading.ledgers.get_mut(&(out.topic.clone(), out.partition)) else {
            return;
        };
        if !ledger.is_open(out.offset) {
            return;
        }
        ledger.give_back(out.offset);
        reading.version += 1;
        let mut again = delivery.clone();
        // Handed out again through `again`, which counts one more attempt.
        again.attempt = again.attempt.saturating_sub(1);
        again.first_attempt_at = delivery.first_attempt_at.or(Some(first_attempt_at));
        reading.again.push_back((at, again, out));
    }

    /// Commits every ledger's point and metadata and waits for Kafka's
    /// answer, once the commits before it are done; made even when another
    /// commit carried everything, for that one may have been handed over
    /// unawaited ([`Self::commit_soon`]) and not be taken yet. What a
    /// careful read's hand-outs wait for ([`Ledger::careful`](super::offsets::Ledger::careful)).
    pub(super) async fn commit(&self) -> Result<(), SourceError> {
        self.commit_awaited(false).await
    }

    /// The stop's [`Self::commit`], marked clean, so that the next reader of
    /// these partitions need not be careful.
    pub(super) async fn commit_at_stop(&self) -> Result<(), SourceError> {
        self.commit_awaited(true).await
    }

    async fn commit_awaited(&self, stop: bool) -> Result<(), SourceError> {
        let mut committed = self.commits.committed.lock().await;
        let (version, wanted) = {
            let mut reading = self.reading();
            let wanted = reading.wanted(stop)?;
            if wanted.count() > 0 {
                reading.committing += 1;
            }
            (reading.version, wanted)
        };
        if wanted.count() > 0 {
            let consumer = self.consumer();
            let result = blocking(move || {
                consumer
                    .commit(&wanted, CommitMode::Sync)
                    .map_err(|e| unavailable(format!("committing offsets: {e}")))
            })
            .await;
            self.reading().committing -= 1;
            result?;
        }
        *committed = version;
        Ok(())
    }

    /// An ack's commit (or an uncareful read's): the ledgers changed, and
    /// [`hand_over_commits`] commits them within [`COMMIT_EVERY`].
    pub(super) fn commit_soon(&self) {
        self.changed.notify_one();
    }
}

/// How long the changes of acks gather before one commit hands them over:
/// a commit per ack (almost every ack moves a commit point) was an
/// `OffsetCommit` with every partition's metadata per message.
const COMMIT_EVERY: Duration = Duration::from_millis(5);

/// Hands the ledgers' commit to librdkafka without waiting for Kafka's
/// answer, as the bare loop's is, at most [`COMMIT_EVERY`] after a change,
/// until the source is gone or stopping (the stop commits, and waits, on
/// its own). librdkafka sends commits in order, so no later one goes back
/// behind it. One refused, or lost in a crash, redelivers what it settled,
/// as at-least-once allows. The counts of hand-outs that find poison
/// pills are only in these where a crash could not hide one
/// ([`Ledger::careful`](super::offsets::Ledger::careful)).
pub(super) async fn hand_over_commits(
    commits: Weak<super::Commits>,
    changed: Arc<Notify>,
    closing: Arc<AtomicBool>,
) {
    loop {
        changed.notified().await;
        tokio::time::sleep(COMMIT_EVERY).await;
        let Some(commits) = commits.upgrade() else {
            return;
        };
        if closing.load(AtomicOrdering::SeqCst) {
            continue;
        }
        if let Err(e) = commits.hand_over().await {
            tracing::warn!(error = %e, "an offset commit failed; the next one carries what it had");
        }
    }
}

impl super::Commits {
    pub(super) fn reading(&self) -> std::sync::MutexGuard<'_, super::Reading> {
        self.reading.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hands the ledgers' commit to librdkafka now, unless one carried
    /// every change already.
    pub(super) async fn hand_over(&self) -> Result<(), SourceError> {
        let consumer = self
            .consumer
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut committed = self.committed.lock().await;
        // Taken and handed over under one lock of the ledgers: a rebalance
        // takes its own commit's snapshot under it too, so this one goes
        // either before the rebalance's commit or without its partitions.
        let reading = self.reading();
        if reading.version <= *committed {
            return Ok(());
        }
        let wanted = reading.wanted(false)?;
        if wanted.count() > 0 {
            consumer
                .commit(&wanted, CommitMode::Async)
                .map_err(|e| unavailable(format!("committing offsets: {e}")))?;
        }
        *committed = reading.version;
        Ok(())
    }
}

/// Produces fields to `topic` and waits for the delivery report: the
/// record is stored (by every in-sync replica) when this returns Ok.
pub(super) async fn produce(
    producer: &Producer,
    topic: &str,
    key: Option<&[u8]>,
    fields: &[(Bytes, Bytes)],
) -> Result<(i32, i64), SourceError> {
    let (body, headers) = to_record(fields);
    let size = fields.iter().map(|(n, v)| n.len() + v.len()).sum();
    producer
        .send(
            topic,
            key,
            Some(&body),
            Some(headers),
            Duration::from_secs(5),
        )
        .await
        .map_err(|e| not_stored(&format!("the record for {topic:?}"), size, e))
}

/// A write the cluster did not take, as the caller sees it: `what` was not
/// stored; `size` (bytes, headers included) says how far over the limit a
/// record too large is.
pub(super) fn not_stored(what: &str, size: usize, e: KafkaError) -> SourceError {
    let text = format!("Kafka did not store {what}: {e}");
    match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::MessageSizeTooLarge) => SourceError::too_large(format!(
            "{text}; the record ({size} bytes with its headers) is over the topic's max.message.bytes"
        )),
        _ => SourceError::broker(text),
    }
    .caused_by(e)
}

#[async_trait]
impl SettleParts for KafkaSource {
    async fn settle_ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        let out = self.out_of(delivery)?;
        self.finish(delivery, out, Settled::Acked).await
    }

    async fn settle_retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let out = self.out_of(delivery)?;
        if next_attempt == delivery.attempt {
            self.give_back(delivery, out, first_attempt_at, at);
            return Ok(());
        }
        let fields = delivery.fields_for_retry(next_attempt, first_attempt_at);
        let fields = self.seal.seal(replace(fields, F_RETRY_AT, rfc3339(at)));
        let topic = self.retry_topic.clone();
        if let Err(e) = produce(&self.producer, &topic, out.key.as_deref(), &fields).await {
            if !e.awaits_a_letter_that_fits(None) {
                self.finish(delivery, out, Settled::NotWritten).await?;
            }
            return Err(e);
        }
        self.finish(delivery, out, Settled::Retried).await
    }

    async fn settle_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError> {
        let out = self.out_of(delivery)?;
        let fields = without(delivery.fields_for_dead_letter(failure), F_RETRY_AT);
        let topic = failure.dead_letter_queue.clone();
        if let Err(e) = produce(&self.producer, &topic, out.key.as_deref(), &fields).await {
            if !e.awaits_a_letter_that_fits(Some(failure)) {
                self.finish(delivery, out, Settled::NotWritten).await?;
            }
            return Err(e);
        }
        self.finish(delivery, out, Settled::DeadLettered).await
    }
}
