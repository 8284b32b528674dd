//! How much sits where, from passive declares only.
//!
//! RabbitMQ reports a queue's ready messages and nothing about their age
//! without handing them out, and a dead letter handed out and put back is
//! no longer where it was (it is flagged redelivered and, on a quorum
//! queue, counts against the delivery limit). So the age of the oldest
//! dead letter is not read here: [`Depth::oldest_dead_letter_age`] stays
//! `None` on RabbitMQ (the capability `dead_letter_age` is off, so the
//! gauge is left out), and `courier dlq list` shows each letter's age. The
//! same holds for the work queue: [`Depth::oldest_waiting_age`] is `None`.
//!
//! The retry backlog is the sum of the tiers' message counts. The tiers in
//! use are known from this process's own retries and from the `x-death`
//! header of what comes back; a new process knows neither, while retries
//! an earlier one parked may wait in the tiers for hours. So the first
//! reading of a process looks for every tier there can be. Only the first:
//! a passive declare of a missing queue closes the channel, which RabbitMQ
//! logs as an error, and a tier another replica starts to use later is
//! learnt from the first message that comes back from it.
//!
//! A retry on its way back is in no queue's count: a quorum tier hands an
//! expired message to its dead-letter worker, which publishes it to the work
//! queue and only then lets the tier forget it (`at-least-once`), and from
//! the work queue it travels to the consumer before courier holds it. A
//! reading then showed nothing waiting anywhere while a retry was still to
//! come. So this process also counts the retries it put in a tier until it
//! sees them again, or until [`RETRY_RETURN_GRACE`] after they were due
//! (another replica may have taken them), and the retry backlog is the
//! larger of that and what the tiers hold: a tier's messages are this
//! process's retries or another replica's, never both.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::session::Session;
use super::tiers::{TIERS_MS, tier_queue};
use super::{AmqpSource, QueueState};
use courier_core::source::{Depth, SourceError};

/// How long after its tier's delay a retry this process stored still counts
/// as on its way back, unless it came back to this process before.
const RETRY_RETURN_GRACE: Duration = Duration::from_secs(5);

impl QueueState {
    /// A retry of `message_id` was stored in a tier of `delay`.
    pub(super) fn retry_out(&self, message_id: &str, delay: Duration) {
        self.retries_out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                message_id.to_string(),
                Instant::now() + delay + RETRY_RETURN_GRACE,
            );
    }

    /// `message_id` was handed to this process again.
    pub(super) fn retry_back(&self, message_id: &str) {
        self.retries_out
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(message_id);
    }

    /// The deliveries this process holds and the retries it stored that
    /// have not come back to it yet, read at one instant: a retry is
    /// recorded before its delivery is acked, and a delivery is held before
    /// its retry is struck off, so a message moving between the two is
    /// always in one of them, but two separate reads could miss it.
    fn held_and_on_their_way(&self) -> (u64, u64) {
        let now = Instant::now();
        let mut out = self.retries_out.lock().unwrap_or_else(|e| e.into_inner());
        out.retain(|_, until| *until > now);
        let held = self.unacked.load(Ordering::SeqCst).max(0) as u64;
        (held, out.len() as u64)
    }
}

impl AmqpSource {
    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let session = self.session().await?;
        // Read the way messages go: tiers, the work queue, then what this
        // process holds. A message that moves on between two reads is
        // counted in the later one rather than in neither. (Another
        // process's retry on its way back from a tier, and a message on its
        // way from the work queue to the consumer, are in no count.)
        self.probe_tiers(&session).await?;
        let tiers: Vec<u64> = self
            .link
            .state
            .tiers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect();
        let mut retry_backlog = 0u64;
        for ms in tiers {
            let name = tier_queue(&self.options.queue, Duration::from_millis(ms));
            match session.passive_count(&name).await? {
                Some(n) => retry_backlog += u64::from(n),
                None => {
                    self.link
                        .state
                        .tiers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&ms);
                }
            }
        }
        let ready = u64::from(
            session
                .passive_count(&self.options.queue)
                .await?
                .unwrap_or(0),
        );
        let (pending, on_their_way) = self.link.state.held_and_on_their_way();
        let retry_backlog = retry_backlog.max(on_their_way);
        // A dead-letter queue that does not exist yet holds nothing; it is
        // declared with the first dead letter, of the work queue's type.
        let dead_letters = session
            .passive_count(&self.dead_letter_queue())
            .await?
            .unwrap_or(0);
        Ok(Depth {
            ready: Some(ready),
            pending,
            retry_backlog,
            dead_letters: u64::from(dead_letters),
            oldest_dead_letter_age: None,
            // The broker's count: a passive declare reports the ready
            // messages only, not those handed out and unacked.
            queue_depth: Some(ready),
            oldest_waiting_age: None,
        })
    }

    /// Adds the tiers that exist to the known ones, once a process.
    async fn probe_tiers(&self, session: &Session) -> Result<(), SourceError> {
        if self.link.state.tiers_probed.load(Ordering::SeqCst) {
            return Ok(());
        }
        let known = self
            .link
            .state
            .tiers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for &ms in TIERS_MS.iter().filter(|ms| !known.contains(ms)) {
            let name = tier_queue(&self.options.queue, Duration::from_millis(ms));
            if session.passive_count(&name).await?.is_some() {
                self.link
                    .state
                    .tiers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(ms);
            }
        }
        self.link.state.tiers_probed.store(true, Ordering::SeqCst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_counts_until_it_is_back() {
        let state = QueueState::default();
        state.unacked.store(1, Ordering::SeqCst);
        state.retry_out("m1", Duration::from_millis(50));
        // Recorded before its delivery is acked: in both for a moment.
        assert_eq!(state.held_and_on_their_way(), (1, 1));
        state.unacked.store(0, Ordering::SeqCst);
        assert_eq!(state.held_and_on_their_way(), (0, 1));
        state.unacked.store(1, Ordering::SeqCst);
        state.retry_back("m1");
        assert_eq!(state.held_and_on_their_way(), (1, 0));
        state.retry_back("unknown");
        assert_eq!(state.held_and_on_their_way(), (1, 0));
    }

    #[test]
    fn a_retry_another_replica_took_stops_counting() {
        let state = QueueState::default();
        state.retry_out("m1", Duration::ZERO);
        state
            .retries_out
            .lock()
            .unwrap()
            .insert("m1".into(), Instant::now());
        assert_eq!(state.held_and_on_their_way(), (0, 0));
    }
}
