//! Google Pub/Sub (`pubsub://PROJECT`, gRPC through tonic).
//!
//! - `--queue` is the subscription. `PUBSUB_EMULATOR_HOST` names an
//!   emulator (plain HTTP/2, no token); otherwise courier talks TLS (rustls
//!   with ring) to `pubsub.googleapis.com` with application default
//!   credentials (`gcp_auth`). With `--create`, a missing subscription is
//!   created on a topic of the same name, with a dead-letter policy.
//! - A read is a unary `Pull` from the work subscription and from
//!   `<subscription>.retry`, sized to what the dispatcher asks, answered at
//!   once; every message pulled is leased for the visibility timeout at
//!   receipt (`ModifyAckDeadline`). No streaming pull: the emulator goes on
//!   pushing to the stream of a replica killed with `kill -9`. On the
//!   emulator, while a backlog waits (the last pull came back full), a pull
//!   of the work subscription first waits for what was pulled before to be
//!   settled, 50 ms at most: the emulator's pull copies the whole backlog
//!   whenever one of its messages is leased.
//! - Ack: `Acknowledge`, concurrent acks in one call.
//! - Every retry, and every give-back (a retry that uses no attempt), is a
//!   sealed copy published to the topic `<subscription>.retry` with the
//!   attempts so far and the due time (`courier-retry-at`); the original is
//!   acked only once the publish answered. A copy received before it is due
//!   is held with `ModifyAckDeadline` for the whole seconds still to wait,
//!   rounded down and at most 600 s, at most once; still a second or more
//!   from due when it comes back, it is published afresh and the old one
//!   acked, and held again; under a second, it is kept in the process until
//!   due (so a retry is not late by a lease's rounding). The 600 s can be
//!   lowered for tests and trials (`COURIER_PUBSUB_MAX_ACK_DEADLINE`).
//! - The reader looks at the retry subscription when a copy it holds falls
//!   due. Copies an earlier process held (it was killed) come back when
//!   their lease ends, which no one here knows: until a new process's first
//!   depth count, and after it while that count found copies in the retry
//!   subscription that the process does not hold, it watches for them (for
//!   at most the longest hold) with a held pull on the retry subscription
//!   while idle (new work then waits up to a second) and a look every half
//!   second while busy.
//! - Attempts: the copy's `courier-attempt` (1 for a producer's message)
//!   plus the deliveries Pub/Sub counted that courier did not settle
//!   (`delivery_attempt` − 1, less the one hold of a copy). Pub/Sub counts
//!   only on a subscription with a dead-letter policy: courier gives the
//!   retry subscription one; a work subscription without one gets a
//!   warning at start (a crash is then not counted on originals).
//! - Dead letters go to the work subscription's dead-letter topic when it
//!   has one, else to `<subscription>.dlq`, read back through a browsing
//!   subscription of the topic's name. `courier dlq` and `courier send`
//!   open the dead-letter store alone (`PubSubStore`): it creates no topic
//!   and no subscription, and reads letters only through a browsing
//!   subscription that exists.
//! - The records of `courier dlq` jobs are messages of a topic beside the
//!   dead-letter topic, `<topic>.courier-jobs`, read through two
//!   subscriptions, one of the same name and `<topic>.courier-jobs.mirror`,
//!   pulled in turn, so that a reader killed between a pull and its give-
//!   back hides a record in one of them at most; one message per job with
//!   the newest version winning; all made by the first record written
//!   (`jobs`). A replay is
//!   not exact: its publish and its ack cannot be one change in Pub/Sub.
//! - Depth: Pub/Sub counts no backlog; a snapshot of each subscription,
//!   sought by a shadow subscription of courier's, is counted.
//!
//! Files: `connection` (URL, channel, names, what courier creates, the
//! seal key), `fields` (fields ↔ a Pub/Sub message), `read` (pull, admit,
//! holding copies), `settle` (ack, retry, dead letter), `dead_letters` (the
//! dead-letter store: browse, replay, purge, send), `jobs` (the records of
//! `courier dlq` jobs), `depth`.
#![deny(rust_2018_idioms)]
#![forbid(unsafe_code)]

mod connection;
mod dead_letters;
mod depth;
mod fields;
mod jobs;
mod read;
mod settle;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;

use courier_core::model::Delivery;
use courier_core::source::shared::Seal;
use courier_core::source::{
    Batcher, Broker, Capabilities, Consumer, DeadLetterStore, Depth, LiveSettings, Observed,
    Settlement, Source, SourceError, SourceOptions, WithStore, settle_by_parts,
};

pub use connection::{
    MAX_ACK_DEADLINE_ENV, MAX_HOLD_SECS, RETRY_MAX_DELIVERY_ATTEMPTS, SEAL_LABEL, check_url,
    delivery_cap_warning,
};
pub use fields::{MAX_KEY_BYTES, MAX_VALUE_BYTES, attribute_ok};
pub use jobs::jobs_topic;
pub use read::EMULATOR_SETTLE_WAIT;

use connection::{Client, Names};
use dead_letters::{PubSubStore, Work};

/// Google Pub/Sub: `pubsub://PROJECT`.
pub const BROKER: Broker = Broker {
    name: "pubsub",
    messaging_system: "gcp_pubsub",
    schemes: &["pubsub"],
    tls_schemes: &[],
    url_form: "pubsub://PROJECT",
    check_url,
    open: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(PubSubSource::connect(url.as_str(), options).await?) as Arc<dyn Source>)
        })
    },
    admin: |url, options| {
        Box::pin(async move {
            Ok(Arc::new(PubSubStore::open(url.as_str(), options).await?)
                as Arc<dyn DeadLetterStore>)
        })
    },
};

/// Which subscription a delivery came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Sub {
    Work,
    Retry,
}

pub struct PubSubSource {
    client: Client,
    names: Names,
    options: SourceOptions,
    live: Mutex<LiveSettings>,
    /// The work subscription's dead-letter policy at start: its topic, and
    /// its `maxDeliveryAttempts`.
    dead_letter_topic: Option<String>,
    max_delivery_attempts: Option<i32>,
    /// The lease a pull of the work subscription takes by itself: its ack
    /// deadline at start, in seconds (Pub/Sub's 10 where it gives none).
    work_deadline_secs: u64,
    seal: Arc<Seal>,
    /// Deliveries with the app (or read ahead), by ack id: looked up at
    /// every hand-out and settlement, with a hasher faster than SipHash on
    /// keys as long as ack ids.
    in_flight: Mutex<foldhash::HashMap<String, Sub>>,
    /// Told when the last delivery of the work subscription in flight here
    /// is settled (`read::EMULATOR_SETTLE_WAIT`).
    work_settled: tokio::sync::Notify,
    /// The last pull of the work subscription came back full: a backlog
    /// waits behind it.
    work_backlog: std::sync::atomic::AtomicBool,
    work_acks: Batcher<String>,
    retry_acks: Batcher<String>,
    /// Dead-letter topics whose browsing subscription this process made
    /// sure of.
    known_dead_letter_topics: Mutex<HashSet<String>>,
    /// One depth count at a time: the shadow subscriptions are shared.
    counting: tokio::sync::Mutex<()>,
    /// Subscriptions whose last count stopped at `depth::COUNT_MOST`: their
    /// depth is a lower bound, said once when it becomes one.
    counted_in_part: Mutex<HashSet<String>>,
    /// Whether the reader rests, and when it looks at retries next.
    pace: Mutex<read::Pace>,
    /// How long a copy is held at most, in seconds: Pub/Sub's 600, or less
    /// with `COURIER_PUBSUB_MAX_ACK_DEADLINE`.
    hold_limit: u64,
    /// The copies this process holds, by Pub/Sub message id (at most
    /// `read::MOST_DUE`): the retry backlog less these and those with the
    /// app is what an earlier process left held.
    holding: Mutex<HashSet<String>>,
    /// Copies due in under a second, kept here until then with their due
    /// time (`read::Waiting::Keep`).
    kept: Mutex<Vec<(std::time::SystemTime, Delivery)>>,
    /// The dead letters and sends, on the same channel.
    store: PubSubStore,
}

impl PubSubSource {
    pub async fn connect(url: &str, options: SourceOptions) -> Result<Self, SourceError> {
        let project = connection::project_of(url).map_err(SourceError::invalid)?;
        let most = Duration::from_secs(MAX_HOLD_SECS);
        let hold_limit = courier_core::duration::limit_from_env(MAX_ACK_DEADLINE_ENV, most, most)
            .map_err(SourceError::invalid)?
            .as_secs();
        if hold_limit < MAX_HOLD_SECS {
            tracing::warn!(
                hold_limit_secs = hold_limit,
                "a retry copy is held at most {hold_limit}s for this run ({MAX_ACK_DEADLINE_ENV} is set), not Pub/Sub's 600s: a longer wait is a chain of copies"
            );
        }
        let client = Client::connect().await?;
        let names = Names::new(&project, &options.queue);
        let lease_secs = read::lease_for(options.live.visibility_timeout);
        let subscription =
            connection::work_subscription(&client, &names, options.create, lease_secs).await?;
        let work = Work::of(&subscription);
        let work_deadline_secs = match subscription.ack_deadline_seconds {
            secs if secs > 0 => secs as u64,
            _ => 10,
        };
        let dead_letter_topic = work.dead_letter_topic.clone();
        let max_delivery_attempts = subscription
            .dead_letter_policy
            .as_ref()
            .map(|p| p.max_delivery_attempts)
            .filter(|_| dead_letter_topic.is_some());
        let mut names = names;
        names.work_topic = work.topic.clone();
        let live = options.live.clone();
        let dead_letters =
            names.dead_letter_topic(&live.dead_letter_queue, dead_letter_topic.as_deref());
        let seal =
            connection::prepare(&client, &names, &dead_letters, options.seal.as_ref()).await?;
        let source = Self {
            store: PubSubStore::new(client.clone(), names.clone(), work, seal.clone()),
            work_acks: settle::ack_batcher(&client, &names.work, options.concurrency),
            retry_acks: settle::ack_batcher(&client, &names.retry, options.concurrency),
            client,
            names,
            live: Mutex::new(live),
            options,
            dead_letter_topic,
            max_delivery_attempts,
            work_deadline_secs,
            seal,
            in_flight: Mutex::default(),
            work_settled: tokio::sync::Notify::new(),
            work_backlog: std::sync::atomic::AtomicBool::new(false),
            known_dead_letter_topics: Mutex::new(HashSet::from([dead_letters])),
            counting: tokio::sync::Mutex::new(()),
            counted_in_part: Mutex::default(),
            pace: Mutex::new(read::Pace::new(Duration::from_secs(hold_limit))),
            hold_limit,
            holding: Mutex::default(),
            kept: Mutex::default(),
        };
        if source.max_delivery_attempts.is_none() {
            tracing::warn!(
                subscription = %source.options.queue,
                "the subscription has no dead-letter policy, so Pub/Sub does not count its deliveries: attempts come from courier's own record only, and a sidecar that crashes mid-delivery does not use up an attempt of the message it had (give the subscription a dead-letter policy; courier --create makes one)"
            );
        }
        source.warn_about_cap(source.options.live.max_deliveries);
        Ok(source)
    }

    fn live(&self) -> LiveSettings {
        lock(&self.live).clone()
    }

    /// The topic dead letters go to now.
    fn dead_letters(&self) -> String {
        self.names.dead_letter_topic(
            &self.live().dead_letter_queue,
            self.dead_letter_topic.as_deref(),
        )
    }

    /// The policy's maxAttempts is `max_deliveries - 2`.
    fn warn_about_cap(&self, max_deliveries: u32) {
        let max_attempts = max_deliveries.saturating_sub(2).max(1);
        if let Some(warning) = self.max_delivery_attempts.and_then(|cap| {
            delivery_cap_warning(
                cap,
                self.dead_letter_topic.as_deref().unwrap_or_default(),
                max_attempts,
            )
        }) {
            tracing::warn!(subscription = %self.options.queue, "{warning}");
        }
    }
}

/// Whether any delivery of the work subscription is in flight here.
fn work_in_flight(in_flight: &foldhash::HashMap<String, Sub>) -> bool {
    in_flight.values().any(|s| *s == Sub::Work)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[async_trait]
impl Consumer for PubSubSource {
    fn longest_claim(&self) -> Option<Duration> {
        Some(Duration::from_secs(MAX_HOLD_SECS))
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            per_message_delay: true,
            out_of_order_acks: true,
            dead_letter_browsing: true,
            dedup: false,
            byte_bounded_reads: false,
            dead_letter_age: true,
            key_ordering: false,
            shared_rate_limit: false,
            dead_letter_jobs: true,
            exact_replay: false,
            multi_process: true,
        }
    }

    async fn receive(&self, max: usize) -> Result<Vec<Delivery>, SourceError> {
        self.read(max).await
    }

    async fn settle(
        &self,
        delivery: &Delivery,
        settlement: Settlement<'_>,
    ) -> Result<(), SourceError> {
        settle_by_parts(self, delivery, settlement).await
    }

    async fn keep_alive(&self, in_flight: &[Delivery]) -> Result<(), SourceError> {
        self.keep_leased(in_flight).await
    }

    /// Held copies stay leased: their lease ends at their due time anyway.
    async fn close(&self) {}
}

#[async_trait]
impl Observed for PubSubSource {
    async fn depth(&self) -> Result<Depth, SourceError> {
        self.read_depth().await
    }

    fn check(&self, settings: &LiveSettings) -> Result<(), String> {
        connection::check_dead_letter_queue(&settings.dead_letter_queue, &self.options.queue)
    }

    fn apply(&self, settings: &LiveSettings) {
        let before = std::mem::replace(&mut *lock(&self.live), settings.clone());
        if before.max_deliveries != settings.max_deliveries {
            self.warn_about_cap(settings.max_deliveries);
        }
    }
}

impl WithStore for PubSubSource {
    fn store(&self) -> &dyn DeadLetterStore {
        &self.store
    }
}
