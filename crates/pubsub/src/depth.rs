//! Depth. Pub/Sub's API counts no backlog (Cloud Monitoring has
//! `num_undelivered_messages`, a minute late). courier counts the unacked
//! messages of a subscription without touching it: a snapshot of it, which
//! a shadow subscription of courier's on the same topic seeks, and whose
//! messages the shadow pulls and acks. The shadows are made when the source
//! opens, before the messages they count (the emulator's seek brings back
//! only messages published after a subscription existed).
//!
//! The work subscription's count is ready plus pending: a snapshot cannot
//! tell a leased message from one waiting. `pending` is what this process
//! has, the rest ready. The retry backlog is the retry subscription's
//! count less the copies this process has with the app. No message's age
//! is told: the oldest unacked one may be with an app, not waiting.
//!
//! A count reads at most [`COUNT_MOST`] messages of a subscription: a
//! count of the whole of a large backlog pulled every message of it every
//! `--depth-interval` (a million messages of a kilobyte is a gigabyte of
//! subscribe throughput, which Google bills, every 15 s), and made the
//! broker do as much work again as the drain itself. Past it, the gauges
//! are a lower bound, which courier logs once.
//!
//! An admin handle (`courier console`) reads no depth: its `depth_of` is
//! the trait's `None`. Every count above makes a snapshot, moves a shadow
//! and pulls from it (and makes a missing shadow again), which a handle
//! that creates nothing and takes nothing does not do, and nothing else in
//! the Pub/Sub API counts a subscription's messages.

use std::time::SystemTime;

use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
    CreateSnapshotRequest, DeleteSnapshotRequest, SeekRequest, seek_request,
};

use super::connection::{Client, Names, status_error};
use super::fields::publish_time;
use super::{PubSubSource, Sub, lock};
use courier_core::model::{F_LAST_ATTEMPT_AT, parse_time};
use courier_core::source::{Depth, ErrorKind, SourceError};

/// Messages pulled from a shadow at once while counting, at most
/// (Pub/Sub's most).
const COUNT_BATCH: usize = 1000;
/// About how many bytes of bodies one pull of a count may bring: a pull
/// has no byte limit of its own, and its messages are in memory at once.
const COUNT_BYTES: usize = 1 << 20;
/// The first pull of a count, before the size of its messages is known.
const FIRST_COUNT_BATCH: usize = 16;
/// The most messages one count of a subscription reads: enough for an
/// alert's threshold and an autoscaler's target (a hundred replicas at a
/// hundred messages each), ten pulls at most.
pub(super) const COUNT_MOST: u64 = 10_000;

/// A count's snapshot still there after this long was left by a counter
/// that died: a count takes a few round trips, tens of milliseconds, and a
/// replica waiting longer would hold up its depth (and a restarted one its
/// start-up checks) for a dead one. A count that takes longer (a large
/// backlog, a shadow made again on a loaded service) is then overtaken: it
/// finds its snapshot or its shadow gone, and is taken once more
/// ([`PubSubSource::count`]).
const STALE_LOCK: std::time::Duration = std::time::Duration::from_secs(1);

/// Deletes a count's snapshot when the count is dropped before it did.
struct Unlock {
    client: Option<Client>,
    snapshot: String,
}

impl Drop for Unlock {
    fn drop(&mut self) {
        let (Some(client), Ok(runtime)) =
            (self.client.take(), tokio::runtime::Handle::try_current())
        else {
            return;
        };
        let snapshot = std::mem::take(&mut self.snapshot);
        runtime.spawn(async move {
            if let Ok(request) = client.request(DeleteSnapshotRequest { snapshot }).await {
                let _ = client.subscriber.clone().delete_snapshot(request).await;
            }
        });
    }
}

/// What a count found.
#[derive(Default)]
struct Count {
    messages: u64,
    /// The oldest message's `courier-last-attempt-at`, else its publish
    /// (of those read, when the count stopped at [`COUNT_MOST`]).
    oldest: Option<SystemTime>,
    /// The count stopped at [`COUNT_MOST`]: there may be more.
    in_part: bool,
}

impl PubSubSource {
    /// Snapshots `subscription` under the name `snapshot`, which is also
    /// the lock of its shadow: one count at a time across replicas (a
    /// second counter seeking the shared shadow meanwhile would make both
    /// count short). A snapshot of that name older than [`STALE_LOCK`] is
    /// one a counter that died left behind, and is taken over.
    async fn lock_by_snapshot(
        &self,
        subscription: &str,
        snapshot: &str,
    ) -> Result<(), SourceError> {
        let started = std::time::Instant::now();
        loop {
            let request = self
                .client
                .request(CreateSnapshotRequest {
                    name: snapshot.to_string(),
                    subscription: subscription.to_string(),
                    ..CreateSnapshotRequest::default()
                })
                .await?;
            match self
                .client
                .subscriber
                .clone()
                .create_snapshot(request)
                .await
            {
                Ok(_) => return Ok(()),
                Err(s) if s.code() == tonic::Code::AlreadyExists => {
                    if started.elapsed() > STALE_LOCK {
                        self.delete_snapshot(snapshot).await;
                    } else {
                        tokio::time::sleep(std::time::Duration::from_millis(25)).await;
                    }
                }
                Err(s) => {
                    return Err(status_error(
                        &format!("snapshotting {subscription} to count it"),
                        &s,
                    ));
                }
            }
        }
    }

    async fn delete_snapshot(&self, snapshot: &str) {
        if let Ok(request) = self
            .client
            .request(DeleteSnapshotRequest {
                snapshot: snapshot.to_string(),
            })
            .await
            && let Err(s) = self
                .client
                .subscriber
                .clone()
                .delete_snapshot(request)
                .await
        {
            tracing::debug!(error = %status_error("deleting a snapshot", &s), snapshot, "a depth snapshot is left; the next count takes it over");
        }
    }

    /// The unacked messages of `subscription`, through its shadow. A count
    /// overtaken by a waiter that took its lock for dead finds its snapshot
    /// or its shadow gone (NOT_FOUND, an `Invalid` error here) and is taken
    /// once more, behind the lock the other holds now: two counters on one
    /// subscription (a replica and a restarted one, or the sidecar and
    /// `courier dlq`) then both get a count instead of an error.
    async fn count(&self, subscription: &str) -> Result<Count, SourceError> {
        let count = match self.count_once(subscription).await {
            Err(e) if e.kind() == ErrorKind::Invalid => {
                tracing::debug!(error = %e, subscription, "a depth count was overtaken; counting again");
                self.count_once(subscription).await
            }
            counted => counted,
        }?;
        self.note_in_part(subscription, &count);
        Ok(count)
    }

    async fn count_once(&self, subscription: &str) -> Result<Count, SourceError> {
        let shadow = Names::shadow(subscription);
        let short = subscription.rsplit('/').next().unwrap_or_default();
        let snapshot = format!(
            "projects/{}/snapshots/{short}.courier-depth",
            self.names.project
        );
        self.lock_by_snapshot(subscription, &snapshot).await?;
        // A count cut short (its task aborted at a stop) still lets go of
        // the lock, so the next counter does not wait for it to go stale.
        let mut unlock = Unlock {
            client: Some(self.client.clone()),
            snapshot: snapshot.clone(),
        };
        let counted = async {
            if let Err(s) = self.seek(&shadow, &snapshot).await {
                // The shadow is bound to another topic than the
                // subscription's (its topic was deleted and made again),
                // or it is gone (deleted by hand, or by a counter that
                // took over a lock it thought dead while remaking it).
                if !matches!(
                    s.code(),
                    tonic::Code::FailedPrecondition | tonic::Code::NotFound
                ) {
                    return Err(status_error(&format!("seeking {shadow} to count it"), &s));
                }
                self.client.remake_shadow(subscription, &shadow).await?;
                self.seek(&shadow, &snapshot)
                    .await
                    .map_err(|s| status_error(&format!("seeking {shadow} to count it"), &s))?;
            }
            self.count_shadow(&shadow).await
        }
        .await;
        unlock.client = None;
        self.delete_snapshot(&snapshot).await;
        counted
    }

    async fn seek(&self, shadow: &str, snapshot: &str) -> Result<(), tonic::Status> {
        let request = self
            .client
            .request(SeekRequest {
                subscription: shadow.to_string(),
                target: Some(seek_request::Target::Snapshot(snapshot.to_string())),
            })
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        self.client.subscriber.clone().seek(request).await.map(drop)
    }

    /// Counts what the shadow holds after its seek a batch at a time, up
    /// to [`COUNT_MOST`], each batch acked in the shadow before the next
    /// pull: a count holds one pull's messages in memory (sized to about
    /// [`COUNT_BYTES`] from the messages of the pull before), not the
    /// backlog (a million retries waiting would otherwise be a million
    /// bodies in courier's memory at every scrape), and what it acked does
    /// not come back to be counted twice. What it leaves unread, the next
    /// count's seek resets.
    async fn count_shadow(&self, shadow: &str) -> Result<Count, SourceError> {
        let mut count = Count::default();
        let mut batch = FIRST_COUNT_BATCH;
        loop {
            let left = COUNT_MOST - count.messages;
            if left == 0 {
                count.in_part = true;
                return Ok(count);
            }
            let got = self.client.pull(shadow, batch.min(left as usize)).await?;
            if got.is_empty() {
                return Ok(count);
            }
            count.messages += got.len() as u64;
            let bytes: usize = got
                .iter()
                .filter_map(|r| r.message.as_ref())
                .map(|m| {
                    m.data.len()
                        + m.attributes
                            .iter()
                            .map(|(k, v)| k.len() + v.len())
                            .sum::<usize>()
                })
                .sum();
            batch = (COUNT_BYTES / (bytes / got.len()).max(1)).clamp(1, COUNT_BATCH);
            let oldest = got
                .iter()
                .filter_map(|r| {
                    let message = r.message.as_ref()?;
                    message
                        .attributes
                        .get(F_LAST_ATTEMPT_AT)
                        .and_then(|t| parse_time(t.as_bytes()))
                        .or_else(|| publish_time(message))
                })
                .min();
            count.oldest = count.oldest.into_iter().chain(oldest).min();
            let ids = got.into_iter().map(|m| m.ack_id).collect();
            // A batch not acked here comes back to the shadow's next seek
            // anyway; this count goes on.
            let _ = self.client.acknowledge(shadow, ids).await;
        }
    }

    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let _one_at_a_time = self.counting.lock().await;
        let work = self.count(&self.names.work).await?;
        let retry = self.count(&self.names.retry).await?;
        let dead_letters = match self.browsing_of_live().await? {
            Some(browsing) => self.count(&browsing).await?,
            None => Count::default(),
        };
        let (with_app, copies_with_app) = {
            let held = lock(&self.in_flight);
            let copies = held.values().filter(|f| **f == Sub::Retry).count() as u64;
            (held.len() as u64 - copies, copies)
        };
        let pending_work = with_app.min(work.messages);
        let pending_copies = copies_with_app.min(retry.messages);
        self.counted_copies(retry.messages - pending_copies);
        Ok(Depth {
            ready: Some(work.messages - pending_work),
            pending: pending_work + pending_copies,
            retry_backlog: retry.messages - pending_copies,
            dead_letters: dead_letters.messages,
            oldest_dead_letter_age: dead_letters
                .oldest
                .map(|t| SystemTime::now().duration_since(t).unwrap_or_default()),
            queue_depth: Some(work.messages + retry.messages),
            oldest_waiting_age: None,
        })
    }

    /// Says once when a subscription's count becomes a lower bound (it
    /// stopped at [`COUNT_MOST`]), and when it is whole again.
    fn note_in_part(&self, subscription: &str, count: &Count) {
        let mut in_part = lock(&self.counted_in_part);
        if count.in_part && in_part.insert(subscription.to_string()) {
            tracing::warn!(
                subscription,
                counted = COUNT_MOST,
                "more messages wait than a depth count reads: the depth gauges of this subscription show that many, a lower bound, until fewer wait"
            );
        } else if !count.in_part && in_part.remove(subscription) {
            tracing::info!(
                subscription,
                messages = count.messages,
                "a depth count reads the whole subscription again"
            );
        }
    }

    /// The browsing subscription of the dead-letter queue in force, when
    /// it exists.
    async fn browsing_of_live(&self) -> Result<Option<String>, SourceError> {
        let topic = self.dead_letters();
        let browsing = Names::browsing(&topic);
        if self
            .client
            .get_subscription(&Names::shadow(&browsing))
            .await?
            .is_none()
        {
            return Ok(None);
        }
        Ok(Some(browsing))
    }
}
