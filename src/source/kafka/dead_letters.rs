//! Dead-letter topics: browsing them, and replaying and purging letters,
//! which Kafka cannot delete one by one: the ids of removed letters are
//! recorded in `<dlq>.removed` and left out when browsing.

use std::collections::HashSet;

use bytes::Bytes;
use rdkafka::consumer::Consumer;
use rdkafka::message::{Message, OwnedMessage};

use super::KafkaSource;
use super::connection::{REQUEST, blocking, partitions, read_topic, unavailable};
use super::fields::{from_record, parse_record_id, record_id, removed_topic, retry_topic};
use crate::model::DeadLetter;
use crate::source::SourceError;
use crate::source::shared::not_there;

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

impl KafkaSource {
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

    /// The number of letters in a dead-letter topic not yet removed: what
    /// its partitions keep, less the ids recorded removed (only that topic
    /// is read, not the letters).
    pub(super) async fn count_letters(&self, dead_letter_topic: &str) -> Result<u64, SourceError> {
        let inspector = self.inspector.clone();
        let topic = dead_letter_topic.to_string();
        blocking(move || {
            let Some(partitions) = partitions(&inspector, &topic)? else {
                return Ok(0);
            };
            let mut kept = 0u64;
            for p in partitions {
                let (low, high) = inspector
                    .fetch_watermarks(&topic, p, REQUEST)
                    .map_err(unavailable)?;
                kept += high.saturating_sub(low).max(0) as u64;
            }
            let removed = removed_ids(&read_topic(&inspector, &removed_topic(&topic))?);
            Ok(kept.saturating_sub(removed.len() as u64))
        })
        .await
    }

    pub(super) async fn browse_dead_letters(
        &self,
        dead_letter_topic: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        Ok(self
            .letters(dead_letter_topic)
            .await?
            .iter()
            .take(limit)
            .map(|r| DeadLetter::from_fields(record_id(r.partition(), r.offset()), from_record(r)))
            .collect())
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

    /// Writes the letter back to the work topic, then records it removed:
    /// a replay cut short between the two leaves it in both, never in
    /// neither.
    pub(super) async fn replay_dead_letter(
        &self,
        dead_letter_topic: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        self.is_there(dead_letter_topic, &letter.id).await?;
        let fields = self.seal.seal(letter.fields_for_replay());
        let topic = self.options.queue.clone();
        self.produce(&topic, None, &fields).await?;
        self.remove(dead_letter_topic, &letter.id).await
    }

    pub(super) async fn purge_dead_letter(
        &self,
        dead_letter_topic: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        self.is_there(dead_letter_topic, &letter.id).await?;
        self.remove(dead_letter_topic, &letter.id).await
    }

    async fn remove(&self, dead_letter_topic: &str, id: &str) -> Result<(), SourceError> {
        let fields = vec![(
            Bytes::from_static(crate::model::PAYLOAD.as_bytes()),
            Bytes::from(id.to_string()),
        )];
        self.produce(
            &removed_topic(dead_letter_topic),
            Some(id.as_bytes()),
            &fields,
        )
        .await
        .map(drop)
    }
}

/// The ids a removed-letters topic records.
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
