//! Dead-letter streams: their names, and the dead-letter store that
//! browses, replays and purges the letters in them and sends to the work
//! stream. Opened alone (`courier dlq`, `courier send`), the store connects
//! and creates nothing: no stream, no durable consumer, no seal key. It
//! reads the work stream's subjects when a send or replay first needs
//! them, and the seal key (made when missing) on the first replay. The
//! records of `courier dlq` jobs are in [`jobs`], whose bucket the first
//! put makes.

use std::sync::Arc;
use std::sync::atomic::AtomicI64;

use async_nats::Client;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::Context;
use async_nats::jetstream::message::StreamMessage;
use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::OnceCell;

use super::connection::{
    WorkStream, check_stream_name, connect_client, held_counter, js_code, unavailable,
};
use super::fields::{F_SUBJECT, from_headers, seal_of};
use super::settle::publish_once;
use courier_core::model::{DeadLetter, F_QUEUE, PAYLOAD};
use courier_core::source::shared::{Seal, not_there};
use courier_core::source::{DeadLetterStore, Depth, SourceError, SourceOptions};

mod jobs;

/// The stream that holds a dead-letter subject: stream names cannot hold
/// `.`, `*`, `>`, `/`, `\` or whitespace, so each becomes `_`.
pub fn dead_letter_stream(subject: &str) -> String {
    subject
        .chars()
        .map(|c| match c {
            '.' | '*' | '>' | '/' | '\\' => '_',
            c if c.is_whitespace() => '_',
            c => c,
        })
        .collect()
}

/// Refuses a dead-letter subject courier could not publish to, or one the
/// work stream captures (its dead letters would come back as work).
pub(super) fn check_dead_letter_subject(
    subject: &str,
    stream: &str,
    work_subjects: &[String],
) -> Result<(), String> {
    let tokens: Vec<&str> = subject.split('.').collect();
    if subject.chars().any(char::is_whitespace)
        || tokens
            .iter()
            .any(|t| t.is_empty() || *t == "*" || *t == ">")
    {
        return Err(format!(
            "the dead-letter queue {subject:?} is not a NATS subject courier can publish to: write dot-separated tokens without spaces or wildcards, like orders.dlq"
        ));
    }
    if let Some(filter) = work_subjects.iter().find(|f| captures(f, &tokens)) {
        return Err(format!(
            "the dead-letter subject {subject:?} is captured by the work stream {stream:?} (subject {filter:?}), so dead letters would be delivered again as work; name another deadLetterQueue in the policy"
        ));
    }
    Ok(())
}

/// Whether a stream subject (`*` one token, `>` the rest) captures a
/// subject of literal tokens.
fn captures(filter: &str, subject: &[&str]) -> bool {
    let mut at = 0;
    for token in filter.split('.') {
        match token {
            ">" => return at < subject.len(),
            "*" if at < subject.len() => {}
            t if subject.get(at) == Some(&t) => {}
            _ => return false,
        }
        at += 1;
    }
    at == subject.len()
}

/// The dead letters of one work stream, and sends to it.
pub(super) struct NatsStore {
    pub(super) client: Client,
    pub(super) js: Context,
    pub(super) queue: String,
    /// The sidecar's durable consumer, whose counts depth reads.
    pub(super) group: String,
    pub(super) redacted: String,
    /// What the sources of this process hold of `group`
    /// ([`super::connection::held_counter`]): depth's `pending`.
    pub(super) held: Arc<AtomicI64>,
    /// The work stream's subjects, read on first use.
    work: OnceCell<WorkStream>,
    /// The stream's seal: the consumer's, or read (and made if missing)
    /// when an admin handle first replays.
    seal: OnceCell<Arc<Seal>>,
}

impl NatsStore {
    pub(super) fn new(
        client: Client,
        options: &SourceOptions,
        redacted: &str,
        held: Arc<AtomicI64>,
        work: Option<WorkStream>,
        seal: Option<Arc<Seal>>,
    ) -> Self {
        Self {
            js: async_nats::jetstream::new(client.clone()),
            client,
            queue: options.queue.clone(),
            group: options.group.clone(),
            redacted: redacted.to_string(),
            held,
            work: OnceCell::new_with(work),
            seal: OnceCell::new_with(seal),
        }
    }

    /// An admin handle: a connection, nothing created.
    pub(super) async fn open(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        check_stream_name(&options.queue)?;
        let client = connect_client(url, &options).await?;
        Ok(Self::new(
            client,
            &options,
            &courier_core::source::redact(url),
            held_counter(url, &options),
            None,
            options.seal.clone(),
        ))
    }

    async fn work(&self) -> Result<&WorkStream, SourceError> {
        self.work
            .get_or_try_init(|| WorkStream::read(&self.js, &self.queue, &self.redacted))
            .await
    }

    async fn stored(&self, stream: &str, id: &str) -> Result<Option<StreamMessage>, SourceError> {
        let Ok(sequence) = id.parse::<u64>() else {
            return Err(SourceError::invalid(format!(
                "{id:?} is not a dead-letter id of NATS (a stream sequence number)"
            )));
        };
        let stream = match self.js.get_stream(stream).await {
            Ok(s) => s,
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => return Ok(None),
            Err(e) => return Err(unavailable(e)),
        };
        match stream.get_raw_message(sequence).await {
            Ok(m) => Ok(Some(m)),
            Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => Ok(None),
            Err(e) => Err(unavailable(e)),
        }
    }
}

impl NatsStore {
    /// The dead letters with sequences from `from` through `through`, at
    /// most `limit`, oldest first.
    async fn page(
        &self,
        dead_letter_queue: &str,
        from: u64,
        through: u64,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let name = dead_letter_stream(dead_letter_queue);
        let stream = match self.js.get_stream(&name).await {
            Ok(s) => s,
            Err(e) if js_code(&e) == Some(ErrorCode::STREAM_NOT_FOUND) => return Ok(Vec::new()),
            Err(e) => return Err(unavailable(e)),
        };
        let state = stream.cached_info().state.clone();
        let last = state.last_sequence.min(through);
        let mut out = Vec::new();
        let mut next = state.first_sequence.max(from);
        while out.len() < limit && state.messages > 0 && next <= last {
            let got = stream
                .raw_message_builder()
                .sequence(next)
                .next_by_subject(dead_letter_queue.to_string())
                .send()
                .await;
            let message = match got {
                Ok(m) => m,
                Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => break,
                Err(e) => return Err(unavailable(e)),
            };
            // The next one by subject may lie past the page's end.
            if message.sequence > last {
                break;
            }
            next = message.sequence + 1;
            out.push(DeadLetter::from_fields(
                message.sequence.to_string(),
                from_headers(&message.payload, Some(&message.headers)),
            ));
        }
        Ok(out)
    }
}

#[async_trait]
impl DeadLetterStore for NatsStore {
    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        self.page(dead_letter_queue, 0, u64::MAX, limit).await
    }

    async fn dead_letter_by_id(
        &self,
        dead_letter_queue: &str,
        id: &str,
    ) -> Result<Option<Option<DeadLetter>>, SourceError> {
        let Ok(sequence) = id.parse::<u64>() else {
            return Ok(Some(None));
        };
        let page = self.page(dead_letter_queue, sequence, sequence, 1).await?;
        Ok(Some(page.into_iter().next()))
    }

    /// Stream sequences are ordered: a page starts at the sequence after
    /// `after`.
    async fn dead_letters_after(
        &self,
        dead_letter_queue: &str,
        after: Option<&str>,
        through: Option<&str>,
        limit: usize,
    ) -> Result<Option<Vec<DeadLetter>>, SourceError> {
        let sequence = |id: Option<&str>, none: u64| {
            id.map_or(Ok(none), |id| {
                id.parse::<u64>()
                    .map_err(|_| not_there(dead_letter_queue, id))
            })
        };
        let from = sequence(after, 0)?.saturating_add(u64::from(after.is_some()));
        let through = sequence(through, u64::MAX)?;
        self.page(dead_letter_queue, from, through, limit)
            .await
            .map(Some)
    }

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let name = dead_letter_stream(dead_letter_queue);
        let stored = self
            .stored(&name, &letter.id)
            .await?
            .ok_or_else(|| not_there(dead_letter_queue, &letter.id))?;
        let stored = DeadLetter::from_fields(
            stored.sequence.to_string(),
            from_headers(&stored.payload, Some(&stored.headers)),
        );
        let work = self.work().await?;
        // The recorded subject belongs to the stream the letter came from;
        // replayed into another stream (`dlq replay --to`), it goes to that
        // stream's own subject.
        let subject = stored
            .field(F_SUBJECT)
            .filter(|_| stored.field(F_QUEUE).is_none_or(|queue| queue == self.queue))
            .map(str::to_string)
            .or_else(|| work.send_subject.clone())
            .ok_or_else(|| {
                SourceError::invalid(format!(
                    "dead letter {} does not record its subject and stream {:?} has no subject without wildcards to publish to",
                    letter.id, self.queue
                ))
            })?;
        let seal = self
            .seal
            .get_or_try_init(|| async {
                seal_of(&self.js, &self.queue, work.replicas)
                    .await
                    .map(Arc::new)
            })
            .await?;
        // Two replays of one letter at once (two operators, a retried
        // command) both read it before either deletes it; the id makes
        // JetStream store the second publish not at all.
        let replay_id = format!("courier-replay:{name}:{}", letter.id);
        publish_once(
            &self.js,
            &subject,
            &self.queue,
            &seal.seal(
                letter
                    .fields_for_replay_of(&stored)
                    .map_err(SourceError::invalid)?,
            ),
            Some(&replay_id),
        )
        .await?;
        let stream = self
            .js
            .get_stream_no_info(&name)
            .await
            .map_err(unavailable)?;
        match stream
            .delete_message(letter.id.parse().unwrap_or_default())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => {
                Err(not_there(dead_letter_queue, &letter.id))
            }
            Err(e) => Err(unavailable(e)),
        }
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        let name = dead_letter_stream(dead_letter_queue);
        if self.stored(&name, &letter.id).await?.is_none() {
            return Err(not_there(dead_letter_queue, &letter.id));
        }
        let stream = self
            .js
            .get_stream_no_info(&name)
            .await
            .map_err(unavailable)?;
        match stream
            .delete_message(letter.id.parse().unwrap_or_default())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if js_code(&e) == Some(ErrorCode::NO_MESSAGE_FOUND) => {
                Err(not_there(dead_letter_queue, &letter.id))
            }
            Err(e) => Err(unavailable(e)),
        }
    }

    /// The sidecar's reading ([`NatsStore::depth`]): stream and consumer
    /// info and messages read by sequence, nothing created or consumed.
    async fn depth_of(&self, dead_letter_queue: &str) -> Result<Option<Depth>, SourceError> {
        self.depth(dead_letter_queue).await.map(Some)
    }

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        let subject = self.work().await?.send_subject.clone().ok_or_else(|| {
            SourceError::invalid(format!(
                "stream {:?} has only wildcard subjects; publish with a NATS client to a subject it captures",
                self.queue
            ))
        })?;
        let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), body)];
        fields.extend(
            headers
                .iter()
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        let sequence = publish_once(&self.js, &subject, &self.queue, &fields, None).await?;
        Ok(sequence.to_string())
    }

    async fn flush(&self) {
        let _ = self.client.flush().await;
    }

    async fn job_records(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        self.read_job_records(dead_letter_queue).await
    }

    /// Stored once the bucket acknowledged it.
    async fn put_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        self.write_job_record(dead_letter_queue, key, record).await
    }

    async fn remove_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        self.delete_job_record(dead_letter_queue, key).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dead_letter_subject_must_be_publishable_and_not_work() {
        let work = vec!["orders".to_string(), "shop.*.created".to_string()];
        assert!(check_dead_letter_subject("orders.dlq", "orders", &work).is_ok());
        assert!(check_dead_letter_subject("shop.eu.created.dlq", "orders", &work).is_ok());
        let err = check_dead_letter_subject("shop.eu.created", "orders", &work).unwrap_err();
        assert!(err.contains("captured by the work stream"), "{err}");
        let wide = vec!["orders.>".to_string()];
        assert!(check_dead_letter_subject("orders.dlq", "orders", &wide).is_err());
        assert!(check_dead_letter_subject("orders", "orders", &wide).is_ok());
        for bad in ["", "orders.*", "a..b", "failed orders", "orders.>"] {
            let err = check_dead_letter_subject(bad, "orders", &work).unwrap_err();
            assert!(err.contains("not a NATS subject"), "{bad}: {err}");
        }
    }

    #[test]
    fn dead_letter_streams_have_no_dots() {
        assert_eq!(dead_letter_stream("orders.dlq"), "orders_dlq");
        assert_eq!(dead_letter_stream("a.*.b>"), "a___b_");
        assert_eq!(dead_letter_stream("failed orders"), "failed_orders");
    }
}
