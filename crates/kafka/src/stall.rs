//! A replica left without partitions while the group consumes nothing.
//!
//! A group member waits for the coordinator's answer to its JoinGroup for
//! up to `max.poll.interval.ms` (an hour here, so that a slow app never
//! makes it leave the group). A coordinator that drops the request
//! without an answer leaves the member in the group's join, holding
//! nothing, for that long: librdkafka's mock cluster does it when a member
//! waiting in a join outlives its session, which a pause of the mock
//! longer than a second at the end of the join causes (its session timer
//! runs before the join's, expires the waiting member and forgets the
//! request, and the connection stays blocked; docs/reliability.md,
//! finding 6). So courier watches: a replica that holds no partition for
//! longer than the session timeout plus the visibility timeout (the
//! longest a rebalance waits for a dead member and for a revoke), while
//! the work and retry topics hold records and the group's commit points
//! have not moved for a session timeout, logs a warning, is not ready
//! (`/readyz`, `courier_broker_up`), and joins the group again with a new
//! consumer (new connections, a new member). A replica that is one too
//! many for the partitions holds nothing too, but the group commits
//! meanwhile, so it stays quiet and ready; while nothing is committed (the
//! app is down) it may take it for a stall, so each join that brings no
//! partition doubles the wait before the next (up to 10 minutes), and it
//! is ready again as soon as the group commits.

use std::time::Duration;

use rdkafka::consumer::Consumer;
use tokio::time::Instant;

use super::KafkaSource;

/// What the source watches of its assignment.
#[derive(Default)]
pub(super) struct Watch {
    /// Since when the consumer holds no partition.
    unassigned_since: Option<Instant>,
    /// The group's commit points when last looked at, and when.
    sample: Option<(Instant, i64)>,
    /// Said stalled (not ready) until partitions come, or the group
    /// commits again.
    stalled: bool,
    /// Joins again since partitions were last held: each waits twice as
    /// long as the one before.
    rejoins: u32,
}

/// The longest a replica holding nothing waits before it joins again,
/// however many joins brought it nothing.
const MAX_STALL_WAIT: Duration = Duration::from_secs(600);

/// `first`, doubled `rejoins` times, at most [`MAX_STALL_WAIT`] (or `first`
/// when that is longer).
fn stall_wait(first: Duration, rejoins: u32) -> Duration {
    first
        .saturating_mul(1 << rejoins.min(10))
        .min(MAX_STALL_WAIT.max(first))
}

impl KafkaSource {
    fn watch(&self) -> std::sync::MutexGuard<'_, Watch> {
        self.watch.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn stalled(&self) -> bool {
        self.watch().stalled
    }

    /// How long a replica may hold nothing before it joins again: the
    /// session timeout plus the visibility timeout, doubled for each join
    /// that brought nothing (a replica one too many for the partitions,
    /// while the app is down and nothing is committed, would otherwise make
    /// the group rebalance every 20 s), at most [`MAX_STALL_WAIT`].
    fn stall_after(&self, rejoins: u32) -> Duration {
        stall_wait(
            self.session_timeout + self.live().visibility_timeout,
            rejoins,
        )
    }

    /// Checked before each read: cheap while partitions are held; while
    /// none are, looks at the group's commits once a session timeout, and
    /// joins again when it stalls.
    pub(super) async fn watch_assignment(&self) {
        let holds = self
            .consumer()
            .assignment()
            .map_or(true, |assigned| assigned.count() > 0);
        let now = Instant::now();
        let since = {
            let mut watch = self.watch();
            if holds {
                if watch.stalled {
                    tracing::info!(queue = %self.options.queue, "Kafka assigned partitions again: ready");
                }
                *watch = Watch::default();
                return;
            }
            let since = *watch.unassigned_since.get_or_insert(now);
            let looked = watch
                .sample
                .is_some_and(|(at, _)| now - at < self.session_timeout);
            if now - since < self.session_timeout || looked {
                return;
            }
            since
        };
        // A broker that cannot be asked is reported by the reads and the
        // depth; this waits for the next look.
        let Ok((unsettled, committed)) = self.progress().await else {
            return;
        };
        let mut watch = self.watch();
        let before = watch.sample.replace((now, committed));
        let still = before.is_some_and(|(_, c)| c == committed);
        if watch.stalled && before.is_some() && (!still || unsettled == 0) {
            // Others consume: this replica is one too many for the
            // partitions, not stuck.
            watch.stalled = false;
            tracing::info!(queue = %self.options.queue, "the group commits again while this replica holds no Kafka partition (more replicas than partitions): ready");
        }
        let idle = now - since;
        if unsettled == 0 || !still || idle < self.stall_after(watch.rejoins) {
            return;
        }
        watch.stalled = true;
        watch.rejoins += 1;
        drop(watch);
        tracing::warn!(
            queue = %self.options.queue,
            unassigned_secs = idle.as_secs(),
            unsettled,
            "this replica has held no Kafka partition for longer than the session timeout plus the visibility timeout while records wait and the group commits nothing: not ready; joining the group again with a new consumer"
        );
        self.rejoin();
    }

    /// Replaces the group's consumer with a new one, which subscribes on
    /// the next read. The old one holds no partition; closing it leaves
    /// the group, which waits for a coordinator that may never answer, so
    /// it closes on a thread of its own.
    fn rejoin(&self) {
        let fresh = match self.join() {
            Ok(fresh) => fresh,
            Err(e) => {
                tracing::warn!(error = %e, "cannot make a new Kafka consumer; trying again later");
                return;
            }
        };
        let old = std::mem::replace(
            &mut *self
                .commits
                .consumer
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
            fresh,
        );
        {
            let mut reading = self.reading();
            reading.subscribed = false;
            reading.paused_at_bound = false;
        }
        let mut watch = self.watch();
        watch.unassigned_since = Some(Instant::now());
        watch.sample = None;
        drop(watch);
        // Rebalance callbacks hold the consumer weakly: this is its last
        // reference but for a commit under way.
        let closing = std::thread::Builder::new()
            .name("courier-kafka-leave".into())
            .spawn(move || drop(old));
        if let Err(e) = closing {
            tracing::warn!(error = %e, "cannot start a thread to close the old Kafka consumer; it was closed here");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_join_that_brought_nothing_doubles_the_wait_up_to_ten_minutes() {
        let first = Duration::from_secs(20);
        let waits: Vec<u64> = (0..8).map(|n| stall_wait(first, n).as_secs()).collect();
        assert_eq!(waits, [20, 40, 80, 160, 320, 600, 600, 600]);
        assert_eq!(stall_wait(first, u32::MAX), MAX_STALL_WAIT);
        let long = Duration::from_secs(900);
        assert_eq!(stall_wait(long, 3), long, "never below the first wait");
    }
}
