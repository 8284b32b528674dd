//! The queues courier declares for a work queue (delay tiers, the
//! dead-letter queue) and the type they take from it.
//!
//! A quorum work queue gets quorum tiers and a quorum dead-letter queue, so
//! a message is replicated the same way wherever it waits; a classic one
//! gets classic ones. RabbitMQ does not report a queue's type or arguments
//! over AMQP. A delivery from a quorum queue that was handed out before
//! carries `x-delivery-count`, but a first one does not; so courier asks
//! the broker: it declares the work queue again with `x-queue-type: quorum`,
//! and RabbitMQ either accepts that (quorum) or names the first argument
//! that differs, with the queue's own value. Courier then takes that value
//! and asks again, until the answer is about `x-queue-type` itself or the
//! declaration is accepted. A declaration with the queue's own arguments
//! changes nothing. An answer courier cannot read counts as classic.

use std::time::Duration;

use lapin::BasicProperties;
use lapin::options::QueueDeclareOptions;
use lapin::protocol::AMQPSoftError;
use lapin::types::{AMQPValue, FieldTable};

use super::convert::header;
use super::errors::{broker_error, is_soft};
use super::session::Session;
use crate::source::SourceError;

/// The most arguments a work queue is asked about before courier gives up
/// and treats it as classic.
const MOST_ARGUMENTS: usize = 24;

/// The delivery counter quorum queues add to every delivery.
pub(super) const DELIVERY_COUNT: &str = "x-delivery-count";

/// The delivery limit of a quorum dead-letter queue: high enough never to
/// be reached by listing (each `courier dlq list` hands the letters out and
/// takes them back), and set so RabbitMQ 4's default limit of 20 does not
/// drop dead letters that were only looked at.
const DEAD_LETTER_DELIVERY_LIMIT: i64 = 1_000_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum QueueKind {
    Classic,
    Quorum,
}

impl QueueKind {
    /// Quorum when a delivery shows it came from a quorum queue; `None`
    /// when it cannot tell.
    pub(super) fn seen_in(properties: &BasicProperties) -> Option<Self> {
        header(properties, DELIVERY_COUNT).map(|_| Self::Quorum)
    }

    /// The type of `queue`, found by declaring it with the arguments it has
    /// (see the module comment).
    pub(super) async fn of_queue(session: &Session, queue: &str) -> Result<Self, SourceError> {
        let mut args = Self::Quorum.arguments();
        for _ in 0..MOST_ARGUMENTS {
            // A declaration creates a queue that is missing: ask only about
            // one that exists.
            if session.passive_count(queue).await?.is_none() {
                return Ok(Self::Classic);
            }
            let declared = session
                .admin_declare(queue, QueueDeclareOptions::durable(), args.clone())
                .await?;
            let e = match declared {
                Ok(_) => return Ok(Self::Quorum),
                Err(e) if is_soft(&e, AMQPSoftError::PRECONDITIONFAILED) => e,
                Err(e) => return Err(broker_error(e)),
            };
            match Difference::read(&e.to_string()) {
                Some(Difference::Type) | None => return Ok(Self::Classic),
                Some(Difference::Missing(name, value)) => {
                    args.insert(name.into(), value);
                }
                Some(Difference::Extra(name)) => {
                    let mut kept = FieldTable::default();
                    for (n, v) in args.inner() {
                        if n.as_str() != name {
                            kept.insert(n.clone(), v.clone());
                        }
                    }
                    args = kept;
                }
            }
        }
        Ok(Self::Classic)
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
        let mut args = self.arguments();
        if self == Self::Quorum {
            args.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(DEAD_LETTER_DELIVERY_LIMIT),
            );
        }
        args
    }
}

/// What RabbitMQ's `inequivalent arg` answer says about the queue.
#[derive(Debug, PartialEq)]
enum Difference {
    /// `x-queue-type` differs: the queue is not quorum.
    Type,
    /// The queue has this argument with this value.
    Missing(String, AMQPValue),
    /// The queue does not have this argument.
    Extra(String),
}

impl Difference {
    /// Reads `inequivalent arg 'K' for queue 'q' in vhost '/': received
    /// none but current is the value 'V' of type 'T'` (or `... but current
    /// is none`).
    fn read(text: &str) -> Option<Self> {
        let (_, rest) = text.split_once("inequivalent arg '")?;
        let (name, rest) = rest.split_once('\'')?;
        if name == "x-queue-type" {
            return Some(Self::Type);
        }
        if rest.ends_with("but current is none") {
            return Some(Self::Extra(name.to_string()));
        }
        let (_, current) = rest.rsplit_once("but current is the value '")?;
        let (value, kind) = current.rsplit_once("' of type '")?;
        let kind = kind.strip_suffix('\'')?;
        let value = match kind {
            "long" => AMQPValue::LongLongInt(value.parse().ok()?),
            "signedint" => AMQPValue::LongInt(value.parse().ok()?),
            "longstr" => AMQPValue::LongString(value.into()),
            "bool" => AMQPValue::Boolean(value.parse().ok()?),
            "double" => AMQPValue::Double(value.parse().ok()?),
            _ => return None,
        };
        Some(Self::Missing(name.to_string(), value))
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
        assert!(
            !QueueKind::Classic
                .tier_arguments(Duration::from_secs(1), "orders")
                .inner()
                .contains_key("x-queue-type")
        );
    }

    #[test]
    fn rabbitmq_answers_are_read() {
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-max-length' for queue 'q' in vhost '/': received none but current is the value '10000' of type 'long'";
        assert_eq!(
            Difference::read(text),
            Some(Difference::Missing(
                "x-max-length".into(),
                AMQPValue::LongLongInt(10_000)
            ))
        );
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-queue-type' for queue 'q' in vhost '/': received the value 'quorum' of type 'longstr' but current is none";
        assert_eq!(Difference::read(text), Some(Difference::Type));
        let text = "PRECONDITION_FAILED - inequivalent arg 'x-overflow' for queue 'q' in vhost '/': received the value 'drop-head' of type 'longstr' but current is none";
        assert_eq!(
            Difference::read(text),
            Some(Difference::Extra("x-overflow".into()))
        );
        assert_eq!(Difference::read("NOT_FOUND - no queue 'q'"), None);
    }
}
