//! Delay tiers: retries wait in `<queue>.retry.<d>` queues, and what the
//! broker hands out is admitted (or sent round again) here.

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

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

/// Delay tiers: each is at most 2.5 times the one before.
pub(super) const TIERS_MS: &[u64] = &[
    10, 20, 50, 100, 200, 500, 1_000, 2_000, 4_000, 8_000, 15_000, 30_000, 60_000, 120_000,
    240_000, 480_000, 900_000, 1_800_000, 3_600_000, 7_200_000, 14_400_000, 28_800_000, 43_200_000,
    86_400_000,
];

/// Where a retry waits next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Hop {
    pub(super) tier: Duration,
    /// Whether the retry is due when the tier sends it back; otherwise it
    /// comes back early, carrying `courier-retry-at`, and goes round a
    /// tier again for what remains.
    pub(super) last: bool,
}

/// The hop of a retry due in `remaining`: the shortest tier not shorter
/// than it when that tier ends at most the shortest tier's length (10 ms)
/// after the due time; otherwise the longest tier not longer than it. So
/// a retry is never early and at most 10 ms late (plus the broker's
/// latency of the last hop), where one tier each way was up to 2.5 times
/// late (a 50 min delay waited 1 h). A hop more costs one publish
/// (confirmed) and one ack; a delay takes about one hop for each tier
/// below it that it spans (5 s: 4 s and 1 s; 50 min: 30 min, 15 min,
/// 4 min, 1 min).
pub(super) fn next_hop(remaining: Duration) -> Hop {
    let ms = remaining.as_millis();
    let slack = u128::from(TIERS_MS[0]);
    let at_least = TIERS_MS.iter().copied().find(|t| u128::from(*t) >= ms);
    if let Some(tier) = at_least
        && u128::from(tier) - ms <= slack
    {
        return Hop {
            tier: Duration::from_millis(tier),
            last: true,
        };
    }
    let at_most = TIERS_MS
        .iter()
        .copied()
        .rev()
        .find(|t| u128::from(*t) <= ms)
        .unwrap_or(TIERS_MS[0]);
    Hop {
        tier: Duration::from_millis(at_most),
        last: false,
    }
}

pub(super) fn tier_queue(queue: &str, tier: Duration) -> String {
    format!("{queue}.retry.{}", duration::format(tier))
}

/// When the producer says it sent the message: the `timestamp` property
/// (seconds), which `courier send` sets and a copy courier publishes keeps.
/// AMQP has no time of its own for a message.
pub(super) fn timestamp(props: &BasicProperties) -> Option<SystemTime> {
    let secs = (*props.timestamp()).filter(|secs| *secs > 0)?;
    Some(UNIX_EPOCH + Duration::from_secs(secs))
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
        let hop = (!delay.is_zero()).then(|| next_hop(delay));
        if hop.is_some_and(|hop| !hop.last) {
            fields.push((F_RETRY_AT.into(), Bytes::from(rfc3339(at))));
        }
        let tier = hop.map(|hop| hop.tier);
        self.move_to(session, tag, tier, &fields, original, message_id)
            .await
    }

    /// Turns what the broker delivered into a delivery for the app, or deals
    /// with it here: a retry that came back before its due time goes round
    /// a tier again, and a redelivery (a crash or a lost connection mid-delivery, a
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
        // A retry back from a tier before its due time goes round again
        // for what remains, however little: it is never offered early.
        if let Some(at) = field(&fields, F_RETRY_AT).and_then(|t| parse_time(t.as_bytes()))
            && at > SystemTime::now()
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
        let stamped = timestamp(props);
        // Only a redelivery is judged: a copy courier stored was judged when
        // it was stored, and a count on a message nobody handed out yet was
        // written by its producer, not by courier.
        let out = if returns > 0 && handed_out >= self.max_deliveries.load(Ordering::SeqCst) {
            let mut out =
                Delivery::from_fields(&message_id, fields, returns, receipt.clone(), stamped);
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
            Delivery::from_fields(&message_id, fields, 0, receipt.clone(), stamped)
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
    fn the_time_of_a_message_is_its_timestamp_when_the_producer_set_one() {
        let at = |props: BasicProperties| timestamp(&props);
        assert_eq!(
            at(BasicProperties::default().with_timestamp(1_700_000_000)),
            Some(UNIX_EPOCH + Duration::from_secs(1_700_000_000))
        );
        assert_eq!(at(BasicProperties::default().with_timestamp(0)), None);
        assert_eq!(at(BasicProperties::default()), None);
    }

    #[test]
    fn a_retry_is_never_early_and_at_most_the_shortest_tier_late() {
        let slack = Duration::from_millis(TIERS_MS[0]);
        let delays_ms: &[u64] = &[
            1,
            10,
            11,
            19,
            49,
            50,
            51,
            999,
            1_000,
            1_001,
            3_000,
            4_990,
            5_000,
            299_999,
            3_000_000,
            90_000_000,
            259_200_000,
        ];
        for &ms in delays_ms {
            // Sent round tier after tier, each hop taking 3 ms, until the
            // last.
            let due = Duration::from_millis(ms);
            let (mut waited, mut hops) = (Duration::ZERO, 0);
            // A retry back at or after its due time is offered.
            while waited < due {
                let hop = next_hop(due - waited);
                hops += 1;
                assert!(TIERS_MS.contains(&(hop.tier.as_millis() as u64)));
                waited += hop.tier;
                if hop.last {
                    break;
                }
                assert!(waited <= due, "{ms}ms went past its due time");
                waited += Duration::from_millis(3);
                assert!(hops < 2 * TIERS_MS.len(), "{ms}ms: {hops} hops");
            }
            assert!(waited >= due, "{ms}ms came back {:?} early", due - waited);
            assert!(
                waited - due <= slack,
                "{ms}ms came back {:?} late",
                waited - due
            );
        }
        // One tier when the delay is one, or just under one.
        for (ms, tier) in [(5, 10), (10, 10), (995, 1_000), (3_600_000, 3_600_000)] {
            assert_eq!(
                next_hop(Duration::from_millis(ms)),
                Hop {
                    tier: Duration::from_millis(tier),
                    last: true
                }
            );
        }
        // Else the longest tier not longer, and round again.
        let cases = [
            (5_000, 4_000),
            (3_000_000, 1_800_000),
            (259_200_000, 86_400_000),
        ];
        for (ms, tier) in cases {
            assert_eq!(
                next_hop(Duration::from_millis(ms)),
                Hop {
                    tier: Duration::from_millis(tier),
                    last: false
                }
            );
        }
        for pair in TIERS_MS.windows(2) {
            assert!(pair[1] * 2 <= pair[0] * 5, "{pair:?}");
        }
        assert_eq!(
            tier_queue("orders", Duration::from_secs(120)),
            "orders.retry.2m"
        );
    }
}
