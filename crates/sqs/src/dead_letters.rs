//! Dead-letter queues and the dead-letter store: their names, browsing,
//! replaying and purging the letters in them, and sending to the work
//! queue. SQS has no way to read a message without receiving it: a listing
//! receives the queue's messages (invisible for [`BROWSE_VISIBILITY`],
//! doubled for all it holds while it runs, so each is seen once) and gives
//! them back; letters another listing holds are waited for a while, and
//! named when they are not listed.
//!
//! Opened alone (`courier dlq`, `courier send`), the store creates nothing:
//! it finds queues with `GetQueueUrl` only, never `CreateQueue`, and writes
//! no tag. Listing a dead-letter queue that does not exist lists nothing; a
//! send or replay needs the work queue and says how to make it when it is
//! missing; the seal key is read, or written, by the first replay.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use bytes::Bytes;
use tokio::sync::OnceCell;

use super::attributes::from_message;
use super::connection::{self, queue_attributes, queue_url, sdk_error, seal_of};
use super::lock;
use super::settle::{F_GROUP, send_fields, set_visibility};
use courier_core::model::{DeadLetter, PAYLOAD};
use courier_core::source::shared::{Seal, not_there};
use courier_core::source::{DeadLetterStore, Depth, SourceError, SourceOptions};

/// How long a listing first keeps the letters it has seen invisible, and
/// how long it waits for letters another listing holds.
const BROWSE_VISIBILITY: i32 = 10;

/// SQS's longest visibility timeout, 12 hours.
const MAX_VISIBILITY: i32 = 43_200;

/// The SQS queue of a dead-letter queue as courier names it: queue names
/// cannot hold dots, so the default `<queue>.dlq` is `<queue>-dlq`, and
/// that of a FIFO queue `<name>.fifo` is `<name>-dlq.fifo`. A name the
/// policy gives is used as it is.
pub fn dead_letter_queue_name(dead_letter_queue: &str) -> String {
    if let Some(base) = dead_letter_queue.strip_suffix(".fifo.dlq") {
        return format!("{base}-dlq.fifo");
    }
    if let Some(base) = dead_letter_queue.strip_suffix(".dlq") {
        return format!("{base}-dlq");
    }
    dead_letter_queue.to_string()
}

/// Refuses a dead-letter queue SQS cannot name, or the work queue itself.
pub(super) fn check_dead_letter_queue(dead_letter_queue: &str, work: &str) -> Result<(), String> {
    let name = dead_letter_queue_name(dead_letter_queue);
    let base = name.strip_suffix(".fifo").unwrap_or(&name);
    let ok = !base.is_empty()
        && name.len() <= 80
        && base
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if !ok {
        return Err(format!(
            "the dead-letter queue {dead_letter_queue:?} is not an SQS queue name: up to 80 letters, digits, - and _, with .fifo at the end for a FIFO queue"
        ));
    }
    if name == work {
        return Err(format!(
            "the dead-letter queue {dead_letter_queue:?} is the work queue; name another deadLetterQueue in the policy"
        ));
    }
    Ok(())
}

pub(super) fn sent_millis(message: &Message) -> u64 {
    message
        .attributes()
        .and_then(|a| a.get(&MessageSystemAttributeName::SentTimestamp))
        .and_then(|t| t.parse().ok())
        .unwrap_or(0)
}

/// The work queue as a send or replay needs it.
#[derive(Debug, Clone)]
pub(super) struct WorkQueue {
    pub url: String,
    pub fifo: bool,
}

impl WorkQueue {
    /// The queue `--queue` names (a name or a URL), looked up and never
    /// created: `None` when it does not exist.
    pub(super) async fn find(client: &Client, queue: &str) -> Result<Option<Self>, SourceError> {
        let name = connection::queue_name(queue);
        let url = if queue.starts_with("http://") || queue.starts_with("https://") {
            queue.to_string()
        } else {
            match queue_url(client, name, false).await? {
                Some(url) => url,
                None => return Ok(None),
            }
        };
        let attributes = queue_attributes(client, &url).await?;
        let fifo = attributes
            .get(&QueueAttributeName::FifoQueue)
            .is_some_and(|v| v == "true")
            || name.ends_with(".fifo");
        Ok(Some(Self { url, fifo }))
    }
}

/// What [`SqsStore::receive_all`] receives, and what it names in a log.
pub(super) struct Listing<'a> {
    /// At most this many messages.
    pub limit: usize,
    /// Stop once the message with this SQS id is received.
    pub looking_for: Option<&'a str>,
    /// Go on while SQS counts visible messages that no receive returned: a
    /// receive that answers at once asks a sample of SQS's servers, which
    /// may miss a few messages of a small queue, and a message another
    /// listing gave back since is visible again.
    pub count_visible: bool,
    /// What the messages are, for the operator: "dead letters".
    pub what: &'a str,
}

impl Listing<'_> {
    /// A listing of dead letters, as browsing has always made it.
    fn dead_letters(limit: usize, looking_for: Option<&str>) -> Listing<'_> {
        Listing {
            limit,
            looking_for,
            count_visible: false,
            what: "dead letters",
        }
    }
}

/// The dead letters of one work queue, and sends to it.
pub(super) struct SqsStore {
    pub(super) client: Client,
    /// `--queue`: a name or a queue URL.
    queue: String,
    region: String,
    /// Looked up on first use (by an admin handle), never created.
    work: OnceCell<WorkQueue>,
    /// Queue URLs by name (dead-letter and jobs queues), once found.
    pub(super) dead_letter_urls: Mutex<HashMap<String, String>>,
    /// The queue's seal: the consumer's, or read (and written if missing)
    /// when an admin handle first replays.
    seal: OnceCell<Arc<Seal>>,
}

impl SqsStore {
    /// A consumer's store, on its client, work queue and seal.
    pub(super) fn new(
        client: Client,
        options: &SourceOptions,
        region: &str,
        work: WorkQueue,
        seal: Arc<Seal>,
    ) -> Self {
        Self {
            client,
            queue: options.queue.clone(),
            region: region.to_string(),
            work: OnceCell::new_with(Some(work)),
            dead_letter_urls: Mutex::default(),
            seal: OnceCell::new_with(Some(seal)),
        }
    }

    /// An admin handle: a client, no call made yet.
    pub(super) async fn open(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let region = connection::region_of(url).map_err(SourceError::invalid)?;
        let client = connection::client(&region).await;
        Ok(Self::admin(client, &region, options))
    }

    /// An admin handle on `client`, which reaches `region`.
    pub(super) fn admin(client: Client, region: &str, options: SourceOptions) -> Self {
        Self {
            client,
            seal: OnceCell::new_with(options.seal.clone()),
            queue: options.queue,
            region: region.to_string(),
            work: OnceCell::new(),
            dead_letter_urls: Mutex::default(),
        }
    }

    /// The work queue, which a send and a replay write to and depth
    /// reads: it must exist.
    pub(super) async fn work(&self) -> Result<&WorkQueue, SourceError> {
        self.work
            .get_or_try_init(|| async {
                WorkQueue::find(&self.client, &self.queue)
                    .await?
                    .ok_or_else(|| {
                        connection::missing_queue(connection::queue_name(&self.queue), &self.region)
                    })
            })
            .await
    }

    /// The URL of the SQS queue `name`, created when missing and `create`
    /// (only the consumer's first dead letter asks for that).
    pub(super) async fn dead_letter_url(
        &self,
        name: &str,
        create: bool,
    ) -> Result<Option<String>, SourceError> {
        if let Some(url) = lock(&self.dead_letter_urls).get(name) {
            return Ok(Some(url.clone()));
        }
        let url = queue_url(&self.client, name, create).await?;
        if let Some(url) = &url {
            lock(&self.dead_letter_urls).insert(name.to_string(), url.clone());
        }
        Ok(url)
    }

    /// Up to `listing.limit` messages of the queue at `url`, each once,
    /// oldest first, with their receipts; they stay invisible until given
    /// back.
    /// A listing that runs long (a large queue, a slow endpoint) doubles
    /// the hold on all it has received before the first of them could show
    /// again; ending when a letter came back as seen listed only what one
    /// hold's time could receive (finding 9: 230 of 389 letters).
    pub(super) async fn receive_all(
        &self,
        url: &str,
        listing: Listing<'_>,
    ) -> Result<Vec<Message>, SourceError> {
        let Listing {
            limit,
            looking_for,
            count_visible,
            what,
        } = listing;
        let mut at: HashMap<String, usize> = HashMap::new();
        let mut out: Vec<Message> = Vec::new();
        let mut hold = BROWSE_VISIBILITY;
        // When the letters received first under the current hold show again.
        let mut held_until: Option<Instant> = None;
        let mut waiting_since: Option<Instant> = None;
        while out.len() < limit {
            if let Some(until) = held_until
                && Instant::now() + Duration::from_secs(hold as u64 / 3) >= until
            {
                hold = (hold * 2).min(MAX_VISIBILITY);
                let receipts = out.iter().map(|m| m.receipt_handle().unwrap_or_default());
                if let Err(e) = set_visibility(
                    &self.client,
                    url,
                    receipts,
                    hold,
                    &format!("keeping listed {what} invisible"),
                )
                .await
                {
                    // Those that show again are received again, with the
                    // newer receipt kept.
                    tracing::debug!(error = %e, "some listed {what} may show again");
                }
                held_until = Some(Instant::now() + Duration::from_secs(hold as u64));
            }
            let got = self
                .client
                .receive_message()
                .queue_url(url)
                .max_number_of_messages(10)
                .wait_time_seconds(0)
                .visibility_timeout(hold)
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .message_attribute_names("All")
                .send()
                .await
                .map_err(|e| sdk_error(&format!("receiving {what}"), e))?
                .messages
                .unwrap_or_default();
            if !got.is_empty() && held_until.is_none() {
                held_until = Some(Instant::now() + Duration::from_secs(hold as u64));
            }
            // Every message of a call is kept, the one looked for or not:
            // each is invisible now and must be given back.
            let mut new = 0;
            let mut found = false;
            for message in got {
                let id = message.message_id().unwrap_or_default().to_string();
                match at.get(&id) {
                    Some(&i) => out[i] = message,
                    None => {
                        new += 1;
                        found |= looking_for == Some(id.as_str());
                        at.insert(id, out.len());
                        out.push(message);
                    }
                }
            }
            if found {
                break;
            }
            if new > 0 {
                waiting_since = None;
                continue;
            }
            // Letters another listing or replay holds (one killed halfway)
            // are invisible for a while yet: wait for them a while, then
            // say that they are not in this list.
            let (visible, invisible) = self.counts(url).await?;
            let elsewhere = invisible.saturating_sub(out.len() as u64)
                + if count_visible { visible } else { 0 };
            if elsewhere == 0 {
                break;
            }
            let since = *waiting_since.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(BROWSE_VISIBILITY as u64 + 2) {
                tracing::warn!(
                    held_elsewhere = elsewhere,
                    "about {elsewhere} {what} are held by another listing or replay (or one that was stopped halfway) and are not in this list; run it again once they show again"
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        out.sort_by_key(sent_millis);
        Ok(out)
    }

    /// How many messages of the queue at `url` are visible, and how many
    /// invisible.
    async fn counts(&self, url: &str) -> Result<(u64, u64), SourceError> {
        let attributes = queue_attributes(&self.client, url).await?;
        let count = |name: QueueAttributeName| {
            attributes
                .get(&name)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Ok((
            count(QueueAttributeName::ApproximateNumberOfMessages),
            count(QueueAttributeName::ApproximateNumberOfMessagesNotVisible),
        ))
    }

    /// Makes received messages visible again.
    pub(super) async fn give_back(&self, url: &str, messages: &[Message]) {
        let receipts = messages
            .iter()
            .map(|m| m.receipt_handle().unwrap_or_default());
        if let Err(e) =
            set_visibility(&self.client, url, receipts, 0, "giving dead letters back").await
        {
            tracing::debug!(error = %e, "they are visible again after 30 s");
        }
    }

    fn letter(message: &Message) -> DeadLetter {
        DeadLetter::from_fields(
            message.message_id().unwrap_or_default().to_string(),
            from_message(message),
        )
    }

    /// The letter `id`, received (the others seen on the way given back).
    async fn find(
        &self,
        dead_letter_queue: &str,
        id: &str,
    ) -> Result<(String, Message), SourceError> {
        let name = dead_letter_queue_name(dead_letter_queue);
        let Some(url) = self.dead_letter_url(&name, false).await? else {
            return Err(not_there(dead_letter_queue, id));
        };
        let mut messages = self
            .receive_all(&url, Listing::dead_letters(usize::MAX, Some(id)))
            .await?;
        let at = messages.iter().position(|m| m.message_id() == Some(id));
        let found = at.map(|at| messages.swap_remove(at));
        self.give_back(&url, &messages).await;
        found
            .map(|m| (url, m))
            .ok_or_else(|| not_there(dead_letter_queue, id))
    }

    async fn delete_letter(&self, url: &str, message: &Message) -> Result<(), SourceError> {
        self.client
            .delete_message()
            .queue_url(url)
            .receipt_handle(message.receipt_handle().unwrap_or_default())
            .send()
            .await
            .map(drop)
            .map_err(|e| sdk_error("deleting a dead letter", e))
    }
}

#[async_trait]
impl DeadLetterStore for SqsStore {
    fn browse_lease(&self) -> Option<Duration> {
        Some(Duration::from_secs(BROWSE_VISIBILITY as u64))
    }

    async fn dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let name = dead_letter_queue_name(dead_letter_queue);
        let Some(url) = self.dead_letter_url(&name, false).await? else {
            return Ok(Vec::new());
        };
        let messages = self
            .receive_all(&url, Listing::dead_letters(limit, None))
            .await?;
        self.give_back(&url, &messages).await;
        Ok(messages.iter().map(Self::letter).collect())
    }

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let (url, message) = self.find(dead_letter_queue, &letter.id).await?;
        let stored = Self::letter(&message);
        let group = stored.field(F_GROUP).map(str::to_string);
        let sent = async {
            let work = self.work().await?;
            let seal = self
                .seal
                .get_or_try_init(|| async { seal_of(&self.client, &work.url).await.map(Arc::new) })
                .await?;
            let fields = seal.seal(
                letter
                    .fields_for_replay_of(&stored)
                    .map_err(SourceError::invalid)?,
            );
            send_fields(
                &self.client,
                &work.url,
                work.fifo,
                &fields,
                0,
                group.as_deref(),
            )
            .await
        }
        .await;
        if let Err(e) = sent {
            self.give_back(&url, std::slice::from_ref(&message)).await;
            return Err(e);
        }
        // Sent: a delete that fails now leaves the letter in both queues,
        // never in neither.
        self.delete_letter(&url, &message).await
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        let (url, message) = self.find(dead_letter_queue, &letter.id).await?;
        self.delete_letter(&url, &message).await
    }

    async fn job_records(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        self.job_records_of(dead_letter_queue).await
    }

    async fn put_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        self.put_job_record_of(dead_letter_queue, key, record).await
    }

    async fn remove_job_record(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        self.remove_job_record_of(dead_letter_queue, key).await
    }

    /// The sidecar's reading ([`SqsStore::depth`]): queue attributes only,
    /// nothing created or received. This process holds nothing here, so
    /// every invisible message of the work queue counts as retry backlog.
    async fn depth_of(&self, dead_letter_queue: &str) -> Result<Option<Depth>, SourceError> {
        self.depth(dead_letter_queue, 0).await.map(Some)
    }

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        if body.is_empty() {
            return Err(SourceError::invalid("SQS takes no empty message body"));
        }
        let work = self.work().await?;
        // FIFO: the group is the header message-group-id, not forwarded.
        let group = headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case("message-group-id"))
            .map(|(_, v)| v.clone());
        let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), body)];
        fields.extend(
            headers
                .iter()
                .filter(|(n, _)| !n.eq_ignore_ascii_case("message-group-id"))
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        send_fields(
            &self.client,
            &work.url,
            work.fifo,
            &fields,
            0,
            group.as_deref(),
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letter_queue_names() {
        assert_eq!(dead_letter_queue_name("orders.dlq"), "orders-dlq");
        assert_eq!(dead_letter_queue_name("orders.fifo.dlq"), "orders-dlq.fifo");
        assert_eq!(dead_letter_queue_name("failed"), "failed");
        assert!(check_dead_letter_queue("orders.dlq", "orders").is_ok());
        assert!(check_dead_letter_queue("orders.fifo.dlq", "orders.fifo").is_ok());
        assert!(check_dead_letter_queue("orders", "orders").is_err());
        for bad in ["a b", "x.y", "", ".fifo"] {
            assert!(check_dead_letter_queue(bad, "orders").is_err(), "{bad}");
        }
    }
}
