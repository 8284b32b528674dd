//! Settling a delivery: ack (batched deletes), retry (a visibility change
//! or a delayed copy), dead letter; and sending.

use async_trait::async_trait;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant, SystemTime};

use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::ProvideErrorMetadata;
use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
};
use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::attributes::to_wire;
use super::connection::{broker, error_code, sdk_error};
use super::dead_letters::dead_letter_queue_name;
use super::{Delete, SqsSource, lock};
use courier_core::duration::limit_from_env;
use courier_core::model::{Delivery, Failure, rfc3339};
use courier_core::source::SettleParts;
use courier_core::source::SourceError;
use courier_core::source::shared::{F_RETRY_AT, replace, without};

/// The longest SQS keeps a message invisible, counted from when it was
/// sent (moto counts from there; SQS from the first receive, which is
/// later, so this is the safe reading).
pub(super) const MAX_VISIBILITY: u64 = 43_200;

/// Room left for clocks that disagree and calls under way.
const VISIBILITY_MARGIN: u64 = 60;

/// The longest `DelaySeconds` SQS takes.
pub(super) const MAX_DELAY_SECONDS: u64 = 900;

/// How long a message whose retry copy or dead letter SQS did not take
/// stays invisible before it is handed out again: not at once, since the
/// write that failed is likely to fail again, and not a whole visibility
/// timeout, so that a passing fault costs little.
const AFTER_FAILED_SETTLE: u64 = 5;

/// The field of a FIFO dead letter naming its message group, where a
/// replay sends it again.
pub(super) const F_GROUP: &str = "courier-group";

/// The variables that lower [`MAX_VISIBILITY`] and [`MAX_DELAY_SECONDS`]
/// for tests and trials ([`limit_from_env`]).
pub const MAX_VISIBILITY_ENV: &str = "COURIER_SQS_MAX_VISIBILITY";
pub const MAX_DELAY_ENV: &str = "COURIER_SQS_MAX_DELAY";

/// How long a message may still be made visible by this process after its
/// due time: closer to the moment SQS makes it visible by itself, the
/// receipt may already be someone else's.
const SURFACE_GUARD: Duration = Duration::from_millis(100);

/// Retries this process made invisible and makes visible at their due
/// time, at most: one over it waits for SQS's own whole seconds.
pub(super) const MOST_SURFACING: usize = 4096;

/// How long a message may wait in SQS, as courier keeps to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Limits {
    /// Seconds a message may be kept invisible, counted from its send.
    pub(super) visibility: u64,
    /// The longest `DelaySeconds` of a copy.
    pub(super) delay: u64,
}

impl Limits {
    /// SQS's own.
    pub(super) const SQS: Self = Self {
        visibility: MAX_VISIBILITY,
        delay: MAX_DELAY_SECONDS,
    };

    /// SQS's, or lower ones from [`MAX_VISIBILITY_ENV`] and
    /// [`MAX_DELAY_ENV`] (whole seconds).
    pub(super) fn from_env() -> Result<Self, SourceError> {
        let secs = |name, most| {
            let most = Duration::from_secs(most);
            limit_from_env(name, most, most)
                .map(|d| d.as_secs())
                .map_err(SourceError::invalid)
        };
        Ok(Self {
            visibility: secs(MAX_VISIBILITY_ENV, MAX_VISIBILITY)?,
            delay: secs(MAX_DELAY_ENV, MAX_DELAY_SECONDS)?,
        })
    }

    /// How many more seconds a message sent at `sent_at` may be kept
    /// invisible.
    pub(super) fn room(&self, sent_at: SystemTime, now: SystemTime) -> u64 {
        let since = now.duration_since(sent_at).unwrap_or_default().as_secs();
        let margin = VISIBILITY_MARGIN.min(self.visibility / 10);
        self.visibility.saturating_sub(margin + since)
    }

    /// What a receive of a copy that is not yet due does. `remaining`: the
    /// time until it is due; `room`: seconds SQS may still keep it invisible
    /// ([`Limits::room`]); `first`: whether this is the copy's first receive,
    /// the one its attempt count leaves out (a later one is sent on as a
    /// new copy, so that the count stays exact).
    pub(super) fn plan_wait(&self, remaining: Duration, room: u64, first: bool) -> Waiting {
        let secs = ceil_secs(remaining);
        if first && secs <= room {
            Waiting::Invisible(secs)
        } else {
            Waiting::SendOn(self.copy_delay(remaining))
        }
    }

    /// The `DelaySeconds` of a copy due in `remaining`: whole seconds
    /// rounded down, so that it comes back before its due time (under a
    /// second before) and the reader that receives it keeps it invisible
    /// until then and makes it visible at that time itself, to the
    /// millisecond; and at most the longest delay.
    pub(super) fn copy_delay(&self, remaining: Duration) -> u64 {
        remaining.as_secs().min(self.delay)
    }
}

/// What a receive of a copy that is not yet due does.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Waiting {
    /// Invisible for this many seconds, then offered.
    Invisible(u64),
    /// Sent on as a new copy delayed this many seconds, this one deleted:
    /// the time still to wait is more than SQS keeps this copy invisible,
    /// or the copy was received before.
    SendOn(u64),
}

/// Whole seconds, rounded up: a retry is never early.
pub(super) fn ceil_secs(d: Duration) -> u64 {
    d.as_millis().div_ceil(1000) as u64
}

/// Gathers acks into `DeleteMessageBatch` calls of up to 10: whatever is
/// waiting when a call can go goes in it, and calls run side by side.
pub(super) async fn delete_batches(
    client: Client,
    queue_url: String,
    mut deletes: mpsc::UnboundedReceiver<Delete>,
) {
    while let Some(first) = deletes.recv().await {
        let mut batch = vec![first];
        while batch.len() < 10 {
            match deletes.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        tokio::spawn(delete_batch(client.clone(), queue_url.clone(), batch));
    }
}

/// One `DeleteMessageBatch`; each ack learns its own entry's result.
async fn delete_batch(client: Client, queue_url: String, batch: Vec<Delete>) {
    let entries: Vec<_> = batch
        .iter()
        .enumerate()
        .filter_map(|(i, d)| {
            DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(&d.receipt)
                .build()
                .ok()
        })
        .collect();
    let answer = client
        .delete_message_batch()
        .queue_url(&queue_url)
        .set_entries(Some(entries))
        .send()
        .await;
    match answer {
        Ok(out) => {
            let deleted: HashSet<&str> = out.successful().iter().map(|s| s.id()).collect();
            let failed: HashMap<&str, String> = out
                .failed()
                .iter()
                .map(|f| {
                    (
                        f.id(),
                        format!("{}: {}", f.code(), f.message().unwrap_or_default()),
                    )
                })
                .collect();
            for (i, delete) in batch.into_iter().enumerate() {
                let id = i.to_string();
                let result = if deleted.contains(id.as_str()) {
                    Ok(())
                } else {
                    let why = failed
                        .get(id.as_str())
                        .cloned()
                        .unwrap_or_else(|| "no answer for it".into());
                    Err(SourceError::broker(format!(
                        "SQS did not delete the message ({why}); it is handed out again after its visibility timeout"
                    )))
                };
                let _ = delete.done.send(result);
            }
        }
        Err(e) => {
            let e = sdk_error("deleting messages", e);
            for delete in batch {
                let _ = delete.done.send(Err(e.clone()));
            }
        }
    }
}

impl SqsSource {
    /// Deletes one message of the work queue, in the next batch.
    pub(super) async fn delete(&self, receipt: &str) -> Result<(), SourceError> {
        let (done, answer) = oneshot::channel();
        self.deletes
            .send(Delete {
                receipt: receipt.to_string(),
                done,
            })
            .map_err(|_| SourceError::unavailable("the source is closed"))?;
        answer
            .await
            .unwrap_or_else(|_| Err(SourceError::unavailable("the delete was cut short")))
    }

    pub(super) async fn change_visibility(
        &self,
        queue_url: &str,
        receipt: &str,
        secs: u64,
    ) -> Result<(), SourceError> {
        self.client
            .change_message_visibility()
            .queue_url(queue_url)
            .receipt_handle(receipt)
            .visibility_timeout(secs.min(self.limits.visibility) as i32)
            .send()
            .await
            .map(drop)
            .map_err(|e| sdk_error("changing a message's visibility", e))
    }

    /// This delivery is no longer with the app; its group may go on.
    fn settled(&self, receipt: &str) -> Option<super::InFlight> {
        let held = lock(&self.in_flight).remove(receipt);
        if let Some(held) = &held {
            self.group_done(held.group.as_deref());
        }
        held
    }

    /// The message is done: forget what the process kept about it.
    fn forget(&self, sqs_id: &str) {
        lock(&self.first_attempts).remove(sqs_id);
        lock(&self.uncounted).remove(sqs_id);
        lock(&self.due).remove(sqs_id);
        lock(&self.retried).remove(sqs_id);
    }

    /// A receive of a copy not yet due: its first, invisible for the time
    /// still to wait when SQS allows that long (and made visible at its due
    /// time by this process), else sent on as a new copy; a later receive
    /// (the process that had the first one died) is sent on too. FIFO
    /// (`in_process`): invisible for as long as SQS allows, and the receive
    /// is not counted.
    pub(super) async fn wait_copy(
        &self,
        message: &aws_sdk_sqs::types::Message,
        fields: Vec<(Bytes, Bytes)>,
        at: SystemTime,
        sent_at: SystemTime,
        in_process: bool,
        first: bool,
    ) {
        let receipt = message.receipt_handle().unwrap_or_default();
        let now = SystemTime::now();
        let remaining = at.duration_since(now).unwrap_or_default();
        let room = self.limits.room(sent_at, now);
        if in_process {
            let id = message.message_id().unwrap_or_default().to_string();
            *lock(&self.uncounted).get_or_insert_with(id, || 0) += 1;
        }
        let send_on = match self.limits.plan_wait(remaining, room, first || in_process) {
            Waiting::Invisible(secs) => {
                if self.put_back(receipt, secs).await && !in_process {
                    self.surface_at(at, receipt, secs);
                }
                return;
            }
            // FIFO has no copies: as long as SQS allows, the rest kept in
            // the process.
            Waiting::SendOn(_) if in_process => {
                self.put_back(receipt, room).await;
                return;
            }
            Waiting::SendOn(delay) => delay,
        };
        let fields = self.seal.seal(fields);
        match send_fields(&self.client, &self.queue_url, false, &fields, send_on, None).await {
            Ok(_) => {
                if let Err(e) = self.delete(receipt).await {
                    tracing::warn!(error = %e, "a retry copy was sent on but the one before it not deleted");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "a retry copy not yet due could not be sent on; it is received again after its visibility timeout");
            }
        }
    }

    /// Makes the message with `receipt`, which this process made invisible
    /// for `secs` (SQS's whole seconds, rounded up), visible at `at`, its
    /// due time.
    pub(super) fn surface_at(&self, at: SystemTime, receipt: &str, secs: u64) {
        let sqs_shows_it = Instant::now() + Duration::from_secs(secs);
        let mut surfacing = lock(&self.surfacing);
        if surfacing.len() < MOST_SURFACING {
            surfacing.insert((at, receipt.to_string()), sqs_shows_it);
        }
    }

    /// How long until the earliest message this process makes visible is
    /// due.
    pub(super) fn next_surfacing(&self) -> Option<Duration> {
        let surfacing = lock(&self.surfacing);
        let ((at, _), _) = surfacing.first_key_value()?;
        Some(at.duration_since(SystemTime::now()).unwrap_or_default())
    }

    /// Makes visible the messages this process made invisible that are
    /// due, but those SQS shows by itself any moment now.
    pub(super) async fn surface_due(&self) {
        let (now, instant) = (SystemTime::now(), Instant::now());
        let due: Vec<String> = {
            let mut surfacing = lock(&self.surfacing);
            let later = surfacing.split_off(&(now, String::new()));
            let due = std::mem::replace(&mut *surfacing, later);
            due.into_iter()
                .filter(|(_, sqs_shows_it)| instant + SURFACE_GUARD < *sqs_shows_it)
                .map(|((_, receipt), _)| receipt)
                .collect()
        };
        if due.is_empty() {
            return;
        }
        if let Err(e) = set_visibility(
            &self.client,
            &self.queue_url,
            due.iter().map(String::as_str),
            0,
            "making retries visible at their due time",
        )
        .await
        {
            tracing::debug!(error = %e, "a retry is made visible by SQS, at most a second after its due time");
        }
    }

    /// A copy not yet due, invisible for `secs` more; whether SQS took it.
    async fn put_back(&self, receipt: &str, secs: u64) -> bool {
        match self.change_visibility(&self.queue_url, receipt, secs).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(error = %e, "a retry copy not yet due could not be put back; it is received again after its visibility timeout");
                false
            }
        }
    }

    /// The write that was to settle this delivery failed: the message stays
    /// in the queue and is handed out again after [`AFTER_FAILED_SETTLE`]
    /// (if even that change is lost, after its visibility timeout).
    async fn unsettled(&self, receipt: &str) {
        let _ = self
            .change_visibility(&self.queue_url, receipt, AFTER_FAILED_SETTLE)
            .await;
        if let Some(held) = self.settled(receipt) {
            // A FIFO group's later messages must not overtake it.
            for waiting in self.take_waiting(held.group.as_deref()) {
                lock(&self.in_flight).remove(&waiting.receipt);
                let _ = self
                    .change_visibility(&self.queue_url, &waiting.receipt, 0)
                    .await;
            }
        }
    }

    /// Keeps what the source holds invisible for another visibility
    /// timeout: the deliveries with the app, and those waiting behind their
    /// FIFO group.
    pub(super) async fn keep_invisible(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        let mut receipts: Vec<String> = {
            let held = lock(&self.in_flight);
            in_flight
                .iter()
                .filter(|d| held.contains_key(&d.receipt))
                .map(|d| d.receipt.clone())
                .collect()
        };
        receipts.extend(self.waiting_receipts());
        *lock(&self.waiting_refreshed) = std::time::Instant::now();
        self.change_visibility_of(&receipts).await
    }

    /// Makes these messages invisible for another visibility timeout.
    pub(super) async fn change_visibility_of(
        &self,
        receipts: &[String],
    ) -> Result<(), SourceError> {
        set_visibility(
            &self.client,
            &self.queue_url,
            receipts.iter().map(String::as_str),
            self.visibility_secs(),
            "keeping messages invisible",
        )
        .await
    }
}

/// Sends fields as one message to the queue at `queue_url`; returns SQS's
/// id of it.
pub(super) async fn send_fields(
    client: &Client,
    queue_url: &str,
    fifo: bool,
    fields: &[(Bytes, Bytes)],
    delay_secs: u64,
    group: Option<&str>,
) -> Result<String, SourceError> {
    let wire = to_wire(fields)?;
    let mut request = client
        .send_message()
        .queue_url(queue_url)
        .message_body(wire.body);
    if !wire.attributes.is_empty() {
        request = request.set_message_attributes(Some(wire.attributes));
    }
    if fifo {
        // A FIFO queue has no per-message delay; its deduplication id
        // is new for every write, as each is a message of its own.
        request = request
            .message_group_id(group.unwrap_or("courier"))
            .message_deduplication_id(format!("{:032x}", rand::random::<u128>()));
    } else if delay_secs > 0 {
        request = request.delay_seconds(delay_secs as i32);
    }
    let out = request.send().await.map_err(|e| {
        // SQS's answer to a message over the queue's MaximumMessageSize
        // (body and attributes together; moto counts the body).
        let too_large = error_code(&e).as_deref() == Some("InvalidParameterValue")
            && e.as_service_error()
                .and_then(|s| s.message())
                .is_some_and(|m| m.contains("must be shorter than"));
        let e = sdk_error("sending to SQS", e);
        if too_large {
            SourceError::too_large(e.message().to_string())
        } else {
            e
        }
    })?;
    Ok(out.message_id().unwrap_or_default().to_string())
}

/// Sets the visibility timeout of the messages with these receipt handles
/// in `queue_url` to `secs`, in `ChangeMessageVisibilityBatch` calls of
/// ten; every call is made, and the last failure, if any, is returned.
pub(super) async fn set_visibility(
    client: &Client,
    queue_url: &str,
    receipts: impl Iterator<Item = &str>,
    secs: i32,
    what: &str,
) -> Result<(), SourceError> {
    let receipts: Vec<&str> = receipts.collect();
    let mut failed = None;
    for chunk in receipts.chunks(10) {
        let entries: Vec<_> = chunk
            .iter()
            .enumerate()
            .filter_map(|(i, receipt)| {
                ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(*receipt)
                    .visibility_timeout(secs)
                    .build()
                    .ok()
            })
            .collect();
        if let Err(e) = client
            .change_message_visibility_batch()
            .queue_url(queue_url)
            .set_entries(Some(entries))
            .send()
            .await
        {
            failed = Some(sdk_error(what, e));
        }
    }
    failed.map_or(Ok(()), Err)
}

#[async_trait]
impl SettleParts for SqsSource {
    async fn settle_ack(&self, delivery: &Delivery) -> Result<(), SourceError> {
        let result = self.delete(&delivery.receipt).await;
        if let Some(held) = self.settled(&delivery.receipt)
            && result.is_ok()
        {
            self.forget(&held.sqs_id);
        }
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
        let now = SystemTime::now();
        let remaining = at.duration_since(now).unwrap_or_default();
        let secs = ceil_secs(remaining);
        let Some(held) = lock(&self.in_flight).get(receipt).cloned() else {
            return Err(SourceError::invalid(format!(
                "message {} is not in flight here",
                delivery.message.id
            )));
        };
        let uses_attempt = next_attempt > delivery.attempt;
        let room = self.limits.room(held.sent_at, now);
        if self.fifo || (uses_attempt && secs <= room) {
            if self.fifo {
                if !uses_attempt {
                    *lock(&self.uncounted).get_or_insert_with(held.sqs_id.clone(), || 0) += 1;
                }
                if secs > room {
                    lock(&self.due).insert(held.sqs_id.clone(), at);
                }
            }
            lock(&self.first_attempts).get_or_insert_with(held.sqs_id.clone(), || first_attempt_at);
            lock(&self.retried).insert(held.sqs_id.clone(), held.received);
            let result = self
                .change_visibility(&self.queue_url, receipt, secs.min(room))
                .await;
            if result.is_ok() && !self.fifo {
                self.surface_at(at, receipt, secs);
            }
            self.settled(receipt);
            // The later messages of its group go back to SQS, which holds
            // the group while this one is invisible and then hands them out
            // after it.
            for waiting in self.take_waiting(held.group.as_deref()) {
                lock(&self.in_flight).remove(&waiting.receipt);
                if let Err(e) = self
                    .change_visibility(&self.queue_url, &waiting.receipt, 0)
                    .await
                {
                    tracing::debug!(error = %e, "a waiting message of the group stays invisible until its timeout");
                }
            }
            return result;
        }
        // A copy that remembers the attempt and the due time.
        let fields = delivery.fields_for_retry(next_attempt, first_attempt_at);
        let fields = self.seal.seal(replace(fields, F_RETRY_AT, rfc3339(at)));
        if let Err(e) = send_fields(
            &self.client,
            &self.queue_url,
            false,
            &fields,
            self.limits.copy_delay(remaining),
            None,
        )
        .await
        {
            if !e.awaits_a_letter_that_fits(None) {
                self.unsettled(receipt).await;
            }
            return Err(e);
        }
        let result = self.delete(receipt).await;
        if let Some(held) = self.settled(receipt) {
            self.forget(&held.sqs_id);
        }
        if let Err(e) = &result {
            tracing::warn!(error = %e, id = %delivery.message.id, "the retry copy is stored but the original was not deleted: the message comes back once more");
        }
        result
    }

    async fn settle_dead_letter(
        &self,
        delivery: &Delivery,
        failure: &Failure,
    ) -> Result<(), SourceError> {
        let receipt = &delivery.receipt;
        let group = lock(&self.in_flight)
            .get(receipt)
            .and_then(|h| h.group.clone());
        let stored = async {
            let name = dead_letter_queue_name(&failure.dead_letter_queue);
            let url = self
                .store
                .dead_letter_url(&name, true)
                .await?
                .ok_or_else(|| {
                    broker(format!(
                        "the dead-letter queue {name:?} could not be created"
                    ))
                })?;
            let mut fields = without(delivery.fields_for_dead_letter(failure), F_RETRY_AT);
            if let Some(group) = &group {
                fields = replace(fields, F_GROUP, group.clone());
            }
            send_fields(
                &self.client,
                &url,
                name.ends_with(".fifo"),
                &fields,
                0,
                group.as_deref(),
            )
            .await
        }
        .await;
        // Deleted only once the dead-letter queue took it.
        if let Err(e) = stored {
            if !e.awaits_a_letter_that_fits(Some(failure)) {
                self.unsettled(receipt).await;
            }
            return Err(e);
        }
        let result = self.delete(receipt).await;
        if let Some(held) = self.settled(receipt)
            && result.is_ok()
        {
            self.forget(&held.sqs_id);
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn visibility_room_counts_from_the_send() {
        let limits = Limits::SQS;
        let sent = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(limits.room(sent, sent), MAX_VISIBILITY - VISIBILITY_MARGIN);
        let later = sent + Duration::from_secs(3600);
        assert_eq!(
            limits.room(sent, later),
            MAX_VISIBILITY - VISIBILITY_MARGIN - 3600
        );
        assert_eq!(limits.room(sent, sent + Duration::from_secs(50_000)), 0);
        // A clock behind the sender's counts as no time passed.
        assert_eq!(limits.room(later, sent), MAX_VISIBILITY - VISIBILITY_MARGIN);
        // A limit lowered for a test keeps a tenth of it as the margin.
        let lowered = Limits {
            visibility: 20,
            delay: 2,
        };
        assert_eq!(lowered.room(sent, sent), 18);
        assert_eq!(ceil_secs(Duration::from_millis(1)), 1);
        assert_eq!(ceil_secs(Duration::from_millis(2000)), 2);
        assert_eq!(ceil_secs(Duration::ZERO), 0);
    }

    #[test]
    fn a_copy_not_yet_due_waits_or_is_sent_on() {
        let limits = Limits::SQS;
        let room = MAX_VISIBILITY - VISIBILITY_MARGIN;
        let secs = Duration::from_secs;
        assert_eq!(limits.plan_wait(secs(0), room, true), Waiting::Invisible(0));
        assert_eq!(limits.plan_wait(secs(5), room, true), Waiting::Invisible(5));
        assert_eq!(
            limits.plan_wait(Duration::from_millis(4_001), room, true),
            Waiting::Invisible(5)
        );
        assert_eq!(
            limits.plan_wait(secs(room), room, true),
            Waiting::Invisible(room)
        );
        // 13 h still to wait: on to a copy delayed the longest SQS takes.
        assert_eq!(
            limits.plan_wait(secs(13 * 3600), room, true),
            Waiting::SendOn(MAX_DELAY_SECONDS)
        );
        assert_eq!(
            limits.plan_wait(secs(room + 1), room, true),
            Waiting::SendOn(MAX_DELAY_SECONDS)
        );
        // Little room left on an old copy: sent on, to come back before it
        // is due.
        assert_eq!(limits.plan_wait(secs(10), 0, true), Waiting::SendOn(10));
        assert_eq!(
            limits.plan_wait(Duration::from_millis(1_500), 0, true),
            Waiting::SendOn(1)
        );
        // Received before (its first receive went to a process that died):
        // sent on whatever the room, so that its attempt count stays exact.
        assert_eq!(limits.plan_wait(secs(5), room, false), Waiting::SendOn(5));
    }

    #[test]
    fn a_copy_comes_back_before_it_is_due_within_the_longest_delay() {
        let limits = Limits {
            visibility: 2,
            delay: 2,
        };
        let ms = Duration::from_millis;
        assert_eq!(limits.copy_delay(ms(4_990)), 2);
        assert_eq!(limits.copy_delay(ms(1_990)), 1);
        assert_eq!(limits.copy_delay(ms(500)), 0);
        assert_eq!(Limits::SQS.copy_delay(ms(4_990)), 4);
        assert_eq!(Limits::SQS.copy_delay(Duration::from_secs(86_400)), 900);
    }
}
