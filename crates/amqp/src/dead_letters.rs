//! The dead-letter store: browse, replay and purge the dead-letter queue,
//! and send to the work queue; and the consumer's dead-lettering, written
//! with confirm.
//!
//! AMQP can only read a queue by handing its messages out. Listing gets
//! them without ack on a channel of its own and closes it, which puts them
//! back where they were. Replay and purge go through a cursor: a channel
//! that keeps what it read past and not yet asked for, so a run over many
//! letters (`courier dlq replay --reason ...`) reads each letter once, not
//! the queue once per letter. Letters the cursor holds are invisible to
//! others until it is closed: when it holds nothing, when a listing
//! starts, when a lookup fails and when the store is flushed.
//!
//! A replay publishes the message to the work queue with a confirm, then
//! acks the letter on the cursor's channel (in transaction mode, so the
//! ack is committed): a refused publish leaves the letter where it was, a
//! kill between the two leaves it in both queues, never in neither.
//!
//! Opened alone (`courier dlq`, `courier send`), the store has a connection
//! of its own and declares nothing: only passive declares and `basic.get`,
//! which on a missing queue answer "not found". A send needs the work queue
//! to exist; the seal key's queue is read (and made) by the first replay;
//! the queues of the `courier dlq` job records by the first record put
//! (`jobs.rs`).

use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use bytes::Bytes;
use lapin::message::Delivery as AmqpDelivery;
use lapin::options::{BasicAckOptions, BasicGetOptions};
use lapin::protocol::AMQPSoftError;
use lapin::{BasicProperties, Channel};
use tokio::sync::{Mutex, OnceCell};

use super::connection::Link;
use super::convert::{dead_letter_of, message_for};
use super::errors::{broker_error, is_soft, short, timed};
use super::jobs;
use super::seal::read_seal;
use super::session::Session;
use super::{AmqpSource, new_id};
use courier_core::model::{DeadLetter, Delivery, F_MESSAGE_ID, Failure, PAYLOAD};
use courier_core::source::shared::{F_RETRY_AT, Seal, not_there, without};
use courier_core::source::{DeadLetterStore, Depth, SourceError, SourceOptions};

/// A channel reading one dead-letter queue from the head, with the letters
/// it read and that were not asked for yet, in queue order.
struct Cursor {
    queue: String,
    channel: Channel,
    held: Vec<(String, AmqpDelivery)>,
}

/// A dead letter's copy for the work queue.
struct Replay {
    /// Writes the letter back when the copy did not arrive.
    session: Arc<Session>,
    queue: String,
    body: Bytes,
    properties: BasicProperties,
}

impl Cursor {
    /// A cursor on a channel of its own, in transaction mode. Not the
    /// session's publisher channel: that one is in confirm mode, which
    /// RabbitMQ does not combine with transactions. A commit is answered
    /// once the broker holds what it commits, as a confirm would be.
    async fn open(queue: &str, channel: Channel) -> Result<Self, SourceError> {
        if let Err(e) = timed(channel.tx_select()).await {
            let _ = channel.close(200, "no transactions".into()).await;
            return Err(e.into());
        }
        Ok(Self {
            queue: queue.to_string(),
            channel,
            held: Vec::new(),
        })
    }

    /// The letter `id`: from what is held, else read on until it comes.
    async fn find(&mut self, id: &str) -> Result<Option<AmqpDelivery>, SourceError> {
        if let Some(i) = self.held.iter().position(|(held, _)| held == id) {
            return Ok(Some(self.held.remove(i).1));
        }
        loop {
            let got = self
                .channel
                .basic_get(short(&self.queue)?, BasicGetOptions { no_ack: false })
                .await;
            match got {
                Ok(Some(message)) => {
                    let letter_id = dead_letter_of(&message.delivery).id;
                    if letter_id == id {
                        return Ok(Some(message.delivery));
                    }
                    self.held.push((letter_id, message.delivery));
                }
                Ok(None) => return Ok(None),
                Err(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => return Ok(None),
                Err(e) => return Err(broker_error(e)),
            }
        }
    }

    /// Publishes `letter`'s `replay`, if any, on the session's publisher
    /// channel and waits for its confirm, then acks the letter. Not one
    /// transaction: a publish in transaction mode that a full queue refuses
    /// (`overflow: reject-publish`) is dropped without a word on a quorum
    /// queue, and the commit still acks the letter, which is then in
    /// neither queue (conformance `amqp_a_replay_stopped_at_the_publish_
    /// loses_nothing` found it). Confirmed first, a refused copy leaves the
    /// letter where it was; a kill between the two leaves it in both.
    async fn settle(
        &self,
        letter: &AmqpDelivery,
        replay: Option<&Replay>,
    ) -> Result<(), SourceError> {
        if let Some(replay) = replay {
            replay
                .session
                .publish(&replay.queue, &replay.body, replay.properties.clone())
                .await?;
        }
        self.channel
            .basic_ack(letter.delivery_tag, BasicAckOptions { multiple: false })
            .await
            .map_err(broker_error)?;
        timed(self.channel.tx_commit())
            .await
            .map_err(SourceError::from)
    }

    /// Puts back everything held, and drops a transaction not committed.
    async fn close(self) {
        let _ = self.channel.close(200, "done".into()).await;
    }
}

/// The dead letters of one work queue, on a connection of the store's own
/// (opened at once by an admin handle, on first use by a consumer's).
pub(super) struct AmqpStore {
    link: Arc<Link>,
    queue: String,
    session: Mutex<Option<Arc<Session>>>,
    /// Replay and purge read the dead-letter queue through this.
    cursor: Mutex<Option<Cursor>>,
    /// The queue's seal: the consumer's, or read (and made if missing)
    /// when an admin handle first replays.
    seal: OnceCell<Arc<Seal>>,
}

impl AmqpStore {
    pub(super) fn new(link: Arc<Link>, queue: &str, seal: Option<Arc<Seal>>) -> Self {
        Self {
            link,
            queue: queue.to_string(),
            session: Mutex::new(None),
            cursor: Mutex::new(None),
            seal: OnceCell::new_with(seal),
        }
    }

    /// An admin handle: one connection, nothing declared.
    pub(super) async fn open(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let link = Link::parse(url, &options)?.with_broker_frames();
        let store = Self::new(Arc::new(link), &options.queue, options.seal.clone());
        store.session().await?;
        Ok(store)
    }

    /// The live session, opening a new one when there is none or the last
    /// was lost.
    async fn session(&self) -> Result<Arc<Session>, SourceError> {
        let mut slot = self.session.lock().await;
        if let Some(session) = slot.as_ref().filter(|s| s.healthy()) {
            return Ok(session.clone());
        }
        if let Some(lost) = slot.take() {
            lost.retire();
        }
        let session = Arc::new(self.link.open().await?);
        *slot = Some(session.clone());
        Ok(session)
    }

    /// The work queue, which a replay and a send write to: it must exist.
    async fn work_queue(&self) -> Result<Arc<Session>, SourceError> {
        let session = self.session().await?;
        session
            .require(&self.queue, None, &self.link.uri.vhost)
            .await?;
        Ok(session)
    }

    /// Gets up to `limit` messages of a queue without acking them, on a
    /// channel of their own; closing it puts them back where they were.
    async fn browse(
        &self,
        queue: &str,
        limit: usize,
    ) -> Result<(Channel, Vec<AmqpDelivery>), SourceError> {
        let channel = self.open_channel().await?;
        let mut out = Vec::new();
        while out.len() < limit {
            let got = channel
                .basic_get(short(queue)?, BasicGetOptions { no_ack: false })
                .await;
            match got {
                Ok(Some(message)) => out.push(message.delivery),
                Ok(None) => break,
                Err(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => break,
                Err(e) => return Err(broker_error(e)),
            }
        }
        Ok((channel, out))
    }

    async fn open_channel(&self) -> Result<Channel, SourceError> {
        let session = self.session().await?;
        session
            .connection
            .create_channel()
            .await
            .map_err(|e| session.fail(e))
    }

    /// Closes the cursor, which puts back what it held.
    async fn close_cursor(&self) {
        if let Some(cursor) = self.cursor.lock().await.take() {
            cursor.close().await;
        }
    }

    /// Puts back what the cursor holds and closes the store's connection.
    pub(super) async fn close(&self) {
        self.close_cursor().await;
        if let Some(session) = self.session.lock().await.take() {
            session.retire();
            let _ = session
                .connection
                .close(200, "courier is done".into())
                .await;
        }
    }

    /// Finds a dead letter by id and acks it, with the copy `then` makes
    /// of it, if any, published in the same transaction.
    async fn take_dead_letter<F>(
        &self,
        dead_letter_queue: &str,
        id: &str,
        then: F,
    ) -> Result<(), SourceError>
    where
        F: FnOnce(&AmqpDelivery) -> Result<Option<Replay>, SourceError>,
    {
        let mut slot = self.cursor.lock().await;
        if let Some(cursor) =
            slot.take_if(|c| c.queue != dead_letter_queue || !c.channel.status().connected())
        {
            cursor.close().await;
        }
        let cursor = match slot.as_mut() {
            Some(cursor) => cursor,
            None => slot.insert(Cursor::open(dead_letter_queue, self.open_channel().await?).await?),
        };
        let result = match cursor.find(id).await {
            Ok(Some(letter)) => match then(&letter) {
                Ok(replay) => cursor.settle(&letter, replay.as_ref()).await,
                Err(e) => Err(e),
            },
            Ok(None) => Err(not_there(dead_letter_queue, id)),
            Err(e) => Err(e),
        };
        // After a failure the letter (and what was read past) goes back
        // where it was; after a success the cursor stays open only while it
        // holds letters a later call may ask for.
        if (result.is_err() || slot.as_ref().is_some_and(|c| c.held.is_empty()))
            && let Some(cursor) = slot.take()
        {
            cursor.close().await;
        }
        result
    }
}

#[async_trait]
impl DeadLetterStore for AmqpStore {
    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        self.close_cursor().await;
        let (channel, got) = self.browse(dead_letter_queue, limit).await?;
        let letters = got.iter().map(dead_letter_of).collect();
        let _ = channel.close(200, "listed".into()).await;
        Ok(letters)
    }

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let session = self.work_queue().await?;
        let seal = self
            .seal
            .get_or_try_init(|| async { read_seal(&session, &self.queue).await.map(Arc::new) })
            .await?;
        let replayed = self
            .take_dead_letter(dead_letter_queue, &letter.id, |found| {
                let stored = dead_letter_of(found);
                let fields = seal.seal(
                    letter
                        .fields_for_replay_of(&stored)
                        .map_err(SourceError::invalid)?,
                );
                let id = stored
                    .field(F_MESSAGE_ID)
                    .map(str::to_string)
                    .unwrap_or_else(new_id);
                let (body, properties) = message_for(&fields, Some(&found.properties), &id);
                // A replay enters the queue now: the letter's own
                // `timestamp` is when it was dead-lettered, and would age
                // the message.
                let properties = properties.with_timestamp(
                    SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap_or_default()
                        .as_secs(),
                );
                Ok(Some(Replay {
                    session: session.clone(),
                    queue: self.queue.clone(),
                    body,
                    properties,
                }))
            })
            .await;
        // The work queue may be what went missing: the next replay looks
        // for it again, and says so before it takes a letter.
        if replayed.is_err() {
            session.forget(&self.queue);
        }
        replayed
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        self.take_dead_letter(dead_letter_queue, &letter.id, |_| Ok(None))
            .await
    }

    /// The sidecar's reading ([`super::depth::read`]) on this store's
    /// connection: passive declares only, so it declares nothing and
    /// consumes nothing.
    async fn depth_of(&self, dead_letter_queue: &str) -> Result<Option<Depth>, SourceError> {
        let session = self.session().await?;
        super::depth::read(
            &session,
            &self.queue,
            dead_letter_queue,
            &self.link.uri.vhost,
        )
        .await
        .map(Some)
    }

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        let session = self.work_queue().await?;
        let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), body)];
        fields.extend(
            headers
                .iter()
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        let id = new_id();
        let (body, properties) = message_for(&fields, None, &id);
        let properties = properties.with_timestamp(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs(),
        );
        session.publish(&self.queue, &body, properties).await?;
        Ok(id)
    }

    async fn flush(&self) {
        self.close().await
    }

    async fn job_records(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        jobs::list(&*self.session().await?, dead_letter_queue).await
    }

    async fn put_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        jobs::change(
            &*self.session().await?,
            dead_letter_queue,
            key,
            Some(record),
        )
        .await
    }

    async fn remove_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        jobs::change(&*self.session().await?, dead_letter_queue, key, None).await
    }
}

impl AmqpSource {
    /// Publishes the dead letter with confirm, then acks the delivery; when
    /// either cannot be done the delivery is handed back, never acked away.
    pub(super) async fn write_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError> {
        let original = self.take_properties(&delivery.receipt);
        let (session, tag) = self.session_for(&delivery.receipt)?;
        let written = async {
            let dlq = &failure.dead_letter_queue;
            let kind = self.work_queue_kind(&session, original.as_ref()).await?;
            session.ensure_dead_letter_queue(dlq, kind).await?;
            let fields = without(delivery.fields_for_dead_letter(failure), F_RETRY_AT);
            let (body, mut properties) = message_for(&fields, original.as_ref(), &new_id());
            properties = properties.with_timestamp(
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default()
                    .as_secs(),
            );
            session.publish(dlq, &body, properties).await
        }
        .await;
        match written {
            Ok(()) => session.ack(tag).await,
            Err(e) => {
                session.give_back(tag);
                Err(handed_back(e))
            }
        }
    }
}

/// A settlement that could not be written, saying the message is safe.
pub(super) fn handed_back(e: SourceError) -> SourceError {
    let kept = "; the delivery was not acked and RabbitMQ hands the message out again";
    e.with_suffix(kept)
}
