//! Settling a delivery: ack (concurrent acks in one `Acknowledge`), retry
//! and give-back (a sealed copy on the retry topic, then the ack), dead
//! letter (a publish to the dead-letter topic, then the ack); and keeping
//! what the app has leased.

use async_trait::async_trait;
use std::time::{Duration, SystemTime};

use super::connection::Client;
use super::{PubSubSource, Sub, lock, work_in_flight};
use courier_core::model::{Delivery, Failure, rfc3339};
use courier_core::source::SettleParts;
use courier_core::source::shared::{F_RETRY_AT, replace, without};
use courier_core::source::{Batcher, Linger, SourceError};

/// How long a message whose retry copy or dead letter Pub/Sub did not take
/// stays leased before it is delivered again: not at once, since the
/// publish that failed is likely to fail again, and not a whole lease, so
/// that a passing fault costs little. Pub/Sub's shortest deadline.
const AFTER_FAILED_SETTLE: u64 = 10;

/// How long an ack waits for the others of its round: a round of
/// `--concurrency` acks is written at once, a shorter one after this long.
/// The server's work follows its calls more than their ids: written as soon
/// as the last one was answered, a drain of 20,000 messages on the emulator
/// took 2,590 `Acknowledge` calls of 7.7 ids (the bare loop, in lockstep,
/// 1,250 of 16); with this, 1,360 of 14.6. The app is not held meanwhile:
/// its slot was freed when it answered.
const ACK_LINGER: Duration = Duration::from_millis(2);

/// Concurrent acks of one subscription become one `Acknowledge`.
pub(super) fn ack_batcher(
    client: &Client,
    subscription: &str,
    concurrency: usize,
) -> Batcher<String> {
    let client = client.clone();
    let subscription = subscription.to_string();
    let linger = Linger {
        fill: concurrency,
        most: ACK_LINGER,
    };
    Batcher::spawn_lingering(512, Some(linger), move |ack_ids: Vec<String>| {
        let client = client.clone();
        let subscription = subscription.clone();
        async move { client.acknowledge(&subscription, ack_ids).await }
    })
}

impl PubSubSource {
    fn subscription(&self, from: Sub) -> &str {
        match from {
            Sub::Work => &self.names.work,
            Sub::Retry => &self.names.retry,
        }
    }

    /// Which subscription a receipt is of; a receipt this process did not
    /// hand out is refused.
    fn subscription_of_receipt(&self, receipt: &str) -> Result<Sub, SourceError> {
        lock(&self.in_flight)
            .get(receipt)
            .copied()
            .ok_or_else(|| SourceError::invalid("the message is not in flight here"))
    }

    /// The ack of the message with this receipt, batched per subscription.
    async fn ack_receipt(&self, receipt: &str) -> Result<(), SourceError> {
        let from = self.subscription_of_receipt(receipt)?;
        let batcher = match from {
            Sub::Work => &self.work_acks,
            Sub::Retry => &self.retry_acks,
        };
        let result = batcher.submit(receipt.to_string()).await;
        self.out_of_flight(receipt);
        result
    }

    /// A delivery is no longer in flight here: settled, or left to come
    /// back. On the emulator, the reader waiting for the work subscription
    /// to have nothing leased is told when its last one goes (elsewhere no
    /// reader waits, and no ack pays for the look).
    fn out_of_flight(&self, receipt: &str) -> Option<Sub> {
        let mut in_flight = lock(&self.in_flight);
        let from = in_flight.remove(receipt);
        if self.client.emulator && from == Some(Sub::Work) && !work_in_flight(&in_flight) {
            self.work_settled.notify_waiters();
        }
        from
    }

    /// The write that was to settle this delivery failed: the message stays
    /// where it is and is delivered again after [`AFTER_FAILED_SETTLE`] (if
    /// even that change is lost, after its lease).
    async fn unsettled(&self, receipt: &str) {
        let Some(from) = self.out_of_flight(receipt) else {
            return;
        };
        let subscription = self.subscription(from).to_string();
        let _ = self
            .client
            .modify_deadline(
                &subscription,
                vec![receipt.to_string()],
                AFTER_FAILED_SETTLE,
            )
            .await;
    }

    /// Keeps the deliveries with the app leased for another visibility
    /// timeout.
    pub(super) async fn keep_leased(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        let (mut work, mut retry) = (Vec::new(), Vec::new());
        {
            let held = lock(&self.in_flight);
            for delivery in in_flight {
                match held.get(&delivery.receipt) {
                    Some(Sub::Work) => work.push(delivery.receipt.clone()),
                    Some(Sub::Retry) => retry.push(delivery.receipt.clone()),
                    None => {}
                }
            }
        }
        let secs = self.lease_secs();
        let work = self
            .client
            .modify_deadline(&self.names.work.clone(), work, secs)
            .await;
        let retry = self
            .client
            .modify_deadline(&self.names.retry.clone(), retry, secs)
            .await;
        work.and(retry)
    }
}

#[async_trait]
impl SettleParts for PubSubSource {
    /// Every retry, and every give-back, is a sealed copy on the retry
    /// topic with the attempt and the due time; the original is acked only
    /// once Pub/Sub took the copy.
    async fn settle_ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        self.ack_receipt(&delivery.receipt).await
    }

    async fn settle_retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        self.subscription_of_receipt(&delivery.receipt)?;
        let fields = delivery.fields_for_retry(next_attempt, first_attempt_at);
        let fields = self.seal.seal(replace(fields, F_RETRY_AT, rfc3339(at)));
        if let Err(e) = self.client.publish(&self.names.retry_topic, &fields).await {
            if !e.awaits_a_letter_that_fits(None) {
                self.unsettled(&delivery.receipt).await;
            }
            return Err(e);
        }
        self.retry_due(tokio::time::Instant::now());
        let result = self.ack_receipt(&delivery.receipt).await;
        if let Err(e) = &result {
            tracing::warn!(error = %e, id = %delivery.message.id, "the retry copy is stored but the original was not acked: the message comes back once more");
        }
        result
    }

    async fn settle_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError> {
        self.subscription_of_receipt(&delivery.receipt)?;
        let topic = self
            .dead_letter_topic_of(&failure.dead_letter_queue)
            .await?;
        let fields = without(delivery.fields_for_dead_letter(failure), F_RETRY_AT);
        // Acked only once the dead-letter topic took it.
        if let Err(e) = self.client.publish(&topic, &fields).await {
            if !e.awaits_a_letter_that_fits(Some(failure)) {
                self.unsettled(&delivery.receipt).await;
            }
            return Err(e);
        }
        self.ack_receipt(&delivery.receipt).await
    }
}
