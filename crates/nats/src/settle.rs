//! Settling a delivery: ack, retry (`Nak` or a waiting copy), dead letter;
//! and publishing.

use async_trait::async_trait;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{Context, PublishError, PublishErrorKind};
use async_nats::jetstream::message::AckKind;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use bytes::Bytes;

use super::NatsSource;
use super::connection::{js_code, unavailable};
use super::dead_letters::dead_letter_stream;
use super::fields::{F_SUBJECT, field, to_headers};
use super::read::Metadata;
use courier_core::model::{Delivery, Failure, rfc3339};
use courier_core::source::SettleParts;
use courier_core::source::SourceError;
use courier_core::source::shared::{F_RETRY_AT, replace, without};

/// How long a message whose retry copy or dead letter could not be written
/// waits before it is handed out again: not at once, since the write that
/// failed (a full or missing stream) is likely to fail again, and not a
/// whole `AckWait`, so that a passing fault costs little.
const AFTER_FAILED_SETTLE: Duration = Duration::from_secs(5);

impl NatsSource {
    pub(super) fn hand_out(&self, receipt: &str, sequence: u64) {
        self.in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(receipt.to_string(), sequence);
        self.held.fetch_add(1, Ordering::SeqCst);
    }

    /// This delivery is settled; when `done`, the message is too.
    pub(super) fn settled(&self, receipt: &str, done: bool) {
        let held = self
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(receipt);
        if let Some(sequence) = held {
            self.held.fetch_sub(1, Ordering::SeqCst);
            if done {
                self.first_attempts
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&sequence);
                self.retried
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&sequence);
            }
        }
    }

    /// An ack the server confirms (`AckSync`).
    pub(super) async fn confirmed(&self, receipt: &str, kind: AckKind) -> Result<(), SourceError> {
        self.client
            .request(receipt.to_string(), kind.into())
            .await
            .map(drop)
            .map_err(|e| {
                SourceError::unavailable(format!(
                    "NATS did not confirm the settlement ({e}); the message is handed out again after AckWait"
                ))
            })
    }

    /// The write that was to settle this delivery failed: the message stays
    /// in the work stream, unsettled, and is handed out again after
    /// [`AFTER_FAILED_SETTLE`] (a `Nak` with that delay; if even that is
    /// lost, after `AckWait`).
    async fn unsettled(&self, receipt: &str) {
        let _ = self
            .client
            .publish(
                receipt.to_string(),
                AckKind::Nak(Some(AFTER_FAILED_SETTLE)).into(),
            )
            .await;
        self.settled(receipt, false);
    }

    /// The dead-letter stream for a subject, created on first use with the
    /// work stream's replica count.
    pub(super) async fn dead_letter_stream(&self, subject: &str) -> Result<String, SourceError> {
        let name = dead_letter_stream(subject);
        if self
            .dead_letter_streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains(&name)
        {
            return Ok(name);
        }
        match self.js.get_stream(&name).await {
            Ok(_) => {}
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => {
                let config = StreamConfig {
                    name: name.clone(),
                    subjects: vec![subject.to_string()],
                    storage: StorageType::File,
                    num_replicas: self.replicas,
                    ..Default::default()
                };
                if let Err(e) = self.js.create_stream(config).await {
                    let overlap = js_code(&e) == Some(ErrorCode::STREAM_SUBJECT_OVERLAP);
                    return Err(if overlap {
                        SourceError::invalid(format!(
                            "the dead-letter subject {subject:?} is already captured by another stream (the work stream's subjects may cover it); name another deadLetterQueue in the policy"
                        ))
                    } else {
                        SourceError::broker(format!(
                            "cannot create the dead-letter stream {name:?}: {e}"
                        ))
                    });
                }
            }
            Err(e) => return Err(unavailable(e)),
        }
        self.dead_letter_streams
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(name.clone());
        Ok(name)
    }

    /// Publishes to `subject` and waits for the stream `stream` to store it.
    pub(super) async fn publish(
        &self,
        subject: &str,
        stream: &str,
        fields: &[(Bytes, Bytes)],
    ) -> Result<u64, SourceError> {
        publish_once(&self.js, subject, stream, fields, None).await
    }
}

/// Publishes to `subject` and waits for the stream `stream` to store it;
/// with `message_id`, JetStream stores a second publish of the same id
/// within the stream's duplicate window only once (`Nats-Msg-Id`).
pub(super) async fn publish_once(
    js: &Context,
    subject: &str,
    stream: &str,
    fields: &[(Bytes, Bytes)],
    message_id: Option<&str>,
) -> Result<u64, SourceError> {
    let (body, mut headers) = to_headers(fields);
    headers.insert("Nats-Expected-Stream", stream);
    if let Some(id) = message_id {
        headers.insert("Nats-Msg-Id", id);
    }
    let ack = js
        .publish_with_headers(subject.to_string(), headers, body)
        .await
        .map_err(|e| publish_error(format!("publishing to {subject:?}: {e}"), e))?
        .await
        .map_err(|e| {
            publish_error(
                format!("JetStream did not store the message for {subject:?}: {e}"),
                e,
            )
        })?;
    if ack.duplicate {
        tracing::debug!(%subject, id = ?message_id, "JetStream had this message already and stored it once");
    }
    Ok(ack.sequence)
}

/// A refused publish as a [`SourceError`]: too large when the message is
/// over the server's `max_payload` or the stream's `max_msg_size` (the
/// same write can never be stored), else a broker error.
fn publish_error(text: String, e: PublishError) -> SourceError {
    let stream_code = std::error::Error::source(&e)
        .and_then(|cause| cause.downcast_ref::<async_nats::jetstream::Error>())
        .map(|cause| cause.error_code());
    let too_large = e.kind() == PublishErrorKind::MaxPayloadExceeded
        || matches!(
            stream_code,
            Some(
                ErrorCode::STREAM_MESSAGE_EXCEEDS_MAXIMUM
                    | ErrorCode::STREAM_HEADER_EXCEEDS_MAXIMUM
            )
        );
    if too_large {
        SourceError::too_large(text).caused_by(e)
    } else {
        SourceError::broker(text).caused_by(e)
    }
}

#[async_trait]
impl SettleParts for NatsSource {
    async fn settle_ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        // Queued to the connection's writer, which writes what concurrent
        // deliveries queued together; `close` flushes it. An ack lost with
        // the connection only means a redelivery.
        let result = self
            .client
            .publish(delivery.receipt.clone(), AckKind::Ack.into())
            .await
            .map_err(unavailable);
        self.settled(&delivery.receipt, true);
        result
    }

    async fn settle_retry(
        &self,
        delivery: &Delivery,
        next_attempt: u32,
        first_attempt_at: SystemTime,
        at: SystemTime,
    ) -> Result<(), SourceError> {
        let receipt = &delivery.receipt;
        if next_attempt > delivery.attempt {
            let delay = at.duration_since(SystemTime::now()).unwrap_or_default();
            if let Some(metadata) = Metadata::read(receipt) {
                self.retried
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(metadata.sequence, metadata.delivered);
            }
            let result = self
                .client
                .publish(receipt.clone(), AckKind::Nak(Some(delay)).into())
                .await
                .map_err(unavailable);
            self.settled(receipt, false);
            return result;
        }
        // The attempt is not used up: a copy that remembers the attempt.
        let fields = delivery.fields_for_retry(next_attempt, first_attempt_at);
        let fields = self.seal.seal(replace(fields, F_RETRY_AT, rfc3339(at)));
        let subject = field(&fields, F_SUBJECT)
            .map(str::to_string)
            .or_else(|| self.send_subject.clone())
            .unwrap_or_else(|| self.options.queue.clone());
        if let Err(e) = self.publish(&subject, &self.options.queue, &fields).await {
            if !e.awaits_a_letter_that_fits(None) {
                self.unsettled(receipt).await;
            }
            return Err(e);
        }
        let result = self.confirmed(receipt, AckKind::Ack).await;
        self.settled(receipt, result.is_ok());
        result
    }

    async fn settle_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError> {
        let receipt = &delivery.receipt;
        let stored = async {
            let subject = &failure.dead_letter_queue;
            let stream = self.dead_letter_stream(subject).await?;
            let fields = without(delivery.fields_for_dead_letter(failure), F_RETRY_AT);
            self.publish(subject, &stream, &fields).await
        }
        .await;
        // Terminated only once the dead-letter stream has stored it.
        if let Err(e) = stored {
            if !e.awaits_a_letter_that_fits(Some(failure)) {
                self.unsettled(receipt).await;
            }
            return Err(e);
        }
        let result = self.confirmed(receipt, AckKind::Term).await;
        self.settled(receipt, result.is_ok());
        result
    }
}
