//! Reading: the group's records in, retry copies held until due, and each
//! hand-out counted in the ledger before the app sees it.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use futures::FutureExt;
use rdkafka::consumer::Consumer;
use rdkafka::message::{Message, OwnedMessage};
use rdkafka::{Offset, TopicPartitionList};
use tokio::time::Instant;

use super::connection::{REQUEST, blocking, unavailable};
use super::fields::{F_RETRY_AT, from_record, record_id, record_time};
use super::offsets::{Ledger, Read};
use super::rebalance::of_topic;
use super::{KafkaSource, Out, Partition};
use courier_core::model::{Delivery, parse_time};
use courier_core::source::shared::{IN_PROCESS_WAIT, RECEIVE_WAIT, field, without};
use courier_core::source::{Ordering, SourceError};

impl KafkaSource {
    /// Up to `max` deliveries: retry copies that came due, then what the
    /// group's partitions have, waiting up to [`IN_PROCESS_WAIT`] for a first
    /// ([`RECEIVE_WAIT`] while paused at the read bound).
    pub(super) async fn read_batch(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        self.watch_assignment().await;
        self.subscribe()?;
        let consumer = self.consumer();
        self.bound_reads();
        let mut out = Vec::new();
        self.release_due(&mut out, max);
        // Paused at the bound, the partitions resume at a read once the
        // app has settled enough: that read must not be 5 s away.
        let wait = if self.reading().paused_at_bound {
            RECEIVE_WAIT
        } else {
            IN_PROCESS_WAIT
        };
        let deadline = Instant::now() + wait;
        while out.len() < max {
            self.resume_retry();
            let now = Instant::now();
            let wait = if out.is_empty() {
                let until = self.next_due().map_or(deadline, |due| due.min(deadline));
                let until = match self.reading().retry_resume_at {
                    Some(at) => until.min(Instant::from_std(at)),
                    None => until,
                };
                until.saturating_duration_since(now)
            } else {
                Duration::ZERO
            };
            let got = if wait.is_zero() {
                consumer.recv().now_or_never()
            } else {
                // The wait is in the process (librdkafka's queue), so a
                // stop may end it: nothing is taken from the queue then.
                tokio::select! {
                    got = tokio::time::timeout(wait, consumer.recv()) => got.ok(),
                    () = self.interrupted.notified() => break,
                }
            };
            let message = match got {
                None => {
                    self.release_due(&mut out, max);
                    if !out.is_empty() || Instant::now() >= deadline {
                        break;
                    }
                    continue;
                }
                Some(Err(e)) if out.is_empty() => return Err(unavailable(e)),
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "a Kafka read ended early");
                    break;
                }
                Some(Ok(message)) => message.detach(),
            };
            self.admit(message, &mut out).await?;
            self.bound_reads();
        }
        let careful = std::mem::take(&mut self.reading().careful);
        if !out.is_empty() {
            // The hand-outs are counted in the commit's metadata: before the
            // app sees them where a crash could hide a poison pill, else
            // handed over as a settlement's commit is. If that commit fails
            // they are counted with the next one.
            let committed = if careful.is_empty() {
                self.commit_soon();
                Ok(())
            } else {
                self.commit().await
            };
            match committed {
                Ok(()) => {
                    let mut reading = self.reading();
                    for key in careful {
                        if let Some(ledger) = reading.ledgers.get_mut(&key) {
                            ledger.synced = true;
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "Kafka did not take the count of hand-outs; it is committed with the next settlement")
                }
            }
        }
        Ok(out)
    }

    /// Pauses the work topic's partitions while its ledgers hold
    /// `max_unsettled` offsets or more (a key retrying for an hour with
    /// `--ordering key` parks every later record of it; one offset left
    /// open keeps every later one), and resumes them once under half.
    /// Records librdkafka fetched before a pause are dropped by it and
    /// fetched again on resume. The retry topic is read on: a retrying
    /// key's copy there is what frees its parked records. Checked on every
    /// read: a rebalance hands over partitions unpaused.
    fn bound_reads(&self) {
        let bound = self.options.max_unsettled.max(1);
        let mut reading = self.reading();
        let unsettled: usize = reading
            .ledgers
            .iter()
            .filter(|((topic, _), _)| *topic == self.options.queue)
            .map(|(_, ledger)| ledger.len())
            .sum();
        let pause = unsettled >= bound || (reading.paused_at_bound && unsettled > bound / 2);
        if !pause && !reading.paused_at_bound {
            return;
        }
        let work = match self.consumer().assignment() {
            Ok(assigned) => of_topic(&assigned, &self.options.queue, &[]),
            Err(_) => TopicPartitionList::new(),
        };
        let done = if pause {
            self.consumer().pause(&work)
        } else {
            self.consumer().resume(&work)
        };
        match done {
            Ok(()) if pause != reading.paused_at_bound => {
                reading.paused_at_bound = pause;
                if pause {
                    tracing::warn!(queue = %self.options.queue, unsettled, bound, "reading paused: this many records are read and not settled; it goes on once half of them are");
                } else {
                    tracing::info!(queue = %self.options.queue, unsettled, "reading goes on");
                }
            }
            Ok(()) => {}
            Err(e) => tracing::warn!(error = %e, "cannot pause or resume the Kafka work topic"),
        }
    }

    fn subscribe(&self) -> Result<(), SourceError> {
        let mut reading = self.reading();
        if !reading.subscribed {
            self.consumer()
                .subscribe(&[&self.options.queue, &self.retry_topic])
                .map_err(unavailable)?;
            reading.subscribed = true;
        }
        Ok(())
    }

    /// The earliest time a held retry copy or a failed settlement is due.
    fn next_due(&self) -> Option<Instant> {
        let reading = self.reading();
        let held = reading
            .held
            .values()
            .filter_map(|q| q.front().map(|(due, _)| *due));
        let again = reading.again.iter().map(|(due, _, _)| *due);
        let due = held.chain(again).min()?;
        let wait = due.duration_since(SystemTime::now()).unwrap_or_default();
        Some(Instant::now() + wait)
    }

    /// Hands out the held retry copies and failed settlements that are
    /// due, up to `max` deliveries in `out`; resumes a retry partition
    /// whose copies are all out.
    fn release_due(&self, out: &mut Vec<Delivery>, max: usize) {
        let now = SystemTime::now();
        let mut due = Vec::new();
        let mut again = Vec::new();
        let mut resume = TopicPartitionList::new();
        {
            let mut reading = self.reading();
            if !reading.revoking.is_empty() {
                // What would come out may be of a partition being taken
                // away; the revoke forgets it, or it comes after.
                return;
            }
            while out.len() + due.len() < max {
                match reading.unblocked.pop_front() {
                    Some(message) => due.push(message),
                    None => break,
                }
            }
            // Failed settlements and give-backs, due in any order.
            let mut at = 0;
            while at < reading.again.len() && out.len() + due.len() + again.len() < max {
                if reading.again[at].0 > now {
                    at += 1;
                    continue;
                }
                let (_, mut delivery, record) = reading.again.remove(at).expect("an entry");
                let Some(ledger) = reading
                    .ledgers
                    .get_mut(&(record.topic.clone(), record.partition))
                else {
                    continue;
                };
                let handed = ledger.hand_out(record.offset);
                if ledger.careful(handed, std::time::Instant::now()) {
                    reading
                        .careful
                        .push((record.topic.clone(), record.partition));
                }
                reading.version += 1;
                delivery.attempt += 1;
                delivery.receipt = receipt(&record.topic, record.partition, record.offset, handed);
                self.check_deliveries(&mut delivery, handed);
                again.push((delivery, record));
            }
            let partitions: Vec<i32> = reading.held.keys().copied().collect();
            for partition in partitions {
                let queue = reading.held.get_mut(&partition).expect("a held partition");
                while out.len() + again.len() + due.len() < max {
                    match queue.front() {
                        Some((at, _)) if *at <= now => {
                            due.push(queue.pop_front().expect("a front").1);
                        }
                        _ => break,
                    }
                }
                if queue.is_empty() {
                    reading.held.remove(&partition);
                    resume.add_partition(&self.retry_topic, partition);
                }
            }
        }
        if resume.count() > 0
            && let Err(e) = self.consumer().resume(&resume)
        {
            tracing::warn!(error = %e, "cannot resume a Kafka retry partition");
        }
        for (delivery, held) in again {
            self.reading().out.insert(delivery.receipt.clone(), held);
            out.push(delivery);
        }
        for message in due {
            if let Some(delivery) = self.hand_out(&message) {
                out.push(delivery);
            }
        }
    }

    /// Registers a record just read in its partition's ledger, and holds
    /// it (a retry copy not yet due) or hands it out.
    async fn admit(
        &self,
        message: OwnedMessage,
        out: &mut Vec<Delivery>,
    ) -> Result<(), SourceError> {
        let key = (message.topic().to_string(), message.partition());
        if self.reading().revoking.contains(&key) {
            // Its new owner reads it from the commit the revoke makes.
            return Ok(());
        }
        let known = self.reading().ledgers.contains_key(&key);
        if !known {
            let ledger = self.resume_ledger(&key, message.offset()).await?;
            self.reading().ledgers.entry(key.clone()).or_insert(ledger);
        }
        {
            let mut reading = self.reading();
            let ledger = reading.ledgers.get_mut(&key).expect("a ledger");
            if ledger.read(message.offset()) == Read::Skip {
                return Ok(());
            }
            reading.version += 1;
            if let Some(record_key) = self.ordered_key(&message) {
                let busy = reading.keys.contains_key(record_key);
                if key.0 == self.retry_topic {
                    // The copy of the message that holds its key.
                    reading.keys.entry(record_key.to_vec()).or_default();
                } else if busy {
                    let waiting = reading.keys.get_mut(record_key).expect("a busy key");
                    waiting.push_back(message);
                    return Ok(());
                } else {
                    reading.keys.insert(record_key.to_vec(), VecDeque::new());
                }
            }
            if key.0 == self.retry_topic {
                let due = self.due_of(&message);
                let waiting = reading.held.contains_key(&key.1);
                if waiting || due > SystemTime::now() {
                    reading
                        .held
                        .entry(key.1)
                        .or_default()
                        .push_back((due, message));
                    drop(reading);
                    if !waiting {
                        let mut pause = TopicPartitionList::new();
                        pause.add_partition(&self.retry_topic, key.1);
                        self.consumer().pause(&pause).map_err(unavailable)?;
                    }
                    return Ok(());
                }
            }
        }
        if let Some(delivery) = self.hand_out(&message) {
            out.push(delivery);
        }
        Ok(())
    }

    /// Resumes the retry topic's partitions that an assignment paused
    /// ([`hold_retry`](super::rebalance::Shared::hold_retry)) once their
    /// wait is over, but those holding a copy not yet due.
    fn resume_retry(&self) {
        let held: Vec<i32> = {
            let mut reading = self.reading();
            match reading.retry_resume_at {
                Some(at) if at <= std::time::Instant::now() => {
                    reading.retry_resume_at = None;
                    reading.held.keys().copied().collect()
                }
                _ => return,
            }
        };
        let consumer = self.consumer();
        let Ok(assigned) = consumer.assignment() else {
            return;
        };
        let resume = of_topic(&assigned, &self.retry_topic, &held);
        if resume.count() > 0
            && let Err(e) = consumer.resume(&resume)
        {
            tracing::warn!(error = %e, "cannot resume the Kafka retry partitions after an assignment");
        }
    }

    /// When a retry copy is due: its sealed `courier-retry-at`, else now
    /// (a record someone else wrote to the retry topic is a new message).
    fn due_of(&self, message: &OwnedMessage) -> SystemTime {
        let fields = self.seal.open(from_record(message));
        field(&fields, F_RETRY_AT)
            .and_then(|at| parse_time(at.as_bytes()))
            .unwrap_or(SystemTime::UNIX_EPOCH)
    }

    /// The ledger of a partition this source reads for the first time since
    /// it was assigned, from the group's commit.
    async fn resume_ledger(&self, key: &Partition, first_read: i64) -> Result<Ledger, SourceError> {
        let consumer = self.consumer();
        let (topic, partition) = key.clone();
        let committed = blocking(move || {
            let mut wanted = TopicPartitionList::new();
            wanted.add_partition(&topic, partition);
            let got = consumer
                .committed_offsets(wanted, REQUEST)
                .map_err(unavailable)?;
            Ok(got
                .find_partition(&topic, partition)
                .and_then(|p| match p.offset() {
                    Offset::Offset(o) => Some((o, p.metadata().to_string())),
                    _ => None,
                }))
        })
        .await?;
        Ok(Ledger::resume(
            committed.as_ref().map(|(o, m)| (*o, m.as_str())),
            first_read,
        ))
    }

    /// Counts one more hand-out of a registered record and makes it a
    /// delivery; a record handed out more than `max_deliveries` times is
    /// marked undeliverable (a poison pill).
    fn hand_out(&self, message: &OwnedMessage) -> Option<Delivery> {
        let (topic, partition, offset) = (message.topic(), message.partition(), message.offset());
        let handed = {
            let mut reading = self.reading();
            let ledger = reading.ledgers.get_mut(&(topic.to_string(), partition))?;
            let handed = ledger.hand_out(offset);
            if ledger.careful(handed, std::time::Instant::now()) {
                reading.careful.push((topic.to_string(), partition));
            }
            reading.version += 1;
            handed
        };
        let fields = without(self.seal.open(from_record(message)), F_RETRY_AT);
        let receipt = receipt(topic, partition, offset, handed);
        let id = record_id(partition, offset);
        let written = record_time(message);
        let mut delivery = Delivery::from_fields(&id, fields, handed - 1, receipt.clone(), written);
        self.check_deliveries(&mut delivery, handed);
        self.reading().out.insert(
            receipt,
            Out {
                topic: topic.to_string(),
                partition,
                offset,
                key: message.key().map(<[u8]>::to_vec),
            },
        );
        Some(delivery)
    }
}

impl KafkaSource {
    /// The record's key when messages of one key go in order.
    fn ordered_key<'m>(&self, message: &'m OwnedMessage) -> Option<&'m [u8]> {
        (self.options.ordering == Ordering::Key)
            .then(|| message.key())
            .flatten()
    }

    /// Marks a delivery handed out more than `max_deliveries` times
    /// undeliverable: a poison pill, dead-lettered without the app.
    fn check_deliveries(&self, delivery: &mut Delivery, handed: u32) {
        let max_deliveries = self.live().max_deliveries;
        if handed > max_deliveries {
            delivery.problem = Some(format!(
                "handed out {handed} times without being settled (the limit is {max_deliveries}, maxAttempts + 2)"
            ));
        }
    }
}

/// A hand-out's receipt: `<partition>/<offset>/<hand-out>/<topic>`, unique
/// per hand-out so that a late settlement of an earlier one is told apart.
pub(super) fn receipt(topic: &str, partition: i32, offset: i64, handed: u32) -> String {
    format!("{partition}/{offset}/{handed}/{topic}")
}
