//! A rebalance that takes partitions away: no new work is taken from them
//! (the reader is inside the rebalance callback meanwhile), deliveries in
//! flight on them get until the visibility timeout to settle, what is
//! settled is committed, and what the source held of them is forgotten.
//! Their new owner reads them from that commit, so nothing settled here is
//! delivered twice. A stop does not wait: what is unsettled then is
//! abandoned, and the commit never passes it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use super::Reading;
use super::connection::Group;

/// What the group consumer's context shares with the source.
pub(super) struct Shared {
    pub(super) reading: Arc<Mutex<Reading>>,
    pub(super) retry_topic: String,
    /// How long deliveries in flight on a revoked partition may take.
    pub(super) bound: Duration,
    /// Set when the source closes or is dropped: a revoke then waits for
    /// nothing.
    pub(super) closing: Arc<AtomicBool>,
}

impl Shared {
    fn reading(&self) -> std::sync::MutexGuard<'_, Reading> {
        self.reading.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn revoke(&self, consumer: &BaseConsumer<Group>, revoked: &TopicPartitionList) {
        let partitions: Vec<(String, i32)> = revoked
            .elements()
            .iter()
            .map(|p| (p.topic().to_string(), p.partition()))
            .collect();
        let work = |wait: bool| {
            let deadline = Instant::now() + self.bound;
            let (wanted, abandoned) = loop {
                let mut reading = self.reading();
                let in_flight = reading
                    .out
                    .values()
                    .filter(|o| partitions.contains(&(o.topic.clone(), o.partition)))
                    .count();
                let settled = in_flight == 0 && reading.committing == 0;
                let waited =
                    !wait || self.closing.load(Ordering::SeqCst) || Instant::now() >= deadline;
                if settled || waited {
                    break self.forget(&mut reading, &partitions, in_flight);
                }
                drop(reading);
                std::thread::sleep(Duration::from_millis(10));
            };
            if wanted.count() > 0
                && let Err(e) = consumer.commit(&wanted, CommitMode::Sync)
            {
                tracing::warn!(error = %e, "the commit before a rebalance failed; its new owner delivers what it covered again");
            }
            tracing::info!(
                partitions = partitions.len(),
                abandoned,
                "Kafka took partitions away (rebalance); settled work committed"
            );
        };
        // The callback runs inside a read, on a runtime thread: where the
        // runtime has others, they run the deliveries meanwhile; on a
        // single thread nothing could settle while it waits.
        match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
            Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                tokio::task::block_in_place(|| work(true))
            }
            _ => work(false),
        }
    }

    /// Drops what the source held of `partitions`; returns their commit
    /// points and metadata, and the hand-outs still unsettled (abandoned).
    fn forget(
        &self,
        reading: &mut Reading,
        partitions: &[(String, i32)],
        abandoned: usize,
    ) -> (TopicPartitionList, usize) {
        let mut wanted = TopicPartitionList::new();
        for (topic, partition) in partitions {
            let key = (topic.clone(), *partition);
            if let Some(ledger) = reading.ledgers.remove(&key) {
                let mut element = wanted.add_partition(topic, *partition);
                if element
                    .set_offset(Offset::Offset(ledger.commit_point()))
                    .is_ok()
                {
                    element.set_metadata(ledger.metadata());
                }
            }
            if *topic == self.retry_topic {
                reading.held.remove(partition);
            }
            reading
                .again
                .retain(|(_, _, out)| out.topic != *topic || out.partition != *partition);
            let elsewhere = |m: &rdkafka::message::OwnedMessage| {
                m.topic() != topic.as_str() || m.partition() != *partition
            };
            reading.unblocked.retain(elsewhere);
            for waiting in reading.keys.values_mut() {
                waiting.retain(elsewhere);
            }
        }
        reading.version += 1;
        (wanted, abandoned)
    }
}
