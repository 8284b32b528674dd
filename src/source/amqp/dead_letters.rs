//! Dead letters: written with confirm, browsed without taking them.

use std::future::Future;
use std::time::{SystemTime, UNIX_EPOCH};

use lapin::Channel;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::protocol::AMQPSoftError;

use super::convert::{dead_letter_of, message_for};
use super::errors::{broker_error, is_soft, short};
use super::{AmqpSource, new_id};
use crate::model::{DeadLetter, Delivery, F_MESSAGE_ID, Failure};
use crate::source::SourceError;
use crate::source::shared::{F_RETRY_AT, without};

impl AmqpSource {
    /// Gets up to `limit` messages of a queue without acking them, on a
    /// channel of their own; closing it puts them back where they were.
    pub(super) async fn browse(
        &self,
        queue: &str,
        limit: usize,
        mut stop_at: impl FnMut(&AmqpDelivery) -> bool,
    ) -> Result<(Channel, Vec<AmqpDelivery>), SourceError> {
        let session = self.session().await?;
        let channel = session
            .connection
            .create_channel()
            .await
            .map_err(|e| session.fail(e))?;
        let mut out = Vec::new();
        while out.len() < limit {
            let got = channel
                .basic_get(short(queue)?, BasicGetOptions { no_ack: false })
                .await;
            match got {
                Ok(Some(message)) => {
                    let stop = stop_at(&message.delivery);
                    out.push(message.delivery);
                    if stop {
                        break;
                    }
                }
                Ok(None) => break,
                Err(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => break,
                Err(e) => return Err(broker_error(e)),
            }
        }
        Ok((channel, out))
    }

    /// Finds a dead letter by id, lets `then` act on it, acks it, and puts
    /// the others back.
    pub(super) async fn take_dead_letter<F, Fut>(
        &self,
        dead_letter_queue: &str,
        id: &str,
        then: F,
    ) -> Result<(), SourceError>
    where
        F: FnOnce(AmqpDelivery) -> Fut,
        Fut: Future<Output = Result<AmqpDelivery, SourceError>>,
    {
        let (channel, mut got) = self
            .browse(dead_letter_queue, usize::MAX, |d| {
                dead_letter_of(d).id == id
            })
            .await?;
        let found = match got.last() {
            Some(d) if dead_letter_of(d).id == id => got.pop(),
            _ => None,
        };
        let result = match found {
            Some(letter) => match then(letter).await {
                Ok(letter) => letter
                    .acker
                    .ack(BasicAckOptions { multiple: false })
                    .await
                    .map(drop)
                    .map_err(broker_error),
                Err(e) => Err(e),
            },
            None => Err(SourceError::Invalid(format!(
                "dead letter {id} is not in {dead_letter_queue} (already replayed or purged?)"
            ))),
        };
        let _ = channel.close(200, "done".into()).await;
        result
    }

    pub(super) async fn write_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError> {
        let original = self.take_properties(&delivery.receipt);
        let (session, tag) = self.session_for(&delivery.receipt)?;
        let dlq = &failure.dead_letter_queue;
        session.ensure_dead_letter_queue(dlq).await?;
        let fields = without(delivery.fields_for_dead_letter(failure), F_RETRY_AT);
        let (body, mut properties) = message_for(&fields, original.as_ref(), &new_id());
        properties = properties.with_timestamp(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
        );
        session.publish(dlq, &body, properties).await?;
        session.ack(tag).await
    }

    pub(super) async fn list_dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let (channel, got) = self.browse(dead_letter_queue, limit, |_| false).await?;
        let letters = got.iter().map(dead_letter_of).collect();
        let _ = channel.close(200, "listed".into()).await;
        Ok(letters)
    }

    pub(super) async fn replay_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let session = self.session().await?;
        session
            .require(&self.options.queue, false, &self.uri.vhost)
            .await?;
        self.take_dead_letter(dead_letter_queue, &letter.id, |found| async {
            let stored = dead_letter_of(&found);
            let fields = stored.fields_for_replay();
            let id = stored
                .field(F_MESSAGE_ID)
                .map(str::to_string)
                .unwrap_or_else(new_id);
            let (body, properties) = message_for(&fields, Some(&found.properties), &id);
            session
                .publish(&self.options.queue, &body, properties)
                .await?;
            Ok(found)
        })
        .await
    }

    pub(super) async fn purge_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        self.take_dead_letter(dead_letter_queue, &letter.id, |found| async { Ok(found) })
            .await
    }
}
