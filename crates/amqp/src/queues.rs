//! The queues courier declares for a work queue (delay tiers, the
//! dead-letter queue) and the type they take from it.
//!
//! A quorum work queue gets quorum tiers and a quorum dead-letter queue, so
//! a message is replicated the same way wherever it waits; a classic one
//! gets classic ones. RabbitMQ does not report a queue's type or arguments
//! over AMQP, so courier tells it from what the broker does, never from the
//! text of its answers (which change between versions and languages):
//!
//! 1. A delivery from a quorum queue that was handed out before carries
//!    `x-delivery-count` (documented for quorum queues; a classic queue
//!    never adds it). A first delivery does not, so courier also asks:
//! 2. It declares the work queue again with only `x-queue-type: quorum`.
//!    A declaration equal to the queue's own changes nothing and is
//!    accepted; one that differs is refused with reply code 406
//!    (`PRECONDITION_FAILED`). Accepted: a quorum queue with no other
//!    arguments.
//! 3. It declares it with no arguments. Accepted: a classic queue without
//!    arguments. A quorum queue always has `x-queue-type` among its
//!    arguments, so it never accepts this.
//! 4. Refused both times, the queue has arguments of its own (a length
//!    limit, a TTL) and the answers cannot say which type it is. Courier
//!    then declares quorum queues: that never keeps a retry or a dead
//!    letter less safely than its work queue, and a classic queue
//!    dead-letters into a quorum one as well as into a classic one. An
//!    operator who wants classic ones declares them beforehand: queues that
//!    exist are used as they are.
//!
//! A missing work queue is classic: courier creates it so with `--create`.

use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::QueueDeclareOptions;
use lapin::protocol::AMQPSoftError;
use lapin::types::{AMQPValue, FieldTable};

use super::convert::header;
use super::errors::{broker_error, is_soft};
use super::session::Session;
use courier_core::source::{QueueType, SourceError};

/// The delivery counter quorum queues add to every delivery.
pub(super) const DELIVERY_COUNT: &str = "x-delivery-count";

/// The delivery limit of a quorum dead-letter queue: high enough never to
/// be reached by listing (each `courier dlq list` hands the letters out and
/// takes them back), and set so RabbitMQ 4's default limit of 20 does not
/// drop dead letters that were only looked at.
const DEAD_LETTER_DELIVERY_LIMIT: i64 = 1_000_000_000;

/// The delivery limit of a quorum work queue courier creates. courier
/// re-publishes every redelivery it sees, which starts the broker's count
/// again, but a delivery handed back while its re-publish keeps failing (a
/// broker short of disk), or returned while no courier runs, counts up; so
/// the limit is set far above anything courier's own poison-pill limit
/// (`maxAttempts + 2`) can reach, instead of RabbitMQ 4's default of 20,
/// which would drop the message: courier's work queue has no dead-letter
/// target of the broker's, courier dead-letters itself.
const WORK_QUEUE_DELIVERY_LIMIT: i64 = DEAD_LETTER_DELIVERY_LIMIT;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum QueueKind {
    Classic,
    Quorum,
}

impl From<QueueType> for QueueKind {
    fn from(queue_type: QueueType) -> Self {
        match queue_type {
            QueueType::Quorum => Self::Quorum,
            QueueType::Classic => Self::Classic,
        }
    }
}

impl QueueKind {
    /// A work queue courier creates because none exists (`--create`).
    pub(super) fn work_queue_arguments(self) -> FieldTable {
        self.with_delivery_limit(WORK_QUEUE_DELIVERY_LIMIT)
    }

    /// This kind's arguments; a quorum queue's with `limit` as its
    /// `x-delivery-limit`.
    fn with_delivery_limit(self, limit: i64) -> FieldTable {
        let mut args = self.arguments();
        if self == Self::Quorum {
            args.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit));
        }
        args
    }

    /// Quorum when a delivery shows it came from a quorum queue; `None`
    /// when it cannot tell.
    pub(super) fn seen_in(properties: &BasicProperties) -> Option<Self> {
        header(properties, DELIVERY_COUNT).map(|_| Self::Quorum)
    }

    /// The type of `queue`, told by the reply codes of two declarations
    /// (see the module comment).
    pub(super) async fn of_queue(session: &Session, queue: &str) -> Result<Self, SourceError> {
        // A declaration creates a queue that is missing: ask only about
        // one that exists.
        if session.passive_count(queue).await?.is_none() {
            return Ok(Self::Classic);
        }
        for (kind, told) in [(Self::Quorum, "quorum"), (Self::Classic, "classic")] {
            match session
                .admin_declare(queue, QueueDeclareOptions::durable(), kind.arguments())
                .await?
            {
                Ok(_) => return Ok(kind),
                Err(e) if is_soft(&e, AMQPSoftError::PRECONDITIONFAILED) => {
                    tracing::debug!(%queue, error = %e, "the work queue is not a {told} queue without arguments");
                }
                Err(e) => return Err(broker_error(e)),
            }
        }
        tracing::info!(%queue, "the work queue has arguments of its own, so RabbitMQ's answers do not tell its type; its delay tiers and dead-letter queue are declared quorum (declare them beforehand to have them classic)");
        Ok(Self::Quorum)
    }

    fn arguments(self) -> FieldTable {
        let mut args = FieldTable::default();
        if self == Self::Quorum {
            args.insert(
                "x-queue-type".into(),
                AMQPValue::LongString("quorum".into()),
            );
        }
        args
    }

    /// A delay tier of `work_queue`: every message waits `ttl`, then the
    /// broker dead-letters it back to the work queue through the default
    /// exchange. A quorum tier does that at least once (the message leaves
    /// the tier only when the work queue confirmed it), which needs
    /// `reject-publish` overflow; a classic tier does it at most once, which
    /// loses a message only when the work queue is deleted meanwhile.
    pub(super) fn tier_arguments(self, ttl: Duration, work_queue: &str) -> FieldTable {
        let mut args = self.arguments();
        args.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(ttl.as_millis() as i64),
        );
        args.insert(
            "x-dead-letter-exchange".into(),
            AMQPValue::LongString("".into()),
        );
        args.insert(
            "x-dead-letter-routing-key".into(),
            AMQPValue::LongString(work_queue.into()),
        );
        if self == Self::Quorum {
            args.insert(
                "x-dead-letter-strategy".into(),
                AMQPValue::LongString("at-least-once".into()),
            );
            args.insert(
                "x-overflow".into(),
                AMQPValue::LongString("reject-publish".into()),
            );
        }
        args
    }

    /// A dead-letter queue courier creates because none exists.
    pub(super) fn dead_letter_arguments(self) -> FieldTable {
        self.with_delivery_limit(DEAD_LETTER_DELIVERY_LIMIT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kind_follows_the_delivery_counter() {
        let mut headers = FieldTable::default();
        headers.insert(DELIVERY_COUNT.into(), AMQPValue::LongLongInt(0));
        let quorum = BasicProperties::default().with_headers(headers);
        assert_eq!(QueueKind::seen_in(&quorum), Some(QueueKind::Quorum));
        assert_eq!(QueueKind::seen_in(&BasicProperties::default()), None);
        let tier = QueueKind::Quorum.tier_arguments(Duration::from_secs(1), "orders");
        assert!(tier.inner().contains_key("x-dead-letter-strategy"));
        let created = QueueKind::from(QueueType::default()).work_queue_arguments();
        assert_eq!(
            created.inner().get("x-delivery-limit"),
            Some(&AMQPValue::LongLongInt(WORK_QUEUE_DELIVERY_LIMIT))
        );
        assert!(QueueKind::Classic.work_queue_arguments().inner().is_empty());
        assert!(
            !QueueKind::Classic
                .tier_arguments(Duration::from_secs(1), "orders")
                .inner()
                .contains_key("x-queue-type")
        );
    }
}
