//! Dead-letter topics and the dead-letter store: browsing them, and
//! replaying and purging letters, which Kafka cannot delete one by one: the
//! ids of removed letters are recorded in `<dlq>.removed` and left out when
//! browsing; sending to the work topic; and the records of `courier dlq`
//! jobs (`jobs.rs`).
//!
//! A replay writes the letter to the work topic, then its id to
//! `<dlq>.removed`: one cut short between the two leaves the letter in
//! both, never in neither. It is not one transaction because the commit
//! markers would leave the group's committed offset one short of each
//! partition's end, which depth and stall detection would read as a
//! waiting record, and librdkafka's mock cluster, the only Kafka courier is
//! tested on, writes none, so the exactness could not be tested.
//!
//! Opened alone (`courier dlq`, `courier send`), the store has a producer
//! and an inspector that never joins the group nor commits for it, and
//! creates nothing: no topic, no group offset, no seal key. Listing a topic
//! that does not exist lists nothing; a send or replay first asks the
//! metadata whether the work topic exists (the producer would have the
//! cluster create it) and says how to create it when it does not; the seal
//! key is read, or recorded, by the first replay; the topic of job records
//! is made by the first record put.

use std::collections::HashSet;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use rdkafka::message::{Message, OwnedMessage};
use tokio::sync::OnceCell;

use super::connection::{
    self, Cluster, Inspector, Marks, Producer, REQUEST, blocking, partitions, read_topic, seal_of,
    unavailable,
};
use super::depth::KnownPartitions;
use super::fields::{from_record, parse_record_id, record_id, removed_topic, retry_topic};
use super::jobs::Jobs;
use super::settle::produce;
use courier_core::model::{DeadLetter, PAYLOAD};
use courier_core::source::shared::{Seal, not_there};
use courier_core::source::{DeadLetterStore, Depth, SourceError, SourceOptions};

/// Refuses a dead-letter topic whose letters would come back as work.
pub(super) fn check_dead_letter_topic(dead_letter_topic: &str, topic: &str) -> Result<(), String> {
    if dead_letter_topic == topic || dead_letter_topic == retry_topic(topic) {
        return Err(format!(
            "the dead-letter queue {dead_letter_topic:?} is a topic courier reads work from, so dead letters would be delivered again; name another deadLetterQueue in the policy"
        ));
    }
    if dead_letter_topic.is_empty()
        || !dead_letter_topic
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
    {
        return Err(format!(
            "the dead-letter queue {dead_letter_topic:?} is not a Kafka topic name: letters, digits, '.', '_' and '-'"
        ));
    }
    Ok(())
}

/// The dead letters of one work topic, and sends to it.
pub(super) struct KafkaStore {
    topic: String,
    producer: Producer,
    inspector: Arc<Inspector>,
    jobs: Jobs,
    /// Known once the work topic was found to exist.
    work_topic: OnceCell<()>,
    /// The partitions of the topics depth reads count.
    known: Arc<KnownPartitions>,
    /// The topic's seal: the consumer's, or read (and recorded if missing)
    /// when an admin handle first replays.
    seal: OnceCell<Arc<Seal>>,
}

impl KafkaStore {
    /// A consumer's store, on its clients, its seal and its work topic,
    /// which it found at start.
    pub(super) fn new(
        cluster: &Cluster,
        options: &SourceOptions,
        producer: Producer,
        inspector: Arc<Inspector>,
        known: Arc<KnownPartitions>,
        seal: Arc<Seal>,
    ) -> Self {
        Self {
            topic: options.queue.clone(),
            jobs: Jobs::new(cluster, options, producer.clone(), inspector.clone()),
            producer,
            inspector,
            work_topic: OnceCell::new_with(Some(())),
            known,
            seal: OnceCell::new_with(Some(seal)),
        }
    }

    /// An admin handle: the clients, nothing created.
    pub(super) async fn open(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let cluster = connection::Cluster::of(url, &options)?;
        connection::check_topic(&options.queue)?;
        let inspector = Arc::new(connection::inspector(&cluster, &options)?);
        // One request before any command's work, so that a refused login or
        // an untrusted certificate ends the command with what to fix.
        let (reached, topic, at) = (inspector.clone(), options.queue.clone(), cluster.clone());
        blocking(move || at.reach(&reached, &topic)).await?;
        let producer = connection::producer(&cluster, &options)?;
        Ok(Self {
            topic: options.queue.clone(),
            jobs: Jobs::new(&cluster, &options, producer.clone(), inspector.clone()),
            producer,
            inspector,
            work_topic: OnceCell::new(),
            known: Arc::default(),
            seal: OnceCell::new_with(options.seal.clone()),
        })
    }

    /// The work topic, which a send and a replay write to and depth reads:
    /// it must exist, as the producer would otherwise have the cluster
    /// create it.
    async fn work_topic(&self) -> Result<&str, SourceError> {
        self.work_topic
            .get_or_try_init(|| async {
                let (inspector, topic) = (self.inspector.clone(), self.topic.clone());
                let found = blocking(move || partitions(&inspector, &topic)).await?;
                match found {
                    Some(_) => Ok(()),
                    None => Err(connection::missing_topic(&self.topic)),
                }
            })
            .await?;
        Ok(&self.topic)
    }

    /// The records of a dead-letter topic not yet removed, oldest first,
    /// and the ids removed.
    async fn letters(&self, dead_letter_topic: &str) -> Result<Vec<OwnedMessage>, SourceError> {
        let inspector = self.inspector.clone();
        let topic = dead_letter_topic.to_string();
        blocking(move || {
            let removed = removed_ids(&read_topic(&inspector, &removed_topic(&topic))?);
            let mut letters: Vec<OwnedMessage> = read_topic(&inspector, &topic)?
                .into_iter()
                .filter(|r| !removed.contains(&record_id(r.partition(), r.offset())))
                .collect();
            letters.sort_by_key(|r| {
                (
                    r.timestamp().to_millis().unwrap_or(0),
                    r.partition(),
                    r.offset(),
                )
            });
            Ok(letters)
        })
        .await
    }

    /// Whether the letter `id` is in the topic and not removed.
    async fn is_there(&self, dead_letter_topic: &str, id: &str) -> Result<(), SourceError> {
        if parse_record_id(id).is_none() {
            return Err(SourceError::invalid(format!(
                "{id:?} is not a dead-letter id of Kafka (<partition>-<offset>)"
            )));
        }
        let there = self
            .letters(dead_letter_topic)
            .await?
            .iter()
            .any(|r| record_id(r.partition(), r.offset()) == id);
        if there {
            Ok(())
        } else {
            Err(not_there(dead_letter_topic, id))
        }
    }

    async fn remove(&self, dead_letter_topic: &str, id: &str) -> Result<(), SourceError> {
        let fields = vec![(
            Bytes::from_static(PAYLOAD.as_bytes()),
            Bytes::from(id.to_string()),
        )];
        produce(
            &self.producer,
            &removed_topic(dead_letter_topic),
            Some(id.as_bytes()),
            &fields,
        )
        .await
        .map(drop)
    }
}

#[async_trait]
impl DeadLetterStore for KafkaStore {
    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        Ok(self
            .letters(dead_letter_queue)
            .await?
            .iter()
            .take(limit)
            .map(|r| DeadLetter::from_fields(record_id(r.partition(), r.offset()), from_record(r)))
            .collect())
    }

    /// Writes the letter back to the work topic, then records it removed:
    /// a replay cut short between the two leaves it in both, never in
    /// neither.
    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        self.is_there(dead_letter_queue, &letter.id).await?;
        let topic = self.work_topic().await?;
        let seal = self
            .seal
            .get_or_try_init(|| async {
                seal_of(&self.producer, &self.inspector, &self.topic)
                    .await
                    .map(Arc::new)
            })
            .await?;
        let fields = seal.seal(letter.fields_for_replay());
        produce(&self.producer, topic, None, &fields).await?;
        self.remove(dead_letter_queue, &letter.id).await
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        self.is_there(dead_letter_queue, &letter.id).await?;
        self.remove(dead_letter_queue, &letter.id).await
    }

    /// The sidecar's reading ([`super::depth::read`]) on this store's
    /// inspector: the group's commits without joining it. The dead-letter
    /// topics are not made here: one that is not there holds nothing.
    async fn depth_of(&self, dead_letter_queue: &str) -> Result<Option<Depth>, SourceError> {
        let topic = self.work_topic().await?;
        super::depth::read(&self.inspector, &self.known, topic, dead_letter_queue)
            .await
            .map(Some)
    }

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        let topic = self.work_topic().await?;
        let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), body)];
        fields.extend(
            headers
                .iter()
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        let (partition, offset) = produce(&self.producer, topic, None, &fields).await?;
        Ok(record_id(partition, offset))
    }

    async fn flush(&self) {
        let producer = self.producer.clone();
        let _ = blocking(move || producer.flush(REQUEST).map_err(unavailable)).await;
    }

    async fn job_records(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        self.jobs.records(dead_letter_queue).await
    }

    async fn put_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        self.jobs.put(dead_letter_queue, key, record).await
    }

    async fn remove_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        self.jobs.remove(dead_letter_queue, key).await
    }
}

/// The ids a removed-letters topic records.
/// The number of letters in `dead_letter_topic` not yet removed, from
/// watermarks already asked (`marks`, which hold it and its `.removed`
/// topic): what its partitions keep, less the ids recorded removed. The
/// `.removed` topic is read only when it holds anything (only that topic
/// is read, never the letters).
pub(super) fn count_letters(
    inspector: &Inspector,
    dead_letter_topic: &str,
    marks: &Marks,
) -> Result<u64, SourceError> {
    let kept_in = |topic: &str| -> u64 {
        marks
            .iter()
            .filter(|((t, _), _)| t == topic)
            .map(|(_, (low, high))| high.saturating_sub(*low).max(0) as u64)
            .sum()
    };
    let kept = kept_in(dead_letter_topic);
    let removed = removed_topic(dead_letter_topic);
    if kept == 0 || kept_in(&removed) == 0 {
        return Ok(kept);
    }
    let removed = removed_ids(&read_topic(inspector, &removed)?);
    Ok(kept.saturating_sub(removed.len() as u64))
}

fn removed_ids(records: &[OwnedMessage]) -> HashSet<String> {
    records
        .iter()
        .filter_map(|r| r.payload())
        .map(|p| String::from_utf8_lossy(p).into_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_topic_is_not_a_work_topic() {
        assert!(check_dead_letter_topic("orders.dlq", "orders").is_ok());
        for bad in ["orders", "orders.retry", "", "with space", "a/b"] {
            assert!(check_dead_letter_topic(bad, "orders").is_err(), "{bad}");
        }
    }
}
