//! Depth from watermarks and the group's commits: per partition, the high
//! watermark minus the committed offset is what the group has not settled;
//! the commit's metadata says how much of that is handed out or settled
//! out of order. Any process can read it, without joining the group.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rdkafka::consumer::Consumer;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use super::KafkaSource;
use super::connection::{Inspector, Marks, REQUEST, blocking, partitions, unavailable, watermarks};
use super::dead_letters::count_letters;
use super::fields::{removed_topic, retry_topic};
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

    /// The sidecar's reading ([`read`]), after making sure the dead-letter
    /// topics exist: the inspector then never asks about a missing one.
    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let dead_letter_topic = self.live().dead_letter_queue.clone();
        super::ensure_dead_letter_topics(
            &self.producer,
            &self.inspector,
            &self.ensured,
            &dead_letter_topic,
        )
        .await?;
        read(
            &self.inspector,
            &self.known,
            &self.options.queue,
            &dead_letter_topic,
        )
        .await
    }
}

/// The depth of the work topic `topic` and its retry topic as the group's
/// commits tell it, with the letters of `dead_letter_topic`: what the
/// sidecar's gauges show and what an admin handle's `depth_of` reads. It
/// asks metadata, watermarks and the group's commits, and reads the first
/// waiting records for their age, on the inspector: nothing joins the
/// group, commits or creates a topic. A topic that is not there counts
/// nothing.
pub(super) async fn read(
    inspector: &Arc<Inspector>,
    known: &Arc<KnownPartitions>,
    topic: &str,
    dead_letter_topic: &str,
) -> Result<Depth, SourceError> {
    let (inspector, known) = (inspector.clone(), known.clone());
    let (topic, retry) = (topic.to_string(), retry_topic(topic));
    let dead_letter_topic = dead_letter_topic.to_string();
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

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use rdkafka::mocking::MockCluster;

    use super::*;
    use crate::connection::partitions;
    use crate::dead_letters::KafkaStore;
    use courier_core::model::Failure;
    use courier_core::source::{
        Consumer as _, DeadLetterStore, ErrorKind, Observed, SettleBy, SourceOptions,
    };

    /// Two readings taken one after the other: equal, but for the ages,
    /// which grow by the time between them.
    fn same(a: &Depth, b: &Depth) -> bool {
        let close = |a: Option<Duration>, b: Option<Duration>| match (a, b) {
            (Some(a), Some(b)) => a.abs_diff(b) < Duration::from_secs(2),
            (a, b) => a == b,
        };
        Depth {
            oldest_waiting_age: None,
            ..a.clone()
        } == Depth {
            oldest_waiting_age: None,
            ..b.clone()
        } && close(a.oldest_waiting_age, b.oldest_waiting_age)
    }

    /// The sidecar's reading, the admin handle's, and the sidecar's again,
    /// until the two of the sidecar agree (a commit between two readings
    /// changes them): then the admin handle's, taken between them, must be
    /// the same.
    async fn read_both(source: &KafkaSource, admin: &KafkaStore, dlq: &str) -> Depth {
        for _ in 0..50 {
            let before = source.depth().await.unwrap();
            let read = admin.depth_of(dlq).await.unwrap().unwrap();
            let after = source.depth().await.unwrap();
            if same(&before, &after) {
                assert!(same(&read, &before), "admin {read:?}, sidecar {before:?}");
                return read;
            }
        }
        panic!("the depth did not hold still");
    }

    /// Against librdkafka's mock cluster: an admin handle reads the figures
    /// the sidecar's gauges read from the group's commits, with records
    /// waiting, one handed out, one retried (a copy waiting in the retry
    /// topic) and one dead-lettered. A missing work topic is named, and the
    /// handle creates no topic. (It has no client that joins the group; the
    /// mock cluster answers no ListGroups to show that.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_admin_handle_reads_the_depth_the_sidecar_reads() {
        let cluster = MockCluster::new(1).unwrap();
        let url = format!("kafka://{}", cluster.bootstrap_servers());
        let topic = "depth-of";
        let mut options = SourceOptions::new(topic);
        let dlq = options.live.dead_letter_queue.clone();
        let admin = KafkaStore::open(&url, options.clone()).await.unwrap();
        let inspector = crate::connection::inspector(
            &crate::connection::Cluster::of(&url, &options).unwrap(),
            &options,
        )
        .unwrap();

        let err = admin.depth_of(&dlq).await.unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
        assert!(err.message().contains(topic), "{err}");
        for name in [topic.to_string(), retry_topic(topic), dlq.clone()] {
            assert_eq!(partitions(&inspector, &name).unwrap(), None, "{name} made");
        }

        cluster.create_topic(topic, 1, 1).unwrap();
        let before_any = admin.depth_of(&dlq).await.unwrap().unwrap();
        assert_eq!(
            (before_any.ready, before_any.dead_letters),
            (Some(0), 0),
            "{before_any:?}"
        );
        for name in [retry_topic(topic), dlq.clone()] {
            assert_eq!(partitions(&inspector, &name).unwrap(), None, "{name} made");
        }

        options.live.visibility_timeout = Duration::from_secs(30);
        let source = KafkaSource::connect(&url, options).await.unwrap();
        for i in 0..6 {
            admin.send(Bytes::from(format!("m{i}")), &[]).await.unwrap();
        }
        admin.flush().await;
        let fresh = read_both(&source, &admin, &dlq).await;
        assert_eq!((fresh.ready, fresh.pending), (Some(6), 0), "{fresh:?}");

        let deadline = Instant::now() + Duration::from_secs(30);
        let mut got = Vec::new();
        while got.len() < 4 {
            assert!(Instant::now() < deadline, "no records: {got:?}");
            got.extend(source.receive(4 - got.len()).await.unwrap());
        }
        let now = SystemTime::now();
        source
            .dead_letter(
                &got[0],
                &Failure::permanent_422(topic, &dlq, &got[0].message.id),
            )
            .await
            .unwrap();
        source
            .retry(&got[1], 2, now, now + Duration::from_secs(3600))
            .await
            .unwrap();
        source.ack(&got[2]).await.unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let read = loop {
            let read = read_both(&source, &admin, &dlq).await;
            let counts = (
                read.ready,
                read.pending,
                read.retry_backlog,
                read.dead_letters,
                read.queue_depth,
            );
            if counts == (Some(2), 1, 1, 1, Some(3)) {
                break read;
            }
            assert!(Instant::now() < deadline, "not committed: {read:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        assert!(read.oldest_waiting_age.is_some(), "{read:?}");
        source.close().await;
    }
}
