//! One connection and its channels: declares, confirmed publishes, acks.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{BasicAckOptions, BasicNackOptions, BasicPublishOptions, QueueDeclareOptions};
use lapin::protocol::AMQPSoftError;
use lapin::types::{FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, Queue};
use tokio::sync::mpsc;

use super::QueueState;
use super::errors::{Timed, broker_error, is_soft, short, timed};
use super::queues::QueueKind;
use courier_core::source::SourceError;

/// How long a delivery whose retry or dead letter could not be written is
/// held before it is requeued.
const GIVE_BACK_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// The work queue `queue` is not in `vhost`: how to make it.
pub(super) fn missing_queue(queue: &str, vhost: &str) -> SourceError {
    SourceError::invalid(format!(
        "queue {queue:?} does not exist in vhost {vhost:?}; declare it (quorum or classic, durable), or start `courier run` with --create to declare a durable quorum queue (--queue-type classic for a classic one)"
    ))
}

/// One connection and its channels; replaced as a whole when anything on it
/// fails, because the broker then requeues what it held anyway.
pub(super) struct Session {
    pub(super) generation: u64,
    pub(super) connection: Connection,
    pub(super) consume: Channel,
    pub(super) publish: Channel,
    pub(super) admin: tokio::sync::Mutex<Option<Channel>>,
    /// Deliveries the pump took from the consumer, in order.
    pub(super) inbox: tokio::sync::Mutex<Option<mpsc::UnboundedReceiver<AmqpDelivery>>>,
    pub(super) consumer_tag: Mutex<Option<ShortString>>,
    pub(super) pump: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// Queues known to exist on this connection.
    pub(super) declared: Mutex<HashSet<String>>,
    /// Delivery tags handed to courier and not yet settled.
    pub(super) outstanding: Arc<Mutex<HashSet<u64>>>,
    pub(super) broken: Arc<AtomicBool>,
    pub(super) state: Arc<QueueState>,
}

impl Session {
    pub(super) fn healthy(&self) -> bool {
        !self.broken.load(Ordering::SeqCst)
            && self.connection.status().connected()
            && self.consume.status().connected()
            && self.publish.status().connected()
    }

    /// Marks the session unusable when an error came from the connection or
    /// one of its long-lived channels (both close on any error).
    pub(super) fn fail(&self, e: lapin::Error) -> SourceError {
        self.broken.store(true, Ordering::SeqCst);
        broker_error(e)
    }

    /// A settled delivery is no longer counted as pending.
    pub(super) fn settled(&self, tag: u64) {
        if self
            .outstanding
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&tag)
        {
            self.state.unacked.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Gives up the connection; the broker requeues whatever it held.
    pub(super) fn retire(&self) {
        self.broken.store(true, Ordering::SeqCst);
        if let Some(pump) = self.pump.lock().unwrap_or_else(|e| e.into_inner()).take() {
            pump.abort();
        }
        let held = std::mem::take(&mut *self.outstanding.lock().unwrap_or_else(|e| e.into_inner()));
        self.state
            .unacked
            .fetch_sub(held.len() as i64, Ordering::SeqCst);
        let (consume, publish) = (self.consume.clone(), self.publish.clone());
        tokio::spawn(async move {
            let _ = consume.close(200, "courier reconnects".into()).await;
            let _ = publish.close(200, "courier reconnects".into()).await;
        });
    }

    /// Declares `queue` on the admin channel, one declaration at a time:
    /// a declaration the broker refuses (a passive one of a missing queue,
    /// the type probe) closes the channel, and must not take another one in
    /// flight on it down with it. The outer error is a channel or time-out
    /// failure; the inner one the broker's refusal.
    pub(super) async fn admin_declare(
        &self,
        queue: &str,
        options: QueueDeclareOptions,
        arguments: FieldTable,
    ) -> Result<Result<Queue, lapin::Error>, SourceError> {
        let mut admin = self.admin.lock().await;
        let channel = match admin.as_ref().filter(|c| c.status().connected()) {
            Some(channel) => channel.clone(),
            None => {
                let channel = self
                    .connection
                    .create_channel()
                    .await
                    .map_err(|e| self.fail(e))?;
                *admin = Some(channel.clone());
                channel
            }
        };
        match timed(channel.queue_declare(short(queue)?, options, arguments)).await {
            Ok(declared) => Ok(Ok(declared)),
            Err(Timed::Broker(e)) => {
                *admin = None;
                Ok(Err(e))
            }
            Err(e) => {
                *admin = None;
                Err(e.into())
            }
        }
    }

    /// Message count of a queue, or `None` when it does not exist.
    pub(super) async fn passive_count(&self, queue: &str) -> Result<Option<u32>, SourceError> {
        let options = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        match self
            .admin_declare(queue, options, FieldTable::default())
            .await?
        {
            Ok(q) => {
                self.known(queue);
                Ok(Some(q.message_count()))
            }
            Err(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => Ok(None),
            Err(e) => Err(broker_error(e)),
        }
    }

    pub(super) fn known(&self, queue: &str) {
        self.declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(queue.to_string());
    }

    /// A queue that was found missing after all: the next use looks again.
    pub(super) fn forget(&self, queue: &str) {
        self.declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(queue);
    }

    pub(super) fn is_known(&self, queue: &str) -> bool {
        self.declared
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(queue)
    }

    /// Declares a queue courier owns (a tier, a dead-letter queue), durable.
    /// One that exists with other arguments (an earlier version of courier
    /// declared it classic, or an operator declared it) is used as it is.
    pub(super) async fn declare(
        &self,
        queue: &str,
        arguments: FieldTable,
    ) -> Result<(), SourceError> {
        if self.is_known(queue) {
            return Ok(());
        }
        let declared = self
            .admin_declare(queue, QueueDeclareOptions::durable(), arguments)
            .await
            .map_err(|e| SourceError::broker(format!("cannot declare queue {queue:?}: {e}")))?;
        if let Err(e) = declared {
            if is_soft(&e, AMQPSoftError::PRECONDITIONFAILED)
                && self.passive_count(queue).await?.is_some()
            {
                tracing::warn!(%queue, error = %e, "the queue exists with other arguments than courier declares; it is used as it is");
                return Ok(());
            }
            return Err(SourceError::broker(format!(
                "cannot declare queue {queue:?}: {}",
                broker_error(e)
            )));
        }
        self.known(queue);
        Ok(())
    }

    /// A dead-letter queue: used as it is when it exists (classic or quorum),
    /// else declared durable, of the work queue's `kind`.
    pub(super) async fn ensure_dead_letter_queue(
        &self,
        queue: &str,
        kind: QueueKind,
    ) -> Result<(), SourceError> {
        if self.is_known(queue) || self.passive_count(queue).await?.is_some() {
            return Ok(());
        }
        self.declare(queue, kind.dead_letter_arguments()).await
    }

    /// A queue that must exist; one that is missing is declared durable, of
    /// the kind `create` names (`--create`), else it is an error.
    pub(super) async fn require(
        &self,
        queue: &str,
        create: Option<QueueKind>,
        vhost: &str,
    ) -> Result<(), SourceError> {
        if self.is_known(queue) || self.passive_count(queue).await?.is_some() {
            return Ok(());
        }
        if let Some(kind) = create {
            return self.declare(queue, kind.work_queue_arguments()).await;
        }
        Err(missing_queue(queue, vhost))
    }

    /// Publishes through the default exchange and waits for the broker's
    /// confirm; an unroutable message (a queue deleted meanwhile) is an error.
    pub(super) async fn publish(
        &self,
        queue: &str,
        body: &[u8],
        properties: BasicProperties,
    ) -> Result<(), SourceError> {
        let options = BasicPublishOptions {
            mandatory: true,
            immediate: false,
        };
        let routing_key = short(queue)?;
        let published = timed(async {
            self.publish
                .basic_publish("".into(), routing_key, options, body, properties)
                .await?
                .await
        })
        .await;
        let confirm = published.map_err(|e| {
            self.broken.store(true, Ordering::SeqCst);
            SourceError::from(e)
        })?;
        match confirm {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(returned)) => {
                self.forget(queue);
                Err(SourceError::broker(format!(
                    "RabbitMQ could not route the message to queue {queue:?} ({} {})",
                    returned.reply_code, returned.reply_text
                )))
            }
            Confirmation::Nack(_) => Err(SourceError::broker(format!(
                "RabbitMQ refused to store the message in queue {queue:?} (publisher nack: the queue is full with x-overflow reject-publish, or the broker is short of disk or memory)"
            ))),
        }
    }

    pub(super) async fn ack(&self, tag: u64) -> Result<(), SourceError> {
        self.consume
            .basic_ack(tag, BasicAckOptions { multiple: false })
            .await
            .map_err(|e| self.fail(e))?;
        self.settled(tag);
        Ok(())
    }

    /// Hands a delivery back to the broker because what was to settle it
    /// (a retry or a dead letter) could not be written: it is requeued and
    /// handed out again, never acked away. The requeue waits a moment, so a
    /// store that stays unwritable does not turn into a hot loop of
    /// deliveries to the app; meanwhile the delivery still takes a place of
    /// the prefetch, which slows the consumer down as well.
    pub(super) fn give_back(self: &Arc<Self>, tag: u64) {
        let session = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(GIVE_BACK_AFTER).await;
            // On a lost connection the broker has requeued it already.
            if session.healthy() {
                let requeue = BasicNackOptions {
                    multiple: false,
                    requeue: true,
                };
                if let Err(e) = session.consume.basic_nack(tag, requeue).await {
                    session.fail(e);
                }
            }
            session.settled(tag);
        });
    }
}
