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
//! another key); a listing receives them all and gives them all back. The new version goes out before the old is
//! deleted, so a write cut short leaves two versions, never none; versions
//! only grow, so the newer wins wherever two are found. A listing that
//! meets messages another command holds waits for them a while (as a
//! dead-letter listing does) and then leaves them out, with a warning.
//!
//! The queue is made by the first write only (a listing or a removal where
//! there is none finds nothing and makes nothing), with SQS's longest
//! retention, 14 days: SQS deletes older messages whatever they are, so a
//! write also sends afresh the other records older than a week.
//!
//! [`DeadLetterStore::job_records`]: courier_core::source::DeadLetterStore::job_records

use std::collections::HashMap;
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
use courier_core::source::{JOB_RECORD_MAX, SourceError, is_job_key};

/// The message attribute with a record's job key.
const KEY: &str = "courier-job-key";
/// The message attribute with a record's version: nanoseconds since the
/// epoch at its write, and always above the versions of the key that write
/// found, so that a clock behind another process's still makes it newer.
const VERSION: &str = "courier-job-version";

/// What a jobs queue's name adds to its dead-letter queue's.
const SUFFIX: &str = "-courier-jobs";
/// SQS's longest queue name.
const MAX_NAME: usize = 80;

/// The most messages a jobs queue is read to. Each is a record of at most
/// [`JOB_RECORD_MAX`] bytes (a third more in base64), so a read holds some
/// 22 MB at most; more than this is not one message per job any more, and
/// the command says so instead of reading on.
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
    if base.len() + SUFFIX.len() <= MAX_NAME {
        return format!("{base}{SUFFIX}");
    }
    let hash = format!("-{:016x}", fnv1a(&base));
    let keep = floor_char_boundary(&base, MAX_NAME - SUFFIX.len() - hash.len());
    format!("{}{hash}{SUFFIX}", &base[..keep])
}

/// FNV-1a: a hash that stays the same across builds and Rust releases,
/// since queue names made from it must.
fn fnv1a(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, b| {
        (hash ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

fn floor_char_boundary(text: &str, at: usize) -> usize {
    (0..=at.min(text.len()))
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0)
}

/// The jobs queue's name, once the dead-letter queue is one SQS can name.
fn checked_name(dead_letter_queue: &str) -> Result<String, SourceError> {
    // No work queue to compare with here: "" is never a queue's name.
    check_dead_letter_queue(dead_letter_queue, "").map_err(SourceError::invalid)?;
    Ok(jobs_queue_name(dead_letter_queue))
}

/// A message of a jobs queue, as read.
#[derive(Debug, Clone, PartialEq)]
struct Held {
    /// `None`: not a record courier wrote (no key, or a body that does
    /// not decode); left where it is.
    key: Option<String>,
    version: u128,
    record: Bytes,
    sent: SystemTime,
}

impl Held {
    fn of(message: &Message) -> Self {
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
        let key = text(KEY).filter(|k| is_job_key(k)).map(str::to_string);
        Self {
            key: key.filter(|_| record.is_some()),
            version: text(VERSION).and_then(|v| v.parse().ok()).unwrap_or(0),
            record: record.unwrap_or_default(),
            sent: UNIX_EPOCH + Duration::from_millis(sent_millis(message)),
        }
    }
}

/// Where each key's newest record is in `held`: the highest version, the
/// first of equal ones (a refresh cut short leaves two alike).
fn newest(held: &[Held]) -> HashMap<&str, usize> {
    let mut newest: HashMap<&str, usize> = HashMap::new();
    for (i, h) in held.iter().enumerate() {
        let Some(key) = h.key.as_deref() else {
            continue;
        };
        match newest.get(key) {
            Some(&j) if held[j].version >= h.version => {}
            _ => {
                newest.insert(key, i);
            }
        }
    }
    newest
}

/// What a write does with a message it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    /// Visible again at once.
    GiveBack,
    /// A version of the key written or removed, or an older version of
    /// another key: no listing would return it.
    Delete,
    /// The newest of its key, near SQS's retention: sent afresh with the
    /// same key and version, then deleted.
    Refresh,
}

/// The fate of each held message, in order, in a write of `key`'s record
/// or its removal.
fn fates(held: &[Held], key: &str, now: SystemTime) -> Vec<Fate> {
    let newest = newest(held);
    held.iter()
        .enumerate()
        .map(|(i, h)| match h.key.as_deref() {
            None => Fate::GiveBack,
            Some(k) if k == key || newest.get(k) != Some(&i) => Fate::Delete,
            Some(_) if now.duration_since(h.sent).unwrap_or_default() >= REFRESH_AFTER => {
                Fate::Refresh
            }
            Some(_) => Fate::GiveBack,
        })
        .collect()
}

/// The version of a new record of `key`: now, or just above the newest
/// version of it held when the clock is behind that.
fn next_version(held: &[Held], key: &str, now: SystemTime) -> u128 {
    let now = now
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    held.iter()
        .filter(|h| h.key.as_deref() == Some(key))
        .map(|h| h.version + 1)
        .fold(now, u128::max)
}

fn check_key(key: &str) -> Result<(), SourceError> {
    if is_job_key(key) {
        Ok(())
    } else {
        Err(SourceError::invalid(format!(
            "{key:?} is not a dlq job key: 1 to 64 of a-z, 0-9 and -"
        )))
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
        let held: Vec<Held> = messages.iter().map(Held::of).collect();
        Ok(newest(&held)
            .into_iter()
            .map(|(key, i)| (key.to_string(), held[i].record.clone()))
            .collect())
    }

    pub(super) async fn put_job_record_of(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        check_key(key)?;
        if record.is_empty() {
            return Err(SourceError::invalid(
                "a dlq job record is never empty (SQS takes no empty message body)",
            ));
        }
        if record.len() > JOB_RECORD_MAX {
            return Err(SourceError::too_large(format!(
                "a dlq job record of {} bytes is over the {JOB_RECORD_MAX} bytes a record may have",
                record.len()
            )));
        }
        let name = checked_name(dead_letter_queue)?;
        let url = self.jobs_url(&name, true).await?.ok_or_else(|| {
            SourceError::broker(format!("SQS made the queue {name} but gave no URL for it"))
        })?;
        let messages = self.hold_all(&url, &name).await?;
        let held: Vec<Held> = messages.iter().map(Held::of).collect();
        let now = SystemTime::now();
        let version = next_version(&held, key, now);
        if let Err(e) = self.send_record(&url, &name, key, version, &record).await {
            self.give_back(&url, &messages).await;
            return Err(e);
        }
        // The new version is there: an older one left by a failed delete is
        // outranked, and taken by the next write.
        if let Err(e) = self
            .settle_held(&url, &name, &messages, &held, &fates(&held, key, now))
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
        check_key(key)?;
        let name = checked_name(dead_letter_queue)?;
        let Some(url) = self.jobs_url(&name, false).await? else {
            return Ok(());
        };
        let messages = self.hold_all(&url, &name).await?;
        let held: Vec<Held> = messages.iter().map(Held::of).collect();
        let now = SystemTime::now();
        self.settle_held(&url, &name, &messages, &held, &fates(&held, key, now))
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
            .message_attributes(KEY, string(key.to_string())?)
            .message_attributes(VERSION, string(version.to_string())?);
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
        for (message, _) in of(Fate::Delete) {
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

    fn held(key: Option<&str>, version: u128, age_days: u64, now: SystemTime) -> Held {
        Held {
            key: key.map(str::to_string),
            version,
            record: Bytes::from(format!("{key:?}@{version}")),
            sent: now - Duration::from_secs(age_days * 24 * 3600),
        }
    }

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
        assert_ne!(name, jobs_queue_name(&format!("{}x", "q".repeat(79))));
        assert_eq!(name, jobs_queue_name(&long), "the same name every time");
        assert_eq!(jobs_queue_name(&"q".repeat(67)).len(), 80);
        assert!(checked_name("a b").is_err());
    }

    #[test]
    fn fate_rows() {
        let now = SystemTime::now();
        let held = [
            held(Some("job-a"), 5, 0, now),
            held(Some("job-b"), 3, 0, now),
            held(Some("job-b"), 4, 0, now),
            held(None, 9, 30, now),
            held(Some("job-c"), 1, 8, now),
            held(Some("job-c"), 1, 8, now),
            held(Some("job-d"), 2, 6, now),
        ];
        use Fate::*;
        assert_eq!(
            fates(&held, "job-a", now),
            [
                Delete,   // the key written
                Delete,   // an older version
                GiveBack, // the newest of job-b
                GiveBack, // not a record of courier's
                Refresh,  // a week old
                Delete,   // the same version twice: one is kept
                GiveBack, // not a week old yet
            ]
        );
        assert_eq!(fates(&held, "job-x", now)[0], GiveBack);
        assert_eq!(fates(&held, "job-b", now)[1..3], [Delete, Delete]);
    }

    #[test]
    fn versions_only_grow() {
        let now = SystemTime::now();
        let nanos = now.duration_since(UNIX_EPOCH).unwrap().as_nanos();
        let ahead = nanos + 1_000_000_000;
        let held = [
            held(Some("job-a"), ahead, 0, now),
            held(Some("job-b"), ahead + 7, 0, now),
        ];
        assert_eq!(next_version(&held, "job-a", now), ahead + 1);
        assert_eq!(next_version(&held, "job-c", now), nanos);
        assert_eq!(next_version(&[], "job-a", now), nanos);
    }

    #[test]
    fn newest_of_each_key() {
        let now = SystemTime::now();
        let held = [
            held(Some("job-a"), 2, 0, now),
            held(Some("job-a"), 1, 0, now),
            held(None, 3, 0, now),
            held(Some("job-b"), 1, 0, now),
        ];
        let newest = newest(&held);
        assert_eq!(newest.len(), 2);
        assert_eq!(newest["job-a"], 0);
        assert_eq!(newest["job-b"], 3);
    }
}
