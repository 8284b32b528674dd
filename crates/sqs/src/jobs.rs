//! The records of `courier dlq` jobs ([`DeadLetterStore::job_records`])
//! beside a dead-letter queue. SQS keeps no value under a key, so the
//! records are the messages of a standard queue of their own
//! ([`jobs_queue_name`]): one per key, the key and a version in message
//! attributes, the record as the body (base64 when SQS cannot carry it as
//! text).
//!
//! A write receives every message of that queue (each once, invisible
//! meanwhile), sends the new version, gives back at once what it keeps and
//! deletes the older versions of the key (and any outranked version of
//! another key); a listing receives them all and gives them all back. The
//! new version goes out before the old is deleted, so a write cut short
//! leaves two versions, never none; versions only grow, so the newer wins
//! wherever two are found ([`courier_core::source::jobs`]). A listing that
//! meets messages another command holds waits for them a while (as a
//! dead-letter listing does) and then leaves them out, with a warning.
//!
//! The queue is made by the first write only (a listing or a removal where
//! there is none finds nothing and makes nothing), with SQS's longest
//! retention, 14 days: SQS deletes older messages whatever they are, so a
//! write also sends afresh the other records older than a week.
//!
//! [`DeadLetterStore::job_records`]: courier_core::source::DeadLetterStore::job_records

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use aws_sdk_sqs::types::{Message, QueueAttributeName};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;

use super::attributes::{ENCODING, is_sqs_text, string};
use super::connection::{error_code, sdk_error};
use super::dead_letters::{
    Listing, SqsStore, check_dead_letter_queue, dead_letter_queue_name, sent_millis,
};
use super::lock;
use courier_core::source::SourceError;
use courier_core::source::jobs::{self, Fate, Held, Writing};

/// What a jobs queue's name adds to its dead-letter queue's.
const SUFFIX: &str = "-courier-jobs";
/// SQS's longest queue name.
const MAX_NAME: usize = 80;

/// The most messages a jobs queue is read to. Each is a record of at most
/// [`jobs::JOB_RECORD_MAX`] bytes (a third more in base64), so a read holds
/// some 22 MB at most; more than this is not one message per job any more,
/// and the command says so instead of reading on.
const MOST_MESSAGES: usize = 1000;

/// SQS's longest retention, given to the jobs queue at its creation.
const RETENTION: Duration = Duration::from_secs(14 * 24 * 3600);
/// A record older than this is sent afresh by the next write on its queue,
/// well before SQS drops it at [`RETENTION`].
const REFRESH_AFTER: Duration = Duration::from_secs(7 * 24 * 3600);

/// The SQS queue that keeps the job records of a dead-letter queue: its
/// SQS name ([`dead_letter_queue_name`]) and `-courier-jobs`, always a
/// standard queue. That of a FIFO dead-letter queue `<name>.fifo` is
/// `<name>-fifo-courier-jobs`, apart from that of a standard `<name>`. A
/// name over SQS's 80 characters keeps its start and a hash of the whole.
pub fn jobs_queue_name(dead_letter_queue: &str) -> String {
    let name = dead_letter_queue_name(dead_letter_queue);
    let base = match name.strip_suffix(".fifo") {
        Some(base) => format!("{base}-fifo"),
        None => name,
    };
    jobs::name_within(&base, SUFFIX, MAX_NAME)
}

/// The jobs queue's name, once the dead-letter queue is one SQS can name.
fn checked_name(dead_letter_queue: &str) -> Result<String, SourceError> {
    // No work queue to compare with here: "" is never a queue's name.
    check_dead_letter_queue(dead_letter_queue, "").map_err(SourceError::invalid)?;
    Ok(jobs_queue_name(dead_letter_queue))
}

/// A message of a jobs queue, as read. A body SQS could not carry as text
/// was sent in base64, which the encoding attribute says; one that does
/// not decode is no record of courier's.
fn held_of(message: &Message) -> Held {
    let text = |name: &str| {
        message
            .message_attributes()
            .and_then(|a| a.get(name))
            .and_then(|v| v.string_value())
    };
    let body = message.body().unwrap_or_default();
    let record = match text(ENCODING) {
        Some("base64") => BASE64.decode(body).ok().map(Bytes::from),
        _ => Some(Bytes::copy_from_slice(body.as_bytes())),
    };
    Held::new(
        message.message_id().unwrap_or_default().to_string(),
        text(jobs::KEY),
        text(jobs::VERSION),
        record,
        UNIX_EPOCH + Duration::from_millis(sent_millis(message)),
    )
}

/// A write or removal of `key`'s record. It holds the whole queue before
/// it sends, so every version of `key` held is older than its own.
fn writing(key: &str) -> Writing<'_> {
    Writing {
        key,
        below: None,
        own: None,
        refresh_after: REFRESH_AFTER,
    }
}

impl SqsStore {
    pub(super) async fn job_records_of(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        let name = checked_name(dead_letter_queue)?;
        let Some(url) = self.jobs_url(&name, false).await? else {
            return Ok(Vec::new());
        };
        let messages = self.hold_all(&url, &name).await?;
        self.give_back(&url, &messages).await;
        let held: Vec<Held> = messages.iter().map(held_of).collect();
        Ok(jobs::newest_records(&held))
    }

    pub(super) async fn put_job_record_of(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        jobs::check_key(key)?;
        if record.is_empty() {
            return Err(SourceError::invalid(
                "a dlq job record is never empty (SQS takes no empty message body)",
            ));
        }
        jobs::check_size(&record)?;
        let name = checked_name(dead_letter_queue)?;
        let url = self.jobs_url(&name, true).await?.ok_or_else(|| {
            SourceError::broker(format!("SQS made the queue {name} but gave no URL for it"))
        })?;
        let messages = self.hold_all(&url, &name).await?;
        let held: Vec<Held> = messages.iter().map(held_of).collect();
        let now = SystemTime::now();
        let version = jobs::next_version(&held, key, now);
        if let Err(e) = self.send_record(&url, &name, key, version, &record).await {
            self.give_back(&url, &messages).await;
            return Err(e);
        }
        // The new version is there: an older one left by a failed delete is
        // outranked, and taken by the next write.
        let fates = writing(key).fates(&held, now);
        if let Err(e) = self
            .settle_held(&url, &name, &messages, &held, &fates)
            .await
        {
            tracing::debug!(error = %e, queue = %name, "an older dlq job record stays until the next write");
        }
        Ok(())
    }

    pub(super) async fn remove_job_record_of(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        jobs::check_key(key)?;
        let name = checked_name(dead_letter_queue)?;
        let Some(url) = self.jobs_url(&name, false).await? else {
            return Ok(());
        };
        let messages = self.hold_all(&url, &name).await?;
        let held: Vec<Held> = messages.iter().map(held_of).collect();
        let now = SystemTime::now();
        let fates = writing(key).fates(&held, now);
        self.settle_held(&url, &name, &messages, &held, &fates)
            .await
    }

    /// The jobs queue's URL; with `create`, the queue is made when missing.
    async fn jobs_url(&self, name: &str, create: bool) -> Result<Option<String>, SourceError> {
        if let Some(url) = self.dead_letter_url(name, false).await? {
            return Ok(Some(url));
        }
        if !create {
            return Ok(None);
        }
        let created = self
            .client
            .create_queue()
            .queue_name(name)
            .attributes(
                QueueAttributeName::MessageRetentionPeriod,
                RETENTION.as_secs().to_string(),
            )
            .send()
            .await;
        let url = match created {
            Ok(out) => out.queue_url().map(str::to_string),
            // Made by someone else meanwhile, or with other attributes by
            // hand: the queue is there all the same.
            Err(e)
                if e.as_service_error()
                    .is_some_and(|s| s.is_queue_name_exists())
                    || error_code(&e).is_some_and(|c| c.contains("QueueAlreadyExists")) =>
            {
                self.dead_letter_url(name, false).await?
            }
            Err(e) => return Err(sdk_error(&format!("creating queue {name:?}"), e)),
        };
        if let Some(url) = &url {
            lock(&self.dead_letter_urls).insert(name.to_string(), url.clone());
        }
        Ok(url)
    }

    /// Every message of the jobs queue, received and invisible until given
    /// back or deleted.
    async fn hold_all(&self, url: &str, name: &str) -> Result<Vec<Message>, SourceError> {
        let listing = Listing {
            limit: MOST_MESSAGES + 1,
            looking_for: None,
            // A jobs queue holds a few messages, where SQS's quick answer
            // from a sample of its servers misses some most often; and a
            // running job reads it four times a second, so a long poll's
            // second at the end is too long to hold the records for.
            count_visible: true,
            what: "dlq job records",
        };
        let messages = self.receive_all(url, listing).await?;
        if messages.len() > MOST_MESSAGES {
            self.give_back(url, &messages).await;
            return Err(SourceError::invalid(format!(
                "the SQS queue {name} holds more than {MOST_MESSAGES} messages, and courier keeps one there per dlq job; remove the records of jobs that are done, or purge the queue"
            )));
        }
        Ok(messages)
    }

    async fn send_record(
        &self,
        url: &str,
        name: &str,
        key: &str,
        version: u128,
        record: &[u8],
    ) -> Result<(), SourceError> {
        let text = std::str::from_utf8(record)
            .ok()
            .filter(|t| !t.is_empty() && is_sqs_text(t));
        let mut request = self
            .client
            .send_message()
            .queue_url(url)
            .message_attributes(jobs::KEY, string(key.to_string())?)
            .message_attributes(jobs::VERSION, string(version.to_string())?);
        request = match text {
            Some(text) => request.message_body(text),
            None => request
                .message_body(BASE64.encode(record))
                .message_attributes(ENCODING, string("base64".into())?),
        };
        request
            .send()
            .await
            .map(drop)
            .map_err(|e| sdk_error(&format!("storing a dlq job record in {name}"), e))
    }

    /// Gives back, deletes and refreshes what a write holds, each by its
    /// fate, the give-backs first so that others wait the least. The last
    /// failed delete, if any, is the error; a failed refresh is only
    /// logged: the record stays as it was.
    async fn settle_held(
        &self,
        url: &str,
        name: &str,
        messages: &[Message],
        held: &[Held],
        fates: &[Fate],
    ) -> Result<(), SourceError> {
        let of = |fate: Fate| {
            messages
                .iter()
                .zip(held)
                .zip(fates)
                .filter(move |(_, f)| **f == fate)
                .map(|(m, _)| m)
        };
        let back: Vec<Message> = of(Fate::GiveBack).map(|(m, _)| m.clone()).collect();
        self.give_back(url, &back).await;
        let mut failed = None;
        for (message, _) in of(Fate::Remove) {
            if let Err(e) = self.delete(url, name, message).await {
                failed = Some(e);
            }
        }
        for (message, h) in of(Fate::Refresh) {
            let key = h.key.as_deref().unwrap_or_default();
            let refreshed = match self.send_record(url, name, key, h.version, &h.record).await {
                Ok(()) => self.delete(url, name, message).await,
                Err(e) => {
                    self.give_back(url, std::slice::from_ref(message)).await;
                    Err(e)
                }
            };
            if let Err(e) = refreshed {
                tracing::warn!(error = %e, queue = %name, job = key, "a dlq job record near SQS's retention was not sent afresh; the next write tries again");
            }
        }
        failed.map_or(Ok(()), Err)
    }

    async fn delete(&self, url: &str, name: &str, message: &Message) -> Result<(), SourceError> {
        self.client
            .delete_message()
            .queue_url(url)
            .receipt_handle(message.receipt_handle().unwrap_or_default())
            .send()
            .await
            .map(drop)
            .map_err(|e| sdk_error(&format!("deleting a dlq job record in {name}"), e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_queue_names() {
        assert_eq!(jobs_queue_name("orders.dlq"), "orders-dlq-courier-jobs");
        assert_eq!(
            jobs_queue_name("orders.fifo.dlq"),
            "orders-dlq-fifo-courier-jobs"
        );
        assert_eq!(jobs_queue_name("failed"), "failed-courier-jobs");
        assert_ne!(
            jobs_queue_name("orders-dlq.fifo"),
            jobs_queue_name("orders-dlq")
        );
        let long = "q".repeat(80);
        let name = jobs_queue_name(&long);
        assert_eq!(name.len(), 80, "{name}");
        assert!(name.starts_with("qqq") && name.ends_with(SUFFIX), "{name}");
        // Pinned: queues with such names exist already.
        assert_eq!(
            name,
            format!("{}-9ab3204404945995-courier-jobs", "q".repeat(50))
        );
        assert_ne!(name, jobs_queue_name(&format!("{}x", "q".repeat(79))));
        assert_eq!(name, jobs_queue_name(&long), "the same name every time");
        assert_eq!(jobs_queue_name(&"q".repeat(67)).len(), 80);
        assert!(checked_name("a b").is_err());
    }

    #[test]
    fn a_record_reads_back_from_its_message() {
        let message = |body: &str| {
            let attribute = |value: &str| string(value.to_string()).unwrap();
            Message::builder()
                .message_id("m1")
                .body(body)
                .message_attributes(jobs::KEY, attribute("job-a"))
                .message_attributes(jobs::VERSION, attribute("42"))
                .message_attributes(ENCODING, attribute("base64"))
                .build()
        };
        let held = held_of(&message(&BASE64.encode(b"\x00{}")));
        assert_eq!(
            (held.id.as_str(), held.key.as_deref()),
            ("m1", Some("job-a"))
        );
        assert_eq!(held.version, 42);
        assert_eq!(held.record, Bytes::from_static(b"\x00{}"));
        assert_eq!(held_of(&message("not base64!")).key, None);
    }
}
