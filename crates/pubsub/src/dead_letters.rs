//! Dead-letter topics, their browsing subscriptions and the dead-letter
//! store: listing, replaying and purging letters, and sending to the work
//! topic. Pub/Sub reads a message only by pulling it: a listing pulls the
//! browsing subscription's messages (leased for [`BROWSE_LEASE`] s, so each
//! is seen once) and gives them back (deadline 0). A letter replayed or
//! purged is acked in the browsing subscription; the topic itself keeps
//! nothing courier can delete.
//!
//! Opened alone (`courier dlq`, `courier send`), the store creates no
//! topic and no subscription. It reads the work subscription (its topic and
//! dead-letter topic) on first use, and reads letters through the browsing
//! subscription the consumer made at start: without the dead-letter topic
//! there are no letters; with the topic but not that subscription, a read
//! says so and what makes it, since Pub/Sub kept no letter for a
//! subscription that was not there. A send needs the work subscription;
//! the seal key is read, or made, by the first replay.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{ReceivedMessage, Subscription};
use tokio::sync::OnceCell;

use super::connection::{
    self, Client, Names, ensure_browsing, missing_subscription, read_seal, seal_of,
};
use super::fields::{MAX_ATTRIBUTES, attribute_ok, from_message, publish_time};
use super::{PubSubSource, lock};
use courier_core::model::{DeadLetter, PAYLOAD};
use courier_core::source::shared::{Seal, not_there};
use courier_core::source::{DeadLetterStore, SourceError, SourceOptions};

/// How long a listing keeps the letters it has seen leased.
const BROWSE_LEASE: u64 = 10;

/// Empty pulls in a row, [`EMPTY_PULL_PAUSE`] apart, that end a listing. A
/// pull that returns at once may bring nothing while messages are there
/// (Pub/Sub says so of `return_immediately`; the emulator did it under load:
/// a listing of 6 letters right after they were written came back empty,
/// once in about 50 runs of conformance's Pub/Sub replay test), so one
/// empty pull is no proof; three take 400 ms more per listing.
const EMPTY_PULLS_AT_THE_END: u32 = 3;
const EMPTY_PULL_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);

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
}

/// What the store needs of the work subscription.
#[derive(Debug, Clone)]
pub(super) struct Work {
    /// The topic it reads, where a send and a replay publish.
    pub topic: String,
    /// Its dead-letter policy's topic, when it has one.
    pub dead_letter_topic: Option<String>,
}

impl Work {
    pub(super) fn of(subscription: &Subscription) -> Self {
        Self {
            topic: subscription.topic.clone(),
            dead_letter_topic: subscription
                .dead_letter_policy
                .as_ref()
                .map(|p| p.dead_letter_topic.clone())
                .filter(|t| !t.is_empty()),
        }
    }
}

/// The dead letters of one work subscription, and sends to its topic.
pub(super) struct PubSubStore {
    pub(super) client: Client,
    names: Names,
    /// The work subscription as the consumer found it, or as read on first
    /// use (`None`: there is none).
    work: OnceCell<Option<Work>>,
    /// The seal: the consumer's, or read (and made if missing) when an
    /// admin handle first replays.
    seal: OnceCell<Arc<Seal>>,
    /// The subscriptions of job records this store found or made, on the
    /// topic they should read ([`super::jobs`]).
    pub(super) known_jobs: Mutex<HashSet<String>>,
}

impl PubSubStore {
    /// A consumer's store, on its client, names, work subscription and seal.
    pub(super) fn new(client: Client, names: Names, work: Work, seal: Arc<Seal>) -> Self {
        Self {
            client,
            names,
            work: OnceCell::new_with(Some(Some(work))),
            seal: OnceCell::new_with(Some(seal)),
            known_jobs: Mutex::default(),
        }
    }

    /// An admin handle: a channel, nothing read or created yet.
    pub(super) async fn open(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let project = connection::project_of(url).map_err(SourceError::invalid)?;
        Ok(Self {
            client: Client::connect().await?,
            names: Names::new(&project, &options.queue),
            work: OnceCell::new(),
            seal: OnceCell::new_with(options.seal.clone()),
            known_jobs: Mutex::default(),
        })
    }

    async fn work(&self) -> Result<Option<&Work>, SourceError> {
        let work = self
            .work
            .get_or_try_init(|| async {
                let found = self.client.get_subscription(&self.names.work).await?;
                Ok::<_, SourceError>(found.as_ref().map(Work::of))
            })
            .await?;
        Ok(work.as_ref())
    }

    /// The work subscription, which a send and a replay need: it must exist.
    async fn existing_work(&self) -> Result<&Work, SourceError> {
        self.work()
            .await?
            .ok_or_else(|| missing_subscription(&self.names.work))
    }

    /// The topic a dead-letter queue names, as the consumer resolves it:
    /// the work subscription's dead-letter topic stands for the default.
    pub(super) async fn topic_of(&self, dead_letter_queue: &str) -> Result<String, SourceError> {
        let subscriptions = self.work().await?.and_then(|w| w.dead_letter_topic.clone());
        Ok(self
            .names
            .dead_letter_topic(dead_letter_queue, subscriptions.as_deref()))
    }

    /// The browsing subscription of a dead-letter queue; `None` when its
    /// topic does not exist, so no letter was ever kept.
    async fn browsing_of(&self, dead_letter_queue: &str) -> Result<Option<String>, SourceError> {
        let topic = self.topic_of(dead_letter_queue).await?;
        let browsing = Names::browsing(&topic);
        if self.client.get_subscription(&browsing).await?.is_some() {
            return Ok(Some(browsing));
        }
        if self.client.get_topic(&topic).await?.is_none() {
            return Ok(None);
        }
        Err(SourceError::invalid(format!(
            "the dead-letter topic {topic} has no subscription {browsing}, which courier reads its letters through: courier run makes it at start; Pub/Sub keeps a letter only for the subscriptions there when it was published, so letters written before it are not kept for courier"
        )))
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
        let mut empty_pulls = 0;
        loop {
            let got = self.client.pull(subscription, 1000).await?;
            if got.is_empty() {
                empty_pulls += 1;
                if empty_pulls == EMPTY_PULLS_AT_THE_END {
                    break;
                }
                tokio::time::sleep(EMPTY_PULL_PAUSE).await;
                continue;
            }
            empty_pulls = 0;
            let ids: Vec<String> = got.iter().map(|m| m.ack_id.clone()).collect();
            self.client
                .modify_deadline(subscription, ids, BROWSE_LEASE)
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
        if let Err(e) = self.client.modify_deadline(subscription, ids, 0).await {
            tracing::debug!(error = %e, "dead letters listed are deliverable again after {BROWSE_LEASE} s");
        }
    }

    fn letter(received: &ReceivedMessage) -> DeadLetter {
        let message = received.message.clone().unwrap_or_default();
        DeadLetter::from_fields(message.message_id.clone(), from_message(&message))
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

    /// The seal, read from the retry topic, or made as the consumer makes
    /// it at start when there is none.
    async fn seal(&self) -> Result<&Seal, SourceError> {
        let seal = self
            .seal
            .get_or_try_init(|| async {
                let seal = match read_seal(&self.client, &self.names.retry_topic).await? {
                    Some(seal) => seal,
                    None => seal_of(&self.client, &self.names.retry_topic).await?,
                };
                Ok::<_, SourceError>(Arc::new(seal))
            })
            .await?;
        Ok(seal)
    }
}

#[async_trait]
impl DeadLetterStore for PubSubStore {
    fn browse_lease(&self) -> Option<std::time::Duration> {
        Some(std::time::Duration::from_secs(BROWSE_LEASE))
    }

    async fn dead_letters(
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

    async fn replay(
        &self,
        dead_letter_queue: &str,
        letter: &DeadLetter,
    ) -> Result<(), SourceError> {
        let (browsing, received) = self.find(dead_letter_queue, &letter.id).await?;
        let published = async {
            let topic = self.existing_work().await?.topic.clone();
            let fields = letter
                .fields_for_replay_of(&Self::letter(&received))
                .map_err(SourceError::invalid)?;
            let fields = self.seal().await?.seal(fields);
            self.client.publish(&topic, &fields).await
        }
        .await;
        if let Err(e) = published {
            self.give_back(&browsing, std::slice::from_ref(&received))
                .await;
            return Err(e);
        }
        // Published: an ack that fails now leaves the letter in both
        // places, never in neither.
        self.client
            .acknowledge(&browsing, vec![received.ack_id.clone()])
            .await
    }

    async fn purge(&self, dead_letter_queue: &str, letter: &DeadLetter) -> Result<(), SourceError> {
        let (browsing, received) = self.find(dead_letter_queue, &letter.id).await?;
        self.client
            .acknowledge(&browsing, vec![received.ack_id.clone()])
            .await
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

    async fn send(&self, body: Bytes, headers: &[(String, String)]) -> Result<String, SourceError> {
        if body.is_empty() && headers.is_empty() {
            return Err(SourceError::invalid(
                "Pub/Sub takes no message without a body and without attributes",
            ));
        }
        // A producer's message, as a producer could publish it: never an
        // envelope, which only courier's copies are.
        if headers.len() > MAX_ATTRIBUTES {
            return Err(SourceError::invalid(format!(
                "Pub/Sub takes at most {MAX_ATTRIBUTES} attributes on a message, and {} headers were given",
                headers.len()
            )));
        }
        if let Some((name, _)) = headers.iter().find(|(n, v)| !attribute_ok(n, v)) {
            return Err(SourceError::invalid(format!(
                "Pub/Sub cannot carry the header {name:?}: an attribute's name is 1 to 256 bytes not starting with goog, its value at most 1024 bytes"
            )));
        }
        let topic = self.existing_work().await?.topic.clone();
        let mut fields = vec![(Bytes::from_static(PAYLOAD.as_bytes()), body)];
        fields.extend(
            headers
                .iter()
                .map(|(n, v)| (Bytes::from(n.clone()), Bytes::from(v.clone()))),
        );
        self.client.publish(&topic, &fields).await
    }
}
