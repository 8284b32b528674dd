//! Dead-letter topics and their browsing subscriptions: listing,
//! replaying and purging letters. Pub/Sub reads a message only by pulling
//! it: a listing pulls the browsing subscription's messages (leased for
//! [`BROWSE_LEASE`] s, so each is seen once) and gives them back (deadline
//! 0). A letter replayed or purged is acked in the browsing subscription;
//! the topic itself keeps nothing courier can delete.

use std::collections::HashSet;

use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::ReceivedMessage;

use super::connection::{Names, ensure_browsing};
use super::fields::{from_message, publish_time};
use super::{PubSubSource, lock};
use crate::model::DeadLetter;
use crate::source::SourceError;
use crate::source::shared::not_there;

/// How long a listing keeps the letters it has seen leased.
const BROWSE_LEASE: u64 = 10;

impl PubSubSource {
    /// The topic a dead-letter queue names, with its browsing subscription
    /// made when this process has not seen it yet.
    pub(super) async fn dead_letter_topic_of(
        &self,
        dead_letter_queue: &str,
    ) -> Result<String, SourceError> {
        let topic = self
            .names
            .dead_letter_topic(dead_letter_queue, self.dead_letter_topic.as_deref());
        if lock(&self.known_dead_letter_topics).contains(&topic) {
            return Ok(topic);
        }
        if self.client.get_topic(&topic).await?.is_none() {
            self.client.ensure_topic(&topic, Default::default()).await?;
        }
        ensure_browsing(&self.client, &topic).await?;
        lock(&self.known_dead_letter_topics).insert(topic.clone());
        Ok(topic)
    }

    /// The browsing subscription of a dead-letter queue, `None` when it
    /// does not exist (no letter was ever written through courier).
    async fn browsing_of(&self, dead_letter_queue: &str) -> Result<Option<String>, SourceError> {
        let topic = self
            .names
            .dead_letter_topic(dead_letter_queue, self.dead_letter_topic.as_deref());
        let browsing = Names::browsing(&topic);
        Ok(self
            .client
            .get_subscription(&browsing)
            .await?
            .map(|_| browsing))
    }

    /// Every letter of the browsing subscription not leased elsewhere,
    /// each once, leased for [`BROWSE_LEASE`] until given back; stops early
    /// at the one `looking_for`. Oldest first.
    async fn pull_all(
        &self,
        subscription: &str,
        looking_for: Option<&str>,
    ) -> Result<Vec<ReceivedMessage>, SourceError> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        loop {
            let got = self.client.pull(subscription, 1000).await?;
            if got.is_empty() {
                break;
            }
            let ids: Vec<String> = got.iter().map(|m| m.ack_id.clone()).collect();
            self.modify_deadline(subscription, ids, BROWSE_LEASE)
                .await?;
            let mut found = false;
            for received in got {
                let id = received
                    .message
                    .as_ref()
                    .map(|m| m.message_id.clone())
                    .unwrap_or_default();
                if seen.insert(id.clone()) {
                    found |= looking_for == Some(id.as_str());
                    out.push(received);
                }
            }
            if found {
                break;
            }
        }
        out.sort_by_key(|r| r.message.as_ref().and_then(publish_time));
        Ok(out)
    }

    /// Makes pulled messages deliverable again.
    async fn give_back(&self, subscription: &str, messages: &[ReceivedMessage]) {
        let ids = messages.iter().map(|m| m.ack_id.clone()).collect();
        if let Err(e) = self.modify_deadline(subscription, ids, 0).await {
            tracing::debug!(error = %e, "dead letters listed are deliverable again after {BROWSE_LEASE} s");
        }
    }

    fn letter(received: &ReceivedMessage) -> DeadLetter {
        let message = received.message.clone().unwrap_or_default();
        DeadLetter::from_fields(message.message_id.clone(), from_message(&message))
    }

    pub(super) async fn browse_dead_letters(
        &self,
        dead_letter_queue: &str,
        limit: usize,
    ) -> Result<Vec<DeadLetter>, SourceError> {
        let Some(browsing) = self.browsing_of(dead_letter_queue).await? else {
            return Ok(Vec::new());
        };
        let mut messages = self.pull_all(&browsing, None).await?;
        self.give_back(&browsing, &messages).await;
        messages.truncate(limit);
        Ok(messages.iter().map(Self::letter).collect())
    }

    /// The letter `id`, pulled (the others seen on the way given back).
    async fn find(
        &self,
        dead_letter_queue: &str,
        id: &str,
    ) -> Result<(String, ReceivedMessage), SourceError> {
        let Some(browsing) = self.browsing_of(dead_letter_queue).await? else {
            return Err(not_there(dead_letter_queue, id));
        };
        let mut messages = self.pull_all(&browsing, Some(id)).await?;
        let at = messages
            .iter()
            .position(|m| m.message.as_ref().is_some_and(|m| m.message_id == id));
        let found = at.map(|at| messages.swap_remove(at));
        self.give_back(&browsing, &messages).await;
        found
            .map(|m| (browsing, m))
            .ok_or_else(|| not_there(dead_letter_queue, id))
    }

    async fn remove_letter(
        &self,
        browsing: &str,
        received: &ReceivedMessage,
    ) -> Result<(), SourceError> {
        self.client
            .acknowledge(browsing, vec![received.ack_id.clone()])
            .await
    }

    pub(super) async fn replay_dead_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let (browsing, received) = self.find(dead_letter_queue, &letter.id).await?;
        let fields = self.seal.seal(Self::letter(&received).fields_for_replay());
        if let Err(e) = self.publish(&self.names.work_topic, &fields).await {
            self.give_back(&browsing, std::slice::from_ref(&received))
                .await;
            return Err(e);
        }
        // Published: an ack that fails now leaves the letter in both
        // places, never in neither.
        self.remove_letter(&browsing, &received).await
    }

    pub(super) async fn purge_dead_letter(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let (browsing, received) = self.find(dead_letter_queue, &letter.id).await?;
        self.remove_letter(&browsing, &received).await
    }
}
