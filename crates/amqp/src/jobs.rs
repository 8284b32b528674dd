//! The records of `courier dlq` jobs (a replay or purge that can be resumed
//! and cancelled), kept beside a dead-letter queue.
//!
//! AMQP has no table, so the records are messages: one per job in the
//! durable queue `<dead-letter queue>.courier-jobs`, the job's key in the
//! `courier-job-key` header and the record as the body, persistent. Both it
//! and `<dead-letter queue>.courier-jobs.lock` are declared by the first
//! put; a list or a removal before that finds nothing and creates nothing.
//!
//! A queue can only be read by taking its messages, and a message taken is
//! invisible to everyone else until it is handed back. So every read and
//! write first takes a lock: an exclusive consumer on the `.lock` queue,
//! which RabbitMQ grants to one channel at a time and frees when that
//! channel or its connection ends (a killed courier holds it no longer
//! than the broker takes to notice). Without it, a list running while
//! another process writes would miss the records that process holds, and a
//! removal would miss the record it was asked to remove.
//!
//! Holding the lock, a channel gets every record without ack. A put or a
//! removal then, in one transaction, acks the records of its key, hands
//! back the others and (a put) publishes the new record: a kill before the
//! commit changes nothing, after it the new record replaced the old ones.
//! A list hands them all back. The records are handed back before the
//! channel, and with it the lock, is closed, so that the next holder finds
//! them in the queue again.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicPublishOptions, BasicRejectOptions,
};
use lapin::protocol::AMQPSoftError;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Consumer};
use tokio::time::Instant;

use super::convert::{header, value_bytes};
use super::errors::{OPERATION_TIMEOUT, Timed, broker_error, is_soft, short, timed};
use super::session::Session;
use courier_core::source::{JOB_RECORD_MAX, SourceError, is_job_key};

/// The header that carries a record's job key.
const KEY_HEADER: &str = "courier-job-key";

/// The most messages a records' queue is read for. Each put replaces its
/// key's record, so the queue holds one message per job that keeps one, a
/// few hundred at most; more means something else publishes there, and
/// reading on would hold ever more of them in memory.
const MAX_RECORDS: usize = 1000;

/// How long a command waits for the lock another one holds. A holder is
/// done in a few round trips; one whose host vanished is let go after the
/// broker misses its heartbeats (courier asks for 10 s).
const LOCK_WAIT: Duration = OPERATION_TIMEOUT;

/// The queue of `dead_letter_queue`'s job records.
fn jobs_queue(dead_letter_queue: &str) -> String {
    format!("{dead_letter_queue}.courier-jobs")
}

/// The queue whose exclusive consumer is the lock on them.
fn lock_queue(dead_letter_queue: &str) -> String {
    format!("{dead_letter_queue}.courier-jobs.lock")
}

/// The last record put under each key.
pub(super) async fn list(
    session: &Session,
    dead_letter_queue: &str,
) -> Result<Vec<(String, Bytes)>, SourceError> {
    let Some(locked) = Locked::take(session, dead_letter_queue, false).await? else {
        return Ok(Vec::new());
    };
    let read = async {
        let got = locked.get_all().await?.unwrap_or_default();
        // In queue order, so a later record of a key replaces an earlier
        // one (there is one per key unless a put was cut short by a broker
        // failure in the middle of its commit).
        let mut records = BTreeMap::new();
        for delivery in &got {
            if let Some(key) = key_of(delivery) {
                records.insert(key, Bytes::copy_from_slice(&delivery.data));
            }
        }
        locked.hand_back(&got).await?;
        Ok(records.into_iter().collect())
    }
    .await;
    locked.release().await;
    read
}

/// Replaces `key`'s record with `record`; with `None`, removes it.
pub(super) async fn change(
    session: &Session,
    dead_letter_queue: &str,
    key: &str,
    record: Option<Bytes>,
) -> Result<(), SourceError> {
    if !is_job_key(key) {
        return Err(SourceError::invalid(format!(
            "{key:?} is not a job key: write 1 to 64 of a-z, 0-9 and -"
        )));
    }
    if let Some(record) = &record
        && record.len() > JOB_RECORD_MAX
    {
        return Err(SourceError::invalid(format!(
            "the record of job {key} has {} bytes; RabbitMQ keeps at most {JOB_RECORD_MAX}",
            record.len()
        )));
    }
    let create = record.is_some();
    // Once more when the records' queue this connection declared was
    // deleted since: the second time it is declared again.
    for _ in 0..2 {
        if create {
            // The lock first: a records' queue without its lock would be
            // written by whoever comes, unguarded.
            session
                .declare(&lock_queue(dead_letter_queue), classic())
                .await?;
            session
                .declare(&jobs_queue(dead_letter_queue), classic())
                .await?;
        }
        let Some(locked) = Locked::take(session, dead_letter_queue, create).await? else {
            return Ok(());
        };
        let changed = locked.replace(key, record.clone()).await;
        locked.release().await;
        match changed {
            Ok(Replaced::Done) => return Ok(()),
            Ok(Replaced::NoQueue) if !create => return Ok(()),
            Ok(Replaced::NoQueue) => session.forget(&jobs_queue(dead_letter_queue)),
            Err(e) => return Err(e),
        }
    }
    Err(SourceError::broker(format!(
        "the record of job {key} was not stored: queue {:?} was deleted while courier wrote to it; try again",
        jobs_queue(dead_letter_queue)
    )))
}

/// What became of a change.
enum Replaced {
    Done,
    /// The records' queue does not exist (or no longer): nothing stored.
    NoQueue,
}

/// Classic, named so against a vhost whose default type is quorum: the
/// records are read by taking every message and handing it back, and a
/// quorum queue counts each hand-back as a delivery, which its delivery
/// limit (20 by default from RabbitMQ 4) ends by dropping the message. A
/// classic queue keeps the order of what is handed back as well.
fn classic() -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("classic".into()),
    );
    arguments
}

fn key_of(delivery: &AmqpDelivery) -> Option<String> {
    let key = header(&delivery.properties, KEY_HEADER).and_then(value_bytes)?;
    String::from_utf8(key.to_vec())
        .ok()
        .filter(|key| is_job_key(key))
}

/// A channel that holds the lock on one dead-letter queue's records.
struct Locked {
    channel: Channel,
    jobs: String,
    /// The consumer that is the lock, kept as long as the channel.
    _lock: Consumer,
}

impl Locked {
    /// Waits for the lock. `None` when there are no records to lock:
    /// neither queue exists and `create` is false.
    async fn take(
        session: &Session,
        dead_letter_queue: &str,
        create: bool,
    ) -> Result<Option<Self>, SourceError> {
        let jobs = jobs_queue(dead_letter_queue);
        let lock = lock_queue(dead_letter_queue);
        let exclusive = BasicConsumeOptions {
            exclusive: true,
            ..BasicConsumeOptions::default()
        };
        let deadline = Instant::now() + LOCK_WAIT;
        let mut pause = Duration::from_millis(10);
        loop {
            let channel = session
                .connection
                .create_channel()
                .await
                .map_err(|e| session.fail(e))?;
            let taken = timed(channel.basic_consume(
                short(&lock)?,
                "".into(),
                exclusive,
                FieldTable::default(),
            ))
            .await;
            // A refusal closed the channel; any other outcome leaves it to
            // be closed here.
            let e = match taken {
                Ok(consumer) => {
                    return Ok(Some(Self {
                        channel,
                        jobs,
                        _lock: consumer,
                    }));
                }
                Err(Timed::Broker(e)) => e,
                Err(Timed::TimedOut) => {
                    let _ = channel.close(200, "no answer".into()).await;
                    return Err(Timed::TimedOut.into());
                }
            };
            if is_soft(&e, AMQPSoftError::NOTFOUND) {
                // Records without their lock (someone deleted it) get it
                // back; no records and nothing to write: nothing to lock.
                session.forget(&lock);
                if !create && session.passive_count(&jobs).await?.is_none() {
                    return Ok(None);
                }
                session.declare(&lock, classic()).await?;
            } else if is_soft(&e, AMQPSoftError::ACCESSREFUSED) && Instant::now() < deadline {
                // Held by another command, most likely; a user who may not
                // read the lock queue is told so when the wait is over.
                tokio::time::sleep(pause.mul_f64(0.5 + rand::random::<f64>())).await;
                pause = (pause * 2).min(Duration::from_millis(250));
            } else if is_soft(&e, AMQPSoftError::ACCESSREFUSED) {
                return Err(SourceError::unavailable(format!(
                    "courier waited {LOCK_WAIT:?} for the lock on the dlq job records in {jobs:?} ({}): another courier command holds it, or the user in --source may not read queue {lock:?}; try again",
                    broker_error(e)
                )));
            } else {
                return Err(broker_error(e));
            }
            if Instant::now() >= deadline {
                return Err(SourceError::unavailable(format!(
                    "courier could not take the lock on the dlq job records in {jobs:?} within {LOCK_WAIT:?}: queue {lock:?} kept disappearing"
                )));
            }
        }
    }

    /// Every message of the records' queue, taken without ack; `None` when
    /// the queue does not exist (which closes the channel).
    async fn get_all(&self) -> Result<Option<Vec<AmqpDelivery>>, SourceError> {
        let mut got = Vec::new();
        loop {
            let message = match timed(
                self.channel
                    .basic_get(short(&self.jobs)?, BasicGetOptions { no_ack: false }),
            )
            .await
            {
                Ok(Some(message)) => message,
                Ok(None) => return Ok(Some(got)),
                Err(Timed::Broker(e)) if is_soft(&e, AMQPSoftError::NOTFOUND) => return Ok(None),
                Err(e) => return Err(e.into()),
            };
            let left = message.message_count as usize;
            got.push(message.delivery);
            if got.len() + left > MAX_RECORDS {
                return Err(SourceError::broker(format!(
                    "queue {:?} holds more than {MAX_RECORDS} messages, where courier keeps one per dlq job; is another program publishing to it? Purging it loses the job records (so running jobs cannot be resumed), not the dead letters",
                    self.jobs
                )));
            }
            // Nobody else takes from or writes to the queue while the lock
            // is held: none left means this was the last.
            if left == 0 {
                return Ok(Some(got));
            }
        }
    }

    /// Hands back what was got. Explicitly rather than by closing the
    /// channel: RabbitMQ frees the lock queue's consumer while it closes
    /// the channel, but requeues what the channel got only once the
    /// channel's process has ended, which would leave a moment in which the
    /// next holder of the lock finds records missing.
    async fn hand_back(&self, got: &[AmqpDelivery]) -> Result<(), SourceError> {
        for delivery in got {
            self.channel
                .basic_reject(delivery.delivery_tag, BasicRejectOptions { requeue: true })
                .await
                .map_err(broker_error)?;
        }
        Ok(())
    }

    /// In one transaction: acks every record of `key`, hands back the
    /// others and, with a `record`, publishes it.
    async fn replace(&self, key: &str, record: Option<Bytes>) -> Result<Replaced, SourceError> {
        timed(self.channel.tx_select()).await?;
        let Some(got) = self.get_all().await? else {
            return Ok(Replaced::NoQueue);
        };
        if got.is_empty() && record.is_none() {
            return Ok(Replaced::Done);
        }
        let (old, others): (Vec<_>, Vec<_>) = got
            .into_iter()
            .partition(|delivery| key_of(delivery).as_deref() == Some(key));
        for delivery in &old {
            self.channel
                .basic_ack(delivery.delivery_tag, BasicAckOptions { multiple: false })
                .await
                .map_err(broker_error)?;
        }
        self.hand_back(&others).await?;
        if let Some(record) = &record {
            let mut headers = FieldTable::default();
            headers.insert(
                KEY_HEADER.into(),
                AMQPValue::LongString(key.as_bytes().to_vec().into()),
            );
            let properties = BasicProperties::default()
                .with_delivery_mode(2)
                .with_headers(headers);
            let options = BasicPublishOptions {
                mandatory: true,
                immediate: false,
            };
            self.channel
                .basic_publish("".into(), short(&self.jobs)?, options, record, properties)
                .await
                .map_err(broker_error)?
                .await
                .map_err(broker_error)?;
        }
        timed(self.channel.tx_commit()).await?;
        // RabbitMQ returns an unroutable message in a transaction before it
        // answers the commit, so lapin has it by now.
        let returned = self
            .channel
            .wait_for_confirms()
            .await
            .map_err(broker_error)?;
        if !returned.is_empty() {
            return Ok(Replaced::NoQueue);
        }
        Ok(Replaced::Done)
    }

    /// Closes the channel, which frees the lock and drops an uncommitted
    /// transaction.
    async fn release(self) {
        let _ = self.channel.close(200, "done".into()).await;
    }
}
