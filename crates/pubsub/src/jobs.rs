//! The records of `courier dlq` jobs ([`DeadLetterStore::job_records`])
//! beside a dead-letter topic. Pub/Sub keeps no value under a key, so the
//! records are the messages of a topic of their own ([`jobs_topic`]), read
//! through a subscription of the same name, as the dead-letter topic is
//! read through its browsing subscription: one message per key, the key
//! and a version in attributes, the record as the data.
//!
//! A write publishes the new version first, then pulls every message of
//! that subscription and acks the versions of its key before its own; a
//! listing pulls them all. Each pull gives back at once (deadline 0) what
//! it does not ack, so that a record is leased to a read for the moment of
//! a pull only, and a write cut short leaves two versions, never none.
//! Versions only grow, so the newer wins wherever two are found
//! ([`courier_core::source::jobs`]). Pub/Sub says nothing of messages
//! another read has leased: a read ends after pulls that bring nothing
//! new, some 100 ms, which a lease for the moment of a pull rarely
//! outlasts; a record a killed command had leased shows again after its
//! lease, 10 s.
//!
//! The topic and subscription are made by the first write only (a listing
//! or a removal where there is none finds nothing and makes nothing); the
//! subscription never expires and keeps a record 31 days, Pub/Sub's
//! longest (7, the default, where that is refused, as the emulator does),
//! and a write publishes afresh the other records older than 3 days, so
//! that they outlive even the default.
//!
//! [`DeadLetterStore::job_records`]: courier_core::source::DeadLetterStore::job_records

use std::collections::{HashMap, HashSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
    ExpirationPolicy, PubsubMessage, ReceivedMessage,
};

use super::connection::{Names, check_dead_letter_queue, subscription_of};
use super::dead_letters::PubSubStore;
use super::fields::publish_time;
use super::lock;
use courier_core::source::jobs::{self, Fate, Held, Writing};
use courier_core::source::{ErrorKind, SourceError};

/// What a jobs topic's name adds to its dead-letter topic's.
const SUFFIX: &str = ".courier-jobs";
/// Pub/Sub's longest topic or subscription id.
const MAX_ID: usize = 255;

/// The most messages a jobs subscription is read to. Each is a record of
/// at most [`jobs::JOB_RECORD_MAX`] bytes, so a read holds some 16 MB at
/// most; more than this is not one message per job any more, and the
/// command says so instead of reading on.
const MOST_MESSAGES: usize = 1000;

/// The jobs subscription's retention, Pub/Sub's longest (the emulator's is
/// 7 days).
const RETENTION: Duration = Duration::from_secs(31 * 24 * 3600);
/// A record older than this is published afresh by the next write on its
/// topic: under half of Pub/Sub's default retention, 7 days, in case the
/// subscription was made by hand with that.
const REFRESH_AFTER: Duration = Duration::from_secs(3 * 24 * 3600);

/// Pub/Sub's shortest ack deadline.
const LEASE_SECS: u64 = 10;

/// Pulls in a row that bring nothing new and end a read, [`QUIET_PAUSE`]
/// apart: about 100 ms a read, which a running job makes between two
/// letters.
const QUIET_PULLS: u32 = 3;
const QUIET_PAUSE: Duration = Duration::from_millis(50);
/// The most pulls a read makes: a read of [`MOST_MESSAGES`] ends after a
/// few, as one pull brings up to 1000.
const MOST_PULLS: usize = 50;

/// The topic that keeps the job records of a dead-letter topic (a full
/// name): `<topic>.courier-jobs`, in the same project; its subscription
/// has the same name ([`Names::browsing`]). An id over Pub/Sub's 255
/// characters keeps its start and a hash of the whole.
pub fn jobs_topic(dead_letter_topic: &str) -> String {
    let (prefix, id) = match dead_letter_topic.rsplit_once("/topics/") {
        Some((project, id)) => (format!("{project}/topics/"), id),
        None => (String::new(), dead_letter_topic),
    };
    format!("{prefix}{}", jobs::name_within(id, SUFFIX, MAX_ID))
}

/// Where the records of one dead-letter topic are.
struct Place {
    topic: String,
    subscription: String,
}

/// A message of a jobs subscription, as read.
fn held_of(received: &ReceivedMessage) -> Held {
    let message = received.message.clone().unwrap_or_default();
    let text = |name: &str| message.attributes.get(name).map(String::as_str);
    Held::new(
        message.message_id.clone(),
        text(jobs::KEY),
        text(jobs::VERSION),
        Some(message.data.clone()),
        publish_time(&message).unwrap_or(UNIX_EPOCH),
    )
}

/// What a read saw: every record courier wrote, each once, and the
/// messages it keeps leased for their fate.
struct Read {
    held: Vec<Held>,
    kept: Vec<(ReceivedMessage, Fate)>,
}

fn record_message(key: &str, version: u128, record: Bytes) -> PubsubMessage {
    PubsubMessage {
        data: record,
        attributes: HashMap::from([
            (jobs::KEY.to_string(), key.to_string()),
            (jobs::VERSION.to_string(), version.to_string()),
        ]),
        ..PubsubMessage::default()
    }
}

fn nanos(at: SystemTime) -> u128 {
    at.duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos()
}

impl PubSubStore {
    pub(super) async fn job_records_of(
        &self,
        dead_letter_queue: &str,
    ) -> Result<Vec<(String, Bytes)>, SourceError> {
        let Some(place) = self.jobs_place(dead_letter_queue, false).await? else {
            return Ok(Vec::new());
        };
        let read = self.read(&place, None).await?;
        Ok(jobs::newest_records(&read.held))
    }

    /// Publishes the new version first, so that a listing in another
    /// process while this write reads finds one version or the other,
    /// never none; then acks the versions before it.
    pub(super) async fn put_job_record_of(
        &self,
        dead_letter_queue: &str,
        key: &str,
        record: Bytes,
    ) -> Result<(), SourceError> {
        jobs::check_key(key)?;
        jobs::check_size(&record)?;
        let place = self
            .jobs_place(dead_letter_queue, true)
            .await?
            .ok_or_else(|| SourceError::broker("the dlq jobs subscription is gone again"))?;
        let now = SystemTime::now();
        let version = nanos(now);
        let own = self
            .client
            .publish_message(&place.topic, record_message(key, version, record.clone()))
            .await?;
        let writing = Writing {
            key,
            below: Some(version),
            own: Some(&own),
            refresh_after: REFRESH_AFTER,
        };
        let read = self.read(&place, Some(&writing)).await?;
        // The version this record needs to be the newest read: above this
        // write's where one at or above it was found (a clock ahead of this
        // one wrote it, or another write of the key at the same moment).
        // The record then goes out again with it, as the last one put.
        let newest = jobs::next_version(&read.held, key, now);
        if newest > version {
            let again = record_message(key, newest, record);
            if let Err(e) = self.client.publish_message(&place.topic, again).await {
                self.give_back_kept(&place, &read.kept).await;
                return Err(e);
            }
        }
        // The new version is there: an older one left by a failed ack is
        // outranked, and taken by the next write.
        if let Err(e) = self.settle(&place, read.kept).await {
            tracing::debug!(error = %e, subscription = %place.subscription, "an older dlq job record stays until the next write");
        }
        Ok(())
    }

    pub(super) async fn remove_job_record_of(
        &self,
        dead_letter_queue: &str,
        key: &str,
    ) -> Result<(), SourceError> {
        jobs::check_key(key)?;
        let Some(place) = self.jobs_place(dead_letter_queue, false).await? else {
            return Ok(());
        };
        let writing = Writing {
            key,
            below: None,
            own: None,
            refresh_after: REFRESH_AFTER,
        };
        let read = self.read(&place, Some(&writing)).await?;
        self.settle(&place, read.kept).await
    }

    /// The jobs topic and subscription of a dead-letter queue: `None` when
    /// the subscription is not there, made when `create`. One that reads
    /// another topic is refused rather than read.
    async fn jobs_place(
        &self,
        dead_letter_queue: &str,
        create: bool,
    ) -> Result<Option<Place>, SourceError> {
        let dead_letters = self.topic_of(dead_letter_queue).await?;
        // No work subscription to compare with here: "" is never a name.
        check_dead_letter_queue(&dead_letters, "").map_err(SourceError::invalid)?;
        let topic = jobs_topic(&dead_letters);
        let subscription = Names::browsing(&topic);
        let place = Place {
            topic,
            subscription,
        };
        if lock(&self.known_jobs).contains(&place.subscription) {
            return Ok(Some(place));
        }
        let mut found = self.client.get_subscription(&place.subscription).await?;
        if found.is_none() && create {
            self.client
                .ensure_topic(&place.topic, HashMap::new())
                .await?;
            let mut subscription = subscription_of(&place.subscription, &place.topic, LEASE_SECS);
            // Unset, a subscription no one reads for 31 days is deleted,
            // with the records of a job left paused that long.
            subscription.expiration_policy = Some(ExpirationPolicy { ttl: None });
            let mut longest = subscription.clone();
            longest.message_retention_duration = Some(prost_types::Duration {
                seconds: RETENTION.as_secs() as i64,
                nanos: 0,
            });
            match self.client.ensure_subscription(longest).await {
                Ok(()) => {}
                // The emulator keeps 7 days at most, and says so as an
                // invalid argument; the refreshes keep records past that.
                Err(e) if e.kind() == ErrorKind::Invalid => {
                    tracing::debug!(error = %e, "the dlq jobs subscription keeps records Pub/Sub's default 7 days");
                    self.client.ensure_subscription(subscription).await?;
                }
                Err(e) => return Err(e),
            }
            found = self.client.get_subscription(&place.subscription).await?;
        }
        let Some(found) = found else {
            return Ok(None);
        };
        if found.topic != place.topic {
            return Err(SourceError::invalid(format!(
                "the subscription {} reads {}, not {}, where courier keeps the dlq job records of {dead_letter_queue}; delete it, and the next write makes it again",
                place.subscription, found.topic, place.topic
            )));
        }
        lock(&self.known_jobs).insert(place.subscription.clone());
        Ok(Some(place))
    }

    /// Every record of the jobs subscription, each once. Unlike a
    /// dead-letter listing, which keeps what it pulled leased until it
    /// ends, each pull gives back at once all but the messages `writing`
    /// acks or refreshes: a running job reads its records four times a
    /// second, and a record leased for a whole read is one that a listing
    /// in another process does not see. Ends after [`QUIET_PULLS`] pulls
    /// bring nothing new: one pull that answers at once may miss messages
    /// that are there (Pub/Sub says so; the emulator does under load), or
    /// that another read leased for the moment of its pull.
    async fn read(
        &self,
        place: &Place,
        writing: Option<&Writing<'_>>,
    ) -> Result<Read, SourceError> {
        let mut ids = HashSet::new();
        let mut read = Read {
            held: Vec::new(),
            kept: Vec::new(),
        };
        let mut quiet = 0;
        for _ in 0..MOST_PULLS {
            let got = self.client.pull(&place.subscription, 1000).await;
            let got = match got {
                Ok(got) => got,
                Err(e) => {
                    self.give_back_kept(place, &read.kept).await;
                    return Err(e);
                }
            };
            let now = SystemTime::now();
            let mut back = Vec::new();
            let mut new = 0;
            for received in got {
                let held = held_of(&received);
                // Decided as each pull comes, before all are seen: an
                // outranked record is not known as such here.
                let fate = writing.map_or(Fate::GiveBack, |w| w.fate(&held, false, now));
                match fate {
                    Fate::GiveBack => back.push(received.ack_id.clone()),
                    fate => read.kept.push((received, fate)),
                }
                if ids.insert(held.id.clone()) {
                    new += 1;
                    if held.key.is_some() {
                        read.held.push(held);
                    }
                }
            }
            if let Err(e) = self
                .client
                .modify_deadline(&place.subscription, back, 0)
                .await
            {
                tracing::debug!(error = %e, subscription = %place.subscription, "dlq job records read are deliverable again after {LEASE_SECS} s");
            }
            if ids.len() > MOST_MESSAGES {
                self.give_back_kept(place, &read.kept).await;
                return Err(SourceError::invalid(format!(
                    "the Pub/Sub subscription {} holds more than {MOST_MESSAGES} messages, and courier keeps one there per dlq job; remove the records of jobs that are done, or seek the subscription to now to drop them all",
                    place.subscription
                )));
            }
            if new > 0 {
                quiet = 0;
                continue;
            }
            quiet += 1;
            if quiet == QUIET_PULLS {
                return Ok(read);
            }
            tokio::time::sleep(QUIET_PAUSE).await;
        }
        self.give_back_kept(place, &read.kept).await;
        Err(SourceError::broker(format!(
            "the Pub/Sub subscription {} brought new messages in each of {MOST_PULLS} pulls; courier keeps one message there per dlq job, and nothing else should publish to {}",
            place.subscription, place.topic
        )))
    }

    async fn give_back_kept(&self, place: &Place, kept: &[(ReceivedMessage, Fate)]) {
        let ids = kept.iter().map(|(m, _)| m.ack_id.clone()).collect();
        if let Err(e) = self
            .client
            .modify_deadline(&place.subscription, ids, 0)
            .await
        {
            tracing::debug!(error = %e, subscription = %place.subscription, "dlq job records read are deliverable again after {LEASE_SECS} s");
        }
    }

    /// Acks and refreshes what a read kept. A failed ack is the error; a
    /// failed refresh is only logged: the record stays as it was.
    async fn settle(
        &self,
        place: &Place,
        kept: Vec<(ReceivedMessage, Fate)>,
    ) -> Result<(), SourceError> {
        let (acks, refreshes): (Vec<_>, Vec<_>) = kept
            .into_iter()
            .partition(|(_, fate)| *fate == Fate::Remove);
        let acks: Vec<String> = acks.into_iter().map(|(m, _)| m.ack_id).collect();
        let acked = if acks.is_empty() {
            Ok(())
        } else {
            self.client.acknowledge(&place.subscription, acks).await
        };
        for (received, fate) in refreshes {
            let h = held_of(&received);
            let key = h.key.as_deref().unwrap_or_default();
            let copy = record_message(key, h.version, h.record.clone());
            let refreshed = match self.client.publish_message(&place.topic, copy).await {
                Ok(_) => {
                    self.client
                        .acknowledge(&place.subscription, vec![received.ack_id.clone()])
                        .await
                }
                Err(e) => {
                    self.give_back_kept(place, &[(received, fate)]).await;
                    Err(e)
                }
            };
            if let Err(e) = refreshed {
                tracing::warn!(error = %e, subscription = %place.subscription, job = key, "a dlq job record nearing its retention was not published afresh; the next write tries again");
            }
        }
        acked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_topic_names() {
        assert_eq!(
            jobs_topic("projects/p/topics/orders.dlq"),
            "projects/p/topics/orders.dlq.courier-jobs"
        );
        assert_eq!(
            Names::browsing(&jobs_topic("projects/q/topics/dead")),
            "projects/q/subscriptions/dead.courier-jobs"
        );
        let long = format!("projects/p/topics/{}", "t".repeat(255));
        let name = jobs_topic(&long);
        let id = name.strip_prefix("projects/p/topics/").unwrap();
        assert_eq!(id.len(), 255, "{name}");
        assert!(id.starts_with("ttt") && id.ends_with(SUFFIX), "{name}");
        // Pinned: topics with such names exist already.
        assert_eq!(
            id,
            format!("{}-c30d0da030fd73b3.courier-jobs", "t".repeat(225))
        );
        assert_ne!(
            name,
            jobs_topic(&format!("projects/p/topics/{}x", "t".repeat(254)))
        );
        assert_eq!(name, jobs_topic(&long), "the same name every time");
        assert!(check_dead_letter_queue(id, "").is_ok(), "{id}");
    }

    #[test]
    fn a_record_reads_back_from_its_message() {
        let mut message = record_message("job-a", 42, Bytes::from_static(b"{}"));
        message.message_id = "m1".into();
        let received = ReceivedMessage {
            message: Some(message),
            ..ReceivedMessage::default()
        };
        let back = held_of(&received);
        assert_eq!(back.id, "m1");
        assert_eq!(back.key.as_deref(), Some("job-a"));
        assert_eq!(back.version, 42);
        assert_eq!(back.record, Bytes::from_static(b"{}"));
        let mut foreign = received.clone();
        if let Some(m) = foreign.message.as_mut() {
            m.attributes.insert(jobs::KEY.into(), "Not A Key".into());
        }
        assert_eq!(held_of(&foreign).key, None);
    }
}
