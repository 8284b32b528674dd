//! A rebalance that takes partitions away: no new work is taken from them,
//! deliveries in flight on them get until the visibility timeout to
//! settle, what is settled is committed, and what the source held of them
//! is forgotten; only then are they given up. Their new owner reads them
//! from that commit, so nothing settled here is delivered twice, and
//! nothing in flight here is delivered there meanwhile. A stop does not
//! wait: what is unsettled then is abandoned, and the commit never passes
//! it.
//!
//! The callback runs inside a read, on a runtime thread. Where the runtime
//! has others, it waits there (they run the deliveries). On one thread
//! (`--threads 1`, the default) nothing could settle while it waited, so
//! it returns at once without giving the partitions up, and a thread of
//! its own waits, commits and gives them up (`unassign`): the group's
//! rebalance does not go on before that. The group keeps a member that
//! waits for about its session timeout; a wait past it loses the commit,
//! and the new owner delivers what was settled meanwhile again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, RebalanceProtocol};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use super::Reading;
use super::connection::{Group, GroupConsumer};

/// What the group consumer's context shares with the source.
#[derive(Clone)]
pub(super) struct Shared {
    pub(super) reading: Arc<Mutex<Reading>>,
    pub(super) retry_topic: String,
    /// How long deliveries in flight on a revoked partition may take.
    pub(super) bound: Duration,
    /// Set when the source closes or is dropped: a revoke then waits for
    /// nothing.
    pub(super) closing: Arc<AtomicBool>,
    /// The consumer, for giving up partitions after the callback returned.
    pub(super) consumer: Weak<GroupConsumer>,
}

/// How long the retry topic's partitions wait after an assignment before
/// they are read. librdkafka keeps one fetch in flight per broker, and a
/// partition that becomes readable while it waits joins the next one. The
/// retry partitions, usually empty, were readable microseconds before the
/// work partitions (which first check their leader epoch): a broker's first
/// fetch then held only them, and the broker held it, empty, for
/// `fetch.wait.max.ms` (3 s) while the work partitions' records waited.
/// Read a moment later, they join a fetch the work partitions are in.
pub(super) const RETRY_AFTER_ASSIGN: Duration = Duration::from_millis(100);

impl Shared {
    fn reading(&self) -> std::sync::MutexGuard<'_, Reading> {
        self.reading.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Pauses the retry topic's partitions of `assigned` for
    /// [`RETRY_AFTER_ASSIGN`]; a read resumes them (`read.rs`). A retry copy
    /// due at the assignment so comes up to that much later, or, when the
    /// work partitions on its broker are empty, up to one fetch wait.
    pub(super) fn hold_retry(&self, consumer: &BaseConsumer<Group>, assigned: &TopicPartitionList) {
        let retry = of_topic(assigned, &self.retry_topic, &[]);
        if retry.count() == 0 {
            return;
        }
        match consumer.pause(&retry) {
            Ok(()) => self.reading().retry_resume_at = Some(Instant::now() + RETRY_AFTER_ASSIGN),
            Err(e) => tracing::debug!(error = %e, "the retry partitions are read at once"),
        }
    }

    /// The revoke of `revoked`, by the consumer in the callback; gives the
    /// partitions up itself, now or from a thread of its own.
    pub(super) fn revoke(&self, consumer: &BaseConsumer<Group>, revoked: &TopicPartitionList) {
        let partitions = partitions_of(revoked);
        let multi_thread = matches!(
            tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()),
            Ok(tokio::runtime::RuntimeFlavor::MultiThread)
        );
        if multi_thread {
            tokio::task::block_in_place(|| self.settle_then_forget(consumer, &partitions, true));
            give_up(consumer, revoked);
            return;
        }
        let waits = !self.closing.load(Ordering::SeqCst) && self.bound > Duration::ZERO;
        if waits {
            self.reading().revoking.extend(partitions.iter().cloned());
            let (shared, revoked) = (self.clone(), revoked.clone());
            let spawned = std::thread::Builder::new()
                .name("courier-revoke".into())
                .spawn(move || {
                    let Some(consumer) = shared.consumer.upgrade() else {
                        return;
                    };
                    shared.settle_then_forget(consumer.as_ref(), &partitions_of(&revoked), true);
                    give_up(consumer.as_ref(), &revoked);
                });
            match spawned {
                Ok(_) => return,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot start a thread to wait for the deliveries on the partitions taken away; they are given up now");
                }
            }
        }
        self.settle_then_forget(consumer, &partitions, false);
        give_up(consumer, revoked);
    }

    /// Waits (with `wait`, up to the bound, or until the source closes) for
    /// the deliveries in flight on `partitions` and the commits under way,
    /// then commits what is settled and forgets the partitions.
    fn settle_then_forget<C: Consumer<Group>>(
        &self,
        consumer: &C,
        partitions: &[(String, i32)],
        wait: bool,
    ) {
        let deadline = Instant::now() + self.bound;
        let (wanted, abandoned) = loop {
            let mut reading = self.reading();
            let in_flight = reading
                .out
                .values()
                .filter(|o| partitions.contains(&(o.topic.clone(), o.partition)))
                .count();
            let settled = in_flight == 0 && reading.committing == 0;
            let waited = !wait || self.closing.load(Ordering::SeqCst) || Instant::now() >= deadline;
            if settled || waited {
                break self.forget(&mut reading, partitions, in_flight);
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
                    element.set_metadata(ledger.metadata(false));
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
        for partition in partitions {
            reading.revoking.remove(partition);
        }
        reading.version += 1;
        (wanted, abandoned)
    }
}

/// The partitions of `topic` in `list`, but those numbered in `except`.
pub(super) fn of_topic(
    list: &TopicPartitionList,
    topic: &str,
    except: &[i32],
) -> TopicPartitionList {
    let mut out = TopicPartitionList::new();
    for element in list.elements_for_topic(topic) {
        if !except.contains(&element.partition()) {
            out.add_partition(topic, element.partition());
        }
    }
    out
}

/// The topic and partition of each element of `list`.
fn partitions_of(list: &TopicPartitionList) -> Vec<(String, i32)> {
    list.elements()
        .iter()
        .map(|p| (p.topic().to_string(), p.partition()))
        .collect()
}

/// Gives up `revoked` as the group's protocol wants: all of the
/// assignment (eager) or these partitions (cooperative).
fn give_up<C: Consumer<Group>>(consumer: &C, revoked: &TopicPartitionList) {
    let given_up = match consumer.rebalance_protocol() {
        RebalanceProtocol::Cooperative => consumer.incremental_unassign(revoked),
        _ => consumer.unassign(),
    };
    if let Err(e) = given_up {
        tracing::warn!(error = %e, "giving up the partitions taken away failed");
    }
}
