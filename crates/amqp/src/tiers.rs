//! Delay tiers: retries wait in `<queue>.retry.<d>` queues, and what the
//! broker hands out is admitted (or sent round again) here.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use lapin::BasicProperties;
use lapin::message::Delivery as AmqpDelivery;
use lapin::types::AMQPValue;

use super::convert::{fields_with_body, header, header_u32, message_for, value_bytes};
use super::queues::DELIVERY_COUNT;
use super::session::Session;
use super::{AmqpSource, new_id};
use courier_core::duration;
use courier_core::model::{Delivery, F_ATTEMPT, F_DELIVERIES, F_MESSAGE_ID, parse_time, rfc3339};
use courier_core::source::SourceError;
use courier_core::source::shared::{F_RETRY_AT, field, replace, without};

/// Delay tiers: each is at most 2.5 times the one before, so a retry is late
/// by less than one tier step.
pub(super) const TIERS_MS: &[u64] = &[
    10, 20, 50, 100, 200, 500, 1_000, 2_000, 4_000, 8_000, 15_000, 30_000, 60_000, 120_000,
    240_000, 480_000, 900_000, 1_800_000, 3_600_000, 7_200_000, 14_400_000, 28_800_000, 43_200_000,
    86_400_000,
];

/// The tier for a delay: the shortest not shorter than it, else the longest.
pub(super) fn tier_for(delay: Duration) -> Duration {
    let ms = delay.as_millis();
    let tier = TIERS_MS
        .iter()
        .copied()
        .find(|t| u128::from(*t) >= ms)
        .unwrap_or(TIERS_MS[TIERS_MS.len() - 1]);
    Duration::from_millis(tier)
}

pub(super) fn tier_queue(queue: &str, tier: Duration) -> String {
    format!("{queue}.retry.{}", duration::format(tier))
}

impl AmqpSource {
    /// Publishes `fields` to `queue` (after the delay of `tier`, when given),
    /// then acks the delivery `tag`.
    pub(super) async fn move_to(
        &self,
        session: &Session,
        tag: u64,
        tier: Option<Duration>,
        fields: &[(Bytes, Bytes)],
        original: Option<&BasicProperties>,
        message_id: &str,
    ) -> Result<(), SourceError> {
        let target = match tier {
            Some(tier) => {
                let name = tier_queue(&self.options.queue, tier);
                if !session.is_known(&name) {
                    let kind = self.work_queue_kind(session, original).await?;
                    let args = kind.tier_arguments(tier, &self.options.queue);
                    session.declare(&name, args).await?;
                    self.link
                        .state
                        .tiers
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(tier.as_millis() as u64);
                }
                name
            }
            None => self.options.queue.clone(),
        };
        let fields = self.seal().seal(fields.to_vec());
        let (body, properties) = message_for(&fields, original, message_id);
        session.publish(&target, &body, properties).await?;
        if let Some(tier) = tier {
            self.link.state.retry_out(message_id, tier);
        }
        session.ack(tag).await
    }

    /// Schedules `fields` for delivery at `at`.
    pub(super) async fn schedule(
        &self,
        session: &Session,
        tag: u64,
        fields: Vec<(Bytes, Bytes)>,
        original: Option<&BasicProperties>,
        message_id: &str,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let delay = at.duration_since(SystemTime::now()).unwrap_or_default();
        let mut fields = without(fields, F_RETRY_AT);
        let tier = (!delay.is_zero()).then(|| tier_for(delay));
        if tier.is_some_and(|t| t < delay) {
            fields.push((F_RETRY_AT.into(), Bytes::from(rfc3339(at))));
        }
        self.move_to(session, tag, tier, &fields, original, message_id)
            .await
    }

    /// Turns what the broker delivered into a delivery for the app, or deals
    /// with it here: a long retry that came back early goes round a tier
    /// again, and a redelivery (a crash or a lost connection mid-delivery, a
    /// settlement that could not be written) is re-published with the
    /// attempt and the unsettled hand-outs advanced first. Re-publishing
    /// resets a quorum queue's own delivery counter, so its delivery limit
    /// never drops a message courier still means to retry; courier counts
    /// the hand-outs in `courier-deliveries` instead, and one handed out
    /// `max_deliveries` times without being settled is a poison pill: it is
    /// handed over as undeliverable, never offered to the app again.
    pub(super) async fn admit(
        &self,
        session: &Session,
        mut delivery: AmqpDelivery,
    ) -> Result<Option<Delivery>, SourceError> {
        // The body moves into the fields: a 40 MiB message is held once.
        let body = Bytes::from(std::mem::take(&mut delivery.data));
        let props = &delivery.properties;
        let tag = delivery.delivery_tag;
        // Only a copy courier sealed carries courier's state.
        let fields = self.seal().open(fields_with_body(props, body));
        let number = |name| field(&fields, name).and_then(|v| v.trim().parse::<u32>().ok());
        let message_id = field(&fields, F_MESSAGE_ID)
            .map(str::to_string)
            .or_else(|| props.message_id().as_ref().map(|id| id.to_string()))
            .unwrap_or_else(new_id);
        if let Some(at) = field(&fields, F_RETRY_AT).and_then(|t| parse_time(t.as_bytes()))
            && at.duration_since(SystemTime::now()).unwrap_or_default()
                >= Duration::from_millis(TIERS_MS[0])
        {
            self.schedule(session, tag, fields, Some(props), &message_id, at)
                .await?;
            return Ok(None);
        }
        self.learn_tiers(props);
        self.link.state.retry_back(&message_id);
        // A quorum queue counts every return; a classic one only flags that
        // there was at least one.
        let returns = match header_u32(props, DELIVERY_COUNT) {
            Some(count) => count,
            None => u32::from(delivery.redelivered),
        };
        let handed_out = number(F_DELIVERIES).unwrap_or(0).saturating_add(returns);
        let receipt = format!("{}:{tag}", session.generation);
        // Only a redelivery is judged: a copy courier stored was judged when
        // it was stored, and a count on a message nobody handed out yet was
        // written by its producer, not by courier.
        let out = if returns > 0 && handed_out >= self.max_deliveries.load(Ordering::SeqCst) {
            let mut out = Delivery::from_fields(&message_id, fields, returns, receipt.clone());
            out.problem = Some(format!(
                "handed out {handed_out} times without being settled"
            ));
            out
        } else if returns > 0 {
            let attempt = number(F_ATTEMPT).unwrap_or(1).max(1);
            let fields = replace(
                fields,
                F_ATTEMPT,
                attempt.saturating_add(returns).to_string(),
            );
            let fields = replace(fields, F_DELIVERIES, handed_out.to_string());
            let fields = replace(fields, F_MESSAGE_ID, message_id.clone());
            tracing::info!(id = %message_id, attempt, handed_out, queue = %self.options.queue, "a delivery was never settled (crash, lost connection or a settlement that could not be written); it counts as an attempt");
            self.move_to(session, tag, None, &fields, Some(props), &message_id)
                .await?;
            return Ok(None);
        } else {
            Delivery::from_fields(&message_id, fields, 0, receipt.clone())
        };
        self.properties
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(receipt, delivery.properties);
        Ok(Some(out))
    }

    /// Tiers this process did not declare (another replica did, or an
    /// earlier run) show in the `x-death` header of the messages they send
    /// back; from then on they count in the retry backlog.
    pub(super) fn learn_tiers(&self, props: &BasicProperties) {
        let Some(AMQPValue::FieldArray(deaths)) = header(props, "x-death") else {
            return;
        };
        let prefix = format!("{}.retry.", self.options.queue);
        for death in deaths.as_slice() {
            let AMQPValue::FieldTable(death) = death else {
                continue;
            };
            let Some(queue) = death.inner().get("queue").and_then(value_bytes) else {
                continue;
            };
            let queue = String::from_utf8_lossy(&queue);
            let Some(tier) = queue.strip_prefix(&prefix) else {
                continue;
            };
            if let Some(ms) = TIERS_MS
                .iter()
                .find(|ms| duration::format(Duration::from_millis(**ms)) == tier)
            {
                self.link
                    .state
                    .tiers
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(*ms);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiers_are_never_shorter_and_at_most_one_step_longer() {
        for ms in [1u64, 10, 11, 49, 50, 51, 999, 1_000, 1_001, 3_000, 299_999] {
            let delay = Duration::from_millis(ms);
            let tier = tier_for(delay);
            assert!(tier >= delay, "{ms}ms went to {tier:?}");
            let i = TIERS_MS
                .iter()
                .position(|t| *t == tier.as_millis() as u64)
                .unwrap();
            assert!(i == 0 || TIERS_MS[i - 1] < ms, "{ms}ms skipped a tier");
        }
        assert_eq!(
            tier_for(Duration::from_secs(3 * 86_400)),
            Duration::from_secs(86_400)
        );
        for pair in TIERS_MS.windows(2) {
            assert!(pair[1] * 2 <= pair[0] * 5, "{pair:?}");
        }
        assert_eq!(
            tier_queue("orders", Duration::from_secs(120)),
            "orders.retry.2m"
        );
    }
}
