//! The records of `courier dlq` jobs ([`DeadLetterStore::job_records`])
//! beside a dead-letter topic. Pub/Sub keeps no value under a key, so the
//! records are the messages of a topic of their own ([`jobs_topic`]), read
//! through a subscription of the same name, as the dead-letter topic is
//! read through its browsing subscription, and through a second one, its
//! mirror ([`jobs_mirror`]): one message per key, the key and a version in
//! attributes, the record as the data.
//!
//! A write publishes the new version first, then pulls every message of
//! the subscriptions and acks the versions of its key before its own; a
//! listing pulls them all. Each pull gives back at once (deadline 0) what
//! it does not ack, so that a record is leased to a read for the moment of
//! a pull only, and a write cut short leaves two versions, never none.
//! Versions only grow, so the newer wins wherever two are found
//! ([`courier_core::source::jobs`]); a write's own message, read back, is
//! no newer version than its own. Pub/Sub says nothing of messages
//! another read has leased: a read ends after pulls that bring nothing
//! new, some 100 ms, which a lease for the moment of a pull rarely
//! outlasts. A command killed between a pull and its give-back leaves
//! what it pulled leased for the whole lease, 10 s: that is why there are
//! two subscriptions, pulled in turn, each given back before the other is
//! pulled, so that a killed command holds a record in one of them at most
//! and a listing finds it in the other. With one, `courier dlq jobs` right
//! after a kill of another listing missed the only record of a job in 11
//! of 150 kills on the emulator (so would the command run again to resume
//! the job, which then starts another), and the resume scenario failed
//! once in about 10 runs; with two, in none of 300.
//!
//! The topic and subscriptions are made by the first write only (a
//! listing or a removal where there are none finds nothing and makes
//! nothing); they never expire. The first keeps a record 31 days, Pub/Sub's
//! longest (7, the default, where that is refused, as the emulator does),
//! the mirror the default 7; a write publishes afresh the other records of
//! the first older than 3 days, so that they outlive even the default, and
//! the copy goes to the mirror too (whose older copy, the same version,
//! is dropped by its retention, or with the key's next write). A mirror
//! made beside a subscription that holds records already (by a write of
//! courier from before it) is filled by that write, which publishes afresh
//! every record it reads.
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
/// What the mirror subscription's name adds to its jobs topic's.
const MIRROR_SUFFIX: &str = ".mirror";
/// Pub/Sub's longest topic or subscription id.
const MAX_ID: usize = 255;

/// The most messages a jobs subscription is read to. Each is a record of
/// at most [`jobs::JOB_RECORD_MAX`] bytes, so a read holds some 16 MB at
/// most; more than this is not one message per job any more, and the
/// command says so instead of reading on.
const MOST_MESSAGES: usize = 1000;

/// The jobs subscription's retention, Pub/Sub's longest (the emulator's is
/// 7 days); the mirror keeps Pub/Sub's default, 7.
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

/// The second subscription a jobs topic (a full name) is read through:
/// `<topic>.mirror`, in its project; an id over Pub/Sub's 255 characters
/// keeps its start and a hash of the whole, as [`jobs_topic`] does.
fn jobs_mirror(jobs_topic: &str) -> String {
    let subscription = Names::browsing(jobs_topic);
    let (prefix, id) = match subscription.rsplit_once("/subscriptions/") {
        Some((project, id)) => (format!("{project}/subscriptions/"), id),
        None => (String::new(), subscription.as_str()),
    };
    format!("{prefix}{}", jobs::name_within(id, MIRROR_SUFFIX, MAX_ID))
}

/// Where the records of one dead-letter topic are.
struct Place {
    topic: String,
    /// The subscriptions there are of the two: the topic's namesake, then
    /// its mirror. A listing merges what it reads in each.
    subscriptions: Vec<String>,
    /// Which of `subscriptions` a write publishes afresh the records of
    /// (the copy goes to every subscription): the namesake, or the one
    /// that was there already when [`Place::fresh`].
    refreshing: usize,
    /// A subscription was made now, beside one that may hold records: the
    /// write publishes every record afresh, so that both hold them.
    fresh: bool,
}

/// A message a read keeps leased for its fate: in which of the place's
/// subscriptions.
struct Kept {
    at: usize,
    received: ReceivedMessage,
    fate: Fate,
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

/// What a read saw: every record courier wrote, each once (a message is
/// in each subscription under the same id), and the messages it keeps
/// leased for their fate.
struct Read {
    held: Vec<Held>,
    kept: Vec<Kept>,
}

/// The fate of a message read in a subscription where the write does
/// (`refreshes`) or does not publish records afresh. Where it does not,
/// a record the other publishes afresh stays as it is: leased in one
/// subscription only while the write runs, it shows in the other. Where
/// it does, a second message of the same key and version (a refresh or a
/// write cut short) is removed rather than published afresh again.
fn fate_of(
    writing: &Writing<'_>,
    held: &Held,
    refreshes: bool,
    refreshing: &mut HashSet<(String, u128)>,
    now: SystemTime,
) -> Fate {
    match writing.fate(held, false, now) {
        Fate::Refresh if !refreshes => Fate::GiveBack,
        Fate::Refresh => {
            let key = held.key.clone().unwrap_or_default();
            if refreshing.insert((key, held.version)) {
                Fate::Refresh
            } else {
                Fate::Remove
            }
        }
        fate => fate,
    }
}

/// The version a put of `key` at `now`, whose message is `own`, publishes
/// its record again with, when `held` has a version of `key` at or above
/// its own: a clock ahead of this one wrote it, or another write of the key
/// at the same instant. The put's own message, read back, has its own
/// version, and is no such version.
fn version_above(held: &[Held], key: &str, own: &str, now: SystemTime) -> Option<u128> {
    let others: Vec<Held> = held.iter().filter(|h| h.id != own).cloned().collect();
    Some(jobs::next_version(&others, key, now)).filter(|&v| v > nanos(now))
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
            refresh_after: if place.fresh {
                Duration::ZERO
            } else {
                REFRESH_AFTER
            },
        };
        let read = self.read(&place, Some(&writing)).await?;
        // Where a version at or above this write's was found, the record
        // goes out again above it, as the last one put.
        if let Some(newest) = version_above(&read.held, key, &own, now) {
            let again = record_message(key, newest, record);
            if let Err(e) = self.client.publish_message(&place.topic, again).await {
                self.give_back_kept(&place, &read.kept).await;
                return Err(e);
            }
        }
        // The new version is there: an older one left by a failed ack is
        // outranked, and taken by the next write.
        if let Err(e) = self.settle(&place, read.kept).await {
            tracing::debug!(error = %e, topic = %place.topic, "an older dlq job record stays until the next write");
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

    /// The jobs topic and subscriptions of a dead-letter queue: `None` when
    /// neither subscription is there, both made when `create`. One that
    /// reads another topic is refused rather than read.
    async fn jobs_place(
        &self,
        dead_letter_queue: &str,
        create: bool,
    ) -> Result<Option<Place>, SourceError> {
        let dead_letters = self.topic_of(dead_letter_queue).await?;
        // No work subscription to compare with here: "" is never a name.
        check_dead_letter_queue(&dead_letters, "").map_err(SourceError::invalid)?;
        let topic = jobs_topic(&dead_letters);
        let mut topic_made = false;
        // Each subscription there is, and whether it was made now.
        let mut there = Vec::new();
        for (at, name) in [Names::browsing(&topic), jobs_mirror(&topic)]
            .into_iter()
            .enumerate()
        {
            if lock(&self.known_jobs).contains(&name) {
                there.push((name, false));
                continue;
            }
            let mut found = self.client.get_subscription(&name).await?;
            let made = found.is_none() && create;
            if made {
                if !topic_made {
                    self.client.ensure_topic(&topic, HashMap::new()).await?;
                    topic_made = true;
                }
                self.make_subscription(&name, &topic, at == 0).await?;
                found = self.client.get_subscription(&name).await?;
            }
            let Some(found) = found else {
                continue;
            };
            if found.topic != topic {
                return Err(SourceError::invalid(format!(
                    "the subscription {name} reads {}, not {topic}, where courier keeps the dlq job records of {dead_letter_queue}; delete it, and the next write makes it again",
                    found.topic
                )));
            }
            lock(&self.known_jobs).insert(name.clone());
            there.push((name, made));
        }
        let before = there.iter().position(|(_, made)| !made);
        Ok((!there.is_empty()).then(|| Place {
            topic,
            fresh: before.is_some() && there.iter().any(|(_, made)| *made),
            refreshing: before.unwrap_or(0),
            subscriptions: there.into_iter().map(|(name, _)| name).collect(),
        }))
    }

    /// Makes a jobs subscription on `topic`: one that never expires, with
    /// Pub/Sub's longest retention where `longest`, else its default.
    async fn make_subscription(
        &self,
        name: &str,
        topic: &str,
        longest: bool,
    ) -> Result<(), SourceError> {
        let mut subscription = subscription_of(name, topic, LEASE_SECS);
        // Unset, a subscription no one reads for 31 days is deleted, with
        // the records of a job left paused that long.
        subscription.expiration_policy = Some(ExpirationPolicy { ttl: None });
        if !longest {
            return self.client.ensure_subscription(subscription).await;
        }
        let mut longest = subscription.clone();
        longest.message_retention_duration = Some(prost_types::Duration {
            seconds: RETENTION.as_secs() as i64,
            nanos: 0,
        });
        match self.client.ensure_subscription(longest).await {
            Ok(()) => Ok(()),
            // The emulator keeps 7 days at most, and says so as an invalid
            // argument; the refreshes keep records past that.
            Err(e) if e.kind() == ErrorKind::Invalid => {
                tracing::debug!(error = %e, "the dlq jobs subscription keeps records Pub/Sub's default 7 days");
                self.client.ensure_subscription(subscription).await
            }
            Err(e) => Err(e),
        }
    }

    /// Every record of the jobs subscriptions, each once. Unlike a
    /// dead-letter listing, which keeps what it pulled leased until it
    /// ends, each pull gives back at once all but the messages `writing`
    /// acks or refreshes: a running job reads its records four times a
    /// second, and a record leased for a whole read is one that a listing
    /// in another process does not see. The subscriptions are pulled in
    /// turn, and what one pull gives back is given back before the next
    /// subscription is pulled: a read killed at any moment holds a record
    /// in one of them at most (and what it keeps leased for a refresh, in
    /// the one it refreshes, [`Place::refreshing`]). Ends after
    /// [`QUIET_PULLS`] rounds bring nothing new: one pull that answers at
    /// once may miss messages that are there (Pub/Sub says so; the
    /// emulator does under load), or that another read leased for the
    /// moment of its pull.
    async fn read(
        &self,
        place: &Place,
        writing: Option<&Writing<'_>>,
    ) -> Result<Read, SourceError> {
        let mut ids = HashSet::new();
        let mut refreshing = HashSet::new();
        let mut read = Read {
            held: Vec::new(),
            kept: Vec::new(),
        };
        let mut quiet = 0;
        for _ in 0..MOST_PULLS {
            let mut new = 0;
            for (at, subscription) in place.subscriptions.iter().enumerate() {
                let got = match self.client.pull(subscription, 1000).await {
                    Ok(got) => got,
                    Err(e) => {
                        self.give_back_kept(place, &read.kept).await;
                        return Err(e);
                    }
                };
                let now = SystemTime::now();
                let mut back = Vec::new();
                for received in got {
                    let held = held_of(&received);
                    // Decided as each pull comes, before all are seen: an
                    // outranked record is not known as such here.
                    let fate = writing.map_or(Fate::GiveBack, |w| {
                        fate_of(w, &held, at == place.refreshing, &mut refreshing, now)
                    });
                    match fate {
                        Fate::GiveBack => back.push(received.ack_id.clone()),
                        fate => read.kept.push(Kept { at, received, fate }),
                    }
                    if ids.insert(held.id.clone()) {
                        new += 1;
                        if held.key.is_some() {
                            read.held.push(held);
                        }
                    }
                }
                if let Err(e) = self.client.modify_deadline(subscription, back, 0).await {
                    tracing::debug!(error = %e, %subscription, "dlq job records read are deliverable again after {LEASE_SECS} s");
                }
            }
            if ids.len() > MOST_MESSAGES {
                self.give_back_kept(place, &read.kept).await;
                return Err(SourceError::invalid(format!(
                    "the Pub/Sub subscriptions of {} hold more than {MOST_MESSAGES} messages, and courier keeps one there per dlq job; remove the records of jobs that are done, or seek the subscriptions ({}) to now to drop them all",
                    place.topic,
                    place.subscriptions.join(", ")
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
            "the Pub/Sub subscriptions of {} brought new messages in each of {MOST_PULLS} pulls; courier keeps one message there per dlq job, and nothing else should publish to {}",
            place.topic, place.topic
        )))
    }

    async fn give_back_kept(&self, place: &Place, kept: &[Kept]) {
        for (at, subscription) in place.subscriptions.iter().enumerate() {
            let ids = kept
                .iter()
                .filter(|k| k.at == at)
                .map(|k| k.received.ack_id.clone())
                .collect();
            if let Err(e) = self.client.modify_deadline(subscription, ids, 0).await {
                tracing::debug!(error = %e, %subscription, "dlq job records read are deliverable again after {LEASE_SECS} s");
            }
        }
    }

    /// Acks and refreshes what a read kept. A failed ack is the error; a
    /// failed refresh is only logged: the record stays as it was.
    async fn settle(&self, place: &Place, kept: Vec<Kept>) -> Result<(), SourceError> {
        let (acks, refreshes): (Vec<_>, Vec<_>) =
            kept.into_iter().partition(|k| k.fate == Fate::Remove);
        let mut acked = Ok(());
        for (at, subscription) in place.subscriptions.iter().enumerate() {
            let ids: Vec<String> = acks
                .iter()
                .filter(|k| k.at == at)
                .map(|k| k.received.ack_id.clone())
                .collect();
            if ids.is_empty() {
                continue;
            }
            if let Err(e) = self.client.acknowledge(subscription, ids).await {
                acked = acked.and(Err(e));
            }
        }
        for kept in refreshes {
            let subscription = &place.subscriptions[kept.at];
            let h = held_of(&kept.received);
            let key = h.key.as_deref().unwrap_or_default();
            let copy = record_message(key, h.version, h.record.clone());
            let refreshed = match self.client.publish_message(&place.topic, copy).await {
                Ok(_) => {
                    self.client
                        .acknowledge(subscription, vec![kept.received.ack_id.clone()])
                        .await
                }
                Err(e) => {
                    self.give_back_kept(place, &[kept]).await;
                    Err(e)
                }
            };
            if let Err(e) = refreshed {
                tracing::warn!(error = %e, %subscription, job = key, "a dlq job record nearing its retention was not published afresh; the next write tries again");
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
    fn jobs_mirror_names() {
        assert_eq!(
            jobs_mirror(&jobs_topic("projects/p/topics/orders.dlq")),
            "projects/p/subscriptions/orders.dlq.courier-jobs.mirror"
        );
        let long = jobs_topic(&format!("projects/p/topics/{}", "t".repeat(255)));
        let name = jobs_mirror(&long);
        let id = name.strip_prefix("projects/p/subscriptions/").unwrap();
        assert_eq!(id.len(), 255, "{name}");
        assert!(id.ends_with(MIRROR_SUFFIX), "{name}");
        assert_ne!(name, Names::browsing(&long));
        assert_ne!(
            name,
            jobs_mirror(&jobs_topic(&format!(
                "projects/p/topics/{}x",
                "t".repeat(254)
            )))
        );
        assert_eq!(name, jobs_mirror(&long), "the same name every time");
        assert!(check_dead_letter_queue(id, "").is_ok(), "{id}");
    }

    fn held(id: &str, key: &str, version: u128, sent: SystemTime) -> Held {
        Held::new(
            id.into(),
            Some(key),
            Some(&version.to_string()),
            Some(Bytes::from(format!("{key}@{version}"))),
            sent,
        )
    }

    /// A put reads back its own message, of its own version: that is no
    /// newer write, and the record is not published a second time. Only
    /// another message of the key at or above it is.
    #[test]
    fn a_put_outranks_what_others_wrote_not_its_own_message() {
        let now = SystemTime::now();
        let mine = nanos(now);
        let own = held("own", "job-a", mine, now);
        let other = |id, version| held(id, "job-a", version, now);
        let rows = [
            // (what the read found, the version to publish again with)
            (vec![], None),
            (vec![own.clone()], None),
            (vec![other("m1", mine - 5), own.clone()], None),
            (vec![own.clone(), held("m2", "job-b", mine + 9, now)], None),
            // Another write of the key at the same instant.
            (vec![own.clone(), other("m3", mine)], Some(mine + 1)),
            // A clock ahead of this one.
            (vec![other("m4", mine + 7), own.clone()], Some(mine + 8)),
        ];
        for (i, (found, expected)) in rows.into_iter().enumerate() {
            assert_eq!(
                version_above(&found, "job-a", "own", now),
                expected,
                "row {i}"
            );
        }
    }

    /// Only the subscription a write refreshes publishes records afresh;
    /// in the other the same record is given back, so that a write killed
    /// while it holds one for its refresh leaves it in the other. A second
    /// copy of a record refreshed is removed.
    #[test]
    fn a_record_is_refreshed_in_one_subscription() {
        let now = SystemTime::now();
        let old = now - REFRESH_AFTER;
        let put = Writing {
            key: "job-a",
            below: Some(nanos(now)),
            own: Some("own"),
            refresh_after: REFRESH_AFTER,
        };
        let mut refreshing = HashSet::new();
        let b = held("b", "job-b", 3, old);
        let fate = |h: &Held, refreshes, r: &mut HashSet<_>| fate_of(&put, h, refreshes, r, now);
        assert_eq!(fate(&b, false, &mut refreshing), Fate::GiveBack);
        assert_eq!(fate(&b, true, &mut refreshing), Fate::Refresh);
        let copy = held("b2", "job-b", 3, old);
        assert_eq!(fate(&copy, true, &mut refreshing), Fate::Remove);
        assert_eq!(
            fate(&held("c", "job-c", 3, old), true, &mut refreshing),
            Fate::Refresh
        );
        assert_eq!(
            fate(&held("d", "job-d", 3, now), true, &mut refreshing),
            Fate::GiveBack,
            "not old enough"
        );
        let own = held("own", "job-a", nanos(now), now);
        assert_eq!(fate(&own, true, &mut refreshing), Fate::GiveBack);
        let before = held("a0", "job-a", 1, old);
        assert_eq!(fate(&before, false, &mut refreshing), Fate::Remove);
        assert_eq!(fate(&before, true, &mut refreshing), Fate::Remove);
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
