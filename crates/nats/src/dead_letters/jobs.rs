//! The records of `courier dlq` jobs: keys of the key-value bucket
//! [`JOBS_BUCKET`], one per job, `<dead-letter stream>.<job key>`. The
//! bucket is laid out as `nats kv add` makes one, so `nats kv ls`, `get`
//! and `del` work on it; the first put makes it, and listing or removing
//! without it finds nothing.
//!
//! A job rewrites its record every second and lists its queue's records
//! every quarter of a second, so the bucket keeps one revision per key, a
//! removal leaves no marker behind (a purge of the key's subject, where
//! `nats kv del` would leave a delete marker per finished job for ever),
//! and records are read from the stream leader: a record put is listed at
//! once by any process, where a direct get could be answered by a replica
//! that has not stored it yet.

use async_nats::HeaderMap;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use async_nats::jetstream::stream::{
    Config as StreamConfig, DiscardPolicy, PurgeErrorKind, StorageType,
};
use futures::{StreamExt, TryStreamExt};

use super::*;
use crate::fields::stream_key;
use courier_core::source::{JOB_RECORD_MAX, is_job_key};

/// The key-value bucket of every queue's job records.
const JOBS_BUCKET: &str = "courier-jobs";
/// The stream that is [`JOBS_BUCKET`].
const JOBS_STREAM: &str = "KV_courier-jobs";
/// The most records one dead-letter queue's listing reads: the command
/// keeps a few dozen (the running jobs, their cancels and the last
/// finished ones), and a listing costs a request per record.
const RECORDS_PER_QUEUE: usize = 1024;
/// The bucket's size: far more than the jobs of every queue need (4,096
/// records of the largest size), and a put is refused beyond it rather
/// than records piling up on the servers' disks unnoticed.
const BUCKET_BYTES: i64 = 64 << 20;
/// The largest message the bucket stores: a record of the largest size
/// and the publish's header.
const MESSAGE_BYTES: i32 = JOB_RECORD_MAX as i32 + 1024;

impl NatsStore {
    pub(super) async fn read_job_records(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        let prefix = key_prefix(dead_letter_queue, &self.queue)?;
        let stream = self
            .js
            .get_stream_no_info(JOBS_STREAM)
            .await
            .map_err(unavailable)?;
        let subjects = match stream.info_with_subjects(format!("{prefix}*")).await {
            Ok(subjects) => subjects,
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => return Ok(Vec::new()),
            Err(e) => return Err(unavailable(e)),
        };
        let subjects: Vec<String> = subjects
            .take(RECORDS_PER_QUEUE + 1)
            .map_ok(|(subject, _)| subject)
            .try_collect()
            .await
            .map_err(unavailable)?;
        if subjects.len() > RECORDS_PER_QUEUE {
            return Err(SourceError::broker(format!(
                "more than {RECORDS_PER_QUEUE} dlq job records beside {dead_letter_queue} in the key-value bucket {JOBS_BUCKET:?}, more than courier keeps; remove the ones no job needs (nats kv ls {JOBS_BUCKET}, nats kv del {JOBS_BUCKET} KEY)"
            )));
        }
        let mut records = Vec::with_capacity(subjects.len());
        for subject in subjects {
            // A key another tool put under the prefix: no job of courier's.
            let Some(key) = subject.strip_prefix(&prefix).filter(|k| is_job_key(k)) else {
                continue;
            };
            let message = match stream.get_last_raw_message_by_subject(&subject).await {
                Ok(message) => message,
                // Removed since it was listed.
                Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => continue,
                Err(e) => return Err(unavailable(e)),
            };
            if is_removal(&message.headers) {
                continue;
            }
            records.push((key.to_string(), message.payload));
        }
        Ok(records)
    }

    pub(super) async fn write_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        check_key(key)?;
        if record.len() > JOB_RECORD_MAX {
            return Err(SourceError::invalid(format!(
                "the record of dlq job {key} is {} bytes, over the {JOB_RECORD_MAX} bytes a job record may take",
                record.len()
            )));
        }
        let subject = format!("{}{key}", key_prefix(dead_letter_queue, &self.queue)?);
        // Tried first: the bucket is there but for the very first put.
        match publish(&self.js, &subject, record.clone()).await {
            Err(e) if e.kind() == PublishErrorKind::StreamNotFound => {}
            stored => return stored.map_err(|e| refused_put(key, e)),
        }
        let replicas = self.jobs_replicas(dead_letter_queue).await?;
        // Another process may make it meanwhile; the put tells.
        let created = self.js.create_stream(bucket(replicas)).await.err();
        match (publish(&self.js, &subject, record).await, created) {
            (Ok(()), _) => Ok(()),
            (Err(e), None) => Err(refused_put(key, e)),
            (Err(_), Some(created)) => Err(refused_bucket(&created)),
        }
    }

    pub(super) async fn delete_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        // Checked before it goes into a purge's subject filter, where a
        // wildcard would take other jobs' records with it.
        check_key(key)?;
        let subject = format!("{}{key}", key_prefix(dead_letter_queue, &self.queue)?);
        let stream = self
            .js
            .get_stream_no_info(JOBS_STREAM)
            .await
            .map_err(unavailable)?;
        match stream.purge().filter(subject).await {
            Ok(_) => Ok(()),
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => Ok(()),
            // Refused by the server: a permission, or a bucket made
            // without purges.
            Err(e) if matches!(e.kind(), PurgeErrorKind::JetStream(_)) => Err(refused_bucket(&e)),
            Err(e) => Err(unavailable(e)),
        }
    }

    /// The replicas the bucket is made with: the work stream's, as the
    /// dead-letter streams and the seal bucket have, so that it survives
    /// what they survive. Without a work stream (a purge of what a deleted
    /// queue left) the dead-letter stream's, and with neither, 1.
    async fn jobs_replicas(&self, dead_letter_queue: &str) -> Result<usize, SourceError> {
        if let Some(work) = self.work.get() {
            return Ok(work.replicas);
        }
        for name in [self.queue.clone(), dead_letter_stream(dead_letter_queue)] {
            match self.js.get_stream(&name).await {
                Ok(stream) => return Ok(stream.cached_info().config.num_replicas.max(1)),
                Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => {}
                Err(e) => return Err(unavailable(e)),
            }
        }
        Ok(1)
    }
}

/// `$KV.courier-jobs.<dead-letter stream>.`: the dead-letter stream as
/// the seal bucket names it (`hex.<its name in hex>` when it is no valid
/// key), so one queue's records are a single-token wildcard (`*`) away and
/// never another queue's (a job key holds no `.`).
fn key_prefix(dead_letter_queue: &str, queue: &str) -> Result<String, SourceError> {
    check_dead_letter_subject(dead_letter_queue, queue, &[]).map_err(SourceError::invalid)?;
    Ok(format!(
        "$KV.{JOBS_BUCKET}.{}.",
        stream_key(&dead_letter_stream(dead_letter_queue))
    ))
}

fn check_key(key: &str) -> Result<(), SourceError> {
    if is_job_key(key) {
        return Ok(());
    }
    Err(SourceError::invalid(format!(
        "{key:?} is not a dlq job key: 1 to 64 of a-z, 0-9 and -"
    )))
}

/// Stored only by the bucket's stream, so that a stream of someone else's
/// capturing the subject cannot take a record.
async fn publish(js: &Context, subject: &str, record: Bytes) -> Result<(), PublishError> {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Expected-Stream", JOBS_STREAM);
    js.publish_with_headers(subject.to_string(), headers, record)
        .await?
        .await
        .map(drop)
}

/// A key's last message is a `nats kv del` or `purge` marker.
fn is_removal(headers: &HeaderMap) -> bool {
    headers
        .get("KV-Operation")
        .is_some_and(|op| matches!(op.as_str(), "DEL" | "PURGE"))
}

/// The bucket as `nats kv add courier-jobs --history 1` makes it, bounded,
/// made directly: async-nats' `create_key_value` first asks for the
/// account's info, and fails to parse a 2.9 server's answer.
fn bucket(replicas: usize) -> StreamConfig {
    StreamConfig {
        name: JOBS_STREAM.into(),
        description: Some(
            "courier: the records of `courier dlq` replay and purge jobs, per dead-letter stream"
                .into(),
        ),
        subjects: vec![format!("$KV.{JOBS_BUCKET}.>")],
        max_messages_per_subject: 1,
        max_bytes: BUCKET_BYTES,
        max_message_size: MESSAGE_BYTES,
        storage: StorageType::File,
        num_replicas: replicas,
        allow_rollup: true,
        deny_delete: true,
        allow_direct: true,
        discard: DiscardPolicy::New,
        ..Default::default()
    }
}

fn refused_bucket(e: &dyn std::fmt::Display) -> SourceError {
    SourceError::broker(format!(
        "cannot use the key-value bucket {JOBS_BUCKET:?} that holds the records of `courier dlq` jobs ({e}); let courier's NATS user create it and write to it, or create it (nats kv add {JOBS_BUCKET} --history 1)"
    ))
}

fn refused_put(key: &str, e: PublishError) -> SourceError {
    let code = std::error::Error::source(&e)
        .and_then(|cause| cause.downcast_ref::<async_nats::jetstream::Error>())
        .map(|cause| cause.error_code());
    let text = format!(
        "the key-value bucket {JOBS_BUCKET:?} did not store the record of dlq job {key} ({e})"
    );
    match (e.kind(), code) {
        (PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe, _) => unavailable(text),
        // What a full stream answers (maximum bytes exceeded).
        (_, Some(ErrorCode::STREAM_STORE_FAILED)) => SourceError::broker(format!(
            "{text}; it holds at most {} MiB: remove the records no job needs (nats kv ls {JOBS_BUCKET}, nats kv del {JOBS_BUCKET} KEY)",
            BUCKET_BYTES >> 20
        )),
        _ => SourceError::broker(text),
    }
    .caused_by(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_keys_of_a_queue_share_one_token() {
        assert_eq!(
            key_prefix("orders.dlq", "orders").unwrap(),
            "$KV.courier-jobs.orders_dlq."
        );
        assert_eq!(
            key_prefix("zamówienia.dlq", "zamówienia").unwrap(),
            "$KV.courier-jobs.hex.7a616dc3b37769656e69615f646c71."
        );
        assert!(key_prefix("", "orders").is_err());
        assert!(key_prefix("orders.*", "orders").is_err());
    }

    #[test]
    fn only_job_keys_go_into_a_subject() {
        assert!(check_key("job-1").is_ok());
        for bad in ["", "a.b", "*", ">", "Job", &"x".repeat(65)] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
    }
}
