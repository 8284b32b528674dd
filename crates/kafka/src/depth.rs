//! Depth from watermarks and the group's commits: per partition, the high
//! watermark minus the committed offset is what the group has not settled;
//! the commit's metadata says how much of that is handed out or settled
//! out of order. Any process can read it, without joining the group.

use std::time::{Duration, SystemTime};

use rdkafka::consumer::Consumer;
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use super::KafkaSource;
use super::connection::{Inspector, REQUEST, blocking, partitions, unavailable};
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

fn lag(inspector: &Inspector, topic: &str) -> Result<Lag, SourceError> {
    let Some(partitions) = partitions(inspector, topic)? else {
        return Ok(Lag::default());
    };
    let mut wanted = TopicPartitionList::new();
    for p in &partitions {
        wanted.add_partition(topic, *p);
    }
    let committed = inspector
        .committed_offsets(wanted, REQUEST)
        .map_err(unavailable)?;
    let mut lag = Lag::default();
    for p in partitions {
        let (low, high) = inspector
            .fetch_watermarks(topic, p, REQUEST)
            .map_err(unavailable)?;
        let (from, metadata) = match committed.find_partition(topic, p) {
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
            lag.first_waiting.push((p, first));
        }
    }
    Ok(lag)
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
        let inspector = self.inspector.clone();
        let (topic, retry) = (self.options.queue.clone(), self.retry_topic.clone());
        blocking(move || {
            let work = lag(&inspector, &topic)?;
            let retries = lag(&inspector, &retry)?;
            Ok((
                work.waiting + work.handed + retries.waiting + retries.handed,
                work.committed + retries.committed,
            ))
        })
        .await
    }

    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let inspector = self.inspector.clone();
        let (topic, retry) = (self.options.queue.clone(), self.retry_topic.clone());
        let (work, retries, oldest_waiting_age) = blocking(move || {
            let work = lag(&inspector, &topic)?;
            let retries = lag(&inspector, &retry)?;
            let age = if work.waiting == 0 {
                Some(Duration::ZERO)
            } else {
                oldest_age(&inspector, &topic, &work.first_waiting)
            };
            Ok((work, retries, age))
        })
        .await?;
        let dead_letters = self
            .store
            .count_letters(&self.live().dead_letter_queue)
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
