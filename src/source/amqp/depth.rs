//! How much sits where, from passive declares only.
//!
//! RabbitMQ reports a queue's ready messages and nothing about their age
//! without handing them out, and a dead letter handed out and put back is
//! no longer where it was (it is flagged redelivered and, on a quorum
//! queue, counts against the delivery limit). So the age of the oldest
//! dead letter is not read here: [`Depth::oldest_dead_letter_age`] stays
//! `None` on RabbitMQ, and `courier dlq list` shows each letter's age. The
//! same holds for the work queue: [`Depth::oldest_waiting_age`] is `None`.

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::AmqpSource;
use super::tiers::tier_queue;
use crate::source::{Depth, SourceError};

impl AmqpSource {
    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let session = self.session().await?;
        let ready = session.passive_count(&self.options.queue).await?;
        // A dead-letter queue that does not exist yet holds nothing; it is
        // declared with the first dead letter, of the work queue's type.
        let dead_letters = session
            .passive_count(&self.dead_letter_queue())
            .await?
            .unwrap_or(0);
        let tiers: Vec<u64> = self
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
                    self.state
                        .tiers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .remove(&ms);
                }
            }
        }
        let ready = u64::from(ready.unwrap_or(0));
        Ok(Depth {
            ready,
            pending: self.state.unacked.load(Ordering::SeqCst).max(0) as u64,
            retry_backlog,
            dead_letters: u64::from(dead_letters),
            oldest_dead_letter_age: None,
            // The broker's count: a passive declare reports the ready
            // messages only, not those handed out and unacked.
            queue_depth: ready,
            oldest_waiting_age: None,
        })
    }
}
