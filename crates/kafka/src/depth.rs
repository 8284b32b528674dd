//! Depth from watermarks and the group's commits: per partition, the high
//! watermark minus the committed offset is what the group has not settled;
//! the commit's metadata says how much of that is handed out or settled
//! out of order. Any process can read it, without joining the group.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use rdkafka::consumer::Consumer;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use super::KafkaSource;
use super::connection::{Inspector, Marks, REQUEST, blocking, partitions, unavailable, watermarks};
use super::dead_letters::count_letters;
use super::fields::removed_topic;
use super::offsets::summary;
use courier_core::source::{Depth, SourceError};

/// One topic's unsettled work as the group's commits tell it.
#[derive(Debug, Default)]
struct Lag {
    /// Not handed out and not settled.
    waiting: u64,
    /// Handed out, not settled.
    handed: u64,
    /// The first waiting record of each partition that has one.
    first_waiting: Vec<(i32, i64)>,
    /// The sum of the partitions' commit points: it moves while the group
    /// settles anything.
    committed: i64,
}

/// How long a topic's partitions, once seen, are taken as known: a depth
/// read then asks no metadata, and a partition added to a topic is counted
/// within this long.
const PARTITIONS_KNOWN: Duration = Duration::from_secs(60);

/// The partitions of the topics depth reads count, as last seen.
#[derive(Default)]
pub(super) struct KnownPartitions(Mutex<HashMap<String, (Instant, Vec<i32>)>>);

impl KnownPartitions {
    /// `topic`'s partitions, from the cluster when not seen within
    /// [`PARTITIONS_KNOWN`]; none for a topic that does not exist (asked
    /// again next time).
    fn of(&self, inspector: &Inspector, topic: &str) -> Result<Vec<i32>, SourceError> {
        let lock = || self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((at, known)) = lock().get(topic)
            && at.elapsed() < PARTITIONS_KNOWN
        {
            return Ok(known.clone());
        }
        let found = partitions(inspector, topic)?;
        let mut known = lock();
        match &found {
            Some(found) => {
                known.insert(topic.to_string(), (Instant::now(), found.clone()));
            }
            None => {
                known.remove(topic);
            }
        }
        Ok(found.unwrap_or_default())
    }
}

/// The lag of each of `topics`, and the watermarks of them and of `also`:
/// their partitions (a metadata request each), the group's commits of
/// `topics` (one request) and the watermarks of all (two rounds, a request
/// per leader each).
fn lags<const N: usize>(
    inspector: &Inspector,
    known: &KnownPartitions,
    topics: [&str; N],
    also: &[&str],
) -> Result<([Lag; N], Marks), SourceError> {
    let mut found = Vec::new();
    for topic in topics.iter().chain(also) {
        found.push(known.of(inspector, topic)?);
    }
    let mut wanted = TopicPartitionList::new();
    for (topic, partitions) in topics.iter().zip(&found) {
        for p in partitions {
            wanted.add_partition(topic, *p);
        }
    }
    let committed = if wanted.count() == 0 {
        TopicPartitionList::new()
    } else {
        inspector
            .committed_offsets(wanted, REQUEST)
            .map_err(unavailable)?
    };
    let asked: Vec<(&str, &[i32])> = topics
        .iter()
        .chain(also)
        .zip(&found)
        .map(|(t, p)| (*t, p.as_slice()))
        .collect();
    let marks = watermarks(inspector, &asked)?;
    let mut out = std::array::from_fn(|_| Lag::default());
    for ((topic, partitions), lag) in asked.into_iter().zip(out.iter_mut()) {
        for p in partitions {
            let (low, high) = marks
                .get(&(topic.to_string(), *p))
                .copied()
                .ok_or_else(|| unavailable(format!("no offsets of {topic} [{p}]")))?;
            let (from, metadata) = match committed.find_partition(topic, *p) {
                Some(e) => match e.offset() {
                    Offset::Offset(o) => (o.max(low), e.metadata().to_string()),
                    _ => (low, String::new()),
                },
                None => (low, String::new()),
            };
            lag.committed += from;
            if high <= from {
                continue;
            }
            let (handed, done, first) = summary(&metadata, from, high);
            let unsettled = (high - from) as u64;
            lag.handed += handed;
            lag.waiting += unsettled.saturating_sub(handed + done);
            if let Some(first) = first {
                lag.first_waiting.push((*p, first));
            }
        }
    }
    Ok((out, marks))
}

/// The age of the oldest of these records, from their timestamps.
fn oldest_age(inspector: &Inspector, topic: &str, records: &[(i32, i64)]) -> Option<Duration> {
    let mut oldest: Option<i64> = None;
    for (p, offset) in records {
        let mut wanted = TopicPartitionList::new();
        wanted
            .add_partition_offset(topic, *p, Offset::Offset(*offset))
            .ok()?;
        let at = {
            let _reading = super::connection::READING
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            inspector.assign(&wanted).ok()?;
            let got = inspector.poll(REQUEST);
            let _ = inspector.unassign();
            match got {
                Some(Ok(m)) if m.partition() == *p => m.timestamp().to_millis(),
                _ => None,
            }
        }?;
        oldest = Some(oldest.map_or(at, |o: i64| o.min(at)));
    }
    let at = SystemTime::UNIX_EPOCH + Duration::from_millis(u64::try_from(oldest?).ok()?);
    Some(SystemTime::now().duration_since(at).unwrap_or_default())
}

impl KafkaSource {
    /// The records of the work and retry topics not settled by the group
    /// (waiting or handed out), and the sum of the group's commit points.
    pub(super) async fn progress(&self) -> Result<(u64, i64), SourceError> {
        let (inspector, known) = (self.inspector.clone(), self.known.clone());
        let (topic, retry) = (self.options.queue.clone(), self.retry_topic.clone());
        blocking(move || {
            let ([work, retries], _) = lags(&inspector, &known, [&topic, &retry], &[])?;
            Ok((
                work.waiting + work.handed + retries.waiting + retries.handed,
                work.committed + retries.committed,
            ))
        })
        .await
    }

    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let dead_letter_topic = self.live().dead_letter_queue.clone();
        super::ensure_dead_letter_topics(
            &self.producer,
            &self.inspector,
            &self.ensured,
            &dead_letter_topic,
        )
        .await?;
        let (inspector, known) = (self.inspector.clone(), self.known.clone());
        let (topic, retry) = (self.options.queue.clone(), self.retry_topic.clone());
        let (work, retries, dead_letters, oldest_waiting_age) = blocking(move || {
            let removed = removed_topic(&dead_letter_topic);
            let ([work, retries], marks) = lags(
                &inspector,
                &known,
                [&topic, &retry],
                &[&dead_letter_topic, &removed],
            )?;
            let dead_letters = count_letters(&inspector, &dead_letter_topic, &marks)?;
            let age = if work.waiting == 0 {
                Some(Duration::ZERO)
            } else {
                oldest_age(&inspector, &topic, &work.first_waiting)
            };
            Ok((work, retries, dead_letters, age))
        })
        .await?;
        Ok(Depth {
            ready: Some(work.waiting),
            pending: work.handed + retries.handed,
            retry_backlog: retries.waiting,
            dead_letters,
            oldest_dead_letter_age: None,
            queue_depth: Some(work.waiting + work.handed),
            oldest_waiting_age,
        })
    }
}
