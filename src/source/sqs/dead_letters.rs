//! Dead-letter queues: their names, and browsing, replaying and purging
//! the letters in them. SQS has no way to read a message without
//! receiving it: a listing receives the queue's messages (invisible for
//! [`BROWSE_VISIBILITY`] so each is seen once) and gives them back; letters
//! another listing holds are waited for.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};

use super::attributes::from_message;
use super::connection::{queue_attributes, queue_url, sdk_error};
use super::settle::{F_GROUP, set_visibility};
use super::{SqsSource, lock};
use crate::model::DeadLetter;
use crate::source::SourceError;
use crate::source::shared::not_there;

/// How long a listing keeps the letters it has seen invisible.
const BROWSE_VISIBILITY: i32 = 10;

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

fn sent_millis(message: &Message) -> u64 {
    message
        .attributes()
        .and_then(|a| a.get(&MessageSystemAttributeName::SentTimestamp))
        .and_then(|t| t.parse().ok())
        .unwrap_or(0)
}

impl SqsSource {
    /// The URL of the SQS queue `name`, created when missing and `create`.
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

    /// Up to `limit` messages of the queue at `url`, each once, oldest
    /// first, with their receipts; they stay invisible until given back.
    async fn receive_all(
        &self,
        url: &str,
        limit: usize,
        looking_for: Option<&str>,
    ) -> Result<Vec<Message>, SourceError> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        let deadline = Instant::now() + Duration::from_secs(BROWSE_VISIBILITY as u64 + 2);
        while out.len() < limit {
            let got = self
                .client
                .receive_message()
                .queue_url(url)
                .max_number_of_messages(10)
                .wait_time_seconds(0)
                .visibility_timeout(BROWSE_VISIBILITY)
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .message_attribute_names("All")
                .send()
                .await
                .map_err(|e| sdk_error("receiving dead letters", e))?
                .messages
                .unwrap_or_default();
            // Every message of a call is kept, the one looked for or not:
            // each is invisible now and must be given back.
            let mut new = 0;
            let mut found = false;
            for message in got {
                let id = message.message_id().unwrap_or_default().to_string();
                if seen.insert(id.clone()) {
                    new += 1;
                    found |= looking_for == Some(id.as_str());
                    out.push(message);
                }
            }
            if found {
                break;
            }
            if new == 0 {
                // Letters another listing or replay holds (one killed
                // halfway) are invisible for a while yet: wait for them,
                // not longer than they can be held.
                if Instant::now() > deadline || self.invisible(url).await? <= out.len() as u64 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
        out.sort_by_key(sent_millis);
        Ok(out)
    }

    /// How many messages of the queue at `url` are invisible.
    async fn invisible(&self, url: &str) -> Result<u64, SourceError> {
        let attributes = queue_attributes(&self.client, url).await?;
        Ok(attributes
            .get(&QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0))
    }

    /// Makes received messages visible again.
    async fn give_back(&self, url: &str, messages: &[Message]) {
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

    pub(super) async fn browse_dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let name = dead_letter_queue_name(dead_letter_queue);
        let Some(url) = self.dead_letter_url(&name, false).await? else {
            return Ok(Vec::new());
        };
        let messages = self.receive_all(&url, limit, None).await?;
        self.give_back(&url, &messages).await;
        Ok(messages.iter().map(Self::letter).collect())
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
        let mut messages = self.receive_all(&url, usize::MAX, Some(id)).await?;
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

    pub(super) async fn replay_dead_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let (url, message) = self.find(dead_letter_queue, &letter.id).await?;
        let stored = Self::letter(&message);
        let group = stored.field(F_GROUP).map(str::to_string);
        let fields = self.seal.seal(stored.fields_for_replay());
        if let Err(e) = self
            .send_fields(&self.queue_url, self.fifo, &fields, 0, group.as_deref())
            .await
        {
            self.give_back(&url, std::slice::from_ref(&message)).await;
            return Err(e);
        }
        // Sent: a delete that fails now leaves the letter in both queues,
        // never in neither.
        self.delete_letter(&url, &message).await
    }

    pub(super) async fn purge_dead_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let (url, message) = self.find(dead_letter_queue, &letter.id).await?;
        self.delete_letter(&url, &message).await
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
