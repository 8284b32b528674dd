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

use std::time::SystemTime;

use googleapis_tonic_google_pubsub_v1::google::pubsub::v1::{
    CreateSnapshotRequest, DeleteSnapshotRequest, SeekRequest, seek_request,
};

use super::connection::{Client, Names, status_error};
use super::fields::{from_message, publish_time};
use super::{PubSubSource, Sub, lock};
use crate::model::{F_LAST_ATTEMPT_AT, parse_time};
use crate::source::shared::field;
use crate::source::{Depth, SourceError};

/// How long the shadow keeps what it pulled while counting.
const COUNT_LEASE: u64 = 60;

/// A count's snapshot still there after this long was left by a counter
/// that died: a count takes a few round trips, tens of milliseconds, and a
/// replica waiting longer would hold up its depth (and a restarted one its
/// start-up checks) for a dead one. A count of a large backlog can take
/// longer and then be overtaken; the two counts may then each come out
/// short, once.
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
struct Count {
    messages: u64,
    /// The oldest message's `courier-last-attempt-at`, else its publish.
    oldest: Option<SystemTime>,
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

    /// The unacked messages of `subscription`, through its shadow.
    async fn count(&self, subscription: &str) -> Result<Count, SourceError> {
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
            let request = self
                .client
                .request(SeekRequest {
                    subscription: shadow.clone(),
                    target: Some(seek_request::Target::Snapshot(snapshot.clone())),
                })
                .await?;
            self.client
                .subscriber
                .clone()
                .seek(request)
                .await
                .map_err(|s| status_error(&format!("seeking {shadow} to count it"), &s))?;
            let messages = self
                .pull_all(&shadow, usize::MAX, None, COUNT_LEASE)
                .await?;
            let oldest = messages
                .iter()
                .filter_map(|r| {
                    let message = r.message.as_ref()?;
                    let fields = from_message(message);
                    field(&fields, F_LAST_ATTEMPT_AT)
                        .and_then(|t| parse_time(t.as_bytes()))
                        .or_else(|| publish_time(message))
                })
                .min();
            // Acked in the shadow, so that nothing of it stays leased
            // until the next count seeks again.
            let ids: Vec<String> = messages.iter().map(|m| m.ack_id.clone()).collect();
            for chunk in ids.chunks(1000) {
                let _ = self.client.acknowledge(&shadow, chunk.to_vec()).await;
            }
            Ok::<_, SourceError>(Count {
                messages: messages.len() as u64,
                oldest,
            })
        }
        .await;
        unlock.client = None;
        self.delete_snapshot(&snapshot).await;
        counted
    }

    pub(super) async fn read_depth(&self) -> Result<Depth, SourceError> {
        let _one_at_a_time = self.counting.lock().await;
        let work = self.count(&self.names.work).await?;
        let retry = self.count(&self.names.retry).await?;
        let dead_letters = match self.browsing_of_live().await? {
            Some(browsing) => self.count(&browsing).await?,
            None => Count {
                messages: 0,
                oldest: None,
            },
        };
        let (with_app, copies_with_app) = {
            let held = lock(&self.in_flight);
            let copies = held.values().filter(|f| **f == Sub::Retry).count() as u64;
            (held.len() as u64 - copies, copies)
        };
        let pending_work = with_app.min(work.messages);
        let pending_copies = copies_with_app.min(retry.messages);
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
