//! The records of `courier dlq` jobs, kept beside a dead-letter topic in
//! `<dlq>.courier-jobs` ([`jobs_topic`]): one Kafka record per record put,
//! keyed by the job's key, the last of a key the one that counts, and a
//! removal a tombstone (a null value). The topic is made on the first put,
//! never before: a list or a removal where it is not there finds nothing.
//!
//! It is made compacted (`cleanup.policy=compact`, one partition), so that
//! Kafka keeps each key's last record however old it is, where the cluster
//! lets courier create topics (CreateTopics). Where it does not, the topic
//! is made on first use with the cluster's defaults, and a job whose
//! record is older than their retention is forgotten; create it compacted
//! yourself there.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::Consumer;
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::message::{Message, OwnedMessage};

use super::connection::{
    self, Cluster, Inspector, Producer, REQUEST, blocking, partitions, read_topic,
};
use super::fields::jobs_topic;
use super::settle::not_stored;
use courier_core::source::{SourceError, SourceOptions, is_job_key};

/// The longest topic name Kafka takes.
const TOPIC_NAME_MAX: usize = 249;

/// The job records of the dead-letter topics of one store.
pub(super) struct Jobs {
    cluster: Cluster,
    client_id: String,
    producer: Producer,
    inspector: Arc<Inspector>,
    /// Job topics known to exist: a put after the first asks nothing more.
    known: Mutex<HashSet<String>>,
}

impl Jobs {
    /// The job records of a store on these clients.
    pub(super) fn new(
        cluster: &Cluster,
        options: &SourceOptions,
        producer: Producer,
        inspector: Arc<Inspector>,
    ) -> Self {
        Self {
            cluster: cluster.clone(),
            client_id: options.consumer.clone(),
            producer,
            inspector,
            known: Mutex::default(),
        }
    }

    /// The last record of each key; none where the topic is not there.
    pub(super) async fn records(
        &self,
        dead_letter_topic: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        let (inspector, topic) = (self.inspector.clone(), jobs_topic(dead_letter_topic));
        let records = blocking(move || read_topic(&inspector, &topic)).await?;
        Ok(last_records(&records))
    }

    /// Writes `record` under `key`, making the topic first if needed, and
    /// returns once the cluster stored it (every in-sync replica, so any
    /// reader finds it next).
    pub(super) async fn put(
        &self,
        dead_letter_topic: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        check_key(key)?;
        let topic = jobs_topic(dead_letter_topic);
        if topic.len() > TOPIC_NAME_MAX {
            return Err(SourceError::invalid(format!(
                "the dead-letter queue {dead_letter_topic:?} has too long a name for the topic of its jobs ({topic:?} is over Kafka's {TOPIC_NAME_MAX} characters); name a shorter deadLetterQueue in the policy"
            )));
        }
        self.make(&topic).await?;
        self.write(&topic, key, Some(&record)).await
    }

    /// Writes the tombstone of `key`, where the topic is there: a removal
    /// creates nothing.
    pub(super) async fn remove(
        &self,
        dead_letter_topic: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        check_key(key)?;
        let topic = jobs_topic(dead_letter_topic);
        if !self.is_known(&topic) {
            let (inspector, asked) = (self.inspector.clone(), topic.clone());
            if blocking(move || partitions(&inspector, &asked))
                .await?
                .is_none()
            {
                return Ok(());
            }
            self.learn(&topic);
        }
        self.write(&topic, key, None).await
    }

    async fn write(
        &self,
        topic: &str,
        key: &str,
        record: Option<&[u8]>,
    ) -> Result<(), SourceError> {
        self.producer
            .send(topic, Some(key.as_bytes()), record, None, REQUEST)
            .await
            .map(drop)
            .map_err(|e| {
                let what = match record {
                    Some(_) => format!("the record of job {key:?} in {topic:?}"),
                    None => format!("the removal of job {key:?} from {topic:?}"),
                };
                not_stored(&what, key.len() + record.map_or(0, <[u8]>::len), e)
            })
    }

    /// Makes `topic` if it is not there: compacted where the cluster takes
    /// CreateTopics, else on first use ([`connection::ensure_topic`]), and
    /// waits until the metadata shows it.
    async fn make(&self, topic: &str) -> Result<(), SourceError> {
        if self.is_known(topic) {
            return Ok(());
        }
        let (cluster, client_id) = (self.cluster.clone(), self.client_id.clone());
        let (producer, inspector) = (self.producer.clone(), self.inspector.clone());
        let made = topic.to_string();
        blocking(move || {
            if partitions(&inspector, &made)?.is_none() {
                match create_compacted(&cluster, &client_id, &inspector, &made) {
                    Ok(()) => {}
                    // Only the mock cluster (and brokers before 0.10.2)
                    // have no CreateTopics; the mock keeps every record.
                    Err(RDKafkaErrorCode::UnsupportedFeature) => {
                        tracing::debug!(topic = %made, "no CreateTopics: the topic of dlq job records is made on first use");
                    }
                    Err(code) => tracing::warn!(
                        topic = %made,
                        "the cluster did not create the topic of dlq job records compacted (CreateTopics: {code}); it is made on first use with the cluster's defaults, and a job whose record is older than their retention is forgotten: create it with cleanup.policy=compact"
                    ),
                }
            }
            connection::ensure_topic(&producer, &inspector, &made).map(drop)
        })
        .await?;
        self.learn(topic);
        Ok(())
    }

    fn is_known(&self, topic: &str) -> bool {
        self.known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(topic)
    }

    fn learn(&self, topic: &str) {
        self.known
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(topic.to_string());
    }
}

/// Refuses a key that is not a job key: its record would be written and
/// then never listed ([`last_records`]).
fn check_key(key: &str) -> Result<(), SourceError> {
    if is_job_key(key) {
        Ok(())
    } else {
        Err(SourceError::invalid(format!(
            "{key:?} is not a dlq job key: 1 to 64 of a-z, 0-9 and -"
        )))
    }
}

/// Asks the cluster to create `topic` compacted, with one partition and
/// the cluster's replication factor (blocking); `Ok` when it did or the
/// topic is there already. Asked of the broker the inspector reached, not
/// of the controller, because librdkafka's admin client waits for a
/// controller the mock cluster never names (it would wait out the whole
/// timeout there); brokers forward it to the controller since Kafka 2.8,
/// and one that answers that it is not the controller (a ZooKeeper
/// cluster before that) has it asked of the controller.
fn create_compacted(
    cluster: &Cluster,
    client_id: &str,
    inspector: &Inspector,
    topic: &str,
) -> Result<(), RDKafkaErrorCode> {
    let code =
        |e: rdkafka::error::KafkaError| e.rdkafka_error_code().unwrap_or(RDKafkaErrorCode::Unknown);
    let reached = inspector
        .fetch_metadata(Some(topic), REQUEST)
        .map_err(code)?
        .orig_broker_id();
    let admin = cluster.admin(client_id).map_err(code)?;
    let wanted =
        NewTopic::new(topic, 1, TopicReplication::Fixed(-1)).set("cleanup.policy", "compact");
    let ask = |options: AdminOptions| {
        let asked = admin.create_topics([&wanted], &options.request_timeout(Some(REQUEST)));
        match futures::executor::block_on(asked) {
            Ok(results) => match results.into_iter().next() {
                Some(Ok(_)) | Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) => Ok(()),
                Some(Err((_, code))) => Err(code),
                None => Err(RDKafkaErrorCode::Unknown),
            },
            Err(e) => Err(code(e)),
        }
    };
    match ask(AdminOptions::new().broker_id(reached)) {
        Err(RDKafkaErrorCode::NotController) => ask(AdminOptions::new()),
        done => done,
    }
}

/// The last record of each job key, from a topic read partition by
/// partition in offset order (a key's records are all in one partition):
/// a tombstone removes the key. A record whose key is not a job key is
/// not courier's and is left out.
fn last_records(records: &[OwnedMessage]) -> Vec<(String, Bytes)> {
    let mut last: HashMap<&str, Option<&[u8]>> = HashMap::new();
    for record in records {
        let Some(key) = record
            .key()
            .and_then(|k| std::str::from_utf8(k).ok())
            .filter(|k| is_job_key(k))
        else {
            continue;
        };
        last.insert(key, record.payload());
    }
    last.into_iter()
        .filter_map(|(key, value)| Some((key.to_string(), Bytes::copy_from_slice(value?))))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::Timestamp;

    fn record(partition: i32, offset: i64, key: &[u8], value: Option<&[u8]>) -> OwnedMessage {
        OwnedMessage::new(
            value.map(<[u8]>::to_vec),
            Some(key.to_vec()),
            "q.dlq.courier-jobs".into(),
            Timestamp::NotAvailable,
            partition,
            offset,
            None,
        )
    }

    #[test]
    fn the_last_record_of_a_key_counts_and_a_tombstone_removes_it() {
        let records = [
            record(0, 0, b"job-a", Some(b"1")),
            record(0, 1, b"job-b", Some(b"1")),
            record(0, 2, b"job-a", Some(b"2")),
            record(0, 3, b"job-b", None),
            record(0, 4, b"job-c", None),
            record(0, 5, b"job-c", Some(b"")),
            record(1, 0, b"job-d", Some(b"x")),
            record(1, 1, b"Not A Job", Some(b"foreign")),
            record(1, 2, &[0xff, 0xfe], Some(b"foreign")),
        ];
        let mut kept = last_records(&records);
        kept.sort();
        assert_eq!(
            kept,
            vec![
                ("job-a".to_string(), Bytes::from_static(b"2")),
                ("job-c".to_string(), Bytes::new()),
                ("job-d".to_string(), Bytes::from_static(b"x")),
            ]
        );
    }

    #[test]
    fn a_record_without_a_key_is_not_a_job() {
        let keyless = OwnedMessage::new(
            Some(b"v".to_vec()),
            None,
            "t".into(),
            Timestamp::NotAvailable,
            0,
            0,
            None,
        );
        assert_eq!(last_records(&[keyless]), vec![]);
    }

    #[test]
    fn only_job_keys_are_written() {
        assert!(check_key("job-1").is_ok());
        for bad in ["", "Job", "a/b", &"x".repeat(65)] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
    }
}
